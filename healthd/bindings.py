"""Job bindings: which job held which GPUs on this node, and when.

The prolog writes `<run_dir>/jobs/<jobid>.json` = {job, user, uid, node, gpus, start}; the epilog
adds `end` and moves it to `<run_dir>/jobs/done/<jobid>.json` (the newest DONE_KEEP are kept, so a
finding the agent classifies just after the job ended still finds its job). The agent reads both
directories each tick (cached by mtime and size; only files and directories root owns and nobody
else can write, no link followed: healthd.trusted) and sets `Finding.job` on GPU findings whose GPU
was bound to a job at the finding's `last_seen`; the epilog charges user-attributed findings seen
during the job to the job and its user.

Standard library only at module level: the prolog and epilog import this.
"""

from __future__ import annotations

import os
import stat

from healthd.record import Record
from healthd.statedoc import f_gpu
from healthd.text import clean, iso, parse_time
from healthd.trusted import SMALL_MAX_BYTES
from healthd.trusted import TRUSTED_UID, TrustedDir, json_object, read_fd

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable

JOBS_DIR = "jobs"
DONE_DIR = os.path.join("jobs", "done")


class _BindingName:
    """`<job>.json` with a job id of 1-20 ASCII digits: `fullmatch(name)` gives the job id or None,
    like the regular expression it replaces (re costs the hooks ~3 ms of every start)."""

    def fullmatch(self, name: str) -> str | None:
        job = name[:-5] if name.endswith(".json") else ""
        return job if 1 <= len(job) <= 20 and job.isascii() and job.isdigit() else None


BINDING_NAME = _BindingName()
DONE_KEEP = 256
"""Closed bindings kept in jobs/done (the oldest beyond this are removed by the epilog)."""
MAX_BINDINGS = 2048
"""The agent reads at most this many binding files per tick."""


class Binding(Record):
    """One job on this node: job, node, gpus (GPU indices, Slurm/CUDA numbering; None when the
    prolog could not tell), start, end (None while open), user, uid."""

    _fields = ("job", "node", "gpus", "start", "end", "user", "uid")
    _defaults = {"end": None, "user": None, "uid": None}
    job: str
    node: str
    gpus: tuple[int, ...] | None
    start: float
    end: float | None
    user: str | None
    uid: int | None

    def active_at(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t <= self.end)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "job": self.job,
            "user": self.user,
            "uid": self.uid,
            "node": self.node,
            "gpus": list(self.gpus) if self.gpus is not None else None,
            "start": iso(self.start),
        }
        if self.end is not None:
            doc["end"] = iso(self.end)
        return doc


def parse_binding(doc: dict[str, Any]) -> Binding:
    """A binding document -> Binding; ValueError naming the bad field."""
    job = doc.get("job")
    if not isinstance(job, str) or not BINDING_NAME.fullmatch(f"{job}.json"):
        raise ValueError(f"job {clean(repr(job), 40)} is not a job id")
    node = doc.get("node")
    if not isinstance(node, str) or not node:
        raise ValueError("no node")
    gpus = doc.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            raise ValueError("gpus is not a list of indices")
        gpus = tuple(gpus)
    start = parse_time(doc.get("start"))
    if start is None:
        raise ValueError("start is not an RFC 3339 time")
    end = None
    if doc.get("end") is not None:
        end = parse_time(doc.get("end"))
        if end is None:
            raise ValueError("end is not an RFC 3339 time")
    user = doc.get("user") if isinstance(doc.get("user"), str) else None
    uid = doc.get("uid") if isinstance(doc.get("uid"), int) and not isinstance(doc.get("uid"), bool) else None
    return Binding(job=job, node=node, gpus=gpus, start=start, end=end, user=user, uid=uid)


def binding_name(job: str) -> str:
    """`<job>.json`; ValueError for anything but a job id (callers validated it: a name never
    leaves jobs/)."""
    if not BINDING_NAME.fullmatch(f"{job}.json"):
        raise ValueError(f"not a job id: {job!r}")
    return f"{job}.json"


def binding_path(run_dir: str, job: str) -> str:
    return os.path.join(run_dir, JOBS_DIR, binding_name(job))


def done_path(run_dir: str, job: str) -> str:
    return os.path.join(run_dir, DONE_DIR, binding_name(job))


