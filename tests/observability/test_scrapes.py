"""`promtool check metrics` on real scrapes of the agent (/metrics and textfile) and the controller."""

from __future__ import annotations

import subprocess

import pytest

from tests.observability.conftest import metric_names
from tests.observability.promql import metric_names as promql_names

AGENT_FAMILIES = {
    "healthd_verdict", "healthd_findings", "healthd_collector_success", "healthd_collector_duration_seconds",
    "healthd_last_tick_timestamp_seconds", "healthd_gpus", "healthd_gpu_temperature_celsius", "healthd_gpu_lost",
    "healthd_ib_port_up", "healthd_ib_port_rate_bytes_per_second", "healthd_kernel_lines_total",
    "healthd_kernel_xid_lines_total", "healthd_kernel_malformed_lines_total",
}
CONTROLLER_FAMILIES = {
    "healthd_controller_reports_total", "healthd_controller_actions_total", "healthd_controller_refusals_total",
    "healthd_controller_breaker_open", "healthd_controller_report_latency_seconds_bucket",
    "healthd_controller_last_round_timestamp_seconds", "healthd_controller_nodes_reporting",
    "healthd_controller_nodes_stale", "healthd_controller_approvals_waiting",
    "healthd_controller_approvals_waiting_oldest_age_seconds", "healthd_controller_incidents_open",
    "healthd_controller_reintegrations", "healthd_controller_incident_latency_seconds_bucket",
}


def promtool_check(promtool: str, body: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("which", ["http", "textfile"])
def test_agent_scrape_passes_promtool(promtool, agent_scrapes, which):
    body = agent_scrapes[which]
    done = promtool_check(promtool, body)
    assert done.returncode == 0, f"promtool check metrics ({which}):\n{done.stdout}{done.stderr}"
    names = metric_names(body)
    assert AGENT_FAMILIES <= names, AGENT_FAMILIES - names
    assert 'healthd_findings{attribution="hardware",tier="1"} 1.0' in body
    assert 'healthd_ib_port_rate_bytes_per_second{device="mlx5_0",port="1"} 5e+10' in body


def test_controller_scrape_passes_promtool(promtool, controller_scrape):
    done = promtool_check(promtool, controller_scrape)
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}{done.stderr}"
    names = metric_names(controller_scrape)
    assert CONTROLLER_FAMILIES <= names, CONTROLLER_FAMILIES - names
    body = controller_scrape
    assert 'healthd_controller_reports_total{result="accepted"} 2.0' in body
    assert 'healthd_controller_reports_total{result="403"} 1.0' in body
    assert 'healthd_controller_nodes_reporting{verdict="failed"} 1.0' in body
    assert 'healthd_controller_nodes_reporting{verdict="healthy"} 1.0' in body
    assert 'healthd_controller_incidents_open{attribution="hardware",tier="T1"} 1.0' in body
    assert "healthd_controller_approvals_waiting 1.0" in body
    assert 'healthd_controller_incident_latency_seconds_count{stage="detection"} 1.0' in body
    # no node names in the controller's label values: its series count does not grow with the fleet
    for line in body.splitlines():
        if not line.startswith("#") and "{" in line:
            assert "node0" not in line, line


def test_every_family_has_help_and_type(agent_scrapes, controller_scrape):
    for body in (agent_scrapes["http"], agent_scrapes["textfile"], controller_scrape):
        helps = {ln.split()[2] for ln in body.splitlines() if ln.startswith("# HELP ")}
        types = {ln.split()[2] for ln in body.splitlines() if ln.startswith("# TYPE ")}
        assert helps == types and helps


@pytest.mark.parametrize("expr,names", [
    ('sum by (instance) (healthd_findings{tier="1"}) > 0', {"healthd_findings"}),
    ('time() - healthd_last_tick_timestamp_seconds > 300', {"healthd_last_tick_timestamp_seconds"}),
    ('up{job="node"} == 1 unless on(instance) healthd_gpus', {"up", "healthd_gpus"}),
    ('histogram_quantile(0.95, sum by (le, stage) (rate(x_bucket{a="b"}[1d])))', {"x_bucket"}),
    ('sum by (kind) (increase(a_total[$__rate_interval])) / ignoring(kind) group_left b', {"a_total", "b"}),
    ('healthd_verdict{instance=~"$node"} == 1', {"healthd_verdict"}),
    ('1e3 * foo offset 5m', {"foo"}),
])
def test_promql_name_extraction(expr, names):
    assert promql_names(expr) == names
