"""In-band signals at the controller: the training jobs' own step progress, compared job-wide.

An agent reads the step records of the ranks on its node and sends them in its report's `inband`
section (healthd.report_schema checks it). It judges the jobs whose ranks all run on its node itself
(its own `inband.*` findings); a job spread over several nodes is judged here, where every node's
ranks meet:

- `jobs_from_json` turns a report's checked section into values (`JobProgress`, one per job).
- `merge` joins the fresh reports' ranks per job (a rank two nodes report: the newer report wins).
- `straggler_flags` runs healthd.progress.stragglers over a multi-node job's ranks; `findings_for`
  makes each flagged rank a finding for the rank's node with the agent's id scheme and tiering:
  `inband.straggler:gpu<i>` (or `:node`), T3 and action `none` on in-band evidence alone, T2 and
  `drain` only when the rank's node corroborates it with out-of-band evidence on that GPU or rail
  (attribution hardware or fabric). Slow ranks of one job on two or more nodes under one topology
  group are one fabric incident: each of their findings names the group.
- `hangs` runs healthd.progress.hang over a job's ranks from every node (ages brought forward to
  `now` by how old each report is).
- `node_ratio` measures one node's ranks against their job's median (the ratio stragglers compares),
  and `slowest_on` names the worst straggler flag or finding on a node: the in-band evidence a
  reintegration's probation records (healthd.controller.reintegrate).

Those are pure. `HangResponder` is the one stateful part: it proposes the requeue of a hung job that
opted in, once per job and stall step (a ledger action keyed `requeue-hang:<job>:<step>`), for the
round to gate like any decision (the mode, the breaker and the kind's own hourly budget); any other
hang is recorded and alerted once. A hang never drains a node: without out-of-band evidence nothing
says which node is at fault.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from healthd import progress
from healthd.controller.actions import Decision, next_attempt
from healthd.controller.ledger import Ledger
from healthd.model import NODE, Component, Evidence, Finding
from healthd.progress import THROTTLE_WORDS, Hang, RankProgress, RankWindow, Straggler
from healthd.settings import DetectorSettings
from healthd.text import natural_key
from healthd.slurm.backend import JobInfo, SlurmError

_log = logging.getLogger("healthd.controller.inband")

STRAGGLER_PREFIX = "inband.straggler:"
HANG_PREFIX = "inband.hang:"
HANG_KEY_PREFIX = "requeue-hang:"
"""Idempotency key (and decision id) of a hung job's requeue: `requeue-hang:<job>:<step>`."""
HANG_DECISION_KIND = "requeue-hang"
MAX_EVIDENCE_PER_FINDING = 64
"""Evidence items one injected finding carries (several slow ranks on one GPU or node add theirs)."""

_GROUP_WORDS = {"switch": "under switch", "rack": "in rack", "pdu": "on PDU", "rail": "on rail"}
_FABRIC_WORDS = ("infiniband", "mlx", "rail", "port", "link", "roce", "fabric", "hca", " ib ", "ib:")


# --------------------------------------------------------------------------- the report's section


@dataclass(frozen=True)
class RankState:
    """One rank of a job as its node reported it."""

    progress: RankProgress
    windows: tuple[RankWindow, ...] = ()
    """The rank's recent complete windows, oldest first."""
    local_rank: int | None = None
    gpu: int | None = None
    """The GPU index on its node; None when the agent could not tell (it sends -1)."""
    pid: int | None = None
    rail: str | None = None
    """The HCA port the rank's traffic leaves by (`mlx5_0/1`), when known."""
    corroboration: tuple[str, ...] = ()
    """Out-of-band evidence the node has on this rank's GPU or rail, one line each (empty: none)."""
    lost: int = 0
    torn: int = 0

    @property
    def rank(self) -> int:
        return self.progress.rank


@dataclass(frozen=True)
class JobProgress:
    """One job's in-band data from one node's report."""

    job: str
    ranks: tuple[RankState, ...] = ()
    world_size: int | None = None
    ranks_here: int = 0
    step_median_s: float | None = None
    stragglers: tuple[Straggler, ...] = ()
    """The agent's own verdict over the ranks on its node."""
    hang: Hang | None = None
    errors: tuple[str, ...] = ()


def _window(doc: Mapping[str, Any], rank: int) -> RankWindow:
    waits = doc.get("waits")
    return RankWindow(rank=rank, window=doc["window"], steps=doc["steps"], compute_s=float(doc["compute_s"]),
                      step_s=float(doc["step_s"]), wait_s=float(doc["wait_s"]),
                      waits=tuple(float(w) for w in waits) if waits is not None else None)


