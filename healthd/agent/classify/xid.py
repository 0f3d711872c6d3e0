"""Kernel-log rules: each Xid event is folded into its record (the occurrences the repeat and
sympathetic rules count, and the current episode), and every live episode is one finding whose
outcome is the catalog row's after those rules. Lost kernel lines are reported too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from healthd.agent.classify.catalog import XidOutcome
from healthd.agent.classify.context import TickContext, dur, fmt, in_range, iso, norm_bus
from healthd.agent.history import MAX_TEXT, Occurrence, XidRecord
from healthd.model import NODE, Component, Evidence, XidEvent

KERNEL_LOG = "kernel_log"

_RECOVERY = re.compile(r"\bto\s+(?:0x[0-9a-fA-F]+\s*)?\(([^)]*)\)")


def evaluate(ctx: TickContext) -> None:
    k = ctx.snap.kernel
    if k.status == "error":
        ctx.collector_error(KERNEL_LOG, k.detail)
    if k.gap:
        ctx.emit("kernel.gap", "node", NODE, KERNEL_LOG,
                 "kernel log lines may have been lost (the saved journal cursor was vacuumed)",
                 [Evidence("state", f"journal cursor gap; resumed at {k.cursor}", {"cursor": k.cursor})])

    def order(e: XidEvent) -> tuple[bool, float]:
        entry = ctx.catalog.lookup(e.xid)  # followers (45, 154) after the Xids they may follow
        return (entry.sympathetic or bool(entry.recovery_action), in_range(e.first_ts, ctx.now))

    for e in sorted(k.events, key=order):
        fold(ctx, e)
    ttl = ctx.settings.classify.finding_ttl_s
    for _key, rec in sorted(ctx.xids.items()):
        if rec.live_episode and rec.last_seen is not None and ctx.now - rec.last_seen <= ttl:
            xid_finding(ctx, rec)


def component_for_bus(ctx: TickContext, raw: str | None) -> Component:
    """The GPU at a bus id: this tick's from NVML, else the one last seen there, else what the
    kernel log said about it."""
    bus = norm_bus(raw)
    if bus is None:
        return NODE
    if bus in ctx.bus_map:
        return ctx.bus_map[bus]
    if bus in ctx.gpu_ids:
        return ctx.gpu_ids[bus]
    identities = ctx.snap.kernel.identities
    known = identities.get(bus) or (identities.get(raw) if raw else None)
    uuid, serial = known or (None, None)
    return Component(kind="gpu", bus_id=bus, uuid=uuid, serial=serial)


def fold(ctx: TickContext, e: XidEvent) -> None:
    """Add one XidEvent to its record: an occurrence (for repeat counting) and the episode."""
    first = in_range(e.first_ts, ctx.now)
    last = max(first, in_range(e.last_ts, first))
    count = e.count
    comp = component_for_bus(ctx, e.bus_id)
    where = comp.bus_id or "node"
    key = f"{where}:{e.xid}"
    rec = ctx.xids.get(key) or XidRecord(component=comp, xid=e.xid)
    if comp.index is not None or rec.component.index is None:
        rec = dataclasses.replace(rec, component=comp)
    occurrences = rec.occurrences + (Occurrence(first, last, count, e.gpc, e.tpc),)
    text = e.text[:MAX_TEXT]
    ttl = ctx.settings.classify.finding_ttl_s
    if not rec.live_episode or rec.last_seen is None or first - rec.last_seen > ttl:
        rec = dataclasses.replace(
            rec, occurrences=occurrences, first_seen=first, last_seen=last, count=count, first_text=text,
            first_cursor=e.first_cursor, last_cursor=e.last_cursor, pid=e.pid, process=e.process,
            subcode=e.subcode, severity=e.nvlink_severity, primary=None, primary_ts=None, detail=None,
            synthesized=e.synthesized,
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
    entry = ctx.catalog.lookup(e.xid)
    if entry.sympathetic or entry.recovery_action:
        primary = find_primary(ctx, where, e.xid, first)
        if primary is not None:
            rec = dataclasses.replace(rec, primary=primary[0], primary_ts=primary[1])
    if entry.recovery_action:
        m = _RECOVERY.search(text)
        if m:
            rec = dataclasses.replace(rec, detail=m.group(1).strip()[:200])
    ctx.xids[key] = rec


def find_primary(ctx: TickContext, where: str, xid: int, t: float) -> tuple[int, float] | None:
    """The latest other Xid on the same GPU that ended at most sympathetic_window_s before `t`."""
    window = ctx.settings.classify.sympathetic_window_s
    best: tuple[float, int] | None = None
    for key, rec in ctx.xids.items():
        if rec.xid == xid or key.rsplit(":", 1)[0] != where:
            continue
        other = ctx.catalog.lookup(rec.xid)
        if other.sympathetic or other.recovery_action:
            continue
        for o in rec.occurrences:
            if o.first_ts <= t + 1.0 and o.last_ts >= t - window:
                cand = (min(o.last_ts, t), rec.xid)
                if best is None or cand > best:
                    best = cand
    return (best[1], best[0]) if best is not None else None


def outcome_for(ctx: TickContext, rec: XidRecord) -> tuple[XidOutcome, list[Evidence], str]:
    """The catalog row's tier/attribution/action for this record after the rules, with the
    evidence for each rule that applied and a summary suffix."""
    entry = ctx.catalog.lookup(rec.xid)
    outcome = entry.outcome
    notes: list[Evidence] = []
    suffix = ""
    cs = ctx.settings.classify
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
        pe = ctx.catalog.lookup(rec.primary)
        ago = (rec.first_seen or 0.0) - (rec.primary_ts or 0.0)
        if entry.sympathetic:
            # Cleanup after another Xid: recorded (T3, no action) and charged to what that Xid is.
            outcome = XidOutcome(3, pe.attribution, "none")
            suffix = f" (sympathetic to xid {rec.primary})"
            text = f"follows Xid {rec.primary} ({pe.mnemonic}) on {gk} {fmt(max(0.0, ago))}s earlier (within {fmt(cs.sympathetic_window_s)}s): sympathetic, see that Xid"
        else:
            outcome = XidOutcome(outcome.tier, pe.attribution, outcome.action)
            text = f"follows Xid {rec.primary} ({pe.mnemonic}) on {gk} {fmt(max(0.0, ago))}s earlier"
        notes.append(Evidence("history", text, {"primary_xid": rec.primary, "primary_seen": iso(rec.primary_ts)}))
    if entry.repeat is not None and rec.last_seen is not None:
        outcome, suffix = _repeat(ctx, rec, rec.last_seen, entry.repeat, outcome, suffix, notes)
    return outcome, notes, suffix


def _repeat(
    ctx: TickContext, rec: XidRecord, last_seen: float, repeat: XidOutcome, outcome: XidOutcome, suffix: str,
    notes: list[Evidence],
) -> tuple[XidOutcome, str]:
    """The repeat rule: bursts of this Xid on this GPU (for Xid 13 at one GPC/TPC) within the repeat
    window and on no other GPU make the row's `repeat` outcome; seen on other GPUs it is the
    application's."""
    cs = ctx.settings.classify
    gk = rec.component.key()
    lo, hi = last_seen - cs.xid_repeat_window_s, last_seen
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
            for r in ctx.xids.values()
            if r.xid == rec.xid and r.component.bus_id != rec.component.bus_id
            and any(o.last_ts >= lo for o in r.occurrences)
        }
    )
    data = {"repeats": here, "repeat_count": cs.xid_repeat_count, "window_s": cs.xid_repeat_window_s, "other_gpus": others}
    if here >= cs.xid_repeat_count and not others:
        outcome = repeat
        suffix = f" (repeated {here}x on this GPU{where}: hardware suspect)"
        notes.append(Evidence("history", f"{here} bursts on {gk}{where} within {dur(cs.xid_repeat_window_s)} and on no other GPU "
                              f"(threshold {cs.xid_repeat_count}): the same GPU keeps failing", data))
    elif others:
        suffix = " (also on other GPUs: application fault)"
        notes.append(Evidence("history", f"also seen on {', '.join(others)} within {dur(cs.xid_repeat_window_s)}: "
                              "the application, not this GPU", data))
    else:
        notes.append(Evidence("history", f"{here} burst(s) on {gk}{where} within {dur(cs.xid_repeat_window_s)} "
                              f"(hardware suspect at {cs.xid_repeat_count})", data))
    return outcome, suffix


def xid_finding(ctx: TickContext, rec: XidRecord) -> None:
    """The finding of a live episode (suppressed instead when a site override ignores the Xid)."""
    entry = ctx.catalog.lookup(rec.xid)
    comp = ctx.bus_map.get(rec.component.bus_id or "", rec.component)
    rec = dataclasses.replace(rec, component=comp)
    outcome, notes, suffix = outcome_for(ctx, rec)
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
    f = ctx.build(
        f"xid:{gk}:{rec.xid}", comp, KERNEL_LOG, outcome.tier, outcome.attribution, outcome.action,
        f"xid {rec.xid} {gk}: {entry.summary}{suffix}", [line, *notes, catalog_ev],
        xid=rec.xid, count=rec.count, first_seen=rec.first_seen, last_seen=rec.last_seen,
    )
    if entry.ignore:
        ctx.suppressed.append(f)
    else:
        ctx.add(f)


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
