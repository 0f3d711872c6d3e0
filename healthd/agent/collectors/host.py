"""The host around the GPUs: memory, pressure stall information, D-state processes and the
filesystems jobs depend on (checkpoint, dataset, scratch).

Everything is read below `proc_root`, so tests point it at a fake tree:
- memory from `<proc_root>/meminfo` (MemTotal, MemAvailable), parsed here rather than through
  psutil.virtual_memory(): psutil reads the same file on Linux, and one code path that tests can
  feed is worth more than a second, untested one. Kernels without MemAvailable (< 3.14) get
  psutil's own estimate, MemFree + Active(file) + Inactive(file) + SReclaimable;
- PSI from `<proc_root>/pressure/{cpu,memory,io}`; a kernel without PSI (absent, or EOPNOTSUPP
  with psi=0) leaves the resource out, it is not an error;
- D-state processes from `<proc_root>/<pid>/task/<tid>/stat` (falling back to `<pid>/stat`): a
  process counts when any of its threads is in uninterruptible sleep, because the thread stuck
  on a hung mount is often not the main one (an async checkpoint writer). That scan opens one
  file per thread (thousands on a busy node), so it is gated on two cheap files (`dstate_gate`):
  it runs when `<proc_root>/stat` counts blocked tasks, when the last scan found D-state tasks,
  or when the 1-minute load average in `<proc_root>/loadavg` (which counts D-state tasks) reaches
  `dstate_scan_min_load` — then at most every `dstate_scan_interval_s`. A gate file that cannot
  be read opens it, and between scans the last scan's answer (none found) stands;
- mounts from `<proc_root>/mounts`.

Filesystem probes write and fsync a small file inside each configured path, in a daemon thread,
and wait at most `spec.timeout_s`. A probe on a hung NFS or Lustre mount never returns (the thread
sits in D state), so a filesystem whose previous probe is still stuck gets no second probe: it is
reported hung again with the time the stuck probe started. collect() itself never waits longer than
the largest timeout.

The configured paths are checkpoint and dataset mounts that users can write, so nothing a user
plants there may make healthd act. Each probe therefore creates a fresh file with an unpredictable
name (`.healthd-probe.<pid>.<16 random hex digits>`) using O_CREAT | O_EXCL | O_NOFOLLOW: O_EXCL
never opens an existing file of any kind, so a planted FIFO (whose open would block and read as a
hung filesystem), symlink or hard link is never opened or written, and a name nobody can predict
cannot be occupied in advance.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from healthd.model import FilesystemProbe, HostSample, iso
from healthd.settings import FilesystemSpec

log = logging.getLogger(__name__)

PROBE_PREFIX = ".healthd-probe"
PROBE_PAYLOAD = b"healthd write+fsync probe\n" * 160  # ~4 KiB: one page, one block
PSI_RESOURCES = ("cpu", "memory", "io")


# --------------------------------------------------------------------------- pure parsing


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """`/proc/meminfo` -> (available_bytes, total_bytes); a missing field is None."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and fields and fields[0].isdigit():
            kb[key.strip()] = int(fields[0])
    total = kb.get("MemTotal")
    avail = kb.get("MemAvailable")
    if avail is None and "MemFree" in kb:
        avail = kb["MemFree"] + kb.get("Active(file)", 0) + kb.get("Inactive(file)", 0) + kb.get("SReclaimable", 0)
    return (
        avail * 1024 if avail is not None else None,
        total * 1024 if total is not None else None,
    )


