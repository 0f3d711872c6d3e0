"""Prometheus metrics of healthd-controller (its own registry, served on `metrics_listen`).

Naming follows Prometheus conventions (checked by `promtool check metrics` in tests/observability):
counters end in `_total`, durations are `_seconds`, timestamps `_timestamp_seconds` (Unix time, so an
alert is `time() - x > N`), gauges of "how many now" are plain plurals. Labels are bounded sets (result
= accepted or an HTTP status, action kind/status, gate, verdict, tier, attribution, reintegration state,
incident stage); never a node name: per-node series are the agents' own (`healthd_verdict` by
`instance`), so the controller's series count does not grow with the fleet.

Counters and `breaker_open` are updated where things happen (daemon.py). The fleet gauges are set once
per full control round from the figures the round hands over (`RoundFigures`, read by the round thread
from its reports and its ledger; this module reads nothing of the controller). A collector serves them
from one immutable set of samples that each round replaces whole, so a scrape sees one round's values
and never a family half filled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


from healthd.controller.ledger import REINTEGRATION_STATES
from healthd.gauges import Family, Samples, SnapshotGauges
from healthd.goodput_categories import CATEGORIES
from healthd.model import VERDICTS

_log = logging.getLogger("healthd.controller")
INCIDENT_STAGES = ("detection", "decision", "action", "recovery")
INCIDENT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
INCIDENT_WINDOW_S = 7 * 86400.0
"""Incidents whose stage timings are still watched: created within the last week (and since start)."""
STARTUP_SLACK_S = 60.0
INBAND_TIERS = ("T2", "T3")
"""The tiers an in-band straggler can have (healthd.controller.inband)."""


@dataclass(frozen=True)
class IncidentTimings:
    """One incident's stage timings in seconds; None for a stage that has not happened yet."""

    id: int
    created_at: float
    detection: float | None = None
    """First evidence to detected."""
    decision: float | None = None
    """Detected to decided."""
    action: float | None = None
    """Decided to applied in Slurm."""
    recovery: float | None = None
    """First evidence to back in service."""


@dataclass(frozen=True)
class RoundFigures:
    """What one full control round exports."""

    at: float
    """When the round completed (Unix time)."""
    nodes_reporting: Mapping[str, int] = field(default_factory=dict)
    """Nodes whose latest report is fresh (within report_ttl_s), by its verdict."""
    nodes_stale: int = 0
    """Nodes that reported once but not within report_ttl_s."""
    approvals_waiting: int = 0
    oldest_waiting_since: float | None = None
    """When the oldest decision waiting for approval was made; None when none waits."""
    incidents_open: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(tier, attribution) -> open incidents."""
    reintegrations: Mapping[str, int] = field(default_factory=dict)
    """Reintegration state -> reintegrations in the ledger."""
    incidents: tuple[IncidentTimings, ...] = ()
    """The incidents created within INCIDENT_WINDOW_S before `at`."""
    inband_jobs: int = 0
    """Jobs with in-band progress in fresh reports."""
    inband_stragglers: Mapping[str, int] = field(default_factory=dict)
    """Tier (T2, T3) -> ranks flagged slow (by their agent, or job-wide by the controller)."""
    inband_hangs: int = 0
    """Jobs whose progress has stalled past their bound."""


@dataclass(frozen=True)
class GoodputFigures:
    """What the goodput metrics export: the totals over the accounted jobs (healthd.controller.goodput_jobs).
    Each total only grows; what accounting a job again took back from it is counted in its
    `*_retracted` twin, so total - retracted is the sum over the jobs' latest accounts."""

    gpu_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(partition, category) -> GPU-seconds."""
    cost: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(partition, cause) -> the interruption cost in GPU-seconds (lost work, detection, decision,
    waiting and restart), charged to its cause."""
    jobs: Mapping[str, int] = field(default_factory=dict)
    """partition -> jobs accounted."""
    objective: Mapping[str, float] = field(default_factory=dict)
    """partition -> its goodput objective."""
    gpu_s_retracted: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(partition, category) -> GPU-seconds taken back from `gpu_s` by accounting a job again."""
    cost_retracted: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(partition, cause) -> interruption cost taken back from `cost`."""
    jobs_retracted: Mapping[str, int] = field(default_factory=dict)
    """partition -> jobs taken back from `jobs` (accounted again in another partition)."""
    worst_window_ettr: Mapping[str, float] = field(default_factory=dict)
    """partition -> the lowest sliding-window ETTR of the jobs accounted in the last 30 days."""
    longest_unproductive_s: Mapping[str, float] = field(default_factory=dict)
    """partition -> the longest unproductive stretch (wall seconds) of the jobs accounted in the last 30 days."""


