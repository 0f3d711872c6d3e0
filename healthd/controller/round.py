"""The control round: its steps in order, each a function from the round's state (a frozen value) to
the next, run by one guarded loop (`run`), as the agent's classification runs its sources
(healthd.agent.classify.engine).

    step         reads                                               returns
    reconcile    the fleet view, the ledger's writes and holds      what the reconciler changed
    in-band      the reports, the clears, the last in-band view     the in-band view, the reports as the
                                                                    round sees them, the fleet view
    incidents    the reports, the open incidents, holds, writes     the open incidents, the correlated
                 not yet settled, remediation counts                groups, the ledger view
    decide       the fleet and ledger views, the verdicts, the      the proposals: an operator's undos,
                 operators' undos, the hangs                        policy's, the hang responder's
    gate         the proposals, the breaker, the budgets spent      each proposal's outcome, the gate
                                                                    context after them
    act          the outcomes, the mode                             what the act step did (policy's)
    spares       what the act step did, the fleet view, reports,    the gate context after the spare
                 holds, the ledger's spare actions, the spare       decisions (policy.spares only)
                 revalidations that finished
    reintegrate  the fleet view, holds, the gate context, flags     the gate context after its writes
    observe      the reports, the ledger's figures                  nothing: the metrics are set

The guard, as before the round had steps: a step that fails stops the round there (a ledger that
cannot record: nothing after it is applied; the controller raises it to the main loop), except the
steps whose failure must not stop drains (spares, reintegrate, observe): logged, and the round goes on with
the state it had. One node's bad data is each step's own to log and skip. A round whose fleet view is
unusable (Slurm unreachable) never starts (`usable_snapshot`): nothing stale is acted on.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from types import MappingProxyType
from typing import Literal

from healthd.controller import incidents, inband, spares
from healthd.controller.actions import REMOVING_KINDS, Decision, next_attempt, series_key
from healthd.controller.config import ControllerSettings
from healthd.controller.executor import UNDO_KINDS, UNDO_PREFIX, ExecResult, Executor
from healthd.controller.fleetcache import FleetCache, SlurmSnapshot
from healthd.controller.gates import BreakerState, GateContext, GateResult, GroupIncident, build_context, correlate, \
    gate_batch
from healthd.controller.goodput_gather import InbandLogs
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.metrics import INCIDENT_WINDOW_S, ControllerMetrics, IncidentTimings, RoundFigures
from healthd.controller.policy import ControllerPolicySettings, FleetView, LedgerView, NodeReport, decide, \
    make_reason, without_cleared
from healthd.controller.reconcile import Change, Reconciler
from healthd.controller.recorder import Recorder, Verdicts, verdicts
from healthd.controller.reintegrate import Reintegrator, failure_summary
from healthd.lograte import RateLimitedLog
from healthd.slurm.backend import SlurmError
from healthd.slurm.topology import topology_of

_log = logging.getLogger("healthd.controller")

WRITE_IN_FLIGHT_S = 30.0
"""How long before the fleet view's read a write healthd planned may still have landed after it (a
client that timed out, a slurmctld that answered slowly): such writes whose outcome the ledger does not
know count as out of service and as spent budget in the gates (LedgerView.unsettled)."""
_INBAND = operator.attrgetter("inband")
_VERDICT = operator.attrgetter("verdict")
_RECEIVED_AT = operator.attrgetter("received_at")
Clears = Mapping[str, tuple[Mapping[str, float], Mapping[str, float]]]
"""node -> (evidence clears, episode clears): finding id -> the time before which it no longer counts."""


@dataclass(frozen=True)
class RoundParts:
    """What the round works with: the parts that keep their own records (the ledger, the executor, the
    reconciler, the reintegrator, the hang responder, the recorder) and what it only reads."""

    settings: ControllerSettings
    """The controller's settings (policy's are the round's own: RoundState.policy)."""
    ledger: Ledger
    """What every step reads and records."""
    executor: Executor
    """The act step (Executor.apply) and the operator's undo."""
    reconciler: Reconciler
    """Keeps the ledger true to Slurm (the reconcile step)."""
    reintegrator: Reintegrator
    """Moves reintegrations on and names the findings they cleared."""
    hangs: inband.HangResponder
    """Proposes a hung job's requeue; remembers the hangs it settled."""
    recorder: Recorder
    """Records each gate outcome once."""
    metrics: ControllerMetrics
    """The controller's counters and the round's gauges."""
    log: RateLimitedLog
    """The controller's rate-limited log lines (the observe step tells what it held back)."""
    clock: Callable[[], float]
    """The wall clock: when a decision or a write really happened (`moment`)."""
    topology_text: str = ""
    """topology.conf as read at start: its switches are topology groups."""
    goodput: InbandLogs | None = None
    """Where the in-band view's records go in the jobs' goodput logs; None without goodput."""


