"""Executor: apply exactly once, recover after a crash between plan and call, refuse on a foreign reason."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.controller.executor import MAX_ATTEMPTS, Executor, JobInfo, idempotency_key
from healthd.controller.gates import Outcome
from healthd.controller.ledger import Ledger
from healthd.controller.policy import Decision, make_reason
from tests.support.fake_slurm import FakeBackend
from healthd.slurm.backend import SlurmBackend

NOW = 1_800_000_000.0


def drain_decision(node: str = "node02", kind: str = "drain", incident: str = "H1") -> Decision:
    return Decision(id=f"{kind}:{node}:xid:gpu0:79", kind=kind, node=node,  # type: ignore[arg-type]
                    reason=make_reason("xid 79 gpu0: fell off the bus", incident), tier=1,
                    attribution="hardware", finding_ids=("xid:gpu0:79",), incident=incident, decided_at=NOW)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def test_fake_backend_is_a_slurm_backend():
    assert isinstance(FakeBackend(), SlurmBackend)


def test_applied_once(ledger):
    be = FakeBackend()
    ex = Executor(be, ledger)
    d = drain_decision()
    first = ex.apply(Outcome(d, "allowed"), NOW)
    assert first.status == "applied"
    assert be.writes == [("drain", "node02", d.reason)]
    again = ex.apply(Outcome(d, "allowed"), NOW + 5)
    assert again.status in ("refused", "already-applied")
    assert len(be.writes) == 1
    action = ledger.action_by_key(idempotency_key(d))
    assert action.status == "applied" and action.argv[-1] == f"Reason={d.reason}"
    assert ledger.healthd_drains() == {"node02": None}  # "H1" is not a ledger incident id
    assert ledger.actions_applied_since(NOW - 1) == 1


def test_not_allowed_is_skipped(ledger):
    be = FakeBackend()
    assert Executor(be, ledger).apply(Outcome(drain_decision(), "refused", "mode", "observe"), NOW).status == "skipped"
    assert be.writes == []


def test_failure_is_recorded_with_slurms_message(ledger):
    be = FakeBackend()
    be.fail_next = "Invalid node state specified"
    res = Executor(be, ledger).apply(Outcome(drain_decision(), "allowed"), NOW)
    assert res.status == "failed"
    assert ledger.action(res.action_id).status == "failed"
    assert "Invalid node state" in ledger.action(res.action_id).outcome


def test_a_failed_write_is_tried_again_next_round_then_left_to_a_human(ledger):
    be = FakeBackend()
    ex = Executor(be, ledger)
    d = drain_decision()
    be.fail_next = "Unable to contact slurm controller"
    assert ex.apply(Outcome(d, "allowed"), NOW).status == "failed"
    retry = ex.apply(Outcome(d, "allowed"), NOW + 5)  # the next round: a second attempt, its own row
    assert retry.status == "applied" and be.state["node02"].drain_requested
    assert ledger.action(retry.action_id).idempotency_key == f"{idempotency_key(d)}#try2"
    writes = len(be.writes)
    assert ex.apply(Outcome(d, "allowed"), NOW + 10).status in ("refused", "skipped")  # applied: nothing more
    assert len(be.writes) == writes

    other = drain_decision("node03", incident="H2")
    for i in range(MAX_ATTEMPTS):
        be.fail_next = "Invalid node state specified"
        assert ex.apply(Outcome(other, "allowed"), NOW + 20 + i).status == "failed"
    be.fail_next = None
    last = ex.apply(Outcome(other, "allowed"), NOW + 30)
    assert last.status == "skipped" and f"after {MAX_ATTEMPTS} attempts" in last.detail
    assert [a.status for a in ledger.actions(node="node03")] == ["failed"] * MAX_ATTEMPTS
    assert not be.state["node03"].drain_requested


def test_foreign_reason_between_decide_and_write_refused(ledger):
    be = FakeBackend()
    be.state["node02"] = dataclasses.replace(be.state["node02"], flags=frozenset({"DRAIN"}),
                                             reason="bad DIMM, ticket 123", reason_user="alice")
    res = Executor(be, ledger).apply(Outcome(drain_decision(), "allowed"), NOW)
    assert res.status == "refused" and "alice" in res.detail
    assert be.writes == []
    assert ledger.pending_actions() == [] and ledger.actions() == []


def crash_after_plan(ledger, be, d, at: float = NOW):
    """A decision recorded and its action planned, then nothing: what a SIGKILL before the Slurm call leaves."""
    ex = Executor(be, ledger)
    row = ledger.record_decision(node=d.node, kind=d.kind, tier="T1", mode="auto", reason=d.reason, outcome="allowed",
                                 at=at)
    ledger.plan_action(decision_id=row.id, idempotency_key=idempotency_key(d), node=d.node, kind=d.kind,
                       argv=ex.argv_for(d), at=at)
    return row


def test_recover_applies_exactly_once(ledger):
    be = FakeBackend()
    d = drain_decision()
    crash_after_plan(ledger, be, d)
    ex = Executor(be, ledger)
    results = ex.recover(NOW + 10)
    assert [r.status for r in results] == ["applied"]
    assert be.writes == [("drain", "node02", d.reason)]
    assert ex.recover(NOW + 20) == []  # nothing pending any more
    assert ex.apply(Outcome(d, "allowed"), NOW + 30).status in ("refused", "already-applied")
    assert len(be.writes) == 1


def test_recover_marks_applied_when_slurm_shows_it(ledger):
    be = FakeBackend()
    d = drain_decision()
    crash_after_plan(ledger, be, d)
    be.drain("node02", d.reason)  # the write landed, the crash came before mark_applied
    be.writes.clear()
    results = Executor(be, ledger).recover(NOW + 10)
    assert [r.status for r in results] == ["already-applied"]
    assert be.writes == []
    assert ledger.action_by_key(idempotency_key(d)).status == "applied"


def test_recover_refuses_a_foreign_reason(ledger):
    be = FakeBackend()
    d = drain_decision()
    crash_after_plan(ledger, be, d)
    be.state["node02"] = dataclasses.replace(be.state["node02"], flags=frozenset({"DRAIN"}), reason="maintenance",
                                             reason_user="bob")
    results = Executor(be, ledger).recover(NOW + 10)
    assert [r.status for r in results] == ["refused"]
    assert be.writes == []
    assert ledger.action_by_key(idempotency_key(d)).status == "failed"


def test_drain_and_requeue_requeues_only_opted_in_batch_jobs(ledger):
    be = FakeBackend()
    jobs = [JobInfo("101", True, "healthd:requeue"), JobInfo("102", True, "no"), JobInfo("103", False, "healthd:requeue")]
    ex = Executor(be, ledger, list_jobs=lambda node: jobs)
    d = drain_decision(kind="drain-and-requeue")
    res = ex.apply(Outcome(d, "allowed"), NOW)
    assert res.status == "applied" and "101" in res.detail
    assert be.writes == [("drain", "node02", d.reason), ("requeue", "101")]


def test_dry_run_prints_and_writes_nothing(ledger):
    be = FakeBackend()
    printed: list[str] = []
    res = Executor(be, ledger, dry_run=True, out=printed.append).apply(Outcome(drain_decision(), "allowed"), NOW)
    assert res.status == "dry-run"
    assert be.writes == [] and ledger.actions() == []
    assert printed and "State=DRAIN" in printed[0] and "node02" in printed[0]


def test_recover_refuses_while_the_breaker_is_open(ledger):
    be = FakeBackend()
    d = drain_decision()
    crash_after_plan(ledger, be, d)
    ledger.open_breaker("switch:leaf1", nodes=["node01", "node02", "node03"], at=NOW + 1)
    results = Executor(be, ledger).recover(NOW + 10)
    assert [r.status for r in results] == ["refused"] and "breaker" in results[0].detail
    assert be.writes == []


def test_recover_refuses_a_decision_older_than_a_breaker_reset(ledger):
    be = FakeBackend()
    d = drain_decision()
    crash_after_plan(ledger, be, d)
    ledger.open_breaker("unknown", at=NOW + 1)
    ledger.reset_breaker(by="alice", why="switch replaced", at=NOW + 2)
    results = Executor(be, ledger).recover(NOW + 10)
    assert [r.status for r in results] == ["refused"] and "stale" in results[0].detail
    assert be.writes == []
