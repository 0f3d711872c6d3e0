"""The per-tick (agent) and per-round (controller) gauges are served from one immutable set of samples:
a scrape taken while an update runs sees one update's samples, every family whole; the metrics modules
take figures and read nothing of the daemons."""

from __future__ import annotations

import ast
import dataclasses
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from healthd.agent.metrics import CollectorFigure, GpuFigure, Metrics, PortFigure, TickFigures
from healthd.controller.ledger import REINTEGRATION_STATES
from healthd.controller.metrics import ControllerMetrics, IncidentTimings, RoundFigures
from healthd.model import VERDICTS, GpuSample, HostSample, InfinibandSample, KernelSample, NvmlSample
from healthd.model import PortSample, Snapshot, XidEvent
from healthd.settings import MetricsSettings

PACKAGE = Path(__file__).resolve().parents[2] / "healthd"
T0 = 1_800_000_000.0
GPUS = 8
PORTS = 4
OPEN = (("T1", "hardware"), ("T2", "fabric"), ("T3", "software"))


def tick(i: int) -> TickFigures:
    """Tick `i`: every GPU, port and collector present, values that change from tick to tick."""
    return TickFigures(
        at=T0 + i, verdict=VERDICTS[i % len(VERDICTS)],
        findings=((1, "hardware"), (2, "fabric"), (2, "fabric")),
        collectors=tuple(CollectorFigure(n, i % 2 == 0, 0.001 * i) for n in ("nvml", "kernel_log", "infiniband", "host")),
        gpus=tuple(GpuFigure(g, f"GPU-{g}", 40.0 + i % 7, i % 3 == 0) for g in range(GPUS)),
        ports=tuple(PortFigure(f"mlx5_{p}", 1, i % 2 == 1, 5e10) for p in range(PORTS)),
        kernel_lines=2, xid_lines=((79, 1),))


def round_(i: int) -> RoundFigures:
    return RoundFigures(at=T0 + i, nodes_reporting={"healthy": 10 + i % 5, "failed": i % 2}, nodes_stale=i % 3,
                        approvals_waiting=i % 4, oldest_waiting_since=T0 if i % 4 else None,
                        incidents_open=dict.fromkeys(OPEN, 1 + i % 2),
                        reintegrations={"failed": i, "probation": 1})


AGENT_LABELSETS = {
    "healthd_verdict": len(VERDICTS), "healthd_findings": 2, "healthd_collector_success": 4,
    "healthd_collector_duration_seconds": 4, "healthd_last_tick_timestamp_seconds": 1, "healthd_gpus": 1,
    "healthd_gpu_temperature_celsius": GPUS, "healthd_gpu_lost": GPUS, "healthd_ib_port_up": PORTS,
    "healthd_ib_port_rate_bytes_per_second": PORTS,
}
CONTROLLER_LABELSETS = {
    "healthd_controller_last_round_timestamp_seconds": 1, "healthd_controller_nodes_reporting": len(VERDICTS),
    "healthd_controller_nodes_stale": 1, "healthd_controller_approvals_waiting": 1,
    "healthd_controller_approvals_waiting_oldest_age_seconds": 1, "healthd_controller_incidents_open": len(OPEN),
    "healthd_controller_reintegrations": len(REINTEGRATION_STATES),
}


