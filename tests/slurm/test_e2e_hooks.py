"""End to end on a REAL local Slurm 22.05 cluster: healthd's three hooks (healthd-healthcheck, -prolog,
-epilog) installed through the operator wrapper slurm/healthd-hook-wrapper.sh, run by real slurmd
daemons, each node with its own `healthd run` agent against the C stand-in NVML, an InfiniBand tree and
a journal directory (tests/slurm/e2e_support.py):

1. Xid 79 on node02, gating local: the prolog refuses the job there, node02 is drained with healthd's
   own reason, the job is requeued and completes on another node.
2. Xid 13 during a job on node03: charged to the job and its user by the epilog, node03 stays idle.
3. A pending row remap on node01: after a job the epilog leaves a request for the controller and Slurm
   shows the reboot request (REBOOT_REQUESTED, next state RESUME, a healthd reason).
4. node04's agent killed: the hooks say "agent unknown", node04 is never drained, jobs still run.
5. An administrator's drain (on a node with a T1 finding and a running job, and on one with a GPU
   job): the reason stays exactly the administrator's through health checks and epilogs.
6. slurmctld stopped: the health check still exits 0 within its timeout, says Slurm is unreachable,
   and no node changes state.
7. Hostile files (node04, with a T1 finding): the state file's directory owned by nobody and the run
   directory's jobs/ a link to another directory: the hooks say the state is not trusted, the GPU job
   runs, the node is never drained, and nothing is written through the link.
8. A node-level T1 finding (node03 shows 3 of its 4 GPUs): the prolog refuses a GPU job (drain with
   healthd's reason, requeue) while a job without GPUs runs to completion on the same node.

Hostile node names and reasons and unexpected scontrol/sinfo output are covered without a cluster by
tests/slurm/test_parsers.py and tests/slurm/test_backend_contract.py (the backend) and
tests/hooks/test_scripts.py (the hooks against a fake client).

Every scenario restores the cluster when it ends (e2e.restore(): jobs cancelled, reboots cancelled, nodes
resumed, weights reset, agents running with healthy NVML values), so each can run alone:
`pytest tests/slurm/test_e2e_hooks.py -k xid13`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.slurm.e2e_support import (
    EXTRA_CONF,
    HEALTH_CHECK_INTERVAL,
    HOOK_NAMES,
    HOOK_TIMEOUT_S,
    NODES,
    REPO,
    WRAPPER_TEMPLATE,
    HooksCluster,
    job_field,
    running_cluster,
    scenario_then_restore,
    wait_for,
)

VENV_BIN = Path(sys.executable).parent
SCENARIO_LIMIT_S = 90
ADMIN_REASON = "maintenance: PSU swap"
XID79_TEXT = "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID13_TEXT = "pid=4242, name=python3, Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): Out Of Range Address"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a real Slurm cluster needs root (slurmd, mknod)")


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest, shared_slurm) -> Iterator[HooksCluster]:
    with running_cluster(request, "e2e-hooks", VENV_BIN, shared=shared_slurm) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def scenario(e2e: HooksCluster) -> Iterator[HooksCluster]:
    with scenario_then_restore(e2e, SCENARIO_LIMIT_S):
        yield e2e


def reasons_set(log: str, node: str) -> list[str]:
    """Every reason slurmctld recorded for `node` in a log excerpt (scontrol update and its own drains)."""
    out = [m.group(1) for m in re.finditer(rf"update_node: node {node} reason set to: (.*)", log)]
    out += [f"(slurmctld drain) {m.group(0)}" for m in re.finditer(rf"drain_nodes: node {node} state set to DRAIN", log)]
    return out


def wait_done_binding(node, job: str, timeout: float = 20) -> dict:
    """The epilog closed the job's binding: jobs/done/<id>.json (the epilog ran to its end)."""
    path = node.run_dir / "jobs" / "done" / f"{job}.json"
    wait_for(path.is_file, timeout, f"the epilog of job {job} on {node.name} to close its binding",
             diagnostics=node.diagnostics)
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- the installation itself


