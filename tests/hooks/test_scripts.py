"""The installed console scripts as slurmd runs them: a subprocess with slurmd's exact environment
(HealthCheckProgram: only SLURMD_NODENAME; Prolog/Epilog: the variables slurmd 22.05 sets), a crafted
state file, and a fake 22.05 `scontrol`/`sinfo` found through `hooks.path` from the config."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hooks.support import BIN, Node, finding, prolog_would_refuse, state_doc
from tests.support.hook_log import hook_lines


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")


# --------------------------------------------------------------------------- prolog


def test_prolog_records_the_binding_and_runs_the_job(node):
    node.write_state(state_doc(findings=[finding("xid:gpu3:79", 3)]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    b = json.loads((node.run_dir / "jobs/7.json").read_text())
    assert {k: b[k] for k in ("job", "user", "uid", "node", "gpus")} == {
        "job": "7", "user": "alice", "uid": 1000, "node": "node01", "gpus": [0, 1]}
    assert abs(time.time() - __import__("datetime").datetime.fromisoformat(b["start"]).timestamp()) < 30
    assert "job 7 runs: no finding on GPUs 0,1" in err
    assert node.calls() == []  # nothing to refuse: Slurm is not asked anything


def test_prolog_gating_off_only_says_what_it_would_refuse(node):
    node.write_state(state_doc(findings=[T1_GPU1]))
    prolog_would_refuse(node, "8", "1", "xid 79 gpu1: fell off the bus")


def test_prolog_gating_local_drains_with_its_own_reason_then_refuses(node):
    node.write_config(gating="local")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="9", gpus="0,1"))
    assert rc == 1, err
    assert node.writes() == [["update", "NodeName=node01", "State=DRAIN", "Reason=healthd: xid 79 gpu1: fell off the bus [job 9]"]]
    assert node.slurm_node()["reason"] == "healthd: xid 79 gpu1: fell off the bus [job 9]"
    assert "refused job 9" in err
    calls = node.calls()
    assert calls and all(c["slurm_conf"] == str(node.slurm_conf) for c in calls)  # never without SLURM_CONF
    assert all(c["path"].startswith(str(node.fakebin)) for c in calls)


def test_prolog_keeps_the_first_healthd_reason(node):
    node.write_config(gating="local")
    node.set_slurm(state="idle", flags=["DRAIN"], reason="healthd: xid 48 gpu0: DBE [job 3]", user="root")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="10", gpus="1"))
    assert rc == 1 and node.writes() == []
    assert node.slurm_node()["reason"] == "healthd: xid 48 gpu0: DBE [job 3]"
    assert "the first reason stays" in err


def test_prolog_never_overwrites_someone_elses_reason(node):
    node.write_config(gating="local")
    node.set_slurm(state="idle", flags=["DRAIN"], reason="admin: swapping PSU", user="bob")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="11", gpus="1"))
    assert rc == 1 and node.writes() == []  # drained by someone else: Slurm keeps their reason
    assert node.slurm_node()["reason"] == "admin: swapping PSU"

    # resumed: Slurm 24.11 still shows the old reason on the node, IDLE again, until it runs a job. A
    # reason outside DRAIN, DOWN or FAIL is history, not someone's drain: the prolog drains with its own
    node.set_slurm(state="idle", reason="admin: swapping PSU", user="bob")
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="12", gpus="1"))
    assert rc == 1 and node.slurm_node()["reason"] == "healthd: xid 79 gpu1: fell off the bus [job 12]"


def test_prolog_runs_the_job_when_slurm_is_unreachable(node):
    node.write_config(gating="local")
    node.set_slurm(mode="unreachable")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="13", gpus="1"))
    assert rc == 0
    assert "cannot read node node01 from Slurm" in err and "Unable to contact slurm controller" in err
    assert "job 13 runs although xid 79 gpu1: fell off the bus" in err


def test_prolog_hard_timeout_on_a_hung_slurm_call(node):
    node.write_config(gating="local", timeout_s=1.5)
    node.set_slurm(mode="hang")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, wall = node.run("healthd-prolog", node.prolog_env(job="14", gpus="1"))
    assert rc == 0, err
    assert wall < 1.5 + 2.0, wall
    assert "job 14 runs although" in err or "timed out" in err


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "is missing"),
        ('{"node": "node01", "verdict": "failed", "generated_at": "2026-11-29T10:25:38.728+00:00", "findings": [{"id"', "unparsable (truncated?)"),
        (b"\xff\xfe garbage", "unparsable"),
    ],
)
def test_prolog_with_missing_or_truncated_state_runs_the_job(node, content, why):
    node.write_config(gating="local")
    if content is not None:
        node.write_state(content)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="15"))
    assert rc == 0 and "job 15 runs: agent unknown: " in err and why in err
    assert node.calls() == []
    assert (node.run_dir / "jobs/15.json").exists()  # the binding is still recorded


def test_prolog_with_a_stale_state_or_a_dead_agent_never_refuses(node):
    node.write_config(gating="local")
    node.write_state(state_doc(findings=[T1_GPU1], age_s=120))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="16", gpus="1"))
    # the age is read when the hook runs: a loaded machine adds a second or more after the write
    assert rc == 0 and re.search(r"agent unknown: state is 1[2-3]\ds old", err), err
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    node.write_state(state_doc(findings=[T1_GPU1], pid=dead))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="17", gpus="1"))
    assert rc == 0 and f"agent unknown: agent pid {dead} is not running" in err
    assert node.calls() == []


def test_prolog_state_file_on_a_fifo_cannot_hang_the_launch(node):
    node.write_config(gating="local", timeout_s=2.0)
    node.state_file.parent.mkdir(parents=True)
    os.mkfifo(node.state_file)  # no writer ever opens it: a blocking open would hang here
    rc, err, wall = node.run("healthd-prolog", node.prolog_env(job="18"))
    assert rc == 0 and wall < 2.0 + 2.0
    assert "agent unknown" in err and "not a regular file" in err


def test_prolog_unknown_gpu_list_runs_the_job(node):
    node.write_config(gating="local")
    node.write_state(state_doc(findings=[T1_GPU1]))
    env = node.prolog_env(job="19", gpus=None, CUDA_VISIBLE_DEVICES="GPU-8f2a1c")
    rc, err, _ = node.run("healthd-prolog", env)
    assert rc == 0 and "GPU list unknown (CUDA_VISIBLE_DEVICES='GPU-8f2a1c' is not a list of GPU indices)" in err
    assert json.loads((node.run_dir / "jobs/19.json").read_text())["gpus"] is None


@pytest.mark.parametrize("job", ["../../../tmp/evil", "7\nhealthd: forged", "9" * 300, "7/../../x", "-1"])
def test_prolog_rejects_hostile_job_ids_cleanly(node, job):
    node.write_config(gating="local")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job=job, gpus="1"))
    assert rc == 0
    out = hook_lines(err)
    assert any("is not a job id; nothing recorded, the job runs" in line for line in out)
    jobs = node.run_dir / "jobs"
    assert not jobs.exists() or list(jobs.iterdir()) == []
    assert sorted(p.name for p in node.root.iterdir()) == sorted(["dev", "fakebin", "healthd.yaml", "run", "slurm"])
    assert node.calls() == []


def test_prolog_drops_a_hostile_user_but_binds_the_job(node):
    node.write_state(state_doc())
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="20", user="alice\nhealthd: forged line " + "x" * 500, uid="1000;id"))
    assert rc == 0
    out = hook_lines(err)
    assert any("SLURM_JOB_USER" in line and "rejected" in line for line in out)
    b = json.loads((node.run_dir / "jobs/20.json").read_text())
    assert b["user"] is None and b["uid"] is None and b["gpus"] == [0, 1]


def test_prolog_bad_config_runs_the_job(node):
    node.config.write_text("hooks: {gating: sometimes}\n")
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="21"))
    assert rc == 0 and "hooks.gating: expected one of off, local" in err


# --------------------------------------------------------------------------- epilog


def bind(node: Node, job: str = "7", gpus: str = "0,1") -> None:
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job=job, gpus=gpus))
    assert rc == 0, err


def test_epilog_charges_user_findings_and_closes_the_binding(node):
    node.write_state(state_doc())
    bind(node, "30", "0,1")
    time.sleep(0.05)
    node.write_state(state_doc(findings=[
        finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none", xid=13, serial="1652000000",
                summary="xid 13 gpu0: graphics engine exception"),
        finding("xid:gpu2:13", 2, tier=3, attribution="user", action="none", xid=13),  # another job's GPU
        finding("nvml.ecc_sbe:gpu1", 1, tier=2, attribution="hardware", action="none"),  # not the user's
    ]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="30", gpus="0,1"))
    assert rc == 0, err
    charges = [json.loads(line) for line in node.charges.read_text().splitlines()]
    assert len(charges) == 1
    c = charges[0]
    assert {k: c[k] for k in ("job", "user", "node", "gpu", "serial", "xid", "finding", "summary")} == {
        "job": "30", "user": "alice", "node": "node01", "gpu": 0, "serial": "1652000000", "xid": 13,
        "finding": "xid:gpu0:13", "summary": "xid 13 gpu0: graphics engine exception"}
    assert "charged to job 30 (user alice): gpu0 xid 13 xid:gpu0:13" in err
    assert not (node.run_dir / "jobs/30.json").exists()
    done = json.loads((node.run_dir / "jobs/done/30.json").read_text())
    assert done["end"] >= done["start"] and done["charged"] == ["xid:gpu0:13"]
    checks = json.loads((node.run_dir / "checks.json").read_text())
    assert checks["results"][0]["name"] == "gpu_count" and checks["results"][0]["ok"] is True
    assert node.calls() == []


def test_epilog_requests_a_reboot_when_idle_for_a_pending_remap(node):
    node.write_config(gating="local")
    node.write_state(state_doc())
    bind(node, "31")
    remap = finding("nvml.remap_pending:gpu1", 1, tier=2, action="reset-gpu-when-idle",
                    summary="gpu1: row remapping pending (reset the GPU to apply)")
    node.write_state(state_doc(findings=[remap]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="31"))
    assert rc == 0, err
    req = json.loads((node.run_dir / "requests/nvml.remap_pending:gpu1.json").read_text())
    assert req["action"] == "reset-gpu-when-idle" and req["node"] == "node01" and req["job"] == "31"
    assert node.writes() == [["reboot", "ASAP", "nextstate=RESUME",
                              "reason=healthd: gpu1: row remapping pending (reset the GPU to apply)", "node01"]]
    # a second epilog asks no second time
    bind(node, "32")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="32"))
    assert rc == 0 and len(node.writes()) == 1


def test_epilog_asks_no_reboot_over_a_foreign_reason_or_with_gating_off(node):
    remap = finding("nvml.remap_pending:gpu1", 1, tier=2, action="reset-gpu-when-idle")
    node.write_state(state_doc(findings=[remap]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="33"))
    assert rc == 0 and node.calls() == []  # gating off: the request file only
    assert (node.run_dir / "requests/nvml.remap_pending:gpu1.json").exists()
    node.write_config(gating="local")
    node.set_slurm(state="mixed", flags=["DRAIN"], reason="admin: firmware next week", user="bob")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="34"))
    assert rc == 0 and node.writes() == [] and "someone else's reason" in err


def test_epilog_drains_on_a_t1_hardware_finding_only_with_gating_local_and_exits_0(node):
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="35"))
    assert rc == 0 and "would drain the node: healthd: xid 79 gpu1: fell off the bus [job 35]" in err
    assert node.writes() == []
    node.write_config(gating="local")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="36"))
    # exit 0: the drain keeps the next job off; a non-zero exit would skip the site's epilogs after ours
    assert rc == 0 and "node drained for a T1 hardware finding: healthd: xid 79 gpu1" in err, err
    assert node.slurm_node()["reason"] == "healthd: xid 79 gpu1: fell off the bus [job 36]"
    assert all(w[0] == "update" for w in node.writes())  # no reboot request over a T1 drain


def test_epilog_with_unknown_agent_charges_nothing_and_exits_0(node):
    node.write_config(gating="local")
    node.write_state(state_doc())
    bind(node, "37")
    node.write_state(state_doc(findings=[T1_GPU1], age_s=3600))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="37"))
    assert rc == 0 and "agent unknown" in err and not node.charges.exists()
    assert (node.run_dir / "jobs/done/37.json").exists() and node.calls() == []


def test_epilog_post_job_check_reports_a_missing_gpu(node):
    node.write_state(state_doc())
    (node.dev / "nvidia3").unlink()
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="38"))
    assert rc == 0 and "post-job check gpu_count failed: 3 of 4 GPU device files present" in err
    checks = json.loads((node.run_dir / "checks.json").read_text())
    assert [(r["name"], r["ok"], r["source"]) for r in checks["results"]] == [("gpu_count", False, "epilog")]


# --------------------------------------------------------------------------- health check

DCGMI = """#!/bin/sh
echo "$@" >> {log}
{body}
"""


def healthcheck_env(node: Node) -> dict[str, str]:
    return {"SLURMD_NODENAME": node.name}  # all slurmd gives a HealthCheckProgram


def test_healthcheck_on_an_idle_node_runs_the_quick_checks(node):
    node.write_state(state_doc())
    dcgmi_log = node.root / "dcgmi.log"
    (node.fakebin / "dcgmi").write_text(DCGMI.format(log=dcgmi_log, body="echo '| Memory | Pass |'; exit 0"))
    (node.fakebin / "dcgmi").chmod(0o755)
    node.write_config(dcgmi="dcgmi")
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    assert rc == 0, err
    doc = json.loads((node.run_dir / "checks.json").read_text())
    assert doc["node"] == "node01" and doc["active"] == "ran" and doc["agent"]["known"] is True
    assert {r["name"]: r["ok"] for r in doc["results"]} == {"gpu_count": True, "dcgmi_diag": True}
    assert dcgmi_log.read_text().split() == ["diag", "-r", "1"]
    calls = node.calls()
    # one RPC for this node only: never the whole cluster, never a version query first
    assert [(c["prog"], c["args"]) for c in calls] == [("scontrol", ["show", "node", "-o", "node01"])]
    assert all(c["slurm_conf"] == str(node.slurm_conf) for c in calls)
    # dcgmi runs at most every hooks.dcgmi_interval_s; the GPU count every time
    (node.dev / "nvidia2").unlink()
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    assert rc == 0 and len(dcgmi_log.read_text().splitlines()) == 1
    doc = json.loads((node.run_dir / "checks.json").read_text())
    assert {r["name"]: r["ok"] for r in doc["results"]} == {"gpu_count": False, "dcgmi_diag": True}
    assert "quick check gpu_count failed: 3 of 4 GPU device files present" in err


def test_healthcheck_reports_a_failing_dcgmi_diag(node):
    node.write_state(state_doc())
    (node.fakebin / "dcgmi").write_text(DCGMI.format(
        log=node.root / "d.log", body="echo '| Memory                  | Fail - GPU 2: ECC DBE   |'; exit 226"))
    (node.fakebin / "dcgmi").chmod(0o755)
    node.write_config(dcgmi="dcgmi")
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    assert rc == 0
    r = {r["name"]: r for r in json.loads((node.run_dir / "checks.json").read_text())["results"]}["dcgmi_diag"]
    assert r["ok"] is False and "Memory Fail - GPU 2: ECC DBE" in r["detail"]


def test_healthcheck_skips_active_checks_on_a_busy_node_and_says_slurm_is_unreachable(node):
    node.write_state(state_doc())
    node.set_slurm(state="mixed")
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    doc = json.loads((node.run_dir / "checks.json").read_text())
    assert rc == 0 and doc["active"] == "skipped: node busy (mixed)" and doc["results"] == []
    node.set_slurm(mode="unreachable")
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    doc = json.loads((node.run_dir / "checks.json").read_text())
    assert rc == 0 and doc["active"].startswith("skipped: Slurm unreachable")
    assert "active checks skipped: Slurm unreachable" in err


def test_healthcheck_reports_an_unknown_agent_and_never_drains(node):
    node.write_config(gating="local")
    node.write_state(state_doc(findings=[T1_GPU1], age_s=600))
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    assert rc == 0 and re.search(r"agent unknown: state is 6[0-1]\ds old", err), err
    doc = json.loads((node.run_dir / "checks.json").read_text())
    assert doc["agent"]["known"] is False and node.writes() == []


def test_healthcheck_closes_bindings_whose_epilog_never_ran(node):
    node.write_state(state_doc())
    bind(node, "40")
    b = json.loads((node.run_dir / "jobs/40.json").read_text())
    b["start"] = "2026-01-01T00:00:00.000+00:00"
    (node.run_dir / "jobs/40.json").write_text(json.dumps(b))
    bind(node, "41")  # just started: a prolog may be racing the check
    rc, err, _ = node.run("healthd-healthcheck", healthcheck_env(node))
    assert rc == 0 and "closed the binding of job 40" in err
    assert (node.run_dir / "jobs/done/40.json").exists() and (node.run_dir / "jobs/41.json").exists()


def test_prolog_falls_back_to_the_configured_node_name_and_refuses_unknown_arguments(node):
    node.write_state(state_doc())
    env = node.prolog_env(job="22")
    del env["SLURMD_NODENAME"]
    rc, err, _ = node.run("healthd-prolog", env)
    assert rc == 0 and err.startswith("healthd-prolog[node01]: info: job 22 runs: no finding on GPUs 0,1")
    p = subprocess.run([str(BIN / "healthd-prolog"), "--bogus"], env=node.prolog_env(job="23"),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "unknown argument '--bogus'" in p.stderr


HOOK_MODULES = {
    "healthd", "healthd.hooks", "healthd.hooks.common", "healthd.hooks.healthcheck", "healthd.hooks.prolog",
    "healthd.hooks.epilog", "healthd.hooks.taskprolog", "healthd.hooks.inband_dirs", "healthd.hooks.slurmnode",
    # the floor modules a hook may load: each cheap to import (standard library only, nothing heavy at the
    # top), the contracts with the agent among them (statedoc, checks, bindings, goodput_events, inband_layout)
    "healthd.bindings", "healthd.checks", "healthd.fastjson", "healthd.goodput_events", "healthd.hookconfig",
    "healthd.inband_layout", "healthd.persist", "healthd.reason", "healthd.record", "healthd.slurmtext",
    "healthd.statedoc", "healthd.text", "healthd.trusted",
}
"""The healthd modules the hooks' start may load; anything else they import is the standard library's."""
YAML_PATH = {"healthd.config", "healthd.settings", "yaml"}
"""Loaded only without a current compiled config (test_hookconfig checks the compiled path loads none)."""
TASKPROLOG_MODULES = {"healthd", "healthd.hooks", "healthd.hooks.taskprolog", "healthd.inband_layout"}
"""The TaskProlog runs before every task: with a plain config, these and the standard library only."""


def imported(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `argv` under `python -X importtime`; the modules it imported beyond a bare interpreter's start
    (a name that is no module, such as copy's probe for Jython's org.python.core, is left out)."""
    def run(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
        p = subprocess.run([sys.executable, "-X", "importtime", *args], env=env, capture_output=True, text=True,
                           timeout=30)
        names = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        return p, names - {"imported package"}

    _, bare = run("-c", "pass")
    p, names = run(*argv)
    return p, {m for m in names - bare if importlib.util.find_spec(m.split(".")[0]) is not None}


@pytest.mark.parametrize("hook", ["healthd-prolog", "healthd-epilog", "healthd-healthcheck", "healthd-taskprolog"])
def test_hooks_import_nothing_heavy(node, hook):
    """The hook path never loads NVML, journald, metrics, the classifier or the agent; the prolog and
    epilog of a healthy node do not even load the Slurm backend. Everything a hook imports is the
    standard library or one of HOOK_MODULES (PyYAML and the settings only on the YAML path)."""
    node.write_state(state_doc())
    (node.state_dir / "goodput").mkdir(parents=True)
    (node.state_dir / "goodput" / "50.jsonl").write_text("")  # the epilog adds the run's end
    (node.run_dir / "inband" / "50").mkdir(parents=True)  # the TaskProlog exports it
    env = node.prolog_env(job="50") if hook != "healthd-healthcheck" else {"SLURMD_NODENAME": node.name}
    if hook == "healthd-epilog":
        env = node.epilog_env(job="50")
    p, loaded = imported([str(BIN / hook), "--config", str(node.config)], env)
    assert p.returncode == 0, p.stderr
    assert f"healthd.hooks.{hook.removeprefix('healthd-')}" in loaded, p.stderr[-2000:]  # the trace was read
    heavy = {"pynvml", "systemd", "prometheus_client", "psutil", "healthd.model"}
    if hook != "healthd-healthcheck":  # the health check asks Slurm every run; these two never do here
        heavy |= {"healthd.slurm", "ClusterShell", "subprocess", "tempfile", "logging"}
    assert loaded & heavy == set()
    other_rooms = {m for m in loaded if m.startswith(("healthd.agent", "healthd.controller"))}
    assert other_rooms == set()
    allowed = TASKPROLOG_MODULES if hook == "healthd-taskprolog" else HOOK_MODULES | YAML_PATH
    outside = {m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names and m not in allowed
               and not (m.startswith("yaml.") and "yaml" in allowed)}
    assert outside == set(), f"{hook} imports {sorted(outside)}: not the standard library, not in HOOK_MODULES"
    if hook == "healthd-taskprolog":
        assert p.stdout.startswith("export HEALTHD_INBAND_DIR="), p.stderr[-500:]


def test_epilog_adds_the_runs_end_to_the_jobs_goodput_log_where_the_node_keeps_one(node):
    node.write_state(state_doc())
    logs = node.state_dir / "goodput"
    logs.mkdir(parents=True)
    (logs / "40.jsonl").write_text('{"job_name":"40","job_start_time":1.0}\n')
    bind(node, "40")
    env = node.epilog_env(job="40")
    env.update(SLURM_JOB_EXIT_CODE="15", SLURM_JOB_EXIT_CODE2="0:15")  # killed by SIGTERM (a requeue)
    rc, err, _ = node.run("healthd-epilog", env)
    assert rc == 0, err
    lines = [json.loads(line) for line in (logs / "40.jsonl").read_text().splitlines()]
    assert lines[0] == {"job_name": "40", "job_start_time": 1.0}
    assert {k: lines[1][k] for k in ("job_name", "healthd_event", "state", "exit_code")} == {
        "job_name": "40", "healthd_event": "run_end", "state": "FAILED", "exit_code": "0:15"}
    assert "job 40: run end (FAILED) added to its goodput log" in err
    bind(node, "41")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="41"))  # no log on this node: none made
    assert rc == 0 and not (logs / "41.jsonl").exists(), err
    (logs / "43.jsonl").write_text("")
    bind(node, "43")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="43"))  # exit 0:0: the run completed
    assert rc == 0 and json.loads((logs / "43.jsonl").read_text())["state"] == "COMPLETED", err
    (logs / "42.jsonl").symlink_to(node.root / "elsewhere.jsonl")
    bind(node, "42")
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="42"))  # a link is not followed
    assert rc == 0 and not (node.root / "elsewhere.jsonl").exists() and "run end not added" in err, err
