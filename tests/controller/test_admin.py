"""The controller's operator-command handlers on a real ledger, and the admin unix socket with
real peers: a child that became `nobody` may read but is refused every change; root may change."""

from __future__ import annotations

import json
import os
import pwd
import socket
from pathlib import Path

import pytest

from healthd.controller import admin
from healthd.controller.admin import AdminResult, AdminUnreachable, call_admin, serve_admin_socket
from healthd.controller.ledger import Ledger
from tests.support.as_nobody import as_nobody, needs_root
from tests.support.tmpdirs import shared_tmpdir

T0 = 1_700_000_000.0
DRAIN_ARGV = ["/usr/bin/scontrol", "update", "NodeName=node02", "State=DRAIN", "Reason=healthd: GPU fell off the bus (Xid 79) [#1]"]


@pytest.fixture
def led(tmp_path: Path):
    with Ledger(tmp_path / "ledger.db") as lg:
        yield lg


def _applied(led: Ledger, kind: str = "drain", argv: list[str] | None = None, node: str = "node02") -> tuple[int, int]:
    inc = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=[node], gpu_serials=["1650923012345"], at=T0)
    d = led.record_decision(node=node, kind=kind, tier="1", mode="auto", reason="healthd: Xid 79", outcome="allowed",
                            incident_id=inc.id, at=T0 + 1)
    a = led.plan_action(decision_id=d.id, idempotency_key=f"{kind}:{node}:{inc.id}", node=node, kind=kind,
                        argv=argv or DRAIN_ARGV, partition="gpu", at=T0 + 2)
    led.mark_applied(a.id, "ok", at=T0 + 3)
    return inc.id, a.id


def _waiting(led: Ledger, mode: str = "supervised", outcome: str = "waiting", **kw) -> int:
    return led.record_decision(node="node03", kind="drain", tier="2", mode=mode, reason="healthd: ECC", outcome=outcome, at=T0, **kw).id


def test_result_is_frozen():
    r = AdminResult(True, "x", {"a": 1})
    with pytest.raises(AttributeError):
        r.ok = False  # type: ignore[misc]
    assert r.to_json() == {"ok": True, "message": "x", "data": {"a": 1}}


def test_approve_and_reject(led: Ledger):
    d1, d2 = _waiting(led), _waiting(led)
    r = admin.approve(led, d1, "alice")
    assert r.ok and "approved" in r.message and led.approval(d1).operator == "alice"
    assert led.waiting_decisions()[0].id == d2
    again = admin.approve(led, d1, "bob")
    assert not again.ok and "already approved by alice" in again.message
    assert not admin.reject(led, d2, "bob", "").ok  # why required
    assert not admin.reject(led, d2, "bob", None).ok
    r = admin.reject(led, d2, "bob", "the ECC count is from the burn-in")
    assert r.ok and led.approval(d2).verdict == "reject" and led.approval(d2).why == "the ECC count is from the burn-in"
    assert led.waiting_decisions() == []
    assert not admin.approve(led, 999, "alice").ok


def test_judging_observe_proposals_and_refusing_others(led: Ledger):
    prop = _waiting(led, mode="observe", outcome="refused", refused_gate="mode", refused_reason="observe mode")
    r = admin.reject(led, prop, "carol", "false alarm")
    assert r.ok and "false positive" in r.message
    assert led.false_positive_rate().rejected == 1
    rate = _waiting(led, mode="auto", outcome="refused", refused_gate="rate-limit", refused_reason="10 in the last hour")
    r = admin.approve(led, rate, "carol")
    assert not r.ok and "refused by rate-limit" in r.message and led.approval(rate) is None
    allowed = _waiting(led, mode="auto", outcome="allowed")
    assert not admin.approve(led, allowed, "carol").ok


def test_breaker_reset(led: Ledger):
    assert not admin.breaker_reset(led, "root", "fixed").ok  # already closed
    led.open_breaker("switch:leaf3", nodes=["node01", "node02", "node03"], at=T0)
    assert not admin.breaker_reset(led, "root", " ").ok
    assert led.breaker_state().open
    r = admin.breaker_reset(led, "root", "leaf3 replaced")
    assert r.ok and r.data["cause"] == "switch:leaf3"
    s = led.breaker_state()
    assert not s.open and s.reset_by == "root" and s.why == "leaf3 replaced"
    # closing replays nothing: no decision or action was written
    assert led.decisions() == [] and led.actions() == []


