"""SimSlurm: an in-memory Slurm on a virtual clock, implementing the SlurmBackend Protocol.

`SimSlurm(nodes, *, clock, partitions=None, topology=None)` is what the simulator's controller talks
to instead of slurmctld. It passes the same contract suite as the real backends
(tests/slurm/contract.py, run against it by tests/sim/test_sim_slurm.py), validates every argument
with the real validators of healthd.slurm.backend before anything changes, and `describe()` returns
the argv the scontrol backend would run for the same call (its own argv builders, never run).

What it models, after slurmctld 22.05-26.05:

- Nodes: base state idle, allocated (a job holds the whole node) or mixed (only shared jobs), down;
  flags DRAIN, NOT_RESPONDING, REBOOT_REQUESTED, REBOOT_ISSUED; a reason with its user and time (whole
  seconds of the clock) only while DRAIN or DOWN holds it: RESUME clears it, as 22.05 and 26.05 do.
  RESUME acts on drained, down or reboot-pending nodes and is skipped elsewhere; cancel_reboot acts
  on a requested (not yet issued) reboot and drops the drain and reason the reboot set; a node
  drained before the reboot stays drained, with the reboot's reason (seen on 22.05).
- Reboot ASAP: DRAIN + REBOOT_REQUESTED with the next state; issued once the node has no job: then
  DOWN + DRAIN + REBOOT_ISSUED with " : reboot issued" appended to the reason by SlurmUser (seen on
  22.05). `reboot_s` virtual seconds later the node boots (`boot_time`) and takes its next state:
  RESUME returns it to service (no drain, not down, no reason), DOWN leaves it down with the
  reason. `reboot_s=None` leaves the boot to the engine (`reboot_done`). A RESUME while the reboot is
  issued leaves the node idle + NOT_RESPONDING until it has booted (seen on 22.05).
- A node that fails (`node_down`): DOWN + NOT_RESPONDING; its reason is kept when it has one other
  than "Not responding" (slurmctld's set_node_down keeps a drain reason), else it becomes the one
  given (default "Not responding"), by SlurmUser. Its jobs end: a batch job that may be requeued goes
  back to PENDING with one more restart (run state NODE_FAIL in accounting), any other ends
  NODE_FAIL. `node_up` is slurmd registering again, under ReturnToService (`return_to_service`,
  default 1): with 1 a DOWN node returns only when its reason is "Not responding", with 2 any DOWN
  node returns, with 0 none does; a returned node is idle (still drained, with its reason, when it
  was), its reason cleared when it was not drained. A node that does not return stays DOWN until a
  RESUME; a RESUME of a node still not responding leaves it idle + NOT_RESPONDING, and slurmctld
  marks it DOWN again "Not responding" `slurmd_timeout_s` later.
- Jobs: started by the engine (`start_job`: the scheduler's choice), never on a drained, down,
  rebooting or reserved node. `requeue` takes a running or finished batch job back to PENDING with
  the same id and one more restart (refused for a pending job, an unknown one, a non-batch one and
  one submitted --no-requeue); `end_job` ends one; a finished job is known to `job()` for
  `min_job_age_s` (MinJobAge) and to `job_runs()` (accounting, one run per start) always.
- Reservations: create (refused for a duplicate name, unknown nodes, nodes running jobs without
  IGNORE_JOBS, and nodes in another reservation unless MAINT or OVERLAP; slurmctld's words, seen on
  22.05), update of the nodes, delete (already gone is done; refused while a job runs in it), and
  expiry after the duration. A node in a reservation takes jobs of that reservation only, and none
  while a second reservation holds it too. A reserved node shows RESERVED, and MAINTENANCE when a
  MAINT reservation holds it (22.05's `scontrol show node`: IDLE+MAINTENANCE+RESERVED, a few seconds
  after the reservation starts; here at once).
- Partitions (node membership; default: every node in `gpu`) and an optional topology: node -> leaf
  switch, also as the text of Slurm's topology.conf (`topology_conf()`, tree plugin).
- slurmctld down (`ctld_down()`): every call raises SlurmUnavailable, nothing changes; `ctld_up()`
  starts it again (a new `ctld_started_at`), state as saved.

Not modelled: FAIL, FUTURE and power-saving states, node features and GRES per job, job arrays,
COMPLETING, ResumeTimeout (a reboot that never completes), and a slurmctld that loses writes since
its last state save.

Counting: `calls` is every call that reached slurmctld (the contract's proof that a refused input
made none); `writes` counts every write that landed, by call, and `write_count` is their sum;
`on_write(call, args)` is told of each.

Speed (tests/sim/test_sim_slurm.py::test_a_fleet_read_costs_microseconds prints it; best of 7 runs
of 2,000 calls on the 2-core development machine with a load average of 10): a read of all 128
nodes with nothing changed costs 0.4-0.7 us (a copy of the cached list), a read after one node
changed 6-18 us (that node's NodeInfo is built again), `node(name)` 0.2-0.3 us, a drain of one node
named plainly 7-16 us; a write given a hostlist expression costs 0.2-0.5 ms, ClusterShell's
expansion and the validators (the fleet's plain names skip them: they were validated once, when the
fleet was built). One read per 60-second round over 140 runs of 28 days is 5.6 million reads,
about 3 s.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from ClusterShell.NodeSet import NodeSet

from healthd.slurm.backend import (
    MAINT_FLAGS,
    MAINT_USERS,
    JobInfo,
    JobRun,
    NodeInfo,
    SlurmRefused,
    SlurmUnavailable,
    StepResult,
    guarded_state_write,
    node_info,
    requested_nodes,
    reservation_args,
    slurm_hostlist,
    validate_admin_comment,
    validate_argv,
    validate_job_id,
    validate_next_state,
    validate_node_name,
    validate_nodes,
    validate_reason,
    validate_reservation_name,
)
from healthd.slurm.runner import STEP_PATH, CommandResult, step_result
from healthd.slurm.scontrol import ScontrolBackend

log = logging.getLogger(__name__)

FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
"""How a job can end (end_job); a finished batch job can still be requeued while slurmctld holds it."""
SIM_VERSION = "26.05.5"
"""The Slurm version SimSlurm answers with: the one whose RESUME it models (the reason is cleared)."""
ISSUED_SUFFIX = " : reboot issued"
"""What slurmctld appends to a node's reason when it issues a requested reboot (22.05)."""
NOT_RESPONDING = "Not responding"
"""slurmctld's reason for a node it marks down when slurmd stops answering."""
SLURM_USER = "slurm"
"""Who slurmctld's own reasons are by (SlurmUser): a node marked down for not responding."""


