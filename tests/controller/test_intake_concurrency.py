"""The report intake under concurrency, end to end: real munged daemons, the real Controller behind
the real ControllerHTTPServer with its verifier threads or its worker processes, reports posted from
many connections at once.
Every refusal rule still holds when the reports that break it arrive together with good ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from healthd.envelope import sign_report
from tests.controller.munge_support import munged_path
from tests.support import wire
from tests.support.controller_rig import ControllerRig

NODES = ["node01", "node02", "node03", "node04"]
"""The nodes of tests/controller/conftest.py's `fleet`."""

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")


@pytest.fixture(params=[0, 2], ids=["in-process", "2-processes"])
def rig(fleet, tmp_path, request):
    r = ControllerRig(fleet, tmp_path, "observe", report_processes=request.param)
    yield r
    r.close()


def doc(node: str, seq: int) -> dict:
    return {"node": node, "verdict": "healthy", "findings": [], "seq": seq}


def post_all(rig: ControllerRig, bodies: list[bytes], workers: int = 16) -> list[tuple[int, dict]]:
    """Each body on a new connection (as agents post), `workers` at a time; answers in body order."""
    addr = rig.server.server_address[:2]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda b: wire.exchange(addr, wire.raw_post("/v1/report", b, "Connection: close\r\n")), bodies))


def test_concurrent_reports_are_each_stored_once_with_the_latest_per_node(rig):
    """200 signed reports, 50 per node, 16 connections at a time: all accepted, the accepted counter
    counts each once, and every node has its report stored."""
    bodies = [sign_report(doc(node, k), node, rig.fleet.socket(node)) for k in range(50) for node in NODES]
    answers = post_all(rig, bodies)
    assert [s for s, _ in answers] == [200] * len(bodies)
    assert sorted(rig.controller.reports) == NODES
    accepted = rig.controller.metrics.registry.get_sample_value("healthd_controller_reports_total", {"result": "accepted"})
    assert accepted == len(bodies)


def test_the_same_credential_on_many_connections_at_once_is_accepted_once(rig):
    """A replayed credential racing its original through different verifier threads: munged's replay
    cache decides, exactly one 200 and the others 409."""
    body = sign_report(doc("node02", 1), "node02", rig.fleet.socket("node02"))
    answers = post_all(rig, [body] * 12, workers=12)
    statuses = sorted(s for s, _ in answers)
    assert statuses == [200] + [409] * 11, statuses


def test_every_refusal_holds_among_concurrent_good_reports(rig):
    """Forgeries of each kind mixed into a stream of good reports: each refused with its status, each
    good one accepted, whatever verifier thread took it."""
    good = [sign_report(doc(n, k), n, rig.fleet.socket(n)) for k in range(10) for n in NODES]
    cross = sign_report(doc("node03", 0), "node03", rig.fleet.socket("node02"))  # made on node02, claims node03
    tampered = sign_report(doc("node01", 0), "node01", rig.fleet.socket("node01")).replace(b'"healthy"', b'"failed"')
    replay_src = sign_report(doc("node04", 99), "node04", rig.fleet.socket("node04"))
    unknown = sign_report(doc("node99", 0), "node99", rig.fleet.socket("node01"))
    bad = [(cross, 403), (tampered, 401), (unknown, 403), (b"{not json", 400), (b'{"v": 1}', 400)]
    assert wire.exchange(rig.server.server_address[:2], wire.raw_post("/v1/report", replay_src))[0] == 200
    bad.append((replay_src, 409))
    mixed = good[:20] + [b for b, _ in bad] + good[20:]
    answers = post_all(rig, mixed)
    want = dict(bad)
    for body, (status, answer) in zip(mixed, answers, strict=True):
        assert status == want.get(body, 200), (body[:80], status, answer)


@pytest.mark.parametrize("processes", [0, 2])
def test_shutdown_under_load_leaves_no_thread(fleet, tmp_path, processes):
    before = set(threading.enumerate())
    r = ControllerRig(fleet, tmp_path, "observe", report_processes=processes)
    workers = r.controller.checkers.pids if processes else []
    bodies = [sign_report(doc(n, k), n, fleet.socket(n)) for k in range(20) for n in NODES]
    addr = r.server.server_address[:2]

    def post(b: bytes) -> int:
        try:
            return wire.exchange(addr, wire.raw_post("/v1/report", b, "Connection: close\r\n"))[0]
        except (OSError, AssertionError):  # aborted by the shutdown (no answer), or nothing listens any more
            return 0

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, b) for b in bodies]
        time.sleep(0.05)
        r.close()
        results = [f.result() for f in futures]
    assert set(results) <= {200, 0}
    stray = [t for t in set(threading.enumerate()) - before if t.name.startswith("healthd-controller")]
    assert stray == []
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []  # every worker process ended
