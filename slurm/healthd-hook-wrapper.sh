#!/bin/sh
# healthd's Slurm hooks behind one small wrapper, for slurm.conf's HealthCheckProgram, Prolog and Epilog.
#
# Install ONE copy and give it the three hook names (symlinks or copies; the name picks the hook):
#   install -m 0755 healthd-hook-wrapper.sh /etc/slurm/healthd-hook
#   ln -sf healthd-hook /etc/slurm/healthd-healthcheck
#   ln -sf ../healthd-hook /etc/slurm/prolog.d/healthd-prolog     # next to the site's own prologs
#   ln -sf ../healthd-hook /etc/slurm/epilog.d/healthd-epilog     # ... and epilogs
# then point slurm.conf at them (slurm.conf.snippet in this directory: Prolog=/etc/slurm/prolog.d/*,
# Epilog=/etc/slurm/epilog.d/*).
#
# Why a wrapper at all: slurmd runs these programs with no arguments, and runs HealthCheckProgram with
# SLURMD_NODENAME as its ONLY environment variable (no PATH, no SLURM_CONF). The hooks take everything
# else (SLURM_CONF, PATH, paths) from healthd.yaml (`hooks.*`), so all the wrapper has to say is where
# the console scripts and that file are. With the default config path (/etc/healthd/healthd.yaml)
# slurm.conf may name the console scripts directly and this wrapper is not needed.
#
# No external command runs before `exec` (PATH is unset under HealthCheckProgram), and every failure of
# the wrapper itself exits 0: a non-zero Prolog exit would refuse the job and drain the node with
# "Prolog error", so a mis-installed wrapper must never take a fleet out of service. The hooks make the
# same choice for every doubtful case.
#
# tests/slurm/test_e2e_hooks.py renders this very file (replacing the three settings below) and runs it
# under a real slurmd, so what is shown here is what is tested.

HEALTHD_BIN=/opt/healthd/current/bin
HEALTHD_CONFIG=/etc/healthd/healthd.yaml
HEALTHD_HOOK_LOG=

# The hooks log one line per event to stderr and to syslog (LOG_DAEMON). slurmd keeps a hook's output
# only when it fails; set HEALTHD_HOOK_LOG to also append the hooks' lines to a file (e.g. on a node
# without a syslog socket).
# (A redirection that fails would end the shell with status 2, so it is tried in a subshell first.)
if [ -n "$HEALTHD_HOOK_LOG" ] && ( : >>"$HEALTHD_HOOK_LOG" ) 2>/dev/null; then
    exec 2>>"$HEALTHD_HOOK_LOG"
fi

hook=${0##*/}
case "$hook" in
    healthd-healthcheck|healthd-prolog|healthd-epilog) ;;
    *)
        echo "healthd hook wrapper: installed as '$hook'; name it healthd-healthcheck, healthd-prolog or healthd-epilog" >&2
        exit 0
        ;;
esac
if [ ! -x "$HEALTHD_BIN/$hook" ]; then
    echo "healthd hook wrapper: $HEALTHD_BIN/$hook is not installed; $hook skipped (exit 0)" >&2
    exit 0
fi
exec "$HEALTHD_BIN/$hook" --config "$HEALTHD_CONFIG"
