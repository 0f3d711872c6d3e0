"""What the control rounds saw, kept for replay: every node's report and Slurm's entry for every node,
each as a row from the round it changed in until the last round it still held, in a SQLite file of its
own beside the ledger (`history.sqlite`). The ledger says what the controller decided and did; this
says what it decided on, so that the same rounds can be run again under another configuration
(`healthd-sim replay`), observe mode included.

What is kept, and what is not:

* a report: the node, its verdict and its findings (each finding's JSON, as the agent sent it), from
  the round that first saw that content. A report whose findings and verdict are unchanged extends
  the row's `until` (the controller's view of it is the same); the time it was received is kept, so
  a report left to expire (`policy.report_ttl_s`) expires in a replay too. The in-band section
  (training progress) is not kept: it changes with every report, and a replay does not judge
  stragglers or hangs again.
* Slurm's entry: state, flags, reason (with its user and time), partitions, the state after a
  requested reboot and the boot time, from the round whose fleet view first showed it.
* `until` is written at most every `flush_s` (in one transaction for every row it moved), and rows
  that ended more than `keep_days` ago are removed then: at 10,000 nodes that are mostly quiet this is
  one short write every few minutes, and the file's size follows the number of changes, not the
  number of rounds.

Its cost at 10,000 nodes (a loaded 2-core VM, 2026-12-03): a round in which nothing changed 1-3 ms; one
in which 1,700 nodes reported again with the same findings 19 ms; Slurm's entries all read again as new
but equal objects 20 ms; the flush of 20,000 open rows every `flush_s`, 170 ms; the first round, which
writes every row, 400-650 ms.

A round's recording never stops the round: a failed write is logged (rate-limited) and the next
round records what is then true.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from healthd.controller.policy import NodeReport
from healthd.slurm.backend import NodeInfo

_log = logging.getLogger("healthd.controller")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS reports (
        id INTEGER PRIMARY KEY,
        node TEXT NOT NULL,
        since REAL NOT NULL,
        until REAL NOT NULL,
        received_at REAL NOT NULL,
        doc TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS reports_span ON reports (since, until)",
    """CREATE TABLE IF NOT EXISTS slurm_nodes (
        id INTEGER PRIMARY KEY,
        node TEXT NOT NULL,
        since REAL NOT NULL,
        until REAL NOT NULL,
        entry TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS slurm_nodes_span ON slurm_nodes (since, until)",
)


def report_doc(report: NodeReport) -> dict[str, Any]:
    """The part of a report a replay decides on: node, verdict and findings (NodeReport.from_document
    reads it back)."""
    return {"node": report.node, "verdict": report.verdict, "findings": [f.to_json() for f in report.findings]}


def node_entry(info: NodeInfo) -> dict[str, Any]:
    """Slurm's entry for a node as JSON (node_from_entry reads it back)."""
    return {"name": info.name, "state": info.state, "flags": sorted(info.flags), "reason": info.reason,
            "reason_user": info.reason_user, "reason_time": info.reason_time, "partitions": list(info.partitions),
            "gres": info.gres, "next_state": info.next_state, "boot_time": info.boot_time}


def node_from_entry(entry: Mapping[str, Any]) -> NodeInfo:
    return NodeInfo(name=entry["name"], state=entry["state"], flags=frozenset(entry["flags"]), reason=entry["reason"],
                    reason_user=entry["reason_user"], reason_time=entry["reason_time"],
                    partitions=tuple(entry["partitions"]), gres=entry["gres"], next_state=entry["next_state"],
                    boot_time=entry["boot_time"])


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class HistorySettings:
    """What the controller keeps of its rounds' inputs for replay (`history:` in the controller config)."""

    enabled: bool = True
    """Keep the rounds' inputs (reports and Slurm's entries), in every mode. A dry run keeps nothing."""
    path: str | None = None
    """The SQLite file; None: `history.sqlite` beside the ledger."""
    keep_days: float = 30.0
    """Rows that ended longer ago than this are removed."""
    flush_s: float = 300.0
    """How often the end times of unchanged rows are written (and old rows removed): the most a crash
    can cut from the end of what is kept."""

    def file(self, ledger: str) -> Path:
        return Path(self.path) if self.path else Path(ledger).parent / "history.sqlite"


class HistoryError(ValueError):
    """A kept row that cannot be read back (the file is damaged or was written by something else)."""


@dataclass(frozen=True)
class Span:
    """One kept row: what held for `node` from `since` to `until` (times of the rounds that saw it)."""

    node: str
    since: float
    until: float
    value: Any
    """NodeReport (reports) or NodeInfo (Slurm's entries)."""


@dataclass
class _Open:
    row: int
    key: str
    """The canonical JSON the row holds (what a change is told by)."""
    source: object
    """The object it was made from: the same object next round is the same content, not compared again."""
    until: float
    flushed: float
    received_at: float | None = None
    """A report's latest receive time (written with `until`)."""