def hammer(registry, update, expected: dict[str, int], seconds: float = 1.0) -> int:
    """Run `update(i)` for i = 1, 2, ... on a thread while this one collects the registry; every collect
    must show each family in `expected` with exactly that many samples. Returns the collects made."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 1
        try:
            while not stop.is_set():
                update(i)
                i += 1
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows: mid-update collects
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    collects = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            counts = {m.name: len(m.samples) for m in registry.collect() if m.name in expected}
            assert counts == expected, f"collect {collects} saw a partial family"
            collects += 1
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(interval)
    assert not errors, errors
    return collects


def test_an_agent_scrape_during_updates_sees_every_family_whole():
    m = Metrics(MetricsSettings())
    m.update(tick(0))
    assert hammer(m.registry, lambda i: m.update(tick(i)), AGENT_LABELSETS) > 10


def test_a_controller_scrape_during_rounds_sees_every_family_whole():
    m = ControllerMetrics()
    m.observe_round(round_(0))
    assert hammer(m.registry, lambda i: m.observe_round(round_(i)), CONTROLLER_LABELSETS) > 10


def test_one_scrape_shows_one_ticks_values():
    """Every per-tick gauge of one scrape comes from the same tick: the timestamp names the tick, and
    the verdict and temperatures are that tick's."""
    m = Metrics(MetricsSettings())
    m.update(tick(0))
    stop = threading.Event()

    def writer() -> None:
        i = 1
        while not stop.is_set():
            m.update(tick(i))
            i += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in m.registry.collect() for s in fam.samples}
            i = int(samples[("healthd_last_tick_timestamp_seconds", ())] - T0)
            assert samples[("healthd_verdict", (("verdict", VERDICTS[i % len(VERDICTS)]),))] == 1
            assert samples[("healthd_gpu_temperature_celsius", (("gpu", "0"), ("uuid", "GPU-0")))] == 40.0 + i % 7
    finally:
        stop.set()
        thread.join(10)


def test_the_gauges_before_the_first_tick_and_round():
    agent = Metrics(MetricsSettings()).registry.get_sample_value
    assert [agent("healthd_verdict", {"verdict": v}) for v in VERDICTS] == [0.0] * len(VERDICTS)
    assert agent("healthd_last_tick_timestamp_seconds") == 0
    assert agent("healthd_gpus") == 0
    controller = ControllerMetrics()
    get = controller.registry.get_sample_value
    assert [get("healthd_controller_nodes_reporting", {"verdict": v}) for v in VERDICTS] == [0.0] * len(VERDICTS)
    assert [get("healthd_controller_reintegrations", {"state": s}) for s in REINTEGRATION_STATES] == \
        [0.0] * len(REINTEGRATION_STATES)
    body = generate_latest(controller.registry).decode()
    assert "# TYPE healthd_controller_incidents_open gauge" in body
    assert "healthd_controller_incidents_open{" not in body


def test_tick_figures_of_a_snapshot():
    snap = Snapshot(
        node="node01", time=T0, boot_id=None,
        nvml=NvmlSample(status="ok", gpus=(GpuSample(index=0, uuid="GPU-a", temperature_c=51),
                                           GpuSample(index=1, lost=True))),
        kernel=KernelSample(status="ok", lines_read=7, malformed=1, events=(
            XidEvent(xid=79, bus_id=None, text="", count=3, first_ts=T0, last_ts=T0, first_cursor=None,
                     last_cursor=None),)),
        infiniband=InfinibandSample(status="error", ports=(
            PortSample("mlx5_0", 1, "ACTIVE", "LinkUp", 400.0, "InfiniBand"),
            PortSample("mlx5_1", 1, "DOWN", "Disabled", None, "InfiniBand"))),
        host=HostSample(status="no_data"),
        collect_seconds={"nvml": 0.12345678},
    )
    m = Metrics(MetricsSettings())
    m.update(TickFigures.of(snap, "failed", ()))
    get = m.registry.get_sample_value
    assert get("healthd_verdict", {"verdict": "failed"}) == 1
    assert get("healthd_gpus") == 2
    assert get("healthd_gpu_temperature_celsius", {"gpu": "0", "uuid": "GPU-a"}) == 51
    assert get("healthd_gpu_temperature_celsius", {"gpu": "1", "uuid": ""}) is None
    assert get("healthd_gpu_lost", {"gpu": "1", "uuid": ""}) == 1
    assert get("healthd_ib_port_up", {"device": "mlx5_0", "port": "1"}) == 1
    assert get("healthd_ib_port_up", {"device": "mlx5_1", "port": "1"}) == 0
    assert get("healthd_ib_port_rate_bytes_per_second", {"device": "mlx5_0", "port": "1"}) == 5e10
    assert get("healthd_ib_port_rate_bytes_per_second", {"device": "mlx5_1", "port": "1"}) is None
    assert get("healthd_collector_success", {"collector": "infiniband"}) == 0
    assert get("healthd_collector_success", {"collector": "host"}) == 1
    assert get("healthd_collector_duration_seconds", {"collector": "nvml"}) == 0.123457
    assert get("healthd_kernel_lines_total") == 7
    assert get("healthd_kernel_malformed_lines_total") == 1
    assert get("healthd_kernel_xid_lines_total", {"xid": "79"}) == 3


