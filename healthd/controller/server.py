"""The controller's HTTP endpoint: a small, strict HTTP/1.1 server on its own asyncio event loop.

    POST /v1/report   a signed report envelope (healthd.controller.auth); 200 {"accepted": true,
                      "instructions": []} or the refusal's HTTP status with {"accepted": false, "error"}
    POST /v1/request  a signed envelope whose report is {"kind": "drain-request", "node", "finding",
                      "job"} from a prolog in `controller` gating mode; 200 {"granted": bool, "reason"}
    POST /v1/goodput  a signed envelope whose report is a node's goodput log lines {"kind":
                      "goodput-lines", "job", "offset", "data"} (healthd.controller.goodput_gather);
                      200 {"accepted": true, "through": N} or the refusal's status
    GET  /healthz     200 {"ok": true}

Why not http.server: every agent opens a new connection per report (a fleet of 10k nodes must not
hold 10k idle keep-alive connections), and the stdlib ThreadingHTTPServer spent about 1 ms of CPU per
connection on its thread spawn, rfile/wfile wrappers and email-module header parsing: ~900 reports/s
on a 2-core head node, when MUNGE verification alone runs ~4,000/s. Here one event-loop thread owns
every socket; a request costs a buffer split and a dict, and no thread is created per connection.

What the parser accepts (anything else is answered, never raised):
  * request line `METHOD SP target SP HTTP/1.x` (400), at most 8 KiB (414); headers at most 64 KiB
    and 100 lines (431); CRLF or bare LF line ends (as http.server accepted).
  * POST needs Content-Length (411; Transfer-Encoding is not supported, so chunked bodies get 411
    too); a body over max_bytes is refused with 413 BEFORE it is read, then the connection is
    closed after draining briefly (a lingering close, so the client sees the 413 rather than a RST).
  * GET, POST only (501). HTTP/1.1 keeps the connection open unless `Connection: close`; HTTP/1.0
    closes it unless `Connection: keep-alive`. `Expect: 100-continue` (curl, for bodies > 1 KiB) is
    answered when the body is wanted.
Timeouts: a request (headers and body) must arrive within request_timeout_s of its first byte (no
slow-loris pinning a connection); an idle keep-alive connection, and a new one that has not sent a
byte yet, is closed after idle_timeout_s.

Bounds: at most max_connections are open at once, and at most max_connections_per_peer from one
source address, so one address holding idle connections cannot keep the fleet's reports out. A
connection over either bound is answered 503 at once and closed, without reading anything from it.
Refusals, timeouts and malformed requests are logged through a RateLimitedLog: at most one line per
reason per LOG_INTERVAL_S, with the count of the lines it held back. At bind time the soft
RLIMIT_NOFILE is raised towards what max_connections needs (nofile_needed), with one warning when
the hard limit does not allow it.

/v1/report runs on report_threads verifier threads (ReportVerifiers): the loop parses HTTP and hands
the body over; a verifier runs Controller.receive_report (MUNGE decode, digest, schema, the store
under its lock) and the answer comes back to the loop in batches. Why: inline, every report held
the loop for its blocking round trip to munged, so a slow or stalled munged stopped accepts, /healthz
and every other connection with it; libmunge's decode runs with the GIL released (healthd.munge), so
the verifiers overlap their munged waits with each other and with the loop's HTTP work. What it buys
in throughput is small where the CPU is the limit: on a 2-core head node, a new connection per report
measured within noise of inline (the Python work of a report, ~0.65 ms of CPU, is serialised by the
GIL either way) and keep-alive ~15 % slower (the thread hop and GIL hand-offs cost more than the
overlap saves): docs/benchmarks.md "Controller, whole path". report_threads=0 runs receive_report
inline on the loop (the benchmark's baseline). A connection stops reading while its report is verified.
When the controller checks reports in worker processes (report_processes, healthd.controller.verifier),
the loop hands each body to a worker through a socket it watches, and stores the checked report itself
when the answer comes: no thread hop, and the checks run on other cores.
/v1/request may wait on Slurm for up to ~20 s, so it runs in a small thread pool of its own, as does
/v1/goodput (a disk write); their connections stop reading meanwhile too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import ipaddress
import collections
import json
import logging
import queue
import re
import resource
import socket
import threading
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Protocol

from healthd.envelope import DEFAULT_MAX_BYTES
from healthd.lograte import RateLimitedLog

if TYPE_CHECKING:
    from healthd.controller.verifier import CheckerPool

_log = logging.getLogger("healthd.controller.server")

SERVER_NAME = "healthd-controller"
MAX_REQUEST_LINE = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
# how long / how much of a refused body we drain before closing (a lingering close)
LINGER_S = 2.0
WRITE_BUFFER_HIGH = 256 * 1024  # a client that pipelines without reading answers: stop reading it
REFUSALS_PER_ACCEPT = 256  # refused in one accept() call at most, so a flood cannot hold the loop
DEFAULT_MAX_CONNECTIONS = 4096
LISTEN_BACKLOG = 1024
DEFAULT_MAX_CONNECTIONS_PER_PEER = 32
LOG_INTERVAL_S = 10.0
"""At most one log line per reason (refusal, timeout, malformed request) per this many seconds."""
DEFAULT_REPORT_THREADS = 4
"""Verifier threads for /v1/report: the best of 2, 4 and 8 measured on a 2-core head node with a new
connection per report (bench/controller_path.py); munged itself runs 2 threads by default."""
NOFILE_RESERVE = 512
"""File descriptors the controller needs besides report connections: the admin socket's clients
(healthd.controller.admin bounds them to under 100), the ledger (database, WAL, shared memory, a
read-only handle), Slurm client children's pipes (three per scontrol/srun, one per request thread
and validation), MUNGE and journald sockets, metrics scrapes, listening sockets and stdio."""

_HEADER_END = re.compile(rb"\r?\n\r?\n")
_LINE_SPLIT = re.compile(rb"\r?\n")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: methods and header names
_VERSION = re.compile(rb"HTTP/1\.[01]")
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII only (str.isdigit also takes '²', which int() refuses)


def nofile_needed(max_connections: int) -> int:
    """The RLIMIT_NOFILE the controller needs to hold max_connections report connections."""
    return max_connections + NOFILE_RESERVE


def check_nofile(needed: int, log: logging.Logger | None = None) -> int:
    """Make the soft RLIMIT_NOFILE at least `needed` where the hard limit allows (systemd starts
    services with a soft limit of 1024 unless the unit's LimitNOFILE says otherwise; only select()
    users must stay under 1024, and nothing here uses select()). Logs one warning when the limit in
    force stays below `needed`. Returns the soft limit in force."""
    log = log or _log
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as exc:
                log.debug("cannot raise RLIMIT_NOFILE to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("the open-file limit (RLIMIT_NOFILE soft %d, hard %s) is below the %d the connection limits need; "
                    "connections past it fail to be accepted: raise LimitNOFILE in the unit or lower max_connections",
                    soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, needed)
    return soft


def _peer_address(peername: Any) -> str:
    """The source address a connection is counted against: an IPv4-mapped IPv6 address as IPv4."""
    if not peername:
        return "?"
    host = str(peername[0])
    if host.startswith("::ffff:"):
        try:
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
        except ValueError:
            mapped = None
        if mapped is not None:
            return str(mapped)
    return host


class _Listener(socket.socket):
    """The listening socket. asyncio's accept loop calls its accept(), which answers connections over
    the server's bounds itself (503 in one send, then close) and returns only admitted ones: a refused
    connection costs an accept, a send and a close, never an asyncio transport, task and protocol."""

    admit: Callable[[socket.socket, Any], bool] | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        admit = self.admit
        for _ in range(REFUSALS_PER_ACCEPT):
            conn, addr = super().accept()  # BlockingIOError when none waits: asyncio's cue to stop
            if admit is None or admit(conn, addr):
                return conn, addr
        raise BlockingIOError  # more wait: asyncio comes back to them after the loop's other work


def _listen(host: str, port: int, backlog: int) -> _Listener:
    """socket.create_server, on a _Listener."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = _Listener(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class Handler(Protocol):
    """The controller as the server sees it. When it has `checkers` (a CheckerPool: report_processes),
    /v1/report goes through its receive_report_later on the loop instead of receive_report."""

    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]: ...

    def receive_request(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]: ...

    def receive_goodput(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]: ...


