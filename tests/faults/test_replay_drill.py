"""Replay of a record the real fleet made (tests/faults/world.py: Slurm, an agent per node, the
healthd-controller process) in observe mode: a GPU off the bus on two nodes, a user's Xid on a third,
an administrator's drain on the fourth. Replayed from the controller's own history and ledger under
auto mode (the breaker holds the second drain back: two of four nodes), under a changed threshold (the
breaker opens at three: both drained) and under the recorded configuration (nothing differs); with
jobs' goodput logs in the controller's gathered directory, each earlier drain measured in them."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import pytest

from healthd.controller.config import load_controller_settings
from healthd.controller.history import History
from healthd.controller.ledger import Ledger
from healthd.sim.replay import changes_by_hand, read_job_logs, replay
from tests.controller.test_replay import job_log
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

    # the drill runs no training job: a job per failing node, written in the documented format into the
    # controller's gathered goodput logs (node02's hung since before the record began, node03's
    # training) and measured there: the whole window of each earlier drain, lost on node02 and
    # productive on node03, 8 GPUs each
    begin, finish = history.span()
    directory = settings.goodput.at(str(ledger.path)).directory
    jobs = {"990002": ("node02", begin - 100), "990003": ("node03", None)}
    try:
        for job, (node, hung) in jobs.items():
            os.makedirs(os.path.join(directory, job))
            with open(os.path.join(directory, job, f"{node}.jsonl"), "w") as f:
                f.write(job_log(job, node, begin - 600, finish + 600, hung_at=hung))
        logs = read_job_logs(directory, ledger=str(ledger.path))
        measured = replay(history, _with(settings, mode="auto", breaker_min_nodes=3, breaker_nodes=3),
                          recorded=ledger, jobs=logs)
    finally:
        for job in jobs:
            shutil.rmtree(os.path.join(directory, job), ignore_errors=True)
    assert {r.job for r in logs.records} >= set(jobs)
    for d in measured.differences:
        job, (_, hung) = next((j, v) for j, v in jobs.items() if v[0] == d.node)
        assert d.jobs is not None and d.jobs.jobs == (job,) and d.jobs.window is not None, d
        a, b = d.jobs.window
        assert a == d.candidate_at and b == finish  # never drained in the record: to the replay's end
        held = (b - a) * 8 / 3600
        assert d.jobs.gpu_h == {("lost" if hung else "productive"): pytest.approx(held, abs=1e-5)}, d.jobs
        assert (d.jobs.productive_gpu_h, d.jobs.unproductive_gpu_h) == pytest.approx(
            (0.0, held) if hung else (held, 0.0), abs=1e-5)


def decided_outcomes(ledger: Ledger) -> dict[str, tuple[str, str | None]]:
    return {d.node: (d.outcome, d.refused_gate) for d in ledger.decisions() if d.kind != "none"}
