"""Ownership by record, on a whole real fleet (tests/faults/world.py): healthd changes a node only while its
ledger holds the drain and Slurm still shows exactly that write; a look-alike `healthd:` reason, an
administrator's re-drain with healthd's own text and an administrator's resume all take the node from it.
Undo and close end an incident by episode: the same evidence never comes back, a new fault is acted on."""

from __future__ import annotations

import time

import pytest


pytestmark = pytest.mark.slow


def quiet(w, seconds: float | None = None) -> None:
    """Let rounds and agent heartbeats pass."""
    time.sleep(seconds if seconds is not None else 6 * w.round_s + 3 * w.heartbeat_s)


def test_a_lookalike_healthd_reason_is_foreign(w):
    w.checker.foreign_drain("node02", "healthd: xid 79 gpu0: fell off the bus [#1]")  # what healthd would write
    w.inject_xid("node02", 79)
    w.wait(lambda: w.incidents("node02"), 30, "node02's incident")
    quiet(w)
    assert w.actions("node02") == [], "healthd wrote over a reason it did not write"
    refused = w.rows("SELECT refused_gate, refused_reason FROM decisions WHERE node = 'node02' AND outcome = 'refused'")
    assert refused and refused[0][0] == "ownership" and "not healthd's by record" in refused[0][1], refused
    rc, out = w.healthctl_run("repaired", "node02", "--why", "x")
    assert rc == 1 and "not drained by healthd" in out, out
    w.checker.check()
    w.checker.drain_not_delayed("node03")


def test_healthds_own_text_written_by_someone_else_is_theirs(w):
    """healthd drained node02, an operator's undo resumed it, then an administrator drains it again with the
    text healthd had written (copied from a ticket): that write is the administrator's, so healthd never
    writes over it, never resumes it, and `repaired` is refused."""
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    reason = w.node_info("node02").reason
    (drain,) = w.actions("node02")
    w.healthctl("undo", str(drain["id"]), "--why", "wrong GPU", json_out=False)
    w.wait(lambda: not w.node_info("node02").drain_requested, 30, "the undo")
    w.checker.foreign_drain("node02", reason)
    w.lose_gpu("node02", 1)  # a new fault on it: still not healthd's to write
    w.wait(lambda: len(w.incidents("node02")) == 2, 30, "the new fault's incident")
    quiet(w)
    assert [a["status"] for a in w.actions("node02") if a["kind"] != "resume"] == ["undone"]
    refused = w.rows("SELECT refused_reason FROM decisions WHERE node = 'node02' AND refused_gate = 'ownership'")
    assert refused and "not healthd's by record" in refused[-1][0], refused
    rc, out = w.healthctl_run("repaired", "node02", "--why", "fixed")
    assert rc == 1 and "not drained by healthd" in out, out
    w.checker.check()
    w.checker.drain_not_delayed("node03")


def test_a_same_text_redrain_is_invisible_in_slurm_and_release_hands_the_node_over(w):
    """Slurm ignores an update that changes neither state nor reason (no reason time, no user, no log line),
    so an administrator re-sending healthd's exact drain changes nothing anyone can see: by record the node
    is still healthd's. `healthctl release` is how an administrator takes it: healthd forgets its hold, the
    incident is handed over, and healthd never resumes or rewrites the node."""
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    before = w.node_info("node02")
    time.sleep(1.1)
    w.checker.admin_write("node02", before.reason)
    after = w.node_info("node02")
    assert (after.reason, after.reason_time, after.reason_user) == (before.reason, before.reason_time,
                                                                    before.reason_user)
    assert w.checker.slurm_writes()[0][("node02", before.reason)] == 1  # slurmctld logged only healthd's write
    w.checker.own_writes[("node02", before.reason)] -= 1  # ...so the test's own write is not in its log
    rc, out = w.healthctl_run("release", "node02", "--why", "I am replacing the board")
    assert rc == 0, out
    assert [a["status"] for a in w.actions("node02")] == ["released"]
    assert [i["status"] for i in w.incidents("node02")] == ["handed-over"]
    w.checker.remember_foreign("node02")  # the administrator's now: never touched again
    snapshot = w.node_info("node02")
    for argv in (["repaired", "node02", "--why", "fixed"], ["undo", str(w.actions("node02")[0]["id"]), "--why", "x"]):
        rc, out = w.healthctl_run(*argv)
        assert rc == 1, f"healthctl {argv[0]} was not refused: {out!r}"
    w.lose_gpu("node02", 1)
    quiet(w)
    now = w.node_info("node02")
    assert (now.reason, now.reason_time, now.drain_requested) == (snapshot.reason, snapshot.reason_time, True)
    w.checker.check()
    w.checker.drain_not_delayed("node03")


