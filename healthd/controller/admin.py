"""The controller side of operator commands (`healthctl approve/reject/undo/repaired/close/release/breaker reset`).

Each handler is a function over a `Ledger` returning a frozen `AdminResult(ok, message, data)`;
`ok=False` is a refusal with a one-line message. The daemon mounts them on its admin unix socket
with `serve_admin_socket`, so only the controller ever writes the ledger; `call_admin` is the
client `healthctl` uses.

Operator commands that have no table of their own (undo, repaired) are recorded as decisions with
`mode="operator"` whose evidence names the operator and the why, so the ledger keeps who did what.

Wire format: one JSON object per line each way.
    request  {"cmd": "approve", "args": {"decision_id": 7, "why": "..."}}
    response {"ok": true, "message": "...", "data": {...}}            (plus "error" on a refusal
             by the socket itself: "forbidden" | "bad-request" | "unknown-command" | "internal",
             or, before the connection is closed, "busy" (over a connection bound) | "timeout")
The operator is never taken from the request: it is the peer's user name from SO_PEERCRED.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import grp
import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd.controller.ledger import CLOSED_INCIDENT_STATUSES, REMEDIATION_KINDS, Ledger, LedgerError
from healthd.controller.server import FlowControlled
from healthd.lograte import RateLimitedLog

OPERATOR_MODE = "operator"
"""The `mode` of decisions that record an operator's command rather than policy's proposal."""
MAX_REQUEST_BYTES = 64 * 1024

# kind of the applied action -> (backend call that reverses it, kind recorded for the reversal)
UNDO_CALLS: dict[str, str] = {"drain": "resume", "drain-and-requeue": "resume", "reboot-asap": "cancel_reboot"}


@dataclass(frozen=True)
class AdminResult:
    ok: bool
    message: str
    """One line for the operator."""
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "message": self.message, "data": dict(self.data)}


def _refuse(message: str, **data: Any) -> AdminResult:
    return AdminResult(False, message, data)


def _need_why(why: str | None, what: str) -> AdminResult | None:
    if why is None or not str(why).strip():
        return _refuse(f"{what} needs a why (--why TEXT)")
    return None


def _judge(ledger: Ledger, decision_id: int, operator: str, verdict: str, why: str | None) -> AdminResult:
    decision = ledger.decision(int(decision_id))
    if decision is None:
        return _refuse(f"no decision {decision_id}")
    existing = ledger.approval(decision.id)
    if existing is not None:
        return _refuse(f"decision {decision.id} was already {existing.verdict}d by {existing.operator}")
    judged_proposal = decision.outcome == "refused" and decision.refused_gate == "mode"
    if decision.outcome != "waiting" and not judged_proposal:
        state = decision.outcome + (f" by {decision.refused_gate}" if decision.refused_gate else "")
        return _refuse(f"decision {decision.id} is {state}; only waiting decisions and observe-mode proposals can be judged")
    try:
        approval = ledger.record_approval(decision.id, operator=operator, verdict=verdict, why=why or None)
    except LedgerError as exc:
        return _refuse(str(exc))
    if verdict == "approve":
        what = "approved; the controller applies it on its next round" if decision.outcome == "waiting" else \
            "judged correct (observe mode: nothing is applied)"
    else:
        what = "rejected; it will not be applied" if decision.outcome == "waiting" else \
            "judged a false positive (observe mode: nothing was applied)"
    return AdminResult(True, f"decision {decision.id} ({decision.kind} {decision.node}) {what}",
                       {"decision_id": decision.id, "verdict": approval.verdict, "operator": operator, "at": approval.at})


def approve(ledger: Ledger, decision_id: int, operator: str, why: str | None = None) -> AdminResult:
    """An operator approves a decision waiting for approval (or judges an observe-mode proposal right)."""
    return _judge(ledger, decision_id, operator, "approve", why)


def reject(ledger: Ledger, decision_id: int, operator: str, why: str | None) -> AdminResult:
    """An operator rejects a waiting decision (or judges an observe-mode proposal a false positive)."""
    return _need_why(why, "reject") or _judge(ledger, decision_id, operator, "reject", why)


def breaker_reset(ledger: Ledger, operator: str, why: str | None) -> AdminResult:
    """Close the circuit breaker. Replays nothing: the daemon re-evaluates current evidence only."""
    missing = _need_why(why, "breaker reset")
    if missing:
        return missing
    before = ledger.breaker_state()
    if not before.open:
        return _refuse("the circuit breaker is already closed")
    after = ledger.reset_breaker(by=operator, why=str(why))
    return AdminResult(True, f"circuit breaker closed by {operator}; decisions made before now are stale and will not be applied",
                       {"opened_at": before.opened_at, "cause": before.cause, "reset_at": after.reset_at})


def repaired(ledger: Ledger, node: str, operator: str, why: str | None = None) -> AdminResult:
    """Record that `node` (drained by healthd) was repaired: it enters reintegration. The daemon puts
    it in a maintenance reservation, runs the validation, and resumes it only if that passes. The
    evidence the node had up to now no longer counts (its agent is told to drop it too)."""
    hold = ledger.hold(node)
    if hold is None:
        return _refuse(f"{node} is not drained by healthd; healthd never resumes a drain it did not make")
    active = ledger.active_reintegration(node)
    if active is not None:
        return _refuse(f"{node} is already in reintegration {active.id} ({active.state})")
    incident_id = hold.incident_id
    why_text = (why or "").strip() or "marked repaired"
    findings = {f.finding_id for f in ledger.findings(node)}
    incident = ledger.incident(incident_id) if incident_id is not None else None
    if incident is not None and not incident.signature.startswith("group:"):
        findings.add(incident.signature)
    r = ledger.request_reintegration(node, incident_id=incident_id, trigger="repaired", findings=sorted(findings),
                                     operator=operator, why=why_text)
    return AdminResult(True, f"{node} enters reintegration {r.id}: validation in a maintenance reservation, "
                             "then resume only if it passes",
                       {"node": node, "incident_id": incident_id, "reintegration_id": r.id, "clears": sorted(findings)})


def _reverse_argv(argv: tuple[str, ...], call: str, node: str) -> list[str]:
    binary = argv[0] if argv and os.path.basename(argv[0]) == "scontrol" else "scontrol"
    if call == "resume":
        return [binary, "update", f"NodeName={node}", "State=RESUME"]
    return [binary, "cancel_reboot", node]


def undo(ledger: Ledger, action_id: int, operator: str, why: str | None) -> AdminResult:
    """The exact reverse Slurm call of an applied healthd action, planned in the ledger (key
    `undo:<id>`, so asking twice gives the same call). The daemon runs `data["argv"]`, marks the
    reversal applied and the original `mark_undone`. Refuses when the action is not applied, is not
    a remediation, or is no longer healthd's latest call on that node."""
    missing = _need_why(why, "undo")
    if missing:
        return missing
    action = ledger.action(int(action_id))
    if action is None:
        return _refuse(f"no action {action_id} in the ledger; healthd only undoes its own actions")
    if action.status != "applied":
        return _refuse(f"action {action.id} ({action.kind} {action.node}) is {action.status}, not applied; nothing to undo")
    call = UNDO_CALLS.get(action.kind)
    if call is None or action.kind not in REMEDIATION_KINDS:
        return _refuse(f"action {action.id} is a {action.kind}; only {', '.join(UNDO_CALLS)} can be undone")
    hold = ledger.hold(action.node)
    if hold is None or hold.action_id != action.id:
        return _refuse(f"{action.node} is no longer in healthd's {action.kind} (a later call superseded action {action.id}, "
                       "or someone else took the node over)")
    argv = _reverse_argv(action.argv, call, action.node)
    source = ledger.decision(action.decision_id)
    with ledger.transaction():
        planned = ledger.action_by_key(f"undo:{action.id}")
        if planned is None:
            decision = ledger.record_decision(
                node=action.node, kind="undo", tier="operator", mode=OPERATOR_MODE, reason=f"healthctl undo {action.id}: {why}",
                outcome="allowed", incident_id=source.incident_id if source else None,
                evidence={"operator": operator, "why": why, "undoes": action.id},
            )
            planned = ledger.plan_action(
                decision_id=decision.id, idempotency_key=f"undo:{action.id}", node=action.node, partition=action.partition,
                kind="resume" if call == "resume" else "cancel-reboot", argv=argv,
                evidence={"operator": operator, "why": why, "undoes": action.id},
            )
    return AdminResult(True, f"undo of action {action.id} ({action.kind} {action.node}): {' '.join(planned.argv)}",
                       {"action_id": action.id, "undo_action_id": planned.id, "node": action.node, "call": call,
                        "argv": list(planned.argv)})