def parse_psi(text: str) -> dict[str, float]:
    """`some avg10=0.12 avg60=0.00 avg300=0.00 total=1234` (+ a `full` line) ->
    {'some_avg10': 0.12, ..., 'some_total': 1234.0, 'full_avg10': ...}. total is in microseconds."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        kind, *fields = line.split() or [""]
        if kind not in ("some", "full"):
            continue
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep:
                raise ValueError(f"expected key=value, got {f!r}")
            out[f"{kind}_{key}"] = float(value)
    return out


def parse_stat(text: str) -> tuple[str, str]:
    """`/proc/<pid>/stat` -> (comm, state). comm may hold spaces and ')' so the state is the first
    field after the LAST ')'."""
    left = text.index("(")
    right = text.rindex(")")
    state = text[right + 1 :].split(None, 1)[0]
    return text[left + 1 : right], state


def parse_procs_blocked(text: str) -> int | None:
    """`/proc/stat` -> its `procs_blocked` count (tasks waiting on I/O now); None when absent."""
    for line in text.splitlines():
        if line.startswith("procs_blocked "):
            return int(line.split()[1])
    return None


def parse_load1(text: str) -> float:
    """`/proc/loadavg` (`0.52 0.58 0.59 2/1024 4242`) -> the 1-minute load average."""
    return float(text.split(None, 1)[0])


def dstate_gate(procs_blocked: int | None, load1: float | None, found_last: bool,
                since_last_scan_s: float | None, min_load: float, interval_s: float) -> bool:
    """Whether this tick scans every thread's stat. procs_blocked/load1 None: unreadable (open).
    since_last_scan_s None: never scanned."""
    if procs_blocked is None or load1 is None or found_last or procs_blocked > 0:
        return True
    if load1 < min_load:
        return False
    return since_last_scan_s is None or since_last_scan_s >= interval_s


def _unescape_mount(field: str) -> str:
    r"""Mount table fields escape space, tab, newline and backslash as octal (`\040`)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        c = field[i]
        if c == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """`/proc/mounts` -> [(mount_point, fstype)] in table order (a later mount hides an earlier one)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            out.append((_unescape_mount(fields[1]), fields[2]))
    return out


def find_mount(path: str, mounts: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The mount holding `path` by the longest mount-point prefix; the last entry wins a tie (an
    over-mount). Pure string work: no stat(), which would hang on the very mount we are checking
    (so a symlink in `path` is not resolved)."""
    path = os.path.abspath(path)
    best: tuple[str, str] | None = None
    for mp, fstype in mounts:
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best[0]):
                best = (mp, fstype)
    return best


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def _read_head(path: str) -> str:
    """The first 512 bytes in one read(): a stat line's pid, comm (at most 64 bytes) and state."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 512).decode("utf-8", "replace")
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the probe


ProbeResult = tuple[bool | None, float | None, str | None]


def write_probe(directory: str) -> ProbeResult:
    """Create a new file with a random name in `directory`, write ~4 KiB, fsync, close, unlink.

    Returns (writable, latency_s, error). latency_s covers open+write+fsync+close. O_EXCL makes the
    open fail rather than open anything already there, so the file written is always a new regular
    file of our own, never a planted FIFO, symlink or hard link. May block forever on a hung mount:
    run it in a thread."""
    target = os.path.join(directory, f"{PROBE_PREFIX}.{os.getpid()}.{secrets.token_hex(8)}")
    try:
        if not stat.S_ISDIR(os.stat(directory).st_mode):
            return False, None, f"{directory} is not a directory"
    except OSError as exc:
        return False, None, f"cannot stat {directory}: {_describe(exc)}"
    t0 = time.perf_counter()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return False, None, f"cannot create {target}: {_describe(exc)}"
    result: ProbeResult
    try:
        try:
            os.write(fd, PROBE_PAYLOAD)
            os.fsync(fd)
        finally:
            os.close(fd)
        result = (True, time.perf_counter() - t0, None)
    except OSError as exc:
        result = (False, None, f"write+fsync of {target} failed: {_describe(exc)}")
    try:
        os.unlink(target)  # also after a failed write: every probe has a new name, none may pile up
    except OSError:
        pass
    return result


@dataclass
class _Probe:
    """One probe thread and what it found."""

    directory: str
    started_at: float
    """The collect() `now` that started it (wall clock, for the report)."""
    deadline: float
    """time.monotonic() after which it counts as timed out."""
    base: dict
    """The FilesystemProbe fields known before the probe ran (path, role, mount)."""
    note: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: ProbeResult | None = None

    def run(self, probe: Callable[[str], ProbeResult]) -> None:
        try:
            self.result = probe(self.directory)
        except BaseException as exc:  # never let a thread die silently
            self.result = (None, None, f"probe crashed: {_describe(exc)}")
        finally:
            self.done.set()


class HostCollector:
    name = "host"

    def __init__(
        self,
        proc_root: str = "/proc",
        filesystems: Sequence[FilesystemSpec] = (),
        probe: Callable[[str], ProbeResult] = write_probe,
        dstate_scan_min_load: float = 0.0,
        dstate_scan_interval_s: float = 0.0,
    ) -> None:
        self.proc_root = proc_root
        self.dstate_scan_min_load = dstate_scan_min_load
        self.dstate_scan_interval_s = dstate_scan_interval_s
        self._last_scan: float | None = None
        """time.monotonic() of the last full D-state scan."""
        self._last_dstate: tuple[tuple[int, str], ...] = ()
        self.dstate_scans = 0
        """Full scans so far (the gate's effect is observable)."""
        self.filesystems = tuple(filesystems)
        self._probe = probe  # the filesystem probe run in each probe thread; a seam for tests
        # spec -> a probe that timed out and has not finished yet
        self._stuck: dict[FilesystemSpec, _Probe] = {}
        self._logged: dict[str, str] = {}

    # ------------------------------------------------------------------ collect

    def collect(self, now: float) -> HostSample:
        mounts, mounts_error = self._mounts()
        # start every probe first so they run while /proc is read, and all share one wait
        started = [(spec, self._start_probe(spec, now, mounts, mounts_error)) for spec in self.filesystems]

        detail = ""
        status = "ok"
        avail = total = None
        try:
            avail, total = parse_meminfo(_read(f"{self.proc_root}/meminfo"))
            if total is None:
                status, detail = "error", f"no MemTotal in {self.proc_root}/meminfo"
        except OSError as exc:
            status, detail = "error", f"cannot read {self.proc_root}/meminfo: {_describe(exc)}"
        psi = self._psi()
        dstate = self._dstate()

        probes = tuple(self._finish_probe(spec, probe) for spec, probe in started)
        return HostSample(
            status=status,
            detail=detail,
            mem_available_bytes=avail,
            mem_total_bytes=total,
            psi=psi,
            dstate_pids=dstate,
            filesystems=probes,
        )

    # ------------------------------------------------------------------ proc

    def _once(self, key: str, message: str) -> None:
        """Log a problem once, until it changes."""
        if self._logged.get(key) != message:
            self._logged[key] = message
            log.warning("host: %s", message)

    def _psi(self) -> dict[str, Mapping[str, float]]:
        out: dict[str, Mapping[str, float]] = {}
        for res in PSI_RESOURCES:
            path = f"{self.proc_root}/pressure/{res}"
            try:
                out[res] = parse_psi(_read(path))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                # EOPNOTSUPP when the kernel booted with psi=0: no data, not a fault
                self._once(path, f"cannot use {path}: {_describe(exc)}")
        return out

    def _dstate(self) -> tuple[tuple[int, str], ...]:
        root = self.proc_root
        try:
            blocked = parse_procs_blocked(_read(f"{root}/stat"))
            load1 = parse_load1(_read(f"{root}/loadavg"))
        except (OSError, ValueError, IndexError):
            blocked = load1 = None
        now = time.monotonic()
        since = None if self._last_scan is None else now - self._last_scan
        if not dstate_gate(blocked, load1, bool(self._last_dstate), since,
                           self.dstate_scan_min_load, self.dstate_scan_interval_s):
            # No task blocked and a low load: no D-state task can be there in any number. Under a
            # load-only gate within the interval, the last scan (which found none) stands.
            return self._last_dstate
        self._last_scan = now
        self.dstate_scans += 1
        self._last_dstate = self._scan_dstate(root)
        return self._last_dstate

    def _scan_dstate(self, root: str) -> tuple[tuple[int, str], ...]:
        found: list[tuple[int, str]] = []
        try:
            entries = [e for e in os.listdir(root) if e.isdigit()]
        except OSError as exc:
            self._once(root, f"cannot list {root}: {_describe(exc)}")
            return ()
        for pid in entries:
            try:
                tids = [t for t in os.listdir(f"{root}/{pid}/task") if t.isdigit()]
                paths = [f"{root}/{pid}/task/{t}/stat" for t in tids]
            except OSError:
                paths = [f"{root}/{pid}/stat"]
            for p in paths:
                try:
                    comm, state = parse_stat(_read_head(p))
                except (OSError, ValueError, IndexError):
                    continue  # the task exited between listing and reading, or a malformed line
                if state == "D":
                    try:
                        comm = parse_stat(_read(f"{root}/{pid}/stat"))[0]
                    except (OSError, ValueError, IndexError):
                        pass
                    found.append((int(pid), comm))
                    break
        return tuple(sorted(found))

    def _mounts(self) -> tuple[list[tuple[str, str]], str | None]:
        path = f"{self.proc_root}/mounts"
        try:
            return parse_mounts(_read(path)), None
        except OSError as exc:
            return [], f"cannot read {path}: {_describe(exc)}"

    # ------------------------------------------------------------------ filesystems

    def _start_probe(
        self, spec: FilesystemSpec, now: float, mounts: list[tuple[str, str]], mounts_error: str | None
    ) -> _Probe | FilesystemProbe:
        """Start the probe thread for `spec`, or return the final report when no probe may start."""
        mount = find_mount(spec.path, mounts)
        mount_point, fstype = mount if mount else (None, None)
        # "mounted": the path lies on a filesystem of its own, not on the root filesystem. An NFS
        # checkpoint directory that failed to mount is a plain directory on / — writable, and wrong.
        mounted = mount_point is not None and (mount_point != "/" or os.path.abspath(spec.path) == "/")
        base = dict(path=spec.path, role=spec.role, mounted=mounted, fstype=fstype, mount_point=mount_point)

        stuck = self._stuck.get(spec)
        if stuck is not None:
            if not stuck.done.is_set():
                return FilesystemProbe(
                    **base,
                    writable=None,
                    latency_s=None,
                    timed_out=True,
                    error=(
                        f"previous probe still hung since {iso(stuck.started_at)} "
                        f"({max(0.0, now - stuck.started_at):.0f}s); not starting another"
                    ),
                )
            del self._stuck[spec]
            log.info("host: the stuck probe of %s returned; probing again", spec.path)

        probe = _Probe(
            directory=spec.path,
            started_at=now,
            deadline=time.monotonic() + spec.timeout_s,
            base=base,
            note=mounts_error,
        )
        thread = threading.Thread(
            target=probe.run, args=(self._probe,), name=f"healthd-fsprobe:{spec.path}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:
            return FilesystemProbe(**base, writable=None, latency_s=None, error=f"cannot start probe thread: {exc}")
        return probe

    def _finish_probe(self, spec: FilesystemSpec, started: _Probe | FilesystemProbe) -> FilesystemProbe:
        if isinstance(started, FilesystemProbe):
            return started
        probe = started
        if not probe.done.wait(max(0.0, probe.deadline - time.monotonic())):
            self._stuck[spec] = probe
            msg = f"write+fsync probe in {probe.directory} did not finish within {spec.timeout_s:g}s"
            log.warning("host: %s; no new probe until it returns", msg)
            return FilesystemProbe(**probe.base, writable=None, latency_s=None, timed_out=True, error=msg)
        writable, latency, error = probe.result or (None, None, "probe returned nothing")
        if probe.note:
            error = f"{error}; {probe.note}" if error else probe.note
        return FilesystemProbe(**probe.base, writable=writable, latency_s=latency, error=error)

    def close(self) -> None:
        """Forget stuck probes. Their daemon threads stay blocked in the kernel until the mount
        answers (nothing can interrupt a D-state thread) and die with the process."""
        self._stuck.clear()
