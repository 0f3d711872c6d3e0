"""The differential check against Google's ml-goodput-measurement: on 144 generated jobs, its own
calculator (tests/goodput/mlgp_oracle.py, run offline in the separate venv `make test` builds) and
healthd read the same file, and their goodputs are at most 0.5 percentage points apart wherever the
library's model applies. Where it does not, the job is set aside only for the stated reason, and the
reason itself is asserted: what the library computes instead is predicted from the log and checked
(to 0.05 pp, or exactly), so a class cannot hide a disagreement. Every job's productive time is also
held to the generator's own account of it (0.5 pp), set-aside jobs included.

Both are compared over the same time: the library's goodput is its productive time over its job time,
the first `job_start_time` to the last `job_end_time`; healthd's productive time is taken over its
held time plus the time queued between runs (held counts allocated time only). The jobs hold 1 to
512 GPUs, the same in every run, since the library weighs no GPU count.

The logs are written here, line by line from the documented format (docs/goodput.md), never by
healthd's writers: a startup, lognormal step times, a blocking save every 50-200 steps with its
durable record, interruptions with the ledger's evidence, detection and decision, each next run
restoring the last durable step and logging the steps after it again, and a last run that completes;
half the jobs carry `run` keys. The classes, 12 jobs each:

compared (the library's model applies):
- clean: 1-4 runs; interruptions: 5-7 runs
- same_second: each requeued run starts in the second the previous one ended (at its very time, at
  the whole second before it, or on a node whose clock is 0.5-3 s behind)
- clock_back_within_wait: the node's clock steps back between runs by less than the queue wait
- duplicates: blocks of lines other than step marks written again right after themselves,
  re-serialized (key order, spacing, 8 as 8.0), and a healthd record shipped again at the end
- custom_events: evaluation and data-loading custom badput events between step marks, and
  ml-goodput-measurement's data_loading_start/end pair before each run's first step
- save_dies: every interrupted run dies during a save (a save's start with no end)

set aside, each for a reason asserted per job:
- clock_back_beyond_wait: the library's job time is the log's clock from first start to last end;
  a clock stepped back by more than the wait makes it shorter than the time the runs held. Asserted:
  its job time is exactly that clock span, and its productive time is within 0.5 pp of healthd's.
- window_marks: the library counts a step's time only between marks of consecutive steps; a mark per
  window gives it none, only the time from the last mark to the job's end. Asserted exactly.
- loading_in_steps: the library counts data_loading_start/end time between two step marks both as
  step time (productive) and as badput; healthd counts it once, in `other`. Asserted: its productive
  time exceeds healthd's by those pairs' time in surviving steps.
- repeated_marks: step marks written again right after themselves; the library reads a repeated mark
  as a restart from that step and forgets the marks before it, so a later run's restart can go
  unseen. Asserted: on the same log without the repeats it agrees with healthd's on the log with them.
- repeated_save: a save's start and end written again; the library subtracts the save twice from its
  step. Asserted: its productive time falls short of healthd's by what the second copy takes, and on
  the log without the repeat it agrees.

The clock-step classes carry no ledger lines (a log read on a compute node): the step is the node's
clock, and which ledger lines (the head node's clock) belong to which run is not what they check.
The per-job table goes to build/test-artifacts/goodput-crosscheck.txt."""

from __future__ import annotations

import json
import math
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from healthd.goodput import account, parse_log

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / "build" / "venv-mlgp" / "bin" / "python"
ORACLE = Path(__file__).with_name("mlgp_oracle.py")
ARTIFACT = ROOT / "build" / "test-artifacts" / "goodput-crosscheck.txt"
PER_CLASS = 12
TOLERANCE_PP = 0.5
REASON_PP = 0.05
"""How close what the library computes instead must come to its prediction (its first-step startup,
which it takes off each run and healthd does not, is a few thousandths of a point here)."""

COMPARED = ("clean", "interruptions", "same_second", "clock_back_within_wait", "duplicates", "custom_events",
            "save_dies")
