"""The controller's ledger: what it saw, decided and did, in one SQLite file (WAL).

The ledger is the learning loop (../shared/DESIGN.md, "Decided"): findings, incidents with their
timeline, decisions with the gate that refused them, actions with the exact Slurm call, operator
approvals, the circuit breaker, and the queries `healthctl report` and the rate limiter need.

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

Schema versioning: `PRAGMA user_version` holds the schema version and `PRAGMA application_id` marks
the file as a healthd ledger. `migrate()` runs each step of `MIGRATIONS` in its own transaction,
together with the version bump. A file that is not SQLite, is corrupt, belongs to another program,
or has a newer schema than this code raises `LedgerError` naming the file; nothing is ever deleted
or recreated to "recover".

Times are POSIX seconds (float); every write takes an optional `at` (default `time.time()`).
All SQL is parameterised; no value is ever formatted into a statement.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from healthd.controller.ownership import NODE_STATE_KINDS, Hold

SCHEMA_VERSION = 3
APPLICATION_ID = 0x68446C67  # "hDlg": marks a healthd ledger (PRAGMA application_id)
DEFAULT_BUSY_TIMEOUT_S = 5.0

DECISION_OUTCOMES = ("allowed", "waiting", "refused")
ACTION_STATUSES = ("planned", "applied", "failed", "undone", "lost", "released", "abandoned", "completed")
"""planned -> applied (the write returned, or the reconciler found it in Slurm) | failed (the client
reported failure; the reconciler still adopts it if Slurm shows it landed) | abandoned (planned before a
restart and not in Slurm: re-decided from current evidence, never applied blindly). An applied
node-state action ends as undone (an operator's `healthctl undo`), lost (Slurm lost it, e.g. slurmctld
came back from an older state save: re-applied through the gates as a new attempt), released (someone
else changed the node: ownership passed to them) or completed (a requested reboot happened)."""
ENDED_STATUSES = ("undone", "lost", "released", "completed")
"""How an applied action's effect ended."""
BUDGET_STATUSES = ("applied", "undone", "released", "completed")
"""Applied actions that spent rate-limit budget; a lost one gives its slot to the attempt that
re-applies it."""
REMEDIATED_STATUSES = ("applied", "released", "completed")
"""Applied actions that count as a remediation for escalation (an undone one was a false positive)."""
CLEAR_SCOPES = ("evidence", "episode")
"""A clear of a finding on a node: `evidence` (a repair: evidence up to `before` no longer counts,
anything newer does) or `episode` (an operator dismissed it: the episode that had begun by `before`
no longer counts; a new episode, or a new kernel log line, does). See healthd.agent.instructions."""
CLOSED_INCIDENT_STATUSES = ("closed", "false_positive", "handed-over", "resolved")
VERDICTS = ("approve", "reject")
REMEDIATION_KINDS = ("drain", "drain-and-requeue", "reboot-asap")
"""Action kinds (policy's decision kinds) that take a node out of service and count as a remediation
for escalation; `resume` puts it back, and other kinds (e.g. a job `requeue`) are neither."""
RESUME_KIND = "resume"
EXCLUDED_INCIDENT_STATUSES = ("false_positive",)
REINTEGRATION_STATES = ("requested", "validating", "probation", "passed", "failed", "recurred", "aborted")
"""requested -> validating (reserved, resumed inside the reservation, validation running) -> probation
(validation passed, back in service) -> passed (probation over). `failed`: validation failed, node
re-drained. `recurred`: the fault came back during probation. `aborted`: the node was taken over or
can no longer be reintegrated (the detail says why)."""
ACTIVE_REINTEGRATION_STATES = ("requested", "validating", "probation")
ESCALATIONS = ("inspect-hardware", "contact-support")
"""Escalation levels, weakest first."""
"""Incidents with these statuses are left out of MTBF and repeat-offender figures."""


class LedgerError(RuntimeError):
    """The ledger cannot be used as asked; the message names the file and says why."""


# --------------------------------------------------------------------------------------------------
# Values returned to callers: frozen dataclasses, never rows.


@dataclass(frozen=True)
class Finding:
    node: str
    finding_id: str
    gpu_serial: str | None
    attribution: str
    tier: str
    action: str
    summary: str
    evidence: Any
    first_seen: float
    last_seen: float


