"""What the agent does with the controller's instructions (they ride on report responses).

The one instruction is `clear-finding`: after `healthctl repaired` the controller tells the agent
that the evidence of some findings up to a time no longer counts (the GPU was reseated or replaced),
so the agent stops reporting them until new evidence arrives. Pure functions over values; the agent
keeps the clears in its memory file so a restart does not bring the old evidence back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

MAX_CLEARS = 256
"""Cleared finding ids remembered at most (oldest dropped first)."""


def parse_clear(instruction: Mapping[str, Any]) -> dict[str, float]:
    """finding id -> before, from one `clear-finding` instruction. Raises ValueError when malformed."""
    if instruction.get("kind") != "clear-finding":
        raise ValueError(f"not a clear-finding instruction: {instruction.get('kind')!r}")
    findings, before = instruction.get("findings"), instruction.get("before")
    if not isinstance(findings, list) or not findings or not all(isinstance(f, str) and 0 < len(f) <= 256 for f in findings):
        raise ValueError("clear-finding needs `findings`: a non-empty list of finding ids")
    if isinstance(before, bool) or not isinstance(before, (int, float)) or not math.isfinite(before) or before <= 0:
        raise ValueError("clear-finding needs `before`: epoch seconds")
    return {f: float(before) for f in findings[:MAX_CLEARS]}


def merge_clears(current: Mapping[str, float], new: Mapping[str, float]) -> dict[str, float]:
    """The later `before` wins per finding; at most MAX_CLEARS kept (the oldest clears go first)."""
    out = dict(current)
    for fid, before in new.items():
        out[fid] = max(out.get(fid, 0.0), before)
    if len(out) > MAX_CLEARS:
        out = dict(sorted(out.items(), key=lambda kv: kv[1])[-MAX_CLEARS:])
    return out


def is_cleared(f: Any, cleared: Mapping[str, float]) -> bool:
    """A finding whose latest evidence is not newer than its clear (finding id -> before) no longer
    counts; new evidence brings it back. The agent and the controller judge by this one rule."""
    before = cleared.get(f.id)
    last = f.last_seen if f.last_seen is not None else f.first_seen
    return before is not None and (last is None or last <= before)


def apply_clears(classification: Any, cleared: Mapping[str, float]) -> tuple[Any, dict[str, float]]:
    """(the classification without cleared findings, the clears still needed). A finding whose latest
    evidence is newer than its clear comes back (the fault recurred) and its clear is dropped; a clear
    whose finding is gone is dropped too (the history forgot the old evidence)."""
    if not cleared:
        return classification, {}
    from healthd.classify import would_do
    from healthd.hooks.checks import verdict

    kept, still = [], {}
    for f in classification.findings:
        if is_cleared(f, cleared):
            still[f.id] = cleared[f.id]
        else:
            kept.append(f)
    if len(kept) == len(classification.findings):
        return classification, still
    findings = tuple(kept)
    # recompute the verdict from what is left, keeping `unknown` (a collector down) as it was
    base = "unknown" if classification.verdict == "unknown" else "healthy"
    return dataclasses.replace(classification, findings=findings, verdict=verdict(findings, base),
                               would_do=would_do(findings)), still
