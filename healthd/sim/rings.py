"""The simulated job's in-band rings, as the controller seam hands them to the nodes' agents.

A `straggler` fault slows one GPU's rank of the job from its onset; a `hang` fault stops every rank
(the faulted GPU's rank outside the collective, the others waiting in it). `JobRings` keeps that state
for the job's current run and says what each node's ranks look like (healthd.sim.agentinput.JobRanks);
the agent of the node writes and reads the rings itself. Writing every rank's ring on every node for
weeks would cost more than the rest of the run, so rings are written where a report is made about
them: on the fault's node, and for a straggler on one other node of the job (the next in the job's node
list, so the controller compares ranks of two nodes, as it does for a job on several nodes), every `tick_s`
until the controller has found the fault, for `watch_s` at most; an agent that holds findings re-reads
its rings whenever it ticks. A
slow rank found, or a hang, is the real detector's and the real controller's doing; nothing here
reads a step time.

When the job's run ends (an interruption) every node's rings go (the epilog); a new run starts new
rings, in which a GPU already slow is slow from the start, which the in-band detector does not name
(docs/inband.md): it shows only in the job's pace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from healthd.sim.agentinput import JobRanks, Slowdown

TICK_S = 240.0
"""How often a watched node's agent reads its rings and reports (a real agent reads every 10 s and
reports when a window completes: about every 250 s at 10-s steps)."""
WATCH_S = 2400.0
"""How long after a fault its nodes' rings are watched at most: the detector needs its first windows
and two slow ones (about 15 minutes at 10-s steps); a fault the controller has found is watched no
longer."""


@dataclass
class JobRings:
    """The in-band state of the job's current run (mutable; the controller seam's)."""

    job: str
    gpus: int
    step_s: float
    seed: int = 0
    nodes: tuple[str, ...] = ()
    """The job's nodes in rank order: node i runs ranks i x gpus ..."""
    started: float = 0.0
    """When the run's ranks started stepping. Every time here is the controller seam's clock (Unix
    seconds), the agents' clock."""
    slow: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    """node -> (since, factor, gpu) of its slow GPU (it stays slow until repaired)."""
    stopped: tuple[float, str, int] | None = None
    """(since, node, gpu) of the run's hang."""
    watched: dict[str, float] = field(default_factory=dict)
    """node -> until when its rings are re-read every tick_s."""
    watching: dict[str, tuple[float, tuple[str, ...]]] = field(default_factory=dict)
    """A straggler's node -> (its onset, the nodes watched for it)."""
    written: set[str] = field(default_factory=set)
    """Nodes whose agent has rings of this run."""
    next_at: float | None = None
    tick_s: float = TICK_S
    watch_s: float = WATCH_S

    def ranks(self, node: str) -> JobRanks:
        """What `node`'s ranks show now."""
        i = self.nodes.index(node)
        slowdowns = tuple(Slowdown(max(since, self.started), factor, gpu if n == node else None)
                          for n, (since, factor, gpu) in sorted(self.slow.items()) if n in self.nodes)
        stopped, stuck = None, None
        if self.stopped is not None:
            stopped = self.stopped[0]
            stuck = self.stopped[2] if self.stopped[1] == node else None
        return JobRanks(self.job, len(self.nodes) * self.gpus, i * self.gpus, self.started, self.step_s, slowdowns,
                        stopped, stuck, self.seed)

    def fault(self, now: float, kind: str, node: str, gpu: int, fields: Mapping[str, object]) -> tuple[str, ...]:
        """A `straggler` or `hang` input on `node`'s GPU `gpu` at `now`; the nodes to report now."""
        if node not in self.nodes:
            return ()
        if kind == "straggler":
            factor = fields.get("slowdown", 1.0)
            self.slow[node] = (now, float(factor) if isinstance(factor, (int, float)) else 1.0, gpu)
        elif kind == "hang" and self.stopped is None:
            self.stopped = (now, node, gpu)
        i = self.nodes.index(node)
        # a slow rank is told from the others across two nodes; a hang shows in the stopped node's ranks
        watch = (node, self.nodes[(i + 1) % len(self.nodes)]) if kind == "straggler" and len(self.nodes) > 1 else (node,)
        for n in watch:
            self.watched[n] = now + self.watch_s
            self.written.add(n)
        if kind == "straggler":
            self.watching[node] = (now, watch)
        self.next_at = now + self.tick_s
        return watch

    def found(self, flagged: Iterable[str], hung: bool, at: float | None) -> None:
        """The controller's in-band view evaluated at `at` flags a slow rank on each node of
        `flagged`, or names the job hung: what was watched for a fault before `at` is watched no
        longer (a view older than the fault is about something else)."""
        if at is None:
            return
        done = set()
        for node in flagged:
            since, watch = self.watching.get(node, (at, ()))
            if since < at:
                done.update(watch)
                del self.watching[node]
        if hung and self.stopped is not None and self.stopped[0] < at:
            done |= set(self.watched)
        for n in done:
            self.watched.pop(n, None)
        if not self.watched:
            self.next_at = None

    def due(self, now: float) -> tuple[str, ...]:
        """The watched nodes to report at `now` (a tick is due), and when the next is."""
        if self.next_at is None or now < self.next_at:
            return ()
        out = tuple(n for n, until in sorted(self.watched.items()) if until >= now)
        self.watched = {n: until for n, until in self.watched.items() if until > now}
        self.next_at = now + self.tick_s if self.watched else None
        return out

    def run_ended(self) -> tuple[str, ...]:
        """The run ended (the job was requeued): the nodes whose rings go."""
        out = tuple(sorted(self.written))
        self.written.clear()
        self.watched.clear()
        self.watching.clear()
        self.next_at = None
        self.stopped = None
        return out

    def run_started(self, started: float, nodes: Sequence[str]) -> None:
        self.started = started
        self.nodes = tuple(nodes)

    def repaired(self, node: str) -> None:
        self.slow.pop(node, None)

    def straggling(self, node: str) -> bool:
        """A straggler fault left `node` slow (taking it out is no false positive)."""
        factor = self.slow.get(node, (0.0, 1.0, 0))[1]
        return factor > 1.0
