"""The real controller behind healthd-sim's seam (healthd.sim.seam.Remediation).

`ControllerSeam` runs healthd.sim.fleet.SimController (the real agent classification and the real
control round: reconcile, decide, gates, executor, a real SQLite ledger) against
healthd.sim.slurm.SimSlurm on the engine's virtual clock. The engine tells it each fault's agent input
and the job's life (started on which nodes, requeued); what healthd did is read back from Slurm's node
states: a node drained or down is out of service, and goes to repair. Nothing here decides what a
fault means.

How a fault reaches healthd: a kernel line through the node's real agent (`report`), an NVML reading
likewise; a host fault takes the node down in SimSlurm and silences its agent; a straggler or a hang
becomes the job's in-band rings on the fault's node and one other node of the job (healthd.sim.rings),
which their agents read. Input the simulated agent cannot read yet (an InfiniBand port reading)
reaches nothing, so such a fault is found by Slurm or by nobody. Rounds run when a fault appears,
when the job is known dead, when a node comes back, and at the controller's own deadlines
(`next_deadline`) up to each of those. A
person closes an open breaker at the first round `healthd.operator_minutes` after it opened (the
ledger's own reset, as `healthctl breaker reset` makes it). The agents load the catalog of the
scenario's `healthd.catalog` section. With `healthd.approve_minutes`, a person approves each decision
that waits for approval that long after the ledger recorded it (`healthctl approve`'s own handler, with
a round then), and the job, known dead while its fault's nodes wait on one, waits for it; the same
person records the repair of a node healthd holds when it comes back (`healthctl repaired`'s handler).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable, Sequence

import yaml

from healthd.controller import admin, spares
from healthd.controller.config import parse_controller_settings
from healthd.sim.agentinput import GpuReading, JobEnded, KernelLines, NvmlReading, catalog_of
from healthd.sim.faults import Fault
from healthd.sim.fleet import RoundResult, SimController
from healthd.sim.job import T0
from healthd.sim.rings import JobRings
from healthd.sim.scenario import Scenario
from healthd.sim.seam import Decision, Tally
from healthd.sim.slurm import SimSlurm
from healthd.slurm.backend import SlurmRefused, StepResult

JOB_ID = "1"
OUT_OF_SERVICE = frozenset({"DRAIN", "NOT_RESPONDING", "RESERVED", "REBOOT_REQUESTED", "REBOOT_ISSUED"})
"""A node with any of these flags takes no job of ours (drained, silent, in healthd's validation
reservation, rebooting)."""
SPARE_KINDS = frozenset(spares.KINDS)
"""The hot-spare step's writes (reserve, release, revalidate)."""
MAX_CATCH_UP = 10_000
"""Rounds at the controller's deadlines between two engine events, at most (a guard, never reached in
the shipped scenarios)."""


def _validation_passes(node: str, argv: list[str], timeout_s: float) -> StepResult:
    return StepResult(0, "validation passed (simulated)")


