"""The ledger's reintegrations: a node healthd took out of service on its way back, from the request
through validation and probation to its end, moving its incident's status with it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from healthd.controller.ledger.core import LedgerCore, at_or_now, dump_json
from healthd.controller.ledger.records import (
    ACTIVE_REINTEGRATION_STATES,
    REINTEGRATION_STATES,
    LedgerError,
    Reintegration,
)


class ReintegrationStore(LedgerCore):
    """Reintegrations."""

    _REINTEGRATION_COLS = (
        "id, node, incident_id, trigger, operator, why, state, reservation, findings, requested_at, started_at, "
        "validated_at, probation_until, ended_at, results, detail"
    )

    @staticmethod
    def _reintegration(row: tuple[Any, ...]) -> Reintegration:
        return Reintegration(
            id=row[0], node=row[1], incident_id=row[2], trigger=row[3], operator=row[4], why=row[5], state=row[6],
            reservation=row[7], findings=tuple(json.loads(row[8])), requested_at=row[9], started_at=row[10],
            validated_at=row[11], probation_until=row[12], ended_at=row[13], results=json.loads(row[14]), detail=row[15],
        )

    def request_reintegration(
        self,
        node: str,
        *,
        incident_id: int | None,
        trigger: str,
        findings: Iterable[str] = (),
        operator: str | None = None,
        why: str | None = None,
        at: float | None = None,
    ) -> Reintegration:
        """Queue `node` for reintegration; the node's reintegration already in flight is returned
        unchanged instead of a second one."""
        with self.transaction():
            active = self.active_reintegration(node)
            if active is not None:
                return active
            cur = self._exec(
                "INSERT INTO reintegrations (node, incident_id, trigger, operator, why, state, findings, requested_at) "
                "VALUES (?, ?, ?, ?, ?, 'requested', ?, ?)",
                (node, incident_id, trigger, operator, why, dump_json(sorted(set(findings))), at_or_now(at)),
            )
            rid = int(cur.lastrowid or 0)
            if incident_id is not None:
                self._exec("UPDATE incidents SET status = 'reintegrating' WHERE id = ?", (incident_id,))
        return self.reintegration(rid)  # type: ignore[return-value]

    def update_reintegration(
        self,
        rid: int,
        *,
        state: str | None = None,
        reservation: str | None = None,
        results: Any = None,
        detail: str | None = None,
        probation_until: float | None = None,
        stamp: str | None = None,
        incident_status: str | None = None,
        at: float | None = None,
    ) -> Reintegration:
        """Move a reintegration on (and its incident's status with it, in the same transaction).
        `stamp` is one of started_at, validated_at, ended_at."""
        if state is not None and state not in REINTEGRATION_STATES:
            raise LedgerError(f"{self.path}: unknown reintegration state {state!r}")
        if stamp is not None and stamp not in ("started_at", "validated_at", "ended_at"):
            raise LedgerError(f"{self.path}: unknown reintegration stamp {stamp!r}")
        ts = at_or_now(at)
        with self.transaction():
            current = self._existing(self.reintegration(rid), "reintegration", rid)
            self._exec(
                "UPDATE reintegrations SET state = COALESCE(?, state), reservation = COALESCE(?, reservation), "
                "results = COALESCE(?, results), detail = COALESCE(?, detail), "
                "probation_until = COALESCE(?, probation_until) WHERE id = ?",
                (state, reservation, None if results is None else dump_json(results), detail, probation_until, rid),
            )
            if stamp is not None:
                # `stamp` is one of the fixed column names checked above, never caller text.
                self._exec(f"UPDATE reintegrations SET {stamp} = ? WHERE id = ?", (ts, rid))
            if incident_status is not None and current.incident_id is not None:
                self._exec("UPDATE incidents SET status = ? WHERE id = ?", (incident_status, current.incident_id))
        return self.reintegration(rid)  # type: ignore[return-value]

    def reintegration_counts(self) -> dict[str, int]:
        """state -> how many reintegrations are in it (for metrics; one GROUP BY, not the rows)."""
        return {state: int(n) for state, n in self.query("SELECT state, COUNT(*) FROM reintegrations GROUP BY state")}

    def reintegration(self, rid: int) -> Reintegration | None:
        row = self.query_one(f"SELECT {self._REINTEGRATION_COLS} FROM reintegrations WHERE id = ?", (rid,))
        return None if row is None else self._reintegration(row)

    def active_reintegration(self, node: str) -> Reintegration | None:
        row = self.query_one(
            f"SELECT {self._REINTEGRATION_COLS} FROM reintegrations WHERE node = ? "
            "AND state IN ('requested', 'validating', 'probation')",
            (node,),
        )
        return None if row is None else self._reintegration(row)

    def reintegrations(self, *, state: str | None = None, node: str | None = None, incident_id: int | None = None,
                       since: float | None = None) -> list[Reintegration]:
        """Reintegrations, oldest first; `state="active"` selects those in flight, `since` those
        requested at or after it."""
        states = ACTIVE_REINTEGRATION_STATES if state == "active" else (state,) if state else REINTEGRATION_STATES
        rows = self.query(
            f"SELECT {self._REINTEGRATION_COLS} FROM reintegrations WHERE state IN ({', '.join('?' for _ in states)}) "
            "AND (? IS NULL OR node = ?) AND (? IS NULL OR incident_id = ?) AND (? IS NULL OR requested_at >= ?) "
            "ORDER BY id",
            (*states, node, node, incident_id, incident_id, since, since),
        )
        return [self._reintegration(r) for r in rows]
