"""healthd-controller end to end over HTTP: real munged daemons (one per fake node plus the controller's),
the real server on 127.0.0.1 with an ephemeral port, a fake Slurm backend."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import pytest

from healthd.controller.daemon import main
from healthd.envelope import sign_report
from tests.controller.munge_support import munged_path
from tests.controller.schema_support import xid79
from tests.support.decisions import crash_after_plan, drain_decision
from tests.support.controller_rig import ControllerRig
from tests.support.fake_slurm import FakeBackend, FakeLinesBackend

NODES = ["node01", "node02", "node03", "node04"]
"""The nodes of tests/controller/conftest.py's `fleet`."""

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")


def state_doc(node: str, now: float, findings=None) -> dict:
    return {"node": node, "verdict": "failed", "findings": [xid79(now, evidence_kind="log")] if findings is None else findings}


class Rig(ControllerRig):
    def report(self, node: str, doc: dict | None = None, socket_of: str | None = None) -> tuple[int, dict]:
        """`node`'s agent reports `doc` (default: a fresh Xid 79), signed by `socket_of`'s munged if given."""
        return self.send("/v1/report", doc or state_doc(node, time.time()), node, signer=socket_of)


@pytest.fixture
def rig_factory(fleet, tmp_path):
    rigs: list[Rig] = []

    def make(mode: str, backend: FakeBackend | None = None, **policy) -> Rig:
        d = tmp_path / f"r{len(rigs)}"
        d.mkdir()
        rig = Rig(fleet, d, mode, backend=backend, **policy)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def test_healthz(rig_factory):
    rig = rig_factory("observe")
    with urllib.request.urlopen(rig.server.url + "/healthz", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"ok": True}


def test_forged_report_is_401_with_a_log_line(rig_factory, caplog):
    rig = rig_factory("auto")
    body = json.loads(sign_report(state_doc("node02", time.time()), "node02", rig.fleet.socket("node02")))
    body["report"]["verdict"] = "healthy"  # tampered after signing
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        status, payload = rig.post("/v1/report", json.dumps(body).encode())
    assert status == 401 and payload["accepted"] is False
    assert any("from 127.0.0.1 refused: 401" in r.getMessage() for r in caplog.records)
    garbage = dict(body, credential="MUNGE:AAAAbogus:")
    assert rig.post("/v1/report", json.dumps(garbage).encode())[0] == 401
    assert rig.controller.reports == {}


def test_cross_node_report_is_403(rig_factory, caplog):
    rig = rig_factory("auto")
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        status, payload = rig.report("node03", socket_of="node02")  # node02's munged claims node03
    assert status == 403 and "cross-node" in payload["error"]
    assert any("refused: 403" in r.getMessage() for r in caplog.records)
    assert rig.controller.reports == {}


def test_replayed_report_is_409(rig_factory, caplog):
    rig = rig_factory("observe")
    body = sign_report(state_doc("node02", time.time()), "node02", rig.fleet.socket("node02"))
    assert rig.post("/v1/report", body) == (200, {"accepted": True, "instructions": []})
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        assert rig.post("/v1/report", body)[0] == 409
    assert any("refused: 409" in r.getMessage() for r in caplog.records)


def test_oversized_body_is_413(rig_factory):
    rig = rig_factory("observe")
    status, _ = rig.post("/v1/report", b"x" * (1_048_576 + 1))
    assert status == 413


def _after_report(rig_factory, mode: str, node: str = "node02", *, rounds: int = 1) -> Rig:
    """A rig in `mode` that accepted `node`'s report of a failed GPU and then ran `rounds` control rounds."""
    rig = rig_factory(mode)
    assert rig.report(node)[0] == 200
    for _ in range(rounds):
        rig.controller.evaluate(time.time())
    return rig


