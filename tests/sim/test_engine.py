"""healthd-sim's engine: determinism, common random numbers, metamorphic properties, and conservation
through healthd.goodput (the simulator has no scorer of its own)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from healthd import goodput
from healthd.sim import engine, scenario
from healthd.sim.job import T0

BASE = scenario.load("baseline")


def short(s: scenario.Scenario, days: float = 7.0, **job: object) -> scenario.Scenario:
    return dataclasses.replace(s, days=days, job=dataclasses.replace(s.job, **job))


def with_groups(s: scenario.Scenario, *groups: scenario.NodeGroup) -> scenario.Scenario:
    return dataclasses.replace(s, fleet=dataclasses.replace(s.fleet, groups=groups))


def test_the_same_seed_gives_the_same_log_and_result_and_another_seed_does_not():
    s = short(BASE)
    logs: list[list[str]] = [[], [], []]
    a = engine.run(s, 7, sink=logs[0].append)
    b = engine.run(s, 7, sink=logs[1].append)
    c = engine.run(s, 8, sink=logs[2].append)
    assert logs[0] == logs[1] and a == b
    assert logs[0] != logs[2] and a.goodput != c.goodput


def test_the_log_is_read_whole_by_healthds_accounting_and_its_categories_sum_to_held_time():
    for name in ("baseline", "no-spares", "combined"):
        s = short(scenario.load(name), days=10)
        for seed in (1, 2, 3):
            lines: list[str] = []
            r = engine.run(s, seed, sink=lines.append)
            acc = goodput.account(goodput.parse_log("\n".join(lines) + "\n"), now=T0 + s.days * 86400)
            assert r.partial == () and acc.problems == ()
            gpus = s.job.nodes * s.job.gpus_per_node
            # the job holds its GPUs for the whole run: held is exactly days x GPUs
            assert acc.held_gpu_s == pytest.approx(s.days * 86400 * gpus, rel=1e-9)
            assert sum(acc.gpu_s.values()) == pytest.approx(acc.held_gpu_s, rel=1e-9)
            assert all(v >= -1e-6 for v in acc.gpu_s.values())
            assert r.goodput == acc.goodput and r.interruptions == acc.interruptions


def test_a_requeued_job_waits_queued_not_held():
    no_spares = scenario.load("no-spares")
    held = short(no_spares, days=10)
    queued = short(no_spares, days=10, hold_while_waiting=False)
    a, b = engine.run(held, 3), engine.run(queued, 3)
    assert b.held_gpu_s < a.held_gpu_s
    assert b.gpu_s["waiting"] == 0 and a.gpu_s["waiting"] > 0
    assert sum(b.gpu_s.values()) == pytest.approx(b.held_gpu_s, rel=1e-9)


def test_policies_compared_on_one_seed_see_the_same_faults():
    # No cause removes a node here, so the job keeps its nodes and the faults (cause and node, in order)
    # depend only on running time: a change of detection time or restart must not change them.
    causes = tuple(dataclasses.replace(c, repair=False) for c in BASE.node_causes)
    s = dataclasses.replace(short(BASE, days=14), node_causes=causes)
    slow = dataclasses.replace(s, node_causes=tuple(dataclasses.replace(c, detect_minutes=(45.0, 45.0)) for c in causes))
    other = short(s, days=14, restart_minutes=60.0)
    for seed in (1, 2, 3, 4):
        runs = [engine.run(x, seed, keep_faults=True) for x in (s, slow, other)]
        seqs = [[(cause, nodes) for _, cause, nodes in r.faults] for r in runs]
        n = min(len(q) for q in seqs)
        assert n >= 10
        assert seqs[0][:n] == seqs[1][:n] == seqs[2][:n]
        # and the slower policy loses goodput on every seed
        assert runs[1].goodput < runs[0].goodput


def test_the_labs_first_faults_are_the_same_under_every_detection_time():
    fast = scenario.load("fast-hang-detection")
    for seed in range(1, 6):
        a = engine.run(short(BASE), seed, keep_faults=True)
        b = engine.run(short(fast), seed, keep_faults=True)
        assert (a.faults[0][1], a.faults[0][2]) == (b.faults[0][1], b.faults[0][2])
        assert a.faults[0][0] == b.faults[0][0]


def test_a_node_outside_the_jobs_pool_that_never_fails_changes_nothing():
    s = short(BASE, days=14)
    plus = with_groups(s, *s.fleet.groups, scenario.NodeGroup(count=3, mtbf_hours=1e9, label="other", pool=False))
    for seed in (1, 2, 3):
        assert engine.run(s, seed).goodput == engine.run(plus, seed).goodput


def test_doubling_the_mtbf_never_lowers_mean_goodput():
    s = short(BASE, days=14)
    twice = with_groups(s, *(dataclasses.replace(g, mtbf_hours=g.mtbf_hours * 2) for g in s.fleet.groups))
    seeds = range(1, 16)
    a = [engine.run(s, seed).goodput for seed in seeds]
    b = [engine.run(twice, seed).goodput for seed in seeds]
    assert statistics.fmean(b) > statistics.fmean(a)


def test_a_save_durable_later_never_keeps_more_work_on_the_same_seed():
    # The blocking part is the same, so the timeline is the same; only what a restart restores changes.
    s = short(scenario.load("async-checkpoint"), days=14)
    late = short(s, days=14, durable_after_minutes=10.0)
    lost_more = 0
    for seed in range(1, 6):
        a, b = engine.run(s, seed), engine.run(late, seed)
        assert b.gpu_s["productive"] <= a.gpu_s["productive"] + 1e-6
        assert b.held_gpu_s == pytest.approx(a.held_gpu_s)
        lost_more += b.gpu_s["lost"] > a.gpu_s["lost"] + 1
    assert lost_more > 0


def test_the_engine_keeps_no_history_unless_asked():
    e = engine.Engine(short(BASE), 1)
    r = e.run()
    assert r.faults == () and e._lines == []
    assert len(e._heap) < 10
