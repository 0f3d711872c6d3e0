"""The action table: every kind of write, and proof that the gates it lists (and only those) refuse it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from healthd.controller import actions
from healthd.controller.actions import ACTIONS, GATE_ORDER, ActionKind, Decision
from healthd.controller.executor import call_args
from healthd.controller.gates import GATES, BreakerState, GateContext, GroupIncident, apply_gates, gate_one
from healthd.controller.ledger import REMEDIATION_KINDS
from healthd.controller.ownership import NODE_STATE_KINDS
from healthd.controller.policy import ControllerPolicySettings, FleetView, LedgerView
from healthd.slurm.backend import NodeInfo, SlurmBackend
from tests.support.holds import hold_for

NOW = 1_800_000_000.0
DOC = Path(__file__).resolve().parents[2] / "docs" / "controller.md"

HELD = NodeInfo(name="node01", state="idle", flags=frozenset({"DRAIN"}), reason="healthd: x [#1]", reason_time=NOW - 60,
                reason_user="root", partitions=("gpu",))
"""A node healthd holds by record: every ownership rule lets healthd write it."""
OTHER = NodeInfo(name="node02", state="idle", partitions=("gpu",))


def decision(kind: str) -> Decision:
    target = {"job": "123", "reservation": "healthd_validate_node01"}.get(ACTIONS[kind].target, "")
    return Decision(id=f"{kind}:node01:x", kind=kind, node="node01", reason="healthd: x [#1]", tier=1,  # type: ignore[arg-type]
                    attribution="hardware", decided_at=NOW, target=target, detail={"minutes": 60})


def permissive() -> GateContext:
    """Every gate lets every decision through."""
    settings = ControllerPolicySettings(mode="auto", max_actions_per_hour=1, max_actions_per_partition_per_hour=1,
                                        breaker_nodes=100, breaker_percent=100.0)
    fleet = FleetView(nodes={n.name: n for n in (HELD, OTHER)})
    return GateContext(settings=settings, fleet=fleet, ledger=LedgerView(holds={"node01": hold_for(HELD)}), now=NOW)


def hostile(gate: str) -> GateContext:
    """The permissive context with the one thing `gate` refuses."""
    ctx = permissive()
    if gate == "mode":
        return dataclasses.replace(ctx, settings=dataclasses.replace(ctx.settings, mode="observe"))
    if gate == "rate-limit":  # both budgets spent
        return dataclasses.replace(ctx, actions_last_hour=1, hang_requeues_last_hour=1)
    if gate == "breaker":
        return dataclasses.replace(ctx, breaker=BreakerState(open=True, opened_at=NOW - 10, cause="switch:s1"))
    if gate == "correlation":
        group = GroupIncident("switch:s1", frozenset({"node01", "node02"}), 2)
        return dataclasses.replace(ctx, correlated={"node01": group})
    if gate == "capacity":
        return dataclasses.replace(ctx, settings=dataclasses.replace(ctx.settings, capacity_floors={"gpu": 2}),
                                   out_of_service=frozenset())
    if gate == "ownership":  # an administrator's reason on the node, and no hold
        foreign = dataclasses.replace(HELD, reason="admin: bad fan", reason_user="alice")
        return dataclasses.replace(ctx, fleet=FleetView(nodes={"node01": foreign, "node02": OTHER}),
                                   ledger=LedgerView())
    raise AssertionError(gate)


@pytest.mark.parametrize("kind", list(ACTIONS))
def test_every_kind_is_refused_by_each_gate_it_lists_and_by_no_other(kind):
    action = ACTIONS[kind]
    d = decision(kind)
    baseline = gate_one(d, permissive())
    if kind == "none":
        assert baseline.status == "recorded"
    elif action.follows:  # never proposed alone: only the decision it follows lets it happen
        assert (baseline.status, baseline.gate) == ("refused", "error")
    else:
        assert baseline.status == "allowed", baseline
    for gate in GATE_ORDER:
        outcome = gate_one(d, hostile(gate))
        if action.applies(gate):
            assert outcome.gate == gate and outcome.status in ("refused", "waiting-approval"), (gate, outcome)
        else:
            assert outcome.gate != gate, (gate, outcome)
            assert outcome.status == baseline.status, (gate, outcome)


def test_every_gate_covers_some_kind_and_the_gates_run_in_the_tables_order():
    assert tuple(name for name, _ in GATES) == GATE_ORDER
    assert {g for a in ACTIONS.values() for g in a.gates} == set(GATE_ORDER)


@pytest.mark.parametrize("mode,kind,tier,expected", [
    ("supervised", "drain", 1, "waiting-approval"),
    ("supervised", "requeue-hang", 3, "waiting-approval"),
    ("supervised", "resume", 1, "allowed"),          # an operator's `repaired` started it
    ("supervised", "undo", 1, "allowed"),
    ("auto", "drain", 2, "waiting-approval"),
    ("auto", "drain", 3, "refused"),
    ("auto", "requeue-hang", 3, "allowed"),          # the job opted in: in-band evidence is T3
    ("auto", "redrain", 1, "allowed"),
])
def test_the_mode_gate_reads_the_kinds_approval_rule(mode, kind, tier, expected):
    ctx = permissive()
    ctx = dataclasses.replace(ctx, settings=dataclasses.replace(ctx.settings, mode=mode))
    outcome = gate_one(dataclasses.replace(decision(kind), tier=tier), ctx)
    assert outcome.status == expected, outcome
    approved = gate_one(dataclasses.replace(decision(kind), tier=tier), dataclasses.replace(ctx, approved={f"{kind}:node01:x"}))
    assert approved.status == ("refused" if expected == "refused" else "allowed")


def test_a_hang_requeue_spends_its_own_budget_not_the_removals():
    ctx = permissive()
    requeues = [dataclasses.replace(decision("requeue-hang"), id=f"requeue-hang:{j}:1", target=j) for j in "12"]
    outs = apply_gates([*requeues, decision("drain")], ctx)
    assert [o.label for o in outs] == ["allowed", "refused-by-rate-limit", "allowed"]
    assert outs[1].reason == "hang requeue budget: 1 of 1 in the last hour"


def test_a_reintegrations_resume_passes_a_capacity_floor_and_the_ownership_proof():
    ctx = hostile("capacity")
    assert gate_one(decision("drain"), ctx).gate == "capacity"
    assert gate_one(decision("resume"), ctx).status == "allowed"
    assert gate_one(decision("resume"), hostile("ownership")).gate == "ownership"


def test_the_kind_sets_are_read_off_the_table():
    assert actions.REMOVING_KINDS == {"drain", "drain-and-requeue", "reboot-asap"}
    assert actions.ACTING_KINDS == {k for k, a in ACTIONS.items() if a.call}
    assert NODE_STATE_KINDS == {"drain", "drain-and-requeue", "reboot-asap"}
    # the ledger keeps its own list of the removing action kinds for its budgets: they must agree
    assert set(REMEDIATION_KINDS) == {ACTIONS[k].records for k in actions.REMOVING_KINDS}
    assert set(actions.DECISION_KINDS) == set(actions.DecisionKind.__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", [k for k, a in ACTIONS.items() if a.call])
def test_every_write_is_one_backend_call(kind):
    call, args = call_args(decision(kind))
    assert call == ACTIONS[kind].call and callable(getattr(SlurmBackend, call))
    assert args


def test_a_row_that_breaks_the_rules_is_refused():
    with pytest.raises(ValueError, match="capacity floor"):
        ActionKind("x", "drain", target="node", records="drain", changes_node=True, removes_capacity=True, holds=True,
                   approval="tier", budget="removals", gates=("mode", "rate-limit"), proposed_by="")
    with pytest.raises(ValueError, match="mode gate"):
        ActionKind("x", "resume", target="node", records="resume", changes_node=True, removes_capacity=False,
                   holds=False, approval="", budget="", gates=(), proposed_by="")


def _doc_rows() -> dict[str, list[str]]:
    text = DOC.read_text()
    start = text.index("| kind | backend call |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_the_docs_action_table_matches_the_code():
    rows = _doc_rows()
    assert list(rows) == list(ACTIONS)
    for kind, cells in rows.items():
        a = ACTIONS[kind]
        call, node, removes, gates, approval, budget = cells[1:7]
        assert call.strip("`") == (a.call or "—"), kind
        assert (approval, budget) == (a.approval or "—", a.budget or "—"), kind
        assert node == ("yes" if a.changes_node else "no"), kind
        assert removes == ("yes" if a.removes_capacity else "no"), kind
        assert re.findall(r"[a-z-]+", gates.replace("—", "")) == list(a.gates), kind