def _rank(doc: Mapping[str, Any]) -> RankState:
    rank = doc["rank"]
    median = doc.get("step_median_s")
    gpu = doc.get("gpu")
    return RankState(
        progress=RankProgress(rank=rank, last_step=doc["last_step"], last_step_age_s=float(doc["last_step_age_s"]),
                              phase=doc["phase"], phase_age_s=float(doc.get("phase_age_s") or 0.0),
                              step_median_s=float(median) if median is not None else None,
                              longest_save_s=float(doc.get("longest_save_s") or 0.0),
                              longest_step_s=_seconds(doc.get("longest_step_s"))),
        windows=tuple(sorted((_window(w, rank) for w in doc.get("windows") or ()), key=lambda w: w.window)),
        local_rank=doc.get("local_rank"),
        gpu=gpu if gpu is not None and gpu >= 0 else None,
        pid=doc.get("pid"),
        rail=doc.get("rail"),
        corroboration=tuple(doc.get("corroboration") or ()),
        lost=doc.get("lost") or 0,
        torn=doc.get("torn") or 0,
    )


def _seconds(v: Any) -> float:
    """An optional duration a newer agent sends beside the checked fields: a finite number of seconds,
    else 0 (an older agent's report has none)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return 0.0
    return float(v)


def _straggler(doc: Mapping[str, Any]) -> Straggler:
    p = doc.get("p_value")
    return Straggler(rank=doc["rank"], test=doc["test"], windows=tuple(doc["windows"]), effect=float(doc["effect"]),
                     threshold=float(doc["threshold"]), last_in=doc.get("last_in") or 0,
                     of_steps=doc.get("of_steps") or 0, p_value=float(p) if p is not None else None)


def _hang(doc: Mapping[str, Any] | None) -> Hang | None:
    if doc is None:
        return None
    return Hang(step=doc["step"], stalled_s=float(doc["stalled_s"]), bound_s=float(doc["bound_s"]),
                behind=tuple(doc["behind"]),
                phases=MappingProxyType({int(k): v for k, v in (doc.get("phases") or {}).items()}))


def jobs_from_json(section: Any) -> tuple[JobProgress, ...]:
    """A report's `inband` section, already checked (healthd.report_schema), as values; () when the
    report has none (an agent from before in-band signals)."""
    if not section:
        return ()
    return tuple(
        JobProgress(job=j["job"], ranks=tuple(_rank(r) for r in j["ranks"]),
                    world_size=j["world_size"] if (j.get("world_size") or 0) > 0 else None,
                    ranks_here=j.get("ranks_here") or 0, step_median_s=j.get("step_median_s"),
                    stragglers=tuple(_straggler(s) for s in j.get("stragglers") or ()), hang=_hang(j.get("hang")),
                    errors=tuple(j.get("errors") or ()))
        for j in section["jobs"]
    )


# --------------------------------------------------------------------------- one job across nodes


class _Report(Protocol):
    node: str
    received_at: float
    inband: tuple[JobProgress, ...]


@dataclass(frozen=True)
class PlacedRank:
    """A rank and the node whose report it came from."""

    node: str
    received_at: float
    state: RankState


@dataclass(frozen=True)
class JobView:
    """One job as the fleet's fresh reports show it."""

    job: str
    ranks: Mapping[int, PlacedRank]
    world_size: int | None = None
    agent_stragglers: Mapping[int, Straggler] = field(default_factory=dict)
    """rank -> the agent's flag, from the node the rank is placed on."""

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({p.node for p in self.ranks.values()}))


def merge(reports: Iterable[_Report], now: float, ttl_s: float) -> dict[str, JobView]:
    """job -> its ranks from every fresh report (received within `ttl_s` of `now`). A rank two nodes
    report (a job that moved, a requeue that landed elsewhere) is taken from the newer report."""
    placed: dict[str, dict[int, PlacedRank]] = {}
    world: dict[str, int] = {}
    flagged: dict[tuple[str, str, int], Straggler] = {}
    for report in sorted(reports, key=lambda r: (r.received_at, r.node)):
        if not report.inband or now - report.received_at > ttl_s:
            continue
        for jp in report.inband:
            ranks = placed.setdefault(jp.job, {})
            for state in jp.ranks:
                ranks[state.rank] = PlacedRank(report.node, report.received_at, state)
            if jp.world_size:
                world[jp.job] = max(world.get(jp.job, 0), jp.world_size)
            for s in jp.stragglers:
                flagged[(jp.job, report.node, s.rank)] = s
    out = {}
    for job, ranks in placed.items():
        mine = {r: s for (j, node, r), s in flagged.items() if j == job and r in ranks and ranks[r].node == node}
        out[job] = JobView(job=job, ranks=MappingProxyType(ranks), world_size=world.get(job),
                           agent_stragglers=MappingProxyType(mine))
    return out