def test_findings_count_by_tier_and_attribution_and_go_when_cleared():
    m = Metrics(MetricsSettings())
    figures = tick(0)
    m.update(figures)
    get = m.registry.get_sample_value
    assert get("healthd_findings", {"tier": "2", "attribution": "fabric"}) == 2
    assert get("healthd_findings", {"tier": "1", "attribution": "hardware"}) == 1
    m.update(dataclasses.replace(figures, findings=()))
    assert get("healthd_findings", {"tier": "2", "attribution": "fabric"}) is None


def test_round_figures_fold_unknown_verdicts_and_drop_closed_incidents():
    m = ControllerMetrics()
    get = m.registry.get_sample_value
    m.observe_round(RoundFigures(at=T0, nodes_reporting={"healthy": 2, "bogus": 1}, incidents_open={("T1", "hardware"): 1},
                                 approvals_waiting=1, oldest_waiting_since=T0 - 30))
    assert get("healthd_controller_nodes_reporting", {"verdict": "unknown"}) == 1
    assert get("healthd_controller_nodes_reporting", {"verdict": "bogus"}) is None
    assert get("healthd_controller_approvals_waiting_oldest_age_seconds") == 30
    m.observe_round(RoundFigures(at=T0 + 5))
    assert get("healthd_controller_incidents_open", {"tier": "T1", "attribution": "hardware"}) is None
    assert get("healthd_controller_approvals_waiting_oldest_age_seconds") == 0
    assert get("healthd_controller_nodes_reporting", {"verdict": "healthy"}) == 0


def test_stage_timings_are_observed_once_and_only_for_incidents_since_start():
    m = ControllerMetrics()
    count = lambda: m.registry.get_sample_value("healthd_controller_incident_latency_seconds_count",  # noqa: E731
                                                {"stage": "detection"})
    old = IncidentTimings(1, created_at=T0 - 3600, detection=5.0)
    new = IncidentTimings(2, created_at=T0 - 30, detection=3.0)
    m.observe_round(RoundFigures(at=T0, incidents=(old, new)))
    assert count() == 1
    m.observe_round(RoundFigures(at=T0 + 5, incidents=(old, new)))
    assert count() == 1
    m.observe_round(RoundFigures(at=T0 + 10, incidents=(old, new, IncidentTimings(3, created_at=T0 + 8))))
    assert count() == 1
    m.observe_round(RoundFigures(at=T0 + 15, incidents=(IncidentTimings(3, created_at=T0 + 8, detection=2.0),)))
    assert count() == 2


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
    return out


@pytest.mark.parametrize("module,allowed", [
    ("agent/metrics.py", set()),
    ("controller/metrics.py", {"healthd.controller.ledger"}),
])
def test_the_metrics_modules_take_figures_not_the_daemons(module, allowed):
    """Only the shared floor, prometheus_client and the standard library: no daemon, no agent or
    controller internals (the controller's one exception is the ledger's list of reintegration states)."""
    imports = _imports(PACKAGE / module)
    ours = {i for i in imports if i.startswith("healthd.")}
    assert all(i.count(".") == 1 for i in ours - allowed), ours - allowed
    third = {i.split(".")[0] for i in imports} - {"healthd", "__future__", *sys.stdlib_module_names}
    assert third == {"prometheus_client"}


@pytest.mark.parametrize("module", ["agent/metrics.py", "controller/metrics.py"])
def test_the_metrics_modules_use_no_private_state_of_metric_objects(module):
    """No `_metrics`, `_value`, `clear()`, `remove()`: what a scrape sees is built by the module's own
    collector, never by editing prometheus_client objects in place."""
    tree = ast.parse((PACKAGE / module).read_text())
    wrong = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and (n.attr in {"clear", "remove"} or (n.attr.startswith("_") and not n.attr.startswith("__")
                                                    and not (isinstance(n.value, ast.Name) and n.value.id == "self")))]
    assert not wrong, wrong
