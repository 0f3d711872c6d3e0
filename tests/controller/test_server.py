"""The controller's HTTP server on its own: the strict parser's answers, timeouts, keep-alive, shutdown.

A stub controller stands in for the real one (MUNGE is tested in test_daemon / test_auth); requests
are written as raw bytes over a socket so malformed ones can be sent at all.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd.controller.server import ControllerHTTPServer
from tests.support import wire
from tests.support.stub_controller import StubController
from tests.support.wire import closed_by_server, raw_post, read_response


@pytest.fixture
def server():
    ctl = StubController()
    srv = ControllerHTTPServer("127.0.0.1:0", ctl, max_bytes=1000, request_timeout_s=0.5, idle_timeout_s=0.5,
                               max_connections=50)
    thread = srv.start_background()
    srv.ctl = ctl  # type: ignore[attr-defined]
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def connect(srv: ControllerHTTPServer) -> socket.socket:
    return wire.connect(srv.server_address[:2])


def exchange(srv: ControllerHTTPServer, raw: bytes) -> tuple[int, dict]:
    return wire.exchange(srv.server_address[:2], raw)


def test_healthz_and_report(server):
    assert exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, {"ok": True})
    assert exchange(server, raw_post("/v1/report", b"{}")) == (200, {"accepted": True, "instructions": []})
    assert server.ctl.reports == [(b"{}", "127.0.0.1")]


def test_keep_alive_two_requests_on_one_connection(server):
    with connect(server) as sock:
        sock.sendall(raw_post("/v1/report", b"one"))
        assert read_response(sock)[0] == 200
        sock.sendall(raw_post("/v1/report", b"two"))
        status, headers, _ = read_response(sock)
        assert status == 200 and "connection" not in headers
        # and pipelined: two requests in one write, two answers in order
        sock.sendall(raw_post("/v1/report", b"three") + b"GET /healthz HTTP/1.1\r\n\r\n")
        assert read_response(sock)[0] == 200
        assert json.loads(read_response(sock)[2]) == {"ok": True}
    assert [b for b, _ in server.ctl.reports] == [b"one", b"two", b"three"]


def test_connection_close_is_honoured(server):
    with connect(server) as sock:
        sock.sendall(raw_post("/v1/report", b"x", "Connection: close\r\n"))
        status, headers, _ = read_response(sock)
        assert status == 200 and headers["connection"] == "close"
        assert closed_by_server(sock)
    with connect(server) as sock:  # HTTP/1.0 closes by default
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert read_response(sock)[0] == 200
        assert closed_by_server(sock)


@pytest.mark.parametrize("raw", [
    b"garbage\r\n\r\n",
    b"GET /healthz\r\n\r\n",
    b"GET /healthz HTTP/2.0\r\n\r\n",
    b"GET  /healthz HTTP/1.1\r\n\r\n",
    b"G(T /healthz HTTP/1.1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n folded: header\r\n\r\n",
    b"POST /v1/report HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
])
def test_malformed_request_is_400_and_closed(server, raw):
    with connect(server) as sock:
        sock.sendall(raw)
        status, headers, body = read_response(sock)
        assert status == 400 and headers["connection"] == "close" and "error" in json.loads(body)
        assert closed_by_server(sock)
    assert server.ctl.reports == []


def test_unsupported_method_is_501(server):
    assert exchange(server, b"DELETE /v1/report HTTP/1.1\r\n\r\n")[0] == 501


def test_post_without_content_length_is_411(server):
    assert exchange(server, b"POST /v1/report HTTP/1.1\r\nHost: x\r\n\r\n") == (
        411, {"accepted": False, "error": "Content-Length required"})
    # chunked framing is not supported: the same answer
    assert exchange(server, b"POST /v1/report HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")[0] == 411
    assert exchange(server, b"POST /v1/report HTTP/1.1\r\nContent-Length: 1x\r\n\r\n")[0] == 411
    assert exchange(server, "POST /v1/report HTTP/1.1\r\nContent-Length: ²\r\n\r\n".encode("latin-1"))[0] == 411


def test_oversized_body_is_413_without_reading_it(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/report HTTP/1.1\r\nContent-Length: 1001\r\n\r\n")  # no body sent at all
        status, headers, body = read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body) == {"accepted": False, "error": "body is 1001 bytes, over the 1000-byte limit"}
        assert closed_by_server(sock)
    # a client that does send the big body still gets the 413 (lingering close, no RST first)
    assert exchange(server, raw_post("/v1/report", b"x" * 50_000))[0] == 413
    assert server.ctl.reports == []


def test_huge_headers_are_refused(server):
    assert exchange(server, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n")[0] == 414
    many = b"".join(b"X-%d: y\r\n" % i for i in range(101))
    assert exchange(server, b"GET /healthz HTTP/1.1\r\n" + many + b"\r\n")[0] == 431


def test_404(server):
    assert exchange(server, b"GET /nope HTTP/1.1\r\n\r\n") == (404, {"error": "no such endpoint '/nope'"})
    assert exchange(server, raw_post("/v1/nope", b"{}")) == (404, {"error": "no such endpoint '/v1/nope'"})
    assert exchange(server, raw_post("/healthz", b"{}"))[0] == 404


def test_handler_exception_is_500_and_server_lives(server):
    assert exchange(server, raw_post("/v1/report", b"boom")) == (500, {"error": "internal error: RuntimeError"})
    assert exchange(server, b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200


def test_slow_client_is_timed_out(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/report HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # 7 bytes never come
        t = time.monotonic()
        status, _, _ = read_response(sock)
        assert status == 408 and closed_by_server(sock)
        assert 0.3 < time.monotonic() - t < 3
    with connect(server) as sock:  # dripping header bytes does not reset the clock (slow-loris)
        t = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        for _ in range(30):  # a header line every 0.1 s until the server answers
            if select.select([sock], [], [], 0.1)[0]:
                break
            sock.sendall(b"X: y\r\n")
        status, _, body = read_response(sock)
        took = time.monotonic() - t
        assert status == 408, body  # the request timeout, not some other refusal of the drip
        assert 0.3 < took < 3, took
        assert closed_by_server(sock)


def test_idle_keep_alive_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert read_response(sock)[0] == 200
        t = time.monotonic()
        assert closed_by_server(sock)
        assert 0.3 < time.monotonic() - t < 3  # kept open while idle, closed at the idle timeout


def test_drain_request_runs_off_the_loop(server):
    """A /v1/request waiting on Slurm does not hold up reports on other connections."""
    server.ctl.request_delay_s = 1.0
    with connect(server) as slow:
        slow.sendall(raw_post("/v1/request", b"{}"))
        time.sleep(0.1)
        t = time.monotonic()
        assert exchange(server, raw_post("/v1/report", b"fast"))[0] == 200
        assert time.monotonic() - t < 0.5
        assert read_response(slow)[2] == b'{"granted":true,"reason":"ok"}'


def test_connection_cap_answers_503(server):
    # 50 open (max_connections) from five addresses, each under max_connections_per_peer
    addr = server.server_address[:2]
    socks = [socket.create_connection(addr, timeout=5, source_address=(f"127.0.0.{2 + i % 5}", 0)) for i in range(50)]
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            status, _, body = read_response(extra)
            assert (status, body) == (503, b'{"accepted":false,"error":"too many connections"}')
    finally:
        for s in socks:
            s.close()


def test_shutdown_stops_every_thread():
    before = set(threading.enumerate())
    srv = ControllerHTTPServer("127.0.0.1:0", StubController())
    srv.start_background()
    exchange(srv, raw_post("/v1/request", b"{}"))  # starts a pool thread
    idle = connect(srv)  # an open keep-alive connection does not block shutdown
    srv.shutdown()
    srv.server_close()
    idle.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(srv.server_address[:2], timeout=1)


def test_shutdown_without_start_returns():
    srv = ControllerHTTPServer("127.0.0.1:0", StubController())
    srv.shutdown()
    srv.server_close()
    with pytest.raises(ConnectionRefusedError):  # the port it bound is closed too
        socket.create_connection(srv.server_address[:2], timeout=1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"GET ", b"POST ", b"/healthz", b"/v1/report", b" HTTP/1.1", b" HTTP/1.0", b"\r\n", b"\n",
                              b"Content-Length: ", b"5", b"-1", b"99999999999999999999", b"Connection: close",
                              b"Transfer-Encoding: chunked", b"Expect: 100-continue", b":", b" ", b"\x00", b"\xff"]),
             max_size=25).map(b"".join),
))
def test_fuzz_raw_bytes_never_kill_the_server(server, raw):
    with connect(server) as sock:
        sock.settimeout(2)
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # whatever comes back, the server must end the exchange
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
    # and it still serves
    assert exchange(server, b"GET /healthz HTTP/1.1\r\n\r\n") == (200, {"ok": True})


# ------------------------------------------------------------------ the report verifier threads


class _GatedController(StubController):
    """Holds every report until `gate` is set (a verifier busy on munged), counting the reports in hand."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.in_hand = 0
        self.lock = threading.Lock()

    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict]:
        with self.lock:
            self.in_hand += 1
        self.gate.wait(10)
        return super().receive_report(body, peer)


