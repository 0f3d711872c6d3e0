"""The synchronous training job of healthd-sim, and the goodput event log it writes.

The job computes in segments between saves; a save blocks for its checkpoint time and is durable when
it ends (or `durable_after_minutes` later: an asynchronous save's background write); an interruption
ends the run, the job holds its nodes while the fault is detected and replacements come (or is
requeued, with `hold_while_waiting: false`), and the next run restarts from the last durable save.

Everything it does is written as the event log real jobs write (docs/goodput.md; the entries are built
by healthd.goodput_events): `job_start_time` and an `allocation` per run, a step mark per compute
segment, the blocking part of each save and its `durable` record, the next run's `restored`, the
ledger's `interrupt`/`evidence`/`detected`/`decided` for each interruption, `run_end` and
`job_end_time`. healthd.goodput scores it; nothing here computes a category.
"""

from __future__ import annotations

from collections.abc import Callable

from healthd import goodput_events as ev

T0 = 1_767_225_600.0
"""The virtual clock's epoch: 2026-01-01T00:00:00Z (times in the log are Unix seconds)."""

RUNNING, CHECKPOINT, DETECT, WAIT, RESTART, ENDED = "running", "checkpoint", "detect", "wait", "restart", "ended"

COMPUTE_SHARE = 0.7
"""Of a healthy step, the part each rank computes; the rest is the all-reduce (a model: the job's
step is its slowest rank's compute plus the all-reduce, as in synchronous data parallel)."""


def slowed_step(step_s: float, factor: float) -> float:
    """The job's step when its slowest rank computes `factor` x as long as a healthy one: every rank
    waits for it in the all-reduce."""
    return step_s * (1 + COMPUTE_SHARE * (max(1.0, factor) - 1))


