"""Prometheus metrics of healthd-controller (its own registry, served on `metrics_listen`).

Naming follows Prometheus conventions (checked by `promtool check metrics` in tests/observability):
counters end in `_total`, durations are `_seconds`, timestamps `_timestamp_seconds` (Unix time, so an
alert is `time() - x > N`), gauges of "how many now" are plain plurals. Labels are bounded sets (result
= accepted or an HTTP status, action kind/status, gate, verdict, tier, attribution, reintegration state,
incident stage); never a node name: per-node series are the agents' own (`healthd_verdict` by
`instance`), so the controller's series count does not grow with the fleet.

Counters and `breaker_open` are updated where things happen (daemon.py); the fleet gauges below are
set once per control round by `update_from_round` (on the round thread, under the round lock, so the
ledger is read where the round already reads it, never from the scrape thread).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from healthd.model import VERDICTS

if TYPE_CHECKING:
    from healthd.controller.daemon import Controller

_log = logging.getLogger("healthd.controller")
REINTEGRATION_STATES = ("requested", "validating", "probation", "passed", "failed", "recurred", "aborted")
INCIDENT_STAGES = ("detection", "decision", "action", "recovery")
INCIDENT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
INCIDENT_WINDOW_S = 7 * 86400.0
"""Incidents whose stage timings are still watched: created within the last week (and since start)."""
STARTUP_SLACK_S = 60.0


def _set_all(gauge: Gauge, values: Mapping[tuple[str, ...], float], keep: Iterable[tuple[str, ...]] = ()) -> None:
    """Set every labelled child from `values` (0 for `keep` labelsets without a value) and drop the
    children neither names: no clear(), so a scrape never sees the family empty mid-update."""
    wanted = {k: 0.0 for k in keep}
    wanted.update(values)
    for labels, v in wanted.items():
        gauge.labels(*labels).set(v)
    for labels in [tuple(s) for s in gauge._metrics]:  # noqa: SLF001 - prometheus_client has no public listing
        if labels not in wanted:
            gauge.remove(*labels)


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
        # -- set by update_from_round ------------------------------------------------------------------
        self.last_round = Gauge("healthd_controller_last_round_timestamp_seconds",
                                "When the last full control round completed (Slurm reachable)", registry=r)
        self.nodes_reporting = Gauge("healthd_controller_nodes_reporting",
                                     "Nodes whose latest report is fresh (within report_ttl_s), by its verdict",
                                     ["verdict"], registry=r)
        self.nodes_stale = Gauge("healthd_controller_nodes_stale",
                                 "Nodes that reported once but not within report_ttl_s", registry=r)
        self.approvals_waiting = Gauge("healthd_controller_approvals_waiting",
                                       "Decisions waiting for an operator's approval (healthctl approve/reject)",
                                       registry=r)
        self.approval_oldest_age = Gauge("healthd_controller_approvals_waiting_oldest_age_seconds",
                                         "Age of the oldest decision waiting for approval (0 when none)", registry=r)
        self.incidents_open = Gauge("healthd_controller_incidents_open", "Open incidents, by tier and attribution",
                                    ["tier", "attribution"], registry=r)
        self.reintegrations = Gauge("healthd_controller_reintegrations",
                                    "Reintegrations in the ledger, by state (the in-flight states are current; "
                                    "passed/failed/recurred/aborted only grow)", ["state"], registry=r)
        self.incident_latency = Histogram("healthd_controller_incident_latency_seconds",
                                          "Incident stage timings: detection (first evidence to detected), decision "
                                          "(detected to decided), action (decided to applied in Slurm), recovery "
                                          "(first evidence to back in service)", ["stage"], buckets=INCIDENT_BUCKETS,
                                          registry=r)
        for v in VERDICTS:
            self.nodes_reporting.labels(v).set(0)
        for s in REINTEGRATION_STATES:
            self.reintegrations.labels(s).set(0)
        for stage in INCIDENT_STAGES:
            self.incident_latency.labels(stage)
        self._started_at: float | None = None
        self._observed: set[tuple[int, str]] = set()

    def update_from_round(self, controller: Controller, now: float) -> None:
        """Set the fleet gauges from the controller's reports and its ledger; call once per full round
        (daemon.py `Controller.evaluate`, under the round lock). Idempotent for the same state. Never
        raises: a metrics problem (the ledger busy) must not fail a control round."""
        try:
            self._update_from_round(controller, now)
        except Exception:
            _log.exception("controller metrics not updated this round")

    def _update_from_round(self, controller: Controller, now: float) -> None:
        ttl = controller.policy.report_ttl_s
        with controller.reports_lock:
            reports = list(controller.reports.values())
        fresh: dict[tuple[str, ...], float] = {}
        stale = 0
        for rep in reports:
            if now - rep.received_at > ttl:
                stale += 1
            else:
                key = (rep.verdict if rep.verdict in VERDICTS else "unknown",)
                fresh[key] = fresh.get(key, 0) + 1
        _set_all(self.nodes_reporting, fresh, keep=[(v,) for v in VERDICTS])
        self.nodes_stale.set(stale)

        ledger = controller.ledger
        waiting = ledger.waiting_decisions()
        self.approvals_waiting.set(len(waiting))
        self.approval_oldest_age.set(max(0.0, now - min(d.decided_at for d in waiting)) if waiting else 0.0)

        open_by: dict[tuple[str, ...], float] = {}
        for inc in ledger.incidents(status="open"):
            key = (inc.tier, inc.attribution)
            open_by[key] = open_by.get(key, 0) + 1
        _set_all(self.incidents_open, open_by)

        by_state = {(state,): float(n) for state, n in ledger.reintegration_counts().items()}
        _set_all(self.reintegrations, by_state, keep=[(s,) for s in REINTEGRATION_STATES])

        self._observe_incidents(controller, now)
        self.last_round.set(now)  # breaker_open is set by the round itself, from the state it evaluated

    def _observe_incidents(self, controller: Controller, now: float) -> None:
        """Observe each stage timing once, when it becomes known, for incidents created since this
        process started (a restart does not count old incidents again). "Started" is the first full
        round less STARTUP_SLACK_S, so incidents that requests opened just before it are counted."""
        if self._started_at is None:
            self._started_at = now - STARTUP_SLACK_S
        since = max(self._started_at, now - INCIDENT_WINDOW_S)
        seen: set[tuple[int, str]] = set()
        for inc in controller.ledger.incidents(since=since):
            for stage, value in (("detection", inc.detection_latency), ("decision", inc.decision_latency),
                                 ("action", inc.action_latency), ("recovery", inc.recovery_time)):
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
