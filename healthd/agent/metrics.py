"""Prometheus metrics for the agent: a node_exporter textfile and/or a loopback /metrics port.

Names follow `healthd_<subsystem>_<name>_<unit>`; the monitor's own health is exported as
`healthd_collector_success{collector=...}` so a silently broken collector is visible.

Naming (Prometheus conventions, checked by `promtool check metrics` in tests/observability):
base units spelled out in the name (`_seconds`, `_celsius`, `_bytes_per_second`), counters end in
`_total`, timestamps are `_timestamp_seconds` (Unix time, so an alert is `time() - x > N`), and
`_count`/`_sum`/`_bucket` are left to histograms. Labels are bounded per node: verdict, tier,
attribution, collector, GPU index/UUID, HCA/port, Xid code; never a job id, PID or message text.
`healthd_gpus` was `healthd_gpu_count` (promtool: `_count` is reserved for histograms and summaries);
`healthd_ib_port_rate_bytes_per_second` was `healthd_ib_port_rate_gbps` (base unit, the name
node_exporter's `node_infiniband_rate_bytes_per_second` uses: 400 Gb/s NDR = 5e10).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server, write_to_textfile

from healthd.model import VERDICTS
from healthd.settings import MetricsSettings

if TYPE_CHECKING:
    from healthd.agent.daemon import Agent

log = logging.getLogger(__name__)
COLLECTORS = ("nvml", "kernel_log", "infiniband", "host")


class Metrics:
    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = r = registry or CollectorRegistry()
        self.verdict = Gauge("healthd_verdict", "1 for the node's current verdict", ["verdict"], registry=r)
        self.findings = Gauge(
            "healthd_findings", "Current findings by tier and attribution", ["tier", "attribution"], registry=r
        )
        self.collector_success = Gauge(
            "healthd_collector_success", "1 if the collector read its source (or it has none) this tick", ["collector"], registry=r
        )
        self.collector_duration = Gauge(
            "healthd_collector_duration_seconds", "Wall time of the collector's last run", ["collector"], registry=r
        )
        self.last_tick = Gauge("healthd_last_tick_timestamp_seconds", "When the verdict was last computed", registry=r)
        self.gpus = Gauge("healthd_gpus", "GPUs NVML reports", registry=r)
        self.gpu_temp = Gauge("healthd_gpu_temperature_celsius", "GPU temperature", ["gpu", "uuid"], registry=r)
        self.gpu_lost = Gauge("healthd_gpu_lost", "1 if NVML reports the GPU lost", ["gpu", "uuid"], registry=r)
        self.port_up = Gauge("healthd_ib_port_up", "1 if the port is ACTIVE and LinkUp", ["device", "port"], registry=r)
        self.port_rate = Gauge("healthd_ib_port_rate_bytes_per_second", "Port link rate (400 Gb/s NDR = 5e10)",
                               ["device", "port"], registry=r)
        self.kernel_lines = Counter("healthd_kernel_lines_total", "Kernel log lines read", registry=r)
        self.xid_lines = Counter("healthd_kernel_xid_lines_total", "NVRM Xid lines read, by Xid", ["xid"], registry=r)
        self.kernel_malformed = Counter("healthd_kernel_malformed_lines_total", "NVRM lines that did not parse",
                                        registry=r)
        for v in VERDICTS:
            self.verdict.labels(v).set(0)
        if settings.listen:
            host, _, port = settings.listen.rpartition(":")
            start_http_server(int(port), addr=host, registry=r)
            log.info("metrics on http://%s/metrics", settings.listen)

    def update(self, agent: "Agent", doc: dict[str, Any]) -> None:
        snap = agent.snapshot
        res = agent.result
        if snap is None or res is None:
            return
        for v in VERDICTS:
            self.verdict.labels(v).set(1 if v == res.verdict else 0)
        self.findings.clear()
        for f in res.findings:
            self.findings.labels(str(f.tier), f.attribution).inc()
        for name, info in doc["sources"].items():
            self.collector_success.labels(name).set(0 if info["status"] == "error" else 1)
            self.collector_duration.labels(name).set(info["seconds"])
        self.last_tick.set(snap.time)
        self.gpus.set(len(snap.nvml.gpus))
        self.gpu_temp.clear()
        self.gpu_lost.clear()
        for g in snap.nvml.gpus:
            if g.temperature_c is not None:
                self.gpu_temp.labels(str(g.index), g.uuid or "").set(g.temperature_c)
            self.gpu_lost.labels(str(g.index), g.uuid or "").set(1 if g.lost else 0)
        self.port_up.clear()
        self.port_rate.clear()
        for p in snap.infiniband.ports:
            self.port_up.labels(p.device, str(p.port)).set(1 if p.up else 0)
            if p.rate_gbps is not None:
                self.port_rate.labels(p.device, str(p.port)).set(p.rate_gbps * 1e9 / 8)
        k = snap.kernel
        if k.lines_read:
            self.kernel_lines.inc(k.lines_read)
        if k.malformed:
            self.kernel_malformed.inc(k.malformed)
        for e in k.events:
            self.xid_lines.labels(str(e.xid)).inc(e.count)
        if self.settings.textfile:
            try:
                write_to_textfile(self.settings.textfile, self.registry)
            except OSError as e:
                log.error("cannot write metrics textfile %s: %s", self.settings.textfile, e)