SET_ASIDE = {
    "clock_back_beyond_wait": "its job time is the log's clock span, shorter than the runs held",
    "window_marks": "it counts no time between marks of steps that are not consecutive",
    "loading_in_steps": "it counts data_loading_* time between step marks as productive and as badput",
    "repeated_marks": "it reads a step mark written again as a restart from that step",
    "repeated_save": "it reads a save's start and end written again as a second save",
}


@dataclass
class Job:
    """One generated job: its log and what the generator knows of it."""

    name: str
    kind: str
    gpus: int
    entries: list[dict] = field(default_factory=list)
    """The lines, in the order written, before duplicates are added."""
    text: str = ""
    truth_productive_s: float = 0.0
    """The compute time of the steps whose work survived (the generator's own account)."""
    first_start: float = 0.0
    last_end: float = 0.0
    last_mark: float = 0.0
    """Clock times as the log has them: the first job_start_time, the last job_end_time, the last step mark."""
    loading_in_surviving_steps_s: float = 0.0
    """data_loading_start/end time between step marks of surviving steps."""
    second_save_copy_s: float = 0.0
    """What a repeated save pair takes off the library's step time: min(save, the step's compute)."""
    plain: str = ""
    """For a class of repeated lines: the same log without its repeats, as job `<name>.plain`."""


def _dumps(entry: dict, rnd: random.Random | None = None) -> str:
    if rnd is None:
        return json.dumps(entry, separators=(",", ":"))
    items = list(entry.items())
    rnd.shuffle(items)
    again = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) and rnd.random() < 0.5 else v
             for k, v in items}
    return json.dumps(again, separators=rnd.choice(((",", ":"), (", ", ": "), (" ,", " : "))))


