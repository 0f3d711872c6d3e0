"""healthd-sim's discrete-event engine: one seeded run of one scenario.

A heap of (time, sequence, event) on a virtual clock (standard library `heapq`), the fleet's node
pools (in the job, spares, in repair), the job model (healthd.sim.job) and the fault clocks
(healthd.sim.faults). Random numbers come from separate streams per purpose (faults per node and
cause, detection per cause, repair per node, bursts), so two configurations run on one seed see the
same faults (common random numbers). The engine keeps no history: its state is the pools, the heap
(a handful of pending events) and the clocks; the job's event log goes to a sink, and by default is
scored by healthd.goodput (the same accounting real jobs get) and dropped.

What stands for healthd is a `Remediation` (the controller seam, healthd.sim.seam): it is told each fault's agent input
when the fault happens, asked what was done when the job knows it is dead (which nodes were taken out
of service, when the action was applied), told when a node comes back from repair, and asked for its
tally of actions taken and refused by gate. `LabRule` is the goodput lab's rule with no controller: a
cause marked `repair` takes its nodes out at detection. healthd.sim.control adapts the real
controller (healthd.sim.fleet.SimController on healthd.sim.slurm.SimSlurm) to the same seam.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from healthd import goodput
from healthd.sim.faults import Fault, FaultClocks, agent_inputs, burst_nodes, stream
from healthd.sim.seam import Decision, LabRule, Remediation
from healthd.sim.job import DETECT, RESTART, T0, WAIT, JobModel
from healthd.sim.scenario import Cause, Scenario


@dataclass(frozen=True)
class RunResult:
    """One seeded run, as healthd.goodput accounted its log."""

    scenario: str
    seed: int
    remediation: str
    goodput: float
    held_gpu_s: float
    gpu_s: Mapping[str, float]
    """Category -> GPU-seconds (healthd.goodput's categories; they sum to held_gpu_s)."""
    cost_by_cause: Mapping[str, float]
    """Cause -> interruption cost in GPU-seconds."""
    interruptions: int
    mtbi_s: float | None
    faults: tuple[tuple[float, str, tuple[str, ...]], ...]
    """(time, cause, nodes) of every interruption, when asked for (`keep_faults`); else empty."""
    taken: Mapping[str, int]
    refused: Mapping[str, int]
    would: Mapping[str, int]
    partial: tuple[str, ...] = ()
    """healthd.goodput's problems with the log (empty: the simulator's log read whole)."""
    slurm_refused: int = 0
    """Job starts Slurm refused (a node went out of service between the engine's choice and the start)."""
    other_gpu_s: float | None = None
    """GPU-seconds the pool's nodes outside the job ran other users' jobs (None: the scenario has no
    other work, `fleet.other_work_hours`)."""
    pool_gpu_s: float = 0.0
    """GPU-seconds of the whole pool over the run (its nodes x GPUs x the run's length)."""

    @property
    def fleet_goodput(self) -> float | None:
        """Of the pool's GPU time, the share that produced work: the job's productive time and the
        other users' jobs (a model: their jobs count as all productive). None without other work."""
        if self.other_gpu_s is None or not self.pool_gpu_s:
            return None
        return (self.gpu_s.get("productive", 0.0) + self.other_gpu_s) / self.pool_gpu_s


Sink = Callable[[str], None]


class Engine:
    """One run of `scenario` on `seed`. `run()` once."""

    def __init__(self, scenario: Scenario, seed: int, *, remediation: Remediation | None = None,
                 sink: Sink | None = None, keep_faults: bool = False):
        """`sink` also receives every log line; `keep_faults` keeps (time, cause, nodes) of every
        interruption in the result."""
        self.s = scenario
        self.seed = seed
        self._remediation = remediation
        self._sink = sink
        self._lines: list[str] = []
        self._keep_faults = keep_faults
        self._faults: list[tuple[float, str, tuple[str, ...]]] = []
        self.horizon = scenario.days * 86400
        self.tau = scenario.interval_seconds()
        self.ckpt = scenario.job.checkpoint_minutes * 60
        self.durable_after = scenario.job.durable_after_minutes * 60
        self.restart = scenario.job.restart_minutes * 60
        self.fleet: list[str] = []
        pool: list[str] = []
        mtbf: dict[str, float] = {}
        for g in scenario.fleet.groups:
            for _ in range(g.count):
                name = f"gpu{len(self.fleet) + 1:04d}"
                self.fleet.append(name)
                mtbf[name] = g.mtbf_hours
                if g.pool:
                    pool.append(name)
        self.pool = frozenset(pool)
        if remediation is None and scenario.healthd.mode != "none":
            from healthd.sim.control import ControllerSeam  # here: the controller's imports only where it runs

            width = scenario.fleet.leaf_size
            index = {n: i for i, n in enumerate(self.fleet)}
            remediation = ControllerSeam(scenario, self.fleet, pool[:scenario.job.nodes],
                                         lambda n: f"leaf{index[n] // width + 1:03d}", seed=seed)
        self.rem: Remediation = remediation if remediation is not None else LabRule()
        self._returning: set[str] = set()
        self._broken: dict[str, tuple[Cause, int | None]] = {}
        """Nodes a fault broke that nobody has taken out yet: they fail the job whenever it runs."""
        self._slow: dict[str, tuple[float, int]] = {}
        """Nodes a straggler fault slowed: node -> (its slow rank's compute factor, the GPU), until repaired."""
        self.operator_s = None if scenario.healthd.operator_minutes is None else scenario.healthd.operator_minutes * 60
        self._operator_drains = 0
        self._operator_due: set[str] = set()
        self._tally_recur = 0
        self._polling = False
        self.clocks = FaultClocks(scenario, seed, self.fleet, mtbf)
        self.in_job: dict[str, None] = dict.fromkeys(pool[:scenario.job.nodes])
        self.spares: set[str] = set(pool[scenario.job.nodes:])
        self.in_repair: set[str] = set()
        self.job = JobModel(scenario.job.name, scenario.job.nodes * scenario.job.gpus_per_node,
                            scenario.job.step_seconds, scenario.job.hold_while_waiting, self._write)
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._gen = 0
        self._run_start = 0.0
        self._fault: Fault | None = None
        self._incidents = 0
        self._detect_rngs: dict[str, object] = {}
        self._repair_rngs: dict[str, object] = {}
        self._burst_rng = stream(seed, "burst-nodes")
        self._work_rngs: dict[str, object] = {}
        self._work: dict[str, float] = {}
        """Nodes running another user's job: node -> when it started."""
        self._other_gpu_s = 0.0
        self._gpu_rng = stream(seed, "gpu")
        self._ran = False

    # ------------------------------------------------------------------ plumbing

    def _write(self, line: str) -> None:
        self._lines.append(line)
        if self._sink is not None:
            self._sink(line)

    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def _detect_s(self, cause: Cause) -> float:
        lo, hi = cause.detect_minutes
        if lo == hi:
            return lo * 60
        rng = self._detect_rngs.get(cause.name)
        if rng is None:
            rng = self._detect_rngs[cause.name] = stream(self.seed, "detect", cause.name)
        return rng.uniform(lo, hi) * 60  # type: ignore[attr-defined]

    def _repair_s(self, node: str, cause: Cause) -> float:
        mean = (cause.repair_hours or self.s.fleet.repair_hours) * 3600
        law = cause.repair_law or self.s.fleet.repair_law
        if law == "fixed":
            return mean
        rng = self._repair_rngs.get(node)
        if rng is None:
            rng = self._repair_rngs[node] = stream(self.seed, "repair", node)
        return rng.expovariate(1 / mean)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ other users' work

    def _settle(self) -> None:
        """Free nodes of the pool that the job is not looking for take other users' jobs."""
        if self.s.fleet.other_work_hours is None or self.job.phase in (DETECT, WAIT):
            return
        for n in sorted(self.spares):
            if n not in self._work and self.rem.usable(n) and self.rem.work_started(self.now, n):
                self._work[n] = self.now
                rng = self._work_rngs.get(n)
                if rng is None:
                    rng = self._work_rngs[n] = stream(self.seed, "other-work", n)
                self._at(self.now + rng.expovariate(1 / (self.s.fleet.other_work_hours * 3600)),  # type: ignore[attr-defined]
                         self._work_done, n)

    def _work_done(self, node: str) -> None:
        self._other_gpu_s += (self.now - self._work.pop(node)) * self.s.job.gpus_per_node
        self.rem.work_ended(self.now, node)
        self.rem.poll(self.now)  # healthd may take the free node as a hot spare
        if self.job.phase == WAIT:
            self._fill()

    # ------------------------------------------------------------------ the job's life

    def _arm(self, t: float) -> None:
        """The job computes from `t`: the next save and the next fault."""
        self._run_start = t
        gen = self._gen
        broken = sorted(n for n in self.in_job if n in self._broken)
        if broken:
            self._at(t, self._recur, gen, broken[0])
            return
        self._at(t + self.tau, self._checkpoint_start, gen)
        self._next_fault(t)

    def _next_fault(self, t: float) -> None:
        """The next fault of the job's nodes, their fault clocks having run to `t`."""
        dt, which, node, idx = self.clocks.next(self.in_job)
        if dt != float("inf"):
            self._at(t + dt, self._fault_fires, self._gen, which, node, idx)

    def _checkpoint_start(self, gen: int) -> None:
        if gen != self._gen:
            return
        step = self.job.checkpoint_start(self.now)
        self._at(self.now + self.ckpt, self._checkpoint_end, gen, step)

    def _checkpoint_end(self, gen: int, step: int) -> None:
        if gen != self._gen:
            return
        self.job.checkpoint_end(self.now)
        if self.durable_after > 0:
            self._at(self.now + self.durable_after, self._durable, gen, step)
        else:
            self.job.made_durable(self.now, step)
        self._at(self.now + self.tau, self._checkpoint_start, gen)

    def _durable(self, gen: int, step: int) -> None:
        if gen == self._gen:
            self.job.made_durable(self.now, step)

    def _fault_fires(self, gen: int, which: str, node: str | None, idx: int) -> None:
        if gen != self._gen:
            return
        self.clocks.advance(self.in_job, self.now - self._run_start)
        self.clocks.fired(which, node, idx)
        if which == "node" and node is not None and self.s.node_causes[idx].input.kind == "straggler":
            self._straggler(self.s.node_causes[idx], node)
            return
        self._gen += 1
        if which == "node" and node is not None:
            cause, nodes, burst = self.s.node_causes[idx], (node,), None
        elif which == "job":
            cause, nodes, burst = self.s.job_causes[idx], (), None
        else:
            b = self.s.bursts[idx]
            cause, burst = self.s.cause(b.cause), b.name
            nodes = burst_nodes(b, self.s, self.fleet, list(self.in_job), self._burst_rng)
        gpu = self._gpu_rng.randrange(self.s.job.gpus_per_node) if nodes else None
        outage = self.s.bursts[idx].outage_hours if which == "burst" else None
        if outage is not None:
            for n in nodes:
                self._broken.setdefault(n, (cause, gpu))
            self._at(self.now + outage * 3600, self._outage_over, nodes)
        elif cause.repair:
            for n in nodes:
                if n not in self._broken:
                    self._broken[n] = (cause, gpu)
                    if self.operator_s is not None:
                        self._at(self.now + self.operator_s, self._operator, n)
        self._interrupt(cause, nodes, burst, gpu)

    def _recur(self, gen: int, node: str) -> None:
        """A node left broken in the job fails the job again as soon as it runs."""
        if gen != self._gen or node not in self._broken or node not in self.in_job:
            return
        self.clocks.advance(self.in_job, self.now - self._run_start)
        self._gen += 1
        cause, gpu = self._broken[node]
        self._tally_recur += 1
        self._interrupt(cause, (node,), None, gpu)

    def _straggler(self, cause: Cause, node: str) -> None:
        """A GPU of `node` turns slow: the job goes on at its slowest rank's pace (a straggler stops
        nothing) until the node leaves the job, taken out at an interruption."""
        gpu = self._gpu_rng.randrange(self.s.job.gpus_per_node)
        self._slow[node] = (float(cause.input.fields.get("slowdown", 1.0)), gpu)
        self._pace()
        if self._keep_faults:
            self._faults.append((self.now, cause.name, (node,)))
        self.rem.fault(self.now, Fault(self.now, cause, (node,), 0.0, agent_inputs(cause, node, gpu), None, gpu))
        self._run_start = self.now  # the fault clocks have run to now
        self._next_fault(self.now)
        self._schedule_poll()

    def _pace(self) -> None:
        """The job steps at its slowest rank's pace: the slowest GPU of its nodes."""
        factor, node, gpu = max(((f, n, g) for n, (f, g) in self._slow.items() if n in self.in_job),
                                default=(1.0, None, None))
        self.job.slowdown(self.now, factor, node, None if node is None else f"{node}/gpu{gpu}")

    def _outage_over(self, nodes: tuple[str, ...]) -> None:
        """The shared part is back: its nodes not taken out meanwhile work again."""
        for n in nodes:
            self._broken.pop(n, None)

    def _operator(self, node: str) -> None:
        """A person takes out a node that has stayed broken this long (what healthd did not), at the
        job's next detection."""
        if node in self._broken:
            self._operator_due.add(node)

    def _interrupt(self, cause: Cause, nodes: tuple[str, ...], burst: str | None, gpu: int | None) -> None:
        inputs = tuple(i for n in nodes for i in agent_inputs(cause, n, gpu or 0))
        fault = Fault(self.now, cause, nodes, self._detect_s(cause), inputs, burst, gpu)
        self._fault = fault
        self._incidents += 1
        if self._keep_faults:
            self._faults.append((self.now, cause.name, nodes))
        first = next((n for n in nodes if n in self.in_job), nodes[0] if nodes else None)
        self.job.interrupt(self.now, f"sim-{self._incidents}", burst or cause.name, first,
                           f"{first}/gpu{gpu}" if first is not None and gpu is not None else None)
        self.rem.fault(self.now, fault)
        self._at(self.now + fault.detect_s, self._detected, self._gen)

    def _detected(self, gen: int) -> None:
        if gen != self._gen or self._fault is None:
            return
        fault = self._fault
        self.job.detected(self.now)
        decision = self.rem.detected(self.now, fault, list(self.in_job))
        at = max(self.now, decision.decided_at)
        if at > self.now:
            self._deciding = True  # no restart before the decision (a poll for a straggler may come first)
            self._at(at, self._decided, gen, decision)
        else:
            self._decided(gen, decision)

    def _decided(self, gen: int, decision: Decision) -> None:
        self._deciding = False
        if gen != self._gen or self._fault is None:
            return
        fault = self._fault
        due = sorted(n for n in self._operator_due if n in self._broken and n not in decision.removed)
        self._operator_due.clear()
        for n in due:
            self.rem.operator_drain(self.now, n)
            self._operator_drains += 1
        for n in (*decision.removed, *due):
            self._broken.pop(n, None)
            self._slow.pop(n, None)
            if n in self.in_repair:
                continue
            self.in_job.pop(n, None)
            self.spares.discard(n)
            self.in_repair.add(n)
            self._at(self.now + self._repair_s(n, fault.cause), self._repaired, n)
        self._state = "NODE_FAIL" if decision.removed or due else "FAILED"
        if decision.false_positive:
            self.job.false_positive(self.now)
        self.job.decided(self.now, self._state)
        self._fill()
        self._schedule_poll()

    def _fill(self) -> None:
        if self._deciding:
            return
        need = self.s.job.nodes - len(self.in_job)
        ready = sorted(n for n in self.spares if n not in self._work and self.rem.usable(n))
        if need > len(ready):
            return
        for n in ready[:need]:
            self.spares.discard(n)
            self.in_job[n] = None
        self._pace()
        self.job.nodes_ready(self.now, list(self.in_job), self._state)
        self.rem.job_started(self.now, list(self.in_job))
        self._at(self.now + self.restart, self._restarted, self._gen)

    def _repaired(self, node: str) -> None:
        self.in_repair.discard(node)
        if node not in self.pool:
            return
        if self.rem.repaired(self.now, node):
            self.spares.add(node)
            if self.job.phase == WAIT:
                self._fill()
        else:
            self._returning.add(node)
            self._schedule_poll()

    def _schedule_poll(self) -> None:
        """While a node waits for healthd to return it, or the job waits for nodes, look again at the
        controller's next deadline."""
        if self._polling or not (self._returning or self.job.phase == WAIT or self._slow.keys() & self.in_job.keys()):
            return
        at = self.rem.poll(self.now)
        if at is not None:
            self._polling = True
            self._at(max(at, self.now + 1.0), self._poll)

    def _poll(self) -> None:
        self._polling = False
        self.rem.poll(self.now)
        for n in sorted(self._returning):
            if self.rem.usable(n):
                self._returning.discard(n)
                self.spares.add(n)
        if self.job.phase == WAIT:
            self._fill()
        self._schedule_poll()

    def _restarted(self, gen: int) -> None:
        if gen != self._gen or self.job.phase != RESTART:
            return
        self.job.restarted(self.now)
        self._arm(self.now)

    # ------------------------------------------------------------------ run

    now = 0.0
    _state = "FAILED"
    _deciding = False

    def run(self) -> RunResult:
        if self._ran:
            raise RuntimeError("an Engine runs once")
        self._ran = True
        self.job.begin(0.0, list(self.in_job))
        self._arm(0.0)
        heap = self._heap
        other = self.s.fleet.other_work_hours is not None
        try:
            if other:
                self.rem.poll(0.0)  # healthd takes its hot spares before other users' jobs start
                self._settle()
            while heap and heap[0][0] < self.horizon:
                t, _, fn, args = heapq.heappop(heap)
                self.now = t
                fn(*args)
                if other:
                    self._settle()
            self.now = self.horizon
            for started in self._work.values():
                self._other_gpu_s += (self.horizon - started) * self.s.job.gpus_per_node
            self.job.finish(self.horizon, self._state)
            tally = self.rem.tally()
        finally:
            self.rem.close()
        text = "\n".join(self._lines) + "\n"
        self._lines = []
        acc = goodput.account(goodput.parse_log(text, self.s.job.name), now=T0 + self.horizon)
        cost: Counter[str] = Counter()
        for inc in acc.incidents:
            cost[inc.cause] += inc.cost_gpu_s
        return RunResult(self.s.name, self.seed, self.rem.name, acc.goodput or 0.0, acc.held_gpu_s, dict(acc.gpu_s),
                         dict(cost), acc.interruptions, acc.mtbi_s, tuple(self._faults), dict(tally.taken),
                         dict(tally.refused), dict(tally.would), acc.problems, tally.slurm_refused,
                         self._other_gpu_s if other else None,
                         self.horizon * len(self.pool) * self.s.job.gpus_per_node)


def run(scenario: Scenario, seed: int, **kw: object) -> RunResult:
    """One seeded run (see Engine)."""
    return Engine(scenario, seed, **kw).run()  # type: ignore[arg-type]
