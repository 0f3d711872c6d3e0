"""The real controller on a virtual clock: healthd's own control round against a simulated Slurm.

`SimController(settings, slurm, clock)` is the daemon's composition root
(healthd.controller.daemon.Controller) built on the simulator's clock, a real SQLite ledger and the
given SlurmBackend (healthd.sim.slurm.SimSlurm in the simulator; any backend works). Nothing of the
policy is copied here: `round(now)` is `Controller.evaluate(now)`, the round the daemon's main loop
runs (reconcile, in-band, incidents, decide, gate, act, reintegrate, observe), and its answer is
read from what that round returned and what it recorded in the ledger.

Reports come from the agent's own code (healthd.sim.agentinput.SimAgent): `report(node, inputs, now)`
runs a node's agent on the input, and its state document, fitted by the agent's reporter step
(report_schema.fit_report, which runs the report schema's checks), is converted as the controller's
intake converts it (NodeReport.from_document; its checks run again only on a document the agent had
to trim: the same checks already passed on any other). Every node
starts with the report a real agent on a healthy node sends; an agent re-ticks every `agent_tick_s`
while it holds findings (so a finding's expiry reaches the controller as it would, at most that late),
and every live node's report is as fresh as its heartbeat (`heartbeat_s`) makes it. A node whose agent
is down (`silence`: powered off, crashed) sends nothing, so its report goes stale; `reboot` starts its
agent again on a new boot.

Time: the round, the ledger, the executor and the fleet view all read the clock given here; no
write of the round reads the wall clock (tests/sim/test_fleet.py checks every time the ledger keeps).

When to run a round (an event-driven caller): after `report` changed a node's findings, after the
simulated Slurm changed (a node down or back, a job ended), and at `next_deadline()`: the next agent
re-tick, the moment a silenced node's report goes stale, and, while the last round left something
unsettled (a refused or waiting decision, a reintegration under way, a write not yet settled),
`recheck_s` after it; the round itself keeps no timer the simulator could read without copying a
rule (the breaker closes only by an operator's reset; the rate limit's hour, the reintegration's
validation and probation are re-read by the next round). None: nothing changes until new input.

Cost of a round with nothing new (CPU time, SimSlurm, the ledger on /dev/shm, rounds 5 s apart so a
heartbeat refresh falls in every sixth; `python -m healthd.sim.fleet` measures it): 128 nodes about
0.3 ms, 1,024 nodes about 0.7 ms on a quiet 2-core VM (two or three times that when the machine is
busy). An agent tick with its report (`report`, a re-tick) costs about 0.4 ms on a node without
in-band rings, a few ms on one whose rings it reads. Building a SimController of 128 nodes: about 7 ms
of CPU. Whole runs: bench/sim.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from healthd.agent.classify.catalog import Catalog, load_catalog
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.executor import ExecResult
from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger
from healthd.controller.ledger.records import DecisionRecord
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.ownership import Hold
from healthd.controller.policy import NodeReport
from healthd.sim.agentinput import AgentInput, SimAgent
from healthd.slurm.backend import SlurmBackend

_log = logging.getLogger("healthd.sim")

INPUT_ONLY_GATES = frozenset({"mode", "breaker"})
"""Gates whose refusal no passing of time lifts: observe mode and a tier that never acts (the mode
gate), an open breaker (closed only by `healthctl breaker reset`)."""

SHM = "/dev/shm"
"""Where the ledger goes when none is named: a memory file system, so the ledger's fsync per commit
(synchronous=FULL, kept as the daemon runs it) costs next to nothing."""


@dataclass(frozen=True)
class Outcome:
    """One of policy's decisions this round and what the gates and the act step made of it."""

    node: str
    kind: str
    """The decision's kind (drain, drain-and-requeue, reboot-asap, none, ...)."""
    status: str
    """allowed | refused | waiting-approval | recorded (a `none` decision)."""
    gate: str | None
    """The refusing gate (for waiting-approval: `mode`); None when allowed or recorded."""
    reason: str
    """The gate's one line, or the decision's note for recorded."""
    slurm_reason: str
    """The Slurm reason the write sets (`healthd: ... [#incident]`)."""
    tier: int
    attribution: str
    incident: str
    evidence: tuple[str, ...]
    """The evidence behind it, primary finding first, as text."""
    applied: str | None
    """What the act step did (applied, already-applied, failed, ...); None: nothing was applied
    (not allowed, or observe mode)."""
    argv: tuple[str, ...] = ()
    """The Slurm call the act step made."""

    @classmethod
    def of(cls, outcome: GateResult, result: ExecResult | None) -> Outcome:
        d = outcome.decision
        return cls(node=d.node, kind=d.kind, status=outcome.status, gate=outcome.gate,
                   reason=outcome.reason or d.note, slurm_reason=d.reason, tier=d.tier, attribution=d.attribution,
                   incident=d.incident, evidence=tuple(e.text for e in d.evidence),
                   applied=None if result is None else result.status, argv=() if result is None else result.argv)


