"""Quick-check results: what the health check (and the epilog) measured, and what the agent makes of it.

`<run_dir>/checks.json` = {"time", "node", "agent": {"known", "reason"}, "active": why the active
checks ran or not, "results": [{"name", "ok", "detail", "time", "source"}]}. `ok` is true, false
or null (could not check: timed out, dcgmi not connected); only false becomes a finding. A writer
replaces the results it measured by name and keeps the others, so the epilog's GPU count does not
erase the health check's dcgmi result.

`findings_from_checks` (pure) maps failed results to findings:

| check        | finding id              | tier | attribution | action |
|--------------|-------------------------|------|-------------|--------|
| `gpu_count`  | `hooks.gpu_count:node`  | T1   | hardware    | drain  |
| `dcgmi_diag` | `hooks.dcgmi_diag:node` | T2   | hardware    | drain  |
| other names  | `hooks.check:<name>`    | T3   | unknown     | none   |

A result older than `classify.finding_ttl_s` is no longer current and maps to nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from healthd.hooks.common import clean, iso, parse_time

CHECKS_FILE = "checks.json"
MAX_RESULTS = 32

RULES: dict[str, tuple[int, str, str]] = {
    "gpu_count": (1, "hardware", "drain"),
    "dcgmi_diag": (2, "hardware", "drain"),
}


def result(name: str, ok: bool | None, detail: str, now: float, source: str) -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": clean(detail, 300), "time": iso(now), "source": source}


def gpu_count_result(pattern: str, expected: int | None, now: float, source: str) -> dict[str, Any] | None:
    """GPU device files matching `pattern` against nvml.expected_gpus; None when no count is expected."""
    if expected is None:
        return None
    import glob

    found = sorted(glob.glob(pattern))
    detail = f"{len(found)} of {expected} GPU device files present ({pattern})"
    return result("gpu_count", len(found) >= expected, detail, now, source)


def merged_doc(old: dict[str, Any] | None, node: str, now: float, new: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The checks document to write: `new` results replace those of the same name in `old` (when
    `old` is for this node); the others are kept."""
    kept: dict[str, dict[str, Any]] = {}
    if old is not None and old.get("node") == node and isinstance(old.get("results"), list):
        for r in old["results"][:MAX_RESULTS]:
            if isinstance(r, dict) and isinstance(r.get("name"), str):
                kept[r["name"]] = r
    for r in new:
        kept[r["name"]] = r
    doc = {"time": iso(now), "node": node, **extra, "results": list(kept.values())[:MAX_RESULTS]}
    return doc


def findings_from_checks(doc: Any, node: str, now: float, ttl_s: float) -> tuple[tuple[Any, ...], str]:
    """(findings, problem): failed, current results of a checks document for `node` as Findings.
    `problem` is '' or why the document was ignored as a whole."""
    from healthd.model import NODE, Evidence, Finding

    if not isinstance(doc, dict):
        return (), "checks document is not an object"
    if doc.get("node") != node:
        return (), f"checks file is for node {clean(repr(doc.get('node')), 80)}, not {node}"
    results = doc.get("results")
    if not isinstance(results, list):
        return (), "checks document has no results list"
    out: dict[str, Any] = {}
    for r in results[:MAX_RESULTS]:
        if not isinstance(r, dict) or r.get("ok") is not False or not isinstance(r.get("name"), str):
            continue
        t = parse_time(r.get("time"))
        if t is None or now - t > ttl_s or t - now > ttl_s:
            continue
        name = clean(r["name"], 40)
        tier, attribution, action = RULES.get(name, (3, "unknown", "none"))
        fid = f"hooks.{name}:node" if name in RULES else f"hooks.check:{name}"
        detail = clean(r.get("detail") or "failed", 200)
        source = clean(r.get("source") or "hook", 40)
        out[fid] = Finding(
            id=fid,
            component=NODE,
            source="host",
            attribution=attribution,  # type: ignore[arg-type]
            tier=tier,  # type: ignore[arg-type]
            action=action,  # type: ignore[arg-type]
            summary=f"quick check {name} failed: {detail}",
            evidence=(Evidence("probe", f"{source} at {iso(t)}: {name} failed: {detail}",
                               {"check": name, "ok": False, "detail": detail, "by": source, "time": iso(t)}),),
            first_seen=t,
            last_seen=t,
        )
    return tuple(out.values()), ""


def verdict(findings: Iterable[Any], before: str) -> str:
    """classify's verdict rule applied to a finding set that grew: any T1 is failed; a node no source
    could read stays unknown; findings make it degraded."""
    findings = list(findings)
    if any(f.tier == 1 for f in findings):
        return "failed"
    if before == "unknown":
        return "unknown"
    return "degraded" if findings else "healthy"


def merge(classification: Any, extra: Iterable[Any]) -> Any:
    """A Classification with `extra` findings added (a classifier finding with the same id wins),
    its verdict and would_do recomputed."""
    ids = {f.id for f in classification.findings}
    extra = [f for f in extra if f.id not in ids]
    if not extra:
        return classification
    from dataclasses import replace

    from healthd.classify import would_do

    findings = tuple(sorted((*classification.findings, *extra), key=lambda f: (f.tier, f.id)))
    return replace(classification, findings=findings, verdict=verdict(findings, classification.verdict),
                   would_do=would_do(findings))