@dataclass(frozen=True)
class Flag:
    """A rank flagged slow, where it runs."""

    job: str
    node: str
    state: RankState
    straggler: Straggler
    by_agent: bool = False
    """The node's agent flagged it (a job on one node): the agent reports its finding itself."""
    corroborated: tuple[str, ...] = ()
    """The node's corroboration lines that can explain this slowdown (`corroborating`)."""

    @property
    def tier(self) -> int:
        return 2 if self.corroborated else 3


_THROTTLE_STEPS = re.compile(r"begun between steps (-?\d+) and (-?\d+)$")


def corroborating(lines: Iterable[str], straggler: Straggler, window_steps: int) -> tuple[str, ...]:
    """The lines of a rank's corroboration that can explain its slowdown. A throttle's line (clocks
    held down) does only when the throttle began within a window of the slowdown's onset
    (healthd.progress.throttle_coincides, from the steps the agent saw it begin between); a line of
    an agent that does not say them, only at one read, explains nothing. The agent leaves out
    findings of the user's code."""
    onset = straggler.windows[0] if straggler.windows else -1
    out = []
    for line in lines:
        head, _, rest = line.partition(": ")
        if rest.startswith(THROTTLE_WORDS):
            m = _THROTTLE_STEPS.search(rest)
            if m is None or not progress.throttle_coincides(onset, int(m[1]), int(m[2]), window_steps):
                continue
        out.append(line)
    return tuple(out)


def straggler_flags(view: JobView, settings: DetectorSettings) -> tuple[Flag, ...]:
    """The job's slow ranks. A job on one node is its agent's to judge (the same windows, with that
    node's settings): its flags are taken as the agent sent them. A job on several nodes is compared
    here, every rank against the job's median."""
    ws = settings.window_steps
    if len(view.nodes) < 2:
        return tuple(Flag(view.job, view.ranks[r].node, view.ranks[r].state, s, by_agent=True,
                          corroborated=corroborating(view.ranks[r].state.corroboration, s, ws))
                     for r, s in sorted(view.agent_stragglers.items()))
    windows = {r: p.state.windows for r, p in view.ranks.items() if p.state.windows}
    if len(windows) < 2:
        return ()
    return tuple(Flag(view.job, view.ranks[s.rank].node, view.ranks[s.rank].state, s,
                      corroborated=corroborating(view.ranks[s.rank].state.corroboration, s, ws))
                 for s in progress.stragglers(windows, settings) if s.rank in view.ranks)


# --------------------------------------------------------------------------- flags -> findings


def group_label(group: str) -> str:
    """`switch:s1` -> `under switch s1` (rack, PDU likewise)."""
    kind, _, name = group.partition(":")
    return f"{_GROUP_WORDS.get(kind, kind)} {name}" if name else group


def shared_groups(flags: Iterable[Flag], groups: Mapping[str, frozenset[str]]) -> dict[tuple[str, int], tuple[str, int]]:
    """(job, rank) -> (group, slow ranks of the job it holds) for slow ranks of one job on two or more
    nodes under one topology group (healthd.controller.policy.FleetView.groups): what they share is the
    likelier cause than each of their nodes. The smallest groups are taken first (a leaf switch before
    the spine above it), each for the nodes no smaller group took, and only while it holds two of them;
    then, for the nodes left, the rail (`rail:<hca>`) slow ranks on two or more nodes share."""
    by_job: dict[str, list[Flag]] = {}
    for f in flags:
        if not f.by_agent:
            by_job.setdefault(f.job, []).append(f)
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for job, mine in by_job.items():
        free = {f.node for f in mine}
        if len(free) < 2:
            continue
        for name, members in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0])):
            hit = free & members
            if len(hit) < 2:
                continue
            free -= hit
            held = [f for f in mine if f.node in hit]
            for f in held:
                out[(job, f.state.rank)] = (name, len(held))
        # then the network rail: the same HCA on two or more nodes (a rail-optimised fabric wires the
        # HCA of each GPU index to its own leaf switch, which topology.conf may not name)
        by_rail: dict[str, list[Flag]] = {}
        for f in mine:
            if f.node in free and f.state.rail:
                by_rail.setdefault(f.state.rail.split("/", 1)[0], []).append(f)
        for rail, held in sorted(by_rail.items()):
            if len({f.node for f in held}) >= 2:
                for f in held:
                    out[(job, f.state.rank)] = (f"rail:{rail}", len(held))
    return out