@dataclass(frozen=True)
class Incident:
    id: int
    signature: str
    attribution: str
    tier: str
    status: str
    nodes: tuple[str, ...]
    gpu_serials: tuple[str, ...]
    jobs: tuple[str, ...]
    first_evidence_at: float | None
    detected_at: float | None
    decided_at: float | None
    action_applied_at: float | None
    back_in_service_at: float | None
    created_at: float
    escalation: str | None = None
    """None, `inspect-hardware` (the same fault after `inspect_after` remediations) or
    `contact-support` (`support_after` remediations on the node within the support window)."""
    closed_at: float | None = None
    closed_by: str | None = None
    close_why: str | None = None

    @property
    def detection_latency(self) -> float | None:
        """First evidence → detected."""
        return _diff(self.detected_at, self.first_evidence_at)

    @property
    def decision_latency(self) -> float | None:
        """Detected → decided."""
        return _diff(self.decided_at, self.detected_at)

    @property
    def action_latency(self) -> float | None:
        """Decided → action applied in Slurm."""
        return _diff(self.action_applied_at, self.decided_at)

    @property
    def recovery_time(self) -> float | None:
        """First evidence → back in service: the whole time the capacity was lost to this fault."""
        return _diff(self.back_in_service_at, self.first_evidence_at)

    @property
    def isolation_granularity(self) -> tuple[int, int]:
        """(nodes, GPUs) the incident took out: the seed-003 "isolation granularity"."""
        return (len(self.nodes), len(self.gpu_serials))


@dataclass(frozen=True)
class Decision:
    id: int
    incident_id: int | None
    node: str
    kind: str
    tier: str
    mode: str
    reason: str
    evidence: Any
    decided_at: float
    outcome: str
    refused_gate: str | None
    refused_reason: str | None


@dataclass(frozen=True)
class Action:
    id: int
    decision_id: int
    idempotency_key: str
    node: str
    partition: str | None
    kind: str
    argv: tuple[str, ...]
    evidence: Any
    status: str
    outcome: str | None
    planned_at: float
    applied_at: float | None
    failed_at: float | None
    undone_at: float | None
    series: str = ""
    """The idempotency key of the first attempt: every attempt of one decision for one incident."""
    attempt: int = 1
    reason: str | None = None
    """The Slurm reason the write sets (node-state actions)."""
    ended_at: float | None = None
    """When it became lost, released, completed or abandoned."""
    slurm_reason_time: float | None = None
    """Slurm's reason time right after the write: with `slurm_reason_user`, the ownership proof."""
    slurm_reason_user: str | None = None


@dataclass(frozen=True)
class Clear:
    """Evidence of one finding on one node that no longer counts (see CLEAR_SCOPES)."""

    id: int
    node: str
    finding_id: str
    before: float
    scope: str
    incident_id: int | None
    by: str | None
    why: str | None
    at: float


@dataclass(frozen=True)
class Approval:
    id: int
    decision_id: int
    operator: str
    verdict: str
    why: str | None
    at: float


@dataclass(frozen=True)
class Reintegration:
    id: int
    node: str
    incident_id: int | None
    trigger: str
    """`repaired` (an operator's healthctl repaired) or `cleared` (the agent reported the fault gone)."""
    operator: str | None
    why: str | None
    state: str
    reservation: str | None
    findings: tuple[str, ...]
    """Finding ids this reintegration clears (evidence up to `requested_at` no longer counts)."""
    requested_at: float
    started_at: float | None
    validated_at: float | None
    probation_until: float | None
    ended_at: float | None
    results: Any
    """Validation step results: [{"argv": [...], "rc": int, "seconds": float, "output": str}, ...]."""
    detail: str | None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_REINTEGRATION_STATES


@dataclass(frozen=True)
class BreakerState:
    open: bool
    opened_at: float | None
    cause: str | None
    reset_at: float | None
    reset_by: str | None
    why: str | None
    nodes: tuple[str, ...] = ()
    """The failing nodes that opened it (the latest opening)."""


@dataclass(frozen=True)
class Offender:
    key: str
    """Node name or GPU serial."""
    incidents: int
    last_at: float


@dataclass(frozen=True)
class FalsePositiveRate:
    approved: int
    rejected: int

    @property
    def rate(self) -> float | None:
        judged = self.approved + self.rejected
        return None if judged == 0 else self.rejected / judged


@dataclass(frozen=True)
class NodeMtbf:
    node: str
    failures: int
    window_s: float
    mtbf_s: float


@dataclass(frozen=True)
class Percentiles:
    n: int
    p50: float | None
    p90: float | None
    p99: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile: the ceil(q/100 · n)-th smallest value (no interpolation, so every
    figure in a report is a latency that really happened)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


