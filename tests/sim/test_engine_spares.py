"""healthd-sim with other users' work in the job's partition and healthd's real hot-spare pool
(`policy.spares`, the controller's spare step on SimSlurm), and the sweep over a field's values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from healthd.sim import cli, engine, scenario


def days(s: scenario.Scenario, n: float) -> scenario.Scenario:
    return dataclasses.replace(s, days=n)


def test_other_users_work_fills_the_free_nodes_and_the_job_waits_for_one_to_come_free():
    # The lab's rule on the same seeds, with and without other work: the faults, in running time, are
    # the same stream, and the job only loses what waiting for a node costs.
    lab = days(scenario.load("baseline"), 7)
    shared = days(scenario.load_with("shared-partition", {"healthd.mode": "none",
                                                          "fleet.groups": [{"count": 132, "mtbf_hours": 3000}]}), 7)
    waits = []
    for seed in (1, 2, 3):
        a, b = engine.run(lab, seed), engine.run(shared, seed)
        assert a.fleet_goodput is None and b.other_gpu_s is not None and b.partial == ()
        # the pool's GPU time splits into the job's held time, other users' jobs and idle/repair time
        assert b.held_gpu_s + b.other_gpu_s <= b.pool_gpu_s + 1e-6
        assert 0 < b.other_gpu_s and 0 < b.fleet_goodput < 1
        waits.append((a.gpu_s["waiting"], b.gpu_s["waiting"]))
    assert all(wb >= wa for wa, wb in waits) and sum(wb for _, wb in waits) > sum(wa for wa, _ in waits)


def test_healthds_spare_pool_serves_removals_at_once_and_drains_no_healthy_node():
    pool = days(scenario.load("hot-spares"), 7)
    none = days(scenario.load("shared-partition"), 7)
    waited = {"pool": 0.0, "none": 0.0}
    for seed in (1, 2, 3):
        with_pool, without = engine.run(pool, seed), engine.run(none, seed)
        for r in (with_pool, without):
            assert r.partial == () and r.slurm_refused == 0
            # the job's nodes are never taken into the pool while it waits (what it keeps stays allocated)
            assert r.gpu_s["false_positive"] == 0
        assert with_pool.taken.get("spare-reserve", 0) >= 2 and with_pool.taken.get("spare-release", 0) >= 1
        assert not {"spare-reserve", "spare-release"} & set(without.taken)
        waited["pool"] += with_pool.gpu_s["waiting"]
        waited["none"] += without.gpu_s["waiting"]
    assert waited["pool"] < waited["none"]


def test_observe_mode_keeps_no_spare():
    r = engine.run(days(scenario.load_with("hot-spares", {"healthd.mode": "observe"}), 3), 1)
    assert not r.taken.get("spare-reserve") and r.would.get("spare-reserve", 0) >= 1


def test_load_with_sets_a_nested_field_and_checks_it_as_a_file():
    s = scenario.load_with("hot-spares", {"healthd.settings.policy.spares.gpu.size": 5, "fleet.other_work_hours": 6})
    assert s.healthd.settings["policy"]["spares"]["gpu"]["size"] == 5 and s.fleet.other_work_hours == 6
    assert s.healthd.settings["policy"]["spares"]["gpu"]["validated_within_h"] == 24
    with pytest.raises(scenario.ScenarioError, match="no_such"):
        scenario.load_with("baseline", {"fleet.no_such": 1})
    with pytest.raises(scenario.ScenarioError, match="size"):
        scenario.load_with("hot-spares", {"healthd.settings.policy.spares.gpu.size": -1})
    with pytest.raises(scenario.ScenarioError, match="not a mapping"):
        scenario.load_with("baseline", {"days.x": 1})


def test_sweep_runs_each_value_on_the_same_seeds_and_names_the_best(capsys):
    args = ["sweep", "shared-partition", "fleet.other_work_hours", "6", "48", "--seeds", "2", "--healthd", "none",
            "--set", "days=3"]
    assert cli.main([*args, "--format", "json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["scenario"] for d in docs] == ["shared-partition other_work_hours=6", "shared-partition other_work_hours=48"]
    best = max(docs, key=lambda d: d["fleet_goodput"])
    assert cli.main([*args, "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"best fleet.other_work_hours: {best['scenario'].rsplit('=', 1)[1]} " in out
    assert f"{best['fleet_goodput'] * 100:.1f}%" in out
    assert cli.main(["run", "baseline", "--seeds", "1", "--set", "fleet.no_such=1"]) == 2


def test_a_run_with_the_spare_pool_is_the_same_on_the_same_seed():
    # the pool's revalidations run on the controller's validation threads: settled at each round
    s = days(scenario.load("hot-spares"), 4)
    a, b = engine.run(s, 5), engine.run(s, 5)
    assert a.taken.get("spare-validate", 0) >= 2
    assert (a.gpu_s, a.taken, a.refused, a.other_gpu_s) == (b.gpu_s, b.taken, b.refused, b.other_gpu_s)