def test_t1_report_in_auto_drains_with_incident_reason(rig_factory):
    rig = _after_report(rig_factory, "auto")
    assert len(rig.backend.writes) == 1
    call, node, reason = rig.backend.writes[0]
    assert (call, node) == ("drain", "node02")
    incident = rig.ledger.incidents(node="node02")[0].id
    assert reason.startswith("healthd: ") and reason.endswith(f"[#{incident}]")
    inc = rig.ledger.incident(incident)
    assert inc.decided_at is not None and inc.action_applied_at is not None
    hold = rig.ledger.hold("node02")
    assert hold.incident_id == incident and hold.reason == reason
    assert hold.reason_time == rig.backend.state["node02"].reason_time  # the proof of ownership, read back
    rig.controller.evaluate(time.time())  # the next round: already drained, no second write
    assert len(rig.backend.writes) == 1


def test_t1_report_in_observe_writes_nothing(rig_factory):
    rig = _after_report(rig_factory, "observe", rounds=2)
    assert rig.backend.writes == []
    rows = rig.ledger.decisions()
    assert len(rows) == 1 and rows[0].outcome == "refused" and rows[0].refused_gate == "mode"


def test_breaker_opens_and_limits_drains(rig_factory, caplog):
    rig = _after_report(rig_factory, "auto", "node01")
    assert len(rig.backend.writes) == 1  # one failing node of four: below breaker_min_nodes
    for node in ("node02", "node03"):
        assert rig.report(node)[0] == 200
    with caplog.at_level(logging.ERROR, logger="healthd.controller"):
        rig.controller.evaluate(time.time())
        rig.controller.evaluate(time.time())
    assert rig.ledger.breaker_state().open
    assert len(rig.backend.writes) == 1  # nothing more drained once the breaker is open
    alerts = [r for r in caplog.records if "circuit breaker open" in r.getMessage()]
    assert len(alerts) == 1
    refused = [d for d in rig.ledger.decisions(outcome="refused") if d.refused_gate == "breaker"]
    assert {d.node for d in refused} == {"node02", "node03"}
    reg = rig.controller.metrics.registry
    assert reg.get_sample_value("healthd_controller_breaker_open") == 1
    assert reg.get_sample_value("healthd_controller_refusals_total", {"gate": "breaker"}) == 2
    assert reg.get_sample_value("healthd_controller_actions_total", {"kind": "drain", "status": "applied"}) == 1
    assert reg.get_sample_value("healthd_controller_reports_total", {"result": "accepted"}) == 3
    assert reg.get_sample_value("healthd_controller_report_latency_seconds_count") == 3


def test_slurm_down_skips_the_round(rig_factory):
    rig = rig_factory("auto")
    assert rig.report("node02")[0] == 200
    rig.backend.unavailable = True
    assert rig.controller.evaluate(time.time()) is None
    assert rig.backend.writes == [] and rig.ledger.decisions() == []


def _drain_request(rig: Rig, node: str) -> tuple[int, dict]:
    doc = {"kind": "drain-request", "node": node, "finding": xid79(time.time(), evidence_kind="log"), "job": "4242"}
    return rig.post("/v1/request", sign_report(doc, node, rig.fleet.socket(node)))


def test_drain_request_granted_in_auto(rig_factory):
    rig = rig_factory("auto")
    status, payload = _drain_request(rig, "node03")
    assert status == 200 and payload["granted"] is True, payload
    assert [w[:2] for w in rig.backend.writes] == [("drain", "node03")]
    assert "4242" in rig.ledger.incidents(node="node03")[0].jobs


def test_drain_request_refused_in_observe(rig_factory):
    rig = rig_factory("observe")
    status, payload = _drain_request(rig, "node03")
    assert status == 200 and payload["granted"] is False and "observe" in payload["reason"]
    assert rig.backend.writes == []


def test_main_rejects_a_bad_config(tmp_path, capsys):
    cfg = tmp_path / "controller.yaml"
    cfg.write_text("listen: 127.0.0.1:9841\npolicy:\n  mode: yolo\n")
    assert main(["--config", str(cfg), "--once"]) == 2
    assert "policy.mode" in capsys.readouterr().err


def test_request_thread_is_not_blocked_by_a_slow_slurm(rig_factory):
    rig = rig_factory("auto")
    rig.controller.slurm_wait_s = 0.5
    real_nodes = rig.backend.nodes

    def slow_nodes(names=None):
        time.sleep(3)
        return real_nodes(names)

    rig.backend.nodes = slow_nodes  # type: ignore[method-assign]
    started = time.monotonic()
    status, payload = _drain_request(rig, "node02")
    assert time.monotonic() - started < 2.5
    assert status == 200 and payload["granted"] is False and "could not decide" in payload["reason"]


