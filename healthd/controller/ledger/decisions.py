"""The ledger's decisions and the operators' approvals of them: what policy proposed, in which mode,
what the gates made of it (allowed, waiting for an operator, or refused by one gate for one reason),
and each operator's verdict."""

from __future__ import annotations

import json
from typing import Any

from healthd.controller.ledger.core import LedgerCore, at_or_now, dump_json
from healthd.controller.ledger.records import (
    APPROVAL_VERDICTS,
    DECISION_OUTCOMES,
    Approval,
    DecisionRecord,
    LedgerError,
)


class DecisionStore(LedgerCore):
    """Decisions and approvals."""

    # -- decisions ---------------------------------------------------------------------------------

    _DECISION_COLS = "id, incident_id, node, kind, tier, mode, reason, evidence, decided_at, outcome, refused_gate, refused_reason"

    @staticmethod
    def _decision(row: tuple[Any, ...]) -> DecisionRecord:
        return DecisionRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], json.loads(row[7]), row[8], row[9], row[10], row[11])

    def _validate_outcome(self, outcome: str, gate: str | None, reason: str | None) -> None:
        if outcome not in DECISION_OUTCOMES:
            raise LedgerError(f"{self.path}: decision outcome {outcome!r} is not one of {DECISION_OUTCOMES}")
        if outcome == "refused" and not (gate and reason):
            raise LedgerError(f"{self.path}: a refused decision needs the refusing gate and its one-line reason")

    def record_decision(
        self,
        *,
        node: str,
        kind: str,
        tier: str,
        mode: str,
        reason: str,
        outcome: str,
        incident_id: int | None = None,
        evidence: Any = None,
        refused_gate: str | None = None,
        refused_reason: str | None = None,
        at: float | None = None,
    ) -> DecisionRecord:
        """Record a policy decision and what the gates made of it (`allowed`, `waiting` for an
        operator, or `refused` by `refused_gate` for `refused_reason`). `mode` is the controller's
        mode at the time (observe/supervised/auto)."""
        self._validate_outcome(outcome, refused_gate, refused_reason)
        with self.transaction():
            cur = self._exec(
                f"INSERT INTO decisions ({self._DECISION_COLS}) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (incident_id, node, kind, tier, mode, reason, dump_json(evidence), at_or_now(at), outcome,
                 refused_gate if outcome == "refused" else None, refused_reason if outcome == "refused" else None),
            )
            decision_id = int(cur.lastrowid or 0)
        return self.decision(decision_id)  # type: ignore[return-value]

    def set_decision_outcome(self, decision_id: int, outcome: str, *, refused_gate: str | None = None, refused_reason: str | None = None) -> DecisionRecord:
        """Move a decision on (e.g. `waiting` → `allowed` after approval, or → `refused`)."""
        self._validate_outcome(outcome, refused_gate, refused_reason)
        with self.transaction():
            cur = self._exec(
                "UPDATE decisions SET outcome = ?, refused_gate = ?, refused_reason = ? WHERE id = ?",
                (outcome, refused_gate if outcome == "refused" else None, refused_reason if outcome == "refused" else None, decision_id),
            )
            if cur.rowcount != 1:
                raise LedgerError(f"{self.path}: no decision {decision_id}")
        return self.decision(decision_id)  # type: ignore[return-value]

    def decision(self, decision_id: int) -> DecisionRecord | None:
        row = self.query_one(f"SELECT {self._DECISION_COLS} FROM decisions WHERE id = ?", (decision_id,))
        return None if row is None else self._decision(row)

    def decisions(self, *, incident_id: int | None = None, outcome: str | None = None) -> list[DecisionRecord]:
        rows = self.query(
            f"SELECT {self._DECISION_COLS} FROM decisions WHERE (? IS NULL OR incident_id = ?) AND (? IS NULL OR outcome = ?) ORDER BY id",
            (incident_id, incident_id, outcome, outcome),
        )
        return [self._decision(r) for r in rows]

    def latest_decision(self, kind: str, decision_key: str) -> DecisionRecord | None:
        """The latest decision recorded under `kind` for the proposal `decision_key` (the stable id a
        proposal carries in its evidence, e.g. `requeue-hang:123:411`), or None: what was decided
        about it before a restart, which the controller's memory of the round no longer holds."""
        row = self.query_one(
            f"SELECT {self._DECISION_COLS} FROM decisions WHERE kind = ? "
            "AND json_extract(evidence, '$.decision') = ? ORDER BY id DESC LIMIT 1",
            (kind, decision_key),
        )
        return None if row is None else self._decision(row)

    def waiting_decisions(self) -> list[DecisionRecord]:
        """Decisions waiting for an operator and not yet approved or rejected."""
        rows = self.query(
            f"SELECT {self._DECISION_COLS} FROM decisions WHERE outcome = 'waiting' "
            "AND id NOT IN (SELECT decision_id FROM approvals) ORDER BY id"
        )
        return [self._decision(r) for r in rows]

    # -- approvals ---------------------------------------------------------------------------------

    def record_approval(self, decision_id: int, *, operator: str, verdict: str, why: str | None = None, at: float | None = None) -> Approval:
        """An operator's verdict on a decision; one per decision, and a rejection needs a why."""
        if verdict not in APPROVAL_VERDICTS:
            raise LedgerError(f"{self.path}: verdict {verdict!r} is not one of {APPROVAL_VERDICTS}")
        if verdict == "reject" and not why:
            raise LedgerError(f"{self.path}: a rejection needs a why")
        with self.transaction():
            if self.decision(decision_id) is None:
                raise LedgerError(f"{self.path}: no decision {decision_id}")
            existing = self.approval(decision_id)
            if existing is not None:
                raise LedgerError(f"{self.path}: decision {decision_id} was already {existing.verdict}d by {existing.operator}")
            self._exec(
                "INSERT INTO approvals (decision_id, operator, verdict, why, at) VALUES (?, ?, ?, ?, ?)",
                (decision_id, operator, verdict, why, at_or_now(at)),
            )
        return self.approval(decision_id)  # type: ignore[return-value]

    def approval(self, decision_id: int) -> Approval | None:
        row = self.query_one("SELECT id, decision_id, operator, verdict, why, at FROM approvals WHERE decision_id = ?", (decision_id,))
        return None if row is None else Approval(*row)
