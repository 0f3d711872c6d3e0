"""healthd-sim through healthd's envelope: a user-code rule mis-tiered as hardware (the agents' catalog
overrides), a person approving in supervised mode, a rate limit a burst exceeds, a capacity floor the
fleet's faults reach. Every decision is the real agent's and the real control round's
(healthd.sim.control.ControllerSeam); these tests read what they did from the run's result, its ledger
and the simulated Slurm."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.config import parse
from healthd.controller.fleetcache import out_of_service
from healthd.controller.ledger import Ledger
from healthd.sim import engine, scenario
from healthd.sim.agentinput import catalog_of
from healthd.sim.fleet import RoundResult

REMOVALS = ("drain", "drain-and-requeue")
DRAINED_BY_HEALTHD = ("gpu_xid79", "gpu_memory", "fabric_link")
"""The baseline's causes whose agent input healthd's packaged catalog drains (tier 1)."""


def days(s: scenario.Scenario, d: float) -> scenario.Scenario:
    return dataclasses.replace(s, days=d)


def with_mode(s: scenario.Scenario, m: str) -> scenario.Scenario:
    return dataclasses.replace(s, healthd=dataclasses.replace(s.healthd, mode=m))


def with_policy(s: scenario.Scenario, **policy: Any) -> scenario.Scenario:
    raw = dict(s.healthd.settings)
    raw["policy"] = {**raw.get("policy", {}), **policy}
    return dataclasses.replace(s, healthd=dataclasses.replace(s.healthd, settings=raw))


def removals(r: engine.RunResult) -> int:
    return sum(r.taken.get(k, 0) for k in REMOVALS)


def seeds_where(s: scenario.Scenario, hit: Any, want: int, upto: int = 60) -> list[int]:
    """The first `want` seeds whose faults (under the lab's rule: a tenth of the controller's cost, and
    the same faults until healthd decides otherwise) satisfy `hit`."""
    lab = with_mode(s, "none")
    found = [seed for seed in range(1, upto) if hit(engine.run(lab, seed, keep_faults=True).faults)]
    assert len(found) >= want, "no seed shows the fault under test: the scenario changed"
    return found[:want]


def ledger_at_close(eng: engine.Engine, read: Any) -> list[Any]:
    """`read(ledger)` on the run's ledger just before the seam releases it."""
    out: list[Any] = []
    close = eng.rem.close

    def reading_close() -> None:
        out.append(read(eng.rem.sim.ledger))
        close()

    eng.rem.close = reading_close  # type: ignore[method-assign]
    return out


# ---------------------------------------------------------------------- a mis-tiered user-code rule


def test_correctly_tiered_user_xids_never_drain_and_a_mis_tiered_one_drains_healthy_nodes_at_a_tax():
    right = days(scenario.load("user-xid"), 6)
    wrong = days(scenario.load("mis-tiered-user-xid"), 6)
    assert wrong.healthd.catalog and not right.healthd.catalog
    for seed in seeds_where(right, lambda faults: any(c == "user_xid31" for _, c, _ in faults), 2):
        a = engine.run(right, seed, keep_faults=True)
        b = engine.run(wrong, seed, keep_faults=True)
        assert a.partial == () and b.partial == ()
        # correctly tiered: exactly the hardware faults drain, no user-code Xid does, no tax
        assert removals(a) == sum(1 for _, c, _ in a.faults if c in DRAINED_BY_HEALTHD)
        assert a.gpu_s["false_positive"] == 0
        # the same faults on the same seed, up to the first Xid 31 (after it the runs part: a node left)
        first = next(i for i, (_, c, _) in enumerate(a.faults) if c == "user_xid31")
        assert b.faults[:first + 1] == a.faults[:first + 1]
        # mis-tiered: every Xid 31 drains its (healthy) node as well, and the job pays a false-positive tax
        xid31 = sum(1 for _, c, _ in b.faults if c == "user_xid31")
        assert removals(b) == sum(1 for _, c, _ in b.faults if c in DRAINED_BY_HEALTHD) + xid31
        assert b.gpu_s["false_positive"] > 0


