"""The installed hooks, run as slurmd runs them (a subprocess with slurmd's environment), against
state files and run directories someone other than root could have planted: a state file owned by
nobody, a group-writable or foreign state directory, a linked state file, `run_dir/jobs`,
`jobs/done`, `requests` or the charges directory linked elsewhere. The hooks treat the agent as
unknown (never refuse, never drain), write nothing outside the run directory, say why in one line,
and exit with their safe code. And a node-level T1 hardware finding refuses GPU jobs only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.hooks.support import Node, finding, prolog_would_refuse, state_doc, snapshot
from tests.support.hook_log import one_line

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root; hostile files are chowned to nobody")

T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")
REMAP = finding("nvml.remap_pending:gpu1", 1, tier=2, action="reset-gpu-when-idle",
                summary="gpu1: row remapping pending (reset the GPU to apply)")
XID13 = finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none", xid=13, summary="xid 13 gpu0")
GPU_COUNT = finding("nvml.gpu_count:node", None, summary="3 of 4 GPUs visible to NVML")


@pytest.fixture
def node(tmp_path: Path) -> Node:
    n = Node(tmp_path)
    n.write_config(gating="local")
    return n


def all_hooks_stay_safe(node: Node, why: str) -> None:
    """With a T1 finding on GPU 1 in an untrusted state and gating local: the prolog runs the job,
    the epilog drains nothing and charges nothing, the health check reports the agent unknown."""
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "warning: job 7 runs: agent unknown: state file refused: ", why)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "agent unknown: state file refused: ", why, "findings are not attributed to this job")
    assert not node.charges.exists()
    rc, err, _ = node.run("healthd-healthcheck", {"SLURMD_NODENAME": node.name})
    assert rc == 0, err
    one_line(err, "agent unknown: state file refused: ", why)
    assert node.writes() == []  # never drained, never a reboot asked
    assert not (node.run_dir / "requests").exists()


# --------------------------------------------------------------------------- hostile state files


def test_a_state_file_owned_by_nobody_is_agent_unknown(node):
    node.write_state(state_doc(findings=[T1_GPU1, XID13, REMAP]))
    node.state_file.chmod(0o644)
    os.chown(node.state_file, NOBODY, NOBODY)
    all_hooks_stay_safe(node, f"file {node.state_file} is not trusted (owner uid 65534, mode -rw-r--r-- (0644))")
    assert json.loads((node.run_dir / "checks.json").read_text())["agent"]["known"] is False


def test_a_group_writable_state_file_is_agent_unknown(node):
    node.write_state(state_doc(findings=[T1_GPU1]))
    node.state_file.chmod(0o664)
    all_hooks_stay_safe(node, f"file {node.state_file} is not trusted (owner uid 0, mode -rw-rw-r-- (0664))")


def test_a_state_file_that_is_a_link_is_agent_unknown(node, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o755)
    (real / "state.json").write_text(json.dumps(state_doc(findings=[T1_GPU1])))  # root's, 0644: only the link is wrong
    node.run_dir.mkdir(parents=True)
    node.state_file.symlink_to(real / "state.json")
    all_hooks_stay_safe(node, f"file {node.state_file} is a symbolic link (to '{real / 'state.json'}'")


@pytest.mark.parametrize("spoil, said", [
    (lambda d: d.chmod(0o775), "directory {d} is not trusted (owner uid 0, mode drwxrwxr-x (0775))"),
    (lambda d: os.chown(d, NOBODY, NOBODY), "directory {d} is not trusted (owner uid 65534, mode drwxr-xr-x (0755))"),
])
def test_a_state_directory_someone_else_owns_or_can_write_is_agent_unknown(node, tmp_path, spoil, said):
    """The state file in its own directory (as on a node whose state_file is not under run_dir), so
    the run directory stays trusted and the bindings are still recorded."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    node.state_file = state_dir / "state.json"
    doc = yaml.safe_load(node.config.read_text())
    doc["state_file"] = str(node.state_file)
    node.config.write_text(yaml.safe_dump(doc))
    node.write_state(state_doc(findings=[T1_GPU1]))
    node.state_file.chmod(0o644)
    spoil(state_dir)
    all_hooks_stay_safe(node, said.format(d=state_dir))
    assert json.loads((node.run_dir / "jobs/done/7.json").read_text())["job"] == "7"  # the binding went its way