@dataclass(frozen=True)
class RoundResult:
    """What one round did."""

    now: float
    ran: bool
    """False: the fleet view was unusable (Slurm unreachable), nothing was decided."""
    outcomes: tuple[Outcome, ...] = ()
    """Policy's decisions this round, each with its gate outcome and what was applied."""
    recorded: tuple[DecisionRecord, ...] = ()
    """The decisions the ledger recorded this round (every proposer's; a gate outcome is recorded once,
    so a refusal repeated round after round appears in the first round only)."""
    holds: Mapping[str, Hold] = dataclasses.field(default_factory=dict)
    """node -> healthd's hold on it after the round (what the ledger says healthd took out of service)."""
    mode: str = "observe"

    @property
    def applied(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.applied in ("applied", "already-applied"))

    @property
    def refused(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.status in ("refused", "waiting-approval"))

    @property
    def would_do(self) -> tuple[Outcome, ...]:
        """What observe mode held back: the writes its mode gate refused. The mode gate runs first, so
        in observe mode no other gate is asked; what they would say is what the same input in auto
        mode shows."""
        return tuple(o for o in self.outcomes if self.mode == "observe" and o.status == "refused" and o.gate == "mode")


@functools.lru_cache(maxsize=1)
def packaged_catalog() -> Catalog:
    """The packaged Xid catalog, read once per process (it is immutable; a simulation of many runs
    would otherwise read and validate it for each)."""
    return load_catalog()


