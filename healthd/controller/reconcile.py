"""The reconciler: the ledger and Slurm agree, always.

A Slurm write can land although its client reported failure (a timeout, slurmctld stopped mid-call),
can be lost after it was applied (slurmctld killed right after it comes back from an older state
save), and the node it took can be taken over by someone else (an administrator re-drains or resumes
it). At start and in every control round, for every write the ledger says may be in force or may
have landed, the reconciler compares the ledger with what Slurm shows and converges:

- planned (a crash between plan and write): adopted if Slurm shows it, else abandoned. An old plan is
  never applied blindly; the next round re-decides from current evidence, through every gate.
- failed or abandoned within the landing window: adopted if Slurm shows it landed after all.
- held (applied node-state writes, healthd.controller.ownership): in force -> verified (and
  confirmed with its reason time and user when the read-back after the write failed); changed by
  someone else -> released (the incident is handed over, its evidence episode cleared); gone with
  slurmctld restarted since it was last seen -> lost (the next round re-applies it through the
  gates, a new attempt under the same incident); a requested reboot that happened -> completed
  (the incident resolved, evidence before it cleared).
- drain-and-requeue holds on a node still running opted-in jobs: the requeue is finished, once per
  job (a requeue Slurm lost is done again).

Cost per round: the held nodes are compared with the fleet view the round already read (no extra
Slurm call); only a mismatch is re-read (at most `max_rereads` nodes per round), slurmctld's start
time is read only when a held write is gone, jobs are listed only on held nodes still running jobs,
and verification times are written at most every `verify_every_s`, only those that moved since.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from healthd.controller.executor import UNDO_PREFIX, Executor
from healthd.controller.ledger import Action
from healthd.controller.ownership import CLOCK_SKEW_S, NODE_STATE_KINDS, Hold, describe_reason, owned, shows_write
from healthd.slurm.backend import NodeInfo, SlurmError
from healthd.text import stamp

_log = logging.getLogger("healthd.controller.reconcile")

LANDING_WINDOW_S = 900.0
"""How long after its client failed a write is still looked for in Slurm (a request queued in a
stopped slurmctld's socket is processed when it continues)."""
MAX_REREADS = 8
"""Nodes re-read from Slurm per round to confirm a mismatch before acting on it."""
VERIFY_EVERY_S = 60.0
"""How often the time each hold was last seen in force is written to the ledger."""


@dataclass(frozen=True)
class Change:
    """One thing the reconciler changed in the ledger (or did in Slurm, for a requeue)."""

    node: str
    action_id: int
    what: str
    """adopted | abandoned | confirmed | released | lost | completed | requeue"""
    detail: str


def judge_gone(hold: Hold, info: NodeInfo, ctld_started_at: float | None) -> tuple[str, str]:
    """Why Slurm no longer shows a held write (pure): ('released' | 'lost' | 'completed', detail).

    Someone else's reason on the node, or healthd's text with another time or user: released.
    No reason: a requested reboot that happened (the node booted after the request) is completed; a
    write gone with slurmctld restarted after it was last seen was lost (a restart from an older
    state save); otherwise someone resumed or undrained the node: released."""
    if info.reason:
        return "released", f"now {describe_reason(info)}"
    if hold.kind == "reboot-asap" and info.boot_time is not None and info.boot_time >= hold.since - CLOCK_SKEW_S:
        return "completed", f"the node booted at {stamp(info.boot_time)}, after the reboot request"
    # BOOT_TIME is to the second: a restart in the second the write was last seen reads as before it
    if ctld_started_at is not None and ctld_started_at >= hold.verified_at - CLOCK_SKEW_S / 60:
        return "lost", (f"slurmctld restarted at {stamp(ctld_started_at)}, after the write was last seen "
                        f"({stamp(hold.verified_at)}), and came back without it (state {info.state})")
    started = f"slurmctld up since {stamp(ctld_started_at)}" if ctld_started_at is not None else \
        "slurmctld's start time unknown"
    return "released", (f"cleared by someone else (state {info.state}, no reason; {started}, the write last "
                        f"seen {stamp(hold.verified_at)})")


class Reconciler:
    """Keeps the ledger true to Slurm. Called by the controller under its round lock."""

    def __init__(self, executor: Executor, *, landing_window_s: float = LANDING_WINDOW_S,
                 max_rereads: int = MAX_REREADS, verify_every_s: float = VERIFY_EVERY_S):
        self.executor = executor
        self.ledger = executor.ledger
        self.backend = executor.backend
        self.landing_window_s = landing_window_s
        self.max_rereads = max_rereads
        self.verify_every_s = verify_every_s
        self._seen: dict[str, float] = {}
        """node -> when its hold was last seen in force (written to the ledger lazily)."""
        self._written: dict[str, float] = {}
        """node -> the time of `_seen` the ledger holds already (a flush writes only what moved)."""
        self._flushed_at = 0.0

    # -- entry points --------------------------------------------------------------------------------

    def at_start(self, now: float, mode: str) -> list[Change]:
        """Before the first round: settle what a crash left planned (a few writes at most), reading each
        node concerned once. Holds are checked by the first round, against the fleet it reads."""
        return self._pass(None, now, mode, (self._planned, self._unresolved))

    def round(self, nodes: Mapping[str, NodeInfo], now: float, mode: str, *, read_at: float | None = None) -> list[Change]:
        """One reconciliation pass against `nodes`, the fleet view the round read (at `read_at`, when
        it was read before the round began). Never raises for one node's trouble: that node waits
        for the next round."""
        return self._pass(nodes, now, mode, (self._planned, self._unresolved, self._holds), read_at)

    def _pass(self, nodes: Mapping[str, NodeInfo] | None, now: float, mode: str, steps,
              read_at: float | None = None) -> list[Change]:
        budget = _Budget(self.max_rereads)
        changes: list[Change] = []
        view = _View(self.executor.read_node, nodes, budget, read_at)
        for step in steps:
            try:
                changes.extend(step(view, now, mode))
            except Exception:  # one step failing must not stop the others or the round
                _log.exception("reconcile: %s failed", step.__name__)
        self._flush(now)
        for c in changes:
            log = _log.info if c.what in ("confirmed", "requeue") else _log.warning
            log("%s: action %s %s: %s", c.node, c.action_id, c.what, c.detail)
        return changes

    # -- planned: what a crash left between plan and write ---------------------------------------------

    def _planned(self, view: _View, now: float, mode: str) -> list[Change]:
        out = []
        for action in self.ledger.pending_actions():
            if action.idempotency_key.startswith(UNDO_PREFIX):
                continue  # an operator's undo: Executor.undo makes it, with its own checks
            info = view.fresh(action.node)
            if info is None:
                continue  # Slurm unreachable: settled next round, before anything is decided on it
            try:
                landed = self._landed(action, info)
            except _Unreadable:
                continue
            if landed:
                self.executor.adopt(action, info, "planned before a restart; Slurm shows the write", mode=mode)
                out.append(Change(action.node, action.id, "adopted", "planned before a restart; Slurm shows it"))
                continue
            detail = ("planned before a restart and not in Slurm: not applied blindly; the next round "
                      "re-decides from current evidence through every gate")
            self.ledger.mark_abandoned(action.id, detail, at=now)
            out.append(Change(action.node, action.id, "abandoned", detail))
        return out

    def _landed(self, action: Action, info: NodeInfo) -> bool:
        if action.kind in NODE_STATE_KINDS and action.reason:
            return shows_write(info, action.reason, action.kind, action.planned_at)
        if action.kind == "resume":
            hold = self.ledger.hold(action.node)
            return not info.resumable and not owned(hold, info)
        if action.kind in ("spare-reserve", "spare-release"):  # a spare's reservation: there or gone
            evidence = action.evidence if isinstance(action.evidence, dict) else {}
            try:
                exists = self.executor.backend.reservation_exists(str(evidence.get("reservation")))
            except (SlurmError, ValueError) as exc:
                _log.warning("reconcile: cannot read reservation %s (next round): %s", evidence.get("reservation"), exc)
                raise _Unreadable from exc
            return exists == (action.kind == "spare-reserve")
        if action.kind == "requeue":
            # Slurm counts a job's requeues: more than when it was planned means the requeue landed
            evidence = action.evidence if isinstance(action.evidence, dict) else {}
            try:
                job = self.executor.read_job(str(evidence.get("job")))
            except SlurmError as exc:
                _log.warning("reconcile: cannot read job %s (next round): %s", evidence.get("job"), exc)
                raise _Unreadable from exc
            return job is not None and job.restarts > int(evidence.get("restarts", 0))
        return False

    # -- failed or abandoned writes that may still land --------------------------------------------------

    def _unresolved(self, view: _View, now: float, mode: str) -> list[Change]:
        out = []
        for action in self.ledger.unresolved_since(now - self.landing_window_s):
            if action.kind not in NODE_STATE_KINDS or not action.reason:
                continue
            later = [a for a in self.ledger.series(action.series) if a.attempt > action.attempt]
            if any(a.status in ("applied", "planned") for a in later):
                continue  # a later attempt settled it (its hold pass sees a late landing)
            info = view.cached(action.node)
            if info is None or not shows_write(info, action.reason, action.kind, action.planned_at):
                continue
            info = view.fresh(action.node)  # act on a fresh read only
            if info is None or not shows_write(info, action.reason, action.kind, action.planned_at):
                continue
            result = self.executor.adopt(action, info, "the write landed after its client reported failure",
                                         mode=mode)
            out.append(Change(action.node, action.id, "adopted", result.detail))
        return out

    # -- holds ----------------------------------------------------------------------------------------

    def _holds(self, view: _View, now: float, mode: str) -> list[Change]:
        out = []
        ctld_started: list[float | None] = []  # read once per round, only when a held write is gone
        undoing = {a.idempotency_key for a in self.ledger.pending_actions() if a.idempotency_key.startswith(UNDO_PREFIX)}
        # what the view shows was true when it was read, which can be before the round by a refresh
        # period: a hold seen in a view read before slurmctld was killed and restored from an older
        # state save was not seen after the restart, and its write is lost, not released
        seen_at = now if view.read_at is None else min(now, view.read_at)
        holds = self.ledger.holds()
        for node in [n for n in self._seen if n not in holds]:  # a hold ended by a resume or a hand-over
            del self._seen[node]
            self._written.pop(node, None)
        for node, hold in holds.items():
            if not hold.confirmed and view.read_at is not None and hold.planned_at > view.read_at:
                continue  # written after the view was read: confirmed by the next read, not re-read now
            info = view.cached(node)
            if info is None or f"{UNDO_PREFIX}{hold.action_id}" in undoing:
                continue  # not readable now, or an operator's undo of it is under way (Executor.undo)
            if owned(hold, info):
                if not hold.confirmed:
                    self.ledger.confirm_hold(node, hold.action_id, info.reason_time, info.reason_user, at=seen_at)
                    out.append(Change(node, hold.action_id, "confirmed", describe_reason(info)))
                self._seen[node] = max(seen_at, self._seen.get(node, 0.0))
                if hold.kind == "drain-and-requeue" and info.draining and mode != "observe":
                    out.extend(self._finish_requeue(hold))
                continue
            info = view.fresh(node)
            if info is None or owned(hold, info):
                continue  # unreadable now, or the cached view was stale: next round
            late = self._late_landing(hold, info)
            if late is not None:
                self.ledger.confirm_hold(node, hold.action_id, info.reason_time, info.reason_user, at=now)
                out.append(Change(node, hold.action_id, "confirmed",
                                  f"a later write of healthd's own (action {late.id}) landed: {describe_reason(info)}"))
                continue
            if not ctld_started:
                try:
                    ctld_started.append(self.backend.ctld_started_at())
                except SlurmError as exc:
                    _log.warning("reconcile: cannot read slurmctld's start time (next round): %s", exc)
                    return out
            seen = max(hold.verified_at, self._seen.get(node, 0.0))
            verdict, detail = judge_gone(replace(hold, verified_at=seen), info, ctld_started[0])
            out.append(self._end(hold, verdict, detail, now))
        return out

    def _late_landing(self, hold: Hold, info: NodeInfo) -> Action | None:
        """A write of healthd's own that explains the node's changed reason time: an attempt of the
        hold's series that failed or was abandoned (its client may have outlived it) and shows now."""
        action = self.ledger.action(hold.action_id)
        if action is None or info.reason != hold.reason:
            return None
        for a in self.ledger.series(action.series):
            if a.status in ("failed", "abandoned") and a.reason == info.reason and \
                    shows_write(info, a.reason, a.kind, a.planned_at):
                return a
        return None

    def _end(self, hold: Hold, verdict: str, detail: str, now: float) -> Change:
        self.ledger.mark_ended(hold.action_id, verdict, detail, at=now)
        self._seen.pop(hold.node, None)
        self._written.pop(hold.node, None)
        if hold.incident_id is not None:
            incident = self.ledger.incident(hold.incident_id)
            if verdict == "released" and incident is not None and incident.status in ("open", "validation-failed",
                                                                                     "recurred"):
                self.ledger.close_incident(hold.incident_id, "handed-over", by=None,
                                           why=f"{hold.node} taken over: {detail}"[:500], at=now)
            elif verdict == "completed" and incident is not None and incident.status == "open":
                self.ledger.mark_timeline(hold.incident_id, "back_in_service_at", now)
                self.ledger.add_clears(hold.node, [incident.signature], before=now, scope="evidence",
                                       incident_id=hold.incident_id, why="reboot completed", at=now)
                self.ledger.update_incident(hold.incident_id, status="resolved")
        return Change(hold.node, hold.action_id, verdict, detail)

    def _finish_requeue(self, hold: Hold) -> list[Change]:
        action = self.ledger.action(hold.action_id)
        if action is None:
            return []
        before = {a.id for a in self.ledger.actions(node=hold.node) if a.kind == "requeue"}
        detail = self.executor.requeue_opted_in(action, mode="auto")
        made = [a for a in self.ledger.actions(node=hold.node) if a.kind == "requeue" and a.id not in before]
        return [Change(hold.node, a.id, "requeue", detail) for a in made]

    def _flush(self, now: float) -> None:
        if not self._seen or now - self._flushed_at < self.verify_every_s:
            return
        # a hold not seen again since the last flush would be written with the time it has already
        moved = {n: t for n, t in self._seen.items() if self._written.get(n, float("-inf")) < t}
        try:
            self.ledger.verify_holds(moved)
            self._written.update(moved)
            self._flushed_at = now
        except Exception as exc:  # bookkeeping: a busy ledger waits for the next flush
            _log.warning("reconcile: cannot record verification times: %s", exc)


class _Unreadable(Exception):
    """Slurm could not be asked whether a write landed: the action waits for the next round."""


class _Budget:
    def __init__(self, n: int):
        self.left = n


class _View:
    """The round's fleet view, with fresh single-node reads (bounded) where a decision needs one."""

    def __init__(self, read_node, nodes: Mapping[str, NodeInfo] | None, budget: _Budget, read_at: float | None = None):
        self.read_node = read_node
        self.read_at = read_at
        self.nodes = nodes
        self.budget = budget
        self._fresh: dict[str, NodeInfo | None] = {}

    def cached(self, node: str) -> NodeInfo | None:
        if self.nodes is None:
            return self.fresh(node)
        return self._fresh.get(node) or self.nodes.get(node)

    def fresh(self, node: str) -> NodeInfo | None:
        if node in self._fresh:
            return self._fresh[node]
        if self.nodes is not None:  # at start (no fleet view) every node concerned is read
            if self.budget.left <= 0:
                return None
            self.budget.left -= 1
        try:
            info: NodeInfo | None = self.read_node(node)
        except (SlurmError, ValueError) as exc:
            _log.warning("reconcile: cannot read %s (next round): %s", node, exc)
            info = None
        self._fresh[node] = info
        return info