def _job_order(job_id: str) -> tuple[int, ...]:
    """squeue's order: by job id, an array task after its array's id."""
    return tuple(int(part) for part in job_id.split("_"))


def _never_run(argv: list[str], env: dict[str, str], timeout_s: float) -> CommandResult:
    raise AssertionError(f"SimSlurm runs no Slurm client: {argv}")


_FLAGS: dict[tuple[bool, bool, str, bool, bool], frozenset[str]] = {}
"""One frozenset per combination of flags, shared by every node that has it."""


class _Node:
    """One node's state as slurmctld holds it (mutable; `info` caches its NodeInfo until it changes)."""

    __slots__ = ("name", "partitions", "gres", "address", "boot_time", "down", "responding", "drain", "reboot",
                 "next_state", "reason", "reason_user", "reason_time", "jobs", "resv", "info", "dead", "booting",
                 "drain_by_reboot", "built")

    def __init__(self, name: str, partitions: tuple[str, ...], gres: str, address: str, boot_time: float):
        self.name = name
        self.partitions = partitions
        self.gres = gres
        self.address = address
        self.boot_time = boot_time
        self.down = False
        self.responding = True
        self.drain = False
        self.reboot = ""  # "", "REQUESTED" or "ISSUED"
        self.drain_by_reboot = False  # the DRAIN is the reboot's own (cancel_reboot drops it)
        self.booting = False  # an issued reboot has not completed (even after a RESUME)
        self.dead = False  # the engine's node_down: slurmd answers nothing until node_up
        self.next_state: str | None = None
        self.reason = ""
        self.reason_user: str | None = None
        self.reason_time: float | None = None
        self.jobs: dict[str, bool] = {}  # job id -> holds the whole node (exclusive)
        self.resv: dict[str, bool] = {}  # the reservations holding it -> whether it is a MAINT one
        self.info: NodeInfo | None = None
        self.built: dict[tuple, NodeInfo] = {}
        """The node's latest few NodeInfo values by what makes them (a job's start and end flip a whole
        allocation between two)."""

    def build(self) -> NodeInfo:
        maint = any(self.resv.values())
        key = (self.drain, self.responding, self.reboot, bool(self.resv), maint)
        flags = _FLAGS.get(key)
        if flags is None:
            named = [("DRAIN", self.drain), ("NOT_RESPONDING", not self.responding),
                     ("REBOOT_" + self.reboot, bool(self.reboot)), ("RESERVED", bool(self.resv)),
                     ("MAINTENANCE", maint)]
            flags = _FLAGS[key] = frozenset(flag for flag, present in named if present)
        if self.down:
            state = "down"
        elif self.jobs:
            state = "allocated" if any(self.jobs.values()) else "mixed"
        else:
            state = "idle"
        next_state = self.next_state if self.reboot else None
        key = (state, flags, self.reason, self.reason_user, self.reason_time, next_state, self.boot_time)
        info = self.built.get(key)
        if info is None:
            if len(self.built) >= 4:
                self.built.clear()
            info = self.built[key] = node_info(self.name, state, flags, self.reason, self.reason_user,
                                               self.reason_time, partitions=self.partitions, gres=self.gres,
                                               next_state=next_state, boot_time=self.boot_time)
        self.info = info
        return info

    def set_reason(self, reason: str, user: str | None, when: float | None) -> None:
        self.reason, self.reason_user, self.reason_time = reason, user, when


class _Job:
    __slots__ = ("job_id", "state", "nodes", "batch", "comment", "restarts", "partition", "account", "requeue_ok",
                 "exclusive", "reservation", "gpus", "ended_at")

    def __init__(self, job_id: str, batch: bool, comment: str, partition: str, account: str, requeue_ok: bool):
        self.job_id = job_id
        self.state = "PENDING"
        self.nodes: tuple[str, ...] = ()
        self.batch = batch
        self.comment = comment
        self.restarts = 0
        self.partition = partition
        self.account = account
        self.requeue_ok = requeue_ok
        self.exclusive = True
        self.reservation: str | None = None
        self.gpus: int | None = None
        self.ended_at: float | None = None

    def info(self) -> JobInfo:
        return JobInfo(self.job_id, self.batch, self.comment, self.restarts, self.state, self.partition, self.account)


