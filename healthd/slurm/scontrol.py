"""SlurmBackend over the Slurm command-line clients (scontrol, sinfo, squeue, sacct, sacctmgr), for
every Slurm version. `ScontrolBackend` is composed of:

- runner: running a client (SLURM_CONF, a scrubbed environment, argv never through a shell, a hard
  timeout on the whole process group, typed failures), dry runs, describe() and validation steps;
- nodereads: nodes by Slurm version (JSON where it is exact, `scontrol show node -o` otherwise),
  node addresses, the client's version and slurmctld's start, parsed by nodeparse (pure);
- nodewrites: drain, resume, reboot ASAP and its cancellation;
- jobs: requeue, the jobs on a node, a job's runs and AdminComment in Slurm's accounting, and
  maintenance reservations, with the parsers of squeue and sacct.

The names callers use from those modules (the parsers, the runner, the formats and the markers of
Slurm's answers) are importable from here too.
"""

from __future__ import annotations

import logging
import os

from healthd.slurm.backend import SlurmError, SlurmUnavailable
from healthd.slurm.jobs import (
    ACCOUNTING_DISABLED_MARKER,
    DBD_UNAVAILABLE_MARKERS,
    JOB_GONE_MARKER,
    RESERVATION_GONE_MARKERS,
    SACCT_FORMAT,
    SQUEUE_FORMAT,
    JobsAndReservations,
    parse_sacct_runs,
    parse_squeue_jobs,
)
from healthd.slurm.nodeparse import (
    json_errors,
    parse_node_addresses,
    parse_scontrol_node_line,
    parse_scontrol_show_node,
    parse_sinfo_json,
    parse_sinfo_json_text,
    parse_version,
)
from healthd.slurm.nodewrites import NodeWrites
from healthd.slurm.runner import STEP_PATH, CommandResult, CommandTimeout, Runner, run_command, step_result
from healthd.slurmtext import UNAVAILABLE_MARKERS

log = logging.getLogger(__name__)


class ScontrolBackend(NodeWrites, JobsAndReservations):
    """SlurmBackend over the Slurm clients. How nodes are read: healthd.slurm.nodereads.

    slurm_conf: path to slurm.conf; None takes SLURM_CONF from the environment. If neither is
    set, or the file does not exist, construction fails: no client is ever run without it.
    read_mode: "auto" (by version), "scontrol-json", "sinfo-json" or "oneliner".
    runner: how commands are run (tests pass a fake; the default is run_command)."""

    READ_MODES = ("auto", "scontrol-json", "sinfo-json", "oneliner")

    def __init__(
        self,
        slurm_conf: str | None = None,
        timeout_s: float = 10.0,
        bin_dir: str | None = None,
        *,
        dry_run: bool = False,
        read_mode: str = "auto",
        runner: Runner | None = None,
        logger: logging.Logger | None = None,
    ):
        conf = slurm_conf if slurm_conf is not None else os.environ.get("SLURM_CONF")
        if not conf:
            raise SlurmUnavailable(
                "no slurm.conf: pass slurm_conf= or set SLURM_CONF. healthd never runs a Slurm client "
                "without one (the client would fall back to a DNS SRV lookup for _slurmctld._tcp)"
            )
        if runner is None and not os.path.isfile(conf):
            raise SlurmUnavailable(f"slurm.conf {conf!r} does not exist (from {'slurm_conf=' if slurm_conf else 'SLURM_CONF'})")
        if read_mode not in self.READ_MODES:
            raise ValueError(f"read_mode {read_mode!r}: one of {', '.join(self.READ_MODES)}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.slurm_conf = os.path.abspath(conf)
        self.timeout_s = float(timeout_s)
        self.bin_dir = bin_dir
        self.dry_run = dry_run
        self.planned: list[list[str]] = []
        self.read_mode = read_mode
        self._runner = runner or run_command
        self._log = logger or log
        self._version: str | None = None
        self._effective_read_mode: str | None = None if read_mode == "auto" else read_mode



__all__ = [
    "ACCOUNTING_DISABLED_MARKER",
    "CommandResult",
    "CommandTimeout",
    "DBD_UNAVAILABLE_MARKERS",
    "JOB_GONE_MARKER",
    "RESERVATION_GONE_MARKERS",
    "Runner",
    "SACCT_FORMAT",
    "SQUEUE_FORMAT",
    "STEP_PATH",
    "ScontrolBackend",
    "SlurmError",
    "UNAVAILABLE_MARKERS",
    "json_errors",
    "parse_node_addresses",
    "parse_sacct_runs",
    "parse_scontrol_node_line",
    "parse_scontrol_show_node",
    "parse_sinfo_json",
    "parse_sinfo_json_text",
    "parse_squeue_jobs",
    "parse_version",
    "run_command",
    "step_result",
]