@pytest.mark.parametrize("spoil, said", [
    (lambda d: d.chmod(0o777), "directory {d} is not trusted (owner uid 0, mode drwxrwxrwx (0777))"),
    (lambda d: os.chown(d, NOBODY, NOBODY), "directory {d} is not trusted (owner uid 65534, mode drwxr-xr-x (0755))"),
])
def test_a_run_directory_someone_else_owns_or_can_write_is_neither_trusted_nor_written(node, spoil, said):
    node.write_state(state_doc(findings=[T1_GPU1]))
    node.state_file.chmod(0o644)
    spoil(node.run_dir)
    why = said.format(d=node.run_dir)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="1"))
    assert rc == 0, err  # no binding could be written, and that never refuses a job
    one_line(err, "error: job 7: cannot record the GPU binding: ", why, "not a reason to refuse the job")
    one_line(err, "job 7 runs: agent unknown: state file refused: ", why)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="1"))
    assert rc == 0, err
    one_line(err, "error: cannot write ", "checks.json", why)
    rc, err, _ = node.run("healthd-healthcheck", {"SLURMD_NODENAME": node.name})
    assert rc == 0, err
    assert node.writes() == []
    assert sorted(p.name for p in node.run_dir.iterdir()) == ["state.json"]  # nothing written into it


# --------------------------------------------------------------------------- linked run directories


def test_a_linked_jobs_directory_gets_no_binding_and_its_target_is_untouched(node, decoy):
    node.write_state(state_doc())
    (decoy / "7.json").write_text(json.dumps({"job": "7", "user": "mallory", "uid": 666, "node": "node01",
                                              "gpus": [0, 1], "start": "2026-01-01T00:00:00.000+00:00"}))
    (decoy / "8.json").write_text(json.dumps({"job": "8", "node": "node01", "gpus": [2],
                                              "start": "2026-01-01T00:00:00.000+00:00"}))
    (node.run_dir / "jobs").symlink_to(decoy)
    before = snapshot(decoy)

    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "error: job 7: cannot record the GPU binding: ",
             f"directory {node.run_dir / 'jobs'} is a symbolic link (to '{decoy}'", "not a reason to refuse the job")
    one_line(err, "info: job 7 runs: no finding on GPUs 0,1")

    node.write_state(state_doc(findings=[finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none", xid=13)]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "job 7: binding unusable (", "is a symbolic link", "nothing charged")
    assert not node.charges.exists()  # the planted binding charged nobody

    rc, err, _ = node.run("healthd-healthcheck", {"SLURMD_NODENAME": node.name})
    assert rc == 0, err
    one_line(err, f"job bindings in {node.run_dir / 'jobs'} ignored: ", "is a symbolic link")
    assert "closed the binding" not in err  # the planted "orphan" 8 was not closed through the link

    assert snapshot(decoy) == before
    assert (node.run_dir / "jobs").is_symlink() and node.writes() == []


def test_a_linked_done_directory_keeps_the_closed_binding_out_of_its_target(node, decoy):
    node.write_state(state_doc())
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="0,1"))
    assert rc == 0 and (node.run_dir / "jobs/7.json").is_file(), err
    (node.run_dir / "jobs/done").symlink_to(decoy)
    before = snapshot(decoy)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "error: job 7: cannot close the binding: ", f"directory {node.run_dir / 'jobs/done'} is a symbolic link")
    assert snapshot(decoy) == before
    assert (node.run_dir / "jobs/7.json").is_file()  # still open: the health check may close it later


def test_a_linked_requests_directory_gets_no_request(node, decoy):
    node.write_config(gating="off")
    node.write_state(state_doc(findings=[REMAP]))
    (node.run_dir / "requests").symlink_to(decoy)
    before = snapshot(decoy)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, f"error: cannot write requests into {node.run_dir / 'requests'}: ", "is a symbolic link")
    assert snapshot(decoy) == before and node.calls() == []


