"""In-band signals at the controller (healthd.controller.inband): a job's ranks merged across nodes, slow
ranks made findings for their nodes with the agent's ids and tiers, slow ranks under one switch made one
fabric incident, an in-band-only straggler never draining anything, and a hung job requeued once when it
opted in (a fake Slurm, a real ledger; the last test sends real signed reports through the HTTP server)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from healthd.controller import inband
from healthd.controller.config import ControllerInbandSettings, ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.gates import BreakerState, apply_gates, build_context
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings, FleetView, LedgerView, NodeReport, decide
from healthd.settings import DetectorSettings
from healthd.slurm.backend import JobInfo
from tests.controller.munge_support import munged_path
from tests.support.fake_slurm import FakeBackend

NOW = 1_800_000_000.0
DETECTOR = DetectorSettings()
SWITCHES = {"switch:s1": frozenset({"node01", "node02"}), "switch:s2": frozenset({"node03", "node04"}),
            "switch:spine": frozenset({"node01", "node02", "node03", "node04"})}
TOPOLOGY = "SwitchName=s1 Nodes=node[01-02]\nSwitchName=s2 Nodes=node[03-04]\nSwitchName=spine Switches=s[1-2]\n"


# --------------------------------------------------------------------------- documents


def rank_doc(rank: int, *, gpu: int, compute: float = 0.1, windows: range = range(1, 9), last_step: int = 449,
             age: float = 1.0, phase: str = "wait", median: float | None = 0.11, corroboration: tuple = (),
             rail: str | None = "mlx5_0/1", onset: int = 0) -> dict[str, Any]:
    """`compute` from window `onset` on, 0.1 before (a slow rank's first windows are its baseline)."""
    return {"rank": rank, "local_rank": gpu, "gpu": gpu, "pid": 1000 + rank, "last_step": last_step,
            "last_step_age_s": age, "phase": phase, "phase_age_s": 0.1, "step_median_s": median,
            "longest_save_s": 0.0, "lost": 0, "torn": 0, "rail": rail, "corroboration": list(corroboration),
            "windows": [{"window": w, "steps": 50, "compute_s": c, "step_s": 0.2, "wait_s": round(0.2 - c, 6),
                         "waits": None} for w in windows for c in [compute if w >= onset else 0.1]]}


def node_doc(node: str, jobs: list[dict[str, Any]], findings: list | None = None) -> dict[str, Any]:
    return {"node": node, "verdict": "healthy", "findings": findings or [], "inband": {"jobs": jobs}}


def job_doc(job: str, ranks: list[dict[str, Any]], world: int, **kw: Any) -> dict[str, Any]:
    return {"job": job, "world_size": world, "ranks_here": len(ranks), "step_median_s": 0.11, "ranks": ranks,
            "stragglers": [], "hang": None, "errors": [], **kw}


def spread_job(job: str, placement: dict[str, int], slow: dict[int, float] | None = None,
               corroborate: dict[int, tuple[str, ...]] | None = None, onset: int = 5,
               **rank_kw: Any) -> dict[str, dict[str, Any]]:
    """node -> its job entry: `placement` node -> ranks there (numbered in order, GPU = local rank);
    `slow` rank -> its compute time from window `onset` on; `corroborate` rank -> its node's out-of-band lines."""
    slow, corroborate = slow or {}, corroborate or {}
    world = sum(placement.values())
    out, r = {}, 0
    for node, n in placement.items():
        ranks = []
        for local in range(n):
            ranks.append(rank_doc(r, gpu=local, compute=slow.get(r, 0.1), corroboration=corroborate.get(r, ()),
                                  onset=onset, **rank_kw))
            r += 1
        out[node] = job_doc(job, ranks, world)
    return out


def reports_of(*jobs: dict[str, dict[str, Any]], at: float = NOW - 1,
               findings: dict[str, list] | None = None) -> dict[str, NodeReport]:
    per_node: dict[str, list] = {}
    for job in jobs:
        for node, entry in job.items():
            per_node.setdefault(node, []).append(entry)
    return {node: NodeReport.from_document(node_doc(node, entries, (findings or {}).get(node)), at)
            for node, entries in per_node.items()}


def run(reports: dict[str, NodeReport], groups=SWITCHES, now: float = NOW, **kw) -> inband.InbandRound:
    return inband.evaluate(reports.values(), groups, DETECTOR, now, 120.0, **kw)


# --------------------------------------------------------------------------- merging


def test_ranks_merge_per_job_across_nodes_and_the_newer_report_wins():
    job = spread_job("123", {"node01": 2, "node02": 2})
    reports = reports_of(job)
    # node03 reports rank 0 too (the job moved there), later than node01
    moved = NodeReport.from_document(node_doc("node03", [job_doc("123", [rank_doc(0, gpu=5, last_step=500)], 4)]),
                                     NOW - 0.5)
    stale = NodeReport.from_document(node_doc("node04", [job_doc("123", [rank_doc(1, gpu=7)], 4)]), NOW - 500)
    views = inband.merge([*reports.values(), moved, stale], NOW, 120.0)
    view = views["123"]
    assert sorted(view.ranks) == [0, 1, 2, 3] and view.world_size == 4
    assert view.ranks[0].node == "node03" and view.ranks[0].state.progress.last_step == 500
    assert view.ranks[1].node == "node01"  # the stale report of node04 does not count
    assert view.nodes == ("node01", "node02", "node03")


def test_an_old_agents_report_has_no_inband_data_and_changes_nothing():
    old = NodeReport.from_document({"node": "node01", "verdict": "healthy", "findings": []}, NOW - 1)
    assert old.inband == ()
    r = run({"node01": old})
    assert r.jobs == 0 and r.findings == {} and r.hangs == ()


# --------------------------------------------------------------------------- stragglers -> findings


def test_a_slow_rank_of_a_multi_node_job_is_a_t3_finding_for_its_node_and_gpu():
    reports = reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}))
    r = run(reports)
    assert [(f.job, f.node, f.state.rank, f.tier) for f in r.flags] == [("123", "node02", 5, 3)]
    assert set(r.findings) == {"node02"}
    [f] = r.findings["node02"]
    assert f.id == "inband.straggler:gpu1" and f.component.kind == "gpu" and f.component.index == 1
    assert (f.tier, f.action, f.attribution, f.source, f.job) == (3, "none", "unknown", "inband", "123")
    assert "rank 5 of job 123" in f.summary and "recorded, never acts" in f.summary
    assert f.evidence[0].kind == "inband" and f.evidence[0].data["rank"] == 5
    assert f.evidence[0].data["windows"][-1] == 8 and f.first_seen == NOW
    assert r.flagged_by_tier() == {"T2": 0, "T3": 1}


