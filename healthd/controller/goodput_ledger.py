"""The ledger's part of a job's goodput event log (healthd.goodput): for each requeue healthd
applied to the job, the incident behind it — its cause, node and GPU serial, first evidence,
detection, the action applied, and whether it was judged a false positive — as `healthd_event`
entries, so that the interruption's cost is charged to its incident. `healthctl goodput` adds
them to the log it reads when it can open the ledger."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from healthd.controller.ledger import Action, Incident


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
