"""Hot spares: per partition, a few validated idle nodes held out of general scheduling in
reservations healthd owns, released next to a node healthd removes so that a requeued job restarts in
the same place in the network.

Pure decisions over values, as policy's: nothing here reads Slurm, the ledger or the clock. Each is a
`Decision` of the action table (healthd.controller.actions) carrying its evidence, gated like any other
write (the mode gate: observe only records; the capacity gate on a reserve):

- `keep_pool`: which idle healthy nodes to reserve so that each configured partition has its pool
  (`policy.spares`), and which spares to give back: one no longer fit to be a spare (drained, down,
  not responding, unhealthy, in use), one over the pool's size, and any while the partition is below
  its capacity floor. A reserve never takes a partition (any partition the node is in) below its
  floor: the spares held already count as out of service. Candidates are spread over the leaf
  switches (a leaf without a spare first, then a rack group without one), then the most recently
  validated, then by name.
- `release_for`: the spare to release when healthd removes a node from a partition: one under the
  same leaf switch (topology.conf), else in the same rack group (`policy.racks`), else (the pool's
  `placement: nearest`) any validated one, else none; the decision (a `none` when there is no such
  spare) says which and why.
- `revalidation_due` and `revalidate`: the spares whose last validation pass is older than half of
  `validated_within_h` (or that have none), validated again in their own reservation before the pass
  they hold expires, at most `revalidate_at_once` per pool at a time (`spare-validate`: the round
  hands an allowed one to the reintegrator's validation). A pass is the spare's new validation time;
  a failure (`validations` reads both back from the ledger) keeps the spare out of use and drains it
  (`redrain`, under the incident its failure opened); once healthd holds it, `keep_pool` gives its
  reservation back and refills the pool.

One reservation per spare, `<reservation>_<node>`: releasing a spare is deleting its reservation, one
existing backend call, and no other spare is ever out of its reservation meanwhile. The reservation
lasts `validated_within_h`: should healthd stop, its spares return to service by themselves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from healthd.controller.actions import Decision
from healthd.model import Evidence
from healthd.slurm.backend import NodeInfo, validate_reservation_name
from healthd.slurm.topology import Topology

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")
NOT_SPARE_FLAGS = frozenset({"DRAIN", "NOT_RESPONDING", "REBOOT_REQUESTED", "REBOOT_ISSUED", "COMPLETING",
                             "POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "POWER_DOWN", "FAIL", "MAINT",
                             "MAINTENANCE", "RESERVED", "PLANNED", "INVALID_REG", "CLOUD"})
"""A node showing any of these is not taken as a spare (in a reservation already, on its way out of
service, or not there); a spare of healthd's that shows one other than its own reservation's is
given back."""
# what a node in healthd's MAINT reservation shows (Slurm 22.05: IDLE+MAINTENANCE+RESERVED, a few
# seconds after the reservation is made, once slurmctld's periodic pass starts it)
_OWN_RESERVATION_FLAGS = frozenset({"MAINT", "MAINTENANCE", "RESERVED"})
KINDS = ("spare-reserve", "spare-release", "spare-validate")
"""The actions of the hot-spare step: all it reads of the ledger's actions."""
PLACEMENTS = ("nearest", "in-place")
RELEASE_WINDOW_S = 600.0
"""A removal whose spare was not released (the controller stopped between deciding the release and
making it) is owed one in the rounds after it, for this long after the removal."""
RENEW_BEFORE_S = 300.0
"""A spare is given back this long before its reservation ends (and the pool refilled, by another node
while RELEASE_GRACE_S runs): a spare is never a node Slurm no longer reserves."""
RELEASE_GRACE_S = 600.0
"""A spare given back is not taken into a pool again for this long: the requeued job it was released
for needs time to start on it (Slurm holds a requeued job before it runs again)."""


