"""Property and metamorphic tests of healthd.goodput on logs written by an independent generator
(tests/goodput/loggen.py, from docs/goodput.md's format, never healthd's writers): transformations
that must not change the answer (a shifted clock, a clock stepped back between runs, lines
re-serialized, duplicated, or shipped in parts in any order, Slurm's runs in place of the log's),
transformations that change it in one known way (a same-second requeue against a 1 s gap, one more
productive step, a running job against the same job completed now), and the GPU-seconds that the
rules fix from the log alone (held, queued, saves, detection, decision, restart, custom events, the
work at risk, the checkpoint interval within runs).

Numbers are compared to 1e-6 of the job's held GPU-seconds, with a floor of 1e-4 GPU-s: Unix times
near 1.7e9 are floats with a resolution of 2.4e-7 s.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from healthd.goodput import SlurmRun, account, interval_advice, merge, parse_log, runs_of, with_runs
from healthd.goodput_categories import CATEGORIES
from tests.goodput import loggen
from tests.goodput.loggen import Job, Line, text

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RUN_KEYS = st.sampled_from([False, True])


def acct(job: Job, txt: str | None = None, *, run_keys: bool | str = False, now: float | None = None):
    txt = text(job, run_keys=run_keys) if txt is None else txt
    now = job.now if now is None else now
    note(f"log (now={now}):\n{txt}")  # the failing example's log, as a file to replay
    return account(parse_log(txt), now=now)


def tol(*accs) -> float:
    return max(1e-4, 1e-6 * max(a.held_gpu_s for a in accs))


def cats(acc) -> dict[str, float]:
    return {c: acc.gpu_s[c] for c in CATEGORIES}


def assert_same(a, b, *, queued: bool = True, what: str = "") -> None:
    """The same categories, held time, goodput, work at risk, incidents (and queued time)."""
    t = tol(a, b)
    assert a.held_gpu_s == pytest.approx(b.held_gpu_s, abs=t), what
    diff = {c: (a.gpu_s[c], b.gpu_s[c]) for c in CATEGORIES if abs(a.gpu_s[c] - b.gpu_s[c]) > t}
    assert not diff, f"{what}: categories differ {diff}"
    if a.held_gpu_s > 0:
        assert a.goodput == pytest.approx(b.goodput, abs=1e-6), what
    assert a.at_risk_gpu_s == pytest.approx(b.at_risk_gpu_s, abs=t), what
    if queued:
        assert a.queued_s == pytest.approx(b.queued_s, abs=1e-4), what
    assert (a.runs, a.interruptions) == (b.runs, b.interruptions), what
    assert same_incidents(a, b, t), (what, a.incidents, b.incidents)
    assert bool(a.problems) == bool(b.problems), (what, a.problems, b.problems)


def same_incidents(a, b, t: float) -> bool:
    """The same incidents, each with the same cause and cost by category."""
    x, y = ({i.incident: i for i in acc.incidents} for acc in (a, b))
    return x.keys() == y.keys() and all(
        (x[k].cause, x[k].false_positive) == (y[k].cause, y[k].false_positive)
        and all(abs(x[k].gpu_s.get(c, 0.0) - y[k].gpu_s.get(c, 0.0)) <= t for c in {*x[k].gpu_s, *y[k].gpu_s})
        for k in x)


def no_repeats(lines: list[str]) -> bool:
    """No two lines equal as JSON (the rules count such a line once, which would be right here)."""
    docs = [json.dumps(json.loads(s), sort_keys=True) for s in lines if s.strip()]
    return len(set(docs)) == len(docs)


# --------------------------------------------------------------------------- what the log fixes


@SETTINGS
@given(loggen.jobs(), RUN_KEYS)
def test_held_is_allocated_time_the_categories_sum_to_it_and_queued_is_outside(job, run_keys):
    acc = acct(job, run_keys=run_keys)
    t = tol(acc)
    assert not acc.problems, acc.problems
    assert acc.runs == len(job.runs)
    assert acc.held_gpu_s == pytest.approx(job.held_gpu_s, abs=t)
    assert sum(acc.gpu_s.values()) == pytest.approx(acc.held_gpu_s, abs=t)
    assert all(v >= -t for v in acc.gpu_s.values()), acc.gpu_s
    assert acc.queued_s == pytest.approx(job.queued_s, abs=1e-4)
    assert 0 <= acc.goodput <= 1 + 1e-9
    if not job.running:
        assert acc.at_risk_gpu_s == 0
    for inc in acc.incidents:
        assert all(v >= -t for v in inc.gpu_s.values())
        assert inc.cost_gpu_s == pytest.approx(sum(inc.gpu_s.values()), abs=t)


@SETTINGS
@given(loggen.jobs(), RUN_KEYS)
def test_saves_detection_decision_and_restart_keep_their_own_time(job, run_keys):
    """A save's blocking part is checkpoint time, one the node died in up to the incident's first
    evidence (the run's end without an incident); the ledger's detection and decision times are theirs;
    a later run's start to its first step is restart (all of an incident's time false_positive when its
    action was wrong)."""
    acc = acct(job, run_keys=run_keys)
    t = tol(acc)
    assert acc.gpu_s["checkpoint"] == pytest.approx(job.checkpoint_gpu_s, abs=t)
    assert acc.gpu_s["detection"] == pytest.approx(job.detection_gpu_s, abs=t)
    assert acc.gpu_s["decision"] == pytest.approx(job.decision_gpu_s, abs=t)
    restart = sum(r.startup * r.gpus for p, r in pairwise(job.runs) if not p.false_positive)
    assert acc.gpu_s["restart"] == pytest.approx(restart, abs=t)
    ledgered = [r for r in job.runs if r.ledger]
    if all(r.ledger for r in job.runs if r.state not in ("COMPLETED", "RUNNING")):
        waiting = sum((r.end - r.decided) * r.gpus for r in ledgered if not r.false_positive)
        assert acc.gpu_s["waiting"] == pytest.approx(waiting, abs=t)


@SETTINGS
@given(loggen.jobs())
def test_custom_events_that_are_not_checkpoints_are_other(job):
    """eval, data loading, profiling: the time is `other`; without their lines it would be the steps'
    (except after the last mark of a last run that failed without an incident, which is `other` anyway)."""
    with_custom, plain = acct(job), acct(loggen.without(job, "custom_start", "custom_end"))
    t = tol(with_custom)
    assert with_custom.gpu_s["other"] >= job.custom_gpu_s - t
    grew = with_custom.gpu_s["other"] - plain.gpu_s["other"]
    if job.runs[-1].state in ("FAILED", "NODE_FAIL") and not job.runs[-1].ledger:
        assert -t <= grew <= job.custom_gpu_s + t
    else:
        assert grew == pytest.approx(job.custom_gpu_s, abs=t)
    assert with_custom.held_gpu_s == pytest.approx(plain.held_gpu_s, abs=t)
    assert not with_custom.problems


@SETTINGS
@given(loggen.jobs(last="running"), RUN_KEYS)
def test_a_running_job_has_work_at_risk_not_lost(job, run_keys):
    """Accounted at `now`: the same categories as the job completed now (its steps productive, nothing
    of the last run lost), and the work since the last durable save at risk."""
    last = len(job.runs) - 1
    job = loggen.without(job, "straggler", run=last)  # a slow rank's share is neither clearly work nor not
    running = acct(job, run_keys=run_keys)
    r = job.runs[-1]
    done = Line({"healthd_event": "run_end", "time": job.now, "state": "COMPLETED"}, last, "node", "run_end")
    completed = account(parse_log(text(job, [*job.lines, done], run_keys=run_keys)))
    assert not running.problems, running.problems
    t = tol(running)
    at_risk = (job.now - r.after_durable) * r.gpus - job.custom_after_durable_gpu_s
    assert running.at_risk_gpu_s == pytest.approx(at_risk, abs=t)
    assert completed.at_risk_gpu_s == 0
    assert cats(running) == pytest.approx(cats(completed), abs=t)
    assert running.gpu_s["lost"] == pytest.approx(completed.gpu_s["lost"], abs=t)


@SETTINGS
@given(loggen.jobs(runs=(2, 4), regular=True, custom=False))
def test_the_checkpoint_interval_is_measured_within_runs(job):
    """Saves every X seconds within each run: the current interval is X, whatever the interruptions."""
    assume(any(len(r.saves) >= 2 for r in job.runs))
    x = next(b - a for r in job.runs for a, b in pairwise(r.saves))
    log = parse_log(text(job))
    advice = interval_advice(account(log, now=job.now))
    assert advice is not None
    assert advice.current_s == pytest.approx(x, abs=1e-3)


@SETTINGS
@given(loggen.jobs(), st.integers(0, 3))
def test_a_run_without_an_allocation_record_holds_the_previous_runs_gpus_and_says_so(job, which):
    which = min(which, len(job.runs) - 1)
    acc = acct(loggen.without(job, "allocation", run=which))
    assert acc.problems, "a run with no allocation record is a stated assumption"
    gpus = [r.gpus for r in job.runs]
    gpus[which] = gpus[which - 1] if which > 0 else (gpus[1] if len(gpus) > 1 else 1)
    ends = [r.end if r.end is not None else job.now for r in job.runs]
    held = sum((e - r.start) * g for r, e, g in zip(job.runs, ends, gpus, strict=True))
    assert acc.held_gpu_s == pytest.approx(held, abs=tol(acc))


@SETTINGS
@given(loggen.jobs(last="both"), st.sampled_from(["run_end", "job_end", "earlier job_end", "later job_end"]), RUN_KEYS)
def test_run_end_and_job_end_time_one_rule(job, keep, run_keys):
    """A run ends at its run_end; without one at job_end_time (COMPLETED). A job_end_time before the
    run_end (the process wrote it, then the epilog the end) or after it (another clock) changes nothing."""
    both = acct(job, run_keys=run_keys)
    last = len(job.runs) - 1
    if keep in ("earlier job_end", "later job_end"):
        by = -min(50, job.runs[-1].end - job.runs[-1].first_mark) if keep.startswith("earlier") else 50
        other = replace_lines(job, lambda ln: replace(ln, entry={"job_end_time": ln.entry["job_end_time"] + by})
                              if ln.role == "job_end" else ln)
    else:
        other = loggen.without(job, "job_end" if keep == "run_end" else "run_end", run=last)
    assert_same(both, acct(other, run_keys=run_keys), what=keep)


def replace_lines(job: Job, f) -> Job:
    return replace(job, lines=tuple(f(ln) for ln in job.lines))


# --------------------------------------------------------------------------- unchanged by


@SETTINGS
@given(loggen.jobs(), RUN_KEYS, st.one_of(st.integers(-10**8, 10**8), st.floats(-1e6, 1e6).map(lambda x: round(x, 3))))
def test_shifting_every_time_changes_nothing(job, run_keys, by):
    assert_same(acct(job, run_keys=run_keys), acct(loggen.shifted(job, by), run_keys=run_keys), what=f"shift {by}")


@SETTINGS
@given(loggen.jobs(runs=(2, 4)), st.data())
def test_a_clock_stepped_back_between_runs_changes_no_category(job, data):
    """Every event of runs >= k earlier by d (up to 3 h): runs are told apart by their `run` key or, in
    one node's file, by file order; the ledger's and the controller's lines go by `run` or time (so
    without keys they are left out: their time alone cannot place them)."""
    k = data.draw(st.integers(1, len(job.runs) - 1), label="k")
    d = data.draw(st.integers(1, 3 * 3600) if job.integer else st.floats(0.001, 3 * 3600), label="d")
    keys = data.draw(st.sampled_from([True, "unordered", False]), label="run keys")
    if keys is False:
        job = loggen.without(job, *loggen.UNORDERED_ROLES)
    stepped = loggen.shifted(job, -d, from_run=k)
    assume(no_repeats(text(stepped, run_keys=keys).splitlines()))
    before, after = acct(job, run_keys=keys), acct(stepped, run_keys=keys)
    assert not after.problems, after.problems
    assert_same(before, after, queued=False, what=f"run {k} on: {d} s back")


@SETTINGS
@given(loggen.jobs(), RUN_KEYS, st.data())
def test_a_clock_stepped_back_inside_a_run_is_taken_as_no_time(job, run_keys, data):
    """The node's clock steps back d between two step marks a and b of a run (b and everything of the
    run after it d earlier, d more than the time between them): the run's time runs on from a, as if
    the steps between the marks took no time. The same answer as that log, not PARTIAL; other runs
    untouched. The ledger's and the controller's lines of that run are left out (the head node's clock
    did not step, so they no longer line up with the node's)."""
    candidates = []
    for r in range(len(job.runs)):
        own = [i for i, ln in enumerate(job.lines) if ln.run == r and ln.source == "node"]
        candidates += [(r, i, j) for i, j in pairwise(own) if job.lines[i].role == job.lines[j].role == "step"]
    assume(candidates)
    r, i, j = data.draw(st.sampled_from(candidates), label="run, marks")
    marks = job.lines[i], job.lines[j]
    job = loggen.without(job, *loggen.UNORDERED_ROLES, run=r)  # the head node's clock did not step
    i, j = (next(k for k, ln in enumerate(job.lines) if ln is x) for x in marks)
    between = loggen.time_of(job.lines[j]) - loggen.time_of(job.lines[i])
    d = between + data.draw(st.integers(1, 3 * 3600) if job.integer else st.floats(0.001, 3 * 3600), label="d")

    def back(by: float) -> Job:
        lines = tuple(replace(ln, entry=loggen.entry_times(ln.entry, lambda v: v - by)) if k >= j and ln.run == r
                      else ln for k, ln in enumerate(job.lines))
        return replace(job, lines=lines)  # `now` is the accounting host's clock, which did not step

    stepped, collapsed = back(d), back(between)
    assume(no_repeats(text(stepped, run_keys=run_keys).splitlines()))  # a stepped line equal to an earlier one counts once
    a, b = acct(stepped, run_keys=run_keys), acct(collapsed, run_keys=run_keys)
    assert not a.problems, a.problems
    assert a.notes, "the clock step is noted"
    assert_same(a, b, queued=False, what=f"run {r}: {d} s back between marks")


@SETTINGS
@given(loggen.jobs(), RUN_KEYS, st.randoms(use_true_random=False))
def test_re_serialized_lines_change_nothing(job, run_keys, rnd):
    """Other key order, other spacing, integer times written as floats."""
    assert_same(acct(job, run_keys=run_keys), acct(job, text(job, run_keys=run_keys, rnd=rnd)), what="re-serialized")


@SETTINGS
@given(loggen.jobs(), RUN_KEYS, st.randoms(use_true_random=False), st.integers(1, 8))
def test_duplicated_lines_count_once(job, run_keys, rnd, copies):
    """A line again later in the file, byte for byte or re-serialized: counted once."""
    lines = [(s, ln) for s, ln in zip(text(job, run_keys=run_keys).splitlines(), job.lines, strict=True)]
    for _ in range(copies):
        i = rnd.randrange(len(lines))
        s, ln = lines[i]
        copy = s if rnd.random() < 0.5 else loggen.serialize(job.name, ln, run_key=run_keys, rnd=rnd)
        lines.insert(rnd.randint(i + 1, len(lines)), (copy, ln))
    assert_same(acct(job, run_keys=run_keys), acct(job, "".join(s + "\n" for s, _ in lines)), what="duplicates")


@SETTINGS
@given(loggen.jobs(runs=(2, 4)), RUN_KEYS, st.randoms(use_true_random=False), st.booleans())
def test_a_log_in_parts_merged_in_any_order_changes_nothing(job, run_keys, rnd, skewed):
    """Rank 0 on another node after a requeue: one part per node (its runs), the ledger's and the
    controller's lines in a part of their own, merged in any order. `skewed`: each node's clock a few
    seconds off (its runs' events moved together), which changes only the queued time."""
    if skewed:
        for r in range(1, len(job.runs)):
            job = loggen.shifted(job, rnd.choice([-5, -3, -1, 1, 2, 5]), from_run=r)
        assume(all(a.start < b.start for a, b in pairwise(job.runs)))
    whole = acct(job, run_keys=run_keys)
    cut = sorted(rnd.sample(range(1, len(job.runs)), rnd.randint(1, len(job.runs) - 1)))
    groups = [range(a, b) for a, b in zip([0, *cut], [*cut, len(job.runs)], strict=True)]
    parts = [(f"node{i}", [ln for ln in job.lines if ln.source == "node" and ln.run in g]) for i, g in enumerate(groups)]
    parts.append(("_controller", [ln for ln in job.lines if ln.source != "node"]))
    rnd.shuffle(parts)
    merged = merge((name, parse_log(text(job, lines, run_keys=run_keys))) for name, lines in parts)
    assert not merged.problems, merged.problems
    assert_same(whole, account(merged, now=job.now), what=f"parts {[n for n, _ in parts]}")


@SETTINGS
@given(loggen.jobs(runs=(2, 4), gap="zero"), RUN_KEYS, st.data())
def test_a_requeue_in_the_same_second_is_a_requeue_one_second_later_but_for_the_queue(job, run_keys, data):
    k = data.draw(st.integers(1, len(job.runs) - 1), label="k")
    same, later = acct(job, run_keys=run_keys), acct(loggen.shifted(job, 1, from_run=k), run_keys=run_keys)
    assert not same.problems, same.problems
    assert_same(same, later, queued=False, what=f"run {k} one second later")
    assert later.queued_s - same.queued_s == pytest.approx(1.0, abs=1e-4)


@SETTINGS
@given(loggen.jobs(), st.sampled_from(["eval_end", "gpu_thermals", "allocation_v2"]), st.randoms(use_true_random=False),
       st.integers(1, 5), RUN_KEYS)
def test_an_unknown_healthd_event_kind_changes_nothing_and_is_not_partial(job, kind, rnd, count, run_keys):
    """A newer agent's kind: a note, not accounted, not PARTIAL."""
    lines = list(job.lines)
    for _ in range(count):
        i = rnd.randint(1, len(lines))
        near = lines[i - 1]
        lines.insert(i, Line({"healthd_event": kind, "time": loggen.time_of(near), "value": 42}, near.run, "node",
                             "unknown"))
    plain, more = acct(job, run_keys=run_keys), acct(job, text(job, lines, run_keys=run_keys))
    assert not more.problems, more.problems
    assert_same(plain, more, what=kind)


@SETTINGS
@given(loggen.jobs(), st.booleans(), st.data())
def test_slurms_run_records_equal_to_the_logs_change_nothing(job, with_gpus, data):
    """The sacct path: Slurm's runs (one per restart, a same-second requeue included) matched to the
    log's by time; equal to the log's own starts and ends, the answer is the log's. Wider (Slurm
    allocated before the first process and released after the epilog): held is Slurm's time."""
    log = parse_log(text(job))
    slurm = [SlurmRun(r.start, r.end, r.state, r.gpus if with_gpus else None) for r in job.runs]
    assert_same(account(log, now=job.now), account(with_runs(log, slurm), now=job.now), what="sacct")
    wider, before = [], None
    for i, r in enumerate(job.runs):
        lo = r.start - 60 if before is None else before
        nxt = job.runs[i + 1].start if i + 1 < len(job.runs) else None
        s = r.start - data.draw(st.integers(0, int(r.start - lo)), label="early")
        e = None if r.end is None else r.end + data.draw(st.integers(0, int((nxt - r.end) // 2) if nxt else 60),
                                                        label="late")
        wider.append(SlurmRun(s, e, r.state, r.gpus if with_gpus else None))
        before = e
    acc = account(with_runs(log, wider), now=job.now)
    held = sum(((w.end if w.end is not None else job.now) - w.start) * r.gpus for w, r in zip(wider, job.runs, strict=True))
    assert not acc.problems, acc.problems
    assert acc.runs == len(job.runs)
    assert acc.held_gpu_s == pytest.approx(held, abs=tol(acc))
    assert sum(acc.gpu_s.values()) == pytest.approx(held, abs=tol(acc))


# --------------------------------------------------------------------------- changed in one way by


@SETTINGS
@given(loggen.jobs(last="completed"), st.integers(1, 120), RUN_KEYS)
def test_one_more_productive_step_never_lowers_goodput(job, seconds, run_keys):
    """The last run, which completed, runs one more step before it ends: productive and held grow by
    that step's GPU time, the rest stays."""
    last = len(job.runs) - 1
    end = job.runs[-1].end
    step = max(ln.entry["step_count"] for ln in job.lines if ln.role == "step" and ln.run == last) + job.window
    lines = []
    for ln in job.lines:
        if ln.run == last and ln.role in ("run_end", "job_end"):
            ln = replace(ln, entry=loggen.entry_times(ln.entry, lambda v: v + seconds))
        lines.append(ln)
    at = max(i for i, ln in enumerate(lines) if ln.run == last and ln.role not in ("run_end", "job_end")) + 1
    lines.insert(at, Line({"step_count": step, "step_start_time": end}, last, "node", "step"))
    before, after = acct(job, run_keys=run_keys), acct(job, text(job, lines, run_keys=run_keys))
    gpus = job.runs[-1].gpus
    t = tol(before, after)
    assert after.goodput >= before.goodput - 1e-12
    assert after.gpu_s["productive"] - before.gpu_s["productive"] == pytest.approx(seconds * gpus, abs=t)
    assert after.held_gpu_s - before.held_gpu_s == pytest.approx(seconds * gpus, abs=t)


def test_runs_of_tells_a_same_second_requeue_apart():
    """The smallest instance of the class, spelled out: run 1 starts the second run 0 ended."""
    job_lines = [
        {"job_start_time": 100}, {"healthd_event": "allocation", "time": 100, "gpus": 8},
        {"step_count": 0, "step_start_time": 110}, {"healthd_event": "run_end", "time": 200, "state": "FAILED"},
        {"job_start_time": 200}, {"healthd_event": "allocation", "time": 200, "gpus": 8},
        {"step_count": 0, "step_start_time": 210}, {"job_end_time": 300}]
    log = parse_log("".join(json.dumps({"job_name": "1", **e}) + "\n" for e in job_lines))
    runs, problems = runs_of(log)
    assert [(r.start, r.end) for r in runs] == [(100, 200), (200, 300)]
    assert [len([e for e in r.events if e.kind == "step"]) for r in runs] == [1, 1]
    assert not problems


# --------------------------------------------------------------------------- accounted again


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(loggen.jobs(), st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["gpu", "gpu-big"])),
                                                  min_size=1, max_size=4)), min_size=1, max_size=3))