def release(ledger: Ledger, node: str, operator: str, why: str | None) -> AdminResult:
    """Hand a node healthd holds over to the operator, changing nothing in Slurm: healthd forgets its
    hold (the action is `released`, the incident handed over, its evidence episode cleared) and from
    then on treats the node's reason as foreign: never written over, never resumed. This is how an
    administrator takes a node healthd drained without rewriting its reason: Slurm ignores an update
    that changes neither the state nor the reason, so re-draining with healthd's own text records
    nothing anyone could see."""
    missing = _need_why(why, "release")
    if missing:
        return missing
    hold = ledger.hold(node)
    if hold is None:
        return _refuse(f"{node} is not held by healthd; there is nothing to release")
    active = ledger.active_reintegration(node)
    if active is not None:
        return _refuse(f"{node} is in reintegration {active.id} ({active.state}); let it finish first")
    detail = f"released to {operator} by healthctl release: {why}"[:500]
    ledger.mark_ended(hold.action_id, "released", detail)
    if hold.incident_id is not None:
        incident = ledger.incident(hold.incident_id)
        if incident is not None and incident.status not in CLOSED_INCIDENT_STATUSES:
            ledger.close_incident(hold.incident_id, "handed-over", by=operator, why=str(why))
    return AdminResult(True, f"{node} released to {operator}: healthd no longer holds it and will never write over or "
                             "resume it; Slurm is unchanged",
                       {"node": node, "action_id": hold.action_id, "incident_id": hold.incident_id})


