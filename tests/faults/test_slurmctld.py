"""slurmctld around healthd's writes, on a whole real fleet (tests/faults/world.py): stopped during a
write, killed right after one and restarted from an older state save, and a client that times out
after its write landed. After each: the checker's invariants, and another node drained within rounds."""

from __future__ import annotations

import signal
import time

import pytest


pytestmark = pytest.mark.slow


def requeued_once(w, job: str, node: str) -> None:
    w.wait(lambda: w.job(job).get("Restarts") == "1" and node not in w.job(job).get("NodeList", ""), 90,
           f"job {job} requeued off {node}")


def adopted_once(w, job: str) -> None:
    """node02's drain-and-requeue, reported failed, is in Slurm once, adopted, and its job requeued once."""
    w.drained_once("node02", 60)
    requeued_once(w, job, "node02")
    (drain,) = [a for a in w.actions("node02") if a["kind"] == "drain-and-requeue"]
    assert drain["status"] == "applied" and drain["outcome"].startswith("adopted"), drain
    w.checker.check()
    w.checker.drain_not_delayed("node03")


def test_slurmctld_stopped_mid_write_the_write_lands_later_and_is_adopted_once(w):
    """SIGSTOP slurmctld as healthd's drain reaches it: the client times out (the action fails), the request
    waits in slurmctld's socket, and lands when slurmctld continues. The reconciler adopts it: one drain, the
    opted-in job requeued once, never a second write."""
    job = w.submit_opted_in("node02")
    w.scontrol.arm("State=DRAIN", "stop-ctld-before", str(w.ctld_pid()))
    w.inject_xid("node02", 79)
    w.wait(lambda: w.scontrol.fired(), 30, "the drain to reach the stopped slurmctld")
    w.wait(lambda: any(a["status"] == "failed" for a in w.actions("node02")), 60, "the client to time out")
    w.stop_ctld_process(signal.SIGCONT)
    adopted_once(w, job)


def test_slurmctld_down_during_a_write_the_next_round_writes_once(w):
    """slurmctld stopped cleanly between healthd's re-read of the node and its drain: the drain fails
    (connection refused) and never lands; when slurmctld is back, the next round tries again under the same
    incident."""
    w.scontrol.arm("State=DRAIN", "term-ctld-before", str(w.ctld_pid()))
    try:
        w.inject_xid("node02", 48)
        w.wait(lambda: any(a["status"] == "failed" for a in w.actions("node02")), 60, "the failed drain")
    finally:
        w.cluster.start_ctld()
    w.drained_once("node02", 60)
    statuses = [a["status"] for a in w.actions("node02")]
    # the failed attempt stays on record; the next round's is a new one (never the failed row reused)
    assert len(statuses) >= 2 and statuses == ["failed"] * (len(statuses) - 1) + ["applied"], w.actions("node02")
    w.checker.check()
    w.checker.drain_not_delayed("node03")


def test_slurmctld_killed_right_after_a_drain_comes_back_without_it_and_healthd_applies_it_again(w):
    """slurmctld SIGKILLed right after healthd's drain and requeue, restarted from a state save taken
    before them: Slurm has lost both. The reconciler marks the drain lost (slurmctld restarted after it was
    last seen) and the next round applies it again through the gates, a new attempt under the same incident."""
    job = w.submit_opted_in("node02")
    time.sleep(3)  # slurmctld saves the running job in its state
    snapshot = w.snapshot_ctld_state()
    w.inject_xid("node02", 79)
    w.drained_once("node02")
    w.wait(lambda: w.job(job).get("Restarts") == "1", 30, "the requeue")
    # the kill is to lose slurmctld's state, not its log: slurmctld 24.11 and 26.05 write their log behind
    # their work, and a SIGKILL right after the requeue took its line with it (22.05 has it at once)
    w.wait(lambda: w.checker.slurm_writes()[1].get(str(job), 0) == 1, 30, "slurmctld to log the requeue")
    first = w.node_info("node02")
    w.kill_ctld_restore(snapshot)
    incident = w.rows("SELECT id FROM incidents")[0][0]
    w.drained_once("node02", 90)
    writes, _ = w.checker.slurm_writes()
    assert writes[("node02", first.reason)] == 2  # slurmctld's own log: the lost write, then written once more
    drains = [(a["attempt"], a["status"]) for a in w.actions("node02") if a["kind"] == "drain-and-requeue"]
    assert drains == [(1, "lost"), (2, "applied")], w.actions("node02")
    assert w.rows("SELECT DISTINCT incident_id FROM decisions WHERE kind = 'drain-and-requeue'") == [(incident,)]
    # whatever slurmctld made of the restored job, it does not run on the drained node
    w.wait(lambda: "node02" not in w.job(job).get("NodeList", "") or w.job(job).get("JobState") != "RUNNING", 90,
           f"job {job} off node02")
    w.checker.check(settle_s=30)
    w.checker.drain_not_delayed("node03")


def test_a_client_that_times_out_after_its_write_landed_is_adopted_never_written_twice(w):
    """The drain lands, then the client hangs past the backend's timeout: the controller records a failure
    for a write Slurm applied. The next round finds the write and adopts it; the requeue follows once."""
    job = w.submit_opted_in("node02")
    w.scontrol.arm("State=DRAIN", "hang-after", "30")
    w.inject_xid("node02", 79)
    w.wait(lambda: any(a["status"] == "failed" for a in w.actions("node02")), 60, "the timed-out drain")
    adopted_once(w, job)