@dataclass(frozen=True)
class SparePool:
    """One partition's hot spares (`policy.spares.<partition>`)."""

    size: int = 1
    """How many spares to keep in the partition's pool (never taking it below its capacity floor)."""
    validated_within_h: float = 24.0
    """A spare is released for a removed node only when its last validation passed within this many
    hours; it is revalidated once that pass is older than half of it. Its reservation lasts this long
    (spares return to service by themselves should healthd stop); healthd gives a spare back 5 minutes
    before its reservation ends and refills the pool."""
    reservation: str = ""
    """Prefix of the reservations healthd keeps the pool's spares in, one per spare:
    `<reservation>_<node>`. Empty: `healthd_spare_<partition>`. healthd owns exactly the reservations
    its ledger records under this prefix."""
    revalidate_at_once: int = 1
    """How many of the pool's spares may run their revalidation at the same time (a spare under
    validation is not released for a removed node)."""
    placement: str = "nearest"
    """Which spare a removed node gets: `nearest`, the one under its leaf switch, else in its rack
    group, else any validated spare of the pool (a job restarted a leaf away beats one waiting for a
    node to come free); `in-place`, only under its leaf switch or in its rack group (none else: a site
    whose jobs must keep their place in the network)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"spares placement: expected {' or '.join(PLACEMENTS)}, found {self.placement!r}")
        for name, low in (("size", 0), ("revalidate_at_once", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1024:
                raise ValueError(f"spares {name}: expected an integer from {low} to 1024, found {value!r}")
        if not 1 / 60 <= self.validated_within_h <= 8760:
            raise ValueError(f"spares validated_within_h: expected 1 minute to 8760 hours, found {self.validated_within_h!r}")
        if self.reservation and not _NAME.fullmatch(self.reservation):
            raise ValueError(f"spares reservation {self.reservation!r}: 1-40 letters, digits and ._-, "
                             "starting with a letter or digit")

    def prefix(self, partition: str) -> str:
        return self.reservation or f"healthd_spare_{partition}"

    def reservation_for(self, partition: str, node: str) -> str:
        return f"{self.prefix(partition)}_{node}"

    @property
    def minutes(self) -> int:
        return max(1, int(self.validated_within_h * 60))


@dataclass(frozen=True)
class Spare:
    """A node in one of healthd's spare reservations, as its ledger records it."""

    node: str
    partition: str
    reservation: str
    reserved_at: float
    validated_at: float | None = None
    """When its last validation passed; None: not validated yet (not released for a removed node)."""


@dataclass(frozen=True)
class SpareWorld:
    """What the spare decisions read, as values."""

    nodes: Mapping[str, NodeInfo]
    """node -> Slurm's view of it."""
    partitions: Mapping[str, frozenset[str]]
    """partition -> its nodes."""
    spares: Mapping[str, Spare] = field(default_factory=dict)
    """node -> its spare record (healthd's by record)."""
    healthy: frozenset[str] = frozenset()
    """Nodes whose fresh report says healthy."""
    unhealthy: frozenset[str] = frozenset()
    """Nodes whose fresh report says anything else (degraded, failed, unknown)."""
    busy: frozenset[str] = frozenset()
    """Nodes healthd has business with (held, an open incident, a reintegration): never spares."""
    out_of_service: frozenset[str] = frozenset()
    """Nodes the capacity floor counts as gone besides the spares (drained, down, healthd's removals)."""
    floors: Mapping[str, int] = field(default_factory=dict)
    """partition -> its capacity floor (policy.capacity_floors)."""
    validated: Mapping[str, float] = field(default_factory=dict)
    """node -> when its latest validation passed (a reintegration, a spare's revalidation)."""
    validating: frozenset[str] = frozenset()
    """Spares whose revalidation runs now."""
    failed: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Spare -> (the Slurm reason to drain it with, the incident) when its latest revalidation failed."""
    released_at: Mapping[str, float] = field(default_factory=dict)
    """node -> when its latest spare reservation was given back (a new one is a new ledger series)."""
    topology: Topology = Topology()
    racks: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """rack group -> its nodes (policy.racks): the fallback where topology.conf names no leaf."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "spares", MappingProxyType(dict(self.spares)))

    def racks_of(self, node: str) -> tuple[str, ...]:
        return tuple(sorted(r for r, members in self.racks.items() if node in members))

    def partitions_of(self, node: str) -> tuple[str, ...]:
        return tuple(sorted(p for p, members in self.partitions.items() if node in members))


