"""What the agent does with the controller's instructions (they ride on report responses).

The one instruction is `clear-finding`, in one of two scopes:

- `evidence` (after `healthctl repaired`, or a completed reboot): the evidence of some findings up to
  a time no longer counts (the GPU was reseated or replaced), so the agent stops reporting them until
  new evidence arrives. A condition still observed after the repair is new evidence.
- `episode` (after `healthctl undo` or `close`: an operator judged healthd wrong): the episode of the
  finding that had begun by that time no longer counts, however long it lasts; a new episode (the
  condition went away and came back) or a new kernel log line does. An episode starts at a
  finding's `first_seen`, which the agent carries from tick to tick while the finding stays
  (`carry_episodes`), so a persistent condition keeps the first_seen of its episode.

Pure functions over values; the agent keeps the clears and the episodes in its memory file so a
restart does not bring the old evidence back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from healthd.model import is_cleared, verdict, would_do

MAX_CLEARS = 256
"""Cleared finding ids remembered at most (oldest dropped first)."""
SCOPES = ("evidence", "episode")
MAX_EPISODES = 1024
"""Episode starts remembered at most (one per current finding)."""


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


def clear_scope(instruction: Mapping[str, Any]) -> str:
    """`evidence` (the default, what older controllers send) or `episode`. ValueError otherwise."""
    scope = instruction.get("scope", "evidence")
    if scope not in SCOPES:
        raise ValueError(f"clear-finding scope must be one of {', '.join(SCOPES)}, found {scope!r}")
    return str(scope)


def merge_clears(current: Mapping[str, float], new: Mapping[str, float]) -> dict[str, float]:
    """The later `before` wins per finding; at most MAX_CLEARS kept (the oldest clears go first)."""
    out = dict(current)
    for fid, before in new.items():
        out[fid] = max(out.get(fid, 0.0), before)
    if len(out) > MAX_CLEARS:
        out = dict(sorted(out.items(), key=lambda kv: kv[1])[-MAX_CLEARS:])
    return out


def carry_episodes(classification: Any, episodes: Mapping[str, float]) -> tuple[Any, dict[str, float]]:
    """(the classification with each finding's first_seen at the start of its episode, the episode
    starts to remember). A finding present in the previous tick keeps the earlier first_seen; one
    that was absent starts a new episode at its own."""
    changed, starts = [], {}
    for f in classification.findings:
        start = episodes.get(f.id)
        if start is not None and (f.first_seen is None or start < f.first_seen):
            f = dataclasses.replace(f, first_seen=start)
            changed.append(f)
        else:
            changed.append(f)
        if f.first_seen is not None and len(starts) < MAX_EPISODES:
            starts[f.id] = f.first_seen
    if all(a is b for a, b in zip(changed, classification.findings, strict=True)):
        return classification, starts
    return dataclasses.replace(classification, findings=tuple(changed)), starts


def apply_clears(classification: Any, cleared: Mapping[str, float],
                 dismissed: Mapping[str, float] | None = None) -> tuple[Any, dict[str, float], dict[str, float]]:
    """(the classification without cleared findings, the evidence clears still needed, the episode
    clears still needed). A finding whose latest evidence is newer than its clear comes back (the
    fault recurred) and its clear is dropped; a finding of a new episode drops its episode clear; a
    clear whose finding is gone is dropped too (the history forgot the old evidence, or the episode
    ended)."""
    dismissed = dismissed or {}
    if not cleared and not dismissed:
        return classification, {}, {}
    kept, still, still_dismissed = [], {}, {}
    for f in classification.findings:
        if is_cleared(f, cleared, dismissed):
            if f.id in cleared:
                still[f.id] = cleared[f.id]
            if f.id in dismissed:
                still_dismissed[f.id] = dismissed[f.id]
        else:
            kept.append(f)
    if len(kept) == len(classification.findings):
        return classification, still, still_dismissed
    findings = tuple(kept)
    # recompute the verdict from what is left, keeping `unknown` (a collector down) as it was
    return dataclasses.replace(classification, findings=findings,
                               verdict=verdict(findings, unreadable=classification.verdict == "unknown"),
                               would_do=would_do(findings)), still, still_dismissed
