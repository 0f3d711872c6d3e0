"""The REAL LBNL NHC (1.4.3+4, ../shared/third_party; tests/support/nhc.py) as the HealthCheckProgram of
a real local Slurm cluster, with healthd's `check_healthd` (slurm/nhc/healthd.nhc) in its nhc.conf, as
slurm/README.md tells a site to install it. Each node has a real `healthd run` agent (the C stand-in
NVML, tests/slurm/e2e_support.py) and healthd's prolog and epilog; slurmd runs NHC every
HEALTH_CHECK_INTERVAL_S, and NHC runs healthd-healthcheck through the check line slurm/README.md gives
(read from that file), then check_healthd, then one NHC check of its own (a file per node that a test
removes to fail it: NHC's own reason for a drain).

1. A healthy node passes: it stays IDLE, NHC's online helper finds it online, healthd-healthcheck ran.
2. A node whose agent holds a hardware T1 finding is drained by NHC with healthd's words in the
   reason, and NHC puts it back online once the finding is gone.
3. A node NHC drained for its own check is never taken over or resumed by healthd's controller; a
   node healthd's controller drained is not resumed by NHC, and stays the controller's (its hold,
   healthd.controller.ownership) through NHC's runs, failing ones included.
4. The agent gone or stuck (stale state): check_healthd logs and passes by default; with -u, NHC
   drains the node, and puts it back online when the agent is back.

Slurm 22.05 on the host; every scenario puts the cluster back (tests/slurm/e2e_support.restore).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.ownership import owned
from healthd.controller.policy import ControllerPolicySettings
from healthd.controller.server import ControllerHTTPServer
from healthd.envelope import sign_report
from healthd.model import iso
from healthd.slurm.scontrol import ScontrolBackend
from tests.controller.munge_support import MungeFleet
from tests.slurm.e2e_support import NODES, HooksCluster, running_cluster, scenario_then_restore, wait_for
from tests.support.nhc import NHC_LEADER, NhcSite, build, missing_reason
from tests.support.shared_daemons import session_cluster, session_munge_fleet
from tests.support.wire import post_json

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
HEALTH_CHECK_INTERVAL_S = 4  # four NHC runs, each with two Python processes, per interval on two cores
STALE_AFTER_S = 6  # node04's hooks.stale_after_s: a stopped agent is stale within a test
SCENARIO_LIMIT_S = 150

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a real Slurm cluster needs root (slurmd, mknod)"),
    pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or ""),
]


def docs_check_line() -> str:
    """The nhc.conf line slurm/README.md gives for running healthd-healthcheck under NHC, exactly."""
    text = (REPO / "slurm" / "README.md").read_text()
    lines = re.findall(r"`(\* \|\| check_cmd_status [^`]*healthd-healthcheck)`", text)
    assert len(lines) == 1, f"slurm/README.md: expected one check_cmd_status line for healthd-healthcheck, found {lines}"
    return lines[0]


class NhcCluster:
    """The HooksCluster with NHC as its HealthCheckProgram, and what the tests change in nhc.conf."""

    def __init__(self, hooks: HooksCluster, site: NhcSite):
        self.e2e = hooks
        self.site = site
        self.marks = hooks.root / "nhc-ok"  # NHC's own check: this node's file must exist

    def conf_lines(self, healthd_args: str = "") -> list[str]:
        hc = self.e2e.bin / "healthd-healthcheck"
        lines = [f"* || export HEALTHD_NHC_BIN={VENV_BIN / 'healthd'}"]
        # the node's own healthd.yaml (as HooksCluster lays them out: nodes/<node>/healthd.yaml)
        lines += [f"{n} || export HEALTHD_NHC_CONFIG={self.e2e.root / 'nodes' / n / 'healthd.yaml'}" for n in NODES]
        lines.append(docs_check_line().replace("/etc/slurm/healthd-healthcheck", str(hc)))
        lines.append(f"* || check_healthd{' ' + healthd_args if healthd_args else ''}")
        lines.append(f"* || check_file_test -f {self.marks}/$HOSTNAME")
        return lines

    def reset(self) -> None:
        self.marks.mkdir(exist_ok=True)
        for n in NODES:
            (self.marks / n).touch()
        self.site.write_conf(self.conf_lines())

    def runs(self, node: str) -> int:
        """NHC runs on `node` that ended in its online helper (a run that passed every check)."""
        return sum(1 for line in self.site.log_lines(node) if line.endswith(f"node-mark-online {node}"))

    def wait_runs(self, node: str, count: int = 2) -> None:
        """Until NHC has run `count` more times on `node` (passing or failing: each run ends in one helper)."""
        def ran() -> int:
            return sum(1 for line in self.site.log_lines(node) if re.search(rf"node-mark-(on|off)line {node}\b", line))

        start = ran()
        wait_for(lambda: ran() >= start + count, count * HEALTH_CHECK_INTERVAL_S + 30,
                 f"{count} more NHC runs on {node}", diagnostics=lambda: self.diagnostics(node))

    def diagnostics(self, node: str) -> str:
        return (f"--- NHC log of {node} (tail)\n" + "\n".join(self.site.log_lines(node)[-15:]) + "\n"
                + self.e2e.diagnostics())

    def reason(self, node: str) -> tuple[str, str]:
        info = self.e2e.node(node)
        return info.get("State", ""), info.get("Reason", "")


@pytest.fixture(scope="module")
def nhc(request: pytest.FixtureRequest) -> Iterator[NhcCluster]:
    nhc_dir = build()
    made: list[NhcCluster] = []

    def prepare(e2e: HooksCluster) -> None:
        site = NhcSite(e2e.root / "nhc", nhc_dir, e2e.cluster.conf_path)
        site.install(extra_scripts=[REPO / "slurm" / "nhc" / "healthd.nhc"])
        e2e.hooks["HealthCheckProgram"] = str(site.program)
        made.append(NhcCluster(e2e, site))
        made[0].reset()

    with running_cluster(request, "nhc", VENV_BIN, prepare, shared=session_cluster(request.config)) as e2e:
        c = made[0]
        e2e.cluster.reconfigure(hooks=e2e.hooks, health_check_interval=HEALTH_CHECK_INTERVAL_S)
        # node04's agent judged stale after STALE_AFTER_S (the default, 60 s, is longer than a test)
        n4 = e2e.nodes["node04"]
        cfg = yaml.safe_load(n4.config.read_text())
        cfg["hooks"]["stale_after_s"] = STALE_AFTER_S
        n4.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        n4.stop_agent()
        n4.start_agent()
        n4.wait_known()
        yield c


@pytest.fixture(autouse=True)
def scenario(nhc: NhcCluster) -> Iterator[NhcCluster]:
    with scenario_then_restore(nhc.e2e, SCENARIO_LIMIT_S, reset=nhc.reset):
        yield nhc


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> MungeFleet:
    return session_munge_fleet(request.config, list(NODES))


# ----------------------------------------------------------------------------- 1. healthy


def test_healthy_nodes_pass_real_nhc_and_stay_idle(nhc: NhcCluster):
    since = {node: len(nhc.site.log_lines(node)) for node in NODES}
    for node in NODES:
        before = nhc.runs(node)
        nhc.wait_runs(node, 2)
        assert nhc.runs(node) >= before + 2, nhc.diagnostics(node)
        state, reason = nhc.reason(node)
        assert state == "IDLE" and reason == "", (state, reason)
        log = "\n".join(nhc.site.log_lines(node)[since[node]:])
        assert f"Node {node} is already online." in log  # NHC's online helper: every check passed
        assert "Health check failed" not in log and "check_healthd" not in log, log
        # NHC ran healthd-healthcheck through the line slurm/README.md gives (default TIMEOUT 30)
        checks = nhc.e2e.nodes[node].checks()
        assert checks is not None and checks["node"] == node and checks["agent"]["known"] is True, checks


# ----------------------------------------------------------------------------- 2. T1 -> NHC drains


def test_a_t1_finding_is_drained_by_nhc_with_healthds_words_and_resumed_by_nhc_when_gone(nhc: NhcCluster):
    n2 = nhc.e2e.nodes["node02"]
    n2.gpus = n2.gpus[:3]  # NVML enumerates 3 of the 4 GPUs: a node-level T1 hardware finding
    n2.write_nvml()
    found = n2.wait_finding(lambda f: f["id"] == "nvml.gpu_count:node")
    assert (found["tier"], found["attribution"]) == (1, "hardware")
    expected = f"{NHC_LEADER} check_healthd: node02: 1 T1 finding: {found['summary']}"
    wait_for(lambda: "DRAIN" in nhc.reason("node02")[0], 3 * HEALTH_CHECK_INTERVAL_S + 20, "NHC to drain node02",
             diagnostics=lambda: nhc.diagnostics("node02"))
    state, reason = nhc.reason("node02")
    assert reason.split(" [")[0] == expected, (reason, expected)  # scontrol adds " [user@time]"
    assert f"Marking idle node02 offline:  {expected}" in nhc.site.log("node02")
    assert all(nhc.reason(n) == ("IDLE", "") for n in ("node01", "node03", "node04"))

    assert n2.heal_nvml()
    wait_for(lambda: not any(f["id"] == "nvml.gpu_count:node" for f in n2.findings()), 20, "the finding to clear",
             diagnostics=n2.diagnostics)
    wait_for(lambda: nhc.reason("node02") == ("IDLE", ""), 3 * HEALTH_CHECK_INTERVAL_S + 20,
             "NHC to put node02 back online", diagnostics=lambda: nhc.diagnostics("node02"))
    assert "node-mark-online:  Marking node02 online and clearing note (NHC: check_healthd: node02" in nhc.site.log("node02")


# ----------------------------------------------------------------------------- 3. who resumes what


def t1_report(fleet: MungeFleet, node: str) -> bytes:
    """The signed report of an agent whose node shows 3 of its 4 GPUs (a node-level T1 finding)."""
    now = time.time()
    finding = {"id": "nvml.gpu_count:node", "component": {"kind": "node", "index": None}, "source": "nvml",
               "attribution": "hardware", "tier": 1, "action": "drain",
               "summary": "NVML shows 3 of the 4 expected GPUs",
               "evidence": [{"kind": "nvml", "text": "nvmlDeviceGetCount: 3, nvml.expected_gpus: 4"}],
               "first_seen": iso(now), "last_seen": iso(now)}
    return sign_report({"node": node, "verdict": "failed", "findings": [finding]}, node, fleet.socket(node))


class LiveController:
    """healthd-controller in auto mode against the NHC cluster's real slurmctld (scontrol backend)."""

    def __init__(self, nhc: NhcCluster, fleet: MungeFleet, directory: Path):
        conf = str(nhc.e2e.cluster.conf_path)
        self.backend = ScontrolBackend(conf, timeout_s=10)
        self.ledger = Ledger(directory / "ledger.sqlite")
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(directory / "ledger.sqlite"),
                                      munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                      slurm_conf=conf, policy=ControllerPolicySettings(mode="auto"))
        self.controller = Controller(settings, self.ledger, self.backend)
        self.server = ControllerHTTPServer(settings.listen, self.controller)
        self.server.start_background()

    def report_and_round(self, body: bytes) -> list:
        status, answer = post_json(self.server.url + "/v1/report", body)
        assert status == 200 and answer.get("accepted") is True, (status, answer)
        results = self.controller.evaluate(time.time())
        assert results is not None
        return results

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.controller.close()
        self.ledger.close()