# --------------------------------------------------------------------------- pure rules


def job_at(bindings: Iterable[Binding], gpu: int, t: float) -> Binding | None:
    """The job that held `gpu` at time `t` (the latest-started one if bindings overlap)."""
    best = None
    for b in bindings:
        if b.gpus is not None and gpu in b.gpus and b.active_at(t):
            if best is None or b.start > best.start:
                best = b
    return best


def attach_jobs(findings: tuple[Any, ...], bindings: list[Binding]) -> tuple[Any, ...]:
    """Set `job` on each GPU finding whose GPU was bound to a job at its last_seen (Finding objects;
    one that already names a job keeps it)."""
    if not bindings:
        return findings
    from dataclasses import replace  # lazy: spared from the hooks' start

    out = []
    for f in findings:
        c = f.component
        if f.job is None and c.kind == "gpu" and c.index is not None and f.last_seen is not None:
            b = job_at(bindings, c.index, f.last_seen)
            if b is not None:
                f = replace(f, job=b.job)
        out.append(f)
    return tuple(out)


def charges(findings: Iterable[dict[str, Any]], binding: Binding, end: float, node: str) -> list[dict[str, Any]]:
    """The charge lines for a finished job: user-attributed findings (state-document dicts) on one of
    the job's GPUs whose last_seen lies within [start, end]."""
    if binding.gpus is None:
        return []
    out = []
    for f in findings:
        gpu = f_gpu(f)
        seen = parse_time(f.get("last_seen"))
        if f.get("attribution") != "user" or gpu is None or gpu not in binding.gpus or seen is None:
            continue
        if not binding.start <= seen <= end:
            continue
        comp = f.get("component") or {}
        xid = f.get("xid")
        out.append({
            "job": binding.job,
            "user": binding.user,
            "node": node,
            "gpu": gpu,
            "serial": comp.get("serial") if isinstance(comp.get("serial"), str) else None,
            "xid": xid if isinstance(xid, int) and not isinstance(xid, bool) else None,
            "finding": clean(f.get("id"), 200),
            "summary": clean(f.get("summary"), 300),
            "time": iso(seen),
            "count": f.get("count") if isinstance(f.get("count"), int) else None,
            "charged_at": iso(end),
        })
    return out


# --------------------------------------------------------------------------- the agent's reader


class BindingReader:
    """Reads jobs/*.json and jobs/done/*.json for the agent, re-parsing only files whose mtime, size,
    inode, owner or mode changed. Only trusted files in trusted directories are read (root's, not
    writable by group or others, no link followed below run_dir: healthd.trusted); an untrusted
    directory is skipped whole, and untrusted, oversized, non-regular and unparsable files are skipped,
    with one log line each."""

    def __init__(self, trusted_uid: int = TRUSTED_UID) -> None:
        self.trusted_uid = trusted_uid
        self._cache: dict[str, tuple[tuple[int, ...], Binding | None]] = {}

    def read(self, run_dir: str, node: str, warn: Callable[[str], None]) -> list[Binding]:
        cache: dict[str, tuple[tuple[int, ...], Binding | None]] = {}
        for sub in (JOBS_DIR, DONE_DIR):
            try:
                d = TrustedDir(run_dir, sub, trusted_uid=self.trusted_uid)
            except FileNotFoundError:
                continue
            except OSError as e:
                warn(f"job bindings in {os.path.join(run_dir, sub)} ignored: {e.strerror or e}")
                continue
            with d:
                try:
                    names = d.names()
                except OSError as e:
                    warn(f"cannot list job bindings in {d.path}: {e.strerror or e}")
                    continue
                for name in names:
                    if len(cache) >= MAX_BINDINGS:
                        break
                    if BINDING_NAME.fullmatch(name):
                        self._one(d, name, cache, warn)
        self._cache = cache
        return [b for _, b in cache.values() if b is not None and b.node == node]

    def _one(self, d: TrustedDir, name: str, cache: dict[str, tuple[tuple[int, ...], Binding | None]],
             warn: Callable[[str], None]) -> None:
        path = d.join(name)
        try:
            st = d.lstat(name)
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_uid, st.st_mode)
        old = self._cache.get(path)
        if old is not None and old[0] == key:
            cache[path] = old
            return
        binding = None
        if not stat.S_ISREG(st.st_mode):
            warn(f"job binding {path} is not a regular file; ignored")
        elif st.st_size > SMALL_MAX_BYTES:
            warn(f"job binding {path} is {st.st_size} bytes (limit {SMALL_MAX_BYTES}); ignored")
        else:
            try:
                fd, fst = d.open_file(name)
                try:
                    key = (fst.st_mtime_ns, fst.st_size, fst.st_ino, fst.st_uid, fst.st_mode)
                    binding = parse_binding(json_object(read_fd(fd, fst, SMALL_MAX_BYTES, path)))
                finally:
                    os.close(fd)
            except FileNotFoundError:
                return  # the epilog moved it meanwhile
            except (OSError, ValueError, UnicodeDecodeError) as e:
                warn(f"job binding {path} is unusable ({clean(e, 300)}); ignored")
        cache[path] = (key, binding)