def test_cluster_runs_the_hooks_through_the_operator_wrapper(e2e: HooksCluster):
    conf = e2e.cluster.conf_path.read_text()
    settings = {line.split("=", 1)[0].lower(): line.split("=", 1)[1] for line in conf.splitlines()
                if "=" in line and not line.startswith("#")}
    for key, name in HOOK_NAMES.items():
        assert settings[key.lower()] == str(e2e.bin / name)
        assert os.readlink(e2e.bin / name) == "healthd-hook"
    assert "nohold_on_prolog_fail" in settings["schedulerparameters"].split(",")  # from SlurmCluster
    assert "Alloc" in settings["prologflags"].split(",")
    assert settings["healthchecknodestate"] == "ANY"
    assert settings["healthcheckinterval"] == str(HEALTH_CHECK_INTERVAL)
    assert EXTRA_CONF in conf
    # what slurm/slurm.conf.snippet tells an operator to set is all set here
    snippet = (REPO / "slurm" / "slurm.conf.snippet").read_text()
    keys = [line.split("=", 1)[0] for line in snippet.splitlines() if line.strip() and not line.startswith("#")]
    assert set(keys) == {"HealthCheckProgram", "HealthCheckInterval", "HealthCheckNodeState", "Prolog", "Epilog",
                         "PrologFlags", "SchedulerParameters", "RebootProgram"}
    assert all(k.lower() in settings for k in keys)
    # the wrapper slurmd runs is slurm/healthd-hook-wrapper.sh with only its three settings changed
    rendered = (e2e.bin / "healthd-hook").read_text().splitlines()
    template = WRAPPER_TEMPLATE.read_text().splitlines()
    assert len(rendered) == len(template)
    changed = [t.split("=", 1)[0] for r, t in zip(rendered, template, strict=True) if r != t]
    assert changed == ["HEALTHD_BIN", "HEALTHD_CONFIG", "HEALTHD_HOOK_LOG"]
    # slurmd ran every node's health check with only SLURMD_NODENAME: the agent is known, the idle
    # node's quick check ran and counted its 4 fake GPUs
    for name in NODES:
        node = e2e.nodes[name]
        node.wait_health_checks(1)
        checks = node.checks()
        assert checks["node"] == name and checks["agent"]["known"] is True, checks
        assert checks["active"] == "ran", checks
        gpu_count = {r["name"]: r for r in checks["results"]}["gpu_count"]
        assert gpu_count["ok"] is True and gpu_count["detail"].startswith("4 of 4 GPU device files"), gpu_count
        assert e2e.node(name)["State"] == "IDLE"


# ----------------------------------------------------------------------------- 1. Xid 79: refused job


def test_xid79_prolog_refuses_the_job_drains_with_healthds_reason_and_the_job_runs_elsewhere(e2e: HooksCluster):
    n2 = e2e.nodes["node02"]
    n2.xid(0, 79, XID79_TEXT)
    finding = n2.wait_finding(lambda f: f["id"] == "xid:gpu0:79")
    assert (finding["tier"], finding["attribution"], finding["action"]) == (1, "hardware", "drain-and-requeue")
    assert finding["component"]["bus_id"] == n2.gpus[0]["bus_id"]

    # node02 is where the scheduler goes first (lowest weight wins)
    e2e.set_weights({"node02": 1, "node01": 100, "node03": 100, "node04": 100})
    mark = e2e.ctld_mark()
    job = e2e.sbatch("--gres=gpu:4", "-N1", wrap="hostname; sleep 1")

    line = wait_for(lambda: (j := e2e.job(job)) and job_field(j, "Restarts") == "1"
                    and job_field(j, "JobState") == "PENDING" and j, 30, f"job {job} to be requeued",
                    diagnostics=lambda: e2e.diagnostics(job))
    # requeued WITHOUT the hold (nohold_on_prolog_fail), waiting for its BeginTime
    assert job_field(line, "Reason") == "BeginTime", line
    assert "held" not in line.lower()

    expected = f"healthd: {finding['summary']} [job {job}]"
    node = e2e.node("node02")
    assert "DRAIN" in node["State"].split("+"), node
    assert node["Reason"] == expected and node["ReasonUser"] == "root", node
    assert node["Reason"].startswith("healthd: xid 79 gpu0")
    assert e2e.sinfo_reasons()["node02"] == (expected, "root")
    n2.wait_line("healthd-prolog", f"refused job {job}: {expected}")
    log = e2e.ctld_since(mark)
    assert f"Prolog launch failure, JobId={job}" in log, log
    assert f"Requeuing JobId={job}" in log, log
    # the epilog of the refused launch ran too, found the T1 finding and the node drained by healthd,
    # and exited 0: the drain keeps jobs off, and slurmctld logs no epilog error
    n2.wait_line("healthd-epilog", f"already drained by healthd ({expected})")
    wait_done_binding(n2, job)
    log = e2e.ctld_since(mark)
    assert f"JobId={job} epilog error" not in log, log
    # so healthd's reason is the only one Slurm recorded (no "Prolog error", no "Epilog error")
    assert reasons_set(log, "node02") == [expected], log

    # skip the ~120 s requeue delay; the job then runs on another node and completes
    e2e.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    line = e2e.wait_job(job, ("COMPLETED",), timeout=40)
    assert job_field(line, "NodeList") in ("node01", "node03", "node04"), line
    assert job_field(line, "Restarts") == "1" and job_field(line, "ExitCode") == "0:0", line
    # node02 is still drained with the same reason after everything (prolog, epilog of the failed
    # launch, health checks) ran on it
    n2.wait_health_checks(1)
    assert e2e.node("node02")["Reason"] == expected
    assert reasons_set(e2e.ctld_since(mark), "node02") == [expected]