class _BadRequest(Exception):
    """A request we answer with `status` and then close the connection (framing is lost)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Request:
    __slots__ = ("method", "target", "version", "request_line", "headers", "keep_alive", "length", "expect_continue")

    def __init__(self, method: str, target: str, version: str, request_line: str, headers: dict[str, str]):
        self.method = method
        self.target = target
        self.version = version
        self.request_line = request_line
        self.headers = headers
        conn = headers.get("connection", "").lower()
        if version == "HTTP/1.1":
            self.keep_alive = "close" not in conn
        else:
            self.keep_alive = "keep-alive" in conn
        self.length: int | None = None
        self.expect_continue = version == "HTTP/1.1" and headers.get("expect", "").lower() == "100-continue"


def _parse_head(head: bytes) -> _Request:
    """The request line and headers (without the blank line). Raises _BadRequest."""
    lines = _LINE_SPLIT.split(head)
    raw_line = lines[0]
    if len(raw_line) > MAX_REQUEST_LINE:
        raise _BadRequest(414, "request line too long")
    parts = raw_line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1] or not _VERSION.fullmatch(parts[2]):
        raise _BadRequest(400, f"bad request line {raw_line[:80]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise _BadRequest(431, "too many headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):  # also refuses obsolete line folding (leading space)
            raise _BadRequest(400, f"bad header line {line[:80]!r}")
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key in headers:
            if key in ("content-length", "host"):  # ambiguous framing or target: refuse (smuggling)
                raise _BadRequest(400, f"duplicate {key} header")
            headers[key] = headers[key] + ", " + text
        else:
            headers[key] = text
    target = parts[1].decode("latin-1")
    return _Request(parts[0].decode("ascii"), target, parts[2].decode("ascii"), raw_line.decode("latin-1"), headers)


_date_cache: list[Any] = [0, b""]


def _http_date() -> bytes:
    """The Date header's value, formatted once a second (formatdate costs more than the rest)."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = email.utils.formatdate(now, usegmt=True).encode()
    return _date_cache[1]


