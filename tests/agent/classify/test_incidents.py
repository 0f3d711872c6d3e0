"""What real drivers print, classified: the recovery the driver announces (154), fatal NVLink errors of
every generation, GPUs that fail to initialise (and NVML's missing GPU), and sequences on one GPU as
one incident with the strongest action."""

from __future__ import annotations

import dataclasses

import pytest

from healthd.agent.classify.catalog import NVIDIA_EQUIVALENT, load_catalog, parse_catalog
from healthd.agent.classify.xid import INIT_FAILED_XID, listed
from healthd.controller.policy import ControllerPolicySettings, FleetView, LedgerView, NodeReport, decide
from healthd.model import ACTIONS
from healthd.slurm.backend import NodeInfo
from healthd.slurm.scontrol import ScontrolBackend
from tests.support.builders import BUS, NOW, get, gpu, ids, kernel, nvml, run, settings, snap, texts, xid

GPUS = nvml(*(gpu(i) for i in range(8)))


def one(*events, cfg=None, t=NOW + 5, nv=GPUS):
    return run(snap(t, nv=nv, k=kernel(*events)), cfg=cfg)[0]


# --------------------------------------------------------------------------- 154: the announced recovery


def test_a_t1_reboot_when_idle_ends_as_scontrol_reboot_asap_with_a_healthd_reason(tmp_path):
    """The controller's side, read not changed: T1 reboot-when-idle is a reboot-asap decision, which
    auto mode applies at once, written as `scontrol reboot ASAP` (Slurm drains the node first, so no
    new job lands) with a `healthd:` reason."""
    text = "NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    res = one(xid(154, 1, NOW, text=text))
    f = get(res, "xid:gpu1:154")
    assert (f.tier, f.action) == (1, "reboot-when-idle")
    fleet = FleetView.build([NodeReport(node="gpu001", verdict=res.verdict, findings=res.findings, received_at=NOW)],
                            [NodeInfo(name="gpu001", state="mixed", partitions=("gpu",))], "", ControllerPolicySettings())
    [d] = decide(fleet, LedgerView(), ControllerPolicySettings(), NOW + 1)
    assert (d.kind, d.tier) == ("reboot-asap", 1)
    assert d.reason.startswith("healthd: xid 154 gpu1: GPU recovery action changed (Node Reboot Required)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\n")
    argv = ScontrolBackend(str(conf), runner=lambda *a, **k: None)._argv_reboot_asap("gpu001", d.reason)
    assert argv[:4] == ["scontrol", "reboot", "ASAP", "nextstate=RESUME"] and argv[4] == f"reason={d.reason}"


# --------------------------------------------------------------------------- fatal NVLink, every generation


def test_a_fatal_nvlink_error_gets_one_outcome_whichever_generation_reports_it():
    res = one(
        xid(74, 0, NOW, text="NVRM: Xid (PCI:0000:18:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error "
            "detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", nvlink_severity="Fatal"),
        xid(149, 1, NOW, text="NVRM: Xid (PCI:0000:2a:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x0)",
            nvlink_severity="Fatal", subcode=4),
        xid(74, 2, NOW, text="NVRM: Xid (PCI:0000:3a:00): 74, NVLink: nonfatal error detected on link 2(0x0)",
            nvlink_severity="Non-fatal"),
        xid(74, 3, NOW),
    )
    old, new = get(res, "xid:gpu0:74"), get(res, "xid:gpu1:149")
    assert (old.tier, old.attribution, old.action) == (new.tier, new.attribution, new.action) == (1, "fabric", "drain")
    assert "NVLink severity printed 'Fatal'" in texts(old)
    assert (get(res, "xid:gpu2:74").tier, get(res, "xid:gpu2:74").action) == (3, "none")
    assert (get(res, "xid:gpu3:74").tier, get(res, "xid:gpu3:74").action) == (2, "reboot-when-idle")
    cat = load_catalog()
    assert all(cat.lookup(x).severity == cat.lookup(74).severity for x in range(144, 151))


# --------------------------------------------------------------------------- GPUs that fail to initialise


def init_line(i: int, t: float, text: str | None = None, **kw):
    bus = BUS[i]
    short = f"{bus[4:8]}:{bus[9:11].lower()}:00.0"
    return xid(INIT_FAILED_XID, i, t, text=text or f"NVRM: GPU {short}: RmInitAdapter failed! (0x62:0x40:2393)",
               synthesized=True, **kw)


