"""The ledger's schema and its migrations.

`PRAGMA user_version` holds the schema version and `PRAGMA application_id` marks the file as a
healthd ledger. `migrate()` runs each step of `MIGRATIONS` in its own transaction, together with the
version bump. A file that has a newer schema than this code raises `LedgerError` naming the file;
nothing is ever deleted or recreated to "recover".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from healthd.controller.ledger.records import ACTION_STATUSES, CLEAR_SCOPES, REINTEGRATION_STATES, LedgerError

SCHEMA_VERSION = 3
APPLICATION_ID = 0x68446C67  # "hDlg": marks a healthd ledger (PRAGMA application_id)


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

