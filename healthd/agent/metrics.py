"""Prometheus metrics for the agent: a node_exporter textfile and/or a loopback /metrics port.

Names follow `healthd_<subsystem>_<name>_<unit>`; the monitor's own health is exported as
`healthd_collector_success{collector=...}` so a silently broken collector is visible.

Naming (Prometheus conventions, checked by `promtool check metrics` in tests/observability):
base units spelled out in the name (`_seconds`, `_celsius`, `_bytes_per_second`), counters end in
`_total`, timestamps are `_timestamp_seconds` (Unix time, so an alert is `time() - x > N`), and
`_count`/`_sum`/`_bucket` are left to histograms (hence `healthd_gpus`, not `healthd_gpu_count`).
Labels are bounded per node: verdict, tier, attribution, collector, GPU index/UUID, HCA/port, Xid
code; never a job id, PID or message text. The IB link rate is in bytes per second, the unit of
node_exporter's `node_infiniband_rate_bytes_per_second` (400 Gb/s NDR = 5e10).

The agent hands over each tick's figures (`TickFigures`, built from its snapshot and verdict, with
one collector figure per registered source, healthd.agent.sources); this module reads nothing of the
agent itself. The per-tick gauges are served by a collector from one immutable
set of samples that each update replaces whole, so a scrape sees one tick's values and never a
family half filled. The kernel-log counters only grow, by what each tick read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server, write_to_textfile

from healthd.agent import sources as registry
from healthd.gauges import Family, Samples, SnapshotGauges
from healthd.model import VERDICTS, Finding, Snapshot
from healthd.settings import MetricsSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectorFigure:
    """One collector's outcome this tick."""

    name: str
    ok: bool
    """It read its source, or the node has none (no_data); False when the source could not be read."""
    seconds: float


@dataclass(frozen=True)
class GpuFigure:
    index: int
    uuid: str
    temperature_c: float | None
    lost: bool


@dataclass(frozen=True)
class PortFigure:
    device: str
    port: int
    up: bool
    """ACTIVE and LinkUp."""
    rate_bytes_per_second: float | None


@dataclass(frozen=True)
class TickFigures:
    """What one tick exports: the gauges' values, and what the counters grow by."""

    at: float
    """When the verdict was computed (Unix time)."""
    verdict: str
    findings: tuple[tuple[int, str], ...]
    """(tier, attribution) of each current finding."""
    collectors: tuple[CollectorFigure, ...]
    gpus: tuple[GpuFigure, ...]
    ports: tuple[PortFigure, ...]
    kernel_lines: int = 0
    """Kernel log lines read this tick."""
    kernel_malformed: int = 0
    """NVRM lines read this tick that did not parse."""
    xid_lines: tuple[tuple[int, int], ...] = ()
    """(Xid, lines) read this tick."""
    inband: tuple[InbandFigure, ...] = ()
    """The training jobs whose ranks report in-band on this node."""
    nvml_unavailable: tuple[tuple[str, str], ...] = ()
    """(NVML function, reading) for each reading the loaded driver cannot give: it lacks the function."""

    @classmethod
    def of(cls, snapshot: Snapshot, verdict: str, findings: Iterable[Finding],
           inband: Iterable[Any] = ()) -> TickFigures:
        """The figures of one tick's snapshot and its classification."""
        samples = tuple((s.name, registry.sample_of(snapshot, s)) for s in registry.SOURCES)
        return cls(
            at=snapshot.time,
            verdict=verdict,
            findings=tuple((f.tier, f.attribution) for f in findings),
            # rounded as the state file's `sources` show them, so both say the same
            collectors=tuple(CollectorFigure(name, s.status != "error", round(snapshot.collect_seconds.get(name, 0.0), 6))
                             for name, s in samples),
            gpus=tuple(GpuFigure(g.index, g.uuid or "", g.temperature_c, g.lost) for g in snapshot.nvml.gpus),
            ports=tuple(PortFigure(p.device, p.port, p.up, None if p.rate_gbps is None else p.rate_gbps * 1e9 / 8)
                        for p in snapshot.infiniband.ports),
            kernel_lines=snapshot.kernel.lines_read,
            kernel_malformed=snapshot.kernel.malformed,
            xid_lines=tuple((e.xid, e.count) for e in snapshot.kernel.events),
            inband=tuple(InbandFigure(j.job, len(j.ranks), j.step_median_s, len(j.stragglers), j.hang is not None)
                         for j in inband),
            nvml_unavailable=tuple((fn, r) for fn, readings in snapshot.nvml.driver_lacks.items() for r in readings),
        )


@dataclass(frozen=True)
class InbandFigure:
    job: str
    ranks: int
    step_s: float | None
    stragglers: int
    hung: bool


