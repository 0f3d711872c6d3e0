"""Executor: apply exactly once, recover after a crash between plan and call, refuse on a foreign reason."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.controller.executor import MAX_ATTEMPTS, Executor, JobInfo, idempotency_key
from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger
from tests.support.decisions import NOW, drain_decision
from tests.support.fake_slurm import FakeBackend
from healthd.slurm.backend import SlurmBackend



@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def test_fake_backend_is_a_slurm_backend():
    assert isinstance(FakeBackend(), SlurmBackend)


def backend() -> FakeBackend:
    return FakeBackend(clock=lambda: NOW)


def test_applied_once(ledger):
    be = backend()
    ex = Executor(be, ledger, clock=lambda: NOW)
    d = drain_decision()
    first = ex.apply(GateResult(d, "allowed"), NOW)
    assert first.status == "applied"
    assert be.writes == [("drain", "node02", d.reason)]
    again = ex.apply(GateResult(d, "allowed"), NOW + 5)
    assert again.status == "already-applied"
    assert len(be.writes) == 1
    action = ledger.action_by_key(idempotency_key(d))
    assert action.status == "applied" and action.argv[-1] == f"Reason={d.reason}"
    assert ledger.hold("node02").incident_id is None  # "H1" is not a ledger incident id
    assert ledger.actions_applied_since(NOW - 1) == 1


def test_not_allowed_is_skipped(ledger):
    be = backend()
    assert Executor(be, ledger, clock=lambda: NOW).apply(GateResult(drain_decision(), "refused", "mode", "observe"), NOW).status == "skipped"
    assert be.writes == []


def test_failure_is_recorded_with_slurms_message(ledger):
    be = backend()
    be.fail_next = "Invalid node state specified"
    res = Executor(be, ledger, clock=lambda: NOW).apply(GateResult(drain_decision(), "allowed"), NOW)
    assert res.status == "failed"
    assert ledger.action(res.action_id).status == "failed"
    assert "Invalid node state" in ledger.action(res.action_id).outcome


def test_a_failed_write_is_tried_again_next_round_then_left_to_a_human(ledger):
    be = backend()
    ex = Executor(be, ledger, clock=lambda: NOW)
    d = drain_decision()
    be.fail_next = "Unable to contact slurm controller"
    assert ex.apply(GateResult(d, "allowed"), NOW).status == "failed"
    retry = ex.apply(GateResult(d, "allowed"), NOW + 5)  # the next round: a second attempt, its own row
    assert retry.status == "applied" and be.state["node02"].drain_requested
    assert ledger.action(retry.action_id).idempotency_key == f"{idempotency_key(d)}#try2"
    writes = len(be.writes)
    assert ex.apply(GateResult(d, "allowed"), NOW + 10).status == "already-applied"  # applied: nothing more
    assert len(be.writes) == writes

    other = drain_decision("node03", incident="H2")
    for i in range(MAX_ATTEMPTS):
        be.fail_next = "Invalid node state specified"
        assert ex.apply(GateResult(other, "allowed"), NOW + 20 + i).status == "failed"
    be.fail_next = None
    last = ex.apply(GateResult(other, "allowed"), NOW + 30)
    assert last.status == "skipped" and f"after {MAX_ATTEMPTS} attempts" in last.detail
    assert [a.status for a in ledger.actions(node="node03")] == ["failed"] * MAX_ATTEMPTS
    assert not be.state["node03"].drain_requested


def test_foreign_reason_between_decide_and_write_refused(ledger):
    be = backend()
    be.state["node02"] = dataclasses.replace(be.state["node02"], flags=frozenset({"DRAIN"}),
                                             reason="bad DIMM, ticket 123", reason_user="alice")
    res = Executor(be, ledger, clock=lambda: NOW).apply(GateResult(drain_decision(), "allowed"), NOW)
    assert res.status == "refused" and "alice" in res.detail
    assert be.writes == []
    assert ledger.pending_actions() == [] and ledger.actions() == []


def test_a_write_whose_client_failed_but_landed_is_adopted_never_written_twice(ledger):
    """The client reports failure (a timeout) after slurmctld applied the drain: the next round finds the
    write in Slurm and adopts that attempt, with the reason time Slurm recorded, instead of writing again."""
    be = backend()
    ex = Executor(be, ledger, clock=lambda: NOW)
    d = drain_decision()
    be.fail_next = "Socket timed out on send/recv operation"
    assert ex.apply(GateResult(d, "allowed"), NOW).status == "failed"
    be.drain("node02", d.reason)  # ...but it had landed
    writes = len(be.writes)
    again = ex.apply(GateResult(d, "allowed"), NOW + 5)
    assert again.status == "already-applied" and again.detail.startswith("adopted")
    assert len(be.writes) == writes
    (action,) = ledger.actions(node="node02")
    assert action.status == "applied" and action.slurm_reason_time == be.state["node02"].reason_time
    hold = ledger.hold("node02")
    assert hold.action_id == action.id and hold.reason == d.reason and hold.reason_user == "root"
    assert ex.apply(GateResult(d, "allowed"), NOW + 10).status == "already-applied"


def test_the_write_is_read_back_as_the_proof_of_ownership(ledger):
    be = backend()
    res = Executor(be, ledger, clock=lambda: NOW + 0.5).apply(GateResult(drain_decision(), "allowed"), NOW)
    action = ledger.action(res.action_id)
    assert action.applied_at == NOW + 0.5  # when the write returned, not when the round began
    hold = ledger.hold("node02")
    assert (hold.reason_time, hold.reason_user) == (be.state["node02"].reason_time, "root")


def test_a_node_changed_right_after_the_write_is_not_healthds(ledger):
    be = backend()
    d = drain_decision()

    class Racing(FakeBackend):
        def node(self, name):
            info = super().node(name)
            if self.writes:  # the read-back: an administrator re-drained it in between
                self.set_reason(name, "admin: bad fan", user="alice")
                info = super().node(name)
            return info

    be = Racing(clock=lambda: NOW)
    res = Executor(be, ledger, clock=lambda: NOW).apply(GateResult(d, "allowed"), NOW)
    assert res.status == "applied"
    assert ledger.action(res.action_id).status == "released" and ledger.hold("node02") is None


def test_drain_and_requeue_requeues_each_opted_in_job_once_as_its_own_action(ledger):
    be = backend()
    jobs = [JobInfo("101", True, "healthd:requeue", restarts=0)]
    ex = Executor(be, ledger, clock=lambda: NOW, list_jobs=lambda node: jobs)
    d = drain_decision(kind="drain-and-requeue")
    assert ex.apply(GateResult(d, "allowed"), NOW).status == "applied"
    drain, requeue = ledger.actions(node="node02")
    assert (requeue.kind, requeue.status, requeue.idempotency_key) == ("requeue", "applied",
                                                                       f"{drain.series}:requeue:101")
    assert requeue.evidence["restarts"] == 0
    # the job still runs on the drained node after the requeue was applied: Slurm lost it; requeued again
    assert "requeued 101" in ex.requeue_opted_in(drain, "auto")
    statuses = [(a.kind, a.status, a.attempt) for a in ledger.actions(node="node02")]
    assert statuses == [("drain-and-requeue", "applied", 1), ("requeue", "lost", 1), ("requeue", "applied", 2)]
    assert be.writes.count(("requeue", "101")) == 2
    jobs.clear()  # requeued for good: nothing more
    assert ex.requeue_opted_in(drain, "auto") == "no opted-in job running"
    assert ex.requeue_opted_in(drain, "observe") == "observe mode: no requeue"


def test_drain_and_requeue_requeues_only_opted_in_batch_jobs(ledger):
    be = backend()
    jobs = [JobInfo("101", True, "healthd:requeue"), JobInfo("102", True, "no"), JobInfo("103", False, "healthd:requeue")]
    ex = Executor(be, ledger, clock=lambda: NOW, list_jobs=lambda node: jobs)
    d = drain_decision(kind="drain-and-requeue")
    res = ex.apply(GateResult(d, "allowed"), NOW)
    assert res.status == "applied" and "101" in res.detail
    assert be.writes == [("drain", "node02", d.reason), ("requeue", "101")]


def test_dry_run_prints_and_writes_nothing(ledger):
    be = backend()
    printed: list[str] = []
    res = Executor(be, ledger, clock=lambda: NOW, dry_run=True, out=printed.append).apply(GateResult(drain_decision(), "allowed"), NOW)
    assert res.status == "dry-run"
    assert be.writes == [] and ledger.actions() == []
    assert printed and "State=DRAIN" in printed[0] and "node02" in printed[0]