@dataclass(frozen=True)
class Batch:
    """One proposer's decisions of the round, and what the gates made of them."""

    by: Literal["undo", "policy", "hang"]
    """An operator's undos (planned by the admin socket), policy's decisions, the hang responder's."""
    decisions: tuple[Decision, ...]
    """In the order the proposer made them."""
    outcomes: tuple[GateResult, ...] = ()
    """Filled by the gate step, in the decisions' order."""


@dataclass(frozen=True)
class RoundState:
    """One round as it stands after each step: what it started from, then what each step returned."""

    now: float
    """The round's time (tests hand in their own)."""
    started: float
    """The clock when the round began: `moment` moves `now` on by the time the round has taken."""
    policy: ControllerPolicySettings
    """Policy's settings as the round began (the mode, the gates' limits)."""
    snapshot: SlurmSnapshot
    """The fleet as Slurm last showed it, usable (`usable_snapshot`)."""
    received: Mapping[str, NodeReport]
    """Every node's latest report as the round began."""
    read_at: float | None = None
    """When a thread of its own read the fleet view (None: read by this round)."""
    only: str | None = None
    """The one node a drain request asks about; None: a full round."""
    jobs: Mapping[str, str] | None = None
    """node -> the job a drain request names (it joins the incident)."""
    inband_round: inband.InbandRound = inband.InbandRound()
    """The in-band view: the last round's until the in-band step, this round's after it."""
    inband_started: bool = False
    """A round has evaluated in-band data since the controller started."""
    reconciled: tuple[Change, ...] = ()
    """What the reconcile step changed in the ledger."""
    reports: Mapping[str, NodeReport] = field(default_factory=dict)
    """The reports as the round sees them: the in-band findings added, cleared evidence removed."""
    fleet: FleetView = FleetView()
    """The reports as the round sees them and the fleet view: partitions, topology groups."""
    open_incidents: incidents.OpenIncidents = field(default_factory=dict)
    """(node, finding id) -> its open incident."""
    correlated: Mapping[str, GroupIncident] = field(default_factory=dict)
    """node -> the correlated group it fails in."""
    ledger_view: LedgerView = LedgerView()
    """What policy and the gates read of the ledger: holds, open incidents, escalations, unsettled writes."""
    verdicts: Verdicts = Verdicts()
    """The operators' approvals and rejections of decisions of open incidents."""
    proposals: tuple[Batch, ...] = ()
    """In the order they are gated and applied."""
    context: GateContext | None = None
    """The gate context after every decision gated so far (the reintegration's come last)."""
    results: tuple[tuple[GateResult, ExecResult | None], ...] = ()
    """Policy's outcomes and what the act step did with each (the answer to a drain request)."""
    stopped: Exception | None = None
    """The failure that stopped the round (nothing after its step ran)."""

    @property
    def mode(self) -> str:
        return self.policy.mode

    @property
    def full(self) -> bool:
        return self.only is None


def moment(parts: RoundParts, s: RoundState) -> float:
    """`now` moved on by the time this round has taken: when a decision or a write really happened, on
    the round's own clock."""
    return s.now + max(0.0, parts.clock() - s.started)


# --------------------------------------------------------------------------- the steps


def reconcile(parts: RoundParts, s: RoundState) -> RoundState:
    """The ledger made to agree with the fleet view: writes that landed adopted, writes Slurm lost or
    someone took over ended (healthd.controller.reconcile)."""
    changes = tuple(parts.reconciler.round(s.snapshot.nodes, s.now, s.mode, read_at=s.read_at))
    for change in changes:
        parts.metrics.actions.labels(kind="reconcile", status=change.what).inc()
    return dataclasses.replace(s, reconciled=changes)