def test_accounting_a_job_again_never_double_counts(history):
    """Each job accounted several times, as its log grew run by run (after a requeue) or unchanged, in
    a partition that may change: every counter only grows, and total - retracted is the sum over the
    jobs' latest accounts, by partition and category, cause and jobs."""
    import tempfile

    from healthd.controller.goodput_jobs import AccountedJobs, GoodputSettings, label

    latest: dict[str, tuple[str, object]] = {}
    with tempfile.TemporaryDirectory() as d:
        store = AccountedJobs(f"{d}/accounted.sqlite")
        try:
            before = None
            at = 1_800_000_000.0
            for n, (job, passes) in enumerate(history):
                name = f"{n}"
                for upto, partition in passes:
                    part = [ln for ln in job.lines if ln.run < upto]
                    acc = account(parse_log(text(job, part)), now=job.now)
                    at += 60
                    store.accounted(name, partition, "acct", at, at, acc)
                    latest[name] = (partition, acc)
                    figs = store.figures(GoodputSettings(), at)
                    if before is not None:
                        for field in ("gpu_s", "gpu_s_retracted", "cost", "cost_retracted", "jobs", "jobs_retracted"):
                            old, new = getattr(before, field), getattr(figs, field)
                            assert all(new.get(k, 0) >= v - 1e-6 for k, v in old.items()), field
                    before = figs
        finally:
            store.close()
    assert before is not None
    want_gpu: Counter = Counter()
    want_cost: Counter = Counter()
    want_jobs = Counter(label(partition) for partition, _ in latest.values())
    for partition, acc in latest.values():
        want_gpu.update({(label(partition), c): v for c, v in acc.gpu_s.items()})
        for i in acc.incidents:
            want_cost[(label(partition), label(i.cause))] += i.cost_gpu_s
    net_gpu = {k: v - before.gpu_s_retracted.get(k, 0.0) for k, v in before.gpu_s.items()}
    for k in set(net_gpu) | set(want_gpu):
        assert net_gpu.get(k, 0.0) == pytest.approx(want_gpu.get(k, 0.0), abs=1e-3), k
    net_cost = {k: v - before.cost_retracted.get(k, 0.0) for k, v in before.cost.items()}
    for k in set(net_cost) | set(want_cost):
        assert net_cost.get(k, 0.0) == pytest.approx(want_cost.get(k, 0.0), abs=1e-3), k
    net_jobs = {p: v - before.jobs_retracted.get(p, 0) for p, v in before.jobs.items()}
    assert {p: v for p, v in net_jobs.items() if v} == dict(want_jobs)
