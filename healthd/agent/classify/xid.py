"""Kernel-log rules: each Xid event is folded into its record (the occurrences the repeat and
sympathetic rules count, and the current episode), and every live episode gets the outcome of its
catalog row after those rules. Episodes on one GPU that follow each other within
`classify.sympathetic_window_s` are one incident: one finding with the strongest outcome, whose
evidence lists the others. A GPU that failed to initialise (read as Xid 143) and NVML's missing GPU
are reported in one place. Lost kernel lines are reported too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from healthd.agent.classify.catalog import XidOutcome
from healthd.agent.classify.context import TickContext, dur, fmt, in_range, iso, norm_bus
from healthd.agent.history import MAX_TEXT, Occurrence, XidRecord
from healthd.model import ACTION_SEVERITY, NODE, Component, Evidence, Finding, KernelSample, XidEvent

KERNEL_LOG = "kernel_log"
INIT_FAILED_XID = 143
"""GPU_INIT_ERROR: what the kernel-log collector reports a failed GPU initialisation as."""
GPU_COUNT_ID = "nvml.gpu_count:node"
INCIDENT_MEMBERS_MAX = 16
"""Other Xids whose lines an incident's evidence carries (the rest are counted)."""
_SYNTHESIZED = {
    79: "'fallen off the bus' read as Xid 79",
    INIT_FAILED_XID: "a GPU that failed to initialise read as Xid 143",
}

_RECOVERY = re.compile(r"\bto\s+(?:0x[0-9a-fA-F]+\s*)?\(([^)]*)\)")


def evaluate(ctx: TickContext, k: KernelSample) -> None:
    if k.gap:
        ctx.emit("kernel.gap", "node", NODE, KERNEL_LOG,
                 "kernel log lines may have been lost (the saved journal cursor was vacuumed)",
                 [Evidence("state", f"journal cursor gap; resumed at {k.cursor}", {"cursor": k.cursor})])

    learn_identities(ctx)

    def order(e: XidEvent) -> tuple[bool, float]:
        entry = ctx.catalog.lookup(e.xid)  # followers (45, 154) after the Xids they may follow
        return (entry.sympathetic or bool(entry.recovery_action), in_range(e.first_ts, ctx.now))

    for e in sorted(k.events, key=order):
        fold(ctx, e)
    ttl = ctx.settings.classify.finding_ttl_s
    missing = missing_gpus(ctx)
    built: list[tuple[XidRecord, Finding]] = []
    for _key, rec in sorted(ctx.xids.items()):
        if not rec.live_episode or rec.last_seen is None:
            continue
        # A GPU that failed to initialise stays failed while NVML still lacks it, past the ttl.
        if ctx.now - rec.last_seen <= ttl or (rec.xid == INIT_FAILED_XID and rec.component.bus_id in missing):
            f, ignored = xid_finding(ctx, rec)
            if ignored:
                ctx.suppressed.append(f)
            else:
                built.append((rec, f))
    for f in incidents(ctx, built):
        ctx.add(f)
    join_gpu_count(ctx, missing)


