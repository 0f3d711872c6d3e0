"""The Slurm hooks: HealthCheckProgram (`healthd-healthcheck`), Prolog (`healthd-prolog`) and Epilog
(`healthd-epilog`), and the agent's side of their files (job bindings, quick-check results).

slurmd runs the hooks synchronously (the prolog sits in every job launch), so they import only the
standard library, healthd.config and healthd.settings; the Slurm backend is imported only when a hook
must ask or tell Slurm something. Every hook runs under a hard internal deadline.
"""