def test_corroboration_on_the_gpu_makes_it_t2_hardware_and_on_the_rail_t2_fabric():
    gpu_line = ("gpu1: clocks throttled (hw_slowdown)",)
    rail_line = ("mlx5_0/1: symbol errors 300/h",)
    job = spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125, 2: 0.13},
                     corroborate={5: gpu_line, 2: rail_line})
    job["node02"]["ranks"][1]["rail"] = "mlx5_1/1"  # not rank 2's rail: two causes, not one shared one
    r = run(reports_of(job), groups={})
    [f2] = r.findings["node02"]
    assert (f2.tier, f2.action, f2.attribution) == (2, "drain", "hardware")
    assert "corroborated: gpu1: clocks throttled" in f2.summary
    assert any(e.text == "corroborated on node02: gpu1: clocks throttled (hw_slowdown)" for e in f2.evidence)
    [f1] = r.findings["node01"]
    assert (f1.tier, f1.action, f1.attribution, f1.id) == (2, "drain", "fabric", "inband.straggler:gpu2")
    assert r.flagged_by_tier() == {"T2": 2, "T3": 0}


def test_an_unknown_gpu_makes_a_node_finding():
    job = spread_job("9", {"node01": 2, "node02": 2}, slow={3: 0.13})
    job["node02"]["ranks"][1]["gpu"] = -1
    [f] = run(reports_of(job)).findings["node02"]
    assert f.id == "inband.straggler:node" and f.component.kind == "node"


def test_a_job_on_one_node_is_its_agents_to_judge():
    """The agent flags and reports its own findings; the controller only counts its flags."""
    job = spread_job("77", {"node01": 4}, slow={2: 0.2})
    job["node01"]["stragglers"] = [{"rank": 2, "test": "magnitude", "windows": [7, 8], "effect": 1.0,
                                    "threshold": 0.05}]
    r = run(reports_of(job))
    assert r.findings == {} and [(f.state.rank, f.by_agent) for f in r.flags] == [(2, True)]
    assert r.flagged_by_tier() == {"T2": 0, "T3": 1}