@dataclass(frozen=True)
class SimReservation:
    """A reservation as SimSlurm holds it."""

    name: str
    nodes: tuple[str, ...]
    """In the order of the fleet."""
    users: tuple[str, ...]
    flags: frozenset[str]
    start: float
    end: float
    """When slurmctld removes it (start + the duration)."""


class _SimCore:
    """The nodes, the clock's timers, slurmctld's availability and the call counters; node reads and
    writes. SimSlurm adds jobs, reservations and steps."""

    def __init__(self, nodes: str | Iterable[str], *, clock: Callable[[], float],
                 partitions: Mapping[str, str | Iterable[str]] | None = None,
                 topology: Mapping[str, str] | None = None, gres: str = "gpu:8", reboot_s: float | None = 300.0,
                 slurmd_timeout_s: float = 300.0, return_to_service: int = 1, min_job_age_s: float = 300.0,
                 accounting: bool = True, user: str = "root", version: str = SIM_VERSION):
        names = list(validate_nodes(nodes)) if isinstance(nodes, str) else [validate_node_name(n) for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError("a node is named twice")
        parts: dict[str, list[str]] = {}
        for part, members in (partitions if partitions is not None else {"gpu": names}).items():
            wanted = set(validate_nodes(members)) if isinstance(members, str) else set(members)
            unknown = wanted - set(names)
            if unknown:
                raise ValueError(f"partition {part!r} names unknown nodes: {', '.join(sorted(unknown)[:5])}")
            parts[part] = [n for n in names if n in wanted]
        if topology is not None and set(topology) - set(names):
            raise ValueError(f"topology names unknown nodes: {', '.join(sorted(set(topology) - set(names))[:5])}")
        self.clock = clock
        self.dry_run = False
        self.planned: list[list[str]] = []
        self.timeout_s = 10.0
        """What a call to a stopped slurmctld may take at most (it takes no time here)."""
        self.user = user
        """Who the Protocol's writes are made by (the controller runs as root)."""
        self.reboot_s = reboot_s
        self.slurmd_timeout_s = slurmd_timeout_s
        if return_to_service not in (0, 1, 2):
            raise ValueError(f"return_to_service is Slurm's ReturnToService: 0, 1 or 2, not {return_to_service!r}")
        self.return_to_service = return_to_service
        self.min_job_age_s = min_job_age_s
        self.accounting = accounting
        self.calls = 0
        self.writes: Counter[str] = Counter()
        self.on_write: Callable[[str, dict[str, Any]], None] | None = None
        now = float(clock())
        self.started_at: float | None = now
        self._version = version
        self._ctld_up = True
        self._describer = ScontrolBackend("simulated/slurm.conf", runner=_never_run, read_mode="oneliner")
        self._nodes = {n: _Node(n, tuple(p for p, m in parts.items() if n in m), gres, f"10.{i >> 16 & 255}."
                                f"{i >> 8 & 255}.{i & 255}", now) for i, n in enumerate(names, start=1)}
        self._index = {n: i for i, n in enumerate(names)}
        self._list: list[NodeInfo] = [node.build() for node in self._nodes.values()]
        self._dirty: set[str] = set()
        self._parts = {p: tuple(m) for p, m in parts.items()}
        self._topology = dict(topology or {})
        self._timers: list[tuple[float, int, str, str]] = []
        self._seq = 0

    # -- the clock and slurmctld ------------------------------------------------------------------

    def _stamp(self) -> float:
        return float(int(self.clock()))

    def _at(self, when: float, kind: str, key: str) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, kind, key))

    def _tick(self) -> None:
        """Run what the clock has reached: boots, nodes timing out, reservations ending, jobs aged out."""
        timers = self._timers
        if timers and timers[0][0] <= self.clock():
            now = self.clock()
            while timers and timers[0][0] <= now:
                _, _, kind, key = heapq.heappop(timers)
                getattr(self, "_timer_" + kind)(key)

    def _reach(self) -> None:
        """One call to slurmctld: SlurmUnavailable while it is stopped."""
        if not self._ctld_up:
            raise SlurmUnavailable("slurmctld is down (simulated): Unable to contact slurm controller")
        self.calls += 1
        self._tick()

    def _landed(self, call: str, **args: Any) -> None:
        self.writes[call] += 1
        if self.on_write is not None:
            self.on_write(call, args)

    def _plan(self, action: str, **kw: Any) -> bool:
        """With dry_run, record the call instead of making it (True); validates either way."""
        argv = self.describe(action, **kw)
        if self.dry_run:
            self.planned.append(argv)
            return True
        return False

    @property
    def write_count(self) -> int:
        """Every write that landed, all calls together."""
        return sum(self.writes.values())

    def ctld_down(self) -> None:
        """Stop slurmctld: every call raises SlurmUnavailable until ctld_up()."""
        self._ctld_up = False

    def ctld_up(self) -> None:
        """Start slurmctld again, from state as it was (a new start time)."""
        if not self._ctld_up:
            self._ctld_up = True
            self.started_at = self._stamp()

    def version(self) -> str:
        return self._version

    def ctld_started_at(self) -> float | None:
        self._reach()
        return self.started_at

    def describe(self, action: str, **kw: Any) -> list[str]:
        """The argv the scontrol backend runs for the same call (validated: ValueError)."""
        if action == "update_reservation":
            name = validate_reservation_name(kw["name"])
            return ["scontrol", "update", f"ReservationName={name}", f"Nodes={slurm_hostlist(kw['nodes'])}"]
        return self._describer.describe(action, **kw)

    # -- node reads -------------------------------------------------------------------------------

    def _changed(self, node: _Node) -> None:
        node.info = None
        self._dirty.add(node.name)

    def _fresh(self) -> list[NodeInfo]:
        if self._dirty:
            for name in self._dirty:
                node = self._nodes[name]
                self._list[self._index[name]] = node.info or node.build()
            self._dirty.clear()
        return self._list

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        fast = None if names is None else self._targets(names)
        wanted = [n.name for n in fast] if fast is not None else requested_nodes(names)
        if wanted == []:
            return []
        self._reach()
        infos = self._fresh()
        if wanted is None:
            return list(infos)
        fast = self._targets(wanted)
        chosen = {n.name for n in fast} if fast is not None else set(validate_nodes(wanted))
        return [i for i in infos if i.name in chosen]

    def node(self, name: str) -> NodeInfo:
        found = self._nodes.get(name) if isinstance(name, str) else None
        if found is not None:
            self._reach()
            return found.info or found.build()
        ns = validate_nodes(name)
        if len(ns) != 1:
            raise ValueError(f"node() takes one node name, got {name!r} ({len(ns)} nodes)")
        self._reach()
        node = self._nodes.get(ns[0])
        if node is None:
            raise SlurmRefused(f"Slurm has no node named {name!r}", argv=["scontrol", "show", "node", name])
        return node.info or node.build()

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        wanted = requested_nodes(names)
        if wanted == []:
            return {}
        self._reach()
        chosen = None if wanted is None else set(validate_nodes(wanted))
        return {n: node.address for n, node in self._nodes.items() if chosen is None or n in chosen}

    def _targets(self, nodes: object) -> list[_Node] | None:
        """Plain names of the fleet's nodes, each once in the fleet's order, found without ClusterShell:
        every fleet name passed validate_node_name when the fleet was built, so a known name is a valid
        one. None for anything else (a hostlist, an unknown name, not a string): the validators decide."""
        names = [nodes] if isinstance(nodes, str) else nodes
        if not isinstance(names, (list, tuple)) or not names:
            return None
        try:
            picked = [self._nodes[n] for n in names]
        except (KeyError, TypeError):
            return None
        if len(picked) > 1:
            picked = sorted(set(picked), key=lambda n: self._index[n.name])
        return picked

    def _known(self, nodes: str | Sequence[str] | NodeSet, what: str) -> list[_Node]:
        """The nodes named, each once in the fleet's order; SlurmRefused for a name slurmctld lacks."""
        fast = self._targets(nodes)
        if fast is not None:
            return fast
        wanted = nodes if isinstance(nodes, NodeSet) else validate_nodes(nodes)
        missing = [n for n in wanted if n not in self._nodes]
        if missing:
            raise SlurmRefused(f"{what}: Invalid node name specified: {', '.join(missing[:5])}", argv=[what],
                               returncode=1, stderr="Invalid node name specified")
        return [self._nodes[n] for n in sorted(wanted, key=self._index.__getitem__)]

    # -- node writes ------------------------------------------------------------------------------

    def _validated(self, action: str, nodes: str | Sequence[str], **kw: Any) -> list[_Node] | None:
        """A write's nodes after validation of every argument (ValueError), or None when dry_run
        recorded the call instead. The fleet's own names skip ClusterShell (see _targets)."""
        fast = None if self.dry_run else self._targets(nodes)
        if fast is None:
            self._plan(action, nodes=nodes, **kw)
            return None if self.dry_run else []
        if "reason" in kw:
            validate_reason(kw["reason"])
        if "next_state" in kw:
            validate_next_state(kw["next_state"])
        return fast

    def drain(self, nodes: str | Sequence[str], reason: str) -> None:
        if self._validated("drain", nodes, reason=reason) is None:
            return
        self._reach()
        targets, when = self._known(nodes, "drain"), self._stamp()
        for node in targets:
            node.drain, node.drain_by_reboot = True, False
            node.set_reason(reason, self.user, when)
            self._changed(node)
        self._landed("drain", nodes=[n.name for n in targets], reason=reason)

    def resume(self, nodes: str | Sequence[str]) -> None:
        """RESUME the nodes that need it (drained, down or awaiting a reboot); the others are skipped."""
        self._guarded("resume", nodes, lambda n: n.resumable, self._resume)

    def _guarded(self, action: str, nodes: str | Sequence[str], needs: Callable[[NodeInfo], bool],
                 write: Callable[[list[str]], None]) -> None:
        """A write Slurm refuses where it is not needed (RESUME, cancel_reboot): one read, then the write
        to the nodes that need it (healthd.slurm.backend.guarded_state_write, which also validates)."""
        fast = None if self.dry_run else self._targets(nodes)
        if fast is None:
            self.describe(action, nodes=nodes)
            guarded_state_write(self._named, nodes, needs, write, action, log)
            return
        self._reach()
        todo = [n.name for n in fast if needs(n.info or n.build())]
        if todo:
            write(todo)

    def _named(self, names: Iterable[str]) -> list[NodeInfo]:
        self._reach()
        return [n.info or n.build() for n in (self._nodes.get(name) for name in names) if n is not None]

    def _resume(self, names: list[str]) -> None:
        if self.dry_run:
            self._plan("resume", nodes=names)
            return
        self._reach()
        for node in self._known(names, "resume"):
            node.drain, node.drain_by_reboot, node.reboot, node.next_state = False, False, "", None
            if node.booting:  # slurmctld waits for the rebooting node to register (seen on 22.05)
                node.responding = False
            if node.down:
                node.down = False
                if not node.responding and not node.booting:  # still silent: down again at its timeout
                    self._at(self.clock() + self.slurmd_timeout_s, "silent", node.name)
            node.set_reason("", None, None)
            self._changed(node)
        self._landed("resume", nodes=names)

    def reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> None:
        if self._validated("reboot_asap", nodes, reason=reason, next_state=next_state) is None:
            return
        self._reach()
        targets, when = self._known(nodes, "reboot"), self._stamp()
        for node in targets:
            if not node.drain:
                node.drain = node.drain_by_reboot = True
            node.next_state = next_state
            if node.reboot != "ISSUED":
                node.reboot = "REQUESTED"
            node.set_reason(reason, self.user, when)
            self._changed(node)
            self._maybe_issue(node)
        self._landed("reboot_asap", nodes=[n.name for n in targets], reason=reason, next_state=next_state)

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None:
        """Cancel a requested (not yet issued) reboot; nodes without one are skipped. The drain the
        reboot set goes with its reason; a node drained before the reboot stays drained, with the
        reboot's reason (seen on 22.05)."""
        self._guarded("cancel_reboot", nodes, lambda n: "REBOOT_REQUESTED" in n.flags, self._cancel_reboot)

    def _cancel_reboot(self, names: list[str]) -> None:
        if self.dry_run:
            self._plan("cancel_reboot", nodes=names)
            return
        self._reach()
        for node in self._known(names, "cancel_reboot"):
            node.reboot, node.next_state = "", None
            if node.drain_by_reboot:
                node.drain = node.drain_by_reboot = False
                if not node.down:
                    node.set_reason("", None, None)
            self._changed(node)
        self._landed("cancel_reboot", nodes=names)

    def _maybe_issue(self, node: _Node) -> None:
        """A requested reboot is issued once the node runs no job and answers: slurmctld marks it DOWN
        and appends " : reboot issued" to the reason, as SlurmUser (seen on 22.05)."""
        if node.reboot == "REQUESTED" and not node.jobs and node.responding:
            node.reboot, node.booting, node.down = "ISSUED", True, True
            if ISSUED_SUFFIX not in node.reason:
                node.set_reason(node.reason + ISSUED_SUFFIX, SLURM_USER, self._stamp())
            self._changed(node)
            if self.reboot_s is not None:
                self._at(self.clock() + self.reboot_s, "boot", node.name)

    def _timer_boot(self, name: str) -> None:
        node = self._nodes[name]
        if node.booting and not node.dead:
            self.reboot_done(name)

    def _timer_silent(self, name: str) -> None:
        node = self._nodes[name]
        if not node.responding and not node.down and not node.booting:
            self._fail(node, NOT_RESPONDING)

    # -- the engine's side: hardware --------------------------------------------------------------

    def reboot_done(self, name: str) -> None:
        """The node has booted and slurmd registers (an issued reboot completes; any other boot is just
        a boot): it takes its next state: RESUME returns it to service (no drain, not down, no
        reason), DOWN leaves it down with the reason."""
        node = self._nodes[name]
        node.boot_time = self._stamp()
        node.responding, node.booting, node.dead = True, False, False
        if node.reboot == "ISSUED":
            if node.next_state == "DOWN":
                node.down, node.drain = True, False
            else:
                node.drain = node.down = False
                node.set_reason("", None, None)
            node.reboot, node.next_state, node.drain_by_reboot = "", None, False
        self._changed(node)

    def node_down(self, name: str, reason: str = NOT_RESPONDING) -> None:
        """The node fails (slurmd stops answering): DOWN + NOT_RESPONDING, its jobs end (a requeueable
        batch job goes back to PENDING). A reason already there is kept."""
        validate_reason(reason)
        node = self._nodes[name]
        node.responding, node.dead = False, True
        self._fail(node, reason)

    def _fail(self, node: _Node, reason: str) -> None:
        node.down = True
        if not node.reason or node.reason.startswith(NOT_RESPONDING):
            node.set_reason(reason, SLURM_USER, self._stamp())
        self._changed(node)
        self._node_failed(node)

    def _node_failed(self, node: _Node) -> None:
        """The jobs on a failed node end (SimSlurm: NODE_FAIL, or requeued)."""

    def node_up(self, name: str) -> None:
        """The node answers again (slurmd registers); a DOWN node returns as ReturnToService says (see
        the module docstring): idle, still drained with its reason when it was."""
        node = self._nodes[name]
        if node.booting:
            self.reboot_done(name)
            return
        node.responding, node.dead = True, False
        rts = self.return_to_service
        if node.down and (rts == 2 or (rts == 1 and node.reason == NOT_RESPONDING)):
            node.down = False
            if not node.drain:
                node.set_reason("", None, None)
        self._changed(node)
        self._maybe_issue(node)