def in_band(parts: RoundParts, s: RoundState) -> RoundState:
    """The in-band view, and the reports as the round sees them: the in-band findings added, the
    evidence a repair, a completed reboot or an operator cleared removed; the fleet view over them."""
    cleared = clears(parts, s.now)
    rnd, started = inband_view(parts, s, cleared)
    reports = dict(s.received)
    for n, extra in rnd.findings.items():
        if n in reports:
            reports[n] = dataclasses.replace(reports[n], findings=inband.with_findings(reports[n].findings, extra))
    for n, (evidence, episodes) in cleared.items():  # only the few nodes with a clear
        if n in reports:
            reports[n] = without_cleared(reports[n], evidence, episodes)
    fleet = FleetView.of(MappingProxyType(reports), s.snapshot, parts.topology_text, s.policy)
    return dataclasses.replace(s, inband_round=rnd, inband_started=started, reports=reports, fleet=fleet)


def record_incidents(parts: RoundParts, s: RoundState) -> RoundState:
    """An open incident for every fresh T1/T2 finding, one per correlated group; the ledger view the
    decisions read (holds, incidents, escalations, writes not yet settled)."""
    ttl = s.policy.report_ttl_s
    nodes = s.fleet.reporting_findings
    opened = incidents.ensure(parts.ledger, s.reports, nodes, s.now, ttl, s.jobs, parts.log)
    correlated = correlate(s.fleet, s.policy, s.now)
    incidents.ensure_groups(parts.ledger, correlated.values(), s.now)
    view = LedgerView(holds=parts.ledger.holds(), incidents={k: str(v) for k, v in opened.items()},
                      escalations=incidents.escalations(parts.ledger, s.reports, nodes, s.now, ttl,
                                                        parts.settings.reintegration, parts.log),
                      unsettled=parts.ledger.unsettled_removals(s.snapshot.read_at - WRITE_IN_FLIGHT_S))
    return dataclasses.replace(s, open_incidents=opened, correlated=correlated, ledger_view=view)


def propose(parts: RoundParts, s: RoundState) -> RoundState:
    """Every decision of the round, by proposer: an operator's undos, policy's (for the one node a
    drain request asks about, if any), the hang responder's; and the operators' verdicts."""
    v = verdicts(parts.ledger, set(s.open_incidents.values()))
    batches = []
    if s.full and s.mode != "observe":
        batches.append(Batch("undo", undos(parts, s.now)))
    decisions = decide(s.fleet, s.ledger_view, s.policy, moment(parts, s))
    if s.only is not None:
        decisions = tuple(d for d in decisions if d.node == s.only)
    batches.append(Batch("policy", decisions))
    if s.full:
        batches.append(Batch("hang", hang_proposals(parts, s, v.rejected)))
    return dataclasses.replace(s, verdicts=v, proposals=tuple(batches))


def gate(parts: RoundParts, s: RoundState) -> RoundState:
    """The breaker evaluated (its alert, once), then every proposal through the gates its kind lists,
    what an allowed one spends charged to the ones after it (healthd.controller.gates)."""
    ledger = parts.ledger
    hour = s.now - 3600.0
    hang_acts = any(d.acts for b in s.proposals if b.by == "hang" for d in b.decisions)
    b = ledger.breaker_state()
    ctx, alert = build_context(
        s.fleet, s.ledger_view, s.policy, s.now,
        BreakerState(open=b.open, opened_at=b.opened_at, reset_at=b.reset_at, cause=b.cause or "",
                     nodes=frozenset(b.nodes)),
        actions_last_hour=ledger.actions_applied_since(hour),
        actions_last_hour_by_partition={p: ledger.actions_applied_since(hour, p) for p in s.fleet.partitions},
        approved=s.verdicts.approved, out_of_service=s.snapshot.out_of_service,
        hang_requeues_last_hour=parts.hangs.requeues_since(hour) if hang_acts else 0, correlated=s.correlated)
    if alert is not None:
        ledger.open_breaker(alert.cause, nodes=alert.nodes, at=s.now)
        _log.error("ALERT %s", alert.text)
    parts.metrics.breaker_open.set(1 if ctx.breaker.open else 0)
    gated = []
    for batch in s.proposals:
        outcomes, ctx = gate_batch(batch.decisions, ctx)
        gated.append(dataclasses.replace(batch, outcomes=outcomes))
    return dataclasses.replace(s, context=ctx, proposals=tuple(gated))