def test_a_gpu_that_fails_to_initialise_is_t1_reboot_naming_bus_and_serial_known_from_earlier():
    seven = nvml(*(gpu(i) for i in range(8) if i != 5))
    res = run(snap(NOW - 600, nv=GPUS), snap(NOW + 5, nv=seven, k=kernel(init_line(5, NOW))), cfg=settings())[-1]
    f = get(res, "xid:gpu5:143")
    assert (f.tier, f.attribution, f.action) == (1, "hardware", "reboot-when-idle")
    assert (f.component.bus_id, f.component.serial, f.component.uuid) == (BUS[5], "1652000005", "GPU-00000005")
    assert "a GPU that failed to initialise read as Xid 143" in f.evidence[0].text
    assert "RmInitAdapter failed!" in f.evidence[0].text


def test_nvml_missing_gpu_and_the_init_failure_are_one_finding():
    cfg = settings(nvml={"expected_gpus": 8})
    seven = nvml(*(gpu(i) for i in range(8) if i != 5))
    res = run(snap(NOW - 600, nv=GPUS), snap(NOW + 5, nv=seven, k=kernel(init_line(5, NOW))), cfg=cfg)[-1]
    assert "nvml.gpu_count:node" not in ids(res)
    f = get(res, "xid:gpu5:143")
    assert f.summary.endswith("NVML sees 7 of 8 GPUs")
    assert "nvmlDeviceGetCount = 7, expected 8" in texts(f)
    # two missing, one explained: the count finding stays and names the one that failed to initialise
    six = nvml(*(gpu(i) for i in range(8) if i not in (5, 6)))
    res = run(snap(NOW - 600, nv=GPUS), snap(NOW + 5, nv=six, k=kernel(init_line(5, NOW))), cfg=cfg)[-1]
    count = get(res, "nvml.gpu_count:node")
    assert f"{BUS[5]} failed to initialise" in count.summary and "xid:gpu5:143" in texts(count)


def test_the_init_failure_stays_while_nvml_still_lacks_the_gpu():
    cfg = settings(nvml={"expected_gpus": 8}, classify={"finding_ttl_s": 600.0})
    seven = nvml(*(gpu(i) for i in range(8) if i != 5))
    res = run(snap(NOW - 600, nv=GPUS), snap(NOW + 5, nv=seven, k=kernel(init_line(5, NOW))),
              snap(NOW + 4000, nv=seven), cfg=cfg)[-1]
    assert "xid:gpu5:143" in ids(res) and "nvml.gpu_count:node" not in ids(res)


def test_an_init_failure_that_comes_back_after_the_reboot_needs_hardware_inspection():
    cfg = settings(classify={"xid_repeat_count": 2})
    seven = nvml(*(gpu(i) for i in range(8) if i != 5))
    first = snap(NOW, nv=seven, k=kernel(init_line(5, NOW)))
    after_reboot = snap(NOW + 1200, nv=seven, k=kernel(init_line(5, NOW + 1190)), boot_id="b2")
    res = run(snap(NOW - 600, nv=GPUS), first, after_reboot, cfg=cfg)
    assert get(res[1], "xid:gpu5:143").action == "reboot-when-idle"
    f = get(res[-1], "xid:gpu5:143")
    assert (f.tier, f.action) == (1, "inspect-hardware") and "repeated 2x on this GPU" in f.summary


def test_an_init_failure_without_a_bus_id_is_a_node_finding():
    res = one(xid(INIT_FAILED_XID, None, NOW, text="NVRM: RmInitAdapter failed! (0x27:0x38:1193)", synthesized=True))
    f = get(res, "xid:node:143")
    assert (f.tier, f.action) == (1, "reboot-when-idle") and f.component.bus_id is None


# --------------------------------------------------------------------------- one incident per GPU


def test_dbe_then_remap_then_remap_failure_is_one_incident_with_the_strongest_action():
    res = one(xid(48, 2, NOW), xid(63, 2, NOW + 1), xid(64, 2, NOW + 2))
    assert [f.id for f in res.findings if f.source == "kernel_log"] == ["xid:gpu2:48"]
    f = get(res, "xid:gpu2:48")
    assert (f.tier, f.action) == (1, "inspect-hardware")
    assert f.summary == "xid 64 gpu2: memory row remap / page retirement failed (one incident with xid 48, xid 63)"
    assert listed([dataclasses.replace(f, xid=x) for x in (8, 13, 14, 31, 32, 38)]) == "xid 8, xid 13, xid 14, xid 31 and 2 more"
    assert {e.data["xid"] for e in f.evidence if e.kind == "log_line"} == {48, 63, 64}
    assert "same incident: xid 63 (INFOROM_DRAM_RETIREMENT_EVENT) on gpu2, 1s after xid 48" in texts(f)
    assert [r["finding"] for r in res.would_do] == ["xid:gpu2:48"]