def corroboration_attribution(lines: Iterable[str], rail: str | None) -> str:
    """`fabric` when every corroborating line is about the rank's rail or the network, else
    `hardware` (the GPU)."""
    lines = list(lines)
    if not lines:
        return "unknown"
    device = rail.split("/", 1)[0] if rail else None

    def about_fabric(text: str) -> bool:
        low = f" {text.lower()}"
        if rail and (text.startswith(rail) or (device and text.startswith(device))):
            return True
        if low.lstrip().startswith("gpu"):
            return False
        return any(w in low for w in _FABRIC_WORDS)

    return "fabric" if all(about_fabric(t) for t in lines) else "hardware"


def _windows_text(windows: tuple[int, ...]) -> str:
    if not windows:
        return "no window"
    return f"window {windows[0]}" if len(windows) == 1 else f"windows {windows[0]}-{windows[-1]}"


def _evidence(flag: Flag) -> list[Evidence]:
    s, st = flag.straggler, flag.state
    if s.test == "rank-order":
        how = (f"arrived last in {s.last_in} of {s.of_steps} steps (p={s.p_value:.2g}, bound {s.threshold:.2g})"
               if s.p_value is not None else f"arrived last in {s.last_in} of {s.of_steps} steps")
    else:
        how = f"compute {s.effect:.1%} above the job's median (threshold {s.threshold:.1%})"
    where = f"{flag.node} gpu{st.gpu}" if st.gpu is not None else flag.node
    data: dict[str, Any] = {"job": flag.job, "rank": st.rank, "node": flag.node, "test": s.test,
                            "windows": list(s.windows), "effect": s.effect, "threshold": s.threshold,
                            "last_step": st.progress.last_step}
    if st.gpu is not None:
        data["gpu"] = st.gpu
    if st.rail:
        data["rail"] = st.rail
    if s.test == "rank-order":
        data.update(last_in=s.last_in, of_steps=s.of_steps, p_value=s.p_value)
    out = [Evidence("inband", f"rank {st.rank} of job {flag.job} on {where}: {how} in {_windows_text(s.windows)} "
                              f"({s.test} test)", data)]
    out += [Evidence("inband", f"corroborated on {flag.node}: {line}", {"job": flag.job, "rank": st.rank})
            for line in flag.corroborated]
    out += [Evidence("inband", f"on {flag.node}, not with the slowdown's onset: {line}", {"job": flag.job, "rank": st.rank})
            for line in st.corroboration if line not in flag.corroborated]
    return out


def _finding_for(flag: Flag, group: tuple[str, int] | None, first_seen: float, now: float) -> Finding:
    st = flag.state
    component = Component(kind="gpu", index=st.gpu) if st.gpu is not None else NODE
    tier = flag.tier
    if group is not None:
        attribution = "fabric"
    else:
        attribution = corroboration_attribution(flag.corroborated, st.rail) if tier == 2 else "unknown"
    slow = f"rank {st.rank} of job {flag.job} slow ({flag.straggler.effect:+.1%} compute, {flag.straggler.test} test)"
    if group is not None:
        summary = f"one of {group[1]} slow ranks of job {flag.job} {group_label(group[0])}: {slow}"
    else:
        summary = f"in-band straggler: {slow}"
    if tier == 2:
        summary += f"; corroborated: {'; '.join(flag.corroborated)}"
    else:
        summary += "; in-band evidence only: recorded, never acts"
    return Finding(id=f"{STRAGGLER_PREFIX}{component.key()}", component=component, source="inband",
                   attribution=attribution, tier=tier, action="drain" if tier == 2 else "none",  # type: ignore[arg-type]
                   summary=summary[:2000], evidence=tuple(_evidence(flag)), first_seen=first_seen, last_seen=now,
                   job=flag.job)


