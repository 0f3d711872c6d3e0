"""Report checks in worker processes (healthd.controller.verifier): real munged daemons, real spawned
workers, a real event loop. The workers decide exactly what the in-process check decides; a worker
killed by PID costs the report it held (503) and nothing else; the node -> address map follows the
controller's; shutdown answers what is still waiting."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from healthd.controller.verifier import Checked, CheckerPool, Refused, check_report
from healthd.envelope import sign_report
from tests.controller.munge_support import MungeFleet, munged_path

NODES = ["node01", "node02", "node03"]

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")


@pytest.fixture(scope="module")
def fleet():
    with MungeFleet(NODES) as f:
        yield f


@pytest.fixture(scope="module")
def pool(fleet):
    p = CheckerPool(2, fleet.controller_socket)
    yield p
    p.close()


def doc(node: str, seq: int, **extra) -> dict:
    return {"node": node, "verdict": "healthy", "findings": [], "seq": seq, **extra}


def run(pool: CheckerPool, jobs: list[tuple[bytes, dict[str, str]]], *, before=None, timeout_s: float = 20.0
        ) -> list[Checked | Refused]:
    """Submit every (body, node_addrs) on a fresh loop, as the report server does; the outcomes in order."""
    loop = asyncio.new_event_loop()
    out: list[Checked | Refused | None] = [None] * len(jobs)
    left = [len(jobs)]
    done = loop.create_future()

    def answer(k: int, outcome: Checked | Refused) -> None:
        out[k] = outcome
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(None)

    async def main() -> None:
        pool.attach(loop)
        try:
            if before is not None:
                before()
            for k, (body, addrs) in enumerate(jobs):
                pool.submit(body, time.time(), addrs, lambda o, k=k: answer(k, o))
            await asyncio.wait_for(done, timeout_s)
        finally:
            pool.detach()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def signed(fleet: MungeFleet, node: str, seq: int, signer: str | None = None, **extra) -> bytes:
    return sign_report(doc(node, seq, **extra), node, fleet.socket(signer or node))


def cases(fleet: MungeFleet, seq: int) -> list[bytes]:
    """One body of each kind the controller must tell apart, freshly signed (a credential decodes once)."""
    return [
        signed(fleet, "node01", seq),  # good
        signed(fleet, "node02", seq, signer="node03"),  # made on node03, claims node02: 403
        signed(fleet, "node01", seq).replace(b'"healthy"', b'"failed"'),  # tampered: 401
        signed(fleet, "node09", seq, signer="node01"),  # a node the controller does not know: 403
        b"{not json",  # 400
        signed(fleet, "node03", seq, verdict="maybe"),  # a valid credential around a bad document: 400
        signed(fleet, "node03", seq, kind="drain-request"),  # a drain request sent as a report: 400
    ]


def test_a_worker_decides_what_the_controller_itself_decides(fleet, pool):
    addrs = dict(fleet.node_addrs)
    here = [check_report(b, socket=fleet.controller_socket, node_addrs=addrs, now=time.time())
            for b in cases(fleet, 1)]
    there = run(pool, [(b, addrs) for b in cases(fleet, 2)])
    assert [type(o) for o in there] == [type(o) for o in here]
    assert [o.status for o in there if isinstance(o, Refused)] == [403, 401, 403, 400, 400, 400]
    assert [(o.status, o.credential) for o in there if isinstance(o, Refused)] == \
        [(o.status, o.credential) for o in here if isinstance(o, Refused)]
    assert [o.reason for o in there if isinstance(o, Refused)] == [o.reason for o in here if isinstance(o, Refused)]
    good = there[0]
    assert isinstance(good, Checked) and good.node == "node01" and good.doc == doc("node01", 2)


def test_many_reports_through_two_workers_are_each_answered_once(fleet, pool):
    addrs = dict(fleet.node_addrs)
    bodies = [signed(fleet, n, k) for k in range(40) for n in NODES]
    outcomes = run(pool, [(b, addrs) for b in bodies])
    assert [(o.node, o.doc["seq"]) for o in outcomes if isinstance(o, Checked)] == \
        [(n, k) for k in range(40) for n in NODES]


def test_the_address_map_follows_the_controllers(fleet, pool):
    """A map the controller replaced reaches the workers with the next report (sent only when it changed)."""
    wrong = {**fleet.node_addrs, "node01": "127.0.0.99"}
    first = run(pool, [(signed(fleet, "node01", k), wrong) for k in range(4)])
    assert {(o.status if isinstance(o, Refused) else 200) for o in first} == {403}
    right = dict(fleet.node_addrs)
    second = run(pool, [(signed(fleet, "node01", 10 + k), right) for k in range(4)])
    assert all(isinstance(o, Checked) for o in second)


def test_a_worker_killed_by_pid_costs_only_the_report_it_held(fleet):
    """One worker stopped with a report in hand, then killed: that report is 503, the others are
    checked, the worker is replaced and the next reports go through both workers again."""
    pool = CheckerPool(2, fleet.controller_socket)
    try:
        addrs = dict(fleet.node_addrs)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGSTOP)  # it will take the first report and never answer it

        def kill_soon() -> None:
            asyncio.get_running_loop().call_later(0.5, os.kill, victim, signal.SIGKILL)

        outcomes = run(pool, [(signed(fleet, NODES[k % 3], k), addrs) for k in range(6)], before=kill_soon)
        statuses = [o.status if isinstance(o, Refused) else 200 for o in outcomes]
        assert statuses.count(503) == 1 and statuses.count(200) == 5, statuses
        assert pool.replaced == 1 and victim not in pool.pids and len(pool.pids) == 2
        later = run(pool, [(signed(fleet, NODES[k % 3], 100 + k), addrs) for k in range(6)])
        assert all(isinstance(o, Checked) for o in later)
    finally:
        pool.close()


def test_detach_answers_what_waits_and_close_ends_every_worker(fleet):
    pool = CheckerPool(1, fleet.controller_socket)
    pids = pool.pids
    loop = asyncio.new_event_loop()
    answers: list[Checked | Refused] = []

    async def main() -> None:
        pool.attach(loop)
        for k in range(5):  # one in the worker, four queued
            pool.submit(signed(fleet, "node02", 200 + k), time.time(), dict(fleet.node_addrs), answers.append)
        pool.detach()

    loop.run_until_complete(main())
    loop.close()
    assert [o.status for o in answers if isinstance(o, Refused)] == [503] * 5
    pool.close()
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


def test_an_answer_still_due_at_detach_is_never_taken_for_a_later_report(fleet):
    """Detached with a report in the worker, attached again: the late answer is dropped, and each
    later report gets its own outcome."""
    pool = CheckerPool(1, fleet.controller_socket)
    try:
        loop = asyncio.new_event_loop()
        answers: list[Checked | Refused] = []

        async def main() -> None:
            pool.attach(loop)
            pool.submit(signed(fleet, "node01", 300), time.time(), dict(fleet.node_addrs), answers.append)
            pool.detach()

        loop.run_until_complete(main())
        loop.close()
        assert [o.status for o in answers if isinstance(o, Refused)] == [503]
        later = run(pool, [(signed(fleet, NODES[k % 3], 310 + k), dict(fleet.node_addrs)) for k in range(3)])
        assert [(o.node, o.doc["seq"]) for o in later if isinstance(o, Checked)] == \
            [(NODES[k % 3], 310 + k) for k in range(3)]
    finally:
        pool.close()


def test_the_number_of_processes_is_bounded():
    with pytest.raises(ValueError, match="report processes"):
        CheckerPool(0, None)
