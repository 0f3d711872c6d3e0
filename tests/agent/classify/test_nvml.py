"""NVML rules: driver/hung, lost, count, remap/retire, ECC, PCIe, slowdown, thermal, NVLink."""

from __future__ import annotations

from tests.support.builders import NOW, get, gpu, ids, kernel, nvml, run, settings, snap, texts, xid


def tick(t, *gpus, **kw):
    return snap(t, nv=nvml(*gpus, **kw))


def test_driver_not_loaded_is_software_t2_reboot_not_a_gpu_fault():
    for kind in ("driver_not_loaded", "init_failed"):
        res = run(snap(NOW, nv=nvml(status="error", error_kind=kind, detail="Driver/library version mismatch")))[0]
        f = get(res, "nvml.driver:node")
        assert (f.tier, f.attribution, f.action, f.component.kind) == (2, "software", "reboot-when-idle", "node")
        assert "Driver/library version mismatch" in f.summary and f"error_kind {kind}" in texts(f)
        assert "collector.nvml:node" not in ids(res) and res.verdict == "degraded"


def test_nvml_timeout_is_nvml_hung():
    f = get(run(snap(NOW, nv=nvml(status="error", error_kind="timeout", detail="collection exceeded 5.0s")))[0], "nvml.hung:node")
    assert (f.tier, f.attribution, f.action) == (2, "unknown", "reboot-when-idle") and f.summary.startswith("NVML hung")


def test_other_nvml_error_is_a_t3_collector_finding():
    f = get(run(snap(NOW, nv=nvml(status="error", error_kind="other", detail="NVML_ERROR_UNKNOWN")))[0], "collector.nvml:node")
    assert (f.tier, f.attribution, f.action) == (3, "unknown", "none") and f.summary == "could not check nvml: NVML_ERROR_UNKNOWN"


def test_no_nvml_on_a_node_expected_to_have_gpus():
    cfg = settings(nvml={"expected_gpus": 8})
    res = run(snap(NOW, nv=nvml(status="no_data", detail="libnvidia-ml.so.1 not found")), cfg=cfg)[0]
    assert get(res, "nvml.driver:node").attribution == "software"
    assert run(snap(NOW, nv=nvml(status="no_data", detail="libnvidia-ml.so.1 not found")))[0].findings == ()


def test_lost_gpu_is_t1_hardware():
    f = get(run(tick(NOW, gpu(0), gpu(1, lost=True, lost_detail="NVML_ERROR_GPU_IS_LOST")))[0], "nvml.lost:gpu1")
    assert (f.tier, f.attribution, f.action) == (1, "hardware", "drain-and-requeue") and "GPU_IS_LOST" in texts(f)


def test_gpu_lost_at_handle_lookup_keeps_its_identity_and_joins_its_xid_79():
    from healthd.model import GpuSample

    seen = gpu(3)
    lost = GpuSample(index=3, lost=True, lost_detail="nvmlDeviceGetHandleByIndex: GPU is lost")
    bus = seen.bus_id.lower()[4:].rsplit(".", 1)[0]
    res = run(tick(NOW, gpu(0), seen),
              snap(NOW + 10, nv=nvml(gpu(0), lost), k=kernel(xid(79, None, NOW + 9, bus_id=bus))))[1]
    f = get(res, "nvml.lost:gpu3")
    assert (f.component.uuid, f.component.serial, f.component.bus_id) == (seen.uuid, seen.serial, seen.bus_id)
    x = get(res, "xid:gpu3:79")
    assert x.component.index == 3 and x.component.serial == seen.serial


def test_fewer_gpus_than_expected_names_the_missing_bus():
    cfg = settings(nvml={"expected_gpus": 3})
    res = run(tick(NOW, gpu(0), gpu(1), gpu(2)), tick(NOW + 10, gpu(0), gpu(2)), cfg=cfg)
    assert "nvml.gpu_count:node" not in ids(res[0])
    f = get(res[1], "nvml.gpu_count:node")
    assert (f.tier, f.attribution, f.action) == (1, "hardware", "drain") and f.summary == "2 of 3 GPUs visible to NVML"
    assert "missing now: 00000000:2A:00.0" in texts(f)


