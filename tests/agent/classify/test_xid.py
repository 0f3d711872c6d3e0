"""Kernel-log Xid rules: catalog mapping, bursts, repeats, sympathetic 45, NVLink5, 154, persistence."""

from __future__ import annotations

import pytest

from healthd.agent.classify.catalog import load_catalog
from healthd.agent.classify import classify
from healthd.agent.history import History
from healthd.settings import XidOverride
from tests.support.builders import (
    BUS,
    NOW,
    get,
    gpu,
    ids,
    kernel,
    nvml,
    restart,
    run,
    settings,
    snap,
    texts,
    xid,
)

GPUS = nvml(*(gpu(i) for i in range(8)))


def one(*events, cfg=None, t=NOW + 5, history=None, nv=GPUS):
    return run(snap(t, nv=nv, k=kernel(*events)), cfg=cfg, history=history)[0]


def test_xid79_is_t1_hardware_drain_and_requeue_with_line_cursor_and_count():
    res = one(xid(79, 3, NOW, count=4, text="NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", cursor="s=1;i=77"))
    f = get(res, "xid:gpu3:79")
    assert (f.tier, f.attribution, f.action, f.source, f.xid, f.count) == (1, "hardware", "drain-and-requeue", "kernel_log", 79, 4)
    assert (f.component.index, f.component.uuid, f.component.serial, f.component.bus_id) == (3, "GPU-00000003", "1652000003", BUS[3])
    line = f.evidence[0]
    assert line.kind == "log_line" and "GPU has fallen off the bus." in line.text and "s=1;i=77" in line.text
    assert line.data["count"] == 4 and line.data["first_cursor"] == "s=1;i=77" and line.data["last_cursor"] == "s=1;i=77+3"
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in texts(f) and "RESTART_BM" in texts(f)
    assert f.summary == "xid 79 gpu3: fell off the bus"
    assert res.verdict == "failed"
    assert res.would_do[0] == {"action": "drain-and-requeue", "component": "gpu3", "reason": "healthd: xid 79 gpu3: fell off the bus",
                               "finding": "xid:gpu3:79", "tier": 1}


def test_synthesized_fallen_off_bus_line_says_so():
    f = get(one(xid(79, 2, NOW, text="NVRM: GPU 0000:3a:00.0: GPU has fallen off the bus.", synthesized=True)), "xid:gpu2:79")
    assert "read as Xid 79" in f.evidence[0].text


def test_catalog_tiers_map_for_t2_rows():
    res = one(xid(63, 1, NOW), xid(119, 2, NOW), xid(74, 4, NOW))
    assert (get(res, "xid:gpu1:63").tier, get(res, "xid:gpu1:63").action) == (2, "reset-gpu-when-idle")
    assert (get(res, "xid:gpu2:119").attribution, get(res, "xid:gpu2:119").action) == ("software", "reboot-when-idle")
    assert get(res, "xid:gpu4:74").attribution == "fabric"
    assert res.verdict == "degraded"


def test_unknown_xid_is_t3_unknown_not_in_catalog():
    f = get(one(xid(201, 0, NOW)), "xid:gpu0:201")
    assert (f.tier, f.attribution, f.action) == (3, "unknown", "none")
    assert f.summary == "xid 201 gpu0: Xid 201 not in catalog" and "(not in catalog)" in texts(f)


def test_single_xid13_is_t3_user():
    f = get(one(xid(13, 5, NOW)), "xid:gpu5:13")
    assert (f.tier, f.attribution, f.action) == (3, "user", "none")
    assert "1 burst(s) on gpu5" in texts(f)


def test_xid13_repeating_on_the_same_gpu_is_t2_hardware_suspect():
    hour = 3600.0
    res = run(*(snap(NOW + k * hour, nv=GPUS, k=kernel(xid(13, 5, NOW + k * hour))) for k in range(3)))
    first, last = get(res[0], "xid:gpu5:13"), get(res[-1], "xid:gpu5:13")
    assert first.tier == 3
    assert (last.tier, last.attribution, last.action) == (2, "hardware", "drain")
    assert "3 bursts on gpu5" in texts(last) and "on no other GPU" in texts(last)
    assert last.count == 3 and last.first_seen == NOW  # lines 1 h apart (= ttl) extend one episode
    assert "hardware suspect" in last.summary


def test_xid13_across_different_gpus_is_user_code_even_when_repeating():
    hour = 3600.0
    # the same job bug hits gpu5 three times and gpu6 once
    ticks = [snap(NOW + k * hour, nv=GPUS, k=kernel(xid(13, 5, NOW + k * hour))) for k in range(3)]
    ticks.append(snap(NOW + 2 * hour + 10, nv=GPUS, k=kernel(xid(13, 6, NOW + 2 * hour + 5))))
    res = run(*ticks)[-1]
    f5, f6 = get(res, "xid:gpu5:13"), get(res, "xid:gpu6:13")
    assert (f5.tier, f5.attribution) == (3, "user") and (f6.tier, f6.attribution) == (3, "user")
    assert "also seen on gpu6" in texts(f5) and "the application, not this GPU" in texts(f5)
    assert "also seen on gpu5" in texts(f6)
    assert res.verdict == "degraded" and res.would_do == ()


