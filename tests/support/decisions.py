"""Controller decisions for the executor, daemon and reconciliation tests: a drain decision as
policy makes one, and the ledger a SIGKILL between planning and the Slurm call leaves."""

from __future__ import annotations

from healthd.controller.executor import Executor, idempotency_key
from healthd.controller.policy import Decision, make_reason

NOW = 1_800_000_000.0


def drain_decision(node: str = "node02", kind: str = "drain", incident: str = "H1") -> Decision:
    return Decision(id=f"{kind}:{node}:xid:gpu0:79", kind=kind, node=node,  # type: ignore[arg-type]
                    reason=make_reason("xid 79 gpu0: fell off the bus", incident), tier=1,
                    attribution="hardware", finding_ids=("xid:gpu0:79",), incident=incident, decided_at=NOW)


def crash_after_plan(ledger, be, d, at: float = NOW):
    """A decision recorded and its action planned, then nothing: what a SIGKILL before the Slurm call leaves."""
    ex = Executor(be, ledger, clock=lambda: NOW)
    row = ledger.record_decision(node=d.node, kind=d.kind, tier="T1", mode="auto", reason=d.reason, outcome="allowed",
                                 at=at)
    ledger.plan_action(decision_id=row.id, idempotency_key=idempotency_key(d), node=d.node, kind=d.kind,
                       argv=ex.argv_for(d), reason=d.reason, at=at)
    return row