def test_remap_failure_pending_and_retirement():
    res = run(tick(NOW, gpu(0, remap_failure=True, remap_uncorrected=3), gpu(1, remap_pending=True, remap_uncorrected=1), gpu(2, retired_pending=True, retired_pages_dbe=2)))[0]
    fail, pend, ret = get(res, "nvml.remap_failure:gpu0"), get(res, "nvml.remap_pending:gpu1"), get(res, "nvml.retired_pending:gpu2")
    assert (fail.tier, fail.attribution, fail.action) == (1, "hardware", "inspect-hardware")
    assert (pend.tier, pend.action) == (2, "reset-gpu-when-idle") and "isPending=1" in texts(pend)
    assert (ret.tier, ret.action) == (2, "reset-gpu-when-idle") and "2 DBE" in texts(ret)


def test_uncorrected_ecc_increase_without_pending_remap_is_t1_and_held_for_ttl():
    cfg = settings(classify={"finding_ttl_s": 100.0})
    res = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=2)), tick(NOW + 10, gpu(0, ecc_uncorrected_volatile=5)),
              tick(NOW + 100, gpu(0, ecc_uncorrected_volatile=5)), tick(NOW + 111, gpu(0, ecc_uncorrected_volatile=5)), cfg=cfg)
    assert res[0].findings == ()  # first reading is a baseline
    f = get(res[1], "nvml.ecc_uncorrected:gpu0")
    assert (f.tier, f.attribution, f.action, f.count) == (1, "hardware", "drain", 3)
    assert "volatile uncorrected ECC 2 -> 5 (+3) in 10s" in texts(f)
    assert "nvml.ecc_uncorrected:gpu0" in ids(res[2]) and "nvml.ecc_uncorrected:gpu0" not in ids(res[3])


def test_uncorrected_ecc_increase_with_remap_pending_is_t2_reset():
    res = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=0)), tick(NOW + 10, gpu(0, ecc_uncorrected_volatile=1, remap_pending=True)))
    f = get(res[1], "nvml.ecc_uncorrected:gpu0")
    assert (f.tier, f.action) == (2, "reset-gpu-when-idle")


def test_uncorrected_ecc_on_a_driver_that_cannot_read_the_remap_state_drains_and_says_it_is_unknown():
    known = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=0, remap_pending=False, retired_pending=False)),
                tick(NOW + 10, gpu(0, ecc_uncorrected_volatile=1, remap_pending=False, retired_pending=False)))
    unread = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=0, remap_pending=None, retired_pending=None)),
                 tick(NOW + 10, gpu(0, ecc_uncorrected_volatile=1, remap_pending=None, retired_pending=None)))
    a, b = get(known[1], "nvml.ecc_uncorrected:gpu0"), get(unread[1], "nvml.ecc_uncorrected:gpu0")
    assert (a.tier, a.action) == (b.tier, b.action) == (1, "drain")
    assert a.summary.endswith("; no remap pending") and b.summary.endswith("; remap state unknown (not readable here)")


def test_counter_reset_is_not_a_delta():
    res = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=9)), tick(NOW + 10, gpu(0, ecc_uncorrected_volatile=0)), tick(NOW + 20, gpu(0, ecc_uncorrected_volatile=0)))
    assert all(r.findings == () for r in res)


def test_sbe_rate_over_the_hour():
    cfg = settings(classify={"ecc_sbe_per_hour": 100.0})
    snaps = [tick(NOW + k * 60, gpu(0, ecc_corrected_volatile=5 * k)) for k in range(25)]
    res = run(*snaps, cfg=cfg)
    assert "nvml.ecc_sbe_rate:gpu0" not in ids(res[19])  # 95 in 19 min
    f = get(res[24], "nvml.ecc_sbe_rate:gpu0")
    assert (f.tier, f.attribution, f.action) == (2, "hardware", "none") and "120 corrected (single-bit) ECC errors in the last 1h00m" in texts(f)


def test_pcie_replay_rate():
    res = run(tick(NOW, gpu(0, pcie_replay=100)), tick(NOW + 10, gpu(0, pcie_replay=103)), tick(NOW + 20, gpu(0, pcie_replay=120)))
    assert "nvml.pcie_replay:gpu0" not in ids(res[1])
    f = get(res[2], "nvml.pcie_replay:gpu0")
    assert (f.tier, f.attribution, f.action) == (2, "hardware", "drain") and "+20 in the last 60s" in texts(f)