@pytest.mark.parametrize("mode", ["auto", "observe"])
def test_recover_at_start_never_applies_an_old_plan_blindly(rig_factory, mode):
    """A plan a crash left is abandoned at start when Slurm does not show it (the next round re-decides from
    current evidence, through every gate), adopted when it does; no Slurm write either way, in any mode."""
    rig = rig_factory(mode)
    d, landed = drain_decision("node04"), drain_decision("node03", incident="H2")
    crash_after_plan(rig.ledger, rig.backend, d, at=time.time())
    crash_after_plan(rig.ledger, rig.backend, landed, at=time.time())
    rig.backend.drain("node03", landed.reason)
    rig.backend.writes.clear()
    rig.controller.recover(time.time())
    rig.controller.recover(time.time())
    assert rig.backend.writes == []
    assert rig.ledger.pending_actions() == []
    assert {a.node: a.status for a in rig.ledger.actions()} == {"node04": "abandoned", "node03": "applied"}
    assert set(rig.ledger.holds()) == {"node03"}


@pytest.mark.parametrize("gate", ["breaker", "rate-limit", "mode"])
def test_a_plan_abandoned_at_start_is_re_decided_through_every_gate(rig_factory, gate):
    """A drain planned before a crash is never applied as planned: the agent's next report re-decides it, and
    what changed meanwhile (the breaker opened, the budget spent, the mode switched to observe) refuses it."""
    policy = {"max_actions_per_hour": 0} if gate == "rate-limit" else {}
    rig = rig_factory("observe" if gate == "mode" else "auto", **policy)
    now = time.time()
    d = drain_decision("node02")
    crash_after_plan(rig.ledger, rig.backend, d, at=now - 600)
    if gate == "breaker":
        rig.ledger.open_breaker("switch:leaf1", nodes=["node01", "node03"], at=now - 60)
    rig.controller.recover(now)
    assert [a.status for a in rig.ledger.actions()] == ["abandoned"]
    assert rig.report("node02")[0] == 200
    rig.controller.evaluate(time.time())
    assert rig.backend.writes == []
    refused = [row for row in rig.ledger.decisions(outcome="refused") if row.node == "node02"]
    assert refused and refused[-1].refused_gate == gate, refused


def test_one_nodes_bad_data_never_holds_another_nodes_drain_back(rig_factory):
    """A report that slipped past intake (or a bug a node's data triggers) breaks decide() for that node
    only: logged and skipped, while every other node's decision happens in the same round."""
    import dataclasses as dc

    from healthd.controller.policy import NodeReport, finding_from_json
    from healthd.model import Finding

    class Poisoned(Finding):
        def __getattribute__(self, name):
            if name in ("tier", "attribution", "action"):
                raise RuntimeError("poisoned finding")
            return super().__getattribute__(name)

    rig = rig_factory("auto")
    now = time.time()
    good = finding_from_json(state_doc("node02", now)["findings"][0])
    bad = dc.replace(good)
    object.__setattr__(bad, "__class__", Poisoned)  # poisoned after it was built, as a bug would be
    rig.controller.reports["node01"] = NodeReport(node="node01", verdict="failed", findings=(bad,), received_at=now)
    assert rig.report("node02")[0] == 200
    results = rig.controller.evaluate(time.time())
    assert results is not None
    assert [w[:2] for w in rig.backend.writes] == [("drain", "node02")]
    (none,) = [o for o, _ in results if o.decision.node == "node01"]
    assert none.decision.kind == "none" and "poisoned finding" in none.decision.note