def _ev(text: str, **data: object) -> Evidence:
    return Evidence("state", text, dict(data))


def fit(node: str, world: SpareWorld) -> str:
    """Why `node` cannot be a spare ('' when it can): idle (a spare already held may run root's
    validation), no flag of NOT_SPARE_FLAGS but its own reservation's, a fresh healthy report (a spare
    held already: no fresh report that is not healthy), nothing healthd is doing with it."""
    info = world.nodes.get(node)
    if info is None:
        return "Slurm does not show it"
    spare = node in world.spares
    flags = sorted(info.flags & (NOT_SPARE_FLAGS - (_OWN_RESERVATION_FLAGS if spare else frozenset())))
    if flags:
        return f"it shows {'+'.join(flags)}"
    # only root runs in a spare's reservation: a spare at work is being validated
    if info.state != "idle" and not (spare and info.state in ("allocated", "mixed")):
        return f"it is {info.state}"
    if node in world.out_of_service:
        return "it is out of service"
    if node in world.unhealthy:
        return "its fresh report is not healthy"
    # a spare is kept while its agent is unheard (a controller that just restarted has no report yet)
    if not spare and node not in world.healthy:
        return "no fresh healthy report"
    if node in world.busy:
        return "healthd holds it or has an incident or reintegration open on it"
    return ""


def _headroom(partition: str, world: SpareWorld, taken: frozenset[str]) -> int | None:
    """How many more nodes the partition can lose before its floor (None: no floor)."""
    floor = world.floors.get(partition)
    if floor is None:
        return None
    members = world.partitions.get(partition, frozenset())
    gone = members & (world.out_of_service | taken)
    return len(members) - len(gone) - floor


def _release(partition: str, spare: Spare, why: str, now: float, incident: str = "",
             evidence: Iterable[Evidence] = ()) -> Decision:
    # one series per spare episode: the node may be a spare again later
    return Decision(id=f"spare-release:{partition}:{spare.node}", kind="spare-release", node=spare.node,
                    reason=f"healthd: spare released: {why}", tier=1, incident=incident, decided_at=now,
                    target=spare.reservation, evidence=(*evidence, _ev(why, partition=partition)),
                    series=f"spare-release:{spare.reservation}@{spare.reserved_at:.0f}",
                    detail={"partition": partition, "why": why, "reservation": spare.reservation,
                            "incident": incident})


