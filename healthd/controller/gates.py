"""The safety envelope: ordered gates that refuse Decisions with a one-line reason.

Each gate is a pure function `(decision, context) -> Refusal | None`. `apply_gates` runs them in
order (mode, rate limit, circuit breaker, topology correlation, capacity floor, ownership) over every
decision the round has, whoever proposed it (policy, the hang responder, the reintegrator, an
operator's undo), and runs for each only the gates the action table lists for its kind
(healthd.controller.actions), with the kind's approval rule and budget as the mode and rate-limit
gates' parameters. It threads the context through the batch, so two drains in one batch count
against the same rate limit and capacity floor. It never raises: a gate that fails is a refusal
(fail closed).

`build_context` evaluates the circuit breaker and topology correlation from the fleet view; the
breaker's state (opened_at, reset_at) lives in the ledger and is handed in and out as a value.
`still_safe` is the ownership check the executor repeats on a node it has just re-read.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from healthd.controller.actions import ACTIONS, GATE_ORDER, ActionKind
from healthd.controller.fleetcache import out_of_service
from healthd.controller.ownership import describe_reason, owned
from healthd.controller.policy import (
    ControllerPolicySettings,
    Decision,
    FleetView,
    LedgerView,
    failing_nodes,
)
from healthd.slurm.backend import NodeInfo
from healthd.text import stamp

OutcomeStatus = Literal["allowed", "waiting-approval", "refused", "recorded"]


@dataclass(frozen=True)
class Refusal:
    """A gate said no."""

    gate: str
    """mode | rate-limit | breaker | correlation | capacity | ownership | error."""
    reason: str
    """One line a human reads in `healthctl` and the ledger."""


@dataclass(frozen=True)
class GateResult:
    """What the envelope made of one Decision."""

    decision: Decision
    status: OutcomeStatus
    """allowed (the executor applies it) | waiting-approval (an operator must approve it) |
    refused (a gate said no) | recorded (a `none` decision: nothing to apply)."""
    gate: str | None = None
    """The refusing gate, for refused; `mode` for waiting-approval."""
    reason: str = ""
    """One line: why refused or why waiting; the decision's note for recorded."""

    @property
    def label(self) -> str:
        """allowed | waiting-approval | recorded | refused-by-<gate>."""
        return f"refused-by-{self.gate}" if self.status == "refused" else self.status


@dataclass(frozen=True)
class BreakerState:
    """The circuit breaker as the ledger stores it."""

    open: bool = False
    opened_at: float | None = None
    """When it last opened (epoch seconds)."""
    reset_at: float | None = None
    """When an operator last closed it (`healthctl breaker reset`); decisions made before are stale."""
    cause: str = ""
    """The likely shared cause named when it opened."""
    nodes: frozenset[str] = frozenset()
    """The failing nodes that opened it."""


@dataclass(frozen=True)
class Alert:
    """The one alert raised when the breaker opens."""

    cause: str
    """`switch:leaf3`, `rack:r12`, `pdu:p4`, `driver rollout (software: xid:119)`, or unknown."""
    text: str
    nodes: frozenset[str]
    """The failing nodes."""


@dataclass(frozen=True)
class GroupIncident:
    """Failures clustered in one topology group, attributed to the group rather than the nodes."""

    group: str
    """`switch:<name>`, `rack:<name>` or `pdu:<name>`."""
    failing: frozenset[str]
    """Its failing nodes."""
    size: int
    """How many nodes the group has."""

    @property
    def label(self) -> str:
        return f"{self.group} ({len(self.failing)} of {self.size} nodes)"


