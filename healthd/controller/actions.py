"""The action table: every write healthd makes to Slurm, what it calls, and which gates it passes.

Every write is a `Decision` of a kind listed in ACTIONS, whoever proposes it: policy (drains and
reboots), the hang responder (a hung job's requeue), the reintegrator (its validation reservation, the
resume into it, the drain again when validation fails) or an operator through the admin socket (undo,
release). The gates (healthd.controller.gates) run for a decision the gates its kind lists, with the
kind's approval rule and budget as their parameters; the executor makes the one backend call its
kind names. REMOVING_KINDS, ACTING_KINDS and NODE_STATE_KINDS are read off the table: a new kind is
one row, a new gate one entry in the rows it covers.

A write's attempts share a ledger series (`series_key`); `next_attempt` says where a series stands.

Pure values: this module imports nothing of the controller, so every other part can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol

from healthd.model import Evidence

GATE_ORDER: tuple[str, ...] = ("mode", "rate-limit", "breaker", "correlation", "capacity", "ownership")
"""The gates in the order they run (healthd.controller.gates.GATES)."""

Approval = Literal["tier", "opt-in", "operator", ""]
Budget = Literal["removals", "hang-requeues", ""]
Target = Literal["node", "job", "reservation"]


@dataclass(frozen=True)
class ActionKind:
    """One row of the table: a kind of decision and the write it makes."""

    kind: str
    call: str | None
    """The SlurmBackend method the write calls (its `describe()` name too); None: no Slurm write."""
    target: Target
    """What the call acts on: the decision's node, its job (`Decision.target`) or its reservation."""
    records: str | None
    """The ledger action kind its attempts are recorded under; None: no ledger action (a reservation
    is recorded in its reintegration, a release ends a hold)."""
    changes_node: bool
    """The write changes a node's state: the node is re-read right before it (ownership checked again
    on that read) and the fleet view re-read after it."""
    removes_capacity: bool
    """It takes a node out of service: charged to the rate limits, counted by the capacity floor."""
    holds: bool
    """The write makes healthd the node's holder (healthd.controller.ownership): read back as proof."""
    approval: Approval
    """How the mode gate lets it act outside observe: `tier` (T1 acts, T2 waits unless the site
    grants it, T3 and user code never; supervised: every one waits), `opt-in` (the job asked for it;
    supervised: waits), `operator` (an operator's command, or what one started: no approval)."""
    budget: Budget
    """The rate-limit gate's hourly budget: node removals (fleet-wide and per partition), or hung
    jobs' requeues (counted apart)."""
    gates: tuple[str, ...]
    """The gates that apply to it, in GATE_ORDER."""
    proposed_by: str
    """Who proposes it."""
    then: str = ""
    """What follows an applied write."""
    follows: str = ""
    """The kind it is the second half of: passed with that kind's decision, never proposed alone."""

    def __post_init__(self) -> None:
        unknown = set(self.gates) - set(GATE_ORDER)
        if unknown:
            raise ValueError(f"action kind {self.kind}: unknown gates {sorted(unknown)}")
        if tuple(g for g in GATE_ORDER if g in self.gates) != self.gates:
            raise ValueError(f"action kind {self.kind}: gates out of order {self.gates}")
        if ("mode" in self.gates) != bool(self.approval):
            raise ValueError(f"action kind {self.kind}: the mode gate and an approval rule go together")
        if ("rate-limit" in self.gates) != bool(self.budget):
            raise ValueError(f"action kind {self.kind}: the rate-limit gate and a budget go together")
        if self.removes_capacity and not (self.holds and self.budget == "removals" and "capacity" in self.gates):
            raise ValueError(f"action kind {self.kind}: a removal is held, budgeted and under the capacity floor")
        if self.call is not None and "mode" not in self.gates and not self.follows:
            raise ValueError(f"action kind {self.kind}: every Slurm write passes the mode gate")

    def applies(self, gate: str) -> bool:
        return gate in self.gates


_REMOVAL = dict(target="node", changes_node=True, removes_capacity=True, holds=True, approval="tier",
                budget="removals", gates=GATE_ORDER)