def keep_pool(pools: Mapping[str, SparePool], world: SpareWorld, now: float) -> tuple[Decision, ...]:
    """The reserves that fill each pool and the releases that give back what must not stay a spare."""
    out: list[Decision] = []
    held = dict(world.spares)
    for node, spare in sorted(world.spares.items(), key=lambda kv: (kv[1].partition, kv[0])):
        unfit = fit(node, world)
        pool = pools.get(spare.partition)
        ends = spare.reserved_at + pool.minutes * 60 if pool is not None else 0.0
        why = (f"partition {spare.partition} has no spare pool configured" if pool is None
               else f"{node} can no longer be a spare: {unfit}" if unfit
               else f"its reservation ends in {max(0.0, ends - now):.0f} s" if now >= ends - RENEW_BEFORE_S else "")
        if why:
            out.append(_release(spare.partition, spare, why, now))
            del held[node]
    for partition, pool in sorted(pools.items()):
        mine = sorted((s for s in held.values() if s.partition == partition),
                      key=lambda s: (s.validated_at is None, -(s.validated_at or 0.0), s.node))
        taken = frozenset(held)
        room = _headroom(partition, world, taken)
        # below the floor, spares are capacity: give back as many as it takes, the least validated first
        while mine and room is not None and room < 0:
            s = mine.pop()
            out.append(_release(partition, s, f"partition {partition} is below its capacity floor "
                                f"{world.floors[partition]}", now))
            del held[s.node]
            room += 1
        while len(mine) > pool.size:
            s = mine.pop()
            out.append(_release(partition, s, f"the pool of {partition} holds {len(mine) + 1}, more than its "
                                f"size {pool.size}", now))
            del held[s.node]
        want = pool.size - len(mine)
        refused = {n for n, t in world.released_at.items() if now - t < RELEASE_GRACE_S}
        while want > 0:  # one at a time: each pick changes which leaf switches a spare covers
            node = next((n for n in _candidates(partition, world, frozenset(held)) if n not in refused), None)
            if node is None:
                break
            taken = frozenset(held) | {node}
            if any((r := _headroom(p, world, taken)) is not None and r < 0 for p in world.partitions_of(node)):
                refused.add(node)
                continue
            reservation = pool.reservation_for(partition, node)
            try:
                validate_reservation_name(reservation)
            except ValueError:  # a node name too long for Slurm's reservation names: never a spare
                refused.add(node)
                continue
            where = _place(node, world)
            out.append(Decision(
                id=f"spare-reserve:{partition}:{node}", kind="spare-reserve", node=node,
                reason=f"healthd: hot spare for {partition}", tier=1, decided_at=now, target=reservation,
                series=f"spare-reserve:{reservation}@{world.released_at.get(node, 0.0):.0f}",
                evidence=(_ev(f"{node} is idle and healthy{where}", partition=partition),
                          _ev(f"pool of {partition}: {len(mine)} of {pool.size} spares",
                              partition=partition, size=pool.size, held=len(mine))),
                detail={"partition": partition, "minutes": pool.minutes, "reservation": reservation,
                        "validated_at": world.validated.get(node)}))
            held[node] = Spare(node, partition, reservation, now, world.validated.get(node))
            mine.append(held[node])
            want -= 1
    return tuple(out)


def _place(node: str, world: SpareWorld) -> str:
    leaf = world.topology.leaf_of(node)
    if leaf:
        return f", under leaf switch {leaf}"
    racks = world.racks_of(node)
    return f", in rack group {racks[0]}" if racks else ""


def _candidates(partition: str, world: SpareWorld, held: frozenset[str]) -> list[str]:
    """The partition's nodes that could be spares, best first: a leaf switch (else a rack group) no
    spare covers yet, then the most recently validated, then by name."""
    covered_leaves = {leaf for n in held for leaf in world.topology.leaves.get(n, ())}
    covered_racks = {r for n in held for r in world.racks_of(n)}
    out = []
    for node in world.partitions.get(partition, frozenset()):
        if node in held or node in world.spares or fit(node, world):  # a spare given back this round stays out
            continue
        leaves = world.topology.leaves.get(node, ())
        new_leaf = bool(leaves) and not covered_leaves.intersection(leaves)
        new_rack = bool(world.racks_of(node)) and not covered_racks.intersection(world.racks_of(node))
        out.append((not new_leaf, not new_rack, -world.validated.get(node, float("-inf")), node))
    return [node for *_, node in sorted(out)]


def _usable(spare: Spare, pool: SparePool, world: SpareWorld, now: float) -> bool:
    info = world.nodes.get(spare.node)
    return (spare.validated_at is not None and now - spare.validated_at <= pool.validated_within_h * 3600
            and spare.node not in world.failed and spare.node not in world.validating
            and not fit(spare.node, world) and info is not None and info.state == "idle")