@dataclass(frozen=True)
class GateContext:
    """Everything the gates read, as values. Build it with `build_context`."""

    settings: ControllerPolicySettings
    fleet: FleetView
    ledger: LedgerView
    now: float
    breaker: BreakerState = BreakerState()
    """The breaker after this round's evaluation (open while the envelope is tripped)."""
    actions_last_hour: int = 0
    """Node-removing actions applied fleet-wide in the last hour (from the ledger)."""
    actions_last_hour_by_partition: Mapping[str, int] = field(default_factory=dict)
    """The same count per partition."""
    hang_requeues_last_hour: int = 0
    """Hung jobs' requeues applied in the last hour (the requeue-hang kind's own budget)."""
    approved: frozenset[str] = frozenset()
    """Decision ids an operator approved (`healthctl approve`)."""
    correlated: Mapping[str, GroupIncident] = field(default_factory=dict)
    """node -> the group incident it belongs to."""
    removed_in_batch: frozenset[str] = frozenset()
    """Nodes allowed out of service earlier in this batch (capacity floor counts them as gone)."""
    out_of_service: frozenset[str] | None = None
    """Nodes the fleet view shows drained, down, not responding or rebooting (computed from the fleet
    when None and capacity floors are configured; without floors no gate reads it and it stays None).
    The view may predate healthd's latest writes: the capacity floor adds own_removals to it."""

    def __post_init__(self) -> None:
        # only the capacity floor reads it: without floors, a walk over every node each round is waste
        if self.out_of_service is None and self.settings.capacity_floors:
            gone = {n for n, i in self.fleet.nodes.items() if out_of_service(i)}
            for members in self.fleet.partitions.values():  # a member Slurm did not report is not healthy
                gone.update(n for n in members if n not in self.fleet.nodes)
            gone = frozenset(gone)
            object.__setattr__(self, "out_of_service", gone)
        object.__setattr__(self, "actions_last_hour_by_partition",
                           MappingProxyType(dict(self.actions_last_hour_by_partition)))
        object.__setattr__(self, "correlated", MappingProxyType(dict(self.correlated)))


# --------------------------------------------------------------------------- evaluation


def likely_cause(fleet: FleetView, failing: frozenset[str]) -> str:
    """Name the likely shared cause of many failing nodes: a software finding most of them share
    ("driver rollout"), else the topology group holding most of them (smallest first on ties)."""
    if not failing:
        return "unknown"
    signatures: Counter[str] = Counter()
    for node in failing:
        report = fleet.reports.get(node)
        if report is None:
            continue
        try:
            sigs = {
                f.id.split(":", 1)[0] + (f":{f.xid}" if f.xid is not None else "")
                for f in report.findings
                if f.attribution == "software"
            }
        except Exception:  # noqa: BLE001 - one node's unreadable data does not name the shared cause
            continue
        signatures.update(sigs)
    if signatures:
        sig, count = max(sorted(signatures.items()), key=lambda kv: kv[1])
        if count * 2 > len(failing):
            return f"driver rollout (software: {sig} on {count} of {len(failing)} failing nodes)"
    best: tuple | None = None
    for name, members in fleet.groups.items():
        hit = len(members & failing)
        if hit < 2:
            continue
        key = (-hit, len(members), name)
        if best is None or key < best:
            best = key
    if best is not None:
        return f"{best[2]} ({-best[0]} of {len(failing)} failing nodes, group of {best[1]})"
    return "unknown shared cause (several independent failures, or a monitoring fault)"


def evaluate_breaker(
    fleet: FleetView, settings: ControllerPolicySettings, now: float, previous: BreakerState
) -> tuple[BreakerState, Alert | None]:
    """The breaker after this round, and the alert when it opened just now (None otherwise).

    It opens when MORE than `breaker_nodes` nodes, or more than `breaker_percent` of the fleet
    (once at least `breaker_min_nodes` fail), fail within `breaker_window_s`. Once open it stays
    open until `reset`; after a reset only failures first seen after it count again."""
    if previous.open:
        return previous, None
    failing = failing_nodes(fleet, settings, now, since=previous.reset_at)
    count = len(failing)
    if count <= settings.breaker_nodes and count < settings.breaker_min_nodes:
        return previous, None  # too few failures for either rule: no need to size the whole fleet
    total = fleet.node_count
    by_count = count > settings.breaker_nodes
    by_percent = total > 0 and count >= settings.breaker_min_nodes and count * 100.0 / total > settings.breaker_percent
    if not (by_count or by_percent):
        return previous, None
    cause = likely_cause(fleet, failing)
    state = dataclasses.replace(previous, open=True, opened_at=now, cause=cause, nodes=failing)
    text = (
        f"circuit breaker open: {count} of {total} nodes failing within {settings.breaker_window_s:.0f} s; "
        f"likely shared cause: {cause}; no automatic action until `healthctl breaker reset`"
    )
    return state, Alert(cause=cause, text=text, nodes=failing)


def reset_breaker(state: BreakerState, now: float) -> BreakerState:
    """Close the breaker (an operator's explicit reset). Decisions made before `now` become stale."""
    return BreakerState(open=False, opened_at=state.opened_at, reset_at=now, cause="", nodes=frozenset())


