"""Reliability of healthd-controller, each an automated test on the real cluster.

Every test runs the controller as a REAL subprocess (`.venv/bin/healthd-controller --config FILE
--interval 0.5`) against a real local Slurm cluster (tests/support/slurm_cluster.py, node01..node04)
and real per-node munged daemons (tests/controller/munge_support.py), and asserts on real state:
`scontrol show node` and the controller's SQLite ledger.

1. controller killed between "action planned in the ledger" and "Slurm write done" (write never
   happened / write happened but was not recorded), restarted: no duplicate, no lost action;
   1b. the same crash between the drain and the requeue of a drain-and-requeue: recovery finishes the requeue;
2. slurmctld away for 60 s: the controller lives, skips rounds, applies nothing stale afterwards;
3. an agent restart (same finding re-reported, signed anew), across a controller restart: one incident;
4. forged (401), tampered (401), replayed (409) and cross-node (403) reports change nothing;
5. an administrator's drain is never resumed or rewritten (report, healthctl undo, healthctl repaired);
6. observe mode changes nothing in Slurm and records its decisions.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import time
from pathlib import Path

import pytest

from healthd.envelope import sign_report
from tests.controller.munge_support import munged_path
from tests.controller.reliability_support import (
    ControllerProc,
    finding,
    kill_group,
    node_snapshot,
    node_view,
    report_doc,
    reset_nodes,
    signed,
    wait_until,
    write_scontrol_wrapper,
)
from tests.support.tmpdirs import shared_tmpdir

NODES = ["node01", "node02", "node03", "node04"]
OUTAGE_S = 60.0

pytestmark = pytest.mark.skipif(
    munged_path() is None or shutil.which("slurmctld") is None or shutil.which("slurmd") is None
    or not (Path(__file__).resolve().parents[2] / ".venv" / "bin" / "healthd-controller").exists(),
    reason="needs munged, slurmctld, slurmd and .venv/bin/healthd-controller",
)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def workdir():
    with shared_tmpdir("hdrel-") as d:  # short path: the admin unix socket lives here
        yield d


@pytest.fixture
def controllers(cluster, fleet):
    """Factory of ControllerProc; every one is stopped by its PID at teardown."""
    made: list[ControllerProc] = []

    def make(workdir: Path, **kw) -> ControllerProc:
        proc = ControllerProc(workdir, cluster, fleet, **kw)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.stop()


@pytest.fixture(autouse=True)
def clean_nodes(cluster):
    """Every test starts and ends with node01..node04 idle, no drain, no reason."""
    reset_nodes(cluster)
    yield
    reset_nodes(cluster)


def _drain_kinds(rows):
    return [r for r in rows if r["kind"] in ("drain", "drain-and-requeue", "reboot-asap")]


def _epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


# ------------------------------------------------------------------------------------ 1. crash mid-action


@pytest.mark.parametrize("write_landed", [False, True], ids=["write-never-happened", "write-happened-unrecorded"])
def test_controller_killed_mid_action_restart_applies_exactly_once(cluster, fleet, workdir, controllers, write_landed):
    node = "node02"
    wrap_dir = workdir / "wrap"
    files = write_scontrol_wrapper(wrap_dir, write_first=write_landed)
    ctl = controllers(workdir, mode="auto")
    wrapper_pid = None
    try:
        ctl.start(path_prefix=str(wrap_dir))
        status, body = ctl.post(signed(fleet, node, [finding()]))
        assert status == 200 and body["accepted"] is True, body
        wait_until(lambda: files["marker"].exists(), 30, "the controller's drain to reach scontrol")
        wrapper_pid = int(files["pid"].read_text())
        ctl.kill()  # crash: between "planned" and "Slurm write done"
        assert not ctl.alive()
    finally:
        if wrapper_pid is None and files["pid"].exists():
            wrapper_pid = int(files["pid"].read_text())
        if wrapper_pid is not None:
            kill_group(wrapper_pid)  # the held scontrol (its own process group) dies with its write undone

    # what the crash left: one planned row in the ledger
    (planned,) = ctl.actions(node)
    assert planned["status"] == "planned", planned
    assert "State=DRAIN" in planned["argv"]
    incident = ctl.incidents(node)[0]["id"]
    shown = node_view(cluster, node)
    if write_landed:
        assert files["rc"].read_text().strip() == "0"
        assert "DRAIN" in shown["State"] and shown["Reason"].startswith("healthd:"), shown
        written_at = shown["ReasonTime"]
        # ReasonTime has whole seconds: once the clock is past it, a second write would show a later one
        wait_until(lambda: time.strftime("%Y-%m-%dT%H:%M:%S") > written_at, 5, "the clock to pass the drain's ReasonTime",
                   interval=0.05)
    else:
        assert "DRAIN" not in shown["State"] and not shown.get("Reason"), shown

    # restart without the wrapper: start-up recovery settles the plan against Slurm, never applies it blindly
    ctl.start()
    wait_until(lambda: ctl.actions(node)[0]["status"] != "planned", 30, "recovery to settle the planned action")
    first = ctl.actions(node)[0]
    assert first["id"] == planned["id"] and first["idempotency_key"] == planned["idempotency_key"]
    if write_landed:
        assert first["status"] == "applied" and first["outcome"].startswith("adopted"), first
    else:
        assert first["status"] == "abandoned" and "re-decides" in first["outcome"], first
        assert "DRAIN" not in node_view(cluster, node)["State"]
        # the agent's next report: re-decided from current evidence through every gate, a second attempt
        status, body = ctl.post(signed(fleet, node, [finding()]))
        assert status == 200, body
        wait_until(lambda: [a for a in ctl.actions(node) if a["status"] == "applied"], 30, "the re-decided drain")
        second = ctl.actions(node)[1]
        assert second["idempotency_key"] == f"{planned['idempotency_key']}#try2" and second["status"] == "applied"
    after = node_view(cluster, node)
    assert "DRAIN" in after["State"], after
    assert after["Reason"].startswith("healthd: ") and f"[#{incident}]" in after["Reason"], after
    if write_landed:
        assert after["ReasonTime"] == written_at, "the drain was written a second time at recovery"
    assert "recover: action" in ctl.log_text()

    # the agent keeps reporting the same fault: more rounds, still one action, one drain decision
    status, body = ctl.post(signed(fleet, node, [finding()]))
    assert status == 200, body
    ctl.wait_rounds(6)
    assert [a["status"] for a in ctl.actions(node)] == (["applied"] if write_landed else ["abandoned", "applied"])
    assert len(_drain_kinds(ctl.decisions(node))) == (1 if write_landed else 2), ctl.decisions(node)
    assert len(ctl.incidents(node)) == 1
    assert node_view(cluster, node) == after
    assert ctl.alive()


# ------------------------------------------------------------------------------------ 2. slurmctld outage


def test_slurmctld_outage_60s_controller_survives_and_applies_nothing_stale(cluster, fleet, workdir, controllers):
    node = "node02"
    ctl = controllers(workdir, mode="auto", policy={"report_ttl_s": 20.0})
    ctl.start()
    ctl.wait_rounds(2)
    before = node_snapshot(cluster)
    cluster.stop_ctld()
    try:
        outage_start = time.monotonic()
        status, body = ctl.post(signed(fleet, node, [finding()]))  # arrives while Slurm is away
        assert status == 200 and body["accepted"] is True, body
        while time.monotonic() - outage_start < OUTAGE_S:
            assert ctl.alive(), f"controller died during the outage:\n{ctl.log_text()[-3000:]}"
            time.sleep(1.0)
        assert ctl.alive()
    finally:
        cluster.start_ctld()
    skipped = ctl.log_text().count("Slurm unreachable, skipping this round")
    assert skipped >= 2, ctl.log_text()[-3000:]
    assert ctl.actions() == [] and _drain_kinds(ctl.decisions()) == []

    # back: the report from the outage is older than report_ttl_s: recorded as stale, never applied
    def stale_recorded():
        return [d for d in ctl.decisions(node) if (d["evidence"] or {}).get("decision") == f"none:{node}:stale-report"]

    wait_until(stale_recorded, 60, "a round after slurmctld came back")
    ctl.wait_rounds(4)
    assert ctl.actions() == [], ctl.actions()
    assert _drain_kinds(ctl.decisions()) == [], ctl.decisions()
    after = node_snapshot(cluster)
    assert after[node]["Reason"] == "" and "DRAIN" not in after[node]["State"], after
    assert {n: s["Reason"] for n, s in after.items()} == {n: s["Reason"] for n, s in before.items()}
    assert ctl.alive()

    # a fresh report after the return does drain
    status, body = ctl.post(signed(fleet, node, [finding()]))
    assert status == 200, body
    wait_until(lambda: [a for a in ctl.actions(node) if a["status"] == "applied"], 30, "the fresh report's drain")
    (action,) = ctl.actions(node)
    shown = node_view(cluster, node)
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith("healthd: "), shown
    assert f"[#{ctl.incidents(node)[0]['id']}]" in shown["Reason"]


# ------------------------------------------------------------------------------------ 3. agent restart


def test_agent_restart_same_finding_keeps_one_incident_across_controller_restart(cluster, fleet, workdir, controllers):
    node = "node01"
    first_seen = time.time() - 30
    ctl = controllers(workdir, mode="auto")
    ctl.start()
    status, body = ctl.post(signed(fleet, node, [finding(first_seen=first_seen)]))
    assert status == 200, body
    wait_until(lambda: [a for a in ctl.actions(node) if a["status"] == "applied"], 30, "the drain")
    (incident,) = ctl.incidents(node)
    assert incident["first_evidence_at"] == pytest.approx(first_seen, abs=0.01)
    drained = node_view(cluster, node)

    # the agent restarts: same finding (id, first_seen), a new report signed anew
    for _ in range(2):
        status, body = ctl.post(signed(fleet, node, [finding(first_seen=first_seen)]))
        assert status == 200, body
        ctl.wait_rounds(3)
    assert ctl.incidents(node) == [incident]

    # the controller restarts too (SIGTERM, clean stop), then the agent reports again
    assert ctl.stop() == 0, ctl.log_text()[-3000:]
    ctl.start()
    status, body = ctl.post(signed(fleet, node, [finding(first_seen=first_seen)]))
    assert status == 200, body
    ctl.wait_rounds(6)
    assert ctl.incidents(node) == [incident], ctl.incidents(node)
    assert len(ctl.ledger_rows("SELECT * FROM findings WHERE node = ?", (node,))) == 1
    assert len(ctl.actions(node)) == 1, ctl.actions(node)
    assert len(_drain_kinds(ctl.decisions(node))) == 1, ctl.decisions(node)
    assert {d["incident_id"] for d in ctl.decisions(node)} == {incident["id"]}
    assert node_view(cluster, node) == drained


# ------------------------------------------------------------------------------------ 4. bad reports


def test_forged_tampered_replayed_and_cross_node_reports_change_nothing(cluster, fleet, workdir, controllers):
    ctl = controllers(workdir, mode="auto")
    ctl.start()
    ctl.wait_rounds(2)
    before = node_snapshot(cluster)
    t1 = [finding()]

    # forged: a credential no munged made
    forged = json.dumps({"healthd_report": 1, "node": "node01", "report": report_doc("node01", t1),
                         "credential": "MUNGE:AwQFAAAgarbagegarbagegarbagegarbagegarbagegarbage=:"}).encode()
    status, body = ctl.post(forged)
    assert status == 401 and body["accepted"] is False, body

    # tampered: node01's real credential for a healthy report, with a T1 report put in its place
    genuine = json.loads(signed(fleet, "node01"))
    genuine["report"] = report_doc("node01", t1)
    status, body = ctl.post(json.dumps(genuine).encode())
    assert status == 401 and body["accepted"] is False, body

    # replayed: the same body twice (a healthy report, so the first, accepted one changes nothing)
    once = signed(fleet, "node04")
    assert ctl.post(once)[0] == 200
    status, body = ctl.post(once)
    assert status == 409 and body["accepted"] is False, body

    # cross-node: node02's munged signs a T1 report that claims to be node03's
    status, body = ctl.post(sign_report(report_doc("node03", t1), "node03", fleet.socket("node02")))
    assert status == 403 and body["accepted"] is False, body

    ctl.wait_rounds(6)
    assert node_snapshot(cluster) == before
    assert ctl.actions() == [] and ctl.decisions() == [] and ctl.incidents() == []
    log = ctl.log_text()
    for code in ("401", "409", "403"):
        assert f"refused: {code} " in log, log[-3000:]
    assert ctl.alive()


# ------------------------------------------------------------------------------------ 5. admin's drain


def test_admin_drain_is_never_resumed_or_rewritten(cluster, fleet, workdir, controllers):
    admin_reason = "admin: bad fan"
    cluster.run(["scontrol", "update", "NodeName=node03", "State=DRAIN", f"Reason={admin_reason}"], timeout=15,
                check=True)
    admin03 = node_view(cluster, "node03")
    assert admin03["Reason"] == admin_reason and "DRAIN" in admin03["State"], admin03
    # two failing nodes of four would open the breaker: this test is about ownership, not the breaker
    ctl = controllers(workdir, mode="auto", policy={"breaker_min_nodes": 3})
    ctl.start()

    # a T1 report for the admin-drained node03 (refused by ownership) and for node04 (drained by healthd)
    for node in ("node03", "node04"):
        status, body = ctl.post(signed(fleet, node, [finding()]))
        assert status == 200, body
    wait_until(lambda: [a for a in ctl.actions("node04") if a["status"] == "applied"], 30, "node04's drain")
    wait_until(lambda: ctl.decisions("node03"), 30, "node03's decision")
    (healthd_drain,) = ctl.actions("node04")

    # an administrator takes node04 over: the reconciler records the hand-over; an operator's undo is refused
    took_over = "admin: replacing gpu0"
    cluster.run(["scontrol", "update", "NodeName=node04", "State=DRAIN", f"Reason={took_over}"], timeout=15,
                check=True)
    admin04 = node_view(cluster, "node04")
    wait_until(lambda: ctl.actions("node04")[0]["status"] == "released", 30, "the hand-over to be recorded")
    assert took_over in ctl.actions("node04")[0]["outcome"]
    undo = ctl.healthctl("undo", str(healthd_drain["id"]), "--why", "false alarm")
    assert undo.returncode != 0 and "released" in undo.stderr, undo
    repaired = ctl.healthctl("repaired", "node03", "--why", "fan replaced")
    assert repaired.returncode != 0 and "not drained by healthd" in repaired.stderr, repaired
    bogus = ctl.healthctl("undo", "9999", "--why", "resume node03")
    assert bogus.returncode != 0, bogus
    ctl.wait_rounds(6)

    assert node_view(cluster, "node03") == admin03, "the administrator's drain of node03 was touched"
    assert node_view(cluster, "node04") == admin04, "the administrator's reason on node04 was touched"
    assert ctl.actions("node03") == []
    refusals = ctl.decisions("node03")
    assert refusals and all(d["outcome"] == "refused" and d["refused_gate"] == "ownership" for d in refusals), refusals
    assert admin_reason in refusals[0]["refused_reason"]
    assert [a["status"] for a in ctl.actions("node04")] == ["released"]
    assert [i["status"] for i in ctl.incidents("node04")] == ["handed-over"]
    assert ctl.alive()


# ------------------------------------------------------------------------------------ 6. observe


def test_observe_mode_changes_nothing_and_records_decisions(cluster, fleet, workdir, controllers):
    ctl = controllers(workdir, mode="observe")
    ctl.start()
    ctl.wait_rounds(2)
    before = node_snapshot(cluster)
    for node in ("node01", "node02"):
        status, body = ctl.post(signed(fleet, node, [finding()]))
        assert status == 200, body
    wait_until(lambda: ctl.decisions("node01") and ctl.decisions("node02"), 30, "decisions for both nodes")
    ctl.wait_rounds(8)
    assert node_snapshot(cluster) == before
    assert ctl.actions() == []
    for node in ("node01", "node02"):
        rows = ctl.decisions(node)
        assert len(rows) == 1, rows  # recorded once, not once per round
        assert rows[0]["kind"] == "drain-and-requeue" and rows[0]["mode"] == "observe", rows
        assert rows[0]["outcome"] == "refused" and rows[0]["refused_gate"] == "mode", rows
        assert len(ctl.incidents(node)) == 1
    assert ctl.stop() == 0


# ------------------------------------------------------------------------------------ 1b. crash inside drain-and-requeue


def test_crash_between_drain_and_requeue_still_requeues_the_opted_in_job(cluster, fleet, workdir, controllers):
    node = "node02"
    out = cluster.run(["sbatch", "--parsable", "-w", node, "--comment", "healthd:requeue please", "--requeue",
                       "-o", "/dev/null", "--wrap", "sleep 300"], check=True).stdout
    job = out.strip().split(";")[0]
    wrap_dir = workdir / "wrap"
    files = write_scontrol_wrapper(wrap_dir, write_first=True)
    ctl = controllers(workdir, mode="auto")
    wrapper_pid = None
    try:
        wait_until(lambda: job in cluster.run(["squeue", "-h", "-t", "R", "-w", node, "-o", "%i"]).stdout.split(),
                   30, f"job {job} to run on {node}")
        ctl.start(path_prefix=str(wrap_dir))
        status, body = ctl.post(signed(fleet, node, [finding(action="drain-and-requeue")]))
        assert status == 200, body
        wait_until(lambda: files["marker"].exists(), 30, "the drain to reach scontrol")
        wrapper_pid = int(files["pid"].read_text())
        ctl.kill()  # the drain landed; the requeue that follows it never ran
        kill_group(wrapper_pid)
        assert "DRAIN" in node_view(cluster, node)["State"]
        assert "Restarts=0" in cluster.run(["scontrol", "show", "job", job], check=True).stdout

        ctl.start()
        wait_until(lambda: ctl.actions(node)[0]["status"] != "planned", 30, "recovery")
        action = ctl.actions(node)[0]
        assert action["status"] == "applied" and action["kind"] == "drain-and-requeue", action
        wait_until(lambda: len(ctl.actions(node)) > 1, 30, "the requeue the crash cut off")
        ctl.wait_rounds(4)
        shown = cluster.run(["scontrol", "show", "job", job], check=True).stdout
        assert "Restarts=1" in shown, f"opted-in job {job} was not requeued after recovery: {ctl.actions(node)!r}"
        assert [(a["kind"], a["status"]) for a in ctl.actions(node)] == [("drain-and-requeue", "applied"),
                                                                         ("requeue", "applied")]
    finally:
        if wrapper_pid is None and files["pid"].exists():
            wrapper_pid = int(files["pid"].read_text())
        if wrapper_pid is not None:
            kill_group(wrapper_pid)
        ctl.stop()
        cluster.run(["scancel", job], timeout=15)
        wait_until(lambda: job not in cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split(), 30,
                   f"job {job} to end")
