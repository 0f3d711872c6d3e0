"""Prometheus metrics of healthd-controller (its own registry, served on `metrics_listen`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ControllerMetrics:
    """The controller's counters; one instance per daemon (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.reports = Counter("healthd_controller_reports_total", "Reports received, by result "
                               "(accepted or the HTTP status of the refusal)", ["result"], registry=self.registry)
        self.actions = Counter("healthd_controller_actions_total", "Slurm actions, by kind and status "
                               "(applied, failed, refused, dry-run)", ["kind", "status"], registry=self.registry)
        self.refusals = Counter("healthd_controller_refusals_total", "Decisions refused, by gate",
                                ["gate"], registry=self.registry)
        self.breaker_open = Gauge("healthd_controller_breaker_open", "1 while the circuit breaker is open",
                                  registry=self.registry)
        self.report_latency = Histogram("healthd_controller_report_latency_seconds",
                                        "Time to verify and store one report", registry=self.registry)

    def serve(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
