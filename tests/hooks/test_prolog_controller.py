"""`hooks.gating: controller`: the installed healthd-prolog, run with slurmd's environment, asks a small
test controller (a real HTTP server on 127.0.0.1 that verifies the signed drain request against real
munged daemons) and refuses the job only when the drain is granted."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from healthd.controller import auth
from tests.controller.munge_support import MungeFleet, munged_path
from tests.hooks.support import Node, finding, state_doc

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")

T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")


@pytest.fixture(scope="module")
def fleet():
    with MungeFleet(["node01"]) as f:
        yield f


class RequestServer:
    """/v1/request: verifies the envelope, records the request, answers with `answer` (or hangs)."""

    def __init__(self, fleet: MungeFleet, answer: tuple[int, dict] | None):
        self.fleet, self.answer = fleet, answer
        self.requests: list[auth.VerifiedReport] = []
        self.paths: list[str] = []
        self.release = threading.Event()
        srv = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                srv.paths.append(self.path)
                if srv.answer is None:  # hanging controller
                    srv.release.wait(30)
                    return
                status, doc = srv.answer
                try:
                    srv.requests.append(auth.verify_report(body, socket=srv.fleet.controller_socket,
                                                           node_addrs=srv.fleet.node_addrs, now=time.time()))
                except auth.ReportRejected as e:
                    status, doc = e.http_status, {"error": e.reason}
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def configure(node: Node, fleet: MungeFleet, url: str, *, hook_timeout_s: float = 5.0, timeout_s: float = 5.0) -> None:
    node.write_config(gating="controller", timeout_s=hook_timeout_s)
    doc = yaml.safe_load(node.config.read_text())
    doc["controller"] = {"url": url, "timeout_s": timeout_s, "munge_socket": fleet.socket("node01")}
    node.config.write_text(yaml.safe_dump(doc))


def serve(fleet, answer):
    s = RequestServer(fleet, answer)
    return s


def test_granted_refuses_the_job(node, fleet):
    srv = serve(fleet, (200, {"granted": True, "reason": "drained node01: healthd: xid 79 gpu1 [#12]"}))
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[T1_GPU1]))
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="21", gpus="0,1"))
        assert rc == 1, err
        assert srv.paths == ["/v1/request"]
        (req,) = srv.requests
        assert req.node == "node01" and req.uid == 0
        assert req.report["kind"] == "drain-request" and req.report["node"] == "node01" and req.report["job"] == "21"
        assert req.report["finding"]["id"] == "xid:gpu1:79"
        assert "refused job 21: the controller drained node node01" in err and "[#12]" in err
        assert node.writes() == []  # the controller drains; the hook does not touch Slurm
    finally:
        srv.close()


def test_refused_by_the_envelope_runs_the_job_and_says_why(node, fleet):
    srv = serve(fleet, (200, {"granted": False, "reason": "circuit breaker open: 3 of 4 nodes failing"}))
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[T1_GPU1]))
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="22", gpus="1"))
        assert rc == 0, err
        assert len(srv.requests) == 1
        assert "job 22 runs although xid 79 gpu1: fell off the bus" in err
        assert "circuit breaker open: 3 of 4 nodes failing" in err
        assert node.writes() == []
    finally:
        srv.close()


def test_a_rejected_envelope_runs_the_job(node, fleet):
    srv = serve(fleet, (200, {"granted": True}))
    srv.fleet = MungeFleet.__new__(MungeFleet)
    srv.fleet.__dict__.update(fleet.__dict__)
    srv.fleet.node_addrs = {"node01": "127.0.0.99"}  # the controller sees a cross-node credential: 403
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[T1_GPU1]))
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="23", gpus="1"))
        assert rc == 0, err
        assert "HTTP 403" in err and "cross-node" in err
    finally:
        srv.close()


def test_no_request_without_a_t1_hardware_finding(node, fleet):
    srv = serve(fleet, (200, {"granted": True}))
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[finding("xid:gpu3:79", 3)]))
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="24", gpus="0,1"))
        assert rc == 0 and srv.paths == [], err
    finally:
        srv.close()


def test_controller_down_runs_the_job(node, fleet):
    srv = serve(fleet, (200, {"granted": True}))
    url = srv.url
    srv.close()  # nothing listens there now
    configure(node, fleet, url)
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, took = node.run("healthd-prolog", node.prolog_env(job="25", gpus="1"))
    assert rc == 0, err
    assert "did not grant the drain" in err and "unreachable" in err
    assert took < 5


def test_a_hanging_controller_runs_the_job_within_the_deadline(node, fleet):
    srv = serve(fleet, None)
    try:
        configure(node, fleet, srv.url, hook_timeout_s=2.0, timeout_s=30.0)  # the deadline is the limit
        node.write_state(state_doc(findings=[T1_GPU1]))
        rc, err, took = node.run("healthd-prolog", node.prolog_env(job="26", gpus="1"))
        assert rc == 0, err
        assert took < 2.0 + 1.5, err  # hooks.timeout_s plus interpreter start
        assert "job 26 runs although" in err and "no answer within 1." in err
        assert srv.paths == ["/v1/request"]
    finally:
        srv.close()


def test_gating_controller_needs_a_controller_url(node):
    node.write_config(gating="controller")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="27", gpus="1"))
    assert rc == 0 and "controller.url" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")
@pytest.mark.parametrize("spoil, said", [
    (lambda n: os.chown(n.state_file, 65534, 65534), "owner uid 65534, mode -rw-r--r-- (0644)"),
    (lambda n: n.state_file.chmod(0o666), "owner uid 0, mode -rw-rw-rw- (0666)"),
    (lambda n: n.run_dir.chmod(0o775), "owner uid 0, mode drwxrwxr-x (0775)"),
])
def test_an_untrusted_state_sends_no_drain_request(node, fleet, spoil, said):
    """A T1 finding on the job's GPU in a state file someone other than root could have written: no
    signed drain request leaves the node, and the job runs."""
    srv = serve(fleet, (200, {"granted": True}))
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[T1_GPU1]))
        node.state_file.chmod(0o644)
        spoil(node)
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="28", gpus="1"))
        assert rc == 0, err
        assert srv.paths == [] and srv.requests == []
        assert "job 28 runs: agent unknown: state file refused: " in err and said in err
        assert node.writes() == []
    finally:
        srv.close()


def test_a_node_level_t1_finding_asks_the_controller(node, fleet):
    srv = serve(fleet, (200, {"granted": True, "reason": "drained node01: healthd: 3 of 4 GPUs [#13]"}))
    try:
        configure(node, fleet, srv.url)
        node.write_state(state_doc(findings=[finding("nvml.gpu_count:node", None, summary="3 of 4 GPUs visible to NVML")]))
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="29", gpus="3"))
        assert rc == 1, err
        (req,) = srv.requests
        assert req.report["finding"]["id"] == "nvml.gpu_count:node" and req.report["job"] == "29"
        # a job without GPUs is not refused, and nothing is asked for it
        rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="30", gpus=""))
        assert rc == 0 and len(srv.paths) == 1, err
    finally:
        srv.close()
