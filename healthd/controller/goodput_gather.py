"""The head node's copy of the jobs' goodput event logs (healthd.goodput): each agent ships the
lines of the logs it writes (rank 0's ring, the epilog's run ends) to `POST /v1/goodput`, signed
like its reports, and the controller appends them to `<directory>/<job>/<node>.jsonl`.

A shipment is `{"kind": "goodput-lines", "job": J, "offset": O, "data": TEXT}`: whole lines of the
node's own file from byte O. `<node>.offset` beside the copy holds how far into the node's file the
copy reaches, so a shipment is appended exactly once: one that starts past it is answered with where
the copy ends (the agent sends again from there), one that repeats lines the copy has skips them, and
the answer is always `{"accepted": true, "through": N}`. A crash between the append and the offset
repeats a few lines at most, which the reader drops as exact repeats.

What a node may say is what its agent and epilog write: ml-goodput-measurement's entries and the
`allocation`, `run_end`, `durable` and `restored` records, each a JSON object of the shipment's job.
Interruptions, their incidents and false positives come from the ledger only, so a node cannot
charge a job's loss to another node. A shipment with any other line is refused whole (400), one
that would grow a copy past `max_log_bytes` or finds the disk full is refused (507) and stays on the
node, which retries.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from healthd import goodput
from healthd import goodput_events as ev
from healthd.controller import inband
from healthd.envelope import NODE_NAME
from healthd.persist import write_json_atomic
from healthd.goodput import MAX_LINE_BYTES
from healthd.slurm.backend import validate_job_id

_log = logging.getLogger("healthd.controller")

MAX_OFFSET_BYTES = 64


class ShipmentRefused(ValueError):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Shipment:
    job: str
    offset: int
    data: str


def parse_shipment(doc: object) -> Shipment:
    """A shipment document -> Shipment; ShipmentRefused(400) naming what is wrong (pure)."""
    if not isinstance(doc, dict) or doc.get("kind") != ev.SHIPMENT_KIND:
        raise ShipmentRefused(400, f"not a {ev.SHIPMENT_KIND} shipment")
    extra = sorted(set(doc) - ev.SHIPMENT_FIELDS)
    if extra:
        raise ShipmentRefused(400, f"unknown field {extra[0][:40]!r}")
    job, offset, data = doc.get("job"), doc.get("offset"), doc.get("data")
    try:
        job = validate_job_id(job)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ShipmentRefused(400, f"job {str(job)[:40]!r} is not a Slurm job id") from None
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 1 << 48:
        raise ShipmentRefused(400, "offset is not a byte offset")
    if not isinstance(data, str) or len(data.encode("utf-8", "surrogatepass")) > ev.MAX_SHIPMENT_BYTES:
        raise ShipmentRefused(400, f"data is not text of at most {ev.MAX_SHIPMENT_BYTES} bytes")
    if data and not data.endswith("\n"):
        raise ShipmentRefused(400, "data does not end with a whole line")
    for n, line in enumerate(data.split("\n")[:-1], 1):
        problem = line_problem(line, job)
        if problem:
            raise ShipmentRefused(400, f"line {n}: {problem}")
    return Shipment(job, offset, data)


def line_problem(line: str, job: str) -> str:
    """Why a node may not add this line to the job's log; empty when it may (pure)."""
    if len(line) > MAX_LINE_BYTES:
        return f"longer than {MAX_LINE_BYTES} bytes"
    try:
        doc = json.loads(line)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get(ev.JOB_NAME) != job:
        return f"{ev.JOB_NAME} is not {job}"
    kind = doc.get(ev.EVENT)
    if kind is not None and kind not in ev.NODE_EVENTS:
        writer = ev.EVENTS[kind][0] if kind in ev.EVENTS else "no writer"
        return f"{ev.EVENT} {str(kind)[:40]!r} comes from the {writer}, not from a node"
    return ""


