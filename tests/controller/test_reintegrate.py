"""Reintegration through the controller's rounds: a fake Slurm backend, a real ledger, real validation
commands (small scripts run by the real runner on the validation thread)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from healthd.config import ConfigError
from healthd.controller import admin
from healthd.controller.config import ControllerSettings, parse_controller_settings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings, NodeReport, finding_from_json
from healthd.controller.reintegrate import ReintegrationSettings, expand, failure_summary
from tests.support.fake_slurm import FakeBackend

XID = "xid:gpu0:79"


def xid79(at: float) -> dict:
    return {"id": XID, "component": {"kind": "gpu", "index": 0, "serial": "1650923012345"}, "source": "kernel_log",
            "xid": 79, "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79 gpu0: fell off the bus",
            "evidence": [{"kind": "log", "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
            "first_seen": at, "last_seen": at}


class Rig:
    def __init__(self, tmp_path: Path, mode: str = "auto", script_rc: int = 0, **reint):
        self.tmp = tmp_path
        self.script = tmp_path / "gpu_check.sh"
        self.set_check(script_rc)
        self.now = time.time()
        self.backend = FakeBackend(clock=lambda: self.now)
        self.ledger_path = tmp_path / "ledger.sqlite"
        self.ledger = Ledger(self.ledger_path)
        reint.setdefault("validation", ((str(self.script), "{node}", "{reservation}"),))
        reint.setdefault("probation_s", 30.0)
        self.settings = ControllerSettings(ledger=str(self.ledger_path), policy=ControllerPolicySettings(mode=mode),  # type: ignore[arg-type]
                                           reintegration=ReintegrationSettings(**reint))
        self.lines: list[str] = []
        self.controller = Controller(self.settings, self.ledger, self.backend, out=self.lines.append,
                                     clock=lambda: self.now)

    def set_check(self, rc: int, message: str = "GPU 0: memory test failed") -> None:
        self.write_script(f"#!/bin/sh\necho \"checking $1 in $2\"\n[ {rc} -eq 0 ] || echo '{message}'\nexit {rc}\n")

    def write_script(self, text: str) -> None:
        """A new file renamed over the check: a validation still running the old one keeps its own
        inode (writing in place fails with ETXTBSY while the kernel executes it)."""
        tmp = self.script.with_name(self.script.name + ".new")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, self.script)

    def report(self, node: str, *findings: dict, at: float | None = None) -> None:
        at = self.now if at is None else at
        self.controller.reports[node] = NodeReport(node=node, verdict="failed" if findings else "healthy",
                                                   findings=tuple(finding_from_json(f) for f in findings), received_at=at)

    def round(self, advance: float = 1.0):
        self.now += advance
        return self.controller.evaluate(self.now)

    def until(self, predicate, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.round()
            if predicate():
                return
            time.sleep(0.05)  # the validation thread
        raise AssertionError(f"condition not reached; reintegrations: {self.ledger.reintegrations()}")

    def reint(self, node: str = "node02"):
        return self.ledger.reintegrations(node=node)[-1]

    def drain_node02(self) -> int:
        self.report("node02", xid79(self.now))
        self.round()
        assert self.backend.state["node02"].drain_requested
        return self.ledger.hold("node02").incident_id

    def close(self) -> None:
        self.controller.close()
        self.ledger.close()


@pytest.fixture
def rig(tmp_path):
    made: list[Rig] = []

    def make(**kw) -> Rig:
        d = tmp_path / f"rig{len(made)}"
        d.mkdir()
        made.append(Rig(d, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def writes(r: Rig, kind: str) -> list[tuple]:
    return [w for w in r.backend.writes if w[0] == kind]


def test_repaired_node_is_validated_in_a_reservation_then_resumed_then_resolved_after_probation(rig):
    r = rig(probation_s=5.0)
    incident = r.drain_node02()
    # the agent keeps echoing the old Xid 79 until it gets the clear: it must not re-drain the node
    res = admin.repaired(r.ledger, "node02", "root", "reseated GPU 0")
    assert res.ok
    assert r.controller.reintegrator.instructions_for(r.controller.reports["node02"]) == [
        {"kind": "clear-finding", "findings": [XID], "before": r.reint().requested_at, "incident": incident,
         "reintegration": r.reint().id}]
    r.until(lambda: r.reint().state == "probation")
    assert writes(r, "create_reservation") == [("create_reservation", "healthd_validate_node02")]
    assert writes(r, "resume") == [("resume", "node02")]
    assert writes(r, "delete_reservation")[-1] == ("delete_reservation", "healthd_validate_node02")
    ri = r.reint()
    assert ri.results[0]["rc"] == 0 and ri.results[0]["argv"][1:] == ["node02", "healthd_validate_node02"]
    assert "checking node02 in healthd_validate_node02" in ri.results[0]["output"]
    inc = r.ledger.incident(incident)
    assert inc.status == "probation" and inc.back_in_service_at is not None
    assert inc.gpu_serials == ("1650923012345",)  # the board to RMA, from the agent's finding
    assert not r.backend.state["node02"].drain_requested
    for _ in range(3):
        r.round()
    assert len(writes(r, "drain")) == 1  # the echoed old evidence never re-drained it
    r.round(advance=10.0)
    assert r.reint().state == "passed" and r.ledger.incident(incident).status == "resolved"
    # the agent sent a fresh report without the finding: no instruction any more
    r.report("node02")
    assert r.controller.reintegrator.instructions_for(r.controller.reports["node02"]) == []


def test_failed_validation_drains_again_with_the_failing_step_and_waits_for_a_human(rig):
    r = rig(script_rc=3)
    incident = r.drain_node02()
    assert admin.repaired(r.ledger, "node02", "root", "reseated").ok
    r.until(lambda: r.reint().state == "failed")
    node = r.backend.state["node02"]
    assert node.drain_requested
    assert node.reason == f"healthd: validation failed: gpu_check.sh rc=3: GPU 0: memory test failed [#{incident}]"
    assert writes(r, "delete_reservation")
    assert r.ledger.incident(incident).status == "validation-failed"
    assert r.ledger.hold("node02").incident_id == incident
    # the fault looks cleared now, but a failed validation is never retried by itself
    r.report("node02")
    for _ in range(3):
        r.round()
    assert len(r.ledger.reintegrations(node="node02")) == 1
    r.set_check(0)
    assert admin.repaired(r.ledger, "node02", "root", "replaced GPU 0").ok
    r.until(lambda: r.reint().state == "probation")
    assert not r.backend.state["node02"].drain_requested


def test_auto_mode_reintegrates_a_node_whose_fault_cleared_supervised_does_not(rig):
    for mode, expected in (("auto", "probation"), ("supervised", None)):
        r = rig(mode=mode)
        if mode == "supervised":
            r.report("node02", xid79(r.now))
            r.round()
            waiting = r.ledger.decisions(outcome="waiting")
            assert admin.approve(r.ledger, waiting[0].id, "root", "yes").ok
        incident = r.drain_node02()
        r.report("node02", at=r.now + 0.5)  # the agent's next report: nothing actionable
        if expected is None:
            for _ in range(5):
                r.round()
            assert r.ledger.reintegrations() == [] and r.backend.state["node02"].drain_requested
            continue
        r.until(lambda r=r, expected=expected: bool(r.ledger.reintegrations()) and r.reint().state == expected)
        assert r.reint().trigger == "cleared" and r.reint().incident_id == incident


def test_a_node_draining_with_jobs_waits_and_an_admin_takeover_aborts(rig):
    r = rig()
    r.drain_node02()
    r.backend.state["node02"] = dataclasses.replace(r.backend.state["node02"], state="allocated")
    assert admin.repaired(r.ledger, "node02", "root", "fixed").ok
    for _ in range(3):
        r.round()
    assert r.reint().state == "requested" and not writes(r, "create_reservation")
    # an administrator takes the node over meanwhile
    r.backend.state["node02"] = dataclasses.replace(r.backend.state["node02"], state="idle", reason="admin: bad fan",
                                                    reason_user="alice")
    r.round()
    assert r.reint().state == "aborted" and "admin: bad fan" in r.reint().detail
    assert not writes(r, "resume") and r.backend.state["node02"].reason == "admin: bad fan"


def test_recurrence_in_probation_escalates_the_third_time_to_inspect_hardware(rig):
    r = rig(probation_s=3600.0)
    for attempt in range(3):
        incident = r.drain_node02()
        inc = r.ledger.incident(incident)
        if attempt < 2:
            assert inc.escalation is None and "INSPECT" not in r.backend.state["node02"].reason
            assert admin.repaired(r.ledger, "node02", "root", f"repair {attempt}").ok
            r.until(lambda: r.reint().state == "probation")
            r.now += 5  # the same GPU falls off the bus again, after the repair
        else:
            assert inc.escalation == "inspect-hardware"
            assert r.backend.state["node02"].reason.startswith("healthd: INSPECT HARDWARE (recurring): xid 79")
            r.round()
            assert r.ledger.reintegrations(node="node02")[-1].state == "recurred"
            # an escalated incident is never reintegrated by itself when the agent goes quiet
            r.report("node02")
            for _ in range(3):
                r.round()
            assert not r.ledger.active_reintegration("node02") and r.backend.state["node02"].drain_requested


def test_a_failed_validation_drains_again_below_a_capacity_floor_and_a_spent_rate_limit(rig):
    """The drain after a failed validation is the action table's `redrain`: the node is in its reservation,
    out of users' reach, so the floor and the hourly budget (which would refuse a new drain) do not apply."""
    r = rig(script_rc=3)
    incident = r.drain_node02()
    r.controller.policy = dataclasses.replace(r.controller.policy, capacity_floors={"gpu": 4}, max_actions_per_hour=1)
    assert admin.repaired(r.ledger, "node02", "root", "reseated").ok
    r.until(lambda: r.reint().state == "failed")
    assert r.backend.state["node02"].drain_requested and r.ledger.hold("node02").incident_id == incident
    rows = [d for d in r.ledger.decisions() if (d.evidence or {}).get("decision", "").startswith("reintegrate:")]
    assert {d.kind for d in rows} >= {"reservation-create", "resume", "redrain", "reservation-delete"}
    assert all(d.outcome == "allowed" for d in rows)


