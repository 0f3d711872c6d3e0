"""Report checks in processes of their own (the controller's `report_processes`).

A report costs the controller about 0.4 ms of interpreter time before it is stored: the JSON parse,
the digest, the MUNGE credential and the field-by-field document check. In one process those run
under one interpreter lock with the HTTP loop and the control round, so the intake cannot use a
second core. `check_report` is that part as a pure function of the body; a `CheckerPool` runs it in
worker processes and hands back the checked document (marshal: it is plain JSON data) to the
report server's event loop, which only stores it. Every refusal is decided by the same code in either place.

The workers decode through libmunge (healthd.munge) and the controller's munged; the node -> address
map goes to a worker when it changed, and each report carries the controller's clock.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import marshal
import signal
import socket as _socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from healthd import munge
from healthd.controller.auth import ReportRejected, verify_report
from healthd.report_schema import MAX_ERROR_CHARS, validate_report

_log = logging.getLogger("healthd.controller.verifier")

MAX_REPORT_PROCESSES = 64
"""The most report_processes a controller starts."""



@dataclass(frozen=True, slots=True)
class Checked:
    """A report whose credential and every field passed: ready to store."""

    node: str
    doc: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Refused:
    """A report refused with `status` (the HTTP answer) for `reason`."""

    status: int
    reason: str
    credential: bool
    """True when the envelope or its credential was refused (auth.verify_report), False for the
    document inside a valid one: the controller logs and counts the two apart."""


def check_report(body: bytes, *, socket: str | None, node_addrs: Mapping[str, str], now: float,
                 decode: Callable[[str, str | None], munge.Decoded] = munge.decode) -> Checked | Refused:
    """Everything the controller checks before it stores a report: the envelope and its MUNGE
    credential (auth.verify_report), then the state document (report_schema.validate_report)."""
    try:
        verified = verify_report(body, socket=socket, node_addrs=node_addrs, now=now, decode=decode)
    except ReportRejected as exc:
        return Refused(exc.http_status, exc.reason, True)
    try:
        if verified.report.get("kind") == "drain-request":
            raise ValueError("a drain-request goes to /v1/request")
        validate_report(verified.report, node=verified.node)
    except (KeyError, ValueError, TypeError) as exc:
        return Refused(400, f"report from {verified.node!r} is not a state document: {str(exc)[:MAX_ERROR_CHARS]}",
                       False)
    return Checked(verified.node, verified.report)


# --------------------------------------------------------------------------- the worker process


def _serve(conn: Connection, socket: str | None) -> None:
    """A worker: (body, now, node_addrs or None when unchanged) in, the outcome out, until EOF."""
    # the controller stops its workers by closing their sockets (an interrupt or a stop signal for the whole
    # service reaches them too, and must not end one before the controller has stopped using it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    addrs: dict[str, str] = {}
    while True:
        try:
            body, now, new_addrs = marshal.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if new_addrs is not None:
            addrs = new_addrs
        try:
            out = check_report(body, socket=socket, node_addrs=addrs, now=now)
            reply = ("ok", out.node, out.doc) if isinstance(out, Checked) else ("no", out.status, out.reason,
                                                                                 out.credential)
        except Exception as exc:  # noqa: BLE001 - a bug of ours is the controller's 500, not a dead worker
            reply = ("no", 500, f"internal error: {type(exc).__name__}", True)
        try:
            conn.send_bytes(marshal.dumps(reply))
        except (OSError, ValueError):
            return


class _Worker:
    """One worker: `python -m healthd.controller.verifier FD` with one end of a socket pair as FD. A
    program of its own rather than a multiprocessing child: nothing of the controller's main module is
    run again in it, and it imports only what the checks need."""

    def __init__(self, socket: str | None):
        ours, theirs = _socket.socketpair()
        argv = [sys.executable, "-m", "healthd.controller.verifier", str(theirs.fileno())]
        if socket:
            argv += ["--munge-socket", socket]
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self.process.pid
        self.fd = self.conn.fileno()
        self.addrs: object = None
        """The node_addrs mapping last sent (by identity: the controller swaps the whole map)."""

    def send(self, body: bytes, now: float, addrs: Mapping[str, str]) -> None:
        sent = None if addrs is self.addrs else dict(addrs)
        # one message at a time, to a worker waiting for it: the socket takes it without blocking for long
        self.conn.send_bytes(marshal.dumps((bytes(body), now, sent)))
        self.addrs = addrs

    def receive(self) -> Checked | Refused:
        reply = marshal.loads(self.conn.recv_bytes())
        if reply[0] == "ok":
            return Checked(reply[1], reply[2])
        return Refused(reply[1], reply[2], reply[3])

    def close(self) -> None:
        """Close its socket (it ends at EOF), then wait for it; killed by PID if it does not end."""
        self.conn.close()
        try:
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


Done = Callable[[Checked | Refused], None]


class CheckerPool:
    """`processes` worker processes running check_report for the report server's event loop.

    submit() (on the loop) sends a report to an idle worker or queues it; the loop reads a worker's
    answer when its socket becomes readable and hands it to the report's `done`, also on the loop. No
    thread waits on a worker: handing a report to another thread and back cost more interpreter time
    than the checks it moved. A worker that dies is replaced, and the report it held is answered 503
    (its agent sends the next one at its next heartbeat)."""

    def __init__(self, processes: int, socket: str | None):
        if not 1 <= processes <= MAX_REPORT_PROCESSES:
            raise ValueError(f"report processes must be 1-{MAX_REPORT_PROCESSES}, got {processes}")
        self._socket = socket
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = [_Worker(socket) for _ in range(processes)]
        self._idle: collections.deque[_Worker] = collections.deque(self._workers)
        self._busy: dict[_Worker, Done] = {}
        self._pending: collections.deque[tuple[bytes, float, Mapping[str, str], Done]] = collections.deque()
        self.replaced = 0
        """Workers that died and were started again."""

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve `loop` (call on it): every later submit() and answer runs there."""
        self._loop = loop
        for w in self._workers:
            loop.add_reader(w.fd, self._ready, w)

    def detach(self) -> None:
        """Stop serving the loop (call on it): reports queued or in a worker are answered 503."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for w in self._workers:
            loop.remove_reader(w.fd)
        waiting = [*self._busy.values(), *(job[3] for job in self._pending)]
        # a worker still checking answers later: on the next attach that answer is read and dropped,
        # never taken for another report's
        self._busy = {w: _dropped for w in self._busy}
        self._pending.clear()
        for done in waiting:
            done(Refused(503, "controller is shutting down", True))

    def submit(self, body: bytes, now: float, addrs: Mapping[str, str], done: Done) -> None:
        """Check `body` in a worker and call done(outcome) on the loop (call on the loop)."""
        if self._loop is None:
            done(Refused(503, "controller is shutting down", True))
        elif self._idle:
            self._send(self._idle.popleft(), body, now, addrs, done)
        else:
            self._pending.append((body, now, addrs, done))

    def _send(self, w: _Worker, body: bytes, now: float, addrs: Mapping[str, str], done: Done) -> None:
        try:
            w.send(body, now, addrs)
        except (OSError, ValueError) as exc:
            self._replace(w, exc)
            done(Refused(503, _GONE, True))
            return
        self._busy[w] = done

    def _ready(self, w: _Worker) -> None:
        done = self._busy.pop(w, None)
        try:
            if done is None:
                raise ValueError("a worker spoke unasked")
            out = w.receive()
        except (EOFError, OSError, ValueError) as exc:
            self._replace(w, exc)
            if done is not None:
                done(Refused(503, _GONE, True))
            return
        self._next(w)
        done(out)

    def _next(self, w: _Worker) -> None:
        if self._pending:
            self._send(w, *self._pending.popleft())
        else:
            self._idle.append(w)

    def _replace(self, w: _Worker, exc: BaseException) -> None:
        _log.error("report check process %s ended (%s: %s); starting another", w.pid,
                   type(exc).__name__, exc)
        if self._loop is not None:
            self._loop.remove_reader(w.fd)
        w.close()
        if w not in self._workers:  # closed meanwhile
            return
        k = self._workers.index(w)
        self._workers[k] = fresh = _Worker(self._socket)
        self.replaced += 1
        if self._loop is not None:
            self._loop.add_reader(fresh.fd, self._ready, fresh)
        self._next(fresh)

    def close(self) -> None:
        """Stop every worker (after detach, or when never attached)."""
        workers, self._workers = self._workers, []
        self._idle.clear()
        for w in workers:
            w.close()


def _dropped(_out: Checked | Refused) -> None:
    pass


_GONE = "controller could not check the report (its checker process ended); send it again"


def main(argv: list[str] | None = None) -> int:
    """A worker's entry point (CheckerPool starts it): check the reports that come on socket FD."""
    ap = argparse.ArgumentParser(prog="python -m healthd.controller.verifier", description=main.__doc__)
    ap.add_argument("fd", type=int, help="this worker's end of the socket pair the controller made")
    ap.add_argument("--munge-socket", default=None, help="the controller's munged socket")
    args = ap.parse_args(argv)
    _serve(Connection(args.fd), args.munge_socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
