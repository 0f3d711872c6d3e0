"""Pure rules of the hooks: judging the state file, gating, slurmd's environment, attribution, the
quick-check mapping and the merge into a classification. No subprocess, no Slurm."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from healthd import config
from healthd.model import would_do
from healthd.reason import MAX_REASON_BYTES
from healthd.bindings import Binding, attach_jobs, charges, job_at, parse_binding
from healthd.agent.hookfiles import findings_from_checks, merge
from healthd.checks import merged_doc, result
from healthd.hooks.common import env_gpus, env_job_id, env_node, env_user, healthd_reason, judge
from healthd.statedoc import load_state
from healthd.trusted import read_bounded
from healthd.hooks.epilog import request_name, when_idle
from healthd.hooks.prolog import gate
from tests.support.builders import NOW, gpu, kernel, nvml, run, settings, snap, xid
from tests.hooks.support import finding, state_doc

T = 1_800_000_000.0


SETTINGS = config.parse("node_name: node01")  # hooks.stale_after_s 60


def alive(pid: int) -> bool:
    return True


def fresh(findings=(), **kw):
    return judge(state_doc("node01", list(findings), now=T, **kw), T, SETTINGS, pid_alive=alive)


# --------------------------------------------------------------------------- judge


def test_fresh_state_from_a_live_agent_is_known():
    j = fresh([finding("xid:gpu1:79", 1)])
    assert j.known and "agent alive" in j.reason and "verdict failed" in j.reason
    assert [f["id"] for f in j.findings] == ["xid:gpu1:79"]


@pytest.mark.parametrize(
    "doc, error, why",
    [
        (None, "state file /run/healthd/state.json is missing (is healthd running?)", "is missing"),
        (state_doc(age_s=61.0, now=T), "", "61s old"),
        (state_doc(age_s=-3600.0, now=T), "", "in the future"),
        (state_doc(node="node02", now=T), "", "for node 'node02', not node01"),
        ({**state_doc(now=T), "generated_at": "yesterday"}, "", "is not an RFC 3339 time"),
        ({**state_doc(now=T), "generated_at": "2026-11-29T10:00:00"}, "", "is not an RFC 3339 time"),
        ({**state_doc(now=T), "agent": {}}, "", "no agent pid"),
        ({**state_doc(now=T), "findings": None}, "", "no findings list"),
    ],
)
def test_unusable_state_is_agent_unknown_with_the_reason(doc, error, why):
    j = judge(doc, T, SETTINGS, error=error, pid_alive=alive)
    assert not j.known and j.reason.startswith("agent unknown: ") and why in j.reason
    assert j.findings == []  # nothing from an unknown agent is ever acted on


def test_a_dead_agent_pid_is_agent_unknown():
    j = judge(state_doc(now=T, pid=4242), T, SETTINGS, pid_alive=lambda pid: pid != 4242)
    assert not j.known and "agent pid 4242 is not running" in j.reason


def test_load_state_says_truncated_and_refuses_a_fifo_without_blocking(tmp_path):
    p = tmp_path / "state.json"
    p.write_text('{"node": "node01", "findings": [')
    doc, err = load_state(str(p))
    assert doc is None and "unparsable (truncated?)" in err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    doc, err = load_state(str(fifo))
    assert doc is None and "not a regular file" in err and time.monotonic() - start < 1.0
    with pytest.raises(OSError, match="is not a regular file"):
        read_bounded(str(fifo), 100)


# --------------------------------------------------------------------------- gating


def test_gate_refuses_only_a_t1_hardware_finding_on_an_allocated_gpu():
    j = fresh([finding("xid:gpu1:79", 1, summary="xid 79 gpu1: fell off the bus")])
    g = gate(j, [0, 1])
    assert g.refuse and g.why == "xid 79 gpu1: fell off the bus" and g.finding["id"] == "xid:gpu1:79"
    assert not gate(j, [2, 3]).refuse


@pytest.mark.parametrize(
    "f, why",
    [
        (finding("nvml.remap_pending:gpu0", 0, tier=2, action="reset-gpu-when-idle"), "only"),
        (finding("xid:gpu0:119", 0, tier=1, attribution="software"), "only"),
        (finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none"), "only"),
        (finding("nvml.gpu_count:node", None, tier=2), "no finding on GPUs 0,1"),
        (finding("nvml.driver:node", None, tier=2, attribution="software", action="reboot-when-idle"), "no finding"),
        (finding("ib.port:mlx5_0/1", None, attribution="fabric", kind="port"), "no finding on GPUs 0,1"),
        (finding("fs.mount:fs:/ckpt", None, attribution="storage", kind="filesystem"), "no finding on GPUs 0,1"),
        ({**finding("nvml.gpu_count:node", None), "component": None}, "no finding on GPUs 0,1"),
    ],
)
def test_gate_lets_the_job_run_on_anything_less_certain(f, why):
    g = gate(fresh([f]), [0, 1])
    assert not g.refuse and why in g.why


@pytest.mark.parametrize(
    "f",
    [
        finding("nvml.gpu_count:node", None, summary="3 of 4 GPUs visible to NVML"),
        finding("hooks.gpu_count:node", None, summary="quick check gpu_count failed: 3 of 4"),
        finding("nvml.lost:gpu[0000:3B:00.0]", None, kind="gpu", action="drain-and-requeue", summary="GPU lost"),
        finding("xid:node:79", None, xid=79, action="drain-and-requeue", summary="xid 79: fell off the bus"),
    ],
)
def test_gate_refuses_any_gpu_job_on_a_node_level_t1_hardware_finding(f):
    g = gate(fresh([f]), [0, 1])
    assert g.refuse and g.finding is f and g.why == f["summary"]
    # a job that holds no GPU is not refused for it; one whose GPUs are unknown runs as always
    g = gate(fresh([f]), [])
    assert not g.refuse and g.why.startswith("the job holds no GPU (") and "concerns GPU jobs only" in g.why
    assert not gate(fresh([f]), None, "neither SLURM_JOB_GPUS nor CUDA_VISIBLE_DEVICES is set").refuse
    # and never from an agent that is not known
    stale = judge(state_doc(findings=[f], age_s=300, now=T), T, SETTINGS, pid_alive=alive)
    assert not gate(stale, [0]).refuse


def test_gate_prefers_a_finding_on_the_jobs_own_gpu_to_a_node_level_one():
    own = finding("xid:gpu1:79", 1, summary="xid 79 gpu1: fell off the bus")
    node = finding("nvml.gpu_count:node", None, summary="3 of 4 GPUs visible to NVML")
    assert gate(fresh([node, own]), [0, 1]).finding is own
    assert gate(fresh([node, own]), [2]).finding is node


def test_gate_lets_the_job_run_when_in_doubt():
    bad = [finding("xid:gpu0:79", 0)]
    stale = judge(state_doc(findings=bad, age_s=300, now=T), T, SETTINGS, pid_alive=alive)
    assert not gate(stale, [0]).refuse and "agent unknown" in gate(stale, [0]).why
    g = gate(fresh(bad), None, "neither SLURM_JOB_GPUS nor CUDA_VISIBLE_DEVICES is set")
    assert not g.refuse and "GPU list unknown" in g.why
    assert not gate(fresh(bad), []).refuse


def test_healthd_reason_is_one_short_owned_line():
    r = healthd_reason("xid 79 gpu1: fell off the bus\nInjected=1 " + "x" * 500, "[job 12345]")
    assert r.startswith("healthd: xid 79 gpu1: fell off the bus?Injected=1") and r.endswith(" [job 12345]")
    assert len(r) <= MAX_REASON_BYTES and r.isprintable()


# --------------------------------------------------------------------------- slurmd's environment


def test_gpus_come_from_slurm_job_gpus_then_cuda_visible_devices():
    assert env_gpus({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == ([2, 3], "")
    assert env_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == ([1], "")
    assert env_gpus({"SLURM_JOB_GPUS": ""}) == ([], "")
    for bad in ("GPU-8f2a", "NoDevFiles", "0,,1", "MIG-1/2/3", "1; rm -rf /"):
        gpus, why = env_gpus({"CUDA_VISIBLE_DEVICES": bad})
        assert gpus is None and "not a list of GPU indices" in why
    assert env_gpus({})[0] is None


@pytest.mark.parametrize("raw", ["../../etc/passwd", "7\n8", "7/../8", "", " 7", "-1", "9" * 21, "7.json", "0x10"])
def test_hostile_job_ids_are_rejected(raw):
    job, why = env_job_id({"SLURM_JOB_ID": raw})
    assert job is None and "is not a job id" in why and "\n" not in why


def test_hostile_user_values_are_dropped_not_logged_raw():
    user, uid, problems = env_user({"SLURM_JOB_USER": "alice\nhealthd: forged line", "SLURM_JOB_UID": "12a"})
    assert user is None and uid is None and len(problems) == 2
    assert all("\n" not in p for p in problems)
    assert env_user({"SLURM_JOB_USER": "svc.alice-2$", "SLURM_JOB_UID": "1000"}) == ("svc.alice-2$", 1000, [])
    assert env_user({"SLURM_JOB_USER": "x" * 100})[0] is None
    assert env_node({"SLURMD_NODENAME": "../x"}, "fallback") == "fallback"
    assert env_node({"SLURMD_NODENAME": "gpu-001"}, "fallback") == "gpu-001"


# --------------------------------------------------------------------------- bindings and attribution


def binding(job="7", gpus=(0, 1), start=T - 100, end=None, user="alice"):
    return Binding(job=job, node="node01", gpus=gpus, start=start, end=end, user=user, uid=1000)


def test_binding_round_trips_and_bad_documents_say_what_is_wrong():
    b = binding(end=T)
    assert parse_binding(b.to_json()) == b.replace(start=round(b.start, 3), end=round(T, 3))
    for doc, why in [({**b.to_json(), "job": "../x"}, "not a job id"), ({**b.to_json(), "gpus": ["0"]}, "gpus"),
                     ({**b.to_json(), "start": "soon"}, "start")]:
        with pytest.raises(ValueError, match=why):
            parse_binding(doc)


def test_job_at_picks_the_job_holding_the_gpu_at_that_time():
    old, new = binding("6", start=T - 500, end=T - 200), binding("7", start=T - 100)
    assert job_at([old, new], 0, T - 300).job == "6"
    assert job_at([old, new], 1, T - 50).job == "7"
    assert job_at([old, new], 2, T - 50) is None
    assert job_at([old, new], 0, T - 150) is None  # between the two jobs


def test_user_findings_seen_during_the_job_are_charged_to_it():
    fs = [
        finding("xid:gpu0:13", 0, tier=3, attribution="user", action="none", xid=13, serial="1652", last_seen=T - 50,
                summary="xid 13 gpu0: graphics engine exception"),
        finding("xid:gpu1:31", 1, tier=3, attribution="user", action="none", xid=31, last_seen=T - 500),  # before start
        finding("xid:gpu2:13", 2, tier=3, attribution="user", action="none", xid=13, last_seen=T - 50),   # not the job's
        finding("xid:gpu1:79", 1, tier=1, attribution="hardware", xid=79, last_seen=T - 50),              # not user
    ]
    lines = charges(fs, binding(), T, "node01")
    assert len(lines) == 1
    c = lines[0]
    assert (c["job"], c["user"], c["node"], c["gpu"], c["serial"], c["xid"], c["finding"]) == (
        "7", "alice", "node01", 0, "1652", 13, "xid:gpu0:13")
    assert c["summary"] == "xid 13 gpu0: graphics engine exception" and c["time"].startswith("20")
    assert charges(fs, binding(gpus=None), T, "node01") == []


def test_attach_jobs_sets_the_job_on_gpu_findings_active_at_last_seen():
    results = run(
        snap(NOW, nv=nvml(*(gpu(i) for i in range(4))), k=kernel(xid(13, 0, NOW - 5), xid(13, 3, NOW - 5))),
        cfg=settings(nvml={"expected_gpus": 4}),
    )
    findings = results[-1].findings
    b = Binding(job="41", node="gpu001", gpus=(0, 1), start=NOW - 60)
    tagged = {f.id: f.job for f in attach_jobs(findings, [b])}
    assert tagged["xid:gpu0:13"] == "41" and tagged["xid:gpu3:13"] is None
    already = dataclasses.replace(findings[0], job="40")
    assert attach_jobs((already,), [b])[0].job == "40"


# --------------------------------------------------------------------------- quick checks


def test_failed_quick_checks_become_findings():
    doc = merged_doc(None, "gpu001", NOW, [
        result("gpu_count", False, "3 of 4 GPU device files present (/dev/nvidia[0-9]*)", NOW - 5, "healthd-healthcheck"),
        result("dcgmi_diag", False, "Memory  Fail - GPU 2", NOW - 5, "healthd-healthcheck"),
        result("custom", False, "something", NOW - 5, "x"),
        result("dcgmi_other", None, "timed out", NOW - 5, "x"),
        result("fine", True, "ok", NOW - 5, "x"),
    ])
    fs, problem = findings_from_checks(doc, "gpu001", NOW, 3600.0)
    by_id = {f.id: f for f in fs}
    assert problem == "" and set(by_id) == {"hooks.gpu_count:node", "hooks.dcgmi_diag:node", "hooks.check:custom"}
    c = by_id["hooks.gpu_count:node"]
    assert (c.tier, c.attribution, c.action) == (1, "hardware", "drain") and "3 of 4" in c.summary
    assert c.evidence[0].kind == "probe" and c.last_seen == pytest.approx(NOW - 5, abs=0.01)
    d = by_id["hooks.dcgmi_diag:node"]
    assert (d.tier, d.attribution, d.action) == (2, "hardware", "drain")
    assert (by_id["hooks.check:custom"].tier, by_id["hooks.check:custom"].action) == (3, "none")


def test_old_or_foreign_checks_map_to_nothing():
    old = merged_doc(None, "gpu001", NOW, [result("gpu_count", False, "3 of 4", NOW - 7200, "x")])
    assert findings_from_checks(old, "gpu001", NOW, 3600.0) == ((), "")
    foreign = merged_doc(None, "gpu002", NOW, [result("gpu_count", False, "3 of 4", NOW, "x")])
    fs, problem = findings_from_checks(foreign, "gpu001", NOW, 3600.0)
    assert fs == () and "for node 'gpu002'" in problem
    assert findings_from_checks(["x"], "gpu001", NOW, 3600.0)[1] == "checks document is not an object"


def test_merged_doc_replaces_results_by_name_and_keeps_the_others():
    first = merged_doc(None, "n", NOW, [result("gpu_count", True, "4 of 4", NOW, "hc"), result("dcgmi_diag", False, "Fail", NOW, "hc")])
    second = merged_doc(first, "n", NOW + 5, [result("gpu_count", False, "3 of 4", NOW + 5, "epilog")])
    assert {r["name"]: r["ok"] for r in second["results"]} == {"gpu_count": False, "dcgmi_diag": False}


def test_merge_recomputes_verdict_and_would_do():
    healthy = run(snap(NOW, nv=nvml(*(gpu(i) for i in range(4)))), cfg=settings(nvml={"expected_gpus": 4}))[-1]
    assert healthy.verdict == "healthy" and healthy.findings == ()
    doc = merged_doc(None, "gpu001", NOW, [result("gpu_count", False, "3 of 4", NOW, "hc")])
    fs, _ = findings_from_checks(doc, "gpu001", NOW, 3600.0)
    merged = merge(healthy, fs)
    assert merged.verdict == "failed" and merged.would_do == would_do(merged.findings)
    assert merged.would_do[0]["action"] == "drain" and merged.would_do[0]["reason"].startswith("healthd: quick check gpu_count")
    assert merge(healthy, ()) is healthy
    t2, _ = findings_from_checks(merged_doc(None, "gpu001", NOW, [result("dcgmi_diag", False, "Fail", NOW, "hc")]),
                                 "gpu001", NOW, 3600.0)
    assert merge(healthy, t2).verdict == "degraded"


# --------------------------------------------------------------------------- epilog rules


def test_when_idle_findings_and_their_request_names():
    j = fresh([
        finding("nvml.remap_pending:gpu5", 5, tier=2, action="reset-gpu-when-idle"),
        finding("xid:gpu2:119", 2, tier=2, attribution="software", action="reboot-when-idle"),
        finding("xid:gpu1:79", 1),
    ])
    assert [f["id"] for f in when_idle(j)] == ["xid:gpu2:119", "nvml.remap_pending:gpu5"]
    assert request_name("ib.drop:mlx5_0/1") == "ib.drop:mlx5_0_1.json"
    assert request_name("../../x") == "_.._.._x.json"
    assert len(request_name("x" * 1000)) <= 160


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "text, key",
    [
        ("hooks: {gating: auto}", "hooks.gating"),
        ("hooks: {timeout_s: 0}", "hooks.timeout_s"),
        ("hooks: {stale_after_s: 5}", "hooks.stale_after_s"),
        ("hooks: {run_dir: run/healthd}", "hooks.run_dir"),
        ("hooks: {path: 'bin:/usr/bin'}", "hooks.path"),
        ("hooks: {dcgmi: 'dcgmi -r 1'}", "hooks.dcgmi"),
        ("hooks: {timeout_s: 20, dcgmi_timeout_s: 45}", "hooks.dcgmi_timeout_s"),
        ("hooks: {gatting: off}", "hooks.gatting"),
    ],
)
def test_bad_hook_settings_name_the_key(text, key):
    with pytest.raises(config.ConfigError) as e:
        config.parse(text, "/etc/healthd/healthd.yaml")
    assert e.value.key == key and str(e.value).startswith(f"/etc/healthd/healthd.yaml: {key}: expected")


def test_hook_defaults():
    h = config.parse("node_name: n1").hooks
    assert (h.gating, h.stale_after_s, h.timeout_s, h.run_dir, h.slurm_conf, h.gpu_devices, h.dcgmi, h.charges_file) == (
        "off", 60.0, 5.0, "/run/healthd", "/etc/slurm/slurm.conf", "/dev/nvidia[0-9]*", "dcgmi", "/var/lib/healthd/charges.jsonl")
    assert config.parse("hooks: {gating: local, dcgmi: null}").hooks.gating == "local"
    assert config.parse("hooks: {gating: off}").hooks.gating == "off"  # YAML 1.1 reads bare off as false
    with pytest.raises(config.ConfigError, match="hooks.gating"):
        config.parse("hooks: {gating: on}")
