"""Real scrapes for the observability tests: the `healthd run` agent on a simulated node (stand-in
NVML, IB tree, journal, as tests/agent/test_cli.py) serving /metrics on loopback and writing its textfile, and the
real Controller (real MUNGE, fake Slurm) serving ControllerMetrics on loopback after a few reports and
rounds. Each scrape is taken once per session and shared."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.fake_nvml import build_fake_nvml, healthy_node, write_nvml_config
from tests.support.ib_tree import make_ndr_node
from tests.support.journal import write_journal
from tests.support.polling import free_port, read_text, scrape, wait_for

HEALTHD = str(Path(sys.executable).with_name("healthd"))
NODES = ["node01", "node02", "node03", "node04"]


@pytest.fixture(scope="session")
def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (apt-get install --no-install-recommends prometheus)")
    return exe


@pytest.fixture(scope="session")
def agent_scrapes(tmp_path_factory) -> dict[str, str]:
    """{"http": the agent's /metrics body, "textfile": its node_exporter textfile}, taken after a T1
    Xid was read, so the labelled families have samples."""
    root = tmp_path_factory.mktemp("obs-agent")
    nvml_dir = build_fake_nvml(root / "fake-nvml")
    write_nvml_config(root / "nvml.conf", healthy_node(8))
    make_ndr_node(root / "sys/class/infiniband", ports=8)
    journal = root / "journal"
    journal.mkdir()
    ckpt = Path(tempfile.mkdtemp(prefix="healthd-obs-ckpt-", dir="/dev/shm"))
    port = free_port()
    textfile = root / "healthd.prom"
    config = root / "healthd.yaml"
    config.write_text(yaml.safe_dump({
        "node_name": "node01", "state_file": str(root / "run/state.json"), "state_dir": str(root / "lib"),
        "interval_s": 0.5, "nvml": {"expected_gpus": 8},
        "kernel_log": {"journal_dir": str(journal), "kmsg_path": None, "start_at": "head"},
        "infiniband": {"sysfs_root": str(root / "sys/class/infiniband"), "expected_ports": 8, "expected_rate_gbps": 400},
        "host": {"filesystems": [{"path": str(ckpt), "role": "checkpoint"}]},
        "metrics": {"listen": f"127.0.0.1:{port}", "textfile": str(textfile)},
    }))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
    env.update(LD_LIBRARY_PATH=str(nvml_dir), FAKE_NVML_CONFIG=str(root / "nvml.conf"))
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: scrape(url), lambda t: 'healthd_verdict{verdict="healthy"} 1.0' in t)
        write_journal(journal, ["NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python, GPU has fallen off the bus"],
                      start_usec=int(time.time() * 1e6))
        body = wait_for(lambda: scrape(url), lambda t: 'healthd_kernel_xid_lines_total{xid="79"}' in t
                        and 'tier="1"' in t)
        text = wait_for(lambda: read_text(textfile), lambda t: 'healthd_kernel_xid_lines_total{xid="79"}' in t)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        shutil.rmtree(ckpt, ignore_errors=True)
    assert proc.returncode == 0, err
    return {"http": body, "textfile": text}


def _xid79(node_now: float) -> dict:
    from healthd.model import iso

    return {"id": "xid:gpu0:79", "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
            "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79 gpu0: fell off the bus",
            "evidence": [{"kind": "log", "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
            "first_seen": iso(node_now), "last_seen": iso(node_now)}


@pytest.fixture(scope="session")
def controller_scrape(request: pytest.FixtureRequest, tmp_path_factory) -> str:
    """The controller's metrics endpoint body after accepted and refused reports and a few rounds in
    supervised mode (a decision waits for approval, an incident is open)."""
    from tests.controller.munge_support import munged_path
    from tests.support.shared_daemons import session_munge_fleet

    if munged_path() is None:
        pytest.skip("munged not installed (apt-get install munge): the controller scrape needs real MUNGE")
    from healthd.agent.goodput_ship import GoodputShipper
    from healthd.envelope import sign_report
    from healthd.controller.config import ControllerSettings
    from healthd.controller.goodput_jobs import GoodputAccountant, GoodputSettings
    from healthd.settings import ControllerClientSettings
    from healthd.slurm.backend import JobInfo
    from tests.goodput.test_ledger_join import node_log
    from healthd.controller.daemon import Controller
    from healthd.controller.ledger import Ledger
    from healthd.controller.metrics import ControllerMetrics
    from healthd.controller.policy import ControllerPolicySettings
    from healthd.controller.server import ControllerHTTPServer
    from tests.support.fake_slurm import FakeBackend

    root = tmp_path_factory.mktemp("obs-controller")
    fleet = session_munge_fleet(request.config, NODES)
    ledger = Ledger(root / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(root / "ledger.sqlite"),
                                  munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                  policy=ControllerPolicySettings(mode="supervised"),
                                  goodput=GoodputSettings(directory=str(root / "gathered"), settle_s=0))
    metrics = ControllerMetrics()
    backend = FakeBackend(NODES)
    controller = Controller(settings, ledger, backend, metrics=metrics)
    server = ControllerHTTPServer(settings.listen, controller)
    server.start_background()
    port = free_port()
    metrics_server = metrics.serve(f"127.0.0.1:{port}")
    try:
        def post(node: str, doc: dict, signer: str) -> int:
            req = urllib.request.Request(server.url + "/v1/report", method="POST",
                                         data=sign_report(doc, node, fleet.socket(signer)),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code

        now = time.time()
        assert post("node01", {"node": "node01", "verdict": "healthy", "findings": []}, "node01") == 200
        assert post("node02", {"node": "node02", "verdict": "failed", "findings": [_xid79(now)]}, "node02") == 200
        assert post("node03", {"node": "node03", "verdict": "healthy", "findings": []}, "node04") != 200
        # a job's goodput log shipped by node01's agent, and accounted once Slurm says it ended
        (root / "node01/goodput").mkdir(parents=True)
        (root / "node01/goodput/4242.jsonl").write_text(node_log())
        shipper = GoodputShipper(ControllerClientSettings(url=server.url, munge_socket=fleet.socket("node01")),
                                 "node01", str(root / "node01"), start=False)
        assert shipper.ship_once() and shipper.counters["shipments"] == 1
        backend.known_jobs["4242"] = JobInfo("4242", True, "", 1, "COMPLETED", "gpu", "ml")
        accountant = GoodputAccountant(settings.goodput, backend, settings.ledger, metrics.goodput.publish)
        assert accountant.pass_once() == ["4242"]
        accountant.jobs.close()
        for _ in range(3):
            controller.evaluate(time.time())
            # the one line daemon.py's evaluate runs after a full round; called here too so this
            # scrape does not depend on it (idempotent)
            metrics.observe_round(controller.round_figures(time.time()))
        body = wait_for(lambda: scrape(f"http://127.0.0.1:{port}/metrics"),
                        lambda t: "healthd_controller_approvals_waiting 1.0" in t)
    finally:
        if metrics_server is not None:
            metrics_server[0].shutdown()
            metrics_server[0].server_close()
        server.shutdown()
        server.server_close()
        controller.close()
        ledger.close()
    return body


def metric_names(exposition: str) -> set[str]:
    """Every name a PromQL query can select in this exposition: sample names (with the histogram
    suffixes) and the family names of HELP/TYPE lines (a labelled family with no child yet)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def dump(obj) -> str:
    return json.dumps(obj, indent=1)[:3000]