def learn_identities(ctx: TickContext) -> None:
    """Remember the UUID and serial the driver printed for a bus id (kept in History with NVML's), so a
    GPU that later fails to initialise, and so never reaches NVML, is still named by its board."""
    for raw, (uuid, serial) in sorted(ctx.snap.kernel.identities.items()):
        bus = norm_bus(raw)
        if bus is None or (uuid is None and serial is None):
            continue
        known = ctx.gpu_ids.get(bus)
        if known is None:
            ctx.gpu_ids[bus] = Component(kind="gpu", bus_id=bus, uuid=uuid, serial=serial)
        elif known.uuid in (None, uuid) and (known.uuid is None or known.serial is None):
            ctx.gpu_ids[bus] = dataclasses.replace(known, uuid=known.uuid or uuid, serial=known.serial or serial)


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
            notes.append(Evidence("config", f"NVLink severity printed '{rec.severity}'{_subcode(rec)}: catalog rule T{match.tier} {match.attribution} {match.action}",
                                  {"severity": rec.severity, "subcode": rec.subcode}))
        else:
            notes.append(Evidence("config", f"no NVLink severity printed{_subcode(rec)}: the row's T{outcome.tier} applies",
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
    elif others and ctx.catalog.lookup(rec.xid).attribution == "user":
        suffix = " (also on other GPUs: application fault)"
        notes.append(Evidence("history", f"also seen on {', '.join(others)} within {dur(cs.xid_repeat_window_s)}: "
                              "the application, not this GPU", data))
    elif others:
        # Several boards failing alike points at what they share (driver, power, firmware), not one board.
        suffix = " (also on other GPUs: not this board alone)"
        notes.append(Evidence("history", f"also seen on {', '.join(others)} within {dur(cs.xid_repeat_window_s)}: "
                              "something the GPUs share, not this board alone", data))
    else:
        notes.append(Evidence("history", f"{here} burst(s) on {gk}{where} within {dur(cs.xid_repeat_window_s)} "
                              f"(hardware suspect at {cs.xid_repeat_count})", data))
    return outcome, suffix


def xid_finding(ctx: TickContext, rec: XidRecord) -> tuple[Finding, bool]:
    """The finding of a live episode, and whether a site override ignores the Xid."""
    entry = ctx.catalog.lookup(rec.xid)
    comp = ctx.bus_map.get(rec.component.bus_id or "", rec.component)
    rec = dataclasses.replace(rec, component=comp)
    outcome, notes, suffix = outcome_for(ctx, rec)
    gk = comp.key()
    synth = f" (no Xid number in the line: {_SYNTHESIZED.get(rec.xid, f'read as Xid {rec.xid}')})" if rec.synthesized else ""
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
        + (f" (differs from NVIDIA: {entry.differs})" if entry.differs else "")
        + (f" (site override: {', '.join(entry.overridden)})" if entry.overridden else "")
        + ("" if entry.in_catalog else " (not in catalog)"),
        {"mnemonic": entry.mnemonic, "source": list(entry.source), "in_catalog": entry.in_catalog, "overridden": list(entry.overridden)},
    )
    f = ctx.build(
        f"xid:{gk}:{rec.xid}", comp, KERNEL_LOG, outcome.tier, outcome.attribution, outcome.action,
        f"xid {rec.xid} {gk}: {entry.summary}{suffix}", [line, *notes, catalog_ev],
        xid=rec.xid, count=rec.count, first_seen=rec.first_seen, last_seen=rec.last_seen,
    )
    return f, entry.ignore


def strength(f: Finding) -> tuple[int, int]:
    """Lower is stronger: certainty first, then the remedy."""
    return (f.tier, -ACTION_SEVERITY.get(f.action, 0))


def incidents(ctx: TickContext, built: list[tuple[XidRecord, Finding]]) -> list[Finding]:
    """Episodes on one GPU that start within the sympathetic window of the one before them (48 then
    63/64, 62 then 154, 79 and its cascade) are one incident: one finding with the strongest outcome.
    Its id is the first Xid's, so it stays the same while the incident grows, and its evidence lists
    the others. Node-level episodes (no bus id) stay apart."""
    window = ctx.settings.classify.sympathetic_window_s
    out: list[Finding] = []
    by_gpu: dict[str, list[tuple[XidRecord, Finding]]] = {}
    for rec, f in built:
        if f.component.bus_id is None:
            out.append(f)
        else:
            by_gpu.setdefault(f.component.bus_id, []).append((rec, f))
    for members in by_gpu.values():
        members.sort(key=lambda m: (m[1].first_seen or 0.0, m[0].xid))
        group: list[tuple[XidRecord, Finding]] = []
        end = 0.0
        for rec, f in members:
            start = f.first_seen or 0.0
            if group and start > end + window:
                out.append(merge(ctx, group))
                group = []
            end = max(end, f.last_seen or start) if group else (f.last_seen or start)
            group.append((rec, f))
        if group:
            out.append(merge(ctx, group))
    return out


def merge(ctx: TickContext, group: list[tuple[XidRecord, Finding]]) -> Finding:
    """One finding for an incident: the first Xid's id, the strongest member's outcome, summary and
    evidence, then a line per other member and their log lines."""
    first = group[0][1]
    if len(group) == 1:
        return first
    strongest = min((f for _, f in group), key=strength)  # a tie keeps the earliest
    rest = [f for _, f in group if f is not strongest]
    gk = first.component.key()
    window = ctx.settings.classify.sympathetic_window_s
    t0 = first.first_seen or 0.0
    evidence = list(strongest.evidence)
    for f in rest:
        entry = ctx.catalog.lookup(f.xid if f.xid is not None else -1)
        where = "first on this GPU" if f is first else f"{fmt(max(0.0, (f.first_seen or 0.0) - t0))}s after xid {first.xid}"
        evidence.append(Evidence(
            "history",
            f"same incident: xid {f.xid} ({entry.mnemonic}) on {gk}, {where}: T{f.tier} {f.attribution} {f.action}",
            {"xid": f.xid, "finding": f.id, "tier": f.tier, "action": f.action, "first_seen": iso(f.first_seen),
             "window_s": window},
        ))
    for f in rest[:INCIDENT_MEMBERS_MAX]:
        evidence.extend(e for e in f.evidence if e.kind == "log_line")
    if len(rest) > INCIDENT_MEMBERS_MAX:
        evidence.append(Evidence("history", f"log lines of {len(rest) - INCIDENT_MEMBERS_MAX} more Xid(s) of this incident not shown",
                                 {"not_shown": len(rest) - INCIDENT_MEMBERS_MAX}))
    firsts = [f.first_seen for _, f in group if f.first_seen is not None]
    lasts = [f.last_seen for _, f in group if f.last_seen is not None]
    return dataclasses.replace(
        first,
        tier=strongest.tier,
        attribution=strongest.attribution,
        action=strongest.action,
        summary=f"{strongest.summary} (one incident with {listed(rest)})",
        evidence=tuple(evidence),
        first_seen=min(firsts) if firsts else first.first_seen,
        last_seen=max(lasts) if lasts else first.last_seen,
    )


def listed(rest: list[Finding], most: int = 4) -> str:
    """`xid 48, xid 63` or `xid 8, xid 13, xid 14, xid 31 and 45 more`: a summary stays one short line."""
    names = [f"xid {f.xid}" for f in rest]
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most])} and {len(names) - most} more"


