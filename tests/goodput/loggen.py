"""An independent writer of goodput event logs for the property tests, written from docs/goodput.md's
table of entries alone (never healthd's writers or healthd.goodput_events' builders), together with
what it wrote: each run's start, end and GPUs, and the GPU-seconds a rule puts in a category where
the log alone fixes them (the blocking saves, detection, decision, restart, custom events, the work
at risk of a running job). The tests transform a job (shift its clock, split it into parts,
re-serialize its lines) and compare the accounts.

A job: 1-4 runs. Each run: a `job_start_time` and an `allocation`, a startup (a `restored` record
in a later run after a durable save), steps with a mark per step or per window (the first step of a
run and of each window), blocking saves (`checkpoint_save` start and end, then `durable` of the step
before it) at window boundaries, optionally evaluations or data loading between steps, a straggler
episode from the controller between two marks. Every run but the last is interrupted: a crash some
time into a step (or during a save that never ends, a node dying), optionally with the ledger's
incident (`interrupt`, `evidence`, `detected`, `decided`, sometimes `false_positive`), then its
`run_end` with a Slurm state; the next run starts after a gap that may be 0 (requeued within the
same second) and restores the last durable step. The last run completes (`run_end` COMPLETED, or
`job_end_time`, or both), fails, or still runs (accounted at `now`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from hypothesis import strategies as st

TIME_KEYS = ("job_start_time", "job_end_time", "step_start_time", "custom_badput_event_start_time",
             "custom_badput_event_end_time", "data_loading_start_time", "data_loading_end_time", "time", "end")
"""Every key of the format that holds a Unix time."""

UNORDERED = ("ledger", "controller")
"""Sources whose lines are not in a node's file order: they belong to a run by their time (or `run`)."""
UNORDERED_ROLES = ("interrupt", "evidence", "detected", "decided", "false_positive", "straggler")


@dataclass(frozen=True)
class Line:
    entry: dict[str, Any]
    """The entry without `job_name` and `run` (added when serialized)."""
    run: int
    source: str
    """node (rank 0's file, in file order), ledger or controller."""
    role: str
    """What the generator wrote it as: start, allocation, step, ckpt_start, ckpt_end, durable, restored,
    custom_start, custom_end, run_end, job_end, interrupt, evidence, detected, decided, false_positive,
    straggler, unknown."""


@dataclass(frozen=True)
class RunTruth:
    start: float
    end: float | None
    """None: still running (the job is accounted at `now`)."""
    gpus: int
    state: str
    """COMPLETED, RUNNING, or the Slurm state of an interrupted or failed run."""
    first_mark: float
    startup: float
    ledger: bool
    """The interruption that ended it has the ledger's incident."""
    false_positive: bool
    evidence: float | None
    decided: float | None
    after_durable: float
    """When the work after this run's last durable save started (its first mark without one)."""
    saves: tuple[float, ...]
    """Start times of its finished saves."""


@dataclass(frozen=True)
class Job:
    name: str
    lines: tuple[Line, ...]
    """In the order of one file holding everything: each run's node lines in time order, the ledger's
    and the controller's lines at their time inside their run."""
    runs: tuple[RunTruth, ...]
    now: float | None
    integer: bool
    window: int
    # what the rules fix, in GPU-seconds
    checkpoint_gpu_s: float
    detection_gpu_s: float
    decision_gpu_s: float
    custom_gpu_s: float
    custom_after_durable_gpu_s: float
    """Custom events of the last run after its last durable save (not work at risk)."""

    @property
    def held_gpu_s(self) -> float:
        return sum(((r.end if r.end is not None else self.now) - r.start) * r.gpus for r in self.runs)  # type: ignore[operator]

    @property
    def queued_s(self) -> float:
        return sum(b.start - a.end for a, b in pairwise(self.runs))  # type: ignore[operator]

    @property
    def running(self) -> bool:
        return self.runs[-1].end is None