def test_one_crash_printing_many_lines_is_one_occurrence():
    # one crash prints a line per SM within a second: one burst, not three repeats
    lines = [xid(13, 1, NOW + k * 0.1, text=f"NVRM: Xid (PCI:0000:2a:00): 13, Graphics SM Warp Exception on (GPC 0, TPC {k}, SM 0)") for k in range(5)]
    f = get(one(*lines), "xid:gpu1:13")
    assert f.tier == 3 and f.count == 5


def test_xid13_same_gpc_tpc_rule():
    hour = 3600.0
    ticks = [snap(NOW + k * hour, nv=GPUS, k=kernel(xid(13, 1, NOW + k * hour, gpc=1, tpc=k))) for k in range(3)]
    assert get(run(*ticks)[-1], "xid:gpu1:13").tier == 3  # different TPC each time: application
    ticks = [snap(NOW + k * hour, nv=GPUS, k=kernel(xid(13, 1, NOW + k * hour, gpc=1, tpc=3))) for k in range(3)]
    f = get(run(*ticks)[-1], "xid:gpu1:13")
    assert f.tier == 2 and "GPC 1, TPC 3" in f.summary


def test_xid31_repeat_respects_configured_count_and_window():
    cfg = settings(classify={"xid_repeat_count": 2, "xid_repeat_window_s": 7200.0})
    res = run(snap(NOW, nv=GPUS, k=kernel(xid(31, 0, NOW))), snap(NOW + 3000, nv=GPUS, k=kernel(xid(31, 0, NOW + 3000))), cfg=cfg)
    assert get(res[-1], "xid:gpu0:31").tier == 2
    res = run(snap(NOW, nv=GPUS, k=kernel(xid(31, 0, NOW))), snap(NOW + 8000, nv=GPUS, k=kernel(xid(31, 0, NOW + 8000))), cfg=cfg)
    assert get(res[-1], "xid:gpu0:31").tier == 3  # outside the window


def test_xid94_contained_is_user_unless_repeating():
    assert get(one(xid(94, 2, NOW)), "xid:gpu2:94").attribution == "user"
    hour = 3600.0
    res = run(*(snap(NOW + k * hour, nv=GPUS, k=kernel(xid(94, 2, NOW + k * hour))) for k in range(3)))
    f = get(res[-1], "xid:gpu2:94")
    assert (f.tier, f.attribution, f.action) == (2, "hardware", "drain")


def test_xid45_after_another_xid_on_the_same_gpu_is_part_of_its_incident():
    res = one(xid(48, 4, NOW), xid(45, 4, NOW + 3, count=12))
    assert "xid:gpu4:45" not in ids(res)
    f = get(res, "xid:gpu4:48")
    assert (f.tier, f.action, f.attribution) == (1, "drain", "hardware")
    assert f.summary == "xid 48 gpu4: double-bit ECC error (one incident with xid 45)"
    assert "same incident: xid 45 (ROBUST_CHANNEL_PREEMPTIVE_REMOVAL) on gpu4, 3s after xid 48: T3 hardware none" in texts(f)
    assert [e.data["xid"] for e in f.evidence if e.kind == "log_line"] == [48, 45]


def test_xid45_sympathetic_outcome_is_its_primarys_attribution():
    # without the incident rule (outside the window of a strong Xid) the 45's own outcome is kept
    from healthd.agent.classify import xid as rules
    from healthd.agent.classify.context import TickContext
    ctx = TickContext(snap(NOW + 5, nv=GPUS, k=kernel()), History(), load_catalog(), settings())
    for e in (xid(48, 4, NOW), xid(45, 4, NOW + 3, count=12)):
        rules.fold(ctx, e)
    rec = ctx.xids[f"{GPUS.gpus[4].bus_id}:45"]
    outcome, notes, suffix = rules.outcome_for(ctx, rec)
    assert (outcome.tier, outcome.attribution, outcome.action) == (3, "hardware", "none")
    assert suffix == " (sympathetic to xid 48)"
    assert "follows Xid 48 (ROBUST_CHANNEL_GPU_ECC_DBE) on gpu4 3s earlier" in " ".join(n.text for n in notes)