def make_job(kind: str, seed: int) -> Job:
    rnd = random.Random(f"{kind}/{seed}")
    job = Job(f"{kind}-{seed}", kind, rnd.choice((1, 8, 64, 512)))
    step_s, every, save_s = rnd.uniform(0.5, 6.0), rnd.choice((50, 100, 200)), rnd.uniform(2.0, 40.0)
    total = rnd.randint(400, 1500)
    runs = rnd.randint(5, 7) if kind == "interruptions" else rnd.randint(1, 4) if kind == "clean" else rnd.randint(2, 4)
    run_keys = rnd.random() < 0.5
    ledger = not kind.startswith("clock_back")
    window = rnd.choice((20, 50)) if kind == "window_marks" else 1
    t = 1_700_000_000.0 + rnd.uniform(0, 1e7)  # the true time
    off = 0.0  # the node's clock minus the true time
    durable = -1
    computed: list[list[tuple[int, float]]] = []  # per run: (step, compute seconds)
    loads: list[tuple[int, int, float]] = []  # (run, step, seconds) of data loading between marks
    saves: list[tuple[int, int, float]] = []  # (run, step, min(save, step compute)), the repeated_save class's

    def clock(at: float) -> float:
        return round(at + off, 3)

    def node(run: int, **entry) -> dict:
        line = {"job_name": job.name, **entry} | ({"run": run} if run_keys else {})
        job.entries.append(line)
        return line

    def led(kind_: str, at: float, **kw) -> None:
        if ledger:
            job.entries.append({"job_name": job.name, "healthd_event": kind_, "time": round(at, 3), **kw})

    for r in range(runs):
        last = r == runs - 1
        node(r, job_start_time=clock(t))
        node(r, healthd_event="allocation", time=clock(t), gpus=job.gpus, nodes=[f"node{r:02d}"])
        if r and durable >= 0:
            node(r, healthd_event="restored", time=clock(t + rnd.uniform(1, 10)), step=durable)
        if kind == "custom_events":
            at = t + rnd.uniform(0.5, 5)
            node(r, data_loading_start_time=clock(at))
            node(r, data_loading_end_time=clock(at + rnd.uniform(1, 10)))
        t += rnd.uniform(20, 300)  # startup, or a restart's load
        first = durable + 1
        stop = total if last else min(total - 1, first + rnd.randint(every // 2, 3 * every))
        computed.append([])
        for s in range(first, stop + 1):
            if s == first or s % window == 0:
                node(r, step_count=s, step_start_time=clock(t))
            d = step_s * rnd.lognormvariate(0, 0.05)
            t += d
            computed[-1].append((s, d))
            inside = first < s < stop  # between two marks, and not the run's first step
            if kind == "custom_events" and inside and rnd.random() < 0.04:
                what, e = rnd.choice(("eval", "data_loading")), rnd.uniform(1, 30)
                node(r, custom_badput_event_type=what, custom_badput_event_start_time=clock(t))
                node(r, custom_badput_event_type=what, custom_badput_event_end_time=clock(t + e))
                t += e
            if kind == "loading_in_steps" and inside and rnd.random() < 0.05:
                e = rnd.uniform(0.5, 10)
                node(r, data_loading_start_time=clock(t))
                node(r, data_loading_end_time=clock(t + e))
                loads.append((r, s, e))
                t += e
            if s % every == every - 1 and s < stop - 2:
                node(r, custom_badput_event_type="checkpoint_save", custom_badput_event_start_time=clock(t))
                node(r, custom_badput_event_type="checkpoint_save", custom_badput_event_end_time=clock(t + save_s))
                saves.append((r, s, min(save_s, d)))
                t += save_s
                durable = s
                node(r, healthd_event="durable", time=clock(t), step=s)
        if last:
            node(r, job_end_time=clock(t))
            if rnd.random() < 0.5:
                node(r, healthd_event="run_end", time=clock(t), state="COMPLETED")
            break
        if kind == "save_dies":
            node(r, custom_badput_event_type="checkpoint_save", custom_badput_event_start_time=clock(t))
            evidence = t + rnd.uniform(0.2, 0.9) * save_s
        else:
            evidence = t + rnd.uniform(0.5, 5)
        inc = f"{seed}-{r}"
        detected = evidence + rnd.uniform(5, 120)
        decided = detected + rnd.uniform(10, 900)
        led("evidence", evidence, incident=inc)
        led("interrupt", evidence, incident=inc, cause="xid:79", node=f"node{r:02d}")
        led("detected", detected, incident=inc)
        led("decided", decided, incident=inc)
        t = decided + rnd.uniform(10, 30)
        node(r, healthd_event="run_end", time=clock(t), state="NODE_FAIL")
        wait = rnd.uniform(60, 1800)
        if kind == "same_second":
            how = rnd.choice(("at_end", "whole_second", "skewed_node"))
            if how == "whole_second":  # the next start is stamped at the whole second, before the end's fraction
                t = math.floor(clock(t)) - off
            elif how == "skewed_node":  # rank 0 now on a node whose clock is behind
                off -= rnd.uniform(0.5, 3.0)
                t += rnd.uniform(0, 0.5)
        elif kind == "clock_back_within_wait":
            off -= rnd.uniform(0.1, 0.9) * wait
            t += wait
        elif kind == "clock_back_beyond_wait":
            off -= wait + rnd.uniform(60, 1800)
            t += wait
        else:
            t += wait
    # the next run restored `durable` of the run before: its steps up to there survived
    restored = [min(s for s, _ in run) - 1 for run in computed[1:]] + [total]
    job.truth_productive_s = sum(d for run, keep in zip(computed, restored, strict=True) for s, d in run if s <= keep)
    job.loading_in_surviving_steps_s = sum(e for r, s, e in loads if s <= restored[r])
    marks = [e for e in job.entries if "step_start_time" in e]
    job.first_start = next(e["job_start_time"] for e in job.entries if "job_start_time" in e)
    job.last_end = next(e["job_end_time"] for e in reversed(job.entries) if "job_end_time" in e)
    job.last_mark = marks[-1]["step_start_time"]
    lines = [_dumps(e) for e in job.entries]
    if kind in ("duplicates", "repeated_marks"):
        lines = _repeat_blocks(job.entries, rnd, marks=kind == "repeated_marks")
    elif kind == "repeated_save":
        lines, job.second_save_copy_s = _repeat_saves(job.entries, saves, rnd)
    job.text = "".join(line + "\n" for line in lines)
    if kind.startswith("repeated"):
        job.plain = "".join(_dumps(e | {"job_name": f"{job.name}.plain"}) + "\n" for e in job.entries)
    return job


def _repeat_blocks(entries: list[dict], rnd: random.Random, marks: bool) -> list[str]:
    """1-4 blocks of 1-4 consecutive lines written again right after themselves, re-serialized (an
    agent that died between its two writes): step marks only (`marks`), or none, and then none holding
    both ends of a custom event, and one healthd record shipped again at the end."""
    def fits(e: dict) -> bool:
        return ("step_count" in e) == marks

    blocks: dict[int, int] = {}  # last line -> first line of a block written again
    for i in sorted(rnd.sample([i for i, e in enumerate(entries) if fits(e)], rnd.randint(1, 4))):
        if any(first <= i <= last for last, first in blocks.items()):
            continue
        last, n = i, rnd.randint(1, 4)
        while last - i + 1 < n and last + 1 < len(entries) and fits(entries[last + 1]) and not (
                "custom_badput_event_start_time" in entries[last] and "custom_badput_event_end_time" in entries[last + 1]):
            last += 1
        blocks[last] = i
    out: list[str] = []
    for i, e in enumerate(entries):
        out.append(_dumps(e))
        if i in blocks:
            out += [_dumps(x, rnd) for x in entries[blocks[i]:i + 1]]
    if not marks:
        out.append(_dumps(rnd.choice([e for e in entries if "healthd_event" in e]), rnd))
    return out


def _repeat_saves(entries: list[dict], saves: list[tuple[int, int, float]],
                  rnd: random.Random) -> tuple[list[str], float]:
    """One or two complete saves (start and end) written again right after themselves; what the second
    copy takes off the library's step time."""
    ends = [i for i, e in enumerate(entries) if e.get("custom_badput_event_type") == "checkpoint_save"
            and "custom_badput_event_end_time" in e]
    picked = set(rnd.sample(range(len(ends)), min(len(ends), rnd.randint(1, 2))))
    out: list[str] = []
    for i, e in enumerate(entries):
        out.append(_dumps(e))
        if i in {ends[k] for k in picked}:
            out += [_dumps(entries[i - 1], rnd), _dumps(e, rnd)]
    return out, sum(saves[k][2] for k in picked)


def jobs() -> list[Job]:
    return [make_job(kind, seed) for kind in (*COMPARED, *SET_ASIDE) for seed in range(PER_CLASS)]


@dataclass(frozen=True)
class Row:
    job: Job
    mlgp_pct: float | None
    healthd_pct: float
    healthd_goodput_pct: float
    truth_pct: float
    mlgp_productive_s: float
    healthd_productive_s: float
    span_s: float
    status: str

    @property
    def diff_pp(self) -> float | None:
        return None if self.mlgp_pct is None else self.healthd_pct - self.mlgp_pct


def _set_aside_holds(job: Job, theirs: dict, plain: dict | None, prod_s: float, span_s: float) -> list[str]:
    """The stated reason, checked: what the library computes instead, predicted from the log (`plain`:
    its answer on the same log without the repeats). Returns what does not hold."""
    def pp(seconds: float) -> float:
        return 100 * abs(seconds) / span_s

    mlgp, wrong = theirs["productive_s"], []
    if job.kind == "clock_back_beyond_wait":
        clock_span = job.last_end - job.first_start
        if abs(theirs["total_s"] - clock_span) > 1e-3 or clock_span > span_s - 60:
            wrong.append(f"its job time {theirs['total_s']:.3f} s is not the log's clock span {clock_span:.3f} s, "
                         f"or that is not shorter than healthd's {span_s:.3f} s")
        if pp(mlgp - prod_s) > TOLERANCE_PP:
            wrong.append(f"its productive time {mlgp:.3f} s against healthd's {prod_s:.3f} s")
    elif job.kind == "window_marks":
        if abs(mlgp - (job.last_end - job.last_mark)) > 1e-3:
            wrong.append(f"its productive time {mlgp:.3f} s is not the last mark to the end "
                         f"{job.last_end - job.last_mark:.3f} s")
    elif job.kind == "loading_in_steps":
        if job.loading_in_surviving_steps_s <= 0 or pp(mlgp - prod_s - job.loading_in_surviving_steps_s) > REASON_PP:
            wrong.append(f"its productive time {mlgp:.3f} s is not healthd's {prod_s:.3f} s and the loading "
                         f"{job.loading_in_surviving_steps_s:.3f} s")
    elif job.kind == "repeated_save":
        if job.second_save_copy_s <= 0 or pp(prod_s - mlgp - job.second_save_copy_s) > REASON_PP:
            wrong.append(f"its productive time {mlgp:.3f} s is not healthd's {prod_s:.3f} s less the second copy "
                         f"{job.second_save_copy_s:.3f} s")
    if job.kind.startswith("repeated"):
        assert plain is not None
        if plain["error"] or pp(plain["productive_s"] - prod_s) > TOLERANCE_PP or \
                abs(plain["total_s"] - span_s) > 1.0:
            wrong.append(f"without the repeats it measures {plain['productive_s']:.3f} s of {plain['total_s']:.3f} s,"
                         f" healthd with them {prod_s:.3f} s of {span_s:.3f} s")
    return wrong


def _rows(all_jobs: list[Job], theirs: dict) -> list[Row]:
    rows = []
    for job in all_jobs:
        acc = account(parse_log(job.text))
        assert not acc.partial, (job.name, acc.problems)
        prod_s = acc.gpu_s.get("productive", 0.0) / job.gpus
        span_s = acc.held_gpu_s / job.gpus + acc.queued_s
        mine = theirs[job.name]
        if job.kind in COMPARED:
            wrong = [f"it refused: {mine['error']}"] if mine["error"] else []
            status = "compared"
        else:
            wrong = _set_aside_holds(job, mine, theirs.get(f"{job.name}.plain"), prod_s, span_s)
            status = f"set aside: {SET_ASIDE[job.kind]}"
        if abs(prod_s - job.truth_productive_s) / span_s > TOLERANCE_PP / 100:
            wrong.append(f"healthd's productive time {prod_s:.3f} s is not the generator's {job.truth_productive_s:.3f} s")
        status = f"FAILED: {status}: {'; '.join(wrong)}" if wrong else status
        rows.append(Row(job, mine["goodput_pct"], 100 * prod_s / span_s, 100 * (acc.goodput or 0.0),
                        100 * job.truth_productive_s / span_s, mine["productive_s"], prod_s, span_s, status))
    return rows


def _table(rows: list[Row]) -> str:
    def f(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    head = (f"{'class':24} {'job':28} {'mlgp %':>8} {'healthd %':>9} {'diff pp':>8} {'truth %':>8} "
            f"{'of held %':>9}  status")
    body = [f"{r.job.kind:24} {r.job.name:28} {f(r.mlgp_pct):>8} {r.healthd_pct:9.3f} {f(r.diff_pp, '+.3f'):>8} "
            f"{r.truth_pct:8.3f} {r.healthd_goodput_pct:9.3f}  {r.status}" for r in rows]
    summary = ["", f"{'class':24} {'jobs':>4} {'max |diff| pp':>14}  compared"]
    for kind in (*COMPARED, *SET_ASIDE):
        mine = [r for r in rows if r.job.kind == kind]
        worst = max((abs(r.diff_pp) for r in mine if r.diff_pp is not None), default=None)
        summary.append(f"{kind:24} {len(mine):4d} {f(worst):>14}  {'yes' if kind in COMPARED else 'no: ' + SET_ASIDE[kind]}")
    return "\n".join([head, *body, *summary]) + "\n"


@pytest.fixture(scope="module")
def oracle_python() -> Path:
    if not ORACLE_PY.exists():
        pytest.fail(f"{ORACLE_PY} missing: `make test` builds it (the mlgp-venv target)")
    return ORACLE_PY


def test_goodput_within_half_a_point_of_ml_goodput_measurement(oracle_python):
    all_jobs = jobs()
    names = [j.name for j in all_jobs] + [f"{j.name}.plain" for j in all_jobs if j.plain]
    done = subprocess.run([str(oracle_python), str(ORACLE), *names], input="".join(j.text + j.plain for j in all_jobs),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(all_jobs, json.loads(done.stdout))
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(_table(rows))
    print(_table(rows))
    assert len(rows) >= 100
    assert {j.kind for j in all_jobs} == {*COMPARED, *SET_ASIDE}
    compared = [r for r in rows if r.job.kind in COMPARED]
    assert len(compared) >= 80
    too_far = [f"{r.job.name}: ml-goodput-measurement {r.mlgp_pct} %, healthd {r.healthd_pct:.3f} %"
               for r in compared if abs(r.diff_pp if r.diff_pp is not None else math.inf) > TOLERANCE_PP]
    failed = [f"{r.job.name}: {r.status}" for r in rows if r.status.startswith("FAILED")]
    assert not too_far + failed, "\n".join(too_far + failed)


def test_the_generated_jobs_hold_each_class():
    """The generator makes what the classes say: otherwise a class would pass by being empty."""
    all_jobs = jobs()
    by = {k: [j for j in all_jobs if j.kind == k] for k in (*COMPARED, *SET_ASIDE)}
    runs = {k: [sum("job_start_time" in e for e in j.entries) for j in v] for k, v in by.items()}
    assert set(runs["clean"]) >= {1, 2, 3, 4} and min(runs["interruptions"]) >= 5

    def boundaries(j: Job) -> list[tuple[float, float]]:
        ends = [e["time"] for e in j.entries if e.get("healthd_event") == "run_end" and e["state"] != "COMPLETED"]
        starts = [e["job_start_time"] for e in j.entries if "job_start_time" in e][1:]
        return list(zip(ends, starts, strict=True))

    same = [b for j in by["same_second"] for b in boundaries(j)]
    assert all(math.floor(start) <= end for end, start in same) and any(start < end for end, start in same)
    assert all(start < end for j in by["clock_back_beyond_wait"] for end, start in boundaries(j))
    assert all(any(e.get("custom_badput_event_type") in ("eval", "data_loading") for e in j.entries)
               for j in by["custom_events"])
    for j in by["save_dies"]:
        opened = [e for e in j.entries if "custom_badput_event_start_time" in e]
        closed = [e for e in j.entries if "custom_badput_event_end_time" in e]
        assert len(opened) - len(closed) == len(boundaries(j)) >= 1
    def as_json(line: str) -> str:  # equal for lines equal as JSON (8 and 8.0 alike)
        return json.dumps(json.loads(line, parse_int=float), sort_keys=True)

    for j in by["duplicates"]:
        lines = j.text.splitlines()
        assert len(lines) > len(j.entries) == len({as_json(x) for x in lines})
        assert len(set(lines)) > len(j.entries)  # some repeats re-serialized: not byte-identical
    for j in by["repeated_marks"]:
        marks = [as_json(x) for x in j.text.splitlines() if "step_count" in x]
        assert len(marks) > len(set(marks)) and j.text.count("\n") == len(marks) - len(set(marks)) + len(j.entries)
    assert {any("run" in e for e in j.entries) for j in all_jobs} == {True, False}  # with and without run keys
    assert all(not any(e.get("healthd_event") == "interrupt" for e in j.entries)
               for k in ("clock_back_within_wait", "clock_back_beyond_wait") for j in by[k])
    assert all(j.loading_in_surviving_steps_s > 0 for j in by["loading_in_steps"])
    assert all(j.second_save_copy_s > 0 for j in by["repeated_save"])
