"""Running the Slurm clients: one command in its own process group with a hard timeout
(`run_command`), how a validation step ended (`step_result`), and `ClientRunner`, what the scontrol
backend's reads and writes run their clients through.

Every client runs with SLURM_CONF in its environment (without it a client falls back to
"configless" mode and sends a DNS SRV query off the machine), from an argv list (never a shell),
with a hard timeout after which the whole process group is killed. Failures are typed:
SlurmUnavailable (timeout, slurmctld unreachable), SlurmRefused (slurmctld said no).

Validation steps (`run_step`, an `srun` the controller starts) run with a minimal environment instead:
srun hands the caller's environment to the job on the node, so the step gets a fixed system PATH,
LANG=C and SLURM_CONF, nothing of the daemon's own.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from healthd.slurm.backend import SlurmRefused, SlurmUnavailable, StepResult, validate_argv
from healthd.slurmtext import SCRUB_ENV, SCRUB_ENV_PREFIXES, UNAVAILABLE_MARKERS

STEP_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"
"""PATH of a validation step (with bin_dir first when one is given): the system's, not the daemon's."""

# ---------------------------------------------------------------------------------------------
# running a client


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class CommandTimeout(Exception):
    pass


Runner = Callable[[list[str], dict[str, str], float], CommandResult]


def run_command(argv: list[str], env: dict[str, str], timeout_s: float) -> CommandResult:
    """Run argv (no shell) with env, stdin closed, in its own process group. After timeout_s the
    whole group is killed and CommandTimeout raised; the call never waits much past timeout_s.
    argv[0] is looked up on env's PATH; FileNotFoundError when it is not there."""
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} not found on PATH={env.get('PATH', os.defpath)}")
    proc = subprocess.Popen(
        [exe, *argv[1:]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        raise CommandTimeout(f"{argv[0]} did not finish within {timeout_s:g} s") from None
    return CommandResult(
        proc.returncode,
        out.decode("utf-8", errors="replace"),
        err.decode("utf-8", errors="replace"),
    )


def step_result(argv: list[str], env: dict[str, str], timeout_s: float, runner: Runner = run_command) -> StepResult:
    """Run one command through `runner` and say how it ended, whatever happened: its exit status and
    stdout then stderr; 124 and the timeout when it was killed at `timeout_s`; 127 and the error when
    it could not be started (not found, not executable, a NUL in an argument)."""
    try:
        done = runner(argv, env, timeout_s)
    except CommandTimeout as exc:
        return StepResult(124, str(exc))
    except (OSError, ValueError) as exc:
        return StepResult(127, f"{type(exc).__name__}: {exc}")
    return StepResult(done.returncode, done.stdout + done.stderr)


class ClientRunner:
    """How the scontrol backend runs its clients: the binaries (`bin_dir`), the environment
    (SLURM_CONF, SLURM_TIME_FORMAT, scrubbed of what changes a client's output), the timeout, the
    typed failures, and dry runs, in which a write or a step is recorded in `planned`, not run. The
    attributes are set by ScontrolBackend."""

    slurm_conf: str
    timeout_s: float
    bin_dir: str | None
    dry_run: bool
    planned: list[list[str]]
    _runner: Runner
    _log: logging.Logger

    def _bin(self, name: str) -> str:
        if self.bin_dir:
            return os.path.join(self.bin_dir, name)
        return name

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(SCRUB_ENV_PREFIXES) and k not in SCRUB_ENV
        }
        env["SLURM_CONF"] = self.slurm_conf
        env["SLURM_TIME_FORMAT"] = "standard"  # the [user@2026-11-29T09:22:22] the parser expects
        env.setdefault("PATH", os.defpath)
        return env

    def _run(self, argv: list[str]) -> str:
        """Run one client call; return stdout or raise SlurmUnavailable / SlurmRefused."""
        env = self._env()
        started = time.monotonic()
        try:
            res = self._runner(argv, env, self.timeout_s)
        except CommandTimeout:
            raise SlurmUnavailable(
                f"{shlex.join(argv)} timed out after {self.timeout_s:g} s: slurmctld is down or overloaded "
                f"(check `scontrol ping` with SLURM_CONF={self.slurm_conf})",
                argv=argv,
            ) from None
        except FileNotFoundError as exc:
            raise SlurmUnavailable(f"{exc}; install the Slurm client or pass bin_dir=", argv=argv) from None
        except OSError as exc:  # permission denied, argument list too long, ...
            raise SlurmUnavailable(f"cannot run {argv[0]}: {exc}", argv=argv) from None
        elapsed = time.monotonic() - started
        if res.returncode != 0:
            msg = (res.stderr.strip() or res.stdout.strip() or f"exit status {res.returncode}")
            short = msg.splitlines()[-1] if msg else msg
            if any(m in msg for m in UNAVAILABLE_MARKERS):
                raise SlurmUnavailable(
                    f"{shlex.join(argv)}: slurmctld unreachable after {elapsed:.1f} s: {short}",
                    argv=argv,
                    returncode=res.returncode,
                    stderr=res.stderr,
                )
            raise SlurmRefused(
                f"{shlex.join(argv)} failed (exit {res.returncode}): {short}",
                argv=argv,
                returncode=res.returncode,
                stderr=res.stderr,
            )
        return res.stdout

    def _write(self, argv: list[str]) -> None:
        if self.dry_run:
            self.planned.append(list(argv))
            self._log.info("dry run, not running: %s", shlex.join(argv))
            return
        self._log.info("running: %s", shlex.join(argv))
        self._run(argv)

    # -- describe: the exact argv of every write ------------------------------------------

    def describe(self, action: str, **kw) -> list[str]:
        """The argv `action` would run, after validation (ValueError on bad arguments).
        Actions: drain, resume, reboot_asap, cancel_reboot, requeue, create_reservation,
        delete_reservation."""
        builder = getattr(self, f"_argv_{action}", None)
        if builder is None:
            raise ValueError(f"unknown action {action!r}")
        return builder(**kw)

    # -- validation steps -----------------------------------------------------------------

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        """Run one command that starts work through Slurm (`srun ... healthd validate`), as it is (no
        shell), with STEP_PATH, LANG=C and SLURM_CONF only, its process group killed at timeout_s.
        Never raises for how it ended (StepResult); with dry_run it is planned, not run."""
        command = validate_argv(argv)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if self.dry_run:
            self.planned.append(command)
            self._log.info("dry run, not running: %s", shlex.join(command))
            return StepResult(0, f"dry run, not run: {shlex.join(command)}")
        path = f"{self.bin_dir}:{STEP_PATH}" if self.bin_dir else STEP_PATH
        env = {"PATH": path, "LANG": "C", "SLURM_CONF": self.slurm_conf}
        self._log.info("running: %s", shlex.join(command))
        return step_result(command, env, float(timeout_s), self._runner)