def correlate(fleet: FleetView, settings: ControllerPolicySettings, now: float,
              since: float | None = None) -> dict[str, GroupIncident]:
    """node -> group incident, for groups where at least `correlation_min_nodes` and at least
    `correlation_threshold` of the members fail within the window. A node in several such groups
    gets the one with the highest failing share (then the smallest group)."""
    failing = failing_nodes(fleet, settings, now, since=since)
    out: dict[str, GroupIncident] = {}
    rank: dict[str, tuple] = {}
    for name, members in sorted(fleet.groups.items()):
        if not members:
            continue
        hit = members & failing
        if len(hit) < max(settings.correlation_min_nodes, 1):
            continue
        if len(hit) / len(members) < settings.correlation_threshold:
            continue
        incident = GroupIncident(group=name, failing=frozenset(hit), size=len(members))
        key = (-len(hit) / len(members), len(members), name)
        for node in hit:
            if node not in rank or key < rank[node]:
                rank[node] = key
                out[node] = incident
    return out


def build_context(
    fleet: FleetView,
    ledger: LedgerView,
    settings: ControllerPolicySettings,
    now: float,
    breaker: BreakerState = BreakerState(),
    actions_last_hour: int = 0,
    actions_last_hour_by_partition: Mapping[str, int] | None = None,
    approved: Iterable[str] = (),
    out_of_service: frozenset[str] | None = None,
    hang_requeues_last_hour: int = 0,
    correlated: Mapping[str, GroupIncident] | None = None,
) -> tuple[GateContext, Alert | None]:
    """Evaluate breaker and correlation for this round; returns the context and the breaker's alert
    (only on the round it opens). Persist `context.breaker` back to the ledger. `out_of_service`:
    the nodes the fleet cache already knows to be gone (computed from the fleet when None);
    `correlated`: the round's correlation when it was evaluated already (`correlate`)."""
    state, alert = evaluate_breaker(fleet, settings, now, breaker)
    context = GateContext(
        settings=settings,
        fleet=fleet,
        ledger=ledger,
        now=now,
        breaker=state,
        actions_last_hour=actions_last_hour,
        actions_last_hour_by_partition=actions_last_hour_by_partition or {},
        hang_requeues_last_hour=hang_requeues_last_hour,
        approved=frozenset(approved),
        # a breaker reset does not dissolve a group incident: the shared part is still the cause
        correlated=correlate(fleet, settings, now) if correlated is None else correlated,
        out_of_service=out_of_service if settings.capacity_floors else None,
    )
    return context, alert


# --------------------------------------------------------------------------- gates

Gate = Callable[[Decision, GateContext], "Refusal | None"]


class _Wait(Refusal):
    """Internal: the mode gate's 'needs approval' (not a refusal; later gates still run)."""


def gate_mode(decision: Decision, ctx: GateContext) -> Refusal | None:
    """observe never acts. Outside it, the kind's approval rule: `tier` (policy's remedies):
    supervised waits for approval, auto: T1 acts, T2 waits (unless the site grants T2), T3 and
    user-attributed never act; `opt-in` (a job asked for it): supervised waits, auto acts; `operator`
    (an operator's command, or what one started): acts. An approved decision id passes a wait."""
    mode = ctx.settings.mode
    if mode == "observe":
        return Refusal("mode", "observe mode: decided and recorded, not applied")
    approval = ACTIONS[decision.kind].approval
    if approval == "operator":
        return None
    if approval == "tier" and (decision.tier not in (1, 2) or decision.attribution == "user"):
        return Refusal("mode", f"T{decision.tier} {decision.attribution} finding: recorded, never acts")
    if decision.id in ctx.approved:
        return None
    if mode == "supervised":
        return _Wait("mode", "supervised mode: waiting for `healthctl approve`")
    if approval == "tier" and decision.tier == 2 and not ctx.settings.auto_tier2:
        return _Wait("mode", "T2 (probable): waiting for `healthctl approve`")
    return None


def unconfirmed(ctx: GateContext) -> frozenset[str]:
    """Nodes whose node-removing write since the view was read has no applied record yet (planned, or
    failed with its outcome unknown): they spend rate-limit budget until a later view settles them."""
    unsettled = ctx.ledger.unsettled
    return unsettled - ctx.ledger.holds.keys() if unsettled else unsettled


