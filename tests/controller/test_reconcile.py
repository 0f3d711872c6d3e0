"""The reconciler on an in-memory Slurm: every way the ledger and Slurm can disagree, and how it converges.

The real cluster versions of these (slurmctld stopped mid-write, killed and restored from an older state
save, an administrator re-draining with healthd's own text) are in tests/controller/test_faults.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from healthd.controller.executor import Executor, JobInfo, idempotency_key
from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger
from healthd.controller.ownership import Hold
from healthd.controller.policy import Decision, make_reason
from healthd.controller.reconcile import Reconciler, judge_gone
from healthd.slurm.backend import NodeInfo
from tests.support.decisions import crash_after_plan
from tests.support.fake_slurm import FakeBackend

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rig(tmp_path):
    clock = Clock()
    be = FakeBackend(clock=clock)
    be.started_at = NOW - 3600
    jobs: list[JobInfo] = []
    with Ledger(tmp_path / "ledger.sqlite") as led:
        ex = Executor(be, led, clock=clock, list_jobs=lambda node: list(jobs))
        yield dataclasses.replace(_Rig(), be=be, led=led, ex=ex, rec=Reconciler(ex), clock=clock,
                                  jobs=jobs)


@dataclasses.dataclass
class _Rig:
    be: FakeBackend = None  # type: ignore[assignment]
    led: Ledger = None  # type: ignore[assignment]
    ex: Executor = None  # type: ignore[assignment]
    rec: Reconciler = None  # type: ignore[assignment]
    clock: Clock = None  # type: ignore[assignment]
    jobs: list = None  # type: ignore[assignment]

    def incident(self, node: str = "node02") -> int:
        return self.led.open_incident("xid:gpu0:79", attribution="hardware", tier="T1", nodes=[node], at=NOW).id

    def decision(self, node: str = "node02", kind: str = "drain", incident: int | None = None) -> Decision:
        inc = str(incident if incident is not None else self.incident(node))
        return Decision(id=f"{kind}:{node}:xid:gpu0:79", kind=kind, node=node,  # type: ignore[arg-type]
                        reason=make_reason("xid 79 gpu0: fell off the bus", inc), tier=1, attribution="hardware",
                        finding_ids=("xid:gpu0:79",), incident=inc, decided_at=self.clock())

    def apply(self, d: Decision):
        return self.ex.apply(GateResult(d, "allowed"), self.clock(), mode="auto")

    def round(self, mode: str = "auto"):
        return self.rec.round({n: i for n, i in self.be.state.items()}, self.clock(), mode)


def whats(changes) -> list[tuple[str, str]]:
    return [(c.node, c.what) for c in changes]


# ------------------------------------------------------------------------------------ planned at a crash


def test_a_plan_slurm_shows_is_adopted_and_one_it_does_not_is_abandoned_then_redecided(rig):
    landed, never = rig.decision("node02"), rig.decision("node03")
    crash_after_plan(rig.led, rig.be, landed, at=NOW)
    crash_after_plan(rig.led, rig.be, never, at=NOW)
    rig.be.drain("node02", landed.reason)  # the write landed, the crash came before it was recorded
    rig.be.writes.clear()
    rig.clock.t += 30
    assert sorted(whats(rig.rec.at_start(rig.clock(), "auto"))) == [("node02", "adopted"), ("node03", "abandoned")]
    assert rig.be.writes == []  # nothing written at start: an old plan is never applied blindly
    assert rig.led.action_by_key(idempotency_key(landed)).status == "applied"
    assert rig.led.hold("node02").reason_time == rig.be.state["node02"].reason_time
    abandoned = rig.led.action_by_key(idempotency_key(never))
    assert abandoned.status == "abandoned" and "re-decides" in abandoned.outcome
    assert rig.led.hold("node03") is None
    # the next round re-decides the same fault: a new attempt under the same incident, once
    result = rig.apply(dataclasses.replace(never, decided_at=rig.clock()))
    assert result.status == "applied"
    assert [(a.attempt, a.status) for a in rig.led.series(idempotency_key(never))] == [(1, "abandoned"), (2, "applied")]
    assert rig.be.writes == [("drain", "node03", never.reason)]
    assert rig.rec.at_start(rig.clock(), "auto") == []


def test_an_abandoned_plan_whose_client_outlived_the_controller_is_adopted_when_it_lands(rig):
    d = rig.decision()
    crash_after_plan(rig.led, rig.be, d, at=NOW)
    rig.rec.at_start(NOW + 1, "auto")
    rig.clock.t += 5
    rig.be.drain("node02", d.reason)  # the orphaned scontrol finally got through
    assert whats(rig.round()) == [("node02", "adopted")]
    assert rig.led.action_by_key(idempotency_key(d)).status == "applied"
    assert rig.apply(d).status == "already-applied"
    assert len(rig.be.writes) == 1


# ------------------------------------------------------------------------------------ failed, but landed


def test_a_write_reported_failed_that_lands_later_is_adopted_by_the_round(rig):
    d = rig.decision()
    rig.be.fail_next = "Socket timed out on send/recv operation"
    assert rig.apply(d).status == "failed"
    assert rig.round() == []  # not in Slurm (yet): nothing to adopt
    rig.clock.t += 20
    rig.be.drain("node02", d.reason)  # the request queued in a stopped slurmctld is processed now
    assert whats(rig.round()) == [("node02", "adopted")]
    (action,) = rig.led.actions(node="node02")
    assert action.status == "applied" and action.applied_at == rig.be.state["node02"].reason_time
    assert rig.led.incident(int(d.incident)).action_applied_at == action.applied_at


# ------------------------------------------------------------------------------------ holds


def test_an_unconfirmed_hold_is_confirmed_from_slurm(rig):
    d = rig.decision()

    class Blind(FakeBackend):
        reads_fail = False

        def node(self, name):
            if self.reads_fail:
                from healthd.slurm.backend import SlurmUnavailable

                raise SlurmUnavailable("slurmctld down")
            return super().node(name)

    rig.be.__class__ = Blind
    real_drain = rig.be.drain

    def drain_then_blind(nodes, reason):
        real_drain(nodes, reason)
        rig.be.reads_fail = True  # slurmctld went away right after the write

    rig.be.drain = drain_then_blind  # type: ignore[method-assign]
    assert rig.apply(d).status == "applied"
    assert not rig.led.hold("node02").confirmed
    rig.be.reads_fail = False
    assert whats(rig.round()) == [("node02", "confirmed")]
    hold = rig.led.hold("node02")
    assert (hold.reason_time, hold.reason_user) == (rig.be.state["node02"].reason_time, "root")


def test_an_administrator_redraining_with_healthds_own_text_takes_the_node_over(rig):
    d = rig.decision()
    rig.apply(d)
    rig.clock.t += 5
    rig.be.set_reason("node02", d.reason, user="root")  # same text, same user, a later reason time
    assert whats(rig.round()) == [("node02", "released")]
    action = rig.led.actions(node="node02")[0]
    assert action.status == "released" and "by root" in action.outcome
    assert rig.led.hold("node02") is None
    incident = rig.led.incident(int(d.incident))
    assert incident.status == "handed-over"
    (clear,) = rig.led.clears(node="node02")
    assert (clear.finding_id, clear.scope) == ("xid:gpu0:79", "episode")
    # healthd never writes over it, never resumes it
    again = rig.apply(d)
    assert again.status == "skipped" and "released" in again.detail
    assert rig.be.state["node02"].reason_time == rig.clock.t


def test_a_foreign_reason_over_healthds_drain_is_released(rig):
    rig.apply(rig.decision())
    rig.be.set_reason("node02", "admin: replacing gpu0", user="alice")
    assert whats(rig.round()) == [("node02", "released")]
    assert "alice" in rig.led.actions(node="node02")[0].outcome


def test_a_drain_slurm_lost_is_marked_lost_and_reapplied_through_the_gates_once(rig):
    d = rig.decision()
    rig.apply(d)
    rig.round()
    rig.clock.t += 10
    # slurmctld killed right after the drain, restarted from an older state save: the drain is gone
    rig.be.state["node02"] = NodeInfo(name="node02", state="idle", partitions=("gpu",))
    rig.be.started_at = rig.clock.t
    rig.clock.t += 2
    assert whats(rig.round()) == [("node02", "lost")]
    assert rig.led.actions(node="node02")[0].status == "lost" and rig.led.hold("node02") is None
    assert rig.led.actions_applied_since(0) == 0  # a lost write gives its slot to its re-application
    assert rig.led.incident(int(d.incident)).status == "open"
    result = rig.apply(dataclasses.replace(d, decided_at=rig.clock()))
    assert result.status == "applied"
    assert [(a.attempt, a.status) for a in rig.led.series(idempotency_key(d))] == [(1, "lost"), (2, "applied")]
    assert rig.led.actions_applied_since(0) == 1
    assert rig.be.state["node02"].drain_requested and rig.round() == []


def test_a_drain_last_seen_in_a_view_read_before_slurmctld_restarted_is_lost_not_released(rig):
    """The fleet view is read off the round: a round after slurmctld came back from an older state
    save may still act on a view read before the kill. The hold was seen then, not at the round."""
    rig.apply(rig.decision())
    rig.round()
    read_before_the_kill = dict(rig.be.state)
    read_at = rig.clock.t
    rig.clock.t += 10
    rig.be.state["node02"] = NodeInfo(name="node02", state="idle", partitions=("gpu",))
    rig.be.started_at = rig.clock.t
    rig.clock.t += 2
    assert rig.rec.round(read_before_the_kill, rig.clock(), "auto", read_at=read_at) == []
    rig.clock.t += 3
    assert whats(rig.rec.round(dict(rig.be.state), rig.clock(), "auto", read_at=rig.clock.t)) == [("node02", "lost")]


def test_the_ledger_records_when_the_view_showing_a_hold_was_read_not_when_the_round_ran(rig):
    """slurmctld killed and restored just after the view was read, the round a few seconds later:
    the ledger's verification time is the read's, so the drain is still found lost after it."""
    rec = Reconciler(rig.ex, verify_every_s=0)
    rig.apply(rig.decision())
    rec.round(dict(rig.be.state), rig.clock(), "auto")
    read_at = rig.clock.t + 1
    read_before_the_kill = dict(rig.be.state)
    rig.be.state["node02"] = NodeInfo(name="node02", state="unknown", partitions=("gpu",))
    rig.be.started_at = read_at + 0.5
    rig.clock.t = read_at + 4
    assert rec.round(read_before_the_kill, rig.clock(), "auto", read_at=read_at) == []
    assert rig.led.hold("node02").verified_at == read_at
    rig.clock.t += 1
    assert whats(rec.round(dict(rig.be.state), rig.clock(), "auto", read_at=rig.clock.t)) == [("node02", "lost")]


def test_a_flush_writes_only_the_verification_times_that_moved(rig):
    """Rounds reading the same view write nothing after the first flush; a later view is written once;
    a hold that ended is forgotten (a later hold on the node starts from its own times)."""
    rec = Reconciler(rig.ex, verify_every_s=0)
    rig.apply(rig.decision())
    statements: list[str] = []
    rig.led._conn.set_trace_callback(statements.append)
    read_at = rig.clock.t + 1
    view = dict(rig.be.state)

    def holds_updates(t: float) -> int:
        statements.clear()
        rig.clock.t = t
        rec.round(view, t, "auto", read_at=read_at)
        return sum(s.startswith("UPDATE holds SET verified_at") for s in statements)

    assert holds_updates(read_at + 5) == 1
    assert rig.led.hold("node02").verified_at == read_at
    assert holds_updates(read_at + 70) == 0 and holds_updates(read_at + 140) == 0
    read_at += 200
    assert holds_updates(read_at + 5) == 1
    assert rig.led.hold("node02").verified_at == read_at
    rig.led.mark_ended(rig.led.hold("node02").action_id, "released", "resumed by hand", at=read_at + 6)
    assert holds_updates(read_at + 10) == 0
    assert "node02" not in rec._seen


def test_an_administrator_resuming_a_healthd_drain_is_a_release_not_a_loss(rig):
    d = rig.decision()
    rig.apply(d)
    rig.round()
    rig.clock.t += 10
    rig.be.resume("node02")  # slurmctld did not restart: a person resumed it
    assert whats(rig.round()) == [("node02", "released")]
    writes = len(rig.be.writes)
    again = rig.apply(d)  # the same fault's decision again: the person's resume stands
    assert again.status == "skipped" and "released" in again.detail and len(rig.be.writes) == writes


def test_a_requested_reboot_that_happened_is_completed_and_its_incident_resolved(rig):
    d = rig.decision(kind="reboot-asap")
    rig.apply(d)
    rig.clock.t += 300
    # the node rebooted (nextstate=RESUME): no reason, no flags, a boot time after the request
    rig.be.state["node02"] = NodeInfo(name="node02", state="idle", partitions=("gpu",), boot_time=rig.clock.t - 60)
    assert whats(rig.round()) == [("node02", "completed")]
    incident = rig.led.incident(int(d.incident))
    assert incident.status == "resolved" and incident.back_in_service_at == rig.clock.t
    assert [c.scope for c in rig.led.clears(node="node02")] == ["evidence"]


def test_a_late_landing_of_healthds_own_failed_attempt_is_not_a_takeover(rig):
    d = rig.decision()
    rig.be.fail_next = "Socket timed out on send/recv operation"
    rig.apply(d)  # attempt 1 fails (but is queued in slurmctld)
    rig.clock.t += 5
    rig.apply(d)  # attempt 2 applied
    rig.clock.t += 5
    rig.be.drain("node02", d.reason)  # attempt 1 lands now: same text, later reason time
    assert whats(rig.round()) == [("node02", "confirmed")]
    assert rig.led.hold("node02").reason_time == rig.be.state["node02"].reason_time


def test_the_requeue_of_a_drain_and_requeue_is_finished_when_a_crash_cut_it_off(rig):
    d = rig.decision(kind="drain-and-requeue")
    rig.jobs.append(JobInfo("77", True, "healthd:requeue"))
    # the drain applied (and the hold recorded), then the controller died before the requeue
    rig.ex.requeue_opt_in = ""
    rig.apply(d)
    rig.ex.requeue_opt_in = "healthd:requeue"
    rig.be.state["node02"] = dataclasses.replace(rig.be.state["node02"], state="allocated")
    assert rig.round(mode="observe") == []  # observe mode never acts
    changes = rig.round()
    assert whats(changes) == [("node02", "requeue")]
    assert ("requeue", "77") in rig.be.writes
    rig.jobs.clear()
    assert rig.round() == []


# ------------------------------------------------------------------------------------ the pure judgement


@pytest.mark.parametrize(("info", "kind", "ctld", "want"), [
    (NodeInfo("n", "idle", reason="admin", reason_user="alice"), "drain", None, "released"),
    (NodeInfo("n", "idle"), "drain", NOW + 50, "lost"),  # slurmctld restarted after the last sighting
    (NodeInfo("n", "idle"), "drain", NOW - 50, "released"),  # it did not: someone resumed it
    (NodeInfo("n", "idle"), "drain", None, "released"),
    (NodeInfo("n", "idle", boot_time=NOW + 100), "reboot-asap", NOW + 500, "completed"),
    (NodeInfo("n", "idle", boot_time=NOW - 3600), "reboot-asap", NOW + 500, "lost"),
])
def test_judge_gone(info, kind, ctld, want):
    hold = Hold(node="n", action_id=1, incident_id=None, kind=kind, reason="healthd: x [#1]", reason_time=NOW,
                reason_user="root", since=NOW, planned_at=NOW, verified_at=NOW + 10)
    assert judge_gone(hold, info, ctld)[0] == want


def test_judge_gone_says_when_in_utc():
    hold = Hold(node="n", action_id=1, incident_id=None, kind="reboot-asap", reason="healthd: x [#1]", reason_time=NOW,
                reason_user="root", since=NOW, planned_at=NOW, verified_at=NOW + 10)
    assert judge_gone(hold, NodeInfo("n", "idle", boot_time=NOW + 100), None)[1] == (
        "the node booted at 2027-01-15T08:01:40Z, after the reboot request")
    assert judge_gone(hold, NodeInfo("n", "idle"), NOW + 500)[1] == (
        "slurmctld restarted at 2027-01-15T08:08:20Z, after the write was last seen (2027-01-15T08:00:10Z), "
        "and came back without it (state idle)")
    admin = NodeInfo("n", "idle", reason="bad fan", reason_user="alice", reason_time=NOW)
    assert judge_gone(hold, admin, None)[1] == "now 'bad fan' by alice at 2027-01-15T08:00:00Z"