def test_config_maps_yaml_onto_settings(tmp_path):
    from healthd.config import ConfigError
    from healthd.controller.config import load_controller_settings, parse_controller_settings

    s = parse_controller_settings(
        "listen: 0.0.0.0:9841\nnode_addrs: {node01: 10.0.0.1}\nrequeue_opt_in: 'requeue-me'\n"
        "policy:\n  mode: supervised\n  racks: {r1: [node01, node02]}\n  capacity_floors: {gpu: 2}\n"
    )
    assert s.listen == "0.0.0.0:9841" and s.node_addrs == {"node01": "10.0.0.1"}
    assert s.policy.mode == "supervised" and s.policy.racks == {"r1": frozenset({"node01", "node02"})}
    assert s.policy.capacity_floors == {"gpu": 2} and s.requeue_opt_in == "requeue-me"
    assert parse_controller_settings("").policy.mode == "observe"
    for text, key in [("bogus: 1", "bogus"), ("policy: {mode: off}", "policy.mode"),
                      ("policy: {max_actions_per_hour: many}", "policy.max_actions_per_hour"),
                      ("node_addrs: {node01: nodeaddr}", "node_addrs.node01"), ("listen: 9841", "listen"),
                      ("policy: {nope: 1}", "policy.nope"), ("ledger: relative.sqlite", "ledger")]:
        with pytest.raises(ConfigError) as info:
            parse_controller_settings(text, "c.yaml")
        assert info.value.key == key, text
    with pytest.raises(ConfigError):
        load_controller_settings(str(tmp_path / "missing.yaml"))


def test_supervised_waits_then_acts_after_approval(rig_factory):
    rig = _after_report(rig_factory, "supervised", rounds=2)
    assert rig.backend.writes == []
    (waiting,) = rig.ledger.waiting_decisions()
    assert waiting.node == "node02" and waiting.kind == "drain"
    rig.ledger.record_approval(waiting.id, operator="alice", verdict="approve")
    rig.controller.evaluate(time.time())
    assert [w[:2] for w in rig.backend.writes] == [("drain", "node02")]
    assert rig.ledger.decision(waiting.id).outcome == "allowed"
    assert rig.ledger.actions(node="node02")[0].decision_id == waiting.id


def test_rejected_decision_never_acts(rig_factory):
    rig = _after_report(rig_factory, "supervised")
    (waiting,) = rig.ledger.waiting_decisions()
    rig.ledger.record_approval(waiting.id, operator="alice", verdict="reject", why="known flaky riser, ticket 9")
    rig.controller.evaluate(time.time())
    assert rig.backend.writes == []


def _undo_a_drain(rig_factory, why: str):
    """A rig whose round drained node02 on its report, the drain, and the operator's undo of it."""
    from healthd.controller import admin

    rig = _after_report(rig_factory, "auto")
    (drain,) = rig.ledger.actions(node="node02")
    return rig, drain, admin.undo(rig.ledger, drain.id, "alice", why)


def test_operator_undo_is_run_once_by_the_next_round(rig_factory):
    rig, drain, result = _undo_a_drain(rig_factory, "false alarm, GPU reseated")
    assert result.ok, result
    rig.controller.evaluate(time.time())
    rig.controller.evaluate(time.time())
    assert [w[:2] for w in rig.backend.writes] == [("drain", "node02"), ("resume", "node02")]
    assert rig.ledger.action(drain.id).status == "undone"
    assert rig.ledger.action(result.data["undo_action_id"]).status == "applied"


def test_undo_refused_when_an_admin_took_the_node_over(rig_factory):
    import dataclasses

    rig, _, result = _undo_a_drain(rig_factory, "false alarm")
    rig.backend.state["node02"] = dataclasses.replace(rig.backend.state["node02"], reason="PSU swap", reason_user="bob")
    rig.controller.evaluate(time.time())
    assert [w[0] for w in rig.backend.writes] == ["drain"]
    assert rig.ledger.action(result.data["undo_action_id"]).status == "failed"


def test_main_rejects_an_unreadable_topology_conf(tmp_path, capsys):
    topo = tmp_path / "topology.conf"
    topo.write_text("SwitchName=leaf1 Nodes=node[01-02\n")
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(f"ledger: {tmp_path / 'l.sqlite'}\ntopology_conf: {topo}\n")
    assert main(["--config", str(cfg), "--once"]) == 2
    assert "topology.conf line 1" in capsys.readouterr().err


