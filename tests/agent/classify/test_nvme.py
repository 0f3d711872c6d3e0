"""NVMe rules: a critical warning (T2 storage, drain), wear at the configured percentage (T3), a rise of
media errors held for its own window (T2) and counted once however often a sample is classified, and a
SMART log that is missing, garbage or stale (T3 unknown, its values unused)."""

from __future__ import annotations

import dataclasses

from healthd.agent.collectors.nvme import NvmeController, NvmeSample, SmartLog
from healthd.model import CounterDelta
from tests.support.builders import NOW, get, ids, restart, run, settings, snap, texts

HOUR = 3600.0


HEALTHY = SmartLog(critical_warning=0, percentage_used=3, media_errors=0)


def drive(name: str = "nvme0", *, smart: SmartLog | None = HEALTHY,
          media: CounterDelta | None = None, smart_at: float | None = None, serial: str = "S64HNE0T000001") -> NvmeController:
    return NvmeController(name=name, model="SAMSUNG MZQL23T8HCLS-00A07", serial=serial, firmware="GDC5602Q", state="live",
                          smart=smart, smart_at=smart_at, media_errors=media)


def tick(t: float, *drives: NvmeController, read_at: float | None = None):
    sample = NvmeSample(status="ok", controllers=drives, time=t if read_at is None else read_at)
    return dataclasses.replace(snap(t), samples={"nvme": sample})


def nvme_ids(res) -> set[str]:
    return {i for i in ids(res) if i.startswith("nvme.")}


def test_a_healthy_drive_raises_nothing():
    (res,) = run(tick(NOW, drive(smart_at=NOW - 60)))
    assert res.verdict == "healthy" and not res.findings


def test_a_critical_warning_is_t2_storage_and_asks_for_a_drain():
    (res,) = run(tick(NOW, drive(smart=SmartLog(critical_warning=0x0C, percentage_used=40, media_errors=0,
                                                available_spare=100, available_spare_threshold=10))))
    f = get(res, "nvme.critical_warning:nvme0")
    assert (f.tier, f.attribution, f.action, f.source) == (2, "storage", "drain", "nvme")
    assert f.summary == "nvme0: critical warning 0x0c: NVM subsystem reliability degraded, media placed in read-only mode"
    assert (f.component.kind, f.component.device, f.component.serial) == ("node", "nvme0", "S64HNE0T000001")
    assert "SAMSUNG MZQL23T8HCLS-00A07" in texts(f) and f.evidence[0].data["bits"] == [
        "NVM subsystem reliability degraded", "media placed in read-only mode"]
    assert res.verdict == "degraded" and res.would_do[0]["action"] == "drain"


def test_wear_at_the_configured_percentage_is_t3():
    cfg = settings(nvme={"wear_warn_pct": 80})
    below, at, past = (drive(n, smart=SmartLog(critical_warning=0, percentage_used=p, media_errors=0))
                       for n, p in (("nvme0", 79), ("nvme1", 80), ("nvme2", 104)))
    (res,) = run(tick(NOW, below, at, past), cfg=cfg)
    assert nvme_ids(res) == {"nvme.wear:nvme1", "nvme.wear:nvme2"}
    f = get(res, "nvme.wear:nvme2")
    assert (f.tier, f.attribution, f.action) == (3, "storage", "none")
    assert f.summary == "nvme2: 104% of its rated endurance used (warn at 80%)"
    (res,) = run(tick(NOW, past))
    assert nvme_ids(res) == {"nvme.wear:nvme2"}  # the default warns at 90


def test_a_rise_of_media_errors_is_held_for_its_own_window_and_counted_once():
    cfg = settings(nvme={"media_errors_window_s": 6 * HOUR})
    rose = drive(smart=SmartLog(critical_warning=0, percentage_used=3, media_errors=7),
                 media=CounterDelta(value=7, delta=2, window_s=10.0))
    same = drive(smart=rose.smart, media=CounterDelta(value=7, delta=0, window_s=10.0))
    first, again, later = run(
        tick(NOW, rose),
        tick(NOW + 5, rose, read_at=NOW),  # the kernel follower ticked: the same sample classified again
        tick(NOW + 2 * HOUR, same),  # past the hour NVML's and InfiniBand's windows keep
        cfg=cfg,
    )
    for res in (first, again, later):
        f = get(res, "nvme.media_errors:nvme0")
        assert (f.tier, f.attribution, f.action) == (2, "storage", "none")
        assert f.summary == "nvme0: media errors rose by 2 in the last 6h00m (now 7)"
    (gone,) = run(tick(NOW + 6 * HOUR + 10, same), history=later.history, cfg=cfg)
    assert "nvme.media_errors:nvme0" not in ids(gone)


def test_the_media_errors_window_survives_a_restart():
    rose = drive(media=CounterDelta(value=1, delta=1, window_s=10.0))
    (res,) = run(tick(NOW, rose))
    (after,) = run(tick(NOW + HOUR, drive()), history=restart(res.history))
    assert "nvme.media_errors:nvme0" in ids(after)


def test_an_unusable_smart_log_is_t3_unknown_and_its_values_unused():
    cfg = settings(nvme={"smart_log_max_age_s": 600.0})
    garbage = drive("nvme0", smart=SmartLog(error="not JSON: Expecting value"))
    stale = drive("nvme1", smart=SmartLog(critical_warning=4, percentage_used=99, media_errors=0), smart_at=NOW - 700)
    fresh = drive("nvme2", smart=SmartLog(critical_warning=0, percentage_used=3, media_errors=0), smart_at=NOW - 500)
    (res,) = run(tick(NOW, garbage, stale, fresh), cfg=cfg)
    assert nvme_ids(res) == {"nvme.unreadable:nvme0", "nvme.unreadable:nvme1"}
    f = get(res, "nvme.unreadable:nvme1")
    assert (f.tier, f.attribution, f.action) == (3, "unknown", "none")
    assert f.summary == "nvme1: SMART log unusable: written 11m40s ago, older than nvme.smart_log_max_age_s (10m00s)"
    assert get(res, "nvme.unreadable:nvme0").summary == "nvme0: SMART log unusable: not JSON: Expecting value"


def test_sysfs_only_raises_nothing():
    (res,) = run(tick(NOW, drive(smart=None)))
    assert not res.findings
