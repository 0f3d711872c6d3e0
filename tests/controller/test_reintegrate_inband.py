"""In-band evidence during a reintegration's probation: the node's ranks against their job's median
(verified when within min_effect), a job on the node alone (no peer to compare), a node still flagged
slow (never drained; the incident left open), and nothing at all without in-band data. Pure functions
on hand-built reports, then through the controller's rounds (a fake Slurm, a real ledger, a real
validation script)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from healthd.controller import admin, inband
from healthd.controller.daemon import Controller
from healthd.controller.ledger import CLOSED_INCIDENT_STATUSES
from healthd.controller.policy import NodeReport
from healthd.controller.healthctl import _next_steps
from healthd.controller.reintegrate import INBAND_SLOW_STATUS, probation_verdict, still_slow
from tests.controller.test_inband import job_doc, node_doc, rank_doc, reports_of
from tests.controller.test_inband import spread_job as _spread_job
from tests.controller.test_reintegrate import Rig


def spread_job(*args: Any, **kw: Any) -> dict[str, dict[str, Any]]:
    """Slow ranks slow in every window unless `onset` says from which: a node's ratio to its job's
    median. A rank slow from the job's first window is structure to the straggler detector, never
    flagged; a flag needs an onset."""
    kw.setdefault("onset", 0)
    return _spread_job(*args, **kw)


NOW = 1_800_000_000.0


def views(*jobs, at: float = NOW - 1, findings: dict | None = None) -> dict[str, inband.JobView]:
    return inband.merge(reports_of(*jobs, at=at, findings=findings).values(), NOW, 120.0)


def agent_straggler(job: str = "77", effect: float = 0.3) -> dict:
    """The finding a node's agent reports for a slow rank of a job on it alone (healthd.agent.inband_jobs)."""
    return {"id": "inband.straggler:gpu1", "component": {"kind": "gpu", "index": 1}, "source": "inband",
            "attribution": "unknown", "tier": 3, "action": "none",
            "summary": f"straggler: job {job} rank 1 on gpu1 {effect:+.1%} compute; in-band evidence only",
            "evidence": [{"kind": "inband", "text": f"job {job} rank 1 (gpu 1): compute {effect:+.1%}",
                          "job": job, "rank": 1, "gpu": 1, "test": "magnitude", "effect": effect, "windows": [7, 8]}],
            "job": job}


# --------------------------------------------------------------------------- pure


def test_node_ratio_is_the_nodes_slowest_rank_against_the_jobs_median_per_window():
    even = views(spread_job("123", {"node01": 4, "node02": 4}))
    assert inband.node_ratio(even, "node02") == inband.NodeRatio(ratio=1.0, windows=8, job="123")
    slow = views(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}))
    got = inband.node_ratio(slow, "node02")
    assert got is not None and got.job == "123" and got.windows == 8
    assert got.ratio == pytest.approx(1.25)  # the slow rank, not the node's median rank
    assert inband.node_ratio(slow, "node01") == inband.NodeRatio(ratio=1.0, windows=8, job="123")
    assert inband.node_ratio(slow, "node03") is None  # no rank there


def test_node_ratio_compares_only_windows_a_peer_on_another_node_holds_and_takes_the_worst_job():
    job = spread_job("123", {"node01": 2, "node02": 2})
    for rank in job["node01"]["ranks"]:  # the peers' windows end where node02's begin: nothing in common
        rank["windows"] = [w for w in rank["windows"] if w["window"] < 3]
    for rank in job["node02"]["ranks"]:
        rank["windows"] = [w for w in rank["windows"] if w["window"] >= 3]
    assert inband.node_ratio(views(job), "node02") is None
    partial = spread_job("123", {"node01": 2, "node02": 2}, windows=range(1, 4))
    other = spread_job("124", {"node02": 1, "node03": 1}, slow={0: 0.11})
    got = inband.node_ratio(views(partial, other), "node02")
    assert got == inband.NodeRatio(ratio=pytest.approx(0.11 / 0.105), windows=8, job="124")
    assert inband.node_ratio(views(partial), "node02") == inband.NodeRatio(ratio=1.0, windows=3, job="123")


