"""The jobs goodput has accounted: `<directory>/accounted.sqlite` beside the gathered logs
(healthd.controller.goodput_jobs). A file of its own, not the ledger: it lives and is deleted with the
gathered logs, and only the accountant's thread writes it.

One row per job (its partition as soon as it is known, its account once it ended) and the running
totals the goodput metrics export; what is added to them is decided by the accountant.

A file written before the interruption cost had its name kept each incident's cost in a `lost`
column and its totals under kind `lost`; opening it copies both to `cost` once, so old rows and totals
keep counting.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ACCOUNTED_NAME = "accounted.sqlite"

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (
        job TEXT PRIMARY KEY,
        partition TEXT NOT NULL,
        account TEXT NOT NULL,
        accounted_at REAL,
        last_write REAL,
        held_gpu_s REAL,
        gpu_s TEXT,
        cost TEXT,
        problems TEXT,
        window_min REAL,
        longest_unproductive_s REAL,
        counted_partition TEXT)""",
    # what the counters export: only ever increased, so deleting an old job or accounting one again
    # never makes a counter go down (which Prometheus would read as a reset); what an account no
    # longer holds is added to a `*_retracted` kind instead
    """CREATE TABLE IF NOT EXISTS totals (
        partition TEXT NOT NULL,
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value REAL NOT NULL,
        PRIMARY KEY (partition, kind, key))""",
)
_ADDED_COLUMNS = (("cost", "TEXT"), ("window_min", "REAL"), ("longest_unproductive_s", "REAL"),
                  ("counted_partition", "TEXT"))
"""Columns a file from an older healthd lacks."""
RETRACTED = "_retracted"
"""The suffix of a total's kind that counts what re-accounting took back from it."""


def _floats(text: str | None) -> dict[str, float]:
    try:
        doc = json.loads(text or "{}")
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in doc.items() if isinstance(v, (int, float))} if isinstance(doc, dict) else {}


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file of an older healthd to this schema: its missing columns added, its `lost` column
    and totals (the interruption cost under its old name) copied to `cost`."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    with db:
        db.execute("BEGIN IMMEDIATE")
        for name, kind in _ADDED_COLUMNS:
            if name not in columns:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        if "lost" in columns:
            db.execute("UPDATE jobs SET cost = lost WHERE cost IS NULL AND lost IS NOT NULL")
        for old, new in (("lost", "cost"), ("lost" + RETRACTED, "cost" + RETRACTED)):
            db.execute("INSERT INTO totals SELECT partition, ?, key, value FROM totals WHERE kind = ? "
                       "ON CONFLICT(partition, kind, key) DO UPDATE SET value = value + excluded.value", (new, old))
            db.execute("DELETE FROM totals WHERE kind = ?", (old,))


@dataclass(frozen=True)
class JobRow:
    """One accounted job's row: what its latest account holds."""

    job: str
    partition: str
    """The partition its account is counted in."""
    accounted_at: float
    gpu_s: Mapping[str, float]
    """category -> GPU-seconds."""
    cost: Mapping[str, float]
    """cause -> interruption cost in GPU-seconds."""
    window_min: float | None
    """Its lowest sliding-window ETTR (None: a job that held nothing, or accounted by an older healthd)."""
    longest_unproductive_s: float | None
    """Its longest unproductive stretch in wall seconds (None: accounted by an older healthd)."""