# ----------------------------------------------------------------------------- 2. Xid 13 during a job


def test_xid13_during_a_job_is_charged_to_the_job_and_its_user_and_drains_nothing(e2e: HooksCluster):
    n3 = e2e.nodes["node03"]
    mark = e2e.ctld_mark()
    hold = e2e.hold_file()
    job = e2e.sbatch("-w", "node03", "--gres=gpu:1", hold=hold)
    e2e.wait_job(job, ("RUNNING",))
    binding_path = n3.run_dir / "jobs" / f"{job}.json"
    binding = json.loads(wait_for(lambda: binding_path.is_file() and binding_path.read_text(), 10,
                                  f"job {job}'s binding", diagnostics=n3.diagnostics))
    assert {k: binding[k] for k in ("job", "user", "uid", "node")} == {
        "job": job, "user": "nobody", "uid": 65534, "node": "node03"}
    assert len(binding["gpus"]) == 1 and 0 <= binding["gpus"][0] < 4, binding
    gpu = binding["gpus"][0]

    n3.xid(gpu, 13, XID13_TEXT)
    finding = n3.wait_finding(lambda f: f.get("xid") == 13 and f["component"]["index"] == gpu and f.get("job") == job,
                              what=f"xid 13 on gpu{gpu} bound to job {job}")
    assert (finding["tier"], finding["attribution"]) == (3, "user")
    assert finding["component"]["serial"] == n3.gpus[gpu]["serial"]
    assert e2e.job_state(job) == "RUNNING"  # attributed while the binding was open

    e2e.release(hold)
    e2e.wait_job(job, ("COMPLETED",))
    done = wait_done_binding(n3, job)
    assert done["charged"] == [finding["id"]], done

    charges = [c for c in n3.charges() if c["job"] == job]
    assert len(charges) == 1, n3.charges()
    c = charges[0]
    assert {k: c[k] for k in ("job", "user", "node", "gpu", "xid", "finding", "serial")} == {
        "job": job, "user": "nobody", "node": "node03", "gpu": gpu, "xid": 13, "finding": finding["id"],
        "serial": n3.gpus[gpu]["serial"]}
    n3.wait_line("healthd-epilog", f"charged to job {job} (user nobody): gpu{gpu} xid 13")

    # user code is never the node's fault: idle, no reason, nothing recorded by slurmctld
    e2e.cluster.wait_idle(15, ["node03"])
    n3.wait_health_checks(1)
    node = e2e.node("node03")
    assert node["State"] == "IDLE" and "Reason" not in node, node
    assert reasons_set(e2e.ctld_since(mark), "node03") == []
    # the agent keeps the attribution after the job ended (the closed binding still covers last_seen)
    after = n3.wait_finding(lambda f: f["id"] == finding["id"])
    assert after["job"] == job


# ----------------------------------------------------------------------------- 3. pending row remap


