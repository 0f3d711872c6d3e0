"""Snapshot + history -> findings and a verdict. A pure function: no I/O, no clock, no logging.

`classify(snapshot, history, catalog, settings)` reads one tick's samples, folds what must be
remembered (counter baselines, Xid occurrences, port states, sticky findings) into a *new* History
and returns it with the findings. The history it was given is never changed. Every finding carries
evidence a human can check: the kernel line with its journal cursor and count, the counter delta and
its window, the NVML value. The rules and their tiers are summarised in the README ("Tiers, attribution and actions"); the
Xid rows are data in healthd/data/xid_catalog.yaml.

Ids are stable for the same condition across ticks (`xid:gpu3:79`, `nvml.remap_pending:gpu2`,
`ib.drop:mlx5_0/1`) so the hooks and the controller can follow a finding over time.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from healthd.agent.classify.catalog import Catalog, Outcome
from healthd.agent.history import MAX_TEXT, History, Latch, Occurrence, PortRecord, XidRecord
from healthd.model import (
    NODE,
    Component,
    Evidence,
    Finding,
    GpuSample,
    PortSample,
    TS_MAX,
    Snapshot,
    verdict,
    would_do,
    normalize_bus_id,
)
from healthd.model import iso as _iso
from healthd.settings import FilesystemSpec, Settings

# NVML clock event reasons (nvmlClocksEventReason*): the hardware-imposed slowdowns gpud counts.
GPU_IDLE = 0x1
HW_SLOWDOWN_BITS = {0x8: "HwSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown"}
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80

SBE_WINDOW_S = 3600.0
PCIE_REPLAY_WINDOW_S = 60.0
HOUR_S, MINUTE_S = 3600.0, 60.0
BASELINE_MAX_AGE_S = 7 * 86400.0
"""Counter baselines of a GPU or port not seen for this long are forgotten."""

# InfiniBand counter rules (NVSentinel NIC monitor thresholds, anchors.md 10.4). Per-second rates
# are the collector's tick rate (a burst); per-minute and per-hour are counts over a trailing window,
# never extrapolated from one short tick.
IB_RATE_RULES: tuple[tuple[str, str, str], ...] = (
    ("symbol_error", "per_hour", "symbol_error_per_hour"),
    ("symbol_error", "per_s", "symbol_error_per_s"),
    ("link_error_recovery", "per_min", "link_error_recovery_per_min"),
    ("port_rcv_errors", "per_s", "port_rcv_errors_per_s"),
    ("port_xmit_discards", "per_s", "port_xmit_discards_per_s"),
    ("local_ack_timeout_err", "per_s", "local_ack_timeout_err_per_s"),
    ("roce_slow_restart", "per_s", "roce_slow_restart_per_s"),
)
IB_ANY_RULES = ("link_downed", "excessive_buffer_overrun_errors", "local_link_integrity_errors", "rnr_nak_retry_err")
"""Any increase is a finding (NVSentinel's 'fatal' set)."""
IB_ERROR_COUNTERS = frozenset(
    {r[0] for r in IB_RATE_RULES}
    | set(IB_ANY_RULES)
    | {
        "port_rcv_remote_physical_errors",
        "port_rcv_switch_relay_errors",
        "port_rcv_constraint_errors",
        "port_xmit_constraint_errors",
        "VL15_dropped",
    }
)
"""Counters whose saturation hides errors. port_xmit_wait (congestion) and the data/packet counters
are not errors and are never reported."""

_RECOVERY = re.compile(r"\bto\s+(?:0x[0-9a-fA-F]+\s*)?\(([^)]*)\)")
_NVLINK_KEY = re.compile(r"^link(\d+)\.(\w+)$")


@dataclass(frozen=True)
class Classification:
    findings: tuple[Finding, ...]
    """Current findings, most certain first (tier, then id)."""
    history: History
    """The history to pass to the next tick (the input history is left as it was)."""
    verdict: str
    """healthy | degraded | failed | unknown."""
    would_do: tuple[dict[str, Any], ...]
    """One request per distinct action and component, strongest action first."""
    suppressed: tuple[Finding, ...] = ()
    """Findings dropped by a catalog override `ignore: true` (for metrics; never acted on)."""


def classify(snapshot: Snapshot, history: History, catalog: Catalog, settings: Settings) -> Classification:
    tick = _Tick(snapshot, history, catalog, settings)
    for name, section in (
        ("nvml", tick.nvml),
        ("kernel_log", tick.kernel),
        ("infiniband", tick.infiniband),
        ("host", tick.host),
    ):
        try:
            section()
        except Exception as exc:  # noqa: BLE001 - a rule bug must not stop the other rules or the agent
            tick.add(
                Finding(
                    id=f"classify.error:node:{name}",
                    component=NODE,
                    source=name,  # type: ignore[arg-type]
                    attribution="unknown",
                    tier=3,
                    action="none",
                    summary=f"healthd could not evaluate {name}: {type(exc).__name__}: {exc}",
                    evidence=(Evidence("state", f"classifier raised {type(exc).__name__}: {exc}"),),
                    first_seen=tick.now,
                    last_seen=tick.now,
                )
            )
    return tick.result()


# --------------------------------------------------------------------------- helpers


def _finite(x: Any, default: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return default
    return float(x)




def iso(ts: Any) -> str | None:
    """model.iso that cannot raise: a time out of range renders as None."""
    t = _num(ts)
    return _iso(t) if t is not None and 0.0 <= t <= TS_MAX else None


def _ts(x: Any, default: float) -> float:
    t = _finite(x, default)
    return t if 0.0 <= t <= TS_MAX else default


def _num(x: Any) -> float | None:
    """A usable number, or None (missing, NaN, a bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _clean(value: Any) -> Any:
    """Evidence data as strict JSON: NaN/inf (a broken reading) become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _is_clean(data: Any) -> bool:
    """Only scalars that JSON writes strictly (the common case: skip the copy)."""
    return isinstance(data, dict) and all(
        v is None or isinstance(v, (str, int)) or (isinstance(v, float) and math.isfinite(v)) for v in data.values()
    )


def _norm_bus(raw: Any) -> str | None:
    if not isinstance(raw, str) or not raw.strip():
        return None
    return normalize_bus_id(raw) or raw.strip()


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _dur(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _gpu_component(g: GpuSample) -> Component:
    return Component(kind="gpu", index=g.index if isinstance(g.index, int) else None, uuid=g.uuid, serial=g.serial, bus_id=_norm_bus(g.bus_id))


def _bursts(times: Iterable[float], gap: float) -> int:
    """Occurrences closer than `gap` to the start of their burst count once."""
    n, start = 0, None
    for t in sorted(times):
        if start is None or t - start > gap:
            n, start = n + 1, t
    return n


def _worse_severity(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a.lower() == "fatal" else b


class _Tick:
    """Working state of one classification. Built from the input history by copying; never
    writes into it."""

    def __init__(self, snap: Snapshot, hist: History, catalog: Catalog, settings: Settings):
        self.snap, self.cat, self.s = snap, catalog, settings
        self.now = _ts(snap.time, _ts(hist.time, 0.0))
        interval = _finite(settings.interval_s, 10.0)
        self.interval = interval if interval > 0 else 10.0
        prev_t = hist.time
        gap = self.now - prev_t if prev_t is not None else None
        self.elapsed = min(gap, 2 * self.interval) if gap is not None and gap > 0 else self.interval
        self.boot_changed = bool(snap.boot_id and hist.boot_id and snap.boot_id != hist.boot_id)
        self.boot_id = snap.boot_id if snap.boot_id else hist.boot_id

        self.gpu_ids = dict(hist.gpu_ids)
        self.baselines = dict(hist.baselines)
        self.series = dict(hist.series)
        self.xids = dict(hist.xids)
        self.ports = dict(hist.ports)
        self.latches = dict(hist.latches)
        self.findings: dict[str, Finding] = {}
        self.suppressed: list[Finding] = []
        self.fired: set[str] = set()
        self.errored: list[tuple[str, str]] = []
        if self.boot_changed:
            self._on_boot_change()

        # This tick's GPUs by bus id (NVML), remembered so a GPU NVML loses still maps its Xids.
        self.bus_map: dict[str, Component] = {}
        if snap.nvml.status == "ok":
            for g in snap.nvml.gpus:
                c = self.gpu_component(g)
                if c.bus_id:
                    self.bus_map[c.bus_id] = c
                    self.gpu_ids.pop(c.bus_id, None)
                    self.gpu_ids[c.bus_id] = c

    # ------------------------------------------------------------------ plumbing

    def _on_boot_change(self) -> None:
        """A reboot resets volatile counters, retrains links and applies every reset-gpu-when-idle
        and reboot-when-idle remedy: forget baselines and port states, close findings that asked for
        a reset or reboot. Xid occurrences stay, so a fault that comes back counts as a repeat."""
        remedied = ("reset-gpu-when-idle", "reboot-when-idle")
        self.baselines = {}
        self.ports = {k: PortRecord(updated=p.updated) for k, p in self.ports.items()}
        self.series = {k: v for k, v in self.series.items() if not k.startswith("port/")}
        self.latches = {k: la for k, la in self.latches.items() if la.finding.action not in remedied}
        for key, rec in list(self.xids.items()):
            if rec.live_episode and self.outcome_for(rec)[0].action in remedied:
                self.xids[key] = dataclasses.replace(rec, first_seen=None, last_seen=None, count=0)

    def add(self, f: Finding) -> None:
        old = self.findings.get(f.id)
        if old is None or f.tier < old.tier:
            self.findings[f.id] = f

    def finding(
        self,
        fid: str,
        component: Component,
        source: str,
        attribution: str,
        tier: int,
        action: str,
        summary: str,
        evidence: Iterable[Evidence],
        **kw: Any,
    ) -> Finding:
        kw.setdefault("first_seen", self.now)
        kw.setdefault("last_seen", self.now)
        evidence = [e if _is_clean(e.data) else dataclasses.replace(e, data=_clean(e.data)) for e in evidence]
        return Finding(
            id=fid,
            component=component,
            source=source,  # type: ignore[arg-type]
            attribution=attribution,  # type: ignore[arg-type]
            tier=tier,  # type: ignore[arg-type]
            action=action,  # type: ignore[arg-type]
            summary=summary,
            evidence=tuple(evidence),
            **kw,
        )

    def latch(self, f: Finding, hold_s: float, increase: int, total: int | None = None) -> None:
        """Report `f` now and for `hold_s` after the last time its condition was seen. Repeated
        firings accumulate `count` (or set it to `total`) and keep the first `first_seen` and the
        strongest tier."""
        old = self.latches.get(f.id)
        if old is not None and old.until >= self.now:
            base = old.finding
            f = dataclasses.replace(
                f,
                first_seen=base.first_seen if base.first_seen is not None else f.first_seen,
                count=base.count + max(0, increase),
            )
            if base.tier < f.tier:
                f = dataclasses.replace(f, tier=base.tier, action=base.action, attribution=base.attribution, summary=base.summary)
        else:
            f = dataclasses.replace(f, count=max(1, increase))
        if total is not None:
            f = dataclasses.replace(f, count=max(1, total))
        self.latches[f.id] = Latch(f, self.now + max(0.0, _finite(hold_s, 0.0)))
        self.fired.add(f.id)
        self.add(f)

    def delta(self, key: str, value: Any) -> tuple[float, float, float] | None:
        """(increase, previous value, seconds since that reading) of a raw counter; None on the first
        reading and after a reset (the value went down). The same value read twice (one sample
        classified again) is an increase of 0, so deltas never count twice."""
        v = _num(value)
        if v is None:
            return None
        prev = self.baselines.get(key)
        self.baselines[key] = (self.now, v)
        if prev is None or v < prev[1]:
            return None
        return (v - prev[1], prev[1], max(0.0, self.now - prev[0]))

    def record(self, key: str, amount: float, span: float) -> None:
        self.series[key] = self.series.get(key, ()) + ((self.now, float(amount), float(span)),)

    def window(self, key: str, window_s: float) -> tuple[float, float]:
        """(sum of amounts, sum of spans) recorded in the trailing window."""
        lo = self.now - window_s
        total = span = 0.0
        for t, a, s in self.series.get(key, ()):
            if t > lo:
                total += a
                span += s
        return total, span

    def collector_error(self, source: str, detail: str) -> None:
        self.errored.append((source, detail))
        self.add(
            self.finding(
                f"collector.{source}:node",
                NODE,
                source,
                "unknown",
                3,
                "none",
                f"could not check {source}: {detail or 'no detail'}",
                [Evidence("state", f"{source} collector status error: {detail or 'no detail'}", {"status": "error", "detail": detail})],
            )
        )

    # ------------------------------------------------------------------ NVML

    def nvml(self) -> None:
        n, cfg = self.snap.nvml, self.s.nvml
        expected = cfg.expected_gpus if isinstance(cfg.expected_gpus, int) and not isinstance(cfg.expected_gpus, bool) else None
        status_ev = Evidence(
            "state",
            f"nvml status {n.status}, error_kind {n.error_kind}: {n.detail or 'no detail'}",
            {"status": n.status, "error_kind": n.error_kind, "detail": n.detail},
        )
        if n.status == "error":
            if n.error_kind in ("driver_not_loaded", "init_failed", "library_not_found"):
                # Not a GPU fault: the driver stack is missing or mismatched (typically a driver
                # upgrade without a reboot: "Driver/library version mismatch"). No GPU job can start;
                # a reboot loads the matching module.
                self.add(
                    self.finding(
                        "nvml.driver:node", NODE, "nvml", "software", 2, "reboot-when-idle",
                        f"NVIDIA driver unusable ({n.error_kind}): {n.detail or 'no detail'}", [status_ev],
                    )
                )
            elif n.error_kind == "timeout":
                self.add(
                    self.finding(
                        "nvml.hung:node", NODE, "nvml", "unknown", 2, "reboot-when-idle",
                        f"NVML hung: {n.detail or 'a driver call did not return'}",
                        [status_ev, Evidence("config", f"nvml.call_timeout_s = {cfg.call_timeout_s}")],
                    )
                )
            else:
                self.collector_error("nvml", n.detail)
            return
        if n.status != "ok":
            if n.status == "no_data" and cfg.enabled and expected:
                self.add(
                    self.finding(
                        "nvml.driver:node", NODE, "nvml", "software", 2, "reboot-when-idle",
                        f"expected {expected} GPUs but NVML is not available: {n.detail or 'no detail'}",
                        [status_ev, Evidence("config", f"nvml.expected_gpus = {expected}", {"expected_gpus": expected})],
                    )
                )
            return

        count = n.count if isinstance(n.count, int) and not isinstance(n.count, bool) else len(n.gpus)
        if expected is not None and count < expected:
            seen = sorted(b for b in self.bus_map)
            missing = sorted(b for b in self.gpu_ids if b not in self.bus_map)
            self.add(
                self.finding(
                    "nvml.gpu_count:node", NODE, "nvml", "hardware", 1, "drain",
                    f"{count} of {expected} GPUs visible to NVML",
                    [
                        Evidence("nvml_value", f"nvmlDeviceGetCount = {count}, expected {expected}", {"count": count, "expected": expected}),
                        Evidence("state", f"bus ids seen: {', '.join(seen) or 'none'}; seen before but missing now: {', '.join(missing) or 'none known'}",
                                 {"seen": seen, "missing": missing}),
                    ],
                )
            )
        for g in n.gpus:
            self.gpu(g)

    def gpu_component(self, g: GpuSample) -> Component:
        """A GPU lost at handle lookup has no bus id, UUID or serial this tick: take them from the
        GPU last seen at its index, so the finding names the serial to RMA and its Xids join it."""
        c = _gpu_component(g)
        if not g.lost or (c.bus_id and c.uuid and c.serial) or c.index is None:
            return c
        known = next((k for k in reversed(list(self.gpu_ids.values())) if k.index == c.index), None)
        if known is None:
            return c
        return Component(kind="gpu", index=c.index, uuid=c.uuid or known.uuid,
                         serial=c.serial or known.serial, bus_id=c.bus_id or known.bus_id)

    def gpu(self, g: GpuSample) -> None:
        c = self.gpu_component(g)
        key = c.key()
        ident = f"gpu/{g.uuid or c.bus_id or f'index{g.index}'}"
        cs = self.s.classify
        ttl = cs.finding_ttl_s

        def add(rule: str, attribution: str, tier: int, action: str, summary: str, *ev: Evidence) -> None:
            self.add(self.finding(f"nvml.{rule}:{key}", c, "nvml", attribution, tier, action, f"{key}: {summary}", ev))

        if g.lost:
            add("lost", "hardware", 1, "drain-and-requeue", "GPU lost (NVML: GPU is lost; fell off the bus)",
                Evidence("nvml_value", f"NVML returned GPU_IS_LOST for {key} ({c.bus_id}): {g.lost_detail or 'no detail'}",
                         {"lost": True, "bus_id": c.bus_id, "detail": g.lost_detail}))
            return

        if g.remap_failure is True:
            add("remap_failure", "hardware", 1, "inspect-hardware", "row remapping failed",
                Evidence("nvml_value", f"nvmlDeviceGetRemappedRows: failureOccurred=1 (uncorrectable remaps {g.remap_uncorrected}, correctable {g.remap_corrected})",
                         {"remap_failure": True, "remap_uncorrected": g.remap_uncorrected, "remap_corrected": g.remap_corrected}))
        if g.remap_pending is True:
            add("remap_pending", "hardware", 2, "reset-gpu-when-idle", "row remapping pending (reset the GPU to apply)",
                Evidence("nvml_value", f"nvmlDeviceGetRemappedRows: isPending=1 (uncorrectable remaps {g.remap_uncorrected}, correctable {g.remap_corrected})",
                         {"remap_pending": True, "remap_uncorrected": g.remap_uncorrected, "remap_corrected": g.remap_corrected}))
        if g.retired_pending is True:
            add("retired_pending", "hardware", 2, "reset-gpu-when-idle", "page retirement pending (reset the GPU to apply)",
                Evidence("nvml_value", f"nvmlDeviceGetRetiredPagesPendingStatus = pending (retired pages: {g.retired_pages_sbe} SBE, {g.retired_pages_dbe} DBE)",
                         {"retired_pending": True, "retired_pages_sbe": g.retired_pages_sbe, "retired_pages_dbe": g.retired_pages_dbe}))

        # Uncorrectable ECC: any increase. With a remap/retirement pending the GPU is handling it and
        # a reset applies the fix (T2); without one the error is in memory that cannot be remapped
        # (SRAM) or remapping is exhausted: a fail-stop (T1 drain).
        d = self.delta(f"{ident}/ecc_uncorrected_volatile", g.ecc_uncorrected_volatile)
        if d is not None and d[0] > 0:
            handled = g.remap_pending is True or g.retired_pending is True
            inc, before, span = d
            ev = Evidence(
                "counter",
                f"volatile uncorrected ECC {before:.0f} -> {g.ecc_uncorrected_volatile} (+{inc:.0f}) in {_dur(span)}; "
                f"remap pending {g.remap_pending}, retirement pending {g.retired_pending}",
                {"counter": "ecc_uncorrected_volatile", "before": before, "value": g.ecc_uncorrected_volatile, "delta": inc, "window_s": span},
            )
            self.latch(
                self.finding(
                    f"nvml.ecc_uncorrected:{key}", c, "nvml", "hardware", 2 if handled else 1,
                    "reset-gpu-when-idle" if handled else "drain",
                    f"{key}: uncorrectable ECC errors increased (+{inc:.0f})" + ("; remap pending" if handled else "; no remap pending"),
                    [ev],
                ),
                ttl,
                int(inc),
            )

        d = self.delta(f"{ident}/ecc_corrected_volatile", g.ecc_corrected_volatile)
        if d is not None and d[0] > 0:
            self.record(f"{ident}/sbe", d[0], d[2])
        total, span = self.window(f"{ident}/sbe", SBE_WINDOW_S)
        per_hour = total / max(SBE_WINDOW_S, span) * HOUR_S
        if total and per_hour > cs.ecc_sbe_per_hour:
            add("ecc_sbe_rate", "hardware", 2, "none", f"corrected ECC errors at {_fmt(per_hour)}/h",
                Evidence("counter", f"{total:.0f} corrected (single-bit) ECC errors in the last {_dur(SBE_WINDOW_S)} "
                         f"(volatile count now {g.ecc_corrected_volatile}); threshold {_fmt(cs.ecc_sbe_per_hour)}/h",
                         {"counter": "ecc_corrected_volatile", "delta": total, "window_s": SBE_WINDOW_S, "per_hour": per_hour,
                          "threshold_per_hour": cs.ecc_sbe_per_hour, "value": g.ecc_corrected_volatile}))

        d = self.delta(f"{ident}/pcie_replay", g.pcie_replay)
        if d is not None and d[0] > 0:
            self.record(f"{ident}/pcie_replay", d[0], d[2])
            total, span = self.window(f"{ident}/pcie_replay", PCIE_REPLAY_WINDOW_S)
            per_min = total / max(PCIE_REPLAY_WINDOW_S, span) * MINUTE_S
            if per_min > cs.pcie_replay_per_min:
                self.latch(
                    self.finding(
                        f"nvml.pcie_replay:{key}", c, "nvml", "hardware", 2, "drain",
                        f"{key}: PCIe replays at {_fmt(per_min)}/min",
                        [Evidence("counter", f"PCIe replay counter +{total:.0f} in the last {_dur(max(PCIE_REPLAY_WINDOW_S, span))} "
                                  f"(now {g.pcie_replay}); threshold {_fmt(cs.pcie_replay_per_min)}/min",
                                  {"counter": "pcie_replay", "delta": total, "window_s": max(PCIE_REPLAY_WINDOW_S, span),
                                   "per_min": per_min, "threshold_per_min": cs.pcie_replay_per_min, "value": g.pcie_replay})],
                    ),
                    ttl,
                    int(d[0]),
                )

        # PCIe link: a narrower link than the slot supports is a real fault (a reseat); a lower
        # generation is normal power saving at idle, so it is only noted (T3) while the GPU is busy.
        width, width_max = _num(g.pcie_width), _num(g.pcie_width_max)
        if width and width_max and width < width_max:
            add("pcie_width", "hardware", 2, "drain", f"PCIe link x{width:.0f} of x{width_max:.0f}",
                Evidence("nvml_value", f"current PCIe width x{width:.0f}, max x{width_max:.0f} (gen {g.pcie_gen} of {g.pcie_gen_max})",
                         {"pcie_width": g.pcie_width, "pcie_width_max": g.pcie_width_max, "pcie_gen": g.pcie_gen, "pcie_gen_max": g.pcie_gen_max}))
        gen, gen_max = _num(g.pcie_gen), _num(g.pcie_gen_max)
        reasons = g.clock_event_reasons if isinstance(g.clock_event_reasons, int) and not isinstance(g.clock_event_reasons, bool) else None
        if gen and gen_max and gen < gen_max and reasons is not None and not reasons & GPU_IDLE:
            add("pcie_gen", "hardware", 3, "none", f"PCIe link gen {gen:.0f} of {gen_max:.0f} while busy",
                Evidence("nvml_value", f"current PCIe gen {gen:.0f}, max {gen_max:.0f}, GPU not idle (clock event reasons {reasons:#x})",
                         {"pcie_gen": g.pcie_gen, "pcie_gen_max": g.pcie_gen_max, "clock_event_reasons": reasons}))

        # Hardware slowdown: time with an HW slowdown bit set over the window, counted in samples of
        # interval_s (gpud: more than 0.6 events/min over 10 min). Weighting by elapsed time keeps the
        # count right when one sample is classified twice (the kernel follower ticks in between).
        if reasons is not None and reasons & HW_SLOWDOWN_MASK:
            self.record(f"{ident}/hw_slowdown", self.elapsed, self.elapsed)
        win = _finite(cs.hw_slowdown_window_s, 600.0)
        observed_s, _ = self.window(f"{ident}/hw_slowdown", win)
        if observed_s and win > 0:
            events = observed_s / self.interval
            per_min = events / (win / MINUTE_S)
            if per_min > cs.hw_slowdown_per_min:
                bits = [name for bit, name in HW_SLOWDOWN_BITS.items() if reasons is not None and reasons & bit]
                add("hw_slowdown", "hardware", 2, "drain", f"hardware slowdown {_fmt(per_min)}/min over {_dur(win)}",
                    Evidence("nvml_value", f"HW slowdown reasons set for ~{events:.0f} samples ({observed_s:.0f}s) of the last {_dur(win)}; "
                             f"now {reasons if reasons is None else hex(reasons)} ({', '.join(bits) or 'clear'}); threshold {cs.hw_slowdown_per_min}/min",
                             {"observed_s": observed_s, "window_s": win, "per_min": per_min, "threshold_per_min": cs.hw_slowdown_per_min,
                              "clock_event_reasons": reasons}))

        margin = _num(g.margin_c)
        if margin is not None and margin < self.s.nvml.margin_warn_c:
            add("thermal", "hardware", 3, "none", f"{margin:.0f} C from thermal slowdown",
                Evidence("nvml_value", f"thermal margin {margin:.0f} C (temperature {g.temperature_c} C, slowdown at {g.slowdown_threshold_c} C); "
                         f"warn below {self.s.nvml.margin_warn_c} C",
                         {"margin_c": g.margin_c, "temperature_c": g.temperature_c, "slowdown_threshold_c": g.slowdown_threshold_c,
                          "margin_warn_c": self.s.nvml.margin_warn_c}))

        increases = []
        for name, value in sorted((g.nvlink_errors or {}).items(), key=lambda kv: str(kv[0])):
            if not isinstance(name, str) or not _NVLINK_KEY.match(name):
                continue
            d = self.delta(f"{ident}/nvlink/{name}", value)
            if d is not None and d[0] > 0:
                increases.append((name, d))
        if increases:
            total = sum(d[0] for _, d in increases)
            self.latch(
                self.finding(
                    f"nvml.nvlink:{key}", c, "nvml", "fabric", 2, "reboot-when-idle",
                    f"{key}: NVLink error counters increasing ({', '.join(n for n, _ in increases)})",
                    [Evidence("counter", f"NVLink {name} {d[1]:.0f} -> {d[1] + d[0]:.0f} (+{d[0]:.0f}) in {_dur(d[2])}",
                              {"counter": name, "before": d[1], "value": d[1] + d[0], "delta": d[0], "window_s": d[2]})
                     for name, d in increases],
                ),
                ttl,
                int(total),
            )

        errors = {str(k): str(v) for k, v in (g.errors or {}).items()}
        if errors:
            add("read_error", "unknown", 3, "none", f"could not read {', '.join(sorted(errors))}",
                Evidence("nvml_value", "; ".join(f"{k}: {v}" for k, v in sorted(errors.items())), {"errors": errors}))

    # ------------------------------------------------------------------ kernel log / Xid

    def kernel(self) -> None:
        k = self.snap.kernel
        if k.status == "error":
            self.collector_error("kernel_log", k.detail)
        if k.gap:
            self.add(
                self.finding(
                    "kernel.gap:node", NODE, "kernel_log", "unknown", 3, "none",
                    "kernel log lines may have been lost (the saved journal cursor was vacuumed)",
                    [Evidence("state", f"journal cursor gap; resumed at {k.cursor}", {"cursor": k.cursor})],
                )
            )
        events = [e for e in k.events if isinstance(e.xid, int) and not isinstance(e.xid, bool)]

        def order(e: Any) -> tuple[bool, float]:
            entry = self.cat.lookup(e.xid)  # followers (45, 154) after the Xids they may follow
            return (entry.sympathetic or bool(entry.recovery_action), _ts(e.first_ts, self.now))

        for e in sorted(events, key=order):
            self.fold(e)
        ttl = self.s.classify.finding_ttl_s
        for key, rec in sorted(self.xids.items()):
            if rec.live_episode and rec.last_seen is not None and self.now - rec.last_seen <= ttl:
                self.xid_finding(key, rec)

    def component_for_bus(self, raw: Any) -> Component:
        bus = _norm_bus(raw)
        if bus is None:
            return NODE
        if bus in self.bus_map:
            return self.bus_map[bus]
        if bus in self.gpu_ids:
            return self.gpu_ids[bus]
        ident = self.snap.kernel.identities.get(bus) or self.snap.kernel.identities.get(raw)
        uuid = serial = None
        if isinstance(ident, (tuple, list)) and len(ident) == 2:
            uuid = ident[0] if isinstance(ident[0], str) else None
            serial = ident[1] if isinstance(ident[1], str) else None
        return Component(kind="gpu", bus_id=bus, uuid=uuid, serial=serial)

    def fold(self, e: Any) -> None:
        """Add one XidEvent to its record: an occurrence (for repeat counting) and the episode."""
        first = _ts(e.first_ts, self.now)
        last = max(first, _ts(e.last_ts, first))
        count = e.count if isinstance(e.count, int) and not isinstance(e.count, bool) and e.count > 0 else 1
        comp = self.component_for_bus(e.bus_id)
        where = comp.bus_id or "node"
        key = f"{where}:{e.xid}"
        rec = self.xids.get(key) or XidRecord(component=comp, xid=e.xid)
        if comp.index is not None or rec.component.index is None:
            rec = dataclasses.replace(rec, component=comp)
        gpc = e.gpc if isinstance(e.gpc, int) and not isinstance(e.gpc, bool) else None
        tpc = e.tpc if isinstance(e.tpc, int) and not isinstance(e.tpc, bool) else None
        occurrences = rec.occurrences + (Occurrence(first, last, count, gpc, tpc),)
        text = e.text[:MAX_TEXT] if isinstance(e.text, str) else ""
        ttl = self.s.classify.finding_ttl_s
        if not rec.live_episode or rec.last_seen is None or first - rec.last_seen > ttl:
            rec = dataclasses.replace(
                rec, occurrences=occurrences, first_seen=first, last_seen=last, count=count, first_text=text,
                first_cursor=e.first_cursor, last_cursor=e.last_cursor, pid=e.pid, process=e.process,
                subcode=e.subcode, severity=e.nvlink_severity, primary=None, primary_ts=None, detail=None,
                synthesized=bool(e.synthesized),
            )
        else:
            rec = dataclasses.replace(
                rec, occurrences=occurrences,
                first_seen=min(rec.first_seen if rec.first_seen is not None else first, first),
                last_seen=max(rec.last_seen, last), count=rec.count + count,
                last_cursor=e.last_cursor or rec.last_cursor,
                severity=_worse_severity(rec.severity, e.nvlink_severity),
                subcode=e.subcode if e.subcode is not None else rec.subcode,
            )
        entry = self.cat.lookup(e.xid)
        if entry.sympathetic or entry.recovery_action:
            primary = self.find_primary(where, e.xid, first)
            if primary is not None:
                rec = dataclasses.replace(rec, primary=primary[0], primary_ts=primary[1])
        if entry.recovery_action:
            m = _RECOVERY.search(text)
            if m:
                rec = dataclasses.replace(rec, detail=m.group(1).strip()[:200])
        self.xids[key] = rec

    def find_primary(self, where: str, xid: int, t: float) -> tuple[int, float] | None:
        """The latest other Xid on the same GPU that ended at most sympathetic_window_s before `t`."""
        window = self.s.classify.sympathetic_window_s
        best: tuple[float, int] | None = None
        for key, rec in self.xids.items():
            if rec.xid == xid or key.rsplit(":", 1)[0] != where:
                continue
            other = self.cat.lookup(rec.xid)
            if other.sympathetic or other.recovery_action:
                continue
            for o in rec.occurrences:
                if o.first_ts <= t + 1.0 and o.last_ts >= t - window:
                    cand = (min(o.last_ts, t), rec.xid)
                    if best is None or cand > best:
                        best = cand
        return (best[1], best[0]) if best is not None else None

    def outcome_for(self, rec: XidRecord) -> tuple[Outcome, list[Evidence], str]:
        """The catalog row's tier/attribution/action for this record after the rules, with the
        evidence for each rule that applied and a summary suffix."""
        entry = self.cat.lookup(rec.xid)
        outcome = entry.outcome
        notes: list[Evidence] = []
        suffix = ""
        cs = self.s.classify
        gk = rec.component.key()
        if entry.severity:
            match = next((o for word, o in entry.severity.items() if rec.severity and word.lower() == rec.severity.lower()), None)
            if match is not None:
                outcome = match
                suffix = f" ({rec.severity})"
                notes.append(Evidence("config", f"NVLink5 severity printed '{rec.severity}' (subcode {rec.subcode}): catalog rule T{match.tier} {match.attribution} {match.action}",
                                      {"severity": rec.severity, "subcode": rec.subcode}))
            else:
                notes.append(Evidence("config", f"no NVLink5 severity printed (subcode {rec.subcode}): the row's T{outcome.tier} applies",
                                      {"severity": rec.severity, "subcode": rec.subcode}))
        if entry.recovery_action and rec.detail:
            low = rec.detail.lower()
            match = next((o for word, o in entry.recovery_action if word in low), None)
            suffix = f" ({rec.detail})"
            if match is not None:
                outcome = match
            notes.append(Evidence("log_line", f"driver announced recovery action '{rec.detail}'", {"recovery_action": rec.detail}))
        if rec.primary is not None and (entry.sympathetic or entry.recovery_action):
            pe = self.cat.lookup(rec.primary)
            ago = (rec.first_seen or 0.0) - (rec.primary_ts or 0.0)
            if entry.sympathetic:
                outcome = Outcome(3, pe.attribution, "none")
                suffix = f" (sympathetic to xid {rec.primary})"
                text = f"follows Xid {rec.primary} ({pe.mnemonic}) on {gk} {_fmt(max(0.0, ago))}s earlier (within {_fmt(cs.sympathetic_window_s)}s): sympathetic, see that Xid"
            else:
                outcome = Outcome(outcome.tier, pe.attribution, outcome.action)
                text = f"follows Xid {rec.primary} ({pe.mnemonic}) on {gk} {_fmt(max(0.0, ago))}s earlier"
            notes.append(Evidence("history", text, {"primary_xid": rec.primary, "primary_seen": iso(rec.primary_ts)}))
        if entry.repeat is not None and rec.last_seen is not None:
            lo, hi = rec.last_seen - cs.xid_repeat_window_s, rec.last_seen
            occ = [o for o in rec.occurrences if o.last_ts >= lo and o.first_ts <= hi]
            located = [o for o in occ if o.gpc is not None and o.tpc is not None]
            if occ and len(located) == len(occ) and rec.xid == 13:
                groups: dict[tuple[int, int], list[float]] = {}
                for o in located:
                    groups.setdefault((o.gpc, o.tpc), []).append(o.first_ts)  # type: ignore[arg-type]
                (gpc, tpc), times = max(groups.items(), key=lambda kv: _bursts(kv[1], cs.xid_burst_window_s))
                here = _bursts(times, cs.xid_burst_window_s)
                where = f" at GPC {gpc}, TPC {tpc}"
            else:
                here = _bursts((o.first_ts for o in occ), cs.xid_burst_window_s)
                where = ""
            others = sorted(
                {
                    r.component.key()
                    for r in self.xids.values()
                    if r.xid == rec.xid and r.component.bus_id != rec.component.bus_id
                    and any(o.last_ts >= lo for o in r.occurrences)
                }
            )
            data = {"repeats": here, "repeat_count": cs.xid_repeat_count, "window_s": cs.xid_repeat_window_s, "other_gpus": others}
            if here >= cs.xid_repeat_count and not others:
                outcome = entry.repeat
                suffix = f" (repeated {here}x on this GPU{where}: hardware suspect)"
                notes.append(Evidence("history", f"{here} bursts on {gk}{where} within {_dur(cs.xid_repeat_window_s)} and on no other GPU "
                                      f"(threshold {cs.xid_repeat_count}): the same GPU keeps failing", data))
            elif others:
                suffix = " (also on other GPUs: application fault)"
                notes.append(Evidence("history", f"also seen on {', '.join(others)} within {_dur(cs.xid_repeat_window_s)}: "
                                      "the application, not this GPU", data))
            else:
                notes.append(Evidence("history", f"{here} burst(s) on {gk}{where} within {_dur(cs.xid_repeat_window_s)} "
                                      f"(hardware suspect at {cs.xid_repeat_count})", data))
        return outcome, notes, suffix

    def xid_finding(self, key: str, rec: XidRecord) -> None:
        entry = self.cat.lookup(rec.xid)
        comp = self.bus_map.get(rec.component.bus_id or "", rec.component)
        rec = dataclasses.replace(rec, component=comp)
        outcome, notes, suffix = self.outcome_for(rec)
        gk = comp.key()
        synth = " (no Xid number in the line: 'fallen off the bus' read as Xid 79)" if rec.synthesized else ""
        line = Evidence(
            "log_line",
            f"{rec.first_text}{synth} [{rec.count} line(s) {iso(rec.first_seen)} .. {iso(rec.last_seen)}; "
            f"first cursor {rec.first_cursor}, last cursor {rec.last_cursor}]",
            {
                "xid": rec.xid, "bus_id": comp.bus_id, "count": rec.count, "first_seen": iso(rec.first_seen),
                "last_seen": iso(rec.last_seen), "first_cursor": rec.first_cursor, "last_cursor": rec.last_cursor,
                "pid": rec.pid, "process": rec.process,
            },
        )
        catalog_ev = Evidence(
            "config",
            f"catalog: Xid {rec.xid} {entry.mnemonic}: NVIDIA immediate {entry.nvidia_immediate or '-'}, "
            f"investigatory {entry.nvidia_investigatory or '-'}; healthd T{entry.tier} {entry.attribution} {entry.action}"
            + (f" (site override: {', '.join(entry.overridden)})" if entry.overridden else "")
            + ("" if entry.in_catalog else " (not in catalog)"),
            {"mnemonic": entry.mnemonic, "source": list(entry.source), "in_catalog": entry.in_catalog, "overridden": list(entry.overridden)},
        )
        f = self.finding(
            f"xid:{gk}:{rec.xid}", comp, "kernel_log", outcome.attribution, outcome.tier, outcome.action,
            f"xid {rec.xid} {gk}: {entry.summary}{suffix}", [line, *notes, catalog_ev],
            xid=rec.xid, count=rec.count, first_seen=rec.first_seen, last_seen=rec.last_seen,
        )
        if entry.ignore:
            self.suppressed.append(f)
        else:
            self.add(f)

    # ------------------------------------------------------------------ InfiniBand

    def infiniband(self) -> None:
        ib, cfg = self.snap.infiniband, self.s.infiniband
        expected = cfg.expected_ports if isinstance(cfg.expected_ports, int) and not isinstance(cfg.expected_ports, bool) else None
        if ib.status == "error":
            self.collector_error("infiniband", ib.detail)
            return
        if ib.status != "ok":
            if ib.status == "no_data" and cfg.enabled and expected:
                self.add(
                    self.finding(
                        "ib.port_count:node", NODE, "infiniband", "fabric", 1, "drain",
                        f"0 of {expected} InfiniBand ports present ({ib.detail or 'no HCA found'})",
                        [Evidence("state", f"infiniband status {ib.status}: {ib.detail}", {"status": ib.status, "detail": ib.detail}),
                         Evidence("config", f"infiniband.expected_ports = {expected}", {"expected_ports": expected})],
                    )
                )
            return
        # A down port matters if it was up this boot (something broke) or if the node has fewer
        # ports up than it must (it is needed). A port never up on a node with enough ports up is
        # an unused one (not cabled) and stays quiet.
        up_count = sum(1 for p in ib.ports if p.up)
        needed = expected is not None and up_count < expected
        present = set()
        for p in ib.ports:
            key = f"{p.device}/{p.port}"
            present.add(key)
            self.port(p, key, needed)
        # A port seen up this boot that vanished from sysfs is down (its HCA is gone).
        for key, rec in list(self.ports.items()):
            if key not in present and rec.seen_up:
                device, _, num = key.rpartition("/")
                ghost = PortSample(device=device, port=int(num) if num.isdigit() else 0, state="ABSENT",
                                   phys_state="missing from sysfs", rate_gbps=None, link_layer=None)
                self.port(ghost, key, True)
        if expected and len(ib.ports) < expected:
            states = [f"{p.device}/{p.port} {p.state}/{p.phys_state}" for p in ib.ports]
            self.add(
                self.finding(
                    "ib.port_count:node", NODE, "infiniband", "fabric", 1, "drain",
                    f"{len(ib.ports)} of {expected} InfiniBand ports present ({up_count} up)",
                    [Evidence("state", f"ports: {', '.join(states) or 'none'}", {"present": len(ib.ports), "up": up_count, "expected": expected}),
                     Evidence("config", f"infiniband.expected_ports = {expected}", {"expected_ports": expected})],
                )
            )

    def port(self, p: PortSample, key: str, needed: bool) -> None:
        cfg = self.s.infiniband
        comp = Component(kind="port", device=p.device, port=p.port)
        self.port_counters(p, key, comp)  # first: this tick's link_downed delta feeds the flap count
        rec = self.ports.get(key) or PortRecord()
        if p.state is not None and p.phys_state is not None:
            rec = self.port_state(p, key, comp, rec, needed)
        self.ports[key] = dataclasses.replace(rec, updated=self.now)

        if p.up and cfg.expected_rate_gbps and _num(p.rate_gbps) is not None and p.rate_gbps < cfg.expected_rate_gbps:  # type: ignore[operator]
            self.add(
                self.finding(
                    f"ib.rate:{key}", comp, "infiniband", "fabric", 2, "drain",
                    f"{key}: link at {_fmt(p.rate_gbps)} Gb/s, expected {_fmt(cfg.expected_rate_gbps)}",  # type: ignore[arg-type]
                    [Evidence("state", f"ports/{p.port}/rate = {_fmt(p.rate_gbps)} Gb/s ({p.link_layer}); infiniband.expected_rate_gbps = "  # type: ignore[arg-type]
                              f"{_fmt(cfg.expected_rate_gbps)}", {"rate_gbps": p.rate_gbps, "expected_rate_gbps": cfg.expected_rate_gbps})],
                )
            )
        unreadable = {str(k): str(v) for k, v in (p.unreadable or {}).items()}
        if unreadable:
            self.add(
                self.finding(
                    f"ib.unreadable:{key}", comp, "infiniband", "unknown", 3, "none",
                    f"{key}: {len(unreadable)} counter file(s) unreadable; errors on them are unknown",
                    [Evidence("state", "; ".join(f"{f}: {err}" for f, err in sorted(unreadable.items())), {"unreadable": unreadable})],
                )
            )

    def port_state(self, p: PortSample, key: str, comp: Component, rec: PortRecord, needed: bool) -> PortRecord:
        """Track down_since and transitions; report drops (T1), short downs (T2) and flaps (T2)."""
        cfg = self.s.infiniband
        state = f"{p.state}/{p.phys_state}"
        transitions = rec.transitions
        if p.up:
            if rec.up is False:
                transitions += ((self.now, "up"),)
            recovered = rec.recovered_at
            if rec.drop_since is not None and recovered is None:
                recovered = self.now
            rec = dataclasses.replace(rec, up=True, state=state, down_since=None, seen_up=True, recovered_at=recovered, transitions=transitions)
        else:
            if rec.up is True:
                transitions += ((self.now, "down"),)
            down_since = rec.down_since if rec.down_since is not None and rec.up is False else self.now
            rec = dataclasses.replace(rec, up=False, state=state, down_since=down_since, transitions=transitions)
            if (rec.seen_up or needed) and self.now - down_since > cfg.drop_after_s:
                rec = dataclasses.replace(rec, drop_since=down_since, recovered_at=None)
        lo = self.now - cfg.flap_window_s
        rec = dataclasses.replace(rec, transitions=tuple(t for t in rec.transitions if t[0] > lo))

        state_ev = Evidence("state", f"ports/{p.port}/state {p.state}, phys_state {p.phys_state}",
                            {"state": p.state, "phys_state": p.phys_state})
        if not p.up and (rec.seen_up or needed) and rec.down_since is not None:
            down_for = self.now - rec.down_since
            if down_for > cfg.drop_after_s:
                self.add(self.finding(
                    f"ib.drop:{key}", comp, "infiniband", "fabric", 1, "drain",
                    f"{key}: port down for {_dur(down_for)} ({state})",
                    [state_ev, Evidence("history", f"down since {iso(rec.down_since)} ({_dur(down_for)}, drop after {_dur(cfg.drop_after_s)})",
                                        {"down_since": iso(rec.down_since), "down_s": down_for, "drop_after_s": cfg.drop_after_s})],
                    first_seen=rec.down_since,
                ))
            else:
                self.add(self.finding(
                    f"ib.down:{key}", comp, "infiniband", "fabric", 2, "none",
                    f"{key}: port down for {_dur(down_for)} ({state}); a drop after {_dur(cfg.drop_after_s)}",
                    [state_ev, Evidence("history", f"down since {iso(rec.down_since)}", {"down_since": iso(rec.down_since), "down_s": down_for})],
                    first_seen=rec.down_since,
                ))
        elif p.up and rec.drop_since is not None and rec.recovered_at is not None:
            if self.now - rec.recovered_at <= cfg.sticky_s:
                down_for = rec.recovered_at - rec.drop_since
                self.add(self.finding(
                    f"ib.drop:{key}", comp, "infiniband", "fabric", 1, "drain",
                    f"{key}: port dropped for {_dur(down_for)}, up again since {iso(rec.recovered_at)} (reported until {iso(rec.recovered_at + cfg.sticky_s)})",
                    [state_ev, Evidence("history", f"down from {iso(rec.drop_since)} to {iso(rec.recovered_at)} ({_dur(down_for)}); "
                                        f"sticky for {_dur(cfg.sticky_s)} after recovery",
                                        {"down_since": iso(rec.drop_since), "recovered_at": iso(rec.recovered_at), "sticky_s": cfg.sticky_s})],
                    first_seen=rec.drop_since,
                ))
            else:
                rec = dataclasses.replace(rec, drop_since=None, recovered_at=None)

        # Flaps: down-then-up cycles seen between ticks, or counted by link_downed (a flap shorter
        # than a tick is invisible to the state but not to the counter).
        ups = sum(1 for _, s in rec.transitions if s == "up")
        downed, _ = self.window(f"port/{key}/link_downed", cfg.flap_window_s)
        cycles = max(ups, int(downed))
        if cycles >= cfg.flap_cycles:
            self.latch(self.finding(
                f"ib.flap:{key}", comp, "infiniband", "fabric", 2, "drain",
                f"{key}: link flapping ({cycles} down/up cycles in {_dur(cfg.flap_window_s)})",
                [Evidence("history", f"{ups} down->up transitions observed and link_downed +{downed:.0f} within {_dur(cfg.flap_window_s)} "
                          f"(flap at {cfg.flap_cycles}); transitions: {', '.join(f'{s}@{iso(t)}' for t, s in rec.transitions) or 'none'}",
                          {"cycles": cycles, "observed_up_transitions": ups, "link_downed_delta": downed,
                           "window_s": cfg.flap_window_s, "flap_cycles": cfg.flap_cycles})],
            ), cfg.sticky_s, 0, total=cycles)
        return rec

    def port_counters(self, p: PortSample, key: str, comp: Component) -> None:
        cfg = self.s.infiniband
        th = cfg.thresholds
        counters = p.counters or {}

        def get(name: str) -> tuple[str, Any] | None:
            for prefix in ("counters/", "hw_counters/"):
                cd = counters.get(prefix + name)
                if cd is not None:
                    return prefix + name, cd
            return None

        # Deltas from raw values with our own baselines: idempotent when one sample is classified twice.
        deltas: dict[str, tuple[float, float]] = {}
        for path, cd in sorted(counters.items(), key=lambda kv: str(kv[0])):
            if not isinstance(path, str):
                continue
            name = path.rsplit("/", 1)[-1]
            if name not in IB_ERROR_COUNTERS:
                continue
            if getattr(cd, "saturated", False):
                self.add(self.finding(
                    f"ib.saturated:{key}:{name}", comp, "infiniband", "unknown", 3, "none",
                    f"{key}: {name} counter saturated at max: errors since are unknown; clear with perfquery -x -R",
                    [Evidence("counter", f"{path} = {getattr(cd, 'value', None)} (the PMA counter's maximum)",
                              {"counter": path, "value": getattr(cd, "value", None), "saturated": True})],
                ))
                self.baselines.pop(f"port/{key}/{name}", None)
                continue
            had = f"port/{key}/{name}" in self.baselines
            d = self.delta(f"port/{key}/{name}", getattr(cd, "value", None))
            if d is None and not had and _num(getattr(cd, "delta", None)) and cd.delta > 0:
                d = (float(cd.delta), float(cd.value) - float(cd.delta), _finite(cd.window_s, self.interval))
            if d is not None and d[0] > 0:
                deltas[name] = (d[0], d[2])
                self.record(f"port/{key}/{name}", d[0], d[2])

        violations: dict[str, list[Evidence]] = {}
        for name, kind, attr in IB_RATE_RULES:
            found = get(name)
            if found is None:
                continue
            path, cd = found
            limit = getattr(th, attr)
            if kind == "per_s":
                rate = _num(getattr(cd, "rate_per_s", None))
                if rate is not None and rate > limit:
                    violations.setdefault(name, []).append(Evidence(
                        "counter", f"{path} +{cd.delta} in {_fmt(cd.window_s)}s = {_fmt(rate)}/s (threshold {_fmt(limit)}/s)",
                        {"counter": path, "delta": cd.delta, "window_s": cd.window_s, "per_s": rate, "threshold_per_s": limit, "value": cd.value}))
            else:
                win = HOUR_S if kind == "per_hour" else MINUTE_S
                total, span = self.window(f"port/{key}/{name}", win)
                cover = max(win, span)
                rate = total / cover * win
                if total and rate > limit:
                    unit = "h" if kind == "per_hour" else "min"
                    violations.setdefault(name, []).append(Evidence(
                        "counter", f"{path} +{total:.0f} in the last {_dur(cover)} = {_fmt(rate)}/{unit} (threshold {_fmt(limit)}/{unit})",
                        {"counter": path, "delta": total, "window_s": cover, f"per_{unit}": rate, f"threshold_per_{unit}": limit, "value": cd.value}))
        for name in IB_ANY_RULES:
            if name in deltas:
                path = (get(name) or (name, None))[0]
                inc, span = deltas[name]
                violations.setdefault(name, []).append(Evidence(
                    "counter", f"{path} +{inc:.0f} in {_dur(span)} (any increase is an error)",
                    {"counter": path, "delta": inc, "window_s": span}))
        for name, ev in sorted(violations.items()):
            self.latch(self.finding(
                f"ib.counter:{key}:{name}", comp, "infiniband", "fabric", 2, "drain",
                f"{key}: {name} errors above threshold",
                ev,
            ), cfg.sticky_s, int(deltas.get(name, (0, 0))[0]))

    # ------------------------------------------------------------------ host

    def host(self) -> None:
        h, cfg = self.snap.host, self.s.host
        if h.status == "error":
            self.collector_error("host", h.detail)
            return
        if h.status != "ok":
            return
        specs = {fs.path: fs for fs in cfg.filesystems}
        for probe in h.filesystems:
            spec = specs.get(probe.path) or FilesystemSpec(path=probe.path)
            comp = Component(kind="filesystem", device=probe.path)
            key = comp.key()
            what = f"{probe.role} filesystem {probe.path}"
            data = {"path": probe.path, "role": probe.role, "mounted": probe.mounted, "writable": probe.writable,
                    "latency_s": probe.latency_s, "timed_out": probe.timed_out, "error": probe.error, "fstype": probe.fstype,
                    "mount_point": getattr(probe, "mount_point", None)}
            probe_ev = Evidence("probe", f"{probe.path}: mounted {probe.mounted} (mount {getattr(probe, 'mount_point', None)}, {probe.fstype}), "
                                f"writable {probe.writable}, write+fsync {probe.latency_s if probe.latency_s is None else f'{probe.latency_s:.3f}s'}"
                                f"{', timed out' if probe.timed_out else ''}{f', error: {probe.error}' if probe.error else ''}", data)

            def add(rule: str, attribution: str, tier: int, action: str, summary: str, *extra: Evidence,
                    key: str = key, comp: Component = comp, probe_ev: Evidence = probe_ev) -> None:
                self.add(self.finding(f"fs.{rule}:{key}", comp, "host", attribution, tier, action, summary, [probe_ev, *extra]))

            latency = _num(probe.latency_s)
            if not probe.mounted:
                add("unmounted", "storage", 1, "drain", f"{what} is not mounted (jobs cannot checkpoint)")
            elif probe.timed_out:
                add("hung", "storage", 1, "drain", f"{what} hung: write+fsync did not finish in {_fmt(spec.timeout_s)}s",
                    Evidence("config", f"timeout_s = {spec.timeout_s}", {"timeout_s": spec.timeout_s}))
            elif probe.writable is False:
                add("readonly", "storage", 1, "drain", f"{what} is not writable{f': {probe.error}' if probe.error else ''}")
            elif latency is not None and latency > spec.max_latency_s:
                add("slow", "storage", 2, "drain", f"{what} slow: write+fsync {latency:.2f}s (max {_fmt(spec.max_latency_s)}s)",
                    Evidence("config", f"max_latency_s = {spec.max_latency_s}", {"max_latency_s": spec.max_latency_s}))
            elif probe.error:
                add("probe_error", "unknown", 3, "none", f"could not probe {what}: {probe.error}")

        avail, total = _num(h.mem_available_bytes), _num(h.mem_total_bytes)
        if avail is not None and total and total > 0:
            pct = avail / total * 100
            if pct < cfg.mem_available_min_pct:
                self.add(self.finding(
                    "host.memory:node", NODE, "host", "software", 2, "none",
                    f"available memory {pct:.1f}% of {total / 2**30:.0f} GiB (minimum {_fmt(cfg.mem_available_min_pct)}%)",
                    [Evidence("state", f"/proc/meminfo MemAvailable {avail:.0f} of MemTotal {total:.0f} bytes = {pct:.2f}%",
                              {"mem_available_bytes": h.mem_available_bytes, "mem_total_bytes": h.mem_total_bytes, "pct": pct,
                               "min_pct": cfg.mem_available_min_pct})],
                ))
        for resource, limit, attribution in (
            ("memory", cfg.psi_memory_full_avg10_max, "software"),
            ("io", cfg.psi_io_full_avg10_max, "storage"),
        ):
            values = (h.psi or {}).get(resource) or {}
            full = _num(values.get("full_avg10")) if hasattr(values, "get") else None
            if full is not None and full > limit:
                self.add(self.finding(
                    f"host.psi_{resource}:node", NODE, "host", attribution, 3, "none",
                    f"{resource} pressure: full avg10 {full:.1f}% (max {_fmt(limit)}%)",
                    [Evidence("state", f"/proc/pressure/{resource} full avg10={full:.2f}", {"resource": resource, "full_avg10": full, "max": limit})],
                ))
        dstate = [(pid, comm) for pid, comm in (h.dstate_pids or ())]
        if len(dstate) >= cfg.dstate_min_count:
            shown = ", ".join(f"{pid} ({comm})" for pid, comm in dstate[:10])
            self.add(self.finding(
                "host.dstate:node", NODE, "host", "storage", 3, "none",
                f"{len(dstate)} processes in uninterruptible sleep (D state)",
                [Evidence("state", f"D-state processes: {shown}{' ...' if len(dstate) > 10 else ''}",
                          {"count": len(dstate), "pids": [[pid, comm] for pid, comm in dstate[:50]], "min_count": cfg.dstate_min_count})],
            ))

    # ------------------------------------------------------------------ result

    def emit_latches(self) -> None:
        for fid, la in sorted(self.latches.items()):
            if fid in self.fired or la.until < self.now:
                continue
            f = la.finding
            self.add(dataclasses.replace(
                f,
                evidence=f.evidence + (Evidence("history", f"last seen {iso(f.last_seen)}; reported until {iso(la.until)}",
                                                {"last_seen": iso(f.last_seen), "until": iso(la.until)}),),
            ))

    def prune(self) -> History:
        cs, ib = self.s.classify, self.s.infiniband
        now = self.now
        keep_s = max(SBE_WINDOW_S, _finite(cs.hw_slowdown_window_s, 0.0), _finite(ib.flap_window_s, 0.0), HOUR_S)
        series = {}
        for k, pts in self.series.items():
            kept = tuple(p for p in pts if p[0] > now - keep_s)
            if kept:
                series[k] = kept
        xid_keep = max(cs.xid_repeat_window_s, cs.finding_ttl_s, cs.sympathetic_window_s)
        xids = {}
        for k, r in self.xids.items():
            occ = tuple(o for o in r.occurrences if o.last_ts > now - xid_keep)
            live = r.live_episode and r.last_seen is not None and now - r.last_seen <= cs.finding_ttl_s
            if occ or live:
                xids[k] = dataclasses.replace(r, occurrences=occ)
        baselines = {k: v for k, v in self.baselines.items() if v[0] > now - BASELINE_MAX_AGE_S}
        latches = {k: la for k, la in self.latches.items() if la.until >= now}
        ports = {k: p for k, p in self.ports.items() if p.updated is None or p.updated > now - BASELINE_MAX_AGE_S}
        return History(
            boot_id=self.boot_id,
            time=now,
            gpu_ids=self.gpu_ids,
            baselines=baselines,
            series=series,
            xids=xids,
            ports=ports,
            latches=latches,
        ).capped()

    def result(self) -> Classification:
        self.emit_latches()
        findings = tuple(sorted(self.findings.values(), key=lambda f: (f.tier, f.id)))
        statuses = [self.snap.nvml.status, self.snap.kernel.status, self.snap.infiniband.status, self.snap.host.status]
        return Classification(
            findings=findings,
            history=self.prune(),
            verdict=verdict(findings, unreadable="ok" not in statuses and "error" in statuses),
            would_do=would_do(findings),
            suppressed=tuple(sorted(self.suppressed, key=lambda f: f.id)),
        )


__all__ = ["Classification", "classify"]
