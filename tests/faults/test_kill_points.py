"""SIGKILL of the controller at every Slurm write (before it reaches slurmctld, and right after it landed)
and at ≥ 100 random points, on a whole real fleet (tests/faults/world.py): after each, the checker's
invariants hold and the flow completes exactly once."""

from __future__ import annotations

import random
import time

import pytest

from tests.faults.world import FaultWorld

pytestmark = pytest.mark.slow

RANDOM_KILLS = 100


def kill_at(w: FaultWorld, pattern: str, when: str, trigger) -> None:
    """Arm the wrapper to SIGKILL the controller `when` (before/after) its write matching `pattern`,
    run `trigger`, wait for the kill, restart the controller."""
    assert w.scontrol is not None
    fired_before = len(w.scontrol.fired())
    w.scontrol.arm(pattern, f"kill-{when}")
    trigger()
    w.wait(lambda: len(w.scontrol.fired()) > fired_before, 60, f"the controller's `{pattern}` call")
    w.reap_controller()
    w.kills += 1
    w.restart_controller()


WHEN = ["before", "after"]


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_drain(w, when):
    kill_at(w, "State=DRAIN", when, lambda: w.inject_xid("node02", 48))
    w.drained_once("node02")
    w.checker.check()
    assert len([a for a in w.actions("node02") if a["status"] == "applied"]) == 1


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_requeue_of_a_drain_and_requeue(w, when):
    job = w.submit_opted_in("node02")
    kill_at(w, f"requeue {job}", when, lambda: w.inject_xid("node02", 79))
    w.drained_once("node02")
    w.wait(lambda: w.job(job).get("Restarts") == "1" and "node02" not in w.job(job).get("NodeList", ""), 60,
           f"job {job} requeued once")
    w.checker.check()
    time.sleep(3 * w.round_s)
    assert w.job(job).get("Restarts") == "1"


def _repaired(w: FaultWorld, node: str) -> None:
    w.healthctl("repaired", node, "--why", "reseated GPU", json_out=False)


def _reintegration_state(w: FaultWorld, node: str) -> str | None:
    rows = w.rows("SELECT state FROM reintegrations WHERE node = ? ORDER BY id DESC LIMIT 1", (node,))
    return rows[0][0] if rows else None


@pytest.mark.parametrize("write,pattern", [("create reservation", "create reservation"),
                                           ("resume into the reservation", "State=RESUME"),
                                           ("delete reservation", "delete ReservationName")])
@pytest.mark.parametrize("when", WHEN)
def test_kill_at_each_reintegration_write(w, write, pattern, when):
    w.inject_xid("node03", 48)
    w.drained_once("node03")
    if write == "delete reservation":
        # the reintegration deletes a leftover reservation before it creates its own: kill at the final one,
        # armed while the validation (two seconds) runs
        _repaired(w, "node03")
        w.wait(lambda: _reintegration_state(w, "node03") == "validating", 60, "validation")
        kill_at(w, pattern, when, lambda: None)
    else:
        kill_at(w, pattern, when, lambda: _repaired(w, "node03"))
    w.wait(lambda: _reintegration_state(w, "node03") == "passed", 90, "the reintegration to pass")
    info = w.node_info("node03")
    assert not info.drain_requested and not info.reason
    assert not w.backend.reservation_exists("healthd_validate_node03")
    resumes = [a for a in w.actions("node03") if a["kind"] == "resume" and a["status"] == "applied"]
    assert len(resumes) == 1, w.actions("node03")
    w.checker.check()


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_redrain_after_a_failed_validation(w, when):
    w.validation_rc.write_text("3\n")
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    _repaired(w, "node02")
    w.wait(lambda: _reintegration_state(w, "node02") == "validating", 60, "validation")
    # validation is under way (it fails after two seconds): the next drain is the re-drain
    kill_at(w, "State=DRAIN", when, lambda: None)
    w.wait(lambda: _reintegration_state(w, "node02") == "failed", 60, "the failed validation")
    w.drained_once("node02")
    assert "validation failed" in w.node_info("node02").reason
    assert not w.backend.reservation_exists("healthd_validate_node02")
    w.checker.check()


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_resume_of_an_undo(w, when):
    w.inject_xid("node02", 48)
    w.drained_once("node02")
    (drain,) = [a for a in w.actions("node02") if a["status"] == "applied"]
    kill_at(w, "State=RESUME", when,
            lambda: w.healthctl("undo", str(drain["id"]), "--why", "a reseated cable, not the GPU", json_out=False))
    w.wait(lambda: not w.node_info("node02").drain_requested, 30, "the undo's resume")
    w.wait(lambda: [a["status"] for a in w.actions("node02") if a["id"] == drain["id"]] == ["undone"], 30,
           "the drain marked undone")
    # the incident is closed by the ledger write after the one marking the drain undone
    w.wait(lambda: w.rows("SELECT status FROM incidents") == [("false_positive",)], 30,
           "the incident closed as a false positive")
    time.sleep(4 * w.round_s + 2 * w.heartbeat_s)  # the agent still reports the old Xid: not drained again
    assert not w.node_info("node02").drain_requested
    w.checker.check()


@pytest.mark.timeout(600)  # 100-130 s on a 2-core machine: RANDOM_KILLS controller restarts
def test_sigkill_at_random_points(w):
    """RANDOM_KILLS kills at random moments while faults arrive on several nodes and operators undo
    healthd's drains; an administrator's look-alike `healthd:` drain on node04 stays untouched throughout."""
    rng = random.Random(20261201)
    w.checker.foreign_drain("node04", "healthd: looks like healthd's, written by an admin [#999]")
    nodes = ["node01", "node02", "node03"]
    kills_before = w.kills
    for i in range(RANDOM_KILLS):
        held = w.holds()
        free = [n for n in nodes if n not in held]
        if free and (rng.random() < 0.7 or len(free) == len(nodes)):
            node = rng.choice(free)
            w.inject_xid(node, rng.choice([48, 79, 95]), gpu=rng.randrange(4))
        elif held:
            node = rng.choice(sorted(n for n in held if n in nodes) or nodes)
            h = held.get(node)
            if h is not None:
                w.healthctl("undo", str(h.action_id), "--why", "operator: not the GPU", json_out=False, check=False)
        if rng.random() < 0.2:
            w.inject_xid("node04", 48, gpu=rng.randrange(4))  # tempting: never overwritten, never resumed
        time.sleep(rng.uniform(0.0, 1.5))
        w.kill_controller()
        w.restart_controller()
        if i % 20 == 19:
            w.checker.check(settle_s=30)
    assert w.kills - kills_before == RANDOM_KILLS
    w.checker.check(settle_s=30)
    free = [n for n in nodes if n not in w.holds()]
    if not free:
        h = w.holds()["node01"]
        w.healthctl("undo", str(h.action_id), "--why", "make room for the probe", json_out=False)
        w.wait(lambda: "node01" not in w.holds(), 30, "node01 resumed")
        free = ["node01"]
    took = w.checker.drain_not_delayed(free[0], xid=64, gpu=2)
    print(f"random kills: {RANDOM_KILLS}, actions {len(w.actions())}, drain after the storm {took:.2f} s")
