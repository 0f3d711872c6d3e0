"""The figures people query from the ledger (`healthctl report`): repeat offenders by node and by
GPU serial, the false-positive rate of proposals, MTBF per node, and percentiles of the incident
stage timings. Each is a read of the ledger's tables through its incidents' store and the connection
beneath it; `Ledger` offers them as methods."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from healthd.controller.ledger.records import LedgerError

if TYPE_CHECKING:  # the reads need only the incidents' store: the ledger itself imports this module
    from healthd.controller.ledger.incidents import IncidentStore

EXCLUDED_INCIDENT_STATUSES = ("false_positive",)
"""Incidents with these statuses are left out of MTBF, repeat-offender and latency figures."""

_COUNTED = f"i.status NOT IN ({', '.join('?' for _ in EXCLUDED_INCIDENT_STATUSES)})"
"""The SQL condition that keeps an incident `i` in the figures (EXCLUDED_INCIDENT_STATUSES are parameters)."""


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


def _offenders(ledger: IncidentStore, table: str, key: str, since: float | None, min_incidents: int) -> list[Offender]:
    rows = ledger.query(
        f"SELECT m.{key}, COUNT(DISTINCT i.id), MAX(i.created_at) FROM {table} m JOIN incidents i ON m.incident_id = i.id "
        f"WHERE {_COUNTED} AND (? IS NULL OR i.created_at >= ?) GROUP BY m.{key} HAVING COUNT(DISTINCT i.id) >= ? "
        "ORDER BY 2 DESC, 3 DESC, 1",
        (*EXCLUDED_INCIDENT_STATUSES, since, since, min_incidents),
    )
    return [Offender(r[0], int(r[1]), r[2]) for r in rows]


def repeat_offenders_by_node(ledger: IncidentStore, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
    """Nodes in at least `min_incidents` incidents (created at or after `since`), worst first."""
    return _offenders(ledger, "incident_nodes", "node", since, min_incidents)


def repeat_offenders_by_gpu(ledger: IncidentStore, *, since: float | None = None, min_incidents: int = 2) -> list[Offender]:
    """GPU serials in at least `min_incidents` incidents: follows a GPU moved between nodes."""
    return _offenders(ledger, "incident_gpus", "gpu_serial", since, min_incidents)


def false_positive_rate(ledger: IncidentStore, *, mode: str = "observe", since: float | None = None) -> FalsePositiveRate:
    """Operators' verdicts on the proposals made in `mode` (default observe):
    rate = rejected / (approved + rejected); None when nothing was judged."""
    row = ledger.query_one(
        "SELECT COALESCE(SUM(a.verdict = 'approve'), 0), COALESCE(SUM(a.verdict = 'reject'), 0) "
        "FROM approvals a JOIN decisions d ON a.decision_id = d.id WHERE d.mode = ? AND (? IS NULL OR d.decided_at >= ?)",
        (mode, since, since),
    )
    assert row is not None
    return FalsePositiveRate(approved=int(row[0]), rejected=int(row[1]))


def mtbf_per_node(ledger: IncidentStore, *, start: float, end: float) -> list[NodeMtbf]:
    """Per node with at least one failure whose first evidence lies in [start, end]:
    MTBF = (end - start) / failures. Nodes with no failure have no finite MTBF and are absent."""
    if end <= start:
        raise LedgerError(f"{ledger.path}: MTBF window must have end > start")
    rows = ledger.query(
        "SELECT m.node, COUNT(DISTINCT i.id) FROM incident_nodes m JOIN incidents i ON m.incident_id = i.id "
        f"WHERE {_COUNTED} AND COALESCE(i.first_evidence_at, i.created_at) BETWEEN ? AND ? GROUP BY m.node ORDER BY m.node",
        (*EXCLUDED_INCIDENT_STATUSES, start, end),
    )
    window = end - start
    return [NodeMtbf(node=r[0], failures=int(r[1]), window_s=window, mtbf_s=window / int(r[1])) for r in rows]


def latency_percentiles(ledger: IncidentStore, *, since: float | None = None) -> dict[str, Percentiles]:
    """p50/p90/p99 (nearest rank) over incidents created at or after `since`, for
    `detection` (first evidence → detected), `decision` (detected → decided), `action`
    (decided → applied) and `recovery` (first evidence → back in service). Incidents missing
    either end of an interval are left out of that figure only."""
    series: dict[str, list[float]] = {"detection": [], "decision": [], "action": [], "recovery": []}
    for inc in ledger.incidents(since=since):
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