class SimSlurm(_SimCore):
    """An in-memory Slurm on a virtual clock (the module docstring says what it models).

    nodes: node names in slurm.conf order (or one hostlist); clock: zero-argument callable giving
    virtual epoch seconds; partitions: name -> its nodes (a list or a hostlist); topology: node -> its
    leaf switch. `step(node, command, timeout_s)` answers run_step for a `srun --nodelist=NODE ...`
    (default: the command runs here, as NODE's job step would, with SLURMD_NODENAME set)."""

    def __init__(self, nodes: str | Iterable[str], *, clock: Callable[[], float],
                 partitions: Mapping[str, str | Iterable[str]] | None = None,
                 topology: Mapping[str, str] | None = None,
                 step: Callable[[str, list[str], float], StepResult] | None = None, **settings: Any):
        super().__init__(nodes, clock=clock, partitions=partitions, topology=topology, **settings)
        self.step = step
        self._jobs: dict[str, _Job] = {}
        self._runs: dict[str, list[JobRun]] = {}
        self._comments: dict[str, str] = {}
        self._resvs: dict[str, SimReservation] = {}
        self._next_job = 1
        self.steps_run = 0

    # -- jobs: the Protocol -----------------------------------------------------------------------

    def requeue(self, job_id: int | str) -> None:
        """Back to PENDING with the same id and one more restart: a running or finished batch job."""
        if self._plan("requeue", job_id=job_id):
            return
        text = validate_job_id(job_id)
        self._reach()
        job = self._jobs.get(text)
        argv = ["scontrol", "requeue", text]
        if job is None:
            raise SlurmRefused(f"requeue {text}: Invalid job id specified", argv, 1, "Invalid job id specified")
        if not job.batch:
            raise SlurmRefused(f"requeue {text}: Only batch jobs are accepted or processed", argv, 1,
                               "Only batch jobs are accepted or processed")
        if job.state == "PENDING":
            raise SlurmRefused(f"requeue {text}: Job is pending execution", argv, 1, "Job is pending execution")
        if not job.requeue_ok:
            raise SlurmRefused(f"requeue {text}: Requested operation is presently disabled", argv, 1,
                               "Requested operation is presently disabled")
        self._back_to_pending(job, "REQUEUED")
        self._landed("requeue", job_id=text)

    def _back_to_pending(self, job: _Job, run_state: str) -> None:
        if job.state == "RUNNING":
            self._finish(job, run_state)
        job.state, job.ended_at = "PENDING", None
        job.restarts += 1

    def _finish(self, job: _Job, state: str) -> None:
        """End the job's current run: its nodes are free, accounting closes the run."""
        now = self._stamp()
        for name in job.nodes:
            node = self._nodes[name]
            node.jobs.pop(job.job_id, None)
            self._changed(node)
            self._maybe_issue(node)
        runs = self._runs.get(job.job_id)
        if runs and runs[-1].end is None:
            last = runs[-1]
            runs[-1] = JobRun(last.job_id, state, last.start, now, last.partition, last.account, last.gpus,
                              last.nodes)
        job.state, job.nodes, job.ended_at = state, (), now

    def _node_failed(self, node: _Node) -> None:
        for job_id in list(node.jobs):
            job = self._jobs[job_id]
            if job.batch and job.requeue_ok:
                self._back_to_pending(job, "NODE_FAIL")
            else:
                self._finish(job, "NODE_FAIL")
                self._at(self.clock() + self.min_job_age_s, "purge", job_id)

    def jobs_on(self, node: str) -> list[JobInfo]:
        name = node if isinstance(node, str) and node in self._nodes else validate_node_name(node)
        self._reach()
        found = self._nodes.get(name)
        if found is None:
            raise SlurmRefused(f"squeue: Invalid node name specified: {name}", ["squeue", f"--nodelist={name}"], 1,
                               "Invalid node name specified")
        return [self._jobs[j].info() for j in sorted(found.jobs, key=_job_order)]

    def job(self, job_id: int | str) -> JobInfo | None:
        text = validate_job_id(job_id)
        self._reach()
        job = self._jobs.get(text)
        return job.info() if job is not None else None

    def job_runs(self, job_id: int | str) -> list[JobRun] | None:
        text = validate_job_id(job_id)
        self._reach()
        if not self.accounting:
            return None
        comment = self._comments.get(text, "")
        return [JobRun(r.job_id, r.state, r.start, r.end, r.partition, r.account, r.gpus,
                       slurm_hostlist(r.nodes.split(",")) if r.nodes else "", comment)
                for r in self._runs.get(text, [])]

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        if self._plan("set_admin_comment", job_id=job_id, text=text):
            return
        job = validate_job_id(job_id)
        validate_admin_comment(text)
        self._reach()
        self._comments[job] = text
        self._landed("set_admin_comment", job_id=job, text=text)

    # -- jobs: the engine's side ------------------------------------------------------------------

    def start_job(self, job_id: int | str | None, nodes: str | Sequence[str], *, partition: str | None = None,
                  requeue_ok: bool = True, batch: bool = True, comment: str = "", account: str = "",
                  exclusive: bool = True, reservation: str | None = None, gpus: int | None = None) -> str:
        """The scheduler starts a job (a new one, or a pending one again) on `nodes`; returns its id.
        SlurmRefused when a node cannot take it: drained, down, rebooting, busy, reserved for another
        reservation (or for one when the job names none), or not in the partition."""
        if not self._ctld_up:
            raise SlurmUnavailable("slurmctld is down (simulated): no job starts")
        self._tick()
        targets = self._known(nodes, "start_job")
        text = str(self._next_job) if job_id is None else validate_job_id(job_id)
        job = self._jobs.get(text)
        if job is not None and job.state != "PENDING":
            raise SlurmRefused(f"job {text} is {job.state}, not pending")
        part = partition or (job.partition if job is not None else "") or (targets[0].partitions or ("",))[0]
        for node in targets:
            self._check_can_run(node, part, exclusive, reservation)
        if job is None:
            job = self._jobs[text] = _Job(text, batch, comment, part, account, requeue_ok)
            self._next_job = max(self._next_job, int(text.split("_")[0]) + 1)
        job.state, job.nodes, job.partition = "RUNNING", tuple(n.name for n in targets), part
        job.exclusive, job.reservation, job.gpus, job.ended_at = exclusive, reservation, gpus, None
        for node in targets:
            node.jobs[text] = exclusive
            self._changed(node)
        if self.accounting:
            # the node list as plain names, in Slurm's hostlist form only when accounting is read: a
            # hostlist of a large job costs more than the rest of a start
            self._runs.setdefault(text, []).append(JobRun(text, "RUNNING", self._stamp(), None, part, job.account,
                                                          gpus, ",".join(job.nodes)))
        return text

    def _check_can_run(self, node: _Node, partition: str, exclusive: bool, reservation: str | None) -> None:
        why = ""
        if node.down or not node.responding:
            why = "down"
        elif node.drain or node.reboot:
            why = "drained or rebooting"
        elif partition not in node.partitions:
            why = f"not in partition {partition!r}"
        elif node.jobs and (exclusive or any(node.jobs.values())):
            why = "busy"
        elif reservation is not None and reservation not in node.resv:
            why = f"not in reservation {reservation!r}"
        elif node.resv.keys() - {reservation}:  # another reservation holds it too (a MAINT one over it)
            why = f"reserved ({', '.join(sorted(node.resv.keys() - {reservation}))})"
        if why:
            raise SlurmRefused(f"node {node.name} cannot take the job: {why}")

    def end_job(self, job_id: int | str, state: str = "COMPLETED") -> None:
        """The job ends (a pending one is cancelled); slurmctld forgets it min_job_age_s later."""
        if state not in FINISHED_STATES:
            raise ValueError(f"a job ends {', '.join(sorted(FINISHED_STATES))}, not {state!r}")
        text = validate_job_id(job_id)
        job = self._jobs.get(text)
        if job is None:
            raise ValueError(f"SimSlurm holds no job {text}")
        if job.state in FINISHED_STATES:
            raise ValueError(f"job {job.job_id} has ended already ({job.state})")
        self._tick()
        self._finish(job, state)
        self._at(self.clock() + self.min_job_age_s, "purge", job.job_id)

    def _timer_purge(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is not None and job.state in FINISHED_STATES and job.ended_at is not None \
                and job.ended_at + self.min_job_age_s <= self.clock():
            del self._jobs[job_id]

    def running_jobs(self) -> dict[str, tuple[str, ...]]:
        """job id -> its nodes, for every running job."""
        return {j.job_id: j.nodes for j in self._jobs.values() if j.state == "RUNNING"}

    def pending_jobs(self) -> list[str]:
        return [j.job_id for j in self._jobs.values() if j.state == "PENDING"]

    # -- reservations -----------------------------------------------------------------------------

    def create_reservation(self, name: str, nodes: str | Sequence[str], duration_min: int,
                           users: Sequence[str] = MAINT_USERS, flags: Sequence[str] = MAINT_FLAGS) -> None:
        if self._plan("create_reservation", name=name, nodes=nodes, duration_min=duration_min, users=users,
                      flags=flags):
            return
        name, _, duration_min, users, flags = reservation_args(name, nodes, duration_min, users, flags)
        self._reach()
        argv = self.describe("create_reservation", name=name, nodes=nodes, duration_min=duration_min, users=users,
                             flags=flags)
        if name in self._resvs:
            raise SlurmRefused(f"create reservation {name}: Duplicate reservation name", argv, 1,
                               "Duplicate reservation name")
        targets = self._known(nodes, "create_reservation")
        self._check_reservable(targets, set(flags), name, argv)
        now = self._stamp()
        resv = SimReservation(name, tuple(n.name for n in targets), tuple(users), frozenset(flags), now,
                              now + duration_min * 60)
        self._resvs[name] = resv
        for node in targets:
            self._hold(node, resv)
        self._at(resv.end, "resv_end", name)
        self._landed("create_reservation", name=name, nodes=list(resv.nodes), duration_min=duration_min,
                     users=list(users), flags=list(flags))

    def _check_reservable(self, targets: list[_Node], flags: set[str], name: str, argv: list[str]) -> None:
        """slurmctld's refusals, in its words (seen on 22.05)."""
        busy = [n.name for n in targets if n.jobs] if "IGNORE_JOBS" not in flags else []
        taken = [n.name for n in targets if n.resv.keys() - {name}] if not flags & {"MAINT", "OVERLAP"} else []
        for nodes, words in ((busy, "Requested nodes are busy"),
                             (taken, "Requested reservation overlaps with another reservation")):
            if nodes:
                raise SlurmRefused(f"reservation {name}: {words}: {', '.join(nodes[:5])}", argv, 1, words)

    def update_reservation(self, name: str, nodes: str | Sequence[str]) -> None:
        """Set the reservation's nodes (`scontrol update ReservationName=NAME Nodes=...`): a spare
        released, the pool refilled."""
        if self._plan("update_reservation", name=name, nodes=nodes):
            return
        argv = self.describe("update_reservation", name=name, nodes=nodes)
        self._reach()
        old = self._resvs.get(name)
        if old is None:
            raise SlurmRefused(f"update reservation {name}: Requested reservation is invalid", argv, 1,
                               "Requested reservation is invalid")
        targets = self._known(nodes, "update_reservation")
        added = [n for n in targets if name not in n.resv]
        self._check_reservable(added, set(old.flags), name, argv)
        for n in old.nodes:
            self._release(self._nodes[n], name)
        new = self._resvs[name] = SimReservation(name, tuple(n.name for n in targets), old.users, old.flags,
                                                 old.start, old.end)
        for node in targets:
            self._hold(node, new)
        self._landed("update_reservation", name=name, nodes=[n.name for n in targets])

    def delete_reservation(self, name: str) -> None:
        """Delete it; one already gone is done. Refused while a job runs in it."""
        if self._plan("delete_reservation", name=name):
            return
        self._reach()
        resv = self._resvs.get(name)
        if resv is None:
            return
        if any(j.reservation == name and j.state == "RUNNING" for j in self._jobs.values()):
            raise SlurmRefused(f"delete reservation {name}: Reservation busy", ["scontrol", "delete",
                               f"ReservationName={name}"], 1, "Reservation busy")
        self._drop_reservation(resv)
        self._landed("delete_reservation", name=name)

    def _drop_reservation(self, resv: SimReservation) -> None:
        del self._resvs[resv.name]
        for n in resv.nodes:
            self._release(self._nodes[n], resv.name)

    def _hold(self, node: _Node, resv: SimReservation) -> None:
        node.resv[resv.name] = "MAINT" in resv.flags
        self._changed(node)

    def _release(self, node: _Node, name: str) -> None:
        node.resv.pop(name, None)
        self._changed(node)

    def _timer_resv_end(self, name: str) -> None:
        resv = self._resvs.get(name)
        if resv is not None and resv.end <= self.clock():
            self._drop_reservation(resv)

    def reservation_exists(self, name: str) -> bool:
        validate_reservation_name(name)
        self._reach()
        return name in self._resvs

    def reservations(self) -> dict[str, SimReservation]:
        """The reservations slurmctld holds now."""
        self._tick()
        return dict(self._resvs)

    # -- job steps --------------------------------------------------------------------------------

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        """A job step: `srun --nodelist=NODE ... COMMAND` is answered by `step` (default: COMMAND run
        here with SLURMD_NODENAME=NODE); anything else runs here as it is. Never raises for how the
        step ended: slurmctld down or a node that cannot take the step is srun's exit 1."""
        command = validate_argv(argv)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if self.dry_run:
            self.planned.append(command)
            return StepResult(0, f"dry run, not run: {' '.join(command)}")
        self.steps_run += 1
        if command[0] != "srun":
            return step_result(command, {"PATH": STEP_PATH, "LANG": "C"}, float(timeout_s))
        opts = list(takewhile(lambda a: a.startswith("-"), command[1:]))
        rest = command[1 + len(opts):]
        node = next((a.split("=", 1)[1] for a in opts if a.startswith(("--nodelist=", "-w="))), "")
        if not self._ctld_up:
            return StepResult(1, "srun: error: Unable to contact slurm controller (connect failure)")
        info = self._nodes.get(node)
        if info is None or info.down or not info.responding or not rest:
            return StepResult(1, f"srun: error: Unable to allocate resources: node {node!r} is not available")
        if self.step is not None:
            return self.step(node, rest, float(timeout_s))
        return step_result(rest, {"PATH": STEP_PATH, "LANG": "C", "SLURMD_NODENAME": node}, float(timeout_s))

    # -- the engine's side: layout ----------------------------------------------------------------

    @property
    def node_names(self) -> list[str]:
        return list(self._nodes)

    @property
    def partitions(self) -> dict[str, tuple[str, ...]]:
        """partition -> its nodes, in the fleet's order."""
        return dict(self._parts)

    @property
    def topology(self) -> dict[str, str]:
        """node -> its leaf switch (empty without a topology)."""
        return dict(self._topology)

    def topology_conf(self) -> str:
        """The topology as Slurm's topology.conf (tree plugin; see topology_conf)."""
        return topology_conf(self._topology, list(self._nodes))


def topology_conf(leaf_of: Mapping[str, str], order: Sequence[str]) -> str:
    """topology.conf (tree plugin) for node -> leaf switch: one line per leaf switch with its nodes
    (in `order`), and a top switch over the leaves when there are several; '' for no topology."""
    leaves: dict[str, list[str]] = {}
    for node in order:
        if node in leaf_of:
            leaves.setdefault(leaf_of[node], []).append(node)
    lines = [f"SwitchName={leaf} Nodes={slurm_hostlist(members)}" for leaf, members in leaves.items()]
    if len(leaves) > 1:
        lines.append(f"SwitchName=top Switches={','.join(leaves)}")
    return "\n".join(lines) + "\n" if lines else ""


__all__ = ["FINISHED_STATES", "NOT_RESPONDING", "SIM_VERSION", "SLURM_USER", "SimReservation", "SimSlurm",
           "topology_conf"]
