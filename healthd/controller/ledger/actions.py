"""The ledger's actions and holds: every Slurm write healthd plans, makes and sees end, and the nodes
it holds out of service by those writes (ownership by record, healthd.controller.ownership), with the
counts the rate limiter and the escalation read from them.

Actions are written in three steps: `plan_action` (status `planned`, keyed by an idempotency key
that is UNIQUE), execute, then `mark_applied` / `mark_failed`. A crash between the steps leaves a
`planned` row that `pending_actions()` returns at start; planning again with the same key returns
that same row, never a second one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from healthd.controller.ledger.core import at_or_now, dump_json
from healthd.controller.ledger.decisions import DecisionStore
from healthd.controller.ledger.records import (
    BUDGET_STATUSES,
    ENDED_STATUSES,
    REMEDIATED_STATUSES,
    REMEDIATION_KINDS,
    Action,
    LedgerError,
)
from healthd.controller.ownership import NODE_STATE_KINDS, Hold


class ActionStore(DecisionStore):
    """Actions and holds. An action is planned for a decision, whose reason a node-state write sets
    and whose incident a hold keeps: hence over the decisions."""

    # -- actions -----------------------------------------------------------------------------------

    _ACTION_COLS = (
        "id, decision_id, idempotency_key, node, partition, kind, argv, evidence, status, outcome, "
        "planned_at, applied_at, failed_at, undone_at, series, attempt, reason, ended_at, slurm_reason_time, "
        "slurm_reason_user"
    )

    @staticmethod
    def _action(row: tuple[Any, ...]) -> Action:
        return Action(
            id=row[0], decision_id=row[1], idempotency_key=row[2], node=row[3], partition=row[4], kind=row[5],
            argv=tuple(json.loads(row[6])), evidence=json.loads(row[7]), status=row[8], outcome=row[9],
            planned_at=row[10], applied_at=row[11], failed_at=row[12], undone_at=row[13], series=row[14],
            attempt=row[15], reason=row[16], ended_at=row[17], slurm_reason_time=row[18], slurm_reason_user=row[19],
        )

    def plan_action(
        self,
        *,
        decision_id: int,
        idempotency_key: str,
        node: str,
        kind: str,
        argv: Sequence[str],
        partition: str | None = None,
        evidence: Any = None,
        series: str | None = None,
        attempt: int = 1,
        reason: str | None = None,
        at: float | None = None,
    ) -> Action:
        """Record an action as `planned` before it is executed. If `idempotency_key` is already
        known, the existing row is returned unchanged (whatever its status): the recorded argv wins,
        so a restart re-plans to the very same call and never to a second one. `series` groups the
        attempts of one decision for one incident (default: the key itself, a first attempt);
        `reason` is the Slurm reason a node-state write sets (default: its decision's reason)."""
        if not idempotency_key:
            raise LedgerError(f"{self.path}: an action needs an idempotency key")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise LedgerError(f"{self.path}: argv must be a non-empty list of strings")
        with self.transaction():
            if kind in NODE_STATE_KINDS and not reason:
                decision = self.decision(decision_id)  # policy's decision reason is the Slurm reason
                reason = decision.reason if decision is not None else None
                if not reason:
                    raise LedgerError(f"{self.path}: a {kind} action needs the reason it writes")
            self._exec(
                "INSERT INTO actions (decision_id, idempotency_key, series, attempt, node, partition, kind, argv, evidence, "
                "reason, status, planned_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'planned', ?) "
                "ON CONFLICT (idempotency_key) DO NOTHING",
                (decision_id, idempotency_key, series or idempotency_key, attempt, node, partition, kind,
                 dump_json(list(argv)), dump_json(evidence), reason, at_or_now(at)),
            )
            row = self.query_one(f"SELECT {self._ACTION_COLS} FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        assert row is not None
        return self._action(row)

    def _transition(self, action_id: int, to: str, from_: tuple[str, ...], stamp: str, outcome: str | None,
                    at: float | None) -> Action:
        # `stamp` is one of the fixed column names passed by the methods below.
        with self.transaction():
            current = self._existing(self.action(action_id), "action", action_id)
            if current.status == to:
                return current  # repeating a completed step is a no-op
            if current.status not in from_:
                raise LedgerError(f"{self.path}: action {action_id} is {current.status}; cannot mark it {to}")
            self._exec(
                f"UPDATE actions SET status = ?, outcome = COALESCE(?, outcome), {stamp} = ? WHERE id = ?",
                (to, outcome, at_or_now(at), action_id),
            )
            if current.status == "applied" or to in ENDED_STATUSES:
                self._exec("DELETE FROM holds WHERE action_id = ?", (action_id,))
        return self.action(action_id)  # type: ignore[return-value]

    def mark_applied(self, action_id: int, outcome: str | None = None, *, at: float | None = None,
                     reason_time: float | None = None, reason_user: str | None = None,
                     hold: bool = True) -> Action:
        """The write is in Slurm: returned without error (`planned` ->), or found there after its client
        reported failure (`failed` ->, an adoption). `reason_time`/`reason_user` are what Slurm showed
        for it right after (None when it could not be read back; the reconciler confirms later). A
        node-state write makes healthd the node's holder (unless `hold=False`: someone else already
        changed the node); a resume ends healthd's hold on its node."""
        with self.transaction():
            before = self.action(action_id)
            action = self._transition(action_id, "applied", ("planned", "failed", "abandoned"), "applied_at", outcome, at)
            if before is not None and before.status == "applied":
                return action  # applied already: repeating the step changes nothing
            self._exec("UPDATE actions SET slurm_reason_time = ?, slurm_reason_user = ? WHERE id = ?",
                       (reason_time, reason_user, action_id))
            if action.kind in NODE_STATE_KINDS and hold:
                decision = self.decision(action.decision_id)
                self._exec(
                    "INSERT INTO holds (node, action_id, incident_id, kind, reason, reason_time, reason_user, since, "
                    "planned_at, verified_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (node) DO UPDATE SET "
                    "action_id = excluded.action_id, incident_id = excluded.incident_id, kind = excluded.kind, "
                    "reason = excluded.reason, reason_time = excluded.reason_time, reason_user = excluded.reason_user, "
                    "since = excluded.since, planned_at = excluded.planned_at, verified_at = excluded.verified_at",
                    (action.node, action_id, decision.incident_id if decision else None, action.kind, action.reason,
                     reason_time, reason_user, action.applied_at, action.planned_at, action.applied_at),
                )
            elif action.kind == "resume":
                self._exec("DELETE FROM holds WHERE node = ?", (action.node,))
        return self.action(action_id)  # type: ignore[return-value]

    def mark_failed(self, action_id: int, outcome: str, *, at: float | None = None) -> Action:
        return self._transition(action_id, "failed", ("planned",), "failed_at", outcome, at)

    def mark_undone(self, action_id: int, outcome: str | None = None, *, at: float | None = None) -> Action:
        """An applied action reversed (`healthctl undo`). It keeps its applied_at for budgets."""
        return self._transition(action_id, "undone", ("applied",), "undone_at", outcome, at)

    def mark_abandoned(self, action_id: int, outcome: str, *, at: float | None = None) -> Action:
        """A planned action that is not in Slurm and will not be applied as planned (re-decided)."""
        return self._transition(action_id, "abandoned", ("planned",), "ended_at", outcome, at)

    def mark_ended(self, action_id: int, status: str, outcome: str, *, at: float | None = None) -> Action:
        """An applied write whose effect ended otherwise than by healthd: `lost`, `released` or
        `completed` (see ACTION_STATUSES). Ends healthd's hold on the node when it was this action's."""
        if status not in ("lost", "released", "completed"):
            raise LedgerError(f"{self.path}: {status!r} is not how an applied action ends")
        return self._transition(action_id, status, ("applied",), "ended_at", outcome, at)

    def action(self, action_id: int) -> Action | None:
        row = self.query_one(f"SELECT {self._ACTION_COLS} FROM actions WHERE id = ?", (action_id,))
        return None if row is None else self._action(row)

    def action_by_key(self, idempotency_key: str) -> Action | None:
        row = self.query_one(f"SELECT {self._ACTION_COLS} FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        return None if row is None else self._action(row)

    def actions(self, *, decision_id: int | None = None, node: str | None = None, status: str | None = None) -> list[Action]:
        rows = self.query(
            f"SELECT {self._ACTION_COLS} FROM actions WHERE (? IS NULL OR decision_id = ?) AND (? IS NULL OR node = ?) "
            "AND (? IS NULL OR status = ?) ORDER BY id",
            (decision_id, decision_id, node, node, status, status),
        )
        return [self._action(r) for r in rows]

    def latest_actions(self, kinds: Sequence[str], recent_since: float) -> list[Action]:
        """Of the actions of `kinds` applied or failed: the latest applied and the latest failed of each
        (node, kind), and every one applied or failed at or after `recent_since`; by id. What the
        hot-spare step reads each round, without decoding the whole history of its writes."""
        marks = ", ".join("?" * len(kinds))
        rows = self.query(
            f"SELECT {self._ACTION_COLS} FROM actions WHERE kind IN ({marks}) AND status IN ('applied', 'failed') "
            f"AND (id IN (SELECT MAX(id) FROM actions WHERE kind IN ({marks}) AND status IN ('applied', 'failed') "
            "GROUP BY node, kind, status) OR COALESCE(applied_at, failed_at) >= ?) ORDER BY id",
            (*kinds, *kinds, recent_since))
        return [self._action(r) for r in rows]

    def pending_actions(self) -> list[Action]:
        """Actions planned but neither applied nor failed: what a crash left half done. At start the
        controller re-reads each node and either completes or fails these before anything else."""
        return self.actions(status="planned")

    def series(self, series: str) -> list[Action]:
        """Every attempt of one decision for one incident, first attempt first."""
        rows = self.query(f"SELECT {self._ACTION_COLS} FROM actions WHERE series = ? ORDER BY attempt, id", (series,))
        return [self._action(r) for r in rows]

    def unresolved_since(self, since: float) -> list[Action]:
        """Writes that may still land: failed (the client reported failure: a timeout, slurmctld
        stopped mid-call) or abandoned (planned before a crash; its client may outlive the
        controller) at or after `since`. The reconciler adopts those Slurm shows."""
        rows = self.query(
            f"SELECT {self._ACTION_COLS} FROM actions WHERE (status = 'failed' AND failed_at >= ?) "
            "OR (status = 'abandoned' AND ended_at >= ?) ORDER BY id", (since, since))
        return [self._action(r) for r in rows]

    # -- holds (ownership by record, healthd.controller.ownership) -------------------------------------

    _HOLD_COLS = "node, action_id, incident_id, kind, reason, reason_time, reason_user, since, planned_at, verified_at"

    def holds(self) -> dict[str, Hold]:
        """node -> healthd's hold on it: every node healthd has taken out of service and still owns."""
        return {r[0]: Hold(*r) for r in self.query(f"SELECT {self._HOLD_COLS} FROM holds ORDER BY node")}

    def unsettled_removals(self, since: float) -> frozenset[str]:
        """Nodes with a node-removing action (REMEDIATION_KINDS) planned at or after `since` that is
        still planned, or failed: whether such a write reached Slurm is known only from a view of the
        fleet read after it (a client that timed out after its write landed, a crash mid-write)."""
        rows = self.query(
            "SELECT DISTINCT node FROM actions WHERE status IN ('planned', 'failed') AND planned_at >= ? "
            f"AND kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)})",
            (since, *REMEDIATION_KINDS),
        )
        return frozenset(r[0] for r in rows)

    def hold(self, node: str) -> Hold | None:
        row = self.query_one(f"SELECT {self._HOLD_COLS} FROM holds WHERE node = ?", (node,))
        return None if row is None else Hold(*row)

    def confirm_hold(self, node: str, action_id: int, reason_time: float | None, reason_user: str | None,
                     *, at: float | None = None) -> None:
        """Record the reason time and user Slurm shows for healthd's write (read back later than the
        write, when the read right after it failed)."""
        ts = at_or_now(at)
        with self.transaction():
            self._exec("UPDATE holds SET reason_time = ?, reason_user = ?, verified_at = ? WHERE node = ? AND action_id = ?",
                       (reason_time, reason_user, ts, node, action_id))
            self._exec("UPDATE actions SET slurm_reason_time = ?, slurm_reason_user = ? WHERE id = ?",
                       (reason_time, reason_user, action_id))

    def verify_holds(self, seen: Mapping[str, float]) -> None:
        """Slurm was seen showing healthd's writes: node -> when (the time its view was read). One
        statement per distinct time (a round's sightings share one), in one transaction."""
        by_time: dict[float, list[str]] = {}
        for node, at in seen.items():
            by_time.setdefault(at, []).append(node)
        if not by_time:
            return
        with self.transaction():
            for ts, nodes in sorted(by_time.items()):
                names = sorted(nodes)
                for i in range(0, len(names), 500):
                    chunk = names[i:i + 500]
                    self._exec(f"UPDATE holds SET verified_at = MAX(verified_at, ?) WHERE node IN "
                               f"({', '.join('?' for _ in chunk)})", (ts, *chunk))

    # -- budgets and escalation --------------------------------------------------------------------

    def actions_applied_since(self, since: float, partition: str | None = None) -> int:
        """Node-removing actions (REMEDIATION_KINDS) applied at or after `since` (fleet-wide, or in
        one partition): the rate limiter's budget. Undone actions still count: they spent the budget
        when they were applied; a lost one does not (its re-application takes its slot). Resumes and
        requeues do not take capacity away and do not count."""
        row = self.query_one(
            "SELECT COUNT(*) FROM actions WHERE applied_at IS NOT NULL AND applied_at >= ? AND (? IS NULL OR partition = ?) "
            f"AND kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)}) "
            f"AND status IN ({', '.join('?' for _ in BUDGET_STATUSES)})",
            (since, partition, partition, *REMEDIATION_KINDS, *BUDGET_STATUSES),
        )
        assert row is not None
        return int(row[0])

    def requeues_applied_since(self, since: float, series_prefix: str) -> int:
        """Job requeues whose series starts with `series_prefix` applied at or after `since` (a lost
        one included: it was made): the hourly budget of one kind of requeue (hung jobs' requeues,
        `requeue-hang:`)."""
        row = self.query_one(
            "SELECT COUNT(*) FROM actions WHERE kind = 'requeue' AND status IN ('applied', 'lost') "
            "AND applied_at IS NOT NULL AND applied_at >= ? AND substr(series, 1, ?) = ?",
            (since, len(series_prefix), series_prefix),
        )
        assert row is not None
        return int(row[0])

    def remediation_count(self, node: str, signature: str, since: float) -> int:
        """How many incidents with this signature were remediated on `node` (a drain, drain and
        requeue, or reboot applied and not undone) at or after `since`: the escalation counter
        (2 → inspect hardware; 5 in 7 days → contact support). Several actions for one incident
        count once."""
        row = self.query_one(
            "SELECT COUNT(DISTINCT i.id) FROM actions a JOIN decisions d ON a.decision_id = d.id "
            "JOIN incidents i ON d.incident_id = i.id "
            f"WHERE a.node = ? AND i.signature = ? AND a.status IN ({', '.join('?' for _ in REMEDIATED_STATUSES)}) "
            f"AND a.applied_at >= ? AND a.kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)})",
            (node, signature, *REMEDIATED_STATUSES, since, *REMEDIATION_KINDS),
        )
        assert row is not None
        return int(row[0])

    def remediations_on_node(self, node: str, since: float) -> int:
        """Remediated incidents on `node` (any signature) at or after `since`: the `contact-support`
        counter (5 in 7 days by default)."""
        row = self.query_one(
            "SELECT COUNT(DISTINCT d.incident_id) FROM actions a JOIN decisions d ON a.decision_id = d.id "
            f"WHERE a.node = ? AND a.status IN ({', '.join('?' for _ in REMEDIATED_STATUSES)}) AND a.applied_at >= ? "
            f"AND d.incident_id IS NOT NULL AND a.kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)})",
            (node, *REMEDIATED_STATUSES, since, *REMEDIATION_KINDS),
        )
        assert row is not None
        return int(row[0])

    def remediation_counts(self, since: float) -> dict[tuple[str, str], int]:
        """(node, signature) -> remediation_count(node, signature, since), for every pair that has
        one: what a round needs for all its nodes in one statement."""
        rows = self.query(
            "SELECT a.node, i.signature, COUNT(DISTINCT i.id) FROM actions a JOIN decisions d ON a.decision_id = d.id "
            "JOIN incidents i ON d.incident_id = i.id "
            f"WHERE a.status IN ({', '.join('?' for _ in REMEDIATED_STATUSES)}) "
            f"AND a.applied_at >= ? AND a.kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)}) "
            "GROUP BY a.node, i.signature",
            (*REMEDIATED_STATUSES, since, *REMEDIATION_KINDS),
        )
        return {(str(node), str(sig)): int(n) for node, sig, n in rows}

    def remediations_per_node(self, since: float) -> dict[str, int]:
        """node -> remediations_on_node(node, since), for every node that has one, in one statement."""
        rows = self.query(
            "SELECT a.node, COUNT(DISTINCT d.incident_id) FROM actions a JOIN decisions d ON a.decision_id = d.id "
            f"WHERE a.status IN ({', '.join('?' for _ in REMEDIATED_STATUSES)}) AND a.applied_at >= ? "
            f"AND d.incident_id IS NOT NULL AND a.kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)}) "
            "GROUP BY a.node",
            (*REMEDIATED_STATUSES, since, *REMEDIATION_KINDS),
        )
        return {str(node): int(n) for node, n in rows}