def test_correlated_rack_failure_is_one_group_incident_not_drains(rig_factory):
    rig = rig_factory("auto", racks={"r1": frozenset({"node01", "node02"})}, breaker_percent=60.0)
    for node in ("node01", "node02"):
        assert rig.report(node)[0] == 200
    rig.controller.evaluate(time.time())
    rig.controller.evaluate(time.time())
    assert rig.backend.writes == []
    assert not rig.ledger.breaker_state().open
    groups = [i for i in rig.ledger.incidents(status="open") if i.signature == "group:rack:r1"]
    assert len(groups) == 1 and groups[0].nodes == ("node01", "node02")
    refused = rig.ledger.decisions(outcome="refused")
    assert {(d.node, d.refused_gate) for d in refused} == {("node01", "correlation"), ("node02", "correlation")}


def test_a_report_with_a_new_actionable_finding_wakes_the_control_loop(rig_factory):
    rig = rig_factory("observe")
    assert rig.report("node02", {"node": "node02", "verdict": "healthy", "findings": []})[0] == 200
    assert not rig.controller.wake.is_set()
    assert rig.report("node02")[0] == 200  # Xid 79 appears
    assert rig.controller.wake.is_set()
    rig.controller.wake.clear()
    assert rig.report("node02")[0] == 200  # the same finding again (heartbeat): no news
    assert not rig.controller.wake.is_set()


def test_slurm_backend_is_scontrol_unless_pyslurm_is_asked_for():
    from healthd.config import ConfigError
    from healthd.controller.config import parse_controller_settings

    assert parse_controller_settings("").slurm_backend == "scontrol"
    assert parse_controller_settings("slurm_backend: pyslurm").slurm_backend == "pyslurm"
    with pytest.raises(ConfigError) as info:
        parse_controller_settings("slurm_backend: slurmrestd", "c.yaml")
    assert info.value.key == "slurm_backend"


def test_node_addresses_come_from_the_backend_resolved_and_unreadable_slurm_is_no_address(caplog):
    from healthd.controller.daemon import slurm_node_addrs

    backend = FakeBackend(["node01", "node02"])
    backend.addresses = {"node01": "127.0.0.1", "node02": "localhost"}
    assert slurm_node_addrs(backend) == {"node01": "127.0.0.1", "node02": "127.0.0.1"}
    backend.unavailable = True
    assert slurm_node_addrs(backend) == {}
    assert "cannot read NodeAddr from Slurm" in caplog.text


def test_node_addresses_come_with_the_fleet_views_lines_not_a_read_of_their_own(tmp_path):
    """With a backend whose lines carry NodeAddr, the controller resolves the addresses its view read
    (only changed lines are parsed for them) and never reads the whole fleet again for them."""
    from healthd.controller.config import ControllerSettings
    from healthd.controller.daemon import Controller
    from healthd.controller.ledger import Ledger
    from healthd.slurm.scontrol import parse_node_addresses as parse

    class Lines(FakeLinesBackend):
        parse_node_addresses = staticmethod(parse)

        def node_addresses(self, names=None):
            raise AssertionError("the whole fleet read again for NodeAddr")

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ctl = Controller(ControllerSettings(ledger=str(tmp_path / "ledger.sqlite")), ledger, Lines(["node01", "node02"]))
    try:
        ctl.fleet.refresh()
        ctl.refresh_node_addrs(time.time())
        assert dict(ctl.node_addrs()) == {"node01": "10.0.0.1", "node02": "10.0.0.1"}
    finally:
        ctl.close()
        ledger.close()


class SlowSlurm(FakeLinesBackend):
    """Slurm whose whole-fleet read and drain each take `delay_s` (a loaded slurmctld)."""

    delay_s = 0.3

    def node_lines(self) -> list[str]:
        time.sleep(self.delay_s)
        return super().node_lines()

    def drain(self, nodes, reason):
        time.sleep(self.delay_s)
        super().drain(nodes, reason)


def test_the_timeline_says_when_the_round_decided_and_when_the_write_returned(rig_factory):
    """decided_at is when the round decided (after a slow read of Slurm, not when the round began) and
    action_applied_at when the drain returned; the gap between them is the write's."""
    slow = SlowSlurm(NODES)
    rig = rig_factory("auto", backend=slow)
    assert rig.report("node02")[0] == 200
    started = time.time()
    rig.controller.evaluate(started)
    inc = rig.ledger.incidents(node="node02")[0]
    assert inc.decided_at - started >= slow.delay_s * 0.9, "decided_at is the round's start, not its decision"
    assert inc.action_applied_at - inc.decided_at >= slow.delay_s * 0.9, "applied before the write returned"
    assert inc.action_applied_at <= time.time()