def test_pmu_halt_then_announced_reset_is_one_incident_keeping_the_first_id_across_ticks():
    text = "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    res = run(snap(NOW + 1, nv=GPUS, k=kernel(xid(62, 0, NOW))),
              snap(NOW + 11, nv=GPUS, k=kernel(xid(154, 0, NOW + 2, text=text), xid(45, 0, NOW + 3))))
    assert get(res[0], "xid:gpu0:62").action == "drain"
    later = [f for f in res[1].findings if f.source == "kernel_log"]
    assert [f.id for f in later] == ["xid:gpu0:62"]
    # both T1: the drain outranks the reset it announces, and the announcement is in the evidence
    assert (later[0].tier, later[0].action) == (1, "drain")
    assert "GPU recovery action changed" in texts(later[0]) and "one incident with xid 154, xid 45" in later[0].summary


def test_fallen_off_the_bus_and_its_cascade_are_one_incident():
    res = one(xid(79, 3, NOW), xid(45, 3, NOW + 0.5, count=30), xid(154, 3, NOW + 1, text=(
        "NVRM: Xid (PCI:0000:5d:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")))
    [f] = [f for f in res.findings if f.source == "kernel_log"]
    assert (f.id, f.tier, f.action) == ("xid:gpu3:79", 1, "drain-and-requeue")


def test_xids_apart_in_time_or_on_other_gpus_stay_apart():
    res = one(xid(48, 2, NOW), xid(63, 2, NOW + 500), xid(63, 3, NOW + 1), t=NOW + 600)
    assert {"xid:gpu2:48", "xid:gpu2:63", "xid:gpu3:63"} <= ids(res)
    assert get(res, "xid:gpu2:63").action == "reset-gpu-when-idle"


# --------------------------------------------------------------------------- the catalog against NVIDIA's buckets


def test_every_row_whose_action_differs_from_nvidias_bucket_says_why():
    cat = load_catalog()
    silent = [x for x in cat.xids() if cat.lookup(x).differs_from_nvidia and not cat.lookup(x).differs]
    assert not silent, f"catalog rows acting unlike NVIDIA's immediate bucket without a `differs` reason: {silent}"
    needless = [x for x in cat.xids() if cat.lookup(x).differs and not cat.lookup(x).differs_from_nvidia]
    assert not needless, f"`differs` on rows that do what NVIDIA says: {needless}"
    assert {109, 119, 120} <= {x for x in cat.xids() if cat.lookup(x).differs}
    assert set(NVIDIA_EQUIVALENT.values()) - {None} <= set(ACTIONS)


def test_a_new_row_that_differs_is_caught():
    row = """
version: 1
xids:
  - xid: 999
    mnemonic: NEW
    description: new
    nvidia_immediate: RESET_GPU
    nvidia_investigatory: ""
    attribution: hardware
    tier: 1
    action: drain
    source: https://docs.nvidia.com/x
"""
    entry = parse_catalog(row)[999]
    assert entry.differs_from_nvidia and not entry.differs


@pytest.mark.parametrize("x", [109, 119, 120])
def test_the_reason_is_in_the_findings_evidence(x):
    f = get(one(xid(x, 1, NOW)), f"xid:gpu1:{x}")
    assert "differs from NVIDIA" in texts(f)


def test_an_init_failure_is_named_by_the_board_the_driver_announced_in_an_earlier_tick():
    from healthd.model import KernelSample
    uuid = "GPU-509665ad-1c2d-3e4f-5a6b-7c8d9e0f1a2b"
    earlier = KernelSample(status="ok", identities={BUS[5]: (uuid, "1652823054928")})
    res = run(snap(NOW - 600, k=earlier), snap(NOW + 5, k=kernel(init_line(5, NOW))))[-1]
    f = get(res, f"xid:gpu[{BUS[5]}]:143")
    assert (f.component.uuid, f.component.serial) == (uuid, "1652823054928")
