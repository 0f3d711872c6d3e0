"""prometheus/healthd-alerts.yml: `promtool check rules`, `promtool test rules`, every alert tested
firing and not firing, on-call annotations, and only metric names the real scrapes have."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.observability.conftest import metric_names
from tests.observability.promql import metric_names as promql_names

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus/healthd-alerts.yml"
RULE_TESTS = ROOT / "prometheus/healthd-alerts.test.yml"
NOT_OURS = {"up"}  # Prometheus' own scrape health series


def alerts() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    found = [r for g in doc["groups"] for r in g["rules"] if "alert" in r]
    assert found, f"{RULES} has no alerting rules"  # every check below runs over these
    return found


def test_promtool_check_rules(promtool):
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_test_rules(promtool):
    done = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULES.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_silent_case():
    cases: dict[str, set[bool]] = {}
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for c in t.get("alert_rule_test", []):
            cases.setdefault(c["alertname"], set()).add(bool(c.get("exp_alerts")))
    names = {a["alert"] for a in alerts()}
    assert set(cases) == names
    missing = {n: c for n, c in cases.items() if c != {True, False}}
    assert not missing, f"alerts without both a firing and a not-firing case: {missing}"


def test_alerts_are_written_for_the_on_call_admin():
    for a in alerts():
        assert a["alert"].startswith("Healthd"), a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning"), a["alert"]
        ann = a["annotations"]
        assert ann["summary"].strip() and len(ann["summary"]) < 120, a["alert"]
        assert len(ann["description"]) > 80, a["alert"]  # what it means and what to do


def recordings() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r]


def test_rules_use_only_metrics_the_scrapes_have(agent_scrapes, controller_scrape):
    scraped = metric_names(agent_scrapes["http"]) | metric_names(controller_scrape) | NOT_OURS
    recorded = {r["record"] for r in recordings()}
    have = scraped | recorded
    for r in recordings():
        used = promql_names(r["expr"])
        assert used and used <= have, f"{r['record']}: unknown metric(s) {used - have}"
    for a in alerts():
        used = promql_names(a["expr"])
        assert used, a["alert"]
        assert used <= have, f"{a['alert']}: unknown metric(s) {used - have}"