def _until(probe, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_with_the_refresh_thread_a_round_reads_no_fleet_and_the_next_read_confirms_the_hold(rig_factory):
    """As the daemon runs: rounds act on the fleet view the refresh thread keeps; the drain's round
    reads only node02 (before the write), and the refresh the write triggers confirms the hold."""
    reads: list[str] = []

    class Counting(FakeLinesBackend):
        def node_lines(self) -> list[str]:
            reads.append("fleet")
            return super().node_lines()

    backend = Counting(NODES)
    rig = rig_factory("auto", backend=backend)
    rig.controller.start_fleet_refresh(3600.0)  # only the first read and the pokes after writes
    assert reads == ["fleet"]
    assert rig.report("node02")[0] == 200
    rig.controller.evaluate(time.time())
    assert [w[:2] for w in backend.writes] == [("drain", "node02")]
    assert not rig.ledger.hold("node02").confirmed  # not read back in the round
    _until(lambda: len(reads) >= 2)  # the write poked the refresh thread
    _until(lambda: "node02" in rig.controller.fleet.snapshot().out_of_service)
    rig.controller.evaluate(time.time())
    hold = rig.ledger.hold("node02")
    assert hold.confirmed and hold.reason_time == backend.state["node02"].reason_time
    assert [w[:2] for w in backend.writes] == [("drain", "node02")]  # never written twice


def test_someone_taking_the_node_right_after_the_write_ends_the_hold_at_the_next_read(rig_factory):
    backend = FakeLinesBackend(NODES)
    rig = rig_factory("auto", backend=backend)
    rig.controller.start_fleet_refresh(3600.0)
    assert rig.report("node02")[0] == 200
    rig.controller.evaluate(time.time())
    backend.set_reason("node02", "admin: cabling", user="alice")  # before the refresh saw healthd's write
    backend.writes.append(("admin",))  # slurmctld's answer changed: the lines are rendered again
    rig.controller.fleet.poke()
    _until(lambda: rig.controller.fleet.snapshot().nodes["node02"].reason == "admin: cabling")
    rig.controller.evaluate(time.time())
    assert rig.ledger.hold("node02") is None
    (action,) = [a for a in rig.ledger.actions(node="node02") if a.kind == "drain"]
    assert action.status == "released", action
    assert backend.state["node02"].reason == "admin: cabling"


def test_the_fleet_view_reads_nothing_during_a_round_and_reads_once_it_ended(rig_factory):
    """A read due (or poked) while a round runs waits for the round's end: on a small head node the
    read and the round would share the cores."""
    backend = FakeLinesBackend(NODES)
    reads: list[float] = []
    listed = backend.node_lines
    backend.node_lines = lambda: (reads.append(time.monotonic()), listed())[1]  # type: ignore[method-assign]
    rig = rig_factory("auto", backend=backend)
    period = 0.5
    rig.controller.start_fleet_refresh(period)
    inside: list[tuple[float, float]] = []
    reconcile = rig.controller.reconciler.round

    def slow_round(*args, **kwargs):
        began = time.monotonic()
        rig.controller.fleet.poke()
        time.sleep(1.6 * period)  # past the next read's time, short of two periods after the last
        inside.append((began, time.monotonic()))
        return reconcile(*args, **kwargs)

    rig.controller.reconciler.round = slow_round  # type: ignore[method-assign]
    seen = len(reads)
    _until(lambda: len(reads) > seen)  # right after a read: the next is due during the round
    assert rig.controller.evaluate(time.time()) is not None
    ended = time.monotonic()
    _until(lambda: any(t > ended for t in reads))
    (began, slept) = inside[0]
    assert not [t for t in reads if began <= t <= slept], (reads, inside)
    assert min(t for t in reads if t > ended) - ended < period / 2  # the due (and poked) read, at once