def _response(status: int, payload: dict[str, Any], close: bool) -> bytes:
    """One buffer, one write: headers and body leave in the same segment (no Nagle/delayed-ACK stall)."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    head = (f"HTTP/1.1 {status} {phrase}\r\nServer: {SERVER_NAME}\r\nDate: ").encode() + _http_date() + (
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        + ("Connection: close\r\n" if close else "") + "\r\n").encode()
    return head + data


class FlowControlled(asyncio.Protocol):
    """Reading paused while a request is handled (or answers pile up) and resumed after, idempotently,
    and one deadline timer: the report server's and the admin socket's connections both work this way."""

    transport: Any = None
    reading_paused = False
    timer: asyncio.TimerHandle | None = None

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.transport.is_closing():
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.transport.is_closing():
            self.reading_paused = False
            self.transport.resume_reading()


class _Connection(FlowControlled):
    """One client connection: a state machine fed by data_received.

    States: "idle" (waiting for a request's first byte), "head" (reading the request line and
    headers), "body" (reading Content-Length bytes), "busy" (a /v1/request runs in the pool; reading
    paused), "linger" (answered and half-closed; discarding what the client still sends), "closed".
    """

    def __init__(self, server: ControllerHTTPServer):
        self.server = server
        self.loop = server._loop
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.buf = bytearray()
        self.state = "idle"
        self.request: _Request | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.write_paused = False
        self.eof = False
        self.counted = False

    # ---------------------------------------------------------------- transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        # admitted and counted against the bounds by the listener's accept() (ControllerHTTPServer._admit)
        self.peer = _peer_address(transport.get_extra_info("peername"))
        self.counted = True
        server._connections.add(self)
        if server._stopping:  # accepted while the server shuts down
            self.state = "closed"
            transport.abort()  # type: ignore[attr-defined]
            return
        # a connection that never sends a byte is closed like an idle keep-alive one
        self._set_timer(server.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = "closed"
        self._cancel_timer()
        if self.counted:
            self.counted = False
            self.server._connections.discard(self)
            self.server._release(self.peer)
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        if self.state == "linger":
            return  # the answer is out; this is the refused body, drained so the client is not RST
        if self.state == "closed":
            return
        self.buf += data
        if self.state == "idle":
            self.state = "head"
            # the whole request (headers and body) must arrive within request_timeout_s of its first byte
            self._set_timer(self.server.request_timeout_s)
        self._process()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.state in ("head", "body") and self.buf.strip():
            _log.debug("%s closed mid-request (%d bytes unread)", self.peer, len(self.buf))
        # close our side too, unless a /v1/request is running: its answer is still written (half-close)
        return self.state == "busy"

    def pause_writing(self) -> None:
        self.write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.state != "busy":
            self._resume_reading()
            self._process()

    # ---------------------------------------------------------------- the request cycle

    def _process(self) -> None:
        """Parse and answer as many complete requests as the buffer holds (pipelining is allowed)."""
        while self.state in ("head", "body") and not self.write_paused:
            try:
                if self.state == "head" and not self._read_head():
                    return
                if self.state == "body" and not self._read_body():
                    return
            except _Refused as exc:
                self._finish(exc.status, exc.payload, close=True)
                return
            except _BadRequest as exc:
                self.server._rlog.info("bad request", "%s bad request: %d %s", self.peer, exc.status, exc.reason)
                self._finish(exc.status, {"error": exc.reason}, close=True)
                return

    def _read_head(self) -> bool:
        """True when a request head was parsed (and the state moved on)."""
        end = _HEADER_END.search(self.buf)
        if (end.start() if end else len(self.buf)) > MAX_HEADER_BYTES:
            first = self.buf.find(b"\n")
            if first < 0 or first > MAX_REQUEST_LINE:
                raise _BadRequest(414, "request line too long")
            raise _BadRequest(431, "request headers too large")
        if end is None:
            return False
        head = bytes(self.buf[:end.start()])
        del self.buf[:end.end()]
        if not head.strip():  # stray blank lines before a request (RFC 9112 2.2): skip them
            if not self.buf:
                self.state = "idle"
                self._set_timer(self.server.idle_timeout_s)
            return True
        req = self.request = _parse_head(head)
        if req.method not in ("GET", "POST"):
            raise _BadRequest(501, f"unsupported method {req.method[:20]!r}")
        self._route_checks(req)
        self.state = "body"
        return True

    def _route_checks(self, req: _Request) -> None:
        """Framing and the answers given before the body is read (411, 413, 404), as before."""
        length_text = req.headers.get("content-length")
        if "transfer-encoding" in req.headers:
            length_text = None  # chunked is not supported; a body we cannot frame ends the connection
            req.keep_alive = False
        if length_text is not None and not _DIGITS.fullmatch(length_text):
            if req.method == "POST":
                length_text = None  # answered 411 below, as http.server's handler did
            else:
                raise _BadRequest(400, "bad Content-Length")
        req.length = int(length_text) if length_text is not None else None
        if req.method == "GET":
            if req.length and req.length > self.server.max_bytes:
                raise _BadRequest(413, "body too large")
            req.length = req.length or 0
            return
        if req.target not in ("/v1/report", "/v1/request", "/v1/goodput"):
            self._refuse(404, {"error": f"no such endpoint {req.target[:80]!r}"})
            return
        if req.length is None:
            self.server._rlog.warning("refused: 411", "%s %s refused: 411 no Content-Length", self.peer, req.target)
            self._refuse(411, {"accepted": False, "error": "Content-Length required"})
            return
        if req.length > self.server.max_bytes:
            reason = f"body is {req.length} bytes, over the {self.server.max_bytes}-byte limit"
            self.server._rlog.warning("refused: 413", "%s %s refused: 413 %s", self.peer, req.target, reason)
            self._refuse(413, {"accepted": False, "error": reason})
            return
        if req.expect_continue and req.length > len(self.buf):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    def _refuse(self, status: int, payload: dict[str, Any]) -> None:
        """Answer without reading the body, then close: the body's framing is not trusted."""
        raise _Refused(status, payload)

    def _read_body(self) -> bool:
        req = self.request
        assert req is not None and req.length is not None
        if len(self.buf) < req.length:
            return False
        body = bytes(self.buf[:req.length])
        del self.buf[:req.length]
        self._dispatch(req, body)
        return True

    def _dispatch(self, req: _Request, body: bytes) -> None:
        if req.method == "GET":
            if req.target == "/healthz":
                self._finish(200, {"ok": True}, close=not req.keep_alive)
            else:
                self._finish(404, {"error": f"no such endpoint {req.target[:80]!r}"}, close=not req.keep_alive)
            return
        verifiers = self.server._verifiers
        if req.target == "/v1/report" and self.server._checkers is not None:
            # checked in a worker process; the loop stores it when the worker answers
            self.state = "busy"
            self._cancel_timer()
            self._pause_reading()
            self.server.controller.receive_report_later(body, self.peer, lambda result: self.deliver(req, result))
            return
        if req.target == "/v1/report" and verifiers is None:  # report_threads=0: inline on the loop
            status, payload = self._call(self.server.controller.receive_report, req, body)
            self._finish(status, payload, close=not req.keep_alive)
            return
        # a report to the verifiers; /v1/request may wait on Slurm for ~20 s, /v1/goodput on the disk:
        # all off the loop, and this connection stops reading until its answer is written
        self.state = "busy"
        self._cancel_timer()
        self._pause_reading()
        if req.target == "/v1/report":
            assert verifiers is not None
            verifiers.submit(self, req, body)
            return
        route = (self.server.controller.receive_request if req.target == "/v1/request"
                 else self.server.controller.receive_goodput)
        fut = self.loop.run_in_executor(self.server._pool, self._call, route, req, body)
        fut.add_done_callback(lambda f: self._request_done(req, f))

    def _call(self, route: Callable[[bytes, str], tuple[int, dict[str, Any]]], req: _Request,
              body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            return route(body, self.peer)
        except Exception as exc:  # a bug must not kill the loop or leave the client hanging
            _log.exception("%s %s failed", self.peer, req.target)
            return 500, {"error": f"internal error: {type(exc).__name__}"}

    def deliver(self, req: _Request, result: tuple[int, dict[str, Any]]) -> None:
        """answered(), for answers delivered in batches (the verifiers') or by the worker pool: this
        connection's failure is logged and ends it, and reaches neither the other answers nor the pool."""
        try:
            self.answered(req, result)
        except Exception:
            _log.exception("%s %s: writing the answer failed", self.peer, req.target)
            if self.transport is not None:
                self.transport.abort()

    def _request_done(self, req: _Request, fut: asyncio.Future) -> None:
        if self.state == "closed" or fut.cancelled():
            return
        self.answered(req, fut.result())

    def answered(self, req: _Request, result: tuple[int, dict[str, Any]]) -> None:
        """A request handled off the loop: write its answer and go on reading (on the loop)."""
        if self.state == "closed":
            return
        status, payload = result
        self._finish(status, payload, close=not req.keep_alive or self.eof)
        if self.state != "closed" and not self.write_paused:
            self._resume_reading()
            self._process()

    def _finish(self, status: int, payload: dict[str, Any], *, close: bool) -> None:
        """Write the answer; then wait for the next request, or close."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            self.state = "closed"
            return
        req = self.request
        self.request = None
        data = _response(status, payload, close)
        transport.write(data)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug('%s "%s" %d %d', self.peer, req.request_line if req else "-", status, len(data))
        if close:
            self._linger()
            return
        if self.buf:
            self.state = "head"  # a pipelined request already started: its clock runs from now
            self._set_timer(self.server.request_timeout_s)
        else:
            self.state = "idle"
            self._set_timer(self.server.idle_timeout_s)

    def _linger(self) -> None:
        """Half-close and drain briefly: closing with unread bytes makes the kernel send RST, and a
        client still sending its (refused) body would then lose our answer."""
        transport = self.transport
        assert transport is not None
        self.state = "linger"
        self.buf = bytearray()
        self._resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._set_timer(LINGER_S)  # then abort, whatever the client does
        else:
            transport.close()

    # ---------------------------------------------------------------- helpers

    def _set_timer(self, seconds: float) -> None:
        self._cancel_timer()
        self.timer = self.loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or self.state == "closed":
            return
        if self.state == "head" or self.state == "body":
            self.server._rlog.info("request timeout", "%s request not complete within %g s: 408, closed", self.peer,
                                   self.server.request_timeout_s)
            self.state = "closed"
            # 408 is best effort: the client may still be writing, and we close right after
            transport.write(_response(408, {"error": "request timeout"}, close=True))
            transport.close()
        elif self.state == "linger":
            transport.abort()
        else:  # idle keep-alive
            self.state = "closed"
            transport.close()


class ReportVerifiers:
    """`threads` threads that run the controller's receive_report for the loop's connections.

    submit() (on the loop) queues a connection's report; a verifier runs it and appends the answer to
    a done queue, and the loop writes the answers in batches: under load one wake-up of the loop (a
    write to its self-pipe) serves many answers instead of one per report. A verifier never raises:
    an exception from receive_report is answered 500 (_Connection._call), and one from the verifier's
    own bookkeeping is logged and answered 500 too, so no connection waits for an answer that never
    comes and no thread dies. stop() discards reports not yet started (their connections are being
    aborted), lets each thread finish the report it holds, and joins them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, route: Callable[[bytes, str], tuple[int, dict[str, Any]]],
                 threads: int):
        self._loop = loop
        self._route = route
        self._jobs: queue.SimpleQueue[tuple[_Connection, _Request, bytes] | None] = queue.SimpleQueue()
        self._done: collections.deque[tuple[_Connection, _Request, tuple[int, dict[str, Any]]]] = collections.deque()
        self._wake_pending = False
        self.threads = [threading.Thread(target=self._run, name=f"healthd-controller-verify-{k}", daemon=True)
                        for k in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, conn: _Connection, req: _Request, body: bytes) -> None:
        self._jobs.put((conn, req, body))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, req, body = job
            try:
                result = conn._call(self._route, req, body)
            except Exception as exc:  # _call catches the route's errors; this is a bug of ours
                _log.exception("%s %s: verifier failed", conn.peer, req.target)
                result = 500, {"error": f"internal error: {type(exc).__name__}"}
            self._done.append((conn, req, result))
            # the flag saves a self-pipe write per answer; a lost race only costs one empty _deliver
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop closed under a report finishing at shutdown
                    return

    def _deliver(self) -> None:
        """On the loop: write every answer the verifiers have finished."""
        self._wake_pending = False  # before draining: an answer appended from here on wakes us again
        done = self._done
        while done:
            conn, req, result = done.popleft()
            conn.deliver(req, result)

    def stop(self) -> None:
        """Blocking: discard queued reports, stop and join every thread (call off the loop)."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in self.threads:
            self._jobs.put(None)
        for t in self.threads:
            t.join()


class _Refused(_BadRequest):
    """Answered before the body was read (404/411/413 on POST): JSON payload as given, then close."""

    def __init__(self, status: int, payload: dict[str, Any]):
        super().__init__(status, str(payload.get("error", "")))
        self.payload = payload


class ControllerHTTPServer:
    """The endpoint: binds in the constructor (an OSError there is the caller's, as with http.server),
    serves on an event loop of its own in start_background()'s thread."""

    def __init__(self, listen: str, controller: Handler, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 request_timeout_s: float = 30.0, idle_timeout_s: float = 15.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
                 request_threads: int = 8, report_threads: int = DEFAULT_REPORT_THREADS,
                 log_interval_s: float = LOG_INTERVAL_S):
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        if max_connections < 1 or max_connections_per_peer < 1:
            raise ValueError("max_connections and max_connections_per_peer must be at least 1")
        if report_threads < 0:
            raise ValueError(f"report_threads must be 0 (inline on the loop) or more, got {report_threads}")
        self.controller = controller
        self.max_bytes = max_bytes
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        # backlog 1024 (http.server's was 5): a fleet's reports arrive in bursts after a round
        self.socket = _listen(host, int(port), backlog=LISTEN_BACKLOG)
        self.socket.admit = self._admit
        self.server_address = self.socket.getsockname()
        self.nofile = check_nofile(nofile_needed(max_connections))
        self._request_threads = request_threads
        self.report_threads = report_threads
        self._verifiers: ReportVerifiers | None = None
        self._checkers: CheckerPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._connections: set[_Connection] = set()
        self._open = 0  # admitted connections not yet lost (some may not have a transport yet)
        self._per_peer: dict[str, int] = {}  # source address -> its admitted connections
        self._rlog = RateLimitedLog(_log, log_interval_s)
        self._flusher: asyncio.TimerHandle | None = None
        self._stopping = False
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._done.set()  # nothing serving yet: shutdown() returns at once
        self._state_lock = threading.Lock()
        self._shut = False

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_background(self) -> threading.Thread:
        self._done.clear()
        thread = threading.Thread(target=self._serve, name="healthd-controller-http", daemon=True)
        thread.start()
        self._started.wait()
        return thread

    def _serve(self) -> None:
        try:
            with self._state_lock:
                if self._shut:
                    return
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._main())
        finally:
            if self._loop is not None:
                self._loop.close()
            self._started.set()
            self._done.set()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        with self._state_lock:  # a shutdown() that came before the loop had its Event still counts
            self._stop = asyncio.Event()
            if self._shut:
                self._stop.set()
        self._pool = concurrent.futures.ThreadPoolExecutor(self._request_threads, thread_name_prefix="healthd-controller-request")
        checkers = getattr(self.controller, "checkers", None)
        if checkers is not None:  # the controller checks reports in worker processes (report_processes)
            checkers.attach(loop)
            self._checkers = checkers
        elif self.report_threads:
            self._verifiers = ReportVerifiers(loop, self.controller.receive_report, self.report_threads)
        loop.set_exception_handler(self._loop_exception)
        # create_server listen()s again with its own backlog (100 unless given): pass ours
        server = await loop.create_server(lambda: _Connection(self), sock=self.socket, backlog=LISTEN_BACKLOG)
        self._started.set()
        self._flusher = loop.call_later(self._rlog.interval_s, self._flush_log)
        try:
            await self._stop.wait()
        finally:
            self._stopping = True
            if self._flusher is not None:
                self._flusher.cancel()
            # stop accepting; connections accepted in the loop's last turn reach connection_made (and
            # abort there) before the server closes: a server closed under them leaves their sockets open
            loop.remove_reader(self.socket.fileno())
            for _ in range(3):  # accept task -> transport -> connection_made -> connection_lost
                await asyncio.sleep(0)
            server.close()  # this also closes self.socket
            for conn in list(self._connections):
                if conn.transport is not None:
                    conn.transport.abort()
            await server.wait_closed()
            if self._checkers is not None:
                self._checkers.detach()
            if self._verifiers is not None:  # each finishes the report it holds; its answer goes nowhere
                await loop.run_in_executor(None, self._verifiers.stop)
            # a /v1/request still waiting on Slurm finishes (bounded by the Controller's Slurm
            # timeouts) so no pool thread outlives the server; its answer has nowhere to go
            await loop.run_in_executor(None, self._pool.shutdown, True)
            await loop.shutdown_default_executor()
            self._rlog.flush(force=True)

    def _admit(self, conn: socket.socket, addr: Any) -> bool:
        """Count a just-accepted connection against the bounds (on the loop, from _Listener.accept);
        over one, answer 503 in one non-blocking send and close it, reading nothing."""
        peer = _peer_address(addr)
        from_peer = self._per_peer.get(peer, 0)
        if self._open >= self.max_connections:
            self._rlog.warning("refused: max_connections", "%s refused: 503, %d connections open (max_connections)",
                               peer, self._open)
            error = "too many connections"
        elif from_peer >= self.max_connections_per_peer:
            self._rlog.warning("refused: max_connections_per_peer",
                               "%s refused: 503, %d connections open from this address (max_connections_per_peer)",
                               peer, from_peer)
            error = "too many connections from this address"
        else:
            self._open += 1
            self._per_peer[peer] = from_peer + 1
            return True
        try:
            conn.send(_response(503, {"accepted": False, "error": error}, close=True), socket.MSG_DONTWAIT)
        except OSError:
            pass
        conn.close()
        return False

    def _release(self, peer: str) -> None:
        self._open -= 1
        left = self._per_peer.get(peer, 1) - 1
        if left > 0:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)

    def _flush_log(self) -> None:
        """Tell what the rate limit held back (every interval, from the loop)."""
        self._rlog.flush()
        assert self._loop is not None
        self._flusher = self._loop.call_later(self._rlog.interval_s, self._flush_log)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio reports a failed accept() (EMFILE/ENFILE: the open-file limit) here once per retry;
        those go through the rate limit, anything else to asyncio's own handler."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
            self._rlog.error("accept failed", "accepting a connection failed: %s (open files: RLIMIT_NOFILE %d)",
                             exc, self.nofile)
            return
        loop.default_exception_handler(context)

    def shutdown(self) -> None:
        """Stop serving and wait for the loop thread to finish (idempotent)."""
        with self._state_lock:
            self._shut = True
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed in between
                pass
        self._done.wait()

    def server_close(self) -> None:
        """Close the listening socket (a no-op after shutdown(), which already did)."""
        self.socket.close()
