"""Apply allowed Decisions to Slurm, exactly once, with the ledger as the write-ahead log.

For each allowed decision: re-read the node, repeat the ownership check (`gates.still_safe`), plan the
action in the ledger under an idempotency key (decision id + incident) with the exact argv the backend
describes, make the call, then mark the action applied or failed with Slurm's message. A crash
between plan and call leaves a `planned` row; `recover()` at start finishes it: marked applied when
Slurm already shows it done, else re-checked and applied once.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from healthd.controller.gates import Outcome, Refusal, still_safe
from healthd.controller.ledger import Action, Ledger
from healthd.controller.policy import Decision, LedgerView
from healthd.slurm.backend import NodeInfo, SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller.executor")

UNDO_PREFIX = "undo:"
"""Idempotency-key prefix of reversals planned by `healthctl undo` (healthd.controller.admin)."""
SAFE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"
JobLister = Callable[[str], list["JobInfo"]]


@dataclass(frozen=True)
class JobInfo:
    """A job running on a node, as far as requeue opt-in needs it."""

    job_id: str
    batch: bool
    comment: str


@dataclass(frozen=True)
class ExecResult:
    """What `Executor.apply` did with one outcome."""

    status: str
    """applied | failed | refused | skipped | dry-run | already-applied"""
    detail: str = ""
    action_id: int | None = None
    argv: tuple[str, ...] = ()


def squeue_jobs(node: str, slurm_conf: str | None = None, timeout_s: float = 10.0,
                squeue: str | None = None) -> list[JobInfo]:
    """Running jobs on `node` from squeue (job id, batch flag, comment), run with SLURM_CONF set to
    `slurm_conf` (a client without it may look for a configless server in DNS). Empty when squeue is
    missing."""
    exe = squeue or shutil.which("squeue", path=SAFE_PATH)
    if exe is None:
        return []
    # the batch flag (sbatch, not salloc/srun) is only in --Format; fields padded, '|' ends the first two
    argv = [exe, "--noheader", f"--nodelist={node}", "--states=RUNNING", "--Format=JobID:40|,BatchFlag:4|,Comment:1000"]
    try:
        env = {"PATH": SAFE_PATH, "LANG": "C"}
        if slurm_conf:
            env["SLURM_CONF"] = slurm_conf
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"squeue failed: {exc}", argv) from None
    if done.returncode != 0:
        raise SlurmError(f"squeue failed: {done.stderr.strip()}", argv, done.returncode, done.stderr)
    out = []
    for line in done.stdout.splitlines():
        parts = line.split("|", 2)
        if len(parts) != 3 or not parts[0].strip():
            continue
        out.append(JobInfo(parts[0].strip(), parts[1].strip() == "1", parts[2].strip()))
    return out


MAX_ATTEMPTS = 3
"""Tries of one decision for one incident: a write Slurm refused or that failed (slurmctld restarting,
a state race) is tried again on later rounds, each attempt its own ledger row, then left to a human."""


def idempotency_key(decision: Decision, attempt: int = 1) -> str:
    key = f"{decision.id}#{decision.incident}"
    return key if attempt == 1 else f"{key}#try{attempt}"


def _tier(value: Any) -> int:
    try:
        return int(str(value).lstrip("Tt"))
    except ValueError:
        return 3


def _done_in_slurm(kind: str, reason: str, info: NodeInfo) -> bool:
    """Slurm already shows the action: our reason with the drain/reboot flag, or resumed."""
    if kind in ("drain", "drain-and-requeue"):
        return info.drain_requested and info.reason == reason
    if kind == "reboot-asap":
        return (info.reboot_requested or info.drain_requested) and info.reason == reason
    if kind == "resume":
        return not info.resumable and not info.reason.startswith("healthd:")
    return False


class Executor:
    """Applies allowed outcomes to Slurm through `backend`, recording every step in `ledger`."""

    def __init__(self, backend: SlurmBackend, ledger: Ledger, dry_run: bool = False, *,
                 requeue_opt_in: str = "healthd:requeue", list_jobs: JobLister | None = None,
                 slurm_conf: str | None = None,
                 out: Callable[[str], None] | None = None):
        self.backend = backend
        self.ledger = ledger
        self.dry_run = dry_run
        self.requeue_opt_in = requeue_opt_in
        self.list_jobs = list_jobs or (lambda node: squeue_jobs(node, slurm_conf))
        self.out = out or (lambda line: print(line, flush=True))
        self._printed: set[str] = set()

    # -- views ---------------------------------------------------------------------------------------

    def ledger_view(self) -> LedgerView:
        drains = {n: "" if i is None else str(i) for n, i in self.ledger.healthd_drains().items()}
        return LedgerView(healthd_drains=drains)

    def argv_for(self, decision: Decision) -> list[str]:
        if decision.kind in ("drain", "drain-and-requeue"):
            return self.backend.describe("drain", nodes=decision.node, reason=decision.reason)
        if decision.kind == "reboot-asap":
            return self.backend.describe("reboot_asap", nodes=decision.node, reason=decision.reason)
        if decision.kind == "resume":
            return self.backend.describe("resume", nodes=decision.node)
        raise ValueError(f"decision kind {decision.kind!r} has no Slurm call")

    def _call(self, decision: Decision) -> str:
        """Make the Slurm write(s); returns a one-line outcome. Raises SlurmError."""
        node = decision.node
        if decision.kind == "drain":
            self.backend.drain(node, decision.reason)
            return "drained"
        if decision.kind == "drain-and-requeue":
            self.backend.drain(node, decision.reason)
            return f"drained; {self._requeue(node)}"
        if decision.kind == "reboot-asap":
            self.backend.reboot_asap(node, decision.reason)
            return "reboot ASAP requested (nextstate=RESUME)"
        if decision.kind == "resume":
            self.backend.resume(node)
            return "resumed"
        raise ValueError(f"decision kind {decision.kind!r} has no Slurm call")

    def _requeue(self, node: str) -> str:
        """Requeue the opted-in batch jobs still running on `node` (a job already requeued is no
        longer running there, so a second pass after a crash requeues nothing twice)."""
        if not self.requeue_opt_in:
            return "requeue disabled"
        jobs = [j for j in self.list_jobs(node) if j.batch and self.requeue_opt_in in j.comment]
        requeued = []
        for job in jobs:
            try:
                self.backend.requeue(job.job_id)
                requeued.append(job.job_id)
            except SlurmError as exc:
                _log.warning("requeue of job %s on %s failed: %s", job.job_id, node, exc)
        return f"requeued {', '.join(requeued) or 'no opted-in job'}"

    def applied(self, decision: Decision) -> Action | None:
        """The action that applied `decision` for its incident (any attempt), if one did."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            action = self.ledger.action_by_key(idempotency_key(decision, attempt))
            if action is None or action.status == "applied":
                return action
        return None

    def _incident_int(self, decision: Decision) -> int | None:
        return int(decision.incident) if decision.incident.isdigit() else None

    def _timeline(self, decision: Decision, stage: str, at: float) -> None:
        iid = self._incident_int(decision)
        if iid is None:
            return
        try:
            self.ledger.mark_timeline(iid, stage, at)
        except Exception as exc:  # the timeline is bookkeeping; never fail an action on it
            _log.warning("incident %s: cannot set %s: %s", iid, stage, exc)

    # -- apply ---------------------------------------------------------------------------------------

    def apply(self, outcome: Outcome, now: float, *, decision_id: int | None = None,
              mode: str = "auto") -> ExecResult:
        """Apply one allowed outcome (anything else is skipped). `decision_id` is the ledger row the
        caller recorded; when None, the executor records the decision as allowed itself."""
        decision = outcome.decision
        if outcome.status != "allowed" or not decision.acts:
            return ExecResult("skipped", f"outcome {outcome.label}")
        try:
            fresh = self.backend.node(decision.node)
        except SlurmError as exc:
            _log.warning("%s: cannot re-read the node before %s: %s", decision.node, decision.kind, exc)
            return ExecResult("refused", f"cannot re-read node: {exc}")
        refusal = still_safe(decision, fresh, self.ledger_view())
        if refusal is not None:
            _log.info("%s: %s not applied: %s", decision.node, decision.kind, refusal.reason)
            return ExecResult("refused", refusal.reason)
        try:
            argv = self.argv_for(decision)
        except ValueError as exc:
            return ExecResult("refused", f"invalid call: {exc}")
        if self.dry_run:
            key = idempotency_key(decision)
            if key not in self._printed:  # once per decision and incident, not every round
                self._printed.add(key)
                self.out("dry-run: would run: " + " ".join(argv))
            return ExecResult("dry-run", "", None, tuple(argv))
        if decision_id is None:
            decision_id = self.ledger.record_decision(
                node=decision.node, kind=decision.kind, tier=f"T{decision.tier}", mode=mode, reason=decision.reason,
                outcome="allowed", incident_id=self._incident_int(decision), at=now).id
        self._timeline(decision, "decided_at", decision.decided_at or now)
        partition = fresh.partitions[0] if fresh.partitions else None
        attempt = 1
        while True:
            action = self.ledger.plan_action(decision_id=decision_id, idempotency_key=idempotency_key(decision, attempt),
                                             node=decision.node, kind=decision.kind, argv=argv, partition=partition,
                                             evidence={"decision": decision.id, "attempt": attempt}, at=now)
            if action.status != "failed" or attempt >= MAX_ATTEMPTS:
                break
            attempt += 1  # the previous attempt failed: this round tries again, under a new key
        if action.status != "planned":
            return ExecResult("already-applied" if action.status == "applied" else "skipped",
                              f"action {action.id} is {action.status}" + (
                                  f" after {attempt} attempts" if action.status == "failed" else ""),
                              action.id, action.argv)
        return self._run(action, decision, now)

    def _run(self, action: Action, decision: Decision, now: float) -> ExecResult:
        try:
            detail = self._call(decision)
        except (SlurmError, ValueError) as exc:
            msg = getattr(exc, "stderr", "") or str(exc)
            msg = " ".join(str(msg).split())[:500] or type(exc).__name__
            self.ledger.mark_failed(action.id, msg, at=now)
            _log.warning("%s: %s failed: %s", decision.node, " ".join(action.argv), msg)
            return ExecResult("failed", msg, action.id, action.argv)
        self.ledger.mark_applied(action.id, detail, at=now)
        self._timeline(decision, "action_applied_at", now)
        _log.info("%s: applied %s: %s", decision.node, " ".join(action.argv), detail)
        return ExecResult("applied", detail, action.id, action.argv)

    # -- operator undo (planned by healthctl through admin.undo) --------------------------------------

    def run_undos(self, now: float) -> list[ExecResult]:
        """Run the reversals `healthctl undo` planned (key `undo:<action id>`): re-read the node, check
        the drain is still healthd's, make the call once, mark it applied and the original undone."""
        return [self._undo(a, now) for a in self.ledger.pending_actions() if a.idempotency_key.startswith(UNDO_PREFIX)]

    def _undo(self, action: Action, now: float) -> ExecResult:
        try:
            original = self.ledger.action(int(action.idempotency_key[len(UNDO_PREFIX):]))
        except ValueError:
            original = None
        try:
            fresh = self.backend.node(action.node)
        except SlurmError as exc:
            return ExecResult("skipped", f"cannot re-read the node: {exc}", action.id, action.argv)

        def finish(detail: str) -> ExecResult:
            self.ledger.mark_applied(action.id, detail, at=now)
            if original is not None and original.status == "applied":
                self.ledger.mark_undone(original.id, f"undone by action {action.id}", at=now)
            _log.info("%s: undo (action %s): %s", action.node, action.id, detail)
            return ExecResult("applied", detail, action.id, action.argv)

        if action.kind == "resume":
            done = not fresh.drain_requested and not fresh.resumable
        elif action.kind == "cancel-reboot":
            done = not fresh.reboot_requested
        else:
            self.ledger.mark_failed(action.id, f"unknown undo kind {action.kind!r}", at=now)
            return ExecResult("failed", f"unknown undo kind {action.kind!r}", action.id, action.argv)
        if done:
            return finish("Slurm already shows it undone")
        if not fresh.reason.startswith("healthd:") or action.node not in self.ledger.healthd_drains():
            who = f"{fresh.reason[:80]!r} by {fresh.reason_user or 'someone else'}" if fresh.reason else "no reason"
            msg = f"not undone: {action.node}'s reason is no longer healthd's ({who})"
            self.ledger.mark_failed(action.id, msg, at=now)
            return ExecResult("refused", msg, action.id, action.argv)
        if self.dry_run:
            if action.idempotency_key not in self._printed:
                self._printed.add(action.idempotency_key)
                self.out("dry-run: would run: " + " ".join(action.argv))
            return ExecResult("dry-run", "", action.id, action.argv)
        try:
            if action.kind == "resume":
                self.backend.resume(action.node)
            else:
                self.backend.cancel_reboot(action.node)
        except (SlurmError, ValueError) as exc:
            msg = " ".join(str(getattr(exc, "stderr", "") or exc).split())[:500] or type(exc).__name__
            self.ledger.mark_failed(action.id, msg, at=now)
            return ExecResult("failed", msg, action.id, action.argv)
        return finish("resumed" if action.kind == "resume" else "reboot cancelled")

    # -- recovery ------------------------------------------------------------------------------------

    def recover(self, now: float) -> list[ExecResult]:
        """Finish what a crash left `planned`: mark applied when Slurm already shows it, otherwise
        re-check ownership and apply it once (or mark it failed with the refusal)."""
        results = []
        for action in self.ledger.pending_actions():
            if action.idempotency_key.startswith(UNDO_PREFIX):
                results.append(self._undo(action, now))
                continue
            row = self.ledger.decision(action.decision_id)
            reason = row.reason if row is not None else ""
            decision = Decision(
                id=action.idempotency_key.split("#", 1)[0], kind=action.kind,  # type: ignore[arg-type]
                node=action.node, reason=reason, tier=_tier(row.tier if row else 3),
                incident=str(row.incident_id) if row is not None and row.incident_id is not None else "",
                decided_at=row.decided_at if row is not None else now,
            )
            try:
                fresh = self.backend.node(action.node)
            except SlurmError as exc:
                _log.warning("recover: action %s on %s left planned: cannot read the node: %s",
                             action.id, action.node, exc)
                results.append(ExecResult("skipped", str(exc), action.id, action.argv))
                continue
            if _done_in_slurm(action.kind, reason, fresh):
                detail = "found applied in Slurm at recovery"
                if action.kind == "drain-and-requeue" and not self.dry_run:
                    # the crash may have come between the drain and the requeue: finish the second half
                    try:
                        detail += f"; {self._requeue(action.node)}"
                    except SlurmError as exc:
                        detail += f"; requeue failed: {exc}"
                self.ledger.mark_applied(action.id, detail, at=now)
                self._timeline(decision, "action_applied_at", now)
                results.append(ExecResult("already-applied", "Slurm shows it done", action.id, action.argv))
                continue
            breaker = self.ledger.breaker_state()
            if breaker.open or (breaker.reset_at is not None and decision.decided_at < breaker.reset_at):
                why = "the circuit breaker is open" if breaker.open else "decided before the breaker reset (stale)"
                self.ledger.mark_failed(action.id, f"not applied at recovery: {why}", at=now)
                results.append(ExecResult("refused", why, action.id, action.argv))
                continue
            refusal: Refusal | None = still_safe(decision, fresh, self.ledger_view())
            if refusal is not None:
                self.ledger.mark_failed(action.id, f"not applied at recovery: {refusal.reason}", at=now)
                results.append(ExecResult("refused", refusal.reason, action.id, action.argv))
                continue
            if self.dry_run:
                if action.idempotency_key not in self._printed:
                    self._printed.add(action.idempotency_key)
                    self.out("dry-run: would run: " + " ".join(action.argv))
                results.append(ExecResult("dry-run", "", action.id, action.argv))
                continue
            results.append(self._run(action, decision, now))
        return results