def test_pcie_width_below_max_is_t2_gen_only_noted_when_busy():
    res = run(tick(NOW, gpu(0, pcie_width=8, pcie_width_max=16, pcie_gen=5, pcie_gen_max=5),
                   gpu(1, pcie_width=16, pcie_width_max=16, pcie_gen=1, pcie_gen_max=5, clock_event_reasons=0x1),
                   gpu(2, pcie_width=16, pcie_width_max=16, pcie_gen=3, pcie_gen_max=5, clock_event_reasons=0x0),
                   gpu(3, pcie_width=16, pcie_width_max=16, pcie_gen=1, pcie_gen_max=5)))[0]
    w = get(res, "nvml.pcie_width:gpu0")
    assert (w.tier, w.action) == (2, "drain") and w.summary == "gpu0: PCIe link x8 of x16"
    assert "nvml.pcie_gen:gpu1" not in ids(res)  # idle: power saving
    assert "nvml.pcie_gen:gpu3" not in ids(res)  # idle state unknown
    assert get(res, "nvml.pcie_gen:gpu2").tier == 3


def test_hw_slowdown_rate_over_window():
    cfg = settings(classify={"hw_slowdown_window_s": 600.0, "hw_slowdown_per_min": 0.6}, interval_s=10.0)
    # slowdown bit set on 6 ticks: 0.6/min, not above; on the 7th it is
    snaps = [tick(NOW + k * 10, gpu(0, clock_event_reasons=0x40 if k < 7 else 0x1)) for k in range(10)]
    res = run(*snaps, cfg=cfg)
    assert "nvml.hw_slowdown:gpu0" not in ids(res[5])
    f = get(res[6], "nvml.hw_slowdown:gpu0")
    assert (f.tier, f.attribution, f.action) == (2, "hardware", "drain") and "HwThermalSlowdown" in texts(f)
    assert "nvml.hw_slowdown:gpu0" in ids(res[9])  # still within the window


def test_hw_slowdown_same_sample_classified_twice_counts_its_time_once():
    cfg = settings(interval_s=10.0)
    g = gpu(0, clock_event_reasons=0x8)
    # 5 real samples, each classified 3 times (every ~3 s): 50 s of slowdown, not 150
    snaps = [tick(NOW + k * 10 + j * 3, g) for k in range(5) for j in range(3)]
    res = run(*snaps, cfg=cfg)
    assert "nvml.hw_slowdown:gpu0" not in ids(res[-1])


def test_thermal_margin():
    f = get(run(tick(NOW, gpu(0, margin_c=3, temperature_c=84, slowdown_threshold_c=87)))[0], "nvml.thermal:gpu0")
    assert (f.tier, f.attribution, f.action) == (3, "hardware", "none") and "3 C from thermal slowdown" in f.summary


def test_nvlink_counters_increasing_is_t2_fabric():
    res = run(tick(NOW, gpu(0, nvlink_errors={"link0.crc_flit": 10, "link3.replay": 0})),
              tick(NOW + 10, gpu(0, nvlink_errors={"link0.crc_flit": 14, "link3.replay": 0})))
    f = get(res[1], "nvml.nvlink:gpu0")
    assert (f.tier, f.attribution, f.action, f.count) == (2, "fabric", "reboot-when-idle", 4)
    assert "NVLink link0.crc_flit 10 -> 14 (+4) in 10s" in texts(f)


def test_field_read_errors_are_t3_unknown():
    f = get(run(tick(NOW, gpu(0, errors={"ecc_corrected_volatile": "NVML_ERROR_UNKNOWN"})))[0], "nvml.read_error:gpu0")
    assert (f.tier, f.attribution) == (3, "unknown") and "ecc_corrected_volatile: NVML_ERROR_UNKNOWN" in texts(f)


def test_boot_change_forgets_volatile_baselines():
    res = run(tick(NOW, gpu(0, ecc_uncorrected_volatile=5)), snap(NOW + 600, nv=nvml(gpu(0, ecc_uncorrected_volatile=7)), boot_id="boot-2"))
    assert res[1].findings == ()
