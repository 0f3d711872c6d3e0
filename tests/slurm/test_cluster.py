"""The local Slurm test cluster itself: it comes up, runs GPU jobs, drains and resumes, survives a
slurmctld outage, runs the configured hooks, and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from healthd.slurm.scontrol import ScontrolBackend
from tests.support.slurm_cluster import (
    SlurmCluster,
    SlurmCommandTimeout,
    _alive,
    held_view,
    parse_node_line,
    slurm_version,
    version_specific_config,
)

REASON = "healthd: xid 79 gpu0 fell off the bus [#7]"


def _executable(path: Path, body: str) -> str:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


# ----------------------------------------------------------------------------- pure parts


def test_node_line_parsing_keeps_spaces_and_splits_the_reason():
    line = (
        "NodeName=node03 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 Gres=gpu:4 NodeAddr=127.0.0.1 "
        "OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0 RealMemory=1000 State=IDLE+DRAIN "
        "Reason=healthd: xid 79 a=b gpu0 fell off the bus [#7] [root@2026-11-29T09:22:22]"
    )
    node = parse_node_line(line)
    assert node["NodeName"] == "node03"
    assert node["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["State"] == "IDLE+DRAIN"
    assert node["Reason"] == "healthd: xid 79 a=b gpu0 fell off the bus [#7]"
    assert (node["ReasonUser"], node["ReasonTime"]) == ("root", "2026-11-29T09:22:22")
    assert "ReasonUser" not in parse_node_line("NodeName=node01 State=IDLE")


@pytest.mark.parametrize("state", ["IDLE", "IDLE*", "ALLOCATED", "MIXED+NOT_RESPONDING", "IDLE+COMPLETING"])
def test_a_kept_reason_on_a_node_that_holds_none_is_not_shown(state):
    """24.11's reason kept after RESUME: the view a test compares has none while the state holds none."""
    line = f"NodeName=node03 State={state} Reason=healthd: old [#7] [root@2026-11-29T09:22:22]"
    assert held_view(parse_node_line(line)) == {"NodeName": "node03", "State": state}


@pytest.mark.parametrize("state", ["IDLE+DRAIN", "DOWN", "DOWN*+DRAIN", "MIXED+DRAIN", "FAIL", "IDLE+FAIL"])
def test_a_reason_held_by_the_state_is_shown(state):
    node = parse_node_line(f"NodeName=node03 State={state} Reason=healthd: now [#8] [root@2026-11-29T09:22:22]")
    assert held_view(node) == node and node["Reason"] == "healthd: now [#8]"


def test_version_specific_config_is_the_only_difference(tmp_path: Path):
    assert version_specific_config((22, 5)) == ([], None)
    lines, cgroup = version_specific_config((24, 11))
    assert cgroup == "CgroupPlugin=disabled\n"
    conf = SlurmCluster(
        tmp_path, nodes=2, gpus_per_node=2, extra_conf="slurmdtimeout=10\nDebugFlags=Gres", port_base=16817
    ).slurm_conf_text()
    assert "SlurmdTimeout=10" in conf and "SlurmdTimeout=30" not in conf  # extra_conf replaces a generated key
    assert "DebugFlags=Gres" in conf
    assert "SchedulerParameters=nohold_on_prolog_fail" in conf and "PrologFlags=Alloc" in conf
    assert "ReturnToService=2" in conf and "Prolog=" not in conf  # no hooks, no hook lines
    assert re.search(r"^NodeName=node02 .*Port=16819 .*Gres=gpu:2", conf, re.M)
    gres = SlurmCluster(tmp_path, nodes=2, gpus_per_node=2).gres_conf_text()
    assert f"NodeName=node02 Name=gpu File={tmp_path}/dev/node02/nvidia[0-1]" in gres


def test_installed_version_is_known():
    assert slurm_version() >= (22, 5)


def test_session_has_slurm_conf(slurm_conf_env: Path):
    assert os.environ["SLURM_CONF"] == str(slurm_conf_env)
    assert slurm_conf_env.is_file()


# ----------------------------------------------------------------------------- the session cluster