def test_slow_ranks_on_two_nodes_under_one_switch_are_one_fabric_incident():
    job = spread_job("123", {"node01": 4, "node02": 4, "node03": 4, "node04": 4}, slow={1: 0.13, 6: 0.13, 9: 0.13})
    r = run(reports_of(job))
    [a], [b], [c] = r.findings["node01"], r.findings["node02"], r.findings["node03"]
    for f in (a, b):
        assert f.attribution == "fabric" and f.tier == 3 and f.action == "none"
        assert f.summary.startswith("one of 2 slow ranks of job 123 under switch s1: ")
    # rank 9 is alone under s2: its own finding (the spine holds all three, but s1 is the smaller group)
    assert c.attribution == "unknown" and c.summary.startswith("in-band straggler: rank 9")


def test_a_fabric_incident_of_corroborated_ranks_goes_through_the_correlation_gate():
    job = spread_job("123", {"node01": 4, "node02": 4, "node03": 4, "node04": 4}, slow={1: 0.13, 6: 0.13},
                     corroborate={1: ("gpu1: clocks throttled",), 6: ("gpu2: clocks throttled",)})
    reports = reports_of(job)
    r = run(reports)
    for node in ("node01", "node02"):
        [f] = r.findings[node]
        assert (f.tier, f.action, f.attribution) == (2, "drain", "fabric") and "under switch s1" in f.summary
    injected = {n: dataclasses.replace(rep, findings=rep.findings + r.findings.get(n, ())) for n, rep in reports.items()}
    fleet = FleetView.build(injected.values(), [], TOPOLOGY, ControllerPolicySettings())
    policy = ControllerPolicySettings(mode="auto", auto_tier2=True, breaker_nodes=100, breaker_percent=100)
    ctx, _ = build_context(fleet, LedgerView(), policy, NOW)
    outcomes = {o.decision.node: o for o in apply_gates(decide(fleet, LedgerView(), policy, NOW), ctx)}
    assert {n: (o.decision.kind, o.gate) for n, o in outcomes.items()} == \
        {"node01": ("drain", "correlation"), "node02": ("drain", "correlation")}


def test_the_agents_own_finding_of_the_same_id_wins():
    agent = {"id": "inband.straggler:gpu1", "component": {"kind": "gpu", "index": 1}, "source": "inband",
             "attribution": "hardware", "tier": 2, "action": "drain", "summary": "the agent's",
             "evidence": [{"kind": "inband", "text": "x"}], "job": "123"}
    reports = reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}), findings={"node02": [agent]})
    r = run(reports)
    merged = inband.with_findings(reports["node02"].findings, r.findings["node02"])
    assert [f.summary for f in merged] == ["the agent's"]


def test_two_slow_ranks_on_one_gpu_are_one_finding_the_stronger_first():
    job_a = spread_job("1", {"node01": 2, "node02": 2}, slow={3: 0.13})
    job_b = spread_job("2", {"node01": 2, "node02": 2}, slow={3: 0.13}, )
    job_b["node02"]["ranks"][1]["corroboration"] = ["gpu1: row remap pending"]
    [f] = run(reports_of(job_a, job_b)).findings["node02"]
    assert f.tier == 2 and f.job == "2" and f.summary.endswith("(and 1 more slow rank here)")
    assert {e.data.get("job") for e in f.evidence} == {"1", "2"}


def test_a_straggler_keeps_its_first_seen_through_its_episode():
    reports = reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125}))
    first = run(reports)
    later = run(reports, now=NOW + 30, first_seen=first.first_seen)
    [f] = later.findings["node02"]
    assert f.first_seen == NOW and f.last_seen == NOW + 30
    healthy = run(reports_of(spread_job("123", {"node01": 4, "node02": 4})), now=NOW + 60,
                  first_seen=later.first_seen)
    assert healthy.first_seen == {}


# --------------------------------------------------------------------------- an in-band straggler alone never acts


def _big_job_with_100_slow_nodes() -> tuple[dict[str, NodeReport], list[str]]:
    nodes = [f"n{i:03d}" for i in range(300)]
    job = spread_job("5000", {n: 1 for n in nodes}, slow={i: 0.13 for i in range(0, 300, 3)})
    return reports_of(job), nodes


def test_a_t3_straggler_on_100_nodes_never_drains_and_never_opens_the_breaker():
    reports, nodes = _big_job_with_100_slow_nodes()
    r = run(reports, groups={})
    assert len(r.findings) == 100 and all(f.tier == 3 and f.action == "none" for fs in r.findings.values() for f in fs)
    injected = {n: dataclasses.replace(rep, findings=rep.findings + r.findings.get(n, ())) for n, rep in reports.items()}
    for mode in ("observe", "supervised", "auto"):
        policy = ControllerPolicySettings(mode=mode, auto_tier2=True, breaker_nodes=5)  # type: ignore[arg-type]
        fleet = FleetView.build(injected.values(), [], "", policy)
        ctx, alert = build_context(fleet, LedgerView(), policy, NOW, BreakerState())
        assert alert is None and not ctx.breaker.open
        outcomes = apply_gates(decide(fleet, LedgerView(), policy, NOW), ctx)
        assert len(outcomes) == 100
        assert all(o.decision.kind == "none" and o.status == "recorded" for o in outcomes)