class GoodputStore:
    """The gathered copies under `directory` (I/O at the edge; one lock, appends are small)."""

    def __init__(self, directory: str, max_log_bytes: int):
        self.directory = directory
        self.max_log_bytes = max_log_bytes
        self._lock = threading.Lock()

    def job_dir(self, job: str) -> str:
        return os.path.join(self.directory, validate_job_id(job))

    def through(self, job: str, node: str) -> int:
        """How far into `node`'s file of `job` the copy reaches (0 when there is none)."""
        try:
            fd = os.open(os.path.join(self.job_dir(job), f"{node}.offset"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            raw = os.read(fd, MAX_OFFSET_BYTES)
        finally:
            os.close(fd)
        text = raw.decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else 0

    def append(self, node: str, shipment: Shipment) -> int:
        """Append what the copy lacks of `shipment` from `node`; returns how far the copy now reaches.
        Raises ShipmentRefused (507: full) or OSError."""
        if not NODE_NAME.fullmatch(node):
            raise ShipmentRefused(400, "node name is not a hostname")
        with self._lock:
            through = self.through(shipment.job, node)
            raw = shipment.data.encode("utf-8", "surrogatepass")
            end = shipment.offset + len(raw)
            if shipment.offset > through or end <= through:
                return through  # a gap (send from `through`) or lines the copy has
            new = raw[through - shipment.offset:]
            if through > shipment.offset and not raw[:through - shipment.offset].endswith(b"\n"):
                return through  # not cut at a line: the node's file is not the one the copy follows
            directory = self.job_dir(shipment.job)
            os.makedirs(directory, mode=0o750, exist_ok=True)
            path = os.path.join(directory, f"{node}.jsonl")
            try:
                size = os.lstat(path).st_size
            except FileNotFoundError:
                size = 0
            if size + len(new) > self.max_log_bytes:
                raise ShipmentRefused(507, f"job {shipment.job}'s log from {node} would pass {self.max_log_bytes} bytes")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
                try:
                    os.write(fd, new)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._write_offset(directory, node, end)
            except OSError as exc:
                if exc.errno == 28:  # ENOSPC: the node keeps its lines and retries
                    raise ShipmentRefused(507, "the controller's disk is full") from None
                raise
            return end

    def _write_offset(self, directory: str, node: str, end: int) -> None:
        write_json_atomic(os.path.join(directory, f"{node}.offset"), end, mode=0o640)


def job_parts(directory: str) -> list[str]:
    """The parts of one job's gathered log (`<node>.jsonl`), in name order."""
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".jsonl"))


def read_parts(paths: list[str], job: str | None, max_bytes: int) -> goodput.Log:
    """One job's log from its parts, at most `max_bytes` of each (a part cut short is noted), merged
    in time order. Raises OSError when none can be read; a part that cannot is noted."""
    parts: list[tuple[str, goodput.Log]] = []
    unreadable: list[str] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                raw = f.read(max_bytes + 1)
        except OSError as exc:
            if len(paths) == 1:
                raise
            unreadable.append(f"{os.path.basename(path)}: not read: {exc.strerror or exc}")
            continue
        log = goodput.parse_log(raw[:max_bytes].decode("utf-8", errors="replace"), job)
        if len(raw) > max_bytes:
            log = goodput.Log(log.job, log.events, (*log.problems, f"only the first {max_bytes} bytes read"))
        parts.append((os.path.basename(path).removesuffix(".jsonl"), log))
    if not parts:
        raise OSError(f"no part of the log could be read ({'; '.join(unreadable)})")
    if len(parts) == 1:
        log = parts[0][1]
    else:
        log = goodput.merge(parts)
    return goodput.Log(job or log.job, log.events, (*log.problems, *unreadable))


# --------------------------------------------------------------------------- the controller's own part


CONTROLLER_PART = "_controller"
"""`<job>/_controller.jsonl`: what the controller itself adds to a job's log (its straggler episodes);
no node can ship to it (a node name starts with a letter or digit)."""


@dataclass
class _Episode:
    first: float
    last: float
    effect: float
    node: str
    gpu: int | None


class StragglerEpisodes:
    """Each slow rank's episode, from the rounds' flags (the agents' and the controller's), written to
    the job's log as one `straggler` record when it ends: from when it was first flagged to when it
    was last, with the largest slowdown seen, the rank, its node and GPU. A rank the latest round no
    longer flags (or whose job left the reports) has ended. Pure but for `write`."""

    def __init__(self, write: Callable[[str, list[str]], None]):
        self.write = write
        self._open: dict[tuple[str, int], _Episode] = {}

    def observe(self, now: float, flags: Iterable[tuple[str, int, str, int | None, float]]) -> list[tuple[str, int]]:
        """One round's flags as (job, rank, node, gpu, effect); returns the episodes it ended."""
        seen: set[tuple[str, int]] = set()
        for job, rank, node, gpu, effect in flags:
            key = (job, rank)
            seen.add(key)
            ep = self._open.get(key)
            if ep is None:
                self._open[key] = _Episode(now, now, max(0.0, effect), node, gpu)
            else:
                ep.last, ep.effect, ep.node, ep.gpu = now, max(ep.effect, effect), node, gpu
        ended = [k for k in self._open if k not in seen]
        self._flush(ended)
        return ended

    def close(self) -> None:
        """The controller stops: every open episode is written as it stands."""
        self._flush(list(self._open))

    def _flush(self, keys: list[tuple[str, int]]) -> None:
        by_job: dict[str, list[str]] = {}
        for key in keys:
            ep = self._open.pop(key)
            if ep.last <= ep.first:
                continue  # one round: no time to charge
            job, rank = key
            by_job.setdefault(job, []).append(ev.log_line(job, **ev.event(
                "straggler", ep.first, end=ep.last, share=round(ep.effect, 4), rank=rank, node=ep.node, gpu=ep.gpu)))
        for job, lines in by_job.items():
            self.write(job, lines)


