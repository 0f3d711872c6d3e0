"""NVML rules: the driver, GPU count, lost GPUs, row remapping and page retirement, ECC, PCIe,
hardware slowdown, thermal margin, NVLink counters and unreadable fields.

NVML's ever-growing counters (ECC, PCIe replays, NVLink errors) arrive as deltas from the NVML
collector (`GpuSample.counters`, against the collector's own baseline); the rules only add them to
trailing windows. A sample classified a second time (the kernel follower ticks between collections)
carries the same read time, and its deltas are not counted again.
"""

from __future__ import annotations

from healthd.agent.classify.context import (
    HOUR_S,
    MINUTE_S,
    TickContext,
    dur,
    finite_or,
    fmt,
)
from healthd.model import NODE, Component, CounterDelta, Evidence, GpuSample, NvmlSample

NVML = "nvml"

# NVML clock event reasons (nvmlClocksEventReason*): the hardware-imposed slowdowns gpud counts.
GPU_IDLE = 0x1
HW_SLOWDOWN_BITS = {0x8: "HwSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown"}
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80

SBE_WINDOW_S = 3600.0
PCIE_REPLAY_WINDOW_S = 60.0

NVLINK_PREFIX = "nvlink/"


def increase(ctx: TickContext, g: GpuSample, name: str) -> CounterDelta | None:
    """The counter's delta when it grew since the collector's previous reading and this sample is
    counted for the first time; None otherwise (first reading, reset, no growth, classified again)."""
    d = g.counters.get(name)
    if d is None or not d.delta or not ctx.nvml_fresh:
        return None
    return d


def noted(ctx: TickContext, n: NvmlSample) -> None:
    """Remember this sample's read time: a sample classified again (the kernel follower ticks between
    collections) does not count its counter deltas twice."""
    ctx.nvml_fresh = n.time is None or n.time != ctx.nvml_read
    ctx.nvml_read = n.time


def expected_gpus(ctx: TickContext) -> int | None:
    cfg = ctx.settings.nvml
    return cfg.expected_gpus if isinstance(cfg.expected_gpus, int) and not isinstance(cfg.expected_gpus, bool) else None


def status_evidence(n: NvmlSample) -> Evidence:
    return Evidence(
        "state",
        f"nvml status {n.status}, error_kind {n.error_kind}: {n.detail or 'no detail'}",
        {"status": n.status, "error_kind": n.error_kind, "detail": n.detail},
    )


def unreadable(ctx: TickContext, n: NvmlSample) -> None:
    """NVML could not be read: a driver that is missing or mismatched, a hung call, or any other
    error (the collector finding)."""
    noted(ctx, n)
    if n.error_kind in ("driver_not_loaded", "init_failed", "library_not_found"):
        # Not a GPU fault: the driver stack is missing or mismatched (typically a driver
        # upgrade without a reboot: "Driver/library version mismatch"). No GPU job can start;
        # a reboot loads the matching module.
        ctx.emit("nvml.driver", "node", NODE, NVML,
                 f"NVIDIA driver unusable ({n.error_kind}): {n.detail or 'no detail'}", [status_evidence(n)])
    elif n.error_kind == "timeout":
        ctx.emit("nvml.hung", "node", NODE, NVML,
                 f"NVML hung: {n.detail or 'a driver call did not return'}",
                 [status_evidence(n), Evidence("config", f"nvml.call_timeout_s = {ctx.settings.nvml.call_timeout_s}")])
    else:
        ctx.collector_error(NVML, n.detail)


def absent(ctx: TickContext, n: NvmlSample) -> None:
    """No NVML on this node: a fault only where the config expects GPUs."""
    noted(ctx, n)
    expected = expected_gpus(ctx)
    if ctx.settings.nvml.enabled and expected:
        ctx.emit("nvml.driver", "node", NODE, NVML,
                 f"expected {expected} GPUs but NVML is not available: {n.detail or 'no detail'}",
                 [status_evidence(n), Evidence("config", f"nvml.expected_gpus = {expected}", {"expected_gpus": expected})])


