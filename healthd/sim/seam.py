"""The controller seam of healthd-sim: what stands for healthd in a run (`Remediation`), what it
answers (`Decision`), what it counts (`Tally`), and the goodput lab's rule (`LabRule`), which stands
for no controller. healthd.sim.control's ControllerSeam puts the real controller behind the same
Protocol; healthd.sim.engine drives either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from healthd.sim.faults import Fault


@dataclass(frozen=True)
class Decision:
    """What healthd did about one interruption."""

    removed: tuple[str, ...]
    """Nodes taken out of service (drained, down): they go to repair."""
    decided_at: float
    """Virtual seconds when the action that ends the run was applied (>= detection)."""
    false_positive: bool = False
    """The removal was wrong (a healthy node drained): charged to the false-positive tax."""


@dataclass
class Tally:
    """Actions taken and refused, over one run."""

    taken: Counter[str] = field(default_factory=Counter)
    """Action kind -> count applied."""
    refused: Counter[str] = field(default_factory=Counter)
    """Gate -> decisions it refused."""
    would: Counter[str] = field(default_factory=Counter)
    """Action kind -> count recorded only (observe mode)."""
    slurm_refused: int = 0
    """Job starts Slurm refused (a node went out of service between the choice and the start)."""


class Remediation(Protocol):
    """The controller seam: what stands for healthd in a run."""

    name: str

    def fault(self, now: float, fault: Fault) -> None:
        """The fault's agent input appears on its nodes at `now`."""

    def detected(self, now: float, fault: Fault, in_job: Sequence[str]) -> Decision:
        """The job is known to be dead at `now`: what was done (and when it was applied)."""

    def usable(self, node: str) -> bool:
        """May the job run on `node` now (not drained, not down)?"""

    def job_started(self, now: float, nodes: Sequence[str]) -> None:
        """The job's next run starts on `nodes`."""

    def operator_drain(self, now: float, node: str) -> None:
        """A person takes `node` out of service (it kept failing the job and healthd did not)."""

    def repaired(self, now: float, node: str) -> bool:
        """The node is back from repair at `now`; True when it may serve again at once."""

    def poll(self, now: float) -> float | None:
        """Whatever is due by `now`; when to look again (None: nothing pending)."""

    def work_started(self, now: float, node: str) -> bool:
        """Another user's job starts on the free `node` (the scheduler's choice); False: refused."""

    def work_ended(self, now: float, node: str) -> None:
        """That job ended: `node` is free."""

    def tally(self) -> Tally:
        """Actions taken and refused so far."""

    def close(self) -> None:
        """Release what the run held."""


class LabRule:
    """The goodput lab's rule, no controller: a cause marked `repair` takes its nodes out when the job
    detects the fault; nothing else is removed."""

    name = "lab-rule"

    def __init__(self) -> None:
        self._tally = Tally()

    def fault(self, now: float, fault: Fault) -> None:
        return None

    def detected(self, now: float, fault: Fault, in_job: Sequence[str]) -> Decision:
        if fault.cause.repair and fault.nodes:
            self._tally.taken["remove"] += len(fault.nodes)
            return Decision(fault.nodes, now)
        return Decision((), now)

    def usable(self, node: str) -> bool:
        return True

    def job_started(self, now: float, nodes: Sequence[str]) -> None:
        return None

    def operator_drain(self, now: float, node: str) -> None:
        self._tally.taken["operator-drain"] += 1

    def repaired(self, now: float, node: str) -> bool:
        return True

    def poll(self, now: float) -> float | None:
        return None

    def work_started(self, now: float, node: str) -> bool:
        return True

    def work_ended(self, now: float, node: str) -> None:
        return None

    def tally(self) -> Tally:
        return self._tally

    def close(self) -> None:
        return None
