"""What the ledger stores and returns: its vocabulary (statuses, kinds, states) and the frozen records
its reads give back, never rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from healthd.controller.actions import ACTIONS

DECISION_OUTCOMES = ("allowed", "waiting", "refused")
ACTION_STATUSES = ("planned", "applied", "failed", "undone", "lost", "released", "abandoned", "completed")
"""planned -> applied (the write returned, or the reconciler found it in Slurm) | failed (the client
reported failure; the reconciler still adopts it if Slurm shows it landed) | abandoned (planned before a
restart and not in Slurm: re-decided from current evidence, never applied blindly). An applied
node-state action ends as undone (an operator's `healthctl undo`), lost (Slurm lost it, e.g. slurmctld
came back from an older state save: re-applied through the gates as a new attempt), released (someone
else changed the node: ownership passed to them) or completed (a requested reboot happened)."""
ENDED_STATUSES = ("undone", "lost", "released", "completed")
"""How an applied action's effect ended."""
BUDGET_STATUSES = ("applied", "undone", "released", "completed")
"""Applied actions that spent rate-limit budget; a lost one gives its slot to the attempt that
re-applies it."""
REMEDIATED_STATUSES = ("applied", "released", "completed")
"""Applied actions that count as a remediation for escalation (an undone one was a false positive)."""
CLEAR_SCOPES = ("evidence", "episode")
"""A clear of a finding on a node: `evidence` (a repair: evidence up to `before` no longer counts,
anything newer does) or `episode` (an operator dismissed it: the episode that had begun by `before`
no longer counts; a new episode, or a new kernel log line, does). See healthd.agent.instructions."""
CLOSED_INCIDENT_STATUSES = ("closed", "false_positive", "handed-over", "resolved")
INBAND_SLOW_STATUS = "in-band-slow"
"""The status of the incident of a reintegration whose node was still a straggler in-band during probation:
not closed, so that an operator looks at it (`healthctl close` once handled)."""
APPROVAL_VERDICTS = ("approve", "reject")
"""An operator's verdicts on a decision waiting for approval."""
REMEDIATION_KINDS: tuple[str, ...] = tuple(dict.fromkeys(
    a.records for a in ACTIONS.values() if a.removes_capacity and a.records))
"""Action kinds that take a node out of service and count as a remediation for escalation, as the
action table (healthd.controller.actions) records its removing kinds; `resume` puts a node back, and
other kinds (e.g. a job `requeue`) are neither."""
RESUME_KIND = "resume"
REINTEGRATION_STATES = ("requested", "validating", "probation", "passed", "failed", "recurred", "aborted")
"""requested -> validating (reserved, resumed inside the reservation, validation running) -> probation
(validation passed, back in service) -> passed (probation over). `failed`: validation failed, node
re-drained. `recurred`: the fault came back during probation. `aborted`: the node was taken over or
can no longer be reintegrated (the detail says why)."""
ACTIVE_REINTEGRATION_STATES = ("requested", "validating", "probation")
ESCALATIONS = ("inspect-hardware", "contact-support")
"""Escalation levels, weakest first."""


class LedgerError(RuntimeError):
    """The ledger cannot be used as asked; the message names the file and says why."""


# --------------------------------------------------------------------------------------------------
# Values returned to callers: frozen dataclasses, never rows.


@dataclass(frozen=True)
class FindingRecord:
    """One finding on one node (and GPU) as the ledger keeps it: first seen, last seen and the latest
    report of it. healthd.model.Finding is the agent's finding itself."""

    node: str
    finding_id: str
    gpu_serial: str | None
    attribution: str
    tier: str
    action: str
    summary: str
    evidence: Any
    first_seen: float
    last_seen: float