ROUND_GAUGES: tuple[Family, ...] = (
    ("healthd_controller_last_round_timestamp_seconds",
     "When the last full control round completed (Slurm reachable)", ()),
    ("healthd_controller_nodes_reporting",
     "Nodes whose latest report is fresh (within report_ttl_s), by its verdict", ("verdict",)),
    ("healthd_controller_nodes_stale", "Nodes that reported once but not within report_ttl_s", ()),
    ("healthd_controller_approvals_waiting",
     "Decisions waiting for an operator's approval (healthctl approve/reject)", ()),
    ("healthd_controller_approvals_waiting_oldest_age_seconds",
     "Age of the oldest decision waiting for approval (0 when none)", ()),
    ("healthd_controller_incidents_open", "Open incidents, by tier and attribution", ("tier", "attribution")),
    ("healthd_controller_reintegrations",
     "Reintegrations in the ledger, by state (the in-flight states are current; "
     "passed/failed/recurred/aborted only grow)", ("state",)),
    ("healthd_controller_inband_jobs", "Training jobs with in-band progress in fresh reports", ()),
    ("healthd_controller_inband_straggler_ranks",
     "Ranks flagged slow by the in-band detector, by tier (T2: corroborated out of band, T3: in-band only)",
     ("tier",)),
    ("healthd_controller_inband_hangs", "Training jobs whose progress has stalled past their hang bound", ()),
)
"""The per-round gauge families: name, help, label names; `round_samples` gives their samples in this order."""


def round_samples(figures: RoundFigures) -> tuple[Samples, ...]:
    """Every per-round gauge family's samples for one round, in ROUND_GAUGES order. A verdict outside
    VERDICTS counts as unknown, so the verdict label stays a bounded set."""
    by_verdict = dict.fromkeys(VERDICTS, 0.0)
    for verdict, n in figures.nodes_reporting.items():
        key = verdict if verdict in by_verdict else "unknown"
        by_verdict[key] += n
    by_state = dict.fromkeys(REINTEGRATION_STATES, 0.0)
    by_state.update((state, float(n)) for state, n in figures.reintegrations.items())
    since = figures.oldest_waiting_since
    return (
        (((), float(figures.at)),),
        tuple(((v,), n) for v, n in by_verdict.items()),
        (((), float(figures.nodes_stale)),),
        (((), float(figures.approvals_waiting)),),
        (((), 0.0 if since is None else max(0.0, figures.at - since)),),
        tuple(((tier, attribution), float(n)) for (tier, attribution), n in figures.incidents_open.items()),
        tuple(((state,), n) for state, n in by_state.items()),
        (((), float(figures.inband_jobs)),),
        tuple(((tier,), float(figures.inband_stragglers.get(tier, 0))) for tier in INBAND_TIERS),
        (((), float(figures.inband_hangs)),),
    )


BEFORE_FIRST_ROUND: tuple[Samples, ...] = (
    (((), 0.0),), tuple(((v,), 0.0) for v in VERDICTS), (((), 0.0),), (((), 0.0),), (((), 0.0),), (),
    tuple(((s,), 0.0) for s in REINTEGRATION_STATES), (((), 0.0),), tuple(((t,), 0.0) for t in INBAND_TIERS),
    (((), 0.0),))
"""What the gauges show until the first full round: zeros, no open incidents."""


class GoodputCollector:
    """The accounted jobs' goodput (healthd.controller.goodput_jobs): counters by partition, set whole
    after each accounting pass; nothing until the first pass."""

    def __init__(self) -> None:
        self._figures: GoodputFigures | None = None

    def publish(self, figures: GoodputFigures) -> None:
        self._figures = figures

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._figures))

    @staticmethod
    def _families(f: GoodputFigures | None) -> list[Metric]:
        held = CounterMetricFamily(
            "healthd_goodput_gpu_seconds", "GPU-seconds held by the jobs that ended, by partition and category "
            f"({', '.join(CATEGORIES)})", labels=("partition", "category"))
        held_back = CounterMetricFamily(
            "healthd_goodput_gpu_seconds_retracted", "GPU-seconds taken back from healthd_goodput_gpu_seconds_total "
            "when a job was accounted again (a category that shrank, or all of a job that moved to another "
            "partition); subtract it for the exact totals", labels=("partition", "category"))
        cost = CounterMetricFamily(
            "healthd_goodput_interruption_cost_gpu_seconds", "The interruption cost of the jobs that ended: GPU-seconds "
            "of lost work, detection, decision, waiting and restart, by partition and cause", labels=("partition", "cause"))
        cost_back = CounterMetricFamily(
            "healthd_goodput_interruption_cost_gpu_seconds_retracted", "Interruption cost taken back from "
            "healthd_goodput_interruption_cost_gpu_seconds_total when a job was accounted again",
            labels=("partition", "cause"))
        jobs = CounterMetricFamily("healthd_goodput_jobs", "Jobs accounted after they ended, by partition",
                                   labels=("partition",))
        jobs_back = CounterMetricFamily("healthd_goodput_jobs_retracted", "Jobs taken back from healthd_goodput_jobs_total "
                                        "when accounted again in another partition", labels=("partition",))
        objective = GaugeMetricFamily("healthd_goodput_objective",
                                      "The goodput objective: the share of held GPU time meant to be productive",
                                      labels=("partition",))
        worst = GaugeMetricFamily("healthd_goodput_worst_window_ettr_ratio",
                                  "The lowest sliding-window effective training time ratio (productive + straggler "
                                  "over held) of any job accounted in the last 30 days", labels=("partition",))
        longest = GaugeMetricFamily("healthd_goodput_longest_unproductive_seconds",
                                    "The longest stretch of held wall time without training of any job accounted "
                                    "in the last 30 days", labels=("partition",))
        if f is not None:
            for family, values in ((held, f.gpu_s), (held_back, f.gpu_s_retracted), (cost, f.cost),
                                   (cost_back, f.cost_retracted)):
                for labels, v in sorted(values.items()):
                    family.add_metric(labels, v)
            for family, by_partition in ((jobs, f.jobs), (jobs_back, f.jobs_retracted), (objective, f.objective),
                                         (worst, f.worst_window_ettr), (longest, f.longest_unproductive_s)):
                for partition, v in sorted(by_partition.items()):
                    family.add_metric((partition,), float(v))
        return [held, held_back, cost, cost_back, jobs, jobs_back, objective, worst, longest]


