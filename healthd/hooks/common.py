"""What the three hooks share: the hard deadline, the log, slurmd's environment, bounded reads and
atomic writes, and the judgement of the agent's state file.

Module-level imports are small standard-library modules (C ones where the Python wrapper is costly:
_signal, _thread); the settings come from healthd.hookconfig (the agent's compiled copy, else the
YAML), the Slurm client (healthd.hooks.slurmnode) only when a hook has to ask or tell Slurm something.

`judge(doc, now, settings)` is the one rule every hook applies to the state file: missing,
unparsable (truncated), not trusted (not root's, writable by group or others, a link: see
healthd.trusted), for another node, older than `hooks.stale_after_s` or written by an agent
whose pid is gone means **agent unknown** -- never a silent pass and never a drain.
"""

from __future__ import annotations

import os
import _thread
import sys
import time

try:  # the C modules: `signal` and `threading` import enum and more, ~5 ms of every run
    import _signal as signal
except ImportError:
    import signal  # type: ignore[no-redef]

from healthd import hookconfig
from healthd import trusted as files
from healthd.reason import MAX_REASON_BYTES, build_reason, is_healthd_reason, reason_bytes
from healthd.text import clean
from healthd.statedoc import Judgement, judge, load_state, pid_alive  # noqa: F401 - the hooks' names for them
from healthd.trusted import SMALL_MAX_BYTES, TRUSTED_UID, TooLarge, Untrusted, read_bounded  # noqa: F401 - re-exported

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

WATCHDOG_GRACE_S = 1.0
"""After the deadline, SIGALRM unwinds the hook; this much later the watchdog thread exits the
process outright (a thread stuck in a syscall that ignores signals)."""

_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_USER_REST = _ALNUM | frozenset("_.@-")
_NODE_REST = _ALNUM | frozenset("._-")
# The checks below are plain string tests, not regular expressions: re costs every hook run ~3 ms.


def _digits(value: str, most: int) -> bool:
    """1 to `most` ASCII digits."""
    return 1 <= len(value) <= most and value.isascii() and value.isdigit()


def _user_name(value: str) -> bool:
    """A plausible user name: [A-Za-z0-9_][A-Za-z0-9_.@-]{0,63} and an optional trailing `$`."""
    body = value[:-1] if value.endswith("$") else value
    return 1 <= len(body) <= 64 and (body[0] in _ALNUM or body[0] == "_") and all(c in _USER_REST for c in body[1:])


def _node_name(value: str) -> bool:
    """A Slurm node name: [A-Za-z0-9][A-Za-z0-9._-]{0,254}."""
    return 1 <= len(value) <= 255 and value[0] in _ALNUM and all(c in _NODE_REST for c in value[1:])


class HookTimeout(BaseException):
    """Raised by SIGALRM at the deadline. A BaseException so that no `except Exception` in the hook
    or a library it calls can swallow it."""


# --------------------------------------------------------------------------- the log


