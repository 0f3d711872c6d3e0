"""NVMe rules: a drive's critical warning, its wear, a rise of its media errors, and a SMART log that
could not be used (unreadable, garbage or stale).

The media errors counter's rise is the collector's delta; the rules add it to a trailing window of
`nvme.media_errors_window_s` (the source's history window) and report the drive while the window
holds any. A drive is named by its controller (nvme0) in finding ids, and by model and serial in the
evidence; its windowed history follows the serial, as controller names may change at boot.
"""

from __future__ import annotations

from collections.abc import Callable

from healthd.agent.classify.context import TickContext, dur, iso
from healthd.agent.collectors.nvme import NvmeController, NvmeSample, SmartLog
from healthd.model import Component, Evidence

NVME = "nvme"
CRITICAL_WARNING_BITS = (
    "available spare below its threshold",
    "temperature outside its thresholds",
    "NVM subsystem reliability degraded",
    "media placed in read-only mode",
    "volatile memory backup device failed",
    "persistent memory region read-only",
)
"""The SMART log's critical warning bits 0-5 (NVMe base specification, log page 02h, byte 0)."""


def evaluate(ctx: TickContext, sample: NvmeSample) -> None:
    fresh = ctx.fresh(NVME, sample.time)
    for c in sample.controllers:
        drive(ctx, c, fresh)


def drive(ctx: TickContext, c: NvmeController, fresh: bool) -> None:
    cfg = ctx.settings.nvme
    smart = c.smart
    if smart is None:
        return
    comp = Component(kind="node", device=c.name, serial=c.serial)
    who = f"{c.name} ({c.model or 'model unknown'}, serial {c.serial or 'unknown'}, firmware {c.firmware or 'unknown'})"

    def emit(kind: str, summary: str, *evidence: Evidence) -> None:
        ctx.emit(kind, c.name, comp, NVME, f"{c.name}: {summary}", evidence)

    age = ctx.now - c.smart_at if c.smart_at is not None else None
    if smart.error or (age is not None and age > cfg.smart_log_max_age_s):
        why = smart.error or f"written {dur(age or 0.0)} ago, older than nvme.smart_log_max_age_s ({dur(cfg.smart_log_max_age_s)})"
        emit("nvme.unreadable", f"SMART log unusable: {why}",
             Evidence("state", f"{who}: SMART log unusable: {why}",
                      {"device": c.name, "error": smart.error, "written": iso(c.smart_at), "max_age_s": cfg.smart_log_max_age_s}))
        return
    values = _values(c, smart)
    warning = smart.critical_warning
    if warning:
        bits = [name for bit, name in enumerate(CRITICAL_WARNING_BITS) if warning & (1 << bit)]
        emit("nvme.critical_warning", f"critical warning 0x{warning:02x}: {', '.join(bits) or 'reserved bits set'}",
             Evidence("state", f"{who}: SMART critical_warning 0x{warning:02x} ({', '.join(bits) or 'reserved bits'}); "
                      f"available spare {smart.available_spare}% (threshold {smart.available_spare_threshold}%)",
                      {**values, "bits": bits}))
    used = smart.percentage_used
    if used is not None and used >= cfg.wear_warn_pct:
        emit("nvme.wear", f"{used}% of its rated endurance used (warn at {cfg.wear_warn_pct}%)",
             Evidence("state", f"{who}: SMART percent_used {used}", values),
             Evidence("config", f"nvme.wear_warn_pct = {cfg.wear_warn_pct}", {"wear_warn_pct": cfg.wear_warn_pct}))
    media_errors(ctx, c, fresh, emit, who)


def media_errors(ctx: TickContext, c: NvmeController, fresh: bool, emit: Callable[..., None], who: str) -> None:
    window_s = ctx.settings.nvme.media_errors_window_s
    key = f"nvme/{c.serial or c.name}/media_errors"
    d = c.media_errors
    if fresh and d is not None and d.delta:
        ctx.record(key, d.delta, d.window_s or 0.0)
    rose, _ = ctx.window(key, window_s)
    if rose > 0:
        now = d.value if d is not None else None
        emit("nvme.media_errors", f"media errors rose by {rose:.0f} in the last {dur(window_s)} (now {now})",
             Evidence("counter", f"{who}: SMART media_errors +{rose:.0f} within {dur(window_s)}, now {now}",
                      {"counter": "media_errors", "delta": rose, "window_s": window_s, "value": now}))


def _values(c: NvmeController, s: SmartLog) -> dict[str, object]:
    return {"device": c.name, "model": c.model, "serial": c.serial, "firmware": c.firmware, "state": c.state,
            "critical_warning": s.critical_warning, "percentage_used": s.percentage_used, "media_errors": s.media_errors,
            "available_spare": s.available_spare, "available_spare_threshold": s.available_spare_threshold}