def test_pending_row_remap_epilog_requests_a_reset_and_slurm_shows_the_reboot_request(e2e: HooksCluster):
    n1 = e2e.nodes["node01"]
    n1.set_gpu(2, **{"remapped_rows.pending": 1})
    finding = n1.wait_finding(lambda f: f["id"] == "nvml.remap_pending:gpu2")
    assert (finding["tier"], finding["action"]) == (2, "reset-gpu-when-idle")

    # two jobs: when the short one ends its epilog asks for the reboot; the long one keeps node01 busy,
    # so the reboot stays *requested* (ASAP waits for the node to be idle) and RebootProgram never runs
    keep, short = e2e.hold_file(), e2e.hold_file()
    long_job = e2e.sbatch("-w", "node01", "--gres=gpu:1", hold=keep)
    short_job = e2e.sbatch("-w", "node01", "--gres=gpu:1", hold=short)
    e2e.wait_job(long_job, ("RUNNING",))
    e2e.wait_job(short_job, ("RUNNING",))
    mark = e2e.ctld_mark()
    e2e.release(short)
    e2e.wait_job(short_job, ("COMPLETED",))
    wait_done_binding(n1, short_job)

    request_path = n1.run_dir / "requests" / "nvml.remap_pending:gpu2.json"
    assert request_path.is_file(), sorted(p.name for p in (n1.run_dir / "requests").glob("*"))
    request = json.loads(request_path.read_text())
    assert {k: request[k] for k in ("finding", "action", "node", "tier", "job", "by")} == {
        "finding": finding["id"], "action": "reset-gpu-when-idle", "node": "node01", "tier": 2,
        "job": short_job, "by": "healthd-epilog"}

    node = wait_for(lambda: (n := e2e.node("node01")) and "REBOOT_REQUESTED" in n["State"] and n, 15,
                    "node01 to show the reboot request", diagnostics=e2e.diagnostics)
    expected = f"healthd: {finding['summary']}"
    assert node["Reason"] == expected and node["ReasonUser"] == "root", node
    assert "remap" in node["Reason"]
    assert node.get("NextState") == "RESUME", node
    assert "DRAIN" in node["State"].split("+"), node  # reboot ASAP drains: no new job lands here
    assert e2e.job_state(long_job) == "RUNNING"  # ASAP does not kill the running job
    n1.wait_line("healthd-epilog", f"requested reboot ASAP of node node01: {expected}")
    log = e2e.ctld_since(mark)
    assert "reboot request queued for nodes node01" in log, log
    assert reasons_set(log, "node01") == [], log  # the drain and reason came with the reboot request itself

    # the controller's side (done by hand here): cancel the reboot; Slurm drops the drain and the
    # reason that `reboot ASAP` set
    n1.heal_nvml()
    wait_for(lambda: not any(f["id"] == finding["id"] for f in n1.findings()), 15, "the remap finding to clear",
             diagnostics=n1.diagnostics)
    e2e.run("scontrol", "cancel_reboot", "node01")
    node = e2e.node("node01")
    assert "REBOOT_REQUESTED" not in node["State"] and "DRAIN" not in node["State"], node
    assert "Reason" not in node, node
    e2e.release(keep)
    e2e.wait_job(long_job, ("COMPLETED",))
    wait_done_binding(n1, long_job)
    e2e.cluster.wait_idle(15, ["node01"])


# ----------------------------------------------------------------------------- 4. agent killed


def test_agent_killed_hooks_say_unknown_node_is_never_drained_and_jobs_still_run(e2e: HooksCluster):
    n4 = e2e.nodes["node04"]
    mark = e2e.ctld_mark()
    lines_before = len(n4.hook_lines())
    started = time.monotonic()
    pid = n4.kill_agent()
    why = f"agent unknown: agent pid {pid} is not running"

    checks = wait_for(lambda: (c := n4.checks()) and c["agent"]["known"] is False and c, 3 * HEALTH_CHECK_INTERVAL + 5,
                      "node04's health check to report the agent unknown", diagnostics=n4.diagnostics)
    assert checks["agent"]["reason"] == why, checks
    assert time.monotonic() - started < 3 * HEALTH_CHECK_INTERVAL + 5
    assert n4.wait_line("healthd-healthcheck", why, since=lines_before).startswith("healthd-healthcheck[node04]: warning: ")

    job = e2e.sbatch("-w", "node04", "--gres=gpu:1", wrap="true")
    line = e2e.wait_job(job, ("COMPLETED",))
    assert job_field(line, "NodeList") == "node04" and job_field(line, "Restarts") == "0", line
    wait_done_binding(n4, job)
    n4.wait_line("healthd-prolog", f"job {job} runs: {why}")
    n4.wait_line("healthd-epilog", f"{why}: findings are not attributed to this job")

    n4.wait_health_checks(2)
    node = e2e.node("node04")
    assert node["State"] == "IDLE" and "Reason" not in node, node
    assert reasons_set(e2e.ctld_since(mark), "node04") == []  # never drained, not even for a moment
    assert n4.checks()["agent"]["known"] is False


