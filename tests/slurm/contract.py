"""The SlurmBackend contract: what every backend must do, as plain functions `check_*(backend, ctl)`.

tests/slurm/test_backend_contract.py runs every check against
- ScontrolBackend on a real local Slurm cluster (tests/support/slurm_cluster.py), and
- PyslurmBackend on the pyslurm 25.11 stand-in (tests/slurm/pyslurm_standin),
so a behaviour proven on the real Slurm is the behaviour the pyslurm adapter is held to.

`ctl` is the small adapter a check needs around the backend (the Ctl Protocol below): reset the
cluster, start a job, look at jobs and reservations, write the argv of a job step, stop and start
slurmctld, and count the Slurm calls made so far (to prove that a refused input made none).
"""

from __future__ import annotations

import time
from typing import Protocol

import pytest

from healthd.reason import MAX_REASON_BYTES
from healthd.slurm.backend import SlurmBackend, SlurmRefused, SlurmUnavailable

NODES = ["node01", "node02", "node03", "node04"]

# Everything a shell would treat as syntax, plus `=` (scontrol's key=value separator), quotes,
# a fake `[user@time]` suffix and a fake Comment= field (what a `scontrol show node -o` parser
# could trip on), and non-ASCII text.
HOSTILE_REASON = (
    "healthd: xid 79 [#7] a=b Reason=c \"double\" 'single' ;|&$() `tick` \\back *? ~ #"
    " ünïcødé ✓ 日本 [root@2020-01-01T00:00:00] Comment=x"
)