def test_four_idle_nodes_with_four_gpus_each(slurm_cluster: SlurmCluster):
    assert slurm_cluster.sinfo_states() == {f"node0{i}": "idle" for i in range(1, 5)}
    for node in slurm_cluster.nodes:
        state = slurm_cluster.node_state(node)
        assert (state["State"], state["Gres"], state["NodeAddr"]) == ("IDLE", "gpu:4", "127.0.0.1")
        # scontrol leaves Port out where it equals SlurmdPort (node01's)
        assert state.get("Port", str(slurm_cluster.node_port("node01"))) == str(slurm_cluster.node_port(node))


def test_up_again_changes_nothing(slurm_cluster: SlurmCluster):
    pids = slurm_cluster.pids()
    started = time.monotonic()
    slurm_cluster.up()
    assert time.monotonic() - started < 1
    assert slurm_cluster.pids() == pids


def test_srun_gets_a_gpu_on_every_node(slurm_cluster: SlurmCluster):
    result = slurm_cluster.run(
        ["srun", "-N4", "--gres=gpu:1", "bash", "-c", "echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"],
        timeout=30,
        check=True,
    )
    assert sorted(result.stdout.split("\n")[:-1]) == [f"node0{i} 0" for i in range(1, 5)]
    two = slurm_cluster.run(
        ["srun", "-w", "node02", "--gres=gpu:2", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"], timeout=30, check=True
    )
    assert two.stdout.strip() == "0,1"


def test_drain_with_spaces_then_resume(slurm_cluster: SlurmCluster):
    run = slurm_cluster.run
    run(["scontrol", "update", "NodeName=node03", "State=DRAIN", f"Reason={REASON}"], check=True)
    try:
        reasons = run(["sinfo", "-R", "-h", "-o", "%N|%E|%u|%H"], check=True).stdout.splitlines()
        assert len(reasons) == 1
        node, reason, user, when = reasons[0].split("|")
        assert (node, reason, user) == ("node03", REASON, "root")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", when)
        state = slurm_cluster.node_state("node03")
        assert state["State"] == "IDLE+DRAIN"
        assert (state["Reason"], state["ReasonUser"]) == (REASON, "root")
    finally:
        run(["scontrol", "update", "NodeName=node03", "State=RESUME"], check=True)
    slurm_cluster.wait_idle(15, nodes=["node03"])  # idle* for about 1 s first (P6)
    # Slurm 24.11 still shows the old reason on the node, IDLE again, until it runs a job (22.05 and
    # 26.05 clear it); healthd reads a reason only while the state holds DRAIN, DOWN or FAIL
    assert slurm_cluster.node_state("node03").get("Reason") in (None, REASON)
    assert ScontrolBackend(str(slurm_cluster.conf_path)).node("node03").reason == ""
    assert run(["sinfo", "-R", "-h", "-o", "%N|%E"]).stdout.strip() == ""


def test_slurmctld_down_fails_fast_and_comes_back(slurm_cluster: SlurmCluster):
    slurm_cluster.stop_ctld()
    try:
        started = time.monotonic()
        with pytest.raises(SlurmCommandTimeout, match=r"sinfo.*no answer within 2 s.*slurmctld is NOT running"):
            slurm_cluster.run(["sinfo"], timeout=2)
        assert time.monotonic() - started < 4
        ping = slurm_cluster.run(["scontrol", "ping"], timeout=5)
        assert ping.returncode != 0 and "DOWN" in ping.stdout
        others = {name: pid for name, pid in slurm_cluster.pids().items() if name != "slurmctld"}
        assert "munged" in others and any(name.startswith("slurmd") for name in others), others
        assert all(_alive(pid) for pid in others.values())
    finally:
        slurm_cluster.start_ctld()
    slurm_cluster.wait_idle(15)
    assert slurm_cluster.run(["scontrol", "ping"], timeout=5).returncode == 0


def test_killed_slurmd_is_restarted(slurm_cluster: SlurmCluster):
    old = slurm_cluster.pids()["slurmd-node04"]
    slurm_cluster.kill_slurmd("node04", signal.SIGTERM)
    assert not _alive(old)
    slurm_cluster.start_slurmd("node04")
    assert slurm_cluster.pids()["slurmd-node04"] != old
    slurm_cluster.wait_idle(15)


# ----------------------------------------------------------------------------- clusters of one's own


def test_hooks_run_and_a_refused_job_is_requeued_without_hold(make_slurm_cluster, slurm_cluster, tmp_path: Path):
    seen = tmp_path / "seen"
    seen.mkdir()
    seen.chmod(0o777)
    hooks = {
        "HealthCheckProgram": _executable(tmp_path / "hc.sh", f'echo "$SLURMD_NODENAME" >> {seen}/hc\n'),
        "Prolog": _executable(
            tmp_path / "prolog.sh",
            f"""\
            echo "$SLURMD_NODENAME $SLURM_JOB_ID $CUDA_VISIBLE_DEVICES $SLURM_CONF" >> {seen}/prolog
            [ "$SLURMD_NODENAME" != node01 ] || [ ! -e {seen}/refuse ]
            """,
        ),
        "Epilog": _executable(tmp_path / "epilog.sh", f'echo "$SLURMD_NODENAME $SLURM_JOB_ID" >> {seen}/epilog\n'),
    }
    cluster = make_slurm_cluster(nodes=2, gpus_per_node=2, hooks=hooks, health_check_interval=1)
    assert slurm_cluster.is_up() and cluster.port_base != slurm_cluster.port_base  # side by side
    hc = seen / "hc"
    cluster.wait_for(lambda: hc.exists() and {"node01", "node02"} <= set(hc.read_text().split()), 10, what="health checks")

    cluster.run(["srun", "-w", "node02", "--gres=gpu:2", "true"], timeout=30, check=True)
    node, job, cvd, conf = (seen / "prolog").read_text().split()
    assert (node, cvd, conf) == ("node02", "0,1", str(cluster.conf_path))
    cluster.wait_for(lambda: (seen / "epilog").exists(), 10, what="the epilog")
    assert (seen / "epilog").read_text().split() == ["node02", job]

    # the main scheduler may skip a cycle while a job is completing; start from an empty queue
    cluster.wait_for(lambda: not cluster.run(["squeue", "-h"], check=True).stdout.strip(), 15, what="an empty queue")
    (seen / "refuse").touch()
    out = cluster.run(["sbatch", "-w", "node01", "--gres=gpu:1", "--wrap", "true"], check=True).stdout
    job_id = out.split()[-1]

    def requeued() -> str:
        shown = cluster.run(["scontrol", "show", "job", job_id], check=True).stdout
        return shown if "Restarts=1" in shown and "JobState=PENDING" in shown else ""  # not REQUEUED/COMPLETING

    shown = cluster.wait_for(requeued, 60, what=f"job {job_id} to be requeued after the refusing prolog")
    assert "held" not in shown.lower() and "Priority=0 " not in shown  # nohold_on_prolog_fail
    assert cluster.node_state("node01")["Reason"] == "Prolog error"
    assert cluster.node_state("node01")["ReasonUser"] == "slurm"  # drained by slurmctld, not by root
    cluster.run(["scancel", job_id], check=True)


def test_down_leaves_no_process_behind(make_slurm_cluster):
    cluster = make_slurm_cluster(nodes=2, gpus_per_node=1)
    job = cluster.run(["sbatch", "-w", "node02", "--wrap", "sleep 300"], check=True).stdout.split()[-1]
    cluster.wait_for(lambda: cluster.job_processes(), 15, what=f"job {job} to start")
    pids = cluster.pids()
    assert set(pids) == {"munged", "slurmctld", "slurmd-node01", "slurmd-node02"}
    steps = cluster.job_processes()

    cluster.down()

    assert [name for name, pid in pids.items() if _alive(pid)] == []
    assert [pid for pid in steps if _alive(pid)] == []
    assert cluster.job_processes() == []
    assert not cluster.is_up()
    cluster.down()  # a second down() is harmless