def test_xid45_primary_may_come_from_an_earlier_tick():
    res = run(snap(NOW, nv=GPUS, k=kernel(xid(79, 4, NOW))), snap(NOW + 60, nv=GPUS, k=kernel(xid(45, 4, NOW + 50))))
    f = get(res[-1], "xid:gpu4:79")
    assert (f.tier, f.action) == (1, "drain-and-requeue") and "one incident with xid 45" in f.summary
    assert "xid:gpu4:45" not in ids(res[-1])


def test_xid45_solo_or_late_or_other_gpu_is_t3_user():
    for events in ([xid(45, 4, NOW)], [xid(48, 4, NOW), xid(45, 4, NOW + 500)], [xid(48, 3, NOW), xid(45, 4, NOW + 1)]):
        f = get(one(*events, t=NOW + 600), "xid:gpu4:45")
        assert (f.tier, f.attribution, f.action) == (3, "user", "none")
        assert "sympathetic" not in f.summary


def test_xid45_never_escalates_however_often():
    res = run(*(snap(NOW + k * 600, nv=GPUS, k=kernel(xid(45, 1, NOW + k * 600, count=50))) for k in range(10)))
    f = get(res[-1], "xid:gpu1:45")
    assert f.tier == 3 and res[-1].would_do == ()


def test_nvlink5_by_printed_severity():
    res = one(
        xid(149, 0, NOW, text="NVRM: Xid (PCI:0000:18:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000)", nvlink_severity="Fatal", subcode=4),
        xid(149, 1, NOW, text="NVRM: Xid (PCI:0000:2a:00): 149, NETIR_BER_EVENT Non-fatal XC0 i0 Link 02", nvlink_severity="Non-fatal"),
        xid(145, 2, NOW, text="NVRM: Xid (PCI:0000:3a:00): 145, RLW_REMAP"),
    )
    fatal, benign, bare = get(res, "xid:gpu0:149"), get(res, "xid:gpu1:149"), get(res, "xid:gpu2:145")
    assert (fatal.tier, fatal.attribution, fatal.action) == (1, "fabric", "drain") and "(Fatal)" in fatal.summary
    assert "severity printed 'Fatal' (subcode 4)" in texts(fatal)
    assert (benign.tier, benign.action) == (3, "none")
    assert (bare.tier, bare.action) == (2, "reset-gpu-when-idle") and "no NVLink severity printed" in texts(bare)


def test_nvlink5_fatal_anywhere_in_the_episode_wins():
    res = run(snap(NOW, nv=GPUS, k=kernel(xid(149, 0, NOW, nvlink_severity="Non-fatal"))),
              snap(NOW + 10, nv=GPUS, k=kernel(xid(149, 0, NOW + 8, nvlink_severity="Fatal"))),
              snap(NOW + 20, nv=GPUS, k=kernel(xid(149, 0, NOW + 18, nvlink_severity="Non-fatal"))))
    assert get(res[-1], "xid:gpu0:149").tier == 1


def test_xid154_requests_the_action_it_names_at_t1_attributed_like_its_primary():
    text = "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    res = one(xid(119, 0, NOW), xid(154, 0, NOW + 1, text=text))
    # one incident: the id is the first Xid's, the outcome the announcement's
    assert "xid:gpu0:154" not in ids(res)
    f = get(res, "xid:gpu0:119")
    assert (f.tier, f.action, f.attribution) == (1, "reboot-when-idle", "software")
    assert "(Node Reboot Required)" in f.summary and "follows Xid 119" in texts(f) and "one incident with xid 119" in f.summary
    reset = get(one(xid(154, 1, NOW, text="NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")), "xid:gpu1:154")
    assert (reset.tier, reset.action, reset.attribution) == (1, "reset-gpu-when-idle", "unknown")
    none = get(one(xid(154, 1, NOW, text="NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)")), "xid:gpu1:154")
    assert (none.tier, none.action) == (3, "none")


@pytest.mark.parametrize("announced,action", [
    ("0x0 (None) to 0x1 (GPU Reset Required)", "reset-gpu-when-idle"),
    ("0x0 (None) to 0x2 (Node Reboot Required)", "reboot-when-idle"),
    ("0x0 (None) to 0x4 (Drain and Reset)", "reset-gpu-when-idle"),
    ("0x4 (Drain and Reset) to 0x1 (GPU Reset Required)", "reset-gpu-when-idle"),
    ("0x0 (None) to 0x3 (Drain P2P)", "reset-gpu-when-idle"),
])
def test_every_recovery_action_the_driver_names_is_t1(announced, action):
    f = get(one(xid(154, 1, NOW, text=f"NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from {announced}")), "xid:gpu1:154")
    assert (f.tier, f.action) == (1, action)
    assert f.id in {r["finding"] for r in one(xid(154, 1, NOW, text=f"NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from {announced}")).would_do}