def test_a_t3_straggler_on_100_nodes_through_the_controller_writes_nothing(tmp_path):
    reports, nodes = _big_job_with_100_slow_nodes()
    with made(tmp_path, "auto", nodes=nodes, auto_tier2=True, breaker_nodes=5) as (c, ledger, backend):
        c.reports.update(reports)
        for i in range(3):
            c.evaluate(NOW + i)
        assert backend.writes == [] and not ledger.breaker_state().open
        assert ledger.incidents(status="open") == [] and ledger.actions() == []
        assert c.round_figures(NOW + 2).inband_stragglers == {"T2": 0, "T3": 100}


# --------------------------------------------------------------------------- the controller


def make(tmp_path: Path, mode: str = "auto", *, nodes=("node01", "node02", "node03", "node04"), dry_run=False,
         ledger: Ledger | None = None, **policy: Any):
    ledger = ledger or Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                  policy=ControllerPolicySettings(mode=mode, **policy),  # type: ignore[arg-type]
                                  inband=ControllerInbandSettings())
    backend = FakeBackend(nodes, clock=lambda: NOW)
    c = Controller(settings, ledger, backend, dry_run=dry_run, metrics=ControllerMetrics(), node_addrs=dict,
                   clock=lambda: NOW, topology_text=TOPOLOGY, out=lambda line: None)
    return c, ledger, backend


@contextmanager
def made(tmp_path: Path, mode: str = "auto", **kw: Any) -> Iterator[tuple[Controller, Ledger, FakeBackend]]:
    """`make`'s controller, ledger and backend, the controller and the ledger closed after."""
    c, ledger, backend = make(tmp_path, mode, **kw)
    try:
        yield c, ledger, backend
    finally:
        c.close()
        ledger.close()


def test_a_corroborated_straggler_on_a_multi_node_job_waits_for_approval_in_auto(tmp_path):
    with made(tmp_path, "auto") as (c, ledger, backend):
        c.reports.update(reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125},
                                               corroborate={5: ("gpu1: clocks throttled (hw_slowdown)",)})))
        c.evaluate(NOW)
        assert backend.writes == []
        [waiting] = ledger.waiting_decisions()
        assert waiting.node == "node02" and waiting.kind == "drain" and waiting.tier == "T2"
        assert waiting.evidence["findings"] == ["inband.straggler:gpu1"]
        [inc] = ledger.incidents(status="open")
        assert inc.signature == "inband.straggler:gpu1" and inc.nodes == ("node02",)
        ledger.record_approval(waiting.id, operator="alice", verdict="approve")
        c.evaluate(NOW + 1)
        assert [w[:2] for w in backend.writes] == [("drain", "node02")]
        assert "rank 5 of job 123" in backend.writes[0][2]


def test_a_dismissed_straggler_stays_dismissed_through_its_episode_and_a_restart(tmp_path):
    spread = spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125},
                        corroborate={5: ("gpu1: clocks throttled (hw_slowdown)",)})
    c, ledger, backend = make(tmp_path, "auto")
    c.reports.update(reports_of(spread))
    c.evaluate(NOW)
    [inc] = ledger.incidents(status="open")
    ledger.close_incident(inc.id, "false_positive", by="alice", why="the job's own data loader", at=NOW + 1)
    c.reports.update(reports_of(spread, at=NOW + 1))
    c.evaluate(NOW + 2)
    drains = [d.id for d in ledger.decisions() if d.kind == "drain"]
    assert ledger.incidents(status="open") == [] and len(drains) == 1
    c.close()
    c, _, backend = make(tmp_path, "auto", ledger=ledger)
    try:
        c.reports.update(reports_of(spread, at=NOW + 3))
        c.evaluate(NOW + 4)
        assert ledger.incidents(status="open") == [] and backend.writes == []
        assert [d.id for d in ledger.decisions() if d.kind == "drain"] == drains
        # the rank recovers, then slows again: a new episode, a new incident
        c.reports.update(reports_of(spread_job("123", {"node01": 4, "node02": 4}), at=NOW + 5))
        c.evaluate(NOW + 6)
        c.reports.update(reports_of(spread, at=NOW + 7))
        c.evaluate(NOW + 8)
        [again] = ledger.incidents(status="open")
        assert again.signature == "inband.straggler:gpu1" and again.id != inc.id
    finally:
        c.close()
        ledger.close()