def test_repaired(led: Ledger):
    assert not admin.repaired(led, "node02", "root", "new GPU").ok  # not drained by healthd
    inc, _ = _applied(led)
    r = admin.repaired(led, "node02", "root", "GPU 1650923012345 replaced")
    assert r.ok and r.data["incident_id"] == inc
    ri = led.reintegration(r.data["reintegration_id"])
    assert (ri.node, ri.trigger, ri.operator, ri.state) == ("node02", "repaired", "root", "requested")
    assert led.incident(inc).signature in ri.findings  # its old evidence no longer counts
    assert led.incident(inc).status == "reintegrating"
    again = admin.repaired(led, "node02", "root", "twice")
    assert not again.ok and "already in reintegration" in again.message


def test_undo_drain_and_reboot(led: Ledger):
    _, drain = _applied(led)
    assert not admin.undo(led, drain, "root", "").ok
    r = admin.undo(led, drain, "root", "false alarm, GPU is fine")
    assert r.ok and r.data["call"] == "resume"
    assert r.data["argv"] == ["/usr/bin/scontrol", "update", "NodeName=node02", "State=RESUME"]
    planned = led.action(r.data["undo_action_id"])
    assert planned.status == "planned" and planned.idempotency_key == f"undo:{drain}" and planned.kind == "resume"
    again = admin.undo(led, drain, "root", "false alarm, GPU is fine")
    assert again.data["undo_action_id"] == planned.id and len(led.actions()) == 2  # same call, not a second one

    reboot_argv = ["scontrol", "reboot", "ASAP", "nextstate=RESUME", "reason=healthd: Xid 79", "node05"]
    _, reboot = _applied(led, kind="reboot-asap", argv=reboot_argv, node="node05")
    r = admin.undo(led, reboot, "root", "wrong node")
    assert r.ok and r.data["argv"] == ["scontrol", "cancel_reboot", "node05"]


def test_undo_refusals(led: Ledger):
    assert "healthd only undoes its own" in admin.undo(led, 42, "root", "x").message
    _, drain = _applied(led)
    led.mark_undone(drain, "resumed by hand")
    assert "is undone, not applied" in admin.undo(led, drain, "root", "x").message
    inc = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=["node04"], at=T0)
    d = led.record_decision(node="node04", kind="drain", tier="1", mode="auto", reason="r", outcome="allowed", incident_id=inc.id, at=T0)
    planned = led.plan_action(decision_id=d.id, idempotency_key="k4", node="node04", kind="drain", argv=["scontrol", "x"], at=T0)
    assert "planned, not applied" in admin.undo(led, planned.id, "root", "x").message
    rq = led.plan_action(decision_id=d.id, idempotency_key="rq", node="node04", kind="requeue", argv=["scontrol", "requeue", "7"], at=T0)
    led.mark_applied(rq.id, at=T0)
    assert "only drain" in admin.undo(led, rq.id, "root", "x").message
    # a drain superseded by a later resume is no longer healthd's to undo
    _, d6 = _applied(led, node="node06")
    res = led.plan_action(decision_id=led.action(d6).decision_id, idempotency_key="res6", node="node06", kind="resume",
                          argv=["scontrol", "update", "NodeName=node06", "State=RESUME"], at=T0 + 10)
    led.mark_applied(res.id, at=T0 + 10)
    assert "no longer" in admin.undo(led, d6, "root", "x").message


def test_release_hands_a_held_node_over_without_touching_slurm(led: Ledger):
    assert "nothing to release" in admin.release(led, "node02", "root", "mine now").message
    inc, drain = _applied(led)
    assert not admin.release(led, "node02", "root", "").ok  # a release needs a why
    r = admin.release(led, "node02", "alice", "replacing the board")
    assert r.ok and r.data == {"node": "node02", "action_id": drain, "incident_id": inc}
    assert led.hold("node02") is None
    assert led.action(drain).status == "released" and "alice" in led.action(drain).outcome
    i = led.incident(inc)
    assert (i.status, i.closed_by, i.close_why) == ("handed-over", "alice", "replacing the board")
    assert [c.scope for c in led.clears(node="node02")] == ["episode"]
    assert not admin.repaired(led, "node02", "root", "x").ok and not admin.undo(led, drain, "root", "x").ok


