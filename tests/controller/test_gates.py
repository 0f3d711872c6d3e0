"""healthd.controller.gates: the safety envelope, gate by gate, and properties over arbitrary fleets."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd.controller.gates import (
    BreakerState,
    GateContext,
    GateResult,
    apply_gates,
    build_context,
    evaluate_breaker,
    likely_cause,
    reset_breaker,
    still_safe,
)
from healthd.controller.ownership import owned
from tests.support.holds import hold_for, holds_for
from healthd.controller.policy import (
    ControllerPolicySettings,
    Decision,
    FleetView,
    LedgerView,
    decide,
    failing_nodes,
)
from tests.support.fleet_inputs import NOW, finding, info, report

NODES = ("node01", "node02", "node03", "node04")
TOPOLOGY = "SwitchName=leaf1 Nodes=node[01-04]\nSwitchName=leaf2 Nodes=node[05-08]\n"

NO_LEDGER = LedgerView()
CLOSED = BreakerState()


def run(reports, *, infos=None, names=NODES, ledger=NO_LEDGER, breaker=CLOSED, applied=0,
        applied_by_partition=None, approved=(), topology="", now=NOW, **settings_kw):
    """decide + build_context + apply_gates, as the controller loop runs them."""
    s = ControllerPolicySettings(**{"mode": "auto", "breaker_percent": 100.0, "breaker_nodes": 1000,
                                    **settings_kw})
    infos = infos if infos is not None else [info(n) for n in names]
    fleet = FleetView.build(reports, infos, topology, s)
    decisions = decide(fleet, ledger, s, now)
    ctx, alert = build_context(fleet, ledger, s, now, breaker, applied, applied_by_partition or {}, approved)
    return apply_gates(decisions, ctx), ctx, alert


def by_node(outcomes) -> dict[str, GateResult]:
    return {o.decision.node: o for o in outcomes}


def acting(outcomes) -> list[GateResult]:
    """The outcomes of decisions that act; never empty, so `all(...)` over them can fail."""
    out = [o for o in outcomes if o.decision.acts]
    assert out, "no acting decision among the outcomes"
    return out


# --------------------------------------------------------------------------- mode


def test_observe_mode_allows_nothing():
    outs, _, _ = run([report(n, finding()) for n in NODES[:2]], mode="observe")
    assert [o.label for o in acting(outs)] == ["refused-by-mode", "refused-by-mode"]
    assert "observe" in acting(outs)[0].reason


def test_observe_is_the_default():
    assert ControllerPolicySettings().mode == "observe"


def test_auto_t1_acts_t2_waits():
    outs, _, _ = run([report("node01", finding()),
                      report("node02", finding("remap_pending:gpu0", tier=2, action="reset-gpu-when-idle",
                                               xid=None))])
    o = by_node(outs)
    assert o["node01"].status == "allowed" and o["node01"].decision.kind == "drain-and-requeue"
    assert o["node02"].status == "waiting-approval" and o["node02"].decision.kind == "reboot-asap"
    assert "approve" in o["node02"].reason


def test_auto_t2_approved_or_granted_acts():
    t2 = report("node02", finding("remap_pending:gpu0", tier=2, action="reset-gpu-when-idle", xid=None))
    outs, _, _ = run([t2], approved=["reboot-asap:node02:remap_pending:gpu0"])
    assert by_node(outs)["node02"].status == "allowed"
    outs, _, _ = run([t2], auto_tier2=True)
    assert by_node(outs)["node02"].status == "allowed"


def test_supervised_everything_waits_until_approved():
    outs, _, _ = run([report("node01", finding())], mode="supervised")
    assert by_node(outs)["node01"].status == "waiting-approval"
    outs, _, _ = run([report("node01", finding())], mode="supervised",
                     approved=["drain-and-requeue:node01:xid:gpu0:79"])
    assert by_node(outs)["node01"].status == "allowed"


def test_waiting_decision_still_refused_by_later_gate():
    infos = [info("node01", flags={"DRAIN"}, reason="bad DIMM", user="admin")]
    outs, _, _ = run([report("node01", finding())], infos=infos, mode="supervised")
    assert by_node(outs)["node01"].label == "refused-by-ownership"


def test_t3_and_user_decisions_never_act_even_if_handcrafted():
    outs, ctx, _ = run([], mode="auto")
    bad = [Decision(id="drain:node01:x", kind="drain", node="node01", reason="healthd: x [#1]", tier=3),
           Decision(id="drain:node02:x", kind="drain", node="node02", reason="healthd: x [#1]", tier=1,
                    attribution="user")]
    assert [o.label for o in apply_gates(bad, ctx)] == ["refused-by-mode", "refused-by-mode"]


def test_none_decisions_are_recorded():
    outs, _, _ = run([report("node01", finding("xid:gpu0:13", tier=3, action="none", attribution="user"))])
    assert by_node(outs)["node01"].status == "recorded"


# --------------------------------------------------------------------------- rate limit


def test_fleet_rate_limit_counts_past_hour_and_this_batch():
    names = tuple(f"node{i:02d}" for i in range(1, 9))
    outs, _, _ = run([report(n, finding()) for n in names[:4]], names=names, applied=1,
                     max_actions_per_hour=3, max_actions_per_partition_per_hour=100)
    assert [o.label for o in acting(outs)] == ["allowed", "allowed", "refused-by-rate-limit",
                                               "refused-by-rate-limit"]
    assert "fleet rate limit" in acting(outs)[2].reason


def test_partition_rate_limit():
    names = ("a1", "a2", "a3", "b1")
    infos = [info("a1", partitions=("pa",)), info("a2", partitions=("pa",)), info("a3", partitions=("pa",)),
             info("b1", partitions=("pb",))]
    outs, _, _ = run([report(n, finding()) for n in names], infos=infos, names=names,
                     max_actions_per_partition_per_hour=2, partition_rate_limits={"pb": 0},
                     applied_by_partition={"pa": 1})
    o = by_node(outs)
    assert o["a1"].status == "allowed"
    assert o["a2"].label == "refused-by-rate-limit" and "partition pa" in o["a2"].reason
    assert o["b1"].label == "refused-by-rate-limit" and "partition pb" in o["b1"].reason


# --------------------------------------------------------------------------- breaker


def test_switch_failure_3_of_4_opens_breaker_with_one_alert_and_drains_nothing():
    names = tuple(f"node{i:02d}" for i in range(1, 9))
    reports = [report(n, finding("ib_port_down:mlx5_0/1", action="drain", attribution="fabric", xid=None))
               for n in names[:3]]
    outs, ctx, alert = run(reports, names=names, topology=TOPOLOGY, breaker_percent=25.0, breaker_nodes=10,
                           max_actions_per_hour=2)
    assert ctx.breaker.open and ctx.breaker.opened_at == NOW
    assert alert is not None and alert.cause.startswith("switch:leaf1") and alert.nodes == set(names[:3])
    assert all(o.label == "refused-by-breaker" for o in acting(outs))
    # a person reads when it opened, in UTC, not epoch seconds
    assert all(o.reason.startswith("circuit breaker open since 2027-01-15T08:00:00Z: likely cause switch:leaf1")
               for o in acting(outs))
    # the next round keeps it open and raises no second alert
    fleet = ctx.fleet
    again, alert2 = evaluate_breaker(fleet, ctx.settings, NOW + 30, ctx.breaker)
    assert again.open and alert2 is None


def test_breaker_count_rule_and_min_nodes():
    s = ControllerPolicySettings(breaker_nodes=2, breaker_percent=100.0)
    fleet = FleetView.build([report(n, finding()) for n in NODES[:3]], [info(n) for n in NODES])
    assert evaluate_breaker(fleet, s, NOW, BreakerState())[0].open  # 3 > 2
    s = ControllerPolicySettings(breaker_nodes=100, breaker_percent=10.0, breaker_min_nodes=2)
    one = FleetView.build([report("node01", finding())], [info(n) for n in NODES])
    assert not evaluate_breaker(one, s, NOW, BreakerState())[0].open  # 25% but a single node


def test_breaker_names_driver_rollout_for_shared_software_finding():
    reports = [report(n, finding(f"xid:gpu{i}:119", tier=1, action="drain", attribution="software", xid=119))
               for i, n in enumerate(NODES[:3])]
    fleet = FleetView.build(reports, [info(n) for n in NODES], TOPOLOGY)
    assert likely_cause(fleet, failing_nodes(fleet, ControllerPolicySettings(), NOW)).startswith("driver rollout")


def test_breaker_reset_does_not_replay_stale_decisions():
    reports = [report(n, finding()) for n in NODES[:3]]
    s = ControllerPolicySettings(mode="auto", breaker_percent=50.0, breaker_nodes=100)
    fleet = FleetView.build(reports, [info(n) for n in NODES])
    stale = decide(fleet, LedgerView(), s, NOW)
    ctx, alert = build_context(fleet, LedgerView(), s, NOW)
    assert ctx.breaker.open and alert is not None
    closed = reset_breaker(ctx.breaker, NOW + 600)
    assert not closed.open and closed.reset_at == NOW + 600
    ctx2, alert2 = build_context(fleet, LedgerView(), s, NOW + 601, closed)
    assert not ctx2.breaker.open and alert2 is None  # failures first seen before the reset do not re-trip it
    # decisions made before the reset are never applied...
    assert all(o.label == "refused-by-breaker" and o.reason.startswith(
        "stale: decided at 2027-01-15T08:00:00Z, before the breaker reset at 2027-01-15T08:10:00Z")
        for o in acting(apply_gates(stale, ctx2)))
    # ...current evidence is re-evaluated: reports still fresh drain node by node within the envelope
    fresh_reports = [dataclasses.replace(r, received_at=NOW + 600) for r in reports]
    fleet2 = FleetView.build(fresh_reports, [info(n) for n in NODES])
    ctx3, _ = build_context(fleet2, LedgerView(), s, NOW + 601, closed)
    outs = apply_gates(decide(fleet2, LedgerView(), s, NOW + 601), ctx3)
    assert [o.status for o in acting(outs)] == ["allowed"] * 3


def test_new_failures_after_reset_reopen_it():
    closed = BreakerState(open=False, opened_at=NOW - 100, reset_at=NOW - 50)
    reports = [report(n, finding(first_seen=NOW - 10)) for n in NODES[:3]]
    fleet = FleetView.build(reports, [info(n) for n in NODES])
    state, alert = evaluate_breaker(fleet, ControllerPolicySettings(breaker_percent=50.0), NOW, closed)
    assert state.open and alert is not None and state.reset_at == NOW - 50


# --------------------------------------------------------------------------- correlation


def test_switch_correlation_attributes_to_group_not_nodes():
    names = tuple(f"node{i:02d}" for i in range(1, 9))
    reports = [report(n, finding("ib_port_down:mlx5_0/1", action="drain", attribution="fabric", xid=None))
               for n in ("node01", "node02", "node03")] + [report("node05", finding())]
    outs, ctx, _ = run(reports, names=names, topology=TOPOLOGY, correlation_threshold=0.5)
    o = by_node(outs)
    for n in ("node01", "node02", "node03"):
        assert o[n].label == "refused-by-correlation"
        assert o[n].reason == "correlated: switch:leaf1 (3 of 4 nodes)"
    assert o["node05"].status == "allowed"  # one failure on leaf2 is just a node


def test_rack_and_pdu_groups_from_config_correlate():
    outs, _, _ = run([report(n, finding()) for n in ("node01", "node02")],
                     racks={"r7": {"node01", "node02", "node03"}})
    assert all(o.reason.startswith("correlated: rack:r7 (2 of 3 nodes)") for o in acting(outs))
    outs, _, _ = run([report(n, finding()) for n in ("node01", "node02")], pdus={"p1": {"node01", "node02"}})
    assert all(o.reason.startswith("correlated: pdu:p1 (2 of 2 nodes)") for o in acting(outs))


# --------------------------------------------------------------------------- capacity floor


def test_capacity_floor_counts_drained_and_down_nodes():
    infos = [info("node01"), info("node02"), info("node03", flags={"DRAIN"}, reason="healthd: x [#1]"),
             info("node04", state="down", reason="healthd: y [#2]")]
    outs, _, _ = run([report("node01", finding()), report("node02", finding())], infos=infos,
                     capacity_floors={"gpu": 1})
    o = by_node(outs)
    assert o["node01"].status == "allowed"
    assert o["node02"].label == "refused-by-capacity" and "minimum 1" in o["node02"].reason


def test_capacity_floor_counts_healthds_own_drain_the_view_has_not_shown_yet():
    """The view was read before healthd's drain of node01 landed: node01 still looks idle there, but
    the ledger holds it, so draining node02 as well would breach the floor of 3."""
    infos = [info(n) for n in NODES]
    held = LedgerView(holds={"node01": hold_for(info("node01", flags={"DRAIN"}, reason="healthd: x [#1]"))})
    outs, _, _ = run([report("node02", finding())], infos=infos, ledger=held, capacity_floors={"gpu": 3})
    assert by_node(outs)["node02"].label == "refused-by-capacity", by_node(outs)["node02"]
    outs, _, _ = run([report("node02", finding())], infos=infos, capacity_floors={"gpu": 3})
    assert by_node(outs)["node02"].status == "allowed"  # without the hold the floor allows one


def test_unsettled_writes_count_as_gone_and_as_spent_budget_except_for_their_own_retry():
    """node01's drain failed with its outcome unknown (a client that timed out) after the view was read:
    it may have landed. It counts against the floor and the rate limit for every other node; node01's own
    retry is not a second removal."""
    unsettled = LedgerView(unsettled=frozenset({"node01"}))
    outs, _, _ = run([report("node02", finding())], ledger=unsettled, capacity_floors={"gpu": 3})
    assert by_node(outs)["node02"].label == "refused-by-capacity"
    outs, _, _ = run([report("node02", finding())], ledger=unsettled, max_actions_per_hour=1)
    o = by_node(outs)["node02"]
    assert o.label == "refused-by-rate-limit" and "1 not yet confirmed by Slurm" in o.reason, o
    outs, _, _ = run([report("node02", finding())], ledger=unsettled, max_actions_per_partition_per_hour=1)
    assert by_node(outs)["node02"].label == "refused-by-rate-limit"
    outs, _, _ = run([report("node01", finding())], ledger=unsettled, max_actions_per_hour=1,
                     capacity_floors={"gpu": 3})
    assert by_node(outs)["node01"].status == "allowed"  # its own write again: budget and floor unchanged


@st.composite
def stale_views(draw):
    """A fleet where healthd holds some nodes and has unsettled writes on others, and the same fleet as
    a view read before those writes landed (the held nodes idle there, with no reason)."""
    names = [f"node{i:02d}" for i in range(1, draw(st.integers(2, 9)))]
    infos = [info(n, flags=draw(st.sampled_from([(), ("DRAIN",)])),
                  reason=draw(st.sampled_from(["", "maintenance"]))) for n in names]
    held = draw(st.sets(st.sampled_from(names)))
    unsettled = frozenset(draw(st.sets(st.sampled_from(names))))
    current = [info(i.name, flags={"DRAIN"}, reason=f"healthd: x [#{k}]") if i.name in held else i
               for k, i in enumerate(infos)]
    ledger = LedgerView(holds={i.name: hold_for(i) for i in current if i.name in held}, unsettled=unsettled)
    stale = [info(i.name) if i.name in held else i for i in current]
    reports = [report(n, finding()) for n in names if draw(st.booleans())]
    s = ControllerPolicySettings(mode="auto", breaker_percent=100.0, breaker_nodes=1000,
                                 max_actions_per_hour=draw(st.integers(0, 9)),
                                 capacity_floors={"gpu": draw(st.integers(0, len(names)))})
    return names, current, stale, ledger, reports, s


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stale_views())
def test_a_view_read_before_healthds_writes_never_allows_more_removals(sample):
    """Metamorphic: the gates over a view that has not yet shown healthd's own writes allow no more
    node removals than over the view that shows them, and never take a partition below its floor as
    Slurm really is (the view's out-of-service nodes, healthd's holds and unsettled writes)."""
    names, current, stale, ledger, reports, s = sample
    allowed = {}
    for label, infos in (("current", current), ("stale", stale)):
        fleet = FleetView.build(reports, infos, "", s)
        ctx, _ = build_context(fleet, ledger, s, NOW)
        outs = apply_gates(decide(fleet, ledger, s, NOW), ctx)
        allowed[label] = {o.decision.node for o in outs
                          if o.status == "allowed" and o.decision.kind in ("drain", "drain-and-requeue", "reboot-asap")}
    really_gone = ({i.name for i in current if "DRAIN" in i.flags} | set(ledger.holds) | ledger.unsettled)
    # a held node the stale view shows idle may be decided again: the executor's re-read settles that
    # write as already made; what must not grow is the removal of nodes still in service
    assert len(allowed["stale"] - really_gone) <= len(allowed["current"] - really_gone), allowed
    for label in ("current", "stale"):
        healthy_after = len(set(names) - really_gone - allowed[label])
        if allowed[label] - really_gone:
            assert healthy_after >= s.capacity_floors["gpu"], (label, allowed[label], really_gone)


def test_capacity_floor_zero_and_other_partition_unaffected():
    outs, _, _ = run([report(n, finding()) for n in NODES], capacity_floors={"other": 10})
    assert all(o.status == "allowed" for o in acting(outs))


# --------------------------------------------------------------------------- ownership


def test_foreign_reason_untouched():
    infos = [info("node01", flags={"DRAIN"}, reason="RMA ticket 123", user="alice"), info("node02")]
    outs, _, _ = run([report("node01", finding()), report("node02", finding())], infos=infos)
    o = by_node(outs)
    assert o["node01"].label == "refused-by-ownership" and "alice" in o["node01"].reason
    assert o["node02"].status == "allowed"


def _resume(node="node01") -> Decision:
    return Decision(id=f"resume:{node}:validated", kind="resume", node=node, reason="", tier=1, decided_at=NOW)


def test_resume_refused_without_ledger_record_or_foreign_reason():
    infos = [info("node01", flags={"DRAIN"}, reason="healthd: xid 79 [#I1]"),
             info("node02", flags={"DRAIN"}, reason="maintenance", user="root"),
             info("node03", state="down")]
    _, ctx, _ = run([], infos=infos)
    outs = by_node(apply_gates([_resume("node01"), _resume("node02"), _resume("node03")], ctx))
    assert outs["node01"].label == "refused-by-ownership" and "holds no healthd write" in outs["node01"].reason
    assert outs["node02"].label == "refused-by-ownership"
    assert outs["node03"].label == "refused-by-ownership" and "no reason" in outs["node03"].reason
    # node02's hold records healthd's own write, but an administrator has since written over it
    holds = holds_for(infos[:1], {"node01": 1}) | {"node02": hold_for(
        dataclasses.replace(infos[1], reason="healthd: x [#9]", reason_user="root"), 9)}
    _, ctx, _ = run([], infos=infos, ledger=LedgerView(holds=holds))
    outs = by_node(apply_gates([_resume("node01"), _resume("node02")], ctx))
    assert outs["node01"].status == "allowed" and outs["node02"].label == "refused-by-ownership"
    assert "no longer shows healthd's write" in outs["node02"].reason


def test_a_healthd_prefix_healthd_did_not_write_is_foreign():
    """Ownership by record: `healthd:` text proves nothing; healthd's own text re-written later is the writer's."""
    d = Decision(id="drain:node01:xid:gpu0:79", kind="drain", node="node01", reason="healthd: y [#2]", tier=1)
    forged = info("node01", flags={"DRAIN"}, reason="healthd: looks like ours [#1]", user="alice")
    assert still_safe(d, forged, LedgerView()).gate == "ownership"
    ours = dataclasses.replace(forged, reason_time=NOW, reason_user="root")
    held = LedgerView(holds={"node01": hold_for(ours, 1)})
    assert still_safe(d, ours, held) is None  # healthd's own drain: it may write again (an escalation)
    redrained = dataclasses.replace(ours, reason_time=NOW + 30)  # same text, a later write by someone
    assert "not healthd's by record" in still_safe(d, redrained, held).reason
    assert still_safe(_resume(), redrained, held).gate == "ownership"


def test_still_safe_rereads_before_write():
    d = Decision(id="drain:node01:xid:gpu0:79", kind="drain", node="node01", reason="healthd: x [#I1]", tier=1)
    assert still_safe(d, info("node01")) is None
    assert still_safe(d, info("node01", flags={"DRAIN"}, reason="admin drain", user="bob")).gate == "ownership"
    assert "not healthd's by record" in still_safe(d, info("node01", flags={"DRAIN"}, reason="healthd: x [#I1]")).reason
    assert still_safe(d, None) is not None
    assert still_safe(d, info("node02")) is not None
    r = _resume()
    drained = info("node01", flags={"DRAIN"}, reason="healthd: x [#I1]")
    assert still_safe(r, drained) is not None  # no ledger given: no record
    assert still_safe(r, drained, LedgerView(holds=holds_for([drained], {"node01": 1}))) is None
    undrained = info("node01", reason="healthd: x [#I1]")
    assert still_safe(r, undrained, LedgerView(holds=holds_for([undrained], {"node01": 1}))).gate == "ownership"


def test_broken_input_fails_closed():
    _, ctx, _ = run([])
    outs = apply_gates([object()], ctx)  # type: ignore[list-item]
    assert outs[0].status == "refused" and outs[0].gate == "error"


# --------------------------------------------------------------------------- properties

node_names = st.sampled_from([f"n{i:02d}" for i in range(12)])
reasons = st.one_of(st.just(""), st.just("healthd: xid 79 [#H1]"), st.text(max_size=20))
findings_st = st.builds(
    finding,
    fid=st.sampled_from(["xid:gpu0:79", "xid:gpu1:48", "remap_pending:gpu0", "ib_port_down:mlx5_0/1"]),
    tier=st.sampled_from([1, 2, 3]),
    action=st.sampled_from(["none", "reset-gpu-when-idle", "reboot-when-idle", "drain", "drain-and-requeue",
                            "inspect-hardware"]),
    attribution=st.sampled_from(["hardware", "fabric", "storage", "software", "user", "unknown"]),
    first_seen=st.floats(NOW - 2000, NOW + 10),
)


@st.composite
def fleets(draw):
    names = sorted(draw(st.sets(node_names, min_size=1, max_size=12)))
    infos = [
        info(
            n,
            state=draw(st.sampled_from(["idle", "mixed", "allocated", "down"])),
            flags=draw(st.sets(st.sampled_from(["DRAIN", "NOT_RESPONDING", "REBOOT_REQUESTED"]))),
            reason=draw(reasons),
            partitions=draw(st.sets(st.sampled_from(["gpu", "debug"]), max_size=2)),
        )
        for n in names
    ]
    reports = [
        report(n, *draw(st.lists(findings_st, max_size=3)), received_at=draw(st.floats(NOW - 300, NOW)),
               verdict="failed")
        for n in names if draw(st.booleans())
    ]
    groups = {f"rack:r{i}": frozenset(draw(st.sets(st.sampled_from(names), max_size=6))) for i in range(2)}
    fleet = FleetView(reports={r.node: r for r in reports}, nodes={i.name: i for i in infos}, groups=groups)
    ledger = LedgerView(holds=holds_for([i for i in infos if draw(st.booleans())], {n: 1 for n in names}))
    s = ControllerPolicySettings(
        mode=draw(st.sampled_from(["observe", "supervised", "auto"])),
        auto_tier2=draw(st.booleans()),
        max_actions_per_hour=draw(st.integers(0, 5)),
        max_actions_per_partition_per_hour=draw(st.integers(0, 5)),
        breaker_percent=draw(st.floats(0, 100)),
        breaker_nodes=draw(st.integers(0, 12)),
        correlation_threshold=draw(st.floats(0.01, 1)),
        capacity_floors={"gpu": draw(st.integers(0, 6))},
    )
    breaker = draw(st.sampled_from([BreakerState(), BreakerState(open=True, opened_at=NOW - 10),
                                    BreakerState(reset_at=NOW - 100)]))
    return fleet, ledger, s, breaker


def _all_decisions(fleet, ledger, s):
    # policy's decisions plus hand-made ones of every kind on every node (resume included)
    made = list(decide(fleet, ledger, s, NOW))
    for n in fleet.all_nodes:
        for kind in ("drain", "drain-and-requeue", "reboot-asap", "resume"):
            made.append(Decision(id=f"{kind}:{n}:x", kind=kind, node=n, reason="healthd: x [#H1]", tier=1,
                                 decided_at=NOW))
    return made


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), st.data())
def test_apply_gates_never_raises_and_never_acts_in_observe_or_on_foreign_reason(sample, data):
    fleet, ledger, s, breaker = sample
    decisions = _all_decisions(fleet, ledger, s)
    approved = data.draw(st.sets(st.sampled_from([d.id for d in decisions]))) if decisions else set()
    ctx, _ = build_context(fleet, ledger, s, NOW, breaker, approved=approved)
    outs = apply_gates(decisions, ctx)
    assert len(outs) == len(decisions)
    for o in outs:
        assert o.status in ("allowed", "waiting-approval", "refused", "recorded")
        if o.status != "allowed":
            continue
        d = o.decision
        assert d.kind != "none"
        assert s.mode != "observe"
        info_ = fleet.nodes[d.node]
        assert not info_.reason or owned(ledger.holds.get(d.node), info_)  # never over a reason not healthd's
        if d.kind == "resume":
            assert owned(ledger.holds.get(d.node), info_)
        assert not ctx.breaker.open
        assert d.tier in (1, 2) and d.attribution != "user"
    allowed_removing = [o for o in outs if o.status == "allowed" and o.decision.kind != "resume"]
    assert len(allowed_removing) <= s.max_actions_per_hour


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_context_is_a_value(sample):
    fleet, ledger, s, breaker = sample
    ctx, _ = build_context(fleet, ledger, s, NOW, breaker)
    assert isinstance(ctx, GateContext)
    before = (ctx.actions_last_hour, dict(ctx.actions_last_hour_by_partition), ctx.removed_in_batch)
    apply_gates(_all_decisions(fleet, ledger, s), ctx)
    assert (ctx.actions_last_hour, dict(ctx.actions_last_hour_by_partition), ctx.removed_in_batch) == before


# --------------------------------------------------------------------------- the drill's two scenarios


def _defaults(**kw) -> ControllerPolicySettings:
    return ControllerPolicySettings(mode="auto", **kw)


def test_drill_one_xid79_on_a_4_node_cluster_drains_it_with_default_envelope():
    s = _defaults()
    fleet = FleetView.build([report("node02", finding())], [info(n) for n in NODES], TOPOLOGY, s)
    ctx, alert = build_context(fleet, NO_LEDGER, s, NOW)
    outs = apply_gates(decide(fleet, NO_LEDGER, s, NOW), ctx)
    assert alert is None and not ctx.breaker.open
    assert [(o.decision.id, o.status) for o in acting(outs)] == [("drain-and-requeue:node02:xid:gpu0:79", "allowed")]


def test_drill_3_of_4_failing_within_seconds_opens_breaker_and_drains_nothing():
    s = _defaults(max_actions_per_hour=1)
    reports = [report(n, finding(first_seen=NOW - i)) for i, n in enumerate(NODES[:3])]
    fleet = FleetView.build(reports, [info(n) for n in NODES], TOPOLOGY, s)
    ctx, alert = build_context(fleet, NO_LEDGER, s, NOW)
    outs = apply_gates(decide(fleet, NO_LEDGER, s, NOW), ctx)
    assert ctx.breaker.open and alert is not None and "switch:leaf1" in alert.text
    assert sum(o.status == "allowed" for o in outs) == 0 <= s.max_actions_per_hour


def test_group_incident_survives_a_breaker_reset():
    # the operator resets the breaker, but the switch is still the shared cause: no per-node drains
    s = _defaults(breaker_percent=100.0, breaker_nodes=1000)
    reports = [report(n, finding(), received_at=NOW) for n in NODES[:3]]
    fleet = FleetView.build(reports, [info(n) for n in NODES], TOPOLOGY, s)
    closed = reset_breaker(BreakerState(open=True, opened_at=NOW - 100), NOW - 50)
    ctx, _ = build_context(fleet, NO_LEDGER, s, NOW, closed)
    outs = apply_gates(decide(fleet, NO_LEDGER, s, NOW), ctx)
    assert {o.label for o in acting(outs)} == {"refused-by-correlation"}


def test_correlated_group_below_breaker_with_rate_limit_drains_at_most_limit():
    names = tuple(f"node{i:02d}" for i in range(1, 9))
    reports = [report(n, finding()) for n in names[:3]] + [report(n, finding()) for n in names[4:8]]
    outs, ctx, _ = run(reports, names=names, topology=TOPOLOGY, max_actions_per_hour=2,
                       correlation_threshold=1.0)
    o = by_node(outs)
    # leaf1: 3 of 4 is under the 100% threshold -> node by node, but never more than the hourly limit
    assert [o[n].label for n in names[:3]] == ["allowed", "allowed", "refused-by-rate-limit"]
    assert not any(o[n].status == "allowed" for n in names[4:8])
    # with budget left, leaf2's 4 of 4 is one group incident: no node of it is drained
    outs, _, _ = run(reports, names=names, topology=TOPOLOGY, correlation_threshold=1.0)
    o = by_node(outs)
    assert {o[n].reason for n in names[4:8]} == {"correlated: switch:leaf2 (4 of 4 nodes)"}
