"""The round's `spares` step: the real controller round (policy, gates, executor, SQLite ledger) over the
in-memory Slurm: a spare reserved, released under the same leaf switch when healthd drains a node there,
both moves in the ledger, the release under the drain's incident; observe only records."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings, NodeReport
from healthd.controller.reintegrate import ReintegrationSettings
from healthd.controller.spares import SparePool
from healthd.slurm.backend import SlurmRefused
from tests.observability.test_controller_round_metrics import xid79
from tests.support.fake_slurm import FakeBackend

T0 = 1_800_000_000.0
TOPOLOGY = "SwitchName=s1 Nodes=node[01-02]\nSwitchName=s2 Nodes=node[03-04]\nSwitchName=top Switches=s[1-2]\n"
NODES = ("node01", "node02", "node03", "node04")


@pytest.fixture
def made(tmp_path):
    def make(mode: str = "auto", **pool):
        ledger = Ledger(tmp_path / f"ledger-{mode}.sqlite")
        policy = ControllerPolicySettings(mode=mode, spares={"gpu": SparePool(**pool)})  # type: ignore[arg-type]
        # a spare never validated is validated in its reservation: here a command that passes
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "l.sqlite"), policy=policy,
                                      reintegration=ReintegrationSettings(validation=(("true",),)))
        backend = FakeBackend(clock=lambda: T0)
        c = Controller(settings, ledger, backend, metrics=ControllerMetrics(), node_addrs=dict, clock=lambda: T0,
                       topology_text=TOPOLOGY)
        for n in NODES:
            c.reports[n] = NodeReport(node=n, verdict="healthy", received_at=T0)
        made.append((c, ledger))
        return c, ledger, backend

    made: list = []
    yield make
    for c, ledger in made:
        c.close()
        ledger.close()


def validated(ledger: Ledger, node: str, at: float) -> None:
    """A passed reintegration validation of `node`, as the reintegrator records it."""
    r = ledger.request_reintegration(node, incident_id=None, trigger="repaired", operator="root", why="test", at=at)
    ledger.update_reintegration(r.id, state="passed", stamp="validated_at", at=at)


def spare_writes(backend: FakeBackend) -> list[tuple]:
    return [w[:2] for w in backend.writes if "reservation" in w[0]]


def test_a_drained_nodes_spare_under_its_leaf_is_released_at_once(made):
    c, ledger, backend = made()
    validated(ledger, "node01", T0 - 600)
    c.evaluate(T0)
    assert spare_writes(backend) == [("create_reservation", "healthd_spare_gpu_node01")]  # validated, leaf s1
    assert "healthd_spare_gpu_node01" in backend.reservations

    c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 + 57),), received_at=T0 + 60)
    c.evaluate(T0 + 60)
    writes = [w[:2] for w in backend.writes]
    drain = writes.index(("drain", "node02"))
    assert writes[drain + 1] == ("delete_reservation", "healthd_spare_gpu_node01")  # the same round, right after
    assert "healthd_spare_gpu_node01" not in backend.reservations
    assert ("create_reservation", "healthd_spare_gpu_node03") in writes[drain + 2:]  # the pool refilled

    [incident] = [i for i in ledger.incidents() if i.nodes == ("node02",)]
    [release] = [a for a in ledger.actions(status="applied") if a.kind == "spare-release"]
    decision = ledger.decision(release.decision_id)
    assert decision is not None and decision.incident_id == incident.id
    assert "node02 removed" in (decision.reason or "") and "same leaf switch s1" in (decision.reason or "")
    assert release.node == "node01"
    reserves = [a for a in ledger.actions(status="applied") if a.kind == "spare-reserve"]
    assert [a.node for a in reserves] == ["node01", "node03"]


def test_no_spare_in_place_is_recorded_with_why(made):
    c, ledger, backend = made(placement="in-place")
    validated(ledger, "node03", T0 - 600)
    c.evaluate(T0)
    assert spare_writes(backend) == [("create_reservation", "healthd_spare_gpu_node03")]
    c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 + 57),), received_at=T0 + 60)
    c.evaluate(T0 + 60)
    c.evaluate(T0 + 90)  # owed a spare still: decided again, recorded once
    assert ("delete_reservation", "healthd_spare_gpu_node03") not in spare_writes(backend)
    [d] = [d for d in ledger.decisions() if d.kind == "spare-release"]
    [incident] = [i for i in ledger.incidents() if i.nodes == ("node02",)]
    assert d.node == "node02" and d.incident_id == incident.id and d.outcome == "refused" and "no validated spare of gpu shares node02's place (leaf switch s1" in d.reason


def test_nearest_placement_releases_a_spare_elsewhere_when_none_is_in_place(made):
    c, ledger, backend = made()
    validated(ledger, "node03", T0 - 600)
    c.evaluate(T0)
    c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 + 57),), received_at=T0 + 60)
    c.evaluate(T0 + 60)
    assert ("delete_reservation", "healthd_spare_gpu_node03") in spare_writes(backend)
    [d] = [d for d in ledger.decisions() if d.kind == "spare-release" and d.outcome == "allowed" and d.incident_id]
    assert d.node == "node03" and "node02 removed" in d.reason and "none shares its leaf switch" in d.reason


def test_observe_records_and_writes_nothing(made):
    c, ledger, backend = made(mode="observe")
    validated(ledger, "node01", T0 - 600)
    c.evaluate(T0)
    assert spare_writes(backend) == []
    [d] = [d for d in ledger.decisions() if d.kind == "spare-reserve"]
    assert (d.outcome, d.refused_gate) == ("refused", "mode") and d.node == "node01"


def test_the_capacity_floor_holds_in_the_round(made):
    c, ledger, backend = made(size=3)
    c.policy = dataclasses.replace(c.policy, capacity_floors={"gpu": 3})
    c.evaluate(T0)
    assert len(spare_writes(backend)) == 1


def test_without_spares_the_step_does_nothing(made):
    c, ledger, backend = made()
    c.policy = dataclasses.replace(c.policy, spares={})
    c.evaluate(T0)
    assert spare_writes(backend) == [] and ledger.decisions() == []


def test_a_release_a_restart_cut_off_is_owed_to_the_removal(made):
    c, ledger, backend = made()
    validated(ledger, "node01", T0 - 600)
    c.evaluate(T0)
    c.reports["node02"] = NodeReport(node="node02", verdict="failed", findings=(xid79(T0 + 57),), received_at=T0 + 60)
    real_delete = backend.delete_reservation

    def refused(name):  # the release's call fails (slurmctld restarting): the spare is still there
        backend.delete_reservation = real_delete
        raise SlurmRefused("Unable to contact slurm controller", ["delete_reservation", name], 1, "")

    backend.delete_reservation = refused
    c.evaluate(T0 + 60)
    assert "healthd_spare_gpu_node01" in backend.reservations
    c.evaluate(T0 + 90)  # the next round releases it for node02's drain, under its incident
    assert "healthd_spare_gpu_node01" not in backend.reservations
    [incident] = [i for i in ledger.incidents() if i.nodes == ("node02",)]
    [release] = [a for a in ledger.actions(status="applied") if a.kind == "spare-release"]
    assert release.evidence["incident"] == str(incident.id) and release.attempt == 2
    c.evaluate(T0 + 120)
    assert len([a for a in ledger.actions() if a.kind == "spare-release"]) == 2  # the failed one and this


@pytest.mark.parametrize("landed", [True, False])
def test_a_spare_release_a_crash_left_planned_is_settled_by_what_slurm_shows(made, landed):
    c, ledger, backend = made()
    validated(ledger, "node01", T0 - 600)
    c.evaluate(T0)
    name = "healthd_spare_gpu_node01"
    d = ledger.record_decision(node="node01", kind="spare-release", tier="T1", mode="auto", reason="x",
                               outcome="allowed", incident_id=None, evidence={}, at=T0 + 1)
    planned = ledger.plan_action(decision_id=d.id, idempotency_key="k", series="k", attempt=1, node="node01",
                                 kind="spare-release", argv=["scontrol", "delete", f"ReservationName={name}"],
                                 partition="gpu", reason=None, evidence={"reservation": name, "partition": "gpu"},
                                 at=T0 + 1)
    if landed:  # the delete reached slurmctld before the controller died
        backend.reservations.discard(name)
    c.evaluate(T0 + 30)
    after = ledger.action(planned.id)
    assert after is not None and after.status == ("applied" if landed else "abandoned")
    # the ledger agrees with Slurm: a release that landed ended node01's spare and the pool refilled
    assert backend.reservations == ({"healthd_spare_gpu_node02"} if landed else {name})
    reserves = [a.node for a in ledger.actions(status="applied") if a.kind == "spare-reserve"]
    assert reserves == (["node01", "node02"] if landed else ["node01"])