def release_for(removed: str, incident: str, pools: Mapping[str, SparePool], world: SpareWorld, now: float,
                taken: frozenset[str] = frozenset()) -> Decision | None:
    """The spare to release because healthd removes `removed` (under `incident`): same leaf switch,
    else same rack group, else any (`placement: nearest`); a `none` decision saying why when the
    partition has a pool but no such spare. None when no partition of `removed` has a pool. `taken`:
    spares released earlier in the round."""
    parts = [p for p in world.partitions_of(removed) if p in pools]
    if not parts:
        return None
    leaves = world.topology.leaves.get(removed, ())
    racks = world.racks_of(removed)
    best: tuple[tuple, Spare, str] | None = None
    usable = 0
    for spare in world.spares.values():
        if spare.partition not in parts or spare.node in taken or spare.node == removed \
                or not _usable(spare, pools[spare.partition], world, now):
            continue
        usable += 1
        shared_leaf = set(leaves).intersection(world.topology.leaves.get(spare.node, ()))
        shared_rack = set(racks).intersection(world.racks_of(spare.node))
        if shared_leaf:
            how, rank = f"under the same leaf switch {sorted(shared_leaf)[0]}", 0
        elif shared_rack:
            how, rank = f"in the same rack group {sorted(shared_rack)[0]}", 1
        elif pools[spare.partition].placement == "nearest":
            how, rank = "the nearest validated spare (none shares its leaf switch or rack group)", 2
        else:
            continue
        key = (rank, -(spare.validated_at or 0.0), spare.node)
        if best is None or key < best[0]:
            best = (key, spare, how)
    if best is not None:
        _, spare, how = best
        return _release(spare.partition, spare, f"{removed} removed [#{incident}]; {spare.node} is {how}", now,
                        incident, (_ev(f"{spare.node} last validated at {spare.validated_at:.0f}",
                                       validated_at=spare.validated_at),))
    where = (f"leaf switch {leaves[0]}" if leaves else "no leaf switch in topology.conf") + \
        (f", rack group {racks[0]}" if racks else ", no rack group")
    why = (f"no validated spare of {', '.join(parts)} shares {removed}'s place ({where}); "
           f"{usable} validated spare(s) elsewhere are kept")
    return Decision(id=f"spare-release:{parts[0]}:for:{removed}", kind="none", about="spare-release", node=removed,
                    reason="", tier=1, incident=incident, decided_at=now, note=why, evidence=(_ev(why),),
                    detail={"partition": parts[0], "why": why})


def decide(pools: Mapping[str, SparePool], world: SpareWorld, removals: Iterable[tuple[str, str]],
           now: float) -> tuple[Decision, ...]:
    """The round's spare decisions: first a release for each node healthd removes ((node, incident),
    in order, each taking a different spare), then the pool kept over what is left (the removed nodes
    counted out of service, so a released spare is replaced in the same round where a node allows),
    then the drain of each spare whose revalidation failed and the revalidations due among the spares
    kept."""
    out: list[Decision] = []
    taken: set[str] = set()
    removed: set[str] = set()
    for node, incident in removals:
        removed.add(node)
        d = release_for(node, incident, pools, world, now, frozenset(taken))
        if d is not None:
            out.append(d)
            if d.kind == "spare-release":
                taken.add(d.node)
    # a spare released for a removal is the requeued job's to take, not the pool's again
    rest = dataclasses.replace(world, spares={n: s for n, s in world.spares.items() if n not in taken},
                               out_of_service=world.out_of_service | removed, busy=world.busy | taken,
                               released_at={**world.released_at, **dict.fromkeys(taken, now)})
    kept = keep_pool(pools, rest, now)
    gone = {d.node for d in kept if d.kind == "spare-release"}
    rest = dataclasses.replace(rest, spares={n: s for n, s in rest.spares.items() if n not in gone})
    return (*out, *kept, *drains(rest, now), *revalidate(pools, rest, now))


