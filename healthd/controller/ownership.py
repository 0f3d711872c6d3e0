"""Ownership by record: when a node is healthd's to change.

healthd writes a Slurm reason that starts with `healthd:` and names its incident, but a prefix proves
nothing: an administrator can write `healthd: ...` too, or re-drain a healthd-drained node with the
very same text. So the controller keeps a *hold* for every node it took out of service: the reason
it wrote and the reason time and user Slurm recorded for that write (read back right after it). A
node is healthd's only while its ledger holds it AND Slurm still shows that exact reason, time and
user; any other reason on it is foreign, whoever wrote it and whatever it starts with.

Pure values and functions; the ledger stores holds (healthd.controller.ledger) and the reconciler
keeps them true (healthd.controller.reconcile).
"""

from __future__ import annotations

from dataclasses import dataclass

from healthd.controller.actions import NODE_STATE_KINDS
from healthd.slurm.backend import NodeInfo
from healthd.text import stamp

__all__ = ["CLOCK_SKEW_S", "NODE_STATE_KINDS", "Hold", "describe_reason", "owned", "shows_write"]
CLOCK_SKEW_S = 60.0
"""How far slurmctld's clock (reason times) may be behind the controller's (planned times) before a
write of ours is no longer recognised as ours. slurmctld may run on another host."""


@dataclass(frozen=True)
class Hold:
    """healthd's claim on one node: the write that took it out of service, as Slurm recorded it."""

    node: str
    action_id: int
    """The ledger action whose write this is."""
    incident_id: int | None
    kind: str
    """drain | drain-and-requeue | reboot-asap."""
    reason: str
    """The reason healthd wrote."""
    reason_time: float | None
    """Slurm's reason time for that write (whole seconds); None until it has been read back."""
    reason_user: str | None
    """The user Slurm recorded for that write; None until it has been read back."""
    since: float
    """When the write was applied (the controller's clock)."""
    planned_at: float
    """When the write was planned: a reason time before this (less the clock skew) is not ours."""
    verified_at: float
    """The last time Slurm was seen showing it (persisted lazily; at least `since`)."""

    @property
    def confirmed(self) -> bool:
        return self.reason_time is not None


def _second(t: float | None) -> int | None:
    return None if t is None else int(round(t))


def shows_write(info: NodeInfo, reason: str, kind: str, planned_at: float) -> bool:
    """Slurm shows a write of `kind` with `reason` made no earlier than `planned_at` (less the clock
    skew): the flag the write sets and exactly its reason. How a write whose client reported failure
    (a timeout, slurmctld stopped mid-call) is recognised as landed."""
    if info.reason != reason:
        return False
    flagged = (info.reboot_requested or info.drain_requested) if kind == "reboot-asap" else info.drain_requested
    if not flagged:
        return False
    return info.reason_time is None or info.reason_time >= planned_at - CLOCK_SKEW_S


def owned(hold: Hold | None, info: NodeInfo | None) -> bool:
    """The node is healthd's: the ledger holds it and Slurm shows exactly the write that hold records
    (reason, reason time and user). An unconfirmed hold (not yet read back) owns a node that shows
    its reason from a write no earlier than it was planned."""
    if hold is None or info is None or info.name != hold.node:
        return False
    if not hold.confirmed:
        return shows_write(info, hold.reason, hold.kind, hold.planned_at)
    if info.reason != hold.reason or _second(info.reason_time) != _second(hold.reason_time):
        return False
    return hold.reason_user is None or info.reason_user == hold.reason_user


def describe_reason(info: NodeInfo) -> str:
    """`'<reason>' by <user> at <time>` for log lines and refusals (no reason: `no reason`)."""
    if not info.reason:
        return "no reason"
    when = f" at {stamp(info.reason_time)}" if info.reason_time is not None else ""
    return f"{info.reason[:80]!r} by {info.reason_user or 'unknown'}{when}"
