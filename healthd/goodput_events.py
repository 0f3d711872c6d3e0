"""The goodput event log's format: where a node keeps a job's log, the entries' keys, healthd's event
kinds with their fields and who writes each, and one builder per entry. The writers (the agent from
rank 0's ring, healthd.agent.goodput_log; the epilog, a run's end; the controller, healthd.controller.
goodput_gather) build their entries here, and the readers (healthd.goodput's parser, the controller's
check of what a node ships) take the keys from here. docs/goodput.md's table of entries says the same.

One JSON object per line. ml-goodput-measurement's keys where that library has one, so its tools read
the same file; healthd's own records are `healthd_event` entries with a `time`. Times are Unix
seconds.

Cheap to import (nothing at the top, JSON only where a line is made): the epilog adds a run's end
with it at every job's end.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

LOG_DIR = "goodput"
"""Under the node's `state_dir`: `<job>.jsonl`, the job's log on the node that runs its rank 0."""
LOG_SUFFIX = ".jsonl"

JOB_NAME = "job_name"
"""On every line: the Slurm job id."""
RUN = "run"
"""On any line, optional: the run it belongs to, Slurm's restart count (SLURM_RESTART_COUNT; 0 for the
job's first run). Without it a line belongs to the run whose job_start_time line precedes it in its
file."""

# ml-goodput-measurement's entries
JOB_START_TIME = "job_start_time"
"""A run starts: the job's first, and one per requeue."""
JOB_END_TIME = "job_end_time"
"""The job ended: its last run completed."""
STEP_COUNT = "step_count"
STEP_START_TIME = "step_start_time"
"""Step `step_count` starts then (a mark: one per window is enough)."""
CUSTOM_EVENT_TYPE = "custom_badput_event_type"
CUSTOM_EVENT_START_TIME = "custom_badput_event_start_time"
CUSTOM_EVENT_END_TIME = "custom_badput_event_end_time"
CHECKPOINT_SAVE = "checkpoint_save"
"""The custom event healthd accounts as `checkpoint`: the blocking part of a save (its start, then its
end). Any other custom event's time (an evaluation, data loading) is `other`."""
DATA_LOADING_START_TIME = "data_loading_start_time"
DATA_LOADING_END_TIME = "data_loading_end_time"
"""ml-goodput-measurement's data loading: accounted like a custom event named `data_loading`."""
DATA_LOADING = "data_loading"

# healthd's own
EVENT = "healthd_event"
TIME = "time"

NODE, CONTROLLER, LEDGER = "node", "controller", "ledger"
"""Who writes a healthd event: a node (the agent of rank 0's node and the epilog; shipped to the
controller), the controller (from its rounds), the ledger (joined where the ledger is read)."""

EVENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "allocation": (NODE, ("gpus", "nodes")),
    "run_end": (NODE, ("state", "exit_code")),
    "durable": (NODE, ("step",)),
    "restored": (NODE, ("step",)),
    "interrupt": (LEDGER, ("incident", "cause", "node", "gpu", "rank")),
    "evidence": (LEDGER, ("incident",)),
    "detected": (LEDGER, ("incident",)),
    "decided": (LEDGER, ("incident",)),
    "false_positive": (LEDGER, ("incident",)),
    "straggler": (CONTROLLER, ("end", "share", "rank", "node", "gpu")),
    "ranks": (CONTROLLER, ("ranks",)),
    "windows": (CONTROLLER, ("window", "compute")),
}
"""kind -> (who writes it, the fields it may carry besides `time`). docs/goodput.md says what each
means."""

NODE_EVENTS = frozenset(k for k, (writer, _) in EVENTS.items() if writer == NODE)
"""What a node may ship: the rest would let a node charge a job's loss (incidents come from the
ledger, stragglers and rank windows from the controller)."""
UNACCOUNTED_EVENTS = frozenset({"ranks", "windows"})
"""For the report's heatmap only."""


# A node's lines on their way to the head node (healthd.agent.goodput_ship to
# healthd.controller.goodput_gather): whole lines of its file from a byte offset.
SHIPMENT_PATH = "/v1/goodput"
SHIPMENT_KIND = "goodput-lines"
MAX_SHIPMENT_BYTES = 512 * 1024
"""Lines in one shipment (the report envelope carries at most 1 MiB)."""


def shipment(job: str, offset: int, data: str) -> dict[str, Any]:
    return {"kind": SHIPMENT_KIND, "job": job, "offset": offset, "data": data}


SHIPMENT_FIELDS = frozenset(shipment("", 0, ""))


def job_start(t: float) -> dict[str, Any]:
    return {JOB_START_TIME: t}


def job_end(t: float) -> dict[str, Any]:
    return {JOB_END_TIME: t}


def step_mark(step: int, start: float) -> dict[str, Any]:
    return {STEP_COUNT: step, STEP_START_TIME: start}


def checkpoint_start(t: float) -> dict[str, Any]:
    return {CUSTOM_EVENT_TYPE: CHECKPOINT_SAVE, CUSTOM_EVENT_START_TIME: t}


def checkpoint_end(t: float) -> dict[str, Any]:
    return {CUSTOM_EVENT_TYPE: CHECKPOINT_SAVE, CUSTOM_EVENT_END_TIME: t}


def event(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    """A healthd event; ValueError for a kind or a field the format does not have (a writer's bug,
    which would otherwise reach the log and be skipped by every reader)."""
    if kind not in EVENTS:
        raise ValueError(f"no goodput event {kind!r}")
    unknown = set(fields) - set(EVENTS[kind][1])
    if unknown:
        raise ValueError(f"goodput event {kind} has no field {sorted(unknown)[0]!r}")
    return {EVENT: kind, TIME: t, **fields}


def log_line(job: str, **entry: Any) -> str:
    """One line of the log (without its newline), keys sorted, no spaces: the same entry is the same
    line, which is how a reader drops a line written twice."""
    import json  # here: the epilog imports this module at every job's end, and makes a line only where the node keeps the log

    return json.dumps({JOB_NAME: job, **entry}, sort_keys=True, separators=(",", ":"))
