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
    """job_start, job_end, step, checkpoint_start, checkpoint_end, or a healthd_event kind."""
    data: Mapping[str, Any] = field(default_factory=dict)
    line: int = 0


@dataclass(frozen=True)
class Log:
    job: str | None
    events: tuple[Event, ...]
    problems: tuple[str, ...] = ()


def number(v: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (booleans included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _event(doc: Mapping[str, Any], line: int) -> Event | str:
    """One entry as an Event, or the reason it is not one."""
    if ev.EVENT in doc:
        kind, t = doc.get(ev.EVENT), number(doc.get(ev.TIME))
        if kind not in HEALTHD_KINDS:
            return f"unknown {ev.EVENT} {str(kind)[:40]!r}"
        if t is None:
            return f"{ev.EVENT} {kind} without a time"
        return Event(t, kind, {k: v for k, v in doc.items() if k not in (ev.EVENT, ev.TIME, ev.JOB_NAME)}, line)
    if ev.STEP_COUNT in doc:
        n, t = doc.get(ev.STEP_COUNT), number(doc.get(ev.STEP_START_TIME))
        if not isinstance(n, int) or isinstance(n, bool) or t is None:
            return f"step entry without an integer {ev.STEP_COUNT} and a {ev.STEP_START_TIME}"
        return Event(t, "step", {"step": n}, line)
    if ev.CUSTOM_EVENT_TYPE in doc:
        what = doc.get(ev.CUSTOM_EVENT_TYPE)
        start, end = number(doc.get(ev.CUSTOM_EVENT_START_TIME)), number(doc.get(ev.CUSTOM_EVENT_END_TIME))
        if what != ev.CHECKPOINT_SAVE:
            return ""  # another custom event: not one healthd accounts for (it stays in `other`)
        if (start is None) == (end is None):
            return f"{ev.CHECKPOINT_SAVE} entry without exactly one of a start and an end time"
        return Event(start if start is not None else end, "checkpoint_start" if start is not None else "checkpoint_end",
                     {}, line)  # type: ignore[arg-type]
    for key, kind in ((ev.JOB_START_TIME, "job_start"), (ev.JOB_END_TIME, "job_end")):
        if key in doc:
            t = number(doc.get(key))
            return Event(t, kind, {}, line) if t is not None else f"{key} is not a number"
    return ""  # an entry of another kind (tpu_init, data_loading): not accounted


_TIE = {"job_start": -2, "allocation": -1, "run_end": 2, "job_end": 2}
"""Order among events of the same time once the file's own order is not trusted: a run's start and
allocation first, its end last."""


def parse_log(text: str, job: str | None = None) -> Log:
    """The events of one job's JSONL log (`job`: only entries of that job_name). A line that repeats
    an earlier one exactly is dropped (no entry can legitimately repeat: each has its own time).
    Events are put in time order (a problem says so when the file was not)."""
    events: list[Event] = []
    problems: list[str] = []
    names: set[str] = set()
    seen: set[int] = set()
    lines = text.split("\n")
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        key = hash(raw)
        if key in seen:
            continue  # an exact repeat: a writer that crashed between its append and its cursor
        seen.add(key)
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
        if isinstance(name, str):
            names.add(name)
        got = _event(doc, i)
        if isinstance(got, str):
            if got:
                problems.append(f"line {i}: {got}; skipped")
            continue
        events.append(got)
        if len(events) >= MAX_EVENTS:
            problems.append(f"more than {MAX_EVENTS} events; the rest not read")
            break
    if any(b.time < a.time for a, b in pairwise(events)):
        problems.append("events out of time order; taken in time order")
        events.sort(key=lambda e: (e.time, _TIE.get(e.kind, 1), e.line))
    if job is None and len(names) > 1:
        problems.append(f"entries of {len(names)} jobs ({', '.join(sorted(names)[:4])}); read together")
    return Log(job if job is not None else (next(iter(names)) if len(names) == 1 else None), tuple(events),
               tuple(problems))


def with_entries(log: Log, entries: Iterable[Mapping[str, Any]]) -> Log:
    """`log` with more entries from another source (the ledger's incident times), in time order:
    two sources interleave, which says nothing wrong about either."""
    extra = [e for e in (_event(doc, 0) for doc in entries) if isinstance(e, Event)]
    if not extra:
        return log
    events = sorted((*log.events, *extra), key=lambda e: (e.time, _TIE.get(e.kind, 1), e.line))
    return Log(log.job, tuple(events), log.problems)


def merge(logs: Iterable[tuple[str, Log]]) -> Log:
    """One job's log from its parts (named: the node each came from), in time order; each part's
    problems keep its name. Parts of several jobs are noted as a problem, like one file's."""
    named = list(logs)
    events = sorted((e for _, log in named for e in log.events), key=lambda e: (e.time, _TIE.get(e.kind, 1), e.line))
    problems = tuple(f"{name}: {p}" for name, log in named for p in log.problems)
    jobs = {log.job for _, log in named if log.job is not None}
    if len(jobs) > 1:
        problems += (f"parts of {len(jobs)} jobs ({', '.join(sorted(jobs)[:4])}); read together",)
    return Log(next(iter(jobs)) if len(jobs) == 1 else None, tuple(events), problems)


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


def with_runs(log: Log, runs: Iterable[SlurmRun]) -> Log:
    """`log` with its runs as Slurm's accounting has them (sacct, each requeue a run): each run's start,
    end, end state and GPUs replace the log's own (rank 0's process start, the epilog's end), so the
    time from the allocation to the job's first process counts too. Where accounting does not track
    GPUs, a run holds what the log's allocation record within it says."""
    started = sorted((r for r in runs if r.start is not None), key=lambda r: r.start)
    if not started:
        return Log(log.job, log.events, (*log.problems, "Slurm's accounting has no run that started; the log's runs used"))
    allocations = [(e.time, e.data.get("gpus")) for e in log.events if e.kind == "allocation"]
    kept = [e for e in log.events if e.kind not in SKELETON_KINDS]
    extra: list[Event] = []
    gpus: Any = None
    for r in started:
        end = math.inf if r.end is None else r.end
        inside = [g for t, g in allocations if r.start - 60 <= t <= end]
        gpus = r.gpus or (inside[0] if inside else gpus)
        extra.append(Event(r.start, "job_start", {"from": "accounting"}))
        if gpus:
            extra.append(Event(r.start, "allocation", {"gpus": gpus, "from": "accounting"}))
        if r.end is not None:
            extra.append(Event(r.end, "run_end", {"state": r.state, "from": "accounting"}))
    events = sorted((*kept, *extra), key=lambda e: (e.time, _TIE.get(e.kind, 1), e.line))
    return Log(log.job, tuple(events), log.problems)


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    index: int
    start: float
    end: float
    gpus: int
    state: str
    """How it ended: Slurm's state from a run_end record, COMPLETED for a job_end, RUNNING for a run
    still going, or UNKNOWN."""
    events: tuple[Event, ...]


def runs_of(log: Log, now: float | None = None) -> tuple[tuple[Run, ...], tuple[str, ...]]:
    """The job's runs, each with the events inside it. A run starts at a job_start_time entry and ends
    at its run_end record, the job's end, or (with a problem noted) its last event; `now` ends a run
    still going."""
    problems: list[str] = []
    starts = [i for i, e in enumerate(log.events) if e.kind == "job_start"]
    if not starts:
        return (), ("no job_start_time entry: no run to account",)
    if starts[0] > 0:
        problems.append(f"{starts[0]} event(s) before the first job_start_time; ignored")
    runs: list[Run] = []
    gpus = 0
    for n, first in enumerate(starts):
        last = starts[n + 1] if n + 1 < len(starts) else len(log.events)
        evs = log.events[first + 1:last]
        start = log.events[first].time
        end, state = None, "UNKNOWN"
        for e in evs:
            if e.kind == "run_end":
                end, state = e.time, str(e.data.get("state") or "UNKNOWN")[:32]
                break
            if e.kind == "job_end":
                end, state = e.time, "COMPLETED"
                break
        if end is None:
            if n + 1 == len(starts) and now is not None:
                end, state = max(now, start), "RUNNING"
            else:
                end = evs[-1].time if evs else start
                problems.append(f"run {n}: no end recorded; taken as its last event")
        for e in evs:
            if e.kind == "allocation":
                g = e.data.get("gpus")
                if isinstance(g, int) and not isinstance(g, bool) and 0 < g <= 1 << 20:
                    gpus = g
                else:
                    problems.append(f"line {e.line}: allocation without a valid gpus count")
                break
        if gpus == 0:
            problems.append(f"run {n}: no allocation record; counted as 1 GPU")
        inside = tuple(e for e in evs if start <= e.time <= end)
        if len(inside) < len(evs):
            problems.append(f"run {n}: {len(evs) - len(inside)} event(s) outside the run's time; ignored")
        runs.append(Run(n, start, end, gpus or 1, state, inside))
    for a, b in pairwise(runs):
        if b.start < a.end:
            problems.append(f"run {b.index} starts before run {a.index} ends (a clock step?); the overlap is run {b.index}'s")
    return tuple(runs), tuple(problems)


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class Incident:
    """What an interruption cost, by category (GPU-seconds)."""

    incident: str
    cause: str
    node: str | None
    gpu: str | None
    false_positive: bool
    gpu_s: Mapping[str, float]

    @property
    def total_gpu_s(self) -> float:
        return sum(self.gpu_s.values())


@dataclass(frozen=True)
class Account:
    job: str | None
    held_gpu_s: float
    gpu_s: Mapping[str, float]
    """category -> GPU-seconds; every category present; they sum to held_gpu_s."""
    incidents: tuple[Incident, ...]
    """Ranked by GPU-seconds lost, largest first."""
    runs: int
    interruptions: int
    running_s: float
    """Wall seconds the job's runs ran."""
    problems: tuple[str, ...] = ()
    """Empty for a complete answer; otherwise what was assumed (a partial answer)."""
    timeline: tuple[tuple[float, float, str], ...] = ()
    """(start, end, category) in time order, neighbours of one category merged: where each
    category's time fell (the report draws it)."""

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


def _overlay(base: list[_Piece], cover: list[tuple[float, float]], category: str) -> list[_Piece]:
    """`base` with every part inside one of `cover`'s intervals relabelled `category`."""
    out: list[_Piece] = []
    for p in base:
        cuts = sorted((max(a, p.start), min(b, p.end)) for a, b in cover if a < p.end and b > p.start)
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


def _checkpoints(run: Run, problems: list[str]) -> list[tuple[float, float]]:
    out, open_at = [], None
    for e in run.events:
        if e.kind == "checkpoint_start":
            if open_at is not None:
                problems.append(f"line {e.line}: checkpoint_save started again before it ended; the first start kept")
                continue
            open_at = e.time
        elif e.kind == "checkpoint_end":
            if open_at is None:
                problems.append(f"line {e.line}: checkpoint_save end without a start; ignored")
                continue
            out.append((open_at, e.time))
            open_at = None
    if open_at is not None:
        out.append((open_at, run.end))  # a save the run ended inside: blocking until then
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


def account(log: Log, now: float | None = None) -> Account:
    """Every GPU-second of the job in one category. See the module's documentation for the log."""
    problems = list(log.problems)
    runs, run_problems = runs_of(log, now)
    problems += run_problems
    if not runs:
        return Account(log.job, 0.0, {c: 0.0 for c in CATEGORIES}, (), 0, 0, 0.0, tuple(problems))
    false_positive = {str(e.data.get("incident")) for e in log.events if e.kind == "false_positive"}
    incidents: dict[str, dict[str, Any]] = {}
    pieces: list[_Piece] = []
    interruptions = 0
    for i, run in enumerate(runs):
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        restored = next((e.data.get("step") for e in nxt.events if e.kind == "restored"), None) if nxt else None
        durable = [e.data.get("step") for e in run.events if e.kind == "durable" and isinstance(e.data.get("step"), int)]
        if nxt is not None:
            # what survived is what the next run restored; without a restore it started over
            saved = float(restored) if isinstance(restored, int) and not isinstance(restored, bool) else -1.0
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
        if interrupt is not None or (nxt is not None and run.state != "COMPLETED"):
            interruptions += 1
            key = str(interrupt.data.get("incident")) if interrupt is not None else f"run-{i}"
            info = incidents.setdefault(key, {
                "cause": str((interrupt.data.get("cause") if interrupt else None) or run.state)[:120],
                "node": interrupt.data.get("node") if interrupt else None,
                "gpu": interrupt.data.get("gpu") if interrupt else None})
            times = {e.kind: e.time for e in log.events
                     if e.kind in ("evidence", "detected", "decided") and str(e.data.get("incident")) == key}
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
            if nxt is not None:
                _label(run_pieces, run.end, nxt.start, "waiting", nxt.gpus, key)
            info["run"] = i
        else:
            # after the last mark of a run that went on to its end, the steps since that mark ran (a
            # mark per window leaves up to a window of them there)
            done = last_mark is not None and saved == math.inf
            _label(run_pieces, tail_start, run.end, "productive" if done else "other", run.gpus)
            if nxt is not None:
                _label(run_pieces, run.end, nxt.start, "waiting", nxt.gpus)
        if i > 0:
            prior = next((k for k, v in incidents.items() if v.get("run") == i - 1), None)
            for p in run_pieces:
                if p.category == "restart" and prior is not None:
                    p.incident = prior
        run_pieces = _overlay(run_pieces, _checkpoints(run, problems), "checkpoint")
        pieces += run_pieces
    pieces = _straggle(pieces, log, problems)
    totals = {c: 0.0 for c in CATEGORIES}
    per_incident: dict[str, dict[str, float]] = {k: {} for k in incidents}
    timeline: list[tuple[float, float, str]] = []
    for p in sorted(pieces, key=lambda p: p.start):
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
    held = sum((r.end - r.start) * r.gpus for r in runs) + sum(
        max(0.0, b.start - a.end) * b.gpus for a, b in pairwise(runs))
    ranked = sorted((Incident(k, v["cause"], v["node"], v["gpu"], k in false_positive, per_incident[k])
                     for k, v in incidents.items()), key=lambda x: (-x.total_gpu_s, x.incident))
    return Account(log.job, held, totals, tuple(ranked), len(runs), interruptions,
                   sum(r.end - r.start for r in runs), tuple(problems), tuple(timeline))


def _straggle(pieces: list[_Piece], log: Log, problems: list[str]) -> list[_Piece]:
    """Move each flagged straggler's share of the productive time in its interval to `straggler`."""
    out = pieces
    for e in log.events:
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


def interval_advice(log: Log, acc: Account) -> IntervalAdvice | None:
    """None without a save or an interruption to go on."""
    saves = []
    open_at = None
    for e in log.events:
        if e.kind == "checkpoint_start":
            open_at = e.time if open_at is None else open_at
        elif e.kind == "checkpoint_end" and open_at is not None:
            saves.append((open_at, e.time))
            open_at = None
    if not saves or acc.mtbi_s is None:
        return None
    c = statistics.median([b - a for a, b in saves])
    starts = [a for a, _ in saves]
    gaps = [b - a for a, b in pairwise(starts) if b > a]
    current = statistics.median(gaps) if gaps else None
    m = acc.mtbi_s
    daly = daly_interval(c, m)
    return IntervalAdvice(c, m, current, young_interval(c, m), daly,
                          efficiency(current - c, c, m) if current is not None and current > c else None,
                          efficiency(daly, c, m))