def findings_for(flags: Iterable[Flag], groups: Mapping[str, frozenset[str]], now: float,
                 first_seen: Mapping[tuple[str, str], float] | None = None) -> dict[str, tuple[Finding, ...]]:
    """node -> the straggler findings of the ranks flagged here (not those the agents flagged: their
    findings are in their reports). Slow ranks on one GPU (or on one node whose GPUs are unknown)
    make one finding: the strongest (T2 before T3), with every rank's evidence. `first_seen`: when
    each (node, finding id) was first flagged in its current episode; unknown ones start at `now`."""
    flags = [f for f in flags if not f.by_agent]
    shared = shared_groups(flags, groups)
    first_seen = first_seen or {}
    by_id: dict[tuple[str, str], list[Finding]] = {}
    for f in sorted(flags, key=lambda f: (f.tier, f.job, f.state.rank)):
        comp = f"gpu{f.state.gpu}" if f.state.gpu is not None else "node"
        key = (f.node, f"{STRAGGLER_PREFIX}{comp}")
        made = _finding_for(f, shared.get((f.job, f.state.rank)), first_seen.get(key, now), now)
        by_id.setdefault(key, []).append(made)
    out: dict[str, list[Finding]] = {}
    for (node, _fid), made in sorted(by_id.items()):
        primary = made[0]
        if len(made) > 1:
            evidence = tuple(e for m in made for e in m.evidence)[:MAX_EVIDENCE_PER_FINDING]
            more = len(made) - 1
            primary = Finding(id=primary.id, component=primary.component, source=primary.source,
                              attribution=primary.attribution, tier=primary.tier, action=primary.action,
                              summary=f"{primary.summary} (and {more} more slow rank{'s' * (more > 1)} here)"[:2000],
                              evidence=evidence, first_seen=primary.first_seen, last_seen=now, job=primary.job)
        out.setdefault(node, []).append(primary)
    return {node: tuple(fs) for node, fs in out.items()}


# --------------------------------------------------------------------------- one node against its jobs


class NodeRatio(NamedTuple):
    """How a node's ranks compare with the rest of one job."""

    ratio: float
    """The node's slowest rank: the median, over the compared windows, of its compute time over the
    job's median compute time in that window (1.03: 3 % slower than the job's median)."""
    windows: int
    """Windows compared: held by one of the node's ranks and by a rank on another node."""
    job: str


def _computes(view: JobView) -> dict[int, dict[int, float]]:
    """window -> rank -> compute time, as healthd.progress.stragglers reads them (a window a rank
    repeats: the later one wins; a time that is not a finite positive number is left out)."""
    by_window: dict[int, dict[int, float]] = {}
    for rank, placed in view.ranks.items():
        for rw in placed.state.windows:
            c = rw.compute_s
            if isinstance(c, (int, float)) and math.isfinite(c) and c > 0.0:
                by_window.setdefault(rw.window, {})[rank] = float(c)
    return by_window


def job_node_ratio(view: JobView, node: str) -> NodeRatio | None:
    """The node's ranks against `view`'s median per window; None when the job has no rank on the node,
    none elsewhere, or no window both hold."""
    mine = {r for r, p in view.ranks.items() if p.node == node}
    if not mine or len(mine) == len(view.ranks):
        return None
    per_rank: dict[int, list[float]] = {}
    compared = 0
    for _w, got in sorted(_computes(view).items()):
        here = mine & got.keys()
        if not here or len(here) == len(got):
            continue  # no rank of the node in it, or no peer on another node to hold it against
        med = statistics.median(got.values())
        compared += 1
        for r in here:
            per_rank.setdefault(r, []).append(got[r] / med)
    if not compared:
        return None
    return NodeRatio(ratio=max(statistics.median(xs) for xs in per_rank.values()), windows=compared, job=view.job)


def node_ratio(jobs: Mapping[str, JobView], node: str) -> NodeRatio | None:
    """The node's ranks against their job's median (see NodeRatio) for the jobs with ranks on the node
    and on at least one other node; of several such jobs the one where the node does worst. None
    when no job compares it with another node (`alone_on` names the jobs on it alone)."""
    worst: NodeRatio | None = None
    for _job, view in sorted(jobs.items()):
        got = job_node_ratio(view, node)
        if got is not None and (worst is None or got.ratio > worst.ratio):
            worst = got
    return worst


def alone_on(jobs: Mapping[str, JobView], node: str) -> tuple[str, ...]:
    """The jobs whose every reported rank runs on `node`: nothing to compare the node with."""
    return tuple(job for job, view in sorted(jobs.items())
                 if view.ranks and all(p.node == node for p in view.ranks.values()))


