"""The goodput categories: where a GPU-second of a training job can go, in the one table that the
accounting (healthd.goodput), the report (healthd.goodput_report), `healthctl goodput` and the
controller's metrics iterate, and that docs/goodput.md lists (a test holds the two to the same rows).

A category is added here, with the rule that puts time in it in healthd.goodput; every reader picks
it up from the table (docs/architecture.md, "Adding a goodput category").
"""

from __future__ import annotations

from typing import NamedTuple


class Category(NamedTuple):
    name: str
    """The key in an account's `gpu_s`, the metrics' `category` label, the JSON's key."""
    colour: str
    """Its colour in the report's charts."""
    help: str
    """A few words, for the report's legend and table."""
    definition: str
    """Which GPU-seconds it holds, in full: docs/goodput.md's table says the same."""
    incident: bool = False
    """Part of what an interruption costs: charged to its incident (all of it to false_positive when
    the incident's action was wrong)."""


TABLE: tuple[Category, ...] = (
    Category("productive", "#2e7d32", "steps whose work survived",
             "steps whose work survived: up to the step the next run restored, or, in the last run of a job "
             "that completed or still runs, every step, up to the job's end (the steps after the last mark "
             "ran too)"),
    Category("checkpoint", "#1565c0", "the blocking part of saves",
             "the blocking part of every save; a save the run stopped inside ends where its evidence ends: at the "
             "interruption's first evidence (or the run's end, without an incident), so detection, decision and "
             "waiting keep their own time"),
    Category("lost", "#c62828", "lost work: redone after an interruption",
             "steps done after what the next run restored (all of them when it restored nothing), and the "
             "time from the last step mark to the interruption's first evidence", incident=True),
    Category("detection", "#ef6c00", "first evidence to detection", "first evidence to detection", incident=True),
    Category("decision", "#f9a825", "detection to the action applied",
             "detection to the action applied, waits for approval included", incident=True),
    Category("waiting", "#6d4c41", "the action to the run's end",
             "the action applied to the run's end (the time until the next run starts is queued, not held)",
             incident=True),
    Category("restart", "#8e24aa", "a later run's start to its first step",
             "a later run's start to its first step", incident=True),
    Category("straggler", "#00838f", "what a slow rank cost the job",
             "what a flagged slow rank cost: for a job s slower, s / (1 + s) of its productive time while "
             "flagged"),
    Category("false_positive", "#ad1457", "the whole cost of a wrong action",
             "an incident whose action was wrong: its lost, detection, decision, waiting and restart time, "
             "all of it"),
    Category("other", "#9e9e9e", "setup, runs with no step mark, custom events",
             "the rest: a first start's setup, a run with no step mark, and custom events other than saves "
             "(an evaluation, data loading)"),
)

CATEGORIES: tuple[str, ...] = tuple(c.name for c in TABLE)
INCIDENT_CATEGORIES: tuple[str, ...] = tuple(c.name for c in TABLE if c.incident)
BY_NAME: dict[str, Category] = {c.name: c for c in TABLE}
