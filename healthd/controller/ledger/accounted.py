"""The jobs goodput has accounted: `<directory>/accounted.sqlite` beside the gathered logs
(healthd.controller.goodput_jobs). A file of its own, not the ledger: it lives and is deleted with the
gathered logs, and only the accountant's thread writes it.

One row per job (its partition as soon as it is known, its account once it ended) and the running
totals the goodput metrics export; what is added to them is decided by the accountant.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence

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
        lost TEXT,
        problems TEXT)""",
    # what the counters export: only ever increased, so deleting an old job or accounting one again
    # never makes a counter go down (which Prometheus would read as a reset)
    """CREATE TABLE IF NOT EXISTS totals (
        partition TEXT NOT NULL,
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value REAL NOT NULL,
        PRIMARY KEY (partition, kind, key))""",
)


def _floats(text: str | None) -> dict[str, float]:
    try:
        doc = json.loads(text or "{}")
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in doc.items() if isinstance(v, (int, float))} if isinstance(doc, dict) else {}


class AccountedStore:
    """`accounted.sqlite`, read and written by one thread."""

    def __init__(self, path: str):
        self.db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        for statement in _SCHEMA:
            self.db.execute(statement)

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
        """(partition, GPU-seconds by category, lost GPU-seconds by cause) the job was last accounted
        with; None when it never was."""
        row = self.db.execute("SELECT partition, gpu_s, lost FROM jobs WHERE job = ? AND accounted_at IS NOT NULL",
                              (job,)).fetchone()
        return None if row is None else (row[0], _floats(row[1]), _floats(row[2]))

    def record_account(self, job: str, partition: str, account: str, at: float, last_write: float,
                       held_gpu_s: float, gpu_s: Mapping[str, float], lost: Mapping[str, float],
                       problems: Sequence[str], adds: Iterable[tuple[str, str, str, float]]) -> None:
        """Replace the job's row and add `adds` ((partition, kind, key, value)) to the totals, in one
        transaction; a value that is not positive adds nothing."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(job) DO UPDATE SET "
                "partition = excluded.partition, account = excluded.account, accounted_at = excluded.accounted_at, "
                "last_write = excluded.last_write, held_gpu_s = excluded.held_gpu_s, gpu_s = excluded.gpu_s, "
                "lost = excluded.lost, problems = excluded.problems",
                (job, partition, account, at, last_write, held_gpu_s, json.dumps(dict(gpu_s)),
                 json.dumps(dict(lost)), json.dumps(list(problems))))
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
