"""The ledger's incidents, with the findings they grow from and the clears that end their evidence:
what was seen on which nodes and GPUs, each incident's timeline and escalation, and how it closed."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from healthd.controller.ledger.core import LedgerCore, at_or_now, dump_json
from healthd.controller.ledger.records import (
    CLEAR_SCOPES,
    CLOSED_INCIDENT_STATUSES,
    ESCALATIONS,
    Clear,
    FindingRecord,
    Incident,
    LedgerError,
)


class IncidentStore(LedgerCore):
    """Findings, incidents and clears."""

    # -- findings ----------------------------------------------------------------------------------

    _FINDING_COLS = "node, finding_id, gpu_serial, attribution, tier, action, summary, evidence, first_seen, last_seen"

    @staticmethod
    def _finding(row: tuple[Any, ...]) -> FindingRecord:
        return FindingRecord(row[0], row[1], row[2] or None, row[3], row[4], row[5], row[6], json.loads(row[7]), row[8], row[9])

    def record_finding(
        self,
        node: str,
        finding_id: str,
        *,
        gpu_serial: str | None = None,
        attribution: str,
        tier: str,
        action: str,
        summary: str,
        evidence: Any = None,
        at: float | None = None,
    ) -> FindingRecord:
        """Insert a finding, or refresh one already known (keeps first_seen, moves last_seen)."""
        ts = at_or_now(at)
        with self.transaction():
            self._exec(
                f"INSERT INTO findings ({self._FINDING_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (node, finding_id, gpu_serial) DO UPDATE SET attribution = excluded.attribution, "
                "tier = excluded.tier, action = excluded.action, summary = excluded.summary, evidence = excluded.evidence, "
                "last_seen = MAX(last_seen, excluded.last_seen)",
                (node, finding_id, gpu_serial or "", attribution, tier, action, summary, dump_json(evidence), ts, ts),
            )
            found = self.finding(node, finding_id, gpu_serial)
        assert found is not None
        return found

    def finding(self, node: str, finding_id: str, gpu_serial: str | None = None) -> FindingRecord | None:
        row = self.query_one(
            f"SELECT {self._FINDING_COLS} FROM findings WHERE node = ? AND finding_id = ? AND gpu_serial = ?",
            (node, finding_id, gpu_serial or ""),
        )
        return None if row is None else self._finding(row)

    def findings(self, node: str | None = None, *, since: float | None = None) -> list[FindingRecord]:
        """Findings, optionally of one node and/or last seen at or after `since`."""
        rows = self.query(
            f"SELECT {self._FINDING_COLS} FROM findings WHERE (? IS NULL OR node = ?) AND (? IS NULL OR last_seen >= ?) "
            "ORDER BY first_seen, node, finding_id, gpu_serial",
            (node, node, since, since),
        )
        return [self._finding(r) for r in rows]

    # -- incidents ---------------------------------------------------------------------------------

    _TIMELINE = ("first_evidence_at", "detected_at", "decided_at", "action_applied_at", "back_in_service_at")

    def open_incident(
        self,
        signature: str,
        *,
        attribution: str,
        tier: str,
        nodes: Iterable[str] = (),
        gpu_serials: Iterable[str] = (),
        jobs: Iterable[str] = (),
        status: str = "open",
        first_evidence_at: float | None = None,
        detected_at: float | None = None,
        at: float | None = None,
    ) -> Incident:
        if not signature or not status:
            raise LedgerError(f"{self.path}: an incident needs a signature and a status")
        ts = at_or_now(at)
        with self.transaction():
            cur = self._exec(
                "INSERT INTO incidents (signature, attribution, tier, status, jobs, first_evidence_at, detected_at, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (signature, attribution, tier, status, dump_json(sorted(set(map(str, jobs)))), first_evidence_at, detected_at, ts),
            )
            incident_id = int(cur.lastrowid or 0)
            self._add_members(incident_id, nodes, gpu_serials)
        return self.incident(incident_id)  # type: ignore[return-value]

    def _add_members(self, incident_id: int, nodes: Iterable[str], gpu_serials: Iterable[str]) -> None:
        for node in nodes:
            self._exec("INSERT OR IGNORE INTO incident_nodes (incident_id, node) VALUES (?, ?)", (incident_id, node))
        for serial in gpu_serials:
            self._exec("INSERT OR IGNORE INTO incident_gpus (incident_id, gpu_serial) VALUES (?, ?)", (incident_id, serial))

    def update_incident(
        self,
        incident_id: int,
        *,
        status: str | None = None,
        add_nodes: Iterable[str] = (),
        add_gpu_serials: Iterable[str] = (),
        add_jobs: Iterable[str] = (),
    ) -> Incident:
        """Change the status and/or add members (nodes, GPU serials, jobs only ever accumulate)."""
        with self.transaction():
            current = self._existing(self.incident(incident_id), "incident", incident_id)
            jobs = sorted(set(current.jobs) | set(map(str, add_jobs)))
            self._exec(
                "UPDATE incidents SET status = COALESCE(?, status), jobs = ? WHERE id = ?",
                (status or None, dump_json(jobs), incident_id),
            )
            self._add_members(incident_id, add_nodes, add_gpu_serials)
        return self.incident(incident_id)  # type: ignore[return-value]

    def mark_timeline(self, incident_id: int, stage: str, at: float | None = None, *, overwrite: bool = False) -> Incident:
        """Set one timeline stamp (`first_evidence_at`, `detected_at`, `decided_at`,
        `action_applied_at`, `back_in_service_at`). The first stamp wins unless `overwrite`."""
        if stage not in self._TIMELINE:
            raise LedgerError(f"{self.path}: unknown timeline stage {stage!r}; expected one of {self._TIMELINE}")
        ts = at_or_now(at)
        with self.transaction():
            # `stage` is one of the fixed column names checked above, never caller text.
            cur = self._exec(
                f"UPDATE incidents SET {stage} = CASE WHEN ? OR {stage} IS NULL THEN ? ELSE {stage} END WHERE id = ?",
                (1 if overwrite else 0, ts, incident_id),
            )
            if cur.rowcount != 1:
                raise LedgerError(f"{self.path}: no incident {incident_id}")
        return self.incident(incident_id)  # type: ignore[return-value]

    _INCIDENT_COLS = (
        "id, signature, attribution, tier, status, jobs, first_evidence_at, detected_at, decided_at, "
        "action_applied_at, back_in_service_at, created_at, escalation, closed_at, closed_by, close_why"
    )

    def _incident(self, row: tuple[Any, ...], members: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> Incident:
        iid = row[0]
        if members is None:
            nodes = tuple(r[0] for r in self.query("SELECT node FROM incident_nodes WHERE incident_id = ? ORDER BY node",
                                                   (iid,)))
            gpus = tuple(r[0] for r in self.query(
                "SELECT gpu_serial FROM incident_gpus WHERE incident_id = ? ORDER BY gpu_serial", (iid,)))
        else:
            nodes, gpus = members
        return Incident(
            id=iid, signature=row[1], attribution=row[2], tier=row[3], status=row[4], nodes=nodes, gpu_serials=gpus,
            jobs=tuple(json.loads(row[5])), first_evidence_at=row[6], detected_at=row[7], decided_at=row[8],
            action_applied_at=row[9], back_in_service_at=row[10], created_at=row[11], escalation=row[12],
            closed_at=row[13], closed_by=row[14], close_why=row[15],
        )

    def incident(self, incident_id: int) -> Incident | None:
        with self._lock:
            row = self.query_one(f"SELECT {self._INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,))
            return None if row is None else self._incident(row)

    def incidents(self, *, status: str | None = None, node: str | None = None, since: float | None = None) -> list[Incident]:
        """Incidents, filtered by status, member node and/or created at or after `since`; oldest first."""
        where = ("WHERE (? IS NULL OR status = ?) AND (? IS NULL OR created_at >= ?) "
                 "AND (? IS NULL OR id IN (SELECT incident_id FROM incident_nodes WHERE node = ?))")
        args = (status, status, since, since, node, node)
        with self._lock:
            rows = self.query(f"SELECT {self._INCIDENT_COLS} FROM incidents {where} ORDER BY id", args)
            if not rows:
                return []
            # the members of every incident listed in two statements, not two per incident
            nodes: dict[int, list[str]] = {}
            for iid, member in self.query(f"SELECT incident_id, node FROM incident_nodes WHERE incident_id IN "
                                          f"(SELECT id FROM incidents {where}) ORDER BY node", args):
                nodes.setdefault(iid, []).append(member)
            gpus: dict[int, list[str]] = {}
            for iid, serial in self.query(f"SELECT incident_id, gpu_serial FROM incident_gpus WHERE incident_id IN "
                                          f"(SELECT id FROM incidents {where}) ORDER BY gpu_serial", args):
                gpus.setdefault(iid, []).append(serial)
            return [self._incident(r, (tuple(nodes.get(r[0], ())), tuple(gpus.get(r[0], ())))) for r in rows]

    def set_escalation(self, incident_id: int, escalation: str) -> Incident:
        """Record the incident's escalation; a stronger one (contact-support) is never downgraded."""
        if escalation not in ESCALATIONS:
            raise LedgerError(f"{self.path}: unknown escalation {escalation!r}; expected one of {ESCALATIONS}")
        with self.transaction():
            current = self._existing(self.incident(incident_id), "incident", incident_id)
            if current.escalation is None or ESCALATIONS.index(escalation) > ESCALATIONS.index(current.escalation):
                self._exec("UPDATE incidents SET escalation = ? WHERE id = ?", (escalation, incident_id))
        return self.incident(incident_id)  # type: ignore[return-value]

    def open_incident_keys(self) -> dict[tuple[str, str], int]:
        """(node, signature) -> id of the open incident holding it, in one statement (each round)."""
        rows = self.query("SELECT n.node, i.signature, i.id FROM incidents i JOIN incident_nodes n ON n.incident_id = i.id "
                          "WHERE i.status = 'open' ORDER BY i.id")
        return {(str(node), str(sig)): int(iid) for node, sig, iid in rows}

    def open_incident_counts(self) -> dict[tuple[str, str], int]:
        """(tier, attribution) -> open incidents, in one statement (the round's gauges)."""
        rows = self.query("SELECT tier, attribution, COUNT(*) FROM incidents WHERE status = 'open' GROUP BY tier, attribution")
        return {(str(tier), str(attr)): int(n) for tier, attr, n in rows}

    def incident_stage_times(self, since: float) -> list[tuple[int, float, float | None, float | None, float | None,
                                                               float | None, float | None]]:
        """(id, created_at, first_evidence_at, detected_at, decided_at, action_applied_at,
        back_in_service_at) of the incidents created at or after `since`, oldest first: the stage
        timings the metrics watch, without the members a full Incident carries."""
        return [tuple(r) for r in self.query(  # type: ignore[misc]
            "SELECT id, created_at, first_evidence_at, detected_at, decided_at, action_applied_at, back_in_service_at "
            "FROM incidents WHERE created_at >= ? ORDER BY id", (since,))]

    # -- clears ------------------------------------------------------------------------------------

    _CLEAR_COLS = "id, node, finding_id, before, scope, incident_id, by, why, at"

    def add_clears(self, node: str, finding_ids: Iterable[str], *, before: float, scope: str,
                   incident_id: int | None = None, by: str | None = None, why: str | None = None,
                   at: float | None = None) -> list[Clear]:
        """Evidence of these findings on `node` up to `before` no longer counts, in `scope`."""
        if scope not in CLEAR_SCOPES:
            raise LedgerError(f"{self.path}: clear scope {scope!r} is not one of {CLEAR_SCOPES}")
        ts = at_or_now(at)
        with self.transaction():
            for fid in sorted(set(finding_ids)):
                self._exec("INSERT INTO clears (node, finding_id, before, scope, incident_id, by, why, at) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (node, fid, before, scope, incident_id, by, why, ts))
        return [c for c in self.clears(node=node) if c.at == ts]

    def clears(self, *, since: float | None = None, node: str | None = None) -> list[Clear]:
        """Clears recorded at or after `since` (and of `node`), oldest first."""
        rows = self.query(f"SELECT {self._CLEAR_COLS} FROM clears WHERE (? IS NULL OR at >= ?) AND (? IS NULL OR node = ?) "
                          "ORDER BY id", (since, since, node, node))
        return [Clear(*r) for r in rows]

    def close_incident(self, incident_id: int, status: str, *, by: str | None, why: str, at: float | None = None) -> Incident:
        """End an incident (`closed` by an operator, `false_positive` after an undo, `handed-over` when
        someone else took its node, `resolved`). Its findings' current episode is cleared on its nodes,
        so the same evidence never re-opens it; a new episode opens a new incident."""
        if status not in CLOSED_INCIDENT_STATUSES:
            raise LedgerError(f"{self.path}: {status!r} is not one of {CLOSED_INCIDENT_STATUSES}")
        ts = at_or_now(at)
        with self.transaction():
            current = self._existing(self.incident(incident_id), "incident", incident_id)
            self._exec("UPDATE incidents SET status = ?, closed_at = ?, closed_by = ?, close_why = ? WHERE id = ?",
                       (status, ts, by, why, incident_id))
            if not current.signature.startswith("group:"):
                for node in current.nodes:
                    self.add_clears(node, [current.signature], before=ts, scope="episode", incident_id=incident_id,
                                    by=by, why=why, at=ts)
        return self.incident(incident_id)  # type: ignore[return-value]