class JobModel:
    """The job's state and its log. The engine calls one method per event, in time order."""

    def __init__(self, name: str, gpus: int, step_seconds: float, hold_while_waiting: bool,
                 write: Callable[[str], None]):
        self.name = name
        self.gpus = gpus
        self.step_s = step_seconds
        self.hold = hold_while_waiting
        self._write = write
        self.phase = ENDED
        self.step = 0
        """The next step to run."""
        self.durable = -1
        """The last durable step (-1: none)."""
        self._seg_start = 0.0
        self._run = 0
        self._incident: str | None = None
        self._run_open = False
        self._slow: tuple[float, str | None, str | None] = (1.0, None, None)
        """(factor, node, gpu) of the job's slowest rank: factor x a healthy rank's compute (1: none)."""
        self._slow_since: float | None = None

    def _line(self, **entry: object) -> None:
        self._write(ev.log_line(self.name, **entry))

    @staticmethod
    def _t(t: float) -> float:
        return round(T0 + t, 3)

    def _start_run(self, t: float, nodes: list[str]) -> None:
        self._line(**ev.job_start(self._t(t)))
        self._line(**ev.event("allocation", self._t(t), gpus=self.gpus, nodes=list(nodes)))
        self._run_open = True

    def begin(self, t: float, nodes: list[str]) -> None:
        """The job's first run starts computing at `t`."""
        self._start_run(t, nodes)
        self._mark(t)
        self.phase = RUNNING

    def _mark(self, t: float) -> None:
        self._seg_start = t
        self._line(**ev.step_mark(self.step, self._t(t)))

    def checkpoint_start(self, t: float) -> int:
        """A save starts: the steps of this segment are done; returns the step the save holds."""
        self.step += max(1, round((t - self._seg_start) / self.step_s))
        self._line(**ev.checkpoint_start(self._t(t)))
        self.phase = CHECKPOINT
        return self.step - 1

    def checkpoint_end(self, t: float) -> None:
        """The blocking part ends; computing resumes."""
        self._line(**ev.checkpoint_end(self._t(t)))
        self._mark(t)
        self.phase = RUNNING

    def made_durable(self, t: float, step: int) -> None:
        self.durable = max(self.durable, step)
        self._line(**ev.event("durable", self._t(t), step=step))

    def slowdown(self, t: float, factor: float, node: str | None = None, gpu: str | None = None) -> None:
        """From `t` the slowest rank of the job (on `node`, `gpu`) computes `factor` x as long as a
        healthy rank (1: no straggler): the job runs slowed_step(factor) x slower while it computes. Each
        stretch is one `straggler` record, which healthd.goodput charges to the straggler category."""
        self._close_slow(t)
        self._slow = (factor, node, gpu)
        if factor > 1 and self.phase in (RUNNING, CHECKPOINT):
            self._slow_since = t

    def _close_slow(self, t: float) -> None:
        if self._slow_since is None:
            return
        factor, node, gpu = self._slow
        fields: dict[str, object] = {"end": self._t(t), "share": round(slowed_step(1.0, factor) - 1, 6)}
        if node is not None:
            fields["node"] = node
        if gpu is not None:
            fields["gpu"] = gpu
        if t > self._slow_since:
            self._line(**ev.event("straggler", self._t(self._slow_since), **fields))
        self._slow_since = None

    def interrupt(self, t: float, incident: str, cause: str, node: str | None, gpu: str | None) -> None:
        """The job stops at `t`: the incident's first evidence."""
        self._close_slow(t)
        self._incident = incident
        fields = {"incident": incident, "cause": cause}
        if node is not None:
            fields["node"] = node
        if gpu is not None:
            fields["gpu"] = gpu
        self._line(**ev.event("interrupt", self._t(t), **fields))
        self._line(**ev.event("evidence", self._t(t), incident=incident))
        self.phase = DETECT

    def detected(self, t: float) -> None:
        self._line(**ev.event("detected", self._t(t), incident=self._incident))
        self.phase = WAIT

    def false_positive(self, t: float) -> None:
        """The incident's action was wrong (a healthy node taken out): its whole cost is the
        false-positive tax."""
        self._line(**ev.event("false_positive", self._t(t), incident=self._incident))

    def decided(self, t: float, state: str) -> None:
        """The action that ends the run was applied at `t` (a drain, a requeue)."""
        self._line(**ev.event("decided", self._t(t), incident=self._incident))
        if not self.hold:
            self._end_run(t, state)

    def _end_run(self, t: float, state: str) -> None:
        if self._run_open:
            self._line(**ev.event("run_end", self._t(t), state=state))
            self._run_open = False

    def nodes_ready(self, t: float, nodes: list[str], state: str) -> None:
        """Replacements are in: the next run starts (and restarts until `restarted`)."""
        self._end_run(t, state)
        self._run += 1
        self._start_run(t, nodes)
        self.phase = RESTART

    def restarted(self, t: float) -> None:
        """The new run loaded the last durable save and takes its first step."""
        if self.durable >= 0:
            self._line(**ev.event("restored", self._t(t), step=self.durable))
        self.step = self.durable + 1
        self._mark(t)
        self.phase = RUNNING
        if self._slow[0] > 1:
            self._slow_since = t

    def finish(self, t: float, state: str = "FAILED") -> None:
        """The simulated time ends at `t` in whatever phase the job is: what it computed since its last
        save counts as done (the job would save it next, as the lab assumes); an interruption still being
        handled gets a last run of no length that restores the last save, so only the work since that
        save is lost."""
        self._close_slow(t)
        if self.phase in (RUNNING, CHECKPOINT):
            self._line(**ev.job_end(self._t(t)))
        elif self.phase in (DETECT, WAIT):
            if self.phase == DETECT:
                self.detected(t)
            self._end_run(t, state)
            self._start_run(t, [])
            if self.durable >= 0:
                self._line(**ev.event("restored", self._t(t), step=self.durable))
            self._line(**ev.job_end(self._t(t)))
        elif self.phase == RESTART:
            if self.durable >= 0:
                self._line(**ev.event("restored", self._t(t), step=self.durable))
            self._line(**ev.job_end(self._t(t)))
        self.phase = ENDED
