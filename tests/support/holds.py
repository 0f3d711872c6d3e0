"""Holds for pure policy/gate tests: healthd's ownership record of a node as Slurm shows it."""

from __future__ import annotations

from healthd.controller.ownership import Hold
from healthd.slurm.backend import NodeInfo


def hold_for(info: NodeInfo, incident: int | None = 1, *, kind: str = "drain", at: float = 0.0) -> Hold:
    """The hold healthd would have recorded for the write `info` shows (its reason, time and user)."""
    return Hold(node=info.name, action_id=1, incident_id=incident, kind=kind, reason=info.reason,
                reason_time=info.reason_time, reason_user=info.reason_user, since=at, planned_at=at, verified_at=at)


def holds_for(infos: list[NodeInfo], incidents: dict[str, int | None]) -> dict[str, Hold]:
    """node -> hold, for the nodes of `infos` named in `incidents` (node -> incident id)."""
    return {i.name: hold_for(i, incidents[i.name]) for i in infos if i.name in incidents}