def hung_job(job: str = "123", *, age: float = 90.0, step: int = 411) -> dict[str, dict[str, Any]]:
    """Ranks on node01 and node02 stalled for `age` s; rank 3 on node02 is one step behind, computing."""
    out = spread_job(job, {"node01": 2, "node02": 2}, age=age, last_step=step)
    out["node02"]["ranks"][1].update(last_step=step - 1, phase="compute")
    return out


def opted_in(backend: FakeBackend, job: str = "123", comment: str = "healthd:requeue run 7", batch: bool = True):
    for node in ("node01", "node02"):
        backend.running.setdefault(node, []).append(JobInfo(job_id=job, batch=batch, comment=comment))


def test_hangs_name_the_behind_ranks_their_nodes_and_phases():
    reports = reports_of(hung_job(age=50.0), at=NOW - 20)  # 50 s old when sent, 70 s by now: over 60 s
    [case] = run(reports).hangs
    assert case.job == "123" and case.hang.step == 411 and case.behind == ((3, "node02", "compute"),)
    assert case.hang.stalled_s == pytest.approx(70.0) and case.key == "requeue-hang:123:411"
    assert "rank 3 on node02 (compute)" in case.describe()
    assert run(reports_of(hung_job(age=50.0), at=NOW - 1)).hangs == ()


def test_a_hung_opted_in_job_is_requeued_exactly_once_across_rounds_and_restarts(tmp_path, caplog):
    c, ledger, backend = make(tmp_path, "auto")
    opted_in(backend)
    c.reports.update(reports_of(hung_job()))
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        for i in range(3):
            c.reports.update(reports_of(hung_job(), at=NOW + i - 1))
            c.evaluate(NOW + i)
    assert backend.writes == [("requeue", "123")]
    [action] = ledger.actions()
    assert (action.kind, action.idempotency_key, action.status, action.node) == \
        ("requeue", "requeue-hang:123:411", "applied", "node02")
    assert action.evidence["behind"] == [{"rank": 3, "node": "node02", "phase": "compute"}]
    [row] = [d for d in ledger.decisions() if d.kind == "requeue-hang"]
    assert row.outcome == "allowed" and "job 123 hung at step 411" in row.reason
    assert sum("ALERT in-band hang" in r.getMessage() for r in caplog.records) == 1
    c.close()
    # a restart: the ledger remembers
    c2, _, backend2 = make(tmp_path, "auto", ledger=ledger)
    opted_in(backend2)
    try:
        c2.reports.update(reports_of(hung_job(), at=NOW + 9))
        c2.evaluate(NOW + 10)
        assert backend2.writes == [] and len(ledger.actions()) == 1
        # a new stall at a later step is a new hang: requeued again, once
        c2.reports.update(reports_of(hung_job(step=900), at=NOW + 19))
        c2.evaluate(NOW + 20)
        c2.evaluate(NOW + 21)
        assert backend2.writes == [("requeue", "123")]
    finally:
        c2.close()
        ledger.close()


def test_a_hung_job_that_did_not_opt_in_is_recorded_and_alerted_once(tmp_path, caplog):
    with made(tmp_path, "auto") as (c, ledger, backend):
        opted_in(backend, comment="my experiment")
        opted_in(backend, job="124", batch=False)  # an interactive job cannot be requeued
        with caplog.at_level(logging.WARNING, logger="healthd.controller"):
            for i in range(3):
                c.reports.update(reports_of(hung_job(), hung_job("124"), at=NOW + i - 1))
                c.evaluate(NOW + i)
        assert backend.writes == [] and ledger.actions() == []
        rows = [d for d in ledger.decisions() if d.kind == "requeue-hang"]
        assert sorted(r.evidence["job"] for r in rows) == ["123", "124"]
        assert all(r.outcome == "refused" and r.refused_gate == "policy" for r in rows)
        assert "did not opt in" in rows[0].refused_reason
        alerts = [r.getMessage() for r in caplog.records if "ALERT in-band hang" in r.getMessage()]
        assert len(alerts) == 2 and all("a hang never drains a node" in a for a in alerts)
        assert not ledger.holds() and not any(w[0] == "drain" for w in backend.writes)