def test_reports_run_on_the_verifier_threads_not_the_loop():
    """While every verifier waits (as on a slow munged) the loop still answers other requests, and
    as many reports are in hand at once as there are verifier threads."""
    ctl = _GatedController()
    srv = ControllerHTTPServer("127.0.0.1:0", ctl, report_threads=3)
    srv.start_background()
    socks = [connect(srv) for _ in range(5)]
    try:
        for k, sock in enumerate(socks):
            sock.sendall(raw_post("/v1/report", b"r%d" % k))
        deadline = time.monotonic() + 5
        while ctl.in_hand < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert ctl.in_hand == 3  # three verifiers busy, two reports queued
        assert exchange(srv, b"GET /healthz HTTP/1.1\r\n\r\n") == (200, {"ok": True})
        ctl.gate.set()
        assert [read_response(s)[0] for s in socks] == [200] * 5
        assert sorted(b for b, _ in ctl.reports) == [b"r%d" % k for k in range(5)]
    finally:
        ctl.gate.set()
        for s in socks:
            s.close()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("report_threads", [0, 1, 4])
def test_many_concurrent_connections_lose_and_duplicate_no_report(report_threads):
    """600 reports from 24 client threads over 3 source addresses, a new connection each and keep-alive
    mixed: every one answered 200 exactly once, and each reached the controller exactly once."""
    ctl = StubController()
    srv = ControllerHTTPServer("127.0.0.1:0", ctl, report_threads=report_threads)
    srv.start_background()
    answers: list[tuple[bytes, int]] = []
    errors: list[BaseException] = []

    def client(k: int) -> None:
        source = f"127.0.0.{2 + k % 3}"
        try:
            sock = None
            for i in range(25):
                body = b"report-%d-%d" % (k, i)
                if sock is None:
                    sock = connect_from(srv, source)
                close = k % 2 == 0  # half the clients as agents do (a connection per report)
                sock.sendall(raw_post("/v1/report", body, "Connection: close\r\n" if close else ""))
                status, _, payload = read_response(sock)
                answers.append((body, status))
                assert payload == b'{"accepted":true,"instructions":[]}'
                if close:
                    sock.close()
                    sock = None
            if sock is not None:
                sock.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        sent = sorted(b"report-%d-%d" % (k, i) for k in range(24) for i in range(25))
        assert sorted(b for b, _ in answers) == sent and {s for _, s in answers} == {200}
        assert sorted(b for b, _ in ctl.reports) == sent  # none lost, none twice
    finally:
        srv.shutdown()
        srv.server_close()


