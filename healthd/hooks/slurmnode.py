"""The hooks' own Slurm client: the three calls they make -- read this node (`scontrol show node -o
NAME`), drain it, ask for a reboot when idle -- with healthd.slurm.ScontrolBackend's semantics for
them (the same argv, environment, one-line parser, error classes by stderr, hard timeout).

Why not ScontrolBackend itself: importing healthd.slurm costs 20-50 ms (ClusterShell, dataclasses,
logging, subprocess, importlib.metadata), more than a whole hook run should. This module imports
only what the hooks load anyway (os, select, _signal) and starts the client with os.posix_spawn
in its own session, so a timeout kills the client's whole process group.
tests/hooks/test_slurmnode.py runs both parsers on the same lines, and both clients against the
same stand-in, and requires the same answers.
"""

from __future__ import annotations

import os
import select
import time

try:  # the C module: `signal` imports enum
    import _signal as signal
except ImportError:
    import signal  # type: ignore[no-redef]

from healthd.record import Record
from healthd.slurmtext import SCRUB_ENV, SCRUB_ENV_PREFIXES, UNAVAILABLE_MARKERS, parse_state_string, reason_holds

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Sequence

_AFTER_REASON = tuple(f" {k}=" for k in ("Comment", "Extra", "InstanceId", "InstanceType", "ReservationName"))
_IDENT_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_IDENT = _IDENT_START | frozenset("0123456789")
_NODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
# The parser below uses string methods where healthd.slurm.scontrol uses regular expressions (the
# pattern each replaces is in its docstring): re costs a hook run ~3 ms.
MAX_OUTPUT = 1 << 20