OVERRIDE = st.fixed_dictionaries({}, optional={
    "attribution": st.sampled_from(["hardware", "fabric", "storage", "software", "user", "unknown", "gpu", 3]),
    "tier": st.sampled_from([1, 2, 3, 0, 4, "1", None]),
    "action": st.sampled_from(["none", "reset-gpu-when-idle", "reboot-when-idle", "drain", "drain-and-requeue",
                               "inspect-hardware", "resume", True]),
    "ignore": st.sampled_from([True, False, "yes"]),
    "repeat": st.just(2),
})
XIDS = st.sampled_from([13, 31, 43, 48, 79, 99999, -1, "x", 0])


def agent_accepts(section: dict[str, Any]) -> bool:
    """What the agent itself does with the section in its healthd.yaml: its config reader, then its
    catalog loader."""
    try:
        s = parse(yaml.safe_dump({"catalog": section}), "healthd.yaml")
        from healthd.agent.classify.catalog import load_catalog

        load_catalog(s.catalog.path, s.catalog.overrides)
    except ValueError:
        return False
    return True


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(XIDS, OVERRIDE, max_size=3))
def test_a_scenarios_catalog_overrides_load_exactly_when_the_agent_would_load_them(overrides):
    section = {"overrides": overrides}
    text = yaml.safe_dump({"base": "user-xid", "name": "x", "healthd": {"catalog": section}})
    try:
        s = scenario.load_text(text, "x.yaml")
    except scenario.ScenarioError as e:
        assert "healthd.catalog" in str(e)
        assert not agent_accepts(section)
        return
    assert agent_accepts(section)
    catalog = catalog_of(s.healthd.catalog)
    for xid, o in overrides.items():
        row = catalog.lookup(xid)
        for key in ("attribution", "tier", "action"):
            if o.get(key) is not None:
                assert getattr(row, key) == o[key]


def test_a_catalog_path_in_a_scenario_is_refused_by_name():
    with pytest.raises(scenario.ScenarioError, match=r"healthd\.catalog\.path"):
        scenario.load_text("base: user-xid\nname: x\nhealthd: {catalog: {path: /etc/healthd/xid.yaml}}\n", "x.yaml")


# ---------------------------------------------------------------------- approvals in supervised mode


def test_with_a_person_approving_supervised_lies_between_observe_and_auto_and_the_wait_is_decision_time():
    approved = days(scenario.load("baseline-supervised-approved"), 6)
    assert approved.healthd.mode == "supervised" and approved.healthd.approve_minutes == 30
    observe, auto = with_mode(approved, "observe"), with_mode(approved, "auto")
    nobody = dataclasses.replace(approved, healthd=dataclasses.replace(approved.healthd, approve_minutes=None))
    means = {"observe": 0.0, "approved": 0.0, "auto": 0.0}
    for seed in (1, 2):
        eng = engine.Engine(approved, seed, keep_faults=True)
        seen = ledger_at_close(eng, lambda led: (
            led.query("SELECT a.node, d.incident_id FROM actions a JOIN decisions d ON d.id = a.decision_id "
                      "WHERE a.status = 'applied' AND a.kind IN ('drain', 'drain-and-requeue')"),
            led.query("SELECT d.node, d.incident_id, d.decided_at, p.verdict FROM approvals p "
                      "JOIN decisions d ON d.id = p.decision_id"),
            {n for n in led.holds() if led.active_reintegration(n) is None}))
        r = eng.run()
        o, a, n = engine.run(observe, seed), engine.run(auto, seed), engine.run(nobody, seed)
        assert r.partial == ()
        applied, approvals, held_idle = seen[0]
        # every removal healthd applied was approved by the person, on the same node and incident
        assert applied and {(node, inc) for node, inc in applied} <= {(node, inc) for node, inc, _, v in approvals
                                                                    if v == "approve"}
        assert r.taken["approval"] == len(approvals) and removals(r) == len(applied)
        # the person records each repair (no reintegration starts by itself outside auto mode): a node
        # healthd still holds with none under way is one still in repair
        assert held_idle <= eng.in_repair and r.taken["repaired"] >= 1
        # the job waits for the approval: decision time, at most the 30 minutes a removal, none in auto
        assert 0 < r.gpu_s["decision"] <= len(approvals) * 30 * 60 * 1024
        assert a.gpu_s["decision"] == 0 and n.gpu_s["decision"] == 0
        # nobody approving: the person of operator_minutes drains instead
        assert removals(n) == 0 and n.taken["operator-drain"] >= 1
        assert o.goodput <= r.goodput <= a.goodput
        for k, v in (("observe", o), ("approved", r), ("auto", a)):
            means[k] += v.goodput / 2
    assert means["observe"] < means["approved"] < means["auto"]