# --------------------------------------------------------------------------- writing lines


def entry_times(entry: dict[str, Any], f) -> dict[str, Any]:
    """`entry` with `f` applied to each of its times."""
    return {k: (f(v) if k in TIME_KEYS else v) for k, v in entry.items()}


def serialize(job_name: str, line: Line, *, run_key: bool, rnd: random.Random | None = None) -> str:
    """One line of the log. With `rnd`: keys in a random order, spaces or not, integer times written
    as floats or not: the same entry as JSON, other bytes."""
    doc: dict[str, Any] = {"job_name": job_name, **line.entry}
    if run_key:
        doc["run"] = line.run
    if rnd is None:
        return json.dumps(doc, separators=(",", ":"))
    if rnd.random() < 0.5:
        doc = entry_times(doc, lambda v: float(v) if isinstance(v, int) else v)
    keys = list(doc)
    rnd.shuffle(keys)
    seps = rnd.choice([(",", ":"), (", ", ": "), (" ,", " : "), (",  ", ":\t")])
    return json.dumps({k: doc[k] for k in keys}, separators=seps)


def text(job: Job, lines: tuple[Line, ...] | list[Line] | None = None, *, run_keys: bool | str = False,
         rnd: random.Random | None = None) -> str:
    """The file of `lines` (the job's by default). run_keys: True (every line has `run`), False (none),
    "unordered" (only the ledger's and the controller's lines)."""
    out = []
    for line in job.lines if lines is None else lines:
        key = run_keys is True or (run_keys == "unordered" and line.source in UNORDERED)
        out.append(serialize(job.name, line, run_key=key, rnd=rnd))
    return "".join(s + "\n" for s in out)


# --------------------------------------------------------------------------- transforms


def shifted(job: Job, by: float, from_run: int = 0) -> Job:
    """The job with every time of runs >= `from_run` moved by `by` (a clock stepped between runs, or the
    whole job's clock when from_run is 0)."""
    def move(v):
        return v + by

    lines = tuple(replace(ln, entry=entry_times(ln.entry, move)) if ln.run >= from_run else ln for ln in job.lines)
    runs = tuple(
        replace(r, start=r.start + by, end=None if r.end is None else r.end + by, first_mark=r.first_mark + by,
                evidence=None if r.evidence is None else r.evidence + by,
                decided=None if r.decided is None else r.decided + by, after_durable=r.after_durable + by,
                saves=tuple(s + by for s in r.saves)) if i >= from_run else r
        for i, r in enumerate(job.runs))
    now = None if job.now is None else job.now + by  # `now` is on the last run's clock
    return replace(job, lines=lines, runs=runs, now=now)


def without(job: Job, *roles: str, run: int | None = None) -> Job:
    """The job without lines of `roles` (of one run, or all)."""
    return replace(job, lines=tuple(ln for ln in job.lines if not (ln.role in roles and (run is None or ln.run == run))))


# --------------------------------------------------------------------------- the strategy


STATES = ("FAILED", "NODE_FAIL", "REQUEUED", "PREEMPTED", "TIMEOUT")


