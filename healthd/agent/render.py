"""The human-readable dry-run report: GPUs, ports, findings with evidence, what would be done. The
agent renders the state document it has just built, so the sections are there; finding fields are
named through healthd.statedoc like every other reader's."""

from __future__ import annotations

from typing import Any

from healthd.statedoc import component_label
from healthd.text import clean, table


def render_text(doc: dict[str, Any]) -> str:
    out: list[str] = []
    out.append(f"healthd on {doc['node']}: {doc['verdict'].upper()}  ({doc['generated_at']}{', dry run: nothing changed' if doc.get('dry_run') else ''})")
    out.append("")
    out.append("Sources")
    out += table(
        ["source", "status", "seconds", "detail"],
        [[name, s["status"], f"{s['seconds']:.4f}", s["detail"] or ""] for name, s in doc["sources"].items()],
    )
    out.append("")
    lacks = doc["sources"].get("nvml", {}).get("driver_lacks")
    if lacks:
        # absent readings, said apart from the GPUs table so no one reads them as healthy ones
        out.append("Not read: this NVIDIA driver's NVML lacks the function (no fault of the node, and no sign of health)")
        out += [f"  {fn}: {', '.join(readings)}" for fn, readings in lacks.items()]
        out.append("")
    if doc["gpus"]:
        out.append("GPUs")
        out += table(
            ["idx", "state", "name", "uuid", "serial", "bus_id", "temp", "pcie"],
            [[g["index"], g["state"], g["name"], g["uuid"], g["serial"], g["bus_id"], g["temperature_c"], g["pcie"]] for g in doc["gpus"]],
        )
    else:
        out.append(f"GPUs: no data ({doc['sources']['nvml']['detail'] or 'none reported'})")
    out.append("")
    if doc["ports"]:
        out.append("Ports")
        out += table(
            ["port", "state", "phys_state", "rate_gbps", "link_layer"],
            [[f"{p['device']}/{p['port']}", p["state"], p["phys_state"], p["rate_gbps"], p["link_layer"]] for p in doc["ports"]],
        )
    else:
        out.append(f"Ports: no data ({doc['sources']['infiniband']['detail'] or 'none found'})")
    out.append("")
    out += _inband(doc.get("inband") or {})
    findings = doc["findings"]
    out.append(f"Findings ({len(findings)})" if findings else "Findings: none")
    for f in findings:
        c = f["component"]
        who = component_label(c)
        xid = f" xid {f['xid']}" if f["xid"] is not None else ""
        out.append(f"  [T{f['tier']} {f['attribution']:<8} -> {f['action']}] {who}{xid}: {f['summary']}")
        if c["kind"] == "gpu" and (c["uuid"] or c["serial"]):
            out.append(f"      gpu uuid={c['uuid']} serial={c['serial']} bus={c['bus_id']}")
        out.append(f"      id={f['id']} count={f['count']} first={f['first_seen']} last={f['last_seen']}")
        for e in f["evidence"][:5]:
            out.append(f"      evidence ({e['kind']}): {e['text']}")
        if len(f["evidence"]) > 5:
            out.append(f"      ... {len(f['evidence']) - 5} more evidence items (see --format json)")
    out.append("")
    would = doc["would_do"]
    out.append("Would request" if would else "Would request: nothing")
    for w in would:
        out.append("  " + "  ".join(f"{k}={v}" for k, v in w.items()))
    return "\n".join(out) + "\n"


def _inband(section: dict[str, Any]) -> list[str]:
    """The training jobs on the node as their ranks report them: one table per job."""
    jobs = section.get("jobs") or []
    if not jobs:
        return ["In-band jobs: none", ""]
    out = []
    for job in jobs:
        median = job["step_median_s"]
        out.append(f"In-band job {job['job']}: {job['ranks_here']} of {job['world_size']} ranks here, "
                   f"median step {'?' if median is None else f'{median * 1000:.1f} ms'}")
        flagged = {f["rank"]: f for f in job["stragglers"]}
        behind = set(job["hang"]["behind"]) if job["hang"] else set()
        rows = []
        for r in job["ranks"]:
            w = r["windows"][-1] if r["windows"] else None
            note = []
            if r["rank"] in flagged:
                f = flagged[r["rank"]]
                note.append(f"STRAGGLER {f['effect']:+.1%} ({f['test']})")
            if r["rank"] in behind:
                note.append("BEHIND")
            if r["lost"] or r["torn"]:
                note.append(f"lost {r['lost']} torn {r['torn']}")
            # a GPU not confirmed by NVML's process list is the header's guess: marked with a '?'
            gpu = r["gpu"] if r.get("gpu_from", "nvml") == "nvml" or r["gpu"] < 0 else f"{r['gpu']}?"
            rows.append([r["rank"], gpu, r["last_step"], f"{r['last_step_age_s']:.1f}s", r["phase"],
                         "-" if w is None else w["window"],
                         "-" if w is None else f"{w['compute_s'] * 1000:.1f}",
                         "-" if w is None else f"{w['wait_s'] * 1000:.1f}", "; ".join(note)])
        out += table(["rank", "gpu", "step", "age", "phase", "window", "compute_ms", "wait_ms", "flags"], rows)
        if job["hang"]:
            h = job["hang"]
            out.append(f"  HANG: no step after {h['step']} for {h['stalled_s']:.0f} s (bound {h['bound_s']:.0f} s)")
        elif (stall := job.get("stall")) and stall["waits_elsewhere"] and stall["stalled_s"] > 1:
            out.append(f"  waiting on ranks of other nodes for {stall['stalled_s']:.0f} s (the controller judges it; "
                       f"the bound here is {stall['bound_s']:.0f} s)")
        for r in job.get("retired") or ():
            out.append(f"  retired: {r['ring']}: {r['why']}")
        for e in job["errors"]:
            out.append(f"  unreadable: {e}")
        out.append("")
    return out


