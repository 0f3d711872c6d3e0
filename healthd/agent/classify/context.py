"""The working state of one classification, shared by the rule modules.

A TickContext starts from the input History by copying it (the input is never changed), holds the
findings raised so far and is folded back into a new History at the end of the tick. Rules raise
findings through `emit` (or `finding` + `latch` for findings held after their condition clears),
which take the tier, attribution and action from the rules table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from healthd.agent.classify.catalog import Catalog
from healthd.agent.classify.rules import rule
from healthd.agent.history import History, Latch
from healthd.model import NODE, TS_MAX, Component, Evidence, Finding, GpuSample, Snapshot, normalize_bus_id
from healthd.model import iso as _iso
from healthd.settings import Settings

HOUR_S, MINUTE_S = 3600.0, 60.0


# --------------------------------------------------------------------------- helpers


def finite_or(x: Any, default: float) -> float:
    """A setting's number, or `default` when it is missing or not a finite number."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return default
    return float(x)


def number(x: Any) -> float | None:
    """A usable number, or None (missing, NaN, a bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def in_range(t: float | None, default: float) -> float:
    """An epoch time between 1970 and 2100, or `default`."""
    return t if t is not None and 0.0 <= t <= TS_MAX else default


def iso(ts: Any) -> str | None:
    """model.iso that cannot raise: a time out of range renders as None."""
    t = number(ts)
    return _iso(t) if t is not None and 0.0 <= t <= TS_MAX else None


def clean(value: Any) -> Any:
    """Evidence data as strict JSON: NaN/inf (a broken reading) become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def is_clean(data: Any) -> bool:
    """Only scalars that JSON writes strictly (the common case: skip the copy)."""
    return isinstance(data, dict) and all(
        v is None or isinstance(v, (str, int)) or (isinstance(v, float) and math.isfinite(v)) for v in data.values()
    )


def norm_bus(raw: str | None) -> str | None:
    if not raw or not raw.strip():
        return None
    return normalize_bus_id(raw) or raw.strip()


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def dur(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def gpu_component(g: GpuSample) -> Component:
    return Component(kind="gpu", index=g.index, uuid=g.uuid, serial=g.serial, bus_id=norm_bus(g.bus_id))


# --------------------------------------------------------------------------- the context


class TickContext:
    """One tick's samples, settings and catalog, the history being built and the findings."""

    def __init__(self, snap: Snapshot, hist: History, catalog: Catalog, settings: Settings):
        self.snap, self.catalog, self.settings = snap, catalog, settings
        self.now = in_range(snap.time, in_range(hist.time, 0.0))
        interval = finite_or(settings.interval_s, 10.0)
        self.interval = interval if interval > 0 else 10.0
        prev_t = hist.time
        gap = self.now - prev_t if prev_t is not None else None
        self.elapsed = min(gap, 2 * self.interval) if gap is not None and gap > 0 else self.interval
        self.boot_changed = bool(snap.boot_id and hist.boot_id and snap.boot_id != hist.boot_id)
        self.boot_id = snap.boot_id if snap.boot_id else hist.boot_id

        self.gpu_ids = dict(hist.gpu_ids)
        self.series = dict(hist.series)
        self.xids = dict(hist.xids)
        self.ports = dict(hist.ports)
        self.latches = dict(hist.latches)
        self.ib_read = hist.ib_read
        self.nvml_read = hist.nvml_read
        self.reads = dict(hist.reads)
        self.nvml_fresh = True
        """This tick's NVML sample was not counted before (its read time is new)."""
        self.findings: dict[str, Finding] = {}
        self.suppressed: list[Finding] = []
        self.fired: set[str] = set()

        # This tick's GPUs by bus id (NVML), remembered so a GPU NVML loses still maps its Xids.
        self.bus_map: dict[str, Component] = {}
        if snap.nvml.status == "ok":
            for g in snap.nvml.gpus:
                c = self.gpu_component(g)
                if c.bus_id:
                    self.bus_map[c.bus_id] = c
                    self.gpu_ids.pop(c.bus_id, None)
                    self.gpu_ids[c.bus_id] = c

    def gpu_component(self, g: GpuSample) -> Component:
        """A GPU lost at handle lookup has no bus id, UUID or serial this tick: take them from the
        GPU last seen at its index, so the finding names the serial to RMA and its Xids join it."""
        c = gpu_component(g)
        if not g.lost or (c.bus_id and c.uuid and c.serial) or c.index is None:
            return c
        known = next((k for k in reversed(list(self.gpu_ids.values())) if k.index == c.index), None)
        if known is None:
            return c
        return Component(kind="gpu", index=c.index, uuid=c.uuid or known.uuid,
                         serial=c.serial or known.serial, bus_id=c.bus_id or known.bus_id)

    # ------------------------------------------------------------------ findings

    def add(self, f: Finding) -> None:
        """Keep `f`; of two findings with one id the stronger (lower tier) stays."""
        old = self.findings.get(f.id)
        if old is None or f.tier < old.tier:
            self.findings[f.id] = f

    def build(
        self,
        fid: str,
        component: Component,
        source: str,
        tier: int,
        attribution: str,
        action: str,
        summary: str,
        evidence: Iterable[Evidence],
        **kw: Any,
    ) -> Finding:
        """A finding with the outcome given (the catalog's, for an Xid)."""
        kw.setdefault("first_seen", self.now)
        kw.setdefault("last_seen", self.now)
        evidence = [e if is_clean(e.data) else dataclasses.replace(e, data=clean(e.data)) for e in evidence]
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

    def finding(
        self,
        kind: str,
        where: str,
        component: Component,
        source: str,
        summary: str,
        evidence: Iterable[Evidence],
        case: str = "",
        **kw: Any,
    ) -> Finding:
        """A finding `<kind>:<where>` with the outcome the rules table gives `kind` (in `case`)."""
        r = rule(kind, case)
        return self.build(f"{kind}:{where}", component, source, r.tier, r.attribution, r.action, summary, evidence, **kw)

    def emit(self, *args: Any, **kw: Any) -> None:
        """Raise a finding for this tick (`finding`'s arguments)."""
        self.add(self.finding(*args, **kw))

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
        self.latches[f.id] = Latch(f, self.now + max(0.0, finite_or(hold_s, 0.0)))
        self.fired.add(f.id)
        self.add(f)

    def fresh(self, source: str, read_time: float | None) -> bool:
        """Whether the counter deltas of `source`'s sample read at `read_time` are new: a sample
        classified again (the kernel follower ticks between collections) carries the same read time,
        and its deltas must not be counted twice. Remembers `read_time` for the next tick."""
        new = read_time is None or read_time != self.reads.get(source)
        if read_time is None:
            self.reads.pop(source, None)
        else:
            self.reads[source] = read_time
        return new

    def collector_error(self, source: str, detail: str) -> None:
        self.emit(
            f"collector.{source}", "node", NODE, source,
            f"could not check {source}: {detail or 'no detail'}",
            [Evidence("state", f"{source} collector status error: {detail or 'no detail'}", {"status": "error", "detail": detail})],
        )

    # ------------------------------------------------------------------ windows

    def record(self, key: str, amount: float, span: float) -> None:
        """Add an amount observed over `span` seconds to the windowed series `key`."""
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
