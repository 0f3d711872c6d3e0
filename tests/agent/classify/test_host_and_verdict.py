"""Host rules, collector errors, the verdict and would_do."""

from __future__ import annotations

from healthd.model import would_do
from healthd.model import Component, Finding
from healthd.settings import FilesystemSpec
from tests.support.builders import (
    NOW,
    fs,
    get,
    gpu,
    host,
    ib,
    ids,
    kernel,
    nvml,
    read_nvml,
    run,
    settings,
    snap,
    texts,
    xid,
)


def test_filesystem_rules():
    cfg = settings(host={"filesystems": (FilesystemSpec(path="/data", role="dataset", max_latency_s=0.5, timeout_s=5.0),)})
    res = run(snap(NOW, h=host(filesystems=(
        fs("/ckpt", mounted=False, mount_point="/"),
        fs("/scratch", role="scratch", timed_out=True, latency_s=None, writable=None),
        fs("/home", role="home", writable=False, error="[Errno 30] Read-only file system"),
        fs("/data", role="dataset", latency_s=0.8),
        fs("/fast", role="scratch", latency_s=0.9),
        fs("/odd", role="scratch", writable=None, latency_s=None, error="EACCES"),
    ))), cfg=cfg)[0]
    un, hung, ro = get(res, "fs.unmounted:fs:/ckpt"), get(res, "fs.hung:fs:/scratch"), get(res, "fs.readonly:fs:/home")
    for f in (un, hung, ro):
        assert (f.tier, f.attribution, f.action, f.source) == (1, "storage", "drain", "host")
    assert un.summary == "checkpoint filesystem /ckpt is not mounted (jobs cannot checkpoint)" and "mount /" in texts(un)
    assert "did not finish in 5s" in hung.summary and "Read-only file system" in ro.summary
    slow = get(res, "fs.slow:fs:/data")
    assert (slow.tier, slow.attribution) == (2, "storage") and "write+fsync 0.80s (max 0.5s)" in slow.summary
    assert "fs.slow:fs:/fast" not in ids(res)  # default max_latency_s 1.0
    assert get(res, "fs.probe_error:fs:/odd").tier == 3
    assert res.verdict == "failed"


def test_memory_psi_dstate():
    res = run(snap(NOW, h=host(
        mem_available_bytes=50 * 2**30, mem_total_bytes=2048 * 2**30,
        psi={"memory": {"some_avg10": 40.0, "full_avg10": 25.0}, "io": {"full_avg10": 60.0}},
        dstate_pids=tuple((1000 + k, "python3") for k in range(6)),
    )))[0]
    mem = get(res, "host.memory:node")
    assert (mem.tier, mem.attribution) == (2, "software") and "2.4% of 2048 GiB" in mem.summary
    assert (get(res, "host.psi_memory:node").tier, get(res, "host.psi_memory:node").attribution) == (3, "software")
    assert (get(res, "host.psi_io:node").tier, get(res, "host.psi_io:node").attribution) == (3, "storage")
    d = get(res, "host.dstate:node")
    assert (d.tier, d.attribution, d.action) == (3, "storage", "none") and "1000 (python3)" in texts(d)


def test_collector_error_names_collector_and_detail_and_no_data_is_silent():
    res = run(snap(NOW, h=host(status="error", detail="/proc/meminfo: EACCES"), i=ib(status="no_data", detail="no HCA")))[0]
    f = get(res, "collector.host:node")
    assert (f.tier, f.attribution, f.action, f.source) == (3, "unknown", "none", "host")
    assert f.summary == "could not check host: /proc/meminfo: EACCES"
    assert [x.id for x in res.findings] == ["collector.host:node"]
    k = get(run(snap(NOW, k=kernel(status="error", detail="journal unreadable")))[0], "collector.kernel_log:node")
    assert k.source == "kernel_log"


def test_kernel_gap_is_noted():
    f = get(run(snap(NOW, k=kernel(gap=True, cursor="s=9")))[0], "kernel.gap:node")
    assert f.tier == 3 and "s=9" in texts(f)


def test_verdicts():
    assert run(snap(NOW))[0].verdict == "healthy"
    all_err = snap(NOW, nv=nvml(status="error", error_kind="other", detail="x"), k=kernel(status="error", detail="x"),
                   i=ib(status="error", detail="x"), h=host(status="error", detail="x"))
    assert run(all_err)[0].verdict == "unknown"
    assert run(snap(NOW, h=host(status="error", detail="x")))[0].verdict == "degraded"  # others still answered


def test_unknown_does_not_hide_a_remembered_t1():
    first = run(snap(NOW, nv=nvml(gpu(0)), k=kernel(xid(79, 0, NOW))))[0]
    all_err = snap(NOW + 10, nv=nvml(status="error", error_kind="other", detail="x"), k=kernel(status="error", detail="x"),
                   i=ib(status="error", detail="x"), h=host(status="error", detail="x"))
    assert run(all_err, history=first.history)[0].verdict == "failed"


def F(fid, key, tier, action, index=None):
    comp = Component(kind="gpu", index=index) if key.startswith("gpu") else Component(kind="node")
    return Finding(id=fid, component=comp, source="nvml", attribution="hardware", tier=tier, action=action, summary=fid, evidence=())


def test_would_do_one_per_action_and_component_strongest_first():
    out = would_do([
        F("a", "gpu1", 2, "reset-gpu-when-idle", 1),
        F("b", "gpu1", 1, "reset-gpu-when-idle", 1),
        F("c", "gpu1", 1, "drain", 1),
        F("d", "node", 2, "reboot-when-idle"),
        F("e", "gpu2", 1, "inspect-hardware", 2),
        F("f", "gpu2", 3, "none", 2),
    ])
    assert [(w["action"], w["component"], w["finding"], w["tier"]) for w in out] == [
        ("inspect-hardware", "gpu2", "e", 1),
        ("drain", "gpu1", "c", 1),
        ("reboot-when-idle", "node", "d", 2),
        ("reset-gpu-when-idle", "gpu1", "b", 1),
    ]
    assert all(w["reason"].startswith("healthd: ") for w in out)


def test_findings_sorted_by_tier_and_input_history_untouched():
    one, two = read_nvml([snap(NOW, nv=nvml(gpu(0, ecc_uncorrected_volatile=0))),
                          snap(NOW + 10, nv=nvml(gpu(0, ecc_uncorrected_volatile=4, margin_c=1)), k=kernel(xid(13, 0, NOW + 5)))])
    first = run(one)[0]
    before = first.history.to_json()
    second = run(two, history=first.history)[0]
    assert first.history.to_json() == before
    assert [f.tier for f in second.findings] == sorted(f.tier for f in second.findings)
    assert {f.tier for f in second.findings} == {1, 3} and "nvml.ecc_uncorrected:gpu0" in ids(second)
    assert second.history is not first.history and second.history.time == NOW + 10