def owed(holds: Iterable[tuple[str, int | None, float]], actions: Iterable[_Recorded], now: float,
         done: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(node, incident) of each removal still owed a spare decision: a node healthd holds since at most
    RELEASE_WINDOW_S whose incident no applied spare release (nor a failed spare validation, whose drain
    removed a spare) names, apart from the nodes in `done`
    (removed this round). A removal no spare could serve is decided again each round of the window (the
    ledger records the same decision once); one a spare served is not."""
    # a spare drained after a failed revalidation was out of service already: owed nothing
    served = {str(a.evidence.get("incident")) for a in actions if isinstance(a.evidence, Mapping) and (
              (a.kind == "spare-release" and a.status == "applied") or (a.kind == "spare-validate" and a.status == "failed"))}
    skip = set(done)
    return sorted((node, str(incident)) for node, incident, since in holds
                  if incident is not None and node not in skip and now - since <= RELEASE_WINDOW_S
                  and str(incident) not in served)


def world_of(*, nodes: Mapping[str, NodeInfo], partitions: Mapping[str, frozenset[str]],
             healthy: Iterable[str], unhealthy: Iterable[str], busy: Iterable[str], out_of_service: Iterable[str],
             floors: Mapping[str, int], actions: Iterable[_Recorded], validated: Mapping[str, float],
             topology: Topology, racks: Mapping[str, frozenset[str]],
             validating: Iterable[str] = ()) -> SpareWorld:
    """The SpareWorld of a round, the spares read from the ledger's actions (recorded_spares), their
    revalidations' passes added to `validated` and their failures read back (validations)."""
    actions = list(actions)
    passed, failures = validations(actions)
    validated = {**validated, **{n: max(t, validated.get(n, t)) for n, t in passed.items()}}
    spares, released = recorded_spares(actions, validated)
    failed = {n: f for n, f in failures.items() if n in spares and f[0] >= spares[n].reserved_at}
    return SpareWorld(nodes=nodes, partitions=partitions, spares=spares, healthy=frozenset(healthy),
                      unhealthy=frozenset(unhealthy),
                      busy=frozenset(busy), out_of_service=frozenset(out_of_service), floors=floors,
                      validated=validated, released_at=released, topology=topology, racks=racks,
                      validating=frozenset(validating), failed={n: f[1:] for n, f in failed.items()})


# --------------------------------------------------------------------------- from the ledger


class _Recorded(Protocol):
    """What `recorded_spares` reads of a ledger action."""

    node: str
    kind: str
    status: str
    evidence: Any
    applied_at: float | None
    id: int


def recorded_spares(actions: Iterable[_Recorded], validated: Mapping[str, float]) -> tuple[dict[str, Spare],
                                                                                           dict[str, float]]:
    """Ownership by record: the spares are the nodes whose latest applied spare action is a reserve
    (node -> Spare, its validation the later of the reserve's and `validated`'s), and when each
    node's latest spare was given back."""
    spares: dict[str, Spare] = {}
    released: dict[str, float] = {}
    for a in sorted((a for a in actions if a.status == "applied" and a.kind in ("spare-reserve", "spare-release")),
                    key=lambda a: (a.applied_at or 0.0, a.id)):
        ev = a.evidence if isinstance(a.evidence, Mapping) else {}
        if a.kind == "spare-release":
            spares.pop(a.node, None)
            released[a.node] = a.applied_at or 0.0
            continue
        reservation, partition = ev.get("reservation"), ev.get("partition")
        if not isinstance(reservation, str) or not isinstance(partition, str):
            continue  # a damaged record: not healthd's by record, so never touched
        spares[a.node] = Spare(a.node, partition, reservation, a.applied_at or 0.0, _number(ev.get("validated_at")))
    for node, spare in spares.items():
        known = [t for t in (spare.validated_at, validated.get(node)) if t is not None]
        spares[node] = Spare(spare.node, spare.partition, spare.reservation, spare.reserved_at, max(known, default=None))
    return spares, released


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def revalidation_due(pools: Mapping[str, SparePool], world: SpareWorld, now: float) -> tuple[Spare, ...]:
    """The spares to validate again: never validated, or their last pass older than half of
    `validated_within_h`; oldest first. Not one whose validation runs now or failed."""
    due = [s for s in world.spares.values() if s.partition in pools and not fit(s.node, world)
           and s.node not in world.validating and s.node not in world.failed
           and (s.validated_at is None or now - s.validated_at > pools[s.partition].validated_within_h * 1800)]
    return tuple(sorted(due, key=lambda s: (s.validated_at or float("-inf"), s.node)))


def revalidate(pools: Mapping[str, SparePool], world: SpareWorld, now: float) -> tuple[Decision, ...]:
    """A `spare-validate` for each spare due (revalidation_due), oldest pass first, as many per pool as
    `revalidate_at_once` leaves beside the validations running. Only an idle spare: the validation
    takes the whole node (a spare at work is running one already)."""
    out: list[Decision] = []
    running = {p: sum(1 for n in world.validating if n in world.spares and world.spares[n].partition == p)
               for p in pools}
    for s in revalidation_due(pools, world, now):
        pool = pools[s.partition]
        info = world.nodes.get(s.node)
        if running[s.partition] >= pool.revalidate_at_once or info is None or info.state != "idle":
            continue
        running[s.partition] += 1
        last = "never validated" if s.validated_at is None else \
            f"last validation passed {(now - s.validated_at) / 3600:.1f} h ago"
        why = f"{s.node} ({last}) is due for revalidation: every {pool.validated_within_h / 2:g} h"
        out.append(Decision(
            id=f"spare-validate:{s.partition}:{s.node}", kind="spare-validate", node=s.node,
            reason=f"healthd: {why}; validated in {s.reservation}", tier=1, decided_at=now, target=s.reservation,
            # one series per pass held: a pass starts the next, an attempt a restart cut off is retried
            series=f"spare-validate:{s.reservation}@{s.validated_at if s.validated_at is not None else s.reserved_at:.0f}",
            evidence=(_ev(why, partition=s.partition, validated_at=s.validated_at),),
            detail={"partition": s.partition, "reservation": s.reservation, "validated_at": s.validated_at}))
    return tuple(out)


def drains(world: SpareWorld, now: float) -> tuple[Decision, ...]:
    """A `redrain` of each spare whose revalidation failed, until healthd holds it (out of users' reach
    in its reservation until then), under the incident the failure opened, its reason naming what
    failed."""
    out = []
    for node, (reason, incident) in sorted(world.failed.items()):
        spare = world.spares.get(node)
        if spare is None or node in world.busy:
            continue
        out.append(Decision(
            id=f"spare-validate:{spare.partition}:{node}:drain", kind="redrain", node=node, reason=reason, tier=1,
            incident=incident, decided_at=now, series=f"spare-validate-drain:{spare.reservation}@{spare.reserved_at:.0f}",
            evidence=(_ev(f"{node} failed its revalidation as a spare of {spare.partition}", partition=spare.partition),),
            detail={"partition": spare.partition, "reservation": spare.reservation}))
    return tuple(out)


FAILED_SIGNATURE = "spare-validation:"
"""The signature prefix of the incident a failed spare revalidation opens (`spare-validation:<node>`):
like a failed reintegration's, it waits for `healthctl repaired`, never reintegrated by itself."""


def validations(actions: Iterable[_Recorded]) -> tuple[dict[str, float], dict[str, tuple[float, str, str]]]:
    """The spares' revalidations by the ledger: node -> when its latest passed (an applied
    `spare-validate`), and node -> (when, the reason to drain it with, its incident) for a node whose
    latest one failed."""
    passed: dict[str, float] = {}
    latest: dict[str, _Recorded] = {}
    for a in sorted((a for a in actions if a.kind == "spare-validate" and a.status in ("applied", "failed")),
                    key=lambda a: (_at(a), a.id)):
        latest[a.node] = a
        if a.status == "applied":
            passed[a.node] = _at(a)
    failed = {}
    for node, a in latest.items():
        ev = a.evidence if isinstance(a.evidence, Mapping) else {}
        if a.status == "failed" and isinstance(ev.get("reason"), str) and isinstance(ev.get("incident"), str):
            failed[node] = (_at(a), ev["reason"], ev["incident"])
    return passed, failed


def _at(a: _Recorded) -> float:
    return a.applied_at if a.applied_at is not None else float(getattr(a, "failed_at", None) or 0.0)