# ----------------------------------------------------------------------------- 5. an administrator's drain


def test_admin_drain_reason_survives_health_checks_and_epilogs(e2e: HooksCluster):
    n2, n3 = e2e.nodes["node02"], e2e.nodes["node03"]
    # node02 has a T1 hardware fault (the epilog would drain it) ...
    n2.xid(0, 79, XID79_TEXT)
    n2.wait_finding(lambda f: f["id"] == "xid:gpu0:79" and f["tier"] == 1)
    # ... and runs a job that holds no GPU (the prolog cannot name its GPUs, so it runs); node03 runs a GPU job
    hold2, hold3 = e2e.hold_file(), e2e.hold_file()
    j2 = e2e.sbatch("-w", "node02", hold=hold2)
    j3 = e2e.sbatch("-w", "node03", "--gres=gpu:1", hold=hold3)
    e2e.wait_job(j2, ("RUNNING",))
    e2e.wait_job(j3, ("RUNNING",))
    n2.wait_line("healthd-prolog", f"job {j2} runs: GPU list unknown")

    mark = e2e.ctld_mark()
    for name in ("node02", "node03"):
        e2e.run("scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={ADMIN_REASON}")
    seen: list[tuple[str, str, str]] = []

    def record(when: str) -> None:
        for name in ("node02", "node03"):
            info = e2e.node(name)
            seen.append((when, name, info.get("Reason", "")))
            assert "DRAIN" in info["State"].split("+"), (when, info)

    record("drained while busy")
    n2.wait_health_checks(2)
    n3.wait_health_checks(2)
    record("after health checks on the busy nodes")

    e2e.release(hold2)
    e2e.release(hold3)
    e2e.wait_job(j2, ("COMPLETED",))
    e2e.wait_job(j3, ("COMPLETED",))
    wait_done_binding(n2, j2)
    wait_done_binding(n3, j3)
    record("after the epilogs")
    n2.wait_line("healthd-epilog", f"already drained by someone else ({ADMIN_REASON}); their reason stays")
    n2.wait_line("healthd-epilog", f"node drained for a T1 hardware finding: healthd: xid 79 gpu0: fell off the bus [job {j2}]")
    assert f"JobId={j2} epilog error" not in e2e.ctld_since(mark)  # the epilog exits 0: the drain is enough

    n2.wait_health_checks(2)
    n3.wait_health_checks(2)
    record("after health checks on the idle drained nodes")
    assert {r for _, _, r in seen} == {ADMIN_REASON}, seen
    for name in ("node02", "node03"):
        info = e2e.node(name)
        assert info["State"] == "IDLE+DRAIN" and info["ReasonUser"] == "root", info
        assert e2e.sinfo_reasons()[name] == (ADMIN_REASON, "root")
        # the administrator's update is the only reason Slurm recorded; no resume, no rewrite
        assert reasons_set(e2e.ctld_since(mark), name) == [ADMIN_REASON], e2e.ctld_since(mark)
    assert "State=RESUME" not in e2e.ctld_since(mark)


# ----------------------------------------------------------------------------- 6. slurmctld down


def hook_env(node: str, job: str, gpus: str, context: str) -> dict[str, str]:
    """What slurmd 22.05 gives a Prolog/Epilog, trimmed to what the hooks read."""
    return {"SLURMD_NODENAME": node, "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_USER": "nobody",
            "SLURM_JOB_UID": "65534", "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus,
            "SLURM_SCRIPT_CONTEXT": context, "SLURM_CLUSTER_NAME": "healthd"}


