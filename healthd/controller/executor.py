"""The act step: apply an allowed Decision to Slurm, exactly once, with the ledger as the write-ahead log.

`Executor.apply` is the one place a decision becomes a write, whoever proposed it (policy, the hang
responder, the reintegrator): where its series of attempts stands (one series per decision and
incident), a re-read of what it changes (the node, the job), the adoption of an earlier attempt Slurm
shows landed (its client reported failure, or it was abandoned at a restart while its client still
ran), the ownership check on that read (`gates.still_safe`), the decision recorded and the attempt
planned under its idempotency key with the exact argv the backend describes, the one backend call the
action table (healthd.controller.actions) names, and a read-back that marks the action applied with
the reason time and user Slurm recorded (healthd's hold on the node, healthd.controller.ownership), or
failed with Slurm's message. A drain-and-requeue then requeues the opted-in jobs, each its own action.
An operator's undo, planned by the admin socket, is carried out by `undo`.

What a crash or a lost write leaves behind is the reconciler's (healthd.controller.reconcile): it never
applies an old plan blindly; the next round re-decides from current evidence through every gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from healthd.controller.actions import (
    ACTIONS,
    MAX_ATTEMPTS,
    MAX_LOST,
    Decision,
    next_attempt,
    series_key,
)
from healthd.controller.gates import GateResult, Refusal, still_safe
from healthd.controller.ledger import Action, Ledger
from healthd.controller.ownership import NODE_STATE_KINDS, describe_reason, owned, shows_write
from healthd.controller.policy import LedgerView
from healthd.slurm.backend import JobInfo, NodeInfo, SlurmBackend, SlurmError, SlurmRefused

__all__ = ["MAX_ATTEMPTS", "MAX_LOST", "UNDO_PREFIX", "ExecResult", "Executor", "JobInfo", "error_text",
           "idempotency_key", "next_attempt"]

_log = logging.getLogger("healthd.controller.executor")

UNDO_PREFIX = "undo:"
"""Idempotency-key prefix of reversals planned by `healthctl undo` (healthd.controller.admin)."""
UNDO_KINDS = {a.records: kind for kind, a in ACTIONS.items() if kind.startswith("undo")}
"""The ledger action kind an undo was planned as -> its kind in the action table."""
JobLister = Callable[[str], list[JobInfo]]
JobReader = Callable[[str], "JobInfo | None"]
RESERVATION_USERS = ("root",)
RESERVATION_FLAGS = ("MAINT", "IGNORE_JOBS")
"""Only root's validation runs in a reintegration's reservation, whatever jobs the node had."""

idempotency_key = series_key


@dataclass(frozen=True)
class ExecResult:
    """What `Executor.apply` did with one outcome."""

    status: str
    """applied | failed | refused | skipped | dry-run | already-applied"""
    detail: str = ""
    action_id: int | None = None
    argv: tuple[str, ...] = ()


def error_text(exc: BaseException) -> str:
    """One line, at most 500 characters, of what Slurm (or the validation) said."""
    msg = getattr(exc, "stderr", "") or str(exc)
    return " ".join(str(msg).split())[:500] or type(exc).__name__


def call_args(decision: Decision) -> tuple[str, dict[str, Any]]:
    """The backend call the action table names for the decision's kind, and its arguments (the same
    for the call and for its `describe()`). ValueError for a kind that writes nothing."""
    call = ACTIONS[decision.kind].call
    if call in ("drain", "reboot_asap"):
        return call, {"nodes": decision.node, "reason": decision.reason}
    if call in ("resume", "cancel_reboot"):
        return call, {"nodes": decision.node}
    if call == "requeue":
        return call, {"job_id": decision.target}
    if call == "create_reservation":
        return call, {"name": decision.target, "nodes": decision.node,
                      "duration_min": int(decision.detail.get("minutes", 0)), "users": RESERVATION_USERS,
                      "flags": RESERVATION_FLAGS}
    if call == "delete_reservation":
        return call, {"name": decision.target}
    raise ValueError(f"decision kind {decision.kind!r} has no Slurm call")


_DONE = {"drain": "drained", "reboot_asap": "reboot ASAP requested (nextstate=RESUME)", "resume": "resumed",
         "cancel_reboot": "reboot cancelled", "requeue": "requeued job {target}",
         "create_reservation": "reservation {target} created", "delete_reservation": "reservation {target} deleted"}


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
        self.on_unreadable: Callable[[str, str], None] | None = None
        """Told (node, why) when the read right before a write failed: the controller's fleet view is
        not acted on until it reads Slurm again."""
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

    def running_job(self, node: str, job_id: str) -> JobInfo | None:
        """The job as running on `node` now, or None (raises SlurmError)."""
        return next((j for j in self.list_jobs(node) if j.job_id == job_id), None)

    def ledger_view(self) -> LedgerView:
        return LedgerView(holds=self.ledger.holds())

    def argv_for(self, decision: Decision) -> list[str]:
        """The exact call the decision's write makes (ValueError for a kind that writes nothing)."""
        call, args = call_args(decision)
        return self.backend.describe(call, **args)

    def _write(self, decision: Decision) -> str:
        """The one backend call the action table names for the decision; a one-line outcome. Raises
        SlurmError (a reservation that exists already is created)."""
        call, args = call_args(decision)
        try:
            getattr(self.backend, call)(**args)
        except SlurmRefused as exc:
            if call != "create_reservation" or "Duplicate reservation name" not in f"{exc.stderr} {exc}":
                raise
            return f"reservation {decision.target} exists already"
        return _DONE[call].format(target=decision.target)

    def applied(self, decision: Decision) -> Action | None:
        """The action that applied `decision` for its incident (any attempt), if one did."""
        return next((a for a in self.ledger.series(series_key(decision)) if a.status == "applied"), None)

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

    # -- the act step --------------------------------------------------------------------------------

    def apply(self, outcome: GateResult, now: float, *, mode: str = "auto",
              record: Callable[[], int] | None = None) -> ExecResult:
        """Apply one allowed outcome (anything else is skipped), in order:

        1. where the decision's series of attempts stands: applied before, or left to a human, is
           answered from the ledger alone;
        2. the re-read of what the write changes (the node, the job); a read that fails is told to
           `on_unreadable` and leaves the decision unrecorded: nothing stale is acted on;
        3. the decision recorded (`record` returns its ledger row; by default it is recorded here as
           allowed), before anything is written;
        4. an earlier attempt Slurm shows landed is adopted, never written twice;
        5. still safe: the ownership check on the re-read node (gates.still_safe), the job still
           running on its node;
        6. the attempt planned in the ledger with the exact argv (write-ahead), or printed in a dry run;
        7. the one backend call the action table names for the kind;
        8. the action marked failed with Slurm's message, or applied with the proof of ownership read
           back for a hold;
        9. what the table says follows it (a drain-and-requeue's requeues)."""
        decision = outcome.decision
        if outcome.status != "allowed" or not decision.acts:
            return ExecResult("skipped", f"outcome {outcome.label}")
        action = ACTIONS[decision.kind]

        def recorded() -> int:
            if record is not None:
                return record()
            return self.ledger.record_decision(
                node=decision.node, kind=decision.recorded_kind, tier=f"T{decision.tier}", mode=mode,
                reason=decision.reason, outcome="allowed", incident_id=self._incident_int(decision),
                evidence={"decision": decision.id, **decision.detail}, at=now).id

        # 1. the series
        series = series_key(decision)
        attempts = self.ledger.series(series) if action.records else []
        attempt, why, settled = next_attempt(attempts)
        if attempt is None:
            if record is not None:  # the round records what it allowed, applied before or not
                record()
            return ExecResult("already-applied" if settled.status == "applied" else "skipped", why, settled.id,
                              settled.argv)
        # 2. the re-read
        fresh: NodeInfo | None = None
        job: JobInfo | None = None
        try:
            if action.changes_node:
                fresh = self.read_node(decision.node)
            elif action.target == "job":
                job = self.running_job(decision.node, decision.target)
        except SlurmError as exc:
            _log.warning("%s: cannot re-read before %s: %s", decision.node, decision.kind, exc)
            if self.on_unreadable is not None:
                self.on_unreadable(decision.node, f"cannot re-read {decision.node} before {decision.kind}: {exc}")
            return ExecResult("refused", f"cannot re-read node: {exc}")
        # 3. the decision, recorded before any write
        decision_id = recorded()
        # 4. an earlier attempt that landed after all
        if fresh is not None:
            landed = self._landed_attempt(attempts, fresh)
            if landed is not None:
                return self.adopt(landed, fresh, "Slurm shows this write", mode=mode)
        # 5. still safe
        refusal = still_safe(decision, fresh, self.ledger_view()) if fresh is not None else \
            self._job_refusal(decision, job) if action.target == "job" else None
        if refusal is not None:
            _log.info("%s: %s not applied: %s", decision.node, decision.kind, refusal.reason)
            return ExecResult("refused", refusal.reason)
        # 6. planned (write-ahead), or printed
        try:
            # the exact argv is the ledger's record of a write; a reservation has none (its reintegration
            # records it), and the backend checks its arguments as it makes the call
            argv = self.argv_for(decision) if action.records or self.dry_run else [str(action.call), decision.target]
        except ValueError as exc:
            return ExecResult("refused", f"invalid call: {exc}")
        if self.dry_run:
            self._print_once(series, argv)
            return ExecResult("dry-run", "", None, tuple(argv))
        incident_id = self._incident_int(decision)
        self._timeline(incident_id, "decided_at", decision.decided_at or now)
        planned: Action | None = None
        if action.records:
            evidence: dict[str, Any] = {"decision": decision.id, "attempt": attempt, **decision.detail}
            if job is not None:
                evidence.update(job=job.job_id, restarts=job.restarts)
            planned = self.ledger.plan_action(
                decision_id=decision_id, idempotency_key=series_key(decision, attempt), series=series,
                attempt=attempt, node=decision.node, kind=action.records, argv=argv,
                partition=fresh.partitions[0] if fresh is not None and fresh.partitions else None,
                reason=decision.reason if action.records in NODE_STATE_KINDS else None, evidence=evidence, at=now)
            if planned.status != "planned":  # planned by another path meanwhile
                return ExecResult("skipped", f"action {planned.id} is {planned.status}", planned.id, planned.argv)
        # 7. the write
        try:
            detail = self._write(decision)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            if planned is not None:
                self.ledger.mark_failed(planned.id, msg, at=self.clock())
            _log.warning("%s: %s failed: %s", decision.node, " ".join(argv), msg)
            return ExecResult("failed", msg, planned.id if planned else None, tuple(argv))
        # 8. applied, with its proof
        done_at = self.clock()
        if planned is not None and action.holds and self.read_back:
            self._record_write(planned, detail, done_at)
        elif planned is not None:  # a hold stays unconfirmed until the fleet view's next read shows it
            self.ledger.mark_applied(planned.id, detail, at=done_at)
        if action.changes_node and self.on_write is not None:
            self.on_write(decision.node)
        if planned is not None:
            self._timeline(incident_id, "action_applied_at", done_at)
        _log.info("%s: applied %s: %s", decision.node, " ".join(argv), detail)
        # 9. what follows
        if planned is not None and decision.kind == "drain-and-requeue":
            detail += f"; {self.requeue_opted_in(self.ledger.action(planned.id) or planned, mode)}"
        return ExecResult("applied", detail, planned.id if planned else None, tuple(argv))

    def _job_refusal(self, decision: Decision, job: JobInfo | None) -> Refusal | None:
        """A job's requeue is safe while the job runs on its node as an opted-in batch job: Slurm
        requeues a finished batch job too, and a job whose records outlived it must never run again."""
        if job is None:
            return Refusal("ownership", f"job {decision.target} is no longer running on {decision.node}")
        if not job.batch or not self.requeue_opt_in or self.requeue_opt_in not in job.comment:
            return Refusal("ownership", f"job {decision.target} is not an opted-in batch job")
        return None

    def _landed_attempt(self, attempts: list[Action], fresh: NodeInfo) -> Action | None:
        """The latest failed or abandoned node-state attempt whose write Slurm shows."""
        for a in reversed(attempts):
            if a.status in ("failed", "abandoned") and a.kind in NODE_STATE_KINDS and a.reason \
                    and shows_write(fresh, a.reason, a.kind, a.planned_at):
                return a
        return None

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
        """One attempt of the requeue series of one job of a drain-and-requeue: planned in the ledger,
        made once (the action table's `requeue`, passed with the drain), marked applied or failed."""
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
        requeue = Decision(id=series, kind="requeue", node=drain.node, reason="", tier=1, target=job.job_id,
                           series=series)
        try:
            argv = self.argv_for(requeue)
        except ValueError as exc:
            return ExecResult("refused", f"invalid job id: {exc}")
        if self.dry_run:
            self._print_once(series, argv)
            return ExecResult("dry-run", "", None, tuple(argv))
        action = self.ledger.plan_action(
            decision_id=drain.decision_id, node=drain.node, partition=drain.partition,
            idempotency_key=series_key(requeue, attempt), series=series, attempt=attempt, kind="requeue", argv=argv,
            evidence={"drain": drain.id, "job": job.job_id, "restarts": job.restarts, "attempt": attempt})
        if action.status != "planned":
            return ExecResult("skipped", f"action {action.id} is {action.status}", action.id, action.argv)
        try:
            self._write(requeue)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            _log.warning("%s: requeue of opted-in job %s failed: %s", drain.node, job.job_id, msg)
            return ExecResult("failed", msg, action.id, action.argv)
        self.ledger.mark_applied(action.id, f"requeued opted-in job {job.job_id}", at=self.clock())
        _log.info("%s: requeued opted-in job %s", drain.node, job.job_id)
        return ExecResult("applied", f"requeued {job.job_id}", action.id, action.argv)

    # -- operator undo (planned by healthctl through admin.undo, proposed by the round) ---------------

    def undo(self, outcome: GateResult, now: float) -> ExecResult:
        """Carry out one allowed undo the admin socket planned (write-ahead already): re-read the node,
        check the node is still healthd's by record for the action it undoes, make the table's call
        once, mark it applied and the original undone, and close the incident as a false positive."""
        decision = outcome.decision
        action = self.ledger.action_by_key(decision.id)
        if outcome.status != "allowed" or decision.kind not in UNDO_KINDS.values() or action is None \
                or action.status != "planned":
            return ExecResult("skipped", f"outcome {outcome.label}")
        try:
            original = self.ledger.action(int(action.idempotency_key[len(UNDO_PREFIX):]))
        except ValueError:
            original = None
        try:
            fresh = self.read_node(action.node)
        except SlurmError as exc:
            return ExecResult("skipped", f"cannot re-read the node: {exc}", action.id, action.argv)

        def finish(detail: str) -> ExecResult:
            # one transaction: a reader (or a crash) never sees the undo applied and its incident still open
            with self.ledger.transaction():
                self.ledger.mark_applied(action.id, detail, at=self.clock())
                if original is not None and original.status == "applied":
                    self.ledger.mark_undone(original.id, f"undone by action {action.id}", at=self.clock())
                row = self.ledger.decision(action.decision_id)
                if row is not None and row.incident_id is not None:
                    why = (row.evidence or {}).get("why") if isinstance(row.evidence, dict) else None
                    operator = (row.evidence or {}).get("operator") if isinstance(row.evidence, dict) else None
                    self.ledger.close_incident(row.incident_id, "false_positive", by=operator,
                                               why=str(why or f"undone by action {action.id}"))
            _log.info("%s: undo (action %s): %s", action.node, action.id, detail)
            return ExecResult("applied", detail, action.id, action.argv)

        hold = self.ledger.hold(action.node)
        ours = original is not None and hold is not None and hold.action_id == original.id and owned(hold, fresh)
        call = ACTIONS[decision.kind].call
        done = not fresh.reboot_requested if call == "cancel_reboot" else \
            not fresh.drain_requested and not fresh.resumable
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
            detail = self._write(decision)
        except (SlurmError, ValueError) as exc:
            msg = error_text(exc)
            self.ledger.mark_failed(action.id, msg, at=self.clock())
            return ExecResult("failed", msg, action.id, action.argv)
        if self.on_write is not None:
            self.on_write(action.node)
        return finish(detail)
