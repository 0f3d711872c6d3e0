"""Stragglers and hangs in healthd-sim through the agent's real in-band path: the simulated job's ranks
write rings (healthd.sim.agentinput), the node's real agent reads them, the real controller compares
the ranks of the nodes that report and decides (healthd.sim.control, healthd.sim.rings)."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.sim import engine
from healthd.sim.agentinput import JobEnded, JobRanks, SimAgent, Slowdown
from healthd.sim.control import ControllerSeam
from healthd.sim.fleet import SimController
from healthd.sim.job import T0, slowed_step
from healthd.sim.scenario import load, load_text

# more stragglers and hangs than the packaged scenario, so that a few short runs see several
DENSE = """
base: stragglers
name: stragglers-dense
days: 5
fleet:
  groups:
    - {label: default, count: 132, mtbf_hours: 1500}
node_causes:
  gpu_xid79: {share: 0.10}
  gpu_memory: {share: 0.05}
  gpu_straggler: {share: 0.40}
"""


@pytest.fixture
def seen(monkeypatch):
    """What the real controller's in-band view held after each round, and each fault the seam got."""
    out: dict[str, list] = {"flags": [], "hangs": [], "faults": []}
    round_, fault = SimController.round, ControllerSeam.fault

    def spy_round(self, now):
        r = round_(self, now)
        view = self.controller.inband_round
        out["flags"] += [(f.node, f.state.gpu, f.tier, now) for f in view.flags]
        out["hangs"] += [(h.job, h.hang.stalled_s, now) for h in view.hangs]
        return r

    def spy_fault(self, now, f):
        out["faults"].append((T0 + now, f.cause.name, f.nodes, f.gpu))  # the controller's clock
        return fault(self, now, f)

    monkeypatch.setattr(SimController, "round", spy_round)
    monkeypatch.setattr(ControllerSeam, "fault", spy_fault)
    return out


def dense(**changes):
    s = load_text(DENSE, "dense")
    return dataclasses.replace(s, **changes) if changes else s


# --------------------------------------------------------------------------- the agent on simulated rings


def agent_findings(agent: SimAgent, now: float) -> list[str]:
    return [f["id"] for f in agent.feed((), now)["findings"] if f["id"].startswith("inband.")]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_agents_own_detector_names_the_slowed_gpu_on_simulated_rings_and_nothing_without_a_slowdown(tmp_path, seed):
    slow, steady = SimAgent("gpu0001", run_dir=str(tmp_path)), SimAgent("gpu0002", run_dir=str(tmp_path))
    for a, factor in ((slow, 1.3), (steady, 1.0)):
        a.feed([JobRanks("7", 8, 0, 0.0, 10.0, seed=seed)], 60.0)
        a.feed([JobRanks("7", 8, 0, 0.0, 10.0, (Slowdown(1800.0, factor, 5),), seed=seed)], 1800.0)
    named = {t: agent_findings(slow, float(t)) for t in range(1800, 4200, 120)}
    assert not any(agent_findings(steady, float(t)) for t in range(1800, 4200, 120))
    first = min(t for t, ids in named.items() if ids)
    assert named[first] == ["inband.straggler:gpu5"] and first - 1800 <= 1800  # within half an hour
    assert all(ids == [] for t, ids in named.items() if t < 1800 + 2 * 25 * 10)  # two slow windows first


def test_the_agents_own_detector_names_a_hang_and_the_rank_behind(tmp_path):
    a = SimAgent("gpu0001", run_dir=str(tmp_path))
    a.feed([JobRanks("7", 8, 0, 0.0, 10.0, seed=1)], 600.0)
    a.feed([JobRanks("7", 8, 0, 0.0, 10.0, stopped=600.0, stuck_gpu=2, seed=1)], 600.0)
    found = None
    for t in range(630, 1800, 30):
        doc = a.feed((), float(t))
        if any(f["id"] == "inband.hang:7" for f in doc["findings"]):
            found = (t - 600, doc["inband"]["jobs"][0]["hang"])
            break
    assert found is not None and found[0] <= 180, found
    assert found[1]["behind"] == [2] and found[1]["phases"]["2"] == "compute"
    a.feed([JobEnded("7")], 1900.0)  # the epilog: nothing left to judge
    assert not any(f["id"].startswith("inband.") for f in a.feed((), 1930.0)["findings"])


def test_a_step_of_the_job_is_its_slowest_ranks():
    assert slowed_step(10.0, 1.0) == 10.0
    assert slowed_step(10.0, 1.3) == pytest.approx(12.1)
    assert slowed_step(10.0, 0.5) == 10.0  # a faster rank does not speed the job up