class ControllerMetrics:
    """The controller's counters and fleet gauges; one instance per daemon (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.reports = Counter("healthd_controller_reports_total", "Reports received, by result "
                               "(accepted or the HTTP status of the refusal)", ["result"], registry=r)
        self.actions = Counter("healthd_controller_actions_total", "Slurm actions, by kind and status "
                               "(applied, failed, refused, dry-run; reintegrate: the state reached)",
                               ["kind", "status"], registry=r)
        self.refusals = Counter("healthd_controller_refusals_total", "Decisions refused, by gate", ["gate"], registry=r)
        self.breaker_open = Gauge("healthd_controller_breaker_open", "1 while the circuit breaker is open", registry=r)
        self.report_latency = Histogram("healthd_controller_report_latency_seconds",
                                        "Time to verify and store one report", registry=r)
        self.gauges = SnapshotGauges(ROUND_GAUGES, BEFORE_FIRST_ROUND)
        r.register(self.gauges)
        self.incident_latency = Histogram("healthd_controller_incident_latency_seconds",
                                          "Incident stage timings: detection (first evidence to detected), decision "
                                          "(detected to decided), action (decided to applied in Slurm), recovery "
                                          "(first evidence to back in service)", ["stage"], buckets=INCIDENT_BUCKETS,
                                          registry=r)
        for stage in INCIDENT_STAGES:
            self.incident_latency.labels(stage)
        self.goodput_shipments = Counter("healthd_controller_goodput_shipments_total",
                                         "Goodput log shipments from the agents, by result (accepted or the "
                                         "HTTP status of the refusal)", ["result"], registry=r)
        self.goodput = GoodputCollector()
        r.register(self.goodput)
        self._lock = threading.Lock()
        """One round's figures are taken in whole before the next's."""
        self._started_at: float | None = None
        self._observed: set[tuple[int, str]] = set()

    def observe_round(self, figures: RoundFigures) -> None:
        """Export one full control round (daemon.py `Controller.evaluate`): observe the stage timings
        that became known, then swap in the round's gauges. Idempotent for the same figures."""
        samples = round_samples(figures)
        with self._lock:
            self._observe_incidents(figures.at, figures.incidents)
            self.gauges.publish(samples)

    def incidents_since(self, now: float) -> float:
        """The creation time from which incidents' stage timings are watched: this process's start
        (a restart does not count old incidents again) or a week ago, whichever is later. "Started"
        is the first full round less STARTUP_SLACK_S, so incidents that requests opened just before
        it are counted. The daemon reads the ledger's incidents from here."""
        if self._started_at is None:
            self._started_at = now - STARTUP_SLACK_S
        return max(self._started_at, now - INCIDENT_WINDOW_S)

    def _observe_incidents(self, now: float, incidents: tuple[IncidentTimings, ...]) -> None:
        """Observe each stage timing once, when it becomes known, for incidents created since
        incidents_since(now)."""
        since = self.incidents_since(now)
        seen: set[tuple[int, str]] = set()
        for inc in incidents:
            if inc.created_at < since:
                continue
            for stage, value in (("detection", inc.detection), ("decision", inc.decision),
                                 ("action", inc.action), ("recovery", inc.recovery)):
                if value is None:
                    continue
                key = (inc.id, stage)
                seen.add(key)
                if key not in self._observed:
                    self.incident_latency.labels(stage).observe(max(0.0, value))
        self._observed = seen  # incidents out of the window are forgotten

    def serve(self, listen: str):
        """Serve /metrics on `listen` (host:port) from a daemon thread; returns (server, thread)."""
        host, _, port = listen.rpartition(":")
        return start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
