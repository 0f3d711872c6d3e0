"""The controller side of operator commands (`healthctl approve/reject/undo/repaired/breaker reset`).

Each handler is a function over a `Ledger` returning a frozen `AdminResult(ok, message, data)`;
`ok=False` is a refusal with a one-line message. The daemon mounts them on its admin unix socket
with `serve_admin_socket`, so only the controller ever writes the ledger; `call_admin` is the
client `healthctl` uses.

Operator commands that have no table of their own (undo, repaired) are recorded as decisions with
`mode="operator"` whose evidence names the operator and the why, so the ledger keeps who did what.

Wire format: one JSON object per line each way.
    request  {"cmd": "approve", "args": {"decision_id": 7, "why": "..."}}
    response {"ok": true, "message": "...", "data": {...}}            (plus "error" on a refusal
             by the socket itself: "forbidden" | "bad-request" | "unknown-command" | "internal")
The operator is never taken from the request: it is the peer's user name from SO_PEERCRED.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import socketserver
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd.controller.ledger import REMEDIATION_KINDS, Ledger, LedgerError

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
    drains = ledger.healthd_drains()
    if node not in drains:
        return _refuse(f"{node} is not drained by healthd; healthd never resumes a drain it did not make")
    active = ledger.active_reintegration(node)
    if active is not None:
        return _refuse(f"{node} is already in reintegration {active.id} ({active.state})")
    incident_id = drains[node]
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
    if action.node not in ledger.healthd_drains():
        return _refuse(f"{action.node} is no longer in healthd's {action.kind} (a later call superseded action {action.id})")
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


# --------------------------------------------------------------------------------------------------
# Reads (allowed to any local user).


def breaker(ledger: Ledger, operator: str) -> AdminResult:
    s = ledger.breaker_state()
    return AdminResult(True, "open" if s.open else "closed", {"open": s.open, "opened_at": s.opened_at, "cause": s.cause,
                                                              "nodes": list(s.nodes), "reset_at": s.reset_at, "reset_by": s.reset_by})


def ping(ledger: Ledger, operator: str) -> AdminResult:
    return AdminResult(True, "pong", {"operator": operator})


@dataclass(frozen=True)
class Handler:
    fn: Callable[..., AdminResult]
    change: bool
    """True when it writes: only root or the admin group may call it."""


DEFAULT_HANDLERS: dict[str, Handler] = {
    "approve": Handler(approve, True),
    "reject": Handler(reject, True),
    "undo": Handler(undo, True),
    "repaired": Handler(repaired, True),
    "breaker-reset": Handler(breaker_reset, True),
    "breaker": Handler(breaker, False),
    "ping": Handler(ping, False),
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


class AdminServer:
    """A running admin socket (a daemon thread). `close()` stops it and removes the socket file."""

    def __init__(self, path: str, ledger: Ledger, handlers: Mapping[str, Handler],
                 allowed_uids: tuple[int, ...], admin_gid: int | None) -> None:
        self.path = path
        self.ledger = ledger
        self.handlers = dict(handlers)
        self.allowed_uids = tuple(allowed_uids)
        self.admin_gid = admin_gid
        _clear_stale(path)
        outer = self

        class _Req(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                peer = peer_credentials(self.connection)
                for line in iter(lambda: self.rfile.readline(MAX_REQUEST_BYTES + 1), b""):
                    reply = outer.dispatch(line, peer)
                    self.wfile.write(json.dumps(reply, sort_keys=True).encode() + b"\n")
                    self.wfile.flush()

        class _Srv(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self._server = _Srv(path, _Req)
        os.chmod(path, 0o666)  # any local user may read; changes are checked per request
        self._thread = threading.Thread(target=self._server.serve_forever, name="healthd-admin", daemon=True)
        self._thread.start()

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
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AdminServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def serve_admin_socket(path: str, ledger: Ledger, handler_map: Mapping[str, Handler] | None = None,
                       allowed_uids: tuple[int, ...] = (0,), admin_gid: int | None = None) -> AdminServer:
    """Serve the admin commands on a unix socket (JSON lines) in a daemon thread. Changes are
    allowed to `allowed_uids` and members of `admin_gid` (by SO_PEERCRED); reads to anyone local."""
    return AdminServer(path, ledger, DEFAULT_HANDLERS if handler_map is None else handler_map, allowed_uids, admin_gid)


class AdminUnreachable(OSError):
    """The admin socket cannot be reached or answered nonsense."""


def call_admin(path: str, cmd: Mapping[str, Any], timeout: float = 5) -> dict[str, Any]:
    """Send one request, return the controller's answer. Raises AdminUnreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            raise AdminUnreachable(f"cannot reach the controller at {path}: {exc.strerror or exc}") from exc
        try:
            sock.sendall(json.dumps(dict(cmd)).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError as exc:
            raise AdminUnreachable(f"controller at {path} did not answer: {exc}") from exc
    finally:
        sock.close()
    try:
        reply = json.loads(buf)
    except ValueError as exc:
        raise AdminUnreachable(f"controller at {path} answered something that is not JSON") from exc
    if not isinstance(reply, dict):
        raise AdminUnreachable(f"controller at {path} answered something that is not a JSON object")
    return reply