def test_a_hung_job_that_did_not_opt_in_is_not_recorded_or_alerted_again_after_a_restart(tmp_path, caplog):
    c, ledger, backend = make(tmp_path, "auto")
    opted_in(backend, comment="my experiment")
    with caplog.at_level(logging.WARNING, logger="healthd.controller"):
        c.reports.update(reports_of(hung_job()))
        c.evaluate(NOW)
        c.close()
        c2, _, backend2 = make(tmp_path, "auto", ledger=ledger)
        opted_in(backend2, comment="my experiment")
        try:
            for i in range(2):
                c2.reports.update(reports_of(hung_job(), at=NOW + 9 + i))
                c2.evaluate(NOW + 10 + i)
            assert len([d for d in ledger.decisions() if d.kind == "requeue-hang"]) == 1
            assert sum("ALERT in-band hang" in r.getMessage() for r in caplog.records) == 1
        finally:
            c2.close()
            ledger.close()


def test_a_finished_job_whose_records_outlived_it_is_never_requeued(tmp_path):
    with made(tmp_path, "auto") as (c, ledger, backend):
        backend.known_jobs["123"] = JobInfo(job_id="123", batch=True, comment="healthd:requeue")  # ended, not running
        c.reports.update(reports_of(hung_job()))
        c.evaluate(NOW)
        assert backend.writes == []
        [row] = [d for d in ledger.decisions() if d.kind == "requeue-hang"]
        assert row.refused_gate == "policy" and "not running on node02" in row.refused_reason


def test_observe_mode_and_dry_run_requeue_nothing(tmp_path):
    with made(tmp_path, "observe") as (c, ledger, backend):
        opted_in(backend)
        for i in range(2):
            c.reports.update(reports_of(hung_job(), at=NOW + i - 1))
            c.evaluate(NOW + i)
        assert backend.writes == []
        [row] = [d for d in ledger.decisions() if d.kind == "requeue-hang"]
        assert (row.outcome, row.refused_gate) == ("refused", "mode")
    d = tmp_path / "dry"
    d.mkdir()
    printed: list[str] = []
    c, ledger, backend = make(d, "auto", dry_run=True)
    c.executor.out = printed.append
    opted_in(backend)
    try:
        for i in range(2):
            c.reports.update(reports_of(hung_job(), at=NOW + i - 1))
            c.evaluate(NOW + i)
        assert backend.writes == [] and ledger.actions() == []
        assert printed == ["dry-run: would run: scontrol requeue 123"]
    finally:
        c.close()
        ledger.close()


def test_supervised_waits_for_approval_then_requeues_once(tmp_path):
    with made(tmp_path, "supervised") as (c, ledger, backend):
        opted_in(backend)
        c.reports.update(reports_of(hung_job()))
        c.evaluate(NOW)
        c.evaluate(NOW + 1)
        assert backend.writes == []
        [waiting] = ledger.waiting_decisions()
        assert waiting.kind == "requeue-hang" and waiting.evidence["decision"] == "requeue-hang:123:411"
        ledger.record_approval(waiting.id, operator="alice", verdict="approve")
        c.evaluate(NOW + 2)
        c.evaluate(NOW + 3)
        assert backend.writes == [("requeue", "123")]
        assert ledger.decision(waiting.id).outcome == "allowed"


def test_hang_requeues_respect_the_breaker_and_an_hourly_budget(tmp_path):
    with made(tmp_path, "auto", max_actions_per_hour=1) as (c, ledger, backend):
        opted_in(backend)
        opted_in(backend, job="124")
        ledger.open_breaker("switch:s1", nodes=["node01"], at=NOW - 5)
        c.reports.update(reports_of(hung_job(), hung_job("124")))
        c.evaluate(NOW)
        assert backend.writes == []
        ledger.reset_breaker(by="alice", why="fixed", at=NOW + 1)
        c.evaluate(NOW + 2)
        c.evaluate(NOW + 3)
        assert backend.writes == [("requeue", "123")]
        rows = {d.evidence["job"]: d for d in ledger.decisions() if d.kind == "requeue-hang"}
        assert (rows["124"].outcome, rows["124"].refused_gate) == ("refused", "rate-limit")
        c.reports.update(reports_of(hung_job(), hung_job("124"), at=NOW + 3699))
        c.evaluate(NOW + 3700)  # an hour later the budget has room again
        assert backend.writes == [("requeue", "123"), ("requeue", "124")]


def _crash_after_plan(tmp_path: Path) -> tuple[Ledger, str]:
    """A hang's requeue decided and planned, then the controller killed before the Slurm call."""
    c, ledger, backend = make(tmp_path, "auto")
    c.reports.update(reports_of(hung_job()))
    case = run(c.reports).hangs[0]
    row = ledger.record_decision(node="node02", kind="requeue-hang", tier="T3", mode="auto", reason="x",
                                 outcome="allowed", evidence=case.evidence(), at=NOW)
    ledger.plan_action(decision_id=row.id, idempotency_key=case.key, series=case.key, node="node02", kind="requeue",
                       argv=["scontrol", "requeue", "123"], evidence={"job": "123", "restarts": 0}, at=NOW)
    c.close()
    return ledger, case.key