def test_close_an_incident_by_hand(led: Ledger):
    assert "no incident" in admin.close(led, 99, "root", "x").message
    inc, drain = _applied(led)
    assert "still holds node02" in admin.close(led, inc, "root", "handled").message
    admin.release(led, "node02", "root", "mine")
    assert "already handed-over" in admin.close(led, inc, "root", "x").message
    other = led.open_incident("ib:port1", attribution="fabric", tier="T2", nodes=["node05"], at=T0)
    assert not admin.close(led, other.id, "root", " ").ok  # a close needs a why
    r = admin.close(led, other.id, "bob", "cable reseated by the vendor")
    assert r.ok and led.incident(other.id).status == "closed" and led.incident(other.id).closed_by == "bob"
    (c,) = led.clears(node="node05")
    assert (c.finding_id, c.scope, c.incident_id) == ("ib:port1", "episode", other.id)


# --------------------------------------------------------------------------------------------------
# the socket


@pytest.fixture
def sockdir():
    """A directory a dropped-privilege child can reach (pytest's tmp_path is under a 0700 parent)."""
    with shared_tmpdir("healthd-admin-") as d:
        yield d


@pytest.fixture
def served(led: Ledger, sockdir: Path):
    path = str(sockdir / "admin.sock")
    with serve_admin_socket(path, led) as srv:
        yield srv


def _as_nobody(path: str, requests: list[dict]) -> list[dict]:
    """A child that became nobody sends each request; its answers."""
    return as_nobody(lambda: [call_admin(path, req) for req in requests])


@needs_root
def test_socket_nobody_reads_but_cannot_change(led: Ledger, served):
    d = _waiting(led)
    led.open_breaker("rack:r1", nodes=["node01", "node02", "node03"], at=T0)
    ping, brk, appr, reset = _as_nobody(served.path, [
        {"cmd": "ping"}, {"cmd": "breaker"},
        {"cmd": "approve", "args": {"decision_id": d}},
        {"cmd": "breaker-reset", "args": {"why": "because"}},
    ])
    assert ping["ok"] and ping["data"]["operator"] == "nobody"
    assert brk["ok"] and brk["data"]["open"] and brk["data"]["cause"] == "rack:r1"
    for refused in (appr, reset):
        assert not refused["ok"] and refused["error"] == "forbidden" and "permission denied for nobody" in refused["message"]
    assert led.approval(d) is None and led.breaker_state().open


@needs_root
def test_socket_admin_group_may_change(led: Ledger, sockdir: Path):
    nobody = pwd.getpwnam("nobody")
    d = _waiting(led)
    with serve_admin_socket(str(sockdir / "a.sock"), led, admin_gid=nobody.pw_gid) as srv:
        (ans,) = _as_nobody(srv.path, [{"cmd": "approve", "args": {"decision_id": d}}])
    assert ans["ok"], ans
    assert led.approval(d).operator == "nobody"


def test_socket_never_takes_the_operator_from_the_request(led: Ledger, served):
    d = _waiting(led)
    ans = call_admin(served.path, {"cmd": "approve", "args": {"decision_id": d, "operator": "mallory"}})
    assert not ans["ok"] and ans["error"] == "bad-request"
    assert led.approval(d) is None


@needs_root
def test_socket_root_changes_with_its_own_name(led: Ledger, served):
    d = _waiting(led)
    ans = call_admin(served.path, {"cmd": "approve", "args": {"decision_id": d}})
    assert ans["ok"] and led.approval(d).operator == pwd.getpwuid(0).pw_name
    ans = call_admin(served.path, {"cmd": "reject", "args": {"decision_id": d, "why": "x"}})
    assert not ans["ok"] and "already approved" in ans["message"]


def test_socket_bad_requests(served):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(served.path)
    f = sock.makefile("rwb")
    for line, err in ((b"not json\n", "bad-request"), (b'{"cmd": "rm -rf"}\n', "unknown-command"), (b"[1]\n", "bad-request")):
        f.write(line)
        f.flush()
        assert json.loads(f.readline())["error"] == err
    f.write(b'{"cmd": "ping"}\n')  # the connection keeps serving
    f.flush()
    assert json.loads(f.readline())["ok"]
    sock.close()


def test_call_admin_unreachable(tmp_path: Path):
    with pytest.raises(AdminUnreachable, match="cannot reach the controller"):
        call_admin(str(tmp_path / "none.sock"), {"cmd": "ping"})


def test_stale_socket_replaced_live_one_refused(led: Ledger, tmp_path: Path):
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file remains, nobody listens
    with serve_admin_socket(path, led) as srv:
        assert call_admin(srv.path, {"cmd": "ping"})["ok"]
        with pytest.raises(OSError, match="another controller"):
            serve_admin_socket(path, led)
    assert not os.path.exists(path)
    Path(path).write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        serve_admin_socket(path, led)