def connect_from(srv: ControllerHTTPServer, source: str) -> socket.socket:
    return wire.connect(srv.server_address[:2], source=source)


def test_a_verifier_exception_is_500_and_every_verifier_lives():
    """A bug in receive_report is one 500 with the exception's type, for as many reports as there are
    verifiers and more: no thread dies, the next reports are accepted."""
    ctl = StubController()
    srv = ControllerHTTPServer("127.0.0.1:0", ctl, report_threads=2)
    srv.start_background()
    try:
        for _ in range(5):
            assert exchange(srv, raw_post("/v1/report", b"boom")) == (500, {"error": "internal error: RuntimeError"})
        assert all(t.is_alive() for t in srv._verifiers.threads)
        for k in range(4):
            assert exchange(srv, raw_post("/v1/report", b"ok%d" % k))[0] == 200
        assert [b for b, _ in ctl.reports] == [b"ok0", b"ok1", b"ok2", b"ok3"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_shutdown_with_reports_in_hand_stops_every_verifier():
    """Shutdown while verifiers hold reports and more are queued: the reports in hand finish, the
    queued ones are dropped (their connections are aborted: the agents send again), and no verifier
    thread outlives the server."""
    before = set(threading.enumerate())
    ctl = _GatedController()
    srv = ControllerHTTPServer("127.0.0.1:0", ctl, report_threads=2)
    srv.start_background()
    socks = [connect(srv) for _ in range(6)]
    for k, sock in enumerate(socks):
        sock.sendall(raw_post("/v1/report", b"r%d" % k))
    deadline = time.monotonic() + 5
    while ctl.in_hand < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    later = threading.Timer(0.3, ctl.gate.set)  # munged answers a little later
    later.start()
    srv.shutdown()
    srv.server_close()
    for s in socks:
        s.close()
    later.join(5)
    assert set(threading.enumerate()) - before == set()
    assert len(ctl.reports) == 2  # the two in hand; the four queued were never started


def test_report_threads_must_not_be_negative():
    with pytest.raises(ValueError, match="report_threads"):
        ControllerHTTPServer("127.0.0.1:0", StubController(), report_threads=-1)