def _finding_slowness(f: Finding) -> tuple[str, float | None]:
    job, effect = f.job, None
    for e in f.evidence:
        data = e.data or {}
        if job is None and data.get("job") is not None:
            job = str(data["job"])
        value = data.get("effect")
        if effect is None and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            effect = float(value)
    return job or "?", effect


def slowest_on(node: str, flags: Iterable[Flag], findings: Iterable[Finding] = ()) -> tuple[str, float | None] | None:
    """(job, compute above the job's median) of the worst slow rank on `node`: a flag of the round's
    job-wide comparison or the node's agent, or one of `findings` (the node's report) with a
    straggler id. The effect is None for a finding that does not say it. None: nothing flagged."""
    found: list[tuple[str, float | None]] = [(f.job, f.straggler.effect) for f in flags if f.node == node]
    found += [_finding_slowness(f) for f in findings if f.id.startswith(STRAGGLER_PREFIX)]
    if not found:
        return None
    return max(found, key=lambda jf: -math.inf if jf[1] is None else jf[1])


# --------------------------------------------------------------------------- hangs


def _aged(placed: PlacedRank, now: float) -> RankProgress:
    """A rank's progress as of `now`: the report's ages grown by how old the report is."""
    p = placed.state.progress
    late = max(0.0, now - placed.received_at)
    return RankProgress(rank=p.rank, last_step=p.last_step, last_step_age_s=p.last_step_age_s + late,
                        phase=p.phase, phase_age_s=p.phase_age_s + late, step_median_s=p.step_median_s,
                        longest_save_s=p.longest_save_s, longest_step_s=p.longest_step_s)


@dataclass(frozen=True)
class HangCase:
    """A job whose progress stalled, with where its behind ranks run."""

    job: str
    hang: Hang
    nodes: tuple[str, ...]
    """Every node the job's ranks were reported from."""
    behind: tuple[tuple[int, str, str], ...]
    """(rank, node, phase) of each rank the others wait for."""

    @property
    def key(self) -> str:
        return f"{HANG_KEY_PREFIX}{self.job}:{self.hang.step}"

    @property
    def node(self) -> str:
        """The node a record of it is filed under: the first behind rank's."""
        return self.behind[0][1] if self.behind else self.nodes[0]

    def describe(self) -> str:
        h = self.hang
        names = ", ".join(f"rank {r} on {n} ({p})" for r, n, p in self.behind[:8])
        if len(self.behind) > 8:
            names += f" and {len(self.behind) - 8} more"
        return (f"job {self.job} hung at step {h.step}: no step for {h.stalled_s:.0f} s (bound {h.bound_s:.0f} s); "
                f"behind: {names or 'none named'}")

    def evidence(self) -> dict[str, Any]:
        h = self.hang
        return {"decision": self.key, "job": self.job, "step": h.step, "stalled_s": round(h.stalled_s, 3),
                "bound_s": round(h.bound_s, 3), "nodes": list(self.nodes),
                "behind": [{"rank": r, "node": n, "phase": p} for r, n, p in self.behind[:64]]}


def hangs(views: Mapping[str, JobView], settings: DetectorSettings, now: float,
          early_s: float = 0.0) -> tuple[HangCase, ...]:
    """The hung jobs, by job id: healthd.progress.hang over each job's ranks from every node (rank 0
    among them: a rank-0-only phase is told apart here, where rank 0's phase is seen). `early_s`: the
    time to the next look (progress.hang)."""
    out = []
    for job, view in sorted(views.items()):
        if not view.ranks:
            continue
        h = progress.hang([_aged(p, now) for p in view.ranks.values()], settings, early_s=early_s)
        if h is None:
            continue
        behind = tuple((r, view.ranks[r].node, str(h.phases.get(r, view.ranks[r].state.progress.phase)))
                       for r in h.behind if r in view.ranks)
        out.append(HangCase(job=job, hang=h, nodes=view.nodes, behind=behind))
    return tuple(out)


# --------------------------------------------------------------------------- one round