def test_a_reintegration_waits_while_the_breaker_is_open(rig):
    r = rig()
    r.drain_node02()
    r.ledger.open_breaker("switch:s1", nodes=["node01", "node03"], at=r.now)
    assert admin.repaired(r.ledger, "node02", "root", "fixed").ok
    for _ in range(3):
        r.round()
    assert r.reint().state == "requested" and not writes(r, "create_reservation") and not writes(r, "resume")
    [held] = [d for d in r.ledger.decisions(outcome="refused") if d.kind == "resume"]
    assert held.refused_gate == "breaker"
    r.ledger.reset_breaker(by="alice", why="switch replaced", at=r.now + 0.5)
    r.until(lambda: r.reint().state == "probation")
    assert len(writes(r, "resume")) == 1


def test_observe_mode_never_reintegrates(rig):
    r = rig(mode="observe")
    r.ledger.open_incident(XID, attribution="hardware", tier="T1", nodes=["node02"])
    r.report("node02")
    for _ in range(3):
        r.round()
    assert r.backend.writes == []


def test_a_restarted_controller_runs_the_validation_again(rig, tmp_path):
    r = rig()
    r.set_check(0)
    r.write_script("#!/bin/sh\nsleep 4\n")  # the first controller dies while this runs
    r.drain_node02()
    assert admin.repaired(r.ledger, "node02", "root", "fixed").ok
    r.until(lambda: r.reint().state == "validating")
    r.controller.close()
    r.set_check(0)
    again = Controller(r.settings, r.ledger, r.backend, out=r.lines.append)
    r.controller = again
    r.until(lambda: r.reint().state == "probation")
    assert len(writes(r, "resume")) == 1  # resumed once, validated twice


def test_settings_validate_placeholders_and_numbers():
    with pytest.raises(ValueError, match="unknown placeholder"):
        ReintegrationSettings(validation=(("srun", "{host}"),))
    with pytest.raises(ValueError, match="probation_s"):
        ReintegrationSettings(probation_s=0)
    s = parse_controller_settings("reintegration:\n  probation_s: 60\n  validation: [[/bin/true, '{node}']]\n")
    assert s.reintegration.validation == (("/bin/true", "{node}"),) and s.reintegration.probation_s == 60
    with pytest.raises(ConfigError, match="reintegration"):
        parse_controller_settings("reintegration:\n  validation: [['{nodes}']]\n")
    assert expand(("x{node}", "{reservation}"), {"node": "n1", "reservation": "r", "incident": "", "slurm_conf": ""}) == ["xn1", "r"]
    assert failure_summary([{"argv": ["srun", "--x", "/opt/check", "n1"], "rc": 2, "output": "a\nGPU bad\n"}]) == \
        "check rc=2: GPU bad"