@st.composite
def jobs(draw, *, runs: tuple[int, int] = (1, 4), last: str | None = None, regular: bool = False,
         gap: str = "any", ledger: bool | None = None, stragglers: bool = True, custom: bool = True,
         integer: bool | None = None) -> Job:
    """A job, as documented at the top. last: completed (run_end COMPLETED, job_end_time or both),
    run_end, job_end, both, failed or running. regular: every step takes the same time and every run
    saves after the same number of steps for the same time (the save interval is then one number).
    gap: "any", "zero" (every requeued run starts the second its predecessor ended)."""
    integer = draw(st.booleans()) if integer is None else integer

    def dur(lo: float, hi: float) -> float:
        if integer:
            return draw(st.integers(int(lo), int(hi)))
        return round(draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False)), 3)

    def half(x: float) -> float:
        return x // 2 if integer else x / 2

    n = draw(st.integers(*runs))
    window = draw(st.sampled_from([1, 1, 2, 3, 5]))
    if last in (None, "completed"):
        last = draw(st.sampled_from(["run_end", "job_end", "both"] + (["failed", "running"] if last is None else [])))
    step_s = dur(1, 30) if regular else None
    save_every = window * draw(st.integers(1, 3)) if regular else None
    save_s = dur(1, 30) if regular else None
    t: float = draw(st.integers(1_600_000_000, 1_800_000_000))
    lines: list[Line] = []
    truths: list[RunTruth] = []
    durable_step: int | None = None
    oracle = {"checkpoint": 0.0, "detection": 0.0, "decision": 0.0, "custom": 0.0, "custom_after": 0.0}
    now = None
    for r in range(n):
        if r > 0:
            t = t + (0 if gap == "zero" or draw(st.integers(0, 2)) == 0 else dur(1, 7200))
        start = t
        gpus = draw(st.integers(1, 64))
        node: list[Line] = [Line({"job_start_time": start}, r, "node", "start"),
                            Line({"healthd_event": "allocation", "time": start, "gpus": gpus,
                                  "nodes": [f"node{r}{k:02d}" for k in range(1 + (gpus - 1) // 8)]}, r, "node",
                                 "allocation")]
        unordered: list[Line] = []
        startup = dur(1, 600)
        if durable_step is not None:
            node.append(Line({"healthd_event": "restored", "time": start + half(startup), "step": durable_step}, r,
                             "node", "restored"))
        first = durable_step + 1 if durable_step is not None else 0
        t = start + startup
        first_mark = t
        after_durable = t
        marks: list[float] = []
        saves: list[float] = []
        nsteps = draw(st.integers(1, 25))
        every = save_every if regular else window * draw(st.integers(0, 3))
        custom_at = set(draw(st.lists(st.integers(0, nsteps - 1), max_size=2))) if custom else set()
        last_run = r == n - 1
        for i in range(nsteps):
            if i % window == 0:
                node.append(Line({"step_count": first + i, "step_start_time": t}, r, "node", "step"))
                marks.append(t)
            t += step_s if regular else dur(1, 60)
            if i in custom_at:
                length = dur(1, 100)
                if draw(st.booleans()):
                    kind = draw(st.sampled_from(["eval", "data_loading", "profiling"]))
                    node += [Line({"custom_badput_event_type": kind, "custom_badput_event_start_time": t}, r, "node",
                                  "custom_start"),
                             Line({"custom_badput_event_type": kind, "custom_badput_event_end_time": t + length}, r,
                                  "node", "custom_end")]
                else:
                    node += [Line({"data_loading_start_time": t}, r, "node", "custom_start"),
                             Line({"data_loading_end_time": t + length}, r, "node", "custom_end")]
                oracle["custom"] += length * gpus
                if last_run and t >= after_durable:
                    oracle["custom_after"] += length * gpus
                t += length
            if every and (i + 1) % every == 0:
                c = save_s if regular else dur(1, 30)
                node += [Line({"custom_badput_event_type": "checkpoint_save", "custom_badput_event_start_time": t},
                              r, "node", "ckpt_start"),
                         Line({"custom_badput_event_type": "checkpoint_save", "custom_badput_event_end_time": t + c},
                              r, "node", "ckpt_end"),
                         Line({"healthd_event": "durable", "time": t + c, "step": first + i}, r, "node", "durable")]
                saves.append(t)
                oracle["checkpoint"] += c * gpus
                durable_step = first + i
                t += c
                after_durable = t
                if last_run:
                    oracle["custom_after"] = 0.0  # what came before this save is safe
        if stragglers and len(marks) >= 2 and draw(st.booleans()):
            a = draw(st.integers(0, len(marks) - 2))
            b = draw(st.integers(a + 1, len(marks) - 1))
            share = round(draw(st.floats(0.01, 1.0)), 3)
            unordered.append(Line({"healthd_event": "straggler", "time": marks[a], "end": marks[b], "share": share,
                                   "rank": 3, "node": f"node{r}00", "gpu": "GPU-1652000003"}, r, "controller",
                                  "straggler"))
        has_ledger, fp, evidence, decided = False, False, None, None
        if not last_run or last == "failed":
            dying = draw(st.booleans())
            if dying:  # the node dies during a save that never ends
                node.append(Line({"custom_badput_event_type": "checkpoint_save", "custom_badput_event_start_time": t},
                                 r, "node", "ckpt_start"))
            into = dur(1 if dying else 0, 300)
            evidence = t + into
            has_ledger = draw(st.booleans()) if ledger is None else ledger
            if has_ledger:
                detection, decision = dur(0, 120), dur(0, 600)
                detected = evidence + detection
                decided = detected + decision
                end = decided + dur(1, 300)  # the requeue applied, then Slurm ends the run
                fp = draw(st.integers(0, 3)) == 0
                key = f"{7 + r}"
                unordered += [
                    Line({"healthd_event": "interrupt", "time": decided, "incident": key, "cause": "xid:79",
                          "node": f"node{r}00", "gpu": f"GPU-16520000{r}", "rank": 0}, r, "ledger", "interrupt"),
                    Line({"healthd_event": "evidence", "time": evidence, "incident": key}, r, "ledger", "evidence"),
                    Line({"healthd_event": "detected", "time": detected, "incident": key}, r, "ledger", "detected"),
                    Line({"healthd_event": "decided", "time": decided, "incident": key}, r, "ledger", "decided")]
                if fp:
                    unordered.append(Line({"healthd_event": "false_positive", "time": decided, "incident": key}, r,
                                          "ledger", "false_positive"))
                else:
                    oracle["detection"] += detection * gpus
                    oracle["decision"] += decision * gpus
            else:
                end = evidence + dur(1, 300)
            if dying:
                oracle["checkpoint"] += ((evidence if has_ledger else end) - t) * gpus
            state = draw(st.sampled_from(STATES if not last_run else ("FAILED", "NODE_FAIL")))
            node.append(Line({"healthd_event": "run_end", "time": end, "state": state}, r, "node", "run_end"))
        elif last == "running":
            end, state = None, "RUNNING"
            now = t + dur(0, 300)
        else:
            end, state = t + dur(0, 30), "COMPLETED"
            if last in ("run_end", "both"):
                node.append(Line({"healthd_event": "run_end", "time": end, "state": "COMPLETED"}, r, "node", "run_end"))
            if last in ("job_end", "both"):
                node.append(Line({"job_end_time": end}, r, "node", "job_end"))
        lines += _interleave(node, unordered)
        truths.append(RunTruth(start, end, gpus, state, first_mark, startup, has_ledger, fp, evidence, decided,
                               after_durable, tuple(saves)))
        if end is not None:
            t = end
    return Job(f"{draw(st.integers(1, 99999))}", tuple(lines), tuple(truths), now, integer, window,
               oracle["checkpoint"], oracle["detection"], oracle["decision"], oracle["custom"], oracle["custom_after"])


def time_of(line: Line) -> float:
    return next(v for k, v in line.entry.items() if k in TIME_KEYS)


def _interleave(node: list[Line], unordered: list[Line]) -> list[Line]:
    """The run's node lines in their order with the unordered ones placed after the node lines of their
    time or earlier (all of them fall inside the run, before its end)."""
    out = list(node)
    for line in sorted(unordered, key=time_of):
        at = max((i + 1 for i, x in enumerate(out) if x.role not in ("run_end", "job_end") and time_of(x) <= time_of(line)),
                 default=len(out))
        out.insert(at, line)
    return out