class ControllerSeam:
    """healthd's real controller in `scenario.healthd.mode` for one run."""

    def __init__(self, scenario: Scenario, fleet: Sequence[str], job_nodes: Sequence[str],
                 leaf_of: Callable[[str], str], seed: int = 0):
        mode = scenario.healthd.mode
        raw = dict(scenario.healthd.settings)
        policy = raw.get("policy") or {}
        raw["policy"] = {**(policy if isinstance(policy, dict) else {}), "mode": mode}
        self.settings = parse_controller_settings(yaml.safe_dump(raw), f"{scenario.name}: healthd.settings")
        self.name = f"controller ({mode})"
        self._t = T0
        self.slurm = SimSlurm(list(fleet), clock=self._clock, topology={n: leaf_of(n) for n in fleet})
        self.slurm.step = _validation_passes
        self.sim = SimController(self.settings, self.slurm, self._clock, topology_text=self.slurm.topology_conf(),
                                 gpus_per_node=scenario.job.gpus_per_node,
                                 catalog=catalog_of(scenario.healthd.catalog) if scenario.healthd.catalog else None)
        self._tally = Tally()
        self._seen: set[int] = set()
        self._would: set[tuple[str, str, str]] = set()
        self._in_service: set[str] = set()
        self._work: dict[str, str] = {}
        """node -> the id of another user's job running on it."""
        self.operator_s = None if scenario.healthd.operator_minutes is None else scenario.healthd.operator_minutes * 60
        self.approve_s = None if scenario.healthd.approve_minutes is None else scenario.healthd.approve_minutes * 60
        self._approvals: list[tuple[float, int, str]] = []
        """(when a person approves it, decision id, node): waiting decisions, earliest first."""
        self.slurm.start_job(JOB_ID, list(job_nodes), requeue_ok=True)
        self._job_nodes = tuple(job_nodes)
        self._breaker = self.sim.ledger.breaker_state()
        """The breaker as the latest round left it."""
        self.rings = JobRings(JOB_ID, scenario.job.gpus_per_node, scenario.job.step_seconds, seed, tuple(job_nodes), T0)
        """The job's in-band rings on the nodes a straggler or a hang is reported from."""
        self._restart_s = scenario.job.restart_minutes * 60
        # only something that takes idle nodes (healthd's spare pool, other users' jobs) can tell
        self._hold_waiting = scenario.job.hold_while_waiting and bool(
            self.settings.policy.spares or scenario.fleet.other_work_hours is not None)
        self._holder: str | None = None
        """While the job waits holding its allocation (the lab's model), a job of ours on the nodes it
        keeps, so that Slurm shows them allocated, as it would, and nothing else takes them."""

    def _clock(self) -> float:
        return self._t

    def _round(self, t: float) -> None:
        self._hold()  # a node failure ended the job's run in Slurm: what it keeps stays allocated
        for _ in range(MAX_CATCH_UP):
            d = self._next_deadline()
            if d is None or d >= t:
                break
            self._step(d)
        self._step(t)

    def _step(self, t: float) -> None:
        """One round at `t`, after what people and the agents' rings do by then."""
        self._t = max(self._t, t)
        self._approve_due()
        self._read_rings()
        self._reset_due()
        self._count(self.sim.round(self._t))
        self._breaker = self.sim.ledger.breaker_state()  # only a round or a reset changes it
        self._hold()

    def _reset_at(self) -> float | None:
        """When the person who investigates an open breaker closes it (None: not open, or nobody)."""
        breaker = self._breaker
        if not breaker.open or self.operator_s is None or breaker.opened_at is None:
            return None
        return breaker.opened_at + self.operator_s

    def _reset_due(self) -> None:
        """The breaker's reset, when due by now: at its own time (a round runs then), as `healthctl
        breaker reset` makes it, so a failure that starts later is new to the breaker."""
        at = self._reset_at()
        if at is not None and self._t >= at:
            self.sim.ledger.reset_breaker(by="operator", why="simulated: investigated", at=at)
            self._tally.taken["breaker-reset"] += 1

    def _hold(self) -> None:
        if not self._hold_waiting or self._holder is not None:
            return
        job = self.slurm.job(JOB_ID)
        if job is not None and job.state == "RUNNING":
            return
        kept = [n for n in self._job_nodes if self.usable(n) and self.slurm.node(n).state == "idle"]
        if kept:
            self._holder = self.slurm.start_job(None, kept, requeue_ok=True)

    def _count(self, r: RoundResult) -> None:
        for o in r.applied:
            self._tally.taken[o.kind] += 1
        for o in r.would_do:
            # observe mode proposes the same write every round until the fault clears: count it once
            if (o.node, o.kind, o.incident) not in self._would:
                self._would.add((o.node, o.kind, o.incident))
                self._tally.would[o.kind] += 1
        # a refusal is recorded once in the ledger, however many rounds repeat it
        for d in r.recorded:
            if d.outcome in ("refused", "waiting") and d.kind != "none" and d.id not in self._seen:
                self._seen.add(d.id)
                if d.outcome == "waiting" and self.approve_s is not None:
                    heapq.heappush(self._approvals, (d.decided_at + self.approve_s, d.id, d.node))
                gate = d.refused_gate or ("mode" if d.outcome == "waiting" else d.outcome)
                if d.kind in SPARE_KINDS and gate == "mode" and d.mode == "observe":
                    # the spare step's writes are not among the round's outcomes: recorded only, by kind
                    self._tally.would[d.kind] += 1
                    continue
                # a removal no validated spare could serve: policy's answer, not a refusal of a write
                self._tally.refused["no spare in place" if d.kind == "spare-release" and gate == "policy" else gate] += 1

    def _next_deadline(self) -> float | None:
        """The controller's next deadline, or the next read of the watched nodes' rings, a person's next
        approval or breaker reset if sooner."""
        times = (self.sim.next_deadline(), self.rings.next_at, self._approvals[0][0] if self._approvals else None,
                 self._reset_at())
        return min((d for d in times if d is not None), default=None)

    def _approve_due(self) -> None:
        """The approvals due by now, each through healthctl approve's own handler on the run's ledger
        (one the round no longer waits on, its incident closed or superseded, is refused there and
        changes nothing)."""
        while self._approvals and self._approvals[0][0] <= self._t:
            _, decision, _ = heapq.heappop(self._approvals)
            if admin.approve(self.sim.ledger, decision, "operator", "simulated: approved").ok:
                self._tally.taken["approval"] += 1

    def usable(self, node: str) -> bool:
        info = self.slurm.node(node)
        return info.state != "down" and not (OUT_OF_SERVICE & info.flags)

    def fault(self, now: float, fault: Fault) -> None:
        t = T0 + now
        self._t = max(self._t, t)
        # what was already out of service (in repair, drained before) is not this fault's doing
        self._in_service = {n for n in fault.nodes if self.usable(n)}
        for i in fault.inputs:
            if i.kind == "kernel" and i.line is not None:
                self.sim.report(i.node, [KernelLines((i.line,))], t)
            elif i.kind == "nvml":
                self.sim.report(i.node, [NvmlReading(gpus=(GpuReading(i.gpu or 0, dict(i.fields)),))], t)
            elif i.kind == "host_down":
                self.slurm.node_down(i.node)
                self.sim.silence(i.node)
            elif i.kind == "ring":
                for node in self.rings.fault(t, str(i.fields.get("ring")), i.node, i.gpu or 0, i.fields):
                    if node not in self.sim.silent:
                        self.sim.report(node, [self.rings.ranks(node)], t)
        self._round(t)

    def _read_rings(self) -> None:
        """The watched nodes' agents read their rings when a tick is due, until the controller's
        in-band view has found what they were watched for."""
        view = self.sim.controller.inband_round
        self.rings.found((f.node for f in view.flags), bool(view.hangs), view.evaluated_at)
        for node in self.rings.due(self._t):
            if node not in self.sim.silent:
                self.sim.report(node, [self.rings.ranks(node)], self._t)

    def detected(self, now: float, fault: Fault, in_job: Sequence[str]) -> Decision:
        t = T0 + now
        self._round(t)
        # the job waits for a person's approval of a removal its fault's nodes wait on: the wait is decision time
        decided = now
        for _ in range(MAX_CATCH_UP):
            pending = [at for at, _, node in self._approvals if node in self._in_service]
            if not pending:
                break
            t = max(t, min(pending))
            self._round(t)
            decided = t - T0
        job = self.slurm.job(JOB_ID)
        if job is not None and job.state == "RUNNING":
            self.slurm.requeue(JOB_ID)  # the job's own restart (its launcher, or the user)
            self._hold()
        for node in self.rings.run_ended():  # the epilog: the run's rings go
            if node not in self.sim.silent:
                self.sim.report(node, [JobEnded(JOB_ID)], t)
        candidates = (*(n for n in fault.nodes if n in self._in_service), *in_job)
        removed = tuple(n for n in dict.fromkeys(candidates) if not self.usable(n))
        wrong = tuple(n for n in removed if (n not in fault.nodes or not fault.cause.repair)
                      and not self.rings.straggling(n))
        return Decision(removed, decided, false_positive=bool(wrong))

    def job_started(self, now: float, nodes: Sequence[str]) -> None:
        self._t = max(self._t, T0 + now)
        if self._holder is not None:
            held = self.slurm.job(self._holder)
            if held is not None and held.state in ("RUNNING", "PENDING"):
                self.slurm.end_job(self._holder, "CANCELLED")
            self._holder = None
        self._job_nodes = tuple(nodes)
        self.rings.run_started(T0 + now + self._restart_s, nodes)
        try:
            self.slurm.start_job(JOB_ID, list(nodes), requeue_ok=True)
        except SlurmRefused:
            # a node healthd took out between the engine's choice and the start: the next fault or
            # round shows it; the job model keeps the nodes it chose
            self._tally.slurm_refused += 1

    def operator_drain(self, now: float, node: str) -> None:
        self._t = max(self._t, T0 + now)
        self.slurm.drain(node, "operator: kept failing the job")
        self._tally.taken["operator-drain"] += 1

    def repaired(self, now: float, node: str) -> bool:
        t = T0 + now
        self._t = max(self._t, t)
        if self.slurm.node(node).state == "down":
            self.slurm.node_up(node)
        if (self.slurm.node(node).reason or "").startswith("operator:"):
            self.slurm.resume(node)  # the person who drained it returns it after the repair
        self.rings.repaired(node)
        self.sim.reboot(node, t)
        self._round(t)
        if (self.approve_s is not None and self.sim.ledger.hold(node) is not None
                and self.sim.ledger.active_reintegration(node) is None):
            # the person who approves also records the repair of a node healthd holds (`healthctl
            # repaired`): outside auto mode no reintegration starts by itself
            if admin.repaired(self.sim.ledger, node, "operator", "simulated: repaired").ok:
                self._tally.taken["repaired"] += 1
            self._round(t)
        return self.usable(node)

    def poll(self, now: float) -> float | None:
        """Rounds due by `now`; the engine's time of the next deadline (None: none)."""
        self._round(T0 + now)
        d = self._next_deadline()
        return None if d is None else d - T0

    def work_started(self, now: float, node: str) -> bool:
        self._t = max(self._t, T0 + now)
        try:
            self._work[node] = self.slurm.start_job(None, [node], requeue_ok=False)
        except SlurmRefused:
            return False
        return True

    def work_ended(self, now: float, node: str) -> None:
        self._t = max(self._t, T0 + now)
        job = self._work.pop(node, None)
        if job is not None and (info := self.slurm.job(job)) is not None and info.state == "RUNNING":
            self.slurm.end_job(job)

    def tally(self) -> Tally:
        # the spare step's writes are not among the round's policy outcomes: read them from the ledger
        done = Counter(a.kind for a in self.sim.ledger.actions(status="applied") if a.kind in SPARE_KINDS)
        return dataclasses.replace(self._tally, taken=self._tally.taken + done)

    def close(self) -> None:
        self.sim.close()
