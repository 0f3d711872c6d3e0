"""Hot spares on the real local Slurm (tests/support/slurm_cluster.py) with real munged daemons: the
controller in `auto` with a spare pool and a small topology.conf (node01-02 under leaf s1, node03-04
under s2) reserves a validated spare, and when a signed Xid 79 report makes it drain node02, deletes the
spare's reservation under the same leaf in the same round, both under the ledger's incident; a spare
whose pass ages past half its window is validated again by the real srun inside its reservation.

topology.conf is healthd's reading of the fabric (`topology_conf`); slurmctld runs without
TopologyPlugin here, which changes nothing healthd does."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest

from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings
from healthd.controller.reintegrate import ReintegrationSettings
from healthd.controller.spares import Spare, SparePool, SpareWorld, fit
from healthd.envelope import sign_report
from healthd.slurm.scontrol import ScontrolBackend
from tests.controller.munge_support import MungeFleet, munged_path
from tests.controller.test_controller_cluster import _report
from tests.controller.test_spares_round import validated
from tests.support.polling import poll
from tests.support.slurm_cluster import SlurmCluster

NODES = ["node01", "node02", "node03", "node04"]
TOPOLOGY = "# leaf switches\nSwitchName=s1 Nodes=node[01-02]\nSwitchName=s2 Nodes=node[03-04]\nSwitchName=top Switches=s[1-2]\n"

pytestmark = pytest.mark.skipif(
    munged_path() is None or shutil.which("slurmctld") is None or shutil.which("slurmd") is None,
    reason="needs munged, slurmctld and slurmd (apt-get install slurm-wlm munge)",
)


def _healthy(fleet: MungeFleet, node: str) -> bytes:
    return sign_report({"node": node, "verdict": "healthy", "findings": []}, node, fleet.socket(node))


# healthd's spare node01 as the pool's decisions see it, healthy and reported
world = SpareWorld(nodes={}, partitions={"debug": frozenset(NODES)}, healthy=frozenset(NODES),
                   spares={"node01": Spare("node01", "debug", "healthd_spare_debug_node01", 0.0, 0.0)})


def _reservation(cluster: SlurmCluster, name: str) -> str:
    return cluster.run(["scontrol", "show", "reservation", name]).stdout


def test_a_drained_nodes_spare_under_its_leaf_is_released_at_once(cluster, fleet, tmp_path: Path):
    cluster.wait_idle()
    topology = tmp_path / "topology.conf"
    topology.write_text(TOPOLOGY)
    backend = ScontrolBackend(str(cluster.conf_path), timeout_s=10)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                  slurm_conf=str(cluster.conf_path), topology_conf=str(topology),
                                  policy=ControllerPolicySettings(mode="auto", spares={"debug": SparePool(size=1)}))
    controller = Controller(settings, ledger, backend, topology_text=topology.read_text())
    made: list[str] = []
    try:
        validated(ledger, "node01", time.time() - 600)  # node01 passed a reintegration's validation
        for n in NODES:
            assert controller.receive_report(_healthy(fleet, n))[0] == 200
        controller.evaluate(time.time())
        shown = _reservation(cluster, "healthd_spare_debug_node01")
        made.append("healthd_spare_debug_node01")
        assert "Nodes=node01 " in shown and "Users=root" in shown, shown
        # slurmctld starts the reservation on its periodic pass: the node shows it seconds later
        poll(lambda: {"MAINTENANCE", "RESERVED"} <= backend.node("node01").flags, 30, "node01 in its reservation")
        assert fit("node01", dataclasses.replace(world, nodes={"node01": backend.node("node01")})) == ""
        controller.evaluate(time.time())  # a quiet round keeps the pool as it is
        assert [d.kind for d in ledger.decisions()] == ["spare-reserve"]

        assert controller.receive_report(_report(fleet, "node02"))[0] == 200
        results = controller.evaluate(time.time())
        assert results is not None and [(o.decision.node, r.status if r else None) for o, r in results] == \
            [("node02", "applied")]
        assert "not found" in _reservation(cluster, "healthd_spare_debug_node01")
        poll(lambda: not backend.node("node01").flags & {"MAINTENANCE", "RESERVED"}, 30,
             "node01 back in general scheduling")
        [incident] = ledger.incidents(node="node02")
        [release] = [a for a in ledger.actions(status="applied") if a.kind == "spare-release"]
        decision = ledger.decision(release.decision_id)
        assert release.node == "node01" and decision is not None and decision.incident_id == incident.id
        assert "same leaf switch s1" in (decision.reason or "")
        # the pool refilled from the other leaf (node01 is left to the requeued job)
        assert "Nodes=node03 " in _reservation(cluster, "healthd_spare_debug_node03")
        made.append("healthd_spare_debug_node03")
    finally:
        controller.close()
        ledger.close()
        for name in made:
            cluster.run(["scontrol", "delete", f"ReservationName={name}"], timeout=15)
        cluster.run(["scontrol", "update", "NodeName=node02", "State=RESUME"], timeout=15)


def test_a_spare_whose_pass_ages_past_half_its_window_is_revalidated_in_its_reservation(cluster, fleet, tmp_path: Path):
    """The clock the round is handed moves on past half of `validated_within_h` (no sleeping for an
    hour): the real round runs the validation through the real srun inside the spare's own
    reservation, and the pass becomes the spare's validation time."""
    cluster.wait_idle()
    backend = ScontrolBackend(str(cluster.conf_path), timeout_s=10)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    # what the job step sees: the node it ran on and the reservation it ran in
    validation = (("srun", "--reservation={reservation}", "--nodelist={node}", "--nodes=1", "--time=1",
                   "--job-name=healthd-validate", "printenv", "SLURMD_NODENAME", "SLURM_JOB_RESERVATION"),)
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                  slurm_conf=str(cluster.conf_path),
                                  reintegration=ReintegrationSettings(validation=validation, validation_timeout_s=60),
                                  policy=ControllerPolicySettings(mode="auto", spares={
                                      "debug": SparePool(size=1, validated_within_h=2.0)}))
    controller = Controller(settings, ledger, backend, topology_text=TOPOLOGY)
    name = "healthd_spare_debug_node01"
    start = time.time()
    try:
        validated(ledger, "node01", start - 0.9 * 3600)  # a reintegration's pass, 0.9 h old: not due
        for n in NODES:
            assert controller.receive_report(_healthy(fleet, n))[0] == 200
        controller.evaluate(start)
        assert "Nodes=node01 " in _reservation(cluster, name)
        controller.evaluate(start + 30)
        assert [d.kind for d in ledger.decisions()] == ["spare-reserve"]
        # 1.1 h after the pass: due, validated again in its reservation by the real srun
        later = start + 0.2 * 3600

        def passed():
            controller.evaluate(later + time.time() - start)
            return [a for a in ledger.actions(status="applied") if a.kind == "spare-validate"]

        [action] = poll(passed, 60, "node01's revalidation recorded", interval=0.5,
                        diagnostics=lambda: f"{ledger.actions()} {ledger.decisions()}")
        [result] = action.evidence["results"]
        assert result["rc"] == 0 and result["output"].split() == ["node01", name], result
        [d] = [d for d in ledger.decisions() if d.kind == "spare-validate"]
        assert d.outcome == "allowed" and "1.1 h ago) is due for revalidation" in (d.reason or "")
        # the pass is node01's validation time: the spare is not due again, and is still healthd's
        assert action.applied_at is not None and action.applied_at >= later
        controller.evaluate(later + time.time() - start + 60)
        assert len([a for a in ledger.actions() if a.kind == "spare-validate"]) == 1
        assert "Nodes=node01 " in _reservation(cluster, name)
    finally:
        controller.close()
        ledger.close()
        cluster.run(["scontrol", "delete", f"ReservationName={name}"], timeout=15)
