"""Replay of a record the real fleet made (tests/faults/world.py: Slurm, an agent per node, the
healthd-controller process) in observe mode: a GPU off the bus on two nodes, a user's Xid on a third,
an administrator's drain on the fourth. Replayed from the controller's own history and ledger under
auto mode (the breaker holds the second drain back: two of four nodes), under a changed threshold (the
breaker opens at three: both drained) and under the recorded configuration (nothing differs)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from healthd.controller.config import load_controller_settings
from healthd.controller.history import History
from healthd.controller.ledger import Ledger
from healthd.sim.replay import changes_by_hand, replay
from tests.faults.world import SUITE_POLICY

OBSERVE = dict(SUITE_POLICY, mode="observe", breaker_nodes=10, breaker_min_nodes=2, breaker_percent=10.0)


def decided(w, node: str) -> list[tuple[str, str | None]]:
    return w.rows("SELECT outcome, refused_gate FROM decisions WHERE node = ? AND kind != 'none' ORDER BY id",
                  (node,))


@pytest.fixture
def drill(w):
    """The record: the controller in observe mode through the drill's faults, stopped cleanly."""
    w.policy = dict(OBSERVE)
    w.stop_controller(fresh_ledger=True)  # a record of this drill alone
    started = time.time()
    w.start_controller()
    w.wait_reported(w.nodes, timeout_s=60)
    w.checker.foreign_drain("node01", "bad fan, ticket 4711")
    w.inject_xid("node04", 13, gpu=1)
    w.inject_xid("node02", 79)
    w.inject_xid("node03", 79, gpu=2)
    for node in ("node02", "node03"):
        w.wait(lambda n=node: decided(w, n), 30, f"a decision for {node}", node)
    w.wait_rounds(3)
    settings = load_controller_settings(str(w.controller_config))
    w.stop_controller()  # a clean stop: the history's open rows are written
    history = History(w.ledger.parent / "history.sqlite", readonly=True)
    ledger = Ledger.open_readonly(w.ledger)
    assert history.span() is not None and history.span()[0] >= started
    yield settings, history, ledger
    history.close()
    ledger.close()


def _with(settings, **policy):
    return dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, **policy))


def test_the_drill_replayed_under_auto_and_under_a_changed_threshold(drill):
    settings, history, ledger = drill
    assert decided_outcomes(ledger) == {"node02": ("refused", "mode"), "node03": ("refused", "mode")}
    assert [(r.node, r.kind) for r in changes_by_hand(history.slurm_nodes())] == [("node01", "drain-by-hand")]

    same = replay(history, settings, recorded=ledger)
    assert same.differences == (), same.differences

    # under auto the breaker opens at the second failing node of four: a node whose report reached an
    # earlier round than the other's is drained, the other is refused by the breaker (reports that
    # reached the same round: both refused)
    auto = replay(history, _with(settings, mode="auto"), recorded=ledger)
    outcomes = {d.node: (d.candidate, d.gate) for d in auto.differences}
    assert set(outcomes) == {"node02", "node03"}, auto.differences
    assert ("refused by breaker", "breaker") in outcomes.values(), auto.differences
    assert all(o in {("refused by breaker", "breaker"), ("applied", None)} for o in outcomes.values()), outcomes

    looser = replay(history, _with(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3), recorded=ledger)
    assert {(d.node, d.candidate) for d in looser.differences} == {("node02", "applied"), ("node03", "applied")}, \
        looser.differences
    for d in looser.differences:
        assert d.kind.startswith("drain") and d.recorded == "healthd decided it: refused by mode"
        assert any("79" in e for e in d.evidence)


def decided_outcomes(ledger: Ledger) -> dict[str, tuple[str, str | None]]:
    return {d.node: (d.outcome, d.refused_gate) for d in ledger.decisions() if d.kind != "none"}