class SlurmError(Exception):
    """Slurm could not be asked or refused; the message says which and why."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr


class SlurmUnavailable(SlurmError):
    """No client, no slurm.conf, slurmctld unreachable, or a timeout."""


class SlurmRefused(SlurmError):
    """The client ran and said no."""


class NodeState(Record):
    """What the hooks read of a node: name, base state (lowercase), flags (uppercase), reason."""

    _fields = ("name", "state", "flags", "reason")
    _defaults = {"reason": ""}
    name: str
    state: str
    flags: frozenset[str]
    reason: str


parse_state = parse_state_string


def _keys(head: str) -> list[tuple[int, int, str]]:
    """(start, end of `Key=`, key) of each `(?:^|(?<=\\s))([A-Za-z_][A-Za-z0-9_]*)=` in `head`."""
    out = []
    i, n = 0, len(head)
    while i < n:
        if (i == 0 or head[i - 1].isspace()) and head[i] in _IDENT_START:
            j = i + 1
            while j < n and head[j] in _IDENT:
                j += 1
            if j < n and head[j] == "=":
                out.append((i, j + 1, head[i:j]))
                i = j + 1
                continue
        i += 1
    return out


def _suffixes(tail: str) -> list[tuple[int, int]]:
    """(start, end) of each ` [user@YYYY-MM-DDTHH:MM:SS]` in `tail`, left to right, not overlapping:
    ` \\[([^\\s\\[\\]@]+)@(\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}:\\d{2})\\]`."""
    out = []
    i = tail.find(" [")
    while i >= 0:
        at = tail.find("@", i + 2)
        user = tail[i + 2:at] if at > i + 2 else ""
        stamp = tail[at + 1:at + 20] if user else ""
        if (user and not any(c.isspace() or c in "[]@" for c in user) and len(stamp) == 19
                and tail[at + 20:at + 21] == "]" and _stamp(stamp)):
            out.append((i, at + 21))
            i = tail.find(" [", at + 21)
        else:
            i = tail.find(" [", i + 1)
    return out


def _stamp(s: str) -> bool:
    """`\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}:\\d{2}` (\\d: any decimal digit, as re reads it)."""
    return all((c.isdecimal() if k not in (4, 7, 10, 13, 16) else c == "--T::"[(4, 7, 10, 13, 16).index(k)])
               for k, c in enumerate(s))


def _reason(tail: str) -> str:
    """The reason text of `Reason=<tail>`: up to the last ` [user@time]` that ends the line or comes
    before one of the optional fields, else up to the first optional field."""
    chosen = None
    for start, end in _suffixes(tail):
        rest = tail[end:]
        if not rest.strip() or rest.startswith(_AFTER_REASON):
            chosen = start
    if chosen is not None:
        return tail[:chosen]
    after = min((i for i in (tail.find(k) for k in _AFTER_REASON) if i >= 0), default=-1)
    return (tail[:after] if after >= 0 else tail).rstrip()


def parse_node_line(line: str) -> NodeState:
    """One line of `scontrol show node -o`; SlurmRefused when it has no NodeName= or State=."""
    line = line.rstrip("\r\n")
    idx = line.find(" Reason=")
    head, tail = (line[:idx], line[idx + len(" Reason="):]) if idx >= 0 else (line, None)
    fields: dict[str, str] = {}
    keys = _keys(head)
    for i, (_, value_at, key) in enumerate(keys):
        end = keys[i + 1][0] if i + 1 < len(keys) else len(head)
        fields.setdefault(key, head[value_at:end].strip())
    name = fields.get("NodeName", "")
    if not name or keys[0][2] != "NodeName":
        raise SlurmRefused(f"scontrol show node -o: line does not start with NodeName=: {line[:120]!r}")
    try:
        state, flags = parse_state(fields.get("State", ""))
    except ValueError as e:
        raise SlurmRefused(f"scontrol show node -o: node {name}: bad State=: {e}") from None
    # a reason kept after RESUME (Slurm 24.11) is history, not a drain: healthd.slurmtext.reason_holds
    reason = _reason(tail) if tail is not None and reason_holds(state, flags) else ""
    return NodeState(name, state, flags, reason)


def _node_name(name: str) -> bool:
    """`[A-Za-z0-9][A-Za-z0-9._-]{0,254}`."""
    return 1 <= len(name) <= 255 and name[0] in _NODE_CHARS and name[0] not in "._-" and all(c in _NODE_CHARS for c in name)


def which(name: str, path: str) -> str | None:
    if "/" in name:
        return name
    for d in path.split(":"):
        candidate = os.path.join(d or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def run(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of argv, stdin /dev/null, in a new session; after `timeout_s`
    the whole process group is killed and SlurmUnavailable raised."""
    exe = which(argv[0], env.get("PATH", os.defpath))
    if exe is None:
        raise SlurmUnavailable(f"{argv[0]} not found on PATH={env.get('PATH', os.defpath)}; install the Slurm client")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(exe, [exe, *argv[1:]], env, setsid=True, file_actions=[
            (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except OSError as e:
        for fd in (out_r, out_w, err_r, err_w, null):
            os.close(fd)
        raise SlurmUnavailable(f"cannot run {exe}: {e}") from None
    for fd in (out_w, err_w, null):
        os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    poller = select.poll()
    for fd in chunks:
        poller.register(fd, select.POLLIN)
    open_fds, at = set(chunks), time.monotonic() + timeout_s
    try:
        while open_fds:
            left = at - time.monotonic()
            if left <= 0:
                _kill(pid)
                raise SlurmUnavailable(f"{' '.join(argv)} timed out after {timeout_s:g} s: slurmctld is down or overloaded")
            for fd, _ in poller.poll(left * 1000):
                data = os.read(fd, 65536)
                if data and sum(map(len, chunks[fd])) < MAX_OUTPUT:
                    chunks[fd].append(data)
                elif not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
        status = os.waitpid(pid, 0)[1]
    except BaseException:
        _kill(pid)  # a HookTimeout from the deadline too: no client outlives the hook
        raise
    finally:
        os.close(out_r)
        os.close(err_r)
    code = os.waitstatus_to_exitcode(status)
    return code, b"".join(chunks[out_r]).decode("utf-8", "replace"), b"".join(chunks[err_r]).decode("utf-8", "replace")


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class Client:
    """scontrol for one hook run: SLURM_CONF always set (never a client without one), the hook's
    PATH, `timeout_s` per call."""

    def __init__(self, slurm_conf: str, path: str, timeout_s: float):
        if not slurm_conf:
            raise SlurmUnavailable("no slurm.conf: healthd never runs a Slurm client without one")
        if not os.path.isfile(slurm_conf):
            raise SlurmUnavailable(f"slurm.conf {slurm_conf!r} does not exist (from slurm_conf=)")
        self.slurm_conf = os.path.abspath(slurm_conf)
        self.timeout_s = timeout_s
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_ENV_PREFIXES) and k not in SCRUB_ENV}
        env["SLURM_CONF"] = self.slurm_conf
        env["SLURM_TIME_FORMAT"] = "standard"
        env["PATH"] = path or os.defpath
        self.env = env

    def _run(self, argv: list[str]) -> str:
        started = time.monotonic()
        code, out, err = run(argv, self.env, self.timeout_s)
        if code != 0:
            msg = err.strip() or out.strip() or f"exit status {code}"
            short = msg.splitlines()[-1]
            if any(m in msg for m in UNAVAILABLE_MARKERS):
                raise SlurmUnavailable(f"{' '.join(argv)}: slurmctld unreachable after "
                                       f"{time.monotonic() - started:.1f} s: {short}", err)
            raise SlurmRefused(f"{' '.join(argv)} failed (exit {code}): {short}", err)
        return out

    def node(self, name: str) -> NodeState:
        if not _node_name(name):
            raise ValueError(f"not a node name: {name!r}")
        argv = ["scontrol", "show", "node", "-o", name]
        try:
            lines = self._run(argv).splitlines()
        except SlurmRefused as e:
            if "invalid node name" in (e.stderr or str(e)).lower():
                raise SlurmRefused(f"Slurm has no node named {name!r}") from None
            raise
        for line in lines:
            if line.strip() and not line.startswith("No nodes in the system"):
                info = parse_node_line(line)
                if info.name == name:
                    return info
        raise SlurmRefused(f"Slurm has no node named {name!r}")

    def drain(self, nodes: Sequence[str], reason: str) -> None:
        self._run(["scontrol", "update", f"NodeName={_one(nodes)}", "State=DRAIN", f"Reason={_clean_reason(reason)}"])

    def reboot_asap(self, nodes: Sequence[str], reason: str, next_state: str = "RESUME") -> None:
        if next_state not in ("RESUME", "DOWN"):
            raise ValueError(f"invalid next state {next_state!r}: one of RESUME, DOWN")
        self._run(["scontrol", "reboot", "ASAP", f"nextstate={next_state}",
                   f"reason={_clean_reason(reason)}", _one(nodes)])


def _one(nodes: Sequence[str]) -> str:
    if len(nodes) != 1 or not _node_name(nodes[0]):
        raise ValueError(f"one node name, not {list(nodes)!r}")
    return nodes[0]


def _clean_reason(reason: str) -> str:
    """The hooks' reasons come from healthd.reason.build_reason (one printable line within Slurm's
    limit); anything else is refused rather than sent."""
    from healthd.reason import MAX_REASON_BYTES, reason_bytes  # lazy: only when a hook writes to Slurm

    if not reason.strip() or not reason.isprintable() or reason_bytes(reason) > MAX_REASON_BYTES:
        raise ValueError(f"not a usable drain reason: {reason[:80]!r}")
    return reason