def act(parts: RoundParts, s: RoundState) -> RoundState:
    """Each batch in turn: the outcomes nothing is applied for recorded (one transaction), each allowed
    one applied by the act step (Executor.apply; outside observe). A hang's requeue must not stop
    drains or reintegration: that batch's failure is logged."""
    results: tuple[tuple[GateResult, ExecResult | None], ...] = ()
    for batch in s.proposals:
        if batch.by == "undo":
            for outcome in batch.outcomes:  # recorded by the admin socket already
                parts.metrics.actions.labels(kind="undo", status=parts.executor.undo(outcome, s.now).status).inc()
            continue
        try:
            done = carry_out(parts, s, batch.outcomes)
        except LedgerError:
            raise
        except Exception:
            if batch.by != "hang":
                raise
            _log.exception("in-band hangs not handled this round")
            continue
        if batch.by == "policy":
            results = done
    return dataclasses.replace(s, results=results)


def spare_pool(parts: RoundParts, s: RoundState) -> RoundState:
    """Hot spares (`policy.spares`, healthd.controller.spares): the revalidations that finished recorded,
    then a spare released next to each node the act step removed (in observe, each removal only the
    mode gate refused), each pool kept, each spare whose revalidation failed drained and the
    revalidations due started; every decision gated with the round's context, recorded, and applied by
    the act step outside observe (a revalidation: handed to the reintegrator's validation)."""
    if not s.policy.spares:
        return s
    assert s.context is not None
    ledger, now = parts.ledger, moment(parts, s)
    for outcome, results in parts.reintegrator.finished_spares():
        spare_validated(parts, s, outcome, results)
    removals = [(o.decision.node, o.decision.incident) for o, done in s.results if o.decision.kind in REMOVING_KINDS
                and ((done is not None and done.status == "applied") or (s.mode == "observe" and o.gate == "mode"))]
    ttl = s.policy.report_ttl_s
    reintegrations = ledger.reintegrations()
    # each node's latest spare write, and the last window's for the removals still owed a spare
    applied = ledger.latest_actions(spares.KINDS, now - 2 * spares.RELEASE_WINDOW_S)
    removals += spares.owed(((n, h.incident_id, h.since) for n, h in s.ledger_view.holds.items()), applied, now,
                            done=(n for n, _ in removals))
    world = spares.world_of(
        nodes=s.snapshot.nodes, partitions=s.fleet.partitions,
        healthy=(n for n, r in s.reports.items() if r.verdict == "healthy" and s.now - r.received_at <= ttl),
        unhealthy=(n for n, r in s.reports.items() if r.verdict != "healthy" and s.now - r.received_at <= ttl),
        busy={*s.ledger_view.holds, *(n for n, _ in s.open_incidents), *(r.node for r in reintegrations if r.active)},
        out_of_service=s.snapshot.out_of_service | set(s.ledger_view.holds), floors=s.policy.capacity_floors,
        actions=applied, topology=topology_of(parts.topology_text), racks=s.policy.racks,
        validated={r.node: r.validated_at for r in sorted(reintegrations, key=lambda r: r.validated_at or 0.0)
                   if r.validated_at is not None and r.state in ("probation", "passed")},
        validating=parts.reintegrator.spares_validating())
    outcomes, ctx = gate_batch(spares.decide(s.policy.spares, world, removals, now), s.context)
    validate = tuple(o for o in outcomes if o.decision.kind == "spare-validate")
    carry_out(parts, s, tuple(o for o in outcomes if o.decision.kind != "spare-validate"))
    parts.recorder.record_batch(validate, moment(parts, s), s.mode)
    for o in validate:
        if s.mode != "observe" and o.status == "allowed":
            parts.reintegrator.validate_spare(o)
    return dataclasses.replace(s, context=ctx)


