"""healthd.controller.round: the round's steps in order, and the guard that runs them."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from healthd.controller import round as rounds
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.fleetcache import SlurmSnapshot
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings, NodeReport
from tests.observability.test_controller_round_metrics import xid79
from tests.support.fake_slurm import FakeBackend

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
ORDER = ("reconcile", "in-band", "incidents", "decide", "gate", "act", "spares", "reintegrate", "observe")


@pytest.fixture
def made(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  policy=ControllerPolicySettings(mode="auto"))
    backend = FakeBackend(clock=lambda: T0)
    c = Controller(settings, ledger, backend, metrics=ControllerMetrics(), node_addrs=dict, clock=lambda: T0)
    c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 - 3),), received_at=T0)
    try:
        yield c, ledger, backend
    finally:
        c.close()
        ledger.close()


def test_the_steps_run_in_the_documented_order():
    assert tuple(s.name for s in rounds.STEPS) == ORDER
    doc = (REPO / "docs/controller.md").read_text()
    listed = re.findall(r"^\| \d \| `([a-z-]+)` \|", doc, re.M)
    assert tuple(listed) == ORDER, "docs/controller.md's table of the round's steps"


def _state(**kw) -> rounds.RoundState:
    kw.setdefault("policy", ControllerPolicySettings(mode="auto"))
    return rounds.RoundState(now=T0, started=T0, snapshot=SlurmSnapshot(nodes={}, read_at=T0), received={}, **kw)


def _step(name: str, seen: list[str], fails: bool = False, **kw) -> rounds.Step:
    def run(_parts, s):
        seen.append(name)
        if fails:
            raise LedgerError("disk full")
        return dataclasses.replace(s, reconciled=(*s.reconciled, name))  # type: ignore[arg-type]
    return rounds.Step(name, run, **kw)


def test_a_step_that_fails_stops_the_round_there():
    seen: list[str] = []
    steps = (_step("a", seen), _step("b", seen, fails=True), _step("c", seen))
    out = rounds.run(None, _state(), steps)  # type: ignore[arg-type]
    assert seen == ["a", "b"] and out.reconciled == ("a",)
    assert isinstance(out.stopped, LedgerError)


def test_a_step_that_survives_is_logged_and_the_round_goes_on_with_the_state_before_it(caplog):
    seen: list[str] = []
    steps = (_step("a", seen), _step("b", seen, fails=True, survives="b failed"), _step("c", seen))
    with caplog.at_level(logging.ERROR, logger="healthd.controller"):
        out = rounds.run(None, _state(), steps)  # type: ignore[arg-type]
    assert seen == ["a", "b", "c"] and out.reconciled == ("a", "c") and out.stopped is None
    assert "b failed" in caplog.text


def test_steps_for_a_full_round_or_outside_observe_are_left_out_otherwise():
    seen: list[str] = []
    steps = (_step("full", seen, full_only=True), _step("acting", seen, acting_only=True), _step("every", seen))
    rounds.run(None, _state(only="node02"), steps)  # type: ignore[arg-type]
    rounds.run(None, _state(policy=ControllerPolicySettings(mode="observe")), steps)  # type: ignore[arg-type]
    assert seen == ["acting", "every", "full", "every"]


def test_a_ledger_that_cannot_record_stops_the_round_and_nothing_is_applied(made, monkeypatch):
    c, ledger, backend = made

    def broken(*_a, **_kw):
        raise LedgerError("ledger.sqlite: database or disk is full")

    monkeypatch.setattr(ledger, "open_incident", broken)
    with pytest.raises(LedgerError, match="disk is full"):
        c.evaluate(T0)
    assert backend.writes == [] and ledger.decisions() == []
    monkeypatch.undo()
    assert c.evaluate(T0 + 1) is not None
    assert [w[:2] for w in backend.writes] == [("drain", "node02")]


def test_a_reintegration_that_fails_does_not_stop_the_round(made, monkeypatch, caplog):
    c, ledger, backend = made

    def broken(*_a, **_kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(c.reintegrator, "step", broken)
    with caplog.at_level(logging.ERROR, logger="healthd.controller"):
        results = c.evaluate(T0)
    assert results is not None and [w[:2] for w in backend.writes] == [("drain", "node02")]
    assert "reintegration step failed" in caplog.text
    assert c.metrics.registry.get_sample_value("healthd_controller_last_round_timestamp_seconds") == T0


def test_slurm_unreachable_skips_the_round(made):
    c, ledger, backend = made
    backend.unavailable = True
    assert c.evaluate(T0) is None
    assert backend.writes == [] and ledger.decisions() == [] and ledger.incidents() == []


def test_the_round_for_a_drain_request_decides_for_its_node_alone(made):
    c, ledger, backend = made
    c.policy = dataclasses.replace(c.policy, breaker_percent=60.0)  # two of four failing: not a shared cause
    c.reports["node03"] = NodeReport(node="node03", verdict="failed", findings=(xid79(T0 - 3),), received_at=T0)
    results = c.evaluate(T0, only="node03", jobs={"node03": "77"})
    assert [o.decision.node for o, _ in results] == ["node03"]
    assert [w[:2] for w in backend.writes] == [("drain", "node03")]
    [inc] = [i for i in ledger.incidents() if i.nodes == ("node03",)]
    assert inc.jobs == ("77",)
