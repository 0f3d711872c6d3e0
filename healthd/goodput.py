"""Goodput accounting: where every GPU-second of a training job went, charged to its cause.

Pure functions over a job's event log, a JSONL file with one object per line: ml-goodput-measurement's
entries (runs, step marks, the blocking part of saves) and healthd's own events (what a run holds and
how it ended, durable checkpoints and restores, incidents from the ledger, stragglers). Its keys and
kinds are healthd.goodput_events; docs/goodput.md says what each means. A run_end whose state is
ENDED (the epilog could not tell how it ended) counts its last run's steps as done.

Every GPU-second from the first run's start to the last run's end falls in exactly one category
(healthd.goodput_categories); they sum to the held GPU-seconds. A log that cannot be read whole (a
truncated line, events out of order, a run without an end, a clock step) gives a partial answer whose
`problems` say what was assumed; never an exception, never a silently different total.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import statistics
from itertools import pairwise
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd import goodput_events as ev
from healthd.goodput_categories import CATEGORIES, INCIDENT_CATEGORIES
from healthd.goodput_events import log_line  # noqa: F401 - the writers' and the tests' name for it

MAX_LINE_BYTES = 64 * 1024
MAX_EVENTS = 5_000_000

HEALTHD_KINDS = frozenset(ev.EVENTS)
"""`ranks` and `windows` (ev.UNACCOUNTED_EVENTS) are read for the report's heatmap, not accounted."""


# --------------------------------------------------------------------------- the log


@dataclass(frozen=True)
class Event:
    time: float
    kind: str
    """job_start, job_end, step, checkpoint_start, checkpoint_end, custom_start, custom_end, or a
    healthd_event kind."""
    data: Mapping[str, Any] = field(default_factory=dict)
    line: int = 0
    """Its line in its part, in the order its writer wrote it; 0 for an entry from a source with no
    order of its own (the ledger, Slurm's accounting), which is placed in a run by its time."""
    part: str = ""
    """The file it came from: a node's part of a gathered log."""
    run: int | None = None
    """The run the line names (its `run` key: Slurm's restart count), when it names one."""
    key: int = 0
    """Its content's fingerprint: two lines equal as JSON are one entry."""


@dataclass(frozen=True)
class Log:
    job: str | None
    events: tuple[Event, ...]
    """In reading order: each part's lines in the order they were written, the parts one after the other."""
    problems: tuple[str, ...] = ()
    """What could not be read: the answer is partial."""
    notes: tuple[str, ...] = ()
    """What was read and set aside without changing the answer (an event kind of a newer agent)."""


