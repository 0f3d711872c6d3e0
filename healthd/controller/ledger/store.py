"""`Ledger`, the controller's ledger: one SQLite file over one connection (core), composed of the
stores of what it keeps (incidents with their findings and clears; decisions with their approvals;
actions with the holds they take; reintegrations; the circuit breaker), with the figures people
query (reports) as methods.

Every store is a class over the same core, so a transaction opened for one (a decision recorded and
its action planned) takes in the writes of the others.
"""

from __future__ import annotations

from healthd.controller.ledger import reports
from healthd.controller.ledger.actions import ActionStore
from healthd.controller.ledger.breaker import BreakerStore
from healthd.controller.ledger.core import DEFAULT_BUSY_TIMEOUT_S
from healthd.controller.ledger.incidents import IncidentStore
from healthd.controller.ledger.reintegrations import ReintegrationStore
from healthd.controller.ledger.reports import FalsePositiveRate, NodeMtbf, Offender, Percentiles

__all__ = ["DEFAULT_BUSY_TIMEOUT_S", "Ledger"]


class Ledger(IncidentStore, ActionStore, ReintegrationStore, BreakerStore):
    """The controller's SQLite ledger. Open one per process; it is safe to share between threads."""

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
