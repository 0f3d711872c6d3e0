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


import os

from healthd.text import clean, iso

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CHECKS_FILE = "checks.json"
MAX_RESULTS = 32

def result(name: str, ok: bool | None, detail: str, now: float, source: str) -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": clean(detail, 300), "time": iso(now), "source": source}


def gpu_count_result(pattern: str, expected: int | None, now: float, source: str) -> dict[str, Any] | None:
    """GPU device files matching `pattern` against nvml.expected_gpus; None when no count is expected."""
    if expected is None:
        return None
    found = count_digit_glob(pattern)
    if found is None:
        import glob  # lazy: any other pattern (glob imports re and fnmatch, ~4 ms of a hook run)

        found = len(glob.glob(pattern))
    detail = f"{found} of {expected} GPU device files present ({pattern})"
    return result("gpu_count", found >= expected, detail, now, source)


def count_digit_glob(pattern: str) -> int | None:
    """len(glob.glob(pattern)) for a pattern of the default's shape, `/dir/name[0-9]*` (a literal,
    absolute directory and a literal name start without `.`), by listing the directory; None for any
    other pattern."""
    directory, _, name = pattern.rpartition("/")
    prefix = name[:-6] if name.endswith("[0-9]*") else ""
    if (not directory.startswith("/") or not prefix or prefix.startswith(".")
            or any(c in directory + prefix for c in "*?[]\\")):
        return None
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    n = len(prefix)
    return sum(1 for e in names if e.startswith(prefix) and len(e) > n and e[n] in "0123456789")


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
