"""Replay (healthd.sim.replay): a record made by the real controller — MUNGE-signed reports over HTTP,
its rounds in observe mode, its history and ledger — run again under auto mode and under a changed
threshold; the differences name the node, the gate and the evidence, and replaying under the
configuration that made the record changes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from healthd.controller.history import History
from healthd.controller.ledger import Ledger
from healthd.sim.replay import ReplayError, changes_by_hand, replay
from tests.controller.schema_support import iso
from tests.controller.test_daemon import rig_factory as rig_factory  # noqa: F401 (a fixture)
from tests.controller.test_daemon import state_doc


def user_xid(now: float) -> dict:
    """A user's program fault (Xid 13, graphics engine exception): user code, tier 3, no action."""
    return {"id": "xid:gpu1:13", "component": {"kind": "gpu", "index": 1}, "source": "kernel_log", "xid": 13,
            "attribution": "user", "tier": 3, "action": "none", "summary": "xid 13 gpu1: graphics engine exception",
            "evidence": [{"kind": "log_line", "text": "NVRM: Xid (PCI:0000:3c:00): 13, Graphics Exception"}],
            "first_seen": iso(now), "last_seen": iso(now)}


@pytest.fixture
def record(rig_factory, tmp_path):  # noqa: F811
    """The real controller in observe mode: node02 and node03 report a GPU off the bus (Xid 79), node04 a
    user's Xid 13, and an administrator drains node01 by hand between rounds."""
    rig = rig_factory("observe")
    t0 = time.time()
    assert rig.report("node04", state_doc("node04", t0, [user_xid(t0)]))[0] == 200
    rig.controller.evaluate(t0)
    assert rig.report("node02")[0] == 200
    assert rig.report("node03")[0] == 200
    rig.controller.evaluate(t0 + 1)
    rig.backend.drain("node01", "bad fan, ticket 4711")
    rig.controller.fleet.refresh()
    rig.controller.evaluate(t0 + 2)
    rig.controller.evaluate(t0 + 3)
    assert rig.backend.writes[-1][:2] == ("drain", "node01")  # the administrator's, not healthd's
    settings = rig.controller.settings
    ledger_path = rig.ledger.path
    history_path = rig.controller.history.path
    rig.close()
    return settings, History(history_path, readonly=True), Ledger.open_readonly(ledger_path)


def _policy(settings, **changes):
    return dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, **changes))


def test_under_the_recorded_configuration_nothing_differs(record):
    settings, history, ledger = record
    result = replay(history, settings, recorded=ledger)
    assert result.differences == ()
    assert result.candidate == {"refused by mode": 2} and result.recorded.get("refused by mode") == 2


def test_under_auto_the_breaker_holds_both_drains_back(record):
    """Two of the four nodes failing within the breaker's window: auto mode would have opened the
    breaker and drained neither (the record: both refused by observe mode)."""
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto"), recorded=ledger)
    by_node = {d.node: d for d in result.differences}
    assert set(by_node) == {"node02", "node03"}, result.differences
    for d in by_node.values():
        assert d.candidate == "refused by breaker" and d.gate == "breaker"
        assert d.recorded == "healthd decided it: refused by mode"
        assert any("79" in e for e in d.evidence)


def test_under_auto_with_a_higher_breaker_threshold_the_two_gpus_off_the_bus_are_drained(record):
    """A changed threshold (the breaker opens at 3 nodes): both Xid 79 nodes drained, the user's Xid 13
    never, and node01, drained by hand, stays the administrator's."""
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3), recorded=ledger)
    by_node = {d.node: d for d in result.differences}
    assert set(by_node) == {"node02", "node03"}, result.differences
    for d in by_node.values():
        assert d.kind.startswith("drain") and d.candidate == "applied", d
        assert d.recorded == "healthd decided it: refused by mode"
    assert [(r.node, r.kind) for r in changes_by_hand(history.slurm_nodes())] == [("node01", "drain-by-hand")]


def test_under_a_tighter_rate_limit_one_drain_is_refused_by_it(record):
    settings, history, ledger = record
    result = replay(history, _policy(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3,
                                     max_actions_per_hour=1), recorded=ledger)
    outcomes = sorted((d.candidate, d.gate) for d in result.differences)
    assert [o[0] for o in outcomes][0] == "applied" and outcomes[1][0].startswith("refused by rate"), outcomes


def test_an_empty_window_is_a_clear_error(record):
    settings, history, ledger = record
    with pytest.raises(ReplayError, match="nothing kept between"):
        replay(history, settings, recorded=ledger, start=0, end=1)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "healthd.sim.replay", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_command_replays_under_a_mode_and_a_setting_given_on_its_line(record):
    _, history, ledger = record
    args = ["--history", str(history.path), "--ledger", str(ledger.path), "--mode", "auto"]
    out = _cli(*args, "--set", "policy.breaker_min_nodes=3", "--set", "policy.breaker_nodes=3", "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mode"] == "auto" and {(d["node"], d["candidate"]) for d in doc["differences"]} == {
        ("node02", "applied"), ("node03", "applied")}
    text = _cli(*args)
    assert text.returncode == 0 and "refused by breaker" in text.stdout and "note: measured" in text.stdout


def test_the_command_says_what_is_wrong_with_a_bad_setting_or_file(record, tmp_path):
    _, history, _ = record
    bad = _cli("--history", str(history.path), "--set", "policy.breaker_min_nodes=lots")
    assert bad.returncode == 2 and "policy.breaker_min_nodes" in bad.stderr and "Traceback" not in bad.stderr
    missing = _cli("--history", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 2 and "no history there" in missing.stderr


def test_healthctl_what_if_replays_the_live_controllers_record(record):
    _, history, ledger = record
    out = subprocess.run([sys.executable, "-m", "healthd.controller.healthctl", "--ledger", str(ledger.path), "--json",
                          "what-if", "--since", "1d", "--set", "policy.breaker_min_nodes=3",
                          "--set", "policy.breaker_nodes=3"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HEALTHCTL_CONFIG": ""})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mode"] == "auto" and {d["node"] for d in doc["differences"]} == {"node02", "node03"}