class History:
    """The kept rounds' inputs, in `path` (created when missing)."""

    def __init__(self, path: str | Path, *, keep_days: float = 30.0, flush_s: float = 300.0):
        self.path = Path(path)
        self.keep_s = keep_days * 86400.0
        self.flush_s = flush_s
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        for statement in SCHEMA:
            self._db.execute(statement)
        self._lock = threading.Lock()
        self._open: dict[str, dict[str, _Open]] = {"reports": {}, "slurm_nodes": {}}
        self._flushed_at = 0.0
        self._fleet_version: int | None = None

    # -- writing (the round) ------------------------------------------------------------------------------

    def record(self, now: float, reports: Mapping[str, NodeReport], nodes: Mapping[str, NodeInfo],
               fleet_version: int | None = None) -> list[str]:
        """What one round saw: every node's latest report and Slurm's entries. `fleet_version`: the
        fleet view's version (SlurmSnapshot.version); when it has not moved, Slurm's entries are not
        compared again. Returns what was skipped: a node whose report or entry cannot be encoded
        (one node's bad data keeps nobody else's from being kept), as 'node: why'."""
        skipped: list[str] = []
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._changes("reports", now, reports, lambda r: (_canonical(report_doc(r)), r.received_at), skipped)
                if fleet_version is None or fleet_version != self._fleet_version:
                    self._changes("slurm_nodes", now, nodes, lambda n: (_canonical(node_entry(n)), None), skipped)
                    self._fleet_version = fleet_version
                else:
                    self._extend("slurm_nodes", now)
                if now - self._flushed_at >= self.flush_s:
                    self._flush(now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return skipped

    def _changes(self, table: str, now: float, current: Mapping[str, Any], encode, skipped: list[str]) -> None:
        opened = self._open[table]
        for node in opened.keys() - current.keys():
            gone = opened.pop(node)
            self._write_until(table, gone)
        for node, value in current.items():
            was = opened.get(node)
            # the same object, or (Slurm's entries, which hold nothing else) an equal one: the same content
            if was is not None and (was.source is value or table == "slurm_nodes" and was.source == value):
                was.until = now
                continue
            try:
                key, received_at = encode(value)
            except Exception as exc:  # one node's bad data (its row, if any, stays open as it was)
                skipped.append(f"{node}: {type(exc).__name__}: {exc}"[:300])
                continue
            if was is not None and was.key == key:
                was.source, was.until, was.received_at = value, now, received_at
                continue
            if was is not None:
                self._write_until(table, was)
            if table == "reports":
                cur = self._db.execute("INSERT INTO reports (node, since, until, received_at, doc) VALUES (?, ?, ?, ?, ?)",
                                       (node, now, now, received_at, key))
            else:
                cur = self._db.execute("INSERT INTO slurm_nodes (node, since, until, entry) VALUES (?, ?, ?, ?)",
                                       (node, now, now, key))
            opened[node] = _Open(int(cur.lastrowid or 0), key, value, now, now, received_at)

    def _extend(self, table: str, now: float) -> None:
        for was in self._open[table].values():
            was.until = now

    def _write_until(self, table: str, was: _Open) -> None:
        if was.until == was.flushed:
            return
        if table == "reports":
            self._db.execute("UPDATE reports SET until = ?, received_at = ? WHERE id = ?",
                             (was.until, was.received_at, was.row))
        else:
            self._db.execute("UPDATE slurm_nodes SET until = ? WHERE id = ?", (was.until, was.row))
        was.flushed = was.until

    def _flush(self, now: float) -> None:
        for table, opened in self._open.items():
            for was in opened.values():
                self._write_until(table, was)
            self._db.execute(f"DELETE FROM {table} WHERE until < ?", (now - self.keep_s,))
        self._flushed_at = now

    def flush(self, now: float) -> None:
        """Write every open row's `until` now (at a clean stop) and drop rows past `keep_days`."""
        with self._lock:
            self._db.execute("BEGIN")
            self._flush(now)
            self._db.execute("COMMIT")

    def close(self, now: float | None = None) -> None:
        if now is not None:
            self.flush(now)
        self._db.close()

    # -- reading (replay) ---------------------------------------------------------------------------------

    def reports(self, start: float = 0.0, end: float = float("inf")) -> Iterable[Span]:
        """Report rows that held at some time in [start, end], by `since`."""
        rows = self._db.execute("SELECT node, since, until, received_at, doc FROM reports WHERE until >= ? AND since <= ? "
                                "ORDER BY since, id", (start, end)).fetchall()
        for node, since, until, received_at, doc in rows:
            try:
                report = NodeReport.from_document(json.loads(doc), received_at)
            except (ValueError, KeyError, TypeError) as exc:
                raise HistoryError(f"{self.path}: the report of {node!r} kept from {since}: {exc}") from None
            yield Span(node, since, until, report)

    def slurm_nodes(self, start: float = 0.0, end: float = float("inf")) -> Iterable[Span]:
        """Slurm entry rows that held at some time in [start, end], by `since`."""
        rows = self._db.execute("SELECT node, since, until, entry FROM slurm_nodes WHERE until >= ? AND since <= ? "
                                "ORDER BY since, id", (start, end)).fetchall()
        for node, since, until, entry in rows:
            try:
                info = node_from_entry(json.loads(entry))
            except (ValueError, KeyError, TypeError) as exc:
                raise HistoryError(f"{self.path}: Slurm's entry for {node!r} kept from {since}: {exc}") from None
            yield Span(node, since, until, info)

    def span(self) -> tuple[float, float] | None:
        """(first, last) round time kept; None when nothing is."""
        row = self._db.execute("SELECT min(since), max(until) FROM (SELECT since, until FROM reports "
                               "UNION ALL SELECT since, until FROM slurm_nodes)").fetchone()
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))
