"""ControllerMetrics.observe_round: the fleet gauges from the figures a Controller takes of its reports
and ledger (fake Slurm, reports put in directly: no MUNGE needed)."""

from __future__ import annotations

import pytest

from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings, NodeReport, finding_from_json
from healthd.model import iso
from tests.support.fake_slurm import FakeBackend

T0 = 1_800_000_000.0


def xid79(at: float):
    return finding_from_json({
        "id": "xid:gpu0:79", "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
        "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79 gpu0: fell off the bus",
        "evidence": [{"kind": "log", "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
        "first_seen": iso(at), "last_seen": iso(at)})


def make(tmp_path, mode="supervised"):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  policy=ControllerPolicySettings(mode=mode))  # type: ignore[arg-type]
    metrics = ControllerMetrics()
    return Controller(settings, ledger, FakeBackend(), metrics=metrics, node_addrs=dict), ledger, metrics


def test_fleet_gauges_follow_reports_and_ledger(tmp_path):
    c, ledger, m = make(tmp_path)
    get = m.registry.get_sample_value
    try:
        ttl = c.policy.report_ttl_s
        c.reports["node01"] = NodeReport(node="node01", verdict="healthy", received_at=T0)
        c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 - 3),), received_at=T0)
        c.reports["node03"] = NodeReport(node="node03", verdict="healthy", received_at=T0 - ttl - 1)
        c.evaluate(T0)
        m.observe_round(c.round_figures(T0))
        assert get("healthd_controller_last_round_timestamp_seconds") == T0
        assert get("healthd_controller_nodes_reporting", {"verdict": "healthy"}) == 1
        assert get("healthd_controller_nodes_reporting", {"verdict": "failed"}) == 1
        assert get("healthd_controller_nodes_reporting", {"verdict": "degraded"}) == 0
        assert get("healthd_controller_nodes_stale") == 1
        assert get("healthd_controller_approvals_waiting") == 1
        assert get("healthd_controller_incidents_open", {"tier": "T1", "attribution": "hardware"}) == 1
        assert get("healthd_controller_incident_latency_seconds_count", {"stage": "detection"}) == 1
        assert get("healthd_controller_incident_latency_seconds_sum", {"stage": "detection"}) == 3
        assert get("healthd_controller_reintegrations", {"state": "failed"}) == 0

        later = T0 + 600
        m.observe_round(c.round_figures(later))  # idempotent: nothing observed twice, the age grows
        # decided_at is when the round decided, a few ms after the round's T0
        assert get("healthd_controller_approvals_waiting_oldest_age_seconds") == pytest.approx(600, abs=1)
        assert get("healthd_controller_incident_latency_seconds_count", {"stage": "detection"}) == 1

        (waiting,) = ledger.waiting_decisions()
        ledger.record_approval(waiting.id, operator="alice", verdict="reject", why="known flaky riser")
        for inc in ledger.incidents(status="open"):
            ledger.update_incident(inc.id, status="resolved")
        rid = ledger.request_reintegration("node02", incident_id=None, trigger="repaired",
                                           operator="alice", why="repaired")
        ledger.update_reintegration(rid.id, state="failed")
        m.observe_round(c.round_figures(later))
        assert get("healthd_controller_approvals_waiting") == 0
        assert get("healthd_controller_approvals_waiting_oldest_age_seconds") == 0
        assert get("healthd_controller_incidents_open", {"tier": "T1", "attribution": "hardware"}) is None
        assert get("healthd_controller_reintegrations", {"state": "failed"}) == 1
    finally:
        c.close()
        ledger.close()


def test_a_restart_does_not_observe_old_incidents_again(tmp_path):
    c, ledger, m = make(tmp_path)
    try:
        c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 - 3),), received_at=T0)
        c.evaluate(T0)
        c.close()
        restarted = ControllerMetrics()
        c2 = Controller(c.settings, ledger, FakeBackend(), metrics=restarted, node_addrs=dict)
        restarted.observe_round(c2.round_figures(T0 + 3600))
        assert restarted.registry.get_sample_value("healthd_controller_incident_latency_seconds_count",
                                                   {"stage": "detection"}) == 0
        c2.close()
    finally:
        ledger.close()


def test_a_full_round_updates_the_fleet_gauges(tmp_path):
    """daemon.py's Controller.evaluate hands the metrics its figures after a full round (not a drain
    request's partial one), so the alerts on round age and approvals see live values."""
    c, ledger, m = make(tmp_path)
    try:
        c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 - 3),), received_at=T0)
        c.evaluate(T0)
        assert m.registry.get_sample_value("healthd_controller_last_round_timestamp_seconds") == T0, \
            "Controller.evaluate does not hand the metrics its round figures"
        assert m.registry.get_sample_value("healthd_controller_approvals_waiting") == 1
        c.evaluate(T0 + 5, only="node02")
        assert m.registry.get_sample_value("healthd_controller_last_round_timestamp_seconds") == T0
    finally:
        c.close()
        ledger.close()