# --------------------------------------------------------------------------- Nagios / Icinga

NAGIOS_STATUS = {"healthy": (0, "OK"), "degraded": (1, "WARNING"), "failed": (2, "CRITICAL"), "unknown": (3, "UNKNOWN")}
"""healthd's verdict -> (plugin exit code, service state), as the plugin guidelines number them."""
NAGIOS_TEXT_MAX = 600
"""The text part of the line is cut to this many characters (NRPE passes at most 1 KiB of a check's output)."""
NAGIOS_SUMMARIES = 3
"""At most this many finding summaries are named in the line; the rest are counted."""


def nagios_text(value: Any, limit: int = 200) -> str:
    """One piece of plugin output: printable ASCII, no `|` (it would start the perfdata), no newline
    (a second line is long output), at most `limit` characters."""
    return clean(str(value).replace("|", "/"), limit)


def _tier(f: Any) -> int | None:
    t = f.get("tier") if isinstance(f, dict) else None
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def render_nagios(doc: dict[str, Any] | None, problem: str = "") -> tuple[str, int]:
    """(one Nagios/Icinga plugin line, its exit code) for an agent document.

    `HEALTHD CRITICAL - node01: 2 T1 findings: xid 79 gpu3: ...; ... | findings=3;;; t1=2;;; t2=1;;; t3=0;;; gpus=8;;;`

    The verdict gives the state: failed CRITICAL (2), degraded WARNING (1), healthy OK (0); `problem`
    (the agent's state could not be used), no document or any other verdict is UNKNOWN (3), without
    perfdata when there is no document. The text names the findings of the worst tier present (their
    summaries, most severe first) and is built from `nagios_text` pieces only, so nothing a finding
    says can add a line or a perfdata field. Never raises on a malformed document: UNKNOWN instead."""
    try:
        return _render_nagios(doc, problem)
    except Exception as e:  # noqa: BLE001 - a plugin must always answer with a line and a code
        return f"HEALTHD UNKNOWN - cannot read the agent's document: {nagios_text(type(e).__name__ + ': ' + str(e))}", 3


def _render_nagios(doc: dict[str, Any] | None, problem: str) -> tuple[str, int]:
    if not isinstance(doc, dict) or problem:
        why = problem or "no agent document"
        perf = _nagios_perfdata(doc) if isinstance(doc, dict) else ""
        return f"HEALTHD UNKNOWN - {nagios_text(why, NAGIOS_TEXT_MAX)}{perf}", 3
    verdict = doc.get("verdict")
    code, state = NAGIOS_STATUS.get(verdict, NAGIOS_STATUS["unknown"]) if isinstance(verdict, str) else NAGIOS_STATUS["unknown"]
    node = nagios_text(doc.get("node") or "?", 64)
    raw = doc.get("findings")
    findings = [f for f in raw if isinstance(f, dict)] if isinstance(raw, list) else []
    if verdict == "unknown":
        text = f"{node}: unknown, no source could be read"
    elif not isinstance(verdict, str) or verdict not in NAGIOS_STATUS:
        text = f"{node}: verdict {nagios_text(repr(verdict), 40)}"
    elif not findings:
        text = f"{node}: {verdict}, no findings"
    else:
        worst = min((t for t in map(_tier, findings) if t is not None), default=None)
        named = [f for f in findings if _tier(f) == worst] if worst is not None else findings
        named.sort(key=lambda f: str(f.get("id")))
        label = f"T{worst} finding" if worst is not None else "finding"
        head = f"{node}: {verdict}, " if verdict == "healthy" else f"{node}: "
        parts = [nagios_text(f.get("summary") or f.get("id") or "unnamed finding", 120) for f in named[:NAGIOS_SUMMARIES]]
        more = f"; and {len(named) - NAGIOS_SUMMARIES} more" if len(named) > NAGIOS_SUMMARIES else ""
        text = f"{head}{len(named)} {label}{'' if len(named) == 1 else 's'}: {'; '.join(parts)}{more}"
    return f"HEALTHD {state} - {nagios_text(text, NAGIOS_TEXT_MAX)}{_nagios_perfdata(doc)}", code


def _nagios_perfdata(doc: dict[str, Any]) -> str:
    raw = doc.get("findings")
    if not isinstance(raw, list):
        return ""
    tiers = [_tier(f) for f in raw if isinstance(f, dict)]
    gpus = doc.get("gpus")
    fields = [f"findings={len(tiers)};;;", *(f"t{t}={tiers.count(t)};;;" for t in (1, 2, 3))]
    if isinstance(gpus, list):
        fields.append(f"gpus={len(gpus)};;;")
    return " | " + " ".join(fields)