@pytest.mark.parametrize("landed", [False, True])
def test_a_requeue_a_crash_left_planned_is_settled_then_done_once(tmp_path, landed):
    ledger, key = _crash_after_plan(tmp_path)
    c, _, backend = make(tmp_path, "auto", ledger=ledger)
    for node in ("node01", "node02"):  # Slurm counts a requeue that landed as a restart
        backend.running[node] = [JobInfo(job_id="123", batch=True, comment="healthd:requeue", restarts=int(landed))]
    try:
        c.reports.update(reports_of(hung_job()))
        c.recover(NOW)  # never applied blindly: adopted when Slurm shows it, else abandoned
        assert ledger.action_by_key(key).status == ("applied" if landed else "abandoned")
        c.evaluate(NOW + 1)
        c.evaluate(NOW + 2)
        assert backend.writes == ([] if landed else [("requeue", "123")])
        assert [a.status for a in ledger.series(key)] == (["applied"] if landed else ["abandoned", "applied"])
    finally:
        c.close()
        ledger.close()


def test_the_round_gauges_count_jobs_stragglers_and_hangs(tmp_path):
    with made(tmp_path, "observe") as (c, ledger, backend):
        c.reports.update(reports_of(hung_job(), spread_job("7", {"node03": 2, "node04": 2}, slow={3: 0.13},
                                                          corroborate={3: ("gpu1: hot",)})))
        c.evaluate(NOW)
        c.metrics.observe_round(c.round_figures(NOW))
        get = c.metrics.registry.get_sample_value
        assert get("healthd_controller_inband_jobs") == 2
        assert get("healthd_controller_inband_hangs") == 1
        assert get("healthd_controller_inband_straggler_ranks", {"tier": "T2"}) == 1
        assert get("healthd_controller_inband_straggler_ranks", {"tier": "T3"}) == 0


def test_a_broken_job_never_stops_the_round(tmp_path, monkeypatch):
    c, ledger, backend = make(tmp_path, "auto")
    try:
        monkeypatch.setattr(inband.progress, "stragglers", lambda *a: 1 / 0)
        c.reports.update(reports_of(spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125})))
        c.reports["node03"] = NodeReport.from_document(
            {"node": "node03", "verdict": "failed", "findings": [{
                "id": "xid:gpu0:79", "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
                "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79",
                "evidence": [{"kind": "log_line", "text": "Xid 79"}]}]}, NOW - 1)
        c.evaluate(NOW)
        assert [w[:2] for w in backend.writes] == [("drain", "node03")]
    finally:
        c.close()
        ledger.close()


# --------------------------------------------------------------------------- signed reports over HTTP


@pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")
def test_signed_reports_of_a_spread_job_make_a_straggler_finding_and_requeue_a_hang(tmp_path):
    from tests.controller.munge_support import MungeFleet
    from tests.support.controller_rig import ControllerRig

    with MungeFleet(["node01", "node02", "node03", "node04"]) as fleet:
        rig = ControllerRig(fleet, tmp_path, "auto")
        try:
            rig.backend.running["node02"] = [JobInfo(job_id="88", batch=True, comment="healthd:requeue")]
            slow = spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125})
            hung = hung_job("88")
            for node in ("node01", "node02"):
                doc = node_doc(node, [slow[node], hung[node]])
                doc["generated_at"] = time.time()
                status, answer = rig.send("/v1/report", doc, node)
                assert status == 200 and answer["accepted"], answer
            bad = node_doc("node03", [job_doc("5", [rank_doc(0, gpu=0, age=-1.0)], 1)])
            status, answer = rig.send("/v1/report", bad, "node03")
            assert status == 400 and "inband.jobs[0].ranks[0].last_step_age_s" in answer["error"]
            now = time.time()
            rig.controller.evaluate(now)
            rig.controller.evaluate(now + 1)
            assert rig.backend.writes == [("requeue", "88")]
            rows = [d for d in rig.ledger.decisions() if d.node == "node02" and d.kind == "none"]
            assert rows and "inband.straggler:gpu1" in rows[0].evidence["findings"]
            assert rig.controller.inband_round.flagged_by_tier() == {"T2": 0, "T3": 1}
        finally:
            rig.close()