# --------------------------------------------------------------------------------------------------
# Schema and migrations.


def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    statements = [
        f"PRAGMA application_id = {APPLICATION_ID:d}",  # an int constant of this module, not a value
        """CREATE TABLE findings (
            node TEXT NOT NULL,
            finding_id TEXT NOT NULL,
            gpu_serial TEXT NOT NULL DEFAULT '',
            attribution TEXT NOT NULL,
            tier TEXT NOT NULL,
            action TEXT NOT NULL,
            summary TEXT NOT NULL,
            evidence TEXT NOT NULL,
            first_seen REAL NOT NULL,
            last_seen REAL NOT NULL,
            PRIMARY KEY (node, finding_id, gpu_serial)
        )""",
        """CREATE TABLE incidents (
            id INTEGER PRIMARY KEY,
            signature TEXT NOT NULL,
            attribution TEXT NOT NULL,
            tier TEXT NOT NULL,
            status TEXT NOT NULL,
            jobs TEXT NOT NULL DEFAULT '[]',
            first_evidence_at REAL,
            detected_at REAL,
            decided_at REAL,
            action_applied_at REAL,
            back_in_service_at REAL,
            created_at REAL NOT NULL
        )""",
        "CREATE INDEX incidents_signature ON incidents (signature)",
        """CREATE TABLE incident_nodes (
            incident_id INTEGER NOT NULL REFERENCES incidents (id),
            node TEXT NOT NULL,
            PRIMARY KEY (incident_id, node)
        )""",
        "CREATE INDEX incident_nodes_node ON incident_nodes (node)",
        """CREATE TABLE incident_gpus (
            incident_id INTEGER NOT NULL REFERENCES incidents (id),
            gpu_serial TEXT NOT NULL,
            PRIMARY KEY (incident_id, gpu_serial)
        )""",
        "CREATE INDEX incident_gpus_serial ON incident_gpus (gpu_serial)",
        """CREATE TABLE decisions (
            id INTEGER PRIMARY KEY,
            incident_id INTEGER REFERENCES incidents (id),
            node TEXT NOT NULL,
            kind TEXT NOT NULL,
            tier TEXT NOT NULL,
            mode TEXT NOT NULL,
            reason TEXT NOT NULL,
            evidence TEXT NOT NULL,
            decided_at REAL NOT NULL,
            outcome TEXT NOT NULL CHECK (outcome IN ('allowed', 'waiting', 'refused')),
            refused_gate TEXT,
            refused_reason TEXT,
            CHECK (outcome != 'refused' OR (refused_gate IS NOT NULL AND refused_reason IS NOT NULL))
        )""",
        "CREATE INDEX decisions_incident ON decisions (incident_id)",
        """CREATE TABLE actions (
            id INTEGER PRIMARY KEY,
            decision_id INTEGER NOT NULL REFERENCES decisions (id),
            idempotency_key TEXT NOT NULL UNIQUE,
            node TEXT NOT NULL,
            partition TEXT,
            kind TEXT NOT NULL,
            argv TEXT NOT NULL,
            evidence TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('planned', 'applied', 'failed', 'undone')),
            outcome TEXT,
            planned_at REAL NOT NULL,
            applied_at REAL,
            failed_at REAL,
            undone_at REAL
        )""",
        "CREATE INDEX actions_status ON actions (status)",
        "CREATE INDEX actions_applied_at ON actions (applied_at)",
        "CREATE INDEX actions_node ON actions (node)",
        """CREATE TABLE approvals (
            id INTEGER PRIMARY KEY,
            decision_id INTEGER NOT NULL UNIQUE REFERENCES decisions (id),
            operator TEXT NOT NULL,
            verdict TEXT NOT NULL CHECK (verdict IN ('approve', 'reject')),
            why TEXT,
            at REAL NOT NULL,
            CHECK (verdict = 'approve' OR (why IS NOT NULL AND why != ''))
        )""",
        """CREATE TABLE breaker_events (
            id INTEGER PRIMARY KEY,
            event TEXT NOT NULL CHECK (event IN ('open', 'reset')),
            at REAL NOT NULL,
            cause TEXT,
            nodes TEXT NOT NULL DEFAULT '[]',
            by TEXT,
            why TEXT,
            CHECK (event = 'open' OR (by IS NOT NULL AND why IS NOT NULL AND why != ''))
        )""",
    ]
    for sql in statements:
        conn.execute(sql)


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    statements = [
        "ALTER TABLE incidents ADD COLUMN escalation TEXT",
        f"""CREATE TABLE reintegrations (
            id INTEGER PRIMARY KEY,
            node TEXT NOT NULL,
            incident_id INTEGER REFERENCES incidents (id),
            trigger TEXT NOT NULL CHECK (trigger IN ('repaired', 'cleared')),
            operator TEXT,
            why TEXT,
            state TEXT NOT NULL CHECK (state IN ({", ".join(repr(s) for s in REINTEGRATION_STATES)})),
            reservation TEXT,
            findings TEXT NOT NULL DEFAULT '[]',
            requested_at REAL NOT NULL,
            started_at REAL,
            validated_at REAL,
            probation_until REAL,
            ended_at REAL,
            results TEXT NOT NULL DEFAULT '[]',
            detail TEXT
        )""",
        # one reintegration in flight per node
        "CREATE UNIQUE INDEX reintegrations_active ON reintegrations (node) "
        "WHERE state IN ('requested', 'validating', 'probation')",
    ]
    for sql in statements:
        conn.execute(sql)


