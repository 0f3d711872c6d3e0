"""The ledger's store: one SQLite file (WAL), its connection and transactions, every write, and the
reads the controller needs to run.

Durability and crash safety
  * One connection per process (`Ledger` refuses to be used after a fork), in autocommit mode;
    every write runs inside an explicit `BEGIN IMMEDIATE` transaction, so a writer takes the write
    lock up front and never deadlocks upgrading a read lock.
  * `journal_mode=WAL`: readers (healthctl, the metrics endpoint) never block the controller's
    writes and never see half a transaction.
  * `synchronous=FULL`: the WAL is fsynced on every commit. The write rate is tiny (decisions and
    actions, not reports), and with NORMAL a power loss may roll back the last commits — such as
    the `mark_applied` of a drain that Slurm did apply — which would make the controller plan the
    same work again after the reboot. FULL costs an fsync per commit and keeps "committed" meaning
    "on disk".
  * Actions are written in three steps: `plan_action` (status `planned`, keyed by an idempotency
    key that is UNIQUE), execute, then `mark_applied` / `mark_failed`. A crash between the steps
    leaves a `planned` row that `pending_actions()` returns at start; planning again with the same
    key returns that same row, never a second one.

Opening a file that is not SQLite, is corrupt, belongs to another program, or has a newer schema
than this code raises `LedgerError` naming the file; nothing is ever deleted or recreated to
"recover".

Times are POSIX seconds (float); every write takes an optional `at` (default `time.time()`).
All SQL is parameterised; no value is ever formatted into a statement.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from healthd.controller.ledger import reports
from healthd.controller.ledger.records import (
    ACTIVE_REINTEGRATION_STATES,
    APPROVAL_VERDICTS,
    BUDGET_STATUSES,
    CLEAR_SCOPES,
    CLOSED_INCIDENT_STATUSES,
    DECISION_OUTCOMES,
    ENDED_STATUSES,
    ESCALATIONS,
    REINTEGRATION_STATES,
    REMEDIATED_STATUSES,
    REMEDIATION_KINDS,
    Action,
    Approval,
    BreakerRecord,
    Clear,
    DecisionRecord,
    FindingRecord,
    Incident,
    LedgerError,
    Reintegration,
)
from healthd.controller.ledger.reports import FalsePositiveRate, NodeMtbf, Offender, Percentiles
from healthd.controller.ledger.schema import APPLICATION_ID, SCHEMA_VERSION, migrate
from healthd.controller.ownership import NODE_STATE_KINDS, Hold

DEFAULT_BUSY_TIMEOUT_S = 5.0


def _dump(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"evidence is not JSON-serialisable: {exc}") from exc


def _read_only_fs(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _now(at: float | None) -> float:
    return time.time() if at is None else float(at)


class Ledger:
    """The controller's SQLite ledger. Open one per process; it is safe to share between threads."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        self.path = str(path)
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._depth = 0
        p = Path(self.path)
        if p.exists() and not p.is_file():
            raise LedgerError(f"{self.path}: not a regular file")
        p.parent.mkdir(parents=True, exist_ok=True)
        if _read_only_fs(p.parent):
            raise LedgerError(f"{self.path}: the file system holding the ledger is mounted read-only; the controller "
                              "records every decision before it acts, so it cannot start (healthctl can still read it)")
        try:
            self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: cannot open ledger: {exc}") from exc
        try:
            self._setup(busy_timeout_s)
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def open_readonly(cls, path: str | os.PathLike[str], *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Ledger:
        """A Ledger over a read-only connection (healthctl, metrics): no migration, no WAL switch, and
        any write raises LedgerError. The file must be a healthd ledger at this code's schema version."""
        p = Path(path)
        if not p.is_file():
            raise LedgerError(f"{path}: no ledger there")
        # On a read-only file system no writer can exist, and SQLite cannot create the WAL index it needs
        # for a plain read-only open: the file is then opened as immutable.
        uri = "file:" + urllib.parse.quote(str(p.resolve())) + ("?mode=ro&immutable=1" if _read_only_fs(p.parent) else "?mode=ro")
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s)
        except sqlite3.Error as exc:
            raise LedgerError(f"{path}: cannot read the ledger: {exc}") from exc
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            if app_id != APPLICATION_ID:
                raise LedgerError(f"{path}: not a healthd ledger")
            if version != SCHEMA_VERSION:
                raise LedgerError(f"{path}: ledger schema version {version}, this healthd reads {SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            conn.close()
            raise LedgerError(f"{path}: cannot read the ledger: {exc}") from exc
        except LedgerError:
            conn.close()
            raise
        led = cls.__new__(cls)
        led.path, led._pid, led._lock, led._depth, led._conn = str(path), os.getpid(), threading.RLock(), 0, conn
        return led

    def _setup(self, busy_timeout_s: float) -> None:
        conn = self._conn
        try:
            # Reading the schema forces SQLite to read the header: a non-database fails here.
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path}: not a usable SQLite database ({exc}); the file was left untouched") from exc
        if app_id != APPLICATION_ID and (app_id != 0 or tables or version != 0):
            raise LedgerError(
                f"{self.path}: not a healthd ledger (application_id={app_id:#x}, user_version={version}, "
                f"tables={sorted(tables)[:5]}); refusing to touch it"
            )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000):d}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"{self.path}: cannot switch to WAL journal mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn, self.path)
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path}: cannot prepare ledger: {exc}") from exc

    # -- plumbing ----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise LedgerError(f"{self.path}: ledger opened in pid {self._pid} used in pid {os.getpid()}; open a new Ledger after fork")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """An explicit write transaction (BEGIN IMMEDIATE … COMMIT). Nested uses join the outer
        one, so a caller can record a decision and plan its action atomically."""
        self._check_pid()
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.DatabaseError as exc:
                raise LedgerError(f"{self.path}: cannot begin a write: {exc}") from exc
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self._rollback()
                raise
            self._depth = 0
            try:
                self._conn.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                self._rollback()
                raise LedgerError(f"{self.path}: commit failed: {exc}") from exc

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the original error is the one worth raising

    def _exec(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        self._check_pid()
        try:
            return self._conn.execute(sql, params)
        except sqlite3.IntegrityError as exc:
            raise LedgerError(f"{self.path}: rejected: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path}: {exc}") from exc

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one parameterised read (the reports read the tables through it)."""
        with self._lock:
            return self._exec(sql, params).fetchall()

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row of one parameterised read, or None."""
        with self._lock:
            return self._exec(sql, params).fetchone()

    def schema_version(self) -> int:
        row = self.query_one("PRAGMA user_version")
        assert row is not None
        return int(row[0])

    def journal_mode(self) -> str:
        row = self.query_one("PRAGMA journal_mode")
        assert row is not None
        return str(row[0])

    def check(self) -> list[str]:
        """PRAGMA quick_check: an empty list when the file is sound, else SQLite's complaints."""
        rows = self.query("PRAGMA quick_check")
        msgs = [str(r[0]) for r in rows]
        return [] if msgs == ["ok"] else msgs

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
        ts = _now(at)
        with self.transaction():
            self._exec(
                f"INSERT INTO findings ({self._FINDING_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (node, finding_id, gpu_serial) DO UPDATE SET attribution = excluded.attribution, "
                "tier = excluded.tier, action = excluded.action, summary = excluded.summary, evidence = excluded.evidence, "
                "last_seen = MAX(last_seen, excluded.last_seen)",
                (node, finding_id, gpu_serial or "", attribution, tier, action, summary, _dump(evidence), ts, ts),
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
        ts = _now(at)
        with self.transaction():
            cur = self._exec(
                "INSERT INTO incidents (signature, attribution, tier, status, jobs, first_evidence_at, detected_at, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (signature, attribution, tier, status, _dump(sorted(set(map(str, jobs)))), first_evidence_at, detected_at, ts),
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
            current = self.incident(incident_id)
            if current is None:
                raise LedgerError(f"{self.path}: no incident {incident_id}")
            jobs = sorted(set(current.jobs) | set(map(str, add_jobs)))
            self._exec(
                "UPDATE incidents SET status = COALESCE(?, status), jobs = ? WHERE id = ?",
                (status or None, _dump(jobs), incident_id),
            )
            self._add_members(incident_id, add_nodes, add_gpu_serials)
        return self.incident(incident_id)  # type: ignore[return-value]

    def mark_timeline(self, incident_id: int, stage: str, at: float | None = None, *, overwrite: bool = False) -> Incident:
        """Set one timeline stamp (`first_evidence_at`, `detected_at`, `decided_at`,
        `action_applied_at`, `back_in_service_at`). The first stamp wins unless `overwrite`."""
        if stage not in self._TIMELINE:
            raise LedgerError(f"{self.path}: unknown timeline stage {stage!r}; expected one of {self._TIMELINE}")
        ts = _now(at)
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
                (incident_id, node, kind, tier, mode, reason, _dump(evidence), _now(at), outcome,
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

    def waiting_decisions(self) -> list[DecisionRecord]:
        """Decisions waiting for an operator and not yet approved or rejected."""
        rows = self.query(
            f"SELECT {self._DECISION_COLS} FROM decisions WHERE outcome = 'waiting' "
            "AND id NOT IN (SELECT decision_id FROM approvals) ORDER BY id"
        )
        return [self._decision(r) for r in rows]

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
                 _dump(list(argv)), _dump(evidence), reason, _now(at)),
            )
            row = self.query_one(f"SELECT {self._ACTION_COLS} FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        assert row is not None
        return self._action(row)

    def _transition(self, action_id: int, to: str, from_: tuple[str, ...], stamp: str, outcome: str | None,
                    at: float | None) -> Action:
        # `stamp` is one of the fixed column names passed by the methods below.
        with self.transaction():
            current = self.action(action_id)
            if current is None:
                raise LedgerError(f"{self.path}: no action {action_id}")
            if current.status == to:
                return current  # repeating a completed step is a no-op
            if current.status not in from_:
                raise LedgerError(f"{self.path}: action {action_id} is {current.status}; cannot mark it {to}")
            self._exec(
                f"UPDATE actions SET status = ?, outcome = COALESCE(?, outcome), {stamp} = ? WHERE id = ?",
                (to, outcome, _now(at), action_id),
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
        ts = _now(at)
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

    # -- clears ------------------------------------------------------------------------------------

    _CLEAR_COLS = "id, node, finding_id, before, scope, incident_id, by, why, at"

    def add_clears(self, node: str, finding_ids: Iterable[str], *, before: float, scope: str,
                   incident_id: int | None = None, by: str | None = None, why: str | None = None,
                   at: float | None = None) -> list[Clear]:
        """Evidence of these findings on `node` up to `before` no longer counts, in `scope`."""
        if scope not in CLEAR_SCOPES:
            raise LedgerError(f"{self.path}: clear scope {scope!r} is not one of {CLEAR_SCOPES}")
        ts = _now(at)
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
        ts = _now(at)
        with self.transaction():
            current = self.incident(incident_id)
            if current is None:
                raise LedgerError(f"{self.path}: no incident {incident_id}")
            self._exec("UPDATE incidents SET status = ?, closed_at = ?, closed_by = ?, close_why = ? WHERE id = ?",
                       (status, ts, by, why, incident_id))
            if not current.signature.startswith("group:"):
                for node in current.nodes:
                    self.add_clears(node, [current.signature], before=ts, scope="episode", incident_id=incident_id,
                                    by=by, why=why, at=ts)
        return self.incident(incident_id)  # type: ignore[return-value]

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

    def pending_actions(self) -> list[Action]:
        """Actions planned but neither applied nor failed: what a crash left half done. At start the
        controller re-reads each node and either completes or fails these before anything else."""
        return self.actions(status="planned")

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

    def set_escalation(self, incident_id: int, escalation: str) -> Incident:
        """Record the incident's escalation; a stronger one (contact-support) is never downgraded."""
        if escalation not in ESCALATIONS:
            raise LedgerError(f"{self.path}: unknown escalation {escalation!r}; expected one of {ESCALATIONS}")
        with self.transaction():
            current = self.incident(incident_id)
            if current is None:
                raise LedgerError(f"{self.path}: no incident {incident_id}")
            if current.escalation is None or ESCALATIONS.index(escalation) > ESCALATIONS.index(current.escalation):
                self._exec("UPDATE incidents SET escalation = ? WHERE id = ?", (escalation, incident_id))
        return self.incident(incident_id)  # type: ignore[return-value]

    # -- reintegration -------------------------------------------------------------------------------

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
                (node, incident_id, trigger, operator, why, _dump(sorted(set(findings))), _now(at)),
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
        ts = _now(at)
        with self.transaction():
            current = self.reintegration(rid)
            if current is None:
                raise LedgerError(f"{self.path}: no reintegration {rid}")
            self._exec(
                "UPDATE reintegrations SET state = COALESCE(?, state), reservation = COALESCE(?, reservation), "
                "results = COALESCE(?, results), detail = COALESCE(?, detail), "
                "probation_until = COALESCE(?, probation_until) WHERE id = ?",
                (state, reservation, None if results is None else _dump(results), detail, probation_until, rid),
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
                (decision_id, operator, verdict, why, _now(at)),
            )
        return self.approval(decision_id)  # type: ignore[return-value]

    def approval(self, decision_id: int) -> Approval | None:
        row = self.query_one("SELECT id, decision_id, operator, verdict, why, at FROM approvals WHERE decision_id = ?", (decision_id,))
        return None if row is None else Approval(*row)

    # -- circuit breaker ---------------------------------------------------------------------------

    def breaker_state(self) -> BreakerRecord:
        with self._lock:
            last_open = self.query_one("SELECT id, at, cause, nodes FROM breaker_events WHERE event = 'open' ORDER BY id DESC LIMIT 1")
            last_reset = self.query_one("SELECT id, at, by, why FROM breaker_events WHERE event = 'reset' ORDER BY id DESC LIMIT 1")
        is_open = last_open is not None and (last_reset is None or last_reset[0] < last_open[0])
        return BreakerRecord(
            open=is_open,
            opened_at=last_open[1] if last_open else None,
            cause=last_open[2] if last_open else None,
            reset_at=last_reset[1] if last_reset else None,
            reset_by=last_reset[2] if last_reset else None,
            why=last_reset[3] if last_reset else None,
            nodes=tuple(json.loads(last_open[3])) if last_open else (),
        )

    def open_breaker(self, cause: str, *, nodes: Iterable[str] = (), at: float | None = None) -> BreakerRecord:
        """Open the breaker; a no-op (keeping the first cause and nodes) if it is already open."""
        with self.transaction():
            if not self.breaker_state().open:
                self._exec(
                    "INSERT INTO breaker_events (event, at, cause, nodes) VALUES ('open', ?, ?, ?)",
                    (_now(at), cause, _dump(sorted(set(nodes)))),
                )
        return self.breaker_state()

    def reset_breaker(self, *, by: str, why: str, at: float | None = None) -> BreakerRecord:
        """Close the breaker (only ever by an operator, with a why). A no-op if already closed."""
        if not by or not why:
            raise LedgerError(f"{self.path}: a breaker reset needs who and why")
        with self.transaction():
            if self.breaker_state().open:
                self._exec("INSERT INTO breaker_events (event, at, by, why) VALUES ('reset', ?, ?, ?)", (_now(at), by, why))
        return self.breaker_state()

    # -- report figures (computed in healthd.controller.ledger.reports) -----------------------------

    def repeat_offenders_by_node(self, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
        """Nodes in at least `min_incidents` incidents (created at or after `since`), worst first."""
        return reports.repeat_offenders_by_node(self, since=since, min_incidents=min_incidents)

    def repeat_offenders_by_gpu(self, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
        """GPU serials in at least `min_incidents` incidents: follows a GPU moved between nodes."""
        return reports.repeat_offenders_by_gpu(self, since=since, min_incidents=min_incidents)

    def false_positive_rate(self, *, mode: str = "observe", since: float | None = None) -> FalsePositiveRate:
        """Operators' verdicts on the proposals made in `mode` (default observe)."""
        return reports.false_positive_rate(self, mode=mode, since=since)

    def mtbf_per_node(self, *, start: float, end: float) -> list[NodeMtbf]:
        """MTBF of each node with at least one failure whose first evidence lies in [start, end]."""
        return reports.mtbf_per_node(self, start=start, end=end)

    def latency_percentiles(self, *, since: float | None = None) -> dict[str, Percentiles]:
        """p50/p90/p99 of the incident stage timings, over incidents created at or after `since`."""
        return reports.latency_percentiles(self, since=since)