def test_slurmctld_down_hooks_exit_in_time_say_unreachable_and_drain_nothing(e2e: HooksCluster):
    """slurmd runs no health check while slurmctld is down (slurmctld triggers each run with a
    REQUEST_HEALTH_CHECK: all four nodes' runs start within the same few ms, and none starts during an
    outage), and it runs an Epilog only when slurmctld tells it the job is over. So the hooks meet a
    dead slurmctld when a run was already under way, or when slurmctld is overloaded. Here they are run
    exactly as slurmd runs them (the installed wrapper, slurmd's environment) against the real, stopped
    slurmctld, node01 carrying a T1 hardware finding that would make the prolog and epilog drain."""
    n1 = e2e.nodes["node01"]
    n1.set_gpu(1, lost=1)
    lost = n1.wait_finding(lambda f: f["id"] == "nvml.lost:gpu1" and f["tier"] == 1)
    assert lost["attribution"] == "hardware"
    before = {name: e2e.node(name) for name in NODES}
    assert all(b["State"] == "IDLE" and "Reason" not in b for b in before.values()), before
    counts = {name: len(e2e.nodes[name].hook_lines()) for name in NODES}
    mark = e2e.ctld_mark()
    e2e.cluster.stop_ctld()
    try:
        runs = {
            "healthcheck node02": ([e2e.hooks["HealthCheckProgram"]], {"SLURMD_NODENAME": "node02"}),
            "prolog node01": ([e2e.hooks["Prolog"]], hook_env("node01", "990001", "1", "prolog_slurmd")),
            "epilog node01": ([e2e.hooks["Epilog"]], hook_env("node01", "990002", "1", "epilog_slurmd")),
        }
        started = time.monotonic()
        procs = {name: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, (argv, env) in runs.items()}
        results = {}
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=HOOK_TIMEOUT_S + 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            results[name] = (proc.returncode, time.monotonic() - started, out + err)
        for name, (rc, took, output) in results.items():
            assert rc == 0, (name, rc, output)
            # each hook's own deadline, not the Slurm client's retries (`sinfo --json` took 9 s here)
            assert took < HOOK_TIMEOUT_S + 1.5, (name, took)

        hc = e2e.nodes["node02"].hook_lines()[counts["node02"]:]
        assert any("active checks skipped: Slurm unreachable" in x for x in hc), hc
        checks = e2e.nodes["node02"].checks()
        assert checks["active"].startswith("skipped: Slurm unreachable"), checks
        assert checks["agent"]["known"] is True  # the agent is fine; only Slurm is away

        new = n1.hook_lines()[counts["node01"]:]
        prolog = [x for x in new if x.startswith("healthd-prolog[node01]")]
        epilog = [x for x in new if x.startswith("healthd-epilog[node01]")]
        assert any("cannot read node node01 from Slurm" in x for x in prolog), prolog
        assert any(f"job 990001 runs although {lost['summary']}" in x for x in prolog), prolog
        assert any(f"the node could not be drained although {lost['summary']}" in x for x in epilog), epilog
    finally:
        e2e.cluster.start_ctld()
        # job 990001 never existed for slurmd, so no epilog closes its binding; an open binding makes
        # node01's health check treat the node as busy (until it closes it as an orphan after 60 s)
        (n1.run_dir / "jobs" / "990001.json").unlink(missing_ok=True)
    e2e.cluster.wait_idle(30)
    for name in NODES:
        after = e2e.node(name)
        assert after["State"] == "IDLE" and "Reason" not in after, after
    assert e2e.sinfo_reasons() == {}
    log = e2e.ctld_since(mark)
    assert all(reasons_set(log, name) == [] for name in NODES), log
    # once slurmctld answers again, the health checks it triggers run their active checks again
    n2 = e2e.nodes["node02"]
    wait_for(lambda: (n2.checks() or {}).get("active") == "ran", 3 * HEALTH_CHECK_INTERVAL + 10,
             "node02's active checks to run again", diagnostics=n2.diagnostics)


# ----------------------------------------------------------------------------- 7. hostile files


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"dir" for p in sorted(d.rglob("*"))}