class Log:
    """One line per event to stderr and syslog (LOG_DAEMON, ident = the hook's name). slurmd keeps
    a hook's output only on failure, so syslog (journald on systemd nodes) is the record."""

    PRIORITIES = {"info": 6, "warning": 4, "error": 3}

    def __init__(self, hook: str):
        self.hook = hook
        self.node = "?"
        self._syslog: Any = None

    def _emit(self, level: str, msg: str) -> None:
        line = clean(msg, 1000)
        try:
            sys.stderr.write(f"{self.hook}[{self.node}]: {level}: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        try:
            if self._syslog is None:
                import syslog  # lazy: spared from the hooks' start

                syslog.openlog(self.hook, syslog.LOG_PID, syslog.LOG_DAEMON)
                self._syslog = syslog
            self._syslog.syslog(self.PRIORITIES[level], f"[{self.node}] {line}")
        except OSError:
            pass

    def info(self, msg: str) -> None:
        self._emit("info", msg)

    def warning(self, msg: str) -> None:
        self._emit("warning", msg)

    def error(self, msg: str) -> None:
        self._emit("error", msg)

    def last_words(self, msg: str) -> None:
        """From the watchdog thread, right before os._exit: no locks that a stuck thread may hold."""
        try:
            os.write(2, f"{self.hook}[{self.node}]: error: {clean(msg, 1000)}\n".encode())
        except OSError:
            pass


# --------------------------------------------------------------------------- the deadline


class Deadline:
    """A hard limit on the whole hook run. At `seconds`, SIGALRM raises HookTimeout in the main
    thread, which unwinds the hook to its safe exit code; if the main thread is stuck where a signal
    cannot reach it, a watchdog thread exits the process with the safe code WATCHDOG_GRACE_S later.
    Slurm clients get a timeout inside the deadline (Context.backend), so they are killed first."""

    def __init__(self, seconds: float, safe_code: int, log: Log):
        self.safe_code = safe_code
        self.log = log
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self._done = False
        # held until _notify releases it: the watchdog's timed acquire is its wait
        self._wake = _thread.allocate_lock()
        self._wake.acquire()
        self._old = signal.signal(signal.SIGALRM, self._alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        _thread.start_new_thread(self._watch, ())  # never joined: the process exits without waiting for it

    def _alarm(self, signum: int, frame: Any) -> None:
        raise HookTimeout(self.seconds)

    def _watch(self) -> None:
        while not self._done:
            left = self.at + WATCHDOG_GRACE_S - time.monotonic()
            if left <= 0:
                self.log.last_words(f"hard timeout: still running {WATCHDOG_GRACE_S:g}s after the "
                                    f"{self.seconds:g}s deadline; exiting {self.safe_code}")
                os._exit(self.safe_code)
            self._wake.acquire(timeout=left)

    def _notify(self) -> None:
        try:
            self._wake.release()
        except RuntimeError:  # released already and the watchdog not yet awake: it will see the change
            pass

    def extend_to(self, seconds: float) -> None:
        """Make the limit `seconds`, counted from the start of the run."""
        self.at = self.at - self.seconds + seconds
        self.seconds = seconds
        self._notify()
        signal.setitimer(signal.ITIMER_REAL, max(0.001, self.at - time.monotonic()))

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def cancel(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._done = True
        self._notify()
        signal.signal(signal.SIGALRM, self._old)


# --------------------------------------------------------------------------- slurmd's environment


def env_node(env: dict[str, str], default: str) -> str:
    """SLURMD_NODENAME when it is a valid node name, else the configured node_name."""
    value = env.get("SLURMD_NODENAME", "")
    return value if _node_name(value) else default


def env_job_id(env: dict[str, str]) -> tuple[str | None, str]:
    """(job id, '') or (None, why): a job id is 1-20 digits; it names a file, so nothing else passes."""
    raw = env.get("SLURM_JOB_ID")
    if raw is None:
        return None, "SLURM_JOB_ID is not set"
    if _digits(raw, 20):
        return raw, ""
    return None, f"SLURM_JOB_ID {clean(repr(raw), 80)} is not a job id"


def env_user(env: dict[str, str]) -> tuple[str | None, int | None, list[str]]:
    """(user, uid, problems): a value that is not a plausible user name / uid is dropped."""
    problems = []
    user = env.get("SLURM_JOB_USER")
    if user is not None and not _user_name(user):
        problems.append(f"SLURM_JOB_USER {clean(repr(user), 80)} rejected")
        user = None
    raw_uid = env.get("SLURM_JOB_UID")
    uid = None
    if raw_uid is not None:
        if _digits(raw_uid, 10):
            uid = int(raw_uid)
        else:
            problems.append(f"SLURM_JOB_UID {clean(repr(raw_uid), 80)} rejected")
    return user, uid, problems


def env_gpus(env: dict[str, str]) -> tuple[list[int] | None, str]:
    """The job's GPU indices on this node, from SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES; (None,
    why) when neither is a plain list of indices (unset, UUIDs, MIG, 'NoDevFiles'). An empty value
    means no GPUs."""
    for name in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        raw = env.get(name)
        if raw is None:
            continue
        raw = raw.strip()
        if not raw:
            return [], ""
        parts = raw.split(",")
        if len(parts) > 1024 or not all(p.strip().isdigit() and len(p.strip()) <= 4 for p in parts):
            return None, f"{name}={clean(repr(raw), 80)} is not a list of GPU indices"
        return sorted({int(p) for p in parts}), ""
    return None, "neither SLURM_JOB_GPUS nor CUDA_VISIBLE_DEVICES is set"


# --------------------------------------------------------------------------- files


def read_json(path: str, limit: int = SMALL_MAX_BYTES, *, root: str | None = None,
              trusted_uid: int = TRUSTED_UID) -> dict[str, Any]:
    """A small JSON object from a trusted file (healthd.trusted): OSError (including TooLarge and
    Untrusted) or ValueError with a reason. `root` (the run directory) is walked without links."""
    return files.read_json(path, limit, root=root, trusted_uid=trusted_uid)


def write_json(path: str, doc: Any, mode: int = 0o644, *, root: str | None = None,
               trusted_uid: int = TRUSTED_UID) -> None:
    """Atomic (write, fsync, rename, fsync the directory) into a trusted directory reached without
    following a link below `root`, creating the directories: readers see the old file or the new.
    healthd.persist.write_json_atomic writes the agent's own files; this one avoids importing
    tempfile and logging on the prolog's path (about 7 ms of a ~50 ms run)."""
    files.write_json(path, doc, mode, root=root, trusted_uid=trusted_uid)


# --------------------------------------------------------------------------- the agent's state


# --------------------------------------------------------------------------- findings in a document


def healthd_reason(text: str, suffix: str = "") -> str:
    """`healthd: <text> <suffix>`, one printable line within Slurm's reason limit (healthd.reason)."""
    return build_reason(text, suffix)


# --------------------------------------------------------------------------- Slurm


def is_drained(info: Any) -> bool:
    states = [str(getattr(info, "state", "") or "")] + [str(f) for f in (getattr(info, "flags", ()) or ())]
    return any(s.upper().startswith("DRAIN") for s in states)


def slurm_error() -> tuple[type[Exception], ...]:
    """The errors a Slurm call of a hook may raise: the hooks' own client's (healthd.hooks.slurmnode),
    and healthd.slurm's when a backend from there is in use (tests pass one through backend_factory)."""
    from healthd.hooks.slurmnode import SlurmError  # lazy: spared from the hooks' start

    backend = sys.modules.get("healthd.slurm.backend")
    return (SlurmError, backend.SlurmError) if backend is not None else (SlurmError,)


def take_node(ctx: "Context", reason: str) -> bool:
    """Make sure the node is drained with a reason a person can read: before the prolog exits
    non-zero (Slurm keeps an existing drain reason instead of writing 'Prolog error'), and for the
    epilog's T1 finding, so the next job does not land here. Re-reads the node first: a reason someone else wrote is never overwritten, and the first
    'healthd:' reason wins. Returns True when the node is drained now (by anyone); False when it is
    not and could not be (Slurm unreachable or refusing, or a foreign reason on an undrained node)."""
    log, node = ctx.log, ctx.node
    SlurmError = slurm_error()
    try:
        backend = ctx.backend()
        info = backend.node(node)
    except SlurmError as e:
        log.warning(f"cannot read node {node} from Slurm: {clean(e, 200)}")
        return False
    current = getattr(info, "reason", None) or ""
    drained = is_drained(info)
    if current and not is_healthd_reason(current):
        if drained:
            log.info(f"node {node} is already drained by someone else ({clean(current, 120)}); their reason stays")
            return True
        log.warning(f"node {node} carries a reason healthd did not write ({clean(current, 120)}); not touching it")
        return False
    if drained and current:
        log.info(f"node {node} is already drained by healthd ({clean(current, 120)}); the first reason stays")
        return True
    # a healthd reason too long for Slurm's record (someone else wrote it) gives way to ours
    keep = current if current and reason_bytes(current) <= MAX_REASON_BYTES else reason
    try:
        backend.drain([node], keep)
    except SlurmError as e:
        log.warning(f"cannot drain node {node}: {clean(e, 200)}")
        return False
    log.warning(f"drained node {node}: {keep}")
    return True


# --------------------------------------------------------------------------- running a hook


class Context:
    """One hook run: what the hook may use. Built by `run_hook`; tests build their own.
    `trusted_uid` is the only owner whose files the hook trusts (root; other values are for tests).
    A plain class, not a dataclass: dataclasses imports inspect and typing, ~10 ms of every run."""

    def __init__(self, hook: str, settings: Any, node: str, env: dict[str, str], log: Log,
                 deadline: Deadline | None, now: float,
                 backend_factory: Callable[[Context], Any] | None = None, trusted_uid: int = TRUSTED_UID):
        self.hook, self.settings, self.node, self.env, self.log = hook, settings, node, env, log
        self.deadline, self.now, self.backend_factory, self.trusted_uid = deadline, now, backend_factory, trusted_uid

    def backend(self) -> Any:
        """The Slurm backend, with SLURM_CONF and PATH from the config and a timeout inside the
        hook's deadline."""
        if self.backend_factory is not None:
            return self.backend_factory(self)
        h = self.settings.hooks
        os.environ["SLURM_CONF"] = h.slurm_conf
        os.environ["PATH"] = h.path
        from healthd.hooks.slurmnode import Client  # lazy: spared from the hooks' start

        left = self.deadline.remaining() if self.deadline is not None else h.timeout_s
        return Client(h.slurm_conf, h.path, max(0.2, left - 0.3))

    def state(self) -> Judgement:
        doc, error = load_state(self.settings.state_file, self.trusted_uid)
        return judge(doc, self.now, self.settings, node=self.node, error=error)

    def path(self, *parts: str) -> str:
        return os.path.join(self.settings.hooks.run_dir, *parts)

    def run_dir(self, rel: str = "", *, create: bool = False) -> files.TrustedDir:
        """`<run_dir>/<rel>` opened as a trusted directory, no link followed at any level below
        run_dir (healthd.trusted.TrustedDir); OSError (Untrusted, FileNotFoundError) otherwise."""
        return files.TrustedDir(self.settings.hooks.run_dir, rel, create=create, trusted_uid=self.trusted_uid)

    def read_json(self, rel: str, limit: int = SMALL_MAX_BYTES) -> dict[str, Any]:
        """A small trusted JSON object at `<run_dir>/<rel>`."""
        return read_json(self.path(rel), limit, root=self.settings.hooks.run_dir, trusted_uid=self.trusted_uid)

    def write_json(self, rel: str, doc: Any, mode: int = 0o644) -> None:
        """Atomically write `<run_dir>/<rel>` (healthd.trusted: no link followed below run_dir)."""
        write_json(self.path(rel), doc, mode, root=self.settings.hooks.run_dir, trusted_uid=self.trusted_uid)


class UsageError(ValueError):
    pass


def parse_args(argv: list[str], hook: str) -> str | None:
    """`--config FILE` / `--config=FILE` / `-c FILE`; slurmd passes no arguments at all."""
    config = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-c") and i + 1 < len(argv):
            config = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            raise UsageError(f"unknown argument {clean(repr(a), 80)}; usage: {hook} [--config FILE] "
                             "(or HEALTHD_CONFIG=FILE; slurmd runs it without arguments)")
        i += 1
    return config


def run_hook(
    hook: str,
    argv: list[str] | None,
    safe_code: int,
    body: Callable[[Context], int],
    *,
    env: dict[str, str] | None = None,
    trusted_uid: int = TRUSTED_UID,
) -> int:
    """Load the config (healthd.hookconfig: the compiled file when it is current, else the YAML),
    arm the deadline, run `body`; a timeout, a config or usage error, or a bug ends with `safe_code` and one log line saying why. Never raises (the console script's exit code
    is what slurmd acts on: a traceback would be exit 1, a refused job and a drained node)."""
    env = dict(os.environ if env is None else env)
    log = Log(hook)
    deadline = None
    try:
        deadline = Deadline(5.0, safe_code, log)  # until the config says otherwise: a hung config read
        path = parse_args(list(sys.argv[1:] if argv is None else argv), hook) or env.get("HEALTHD_CONFIG") or None
        try:
            settings, _ = hookconfig.load(path, trusted_uid, env)
        except hookconfig.Unusable as e:
            log.error(f"cannot use the configuration: {e}; exiting {safe_code}")
            return safe_code
        deadline.extend_to(settings.hooks.timeout_s)
        node = env_node(env, settings.node_name)
        log.node = node
        ctx = Context(hook, settings, node, env, log, deadline, time.time(), trusted_uid=trusted_uid)
        return body(ctx)
    except HookTimeout:
        seconds = deadline.seconds if deadline is not None else 0
        log.error(f"timed out after {seconds:g}s (hooks.timeout_s); exiting {safe_code}")
        return safe_code
    except UsageError as e:
        _disarm()
        log.error(f"{e}; exiting {safe_code}")
        return safe_code
    except BaseException as e:  # noqa: BLE001 - a bug must never refuse a job or hang slurmd
        _disarm()
        log.error(f"internal error {type(e).__name__}: {clean(e, 300)}; exiting {safe_code}")
        return safe_code
    finally:
        if deadline is not None:
            deadline.cancel()


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