# --------------------------------------------------------------------------- through the real controller


def test_a_straggler_is_flagged_by_the_real_controller_on_its_node_and_gpu_and_drained(seen):
    runs = [engine.run(dense(), seed, keep_faults=True) for seed in (1, 2)]
    slowed = {(nodes[0], gpu) for _, cause, nodes, gpu in seen["faults"] if cause == "gpu_straggler"}
    assert len(slowed) >= 3, seen["faults"]
    flagged = {(node, gpu) for node, gpu, _, _ in seen["flags"]}
    assert flagged and flagged <= slowed  # never a rank the fault did not slow
    # each flag is tier 2: the GPU's hardware thermal slowdown, begun with it, corroborates it
    assert {tier for *_, tier, _ in seen["flags"]} == {2}
    onset = {(nodes[0], gpu): t for t, cause, nodes, gpu in seen["faults"] if cause == "gpu_straggler"}
    for key in flagged:
        first = min(now for node, gpu, _, now in seen["flags"] if (node, gpu) == key)
        assert first - onset[key] <= 1800, (key, first - onset[key])
    assert sum(r.taken.get("drain", 0) for r in runs) >= len(flagged)
    assert all(r.partial == () for r in runs)
    assert sum(r.gpu_s.get("straggler", 0.0) for r in runs) > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_straggler_is_flagged_on_ranks_that_no_fault_slowed_and_every_hang_is_found(seen, seed):
    r = engine.run(dataclasses.replace(load("baseline-auto"), days=5), seed, keep_faults=True)
    hangs = [t for t, cause, *_ in seen["faults"] if cause == "collective_hang"]
    assert hangs, "no hang to read rings for on this seed"
    assert seen["flags"] == []
    found = sorted({now for _, _, now in seen["hangs"]})
    for t in hangs:
        # named by the in-band detector within minutes, where the watchdog takes 30
        first = min((now for now in found if now >= t), default=None)
        assert first is not None and first - t <= 600, (t, first)
    assert r.partial == ()


def test_straggler_handling_on_and_off_see_the_same_faults_and_off_leaves_the_slow_node_in_the_job(seen):
    on_s, off_s = dense(), load_text(DENSE.replace("base: stragglers\n", "base: stragglers-off\n"), "dense-off")
    for seed in (1, 2):
        on, off = engine.run(on_s, seed, keep_faults=True), engine.run(off_s, seed, keep_faults=True)
        first = min(t for t, cause, _ in on.faults if cause == "gpu_straggler")
        # the same faults up to the first straggler's drain; after it the job's nodes differ
        assert [f for f in on.faults if f[0] <= first] == [f for f in off.faults if f[0] <= first]
        assert off.refused.get("mode", 0) >= 1 and off.taken.get("drain", 0) < on.taken.get("drain", 0)
        assert off.gpu_s.get("straggler", 0.0) > on.gpu_s.get("straggler", 0.0)
        assert on.partial == () and off.partial == ()


def test_a_slowdown_moves_productive_time_to_the_straggler_category_and_a_factor_of_one_costs_nothing():
    # the lab's rule (no healthd) never takes a straggler out: the job runs at its pace to the end
    base = dataclasses.replace(dense(), healthd=dataclasses.replace(dense().healthd, mode="none"))
    cause = base.cause("gpu_straggler")

    def with_slowdown(factor):
        c = dataclasses.replace(cause, input=dataclasses.replace(cause.input, fields={"slowdown": factor}))
        return dataclasses.replace(base, node_causes=tuple(c if x.name == c.name else x for x in base.node_causes))

    for seed in (1, 2, 3):
        flat, slow = engine.run(with_slowdown(1.0), seed, keep_faults=True), engine.run(with_slowdown(1.3), seed,
                                                                                        keep_faults=True)
        assert flat.faults == slow.faults  # a straggler stops nothing: the same interruptions
        assert flat.gpu_s.get("straggler", 0.0) == 0.0
        if any(c == "gpu_straggler" for _, c, _ in slow.faults):
            assert slow.gpu_s["straggler"] > 0 and slow.goodput < flat.goodput
        assert slow.gpu_s["productive"] + slow.gpu_s.get("straggler", 0.0) == pytest.approx(flat.gpu_s["productive"])
        assert sum(slow.gpu_s.values()) == pytest.approx(slow.held_gpu_s)