def gate_rate_limit(decision: Decision, ctx: GateContext) -> Refusal | None:
    """The kind's hourly budget. Node removals: at most N per hour fleet-wide and per partition, those
    the ledger has applied, those allowed earlier in this batch, and writes whose outcome Slurm has not
    shown yet. Hung jobs' requeues: at most N per hour, counted apart from removals."""
    s = ctx.settings
    if ACTIONS[decision.kind].budget == "hang-requeues":
        used = ctx.hang_requeues_last_hour
        if used >= s.max_actions_per_hour:
            return Refusal("rate-limit", f"hang requeue budget: {used} of {s.max_actions_per_hour} in the last hour")
        return None
    pending = unconfirmed(ctx) - {decision.node}  # a retry of its own unconfirmed write is not a second one
    used = ctx.actions_last_hour + len(pending)
    if used >= s.max_actions_per_hour:
        return Refusal("rate-limit", f"fleet rate limit: {used} of {s.max_actions_per_hour} actions in the last hour"
                                     + (f" ({len(pending)} not yet confirmed by Slurm)" if pending else ""))
    for p in ctx.fleet.partitions_of(decision.node):
        members = ctx.fleet.partitions.get(p, frozenset())
        used = ctx.actions_last_hour_by_partition.get(p, 0) + (len(pending & members) if pending else 0)
        limit = s.partition_limit(p)
        if used >= limit:
            return Refusal("rate-limit", f"partition {p} rate limit: {used} of {limit} actions in the last hour")
    return None


def gate_breaker(decision: Decision, ctx: GateContext) -> Refusal | None:
    """Nothing automatic while the breaker is open; nothing decided before a reset is applied."""
    b = ctx.breaker
    if b.open:
        return Refusal("breaker", f"circuit breaker open since {stamp(b.opened_at)}: likely cause {b.cause}")
    if b.reset_at is not None and decision.decided_at < b.reset_at:
        return Refusal("breaker", f"stale: decided at {stamp(decision.decided_at)}, before the breaker reset at "
                                  f"{stamp(b.reset_at)}; re-evaluate from current evidence")
    return None


def gate_correlation(decision: Decision, ctx: GateContext) -> Refusal | None:
    """A node whose failure is part of a group incident is not drained on its own."""
    incident = ctx.correlated.get(decision.node)
    if incident is None:
        return None
    return Refusal("correlation", f"correlated: {incident.label}")




def own_removals(ctx: GateContext) -> frozenset[str]:
    """Nodes out of service by healthd's own doing, whatever the fleet view shows: every node it
    holds, every removing write since the view was read, and those allowed earlier in this batch."""
    return frozenset(ctx.ledger.holds.keys()) | ctx.ledger.unsettled | ctx.removed_in_batch


def gate_capacity(decision: Decision, ctx: GateContext) -> Refusal | None:
    """Never take a partition below its configured healthy minimum. Not healthy: what the fleet view
    shows drained, down, not responding or rebooting, plus healthd's own removals (own_removals), so a
    view read before healthd's last drain never counts that node as healthy."""
    floors = ctx.settings.capacity_floors
    if not floors:
        return None
    unhealthy = (ctx.out_of_service or frozenset()) | own_removals(ctx)
    for p in ctx.fleet.partitions_of(decision.node):
        floor = floors.get(p)
        if floor is None:
            continue
        members = ctx.fleet.partitions.get(p, frozenset())
        # intersect from the smaller side: unhealthy is small in every round that matters for speed
        down = len(unhealthy & members) if len(unhealthy) < len(members) else len(members & unhealthy)
        healthy = len(members) - down
        after = healthy - (1 if decision.node in members and decision.node not in unhealthy else 0)
        if after < floor:
            return Refusal("capacity", f"partition {p} capacity floor: {healthy} healthy, minimum {floor}")
    return None


def ownership_refusal(decision: Decision, info: NodeInfo | None, ledger: LedgerView) -> Refusal | None:
    """The ownership rule on one NodeInfo (healthd.controller.ownership): resume only a node healthd
    holds by record, and write over no reason healthd does not hold — whatever it starts with, so an
    administrator's `healthd: ...` or their re-drain with healthd's own text stays theirs."""
    action = ACTIONS[decision.kind]
    if not action.changes_node:
        return None
    if info is None:
        return Refusal("ownership", f"{decision.node}: Slurm does not know this node")
    if info.name != decision.node:
        return Refusal("ownership", f"{decision.node}: re-read returned node {info.name!r}")
    hold = ledger.holds.get(decision.node)
    if _gives_back(action):
        if hold is None:
            return Refusal("ownership", f"{decision.node}: not resuming, the ledger holds no healthd write on it "
                                        f"({describe_reason(info)})")
        if not owned(hold, info):
            return Refusal("ownership", f"{decision.node}: not resuming, Slurm no longer shows healthd's write "
                                        f"({describe_reason(info)})")
        return None
    if info.reason and not owned(hold, info):
        return Refusal("ownership", f"{decision.node}: reason {describe_reason(info)} is not healthd's by record; "
                                    "not overwriting")
    return None