def test_approvals_only_apply_to_waiting_decisions_and_auto_mode_is_unchanged_by_them():
    # in auto mode a T1 removal never waits, so a person who approves changes nothing
    base = days(scenario.load("baseline-auto"), 5)
    keen = dataclasses.replace(base, healthd=dataclasses.replace(base.healthd, approve_minutes=0))
    for seed in (1, 2):
        a, b = engine.run(base, seed, keep_faults=True), engine.run(keen, seed, keep_faults=True)
        assert a.faults == b.faults and a.goodput == b.goodput and a.taken == b.taken and "approval" not in b.taken


# ---------------------------------------------------------------------- rate limit


def applied_times(led: Ledger) -> list[float]:
    return [t for (t,) in led.query("SELECT applied_at FROM actions WHERE status = 'applied' "
                                    "AND kind IN ('drain', 'drain-and-requeue', 'reboot-asap') ORDER BY applied_at")]


def test_a_burst_over_the_rate_limit_is_refused_by_the_rate_limit_gate_and_no_hour_holds_more():
    s = days(scenario.load("rate-limited"), 6)
    limit = s.healthd.settings["policy"]["max_actions_per_hour"]
    burst = next(b for b in s.bursts if b.name == "bad_driver")
    assert burst.size is not None and burst.size > limit
    loose = with_policy(s, max_actions_per_hour=100, max_actions_per_partition_per_hour=100)
    for seed in seeds_where(s, lambda faults: any(len(n) == burst.size for _, _, n in faults), 2):
        eng = engine.Engine(s, seed, keep_faults=True)
        times = ledger_at_close(eng, applied_times)
        r = eng.run()
        free = engine.run(loose, seed, keep_faults=True)
        assert r.partial == () and r.refused.get("rate-limit", 0) >= burst.size - limit
        # no hour holds more removals than the limit (the gate counts the hour before each write)
        t = times[0]
        assert t and all(sum(1 for u in t if x - 3600 < u <= x) <= limit for x in t)
        # without the limit the same burst is drained at once: nothing refused, the faults the same until then
        assert "rate-limit" not in free.refused
        first = next(i for i, (_, _, n) in enumerate(r.faults) if len(n) == burst.size)
        assert free.faults[:first + 1] == r.faults[:first + 1]


# ---------------------------------------------------------------------- capacity floor


def below_floor(s: scenario.Scenario, seed: int, floor: int) -> tuple[engine.RunResult, list[tuple[float, int]]]:
    """One run, and each round after which healthd had just removed a node and the `gpu` partition held
    fewer than `floor` healthy nodes (Slurm shows it drained, down, not responding or rebooting, or
    healthd holds it)."""
    eng = engine.Engine(s, seed)
    seam = eng.rem
    count = seam._count
    crossings: list[tuple[float, int]] = []

    def checked(r: RoundResult) -> None:
        if any(o.kind in REMOVALS for o in r.applied):
            held = set(seam.sim.ledger.holds())
            healthy = sum(1 for i in seam.slurm.nodes() if not out_of_service(i) and i.name not in held)
            if healthy < floor:
                crossings.append((r.now, healthy))
        count(r)

    seam._count = checked
    return eng.run(), crossings


def test_the_capacity_floor_is_never_crossed_by_healthd_and_refusals_are_counted_by_the_capacity_gate():
    packaged = scenario.load("capacity-floor")
    assert packaged.healthd.settings["policy"]["capacity_floors"] == {"gpu": 130}
    # one node above the packaged floor, so that a short run reaches it
    floor = 131
    s = with_policy(days(packaged, 7), capacity_floors={"gpu": floor})
    refused = 0
    for seed in (2, 4):
        r, crossings = below_floor(s, seed, floor)
        assert r.partial == () and crossings == [], f"seed {seed}: healthd took the partition below {floor}"
        refused += r.refused.get("capacity", 0)
    assert refused > 0
    # the same check without the floor: healthd's own drains take the partition below it
    r, crossings = below_floor(with_policy(s, capacity_floors={}), 4, floor)
    assert crossings and "capacity" not in r.refused
