"""The human-readable dry-run report: GPUs, ports, findings with evidence, what would be done. The
agent renders the state document it has just built, so the sections are there; finding fields are
named through healthd.statedoc like every other reader's."""

from __future__ import annotations

from typing import Any

from healthd.statedoc import component_label
from healthd.text import table


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