def _migrate_2_to_3(conn: sqlite3.Connection) -> None:
    """Actions get attempts (series), the reason they write, the ownership proof and the statuses of
    reconciliation; holds record which nodes healthd owns; clears record dismissed evidence;
    incidents record who closed them and why. SQLite cannot change a CHECK, so actions is rebuilt."""
    statuses = ", ".join(repr(s) for s in ACTION_STATUSES)
    statements = [
        f"""CREATE TABLE actions_v3 (
            id INTEGER PRIMARY KEY,
            decision_id INTEGER NOT NULL REFERENCES decisions (id),
            idempotency_key TEXT NOT NULL UNIQUE,
            series TEXT NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 1,
            node TEXT NOT NULL,
            partition TEXT,
            kind TEXT NOT NULL,
            argv TEXT NOT NULL,
            evidence TEXT NOT NULL,
            reason TEXT,
            status TEXT NOT NULL CHECK (status IN ({statuses})),
            outcome TEXT,
            planned_at REAL NOT NULL,
            applied_at REAL,
            failed_at REAL,
            undone_at REAL,
            ended_at REAL,
            slurm_reason_time REAL,
            slurm_reason_user TEXT
        )""",
        # series: the key without its `#tryN` suffix; reason: the decision's, for node-state writes
        """INSERT INTO actions_v3 (id, decision_id, idempotency_key, series, attempt, node, partition, kind, argv,
            evidence, reason, status, outcome, planned_at, applied_at, failed_at, undone_at)
           SELECT a.id, a.decision_id, a.idempotency_key,
                  CASE WHEN instr(a.idempotency_key, '#try') > 0
                       THEN substr(a.idempotency_key, 1, instr(a.idempotency_key, '#try') - 1)
                       ELSE a.idempotency_key END,
                  CASE WHEN instr(a.idempotency_key, '#try') > 0
                       THEN CAST(substr(a.idempotency_key, instr(a.idempotency_key, '#try') + 4) AS INTEGER)
                       ELSE 1 END,
                  a.node, a.partition, a.kind, a.argv, a.evidence,
                  CASE WHEN a.kind IN ('drain', 'drain-and-requeue', 'reboot-asap') THEN d.reason END,
                  a.status, a.outcome, a.planned_at, a.applied_at, a.failed_at, a.undone_at
           FROM actions a JOIN decisions d ON a.decision_id = d.id""",
        "DROP TABLE actions",
        "ALTER TABLE actions_v3 RENAME TO actions",
        "CREATE INDEX actions_status ON actions (status)",
        "CREATE INDEX actions_applied_at ON actions (applied_at)",
        "CREATE INDEX actions_node ON actions (node)",
        "CREATE INDEX actions_series ON actions (series)",
        """CREATE TABLE holds (
            node TEXT PRIMARY KEY,
            action_id INTEGER NOT NULL REFERENCES actions (id),
            incident_id INTEGER REFERENCES incidents (id),
            kind TEXT NOT NULL,
            reason TEXT NOT NULL,
            reason_time REAL,
            reason_user TEXT,
            since REAL NOT NULL,
            planned_at REAL NOT NULL,
            verified_at REAL NOT NULL
        )""",
        # the nodes the old rule said healthd holds: its latest applied node-state write, not undone or resumed
        """INSERT INTO holds (node, action_id, incident_id, kind, reason, since, planned_at, verified_at)
           SELECT a.node, a.id, d.incident_id, a.kind, a.reason, a.applied_at, a.planned_at, a.applied_at
           FROM actions a JOIN decisions d ON a.decision_id = d.id
           WHERE a.status = 'applied' AND a.kind IN ('drain', 'drain-and-requeue', 'reboot-asap')
             AND a.reason IS NOT NULL
             AND NOT EXISTS (SELECT 1 FROM actions b WHERE b.node = a.node AND b.applied_at IS NOT NULL
                             AND b.status IN ('applied', 'undone')
                             AND b.kind IN ('drain', 'drain-and-requeue', 'reboot-asap', 'resume')
                             AND (b.applied_at > a.applied_at OR (b.applied_at = a.applied_at AND b.id > a.id)))""",
        f"""CREATE TABLE clears (
            id INTEGER PRIMARY KEY,
            node TEXT NOT NULL,
            finding_id TEXT NOT NULL,
            before REAL NOT NULL,
            scope TEXT NOT NULL CHECK (scope IN ({", ".join(repr(s) for s in CLEAR_SCOPES)})),
            incident_id INTEGER REFERENCES incidents (id),
            by TEXT,
            why TEXT,
            at REAL NOT NULL
        )""",
        "CREATE INDEX clears_at ON clears (at)",
        "CREATE INDEX clears_node ON clears (node, at)",
        "ALTER TABLE incidents ADD COLUMN closed_at REAL",
        "ALTER TABLE incidents ADD COLUMN closed_by TEXT",
        "ALTER TABLE incidents ADD COLUMN close_why TEXT",
        "CREATE INDEX incidents_status ON incidents (status)",
    ]
    for sql in statements:
        conn.execute(sql)


MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_0_to_1, 2: _migrate_1_to_2, 3: _migrate_2_to_3}
"""MIGRATIONS[n] takes a schema at version n-1 to version n."""


def migrate(conn: sqlite3.Connection, path: str, target: int = SCHEMA_VERSION) -> int:
    """Bring the schema from its current `user_version` up to `target`, one transaction per step
    (the step and its version bump commit together or not at all). Returns the final version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > target:
        raise LedgerError(f"{path}: ledger schema version {version} is newer than this healthd supports ({target}); refusing to use it")
    while version < target:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Re-read under the write lock: another process may have migrated meanwhile.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version < target:
                step = MIGRATIONS.get(version + 1)
                if step is None:
                    raise LedgerError(f"{path}: no migration from schema version {version} to {version + 1}")
                step(conn)
                version += 1
                conn.execute(f"PRAGMA user_version = {int(version):d}")  # PRAGMA takes no parameters
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return version


# --------------------------------------------------------------------------------------------------


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

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._exec(sql, params).fetchall()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        with self._lock:
            return self._exec(sql, params).fetchone()

    def schema_version(self) -> int:
        row = self._one("PRAGMA user_version")
        assert row is not None
        return int(row[0])

    def journal_mode(self) -> str:
        row = self._one("PRAGMA journal_mode")
        assert row is not None
        return str(row[0])

    def check(self) -> list[str]:
        """PRAGMA quick_check: an empty list when the file is sound, else SQLite's complaints."""
        rows = self._rows("PRAGMA quick_check")
        msgs = [str(r[0]) for r in rows]
        return [] if msgs == ["ok"] else msgs

    # -- findings ----------------------------------------------------------------------------------

    _FINDING_COLS = "node, finding_id, gpu_serial, attribution, tier, action, summary, evidence, first_seen, last_seen"

    @staticmethod
    def _finding(row: tuple[Any, ...]) -> Finding:
        return Finding(row[0], row[1], row[2] or None, row[3], row[4], row[5], row[6], json.loads(row[7]), row[8], row[9])

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
    ) -> Finding:
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

    def finding(self, node: str, finding_id: str, gpu_serial: str | None = None) -> Finding | None:
        row = self._one(
            f"SELECT {self._FINDING_COLS} FROM findings WHERE node = ? AND finding_id = ? AND gpu_serial = ?",
            (node, finding_id, gpu_serial or ""),
        )
        return None if row is None else self._finding(row)

    def findings(self, node: str | None = None, *, since: float | None = None) -> list[Finding]:
        """Findings, optionally of one node and/or last seen at or after `since`."""
        rows = self._rows(
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

    def _incident(self, row: tuple[Any, ...]) -> Incident:
        iid = row[0]
        nodes = tuple(r[0] for r in self._rows("SELECT node FROM incident_nodes WHERE incident_id = ? ORDER BY node", (iid,)))
        gpus = tuple(r[0] for r in self._rows("SELECT gpu_serial FROM incident_gpus WHERE incident_id = ? ORDER BY gpu_serial", (iid,)))
        return Incident(
            id=iid, signature=row[1], attribution=row[2], tier=row[3], status=row[4], nodes=nodes, gpu_serials=gpus,
            jobs=tuple(json.loads(row[5])), first_evidence_at=row[6], detected_at=row[7], decided_at=row[8],
            action_applied_at=row[9], back_in_service_at=row[10], created_at=row[11], escalation=row[12],
            closed_at=row[13], closed_by=row[14], close_why=row[15],
        )

    def incident(self, incident_id: int) -> Incident | None:
        with self._lock:
            row = self._one(f"SELECT {self._INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,))
            return None if row is None else self._incident(row)

    def incidents(self, *, status: str | None = None, node: str | None = None, since: float | None = None) -> list[Incident]:
        """Incidents, filtered by status, member node and/or created at or after `since`; oldest first."""
        with self._lock:
            rows = self._rows(
                f"SELECT {self._INCIDENT_COLS} FROM incidents WHERE (? IS NULL OR status = ?) AND (? IS NULL OR created_at >= ?) "
                "AND (? IS NULL OR id IN (SELECT incident_id FROM incident_nodes WHERE node = ?)) ORDER BY id",
                (status, status, since, since, node, node),
            )
            return [self._incident(r) for r in rows]

    # -- decisions ---------------------------------------------------------------------------------

    _DECISION_COLS = "id, incident_id, node, kind, tier, mode, reason, evidence, decided_at, outcome, refused_gate, refused_reason"

    @staticmethod
    def _decision(row: tuple[Any, ...]) -> Decision:
        return Decision(row[0], row[1], row[2], row[3], row[4], row[5], row[6], json.loads(row[7]), row[8], row[9], row[10], row[11])

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
    ) -> Decision:
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

    def set_decision_outcome(self, decision_id: int, outcome: str, *, refused_gate: str | None = None, refused_reason: str | None = None) -> Decision:
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

    def decision(self, decision_id: int) -> Decision | None:
        row = self._one(f"SELECT {self._DECISION_COLS} FROM decisions WHERE id = ?", (decision_id,))
        return None if row is None else self._decision(row)

    def decisions(self, *, incident_id: int | None = None, outcome: str | None = None) -> list[Decision]:
        rows = self._rows(
            f"SELECT {self._DECISION_COLS} FROM decisions WHERE (? IS NULL OR incident_id = ?) AND (? IS NULL OR outcome = ?) ORDER BY id",
            (incident_id, incident_id, outcome, outcome),
        )
        return [self._decision(r) for r in rows]

    def waiting_decisions(self) -> list[Decision]:
        """Decisions waiting for an operator and not yet approved or rejected."""
        rows = self._rows(
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
            row = self._one(f"SELECT {self._ACTION_COLS} FROM actions WHERE idempotency_key = ?", (idempotency_key,))
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
        return {r[0]: Hold(*r) for r in self._rows(f"SELECT {self._HOLD_COLS} FROM holds ORDER BY node")}

    def hold(self, node: str) -> Hold | None:
        row = self._one(f"SELECT {self._HOLD_COLS} FROM holds WHERE node = ?", (node,))
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

    def verify_holds(self, nodes: Iterable[str], at: float | None = None) -> None:
        """Slurm was seen showing healthd's writes on `nodes` at `at`: one statement for all of them."""
        names = sorted(set(nodes))
        if not names:
            return
        ts = _now(at)
        with self.transaction():
            for i in range(0, len(names), 500):
                chunk = names[i:i + 500]
                self._exec(f"UPDATE holds SET verified_at = MAX(verified_at, ?) WHERE node IN ({', '.join('?' for _ in chunk)})",
                           (ts, *chunk))

    def series(self, series: str) -> list[Action]:
        """Every attempt of one decision for one incident, first attempt first."""
        rows = self._rows(f"SELECT {self._ACTION_COLS} FROM actions WHERE series = ? ORDER BY attempt, id", (series,))
        return [self._action(r) for r in rows]

    def unresolved_since(self, since: float) -> list[Action]:
        """Writes that may still land: failed (the client reported failure: a timeout, slurmctld
        stopped mid-call) or abandoned (planned before a crash; its client may outlive the
        controller) at or after `since`. The reconciler adopts those Slurm shows."""
        rows = self._rows(
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
        rows = self._rows(f"SELECT {self._CLEAR_COLS} FROM clears WHERE (? IS NULL OR at >= ?) AND (? IS NULL OR node = ?) "
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
        row = self._one(f"SELECT {self._ACTION_COLS} FROM actions WHERE id = ?", (action_id,))
        return None if row is None else self._action(row)

    def action_by_key(self, idempotency_key: str) -> Action | None:
        row = self._one(f"SELECT {self._ACTION_COLS} FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        return None if row is None else self._action(row)

    def actions(self, *, decision_id: int | None = None, node: str | None = None, status: str | None = None) -> list[Action]:
        rows = self._rows(
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
        row = self._one(
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
        row = self._one(
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
        row = self._one(
            "SELECT COUNT(DISTINCT d.incident_id) FROM actions a JOIN decisions d ON a.decision_id = d.id "
            f"WHERE a.node = ? AND a.status IN ({', '.join('?' for _ in REMEDIATED_STATUSES)}) AND a.applied_at >= ? "
            f"AND d.incident_id IS NOT NULL AND a.kind IN ({', '.join('?' for _ in REMEDIATION_KINDS)})",
            (node, *REMEDIATED_STATUSES, since, *REMEDIATION_KINDS),
        )
        assert row is not None
        return int(row[0])

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
        return {state: int(n) for state, n in self._rows("SELECT state, COUNT(*) FROM reintegrations GROUP BY state")}

    def reintegration(self, rid: int) -> Reintegration | None:
        row = self._one(f"SELECT {self._REINTEGRATION_COLS} FROM reintegrations WHERE id = ?", (rid,))
        return None if row is None else self._reintegration(row)

    def active_reintegration(self, node: str) -> Reintegration | None:
        row = self._one(
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
        rows = self._rows(
            f"SELECT {self._REINTEGRATION_COLS} FROM reintegrations WHERE state IN ({', '.join('?' for _ in states)}) "
            "AND (? IS NULL OR node = ?) AND (? IS NULL OR incident_id = ?) AND (? IS NULL OR requested_at >= ?) "
            "ORDER BY id",
            (*states, node, node, incident_id, incident_id, since, since),
        )
        return [self._reintegration(r) for r in rows]

    # -- approvals ---------------------------------------------------------------------------------

    def record_approval(self, decision_id: int, *, operator: str, verdict: str, why: str | None = None, at: float | None = None) -> Approval:
        """An operator's verdict on a decision; one per decision, and a rejection needs a why."""
        if verdict not in VERDICTS:
            raise LedgerError(f"{self.path}: verdict {verdict!r} is not one of {VERDICTS}")
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
        row = self._one("SELECT id, decision_id, operator, verdict, why, at FROM approvals WHERE decision_id = ?", (decision_id,))
        return None if row is None else Approval(*row)

    # -- circuit breaker ---------------------------------------------------------------------------

    def breaker_state(self) -> BreakerState:
        with self._lock:
            last_open = self._one("SELECT id, at, cause, nodes FROM breaker_events WHERE event = 'open' ORDER BY id DESC LIMIT 1")
            last_reset = self._one("SELECT id, at, by, why FROM breaker_events WHERE event = 'reset' ORDER BY id DESC LIMIT 1")
        is_open = last_open is not None and (last_reset is None or last_reset[0] < last_open[0])
        return BreakerState(
            open=is_open,
            opened_at=last_open[1] if last_open else None,
            cause=last_open[2] if last_open else None,
            reset_at=last_reset[1] if last_reset else None,
            reset_by=last_reset[2] if last_reset else None,
            why=last_reset[3] if last_reset else None,
            nodes=tuple(json.loads(last_open[3])) if last_open else (),
        )

    def open_breaker(self, cause: str, *, nodes: Iterable[str] = (), at: float | None = None) -> BreakerState:
        """Open the breaker; a no-op (keeping the first cause and nodes) if it is already open."""
        with self.transaction():
            if not self.breaker_state().open:
                self._exec(
                    "INSERT INTO breaker_events (event, at, cause, nodes) VALUES ('open', ?, ?, ?)",
                    (_now(at), cause, _dump(sorted(set(nodes)))),
                )
        return self.breaker_state()

    def reset_breaker(self, *, by: str, why: str, at: float | None = None) -> BreakerState:
        """Close the breaker (only ever by an operator, with a why). A no-op if already closed."""
        if not by or not why:
            raise LedgerError(f"{self.path}: a breaker reset needs who and why")
        with self.transaction():
            if self.breaker_state().open:
                self._exec("INSERT INTO breaker_events (event, at, by, why) VALUES ('reset', ?, ?, ?)", (_now(at), by, why))
        return self.breaker_state()

    # -- report ------------------------------------------------------------------------------------

    _COUNTED = f"i.status NOT IN ({', '.join('?' for _ in EXCLUDED_INCIDENT_STATUSES)})"

    def repeat_offenders_by_node(self, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
        """Nodes in at least `min_incidents` incidents (created at or after `since`), worst first."""
        rows = self._rows(
            "SELECT m.node, COUNT(DISTINCT i.id), MAX(i.created_at) FROM incident_nodes m JOIN incidents i ON m.incident_id = i.id "
            f"WHERE {self._COUNTED} AND (? IS NULL OR i.created_at >= ?) GROUP BY m.node HAVING COUNT(DISTINCT i.id) >= ? "
            "ORDER BY 2 DESC, 3 DESC, 1",
            (*EXCLUDED_INCIDENT_STATUSES, since, since, min_incidents),
        )
        return [Offender(r[0], int(r[1]), r[2]) for r in rows]

    def repeat_offenders_by_gpu(self, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
        """GPU serials in at least `min_incidents` incidents: follows a GPU moved between nodes."""
        rows = self._rows(
            "SELECT g.gpu_serial, COUNT(DISTINCT i.id), MAX(i.created_at) FROM incident_gpus g JOIN incidents i ON g.incident_id = i.id "
            f"WHERE {self._COUNTED} AND (? IS NULL OR i.created_at >= ?) GROUP BY g.gpu_serial HAVING COUNT(DISTINCT i.id) >= ? "
            "ORDER BY 2 DESC, 3 DESC, 1",
            (*EXCLUDED_INCIDENT_STATUSES, since, since, min_incidents),
        )
        return [Offender(r[0], int(r[1]), r[2]) for r in rows]

    def false_positive_rate(self, *, mode: str = "observe", since: float | None = None) -> FalsePositiveRate:
        """Operators' verdicts on the proposals made in `mode` (default observe):
        rate = rejected / (approved + rejected); None when nothing was judged."""
        row = self._one(
            "SELECT COALESCE(SUM(a.verdict = 'approve'), 0), COALESCE(SUM(a.verdict = 'reject'), 0) "
            "FROM approvals a JOIN decisions d ON a.decision_id = d.id WHERE d.mode = ? AND (? IS NULL OR d.decided_at >= ?)",
            (mode, since, since),
        )
        assert row is not None
        return FalsePositiveRate(approved=int(row[0]), rejected=int(row[1]))

    def mtbf_per_node(self, *, start: float, end: float) -> list[NodeMtbf]:
        """Per node with at least one failure whose first evidence lies in [start, end]:
        MTBF = (end - start) / failures. Nodes with no failure have no finite MTBF and are absent."""
        if end <= start:
            raise LedgerError(f"{self.path}: MTBF window must have end > start")
        rows = self._rows(
            "SELECT m.node, COUNT(DISTINCT i.id) FROM incident_nodes m JOIN incidents i ON m.incident_id = i.id "
            f"WHERE {self._COUNTED} AND COALESCE(i.first_evidence_at, i.created_at) BETWEEN ? AND ? GROUP BY m.node ORDER BY m.node",
            (*EXCLUDED_INCIDENT_STATUSES, start, end),
        )
        window = end - start
        return [NodeMtbf(node=r[0], failures=int(r[1]), window_s=window, mtbf_s=window / int(r[1])) for r in rows]

    def latency_percentiles(self, *, since: float | None = None) -> dict[str, Percentiles]:
        """p50/p90/p99 (nearest rank) over incidents created at or after `since`, for
        `detection` (first evidence → detected), `decision` (detected → decided), `action`
        (decided → applied) and `recovery` (first evidence → back in service). Incidents missing
        either end of an interval are left out of that figure only."""
        series: dict[str, list[float]] = {"detection": [], "decision": [], "action": [], "recovery": []}
        for inc in self.incidents(since=since):
            if inc.status in EXCLUDED_INCIDENT_STATUSES:
                continue
            for name, value in (
                ("detection", inc.detection_latency),
                ("decision", inc.decision_latency),
                ("action", inc.action_latency),
                ("recovery", inc.recovery_time),
            ):
                if value is not None:
                    series[name].append(value)
        return {
            name: Percentiles(n=len(vals), p50=percentile(vals, 50), p90=percentile(vals, 90), p99=percentile(vals, 99))
            for name, vals in series.items()
        }