@dataclass(frozen=True)
class Incident:
    id: int
    signature: str
    attribution: str
    tier: str
    status: str
    nodes: tuple[str, ...]
    gpu_serials: tuple[str, ...]
    jobs: tuple[str, ...]
    first_evidence_at: float | None
    detected_at: float | None
    decided_at: float | None
    action_applied_at: float | None
    back_in_service_at: float | None
    created_at: float
    escalation: str | None = None
    """None, `inspect-hardware` (the same fault after `inspect_after` remediations) or
    `contact-support` (`support_after` remediations on the node within the support window)."""
    closed_at: float | None = None
    closed_by: str | None = None
    close_why: str | None = None

    @property
    def detection_latency(self) -> float | None:
        """First evidence → detected."""
        return _diff(self.detected_at, self.first_evidence_at)

    @property
    def decision_latency(self) -> float | None:
        """Detected → decided."""
        return _diff(self.decided_at, self.detected_at)

    @property
    def action_latency(self) -> float | None:
        """Decided → action applied in Slurm."""
        return _diff(self.action_applied_at, self.decided_at)

    @property
    def recovery_time(self) -> float | None:
        """First evidence → back in service: the whole time the capacity was lost to this fault."""
        return _diff(self.back_in_service_at, self.first_evidence_at)

    @property
    def isolation_granularity(self) -> tuple[int, int]:
        """(nodes, GPUs) the incident took out: its isolation granularity."""
        return (len(self.nodes), len(self.gpu_serials))


@dataclass(frozen=True)
class DecisionRecord:
    """A policy decision as recorded, with what the gates made of it (one of DECISION_OUTCOMES).
    healthd.controller.policy.Decision is the decision itself."""

    id: int
    incident_id: int | None
    node: str
    kind: str
    tier: str
    mode: str
    reason: str
    evidence: Any
    decided_at: float
    outcome: str
    refused_gate: str | None
    refused_reason: str | None


@dataclass(frozen=True)
class Action:
    id: int
    decision_id: int
    idempotency_key: str
    node: str
    partition: str | None
    kind: str
    argv: tuple[str, ...]
    evidence: Any
    status: str
    outcome: str | None
    planned_at: float
    applied_at: float | None
    failed_at: float | None
    undone_at: float | None
    series: str = ""
    """The idempotency key of the first attempt: every attempt of one decision for one incident."""
    attempt: int = 1
    reason: str | None = None
    """The Slurm reason the write sets (node-state actions)."""
    ended_at: float | None = None
    """When it became lost, released, completed or abandoned."""
    slurm_reason_time: float | None = None
    """Slurm's reason time right after the write: with `slurm_reason_user`, the ownership proof."""
    slurm_reason_user: str | None = None


@dataclass(frozen=True)
class Clear:
    """Evidence of one finding on one node that no longer counts (see CLEAR_SCOPES)."""

    id: int
    node: str
    finding_id: str
    before: float
    scope: str
    incident_id: int | None
    by: str | None
    why: str | None
    at: float


@dataclass(frozen=True)
class Approval:
    id: int
    decision_id: int
    operator: str
    verdict: str
    why: str | None
    at: float


@dataclass(frozen=True)
class Reintegration:
    id: int
    node: str
    incident_id: int | None
    trigger: str
    """`repaired` (an operator's healthctl repaired) or `cleared` (the agent reported the fault gone)."""
    operator: str | None
    why: str | None
    state: str
    reservation: str | None
    findings: tuple[str, ...]
    """Finding ids this reintegration clears (evidence up to `requested_at` no longer counts)."""
    requested_at: float
    started_at: float | None
    validated_at: float | None
    probation_until: float | None
    ended_at: float | None
    results: Any
    """Validation step results: [{"argv": [...], "rc": int, "seconds": float, "output": str}, ...]."""
    detail: str | None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_REINTEGRATION_STATES


@dataclass(frozen=True)
class BreakerRecord:
    """The circuit breaker as its recorded events leave it: the latest opening and the latest reset.
    healthd.controller.gates.BreakerState is the state the gates read."""

    open: bool
    opened_at: float | None
    cause: str | None
    reset_at: float | None
    reset_by: str | None
    why: str | None
    nodes: tuple[str, ...] = ()
    """The failing nodes that opened it (the latest opening)."""


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier

