"""The Slurm hooks: HealthCheckProgram (`healthd-healthcheck`), Prolog (`healthd-prolog`) and Epilog
(`healthd-epilog`), and the agent's side of their files (job bindings, quick-check results).

slurmd runs the hooks synchronously (the prolog sits in every job launch), so they read the agent's
compiled copy of the configuration (healthd.hookconfig; the YAML only when that is not current), import
a few small standard-library modules (no re, json, typing, dataclasses or logging), and ask Slurm through
their own small client (slurmnode) only when they must. Every hook runs under a hard internal deadline.
"""