def test_slow_ranks_on_one_rail_of_two_nodes_no_switch_holds_are_one_fabric_incident():
    job = spread_job("123", {"node01": 4, "node02": 4, "node03": 4, "node04": 4}, slow={3: 0.13, 15: 0.13, 9: 0.13})
    for node in ("node01", "node03", "node04"):
        for rank in job[node]["ranks"]:
            rank["rail"] = f"mlx5_{rank['local_rank']}"
    r = run(reports_of(job), groups={})
    [a], [c] = r.findings["node01"], r.findings["node04"]
    for f in (a, c):  # ranks 3 and 15: local rank 3 on two nodes, the same rail
        assert f.attribution == "fabric" and f.tier == 3 and f.action == "none"
        assert f.summary.startswith("one of 2 slow ranks of job 123 on rail mlx5_3: ")
    [b] = r.findings["node03"]  # rank 9: another rail, alone on it
    assert b.attribution == "unknown"


# --------------------------------------------------------------------------- what healthctl inband shows


def test_the_summary_places_every_rank_and_names_the_slow_and_the_behind(tmp_path, capsys):
    """The controller's in-band view as `healthctl inband` gets it: a real admin socket serving the
    summary of a real round, read by the real CLI (table and --json)."""
    from healthd.controller import healthctl
    from healthd.controller.admin import inband_handler, serve_admin_socket, DEFAULT_HANDLERS
    from tests.support.tmpdirs import shared_tmpdir

    slow = spread_job("123", {"node01": 4, "node02": 4}, slow={5: 0.125})
    reports = reports_of(slow, hung_job("77", age=50.0), at=NOW - 20)
    rnd = run(reports)
    doc = inband.summary(rnd, NOW)
    assert [j["job"] for j in doc["jobs"]] == ["77", "123"] and doc["evaluated_at"] == NOW
    j123 = doc["jobs"][1]
    assert j123["nodes"] == ["node01", "node02"] and j123["ranks_reported"] == 8 and j123["world_size"] == 8
    assert [(r["rank"], r["node"], r["gpu"]) for r in j123["ranks"]][4:6] == [(4, "node02", 0), (5, "node02", 1)]
    assert j123["ranks"][0]["last_step_age_s"] == 21.0  # the report's 1 s, and 20 s since it came
    [f] = j123["stragglers"]
    assert (f["rank"], f["node"], f["gpu"], f["tier"], f["test"], f["judged_by"]) == (5, "node02", 1, 3, "magnitude",
                                                                                     "controller")
    assert j123["hang"] is None and doc["jobs"][0]["hang"]["behind"] == [{"rank": 3, "node": "node02", "phase": "compute"}]
    assert inband.summary(rnd, NOW, job="77")["jobs"][0]["job"] == "77" and inband.summary(rnd, NOW, job="9")["jobs"] == []

    handlers = {**DEFAULT_HANDLERS, "inband": inband_handler(lambda job: inband.summary(rnd, NOW, job))}
    with shared_tmpdir("healthctl-inband-") as sockdir, Ledger(tmp_path / "ledger.db") as led, \
            serve_admin_socket(str(sockdir / "admin.sock"), led, handlers) as srv:
        assert healthctl.main(["--socket", srv.path, "inband"]) == 0
        out = capsys.readouterr().out
        assert "job 77: HUNG; 4 of 4 ranks reported from node[01-02]" in out, out
        assert "job 123: 1 slow rank(s); 8 of 8 ranks reported from node[01-02]" in out, out
        assert "slow: rank 5 on node02 gpu 1 +25.0% (magnitude, windows" in out and "in-band evidence only" in out, out
        assert "hang: job 77 hung at step 411" in out and "BEHIND" in out and "SLOW" in out, out
        assert healthctl.main(["--socket", srv.path, "--json", "inband", "--job", "123"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert [j["job"] for j in got["jobs"]] == ["123"] and got["jobs"][0]["stragglers"][0]["rank"] == 5
        assert healthctl.main(["--socket", srv.path, "inband", "--job", "x" * 65]) == 1
        assert "job: expected a job id" in capsys.readouterr().err
    # an older controller without the view: refused, one line
    with shared_tmpdir("healthctl-inband-") as sockdir, Ledger(tmp_path / "ledger2.db") as led, \
            serve_admin_socket(str(sockdir / "admin.sock"), led) as srv:
        assert healthctl.main(["--socket", srv.path, "inband"]) == 1
        assert "unknown command 'inband'" in capsys.readouterr().err
    assert healthctl.main(["--socket", str(tmp_path / "none.sock"), "inband"]) == 3