class AccountedStore:
    """`accounted.sqlite`, read and written by one thread."""

    def __init__(self, path: str):
        self.db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        for statement in _SCHEMA:
            self.db.execute(statement)
        _migrate(self.db)

    def close(self) -> None:
        self.db.close()

    def known(self) -> dict[str, tuple[str, str, float | None, float | None]]:
        """job -> (partition, account, accounted_at, the newest write it was accounted with)."""
        return {job: (p, a, at, lw) for job, p, a, at, lw in
                self.db.execute("SELECT job, partition, account, accounted_at, last_write FROM jobs")}

    def seen(self, job: str, partition: str, account: str) -> None:
        self.db.execute("INSERT INTO jobs (job, partition, account) VALUES (?, ?, ?) ON CONFLICT(job) DO UPDATE "
                        "SET partition = excluded.partition, account = excluded.account", (job, partition, account))

    def last_account(self, job: str) -> tuple[str, dict[str, float], dict[str, float]] | None:
        """(partition, GPU-seconds by category, interruption cost by cause) the job was last accounted
        with; None when it never was. The partition is the one its account was counted in, which
        `seen` does not change when Slurm later names another (a job requeued into another partition)."""
        row = self.db.execute("SELECT COALESCE(counted_partition, partition), gpu_s, cost FROM jobs "
                              "WHERE job = ? AND accounted_at IS NOT NULL", (job,)).fetchone()
        return None if row is None else (row[0], _floats(row[1]), _floats(row[2]))

    def record_account(self, job: str, partition: str, account: str, at: float, last_write: float,
                       held_gpu_s: float, gpu_s: Mapping[str, float], cost: Mapping[str, float],
                       problems: Sequence[str], adds: Iterable[tuple[str, str, str, float]],
                       window_min: float | None = None, longest_unproductive_s: float | None = None) -> None:
        """Replace the job's row and add `adds` ((partition, kind, key, value)) to the totals, in one
        transaction; a value that is not positive adds nothing."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO jobs (job, partition, account, accounted_at, last_write, held_gpu_s, gpu_s, cost, "
                "problems, window_min, longest_unproductive_s, counted_partition) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(job) DO UPDATE SET partition = excluded.partition, account = excluded.account, "
                "accounted_at = excluded.accounted_at, last_write = excluded.last_write, "
                "held_gpu_s = excluded.held_gpu_s, gpu_s = excluded.gpu_s, cost = excluded.cost, "
                "problems = excluded.problems, window_min = excluded.window_min, "
                "longest_unproductive_s = excluded.longest_unproductive_s, "
                "counted_partition = excluded.counted_partition",
                (job, partition, account, at, last_write, held_gpu_s, json.dumps(dict(gpu_s)),
                 json.dumps(dict(cost)), json.dumps(list(problems)), window_min, longest_unproductive_s, partition))
            for add in adds:
                self._add(*add)

    def _add(self, partition: str, kind: str, key: str, value: float) -> None:
        if value <= 0:
            return
        self.db.execute("INSERT INTO totals VALUES (?, ?, ?, ?) ON CONFLICT(partition, kind, key) DO UPDATE "
                        "SET value = value + excluded.value", (partition, kind, key, value))

    def forget(self, job: str) -> None:
        """Delete the job's row; the totals keep what it added."""
        self.db.execute("DELETE FROM jobs WHERE job = ?", (job,))

    def totals(self) -> list[tuple[str, str, str, float]]:
        """Every running total: (partition, kind, key, value)."""
        return list(self.db.execute("SELECT partition, kind, key, value FROM totals"))

    def accounted_since(self, since: float) -> list[JobRow]:
        """The rows of the jobs last accounted at or after `since`."""
        return [JobRow(job, p, at, _floats(g), _floats(c), w, u) for job, p, at, g, c, w, u in self.db.execute(
            "SELECT job, COALESCE(counted_partition, partition), accounted_at, gpu_s, cost, window_min, "
            "longest_unproductive_s FROM jobs "
            "WHERE accounted_at IS NOT NULL AND accounted_at >= ?", (since,))]


def recorded_jobs(path: str) -> dict[str, tuple[str, str]]:
    """job -> (partition, account) from the accounted jobs at `path`, read-only; empty when the file
    cannot be read."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            return {job: (p, a) for job, p, a in db.execute("SELECT job, partition, account FROM jobs")}
        finally:
            db.close()
    except sqlite3.Error:
        return {}