def test_a_job_on_the_node_alone_has_no_peer():
    jobs = views(spread_job("77", {"node02": 4}), spread_job("123", {"node01": 2, "node03": 2}))
    assert inband.node_ratio(jobs, "node02") is None
    assert inband.alone_on(jobs, "node02") == ("77",) and inband.alone_on(jobs, "node01") == ()


def test_slowest_on_takes_the_controllers_flags_and_the_agents_findings():
    reports = reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}, onset=5))
    flags = inband.evaluate(reports.values(), {}, inband.DetectorSettings(), NOW, 120.0).flags
    assert inband.slowest_on("node02", flags) == ("123", pytest.approx(0.25))
    assert inband.slowest_on("node01", flags) is None
    alone = reports_of(spread_job("77", {"node02": 2}), findings={"node02": [agent_straggler()]})
    assert inband.slowest_on("node02", (), alone["node02"].findings) == ("77", pytest.approx(0.3))
    # both: the worse one is named
    assert inband.slowest_on("node02", flags, alone["node02"].findings) == ("77", pytest.approx(0.3))


def test_the_probation_verdict_from_the_recorded_evidence():
    assert probation_verdict(None, 0.05) == (None, True)
    assert probation_verdict("in-band so far: node02's ranks at 101.2 % of job 123's median over 8 windows", 0.05) == \
        ("verified in-band: node02's ranks at 101.2 % of job 123's median over 8 windows", True)
    detail, resolved = probation_verdict("in-band so far: node02's ranks at 107.0 % of job 9's median over 1 window",
                                         0.05)
    assert resolved and detail == ("in-band, not verified: node02's ranks at 107.0 % of job 9's median over 1 window "
                                   "(more than 5% above it, not flagged)")
    assert probation_verdict(still_slow("123", 0.25), 0.05) == \
        ("in-band: still slow (+25.0 % in job 123); probation over, incident left open for an operator", False)
    assert probation_verdict("in-band: no peer to compare (job 77 on node02 alone)", 0.05) == \
        ("in-band: no peer to compare (job 77 on node02 alone)", True)


# --------------------------------------------------------------------------- through the controller


@pytest.fixture
def on_probation(tmp_path):
    """A rig whose node02 was drained for an Xid 79, repaired, validated and is now on probation."""
    made: list[Rig] = []

    def make(**kw) -> tuple[Rig, int]:
        d = tmp_path / f"rig{len(made)}"
        d.mkdir()
        kw.setdefault("probation_s", 60.0)
        r = Rig(d, **kw)
        made.append(r)
        incident = r.drain_node02()
        assert admin.repaired(r.ledger, "node02", "root", "reseated GPU 1").ok
        r.until(lambda: r.reint().state == "probation")
        return r, incident

    yield make
    for r in made:
        r.close()


def send(r: Rig, *jobs, findings: dict | None = None) -> None:
    """Fresh reports with in-band sections (and a healthy node02, its old Xid gone)."""
    r.controller.reports.update(reports_of(*jobs, at=r.now, findings=findings))


def drains(r: Rig) -> list[tuple]:
    return [w for w in r.backend.writes if w[0] == "drain"]


def test_a_node_within_min_effect_of_its_jobs_median_is_verified_in_band(on_probation):
    r, incident = on_probation()
    send(r, spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.102}))
    r.round()
    assert r.reint().detail == "in-band so far: node02's ranks at 102.0 % of job 123's median over 8 windows"
    assert r.ledger.incident(incident).status == "probation"
    r.round(advance=70.0)
    ri = r.reint()
    assert ri.state == "passed" and r.ledger.incident(incident).status == "resolved"
    assert ri.detail == "verified in-band: node02's ranks at 102.0 % of job 123's median over 8 windows"
    assert len(drains(r)) == 1


