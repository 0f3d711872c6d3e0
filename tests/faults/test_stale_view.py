"""The gates that count capacity or budget, on a whole real fleet whose fleet view is always stale
(tests/faults/world.py): slurmctld answers the controller's reads of the whole node list 8 s late, with
the nodes as they were when asked, so every round acts on a view read before healthd's latest writes.
Faults arrive on several nodes of the four-node partition, spread over rounds, each as soon as the
previous one's outcome is visible. The gates must judge the fleet as Slurm last showed it plus every
write healthd made, planned or holds since: never less out of service than healthd itself caused.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.world import SUITE_POLICY

pytestmark = pytest.mark.slow

READ_DELAY_S = 8.0
PARTITION = "debug"


def configure(w, **policy) -> None:
    """The controller again, with this test's envelope and a stale fleet view."""
    w.policy = dict(SUITE_POLICY, **policy)
    w.stop_controller()
    w.scontrol.slow_reads(READ_DELAY_S)
    w.start_controller()
    w.wait_reported(w.nodes, timeout_s=60)


def out_of_service(w) -> set[str]:
    """The nodes Slurm shows drained, draining, down or rebooting, read directly (not through healthd)."""
    return {n for n, st in w.slurm_nodes().items()
            if any(s in st.get("State", "") for s in ("DRAIN", "DOWN", "REBOOT"))}


def decided(w, node: str) -> list[tuple[str, str | None]]:
    return w.rows("SELECT outcome, refused_gate FROM decisions WHERE node = ? AND kind != 'none' ORDER BY id",
                  (node,))


def watch(w, seconds: float, most: int) -> None:
    """Poll Slurm for `seconds`: never more than `most` nodes out of service at any moment."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gone = out_of_service(w)
        assert len(gone) <= most, f"{sorted(gone)} out of service, at most {most} allowed\n{w.diagnostics()}"
        time.sleep(0.2)


def faults_one_after_another(w, nodes: list[str], xid: int = 48) -> None:
    """A T1 fault on each node in turn, the next one as soon as the previous one is decided (allowed
    and written, or refused): each arrives in a later round than the one before, on a stale view."""
    for i, node in enumerate(nodes):
        w.inject_xid(node, xid, gpu=i % 4)
        w.wait(lambda n=node: decided(w, n), 30, f"a decision for {node}", node)


def test_the_capacity_floor_holds_when_the_view_has_not_shown_healthds_own_drain(w):
    """Floor 3 on a four-node partition: of three nodes failing one round after another, exactly one is
    drained; the other two are refused by the capacity gate although the view still shows the drained
    node in service. The later faults are on nodes that sort before the drained one, so their decisions
    come first in a round's batch, before the view's stale idea of the drained node is decided again."""
    configure(w, capacity_floors={PARTITION: 3})
    faults_one_after_another(w, ["node04", "node03", "node02"])
    watch(w, 2 * READ_DELAY_S, most=1)
    assert out_of_service(w) == {"node04"}, w.diagnostics()
    for node in ("node03", "node02"):
        gates = {g for _, g in decided(w, node)}
        assert gates == {"capacity"}, (node, decided(w, node))
    w.checker.check()


def test_the_rate_limit_counts_a_drain_whose_client_timed_out_after_it_landed(w):
    """One removing action an hour. node02's drain lands, then its client hangs past the backend's
    timeout: the ledger has it as failed while Slurm applied it, and the stale view does not show it
    yet. A fault on node01 right after must be refused by the rate limit, not drained as a first action."""
    configure(w, max_actions_per_hour=1)
    w.scontrol.arm("State=DRAIN", "hang-after", "12")
    w.inject_xid("node02", 48)
    w.wait(lambda: w.scontrol.fired(), 30, "node02's drain to land and its client to hang")
    # node01's report arrives while that round waits on the client: it is decided in the round right
    # after the timeout, before node02's own decision is made again and its write adopted
    w.inject_xid("node01", 48, gpu=1)
    w.wait(lambda: decided(w, "node01"), 60, "a decision for node01", "node01")
    watch(w, 2 * READ_DELAY_S, most=1)
    assert out_of_service(w) == {"node02"}, w.diagnostics()
    assert {g for _, g in decided(w, "node01")} == {"rate-limit"}, decided(w, "node01")
    w.wait(lambda: "node02" in w.holds(), 30, "node02's landed drain adopted")
    w.checker.check()


def test_the_breaker_opens_on_failures_spread_over_rounds_and_drains_no_more(w):
    """The breaker opens when more than one node fails within its window: node01 is drained, node02's
    failure opens it and is refused, node03's too. The stale view changes nothing the breaker counts."""
    configure(w, breaker_nodes=1, breaker_min_nodes=1000)
    faults_one_after_another(w, ["node01", "node02", "node03"])
    watch(w, 2 * READ_DELAY_S, most=1)
    assert out_of_service(w) == {"node01"}, w.diagnostics()
    assert w.rows("SELECT COUNT(*) FROM breaker_events WHERE event = 'open'") == [(1,)]
    for node in ("node02", "node03"):
        assert {g for _, g in decided(w, node)} == {"breaker"}, (node, decided(w, node))
    w.checker.check()