@dataclass(frozen=True)
class InbandRound:
    """What one control round made of the fleet's in-band data."""

    findings: Mapping[str, tuple[Finding, ...]] = field(default_factory=dict)
    """node -> straggler findings to add to its report (the agent's own of the same id win)."""
    flags: tuple[Flag, ...] = ()
    """Every slow rank, the agents' and the controller's."""
    hangs: tuple[HangCase, ...] = ()
    jobs: int = 0
    """Jobs with in-band data in fresh reports."""
    first_seen: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(node, finding id) -> when its episode began: hand it to the next round."""
    views: Mapping[str, JobView] = field(default_factory=dict)
    """job -> its ranks from every fresh report: what `healthctl inband` shows."""
    evaluated_at: float | None = None

    def flagged_by_tier(self) -> dict[str, int]:
        out = {"T2": 0, "T3": 0}
        for f in self.flags:
            out[f"T{f.tier}"] += 1
        return out


def evaluate(reports: Iterable[_Report], groups: Mapping[str, frozenset[str]], settings: DetectorSettings,
             now: float, ttl_s: float, first_seen: Mapping[tuple[str, str], float] | None = None) -> InbandRound:
    """Merge, compare and look for hangs. One job's data that cannot be judged is logged and skipped."""
    views = merge(reports, now, ttl_s)
    flags: list[Flag] = []
    for job, view in sorted(views.items()):
        try:
            flags.extend(straggler_flags(view, settings))
        except Exception as exc:  # noqa: BLE001 - one job's data must not stop every other job's
            _log.warning("in-band: job %s cannot be compared: %s: %s", job, type(exc).__name__, exc)
    found = findings_for(flags, groups, now, first_seen)
    try:
        hung = hangs(views, settings, now)
    except Exception as exc:  # noqa: BLE001
        _log.warning("in-band: hangs not evaluated: %s: %s", type(exc).__name__, exc)
        hung = ()
    episodes = {(node, f.id): f.first_seen if f.first_seen is not None else now
                for node, fs in found.items() for f in fs}
    return InbandRound(findings=MappingProxyType(found), flags=tuple(flags), hangs=hung, jobs=len(views),
                       first_seen=MappingProxyType(episodes), views=MappingProxyType(views), evaluated_at=now)


MAX_SUMMARY_RANKS = 4096
"""Ranks listed per job by `summary` (the count says how many more there are)."""


def summary(rnd: InbandRound, now: float, job: str | None = None) -> dict[str, Any]:
    """The fleet's in-band view as of the round `rnd`, for people (`healthctl inband`): each job's
    nodes, ranks (where, how far, how fast), slow ranks with their tier and test, and hang. `job`:
    only that job. Ages are as of `now`."""
    flags: dict[tuple[str, int], Flag] = {(f.job, f.state.rank): f for f in rnd.flags}
    hung = {h.job: h for h in rnd.hangs}
    out = []
    for name, view in sorted(rnd.views.items(), key=lambda kv: natural_key(kv[0])):
        if job is not None and name != job:
            continue
        ranks = []
        for r, placed in sorted(view.ranks.items())[:MAX_SUMMARY_RANKS]:
            p = _aged(placed, now)
            st = placed.state
            last = st.windows[-1] if st.windows else None
            ranks.append({"rank": r, "node": placed.node, "gpu": st.gpu, "rail": st.rail, "last_step": p.last_step,
                          "last_step_age_s": round(p.last_step_age_s, 1), "phase": p.phase,
                          "step_median_s": p.step_median_s,
                          "window": last.window if last else None, "compute_s": last.compute_s if last else None,
                          "wait_s": last.wait_s if last else None})
        slow = [{"rank": f.state.rank, "node": f.node, "gpu": f.state.gpu, "tier": f.tier, "test": f.straggler.test,
                 "effect": round(f.straggler.effect, 4), "windows": list(f.straggler.windows),
                 "judged_by": "agent" if f.by_agent else "controller",
                 "corroboration": list(f.corroborated[:4])}
                for (j, _), f in sorted(flags.items()) if j == name]
        h = hung.get(name)
        out.append({"job": name, "world_size": view.world_size, "nodes": list(view.nodes), "ranks_reported": len(view.ranks),
                    "ranks": ranks, "stragglers": slow,
                    "hang": None if h is None else {**h.evidence(), "summary": h.describe()}})
    return {"evaluated_at": rnd.evaluated_at, "jobs": out}


def with_findings(findings: tuple[Finding, ...], extra: Iterable[Finding]) -> tuple[Finding, ...]:
    """`findings` plus each of `extra` whose id none of them has (the agent's own finding wins)."""
    have = {f.id for f in findings}
    added = tuple(f for f in extra if f.id not in have)
    return findings + added if added else findings