def missing_gpus(ctx: TickContext) -> set[str]:
    """Bus ids NVML does not list this tick although it counts fewer GPUs than expected: known from
    earlier ticks or named by an init-failure line. Empty while NVML sees them all."""
    if GPU_COUNT_ID not in ctx.findings:
        return set()
    return {
        rec.component.bus_id for rec in ctx.xids.values()
        if rec.xid == INIT_FAILED_XID and rec.component.bus_id and rec.component.bus_id not in ctx.bus_map
    }


def join_gpu_count(ctx: TickContext, missing: set[str]) -> None:
    """NVML counting fewer GPUs than expected and the journal naming the GPU that failed to initialise
    are one fault: the init-failure finding (it names the bus id, and the serial when known) carries
    NVML's count, and the count finding goes when those failures account for every missing GPU."""
    count = ctx.findings.get(GPU_COUNT_ID)
    if count is None or not missing:
        return
    failed = [f for f in ctx.findings.values()
              if f.source == KERNEL_LOG and f.component.bus_id in missing
              and (f.xid == INIT_FAILED_XID or any(e.data.get("xid") == INIT_FAILED_XID for e in f.evidence if e.data))]
    if not failed:
        return
    numbers = next((e.data for e in count.evidence if e.kind == "nvml_value" and e.data), {})
    expected, seen = numbers.get("expected"), numbers.get("count")
    unexplained = (expected - seen - len(failed)) if isinstance(expected, int) and isinstance(seen, int) else 1
    names = ", ".join(sorted(f.component.bus_id or "" for f in failed))
    for f in failed:
        ctx.findings[f.id] = dataclasses.replace(
            f,
            summary=f"{f.summary}; NVML sees {seen} of {expected} GPUs",
            evidence=f.evidence + tuple(count.evidence),
        )
    if unexplained <= 0:
        del ctx.findings[GPU_COUNT_ID]
    else:
        ctx.findings[GPU_COUNT_ID] = dataclasses.replace(
            count,
            summary=f"{count.summary}; {names} failed to initialise",
            evidence=count.evidence + (Evidence(
                "history", f"failed to initialise (kernel log): {names}; see {', '.join(sorted(f.id for f in failed))}",
                {"failed": sorted(f.component.bus_id for f in failed), "findings": sorted(f.id for f in failed)}),),
        )


def _subcode(rec: XidRecord) -> str:
    return f" (subcode {rec.subcode})" if rec.subcode is not None else ""


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