TICK_GAUGES: tuple[Family, ...] = (
    ("healthd_verdict", "1 for the node's current verdict", ("verdict",)),
    ("healthd_findings", "Current findings by tier and attribution", ("tier", "attribution")),
    ("healthd_collector_success", "1 if the collector read its source (or it has none) this tick", ("collector",)),
    ("healthd_collector_duration_seconds", "Wall time of the collector's last run", ("collector",)),
    ("healthd_last_tick_timestamp_seconds", "When the verdict was last computed", ()),
    ("healthd_gpus", "GPUs NVML reports", ()),
    ("healthd_gpu_temperature_celsius", "GPU temperature", ("gpu", "uuid")),
    ("healthd_gpu_lost", "1 if NVML reports the GPU lost", ("gpu", "uuid")),
    ("healthd_ib_port_up", "1 if the port is ACTIVE and LinkUp", ("device", "port")),
    ("healthd_ib_port_rate_bytes_per_second", "Port link rate (400 Gb/s NDR = 5e10)", ("device", "port")),
    ("healthd_inband_ranks", "Ranks of the job writing in-band records on this node", ("job",)),
    ("healthd_inband_step_seconds", "Median step time of the job's ranks on this node", ("job",)),
    ("healthd_inband_stragglers", "Ranks of the job on this node flagged as stragglers", ("job",)),
    ("healthd_inband_hung", "1 if the job's ranks on this node have made no step for longer than the bound",
     ("job",)),
    ("healthd_nvml_reading_unavailable", "1 for each reading the NVIDIA driver cannot give: its NVML lacks the function",
     ("function", "reading")),
)
"""The per-tick gauge families: name, help, label names; `tick_samples` gives their samples in this order."""


def tick_samples(figures: TickFigures) -> tuple[Samples, ...]:
    """Every per-tick gauge family's samples for one tick, in TICK_GAUGES order."""
    findings: dict[tuple[str, ...], float] = {}
    for tier, attribution in figures.findings:
        key = (str(tier), attribution)
        findings[key] = findings.get(key, 0.0) + 1.0
    gpus, ports = figures.gpus, figures.ports
    return (
        tuple(((v,), 1.0 if v == figures.verdict else 0.0) for v in VERDICTS),
        tuple(findings.items()),
        tuple(((c.name,), 1.0 if c.ok else 0.0) for c in figures.collectors),
        tuple(((c.name,), float(c.seconds)) for c in figures.collectors),
        (((), float(figures.at)),),
        (((), float(len(gpus))),),
        tuple(((str(g.index), g.uuid), float(g.temperature_c)) for g in gpus if g.temperature_c is not None),
        tuple(((str(g.index), g.uuid), 1.0 if g.lost else 0.0) for g in gpus),
        tuple(((p.device, str(p.port)), 1.0 if p.up else 0.0) for p in ports),
        tuple(((p.device, str(p.port)), float(p.rate_bytes_per_second)) for p in ports
              if p.rate_bytes_per_second is not None),
        tuple(((j.job,), float(j.ranks)) for j in figures.inband),
        tuple(((j.job,), float(j.step_s)) for j in figures.inband if j.step_s is not None),
        tuple(((j.job,), float(j.stragglers)) for j in figures.inband),
        tuple(((j.job,), 1.0 if j.hung else 0.0) for j in figures.inband),
        tuple((pair, 1.0) for pair in figures.nvml_unavailable),
    )


BEFORE_FIRST_TICK: tuple[Samples, ...] = (
    tuple(((v,), 0.0) for v in VERDICTS), (), (), (), (((), 0.0),), (((), 0.0),), (), (), (), (), (), (), (), (), ())
"""What the gauges show until the first tick: every verdict 0, no labelled samples."""


class Metrics:
    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = r = registry or CollectorRegistry()
        self.gauges = SnapshotGauges(TICK_GAUGES, BEFORE_FIRST_TICK)
        r.register(self.gauges)
        self.kernel_lines = Counter("healthd_kernel_lines_total", "Kernel log lines read", registry=r)
        self.xid_lines = Counter("healthd_kernel_xid_lines_total", "NVRM Xid lines read, by Xid", ["xid"], registry=r)
        self.kernel_malformed = Counter("healthd_kernel_malformed_lines_total", "NVRM lines that did not parse",
                                        registry=r)
        if settings.listen:
            host, _, port = settings.listen.rpartition(":")
            start_http_server(int(port), addr=host, registry=r)
            log.info("metrics on http://%s/metrics", settings.listen)

    def update(self, figures: TickFigures) -> None:
        """Export one tick: swap in its gauges, grow the counters, rewrite the textfile."""
        self.gauges.publish(tick_samples(figures))
        if figures.kernel_lines:
            self.kernel_lines.inc(figures.kernel_lines)
        if figures.kernel_malformed:
            self.kernel_malformed.inc(figures.kernel_malformed)
        for xid, lines in figures.xid_lines:
            self.xid_lines.labels(str(xid)).inc(lines)
        if self.settings.textfile:
            try:
                write_to_textfile(self.settings.textfile, self.registry)
            except OSError as e:
                log.error("cannot write metrics textfile %s: %s", self.settings.textfile, e)