ACTIONS: Mapping[str, ActionKind] = MappingProxyType({a.kind: a for a in (
    ActionKind("drain", "drain", records="drain", proposed_by="policy: a T1/T2 finding whose remedy is a drain "
               "(inspect-hardware included)", **_REMOVAL),  # type: ignore[arg-type]
    ActionKind("drain-and-requeue", "drain", records="drain-and-requeue", proposed_by="policy: a T1/T2 finding "
               "whose remedy is drain-and-requeue", then="requeue each opted-in batch job still running on the "
               "node, each its own ledger action (kind requeue)", **_REMOVAL),  # type: ignore[arg-type]
    ActionKind("reboot-asap", "reboot_asap", records="reboot-asap", proposed_by="policy: reset-gpu-when-idle or "
               "reboot-when-idle", **_REMOVAL),  # type: ignore[arg-type]
    ActionKind("requeue", "requeue", target="job", records="requeue", changes_node=False, removes_capacity=False,
               holds=False, approval="", budget="", gates=(), follows="drain-and-requeue",
               proposed_by="the executor after a drain-and-requeue, and the reconciler finishing one: each "
               "opted-in batch job still running on the node, once"),
    ActionKind("requeue-hang", "requeue", target="job", records="requeue", changes_node=False,
               removes_capacity=False, holds=False, approval="opt-in", budget="hang-requeues",
               gates=("mode", "rate-limit", "breaker"),
               proposed_by="the hang responder: a hung training job that opted in, once per job and stall step"),
    ActionKind("resume", "resume", target="node", records="resume", changes_node=True, removes_capacity=False,
               holds=False, approval="operator", budget="", gates=("mode", "breaker", "ownership"),
               proposed_by="the reintegrator: a node healthd drained, resumed inside its validation reservation",
               then="validation runs in the reservation"),
    ActionKind("redrain", "drain", target="node", records="drain", changes_node=True, removes_capacity=False,
               holds=True, approval="operator", budget="", gates=("mode", "ownership"),
               proposed_by="the reintegrator: a node that failed validation, drained again from inside its "
               "reservation (out of users' reach already: it removes no capacity); the spare pool: a spare that "
               "failed its validation, drained from inside its own reservation"),
    ActionKind("reservation-create", "create_reservation", target="reservation", records=None, changes_node=False,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode",),
               proposed_by="the reintegrator: the MAINT reservation validation runs in"),
    ActionKind("reservation-delete", "delete_reservation", target="reservation", records=None, changes_node=False,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode",),
               proposed_by="the reintegrator: its reservation, once validation ended (or a leftover)"),
    ActionKind("spare-reserve", "create_reservation", target="reservation", records="spare-reserve", changes_node=False,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode", "capacity"),
               proposed_by="the spare pool (policy.spares): an idle healthy node put in a reservation of its own, "
               "out of general scheduling; never below a capacity floor, the pool's spares counted as gone"),
    ActionKind("spare-release", "delete_reservation", target="reservation", records="spare-release", changes_node=False,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode",),
               proposed_by="the spare pool: a spare's reservation deleted, next to a node healthd removes (same "
               "leaf switch, else rack group), or when it is no longer fit, over the pool's size or needed "
               "for a capacity floor"),
    ActionKind("spare-validate", None, target="reservation", records="spare-validate", changes_node=False,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode", "breaker"),
               proposed_by="the spare pool: the validation commands run on a spare inside its own reservation, its "
               "last pass older than half of validated_within_h (or none); at most revalidate_at_once per pool",
               then="a pass is its new validation time; a failure opens an incident and drains it (redrain)"),
    ActionKind("undo", "resume", target="node", records="resume", changes_node=True, removes_capacity=False,
               holds=False, approval="operator", budget="", gates=("mode",),
               proposed_by="`healthctl undo` of a drain (planned by the admin socket; the hold must still be "
               "the undone action's, checked on the node read right before the write)",
               then="the undone action marked undone, its incident closed as a false positive"),
    ActionKind("undo-reboot", "cancel_reboot", target="node", records="cancel-reboot", changes_node=True,
               removes_capacity=False, holds=False, approval="operator", budget="", gates=("mode",),
               proposed_by="`healthctl undo` of a reboot-asap (as undo)",
               then="as undo"),
    ActionKind("release", None, target="node", records=None, changes_node=False, removes_capacity=False,
               holds=False, approval="", budget="", gates=(),
               proposed_by="`healthctl release`: the admin socket ends the hold in the ledger; Slurm is unchanged"),
    ActionKind("none", None, target="node", records=None, changes_node=False, removes_capacity=False, holds=False,
               approval="", budget="", gates=(), proposed_by="policy and the hang responder: recorded only"),
)})

DecisionKind = Literal["drain", "drain-and-requeue", "reboot-asap", "requeue", "requeue-hang", "resume", "redrain",
                       "reservation-create", "reservation-delete", "spare-reserve", "spare-release", "spare-validate", "undo",
                       "undo-reboot", "release", "none"]