def test_nhcs_own_drain_is_never_taken_over_or_resumed_by_healthds_controller(nhc: NhcCluster, fleet, tmp_path):
    (nhc.marks / "node01").unlink()  # NHC's own check fails on node01
    wait_for(lambda: "DRAIN" in nhc.reason("node01")[0], 3 * HEALTH_CHECK_INTERVAL_S + 20, "NHC to drain node01",
             diagnostics=lambda: nhc.diagnostics("node01"))
    before = ScontrolBackend(str(nhc.e2e.cluster.conf_path), timeout_s=10).node("node01")
    assert before.reason.startswith(f"{NHC_LEADER} check_file_test:"), before
    ctl = LiveController(nhc, fleet, tmp_path)
    try:
        # a T1 report for the node NHC holds: the controller would drain it, but the reason is not its own
        for _ in range(2):
            results = ctl.report_and_round(t1_report(fleet, "node01"))
            assert [(o.status, o.gate, r) for o, r in results] == [("refused", "ownership", None)], results
            assert "not healthd's by record; not overwriting" in results[0][0].reason
        assert ctl.ledger.actions(node="node01") == [] and ctl.ledger.hold("node01") is None
        nhc.wait_runs("node01", 2)  # NHC still failing node01 in the meantime
        after = ctl.backend.node("node01")
        assert (after.reason, after.reason_time, after.reason_user, after.drain_requested) == (
            before.reason, before.reason_time, before.reason_user, True)
    finally:
        ctl.close()
    # NHC's check passes again: NHC, not healthd, puts its node back
    (nhc.marks / "node01").touch()
    wait_for(lambda: nhc.reason("node01") == ("IDLE", ""), 3 * HEALTH_CHECK_INTERVAL_S + 20,
             "NHC to resume node01", diagnostics=lambda: nhc.diagnostics("node01"))