def number(v: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (booleans included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _canonical(v: Any) -> Any:
    """`v` as the same JSON value whatever its writer's key order or number spelling (1, 1.0)."""
    if isinstance(v, dict):
        return {str(k): _canonical(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


def _flat(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return ("const", v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return v
    return ("json", json.dumps(_canonical(v), sort_keys=True, separators=(",", ":")))


def fingerprint(doc: Mapping[str, Any]) -> int:
    """The same number for two entries that are equal as JSON (a line re-serialized with another key
    order, spacing or number spelling, or shipped twice)."""
    return hash(tuple(sorted((str(k), _flat(v)) for k, v in doc.items())))


_Issue = tuple[str, str]
"""("problem" | "note", what): why an entry is not an event."""


def _event(doc: Mapping[str, Any], line: int) -> Event | _Issue | None:
    """One entry as an Event; an issue when it cannot be one; None for an entry of a kind healthd does
    not account (ml-goodput-measurement's tpu_init and the like)."""
    if ev.EVENT in doc:
        kind, t = doc.get(ev.EVENT), number(doc.get(ev.TIME))
        if kind not in HEALTHD_KINDS:
            return "note", f"{ev.EVENT} {str(kind)[:40]!r} is not a kind this healthd knows (a newer writer's?); not accounted"
        if t is None:
            return "problem", f"{ev.EVENT} {kind} without a time"
        return Event(t, kind, {k: v for k, v in doc.items() if k not in (ev.EVENT, ev.TIME, ev.JOB_NAME, ev.RUN)},
                     line)
    if ev.STEP_COUNT in doc:
        n, t = doc.get(ev.STEP_COUNT), number(doc.get(ev.STEP_START_TIME))
        if not isinstance(n, int) or isinstance(n, bool) or t is None:
            return "problem", f"step entry without an integer {ev.STEP_COUNT} and a {ev.STEP_START_TIME}"
        return Event(t, "step", {"step": n}, line)
    if ev.CUSTOM_EVENT_TYPE in doc:
        what = doc.get(ev.CUSTOM_EVENT_TYPE)
        start, end = number(doc.get(ev.CUSTOM_EVENT_START_TIME)), number(doc.get(ev.CUSTOM_EVENT_END_TIME))
        if (start is None) == (end is None) or not isinstance(what, str):
            return "problem", f"{ev.CUSTOM_EVENT_TYPE} entry without a name and exactly one of a start and an end time"
        if what == ev.CHECKPOINT_SAVE:
            return Event(start if start is not None else end, "checkpoint_start" if start is not None else "checkpoint_end",  # type: ignore[arg-type]
                         {}, line)
        return Event(start if start is not None else end, "custom_start" if start is not None else "custom_end",  # type: ignore[arg-type]
                     {"type": what[:64]}, line)
    for key, kind in ((ev.DATA_LOADING_START_TIME, "custom_start"), (ev.DATA_LOADING_END_TIME, "custom_end")):
        if key in doc:
            t = number(doc.get(key))
            return Event(t, kind, {"type": ev.DATA_LOADING}, line) if t is not None else ("problem", f"{key} is not a number")
    for key, kind in ((ev.JOB_START_TIME, "job_start"), (ev.JOB_END_TIME, "job_end")):
        if key in doc:
            t = number(doc.get(key))
            return Event(t, kind, {}, line) if t is not None else ("problem", f"{key} is not a number")
    return None


_TIE = {"run_end": -3, "job_end": -3, "job_start": -2, "allocation": -1}
"""Order among a run's events of the same time: its start and allocation before the rest. A run's
end sorts first only where runs are told apart by time (a source without order of its own): the run
that ends at T ended before the one that starts at T."""


def _order(e: Event) -> tuple[float, int, str, int]:
    return (e.time, _TIE.get(e.kind, 0), e.part, e.line)


def _run_key(doc: Mapping[str, Any]) -> int | None | str:
    if ev.RUN not in doc:
        return None
    v = doc[ev.RUN]
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 20:
        return v
    return f"{ev.RUN} is not a restart count (an integer from 0); the line is placed as if it had none"


def parse_log(text: str, job: str | None = None, part: str = "") -> Log:
    """The events of one job's JSONL log (`job`: only entries of that job_name; `part`: the name of the
    file, a node's part of a gathered log), in the order they were written. A line equal to an earlier
    one as JSON is dropped: no entry can legitimately repeat, as each has its own time."""
    events: list[Event] = []
    problems: list[str] = []
    notes: dict[str, int] = {}
    names: set[str] = set()
    seen: set[int] = set()
    lines = text.split("\n")
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            problems.append(f"line {i}: longer than {MAX_LINE_BYTES} bytes; skipped")
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            truncated = i == len(lines) and not text.endswith("\n")
            problems.append(f"line {i}: {'truncated (the last line, no newline)' if truncated else 'not JSON'}; skipped")
            continue
        if not isinstance(doc, dict):
            problems.append(f"line {i}: not a JSON object; skipped")
            continue
        name = doc.get(ev.JOB_NAME)
        if job is not None and name != job:
            continue
        key = fingerprint(doc)
        if key in seen:
            continue  # the same entry again: re-shipped, or a writer that crashed between its append and its cursor
        seen.add(key)
        if isinstance(name, str):
            names.add(name)
        got = _event(doc, i)
        if got is None:
            continue
        if isinstance(got, tuple):
            if got[0] == "note":
                notes[got[1]] = notes.get(got[1], 0) + 1
            else:
                problems.append(f"line {i}: {got[1]}; skipped")
            continue
        run = _run_key(doc)
        if isinstance(run, str):
            problems.append(f"line {i}: {run}")
            run = None
        events.append(Event(got.time, got.kind, got.data, i, part, run, key))
        if len(events) >= MAX_EVENTS:
            problems.append(f"more than {MAX_EVENTS} events; the rest not read")
            break
    if job is None and len(names) > 1:
        problems.append(f"entries of {len(names)} jobs ({', '.join(sorted(names)[:4])}); read together")
    return Log(job if job is not None else (next(iter(names)) if len(names) == 1 else None), tuple(events),
               tuple(problems), tuple(f"{n} line(s): {what}" for what, n in notes.items()))


def with_entries(log: Log, entries: Iterable[Mapping[str, Any]]) -> Log:
    """`log` with more entries from a source with no order of its own (the ledger's incident times):
    each is placed in a run by its time."""
    extra = [e for e in (_event(doc, 0) for doc in entries) if isinstance(e, Event)]
    if not extra:
        return log
    return Log(log.job, (*log.events, *(Event(e.time, e.kind, e.data, 0, "ledger") for e in extra)), log.problems,
               log.notes)


def merge(logs: Iterable[tuple[str, Log]]) -> Log:
    """One job's log from its parts (named: the node each came from). An entry in several parts counts
    once; each part's problems keep its name. Parts of several jobs are noted as a problem, like one
    file's."""
    named = list(logs)
    seen: set[int] = set()
    events: list[Event] = []
    for name, log in named:
        for e in log.events:
            if e.key and e.key in seen:
                continue
            seen.add(e.key)
            events.append(e if e.part == name or e.line == 0 else Event(e.time, e.kind, e.data, e.line, name, e.run, e.key))
    problems = tuple(f"{name}: {p}" for name, log in named for p in log.problems)
    notes = tuple(f"{name}: {n}" for name, log in named for n in log.notes)
    jobs = {log.job for _, log in named if log.job is not None}
    if len(jobs) > 1:
        problems += (f"parts of {len(jobs)} jobs ({', '.join(sorted(jobs)[:4])}); read together",)
    return Log(next(iter(jobs)) if len(jobs) == 1 else None, tuple(events), problems, notes)


@dataclass(frozen=True)
class SlurmRun:
    """One run of the job as Slurm's accounting has it."""

    start: float
    end: float | None
    """None: still running."""
    state: str
    gpus: int | None = None
    """None: accounting does not track GPUs (the log's allocation record is used)."""


SKELETON_KINDS = frozenset({"job_start", "job_end", "run_end", "allocation"})
"""The events that say when runs start and end and what they hold."""


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return min(a1, b1) - max(a0, b0)


def with_runs(log: Log, runs: Iterable[SlurmRun]) -> Log:
    """`log` with its runs as Slurm's accounting has them (sacct, one per requeue, in order): each run's
    start, end, end state and GPUs replace the log's own (rank 0's process start, the epilog's end), so
    the time from the allocation to the job's first process counts too. The log's runs are matched to
    Slurm's by their `run` key, else each to the Slurm run its time overlaps most (nearest by start when
    none does), never out of order. Where accounting does not track GPUs, a run holds what the log's
    allocation record within it says."""
    slurm = sorted((r for r in runs if r.start is not None), key=lambda r: r.start)
    if not slurm:
        return Log(log.job, log.events, (*log.problems, "Slurm's accounting has no run that started; the log's runs used"),
                   log.notes)
    own, _, _ = _runs(log, None)
    mapping: dict[int, int] = {}
    floor = 0
    for r in own:
        if r.named is not None and r.named < len(slurm):
            mapping[r.index] = floor = max(floor, r.named)
            continue
        ends = [math.inf if s.end is None else s.end for s in slurm]
        scores = [(_overlap(r.start, r.end, s.start, e), -abs(r.start - s.start), k)
                  for k, (s, e) in enumerate(zip(slurm, ends, strict=True)) if k >= floor]
        best = max(scores)[2] if scores else len(slurm) - 1
        mapping[r.index] = floor = best
    placed = {(e.part, e.line): mapping[r.index] for r in own for e in r.events if e.line}
    kept = [e if (e.part, e.line) not in placed else
            Event(e.time, e.kind, e.data, e.line, e.part, placed[(e.part, e.line)], e.key)
            for e in log.events if e.kind not in SKELETON_KINDS]
    extra: list[Event] = []
    for k, s in enumerate(slurm):
        gpus = s.gpus or next((r.gpus_recorded for r in own if mapping[r.index] == k and r.gpus_recorded), None)
        extra.append(Event(s.start, "job_start", {"from": "accounting"}, 1, "accounting", k))
        if gpus:
            extra.append(Event(s.start, "allocation", {"gpus": gpus, "from": "accounting"}, 1, "accounting", k))
        if s.end is not None:
            extra.append(Event(s.end, "run_end", {"state": s.state, "from": "accounting"}, 1, "accounting", k))
    return Log(log.job, (*extra, *kept), log.problems, log.notes)


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    index: int
    start: float
    end: float
    gpus: int
    state: str
    """How it ended: Slurm's state from a run_end record, COMPLETED for a job_end, RUNNING for the last
    run with no end yet, or UNKNOWN."""
    events: tuple[Event, ...]
    """Its events in time order, on its own clock (a clock stepped back inside it is undone)."""
    named: int | None = None
    """The run's `run` key (Slurm's restart count) when its lines carry one."""
    gpus_recorded: int | None = None
    """What its allocation record says (None: it has none, and `gpus` is assumed)."""


_INCIDENT_KINDS = frozenset({"interrupt", "evidence", "detected", "decided", "false_positive"})


def _rebase(events: list[Event], notes: list[str], index: int) -> list[Event]:
    """One part's events of one run in the order they were written, with a wall clock stepped back
    between two step marks undone: later steps cannot start before earlier ones, so each event after
    the step moves on by the step (the time across it taken as none)."""
    offset, last, out = 0.0, None, []
    for e in events:
        t = e.time + offset
        if e.kind == "step":
            if last is not None and e.data["step"] > last[1] and t < last[0]:
                notes.append(f"run {index}: the clock stepped back {last[0] - t:.3g} s between steps {last[1]} and "
                             f"{e.data['step']}; the later events moved on by that much")
                offset += last[0] - t
                t = last[0]
            last = (t, e.data["step"])
        out.append(e if t == e.time else Event(t, e.kind, e.data, e.line, e.part, e.run, e.key))
    return out


PLACED_BY_TIME = frozenset({"interrupt", "evidence", "detected", "decided", "false_positive", "straggler"})
"""The ledger's and the controller's records: placed in a run by their time, whatever file holds them."""


def _written_order(events: list[Event], part: str, problems: list[str]) -> list[Event]:
    """One part's events in the order they were written. A file is appended to, so that is its line
    order, unless a run's step counts go back in it: then its lines were reordered since (sorted,
    reversed), and time is the order left."""
    events.sort(key=lambda e: e.line)
    last, run = -math.inf, None
    for e in events:
        if e.kind == "job_start" or e.run != run:
            last, run = -math.inf, e.run
        elif e.kind == "step":
            if e.data["step"] < last:
                problems.append(f"{part + ': ' if part else ''}lines out of the order they were written (step counts go "
                                "back); runs told apart by time")
                return sorted(events, key=_order)
            last = e.data["step"]
    return events


def _run_order(starts: Mapping[tuple, Event]) -> list[tuple]:
    """The runs in order: by their `run` keys; else each file's runs in the order it has them, the
    files' interleaved by the runs' start times (rank 0 moved to another node after a requeue)."""
    sequences: dict[str, list[tuple]] = {}
    for key in sorted(starts, key=lambda k: (k[1] if k[0] == "run" else k[2])):
        sequences.setdefault("\0named" if key[0] == "run" else key[1], []).append(key)
    if len(sequences) == 1:
        return next(iter(sequences.values()))
    heads = [(starts[seq[0]].time, name, 0) for name, seq in sequences.items()]
    heapq.heapify(heads)
    order = []
    while heads:
        _, name, i = heapq.heappop(heads)
        order.append(sequences[name][i])
        if i + 1 < len(sequences[name]):
            heapq.heappush(heads, (starts[sequences[name][i + 1]].time, name, i + 1))
    return order


def _runs(log: Log, now: float | None) -> tuple[list[Run], list[str], list[str]]:
    problems: list[str] = []
    notes: list[str] = []
    groups: dict[tuple, list[Event]] = {}
    starts: dict[tuple, Event] = {}
    loose: list[Event] = []
    by_part: dict[str, list[Event]] = {}
    for e in log.events:
        if e.run is None and (e.kind in PLACED_BY_TIME or not e.line):
            loose.append(e)
        elif e.kind in PLACED_BY_TIME or not e.line:
            groups.setdefault(("run", e.run), []).append(e)
        else:
            by_part.setdefault(e.part, []).append(e)
    for part, events in by_part.items():
        current: tuple | None = None
        n = 0
        for e in _written_order(events, part, problems):
            if e.kind == "job_start":
                key = ("run", e.run) if e.run is not None else ("part", part, n)
                n += 1
                current = key
                if key not in starts or e.time < starts[key].time:
                    starts[key] = e
                groups.setdefault(key, [])
                continue
            key = ("run", e.run) if e.run is not None else current
            (groups.setdefault(key, []) if key is not None else loose).append(e)
    orphans = {k: groups.pop(k) for k in [k for k in groups if k not in starts]}
    if not starts:
        return [], ["no job_start_time entry: no run to account"], notes
    order = _run_order(starts)
    for (_, number), events in orphans.items():
        # lines that name their run where the node's lines do not: the run-th run in order
        if isinstance(number, int) and number < len(order):
            groups[order[number]] += events
        else:
            problems.append(f"{len(events)} event(s) of run {number}, which has no job_start_time; placed by their time")
            loose += events
    runs: list[Run] = []
    for n, key in enumerate(order):
        start = starts[key]
        parts: dict[str, list[Event]] = {}
        for e in groups[key]:
            parts.setdefault(e.part, []).append(e)
        evs: list[Event] = []
        for pevs in parts.values():
            evs += _rebase(pevs, notes, n)
        evs.sort(key=_order)
        end, state = None, "UNKNOWN"
        ending = [e for e in evs if e.kind == "run_end"] or [e for e in evs if e.kind == "job_end"]
        if ending:
            end = ending[0].time
            state = str(ending[0].data.get("state") or "UNKNOWN")[:32] if ending[0].kind == "run_end" else "COMPLETED"
            if end < start.time:
                problems.append(f"run {n}: ends {start.time - end:.3g} s before it starts (a clock step?); taken as 0 s long")
                end = start.time
        elif n + 1 == len(order):
            state = "RUNNING"
            if now is not None:
                end = max(now, start.time)
            else:
                end = max([start.time, *(e.time for e in evs)])
                notes.append(f"run {n} has no end yet (still running, or its end was never written): counted to its "
                             "last event")
        else:
            end = max([start.time, *(e.time for e in evs)])
            problems.append(f"run {n}: no end recorded; taken as its last event")
        recorded = None
        for e in evs:
            if e.kind == "allocation":
                g = e.data.get("gpus")
                if isinstance(g, int) and not isinstance(g, bool) and 0 < g <= 1 << 20:
                    recorded = g
                else:
                    problems.append(f"line {e.line}: allocation without a valid gpus count")
                break
        # a job_end_time a run_end supersedes says nothing more wherever it falls
        evs = [e for e in evs if not (e.kind == "job_end" and ending and ending[0].kind == "run_end")]
        inside = tuple(e for e in evs if start.time <= e.time <= end or e.kind in PLACED_BY_TIME)
        if len(inside) < len(evs):
            problems.append(f"run {n}: {len(evs) - len(inside)} event(s) outside the run's time; ignored")
        runs.append(Run(n, start.time, end, recorded or 0, state, inside, key[1] if key[0] == "run" else None,
                        recorded))
    _gpus(runs, problems)
    _place(runs, loose, problems)
    for a, b in pairwise(runs):
        if b.start < a.end:
            notes.append(f"run {b.index} starts {a.end - b.start:.3g} s before run {a.index} ends on the log's clocks "
                         "(the nodes' clocks disagree, or one stepped back): no queued time between them")
    return runs, problems, notes


def _gpus(runs: list[Run], problems: list[str]) -> None:
    """A run without an allocation record holds what the run before it held (a requeued job asks for
    the same again); the first, what the first run with a record held; else 1 GPU. Each is a problem."""
    known = [r.gpus_recorded for r in runs if r.gpus_recorded]
    prev = known[0] if known else None
    for i, r in enumerate(runs):
        if r.gpus_recorded:
            prev = r.gpus_recorded
            continue
        g = prev or 1
        whose = ("the first allocation record's" if i == 0 else f"run {i - 1}'s") if prev else "no allocation anywhere:"
        problems.append(f"run {i}: no allocation record; counted as {whose} {g} GPU(s)")
        runs[i] = Run(r.index, r.start, r.end, g, r.state, r.events, r.named, None)


def _place(runs: list[Run], loose: list[Event], problems: list[str]) -> None:
    """Events placed by their time: the ledger's and the controller's records, and a node's lines before
    the first job_start_time of their file. An incident's go in the earliest run the time falls in (an
    action ends the run it acted on, which may end in the second the next starts), the rest in the
    latest; outside every run, the ledger's and the controller's in the nearest, a node's nowhere."""
    extra: dict[int, list[Event]] = {}
    outside = 0
    for e in loose:
        inside = [r for r in runs if r.start <= e.time <= r.end]
        if inside:
            r = inside[0] if e.kind in _INCIDENT_KINDS else inside[-1]
        elif e.kind in PLACED_BY_TIME:
            r = min(runs, key=lambda r: (min(abs(e.time - r.start), abs(e.time - r.end)), -r.index))
        else:
            outside += 1
            continue
        extra.setdefault(r.index, []).append(e)
    if outside:
        problems.append(f"{outside} event(s) before the first job_start_time of their file and outside every run; ignored")
    for i, evs in extra.items():
        r = runs[i]
        runs[i] = Run(r.index, r.start, r.end, r.gpus, r.state, tuple(sorted((*r.events, *evs), key=_order)), r.named,
                      r.gpus_recorded)


def runs_of(log: Log, now: float | None = None) -> tuple[tuple[Run, ...], tuple[str, ...]]:
    """The job's runs in order, each with its events, and the problems met. A run is what its lines name
    (`run`), else what follows its job_start_time line in the file that has it; it ends at its run_end
    record, else the job's end (job_end_time), else, for the last run, `now` (or, without `now`, its last
    event: still running), else (with a problem noted) its last event."""
    runs, problems, _ = _runs(log, now)
    return tuple(runs), tuple(problems)


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class Incident:
    """One interruption and what it cost the job, by category (GPU-seconds)."""

    incident: str
    cause: str
    node: str | None
    gpu: str | None
    false_positive: bool
    gpu_s: Mapping[str, float]

    @property
    def cost_gpu_s(self) -> float:
        """The interruption cost: all of its lost work, detection, decision, waiting and restart."""
        return sum(self.gpu_s.values())


@dataclass(frozen=True)
class Account:
    job: str | None
    held_gpu_s: float
    """The GPU time the job's runs were allocated: each run's length times its GPUs."""
    gpu_s: Mapping[str, float]
    """category -> GPU-seconds; every category present; they sum to held_gpu_s."""
    incidents: tuple[Incident, ...]
    """Ranked by interruption cost, largest first."""
    runs: int
    interruptions: int
    running_s: float
    """Wall seconds the job's runs ran."""
    problems: tuple[str, ...] = ()
    """Empty for a complete answer; otherwise what was assumed (a partial answer)."""
    timeline: tuple[tuple[float, float, str], ...] = ()
    """(start, end, category), run after run and in time order inside each, neighbours of one
    category merged: where each category's time fell (the report draws it)."""
    queued_s: float = 0.0
    """Wall seconds between runs: the job waited in the queue, holding nothing (not in held_gpu_s)."""
    at_risk_gpu_s: float = 0.0
    """Of the productive time of a run still going, what came after its last durable checkpoint: lost
    if the run failed now."""
    notes: tuple[str, ...] = ()
    """What was read and set aside or corrected without making the answer partial."""
    saves: tuple[tuple[int, float, float], ...] = ()
    """(run, start, end) of the blocking part of each save that ended, run after run."""

    @property
    def partial(self) -> bool:
        return bool(self.problems)

    @property
    def goodput(self) -> float | None:
        return self.gpu_s["productive"] / self.held_gpu_s if self.held_gpu_s > 0 else None

    @property
    def mtbi_s(self) -> float | None:
        """Running time per interruption (None without one)."""
        return self.running_s / self.interruptions if self.interruptions else None


@dataclass
class _Piece:
    start: float
    end: float
    category: str
    gpus: int
    incident: str | None = None


def _label(pieces: list[_Piece], start: float, end: float, category: str, gpus: int,
           incident: str | None = None) -> None:
    if end > start:
        pieces.append(_Piece(start, end, category, gpus, incident))


_OVERLAID = frozenset({"productive", "lost", "restart", "other"})
"""What a save or another blocking event may relabel: time in the job's own hands. Detection, decision
and waiting stay where an incident put them."""


def _overlay(base: list[_Piece], cover: list[tuple[float, float]], category: str) -> list[_Piece]:
    """`base` with every part of a relabelable piece inside one of `cover`'s intervals relabelled
    `category`."""
    merged: list[list[float]] = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    if not merged:
        return base
    starts = [a for a, _ in merged]
    out: list[_Piece] = []
    for p in base:
        # the intervals are disjoint and in order: those that can touch p start before its end
        k = max(bisect.bisect_left(starts, p.end) - 1, 0)
        first = k
        while first > 0 and merged[first - 1][1] > p.start:
            first -= 1
        cuts = [(max(a, p.start), min(b, p.end)) for a, b in merged[first:k + 1] if a < p.end and b > p.start]
        if not cuts or p.category not in _OVERLAID:
            out.append(p)
            continue
        at = p.start
        for a, b in cuts:
            if a > at:
                out.append(_Piece(at, a, p.category, p.gpus, p.incident))
            if b > max(a, at):
                out.append(_Piece(max(a, at), b, category, p.gpus, None))
            at = max(at, b)
        if p.end > at:
            out.append(_Piece(at, p.end, p.category, p.gpus, p.incident))
    return out


def _blocks(run: Run, start: str, end: str, until: float, problems: list[str]) -> list[tuple[float, float, bool]]:
    """The intervals of one kind of blocking event (a save, or a custom event of one name), paired start
    to end (True: it ended); one the run stopped inside ends at `until`, where its evidence ends."""
    out: list[tuple[float, float, bool]] = []
    open_at: dict[str, float] = {}
    for e in run.events:
        name = str(e.data.get("type", ""))
        if e.kind == start:
            if name in open_at:
                problems.append(f"line {e.line}: {name or 'checkpoint_save'} started again before it ended; the first start kept")
                continue
            open_at[name] = e.time
        elif e.kind == end:
            if name not in open_at:
                problems.append(f"line {e.line}: {name or 'checkpoint_save'} end without a start; ignored")
                continue
            out.append((open_at.pop(name), e.time, True))
    out += [(a, until, False) for a in open_at.values() if until > a]
    return out


def _steps(run: Run, saved: float, problems: list[str]) -> tuple[list[_Piece], float | None, float | None]:
    """The pieces between step marks, productive up to step `saved` and lost after it; and the times
    of the first and the last mark (None without marks)."""
    marks = [(e.time, e.data["step"]) for e in run.events if e.kind == "step"]
    pieces: list[_Piece] = []
    for (t0, a), (t1, b) in pairwise(marks):
        n = b - a
        if n <= 0:
            problems.append(f"run {run.index}: step {b} after step {a}; the time between counted as other")
            _label(pieces, t0, t1, "other", run.gpus)
            continue
        good = min(max(saved - a + 1, 0.0), n) / n  # steps a .. b-1; those <= saved survived
        cut = t0 + (t1 - t0) * good
        _label(pieces, t0, cut, "productive", run.gpus)
        _label(pieces, cut, t1, "lost", run.gpus)
    return pieces, (marks[0][0] if marks else None), (marks[-1][0] if marks else None)


def _int_step(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def account(log: Log, now: float | None = None) -> Account:
    """Every GPU-second of the job in one category. See the module's documentation for the log."""
    runs, run_problems, notes = _runs(log, now)
    problems = [*log.problems, *run_problems]
    notes = [*log.notes, *notes]
    if not runs:
        return Account(log.job, 0.0, {c: 0.0 for c in CATEGORIES}, (), 0, 0, 0.0, tuple(problems), notes=tuple(notes))
    false_positive = {str(e.data.get("incident")) for r in runs for e in r.events if e.kind == "false_positive"}
    incident_times: dict[str, dict[str, float]] = {}
    for r in runs:
        for e in r.events:
            if e.kind in ("evidence", "detected", "decided"):
                incident_times.setdefault(str(e.data.get("incident")), {}).setdefault(e.kind, e.time)
    incidents: dict[str, dict[str, Any]] = {}
    pieces: list[list[_Piece]] = []
    interruptions = 0
    at_risk = 0.0
    saves: list[tuple[int, float, float]] = []
    for i, run in enumerate(runs):
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        restored = next((_int_step(e.data.get("step")) for e in nxt.events if e.kind == "restored"), None) if nxt else None
        durable = [s for e in run.events if e.kind == "durable" and (s := _int_step(e.data.get("step"))) is not None]
        if nxt is not None:
            # what survived is what the next run restored; without a restore it started over
            saved = float(restored) if restored is not None else -1.0
        elif run.state in ("COMPLETED", "RUNNING", "ENDED"):
            saved = math.inf  # alive at the end (ENDED: an epilog that could not tell how; nothing says it failed)
        else:
            saved = float(max(durable)) if durable else -1.0
        steps, first_mark, last_mark = _steps(run, saved, problems)
        run_pieces: list[_Piece] = []
        begin = first_mark if first_mark is not None else run.end
        own_restore = any(e.kind == "restored" for e in run.events)
        _label(run_pieces, run.start, begin, "restart" if i > 0 or own_restore else "other", run.gpus)
        run_pieces += steps
        interrupt = next((e for e in run.events if e.kind == "interrupt"), None)
        tail_start = last_mark if last_mark is not None else begin
        evidence = run.end
        if interrupt is not None or (nxt is not None and run.state != "COMPLETED"):
            interruptions += 1
            key = str(interrupt.data.get("incident")) if interrupt is not None else f"run-{i}"
            info = incidents.setdefault(key, {
                "cause": str((interrupt.data.get("cause") if interrupt else None) or run.state)[:120],
                "node": interrupt.data.get("node") if interrupt else None,
                "gpu": interrupt.data.get("gpu") if interrupt else None})
            times = incident_times.get(key, {})
            evidence = min(max(times.get("evidence", interrupt.time if interrupt else run.end), tail_start), run.end)
            detected = min(max(times.get("detected", evidence), evidence), run.end)
            decided = min(max(times.get("decided", detected), detected), run.end)
            _label(run_pieces, tail_start, evidence, "lost", run.gpus, key)
            _label(run_pieces, evidence, detected, "detection", run.gpus, key)
            _label(run_pieces, detected, decided, "decision", run.gpus, key)
            _label(run_pieces, decided, run.end, "waiting", run.gpus, key)
            for p in run_pieces:
                if p.category == "lost":
                    p.incident = key
            info["run"] = i
        else:
            # after the last mark of a run that went on to its end, the steps since that mark ran (a
            # mark per window leaves up to a window of them there)
            done = last_mark is not None and saved == math.inf
            _label(run_pieces, tail_start, run.end, "productive" if done else "other", run.gpus)
        if i > 0:
            prior = next((k for k, v in incidents.items() if v.get("run") == i - 1), None)
            for p in run_pieces:
                if p.category == "restart" and prior is not None:
                    p.incident = prior
        custom = _blocks(run, "custom_start", "custom_end", evidence, problems)
        run_saves = _blocks(run, "checkpoint_start", "checkpoint_end", evidence, problems)
        saves += [(i, a, b) for a, b, ended in run_saves if ended]
        run_pieces = _overlay(run_pieces, [(a, b) for a, b, _ in custom], "other")
        run_pieces = _overlay(run_pieces, [(a, b) for a, b, _ in run_saves], "checkpoint")
        run_pieces = _straggle(run_pieces, run, problems)
        if run.state == "RUNNING" and nxt is None and last_mark is not None:
            at_risk = _at_risk(run, run_pieces, run_saves, last_mark)
        pieces.append(run_pieces)
    totals = {c: 0.0 for c in CATEGORIES}
    per_incident: dict[str, dict[str, float]] = {k: {} for k in incidents}
    timeline: list[tuple[float, float, str]] = []
    for run_pieces in pieces:
        for p in sorted(run_pieces, key=lambda p: p.start):
            category = p.category
            if p.incident is not None and p.incident in false_positive and category in INCIDENT_CATEGORIES:
                category = "false_positive"
            if timeline and timeline[-1][2] == category and abs(timeline[-1][1] - p.start) < 1e-9:
                timeline[-1] = (timeline[-1][0], p.end, category)
            else:
                timeline.append((p.start, p.end, category))
            gpu_s = (p.end - p.start) * p.gpus
            totals[category] += gpu_s
            if p.incident is not None and p.incident in per_incident:
                bucket = per_incident[p.incident]
                bucket[category] = bucket.get(category, 0.0) + gpu_s
    held = sum((r.end - r.start) * r.gpus for r in runs)
    queued = sum(max(0.0, b.start - a.end) for a, b in pairwise(runs))
    ranked = sorted((Incident(k, v["cause"], v["node"], v["gpu"], k in false_positive, per_incident[k])
                     for k, v in incidents.items()), key=lambda x: (-x.cost_gpu_s, x.incident))
    return Account(log.job, held, totals, tuple(ranked), len(runs), interruptions,
                   sum(r.end - r.start for r in runs), tuple(problems), tuple(timeline), queued,
                   min(at_risk, totals["productive"]), tuple(notes), tuple(saves))


def _at_risk(run: Run, pieces: list[_Piece], saves: list[tuple[float, float, bool]], last_mark: float) -> float:
    """Of a run still going, the productive GPU-seconds after its last durable checkpoint: from where
    the marks put the first step past it, or, when no mark is past it, from the end of the save that
    wrote it (the steps before that save are in it)."""
    durable = [(e.time, s) for e in run.events if e.kind == "durable" and (s := _int_step(e.data.get("step"))) is not None]
    if not durable:
        since = run.start
    else:
        at, step = max(durable, key=lambda d: d[1])
        past = [p.start for p in _steps(run, float(step), [])[0] if p.category == "lost"]
        if past:
            since = past[0]
        else:
            ends = [b for a, b, _ in saves if a <= at]
            since = max(max(ends) if ends else at, last_mark) if ends else at
    return sum((p.end - max(p.start, since)) * p.gpus for p in pieces if p.category == "productive" and p.end > since)


def _straggle(pieces: list[_Piece], run: Run, problems: list[str]) -> list[_Piece]:
    """Move each flagged straggler's share of the run's productive time in its interval to `straggler`."""
    out = pieces
    for e in run.events:
        if e.kind != "straggler":
            continue
        end, share = number(e.data.get("end")), number(e.data.get("share"))
        if end is None or share is None or not 0 <= share or end < e.time:
            problems.append(f"line {e.line}: straggler record without a valid end and share; ignored")
            continue
        part = share / (1 + share)  # the job ran (1 + share) x as long: this part of it was the straggler
        moved: list[_Piece] = []
        for p in out:
            a, b = max(p.start, e.time), min(p.end, end)
            if p.category != "productive" or b <= a:
                moved.append(p)
                continue
            cut = b - (b - a) * part
            moved += [x for x in (_Piece(p.start, a, p.category, p.gpus, p.incident),
                                  _Piece(a, cut, "productive", p.gpus, p.incident),
                                  _Piece(cut, b, "straggler", p.gpus, p.incident),
                                  _Piece(b, p.end, p.category, p.gpus, p.incident)) if x.end > x.start]
        out = moved
    return out


# --------------------------------------------------------------------------- effective training time


ETTR_WINDOW_S = 3600.0
"""The default sliding window of the effective training time ratio."""
EFFECTIVE = frozenset({"productive", "straggler"})
"""The categories in which the job trained: ByteRobust's effective training time (a slow rank's cost
is time the job trained, slower)."""


@dataclass(frozen=True)
class Ettr:
    """The job's effective training time ratio as ByteRobust publishes it, from healthd's categories."""

    cumulative: float | None
    """(productive + straggler) over held GPU time."""
    window_s: float
    """The sliding window, in held wall time."""
    window_min: float | None
    """The lowest effective share of any window of `window_s` of the job's held wall time (the whole
    job when it held less)."""
    longest_unproductive_s: float
    """The longest stretch of held wall time in which the job did not train (queued time excluded)."""
    longest_unproductive_at: float | None
    """When that stretch began."""


def ettr(acc: Account, window_s: float = ETTR_WINDOW_S) -> Ettr:
    """Cumulative and sliding-window ETTR and the longest unproductive stretch, from the timeline."""
    cumulative = sum(acc.gpu_s[c] for c in EFFECTIVE) / acc.held_gpu_s if acc.held_gpu_s > 0 else None
    bounds, good = [0.0], [0.0]  # held wall time concatenated: boundaries and effective time up to each
    longest, longest_at, stretch, stretch_at = 0.0, None, 0.0, None
    for a, b, c in acc.timeline:
        d = b - a
        bounds.append(bounds[-1] + d)
        good.append(good[-1] + (d if c in EFFECTIVE else 0.0))
        if c in EFFECTIVE:
            stretch, stretch_at = 0.0, None
        else:
            stretch_at = a if stretch_at is None else stretch_at
            stretch += d
            if stretch > longest:
                longest, longest_at = stretch, stretch_at
    total = bounds[-1]
    if total <= 0:
        return Ettr(cumulative, window_s, None, longest, longest_at)

    def effective_to(x: float) -> float:
        k = min(max(bisect.bisect_right(bounds, x) - 1, 0), len(bounds) - 2)
        step = bounds[k + 1] - bounds[k]
        share = (good[k + 1] - good[k]) / step if step > 0 else 0.0
        return good[k] + share * (x - bounds[k])

    if total <= window_s:
        low = good[-1] / total
    else:
        # the effective time in a window is piecewise linear in its start: its least is where an edge meets a boundary
        starts = {min(max(x, 0.0), total - window_s) for b in bounds for x in (b, b - window_s)}
        low = min(effective_to(x + window_s) - effective_to(x) for x in starts) / window_s
    return Ettr(cumulative, window_s, min(max(low, 0.0), 1.0), longest, longest_at)


# --------------------------------------------------------------------------- checkpoint interval


def young_interval(c: float, m: float) -> float:
    """Young's checkpoint interval sqrt(2 C M), for a blocking checkpoint cost `c` and a mean time
    between interruptions `m` (same unit)."""
    return math.sqrt(2 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly's higher-order interval: sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M
    (J. T. Daly, FGCS 22 (2006) 303-312)."""
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def efficiency(tau: float, c: float, m: float, r: float = 0.0) -> float:
    """The share of wall time that is work, checkpointing every `tau` of work at cost `c` with
    exponential interruptions of mean `m` and a restart cost `r` (Daly's model:
    tau / (M e^(R/M) (e^((tau + C)/M) - 1)))."""
    if tau <= 0 or m <= 0:
        return 0.0
    return tau / (m * math.exp(r / m) * math.expm1((tau + c) / m))


@dataclass(frozen=True)
class IntervalAdvice:
    """The job's checkpoint interval against Young's and Daly's, from its own log."""

    checkpoint_s: float
    """The median blocking part of its saves (C)."""
    mtbi_s: float
    """Its running time per interruption (M)."""
    current_s: float | None
    """The median time between the starts of its saves (None with fewer than two)."""
    young_s: float
    daly_s: float
    efficiency_current: float | None
    efficiency_daly: float

    @property
    def gain(self) -> float | None:
        """Goodput the job would gain at Daly's interval (a share of wall time)."""
        return None if self.efficiency_current is None else self.efficiency_daly - self.efficiency_current


def interval_advice(acc: Account) -> IntervalAdvice | None:
    """None without a save or an interruption to go on. The job's current interval is measured between
    the saves of one run, never across an interruption."""
    if not acc.saves or acc.mtbi_s is None:
        return None
    c = statistics.median([b - a for _, a, b in acc.saves])
    gaps = [b[1] - a[1] for a, b in pairwise(acc.saves) if a[0] == b[0] and b[1] > a[1]]
    current = statistics.median(gaps) if gaps else None
    m = acc.mtbi_s
    daly = daly_interval(c, m)
    return IntervalAdvice(c, m, current, young_interval(c, m), daly,
                          efficiency(current - c, c, m) if current is not None and current > c else None,
                          efficiency(daly, c, m))