class SimController:
    """The real controller's round on a virtual clock (see the module docstring)."""

    def __init__(self, settings: ControllerSettings, slurm: SlurmBackend, clock: Callable[[], float],
                 ledger_path: str | None = None, *, topology_text: str = "", gpus_per_node: int = 8,
                 catalog: Catalog | None = None, heartbeat_s: float = 30.0, agent_tick_s: float = 300.0,
                 recheck_s: float = 300.0):
        self.clock = clock
        self._dir = tempfile.mkdtemp(prefix="healthd-sim-", dir=SHM if os.path.isdir(SHM) else None)
        path = ledger_path or os.path.join(self._dir, "ledger.sqlite")
        changes: dict[str, Any] = {"ledger": path}
        history = getattr(settings, "history", None)
        if history is not None and getattr(history, "enabled", False):
            changes["history"] = dataclasses.replace(history, enabled=False)  # a simulation keeps no replay log
        self.settings = dataclasses.replace(settings, **changes)
        self.ledger = Ledger(path)
        self.slurm = slurm
        self.controller = Controller(self.settings, self.ledger, slurm, metrics=ControllerMetrics(), clock=clock,
                                     node_addrs=dict, topology_text=topology_text)
        self.gpus = gpus_per_node
        self.catalog = catalog or packaged_catalog()
        self.heartbeat_s = heartbeat_s
        self.agent_tick_s = agent_tick_s
        self.recheck_s = recheck_s
        self.agents: dict[str, SimAgent] = {}
        self.silent: set[str] = set()
        self._ticked: dict[str, float] = {}
        """node -> when its agent last ticked (agents holding findings only)."""
        self._fresh_at = float("-inf")
        self._last_decision = 0
        self._last: RoundResult | None = None
        self._wake: float | None = None
        now = clock()
        healthy = SimAgent("template", gpus=gpus_per_node, catalog=self.catalog, run_dir=self._dir,
                           now=now).feed((), now)
        names = [n.name for n in slurm.nodes()]
        # checked once: the copies differ only in the node's name, which Slurm's own checks passed
        NodeReport.from_document({**healthy, "node": names[0] if names else "template"}, now)
        reports = {n: NodeReport.from_document({**healthy, "node": n}, now, checked=True) for n in names}
        with self.controller.reports_lock:
            self.controller.reports.update(reports)

    # -- the agents' side --------------------------------------------------------------------------

    def agent(self, node: str) -> SimAgent:
        found = self.agents.get(node)
        if found is None:
            found = self.agents[node] = SimAgent(node, gpus=self.gpus, catalog=self.catalog, run_dir=self._dir,
                                                 now=self.clock())
        return found

    def report(self, node: str, inputs: Iterable[AgentInput], now: float) -> NodeReport:
        """`inputs` on `node` at `now` through its real agent; the report the controller then holds
        (checked by the report schema as the intake checks it)."""
        doc = self.agent(node).feed(tuple(inputs), now)
        self.silent.discard(node)
        return self._store(node, self._received(node, doc, now))

    def _received(self, node: str, doc: dict[str, Any], now: float) -> NodeReport:
        """The report as the intake converts it; checked again only when the agent had to trim it (an
        untrimmed document passed the same schema's checks in the agent's fit_report)."""
        return NodeReport.from_document(doc, now, checked=not self.agents[node].trimmed)

    def _store(self, node: str, report: NodeReport) -> NodeReport:
        if self.agents[node].findings:
            self._ticked[node] = report.received_at
        else:
            self._ticked.pop(node, None)
        with self.controller.reports_lock:
            self.controller.reports[node] = report
        return report

    def silence(self, node: str) -> None:
        """`node`'s agent is down (powered off, crashed): it reports nothing until `reboot`."""
        self.silent.add(node)
        self._ticked.pop(node, None)

    def reboot(self, node: str, now: float) -> NodeReport:
        """`node` booted again (repaired, or rebooted): its agent starts on a new boot and reports."""
        self.agent(node).reboot()
        return self.report(node, (), now)

    def _heartbeats(self, now: float) -> None:
        """Agents holding findings tick again when due; every live node's report is as fresh as its
        latest heartbeat."""
        for node, at in list(self._ticked.items()):
            if now - at >= self.agent_tick_s and node not in self.silent:
                self._store(node, self._received(node, self.agents[node].feed((), now), now))
        if now - self._fresh_at < self.heartbeat_s:
            return
        with self.controller.reports_lock:
            reports = self.controller.reports
            for node, r in reports.items():
                if node not in self.silent and r.received_at < now:
                    # built directly: dataclasses.replace was most of a round's cost at 1,024 nodes
                    reports[node] = NodeReport(r.node, r.verdict, r.findings, now, r.inband)
        self._fresh_at = now

    # -- the round --------------------------------------------------------------------------------

    def round(self, now: float) -> RoundResult:
        """The daemon's round at `now` (Controller.evaluate), and what it did."""
        self._heartbeats(now)
        results = self.controller.evaluate(now)
        # the validation threads this round started: done before anything else happens, so the next
        # round finds their results whatever the threads' timing (the same seed, the same run)
        self.controller.reintegrator.settle()
        recorded = tuple(r for (i,) in self.ledger.query("SELECT id FROM decisions WHERE id > ? ORDER BY id",
                                                         (self._last_decision,))
                         if (r := self.ledger.decision(i)) is not None)
        if recorded:
            self._last_decision = recorded[-1].id
        outcomes = tuple(Outcome.of(o, r) for o, r in results or ())
        result = RoundResult(now=now, ran=results is not None, outcomes=outcomes, recorded=recorded,
                             holds=self.ledger.holds(), mode=self.controller.policy.mode)
        self._wake = self._controller_deadline(now, result)
        self._last = result
        return result

    def _controller_deadline(self, now: float, result: RoundResult) -> float | None:
        """When the round should look again without new input: a reintegration on probation at the end
        its record names; otherwise `recheck_s` from now while a write is unsettled, a reintegration is
        being validated, or a decision was refused by a gate that time can lift (the mode gate's and the
        breaker's refusals lift only by an operator's hand, which is new input)."""
        times = []
        recheck = (not result.ran or bool(self.ledger.pending_actions())
                   or any(o.status == "refused" and o.gate not in INPUT_ONLY_GATES for o in result.outcomes))
        for r in self.ledger.reintegrations(state="active"):
            if r.state == "probation" and r.probation_until is not None:
                times.append(max(now, r.probation_until) + 1.0)
            else:
                recheck = True
        if recheck:
            times.append(now + self.recheck_s)
        return min(times, default=None)

    def next_deadline(self) -> float | None:
        """The earliest virtual time a round may decide differently without new input (the module
        docstring says what counts); None: nothing will change until new input."""
        times = [at + self.agent_tick_s for node, at in self._ticked.items() if node not in self.silent]
        ttl = self.controller.policy.report_ttl_s
        with self.controller.reports_lock:
            times += [r.received_at + ttl + 1.0 for n in self.silent if (r := self.controller.reports.get(n))
                      and self._last is not None and self._last.now <= r.received_at + ttl]
        if self._wake is not None:
            times.append(self._wake)
        return min(times, default=None)

    def close(self) -> None:
        self.controller.close()
        self.ledger.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _bench(nodes: int, rounds: int = 200) -> float:
    """CPU seconds per round with nothing new on a fleet of `nodes`, rounds 5 virtual seconds apart."""
    from healthd.controller.policy import ControllerPolicySettings  # the bench only
    from healthd.sim.slurm import SimSlurm  # the bench only: the simulator's Slurm

    t = [1.8e9]
    slurm = SimSlurm([f"gpu{i:04d}" for i in range(nodes)], clock=lambda: t[0])
    sim = SimController(ControllerSettings(policy=ControllerPolicySettings(mode="auto")), slurm, lambda: t[0])
    try:
        for _ in range(5):
            t[0] += 5
            sim.round(t[0])
        started = time.process_time()
        for _ in range(rounds):
            t[0] += 5
            sim.round(t[0])
        return (time.process_time() - started) / rounds
    finally:
        sim.close()


if __name__ == "__main__":
    for n in (128, 1024):
        print(f"{n} nodes: {_bench(n) * 1000:.2f} ms of CPU per round with nothing new")