def test_a_node_still_slow_in_band_is_never_drained_and_its_incident_stays_open(on_probation, caplog):
    r, incident = on_probation()
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        for _ in range(3):
            send(r, spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}, onset=5))
            r.round()
        assert r.reint().detail == "in-band: still slow (+25.0 % in job 123)"
        # the rank recovers later in the probation: the flag it had stays the evidence
        send(r, spread_job("123", {"node01": 4, "node02": 4}))
        r.round()
        assert r.reint().detail == "in-band: still slow (+25.0 % in job 123)"
        r.round(advance=70.0)
    ri = r.reint()
    assert ri.state == "passed"
    assert ri.detail == "in-band: still slow (+25.0 % in job 123); probation over, incident left open for an operator"
    inc = r.ledger.incident(incident)
    assert inc.status == INBAND_SLOW_STATUS and inc.status not in CLOSED_INCIDENT_STATUSES
    assert len(drains(r)) == 1 and not r.backend.state["node02"].drain_requested and r.ledger.hold("node02") is None
    (step,) = _next_steps(inc, [], [], r.ledger)  # what `healthctl show` tells the operator to do
    assert "still show" in step and f"healthctl close {inc.id}" in step
    warned = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING and "still slow" in m.getMessage()]
    assert len(warned) == 2 and "no action" in warned[0] and "incident left open" in warned[1]
    # an operator looks at it and closes it
    assert admin.close(r.ledger, incident, "alice", "the job's own data loader").ok


def test_the_agents_own_straggler_finding_on_a_job_alone_counts_too(on_probation):
    r, incident = on_probation()
    job = spread_job("77", {"node02": 4}, slow={1: 0.13})
    job["node02"]["stragglers"] = [{"rank": 1, "test": "magnitude", "windows": [7, 8], "effect": 0.3,
                                    "threshold": 0.05}]
    send(r, job, findings={"node02": [agent_straggler()]})
    r.round()
    assert r.reint().detail == "in-band: still slow (+30.0 % in job 77)"
    r.round(advance=70.0)
    assert r.ledger.incident(incident).status == INBAND_SLOW_STATUS and len(drains(r)) == 1


def test_a_job_on_the_node_alone_says_no_peer_to_compare_and_resolves(on_probation):
    r, incident = on_probation()
    send(r, spread_job("77", {"node02": 4}))
    r.round()
    assert r.reint().detail == "in-band: no peer to compare (job 77 on node02 alone)"
    # a spread job later measures it; a job alone after that does not erase the measurement
    send(r, spread_job("123", {"node01": 2, "node02": 2}))
    r.round()
    measured = "node02's ranks at 100.0 % of job 123's median over 8 windows"
    assert r.reint().detail == f"in-band so far: {measured}"
    del r.controller.reports["node01"]
    send(r, spread_job("77", {"node02": 4}))
    r.round()
    assert r.reint().detail == f"in-band so far: {measured}"
    r.round(advance=70.0)
    assert r.reint().detail == f"verified in-band: {measured}"
    assert r.ledger.incident(incident).status == "resolved"


def test_without_in_band_data_nothing_changes(on_probation):
    r, incident = on_probation()
    r.report("node02")
    r.report("node01")
    r.round()
    assert r.reint().detail is None
    r.round(advance=70.0)
    assert r.reint().state == "passed" and r.reint().detail is None
    assert r.ledger.incident(incident).status == "resolved"


def test_a_report_from_before_the_validation_is_no_evidence(on_probation):
    r, incident = on_probation()
    before = r.reint().validated_at - 5
    r.controller.reports.update(reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}), at=before))
    r.round()
    assert r.reint().detail is None
    r.round(advance=70.0)
    assert r.ledger.incident(incident).status == "resolved"


def test_the_evidence_survives_a_controller_restart(on_probation):
    r, incident = on_probation()
    send(r, spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}, onset=5))
    r.round()
    r.controller.close()
    r.controller = Controller(r.settings, r.ledger, r.backend, out=r.lines.append, clock=lambda: r.now)
    r.round(advance=70.0)  # the new controller has no report yet: the ledger's evidence decides
    assert r.reint().state == "passed" and r.ledger.incident(incident).status == INBAND_SLOW_STATUS


def test_in_band_data_of_other_nodes_only_changes_nothing(on_probation):
    r, incident = on_probation()
    r.controller.reports["node02"] = NodeReport.from_document(node_doc("node02", []), r.now)
    r.controller.reports["node01"] = NodeReport.from_document(
        {"node": "node01", "verdict": "healthy", "findings": [],
         "inband": {"jobs": [job_doc("5", [rank_doc(0, gpu=0)], 1)]}}, r.now)
    r.round()
    assert r.reint().detail is None
    r.round(advance=70.0)
    assert r.ledger.incident(incident).status == "resolved"