def spare_validated(parts: RoundParts, s: RoundState, outcome: GateResult, results: list[dict]) -> None:
    """A spare's revalidation in the ledger, as a `spare-validate` action carrying the results: applied
    for a pass, failed for a failure, which also opens the incident its drain (spares.drains) is made
    under; the incident, the action and its outcome in one transaction (a restart before it: the
    validation runs again)."""
    d, now = outcome.decision, moment(parts, s)
    attempt, why, _ = next_attempt(parts.ledger.series(series_key(d)))
    if attempt is None:  # recorded already (the series ended): nothing to add
        _log.warning("%s: spare revalidation not recorded: %s", d.node, why)
        return
    passed = bool(results) and all(r.get("rc") == 0 for r in results)
    evidence: dict = {"reservation": d.target, "partition": d.detail.get("partition"), "results": results}
    summary = failure_summary(results)
    decision_id = parts.recorder.record(outcome, now, s.mode)
    with parts.ledger.transaction():
        if not passed:
            incident = parts.ledger.open_incident(f"{spares.FAILED_SIGNATURE}{d.node}", attribution="hardware",
                                                  tier="T1", nodes=(d.node,), status="validation-failed",
                                                  detected_at=now, at=now)
            evidence.update(incident=str(incident.id),
                            reason=make_reason(f"validation failed: {summary}", str(incident.id)))
        action = parts.ledger.plan_action(decision_id=decision_id, idempotency_key=series_key(d, attempt),
                                          series=series_key(d), attempt=attempt, node=d.node, kind="spare-validate",
                                          argv=[str(a) for a in results[-1]["argv"]] if results else [d.target],
                                          partition=evidence["partition"], evidence=evidence, at=now)
        if passed:
            parts.ledger.mark_applied(action.id, f"validation passed ({len(results)} command(s))", at=now, hold=False)
        else:
            parts.ledger.mark_failed(action.id, f"validation failed: {summary}", at=now)
    if passed:
        _log.info("%s: spare revalidation passed in %s", d.node, d.target)
    else:
        _log.error("%s: spare revalidation failed in %s: %s; to be drained [#%s]", d.node, d.target, summary,
                   evidence["incident"])


def reintegrate(parts: RoundParts, s: RoundState) -> RoundState:
    """Nodes whose fault cleared queued (auto mode, breaker closed), then every reintegration moved on,
    each write it proposes gated with the round's context and applied by the act step."""
    assert s.context is not None
    held = [s.context]

    def gate_some(decisions: Iterable[Decision]) -> tuple[GateResult, ...]:
        outcomes, held[0] = gate_batch(decisions, held[0])
        parts.recorder.record_batch([o for o in outcomes if o.status != "allowed"], moment(parts, s), s.mode)
        return outcomes

    ttl = s.policy.report_ttl_s
    if not s.context.breaker.open:
        parts.reintegrator.auto_requests(s.fleet, s.ledger_view.holds, s.mode, s.now, ttl)
    for r, what in parts.reintegrator.step(s.now, s.mode, gate=gate_some,
                                           act=lambda outcome: act_one(parts, outcome, moment(parts, s), s.mode),
                                           reports=s.fleet.reports, flags=s.inband_round.flags, report_ttl_s=ttl):
        parts.metrics.actions.labels(kind="reintegrate", status=r.state).inc()
        _log.info("%s: reintegration %s: %s", r.node, r.id, what)
    return dataclasses.replace(s, context=held[0])


def observe(parts: RoundParts, s: RoundState) -> RoundState:
    """The counts of log lines held back told; the round's figures to the metrics."""
    parts.log.flush()
    parts.metrics.observe_round(figures(parts.ledger, s.received.values(), s.inband_round, s.policy.report_ttl_s,
                                        s.now, parts.metrics.incidents_since(s.now)))
    return s


@dataclass(frozen=True)
class Step:
    """One step of the round."""

    name: str
    """As the documentation names it."""
    run: Callable[[RoundParts, RoundState], RoundState]
    """The state after the step, from the state before it."""
    full_only: bool = False
    """Only in a full round, not in the round for one node's drain request."""
    acting_only: bool = False
    """Not in observe mode."""
    survives: str = ""
    """Where a failure must not stop the round: the line logged, and the round goes on with the state
    as it was before the step. Empty: a failure stops the round."""


STEPS: tuple[Step, ...] = (
    Step("reconcile", reconcile, full_only=True),
    Step("in-band", in_band),
    Step("incidents", record_incidents),
    Step("decide", propose),
    Step("gate", gate),
    Step("act", act),
    Step("spares", spare_pool, full_only=True, survives="spare pool not kept this round"),
    Step("reintegrate", reintegrate, full_only=True, acting_only=True, survives="reintegration step failed"),
    Step("observe", observe, full_only=True, survives="controller metrics not updated this round"),
)


