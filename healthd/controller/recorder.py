"""What the round decided, in the ledger: each gate outcome recorded once, and the operators' verdicts
on the decisions that wait for one.

A decision is recorded once per proposal, incident and outcome: a proposal the gates refuse round
after round for the same reason is one ledger row, a refusal by another gate a new row (the ledger
says why a decision waits now), and an approved decision's waiting row moves on to `allowed`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics

LEDGER_OUTCOME = {"allowed": "allowed", "waiting-approval": "waiting", "refused": "refused", "recorded": "refused"}
"""gates' GateResult.status -> the ledger's decision outcome (`recorded` is a refusal by policy)."""


def ledger_outcome(outcome: GateResult) -> tuple[str, str | None, str | None]:
    """(outcome, refused_gate, refused_reason) in the ledger's vocabulary."""
    status = LEDGER_OUTCOME[outcome.status]
    if outcome.status == "recorded":
        return status, "policy", outcome.reason or outcome.decision.note or "recorded only"
    if status == "refused":
        return status, outcome.gate or "error", outcome.reason or "refused"
    return status, None, None


@dataclass(frozen=True)
class Verdicts:
    """The operators' verdicts on decisions that wait for one, for incidents still open (a verdict never
    carries over to a later incident with the same decision id)."""

    approved: frozenset[str] = frozenset()
    """Decision ids an operator approved (`healthctl approve`)."""
    rejected: Mapping[str, str] = field(default_factory=dict)
    """Decision id -> the operator who rejected it (`healthctl reject`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rejected", MappingProxyType(dict(self.rejected)))


def verdicts(ledger: Ledger, open_incidents: Collection[int]) -> Verdicts:
    """The verdicts on the waiting decisions of `open_incidents` (and of decisions without one)."""
    approved: set[str] = set()
    rejected: dict[str, str] = {}
    for row in ledger.decisions(outcome="waiting"):
        if row.incident_id is not None and row.incident_id not in open_incidents:
            continue
        verdict = ledger.approval(row.id)
        if verdict is None or not isinstance(row.evidence, dict):
            continue
        if verdict.verdict == "approve":
            approved.add(str(row.evidence.get("decision", "")))
        else:
            rejected[str(row.evidence.get("decision", ""))] = verdict.operator
    return Verdicts(frozenset(approved), rejected)


class Recorder:
    """Records gate outcomes in the ledger, each once. Its memory (which outcome each proposal's row
    holds) lives as long as the controller; the ledger keeps the rows."""

    def __init__(self, ledger: Ledger, metrics: ControllerMetrics):
        self.ledger = ledger
        self.metrics = metrics
        # (decision id, incident) -> (ledger outcome, refusing gate, ledger row id): the same decision id
        # recurs for a later incident of the same fault, which is a new ledger row
        self._recorded: dict[tuple[str, str], tuple[str, str | None, int]] = {}

    def _known(self, outcome: GateResult) -> bool:
        """The ledger's row for this decision and incident holds this outcome already."""
        prev = self._recorded.get((outcome.decision.id, outcome.decision.incident))
        return prev is not None and prev[:2] == ledger_outcome(outcome)[:2]

    def record(self, outcome: GateResult, now: float, mode: str) -> int:
        """The ledger row of the outcome: recorded now, or the row an earlier round recorded for it."""
        d = outcome.decision
        status, gate, reason = ledger_outcome(outcome)
        prev = self._recorded.get((d.id, d.incident))
        if prev is not None and prev[:2] == (status, gate):
            return prev[2]
        if prev is not None and prev[0] == "waiting" and status == "allowed":
            self.ledger.set_decision_outcome(prev[2], "allowed")
            row_id = prev[2]
        else:
            row = self.ledger.record_decision(
                node=d.node, kind=d.recorded_kind, tier=f"T{d.tier}", mode=mode, reason=d.reason or d.note,
                outcome=status, incident_id=int(d.incident) if d.incident.isdigit() else None,
                evidence={"decision": d.id, "findings": list(d.finding_ids), **d.detail},
                refused_gate=gate, refused_reason=reason, at=now)
            row_id = row.id
        self._recorded[(d.id, d.incident)] = (status, gate, row_id)
        if status == "refused" and outcome.status == "refused":
            self.metrics.refusals.labels(gate=gate or "error").inc()
        return row_id

    def record_batch(self, outcomes: Iterable[GateResult], now: float, mode: str) -> None:
        """Record the outcomes nothing is applied for in ONE transaction: when a whole fleet's agents
        go silent, 10,000 stale-report decisions were 10,000 fsynced commits under the round lock."""
        # an outcome recorded by an earlier round needs no write: a round repeating them opens nothing
        new = [o for o in outcomes if not self._known(o)]
        if not new:
            return
        before = dict(self._recorded)
        try:
            with self.ledger.transaction():
                for outcome in new:
                    self.record(outcome, now, mode)
        except BaseException:
            self._recorded = before  # rolled back: forget the row ids that no longer exist
            raise
