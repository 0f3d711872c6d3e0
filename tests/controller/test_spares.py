"""healthd.controller.spares: the pool to keep, the spare to release, revalidation; gated as any write.

Hypothesis builds fleets (node states and flags, reports, floors, held spares, topology.conf and rack
groups) and checks what must hold whatever the fleet: no reserve takes a partition below its floor,
none takes a node in a reservation, drained, busy or unhealthy, a pool never exceeds its size, and a
spare under the removed node's leaf switch wins over one in its rack group."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from healthd.config import ConfigError
from healthd.controller.actions import ACTIONS
from healthd.controller.config import parse_controller_settings
from healthd.controller.gates import GateContext, gate_one
from healthd.controller.policy import ControllerPolicySettings, FleetView, LedgerView
from healthd.controller.spares import NOT_SPARE_FLAGS, PLACEMENTS, Spare, SparePool, SpareWorld, decide, fit, keep_pool, owed, \
    recorded_spares, release_for, revalidate, revalidation_due, validations, world_of
from healthd.slurm.backend import NodeInfo
from healthd.slurm.topology import parse_topology

NOW = 1_800_000_000.0
H = 3600.0
TOPO = parse_topology("SwitchName=s1 Nodes=n[01-04]\nSwitchName=s2 Nodes=n[05-08]\nSwitchName=top Switches=s[1-2]\n")
RACKS = {"r1": frozenset({"n01", "n02", "n03", "n04", "n05"}), "r2": frozenset({"n06", "n07", "n08"})}
NAMES = [f"n{i:02d}" for i in range(1, 9)]


def idle(name: str, *flags: str, state: str = "idle") -> NodeInfo:
    return NodeInfo(name=name, state=state, flags=frozenset(flags), partitions=("gpu",))


def world(**kw) -> SpareWorld:
    base = dict(nodes={n: idle(n) for n in NAMES}, partitions={"gpu": frozenset(NAMES)}, healthy=frozenset(NAMES),
                topology=TOPO, racks=RACKS)
    base.update(kw)
    return SpareWorld(**base)


def spare(node: str, validated: float | None = NOW - H, partition: str = "gpu") -> Spare:
    return Spare(node, partition, f"healthd_spare_{partition}_{node}", NOW - 2 * H, validated)


def with_spares(w: SpareWorld, *spares: Spare) -> SpareWorld:
    nodes = dict(w.nodes)
    for s in spares:
        nodes[s.node] = dataclasses.replace(nodes[s.node], flags=nodes[s.node].flags | {"MAINT", "RESERVED"})
    return dataclasses.replace(w, nodes=nodes, spares={s.node: s for s in spares})


# --------------------------------------------------------------------------- the pool


def test_the_pool_is_spread_over_the_leaf_switches():
    out = keep_pool({"gpu": SparePool(size=2)}, world(), NOW)
    assert [d.kind for d in out] == ["spare-reserve", "spare-reserve"]
    assert {TOPO.leaf_of(d.node) for d in out} == {"s1", "s2"}
    d = out[0]
    assert d.target == f"healthd_spare_gpu_{d.node}" and d.detail["minutes"] == 24 * 60
    assert "under leaf switch" in d.evidence[0].text and "0 of 2 spares" in d.evidence[1].text


def test_a_full_pool_proposes_nothing():
    w = with_spares(world(), spare("n01"), spare("n05"))
    assert keep_pool({"gpu": SparePool(size=2)}, w, NOW) == ()


def test_the_most_recently_validated_node_is_taken_first_on_a_leaf():
    w = world(validated={"n03": NOW - 5 * H, "n02": NOW - H}, topology=parse_topology(""), racks={})
    (d,) = keep_pool({"gpu": SparePool(size=1)}, w, NOW)
    assert d.node == "n02" and d.detail["validated_at"] == NOW - H


def test_the_capacity_floor_limits_the_pool():
    pools = {"gpu": SparePool(size=3)}
    assert len(keep_pool(pools, world(floors={"gpu": 6}), NOW)) == 2
    out_n08 = world(floors={"gpu": 6}, out_of_service=frozenset({"n08"}))
    (d,) = keep_pool(pools, out_n08, NOW)
    assert d.node != "n08" and "out of service" in fit("n08", out_n08)
    assert keep_pool(pools, world(floors={"gpu": 8}), NOW) == ()


def test_below_the_floor_spares_are_given_back():
    w = with_spares(world(floors={"gpu": 6}, out_of_service=frozenset({"n08"})), spare("n01"), spare("n05", NOW - 3 * H))
    (d,) = keep_pool({"gpu": SparePool(size=2)}, w, NOW)
    assert (d.kind, d.node, d.target) == ("spare-release", "n05", "healthd_spare_gpu_n05")  # the least validated
    assert "below its capacity floor 6" in d.reason


def test_a_spare_no_longer_fit_or_over_the_size_is_released():
    w = with_spares(world(), spare("n01"), spare("n02"), spare("n05"))
    w = dataclasses.replace(w, nodes={**w.nodes, "n02": idle("n02", "DRAIN", "MAINT", "RESERVED")})
    out = keep_pool({"gpu": SparePool(size=1)}, w, NOW)
    assert {(d.kind, d.node) for d in out} == {("spare-release", "n02"), ("spare-release", "n05")}
    assert any("shows DRAIN" in d.reason for d in out)


@pytest.mark.parametrize("node, why", [
    (idle("n01", "RESERVED"), "shows RESERVED"),  # someone else's reservation
    (idle("n01", "MAINTENANCE", "RESERVED"), "shows MAINTENANCE+RESERVED"),  # a MAINT one, as Slurm 22.05 shows it
    (idle("n01", "DRAIN"), "shows DRAIN"),
    (idle("n01", state="allocated"), "is allocated"),
    (idle("n01", "NOT_RESPONDING", state="down"), "shows NOT_RESPONDING"),
])
def test_a_node_in_use_or_out_of_service_is_never_a_spare(node, why):
    w = world(nodes={"n01": node}, partitions={"gpu": frozenset({"n01"})})
    assert why in fit("n01", w)
    assert keep_pool({"gpu": SparePool(size=1)}, w, NOW) == ()


def test_a_spare_running_its_validation_stays_a_spare():
    w = with_spares(world(), spare("n01"))
    w = dataclasses.replace(w, nodes={**w.nodes, "n01": idle("n01", "MAINT", "RESERVED", state="allocated")})
    assert fit("n01", w) == ""


def test_a_spare_given_back_is_left_to_its_job_for_a_while():
    w = world(released_at={"n01": NOW - 60}, topology=parse_topology(""), racks={})
    (d,) = keep_pool({"gpu": SparePool(size=1)}, w, NOW)
    assert d.node == "n02"
    (d,) = keep_pool({"gpu": SparePool(size=1)}, dataclasses.replace(w, released_at={"n01": NOW - 601}), NOW)
    assert d.node == "n01"


def test_a_spare_whose_agent_is_unheard_stays_one_whose_report_is_unhealthy_goes():
    w = with_spares(world(healthy=frozenset()), spare("n01"), spare("n05"))  # a controller just restarted
    assert keep_pool({"gpu": SparePool(size=2)}, w, NOW) == ()
    (d,) = keep_pool({"gpu": SparePool(size=2)}, dataclasses.replace(w, unhealthy=frozenset({"n05"})), NOW)
    assert (d.kind, d.node) == ("spare-release", "n05") and "not healthy" in d.reason


def test_a_spare_is_given_back_before_its_reservation_ends():
    pool = {"gpu": SparePool(size=1, validated_within_h=2)}
    w = with_spares(world(), spare("n01"))  # reserved two hours ago: its reservation ends at NOW
    assert keep_pool(pool, w, NOW - 301) == ()
    release, reserve = keep_pool(pool, w, NOW - 299)
    assert (release.kind, release.node) == ("spare-release", "n01") and "ends in 299 s" in release.reason
    assert reserve.kind == "spare-reserve" and reserve.node != "n01"


def test_unhealthy_or_busy_nodes_are_not_taken():
    w = world(healthy=frozenset({"n01", "n02"}), busy=frozenset({"n01"}))
    (d,) = keep_pool({"gpu": SparePool(size=3)}, w, NOW)
    assert d.node == "n02"


# --------------------------------------------------------------------------- release


def test_a_removed_node_gets_the_spare_under_its_leaf_switch():
    w = with_spares(world(), spare("n04"), spare("n05"))  # n05: rack r1 like n02, but leaf s2
    d = release_for("n02", "17", {"gpu": SparePool()}, w, NOW)
    assert d is not None and (d.kind, d.node, d.incident) == ("spare-release", "n04", "17")
    assert "under the same leaf switch s1" in d.reason and d.target == "healthd_spare_gpu_n04"


def test_else_the_spare_in_its_rack_group():
    w = with_spares(world(), spare("n05"), spare("n08"))
    d = release_for("n02", "17", {"gpu": SparePool()}, w, NOW)
    assert d is not None and d.node == "n05" and "in the same rack group r1" in d.reason


def test_else_the_nearest_validated_spare_by_default():
    w = with_spares(world(), spare("n08"))
    d = release_for("n02", "17", {"gpu": SparePool()}, w, NOW)
    assert d is not None and (d.kind, d.node) == ("spare-release", "n08")
    assert "none shares its leaf switch or rack group" in d.reason


def test_in_place_placement_releases_no_spare_elsewhere_and_the_decision_says_why():
    w = with_spares(world(), spare("n08"))
    d = release_for("n02", "17", {"gpu": SparePool(placement="in-place")}, w, NOW)
    assert d is not None and (d.kind, d.about, d.node) == ("none", "spare-release", "n02")
    assert "leaf switch s1, rack group r1" in d.note and "1 validated spare(s) elsewhere" in d.note


def test_a_spare_not_validated_within_h_is_not_released():
    w = with_spares(world(), spare("n04", validated=NOW - 25 * H), spare("n03", validated=None))
    d = release_for("n02", "17", {"gpu": SparePool(validated_within_h=24)}, w, NOW)
    assert d is not None and d.kind == "none"


def test_no_pool_no_decision():
    assert release_for("n02", "17", {"cpu": SparePool()}, world(), NOW) is None


def test_two_removals_take_two_spares():
    w = with_spares(world(), spare("n03"), spare("n04"))
    first = release_for("n01", "1", {"gpu": SparePool()}, w, NOW)
    second = release_for("n02", "2", {"gpu": SparePool()}, w, NOW, taken=frozenset({first.node}))
    assert {first.node, second.node} == {"n03", "n04"}


def test_revalidation_is_due_at_half_of_h():
    w = with_spares(world(), spare("n01", NOW - 11 * H), spare("n02", NOW - 13 * H), spare("n03", None))
    due = revalidation_due({"gpu": SparePool(validated_within_h=24)}, w, NOW)
    assert [s.node for s in due] == ["n03", "n02"]


# --------------------------------------------------------------------------- gated like any write


def _ctx(mode: str, floors=None) -> GateContext:
    settings = ControllerPolicySettings(mode=mode, capacity_floors=floors or {})  # type: ignore[arg-type]
    nodes = {n: idle(n) for n in NAMES}
    return GateContext(settings=settings, fleet=FleetView(nodes=nodes), ledger=LedgerView(), now=NOW,
                       out_of_service=frozenset() if floors else None)


@pytest.mark.parametrize("mode, floors, status, gate", [
    ("observe", None, "refused", "mode"),        # observe records what it would do
    ("supervised", None, "allowed", ""),         # the site configured the pool: no approval
    ("auto", {"gpu": 8}, "refused", "capacity"),
])
def test_a_reserve_passes_the_gates(mode, floors, status, gate):
    (d, *_) = keep_pool({"gpu": SparePool()}, world(), NOW)
    out = gate_one(d, _ctx(mode, floors))
    assert out.status == status and (out.gate or "") == gate, out


def test_the_action_table_rows():
    assert ACTIONS["spare-reserve"].gates == ("mode", "capacity")
    assert ACTIONS["spare-release"].call == "delete_reservation"


# --------------------------------------------------------------------------- settings


def test_spares_are_off_by_default_and_read_per_partition():
    assert parse_controller_settings("{}").policy.spares == {}
    s = parse_controller_settings("policy: {spares: {gpu: {size: 2, validated_within_h: 12, reservation: hs}}}")
    pool = s.policy.spares["gpu"]
    assert (pool.size, pool.validated_within_h, pool.reservation_for("gpu", "n01")) == (2, 12.0, "hs_n01")
    assert SparePool().reservation_for("gpu", "n01") == "healthd_spare_gpu_n01"


@pytest.mark.parametrize("text, key", [
    ("policy: {spares: {gpu: {size: -1}}}", "policy.spares.gpu"),
    ("policy: {spares: {gpu: {sizes: 1}}}", "policy.spares.gpu.sizes"),
    ("policy: {spares: {gpu: {reservation: 'a b'}}}", "policy.spares.gpu"),
    ("policy: {spares: {gpu: {validated_within_h: 0}}}", "policy.spares.gpu"),
])
def test_bad_spare_settings_name_the_key(text, key):
    with pytest.raises(ConfigError, match=f"{key}:"):
        parse_controller_settings(text, "c.yaml")


def test_every_spare_pool_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(SparePool) if f"`policy.spares.<partition>.{f.name}`" not in doc]
    assert not missing


# --------------------------------------------------------------------------- properties


FLAG_CHOICES = sorted(NOT_SPARE_FLAGS) + ["", "", "", ""]


@st.composite
def fleets(draw):
    n = draw(st.integers(2, 12))
    names = [f"g{i:02d}" for i in range(n)]
    nodes = {}
    for name in names:
        flag = draw(st.sampled_from(FLAG_CHOICES))
        state = draw(st.sampled_from(["idle", "idle", "idle", "allocated", "mixed", "down"]))
        nodes[name] = NodeInfo(name=name, state=state, flags=frozenset({flag} - {""}))
    parts = {"a": frozenset(draw(st.lists(st.sampled_from(names), min_size=1, unique=True))),
             "b": frozenset(draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))}
    leaves = draw(st.lists(st.sampled_from(["s1", "s2", "s3", None]), min_size=n, max_size=n))
    topo = parse_topology("\n".join(
        f"SwitchName={s} Nodes={','.join(x for x, leaf in zip(names, leaves, strict=True) if leaf == s)}"
        for s in sorted({leaf for leaf in leaves if leaf})))
    racks = {r: frozenset(draw(st.lists(st.sampled_from(names), unique=True))) for r in ("r1", "r2")}
    held = draw(st.lists(st.sampled_from(names), unique=True, max_size=4))
    spares = {}
    for x in held:
        p = draw(st.sampled_from(["a", "b"]))
        spares[x] = Spare(x, p, f"healthd_spare_{p}_{x}", NOW - H, draw(st.sampled_from([None, NOW - H, NOW - 30 * H])))
        nodes[x] = dataclasses.replace(nodes[x], flags=nodes[x].flags | {"RESERVED"})
    floors = {p: draw(st.integers(0, len(m))) for p, m in parts.items() if draw(st.booleans())}
    healthy = frozenset(draw(st.lists(st.sampled_from(names), unique=True)))
    w = SpareWorld(nodes=nodes, partitions=parts, spares=spares, healthy=healthy,
                   unhealthy=frozenset(draw(st.lists(st.sampled_from(sorted(set(names) - healthy) or names),
                                                     unique=True))) - healthy,
                   busy=frozenset(draw(st.lists(st.sampled_from(names), unique=True, max_size=3))),
                   out_of_service=frozenset(x for x, i in nodes.items() if i.state == "down" or "DRAIN" in i.flags),
                   floors=floors, topology=topo, racks=racks)
    pools = {p: SparePool(size=draw(st.integers(0, 4)), placement=draw(st.sampled_from(PLACEMENTS)))
             for p in draw(st.sampled_from([["a"], ["b"], ["a", "b"]]))}
    return pools, w


@hsettings(max_examples=400, deadline=None)
@given(fleets())
def test_the_pool_never_takes_a_partition_below_its_floor_nor_an_unfit_node(case):
    pools, w = case
    out = keep_pool(pools, w, NOW)
    after = dict(w.spares)
    for d in out:
        assert d.kind in ("spare-reserve", "spare-release")
        if d.kind == "spare-release":
            assert d.node in w.spares and after.pop(d.node)
        else:
            assert d.node not in after and fit(d.node, w) == ""  # never RESERVED by another, drained, busy...
            assert not {"RESERVED", "DRAIN", "MAINT"} & w.nodes[d.node].flags
            assert d.node in w.healthy and d.node not in w.busy
            after[d.node] = Spare(d.node, d.detail["partition"], d.target, NOW)
    reserved = {d.node for d in out if d.kind == "spare-reserve"}
    for p, floor in w.floors.items():
        members = w.partitions[p]
        if reserved & members:  # a partition a reserve touched ends at or above its floor
            assert len(members - w.out_of_service - set(after)) >= floor, (p, out)
    for p, pool in pools.items():
        assert sum(1 for s in after.values() if s.partition == p) <= max(pool.size, 0) or not reserved


@hsettings(max_examples=400, deadline=None)
@given(fleets(), st.data())
def test_the_released_spare_shares_the_leaf_when_one_can(case, data):
    pools, w = case
    removed = data.draw(st.sampled_from(sorted(w.nodes)))
    d = release_for(removed, "9", pools, w, NOW)
    if not any(p in pools for p in w.partitions_of(removed)):
        assert d is None
        return
    assert d is not None

    def usable(s: Spare) -> bool:
        return (s.partition in pools and s.partition in w.partitions_of(removed) and s.node != removed
                and s.validated_at is not None and NOW - s.validated_at <= pools[s.partition].validated_within_h * H
                and fit(s.node, w) == "" and w.nodes[s.node].state == "idle")

    same_leaf = [s for s in w.spares.values() if usable(s) and w.topology.same_leaf(s.node, removed)]
    same_rack = [s for s in w.spares.values() if usable(s) and set(w.racks_of(s.node)) & set(w.racks_of(removed))]
    if same_leaf:
        assert d.kind == "spare-release" and w.topology.same_leaf(d.node, removed)
    elif same_rack:
        assert d.kind == "spare-release" and set(w.racks_of(d.node)) & set(w.racks_of(removed))
    elif any(usable(s) and pools[s.partition].placement == "nearest" for s in w.spares.values()):
        assert d.kind == "spare-release"
    else:
        assert d.kind == "none" and d.note
    if d.kind == "spare-release":
        assert usable(w.spares[d.node])


# --------------------------------------------------------------------------- from the ledger


@dataclasses.dataclass
class Act:
    id: int
    node: str
    kind: str
    status: str
    evidence: object
    applied_at: float | None
    failed_at: float | None = None


def test_the_spares_are_the_ledgers_latest_applied_reserves():
    acts = [Act(1, "n01", "spare-reserve", "applied", {"reservation": "r_n01", "partition": "gpu", "validated_at": 5.0}, 10),
            Act(2, "n02", "spare-reserve", "applied", {"reservation": "r_n02", "partition": "gpu"}, 11),
            Act(3, "n01", "spare-release", "applied", {"reservation": "r_n01", "incident": "7"}, 20),
            Act(4, "n03", "spare-reserve", "abandoned", {"reservation": "r_n03", "partition": "gpu"}, None),
            Act(5, "n04", "spare-reserve", "applied", "damaged", 12)]
    spares, released = recorded_spares(acts, {"n02": 8.0})
    assert set(spares) == {"n02"} and spares["n02"].validated_at == 8.0 and spares["n02"].reservation == "r_n02"
    assert released == {"n01": 20}


def test_a_removal_is_owed_a_spare_until_a_release_names_its_incident():
    acts = [Act(1, "n01", "spare-release", "applied", {"incident": "7"}, 10)]
    holds = [("n05", 7, NOW - 60), ("n06", 8, NOW - 60), ("n07", 9, NOW - 601), ("n08", None, NOW), ("n09", 10, NOW)]
    assert owed(holds, acts, NOW, done=["n09"]) == [("n06", "8")]


# --------------------------------------------------------------------------- revalidation


def _due_world(*spares: Spare, **kw) -> SpareWorld:
    return dataclasses.replace(with_spares(world(), *spares), **kw)


def test_revalidate_takes_the_oldest_due_idle_spares_up_to_revalidate_at_once():
    w = _due_world(spare("n01", NOW - 13 * H), spare("n02", NOW - 20 * H), spare("n05", None), spare("n06", NOW - H))
    pools = {"gpu": SparePool(size=4, validated_within_h=24, revalidate_at_once=2)}
    out = revalidate(pools, w, NOW)
    assert [(d.kind, d.node) for d in out] == [("spare-validate", "n05"), ("spare-validate", "n02")]
    assert out[0].target == "healthd_spare_gpu_n05" and "never validated" in out[0].reason
    assert "last validation passed 20.0 h ago) is due for revalidation: every 12 h" in out[1].reason
    # one pass, one series: a pass starts the next, a restart retries the same one
    assert out[1].series == f"spare-validate:healthd_spare_gpu_n02@{NOW - 20 * H:.0f}"
    # one running already leaves room for one more; a spare at work is skipped (its validation takes the node)
    busy_n05 = {**w.nodes, "n05": idle("n05", "MAINT", "RESERVED", state="allocated")}
    assert [d.node for d in revalidate(pools, dataclasses.replace(w, nodes=busy_n05, validating=frozenset({"n06"})),
                                       NOW)] == ["n02"]
    assert revalidate(pools, dataclasses.replace(w, validating=frozenset({"n06", "n01"})), NOW) == ()


def test_a_spare_validating_or_failed_is_neither_due_nor_released_for_a_removal():
    w = _due_world(spare("n03", NOW - 13 * H), spare("n04", NOW - H))
    pools = {"gpu": SparePool(validated_within_h=24)}
    assert release_for("n02", "7", pools, w, NOW).node == "n04"
    for kw in ({"validating": frozenset({"n04"})}, {"failed": {"n04": ("healthd: validation failed [#3]", "3")}}):
        other = dataclasses.replace(w, **kw)
        d = release_for("n02", "7", pools, other, NOW)
        assert d is not None and d.node == "n03", kw  # the other spare under s1
        assert [s.node for s in revalidation_due(pools, other, NOW)] == ["n03"]


def test_a_failed_spare_is_drained_until_healthd_holds_it_then_given_back_and_replaced():
    reason = "healthd: validation failed: validate.sh rc=3: GPU 1 gone [#12]"
    w = _due_world(spare("n01", NOW - 13 * H), failed={"n01": (reason, "12")})
    pools = {"gpu": SparePool(size=1, validated_within_h=24)}
    out = decide(pools, w, [], NOW)
    assert [(d.kind, d.node, d.reason, d.incident) for d in out] == [("redrain", "n01", reason, "12")]
    held = dataclasses.replace(w, busy=frozenset({"n01"}), out_of_service=frozenset({"n01"}))
    out = decide(pools, held, [], NOW + 30)
    assert [(d.kind, d.node) for d in out][:1] == [("spare-release", "n01")]
    assert [d.kind for d in out][1:] == ["spare-reserve"] and out[1].node != "n01"


def test_validations_are_read_back_from_the_ledger():
    acts = [Act(1, "n01", "spare-reserve", "applied", {"reservation": "r_n01", "partition": "gpu"}, 10),
            Act(2, "n01", "spare-validate", "applied", {"reservation": "r_n01"}, 20),
            Act(3, "n01", "spare-validate", "failed", {"reason": "healthd: x [#4]", "incident": "4"}, None, 30),
            Act(4, "n02", "spare-validate", "applied", {}, 25),
            Act(5, "n03", "spare-validate", "failed", {"reason": "healthd: y [#5]", "incident": "5"}, None, 5),
            Act(6, "n03", "spare-validate", "applied", {}, 40),
            Act(7, "n04", "spare-validate", "abandoned", {}, None)]
    passed, failed = validations(acts)
    assert passed == {"n01": 20, "n02": 25, "n03": 40}
    assert failed == {"n01": (30, "healthd: x [#4]", "4")}  # n03 passed after its failure


def test_the_world_takes_a_pass_as_the_spares_validation_time_and_a_failure_only_after_its_reserve():
    acts = [Act(1, "n01", "spare-reserve", "applied", {"reservation": "r_n01", "partition": "gpu", "validated_at": 5.0}, 10),
            Act(2, "n01", "spare-validate", "applied", {}, 50),
            Act(3, "n02", "spare-validate", "failed", {"reason": "healthd: y [#5]", "incident": "5"}, None, 5),
            Act(4, "n02", "spare-reserve", "applied", {"reservation": "r_n02", "partition": "gpu"}, 60),
            Act(5, "n03", "spare-reserve", "applied", {"reservation": "r_n03", "partition": "gpu"}, 60),
            Act(6, "n03", "spare-validate", "failed", {"reason": "healthd: z [#6]", "incident": "6"}, None, 70)]
    w = world_of(nodes={}, partitions={"gpu": frozenset(NAMES)}, healthy=(), unhealthy=(), busy=(), out_of_service=(),
                 floors={}, actions=acts, validated={"n01": 30.0}, topology=TOPO, racks={}, validating=["n02"])
    assert w.spares["n01"].validated_at == 50 and w.validated["n01"] == 50
    assert w.failed == {"n03": ("healthd: z [#6]", "6")}  # n02's failure was before it became a spare again
    assert w.validating == {"n02"}


def test_a_failed_revalidations_drain_is_owed_no_spare():
    acts = [Act(1, "n01", "spare-validate", "failed", {"incident": "8", "reason": "healthd: x [#8]"}, None, NOW - 60)]
    assert owed([("n01", 8, NOW - 30), ("n02", 9, NOW - 30)], acts, NOW) == [("n02", "9")]


def test_revalidate_at_once_is_checked():
    assert SparePool(revalidate_at_once=3).revalidate_at_once == 3
    for bad in (0, True, 1.5, 2000):
        with pytest.raises(ValueError, match="revalidate_at_once"):
            SparePool(revalidate_at_once=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="revalidate_at_once"):
        parse_controller_settings("policy: {spares: {gpu: {revalidate_at_once: 0}}}")


def test_the_revalidation_is_gated_as_validation_work():
    assert ACTIONS["spare-validate"].gates == ("mode", "breaker") and ACTIONS["spare-validate"].call is None
    (d,) = revalidate({"gpu": SparePool()}, _due_world(spare("n01", None)), NOW)
    assert (gate_one(d, _ctx("observe")).gate, gate_one(d, _ctx("supervised")).status) == ("mode", "allowed")


@st.composite
def rounds(draw):
    """A pool over NAMES on a virtual clock: its window, how many run at once, rounds apart little enough
    for the pool to get through its due spares in half a window, the nodes' passes before the first
    round (none, or within half a window), the nodes whose validation fails, removals by round."""
    size = draw(st.integers(1, 4))
    at_once = draw(st.integers(1, 3))
    hours = draw(st.floats(1.0, 4.0))
    step = draw(st.integers(60, int(hours * H / (2 * (size + 2)))))
    before = {n: NOW - draw(st.floats(0, hours * H / 2)) for n in draw(st.sets(st.sampled_from(NAMES)))}
    failing = draw(st.sets(st.sampled_from(NAMES), max_size=2))
    count = int(2.5 * hours * H / step)
    removals = draw(st.dictionaries(st.integers(0, count - 1), st.sampled_from(NAMES), max_size=2))
    return SparePool(size=size, validated_within_h=hours, revalidate_at_once=at_once), step, before, failing, \
        count, removals


@hsettings(max_examples=60, deadline=None)
@given(rounds())
def test_with_revalidation_no_spare_outlives_its_window_and_a_failing_one_leaves_the_pool(case):
    pool, step, validated, failing, count, removals = case
    pools = {"gpu": pool}
    held: dict[str, Spare] = {}
    released: dict[str, float] = {}
    drained: set[str] = set()
    failed: dict[str, tuple[str, str]] = {}
    failed_at: dict[str, int] = {}
    running: set[str] = set()
    # a spare waits at most for the ones due with it, one round each, besides the round it is due in
    settle = (pool.size // pool.revalidate_at_once + 2) * step
    for k in range(count):
        now = NOW + k * step
        for n in running:  # launched last round, finished by this one
            if n in failing:
                failed[n], failed_at[n] = (f"healthd: validation failed [#{k}]", str(k)), k
            else:
                validated[n] = now
                if n in held:
                    held[n] = dataclasses.replace(held[n], validated_at=now)
        running = set()
        nodes = {n: idle(n, *(("DRAIN",) if n in drained else ()), *(("MAINT", "RESERVED") if n in held else ()))
                 for n in NAMES}
        removal = [] if removals.get(k) in (None, *drained, *held) else [(removals[k], f"r{k}")]
        drained |= {n for n, _ in removal}
        w = world(nodes=nodes, spares=held, healthy=frozenset(NAMES) - drained, busy=frozenset(drained),
                  out_of_service=frozenset(drained), validated=dict(validated), released_at=dict(released),
                  failed={n: f for n, f in failed.items() if n in held})
        for d in decide(pools, w, removal, now):
            if d.kind == "spare-release":
                if d.incident:  # for a removal: a spare validated within its window, not failed, not running
                    s = held[d.node]
                    assert s.validated_at is not None and now - s.validated_at <= pool.validated_within_h * H
                    assert d.node not in failed
                del held[d.node]
                released[d.node] = now
            elif d.kind == "spare-reserve":
                held[d.node] = Spare(d.node, "gpu", d.target, now, validated.get(d.node))
            elif d.kind == "spare-validate":
                assert d.node in held and d.node not in failed
                running.add(d.node)
            elif d.kind == "redrain":
                assert d.node in failed and d.incident == failed[d.node][1]
                drained.add(d.node)
        assert len(running) <= pool.revalidate_at_once
        for n, s in held.items():
            assert n not in failed or k - failed_at[n] <= 1, (n, k)  # drained, then given back the round after
            if n not in failed and now - s.reserved_at >= settle:
                assert s.validated_at is not None and now - s.validated_at <= pool.validated_within_h * H, (n, s, now)
