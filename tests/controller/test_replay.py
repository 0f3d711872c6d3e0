"""Replay (healthd.sim.replay): a record made by the real controller — MUNGE-signed reports over HTTP,
its rounds in observe mode, its history and ledger — run again under auto mode and under a changed
threshold; the differences name the node, the gate and the evidence, and replaying under the
configuration that made the record changes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from healthd import goodput
from healthd.controller.history import History
from healthd.controller.ledger import Ledger
from healthd.goodput_categories import INCIDENT_CATEGORIES
from healthd.sim.replay import (MATCH_S, Difference, JobRecord, ReplayError, changes_by_hand, jobs_effects,
                                read_job_logs, replay)
from tests.goodput import loggen
from tests.controller.schema_support import iso
from tests.controller.test_daemon import rig_factory as rig_factory  # noqa: F401 (a fixture)
from tests.controller.test_daemon import state_doc


def user_xid(now: float) -> dict:
    """A user's program fault (Xid 13, graphics engine exception): user code, tier 3, no action."""
    return {"id": "xid:gpu1:13", "component": {"kind": "gpu", "index": 1}, "source": "kernel_log", "xid": 13,
            "attribution": "user", "tier": 3, "action": "none", "summary": "xid 13 gpu1: graphics engine exception",
            "evidence": [{"kind": "log_line", "text": "NVRM: Xid (PCI:0000:3c:00): 13, Graphics Exception"}],
            "first_seen": iso(now), "last_seen": iso(now)}


@pytest.fixture
def record(rig_factory, tmp_path):  # noqa: F811
    """The real controller in observe mode: node02 and node03 report a GPU off the bus (Xid 79), node04 a
    user's Xid 13, and an administrator drains node01 by hand between rounds."""
    rig = rig_factory("observe")
    t0 = time.time()
    assert rig.report("node04", state_doc("node04", t0, [user_xid(t0)]))[0] == 200
    rig.controller.evaluate(t0)
    assert rig.report("node02")[0] == 200
    assert rig.report("node03")[0] == 200
    rig.controller.evaluate(t0 + 1)
    rig.backend.drain("node01", "bad fan, ticket 4711")
    rig.controller.fleet.refresh()
    rig.controller.evaluate(t0 + 2)
    rig.controller.evaluate(t0 + 3)
    assert rig.backend.writes[-1][:2] == ("drain", "node01")  # the administrator's, not healthd's
    settings = rig.controller.settings
    ledger_path = rig.ledger.path
    history_path = rig.controller.history.path
    rig.close()
    return settings, History(history_path, readonly=True), Ledger.open_readonly(ledger_path)


def _policy(settings, **changes):
    return dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, **changes))


def test_under_the_recorded_configuration_nothing_differs(record):
    settings, history, ledger = record
    result = replay(history, settings, recorded=ledger)
    assert result.differences == ()
    assert result.candidate == {"refused by mode": 2} and result.recorded.get("refused by mode") == 2


def test_under_auto_the_breaker_holds_both_drains_back(record):
    """Two of the four nodes failing within the breaker's window: auto mode would have opened the
    breaker and drained neither (the record: both refused by observe mode)."""
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto"), recorded=ledger)
    by_node = {d.node: d for d in result.differences}
    assert set(by_node) == {"node02", "node03"}, result.differences
    for d in by_node.values():
        assert d.candidate == "refused by breaker" and d.gate == "breaker"
        assert d.recorded == "healthd decided it: refused by mode"
        assert any("79" in e for e in d.evidence)


def test_under_auto_with_a_higher_breaker_threshold_the_two_gpus_off_the_bus_are_drained(record):
    """A changed threshold (the breaker opens at 3 nodes): both Xid 79 nodes drained, the user's Xid 13
    never, and node01, drained by hand, stays the administrator's."""
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3), recorded=ledger)
    by_node = {d.node: d for d in result.differences}
    assert set(by_node) == {"node02", "node03"}, result.differences
    for d in by_node.values():
        assert d.kind.startswith("drain") and d.candidate == "applied", d
        assert d.recorded == "healthd decided it: refused by mode"
    assert [(r.node, r.kind) for r in changes_by_hand(history.slurm_nodes())] == [("node01", "drain-by-hand")]