def evaluate(ctx: TickContext, n: NvmlSample) -> None:
    noted(ctx, n)
    expected = expected_gpus(ctx)
    count = n.count if n.count is not None else len(n.gpus)
    if expected is not None and count < expected:
        seen = sorted(b for b in ctx.bus_map)
        missing = sorted(b for b in ctx.gpu_ids if b not in ctx.bus_map)
        ctx.emit(
            "nvml.gpu_count", "node", NODE, NVML,
            f"{count} of {expected} GPUs visible to NVML",
            [
                Evidence("nvml_value", f"nvmlDeviceGetCount = {count}, expected {expected}", {"count": count, "expected": expected}),
                Evidence("state", f"bus ids seen: {', '.join(seen) or 'none'}; seen before but missing now: {', '.join(missing) or 'none known'}",
                         {"seen": seen, "missing": missing}),
            ],
        )
    for g in n.gpus:
        gpu(ctx, g)


def gpu(ctx: TickContext, g: GpuSample) -> None:
    """Every rule of one GPU."""
    c = ctx.gpu_component(g)
    key = c.key()
    ident = f"gpu/{g.uuid or c.bus_id or f'index{g.index}'}"
    cs = ctx.settings.classify
    ttl = cs.finding_ttl_s

    def emit(kind: str, summary: str, *ev: Evidence) -> None:
        ctx.emit(kind, key, c, NVML, f"{key}: {summary}", ev)

    if g.lost:
        emit("nvml.lost", "GPU lost (NVML: GPU is lost; fell off the bus)",
             Evidence("nvml_value", f"NVML returned GPU_IS_LOST for {key} ({c.bus_id}): {g.lost_detail or 'no detail'}",
                      {"lost": True, "bus_id": c.bus_id, "detail": g.lost_detail}))
        return

    if g.remap_failure is True:
        emit("nvml.remap_failure", "row remapping failed",
             Evidence("nvml_value", f"nvmlDeviceGetRemappedRows: failureOccurred=1 (uncorrectable remaps {g.remap_uncorrected}, correctable {g.remap_corrected})",
                      {"remap_failure": True, "remap_uncorrected": g.remap_uncorrected, "remap_corrected": g.remap_corrected}))
    if g.remap_pending is True:
        emit("nvml.remap_pending", "row remapping pending (reset the GPU to apply)",
             Evidence("nvml_value", f"nvmlDeviceGetRemappedRows: isPending=1 (uncorrectable remaps {g.remap_uncorrected}, correctable {g.remap_corrected})",
                      {"remap_pending": True, "remap_uncorrected": g.remap_uncorrected, "remap_corrected": g.remap_corrected}))
    if g.retired_pending is True:
        emit("nvml.retired_pending", "page retirement pending (reset the GPU to apply)",
             Evidence("nvml_value", f"nvmlDeviceGetRetiredPagesPendingStatus = pending (retired pages: {g.retired_pages_sbe} SBE, {g.retired_pages_dbe} DBE)",
                      {"retired_pending": True, "retired_pages_sbe": g.retired_pages_sbe, "retired_pages_dbe": g.retired_pages_dbe}))

    ecc_uncorrected(ctx, g, c, ident, ttl)
    ecc_corrected(ctx, g, c, ident)
    pcie(ctx, g, c, ident, ttl)
    hw_slowdown(ctx, g, c, ident)

    margin = g.margin_c
    if margin is not None and margin < ctx.settings.nvml.margin_warn_c:
        warn = ctx.settings.nvml.margin_warn_c
        emit("nvml.thermal", f"{margin:.0f} C from thermal slowdown",
             Evidence("nvml_value", f"thermal margin {margin:.0f} C (temperature {g.temperature_c} C, slowdown at {g.slowdown_threshold_c} C); "
                      f"warn below {warn} C",
                      {"margin_c": g.margin_c, "temperature_c": g.temperature_c, "slowdown_threshold_c": g.slowdown_threshold_c,
                       "margin_warn_c": warn}))

    nvlink(ctx, g, c, ident, ttl)

    if g.errors:
        errors = dict(g.errors)
        emit("nvml.read_error", f"could not read {', '.join(sorted(errors))}",
             Evidence("nvml_value", "; ".join(f"{k}: {v}" for k, v in sorted(errors.items())), {"errors": errors}))