def test_a_drain_by_healthds_controller_is_not_resumed_by_nhc_and_stays_the_controllers(nhc: NhcCluster, fleet,
                                                                                        tmp_path):
    ctl = LiveController(nhc, fleet, tmp_path)
    try:
        results = ctl.report_and_round(t1_report(fleet, "node03"))
        assert [(o.status, r.status if r else None) for o, r in results] == [("allowed", "applied")], results
        hold = ctl.ledger.hold("node03")
        info = ctl.backend.node("node03")
        assert hold is not None and owned(hold, info) and info.reason.startswith("healthd: "), (hold, info)

        # node03's agent is healthy: every NHC check passes, and NHC's online helper leaves the node alone
        nhc.wait_runs("node03", 2)
        assert f"Not onlining node03:  Down for non-NHC reason ({info.reason})" in nhc.site.log("node03")
        fresh = ctl.backend.node("node03")
        assert fresh.drain_requested and owned(ctl.ledger.hold("node03"), fresh), fresh

        # now NHC fails on node03 too (its own check): its offline helper keeps a non-NHC reason and
        # drains again with it; Slurm 22.05 records nothing for an update that changes neither state
        # nor reason, so the reason time and user -- the controller's proof of its write -- stay
        (nhc.marks / "node03").unlink()
        nhc.wait_runs("node03", 2)
        assert f"Marking drain node03 offline:  {info.reason}" in nhc.site.log("node03")
        fresh = ctl.backend.node("node03")
        assert (fresh.reason, fresh.reason_time, fresh.reason_user) == (info.reason, info.reason_time, info.reason_user)
        assert owned(ctl.ledger.hold("node03"), fresh)
        (nhc.marks / "node03").touch()
        nhc.wait_runs("node03", 1)
        assert "DRAIN" in nhc.reason("node03")[0]
    finally:
        ctl.close()


# ----------------------------------------------------------------------------- 4. agent gone or stuck


def test_agent_gone_or_stale_passes_by_default_and_drains_with_u(nhc: NhcCluster):
    n4 = nhc.e2e.nodes["node04"]
    pid = n4.kill_agent()
    # what `healthd state` says of the dead agent's last document: its pid is gone, or, once that
    # document is older than hooks.stale_after_s, that it is stale (checked first)
    gone = re.compile(rf"agent unknown: (agent pid {pid} is not running|state is \d+s old "
                      rf"\(hooks.stale_after_s {STALE_AFTER_S}\): the agent is stopped or stuck)$")
    nhc.wait_runs("node04", 2)
    assert nhc.reason("node04") == ("IDLE", "")
    logged = [line for line in nhc.site.log_lines("node04") if line.startswith("check_healthd: ")]
    assert logged and all(line.startswith("check_healthd: cannot tell, not failing the check: ")
                          and gone.search(line) for line in logged[-2:]), logged

    nhc.site.write_conf(nhc.conf_lines("-u"))
    wait_for(lambda: "DRAIN" in nhc.reason("node04")[0], 3 * HEALTH_CHECK_INTERVAL_S + 20, "NHC to drain node04",
             diagnostics=lambda: nhc.diagnostics("node04"))
    reason = nhc.reason("node04")[1].split(" [")[0]
    assert reason.startswith(f"{NHC_LEADER} check_healthd: agent unknown: ") and gone.search(reason), reason

    # the agent back: the check passes, NHC puts back the node it drained
    n4.start_agent()
    n4.wait_known()
    wait_for(lambda: nhc.reason("node04") == ("IDLE", ""), 3 * HEALTH_CHECK_INTERVAL_S + 20,
             "NHC to put node04 back online", diagnostics=lambda: nhc.diagnostics("node04"))

    # stuck: alive but its state older than hooks.stale_after_s
    assert n4.proc is not None
    n4.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: "DRAIN" in nhc.reason("node04")[0], STALE_AFTER_S + 3 * HEALTH_CHECK_INTERVAL_S + 20,
                 "NHC to drain node04 with a stale state", diagnostics=lambda: nhc.diagnostics("node04"))
        reason = nhc.reason("node04")[1]
        assert reason.startswith(f"{NHC_LEADER} check_healthd: agent unknown: ") and (
            f"old (hooks.stale_after_s {STALE_AFTER_S})" in reason), reason
        nhc.site.write_conf(nhc.conf_lines())  # without -u: a stuck agent only logs, and NHC resumes its drain
        wait_for(lambda: nhc.reason("node04") == ("IDLE", ""), 3 * HEALTH_CHECK_INTERVAL_S + 20,
                 "NHC to put node04 back online", diagnostics=lambda: nhc.diagnostics("node04"))
        assert "the agent is stopped or stuck" in nhc.site.log("node04")
    finally:
        n4.proc.send_signal(signal.SIGCONT)