BAD_NODE_NAMES = [
    "",
    "node01 node02",
    "node01;reboot",
    "node01|x",
    "node01&",
    "$(reboot)",
    "`id`",
    "node01\nnode02",
    "node01\x00",
    "node'01",
    'node"01',
    "NodeName=node01",
    "node01 State=RESUME",
    "node[01-02",
    "node01>x",
    "n" * 257,
    "n[0-99999999]",
    "-node01",
]
BAD_REASONS = [
    "",
    "   ",
    "line one\nline two",
    "carriage\rreturn",
    "tab\there",
    "nul\x00byte",
    "bell\x07",
    "esc\x1b[31m",
    "x" * (MAX_REASON_BYTES + 1),
    "é" * (MAX_REASON_BYTES // 2 + 1),  # within the limit in characters, over it in UTF-8 bytes
    "line\u2028separator",
]


class Ctl(Protocol):
    nodes: list[str]

    def reset(self) -> None:
        """All nodes idle and undrained, no reboot pending, no job, no test reservation, slurmctld up."""

    def submit_running_job(self, node: str, comment: str = "") -> int:
        """A batch job running on `node`, with `comment` as its --comment (returns once it runs)."""

    def job_state(self, job_id: int) -> str:
        """RUNNING, PENDING, ... ('' when the job is gone)."""

    def reservation_exists(self, name: str) -> bool: ...

    def step(self, node: str, command: list[str]) -> list[str]:
        """The argv of a job step that runs `command` on `node` (srun, one node, a short time limit)."""

    def stop_ctld(self) -> None: ...

    def start_ctld(self) -> None: ...

    def calls(self) -> int:
        """How many Slurm calls (client processes or pyslurm RPCs) were made so far."""

    def settle(self, node: str) -> None:
        """Wait until a just-resumed node responds again (22.05: idle* for about a second)."""


def _wait(predicate, timeout: float = 20.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# ----------------------------------------------------------------------------- reads


def check_lists_nodes(backend: SlurmBackend, ctl: Ctl) -> None:
    nodes = backend.nodes()
    assert [n.name for n in nodes] == ctl.nodes
    for n in nodes:
        assert n.state == "idle", n
        assert not n.drain_requested and n.reason == "" and n.reason_user is None and n.reason_time is None
        assert n.partitions, n
        assert n.gres and n.gres.startswith("gpu"), n
        assert n.next_state is None
    assert [n.name for n in backend.nodes(["node[02-03]"])] == ["node02", "node03"]
    assert [n.name for n in backend.nodes("node04")] == ["node04"]
    assert backend.nodes([]) == []
    assert backend.node("node01").name == "node01"
    with pytest.raises(SlurmRefused):
        backend.node("node99")
    assert isinstance(backend.version(), str) and backend.version()[0].isdigit()


# ----------------------------------------------------------------------------- drain / resume


def check_longest_reason_round_trips(backend: SlurmBackend, ctl: Ctl) -> None:
    """A reason of exactly the limit is written and read back whole; one byte more is refused."""
    longest = "healthd: " + "x" * (MAX_REASON_BYTES - len("healthd: "))
    backend.drain("node02", longest)
    assert backend.node("node02").reason == longest
    with pytest.raises(ValueError, match=f"more than the {MAX_REASON_BYTES}"):
        backend.drain("node02", longest + "x")


def check_drain_reason_round_trips(backend: SlurmBackend, ctl: Ctl) -> None:
    before = time.time()
    backend.drain("node02", HOSTILE_REASON)
    node = backend.node("node02")
    assert node.reason == HOSTILE_REASON
    assert "DRAIN" in node.flags and node.drained and not node.draining
    assert node.reason_user == "root"
    assert node.reason_time is not None and before - 5 <= node.reason_time <= time.time() + 5
    listed = {n.name: n for n in backend.nodes()}
    assert listed["node02"] == node
    assert not listed["node01"].drain_requested


def check_drain_hostlist(backend: SlurmBackend, ctl: Ctl) -> None:
    backend.drain("node[02-03]", "healthd: range test [#2]")
    got = {n.name: n for n in backend.nodes()}
    assert got["node02"].drained and got["node03"].drained
    assert not got["node01"].drain_requested and not got["node04"].drain_requested
    backend.resume(["node02", "node03"])
    for n in backend.nodes(["node02", "node03"]):
        assert not n.drain_requested and n.reason == ""


def check_resume_twice_is_fine(backend: SlurmBackend, ctl: Ctl) -> None:
    backend.drain("node02", "healthd: resume twice [#3]")
    backend.resume("node02")
    ctl.settle("node02")
    backend.resume("node02")  # Slurm itself refuses this one: "Invalid node state specified"
    backend.resume("node01")  # never drained
    node = backend.node("node02")
    assert not node.drain_requested and node.reason == "" and node.state == "idle"


def check_draining_busy_node(backend: SlurmBackend, ctl: Ctl) -> None:
    ctl.submit_running_job("node03")
    backend.drain("node03", "healthd: drain while busy [#4]")
    node = backend.node("node03")
    assert node.state in ("mixed", "allocated"), node
    assert node.draining and not node.drained
    backend.resume("node03")
    assert not backend.node("node03").drain_requested


# ----------------------------------------------------------------------------- reboot


def check_reboot_asap_and_cancel(backend: SlurmBackend, ctl: Ctl) -> None:
    # A busy node: ASAP waits for its job, so the reboot stays requested (never issued) until cancelled.
    ctl.submit_running_job("node03")
    reason = "healthd: pending row remap gpu1 [#9]"
    backend.reboot_asap("node03", reason)
    node = backend.node("node03")
    assert "REBOOT_REQUESTED" in node.flags and node.reboot_requested, node
    assert node.next_state == "RESUME"
    assert node.drain_requested and node.reason == reason and node.reason_user == "root"
    backend.cancel_reboot("node03")
    node = backend.node("node03")
    assert not node.reboot_requested and not node.drain_requested and node.next_state is None, node
    backend.cancel_reboot("node03")  # nothing pending any more: not an error


def check_reboot_next_state_down(backend: SlurmBackend, ctl: Ctl) -> None:
    ctl.submit_running_job("node03")
    backend.reboot_asap(["node03"], "healthd: reboot then down [#10]", next_state="DOWN")
    assert backend.node("node03").next_state == "DOWN"
    backend.resume("node03")  # RESUME also drops a pending reboot (seen on 22.05)
    node = backend.node("node03")
    assert not node.reboot_requested and not node.drain_requested, node


# ----------------------------------------------------------------------------- jobs, reservations


def check_requeue_running_batch_job(backend: SlurmBackend, ctl: Ctl) -> None:
    job = ctl.submit_running_job("node04")
    assert ctl.job_state(job) == "RUNNING"
    backend.requeue(job)
    assert _wait(lambda: ctl.job_state(job) == "PENDING", 10), ctl.job_state(job)
    with pytest.raises(SlurmRefused):
        backend.requeue(999999)


def check_reservation_create_delete(backend: SlurmBackend, ctl: Ctl) -> None:
    name = "healthd-contract-val"
    backend.create_reservation(name, "node04", duration_min=10)
    assert ctl.reservation_exists(name)
    with pytest.raises(SlurmRefused):
        backend.create_reservation(name, "node04", duration_min=10)  # duplicate name
    assert backend.reservation_exists(name)
    backend.delete_reservation(name)
    assert not ctl.reservation_exists(name)
    assert not backend.reservation_exists(name)
    # a restart after the delete repeats it: already gone is done, not an error
    backend.delete_reservation(name)
    assert not ctl.reservation_exists(name)


def check_jobs_on_a_node_and_one_job(backend: SlurmBackend, ctl: Ctl) -> None:
    """The running jobs of one node, and one job in any state: a requeue Slurm kept raises the
    job's restart count (how the reconciler tells a requeue that landed)."""
    job = ctl.submit_running_job("node04", comment="x healthd:requeue y")
    (running,) = backend.jobs_on("node04")
    assert running.job_id == str(job) and running.batch and running.restarts == 0
    assert "healthd:requeue" in running.comment
    assert backend.jobs_on("node01") == []
    assert backend.job(job) == running and backend.job(str(job)) == running
    backend.requeue(job)
    assert _wait(lambda: (j := backend.job(job)) is not None and j.restarts == 1, 10), backend.job(job)
    assert backend.job(999999) is None  # a job Slurm does not know


def check_node_addresses(backend: SlurmBackend, ctl: Ctl) -> None:
    addrs = backend.node_addresses()
    assert sorted(addrs) == sorted(ctl.nodes) and all(addrs.values()), addrs
    assert backend.node_addresses(["node02"]) == {"node02": addrs["node02"]}
    assert backend.node_addresses("node[03-04]") == {"node03": addrs["node03"], "node04": addrs["node04"]}
    assert backend.node_addresses([]) == {}


def check_run_step(backend: SlurmBackend, ctl: Ctl) -> None:
    """A job step runs where it is sent and says how it ended; it never raises for that: a failure
    is its exit status, a step still running at its timeout is killed (124), a command that cannot
    start is 127."""
    ok = backend.run_step(ctl.step("node02", ["printenv", "SLURMD_NODENAME"]), timeout_s=60)
    assert ok.returncode == 0 and ok.output.split()[:1] == ["node02"], ok
    failed = backend.run_step(ctl.step("node02", ["false"]), timeout_s=60)
    assert failed.returncode not in (0, 124, 127), failed
    started = time.monotonic()
    slow = backend.run_step(ctl.step("node03", ["sleep", "60"]), timeout_s=2)
    assert slow.returncode == 124 and "did not finish within 2 s" in slow.output, slow
    assert time.monotonic() - started < 10
    missing = backend.run_step(["/nonexistent/healthd-step"], timeout_s=5)
    assert missing.returncode == 127 and "FileNotFoundError" in missing.output, missing


def check_node_boot_time(backend: SlurmBackend, ctl: Ctl) -> None:
    """Every reader gives the node's boot time where Slurm has one (the reconciler tells a finished
    reboot from a lost request by it); `ctld_started_at` is slurmctld's start, when known."""
    info = backend.node("node01")
    assert info.boot_time is None or 1e9 < info.boot_time <= time.time() + 5, info
    started = backend.ctld_started_at()
    assert started is None or 1e9 < started <= time.time() + 5, started


# ----------------------------------------------------------------------------- refused before any call


def check_hostile_inputs_refused_before_any_call(backend: SlurmBackend, ctl: Ctl) -> None:
    calls = ctl.calls()
    for bad in BAD_NODE_NAMES:
        for call in (
            lambda bad=bad: backend.drain(bad, "healthd: x"),
            lambda bad=bad: backend.resume(bad),
            lambda bad=bad: backend.reboot_asap(bad, "healthd: x"),
            lambda bad=bad: backend.cancel_reboot(bad),
            lambda bad=bad: backend.create_reservation("healthd-x", bad, 10),
            lambda bad=bad: backend.nodes([bad]),
            lambda bad=bad: backend.node(bad),
            lambda bad=bad: backend.jobs_on(bad),
            lambda bad=bad: backend.node_addresses([bad]),
            lambda bad=bad: backend.describe("drain", nodes=bad, reason="healthd: x"),
        ):
            with pytest.raises(ValueError):
                call()
    for bad in BAD_REASONS:
        for call in (
            lambda bad=bad: backend.drain("node01", bad),
            lambda bad=bad: backend.reboot_asap("node01", bad),
            lambda bad=bad: backend.describe("drain", nodes="node01", reason=bad),
        ):
            with pytest.raises(ValueError):
                call()
    for bad_job in (0, -1, "1;2", "1 2", "abc", "", True, 1.5, "12_x"):
        with pytest.raises(ValueError):
            backend.requeue(bad_job)
        with pytest.raises(ValueError):
            backend.job(bad_job)
    with pytest.raises(ValueError):
        backend.jobs_on("node[01-02]")  # one node, not a hostlist
    for bad_argv in ([], "srun hostname", [""], ["srun", 7], None):
        with pytest.raises(ValueError):
            backend.run_step(bad_argv, timeout_s=5)
    for bad_name in ("", "a b", "x;y", "x=y", "-x", "x" * 65):
        with pytest.raises(ValueError):
            backend.create_reservation(bad_name, "node01", 10)
        with pytest.raises(ValueError):
            backend.delete_reservation(bad_name)
    with pytest.raises(ValueError):
        backend.create_reservation("healthd-x", "node01", 0)
    with pytest.raises(ValueError):
        backend.create_reservation("healthd-x", "node01", 10, users=["root;id"])
    with pytest.raises(ValueError):
        backend.create_reservation("healthd-x", "node01", 10, flags=["MAINT", "DROP TABLE"])
    with pytest.raises(ValueError):
        backend.reboot_asap("node01", "healthd: x", next_state="IDLE; rm")
    assert ctl.calls() == calls, "a refused input reached Slurm"


def check_dry_run_changes_nothing(backend: SlurmBackend, ctl: Ctl) -> None:
    planned_before = len(backend.planned)
    backend.dry_run = True
    try:
        calls = ctl.calls()
        backend.drain("node01", HOSTILE_REASON)
        backend.create_reservation("healthd-dry", "node01", 10)
        backend.requeue(12345)
        step = ctl.step("node01", ["false"])
        assert backend.run_step(step, timeout_s=5).returncode == 0
        assert ctl.calls() == calls
        assert len(backend.planned) == planned_before + 4
        assert backend.planned[-4] == backend.describe("drain", nodes="node01", reason=HOSTILE_REASON)
        assert backend.planned[-1] == step
    finally:
        backend.dry_run = False
    assert not backend.node("node01").drain_requested
    assert not ctl.reservation_exists("healthd-dry")


# ----------------------------------------------------------------------------- slurmctld down


def check_slurmctld_down_is_unavailable_within_timeout(backend: SlurmBackend, ctl: Ctl) -> None:
    """Every call to a stopped slurmctld raises SlurmUnavailable within the backend's bound: timeout_s,
    or longer where the backend says it cannot cut a call short (`unavailable_within_s`: pyslurm's
    RPCs hold the interpreter until libslurm gives up)."""
    old_timeout = backend.timeout_s
    backend.timeout_s = 3.0
    bound = max(backend.timeout_s, getattr(backend, "unavailable_within_s", 0.0))
    ctl.stop_ctld()
    try:
        for call in (
            lambda: backend.nodes(),
            lambda: backend.drain("node01", "healthd: ctld down [#11]"),
            lambda: backend.requeue(1),
            lambda: backend.jobs_on("node01"),
            lambda: backend.job(1),
            lambda: backend.node_addresses(),
        ):
            started = time.monotonic()
            with pytest.raises(SlurmUnavailable):
                call()
            assert time.monotonic() - started < bound + 3.0
    finally:
        backend.timeout_s = old_timeout
        ctl.start_ctld()
    assert [n.name for n in backend.nodes()] == ctl.nodes
    assert not backend.node("node01").drain_requested


CHECKS = [
    check_lists_nodes,
    check_drain_reason_round_trips,
    check_longest_reason_round_trips,
    check_drain_hostlist,
    check_resume_twice_is_fine,
    check_draining_busy_node,
    check_reboot_asap_and_cancel,
    check_reboot_next_state_down,
    check_requeue_running_batch_job,
    check_reservation_create_delete,
    check_jobs_on_a_node_and_one_job,
    check_node_addresses,
    check_run_step,
    check_node_boot_time,
    check_hostile_inputs_refused_before_any_call,
    check_dry_run_changes_nothing,
    check_slurmctld_down_is_unavailable_within_timeout,
]
