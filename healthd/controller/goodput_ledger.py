"""The ledger's part of a job's goodput event log (healthd.goodput): for each requeue healthd
applied to the job, the incident behind it — its cause, node and GPU serial, first evidence,
detection, the action applied, and whether it was judged a false positive — as `healthd_event`
entries, so that the interruption's cost is charged to its incident. `healthctl goodput` adds
them to the log it reads when it can open the ledger."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from healthd import goodput
from healthd.controller.ledger import Action, Incident, Ledger, LedgerError

Requeues = dict[str, list[tuple[Action, Incident | None]]]
"""job -> its applied requeues, each with its incident (None when the ledger has none)."""


def requeues_by_job(actions: Iterable[Action]) -> dict[str, list[Action]]:
    """job -> its applied requeues (a drain-and-requeue of its node, or a hang requeue), oldest first."""
    out: dict[str, list[Action]] = {}
    for a in actions:
        evidence = a.evidence if isinstance(a.evidence, dict) else {}
        if a.kind == "requeue" and a.applied_at is not None and evidence.get("job") is not None:
            out.setdefault(str(evidence["job"]), []).append(a)
    for requeues in out.values():
        requeues.sort(key=lambda a: (a.applied_at, a.id))
    return out


def entries(job: str, requeues: Iterable[tuple[Action, Incident | None]]) -> list[dict[str, Any]]:
    """Log entries (without job_name) for each requeue of the job and its incident (pure)."""
    out: list[dict[str, Any]] = []
    for action, inc in requeues:
        applied = float(action.applied_at)  # type: ignore[arg-type]
        key = str(inc.id) if inc is not None else f"action-{action.id}"
        cause = inc.signature if inc is not None else "requeue"
        node = (inc.nodes[0] if inc is not None and inc.nodes else None) or action.node
        gpu = inc.gpu_serials[0] if inc is not None and inc.gpu_serials else None
        out.append({"healthd_event": "interrupt", "time": applied, "incident": key, "cause": cause, "node": node,
                    "gpu": gpu})
        if inc is not None:
            for kind, at in (("evidence", inc.first_evidence_at), ("detected", inc.detected_at)):
                if at is not None:
                    out.append({"healthd_event": kind, "time": float(at), "incident": key})
            if inc.status == "false_positive":
                out.append({"healthd_event": "false_positive", "time": float(inc.closed_at or applied),
                            "incident": key})
        out.append({"healthd_event": "decided", "time": applied, "incident": key})
    return out


def ledger_requeues(path: str) -> Requeues | None:
    """Every job's applied requeues with their incidents, read from the ledger at `path` once (read
    only); None when it cannot be read (on a compute node there is none)."""
    if not Path(path).is_file():
        return None
    try:
        led = Ledger.open_readonly(path)
    except LedgerError:
        return None
    try:
        return {job: [(a, led.incident(d.incident_id) if (d := led.decision(a.decision_id)) and d.incident_id else None)
                      for a in actions]
                for job, actions in requeues_by_job(led.actions()).items()}
    except (LedgerError, sqlite3.Error):
        return None
    finally:
        led.close()


def joined(log: goodput.Log, requeues: Requeues | None) -> tuple[goodput.Log, int]:
    """`log` with its job's requeues and their incidents added; and how many were."""
    mine = requeues.get(log.job, []) if requeues is not None and log.job else []
    return (goodput.with_entries(log, entries(log.job, mine)) if mine else log), len(mine)  # type: ignore[arg-type]
