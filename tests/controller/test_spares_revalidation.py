"""Spare revalidation through the real controller round (policy, gates, executor, SQLite ledger, the
reintegrator's validation thread running a real script) over the in-memory Slurm: a spare whose pass
ages past half of `validated_within_h` is validated again inside its own reservation, a pass is its new
validation time, a failure opens an incident, drains it and the pool refills; observe and an open
breaker only record; at most `revalidate_at_once` run at once; a revalidation a restart cut off runs
again, and one whose record was left planned is settled by the reconciler and run again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from healthd.controller import spares
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings, NodeReport
from healthd.controller.reintegrate import ReintegrationSettings
from healthd.controller.spares import SparePool
from tests.controller.test_spares_round import NODES, TOPOLOGY, validated
from tests.support.fake_slurm import FakeBackend
from tests.support.polling import poll

T0 = 1_800_000_000.0
H = 3600.0


class Rig:
    """A controller in auto mode with a spare pool of `gpu` over node01-04, its validation one script whose
    exit status `rc` sets (its output names the node and the reservation it ran in)."""

    def __init__(self, tmp: Path, **pool):
        self.now = T0
        self.script = tmp / "validate.sh"
        self.rcfile = tmp / "validate.rc"
        self.script.write_text(f"#!/bin/sh\necho \"validating $1 in $2\"\n"
                               f"rc=$(cat {self.rcfile} 2>/dev/null || echo 0)\n"
                               f"[ \"$rc\" -eq 0 ] || echo 'GPU 1: ECC page retirement failed'\nexit $rc\n")
        self.script.chmod(0o755)
        self.ledger = Ledger(tmp / "ledger.sqlite")
        self.backend = FakeBackend(clock=lambda: self.now)
        policy = ControllerPolicySettings(mode="auto", spares={"gpu": SparePool(**pool)})
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp / "l.sqlite"), policy=policy,
                                      reintegration=ReintegrationSettings(
                                          validation=((str(self.script), "{node}", "{reservation}"),)))
        self.c = Controller(settings, self.ledger, self.backend, metrics=ControllerMetrics(), node_addrs=dict,
                            clock=lambda: self.now, topology_text=TOPOLOGY)

    def rc(self, value: int) -> None:
        self.rcfile.write_text(f"{value}\n")

    def round(self, at: float | None = None):
        self.now = self.now + 30 if at is None else at
        for n in NODES:
            if not self.backend.node(n).drain_requested:
                self.c.reports[n] = NodeReport(node=n, verdict="healthy", received_at=self.now)
        return self.c.evaluate(self.now)

    def until(self, predicate, timeout_s: float = 30.0) -> None:
        """Rounds 30 virtual seconds apart until `predicate` holds (the validation runs on a thread)."""
        poll(lambda: self.round() is not None and predicate(), timeout_s, "the condition", interval=0.05,
             diagnostics=lambda: f"actions: {self.ledger.actions()}")

    def validations(self, status: str | None = None) -> list:
        return [a for a in self.ledger.actions(status=status) if a.kind == "spare-validate"]

    def spares(self) -> dict[str, spares.Spare]:
        acts = [*self.ledger.actions(status="applied"), *self.validations("failed")]
        passed, _ = spares.validations(acts)
        return spares.recorded_spares(acts, passed)[0]


@pytest.fixture
def rig(tmp_path):
    made: list[Rig] = []
    yield lambda **pool: made.append(Rig(tmp_path, **pool)) or made[-1]
    for r in made:  # the controller first: its rounds write to the ledger
        r.c.close()
        r.ledger.close()


def test_a_spare_whose_pass_ages_past_half_its_window_is_revalidated_in_its_reservation(rig):
    r = rig(validated_within_h=4.0)
    validated(r.ledger, "node01", T0 - 1.5 * H)  # a reintegration's pass, 1.5 h old: not due yet
    r.round(T0)
    assert list(r.spares()) == ["node01"] and r.validations() == []
    r.round(T0 + 0.4 * H)  # 1.9 h: still within half of 4 h
    assert r.validations() == [] and not r.backend.steps
    r.round(T0 + 0.6 * H)  # 2.1 h: due
    r.until(lambda: r.validations("applied"))
    [a] = r.validations()
    assert a.node == "node01" and a.evidence["reservation"] == "healthd_spare_gpu_node01"
    [result] = a.evidence["results"]
    assert result["rc"] == 0 and "validating node01 in healthd_spare_gpu_node01" in result["output"]
    # the pass is the spare's validation time now: not due again, usable for a removal
    assert r.spares()["node01"].validated_at == a.applied_at and a.applied_at > T0 + 0.6 * H
    [d] = [d for d in r.ledger.decisions() if d.kind == "spare-validate"]
    assert d.outcome == "allowed" and "last validation passed 2.1 h ago) is due for revalidation: every 2 h" in d.reason
    steps = len(r.backend.steps)
    r.round()
    r.round()
    assert len(r.backend.steps) == steps and len(r.validations()) == 1
    assert "healthd_spare_gpu_node01" in r.backend.reservations  # it never left its reservation


def test_a_spare_that_fails_is_drained_under_an_incident_and_the_pool_refills(rig):
    r = rig(validated_within_h=4.0)
    validated(r.ledger, "node01", T0 - 3 * H)  # due once it is a spare
    r.rc(3)
    r.round(T0)
    assert list(r.spares()) == ["node01"]
    spare = "node01"
    r.until(lambda: r.validations("failed"))
    r.rc(0)  # the node that refills the pool passes
    [a] = r.validations()
    incident = r.ledger.incident(int(a.evidence["incident"]))
    assert incident is not None and incident.status == "validation-failed" and incident.nodes == (spare,)
    r.until(lambda: r.backend.node(spare).drain_requested)
    info = r.backend.node(spare)
    assert info.reason.startswith("healthd: validation failed: validate.sh rc=3: GPU 1: ECC page retirement failed")
    assert info.reason.endswith(f"[#{incident.id}]")
    hold = r.ledger.hold(spare)
    assert hold is not None and hold.incident_id == incident.id
    # held by healthd: its reservation is given back and another node takes its place
    r.until(lambda: spare not in r.spares() and len(r.spares()) == 1)
    assert f"healthd_spare_gpu_{spare}" not in r.backend.reservations
    # its drain removed a spare, not capacity: no other spare is released for it
    releases = [x for x in r.ledger.actions(status="applied") if x.kind == "spare-release"]
    assert [x.node for x in releases] == [spare]
    [d] = [d for d in r.ledger.decisions() if d.kind == "redrain"]
    assert d.incident_id == incident.id
    # a failed validation waits for `healthctl repaired`: its agent's healthy reports reintegrate nothing
    r.round()
    r.round()
    assert r.ledger.reintegrations(incident_id=incident.id) == [] and r.backend.node(spare).drain_requested


@pytest.mark.parametrize("gate", ["mode", "breaker"])
def test_observe_and_an_open_breaker_only_record_a_due_revalidation(rig, gate):
    r = rig(validated_within_h=4.0)
    validated(r.ledger, "node01", T0 - 1.9 * H)
    r.round(T0)
    assert list(r.spares()) == ["node01"]
    if gate == "mode":  # the site switched back to observe
        r.c.policy = ControllerPolicySettings(mode="observe", spares=r.c.policy.spares)
    else:
        r.ledger.open_breaker("switch:s2", nodes=["node03", "node04"], at=T0 + 1)
    r.round(T0 + 0.2 * H)  # due now
    time.sleep(0.3)
    r.round()
    assert not r.backend.steps and r.validations() == []
    [d] = [d for d in r.ledger.decisions() if d.kind == "spare-validate"]
    assert (d.outcome, d.refused_gate) == ("refused", gate)


def test_at_most_revalidate_at_once_run_together(rig):
    r = rig(size=2, validated_within_h=4.0)
    r.script.write_text(f"#!/bin/sh\nsleep 0.5\necho \"validating $1 in $2\"\nexit $(cat {r.rcfile} 2>/dev/null || echo 0)\n")
    validated(r.ledger, "node01", T0 - 3 * H)
    validated(r.ledger, "node03", T0 - 3.5 * H)
    r.round(T0)
    assert sorted(r.spares()) == ["node01", "node03"]
    seen = []
    deadline = time.monotonic() + 30
    while len(r.validations("applied")) < 2 and time.monotonic() < deadline:
        r.round()
        seen.append(set(r.c.reintegrator.spares_validating()))
        time.sleep(0.05)
    assert seen[0] == {"node03"}  # the older pass first
    assert all(len(x) <= 1 for x in seen) and {"node01"} in seen
    [first, second] = r.validations()
    assert (first.node, second.node, first.status, second.status) == ("node03", "node01", "applied", "applied")


def test_a_revalidation_left_planned_is_abandoned_and_run_again(rig):
    r = rig(validated_within_h=4.0)
    validated(r.ledger, "node01", T0 - 3 * H)
    r.round(T0)
    # should a revalidation's record be left planned (the round writes it in one transaction), the
    # reconciler settles it
    d = r.ledger.record_decision(node="node01", kind="spare-validate", tier="T1", mode="auto", reason="x",
                                 outcome="allowed", incident_id=None, evidence={}, at=T0 + 1)
    series = f"spare-validate:healthd_spare_gpu_node01@{T0 - 3 * H:.0f}"
    planned = r.ledger.plan_action(decision_id=d.id, idempotency_key=series, series=series, attempt=1, node="node01",
                                   kind="spare-validate", argv=["validate.sh"], partition="gpu",
                                   evidence={"reservation": "healthd_spare_gpu_node01", "partition": "gpu", "results": []},
                                   at=T0 + 1)
    r.until(lambda: r.validations("applied"))
    after = r.ledger.action(planned.id)
    assert after is not None and after.status == "abandoned"
    [again] = r.validations("applied")
    assert again.series == series and again.attempt == 2  # the same pass's series, its next attempt
    assert r.spares()["node01"].validated_at == again.applied_at


def test_a_restart_while_validating_runs_it_again(rig):
    r = rig(validated_within_h=4.0)
    r.script.write_text("#!/bin/sh\nsleep 3\n")
    validated(r.ledger, "node01", T0 - 3 * H)
    r.round(T0)
    r.round()
    assert r.c.reintegrator.spares_validating() == {"node01"}
    r.c.close()  # the validation thread is a daemon: a stopping controller does not wait for it
    tmp = r.script.with_name("new.sh")
    tmp.write_text("#!/bin/sh\necho \"validating $1 in $2\"\n")
    tmp.chmod(0o755)
    os.replace(tmp, r.script)
    r.c = Controller(r.c.settings, r.ledger, r.backend, metrics=ControllerMetrics(), node_addrs=dict,
                     clock=lambda: r.now, topology_text=TOPOLOGY)
    r.until(lambda: r.validations("applied"))
    [a] = r.validations()
    assert a.attempt == 1 and "validating node01" in a.evidence["results"][0]["output"]
