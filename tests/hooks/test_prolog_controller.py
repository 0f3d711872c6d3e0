"""`hooks.gating: controller`: the installed healthd-prolog, run with slurmd's environment, asks a small
test controller (a real HTTP server on 127.0.0.1 that verifies the signed drain request against real
munged daemons) and refuses the job only when the drain is granted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.controller.munge_support import MungeFleet, munged_path
from tests.hooks.support import Node, finding, state_doc
from tests.support.shared_daemons import session_munge_fleet
from tests.support.stub_controller import VerifyingController

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")

NODES = ["node01", "node02", "node03", "node04"]
T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> MungeFleet:
    """The session's munged fleet of node01..node04 (tests/support/shared_daemons.py): node01 signs."""
    return session_munge_fleet(request.config, NODES)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def configure(node: Node, fleet: MungeFleet, url: str, *, hook_timeout_s: float = 5.0, timeout_s: float = 5.0) -> None:
    node.write_config(gating="controller", timeout_s=hook_timeout_s)
    doc = yaml.safe_load(node.config.read_text())
    doc["controller"] = {"url": url, "timeout_s": timeout_s, "munge_socket": fleet.socket("node01")}
    node.config.write_text(yaml.safe_dump(doc))


@pytest.fixture
def serve(node: Node, fleet: MungeFleet):
    """serve(answer): a test controller whose /v1/request verifies the envelope, records it and answers
    `answer` (None: never answers), with `node` configured to ask it; closed at the end."""
    made: list[VerifyingController] = []

    def start(answer: dict | None, *, node_addrs: dict[str, str] | None = None, **timeouts: float) -> VerifyingController:
        srv = VerifyingController(fleet, answer, hang=answer is None, node_addrs=node_addrs)
        made.append(srv)
        configure(node, fleet, srv.url, **timeouts)
        return srv

    yield start
    for srv in made:
        srv.close()


def test_granted_refuses_the_job(node, serve):
    srv = serve({"granted": True, "reason": "drained node01: healthd: xid 79 gpu1 [#12]"})
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="21", gpus="0,1"))
    assert rc == 1, err
    assert srv.paths == ["/v1/request"]
    (req,) = srv.verified
    assert req.node == "node01" and req.uid == 0
    assert req.report["kind"] == "drain-request" and req.report["node"] == "node01" and req.report["job"] == "21"
    assert req.report["finding"]["id"] == "xid:gpu1:79"
    assert "refused job 21: the controller drained node node01" in err and "[#12]" in err
    assert node.writes() == []  # the controller drains; the hook does not touch Slurm


def test_refused_by_the_envelope_runs_the_job_and_says_why(node, serve):
    srv = serve({"granted": False, "reason": "circuit breaker open: 3 of 4 nodes failing"})
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="22", gpus="1"))
    assert rc == 0, err
    assert len(srv.verified) == 1
    assert "job 22 runs although xid 79 gpu1: fell off the bus" in err
    assert "circuit breaker open: 3 of 4 nodes failing" in err
    assert node.writes() == []


def test_a_rejected_envelope_runs_the_job(node, serve):
    srv = serve({"granted": True}, node_addrs={"node01": "127.0.0.99"})  # a cross-node credential to it: 403
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="23", gpus="1"))
    assert rc == 0, err
    assert "HTTP 403" in err and "cross-node" in err
    assert srv.paths == ["/v1/request"] and srv.verified == []


def test_no_request_without_a_t1_hardware_finding(node, serve):
    srv = serve({"granted": True})
    node.write_state(state_doc(findings=[finding("xid:gpu3:79", 3)]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="24", gpus="0,1"))
    assert rc == 0 and srv.paths == [], err


def test_controller_down_runs_the_job(node, serve):
    serve({"granted": True}).close()  # nothing listens there now
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, took = node.run("healthd-prolog", node.prolog_env(job="25", gpus="1"))
    assert rc == 0, err
    assert "did not grant the drain" in err and "unreachable" in err
    assert took < 5


def test_a_hanging_controller_runs_the_job_within_the_deadline(node, serve):
    srv = serve(None, hook_timeout_s=2.0, timeout_s=30.0)  # the deadline is the limit
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, took = node.run("healthd-prolog", node.prolog_env(job="26", gpus="1"))
    assert rc == 0, err
    assert took < 2.0 + 1.5, err  # hooks.timeout_s plus interpreter start
    assert "job 26 runs although" in err and "no answer within 1." in err
    assert srv.paths == ["/v1/request"]


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
def test_an_untrusted_state_sends_no_drain_request(node, serve, spoil, said):
    """A T1 finding on the job's GPU in a state file someone other than root could have written: no
    signed drain request leaves the node, and the job runs."""
    srv = serve({"granted": True})
    node.write_state(state_doc(findings=[T1_GPU1]))
    node.state_file.chmod(0o644)
    spoil(node)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="28", gpus="1"))
    assert rc == 0, err
    assert srv.paths == [] and srv.verified == []
    assert "job 28 runs: agent unknown: state file refused: " in err and said in err
    assert node.writes() == []


def test_a_node_level_t1_finding_asks_the_controller(node, serve):
    srv = serve({"granted": True, "reason": "drained node01: healthd: 3 of 4 GPUs [#13]"})
    node.write_state(state_doc(findings=[finding("nvml.gpu_count:node", None, summary="3 of 4 GPUs visible to NVML")]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="29", gpus="3"))
    assert rc == 1, err
    (req,) = srv.verified
    assert req.report["finding"]["id"] == "nvml.gpu_count:node" and req.report["job"] == "29"
    # a job without GPUs is not refused, and nothing is asked for it
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="30", gpus=""))
    assert rc == 0 and len(srv.paths) == 1, err
