"""One classification: each registered source (healthd.agent.sources) in order over a shared
TickContext, its status handled before its rules, then the held findings, the pruned History, the
verdict and the requests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The registry imports the rule modules (this package), so it is read at call time, not bound here.
from healthd.agent import sources as registry
from healthd.agent.classify import xid
from healthd.agent.classify.catalog import Catalog
from healthd.agent.classify.context import TickContext, iso
from healthd.agent.classify.rules import rule
from healthd.agent.history import History, PortRecord
from healthd.model import NODE, Evidence, Finding, Snapshot, verdict, would_do
from healthd.settings import Settings

PORT_MAX_AGE_S = 7 * 86400.0
"""The record of a port not seen for this long is forgotten."""


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
    ctx = TickContext(snapshot, history, catalog, settings)
    if ctx.boot_changed:
        forget_on_reboot(ctx)
    for source in registry.SOURCES:
        name = source.name
        try:
            section(ctx, source, registry.sample_of(snapshot, source))
        except Exception as exc:  # noqa: BLE001 - a rule bug must not stop the other rules or the agent
            r = rule("classify.error")
            ctx.add(
                Finding(
                    id=f"classify.error:node:{name}",
                    component=NODE,
                    source=name,  # type: ignore[arg-type]
                    attribution=r.attribution,  # type: ignore[arg-type]
                    tier=r.tier,  # type: ignore[arg-type]
                    action=r.action,  # type: ignore[arg-type]
                    summary=f"healthd could not evaluate {name}: {type(exc).__name__}: {exc}",
                    evidence=(Evidence("state", f"classifier raised {type(exc).__name__}: {exc}"),),
                    first_seen=ctx.now,
                    last_seen=ctx.now,
                )
            )
    return result(ctx)


def section(ctx: TickContext, source: registry.Source, sample: Any) -> None:
    """One source: its status first (an error, an absent source), then its rules."""
    if sample.status == "error":
        if source.on_error is not None:
            source.on_error(ctx, sample)
        else:
            ctx.collector_error(source.name, sample.detail)
    elif sample.status == "no_data" and source.on_no_data is not None:
        source.on_no_data(ctx, sample)
    if sample.status == "ok" or source.always:
        source.rules(ctx, sample)


def forget_on_reboot(ctx: TickContext) -> None:
    """A reboot resets volatile counters, retrains links and applies every reset-gpu-when-idle
    and reboot-when-idle remedy: forget baselines and port states, close findings that asked for
    a reset or reboot. Xid occurrences stay, so a fault that comes back counts as a repeat."""
    remedied = ("reset-gpu-when-idle", "reboot-when-idle")
    ctx.ports = {k: PortRecord(updated=p.updated) for k, p in ctx.ports.items()}
    ctx.series = {k: v for k, v in ctx.series.items() if not k.startswith("port/")}
    ctx.latches = {k: la for k, la in ctx.latches.items() if la.finding.action not in remedied}
    for key, rec in list(ctx.xids.items()):
        if rec.live_episode and xid.outcome_for(ctx, rec)[0].action in remedied:
            ctx.xids[key] = dataclasses.replace(rec, first_seen=None, last_seen=None, count=0)


def emit_latches(ctx: TickContext) -> None:
    """Findings held after their condition cleared, with when they were last seen."""
    for fid, la in sorted(ctx.latches.items()):
        if fid in ctx.fired or la.until < ctx.now:
            continue
        f = la.finding
        ctx.add(dataclasses.replace(
            f,
            evidence=f.evidence + (Evidence("history", f"last seen {iso(f.last_seen)}; reported until {iso(la.until)}",
                                            {"last_seen": iso(f.last_seen), "until": iso(la.until)}),),
        ))


def prune(ctx: TickContext) -> History:
    """The new History: what the rules' windows still need, within the size limits."""
    cs = ctx.settings.classify
    now = ctx.now
    keep = {s.name: s.keep_s(ctx.settings) for s in registry.SOURCES}
    owned = [(s.series_prefix, keep[s.name]) for s in registry.SOURCES if s.series_prefix]
    longest = max((w for _, w in owned), default=0.0)
    series = {}
    for k, pts in ctx.series.items():
        keep_s = next((w for prefix, w in owned if k.startswith(prefix)), longest)
        kept = tuple(p for p in pts if p[0] > now - keep_s)
        if kept:
            series[k] = kept
    xid_keep = keep[xid.KERNEL_LOG]
    xids = {}
    for k, r in ctx.xids.items():
        occ = tuple(o for o in r.occurrences if o.last_ts > now - xid_keep)
        live = r.live_episode and r.last_seen is not None and now - r.last_seen <= cs.finding_ttl_s
        if occ or live:
            xids[k] = dataclasses.replace(r, occurrences=occ)
    latches = {k: la for k, la in ctx.latches.items() if la.until >= now}
    ports = {k: p for k, p in ctx.ports.items() if p.updated is None or p.updated > now - PORT_MAX_AGE_S}
    return History(
        boot_id=ctx.boot_id,
        time=now,
        gpu_ids=ctx.gpu_ids,
        series=series,
        xids=xids,
        ports=ports,
        latches=latches,
        ib_read=ctx.ib_read,
        nvml_read=ctx.nvml_read,
        reads=ctx.reads,
    ).capped()


def result(ctx: TickContext) -> Classification:
    emit_latches(ctx)
    findings = tuple(sorted(ctx.findings.values(), key=lambda f: (f.tier, f.id)))
    statuses = [registry.sample_of(ctx.snap, s).status for s in registry.SOURCES]
    return Classification(
        findings=findings,
        history=prune(ctx),
        verdict=verdict(findings, unreadable="ok" not in statuses and "error" in statuses),
        would_do=would_do(findings),
        suppressed=tuple(sorted(ctx.suppressed, key=lambda f: f.id)),
    )