# --------------------------------------------------------------------------- proposing a hang's requeue


def hang_decision(case: HangCase, job: JobInfo | None, requeue_opt_in: str, now: float) -> Decision:
    """The decision about one hang (pure): the requeue of a batch job that runs on the node of its
    behind rank and opted in; otherwise a `none` filed under requeue-hang that says why not."""
    base = dict(id=case.key, node=case.node, reason=case.describe()[:500], tier=3, decided_at=now,
                detail=case.evidence())
    if not requeue_opt_in:
        why = "requeue disabled (requeue_opt_in is empty)"
    elif job is None:
        why = f"job {case.job} is not running on {case.node}"
    elif not job.batch or requeue_opt_in not in job.comment:
        why = f"job {case.job} did not opt in to requeue ({requeue_opt_in!r} in a batch job's --comment)"
    else:
        return Decision(kind="requeue-hang", target=case.job, series=case.key, **base)  # type: ignore[arg-type]
    return Decision(kind="none", about=HANG_DECISION_KIND, note=f"{why}: recorded only", **base)  # type: ignore[arg-type]


class HangResponder:
    """Proposes the requeue of a hung job that opted in, once per job and stall step; the others are
    recorded and alerted once.

    It only proposes: the round gates its decisions like any other (the mode and approval, the breaker,
    the requeue-hang kind's own hourly budget; healthd.controller.actions) and the executor applies what
    they allow, re-reading the job first. The ledger remembers across restarts: the requeue is an
    action keyed `requeue-hang:<job>:<step>`, and a series applied, or left to a human after its
    failed attempts, is never proposed again."""

    def __init__(self, ledger: Ledger, list_jobs: Callable[[str], list[JobInfo]], requeue_opt_in: str):
        self.ledger = ledger
        self.list_jobs = list_jobs
        """The jobs running on a node (a read of Slurm)."""
        self.requeue_opt_in = requeue_opt_in
        self._final: set[str] = set()
        self._alerted: set[str] = set()

    def propose(self, cases: Iterable[HangCase], now: float,
                rejected: Mapping[str, str] | None = None) -> tuple[Decision, ...]:
        """The round's decisions about `cases`. `rejected`: decision id -> the operator who rejected
        it (`healthctl reject`): that hang is recorded as it is and never proposed again."""
        out = []
        for case in cases:
            if case.key in self._final:
                continue
            attempt, _why, settled = next_attempt(self.ledger.series(case.key))
            if attempt is None:
                if settled.status != "planned":  # applied, or left to a human (planned: the reconciler's first)
                    self._final.add(case.key)
                continue
            if rejected and case.key in rejected:
                self._final.add(case.key)
                _log.info("in-band hang: %s; requeue rejected by %s", case.describe(), rejected[case.key])
                continue
            if self._recorded_only(case):
                self._final.add(case.key)  # recorded and alerted before a restart: not twice
                continue
            try:
                # the job as running on the node of its behind rank: Slurm requeues a finished batch job
                # too, and a job whose records outlived it must never run again
                job = next((j for j in self.list_jobs(case.node) if j.job_id == case.job), None)
            except SlurmError as exc:
                _log.warning("in-band hang of job %s: cannot read job %s (next round): %s", case.job, case.job, exc)
                continue
            decision = hang_decision(case, job, self.requeue_opt_in, now)
            if decision.kind == "none":
                self._final.add(case.key)
                self._alert(case, f"{decision.note.removesuffix(': recorded only')}: nothing done "
                                  "(a hang never drains a node)")
            else:
                self._alert(case, f"job {case.job} opted in: requeue")
            out.append(decision)
        return tuple(out)

    def requeues_since(self, since: float) -> int:
        """Hung jobs' requeues applied since `since` (the requeue-hang kind's budget)."""
        return self.ledger.requeues_applied_since(since, HANG_KEY_PREFIX)

    def _recorded_only(self, case: HangCase) -> bool:
        """The ledger's latest decision about the hang is a `none` (a job that did not opt in): the
        policy's refusal that records it."""
        prior = self.ledger.latest_decision(HANG_DECISION_KIND, case.key)
        return prior is not None and prior.outcome == "refused" and prior.refused_gate == "policy"

    def _alert(self, case: HangCase, what: str) -> None:
        if case.key in self._alerted:
            return
        self._alerted.add(case.key)
        _log.error("ALERT in-band hang: %s; %s", case.describe(), what)