def ecc_uncorrected(ctx: TickContext, g: GpuSample, c: Component, ident: str, ttl: float) -> None:
    """Uncorrectable ECC: any increase. With a remap/retirement pending the GPU is handling it and a
    reset applies the fix (T2); without one the error is in memory that cannot be remapped (SRAM)
    or remapping is exhausted: a fail-stop (T1 drain)."""
    d = increase(ctx, g, "ecc_uncorrected_volatile")
    if d is None:
        return
    key = c.key()
    handled = g.remap_pending is True or g.retired_pending is True
    # A driver that cannot read either state is taken as none pending (the drain is the safe side),
    # but the summary must not claim a reading it never had.
    unknown = g.remap_pending is None and g.retired_pending is None
    unhandled = "; remap state unknown (not readable here)" if unknown else "; no remap pending"
    inc, before, span = float(d.delta), float(d.value - d.delta), d.window_s or 0.0
    ev = Evidence(
        "counter",
        f"volatile uncorrected ECC {before:.0f} -> {g.ecc_uncorrected_volatile} (+{inc:.0f}) in {dur(span)}; "
        f"remap pending {g.remap_pending}, retirement pending {g.retired_pending}",
        {"counter": "ecc_uncorrected_volatile", "before": before, "value": g.ecc_uncorrected_volatile, "delta": inc, "window_s": span},
    )
    ctx.latch(
        ctx.finding(
            "nvml.ecc_uncorrected", key, c, NVML,
            f"{key}: uncorrectable ECC errors increased (+{inc:.0f})" + ("; remap pending" if handled else unhandled),
            [ev],
            case="remap pending" if handled else "no remap pending",
        ),
        ttl,
        int(inc),
    )


def ecc_corrected(ctx: TickContext, g: GpuSample, c: Component, ident: str) -> None:
    """Corrected (single-bit) ECC errors: a rate over the last hour."""
    cs = ctx.settings.classify
    d = increase(ctx, g, "ecc_corrected_volatile")
    if d is not None:
        ctx.record(f"{ident}/sbe", d.delta, d.window_s or 0.0)
    total, span = ctx.window(f"{ident}/sbe", SBE_WINDOW_S)
    per_hour = total / max(SBE_WINDOW_S, span) * HOUR_S
    if total and per_hour > cs.ecc_sbe_per_hour:
        key = c.key()
        ctx.emit("nvml.ecc_sbe_rate", key, c, NVML, f"{key}: corrected ECC errors at {fmt(per_hour)}/h",
                 [Evidence("counter", f"{total:.0f} corrected (single-bit) ECC errors in the last {dur(SBE_WINDOW_S)} "
                           f"(volatile count now {g.ecc_corrected_volatile}); threshold {fmt(cs.ecc_sbe_per_hour)}/h",
                           {"counter": "ecc_corrected_volatile", "delta": total, "window_s": SBE_WINDOW_S, "per_hour": per_hour,
                            "threshold_per_hour": cs.ecc_sbe_per_hour, "value": g.ecc_corrected_volatile})])