def close(ledger: Ledger, incident_id: int, operator: str, why: str | None) -> AdminResult:
    """Close an incident by hand (handled out of band, or healthd's evidence was wrong): its findings'
    current episode no longer counts on its nodes, so the same evidence never re-opens it, and a new
    episode of the fault is a new incident. Refused while healthd still holds a node for it: `undo`
    resumes the node, `repaired` validates it first."""
    missing = _need_why(why, "close")
    if missing:
        return missing
    incident = ledger.incident(int(incident_id))
    if incident is None:
        return _refuse(f"no incident {incident_id}")
    if incident.status in CLOSED_INCIDENT_STATUSES:
        return _refuse(f"incident {incident.id} is already {incident.status}")
    held = sorted(n for n, h in ledger.holds().items() if h.incident_id == incident.id)
    if held:
        return _refuse(f"incident {incident.id}: healthd still holds {', '.join(held)} for it; "
                       f"`healthctl undo` resumes it, `healthctl repaired` validates it first")
    active = [r for r in ledger.reintegrations(state="active", incident_id=incident.id)]
    if active:
        return _refuse(f"incident {incident.id} is in reintegration {active[0].id} ({active[0].state}); let it finish")
    closed = ledger.close_incident(incident.id, "closed", by=operator, why=str(why))
    return AdminResult(True, f"incident {incident.id} ({incident.signature}) closed by {operator}; a new episode of the "
                             "same fault opens a new incident",
                       {"incident_id": closed.id, "status": closed.status, "closed_at": closed.closed_at})


