"""healthd-sim through the controller seam: the real agent classification and control round
(healthd.sim.fleet.SimController on healthd.sim.slurm.SimSlurm) decide which nodes leave the job."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.sim import engine, scenario


def mode(s: scenario.Scenario, m: str, days: float = 5.0) -> scenario.Scenario:
    return dataclasses.replace(s, days=days, healthd=dataclasses.replace(s.healthd, mode=m))


def test_in_auto_mode_the_real_controller_takes_out_what_the_lab_removes_so_goodput_is_the_labs():
    # The lab's causes that send a node to repair show as an Xid 79, an Xid 48, a fatal NVLink Xid 74
    # (healthd drains each: tier 1) or a host that goes down (Slurm marks it down); a collective hang
    # or a job-level fault shows nothing on a node. So the same nodes leave, at the same times.
    base = scenario.load("baseline")
    for seed in (1, 2):
        lab = engine.run(mode(base, "none"), seed, keep_faults=True)
        auto = engine.run(mode(base, "auto"), seed, keep_faults=True)
        assert auto.remediation == "controller (auto)"
        assert auto.faults == lab.faults and auto.partial == ()
        assert auto.goodput == pytest.approx(lab.goodput, abs=1e-12)
        drained = auto.taken.get("drain", 0) + auto.taken.get("drain-and-requeue", 0)
        by_healthd = sum(1 for _, cause, _ in lab.faults if cause in ("gpu_xid79", "gpu_memory", "fabric_link"))
        assert drained == by_healthd > 0


def test_user_code_xids_interrupt_the_job_but_never_drain_a_node():
    # Xid 13 is user code in healthd's catalog (tier 3): each one is the job's own crash, charged to the
    # job; the real agent and round take no node out.
    base = scenario.load("baseline")
    user = scenario.Cause(name="user_xid13", share=1.0, detect_minutes=(1.0, 1.0), repair=False, attribution="user",
                          input=scenario.AgentInputSpec("xid", 13))
    s = dataclasses.replace(mode(base, "auto", days=3), node_causes=(user,), job_causes=(),
                            job_mtbi_hours=float("inf"),
                            fleet=dataclasses.replace(base.fleet, groups=(scenario.NodeGroup(132, 300.0),)))
    r = engine.run(s, 1)
    assert r.interruptions >= 3 and r.partial == ()
    assert not r.taken and not r.would and r.gpu_s["false_positive"] == 0 and r.gpu_s["waiting"] == 0


def test_bad_controller_settings_in_a_scenario_are_a_scenario_error():
    text = "base: baseline\nname: x\nhealthd: {mode: auto, settings: {policy: {no_such_key: 1}}}\n"
    with pytest.raises(scenario.ScenarioError, match="no_such_key"):
        scenario.load_text(text, "x.yaml")


def test_observe_mode_drains_nothing_records_what_auto_would_do_and_the_broken_nodes_cost_goodput():
    base = scenario.load("baseline")
    auto = engine.run(mode(base, "auto", days=10), 1, keep_faults=True)
    observe = engine.run(mode(base, "observe", days=10), 1, keep_faults=True)
    assert not {"drain", "drain-and-requeue"} & set(observe.taken)
    assert set(observe.would) <= {"drain", "drain-and-requeue"} and sum(observe.would.values()) >= 1
    # each write observe mode would have made is recorded once, refused by the mode gate
    assert observe.refused.get("mode") == sum(observe.would.values())
    # a node left broken fails the job each time it restarts, until a person drains it
    assert observe.taken["operator-drain"] >= 1
    assert observe.interruptions > auto.interruptions and observe.goodput < auto.goodput
    assert observe.faults[0] == auto.faults[0]


def test_without_an_operator_a_broken_node_fails_the_job_until_the_end():
    base = scenario.load("baseline")
    s = mode(base, "observe", days=5)
    s = dataclasses.replace(s, healthd=dataclasses.replace(s.healthd, operator_minutes=None))
    r = engine.run(s, 1)
    with_operator = engine.run(mode(base, "observe", days=5), 1)
    assert "operator-drain" not in r.taken and r.partial == ()
    assert r.goodput <= with_operator.goodput


def test_a_leaf_switch_burst_costs_no_false_positive_with_the_breaker_and_drains_healthy_nodes_without():
    with_breaker = dataclasses.replace(scenario.load("leaf-burst"), days=14)
    without = dataclasses.replace(scenario.load("leaf-burst-no-breaker"), days=14)
    seed = next(s for s in range(1, 20)
                if any(c == "leaf_link" for _, c, _ in engine.run(dataclasses.replace(with_breaker, healthd=dataclasses.replace(
                    with_breaker.healthd, mode="none")), s, keep_faults=True).faults))
    a, b = engine.run(with_breaker, seed), engine.run(without, seed)
    assert a.refused.get("breaker", 0) > 0 and a.gpu_s["false_positive"] == 0
    assert b.gpu_s["false_positive"] > 0 and b.taken.get("drain", 0) + b.taken.get("drain-and-requeue", 0) >= 16
    assert a.partial == () == b.partial