def test_an_administrator_resuming_a_healthd_drain_is_respected_and_a_new_fault_is_acted_on(w):
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    w.slurm(["scontrol", "update", "NodeName=node02", "State=RESUME"])  # a person puts it back
    w.wait(lambda: [a["status"] for a in w.actions("node02")] == ["released"], 30, "the hand-over")
    quiet(w)  # the agent still reports the old Xid line: the person's decision stands
    assert not w.node_info("node02").drain_requested
    assert len(w.actions("node02")) == 1
    w.inject_xid("node02", 48)  # a genuinely new Xid 48 line on the same GPU
    w.drained_once("node02")
    assert [i["status"] for i in w.incidents("node02")] == ["handed-over", "open"]
    w.checker.check()


def test_undo_is_a_false_positive_the_same_evidence_never_returns_a_new_fault_does(w):
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    (drain,) = w.actions("node02")
    w.healthctl("undo", str(drain["id"]), "--why", "the Xid came from a reset we did by hand", json_out=False)
    w.wait(lambda: not w.node_info("node02").drain_requested, 30, "the undo")
    incident = w.incidents("node02")[0]
    assert incident["status"] == "false_positive" and incident["closed_by"] == "root"
    quiet(w)
    assert not w.node_info("node02").drain_requested  # the agent's old evidence does not re-drain it
    w.inject_xid("node02", 48)  # later, a genuinely new fault on the same GPU
    w.drained_once("node02")
    assert [i["status"] for i in w.incidents("node02")] == ["false_positive", "open"]
    w.checker.check()


def test_an_undone_persistent_condition_stays_dismissed_until_it_goes_away_and_comes_back(w):
    """A GPU NVML keeps reporting lost is re-observed every tick; its episode began before the undo, so the
    operator's verdict holds for as long as it lasts. When it recovers and is lost again, that is new."""
    w.lose_gpu("node03", 1)
    w.drained_once("node03")
    (drain,) = [a for a in w.actions("node03") if a["kind"] != "requeue"]
    w.healthctl("undo", str(drain["id"]), "--why", "known flaky riser, replacement scheduled", json_out=False)
    w.wait(lambda: not w.node_info("node03").drain_requested, 30, "the undo")
    quiet(w, 10 * w.round_s + 5 * w.agent_interval_s)
    assert not w.node_info("node03").drain_requested, "an undone persistent condition re-drained the node"
    w.lose_gpu("node03", 1, lost=False)
    quiet(w, 3 * w.agent_interval_s + 1)
    w.lose_gpu("node03", 1)  # lost again: a new episode
    w.drained_once("node03")
    assert [i["status"] for i in w.incidents("node03")] == ["false_positive", "open"]
    w.checker.check()


def test_close_ends_an_incident_that_holds_no_node_and_its_episode_stays_closed(w):
    w.checker.foreign_drain("node02", "admin: replacing the fan")
    w.inject_xid("node02", 79)
    w.wait(lambda: w.incidents("node02"), 30, "node02's incident")
    (incident,) = w.incidents("node02")
    w.healthctl("close", str(incident["id"]), "--why", "vendor swapped the board", json_out=False)
    assert w.incidents("node02")[0]["status"] == "closed"
    quiet(w)
    assert len(w.incidents("node02")) == 1, "the same episode re-opened an incident"
    # an incident healthd still holds a node for cannot be closed by hand
    w.inject_xid("node03", 48)
    w.drained_once("node03")
    (held,) = w.incidents("node03")
    rc, out = w.healthctl_run("close", str(held["id"]), "--why", "x")
    assert rc == 1 and "still holds node03" in out and w.incidents("node03")[0]["status"] == "open", out
    w.checker.check()