# --------------------------------------------------------------------------------------------------
# Reads (allowed to any local user).


def breaker(ledger: Ledger, operator: str) -> AdminResult:
    s = ledger.breaker_state()
    return AdminResult(True, "open" if s.open else "closed", {"open": s.open, "opened_at": s.opened_at, "cause": s.cause,
                                                              "nodes": list(s.nodes), "reset_at": s.reset_at, "reset_by": s.reset_by})


def ping(ledger: Ledger, operator: str) -> AdminResult:
    return AdminResult(True, "pong", {"operator": operator})


@dataclass(frozen=True)
class AdminHandler:
    fn: Callable[..., AdminResult]
    change: bool
    """True when it writes: only root or the admin group may call it."""


def inband_handler(view: Callable[[str | None], dict[str, Any]]) -> AdminHandler:
    """The `inband` read: `view(job or None)` is the controller's in-band summary as of its latest
    round (healthd.controller.inband.summary), held in memory, not in the ledger."""

    def inband(ledger: Ledger, operator: str, job: Any = None) -> AdminResult:
        if job is not None and not (isinstance(job, str) and 0 < len(job) <= 64 and job.isprintable()):
            raise ValueError("job: expected a job id")
        doc = view(job)
        n = len(doc.get("jobs") or ())
        what = f"job {job}" if job is not None else "jobs"
        return AdminResult(True, f"{n} {what} with in-band data" if n else f"no {what} with in-band data", doc)

    return AdminHandler(inband, False)


DEFAULT_HANDLERS: dict[str, AdminHandler] = {
    "approve": AdminHandler(approve, True),
    "reject": AdminHandler(reject, True),
    "undo": AdminHandler(undo, True),
    "repaired": AdminHandler(repaired, True),
    "close": AdminHandler(close, True),
    "release": AdminHandler(release, True),
    "breaker-reset": AdminHandler(breaker_reset, True),
    "breaker": AdminHandler(breaker, False),
    "ping": AdminHandler(ping, False),
}


# --------------------------------------------------------------------------------------------------
# The unix socket.


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @property
    def name(self) -> str:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return f"uid:{self.uid}"


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