def run(parts: RoundParts, state: RoundState, steps: Iterable[Step] = STEPS) -> RoundState:
    """The round: each step that applies, in order, under the guard (above)."""
    for step in steps:
        if (step.full_only and not state.full) or (step.acting_only and state.mode == "observe"):
            continue
        try:
            state = step.run(parts, state)
        except Exception as exc:
            if not step.survives:
                return dataclasses.replace(state, stopped=exc)
            _log.exception(step.survives)
    return state


# --------------------------------------------------------------------------- what the steps share


def usable_snapshot(fleet: FleetCache, period_s: float | None, now: float, log: RateLimitedLog) -> SlurmSnapshot | None:
    """The fleet as a round may act on it; None when Slurm could not be read (the latest read failed, or
    none succeeded for three refresh periods). `period_s`: the refresh thread's, None: read it now."""
    if period_s is None:
        try:
            fleet.refresh()
        except SlurmError as exc:
            _log.warning("Slurm unreachable, skipping this round: %s", exc)
            return None
        return fleet.snapshot()
    snap = fleet.snapshot()
    if snap is None or not fleet.healthy:
        log.warning("fleet", "Slurm unreachable, skipping this round: %s", fleet.error or "its node list not read yet")
        return None
    if now - snap.read_at > max(3 * period_s, 30.0):
        log.warning("fleet-stale", "Slurm unreachable, skipping this round: its node list was last read %.0f s ago",
                    now - snap.read_at)
        return None
    return snap


def clears(parts: RoundParts, now: float) -> Clears:
    """Evidence clears come from reintegrations (a repair) and completed reboots; episode clears from
    undo, close and hand-over. Read from SQL within the support window: clears accumulate for as long
    as the ledger lives."""
    since = now - parts.settings.reintegration.support_window_s
    out: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for node, findings in parts.reintegrator.cleared(now).items():
        out.setdefault(node, ({}, {}))[0].update(findings)
    for c in parts.ledger.clears(since=since):
        per = out.setdefault(c.node, ({}, {}))[0 if c.scope == "evidence" else 1]
        per[c.finding_id] = max(per.get(c.finding_id, 0.0), c.before)
    return out


def inband_view(parts: RoundParts, s: RoundState, cleared: Clears) -> tuple[inband.InbandRound, bool]:
    """The round's in-band view (findings for the slow ranks of jobs on several nodes, hangs) and
    whether in-band data has been evaluated since the start. A straggler's episode is carried from
    round to round; on the first round after a start, one still flagged that an operator had dismissed
    (undo, close) keeps the dismissed episode."""
    if not any(map(_INBAND, s.received.values())):
        rnd = inband.InbandRound()
        goodput_logs(parts, rnd, s.now)
        return rnd, s.inband_started
    carried = dict(s.inband_round.first_seen)
    if not s.inband_started:
        for node, (_evidence, episodes) in cleared.items():
            for fid, before in episodes.items():
                if fid.startswith(inband.STRAGGLER_PREFIX):
                    carried.setdefault((node, fid), before)
    groups = FleetView.build((), (), parts.topology_text, s.policy).groups
    try:
        rnd = inband.evaluate(s.received.values(), groups, parts.settings.inband.detector, s.now,
                              s.policy.report_ttl_s, carried)
    except Exception as exc:  # the in-band view must never stop the round's other decisions
        parts.log.warning("inband", "in-band signals not evaluated this round: %s: %s", type(exc).__name__, exc)
        return inband.InbandRound(first_seen=s.inband_round.first_seen), True
    goodput_logs(parts, rnd, s.now)
    for node, found in sorted(rnd.findings.items()):
        for f in found:
            if (node, f.id) not in carried:  # a new episode: said once, whatever the tier decides
                _log.warning("%s: in-band straggler (T%d%s): %s", node, f.tier, ", recorded only" if f.tier == 3 else "",
                             f.summary)
    return rnd, True


def goodput_logs(parts: RoundParts, rnd: inband.InbandRound, now: float) -> None:
    if parts.goodput is None:
        return
    try:
        parts.goodput.observe(now, rnd)
    except Exception as exc:  # the goodput log must never stop the round
        parts.log.warning("straggler-log", "in-band records not written to the goodput logs: %s", exc)