def test_under_a_tighter_rate_limit_one_drain_is_refused_by_it(record):
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3,
                                     max_actions_per_hour=1), recorded=ledger)
    outcomes = sorted((d.candidate, d.gate) for d in result.differences)
    assert [o[0] for o in outcomes][0] == "applied" and outcomes[1][0].startswith("refused by rate"), outcomes


def test_an_empty_window_is_a_clear_error(record):
    settings, history, ledger = record
    with pytest.raises(ReplayError, match="nothing kept between"):
        replay(history, settings, recorded=ledger, start=0, end=1)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "healthd.sim.replay", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_command_replays_under_a_mode_and_a_setting_given_on_its_line(record):
    _, history, ledger = record
    args = ["--history", str(history.path), "--ledger", str(ledger.path), "--mode", "auto"]
    out = _cli(*args, "--set", "policy.breaker_min_nodes=3", "--set", "policy.breaker_nodes=3", "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mode"] == "auto" and {(d["node"], d["candidate"]) for d in doc["differences"]} == {
        ("node02", "applied"), ("node03", "applied")}
    text = _cli(*args)
    assert text.returncode == 0 and "refused by breaker" in text.stdout and "note: measured" in text.stdout


def test_the_command_says_what_is_wrong_with_a_bad_setting_or_file(record, tmp_path):
    _, history, _ = record
    bad = _cli("--history", str(history.path), "--set", "policy.breaker_min_nodes=lots")
    assert bad.returncode == 2 and "policy.breaker_min_nodes" in bad.stderr and "Traceback" not in bad.stderr
    missing = _cli("--history", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 2 and "no history there" in missing.stderr


def _what_if(ledger: Ledger) -> dict:
    """`healthctl what-if` over the record, the breaker opening at three nodes, as JSON."""
    out = subprocess.run([sys.executable, "-m", "healthd.controller.healthctl", "--ledger", str(ledger.path), "--json",
                          "what-if", "--since", "1d", "--set", "policy.breaker_min_nodes=3",
                          "--set", "policy.breaker_nodes=3"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HEALTHCTL_CONFIG": ""})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_healthctl_what_if_replays_the_live_controllers_record(record):
    _, history, ledger = record
    doc = _what_if(ledger)
    assert doc["mode"] == "auto" and {d["node"] for d in doc["differences"]} == {"node02", "node03"}


# --------------------------------------------------------------------------- the jobs' goodput logs
#
# Jobs come from tests/goodput/loggen.py, a writer of the documented format (docs/goodput.md), never
# healthd's: run r holds node{r}00 .. (one node per 8 GPUs), and its interruption names node{r}00.

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _record(job: loggen.Job) -> JobRecord:
    return JobRecord.of(job.name, goodput.parse_log(loggen.text(job)), job.now)


def _drain(node: str, at: float, until: float | None, *, recorded: str = "healthd applied it 1 min later",
           candidate: str = "applied") -> Difference:
    """A candidate's drain at `at`, the record's at `until` (None: never)."""
    return Difference(node, "drain-and-requeue", at, candidate, until, recorded if until is not None else "nothing",
                      None, (), None if until is None else until - at)


def _held(job: loggen.Job, node: str, a: float, b: float) -> float:
    """The generator's own held GPU-seconds of the runs that held `node`, inside [a, b]."""
    total = 0.0
    for r, run in enumerate(job.runs):
        end = run.end if run.end is not None else job.now
        nodes = {f"node{r}{k:02d}" for k in range(1 + (run.gpus - 1) // 8)}
        if node in nodes:
            total += max(0.0, min(end, b) - max(run.start, a)) * run.gpus
    return total


@SETTINGS
@given(job=loggen.jobs(), data=st.data())
def test_measured_productive_and_unproductive_sum_to_the_gpu_time_the_nodes_runs_held_in_the_window(job, data):
    r = data.draw(st.integers(0, len(job.runs) - 1))
    node = f"node{r}00"
    first, last = job.runs[0].start, (job.runs[-1].end or job.now)
    a = data.draw(st.floats(first - 3600, last + 60, allow_nan=False))
    b = a + data.draw(st.floats(1, 3 * (last - first) + 3600, allow_nan=False))
    (effect,) = jobs_effects([_drain(node, a, b)], [_record(job)], {}, b)
    expected = _held(job, node, a, b)
    note(f"{effect}, held {expected}")
    if expected == 0:
        assert effect.productive_gpu_h is None and effect.jobs == () and "no job's log covers node" in effect.note
    else:
        assert effect.jobs == (job.name,) and effect.window == (a, b)
        assert effect.productive_gpu_h + effect.unproductive_gpu_h == pytest.approx(expected / 3600, abs=1e-5)
        assert sum(effect.gpu_h.values()) == pytest.approx(expected / 3600, abs=1e-5)
        assert effect.productive_gpu_h == pytest.approx(effect.gpu_h.get("productive", 0.0), abs=1e-9)


@SETTINGS
@given(job=loggen.jobs(), data=st.data())
def test_shifting_every_time_of_the_logs_and_the_differences_changes_no_figure(job, data):
    by = data.draw(st.integers(-10**8, 10**8))
    r = data.draw(st.integers(0, len(job.runs) - 1))
    first, last = job.runs[0].start, (job.runs[-1].end or job.now)
    a = float(data.draw(st.integers(int(first) - 600, int(last))))
    b = a + data.draw(st.integers(1, int(last - first) + 600))
    c = float(data.draw(st.integers(int(first), int(last) + 60)))
    diffs = [_drain(f"node{r}00", a, b), _drain(f"node{r}00", a, None),
             _drain(f"node{r}00", a, c, recorded="healthd applied it", candidate="not decided")]
    moved = [dataclasses.replace(d, candidate_at=d.candidate_at + by,
                                 recorded_at=None if d.recorded_at is None else d.recorded_at + by) for d in diffs]
    here = jobs_effects(diffs, [_record(job)], {f"node{r}00": [b + 5]}, last + 100)
    there = jobs_effects(moved, [_record(loggen.shifted(job, by))], {f"node{r}00": [b + 5 + by]}, last + 100 + by)
    for x, y in zip(here, there, strict=True):
        assert x.jobs == y.jobs and x.incidents == y.incidents and x.note == y.note
        for mine, theirs in ((x.gpu_h, y.gpu_h), (x.interruption_gpu_h, y.interruption_gpu_h)):
            assert set(mine) <= set(theirs) | {c for c, v in mine.items() if v < 1e-5}
            for k in set(mine) | set(theirs):
                assert mine.get(k, 0.0) == pytest.approx(theirs.get(k, 0.0), abs=2e-5), k
    assert here[1].window == (a, b + 5)  # never recorded: up to the node's next recorded drain


@SETTINGS
@given(job=loggen.jobs(runs=(2, 4), ledger=True, last="completed"))
def test_each_recorded_requeue_finds_its_own_incident_and_they_add_up_to_the_jobs_interruption_cost(job):
    """Each interrupted run's requeue, recorded on node{r}00 at its decision time and not made by the
    candidate, is charged with exactly its incident's cost; over all of them, the job's incident
    categories. A drain recorded more than MATCH_S before the requeue was applied finds nothing."""
    rec = _record(job)
    interrupted = [(r, run) for r, run in enumerate(job.runs) if run.decided is not None]
    diffs = [_drain(f"node{r}00", run.decided, run.decided, recorded="healthd applied it", candidate="not decided")
             for r, run in interrupted]
    effects = jobs_effects(diffs, [rec], {}, job.runs[-1].end)
    assert [e.incidents for e in effects] == [(f"{7 + r}",) for r, _ in interrupted]
    charged = sum(sum(e.interruption_gpu_h.values()) for e in effects)
    acc = rec.account
    assert charged == pytest.approx(sum(acc.gpu_s[c] for c in (*INCIDENT_CATEGORIES, "false_positive")) / 3600,
                                    abs=1e-4)
    for (_, run), e in zip(interrupted, effects, strict=True):
        # the requeue applied, then Slurm ended the run: its waiting time at least is charged
        assert (set(e.interruption_gpu_h) == {"false_positive"}) if run.false_positive else \
            ("waiting" in e.interruption_gpu_h and "false_positive" not in e.interruption_gpu_h), e
    before = job.runs[0].decided - MATCH_S - 60
    earlier = jobs_effects([_drain("node000", before, before, recorded="healthd applied it", candidate="not decided")],
                           [rec], {}, 0.0)
    assert earlier[0].interruption_gpu_h == {} and "no job's log has an interruption on node000" in earlier[0].note


def test_only_drains_that_differ_are_measured():
    job_lines = [{"job_start_time": 1000}, {"healthd_event": "allocation", "time": 1000, "gpus": 8, "nodes": ["n1"]},
                 {"step_count": 0, "step_start_time": 1010}, {"healthd_event": "run_end", "time": 5000,
                                                              "state": "COMPLETED"}]
    text = "".join(json.dumps({"job_name": "7", **e}) + "\n" for e in job_lines)
    rec = JobRecord.of("7", goodput.parse_log(text))
    refused = dataclasses.replace(_drain("n1", 2000, None), candidate="refused by breaker")
    resume = dataclasses.replace(_drain("n1", 2000, None), kind="resume")
    later = _drain("n1", 3000, 2000)  # the candidate drains after the record did: the record's interruption
    effects = jobs_effects([refused, resume, later, _drain("n1", 2000, 2600)], [rec], {}, 9000)
    assert effects[:2] == (None, None)
    assert effects[2].window is None and "no job's log has an interruption on n1" in effects[2].note
    assert effects[3].gpu_h == {"productive": pytest.approx(600 * 8 / 3600)} and effects[3].unproductive_gpu_h == 0


def test_missing_unreadable_and_corrupt_logs_are_notes_never_an_error(tmp_path):
    missing = read_job_logs(str(tmp_path / "none"))
    assert not missing.read and "the jobs' goodput logs not read" in missing.notes[0]
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "node01.jsonl").write_bytes(b'{"job_name": "41", "job_start_time": 100}\n\xff\x00garbage\n'
                                                   b'{"job_name": "41", "healthd_event": "allocation", "time": 100, '
                                                   b'"gpus": 8}\n{"job_name": "41", "step_count": 1, "step_st')
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "node02.jsonl").mkdir()  # a part that is not a file
    (tmp_path / "43").mkdir()  # a job with no part yet
    (tmp_path / "accounted.sqlite").write_bytes(b"not a log")
    logs = read_job_logs(str(tmp_path))
    assert logs.read and [r.job for r in logs.records] == ["41"]
    assert logs.records[0].runs[0][3] == frozenset({"node01"})  # the agent's allocation has no nodes: its part's
    assert any(n.startswith("job 41: its goodput log is partial") for n in logs.notes), logs.notes
    assert any(n.startswith("job 42: its goodput log not read") for n in logs.notes), logs.notes


def job_log(job: str, node: str, start: float, end: float, *, hung_at: float | None = None) -> str:
    """A job of 8 GPUs on `node` from `start` to `end`, in the documented format: a step mark every 30 s,
    a durable save at its first step. With `hung_at`: no step after it, the run FAILED at `end` and
    the job requeued a minute later, restoring that save (the hang's time is lost work)."""
    marks = [start + 10 + 30 * i for i in range(int((end - start - 10) // 30))]
    marks = [t for t in marks if hung_at is None or t < hung_at]
    lines = [{"job_start_time": start}, {"healthd_event": "allocation", "time": start, "gpus": 8, "nodes": [node]},
             *({"step_count": i, "step_start_time": t} for i, t in enumerate(marks)),
             {"healthd_event": "durable", "time": marks[0] + 1, "step": 0},
             {"healthd_event": "run_end", "time": end, "state": "COMPLETED" if hung_at is None else "FAILED"}]
    if hung_at is not None:
        lines += [{"job_start_time": end + 60}, {"healthd_event": "allocation", "time": end + 60, "gpus": 8},
                  {"healthd_event": "restored", "time": end + 70, "step": 0},
                  {"step_count": 1, "step_start_time": end + 80},
                  {"healthd_event": "run_end", "time": end + 600, "state": "COMPLETED"}]
    return "".join(json.dumps({"job_name": job, **e}) + "\n" for e in lines)


@pytest.fixture
def gathered(record):
    """The controller's gathered goodput logs beside its ledger: job 4242 hung on node02 since before
    the record began, job 4243 training on node03, job 4244 on a node outside the fleet."""
    _, history, ledger = record
    t0 = history.span()[0]
    root = os.path.join(os.path.dirname(str(ledger.path)), "goodput-gathered")
    for job, node, hung in (("4242", "node02", t0 - 100), ("4243", "node03", None), ("4244", "node09", None)):
        os.makedirs(os.path.join(root, job), exist_ok=True)
        with open(os.path.join(root, job, f"{node}.jsonl"), "w") as f:
            f.write(job_log(job, node, t0 - 600, t0 + 600, hung_at=hung))
    return root


def _measured_as_expected(doc: dict) -> None:
    """node02's hung job: the whole window unproductive (what an earlier drain could at best have
    saved); node03's: the whole window productive (what it would have interrupted); 8 GPUs each."""
    by_node = {d["node"]: d for d in doc["differences"]}
    assert set(by_node) == {"node02", "node03"}
    for node, job, productive in (("node02", "4242", False), ("node03", "4243", True)):
        jobs = by_node[node]["jobs"]
        a, b = jobs["window"]
        assert b > a and jobs["jobs"] == [job], jobs
        held = (b - a) * 8 / 3600
        assert jobs["productive_gpu_h"] == pytest.approx(held if productive else 0.0, abs=1e-5)
        assert jobs["unproductive_gpu_h"] == pytest.approx(0.0 if productive else held, abs=1e-5)
        assert jobs["gpu_h"] == {"productive" if productive else "lost": pytest.approx(held, abs=1e-5)}


def test_the_command_measures_each_drain_in_the_jobs_goodput_logs(record, gathered):
    _, history, ledger = record
    args = ["--history", str(history.path), "--ledger", str(ledger.path), "--mode", "auto",
            "--set", "policy.breaker_min_nodes=3", "--set", "policy.breaker_nodes=3"]
    out = _cli(*args, "--goodput", gathered, "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    _measured_as_expected(doc)
    assert any(n.startswith("measured, from the jobs' goodput logs") and "(3 job(s))" in n for n in doc["notes"])
    text = _cli(*args, "--goodput", gathered)
    assert text.returncode == 0 and "JOBS GPU-H (measured) productive/unproductive" in text.stdout
    assert "GPU-H (model)" in text.stdout and "job(s) 4242: lost" in text.stdout, text.stdout
    none = json.loads(_cli(*args, "--format", "json").stdout)
    assert all(d["jobs"] is None for d in none["differences"])
    assert any("goodput logs were not given" in n for n in none["notes"])
    broken = _cli(*args, "--goodput", os.path.join(gathered, "4242", "node02.jsonl"), "--format", "json")
    assert broken.returncode == 0, broken.stderr
    assert any("the jobs' goodput logs not read" in n for n in json.loads(broken.stdout)["notes"])


def test_healthctl_what_if_measures_in_the_controllers_gathered_logs(record, gathered):
    _measured_as_expected(_what_if(record[2]))
