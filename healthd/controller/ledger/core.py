"""The ledger's core: one SQLite file (WAL), its one connection, transactions and reads. The stores
(incidents, decisions, actions, reintegrations, breaker) are written over this core and composed into
`Ledger` (healthd.controller.ledger.store).

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TypeVar

from healthd.controller.ledger.records import LedgerError
from healthd.controller.ledger.schema import APPLICATION_ID, SCHEMA_VERSION, migrate

_Row = TypeVar("_Row")

DEFAULT_BUSY_TIMEOUT_S = 5.0


def dump_json(value: Any) -> str:
    """`value` as the compact, key-sorted JSON the ledger keeps; LedgerError when it is not JSON."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"evidence is not JSON-serialisable: {exc}") from exc


def _read_only_fs(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def at_or_now(at: float | None) -> float:
    """A write's time: `at` when the caller gave one, else now."""
    return time.time() if at is None else float(at)


class LedgerCore:
    """The connection, its transactions and parameterised reads; safe to share between threads."""

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
    def open_readonly(cls, path: str | os.PathLike[str], *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Self:
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

    def __enter__(self) -> Self:
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

    def _existing(self, record: _Row | None, what: str, key: object) -> _Row:
        """`record` as read inside the transaction that changes it; a change to a row that is not there
        is the caller's mistake, said with the ledger's path."""
        if record is None:
            raise LedgerError(f"{self.path}: no {what} {key}")
        return record

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
