"""Bounded resources: one peer cannot keep agents' reports or root's healthctl out.

Real sockets and real servers throughout: the report server (ControllerHTTPServer with a stub
handler, as in test_server) driven from several loopback source addresses (all of 127.0.0.0/8 is
local on Linux), the admin socket flooded by a child process running as `nobody`, the rate-limited
log lines counted with caplog, and the unit's LimitNOFILE read from the file systemd reads.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from healthd.controller import admin
from healthd.controller.admin import call_admin, serve_admin_socket
from healthd.controller.config import ControllerSettings, parse_controller_settings
from healthd.controller.ledger import Ledger
from healthd.controller.server import ControllerHTTPServer, nofile_needed
from healthd.lograte import MAX_KEYS, OVERFLOW_KEY, RateLimitedLog
from tests.support import wire
from tests.support.as_nobody import AsNobody, needs_root
from tests.support.stub_controller import StubController
from tests.support.tmpdirs import shared_tmpdir
from tests.support.wire import closed_by_server, raw_post, read_response

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "healthd-controller.service"


def _need_fds(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _from(srv: ControllerHTTPServer, source: str) -> socket.socket:
    return wire.connect(srv.server_address[:2], source=source)


def _serve(**kw) -> ControllerHTTPServer:
    srv = ControllerHTTPServer("127.0.0.1:0", StubController(), max_bytes=1000, **kw)
    srv.ctl = srv.controller  # type: ignore[attr-defined]
    srv.start_background()
    return srv


@pytest.fixture
def serving():
    made: list[ControllerHTTPServer] = []

    def make(**kw) -> ControllerHTTPServer:
        srv = _serve(**kw)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.shutdown()
        srv.server_close()


def _refused_among(socks: list[socket.socket], wait_s: float = 2.0) -> int:
    """How many of `socks` the server answered 503 and closed (the others it holds, silent)."""
    refused = 0
    by_fd = {s.fileno(): s for s in socks}
    poller = select.poll()  # not select(): these descriptors go past 1024
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + wait_s
    while by_fd and time.monotonic() < deadline:
        events = poller.poll(200)
        if not events and refused:
            break
        for fd, _ in events:
            s = by_fd.pop(fd)
            poller.unregister(fd)
            try:
                got = read_response(s)
            except ConnectionResetError:
                got = None
            assert got is not None and got[0] == 503, got
            refused += 1
    return refused


def _exchange_from(srv: ControllerHTTPServer, source: str, raw: bytes) -> int:
    return wire.exchange(srv.server_address[:2], raw, source=source)[0]


def _report_latency(srv: ControllerHTTPServer, source: str = "127.0.0.1") -> float:
    t = time.monotonic()
    with _from(srv, source) as sock:
        sock.sendall(raw_post("/v1/report", b"{}"))
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body)["accepted"]
    return time.monotonic() - t


# ---------------------------------------------------------------------------------------- report server


def test_one_peer_holding_1000_idle_connections_does_not_keep_reports_out(serving):
    _need_fds(2500)
    srv = serving(max_connections=4096, max_connections_per_peer=32, idle_timeout_s=30.0)
    hog = [_from(srv, "127.0.0.2") for _ in range(1000)]
    try:
        refused = _refused_among(hog)
        assert refused == 1000 - 32
        assert srv._per_peer == {"127.0.0.2": 32}
        latencies = sorted(_report_latency(srv) for _ in range(20))
        assert latencies[-1] < 0.5, latencies
        # the hog itself still cannot get another one in
        with _from(srv, "127.0.0.2") as extra:
            assert read_response(extra)[0] == 503
        print(f"report latency with 1000 idle connections held by one peer: median {latencies[10] * 1e3:.2f} ms, "
              f"max {latencies[-1] * 1e3:.2f} ms")
    finally:
        for s in hog:
            s.close()
    assert srv.ctl.reports and all(peer == "127.0.0.1" for _, peer in srv.ctl.reports)


def test_peers_are_counted_separately_and_released(serving):
    srv = serving(max_connections=100, max_connections_per_peer=4, idle_timeout_s=30.0)
    two = [_from(srv, "127.0.0.2") for _ in range(4)]
    with _from(srv, "127.0.0.2") as fifth:
        status, headers, body = read_response(fifth)
        assert (status, headers["connection"]) == (503, "close")
        assert json.loads(body) == {"accepted": False, "error": "too many connections from this address"}
        assert closed_by_server(fifth)
    one = [_from(srv, "127.0.0.1") for _ in range(4)]
    for s in one:  # 127.0.0.1 has its own four, each one served
        s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert read_response(s)[0] == 200
    with _from(srv, "127.0.0.1") as fifth:
        assert read_response(fifth)[0] == 503
    assert srv._per_peer == {"127.0.0.1": 4, "127.0.0.2": 4}
    for s in two:
        s.close()
    deadline = time.monotonic() + 3
    while "127.0.0.2" in srv._per_peer and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "127.0.0.2" not in srv._per_peer  # closed connections give their place back
    assert _report_latency(srv, "127.0.0.2") < 1
    for s in one:
        s.close()


def test_global_cap_holds_across_peers(serving):
    srv = serving(max_connections=20, max_connections_per_peer=5, idle_timeout_s=30.0)
    held = [_from(srv, f"127.0.0.{i}") for i in range(2, 6) for _ in range(5)]
    try:
        time.sleep(0.2)
        with _from(srv, "127.0.0.9") as extra:  # a fresh address, but 20 are open
            assert read_response(extra)[2] == b'{"accepted":false,"error":"too many connections"}'
    finally:
        for s in held:
            s.close()


def test_a_connection_that_never_sends_a_byte_is_closed(serving):
    srv = serving(idle_timeout_s=0.5, request_timeout_s=5.0)
    with _from(srv, "127.0.0.3") as sock:
        t = time.monotonic()
        assert closed_by_server(sock)
        assert 0.4 < time.monotonic() - t < 3
    deadline = time.monotonic() + 3
    while srv._per_peer and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv._per_peer == {} and not srv._connections


def test_refusal_log_lines_are_rate_limited(serving, caplog):
    srv = serving(max_connections=100, max_connections_per_peer=2, idle_timeout_s=30.0, request_timeout_s=0.3,
                  log_interval_s=60.0)
    caplog.set_level(logging.INFO, logger="healthd.controller.server")
    held = [_from(srv, "127.0.0.2") for _ in range(2)]
    try:
        for _ in range(1500):  # over the per-address cap: each one a 503
            with _from(srv, "127.0.0.2") as s:
                try:
                    assert read_response(s)[0] == 503
                except ConnectionResetError:
                    pass
        for i in range(300):  # malformed: each one a 400 (from many addresses: the cap of 2 is not the point)
            assert _exchange_from(srv, f"127.0.1.{i % 250 + 1}", b"garbage\r\n\r\n") == 400
        for i in range(300):  # over max_bytes: each one a 413
            assert _exchange_from(srv, f"127.0.2.{i % 250 + 1}",
                                  b"POST /v1/report HTTP/1.1\r\nContent-Length: 5000\r\n\r\n") == 413
        slow = [_from(srv, "127.0.0.4") for _ in range(2)]
        for s in slow:  # slow-loris: a started request that never completes
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
        for s in slow:
            assert read_response(s)[0] == 408
            s.close()
    finally:
        for s in held:
            s.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "healthd.controller.server"]
    assert len([m for m in lines if "max_connections_per_peer" in m]) == 1, lines
    assert len([m for m in lines if "bad request" in m]) == 1, lines
    assert len([m for m in lines if "refused: 413" in m]) == 1, lines
    assert len([m for m in lines if "408" in m]) == 1, lines
    assert len(lines) == 4, lines
    assert srv._rlog.flush(force=True) == 4  # the held-back counts, one line per reason
    told = [r.getMessage() for r in caplog.records][-4:]
    assert "refused: max_connections_per_peer: 1499 more lines suppressed" in " | ".join(told)
    assert "bad request: 299 more lines suppressed" in " | ".join(told)
    assert "refused: 413: 299 more lines suppressed" in " | ".join(told)
    assert "request timeout: 1 more lines suppressed" in " | ".join(told)


def test_accept_failures_go_through_the_rate_limit(serving, caplog):
    """asyncio reports an accept() that hit the open-file limit to the loop's exception handler once
    per retry; the server's handler logs those through the rate limit instead."""
    srv = serving(log_interval_s=60.0)
    caplog.set_level(logging.ERROR)
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    for _ in range(100):
        srv._loop.call_soon_threadsafe(srv._loop_exception, srv._loop, context)
    time.sleep(0.3)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "accepting a connection failed" in msgs[0] and "RLIMIT_NOFILE" in msgs[0], msgs


