"""grafana/healthd-fleet.json: a dashboard Grafana can import, whose every query selects metrics the
real agent and controller scrapes have."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.observability.conftest import metric_names
from tests.observability.promql import metric_names as promql_names

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana/healthd-fleet.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def test_dashboard_shape():
    doc = load()
    assert doc["title"] and doc["uid"] == "healthd-fleet" and isinstance(doc["schemaVersion"], int)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels(doc) if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["title"] and p["targets"], p.get("title")
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t.get("datasource", p["datasource"])["uid"] == "${datasource}", p["title"]


def test_dashboard_covers_the_fleet_view():
    exprs = " ".join(t["expr"] for p in panels(load()) for t in p.get("targets", []))
    for needed in ("healthd_verdict", "healthd_findings", "healthd_controller_actions_total",
                   "healthd_controller_refusals_total", "healthd_controller_breaker_open",
                   "healthd_controller_incident_latency_seconds_bucket",
                   "healthd_controller_report_latency_seconds_bucket"):
        assert needed in exprs, needed


def test_every_query_selects_real_metrics(agent_scrapes, controller_scrape):
    have = metric_names(agent_scrapes["http"]) | metric_names(controller_scrape)
    doc = load()
    queries = [(p["title"], t["expr"]) for p in panels(doc) for t in p.get("targets", [])]
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q.strip())  # label_values(selector, label)
            queries.append((f"variable {v['name']}", m.group(1) if m else q))
    for title, expr in queries:
        used = promql_names(expr)
        assert used, (title, expr)
        assert used <= have, f"{title}: unknown metric(s) {used - have} in {expr}"
