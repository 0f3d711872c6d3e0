"""Shared helpers for the benchmarks: percentiles, the machine, and writing results to a file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))  # so `tests.support` builders are importable when run as a script


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p99": pct(values, 99), "max": max(values), "n": len(values)}


def machine() -> dict[str, object]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save(name: str, doc: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"machine": machine(), **doc}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {path.relative_to(ROOT)}")
    return path


def print_and_save(name: str, results: dict, width: int) -> Path:
    """Each figure on a line of its own, names padded to `width`, then `save`."""
    for k, v in results.items():
        print(f"{k:{width}} {v}")
    return save(name, results)


def keep_skipped(name: str, doc: dict, keys: list[str]) -> dict:
    """`doc` with each of `keys` (the parts a run skipped) taken from the last saved results of `name`,
    so that a partial run does not erase the figures it did not measure."""
    path = RESULTS / f"{name}.json"
    if not keys or not path.exists():
        return doc
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return doc
    return {**doc, **{k: old[k] for k in keys if k in old}}