def _gives_back(action: ActionKind) -> bool:
    # a node write that is no hold of its own ends one: only a node healthd holds may get it
    return action.changes_node and not action.holds


def gate_ownership(decision: Decision, ctx: GateContext) -> Refusal | None:
    """Ownership against the fleet view's NodeInfo (the executor repeats it with `still_safe`)."""
    return ownership_refusal(decision, ctx.fleet.nodes.get(decision.node), ctx.ledger)


def still_safe(decision: Decision, fresh: NodeInfo | None, ledger: LedgerView | None = None) -> Refusal | None:
    """The executor's last check on the node it re-read right before writing. With no ledger
    given, a resume is refused (the ledger record is required)."""
    refusal = ownership_refusal(decision, fresh, ledger or LedgerView())
    if refusal is not None or fresh is None:
        return refusal
    call = ACTIONS[decision.kind].call
    if call == "drain" and fresh.drain_requested and fresh.reason == decision.reason:
        return Refusal("ownership", f"{decision.node}: already drained with this reason by a write healthd "
                                    f"did not make ({describe_reason(fresh)})")
    if call == "resume" and not fresh.resumable:
        return Refusal("ownership", f"{decision.node}: nothing to resume (state {fresh.state})")
    return None


GATES: tuple[tuple[str, Gate], ...] = (
    ("mode", gate_mode),
    ("rate-limit", gate_rate_limit),
    ("breaker", gate_breaker),
    ("correlation", gate_correlation),
    ("capacity", gate_capacity),
    ("ownership", gate_ownership),
)
assert tuple(name for name, _ in GATES) == GATE_ORDER, "the action table names the gates in this order"


def _charge(ctx: GateContext, decision: Decision) -> GateContext:
    budget = ACTIONS[decision.kind].budget
    if budget == "hang-requeues":
        return dataclasses.replace(ctx, hang_requeues_last_hour=ctx.hang_requeues_last_hour + 1)
    if budget != "removals":
        return ctx
    by_part = dict(ctx.actions_last_hour_by_partition)
    for p in ctx.fleet.partitions_of(decision.node):
        by_part[p] = by_part.get(p, 0) + 1
    return dataclasses.replace(
        ctx,
        actions_last_hour=ctx.actions_last_hour + 1,
        actions_last_hour_by_partition=by_part,
        removed_in_batch=ctx.removed_in_batch | {decision.node},
    )


def gate_one(decision: Decision, ctx: GateContext) -> GateResult:
    """Run in order the gates the action table lists for the decision's kind."""
    if decision.kind == "none":
        return GateResult(decision, "recorded", None, decision.note)
    action = ACTIONS[decision.kind]
    if action.follows:  # it has no gates of its own: only the decision it follows may let it happen
        return GateResult(decision, "refused", "error", f"a {decision.kind} follows a {action.follows}; "
                                                        "it is never proposed on its own")
    waiting: Refusal | None = None
    for name, gate in GATES:
        if not action.applies(name):
            continue
        try:
            refusal = gate(decision, ctx)
        except Exception as exc:  # fail closed: a broken gate refuses
            return GateResult(decision, "refused", "error", f"gate {name} failed: {type(exc).__name__}: {exc}"[:200])
        if isinstance(refusal, _Wait):
            waiting = refusal
        elif refusal is not None:
            return GateResult(decision, "refused", refusal.gate, refusal.reason)
    if waiting is not None:
        return GateResult(decision, "waiting-approval", waiting.gate, waiting.reason)
    return GateResult(decision, "allowed", None, "")


def apply_gates(decisions: Iterable[Decision], context: GateContext) -> tuple[GateResult, ...]:
    """Gate every decision in order; what an allowed one spends (a node removal, a hang requeue) is
    charged to the ones after it. Never raises."""
    return gate_batch(decisions, context)[0]


def gate_batch(decisions: Iterable[Decision], context: GateContext) -> tuple[tuple[GateResult, ...], GateContext]:
    """apply_gates, and the context with what the allowed ones spent: hand it to the round's next
    batch (the hang responder's and the reintegrator's decisions come after policy's)."""
    out: list[GateResult] = []
    ctx = context
    for decision in decisions:
        try:
            outcome = gate_one(decision, ctx)
            if outcome.status == "allowed":
                ctx = _charge(ctx, decision)
        except Exception as exc:  # fail closed
            outcome = GateResult(decision, "refused", "error", f"{type(exc).__name__}: {exc}"[:200])
        out.append(outcome)
    return tuple(out), ctx