DECISION_KINDS: tuple[str, ...] = tuple(ACTIONS)
ACTING_KINDS: frozenset[str] = frozenset(k for k, a in ACTIONS.items() if a.call is not None)
"""Kinds that write to Slurm."""
REMOVING_KINDS: frozenset[str] = frozenset(k for k, a in ACTIONS.items() if a.removes_capacity)
"""Kinds that take a node out of service: they count against rate limits and capacity floors."""
NODE_STATE_KINDS: frozenset[str] = frozenset(a.records for a in ACTIONS.values() if a.holds and a.records)
"""Ledger action kinds whose write takes a node out of service and so creates a hold."""


def action_of(kind: str) -> ActionKind:
    """The table's row for `kind` (KeyError for a kind it does not list)."""
    return ACTIONS[kind]


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decision:
    """A proposed write (or, of kind `none`, the decision to make none); gates decide whether it may happen."""

    id: str
    """Stable for the same proposal: `drain:node02:xid:gpu0:79`, `requeue-hang:123:411`, `reintegrate:7:resume`."""
    kind: DecisionKind
    """A kind of ACTIONS."""
    node: str
    reason: str
    """The Slurm reason a node write sets, `healthd: <short cause> [#<incident>]`; for any other write,
    what it is about (a hang's description)."""
    tier: int
    """The strongest (lowest) tier among the findings behind it."""
    attribution: str = "unknown"
    """Attribution of the primary finding."""
    evidence: tuple[Evidence, ...] = ()
    """The evidence of the findings behind it, primary finding first."""
    finding_ids: tuple[str, ...] = ()
    """The findings behind it, primary first."""
    incident: str = ""
    """The ledger's open incident for the primary finding, or a proposed id derived from it."""
    decided_at: float = 0.0
    """When it was proposed; decisions older than a breaker reset are never applied."""
    note: str = ""
    """For `none`: why nothing is done (T3 only, user code, already drained, fault cleared...)."""
    escalation: str = ""
    """`inspect-hardware` or `contact-support` when this drain repeats a fault (shown first in the reason)."""
    target: str = ""
    """What a job or reservation write acts on: the job id, the reservation name."""
    series: str = ""
    """The ledger series its write's attempts share, when not `<id>#<incident>` (series_key)."""
    about: str = ""
    """For `none`: the kind it decided against, which the ledger files it under (a hung job that did
    not opt in: `requeue-hang`)."""
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """What the ledger keeps with the decision and its write beyond the above (a hang's step, stall
    and behind ranks; a reservation's length in minutes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", MappingProxyType(dict(self.detail)))

    @property
    def acts(self) -> bool:
        return self.kind in ACTING_KINDS

    @property
    def recorded_kind(self) -> str:
        """The kind the ledger records the decision under."""
        return self.about or self.kind


def series_key(decision: Decision, attempt: int = 1) -> str:
    """The ledger idempotency key of a decision's write: its series, `#try<n>` from the second attempt."""
    key = decision.series or f"{decision.id}#{decision.incident}"
    return key if attempt == 1 else f"{key}#try{attempt}"


# --------------------------------------------------------------------------- attempts


class Attempt(Protocol):
    """What next_attempt reads of a ledger action."""

    id: int
    status: str
    attempt: int


MAX_ATTEMPTS = 3
"""Failed tries of one decision for one incident: a write Slurm refused or that failed (slurmctld
restarting, a state race) is tried again on later rounds, each attempt its own ledger row, then left to a
human."""
MAX_LOST = 3
"""Times Slurm may lose one decision's write (slurmctld restarting from an older state save) before
healthd stops re-applying it and leaves it to a human."""


def next_attempt(attempts: Sequence[Attempt]) -> tuple[int | None, str, Any]:
    """Where one series stands (pure): (the next attempt's number, '', None), or (None, why not,
    the action that settles it: an applied one, or the last ended one)."""
    if not attempts:
        return 1, "", None
    latest = attempts[-1]
    if latest.status == "applied":
        return None, f"action {latest.id} is applied", latest
    if latest.status == "planned":
        return None, f"action {latest.id} is planned (being reconciled)", latest
    if latest.status in ("released", "undone", "completed"):
        return None, f"action {latest.id} is {latest.status}: the series ended", latest
    failed = sum(1 for a in attempts if a.status == "failed")
    if failed >= MAX_ATTEMPTS:
        return None, f"action {latest.id} is failed after {failed} attempts", latest
    lost = sum(1 for a in attempts if a.status == "lost")
    if lost >= MAX_LOST:
        return None, f"Slurm lost this write {lost} times; left to a human", latest
    return max(a.attempt for a in attempts) + 1, "", None