def _in_group(peer: Peer, gid: int) -> bool:
    if peer.gid == gid:
        return True
    try:  # the peer process's own supplementary groups, as the kernel has them
        with open(f"/proc/{peer.pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return gid in {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    try:
        return gid in os.getgrouplist(pwd.getpwuid(peer.uid).pw_name, peer.gid)
    except KeyError:
        return False


def may_change(peer: Peer, allowed_uids: tuple[int, ...], admin_gid: int | None) -> bool:
    return peer.uid in allowed_uids or (admin_gid is not None and _in_group(peer, admin_gid))


ADMIN_IDLE_TIMEOUT_S = 10.0
"""A client has this long to send a complete request line, from connecting and again from each
answer; then it is closed (a partial line never completes, however slowly it drips)."""
ADMIN_MAX_CLIENTS = 64
"""Connections open at once from all uids outside allowed_uids together."""
ADMIN_MAX_CLIENTS_PER_UID = 8
"""Connections open at once from one uid outside allowed_uids."""
ADMIN_PRIVILEGED_CLIENTS = 32
"""Connections open at once from allowed_uids (root): an allowance of their own, outside
ADMIN_MAX_CLIENTS, so root's healthctl gets in however many connections other users hold."""
ADMIN_PRIVILEGED_THREADS = 2
ADMIN_USER_THREADS = 1
"""AdminHandler threads for allowed_uids' requests and for everyone else's: a user's requests queue behind
each other, never in front of root's, and reach the ledger one at a time."""
ADMIN_BACKLOG = 128
ADMIN_LOG_INTERVAL_S = 10.0

_log = logging.getLogger("healthd.controller.admin")


class _AdminConnection(FlowControlled):
    """One client on the admin loop: JSON lines in, one answer line per request, in order. While a
    request runs on a handler thread the connection reads nothing more (one request in flight)."""

    def __init__(self, server: AdminServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.buf = bytearray()
        self.admitted: str | None = None  # "privileged" | "user" once counted against a bound
        self.busy = False
        self.closed = False
        self.eof = False
        self.reading_paused = False
        self.write_paused = False
        self.timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if server._stopping:  # accepted while the server shuts down
            self._close(abort=True)
            return
        try:
            self.peer = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            server._rlog.warning("no peer credentials", "admin socket: no peer credentials (%s): closed", exc)
            self._close(abort=True)
            return
        refusal = server._admit(self)
        if refusal is not None:
            self._send({"ok": False, "error": "busy", "message": refusal})
            self._close()
            return
        self._set_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.server._release(self)
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buf += data
        self._process()

    def eof_received(self) -> bool:
        self.eof = True
        self._process()  # answers the complete lines still buffered, then closes
        return True  # this side is closed by _process / _answered, after the last answer

    def pause_writing(self) -> None:
        self.write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.busy:
            self._resume_reading()
            self._process()

    # ------------------------------------------------------------------ requests

    def _process(self) -> None:
        if self.busy or self.closed or self.write_paused:
            return
        end = self.buf.find(b"\n")
        if end < 0:
            if len(self.buf) > MAX_REQUEST_BYTES:
                self.server._rlog.info("request too large", "admin socket: uid %d sent a line over %d bytes: closed",
                                       self.peer.uid if self.peer else -1, MAX_REQUEST_BYTES)
                self._send({"ok": False, "error": "bad-request", "message": "request too large"})
                self._close()
            elif self.eof:
                self._close()
            return
        line = bytes(self.buf[:end + 1])
        del self.buf[:end + 1]
        server = self.server
        pool = server._privileged_pool if self.admitted == "privileged" else server._user_pool
        try:
            fut = asyncio.get_running_loop().run_in_executor(pool, server.dispatch, line, self.peer)
        except RuntimeError:  # the pool is shut down: the server is closing
            self._close(abort=True)
            return
        self.busy = True
        self._cancel_timer()
        self._pause_reading()
        fut.add_done_callback(self._answered)

    def _answered(self, fut: asyncio.Future) -> None:
        self.busy = False
        if self.closed or fut.cancelled():
            self._close(abort=True)
            return
        exc = fut.exception()
        if exc is not None:
            _log.error("admin socket: request failed: %s: %s", type(exc).__name__, exc)
            reply: dict[str, Any] = {"ok": False, "error": "internal", "message": f"internal error: {type(exc).__name__}"}
        else:
            reply = fut.result()
        self._send(reply)
        self._set_timer()
        if not self.write_paused:
            self._resume_reading()
        self._process()

    def _send(self, reply: Mapping[str, Any]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            data = json.dumps(reply, sort_keys=True).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            data = json.dumps({"ok": False, "error": "internal", "message": f"internal error: {exc}"}).encode() + b"\n"
        transport.write(data)

    # ------------------------------------------------------------------ helpers

    def _close(self, *, abort: bool = False) -> None:
        self.closed = True
        self._cancel_timer()
        transport = self.transport
        if transport is None:
            return
        # abort when the answer cannot leave (a client that does not read must not pin the socket)
        if abort or transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

    def _set_timer(self) -> None:
        self._cancel_timer()
        self.timer = asyncio.get_running_loop().call_later(self.server.idle_timeout_s, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.closed or self.busy:
            return
        uid = self.peer.uid if self.peer else -1
        self.server._rlog.info("idle timeout", "admin socket: uid %d sent no complete request within %g s: closed",
                               uid, self.server.idle_timeout_s)
        self._send({"ok": False, "error": "timeout",
                    "message": f"no complete request line within {self.server.idle_timeout_s:g} s"})
        self._close(abort=True)



class AdminServer:
    """A running admin socket. `close()` stops it and removes the socket file.

    One thread runs an asyncio loop that owns every connection (no thread per connection); the
    command handlers, which may wait on the ledger for up to its busy timeout, run on two small
    thread pools, one for allowed_uids and one for everyone else, so the loop never blocks and no
    user's requests queue in front of root's. Bounds, by the peer's uid from SO_PEERCRED:
    `max_clients_per_uid` connections per uid outside allowed_uids and `max_clients` for all of
    those together; allowed_uids (root) have `max_privileged_clients` of their own. A connection
    over a bound gets one line `{"ok": false, "error": "busy", ...}` and is closed. A client that
    sends no complete request line within `idle_timeout_s` (from connecting, and from each answer)
    gets `{"ok": false, "error": "timeout", ...}` and is closed. Refusals and timeouts are logged at
    most once per reason per log interval (healthd.lograte)."""

    def __init__(self, path: str, ledger: Ledger, handlers: Mapping[str, AdminHandler],
                 allowed_uids: tuple[int, ...], admin_gid: int | None, *,
                 idle_timeout_s: float = ADMIN_IDLE_TIMEOUT_S, max_clients: int = ADMIN_MAX_CLIENTS,
                 max_clients_per_uid: int = ADMIN_MAX_CLIENTS_PER_UID,
                 max_privileged_clients: int = ADMIN_PRIVILEGED_CLIENTS,
                 log_interval_s: float = ADMIN_LOG_INTERVAL_S) -> None:
        self.path = path
        self.ledger = ledger
        self.handlers = dict(handlers)
        self.allowed_uids = tuple(allowed_uids)
        self.admin_gid = admin_gid
        self.idle_timeout_s = idle_timeout_s
        self.max_clients = max_clients
        self.max_clients_per_uid = max_clients_per_uid
        self.max_privileged_clients = max_privileged_clients
        self._rlog = RateLimitedLog(_log, log_interval_s)
        self._connections: set[_AdminConnection] = set()
        self._per_uid: dict[int, int] = {}
        self._users_open = 0
        self._privileged_open = 0
        self._closed = False
        self._stopping = False
        self._flusher: asyncio.TimerHandle | None = None
        _clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)  # any local user may read; changes are checked per request
            sock.listen(ADMIN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._privileged_pool = concurrent.futures.ThreadPoolExecutor(ADMIN_PRIVILEGED_THREADS,
                                                                      thread_name_prefix="healthd-admin-root")
        self._user_pool = concurrent.futures.ThreadPoolExecutor(ADMIN_USER_THREADS, thread_name_prefix="healthd-admin-user")
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sock,), name="healthd-admin", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.close()
            self._privileged_pool.shutdown()
            self._user_pool.shutdown()
            raise self._error

    # ------------------------------------------------------------------ the loop thread

    def _run(self, sock: socket.socket) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(loop.create_unix_server(lambda: _AdminConnection(self), sock=sock))
            except BaseException as exc:
                sock.close()
                self._error = exc
                return
            self._flusher = loop.call_later(self._rlog.interval_s, self._flush_log)
            self._ready.set()
            try:
                loop.run_forever()
            finally:
                self._stopping = True
                self._flusher.cancel()
                loop.run_until_complete(_stop_accepting(loop, server))
                server.close()
                for conn in list(self._connections):
                    if conn.transport is not None:
                        conn.transport.abort()
                loop.run_until_complete(server.wait_closed())
                # a handler still on the ledger finishes (bounded by its busy timeout); what is queued is dropped
                for pool in (self._privileged_pool, self._user_pool):
                    pool.shutdown(wait=False, cancel_futures=True)
                loop.run_until_complete(loop.run_in_executor(None, self._join_pools))
                loop.run_until_complete(loop.shutdown_default_executor())
                self._rlog.flush(force=True)
        finally:
            self._ready.set()
            loop.close()

    def _join_pools(self) -> None:
        self._privileged_pool.shutdown(wait=True)
        self._user_pool.shutdown(wait=True)

    def _flush_log(self) -> None:
        """Tell what the rate limit held back (every interval, from the loop)."""
        self._rlog.flush()
        self._flusher = self._loop.call_later(self._rlog.interval_s, self._flush_log)

    def _admit(self, conn: _AdminConnection) -> str | None:
        """Count `conn` against its bound (on the loop thread); the refusal's message when over it."""
        assert conn.peer is not None
        uid = conn.peer.uid
        if uid in self.allowed_uids:
            if self._privileged_open >= self.max_privileged_clients:
                self._rlog.warning("refused: privileged clients", "admin socket: uid %d refused: %d connections open from %s",
                                   uid, self._privileged_open, "privileged uids")
                return f"too many admin connections: {self._privileged_open} open from privileged uids"
            self._privileged_open += 1
            conn.admitted = "privileged"
        else:
            mine = self._per_uid.get(uid, 0)
            if mine >= self.max_clients_per_uid:
                self._rlog.warning("refused: per-uid clients", "admin socket: uid %d refused: %d connections open from it",
                                   uid, mine)
                return f"too many admin connections from uid {uid}: {mine} open, at most {self.max_clients_per_uid} per user"
            if self._users_open >= self.max_clients:
                self._rlog.warning("refused: clients", "admin socket: uid %d refused: %d connections open", uid,
                                   self._users_open)
                return f"too many admin connections: {self._users_open} open"
            self._per_uid[uid] = mine + 1
            self._users_open += 1
            conn.admitted = "user"
        self._connections.add(conn)
        return None

    def _release(self, conn: _AdminConnection) -> None:
        if conn.admitted is None:
            return
        if conn.admitted == "privileged":
            self._privileged_open -= 1
        else:
            assert conn.peer is not None
            uid = conn.peer.uid
            left = self._per_uid.get(uid, 1) - 1
            if left > 0:
                self._per_uid[uid] = left
            else:
                self._per_uid.pop(uid, None)
            self._users_open -= 1
        conn.admitted = None
        self._connections.discard(conn)

    def open_connections(self) -> dict[str, Any]:
        """{"privileged": N, "users": N, "per_uid": {uid: N}}, read on the loop thread (for tests and
        diagnostics)."""
        def snapshot() -> dict[str, Any]:
            return {"privileged": self._privileged_open, "users": self._users_open, "per_uid": dict(self._per_uid)}
        if self._loop.is_closed() or not self._thread.is_alive():
            return snapshot()
        return asyncio.run_coroutine_threadsafe(_call(snapshot), self._loop).result(timeout=5)

    # ------------------------------------------------------------------ requests (on a handler thread)

    def dispatch(self, line: bytes, peer: Peer) -> dict[str, Any]:
        if len(line) > MAX_REQUEST_BYTES:
            return {"ok": False, "error": "bad-request", "message": "request too large"}
        try:
            req = json.loads(line)
            cmd = req["cmd"]
            args = req.get("args", {})
            if not isinstance(cmd, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "error": "bad-request", "message": 'expected one JSON object {"cmd": ..., "args": {...}} per line'}
        handler = self.handlers.get(cmd)
        if handler is None:
            return {"ok": False, "error": "unknown-command", "message": f"unknown command {cmd!r}"}
        if handler.change and not may_change(peer, self.allowed_uids, self.admin_gid):
            group = ""
            if self.admin_gid is not None:
                try:
                    group = f" or a member of group {grp.getgrgid(self.admin_gid).gr_name}"
                except KeyError:
                    group = f" or a member of gid {self.admin_gid}"
            return {"ok": False, "error": "forbidden", "message": f"{cmd}: permission denied for {peer.name}; only root{group} may change anything"}
        try:
            result = handler.fn(self.ledger, operator=peer.name, **args)
        except TypeError as exc:
            return {"ok": False, "error": "bad-request", "message": f"{cmd}: {exc}"}
        except (LedgerError, ValueError) as exc:
            return {"ok": False, "message": f"{cmd}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - the socket must answer, and keep serving
            return {"ok": False, "error": "internal", "message": f"{cmd}: internal error: {type(exc).__name__}: {exc}"}
        return result.to_json()

    def close(self) -> None:
        """Stop serving (idempotent): the listener and every connection close, a handler still
        running finishes, and the socket file is removed."""
        if self._closed:
            return
        self._closed = True
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:  # closed in between
                pass
        self._thread.join(timeout=10)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AdminServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()


async def _stop_accepting(loop: asyncio.AbstractEventLoop, server: asyncio.AbstractServer) -> None:
    """Stop accepting, then let the connections accepted in the loop's last turn reach
    connection_made (where they abort, the server stopping): a server closed under them would
    leave their sockets open."""
    for sock in getattr(server, "sockets", ()):
        loop.remove_reader(sock.fileno())
    for _ in range(3):  # accept task -> transport -> connection_made -> connection_lost
        await asyncio.sleep(0)


def _clear_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path}: exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a socket left by a dead controller
        return
    finally:
        probe.close()
    raise OSError(f"{path}: another controller is listening on it")


def serve_admin_socket(path: str, ledger: Ledger, handler_map: Mapping[str, AdminHandler] | None = None,
                       allowed_uids: tuple[int, ...] = (0,), admin_gid: int | None = None, **limits: Any) -> AdminServer:
    """Serve the admin commands on a unix socket (JSON lines) from an event-loop thread of its own.
    Changes are allowed to `allowed_uids` and members of `admin_gid` (by SO_PEERCRED); reads to
    anyone local. `limits`: AdminServer's keyword arguments (timeouts and connection bounds)."""
    return AdminServer(path, ledger, DEFAULT_HANDLERS if handler_map is None else handler_map, allowed_uids, admin_gid,
                       **limits)


class AdminUnreachable(OSError):
    """The admin socket cannot be reached or answered nonsense."""


def call_admin(path: str, cmd: Mapping[str, Any], timeout: float = 5) -> dict[str, Any]:
    """Send one request, return the controller's answer. Raises AdminUnreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A unix socket connect with a Python timeout is non-blocking and fails at once (EAGAIN) while the
        # listen backlog is full, which a local user flooding connects can keep it: connect blocking,
        # bounded by the kernel's send timeout, so root's healthctl waits its turn instead.
        sec = max(timeout, 0.001)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(sec), int(sec % 1 * 1e6)))
        try:
            sock.connect(path)
        except OSError as exc:
            raise AdminUnreachable(f"cannot reach the controller at {path}: {exc.strerror or exc}") from exc
        sock.settimeout(timeout)
        sent: OSError | None = None
        try:
            sock.sendall(json.dumps(dict(cmd)).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError) as exc:
            sent = exc  # refused at once ("busy"): its one line may already be here; read it
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError as exc:
            if not buf.endswith(b"\n"):
                raise AdminUnreachable(f"controller at {path} did not answer: {sent or exc}") from exc
        if sent is not None and not buf.endswith(b"\n"):
            raise AdminUnreachable(f"controller at {path} did not answer: {sent}") from sent
    finally:
        sock.close()
    try:
        reply = json.loads(buf)
    except ValueError as exc:
        raise AdminUnreachable(f"controller at {path} answered something that is not JSON") from exc
    if not isinstance(reply, dict):
        raise AdminUnreachable(f"controller at {path} answered something that is not a JSON object")
    return reply