def test_a_linked_checks_file_is_replaced_not_written_through(node, decoy):
    node.write_state(state_doc())
    (node.run_dir / "checks.json").symlink_to(decoy / "keep.txt")
    rc, err, _ = node.run("healthd-healthcheck", {"SLURMD_NODENAME": node.name})
    assert rc == 0, err
    one_line(err, "previous quick-check results", "is a symbolic link", "starting over")
    assert not (node.run_dir / "checks.json").is_symlink()
    assert json.loads((node.run_dir / "checks.json").read_text())["agent"]["known"] is True
    assert snapshot(decoy) == {"keep.txt": b"untouched\n"}


def test_a_charges_file_below_a_linked_directory_of_the_run_directory_is_not_appended(node, decoy):
    node.write_config(gating="off", charges_file=str(node.run_dir / "acct" / "charges.jsonl"))
    node.write_state(state_doc())
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    (node.run_dir / "acct").symlink_to(decoy)
    node.write_state(state_doc(findings=[finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none", xid=13)]))
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7", gpus="0,1"))
    assert rc == 0, err
    one_line(err, "error: job 7: cannot append to ", f"directory {node.run_dir / 'acct'} is a symbolic link")
    assert snapshot(decoy) == {"keep.txt": b"untouched\n"}
    assert json.loads((node.run_dir / "jobs/done/7.json").read_text())["charged"] == ["xid:gpu0:13"]


# --------------------------------------------------------------------------- node-level T1 findings


@pytest.mark.parametrize("f", [
    GPU_COUNT,
    finding("hooks.gpu_count:node", None, summary="quick check gpu_count failed: 3 of 4 GPU device files present"),
    finding("nvml.lost:gpu[00000000:3B:00.0]", None, kind="gpu", action="drain-and-requeue",
            summary="gpu[00000000:3B:00.0]: GPU lost (NVML: GPU is lost; fell off the bus)"),
])
def test_a_node_level_t1_hardware_finding_refuses_a_gpu_job_with_gating_local(node, f):
    node.write_state(state_doc(findings=[f]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="9", gpus="2"))
    assert rc == 1, err
    reason = f"healthd: {f['summary']} [job 9]"
    assert node.writes() == [["update", "NodeName=node01", "State=DRAIN", f"Reason={reason}"]]
    one_line(err, f"error: refused job 9: {reason}")


def test_a_node_level_t1_hardware_finding_does_not_refuse_a_job_without_gpus(node):
    node.write_state(state_doc(findings=[GPU_COUNT]))
    # slurmd sets no GPU variable at all for a job without GPUs (tests/slurm/test_e2e_hooks.py, scenario 5)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="10", gpus=None))
    assert rc == 0, err
    one_line(err, "job 10 runs: GPU list unknown (neither SLURM_JOB_GPUS nor CUDA_VISIBLE_DEVICES is set)")
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="11", gpus=""))
    assert rc == 0, err
    one_line(err, "job 11 runs: the job holds no GPU (3 of 4 GPUs visible to NVML concerns GPU jobs only)")
    assert node.calls() == []


def test_a_node_level_t1_finding_with_gating_off_only_says_what_it_would_refuse(node):
    node.write_config(gating="off")
    node.write_state(state_doc(findings=[GPU_COUNT]))
    prolog_would_refuse(node, "12", "0,1", "3 of 4 GPUs visible to NVML")


def test_a_node_level_finding_in_an_untrusted_state_refuses_nothing(node):
    node.write_state(state_doc(findings=[GPU_COUNT]))
    node.state_file.chmod(0o644)
    os.chown(node.state_file, NOBODY, NOBODY)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="13", gpus="0,1"))
    assert rc == 0 and node.calls() == [], err
    one_line(err, "job 13 runs: agent unknown: state file refused: ", "owner uid 65534")