def pcie(ctx: TickContext, g: GpuSample, c: Component, ident: str, ttl: float) -> None:
    """PCIe replays (a rate over a minute) and the link: a narrower link than the slot supports is a
    real fault (a reseat); a lower generation is normal power saving at idle, so it is only noted
    (T3) while the GPU is busy."""
    cs = ctx.settings.classify
    key = c.key()
    d = increase(ctx, g, "pcie_replay")
    if d is not None:
        ctx.record(f"{ident}/pcie_replay", d.delta, d.window_s or 0.0)
        total, span = ctx.window(f"{ident}/pcie_replay", PCIE_REPLAY_WINDOW_S)
        per_min = total / max(PCIE_REPLAY_WINDOW_S, span) * MINUTE_S
        if per_min > cs.pcie_replay_per_min:
            ctx.latch(
                ctx.finding(
                    "nvml.pcie_replay", key, c, NVML,
                    f"{key}: PCIe replays at {fmt(per_min)}/min",
                    [Evidence("counter", f"PCIe replay counter +{total:.0f} in the last {dur(max(PCIE_REPLAY_WINDOW_S, span))} "
                              f"(now {g.pcie_replay}); threshold {fmt(cs.pcie_replay_per_min)}/min",
                              {"counter": "pcie_replay", "delta": total, "window_s": max(PCIE_REPLAY_WINDOW_S, span),
                               "per_min": per_min, "threshold_per_min": cs.pcie_replay_per_min, "value": g.pcie_replay})],
                ),
                ttl,
                d.delta,
            )

    width, width_max = g.pcie_width, g.pcie_width_max
    if width and width_max and width < width_max:
        ctx.emit("nvml.pcie_width", key, c, NVML, f"{key}: PCIe link x{width:.0f} of x{width_max:.0f}",
                 [Evidence("nvml_value", f"current PCIe width x{width:.0f}, max x{width_max:.0f} (gen {g.pcie_gen} of {g.pcie_gen_max})",
                           {"pcie_width": g.pcie_width, "pcie_width_max": g.pcie_width_max, "pcie_gen": g.pcie_gen, "pcie_gen_max": g.pcie_gen_max})])
    gen, gen_max = g.pcie_gen, g.pcie_gen_max
    reasons = g.clock_event_reasons
    if gen and gen_max and gen < gen_max and reasons is not None and not reasons & GPU_IDLE:
        ctx.emit("nvml.pcie_gen", key, c, NVML, f"{key}: PCIe link gen {gen:.0f} of {gen_max:.0f} while busy",
                 [Evidence("nvml_value", f"current PCIe gen {gen:.0f}, max {gen_max:.0f}, GPU not idle (clock event reasons {reasons:#x})",
                           {"pcie_gen": g.pcie_gen, "pcie_gen_max": g.pcie_gen_max, "clock_event_reasons": reasons})])


def hw_slowdown(ctx: TickContext, g: GpuSample, c: Component, ident: str) -> None:
    """Hardware slowdown: time with an HW slowdown bit set over the window, counted in samples of
    interval_s (gpud: more than 0.6 events/min over 10 min). Weighting by elapsed time keeps the
    count right when one sample is classified twice (the kernel follower ticks in between)."""
    cs = ctx.settings.classify
    reasons = g.clock_event_reasons
    if reasons is not None and reasons & HW_SLOWDOWN_MASK:
        ctx.record(f"{ident}/hw_slowdown", ctx.elapsed, ctx.elapsed)
    win = finite_or(cs.hw_slowdown_window_s, 600.0)
    observed_s, _ = ctx.window(f"{ident}/hw_slowdown", win)
    if observed_s and win > 0:
        events = observed_s / ctx.interval
        per_min = events / (win / MINUTE_S)
        if per_min > cs.hw_slowdown_per_min:
            key = c.key()
            bits = [name for bit, name in HW_SLOWDOWN_BITS.items() if reasons is not None and reasons & bit]
            ctx.emit("nvml.hw_slowdown", key, c, NVML, f"{key}: hardware slowdown {fmt(per_min)}/min over {dur(win)}",
                     [Evidence("nvml_value", f"HW slowdown reasons set for ~{events:.0f} samples ({observed_s:.0f}s) of the last {dur(win)}; "
                               f"now {reasons if reasons is None else hex(reasons)} ({', '.join(bits) or 'clear'}); threshold {cs.hw_slowdown_per_min}/min",
                               {"observed_s": observed_s, "window_s": win, "per_min": per_min, "threshold_per_min": cs.hw_slowdown_per_min,
                                "clock_event_reasons": reasons})])


def nvlink(ctx: TickContext, g: GpuSample, c: Component, ident: str, ttl: float) -> None:
    """NVLink data-link error counters: any increase on any link."""
    increases = []
    for counter in sorted(g.counters):
        if counter.startswith(NVLINK_PREFIX) and (d := increase(ctx, g, counter)) is not None:
            increases.append((counter[len(NVLINK_PREFIX):], d))
    if not increases:
        return
    key = c.key()
    total = sum(d.delta for _, d in increases)
    ctx.latch(
        ctx.finding(
            "nvml.nvlink", key, c, NVML,
            f"{key}: NVLink error counters increasing ({', '.join(n for n, _ in increases)})",
            [Evidence("counter", f"NVLink {name} {d.value - d.delta} -> {d.value} (+{d.delta}) in {dur(d.window_s or 0.0)}",
                      {"counter": name, "before": float(d.value - d.delta), "value": float(d.value), "delta": float(d.delta),
                       "window_s": d.window_s or 0.0})
             for name, d in increases],
        ),
        ttl,
        total,
    )