# ---------------------------------------------------------------------------------------- the log helper


def test_rate_limited_log_counts_and_tells(caplog):
    now = [100.0]
    log = logging.getLogger("test.lograte")
    rl = RateLimitedLog(log, 10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.lograte")
    assert rl.warning("cap", "refused %s", "a")
    for _ in range(500):
        assert not rl.warning("cap", "refused %s", "b")
    assert rl.info("other", "a different reason")  # its own window
    now[0] += 10
    assert rl.warning("cap", "refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "a different reason", "refused c (500 more suppressed in the last 10 s)"]
    rl.warning("cap", "refused %s", "d")
    rl.warning("cap", "refused %s", "e")
    assert rl.flush() == 0  # the window has not ended
    now[0] += 11
    assert rl.flush() == 1  # "other" had nothing held back: nothing to tell
    assert caplog.records[-1].getMessage() == "cap: 2 more lines suppressed in the last 11 s"
    assert caplog.records[-1].levelno == logging.WARNING
    assert rl.warning("cap", "refused %s", "f")  # a told window is forgotten: the next line goes out
    caplog.clear()
    for i in range(MAX_KEYS + 50):  # keys are reasons; a caller passing addresses cannot grow it unbounded
        rl.info(f"k{i}", "line %d", i)
    assert len(rl._windows) <= MAX_KEYS + 1 and OVERFLOW_KEY in rl._windows
    assert not rl.debug("cap", "below the logger's level")


# ---------------------------------------------------------------------------------------- open-file limit


def test_unit_limit_nofile_covers_the_limits():
    limits = [ln.split("=", 1)[1] for ln in UNIT.read_text().splitlines() if ln.startswith("LimitNOFILE=")]
    assert len(limits) == 1
    admin_bound = admin.ADMIN_MAX_CLIENTS + admin.ADMIN_PRIVILEGED_CLIENTS + admin.ADMIN_BACKLOG
    needed = nofile_needed(ControllerSettings().max_connections)
    assert needed >= ControllerSettings().max_connections + admin_bound
    assert int(limits[0]) >= needed * 1.5  # headroom


_CHILD_LIMIT = """
import logging, resource, sys
logging.basicConfig(format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
from healthd.controller.server import check_nofile
print(check_nofile(5000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize(("soft", "hard", "raised", "warned"), [(256, 20000, 5000, False), (256, 512, 512, True)])
def test_check_nofile_raises_the_soft_limit_or_warns_once(soft, hard, raised, warned):
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip("the hard limit here is lower than the case needs")
    p = subprocess.run([sys.executable, "-c", _CHILD_LIMIT.format(soft=soft, hard=hard)], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(raised), str(raised)]
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == (1 if warned else 0), p.stderr
    if warned:
        assert "RLIMIT_NOFILE soft 512, hard 512" in warnings[0] and "5000" in warnings[0]


def test_limit_settings_load_and_are_checked():
    s = parse_controller_settings("max_connections: 100\nmax_connections_per_peer: 10\n")
    assert (s.max_connections, s.max_connections_per_peer) == (100, 10)
    assert (ControllerSettings().max_connections, ControllerSettings().max_connections_per_peer) == (4096, 32)
    for bad, key in (("max_connections: 0", "max_connections"), ("max_connections_per_peer: -1", "max_connections_per_peer"),
                     ("max_connections: 10\nmax_connections_per_peer: 11", "max_connections_per_peer"),
                     ("max_connections: many", "max_connections")):
        with pytest.raises(ValueError, match=key):
            parse_controller_settings(bad, "c.yaml")


# ---------------------------------------------------------------------------------------- admin socket


@pytest.fixture
def led(tmp_path: Path):
    with Ledger(tmp_path / "ledger.db") as lg:
        yield lg


@pytest.fixture
def sockdir():
    with shared_tmpdir("healthd-admin-") as d:
        yield d


def _flood(path: str, n: int, socks: list[socket.socket]) -> dict[str, int]:
    """Open `n` connections to the admin socket (kept in `socks`): how many the server answered
    `busy` (and closed), and how many it holds."""
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    busy = 0
    pending = {s.fileno(): s for s in socks}
    poller = select.poll()  # not select(): these descriptors go past 1024
    for fd in pending:
        poller.register(fd, select.POLLIN)
    while pending:
        events = poller.poll(1000)
        if not events:
            break
        for fd, _ in events:
            poller.unregister(fd)
            busy += b'"busy"' in _rest(pending.pop(fd))
    return {"connected": len(socks), "busy": busy, "held": len(pending), "uid": os.getuid()}


def _flood_as_nobody(path: str, n: int) -> AsNobody:
    """A child that became `nobody` floods the admin socket and keeps what it got until release()."""
    socks: list[socket.socket] = []  # the child's: held open while it waits
    return AsNobody(lambda: _flood(path, n, socks), hold=True)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_root
def test_one_user_holding_1000_admin_connections_keeps_out_neither_root_nor_reports(led: Ledger, sockdir: Path, serving):
    _need_fds(2500)
    path = str(sockdir / "admin.sock")
    reports = serving(max_connections_per_peer=32, idle_timeout_s=30.0)
    nobody = pwd.getpwnam("nobody").pw_uid
    with serve_admin_socket(path, led) as srv:
        assert call_admin(path, {"cmd": "ping"})["ok"]  # the loop and one root handler thread are up
        before = _threads()
        flood = _flood_as_nobody(path, 1000)
        got = flood.answer
        try:
            assert got == {"connected": 1000, "busy": 1000 - admin.ADMIN_MAX_CLIENTS_PER_UID,
                           "held": admin.ADMIN_MAX_CLIENTS_PER_UID, "uid": nobody}
            assert srv.open_connections()["per_uid"] == {nobody: admin.ADMIN_MAX_CLIENTS_PER_UID}
            during = _threads()
            times = []
            for _ in range(10):
                t = time.monotonic()
                ans = call_admin(path, {"cmd": "ping"}, timeout=1)
                times.append(time.monotonic() - t)
                assert ans["ok"] and ans["data"]["operator"] == "root"
            assert max(times) < 1.0, times
            latency = _report_latency(reports)
            assert latency < 0.5
            assert during - before <= 1, (before, during)  # no thread per connection
            print(f"admin: 1000 connections by uid {nobody}: {got['held']} held, threads {before} -> {during}, "
                  f"root ping max {max(times) * 1e3:.2f} ms, report {latency * 1e3:.2f} ms")
        finally:
            flood.release()
        deadline = time.monotonic() + 3
        while srv.open_connections()["users"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.open_connections() == {"privileged": 0, "users": 0, "per_uid": {}}


@needs_root
def test_users_together_are_bounded_and_root_has_its_own_allowance(led: Ledger, sockdir: Path):
    path = str(sockdir / "admin.sock")
    with serve_admin_socket(path, led, max_clients=4, max_clients_per_uid=8, max_privileged_clients=2) as srv:
        flood = _flood_as_nobody(path, 10)
        got = flood.answer
        try:
            assert (got["held"], got["busy"]) == (4, 6)  # the global bound for non-root uids
            held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
            for s in held:
                s.connect(path)
            assert call_admin(path, {"cmd": "ping"}) == {  # root's allowance is full too: it says so
                "ok": False, "error": "busy", "message": "too many admin connections: 2 open from privileged uids"}
            held.pop().close()
            time.sleep(0.1)
            assert call_admin(path, {"cmd": "ping"}, timeout=1)["ok"]
            held[0].close()
            assert srv.open_connections()["users"] == 4
        finally:
            flood.release()


def test_per_uid_bound_in_process(led: Ledger, sockdir: Path):
    """With no privileged uid, this process's own uid is an ordinary user: three, then `busy`."""
    path = str(sockdir / "admin.sock")
    with serve_admin_socket(path, led, allowed_uids=(), max_clients_per_uid=3) as srv:
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        for s in socks:
            s.connect(path)
        ans = call_admin(path, {"cmd": "ping"})
        assert ans["error"] == "busy" and f"uid {os.getuid()}: 3 open, at most 3 per user" in ans["message"]
        f = socks[0].makefile("rwb")  # the held ones are served
        f.write(b'{"cmd": "ping"}\n')
        f.flush()
        assert json.loads(f.readline())["ok"]
        f.close()
        socks[0].close()
        deadline = time.monotonic() + 3
        while srv.open_connections()["users"] > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert call_admin(path, {"cmd": "ping"})["ok"]  # a place came free
        for s in socks[1:]:
            s.close()


@pytest.fixture
def quick(led: Ledger, sockdir: Path):
    with serve_admin_socket(str(sockdir / "admin.sock"), led, idle_timeout_s=0.5) as srv:
        yield srv


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _rest(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_admin_idle_connection_is_closed_after_the_timeout(quick):
    with _connect(quick.path) as s:
        t = time.monotonic()
        data = _rest(s)
        assert 0.4 < time.monotonic() - t < 3
        assert json.loads(data)["error"] == "timeout"


def test_admin_partial_line_never_completes(quick):
    with _connect(quick.path) as s:
        t = time.monotonic()
        s.sendall(b'{"cmd": "pi')
        for _ in range(40):  # dripping does not extend the deadline: a byte every 0.1 s until the answer
            if select.select([s], [], [], 0.1)[0]:
                break
            try:
                s.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break  # the answer and the close came just after the select: read what was answered
        data = _rest(s)
        took = time.monotonic() - t
    assert json.loads(data)["error"] == "timeout", data  # the line's deadline, not some other refusal
    assert 0.4 < took < 3, took


def test_admin_timer_restarts_after_each_answer_and_eof_is_answered(quick):
    with _connect(quick.path) as s:
        f = s.makefile("rwb")
        for _ in range(3):
            time.sleep(0.3)  # each under the timeout, together over it
            f.write(b'{"cmd": "ping"}\n')
            f.flush()
            assert json.loads(f.readline())["ok"]
        f.close()
    with _connect(quick.path) as s:  # printf '...' | nc -U: two lines, then EOF; both are answered
        s.sendall(b'{"cmd": "ping"}\n{"cmd": "breaker"}\n')
        s.shutdown(socket.SHUT_WR)
        answers = [json.loads(line) for line in _rest(s).splitlines()]
        assert [a["message"] for a in answers] == ["pong", "closed"]


def test_admin_oversized_line_is_refused_and_closed(quick):
    with _connect(quick.path) as s:
        try:
            s.sendall(b"x" * (admin.MAX_REQUEST_BYTES + 10))
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _rest(s)
    assert json.loads(data) == {"ok": False, "error": "bad-request", "message": "request too large"}


def test_admin_handlers_run_off_the_loop(led: Ledger, sockdir: Path):
    """A handler stuck on the ledger holds one handler thread, not the loop: root still gets answers."""
    release = threading.Event()

    def slow(ledger, operator):
        release.wait(5)
        return admin.AdminResult(True, "slow")

    handlers = dict(admin.DEFAULT_HANDLERS, slow=admin.AdminHandler(slow, False))
    with serve_admin_socket(str(sockdir / "admin.sock"), led, handlers) as srv:
        got: list[dict] = []
        t = threading.Thread(target=lambda: got.append(call_admin(srv.path, {"cmd": "slow"})))
        t.start()
        time.sleep(0.1)
        start = time.monotonic()
        assert call_admin(srv.path, {"cmd": "ping"})["ok"]
        assert time.monotonic() - start < 1
        release.set()
        t.join(5)
        assert got == [{"ok": True, "message": "slow", "data": {}}]


def test_admin_close_stops_every_thread(led: Ledger, sockdir: Path):
    before = set(threading.enumerate())
    srv = serve_admin_socket(str(sockdir / "admin.sock"), led)
    assert call_admin(srv.path, {"cmd": "ping"})["ok"]
    idle = _connect(srv.path)
    srv.close()
    srv.close()  # idempotent
    assert _rest(idle) == b""
    idle.close()
    assert set(threading.enumerate()) - before == set()
    assert not os.path.exists(srv.path)


def test_admin_refusals_are_rate_limited(led: Ledger, sockdir: Path, caplog):
    caplog.set_level(logging.INFO, logger="healthd.controller.admin")
    path = str(sockdir / "admin.sock")
    with serve_admin_socket(path, led, allowed_uids=(), max_clients_per_uid=1, log_interval_s=60.0) as srv:
        with _connect(path):
            for _ in range(500):
                assert call_admin(path, {"cmd": "ping"})["error"] == "busy"
        lines = [r.getMessage() for r in caplog.records if r.name == "healthd.controller.admin"]
        assert len(lines) == 1 and re.search(r"uid \d+ refused: 1 connections open from it", lines[0]), lines
        assert srv._rlog.flush(force=True) == 1
        assert "499 more lines suppressed" in caplog.records[-1].getMessage()
