"""Apply allowed Decisions to Slurm, exactly once, with the ledger as the write-ahead log.

For each allowed decision: find where its series of attempts stands (one series per decision and
incident), re-read the node, adopt an earlier attempt Slurm shows landed (its client reported failure,
or it was abandoned at a restart while its client still ran), repeat the ownership check
(`gates.still_safe`), plan the action in the ledger under the next attempt's idempotency key with the
exact argv the backend describes, make the call, read the node back and mark the action applied with
the reason time and user Slurm recorded (healthd's hold on the node, healthd.controller.ownership), or
failed with Slurm's message. A drain-and-requeue then requeues the opted-in jobs, each its own action.

What a crash or a lost write leaves behind is the reconciler's (healthd.controller.reconcile): it never
applies an old plan blindly; the next round re-decides from current evidence through every gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from healthd.controller.gates import GateResult, still_safe
from healthd.controller.ledger import Action, Ledger
from healthd.controller.ownership import NODE_STATE_KINDS, describe_reason, owned, shows_write
from healthd.controller.policy import Decision, LedgerView
from healthd.slurm.backend import JobInfo, NodeInfo, SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller.executor")

UNDO_PREFIX = "undo:"
"""Idempotency-key prefix of reversals planned by `healthctl undo` (healthd.controller.admin)."""
JobLister = Callable[[str], list[JobInfo]]
JobReader = Callable[[str], "JobInfo | None"]


@dataclass(frozen=True)
class ExecResult:
    """What `Executor.apply` did with one outcome."""

    status: str
    """applied | failed | refused | skipped | dry-run | already-applied"""
    detail: str = ""
    action_id: int | None = None
    argv: tuple[str, ...] = ()


MAX_ATTEMPTS = 3
"""Failed tries of one decision for one incident: a write Slurm refused or that failed (slurmctld
restarting, a state race) is tried again on later rounds, each attempt its own ledger row, then left to a
human."""
MAX_LOST = 3
"""Times Slurm may lose one decision's write (slurmctld restarting from an older state save) before
healthd stops re-applying it and leaves it to a human."""


def idempotency_key(decision: Decision, attempt: int = 1) -> str:
    key = f"{decision.id}#{decision.incident}"
    return key if attempt == 1 else f"{key}#try{attempt}"


def next_attempt(attempts: list[Action]) -> tuple[int | None, str, Action | None]:
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


def error_text(exc: BaseException) -> str:
    """One line, at most 500 characters, of what Slurm (or the validation) said."""
    msg = getattr(exc, "stderr", "") or str(exc)
    return " ".join(str(msg).split())[:500] or type(exc).__name__


class Executor:
    """Applies allowed outcomes to Slurm through `backend`, recording every step in `ledger`."""

    def __init__(self, backend: SlurmBackend, ledger: Ledger, dry_run: bool = False, *,
                 requeue_opt_in: str = "healthd:requeue", list_jobs: JobLister | None = None,
                 read_job: JobReader | None = None,
                 clock: Callable[[], float] = time.time,
                 out: Callable[[str], None] | None = None):
        self.backend = backend
        self.ledger = ledger
        self.dry_run = dry_run
        self.requeue_opt_in = requeue_opt_in
        self.list_jobs = list_jobs or backend.jobs_on
        """The jobs running on a node (the backend's; tests hand in their own)."""
        self.read_job = read_job or self._read_job
        """One job in any state, None once Slurm no longer knows it."""
        self.clock = clock
        """When a write really returned: the ledger's applied_at is this, not the round's start."""
        self.out = out or (lambda line: print(line, flush=True))
        self._printed: set[str] = set()
        self.on_node_read: Callable[[NodeInfo], None] | None = None
        """Told every single-node read (the controller's fleet view keeps the newest)."""
        self.read_back = True
        """Read a node back right after writing it, to confirm the hold with the reason time and user
        Slurm shows. False where a fleet view re-read at once confirms it instead (the controller's
        refresh thread, through the reconciler): the write's round then does not wait for that read."""
        self.on_write: Callable[[str], None] | None = None
        """Told the node of every node-state write that returned (the fleet view re-reads soon)."""

    def read_node(self, name: str) -> NodeInfo:
        """One node, fresh from Slurm (raises SlurmError, ValueError for a bad name)."""
        info = self.backend.node(name)
        if self.on_node_read is not None:
            self.on_node_read(info)
        return info

    # -- views ---------------------------------------------------------------------------------------

    def _read_job(self, job_id: str) -> JobInfo | None:
        try:
            return self.backend.job(job_id)
        except ValueError:
            return None  # not a job id (a damaged ledger record): no job Slurm could know

    def ledger_view(self) -> LedgerView:
        return LedgerView(holds=self.ledger.holds())

    def argv_for(self, decision: Decision) -> list[str]:
        if decision.kind in ("drain", "drain-and-requeue"):
            return self.backend.describe("drain", nodes=decision.node, reason=decision.reason)
        if decision.kind == "reboot-asap":
            return self.backend.describe("reboot_asap", nodes=decision.node, reason=decision.reason)
        if decision.kind == "resume":
            return self.backend.describe("resume", nodes=decision.node)
        raise ValueError(f"decision kind {decision.kind!r} has no Slurm call")

    def _call(self, decision: Decision) -> str:
        """Make the Slurm write; returns a one-line outcome. Raises SlurmError."""
        node = decision.node
        if decision.kind in ("drain", "drain-and-requeue"):
            self.backend.drain(node, decision.reason)
            return "drained"
        if decision.kind == "reboot-asap":
            self.backend.reboot_asap(node, decision.reason)
            return "reboot ASAP requested (nextstate=RESUME)"
        if decision.kind == "resume":
            self.backend.resume(node)
            return "resumed"
        raise ValueError(f"decision kind {decision.kind!r} has no Slurm call")

    def applied(self, decision: Decision) -> Action | None:
        """The action that applied `decision` for its incident (any attempt), if one did."""
        return next((a for a in self.ledger.series(idempotency_key(decision)) if a.status == "applied"), None)

    def _incident_int(self, decision: Decision) -> int | None:
        return int(decision.incident) if decision.incident.isdigit() else None

    def _timeline(self, incident_id: int | None, stage: str, at: float) -> None:
        if incident_id is None:
            return
        try:
            self.ledger.mark_timeline(incident_id, stage, at)
        except Exception as exc:  # the timeline is bookkeeping; never fail an action on it
            _log.warning("incident %s: cannot set %s: %s", incident_id, stage, exc)

    def _print_once(self, key: str, argv: Any) -> None:
        if key not in self._printed:  # once per action, not every round
            self._printed.add(key)
            self.out("dry-run: would run: " + " ".join(argv))

    # -- apply ---------------------------------------------------------------------------------------

    def apply(self, outcome: GateResult, now: float, *, decision_id: int | None = None,
              mode: str = "auto", fresh: NodeInfo | None = None) -> ExecResult:
        """Apply one allowed outcome (anything else is skipped). `decision_id` is the ledger row the
        caller recorded; when None, the executor records the decision as allowed itself. `fresh`: the
        node as the caller read it from Slurm just before (else it is read here)."""
        decision = outcome.decision
        if outcome.status != "allowed" or not decision.acts:
            return ExecResult("skipped", f"outcome {outcome.label}")
        series = idempotency_key(decision)
        attempts = self.ledger.series(series)
        attempt, why, settled = next_attempt(attempts)
        if attempt is None:
            return self._settled(why, settled)
        if fresh is None or fresh.name != decision.node:
            try:
                fresh = self.read_node(decision.node)
            except SlurmError as exc:
                _log.warning("%s: cannot re-read the node before %s: %s", decision.node, decision.kind, exc)
                return ExecResult("refused", f"cannot re-read node: {exc}")
        landed = self._landed_attempt(attempts, fresh)
        if landed is not None:  # an earlier attempt's write is in Slurm after all: never write it twice
            return self.adopt(landed, fresh, "Slurm shows this write", mode=mode)
        refusal = still_safe(decision, fresh, self.ledger_view())
        if refusal is not None:
            _log.info("%s: %s not applied: %s", decision.node, decision.kind, refusal.reason)
            return ExecResult("refused", refusal.reason)
        try:
            argv = self.argv_for(decision)
        except ValueError as exc:
            return ExecResult("refused", f"invalid call: {exc}")
        if self.dry_run:
            self._print_once(series, argv)
            return ExecResult("dry-run", "", None, tuple(argv))
        if decision_id is None:
            decision_id = self.ledger.record_decision(
                node=decision.node, kind=decision.kind, tier=f"T{decision.tier}", mode=mode, reason=decision.reason,
                outcome="allowed", incident_id=self._incident_int(decision), at=now).id
        self._timeline(self._incident_int(decision), "decided_at", decision.decided_at or now)
        partition = fresh.partitions[0] if fresh.partitions else None
        action = self.ledger.plan_action(
            decision_id=decision_id, idempotency_key=idempotency_key(decision, attempt), series=series, attempt=attempt,
            node=decision.node, kind=decision.kind, argv=argv, partition=partition,
            reason=decision.reason if decision.kind in NODE_STATE_KINDS else None,
            evidence={"decision": decision.id, "attempt": attempt}, at=now)
        if action.status != "planned":  # planned by another path meanwhile
            return ExecResult("skipped", f"action {action.id} is {action.status}", action.id, action.argv)
        return self._run(action, decision.kind, mode)

    @staticmethod
    def _settled(why: str, settled: Action | None) -> ExecResult:
        assert settled is not None
        status = "already-applied" if settled.status == "applied" else "skipped"
        return ExecResult(status, why, settled.id, settled.argv)

    def settled(self, outcome: GateResult) -> ExecResult | None:
        """What apply() would answer from the ledger alone (nothing to write: applied before, or
        skipped); None when it would read the node and write."""
        decision = outcome.decision
        if outcome.status != "allowed" or not decision.acts:
            return ExecResult("skipped", f"outcome {outcome.label}")
        attempt, why, settled = next_attempt(self.ledger.series(idempotency_key(decision)))
        return self._settled(why, settled) if attempt is None else None

    def _landed_attempt(self, attempts: list[Action], fresh: NodeInfo) -> Action | None:
        """The latest failed or abandoned node-state attempt whose write Slurm shows."""
        for a in reversed(attempts):
            if a.status in ("failed", "abandoned") and a.kind in NODE_STATE_KINDS and a.reason \
                    and shows_write(fresh, a.reason, a.kind, a.planned_at):
                return a
        return None

    def _run(self, action: Action, kind: str, mode: str) -> ExecResult:
        decision = self.ledger.decision(action.decision_id)
        incident_id = decision.incident_id if decision is not None else None
        call = Decision(id=action.series, kind=kind, node=action.node, reason=action.reason or "",  # type: ignore[arg-type]
                        tier=1)
        try:
            detail = self._call(call)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            _log.warning("%s: %s failed: %s", action.node, " ".join(action.argv), msg)
            return ExecResult("failed", msg, action.id, action.argv)
        done_at = self.clock()
        if kind in NODE_STATE_KINDS and self.read_back:
            self._record_write(action, detail, done_at)
        else:  # a node-state write's hold stays unconfirmed until the fleet view's next read shows it
            self.ledger.mark_applied(action.id, detail, at=done_at)
        if kind in NODE_STATE_KINDS and self.on_write is not None:
            self.on_write(action.node)
        self._timeline(incident_id, "action_applied_at", done_at)
        _log.info("%s: applied %s: %s", action.node, " ".join(action.argv), detail)
        if kind == "drain-and-requeue":
            detail += f"; {self.requeue_opted_in(self.ledger.action(action.id) or action, mode)}"
        return ExecResult("applied", detail, action.id, action.argv)

    def _record_write(self, action: Action, detail: str, at: float) -> None:
        """Mark a node-state write applied with the proof of ownership Slurm shows for it: the reason
        time and user read back right after the write. A read that fails leaves the hold unconfirmed
        (the reconciler confirms it); a node someone else changed in between is not healthd's."""
        try:
            info: NodeInfo | None = self.read_node(action.node)
        except SlurmError as exc:
            _log.warning("%s: cannot read the node back after the write (confirmed later): %s", action.node, exc)
            info = None
        if info is None:
            self.ledger.mark_applied(action.id, detail, at=at)
        elif shows_write(info, action.reason or "", action.kind, action.planned_at):
            self.ledger.mark_applied(action.id, detail, at=at, reason_time=info.reason_time,
                                     reason_user=info.reason_user)
        else:
            self.ledger.mark_applied(action.id, detail, at=at, hold=False)
            self.ledger.mark_ended(action.id, "released",
                                   f"changed by someone else right after the write: {describe_reason(info)}", at=at)
            _log.warning("%s: changed right after healthd's write (%s); not healthd's", action.node,
                         describe_reason(info))

    def adopt(self, action: Action, fresh: NodeInfo, why: str, *, mode: str) -> ExecResult:
        """An attempt whose write Slurm shows although its client failed, or which a restart abandoned:
        mark it applied at the time Slurm recorded it, with its ownership proof, once."""
        was = f"was {action.status}: {action.outcome or '-'}"
        if action.kind in NODE_STATE_KINDS:
            at = fresh.reason_time if fresh.reason_time is not None else self.clock()
            outcome = f"adopted: {why} ({describe_reason(fresh)}; {was})"
            self.ledger.mark_applied(action.id, outcome[:500], at=at, reason_time=fresh.reason_time,
                                     reason_user=fresh.reason_user)
        else:
            at = self.clock()
            outcome = f"adopted: {why} ({was})"
            self.ledger.mark_applied(action.id, outcome[:500], at=at)
        decision = self.ledger.decision(action.decision_id)
        self._timeline(decision.incident_id if decision else None, "action_applied_at", at)
        _log.warning("%s: action %s (%s) adopted: %s", action.node, action.id, action.kind, outcome)
        detail = outcome
        if action.kind == "drain-and-requeue":
            detail += f"; {self.requeue_opted_in(self.ledger.action(action.id) or action, mode)}"
        return ExecResult("already-applied", detail, action.id, action.argv)

    # -- requeue: the second half of a drain-and-requeue, one action per job ------------------------

    def requeue_opted_in(self, drain: Action, mode: str) -> str:
        """Requeue the opted-in batch jobs still running on the node `drain` took out of service,
        each an action of its own (key `<drain key>:requeue:<job>`, attempts like any series). A job
        still running there after its requeue was applied means Slurm lost the requeue: that attempt
        is marked lost and the job requeued again. Nothing in observe mode."""
        if not self.requeue_opt_in:
            return "requeue disabled"
        if mode == "observe":
            return "observe mode: no requeue"
        try:
            jobs = [j for j in self.list_jobs(drain.node) if j.batch and self.requeue_opt_in in j.comment]
        except SlurmError as exc:
            _log.warning("%s: cannot list jobs for the requeue (tried again next round): %s", drain.node, exc)
            return f"requeue waits: cannot list jobs: {error_text(exc)}"
        done, waiting = [], []
        for job in jobs:
            result = self._requeue_job(drain, job)
            (done if result.status == "applied" else waiting).append(f"{job.job_id}" + (
                "" if result.status == "applied" else f" ({result.detail})"))
        if not jobs:
            return "no opted-in job running"
        text = f"requeued {', '.join(done)}" if done else ""
        if waiting:
            text += ("; " if text else "") + f"not requeued: {', '.join(waiting)}"
        return text

    def _requeue_job(self, drain: Action, job: JobInfo) -> ExecResult:
        series = f"{drain.series}:requeue:{job.job_id}"
        attempts = self.ledger.series(series)
        if attempts and attempts[-1].status == "applied":
            # still running here after a requeue that was applied: Slurm lost it (restored state)
            self.ledger.mark_ended(attempts[-1].id, "lost", f"job {job.job_id} still running on {drain.node} "
                                   f"(restarts {job.restarts}) after its requeue", at=self.clock())
            _log.warning("%s: requeue of job %s was lost by Slurm; requeueing again", drain.node, job.job_id)
            attempts = self.ledger.series(series)
        attempt, why, settled = next_attempt(attempts)
        if attempt is None:
            return ExecResult("skipped", why, settled.id if settled else None)
        return self._requeue(job, series, attempt, what="opted-in job",
                             plan={"decision_id": drain.decision_id, "node": drain.node, "partition": drain.partition},
                             evidence={"drain": drain.id})

    def requeue_hung(self, job: JobInfo, series: str, node: str, decision_id: int,
                     evidence: dict[str, Any]) -> ExecResult:
        """Requeue a job whose training hung (healthd.controller.inband), once for its series
        (`requeue-hang:<job>:<step>`): attempts like any series, so a requeue that failed is tried
        again and one a crash left planned is the reconciler's (adopted when the job's restart
        count shows it landed, otherwise abandoned and tried again here)."""
        attempt, why, settled = next_attempt(self.ledger.series(series))
        if attempt is None:
            status = "already-applied" if settled is not None and settled.status == "applied" else "skipped"
            return ExecResult(status, why, settled.id if settled else None)
        return self._requeue(job, series, attempt, what="hung job", plan={"decision_id": decision_id, "node": node},
                             evidence=evidence)

    def _requeue(self, job: Any, series: str, attempt: int, *, what: str, plan: dict[str, Any],
                 evidence: dict[str, Any]) -> ExecResult:
        """One attempt of a requeue series: planned in the ledger, made once, marked applied or failed."""
        try:
            argv = self.backend.describe("requeue", job_id=job.job_id)
        except ValueError as exc:
            return ExecResult("refused", f"invalid job id: {exc}")
        if self.dry_run:
            self._print_once(series, argv)
            return ExecResult("dry-run", "", None, tuple(argv))
        action = self.ledger.plan_action(
            **plan, idempotency_key=series if attempt == 1 else f"{series}#try{attempt}", series=series,
            attempt=attempt, kind="requeue", argv=argv,
            evidence={**evidence, "job": job.job_id, "restarts": job.restarts, "attempt": attempt})
        if action.status != "planned":
            return ExecResult("skipped", f"action {action.id} is {action.status}", action.id, action.argv)
        node = plan["node"]
        try:
            self.backend.requeue(job.job_id)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            _log.warning("%s: requeue of %s %s failed: %s", node, what, job.job_id, msg)
            return ExecResult("failed", msg, action.id, action.argv)
        self.ledger.mark_applied(action.id, f"requeued {what} {job.job_id}", at=self.clock())
        _log.info("%s: requeued %s %s", node, what, job.job_id)
        return ExecResult("applied", f"requeued {job.job_id}", action.id, action.argv)

    # -- operator undo (planned by healthctl through admin.undo) --------------------------------------

    def run_undos(self, now: float) -> list[ExecResult]:
        """Run the reversals `healthctl undo` planned (key `undo:<action id>`): re-read the node, check
        the node is still healthd's by record, make the call once, mark it applied and the original
        undone, and close the incident as a false positive."""
        return [self._undo(a, now) for a in self.ledger.pending_actions() if a.idempotency_key.startswith(UNDO_PREFIX)]

    def _undo(self, action: Action, now: float) -> ExecResult:
        try:
            original = self.ledger.action(int(action.idempotency_key[len(UNDO_PREFIX):]))
        except ValueError:
            original = None
        try:
            fresh = self.read_node(action.node)
        except SlurmError as exc:
            return ExecResult("skipped", f"cannot re-read the node: {exc}", action.id, action.argv)

        def finish(detail: str) -> ExecResult:
            self.ledger.mark_applied(action.id, detail, at=self.clock())
            if original is not None and original.status == "applied":
                self.ledger.mark_undone(original.id, f"undone by action {action.id}", at=self.clock())
            decision = self.ledger.decision(action.decision_id)
            if decision is not None and decision.incident_id is not None:
                why = (decision.evidence or {}).get("why") if isinstance(decision.evidence, dict) else None
                operator = (decision.evidence or {}).get("operator") if isinstance(decision.evidence, dict) else None
                self.ledger.close_incident(decision.incident_id, "false_positive", by=operator,
                                           why=str(why or f"undone by action {action.id}"))
            _log.info("%s: undo (action %s): %s", action.node, action.id, detail)
            return ExecResult("applied", detail, action.id, action.argv)

        hold = self.ledger.hold(action.node)
        ours = original is not None and hold is not None and hold.action_id == original.id and owned(hold, fresh)
        if action.kind == "resume":
            done = not fresh.drain_requested and not fresh.resumable
        elif action.kind == "cancel-reboot":
            done = not fresh.reboot_requested
        else:
            self.ledger.mark_failed(action.id, f"unknown undo kind {action.kind!r}", at=self.clock())
            return ExecResult("failed", f"unknown undo kind {action.kind!r}", action.id, action.argv)
        if done:
            return finish("Slurm already shows it undone")
        if not ours:
            msg = f"not undone: {action.node} is no longer healthd's by record ({describe_reason(fresh)})"
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            return ExecResult("refused", msg, action.id, action.argv)
        if self.dry_run:
            self._print_once(action.idempotency_key, action.argv)
            return ExecResult("dry-run", "", action.id, action.argv)
        try:
            if action.kind == "resume":
                self.backend.resume(action.node)
            else:
                self.backend.cancel_reboot(action.node)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            return ExecResult("failed", msg, action.id, action.argv)
        return finish("resumed" if action.kind == "resume" else "reboot cancelled")