def append_own(store: GoodputStore, job: str, lines: list[str]) -> None:
    """Append the controller's own lines to `<job>/_controller.jsonl` (no offsets: one writer)."""
    directory = store.job_dir(job)
    os.makedirs(directory, mode=0o750, exist_ok=True)
    fd = os.open(os.path.join(directory, f"{CONTROLLER_PART}.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, "".join(f"{x}\n" for x in lines).encode())
    finally:
        os.close(fd)


MAX_WINDOW_RANKS = 4096
"""A job with more ranks has no window records (one line would pass the log's line limit)."""


@dataclass(frozen=True)
class RankWindows:
    """One rank of a job as the round sees it: where it runs and its recent windows' compute time."""

    rank: int
    node: str
    gpu: int | None
    rail: str | None
    windows: tuple[tuple[int, float], ...]
    """(window, compute seconds), from the rank's report."""


class WindowRecords:
    """Each job's rank x window step compute time, from the rounds' in-band views, for the report's
    heatmap: a `ranks` record with the ranks first seen or moved (not those gone from the reports, as
    they are while a job ends), and one `windows` record per window
    once every rank has completed it (the ranks' reports hold only their latest windows, so the
    controller writes them while the job runs). Pure but for `write`."""

    def __init__(self, write: Callable[[str, list[str]], None]):
        self.write = write
        self._done: dict[str, int] = {}
        self._where: dict[str, dict[int, tuple]] = {}

    def wants(self, job: str, complete: int) -> bool:
        """Whether a job whose ranks have all completed window `complete` has anything to write: a
        new job, or a new window (the round skips building the ranks of the others)."""
        return job not in self._done or complete > self._done[job]

    def observe(self, now: float, jobs: dict[str, list[RankWindows]], world: dict[str, int | None] | None = None,
                present: Iterable[str] | None = None) -> None:
        """One round's ranks of each job; `world`: job -> its world size, when known (a window is only
        written once every rank of the job has reported, so a job starting node by node loses none)."""
        still = set(jobs) if present is None else set(present)
        for job in [j for j in self._done if j not in still]:
            del self._done[job]  # gone from the reports (ended, or requeued: its windows start over)
            self._where.pop(job, None)
        for job, ranks in jobs.items():
            if not ranks or len(ranks) > MAX_WINDOW_RANKS:
                continue
            lines = []
            known = self._where.setdefault(job, {})
            moved = sorted((r.rank, r.node, r.gpu, r.rail) for r in ranks if known.get(r.rank) != (r.node, r.gpu, r.rail))
            if moved:
                known.update((rank, (node, gpu, rail)) for rank, node, gpu, rail in moved)
                lines.append(ev.log_line(job, **ev.event("ranks", now, ranks=[
                    {"rank": rank, "node": node, "gpu": gpu, "rail": rail} for rank, node, gpu, rail in moved])))
            size = (world or {}).get(job)
            newest = [max((w for w, _ in r.windows), default=-1) for r in ranks]
            complete = min(newest) if size is None or len({r.rank for r in ranks}) >= size else -1
            done = self._done.get(job, -1)
            by_window: dict[int, list[list[float]]] = {}
            for r in ranks:
                for w, compute in r.windows:
                    if done < w <= complete:
                        by_window.setdefault(w, []).append([r.rank, round(compute, 6)])
            for w in sorted(by_window):
                lines.append(ev.log_line(job, **ev.event("windows", now, window=w, compute=sorted(by_window[w]))))
            self._done[job] = max(complete, done)
            if lines:
                self.write(job, lines)


class InbandLogs:
    """What the rounds' in-band views add to their jobs' goodput logs (`<job>/_controller.jsonl`): the
    slow ranks' episodes (StragglerEpisodes) and each job's rank x window compute time (WindowRecords)."""

    def __init__(self, store: GoodputStore):
        self.store = store
        self.stragglers = StragglerEpisodes(self._write)
        self.windows = WindowRecords(self._write)

    def _write(self, job: str, lines: list[str]) -> None:
        try:
            append_own(self.store, job, lines)
        except ValueError:  # a job id a report carried that is not Slurm's: nothing to charge it to
            _log.debug("straggler episodes of %r not written: not a job id", job)

    def observe(self, now: float, rnd: inband.InbandRound) -> None:
        """One round's slow ranks and rank windows (raises OSError when a log cannot be written)."""
        self.stragglers.observe(now, [(f.job, f.state.rank, f.node, f.state.gpu, f.straggler.effect)
                                      for f in rnd.flags])
        views = rnd.views
        # only the jobs with a window every rank has newly completed (O(ranks) for the others)
        changed = {job: view for job, view in views.items()
                   if self.windows.wants(job, min((p.state.windows[-1].window if p.state.windows else -1)
                                                  for p in view.ranks.values()) if view.ranks else -1)}
        self.windows.observe(now, {
            job: [RankWindows(rank, p.node, p.state.gpu, p.state.rail, tuple((w.window, w.compute_s)
                                                                            for w in p.state.windows))
                  for rank, p in view.ranks.items()]
            for job, view in changed.items()},
            {job: view.world_size for job, view in changed.items()}, present=views)

    def close(self) -> None:
        """The controller stops: the open straggler episodes are written as they stand."""
        self.stragglers.close()