# --------------------------------------------------------------------------- the hooks' writers


def close_binding(run_dir: str, binding: Binding, end: float, *, trusted_uid: int = TRUSTED_UID, **extra: Any) -> str:
    """Write the binding with its end time to jobs/done/ (atomically), remove the open one, and keep
    only the newest DONE_KEEP closed bindings. Returns the closed binding's path. Every directory is
    reached without following a link (healthd.trusted); OSError when one is a link or untrusted."""
    name = binding_name(binding.job)
    with TrustedDir(run_dir, DONE_DIR, create=True, trusted_uid=trusted_uid) as done:
        done.write_json(name, {**binding.to_json(), "end": iso(end), **extra})
        with TrustedDir(run_dir, JOBS_DIR, trusted_uid=trusted_uid) as jobs:
            jobs.unlink(name)
        prune_done(done)
        return done.join(name)


def prune_done(done: TrustedDir, keep: int = DONE_KEEP) -> int:
    """Remove the oldest closed bindings beyond `keep`; stats only when there are too many."""
    try:
        names = [n for n in done.names() if BINDING_NAME.fullmatch(n)]
    except OSError:
        return 0
    if len(names) <= keep:
        return 0
    aged = []
    for n in names:
        try:
            aged.append((done.lstat(n).st_mtime_ns, n))
        except OSError:
            continue
    aged.sort()
    removed = 0
    for _, n in aged[: max(0, len(aged) - keep)]:
        try:
            removed += done.unlink(n)
        except OSError:
            pass
    return removed


def read_binding(run_dir: str, job: str, *, trusted_uid: int = TRUSTED_UID) -> Binding:
    """The open binding of `job` from a trusted file; OSError (FileNotFoundError, Untrusted) or
    ValueError with a reason."""
    with TrustedDir(run_dir, JOBS_DIR, trusted_uid=trusted_uid) as jobs:
        return parse_binding(jobs.read_json(binding_name(job), SMALL_MAX_BYTES))


def remove_binding(run_dir: str, job: str, *, trusted_uid: int = TRUSTED_UID) -> bool:
    with TrustedDir(run_dir, JOBS_DIR, trusted_uid=trusted_uid) as jobs:
        return jobs.unlink(binding_name(job))


def open_bindings(run_dir: str, *, trusted_uid: int = TRUSTED_UID,
                  warn: Callable[[str], None] | None = None) -> list[tuple[str, Binding | None]]:
    """(job id, binding or None if unusable) for every open binding in jobs/ (trusted files only)."""
    try:
        jobs = TrustedDir(run_dir, JOBS_DIR, trusted_uid=trusted_uid)
    except FileNotFoundError:
        return []
    except OSError as e:
        if warn is not None:
            warn(f"job bindings in {os.path.join(run_dir, JOBS_DIR)} ignored: {e.strerror or e}")
        return []
    out: list[tuple[str, Binding | None]] = []
    with jobs:
        try:
            names = sorted(n for n in jobs.names() if BINDING_NAME.fullmatch(n))
        except OSError:
            return []
        for n in names[:MAX_BINDINGS]:
            try:
                out.append((n[:-5], parse_binding(jobs.read_json(n, SMALL_MAX_BYTES))))
            except (OSError, ValueError, UnicodeDecodeError):
                out.append((n[:-5], None))
    return out
