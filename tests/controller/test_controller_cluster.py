"""healthd-controller against a real local Slurm (tests/support/slurm_cluster.py) and real munged daemons:
a signed Xid 79 report for node02 drains it in `auto` and changes nothing in `observe`."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from healthd.envelope import sign_report
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings
from healthd.controller.server import ControllerHTTPServer
from healthd.model import iso
from healthd.slurm.scontrol import ScontrolBackend
from tests.controller.munge_support import MungeFleet, munged_path
from tests.support.polling import poll, scrape
from tests.support.slurm_cluster import SlurmCluster, held_view

NODES = ["node01", "node02", "node03", "node04"]

pytestmark = pytest.mark.skipif(
    munged_path() is None or shutil.which("slurmctld") is None or shutil.which("slurmd") is None,
    reason="needs munged, slurmctld and slurmd (apt-get install slurm-wlm munge)",
)


def snapshot(backend: ScontrolBackend) -> dict:
    return {n.name: (n.state, n.flags, n.reason) for n in backend.nodes()}


def _report(fleet: MungeFleet, node: str) -> bytes:
    now = time.time()
    finding = {"id": "xid:gpu0:79", "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
               "attribution": "hardware", "tier": 1, "action": "drain-and-requeue",
               "summary": "xid 79 gpu0: fell off the bus",
               "evidence": [{"kind": "log", "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
               "first_seen": iso(now), "last_seen": iso(now)}
    doc = {"node": node, "verdict": "failed", "findings": [finding]}
    return sign_report(doc, node, fleet.socket(node))


def _run(cluster: SlurmCluster, fleet: MungeFleet, tmp_path: Path, mode: str):
    backend = ScontrolBackend(str(cluster.conf_path), timeout_s=10)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                  slurm_conf=str(cluster.conf_path),
                                  policy=ControllerPolicySettings(mode=mode))  # type: ignore[arg-type]
    controller = Controller(settings, ledger, backend)
    server = ControllerHTTPServer(settings.listen, controller)
    server.start_background()
    try:
        req = urllib.request.Request(server.url + "/v1/report", data=_report(fleet, "node02"), method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and json.loads(resp.read())["accepted"] is True
        results = controller.evaluate(time.time())
        assert results is not None
        return backend, ledger, results
    finally:
        server.shutdown()
        server.server_close()
        controller.close()


def test_observe_changes_no_node_state(cluster, fleet, tmp_path):
    cluster.wait_idle()
    before = snapshot(ScontrolBackend(str(cluster.conf_path), timeout_s=10))
    backend, ledger, results = _run(cluster, fleet, tmp_path, "observe")
    try:
        assert [o.label for o, _ in results] == ["refused-by-mode"]
        assert snapshot(backend) == before
        assert ledger.actions() == []
    finally:
        ledger.close()


def test_auto_drains_node02_with_healthd_reason(cluster, fleet, tmp_path):
    cluster.wait_idle()
    backend, ledger, results = _run(cluster, fleet, tmp_path, "auto")
    try:
        assert [(o.status, r.status if r else None) for o, r in results] == [("allowed", "applied")], results
        incident = ledger.incidents(node="node02")[0].id
        shown = cluster.run(["scontrol", "show", "node", "node02"], check=True).stdout
        assert "Reason=healthd: " in shown and f"[#{incident}]" in shown
        assert "DRAIN" in shown
        action = ledger.actions(node="node02")[0]
        assert action.status == "applied" and action.argv[0].endswith("scontrol")
    finally:
        ledger.close()
        cluster.run(["scontrol", "update", "NodeName=node02", "State=RESUME"], timeout=15)


def test_drain_and_requeue_requeues_the_opted_in_batch_job(cluster, fleet, tmp_path):
    cluster.wait_idle()
    submitted = []
    for comment in ("healthd:requeue please", "keep me"):
        out = cluster.run(["sbatch", "--parsable", "-w", "node02", "--comment", comment, "--requeue",
                           "-o", "/dev/null", "--wrap", "sleep 300"], check=True).stdout
        submitted.append(out.strip().split(";")[0])
    cluster.wait_for(lambda: set(submitted) <= set(cluster.run(["squeue", "-h", "-w", "node02", "-t", "R", "-o",
                                                                 "%i"]).stdout.split()),
                     30, what=f"jobs {submitted} to start on node02")
    backend, ledger, results = _run(cluster, fleet, tmp_path, "auto")
    try:
        (outcome, result), = results
        assert result is not None and result.status == "applied", result
        assert f"requeued {submitted[0]}" in result.detail
        first = cluster.run(["scontrol", "show", "job", submitted[0]], check=True).stdout
        second = cluster.run(["scontrol", "show", "job", submitted[1]], check=True).stdout
        assert "Restarts=1" in first
        assert "Restarts=0" in second
    finally:
        ledger.close()
        cluster.run(["scancel", *submitted], timeout=15)
        cluster.run(["scontrol", "update", "NodeName=node02", "State=RESUME"], timeout=15)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_dry_run_prints_the_drain_and_stops_on_sigterm(cluster, fleet, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    cluster.wait_idle()
    before = snapshot(ScontrolBackend(str(cluster.conf_path), timeout_s=10))
    port = _free_port()
    cfg = tmp_path / "controller.yaml"
    metrics_port = _free_port()
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\nledger: {tmp_path / 'ledger.sqlite'}\nmunge_socket: {fleet.controller_socket}\n"
        f"slurm_conf: {cluster.conf_path}\nnode_addrs: {json.dumps(fleet.node_addrs)}\npolicy:\n  mode: auto\n"
        f"admin_socket: {tmp_path / 'admin.sock'}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "healthd.controller.daemon", "--config", str(cfg), "--dry-run",
                             "--interval", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SLURM_CONF=str(cluster.conf_path)))
    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"controller did not come up: {proc.communicate(timeout=5)}")
        return scrape(f"http://127.0.0.1:{port}/healthz") is not None

    def rounds() -> list[float]:
        body = scrape(f"http://127.0.0.1:{metrics_port}/metrics") or ""
        return [float(line.split()[1]) for line in body.splitlines()
                if line.startswith("healthd_controller_last_round_timestamp_seconds ")]

    try:
        poll(up, 30, "the controller's /healthz")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/report", data=_report(fleet, "node02"), method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        # several rounds after the report: a drain printed once per round would show more than once
        after, seen = time.time(), set()
        poll(lambda: seen.update(t for t in rounds() if t > after) or len(seen) >= 4, 30, "4 control rounds",
             interval=0.05)
        from healthd.controller.admin import call_admin

        assert call_admin(str(tmp_path / "admin.sock"), {"cmd": "ping"})["ok"] is True
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.startswith("dry-run: would run: ")]
    assert len(lines) == 1, out  # printed once, not once per round
    assert "NodeName=node02" in lines[0] and "State=DRAIN" in lines[0] and "Reason=healthd: " in lines[0]
    assert "stopping" in err
    assert snapshot(ScontrolBackend(str(cluster.conf_path), timeout_s=10)) == before


def test_node_addrs_from_slurm_nodeaddr(cluster, tmp_path):
    from healthd.controller.daemon import slurm_node_addrs

    addrs = slurm_node_addrs(ScontrolBackend(str(cluster.conf_path), timeout_s=10))
    assert set(addrs) == set(cluster.nodes)
    assert all(a.count(".") == 3 for a in addrs.values())


def test_slurmctld_down_skips_rounds_and_nothing_stale_is_applied(cluster, fleet, tmp_path):
    cluster.wait_idle()
    backend = ScontrolBackend(str(cluster.conf_path), timeout_s=3)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                  slurm_conf=str(cluster.conf_path),
                                  policy=ControllerPolicySettings(mode="auto", report_ttl_s=2.0))
    controller = Controller(settings, ledger, backend)
    try:
        assert controller.receive_report(_report(fleet, "node02"))[0] == 200
        cluster.stop_ctld()
        try:
            assert controller.evaluate(time.time()) is None  # logged and skipped, no crash
            assert ledger.decisions() == [] and ledger.actions() == []
            time.sleep(2.5)  # the report goes stale while slurmctld is away
        finally:
            cluster.start_ctld()
        cluster.wait_registered()
        results = controller.evaluate(time.time())
        assert results is not None
        assert [(o.decision.kind, o.status) for o, _ in results] == [("none", "recorded")]
        assert results[0][0].decision.id == "none:node02:stale-report"
        assert ledger.actions() == []
        # not drained: no reason held (24.11 still shows an earlier test's, resumed, on the IDLE node)
        shown = held_view(cluster.node_state("node02"))
        assert "DRAIN" not in shown["State"] and "healthd:" not in shown.get("Reason", ""), shown
    finally:
        controller.close()
        ledger.close()


def test_restart_after_crash_between_plan_and_write_adopts_or_abandons(cluster, fleet, tmp_path):
    """At start, a write a crash left planned is adopted when the real slurmctld shows it (with the reason time
    and user it recorded) and abandoned otherwise; nothing is written at start."""
    from healthd.controller.executor import Executor, idempotency_key
    from healthd.controller.policy import Decision, make_reason
    from healthd.controller.reconcile import Reconciler

    cluster.wait_idle()
    backend = ScontrolBackend(str(cluster.conf_path), timeout_s=10)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        planned = {}
        for node in ("node03", "node04"):
            d = Decision(id=f"drain:{node}:xid:gpu0:79", kind="drain", node=node,
                         reason=make_reason("xid 79 gpu0: fell off the bus", "7"), tier=1, attribution="hardware",
                         incident="7", decided_at=time.time())
            row = ledger.record_decision(node=node, kind="drain", tier="T1", mode="auto", reason=d.reason,
                                         outcome="allowed")
            planned[node] = ledger.plan_action(decision_id=row.id, idempotency_key=idempotency_key(d), node=node,
                                               kind="drain", argv=Executor(backend, ledger).argv_for(d), reason=d.reason)
        # node04's write landed before the crash; node03's did not
        backend.drain("node04", planned["node04"].reason)
        shown = backend.node("node04")
        reconciler = Reconciler(Executor(backend, ledger))
        changes = {c.action_id: c.what for c in reconciler.at_start(time.time(), "auto")}
        assert changes == {planned["node03"].id: "abandoned", planned["node04"].id: "adopted"}
        assert reconciler.at_start(time.time(), "auto") == []
        assert not backend.node("node03").drain_requested  # an old plan is never applied blindly
        assert backend.node("node04").reason_time == shown.reason_time  # not written a second time
        hold = ledger.hold("node04")
        assert (hold.reason_time, hold.reason_user) == (shown.reason_time, shown.reason_user)
        assert ledger.hold("node03") is None
    finally:
        ledger.close()
        cluster.run(["scontrol", "update", "NodeName=node03,node04", "State=RESUME"], timeout=15)