def undos(parts: RoundParts, now: float) -> tuple[Decision, ...]:
    """The reversals `healthctl undo` planned (key `undo:<action id>`), as decisions of the action
    table's undo kinds; one planned as a kind the table does not know is marked failed."""
    out = []
    for a in parts.ledger.pending_actions():
        if not a.idempotency_key.startswith(UNDO_PREFIX):
            continue
        kind = UNDO_KINDS.get(a.kind)
        if kind is None:
            parts.ledger.mark_failed(a.id, f"unknown undo kind {a.kind!r}", at=parts.clock())
            continue
        out.append(Decision(id=a.idempotency_key, kind=kind, node=a.node, reason="", tier=1,  # type: ignore[arg-type]
                            series=a.series, decided_at=now, detail={"action": a.id}))
    return tuple(out)


def hang_proposals(parts: RoundParts, s: RoundState, rejected: Mapping[str, str]) -> tuple[Decision, ...]:
    """What the hang responder proposes this round (nothing when it cannot say: logged)."""
    try:
        return parts.hangs.propose(s.inband_round.hangs, s.now, rejected)
    except LedgerError:
        raise
    except Exception:  # a hang's requeue must not stop drains or reintegration
        _log.exception("in-band hangs not handled this round")
        return ()


def carry_out(parts: RoundParts, s: RoundState,
              outcomes: tuple[GateResult, ...]) -> tuple[tuple[GateResult, ExecResult | None], ...]:
    acts = [s.mode != "observe" and o.status == "allowed" for o in outcomes]
    parts.recorder.record_batch([o for o, a in zip(outcomes, acts, strict=True) if not a], moment(parts, s), s.mode)
    return tuple((o, act_one(parts, o, moment(parts, s), s.mode) if a else None)
                 for o, a in zip(outcomes, acts, strict=True))


def act_one(parts: RoundParts, outcome: GateResult, now: float, mode: str) -> ExecResult:
    """One allowed outcome through the act step (Executor.apply), the decision recorded by the round
    (on its own commit, before its Slurm call); a failure of this write never stops the round."""
    try:
        result = parts.executor.apply(outcome, now, mode=mode, record=lambda: parts.recorder.record(outcome, now, mode))
    except LedgerError:
        raise  # the ledger itself is broken: nothing can be recorded, so nothing may be done
    except Exception as exc:
        parts.log.warning("act", "%s: %s not applied: %s: %s", outcome.decision.node, outcome.decision.kind,
                          type(exc).__name__, exc)
        result = ExecResult("failed", f"{type(exc).__name__}: {exc}"[:300])
    parts.metrics.actions.labels(kind=outcome.decision.kind, status=result.status).inc()
    if result.status == "applied" and outcome.decision.escalation:
        incidents.escalate(parts.ledger, outcome.decision)
    return result


def figures(ledger: Ledger, reports: Iterable[NodeReport], rnd: inband.InbandRound, ttl_s: float, now: float,
            incidents_since: float | None = None) -> RoundFigures:
    """The fleet gauges' figures: the reports by freshness and verdict, the ledger's waiting approvals,
    open incidents, reintegrations and the incidents created since `incidents_since` (default: the
    last week), the in-band view's jobs, slow ranks and hangs."""
    reports = list(reports)
    # counted in C: at 100,000 nodes a Python loop here was a fifth of the round
    fresh = dict(Counter(compress(map(_VERDICT, reports), map((now - ttl_s).__le__, map(_RECEIVED_AT, reports)))))
    waiting = ledger.waiting_decisions()

    def diff(later: float | None, earlier: float | None) -> float | None:
        return None if later is None or earlier is None else later - earlier

    recent = tuple(IncidentTimings(iid, created, diff(detected, first), diff(decided, detected),
                                   diff(applied, decided), diff(back, first))
                   for iid, created, first, detected, decided, applied, back in ledger.incident_stage_times(
                       now - INCIDENT_WINDOW_S if incidents_since is None else incidents_since))
    return RoundFigures(at=now, nodes_reporting=fresh, nodes_stale=len(reports) - sum(fresh.values()),
                        approvals_waiting=len(waiting),
                        oldest_waiting_since=min((d.decided_at for d in waiting), default=None),
                        incidents_open=ledger.open_incident_counts(), reintegrations=ledger.reintegration_counts(),
                        incidents=recent, inband_jobs=rnd.jobs, inband_stragglers=rnd.flagged_by_tier(),
                        inband_hangs=len(rnd.hangs))