def test_burst_accumulates_across_ticks_and_persists_until_ttl():
    cfg = settings(classify={"finding_ttl_s": 600.0})
    res = run(
        snap(NOW, nv=GPUS, k=kernel(xid(95, 6, NOW - 2, count=1000))),
        snap(NOW + 10, nv=GPUS, k=kernel(xid(95, 6, NOW + 5, count=500))),
        snap(NOW + 300, nv=GPUS),
        snap(NOW + 605, nv=GPUS),
        snap(NOW + 620, nv=GPUS),
        cfg=cfg,
    )
    f = get(res[1], "xid:gpu6:95")
    assert (f.count, f.first_seen, f.last_seen) == (1500, NOW - 2, NOW + 5 + 0.499)
    assert get(res[2], "xid:gpu6:95").count == 1500  # no new lines: still reported
    assert "xid:gpu6:95" in ids(res[3])  # 600 s after the last line
    assert "xid:gpu6:95" not in ids(res[4]) and res[4].verdict == "healthy"


def test_findings_and_repeat_counts_survive_a_restart():
    hour = 3600.0
    a = run(snap(NOW, nv=GPUS, k=kernel(xid(13, 5, NOW))), snap(NOW + hour, nv=GPUS, k=kernel(xid(13, 5, NOW + hour))))
    saved = restart(a[-1].history)
    b = run(snap(NOW + 2 * hour, nv=GPUS, k=kernel(xid(13, 5, NOW + 2 * hour))), history=saved)
    assert get(b[0], "xid:gpu5:13").tier == 2  # the 2 earlier bursts were remembered
    c = run(snap(NOW, nv=GPUS, k=kernel(xid(79, 1, NOW - 1, count=3))))
    d = run(snap(NOW + 100, nv=GPUS), snap(NOW + 110, nv=GPUS, k=kernel(xid(79, 1, NOW + 105, count=2))), history=restart(c[0].history))
    assert get(d[0], "xid:gpu1:79").count == 3 and get(d[1], "xid:gpu1:79").count == 5
    assert get(d[1], "xid:gpu1:79").first_seen == NOW - 1


def test_xid_of_a_gpu_nvml_no_longer_lists_keeps_its_identity():
    # tick 1: NVML sees all 8 GPUs; tick 2: gpu3 is gone from NVML and the kernel says why
    res = run(snap(NOW, nv=GPUS), snap(NOW + 10, nv=nvml(*(gpu(i) for i in range(8) if i != 3)), k=kernel(xid(79, 3, NOW + 8))))
    f = get(res[-1], "xid:gpu3:79")
    assert f.component.uuid == "GPU-00000003" and f.component.index == 3


def test_xid_without_nvml_uses_kernel_identities():
    k = kernel(xid(48, 2, NOW), identities={BUS[2]: ("GPU-from-kernel", "SER-K")})
    res = run(snap(NOW + 1, k=k))[0]
    f = get(res, f"xid:gpu[{BUS[2]}]:48")
    assert (f.component.uuid, f.component.serial, f.component.index) == ("GPU-from-kernel", "SER-K", None)


def test_xid_without_bus_id_is_a_node_finding():
    assert "xid:node:79" in ids(one(xid(79, None, NOW)))


def test_ignore_override_suppresses_but_keeps_for_metrics():
    cat = load_catalog(overrides={43: XidOverride(ignore=True)})
    res = classify(snap(NOW + 1, nv=GPUS, k=kernel(xid(43, 0, NOW))), History(), cat, settings())
    assert "xid:gpu0:43" not in ids(res) and [f.id for f in res.suppressed] == ["xid:gpu0:43"]
    assert res.verdict == "healthy"


def test_override_changes_tier_and_evidence_says_so():
    cat = load_catalog(overrides={109: XidOverride(tier=2, action="reset-gpu-when-idle", attribution="hardware")})
    f = get(classify(snap(NOW + 1, nv=GPUS, k=kernel(xid(109, 0, NOW))), History(), cat, settings()), "xid:gpu0:109")
    assert (f.tier, f.action) == (2, "reset-gpu-when-idle") and "site override: action, attribution, tier" in texts(f)


def test_reboot_closes_reset_and_reboot_findings_but_not_drains():
    res = run(snap(NOW, nv=GPUS, k=kernel(xid(119, 0, NOW), xid(79, 1, NOW))),
              snap(NOW + 300, nv=GPUS, boot_id="boot-2"))
    assert "xid:gpu0:119" in ids(res[0]) and "xid:gpu0:119" not in ids(res[1])
    assert "xid:gpu1:79" in ids(res[1])


def test_old_lines_read_at_startup_count_for_repeats_but_raise_no_finding():
    # start_at=boot reads lines from hours ago: outside the ttl they are history, not findings
    res = one(xid(13, 0, NOW - 5 * 3600), t=NOW)
    assert "xid:gpu0:13" not in ids(res) and res.history.xids