def test_untrusted_state_and_a_linked_jobs_directory_the_job_runs_nothing_drained_nothing_written(e2e: HooksCluster):
    n4 = e2e.nodes["node04"]
    n4.set_gpu(1, lost=1)
    lost = n4.wait_finding(lambda f: f["id"] == "nvml.lost:gpu1" and f["tier"] == 1)
    assert lost["attribution"] == "hardware"  # with a trusted state, a GPU job here would be refused
    state_dir = n4.state_file.parent
    jobs, saved = n4.run_dir / "jobs", n4.run_dir / "jobs.saved"
    decoy = Path(tempfile.mkdtemp(prefix="decoy-", dir=e2e.root))
    decoy.chmod(0o755)
    (decoy / "keep.txt").write_text("untouched\n")
    before = tree(decoy)
    mark = e2e.ctld_mark()
    since = {hook: len(n4.hook_lines(hook)) for hook in ("healthd-prolog", "healthd-epilog", "healthd-healthcheck")}
    os.chown(state_dir, 65534, 65534)  # the agent (root) still writes there; the hooks must not believe it
    if jobs.exists():
        jobs.rename(saved)
    jobs.symlink_to(decoy)
    try:
        why = f"agent unknown: state file refused: directory {state_dir} is not trusted (owner uid 65534, mode "
        checks = wait_for(lambda: (c := n4.checks()) and c["agent"]["known"] is False and c, 3 * HEALTH_CHECK_INTERVAL + 5,
                          "node04's health check to refuse the state", diagnostics=n4.diagnostics)
        assert checks["agent"]["reason"].startswith(why), checks
        job = e2e.sbatch("-w", "node04", "--gres=gpu:4", wrap="true")
        line = e2e.wait_job(job, ("COMPLETED",))
        assert job_field(line, "NodeList") == "node04" and job_field(line, "Restarts") == "0", line
        assert why in n4.wait_line("healthd-prolog", f"job {job} runs: ", since=since["healthd-prolog"])
        n4.wait_line("healthd-prolog", f"job {job}: cannot record the GPU binding: directory {jobs} is a symbolic link",
                     since=since["healthd-prolog"])
        assert why in n4.wait_line("healthd-epilog", "findings are not attributed to this job", since=since["healthd-epilog"])
        n4.wait_line("healthd-epilog", f"job {job}: binding unusable (", since=since["healthd-epilog"])
        n4.wait_health_checks(1)
        node = e2e.node("node04")
        assert node["State"] == "IDLE" and "Reason" not in node, node
        assert reasons_set(e2e.ctld_since(mark), "node04") == []
        assert tree(decoy) == before  # nothing written, moved or removed through the link
    finally:
        os.chown(state_dir, 0, 0)
        jobs.unlink(missing_ok=True)
        if saved.exists():
            saved.rename(jobs)
    n4.wait_line("healthd-healthcheck", "agent alive", since=since["healthd-healthcheck"], timeout=3 * HEALTH_CHECK_INTERVAL + 5)


# ----------------------------------------------------------------------------- 8. node-level T1 finding


def test_node_level_t1_finding_refuses_a_gpu_job_and_runs_a_job_without_gpus(e2e: HooksCluster):
    n3 = e2e.nodes["node03"]
    n3.gpus = n3.gpus[:3]  # NVML enumerates 3 of the 4 GPUs slurmd still schedules
    n3.write_nvml()
    found = n3.wait_finding(lambda f: f["id"] == "nvml.gpu_count:node")
    assert (found["tier"], found["attribution"], found["action"]) == (1, "hardware", "drain")
    assert found["component"]["kind"] == "node" and found["component"]["index"] is None

    hold = e2e.hold_file()
    cpu_job = e2e.sbatch("-w", "node03", hold=hold)  # no --gres: slurmd gives its prolog no GPU variable
    e2e.wait_job(cpu_job, ("RUNNING",))
    n3.wait_line("healthd-prolog", f"job {cpu_job} runs: GPU list unknown")

    mark = e2e.ctld_mark()
    gpu_job = e2e.sbatch("-w", "node03", "--gres=gpu:1", wrap="true")
    expected = f"healthd: {found['summary']} [job {gpu_job}]"
    wait_for(lambda: (j := e2e.job(gpu_job)) and job_field(j, "Restarts") == "1" and j, 30,
             f"job {gpu_job} to be requeued", diagnostics=lambda: e2e.diagnostics(gpu_job))
    n3.wait_line("healthd-prolog", f"refused job {gpu_job}: {expected}")
    node = e2e.node("node03")
    assert "DRAIN" in node["State"].split("+") and node["Reason"] == expected, node
    assert f"Prolog launch failure, JobId={gpu_job}" in e2e.ctld_since(mark)

    assert e2e.job_state(cpu_job) == "RUNNING"  # the drain lets the running job finish
    e2e.release(hold)
    line = e2e.wait_job(cpu_job, ("COMPLETED",))
    assert job_field(line, "Restarts") == "0" and job_field(line, "ExitCode") == "0:0", line
    wait_done_binding(n3, cpu_job)
    assert e2e.node("node03")["Reason"] == expected  # healthd's first reason stays
