"""Controller policy: findings + fleet view + ledger -> Decisions, as pure functions over values.

Nothing here reads a file, a socket, Slurm or the clock: `now` is a parameter and every input is a
frozen value. `decide` proposes; `healthd.controller.gates.apply_gates` refuses with a reason; an
executor applies what passed. A Decision's id is stable for the same (kind, node, finding), so the
ledger can tell "decided again" from "decided anew".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from types import MappingProxyType
from typing import Any, Literal


from healthd.report_schema import ReportInvalid, validate_finding, validate_report
from healthd.model import is_cleared
from healthd.controller.actions import Decision
from healthd.controller.fleetcache import SlurmSnapshot
from healthd.controller.inband import JobProgress, jobs_from_json
from healthd.controller.ownership import Hold, owned
from healthd.controller.spares import SparePool
from healthd.model import ACTION_SEVERITY, Finding
from healthd.reason import build_reason, printable
from healthd.slurm.backend import NodeInfo
from healthd.slurm.topology import parse_topology

Mode = Literal["observe", "supervised", "auto"]
MODES: tuple[str, ...] = ("observe", "supervised", "auto")

# finding action -> decision kind
_ACTION_TO_KIND: Mapping[str, str] = MappingProxyType(
    {
        "drain": "drain",
        "drain-and-requeue": "drain-and-requeue",
        "inspect-hardware": "drain",
        "reset-gpu-when-idle": "reboot-asap",
        "reboot-when-idle": "reboot-asap",
    }
)


def _frozen_map(value: Mapping | None) -> Mapping:
    return MappingProxyType(dict(value or {}))


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ControllerPolicySettings:
    """The controller's policy and safety-envelope knobs (site config maps onto these)."""

    mode: Mode = "observe"
    """observe: decide and record, never act (default on first install); supervised: every action
    waits for an operator; auto: T1 acts, T2 waits for approval, T3 never acts."""
    auto_tier2: bool = False
    """Site policy grant: in `auto`, T2 actions act without approval too."""
    max_actions_per_hour: int = 10
    """Fleet-wide limit on node-removing actions (drain, drain-and-requeue, reboot-asap) per hour."""
    max_actions_per_partition_per_hour: int = 4
    """The same limit per partition (a node in several partitions counts in each)."""
    partition_rate_limits: Mapping[str, int] = field(default_factory=dict)
    """Per-partition overrides of `max_actions_per_partition_per_hour`."""
    breaker_percent: float = 10.0
    """The breaker opens when MORE than this percent of the fleet's nodes is failing in the window..."""
    breaker_nodes: int = 10
    """...or MORE than this many nodes."""
    breaker_min_nodes: int = 2
    """The percent rule only counts once at least this many nodes fail (one node in a 4-node
    cluster is 25% and must not open the breaker)."""
    breaker_window_s: float = 600.0
    """Failures first seen within this many seconds before `now` count toward breaker and correlation."""
    correlation_threshold: float = 0.5
    """A topology group whose failing share reaches this fraction becomes one group incident."""
    correlation_min_nodes: int = 2
    """...and only once at least this many of its nodes fail."""
    capacity_floors: Mapping[str, int] = field(default_factory=dict)
    """partition -> the fewest healthy (not drained, not down, responding) nodes it may keep."""
    racks: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """rack name -> its nodes (from config); a correlation group like a topology switch."""
    pdus: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """PDU name -> the nodes it feeds (from config); a correlation group."""
    report_ttl_s: float = 120.0
    """A report older than this is stale: its findings decide nothing (the agent may be dead)."""
    spares: Mapping[str, SparePool] = field(default_factory=dict)
    """partition -> its hot spare pool (healthd.controller.spares); empty: no spares (the default)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"controller mode {self.mode!r}: expected one of {', '.join(MODES)}")
        for name in ("max_actions_per_hour", "max_actions_per_partition_per_hour", "breaker_nodes",
                     "breaker_min_nodes", "correlation_min_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"controller {name}: expected a non-negative integer, found {value!r}")
        if not 0 <= self.breaker_percent <= 100:
            raise ValueError(f"controller breaker_percent: expected 0-100, found {self.breaker_percent!r}")
        if not 0 < self.correlation_threshold <= 1:
            raise ValueError(
                f"controller correlation_threshold: expected a fraction in (0, 1], found {self.correlation_threshold!r}"
            )
        object.__setattr__(self, "partition_rate_limits", _frozen_map(self.partition_rate_limits))
        object.__setattr__(self, "capacity_floors", _frozen_map(self.capacity_floors))
        object.__setattr__(self, "racks", _frozen_map({k: frozenset(v) for k, v in dict(self.racks).items()}))
        object.__setattr__(self, "pdus", _frozen_map({k: frozenset(v) for k, v in dict(self.pdus).items()}))
        object.__setattr__(self, "spares", _frozen_map(self.spares))

    def partition_limit(self, partition: str) -> int:
        return self.partition_rate_limits.get(partition, self.max_actions_per_partition_per_hour)


# --------------------------------------------------------------------------- reports -> Findings


def finding_from_json(doc: Mapping[str, Any], *, checked: bool = False) -> Finding:
    """One finding of the README's state document -> Finding. Raises ValueError on a malformed one
    (healthd.report_schema decides what is malformed, and names the field).

    `checked=True`: the caller has validated `doc` already (receive_report validates the whole
    document at intake), so it is only converted. Otherwise it is validated here first: a Finding
    never carries a value of the wrong type into a control round."""
    if not checked:
        try:
            validate_finding(doc)
        except ReportInvalid as exc:
            fid = doc.get("id") if isinstance(doc, dict) else None
            shown = repr(fid[:80]) if isinstance(fid, str) else "?"
            raise ValueError(f"malformed finding {shown}: {exc.reason}") from None
    return Finding.from_json(doc)


@dataclass(frozen=True)
class NodeReport:
    """The latest report one agent pushed (its state document, already authenticated)."""

    node: str
    """Slurm node name the report is for (the MUNGE encode host, checked by the receiver)."""
    verdict: str
    """healthy | degraded | failed | unknown, as the agent folded its findings."""
    findings: tuple[Finding, ...] = ()
    """The node's current findings; dicts in the README's JSON shape are converted to Finding."""
    received_at: float = 0.0
    """Epoch seconds the controller received the report (its clock, not the agent's)."""
    inband: tuple[JobProgress, ...] = ()
    """The training jobs' step progress on the node (healthd.controller.inband); () from an agent
    that sends none."""

    def __post_init__(self) -> None:
        converted = tuple(f if isinstance(f, Finding) else finding_from_json(f) for f in self.findings)
        object.__setattr__(self, "findings", converted)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any], received_at: float, *, checked: bool = False) -> NodeReport:
        """The README's JSON state document -> NodeReport. Raises ValueError (report_schema's
        ReportInvalid, naming the field) for a document the controller does not accept;
        `checked=True`: validate_report already passed on `doc`, it is only converted."""
        if not checked:
            validate_report(doc)
        return cls(
            node=doc["node"],
            verdict=doc["verdict"],
            findings=tuple(finding_from_json(f, checked=True) for f in doc["findings"]),
            received_at=received_at,
            inband=jobs_from_json(doc.get("inband")),
        )


# --------------------------------------------------------------------------- topology


def parse_topology_conf(text: str) -> dict[str, frozenset[str]]:
    """Slurm topology.conf (topology/tree; `BlockName=` of topology/block too) -> switch -> every node
    under it (healthd.slurm.topology). Raises ValueError naming the line for what cannot be read."""
    return dict(parse_topology(text).groups)


@functools.lru_cache(maxsize=4)
def _topology_cached(text: str) -> Mapping[str, frozenset[str]]:
    # the controller hands the same topology.conf text every round, and parsing it costs ~40% of a
    # 10,000-node round (bench/controller_path.py)
    return MappingProxyType(parse_topology_conf(text))


# --------------------------------------------------------------------------- fleet and ledger


@dataclass(frozen=True)
class FleetView:
    """Everything the controller knows about the fleet at one instant, as values."""

    reports: Mapping[str, NodeReport] = field(default_factory=dict)
    """node -> its latest report."""
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    """node -> what Slurm said about it at the last read."""
    partitions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """partition -> its nodes (derived from NodeInfo.partitions when not given)."""
    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """correlation group -> nodes; names are `switch:<name>`, `rack:<name>`, `pdu:<name>`."""
    reporting_findings: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """The nodes whose report has findings (with_findings): found once per view, since the breaker,
    the correlation and the decisions each start from them."""

    def __post_init__(self) -> None:
        partitions = dict(self.partitions)
        if not partitions:
            for info in self.nodes.values():
                for p in info.partitions:
                    partitions.setdefault(p, set()).add(info.name)
        # build() hands over maps it already made read-only: copying its 10,000-entry dicts again
        # cost a few ms of every control round
        for name in ("reports", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, _frozen_map(value))
        object.__setattr__(self, "partitions", _frozen_map({k: frozenset(v) for k, v in partitions.items()}))
        object.__setattr__(self, "groups", _frozen_map({k: frozenset(v) for k, v in dict(self.groups).items()}))
        object.__setattr__(self, "reporting_findings", tuple(with_findings(self.reports)))

    @classmethod
    def build(
        cls,
        reports: Iterable[NodeReport],
        nodes: Iterable[NodeInfo],
        topology_conf: str = "",
        settings: ControllerPolicySettings | None = None,
    ) -> FleetView:
        """Assemble a view: topology.conf switches plus the racks/PDUs of `settings` as groups."""
        settings = settings or ControllerPolicySettings()
        groups: dict[str, frozenset[str]] = {}
        for name, members in _topology_cached(topology_conf).items():
            groups[f"switch:{name}"] = members
        for name, members in settings.racks.items():
            groups[f"rack:{name}"] = frozenset(members)
        for name, members in settings.pdus.items():
            groups[f"pdu:{name}"] = frozenset(members)
        return cls(
            reports=MappingProxyType({r.node: r for r in reports}),
            nodes=MappingProxyType({n.name: n for n in nodes}),
            groups=groups,
        )

    @classmethod
    def of(cls, reports: Mapping[str, NodeReport], snapshot: SlurmSnapshot, topology_conf: str = "",
           settings: ControllerPolicySettings | None = None) -> FleetView:
        """A view over the fleet cache's snapshot: its node map and partitions are taken as they are
        (already read-only and kept up to date by the cache), so a round copies nothing fleet-sized."""
        groups = cls.build((), (), topology_conf, settings).groups
        return cls(reports=MappingProxyType(dict(reports)) if not isinstance(reports, MappingProxyType) else reports,
                   nodes=snapshot.nodes, partitions=snapshot.partitions, groups=groups)

    @property
    def all_nodes(self) -> frozenset[str]:
        """Every node known from Slurm or from a report."""
        return frozenset(self.nodes) | frozenset(self.reports)

    @property
    def node_count(self) -> int:
        """len(all_nodes) without building it (two 10,000-node frozensets and their union took ~3 ms)."""
        return len(self.nodes) + len(self.reports.keys() - self.nodes.keys())

    def partitions_of(self, node: str) -> tuple[str, ...]:
        info = self.nodes.get(node)
        if info is not None and info.partitions:
            return tuple(info.partitions)
        return tuple(sorted(p for p, members in self.partitions.items() if node in members))


@dataclass(frozen=True)
class LedgerView:
    """What the ledger remembers that policy and gates need (a read-only projection)."""

    holds: Mapping[str, Hold] = field(default_factory=dict)
    """node -> healthd's hold on it: the nodes healthd took out of service and owns by record
    (healthd.controller.ownership). A node is healthd's only while Slurm still shows its write."""
    incidents: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """(node, finding id) -> the open incident id it belongs to."""
    escalations: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """(node, finding id) -> `inspect-hardware` or `contact-support` when the remediation counters
    say a drain for it is no longer routine (reintegrate.ReintegrationSettings)."""
    unsettled: frozenset[str] = frozenset()
    """Nodes with a node-removing write healthd planned, or made without knowing whether it landed
    (a timeout, a crash), since the fleet view was read: Slurm may already show it. The capacity
    floor counts them as gone and the rate limit as spent until a later view settles them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "holds", _frozen_map(self.holds))
        object.__setattr__(self, "incidents", _frozen_map(self.incidents))
        object.__setattr__(self, "escalations", _frozen_map(self.escalations))


# --------------------------------------------------------------------------- decisions


def incident_id(node: str, finding: Finding) -> str:
    """A proposed incident id, deterministic in (node, finding id, first_seen)."""
    raw = f"{node}\0{finding.id}\0{finding.first_seen}".encode()
    return "H" + hashlib.sha1(raw).hexdigest()[:8]


def make_reason(cause: str, incident: str) -> str:
    """`healthd: <cause> [#<incident>]`, one printable line within Slurm's reason limit
    (healthd.reason) with the cause's runs of spaces made one; the cause is shortened (never the
    prefix or the incident)."""
    return build_reason(" ".join(printable(cause).split()), f"[#{incident}]")


def is_actionable(f: Finding) -> bool:
    """A finding the controller may act on: T1/T2, not user code, with a remedy."""
    return f.tier in (1, 2) and f.attribution != "user" and f.action in _ACTION_TO_KIND


def without_cleared(report: NodeReport, cleared: Mapping[str, float],
                    dismissed: Mapping[str, float] | None = None) -> NodeReport:
    """The report without the findings cleared on its node (finding id -> before; see
    healthd.agent.instructions): `cleared` by evidence (a repair: new evidence brings a finding back),
    `dismissed` by episode (an undo or close: a new episode brings it back)."""
    if not cleared and not dismissed:
        return report
    kept = [f for f in report.findings if not is_cleared(f, cleared, dismissed)]
    if len(kept) == len(report.findings):
        return report
    verdict = report.verdict
    if not any(f.tier == 1 for f in kept) and verdict == "failed":
        verdict = "degraded" if kept else "healthy"
    return dataclasses.replace(report, verdict=verdict, findings=tuple(kept))


ESCALATION_TEXT: Mapping[str, str] = MappingProxyType(
    {"inspect-hardware": "INSPECT HARDWARE (recurring)", "contact-support": "CONTACT SUPPORT (repeated failures)"}
)


def _primary_order(f: Finding) -> tuple:
    # certainty first (a T1 drain outranks a T2 one), then the strongest remedy
    return (f.tier, -ACTION_SEVERITY.get(f.action, 0), f.id)


def with_findings(reports: Mapping[str, NodeReport]) -> list[str]:
    """The nodes whose report has findings: the few a round looks at closely. The walk over every
    report runs in C (itertools.compress over the findings tuples): 100,000 reports take ~2 ms."""
    return list(compress(reports.keys(), map(_FINDINGS, reports.values())))


def stale_nodes(reports: Mapping[str, NodeReport], now: float, ttl_s: float) -> list[str]:
    """The nodes whose report is older than `ttl_s`, with the walk in C as in with_findings."""
    return list(compress(reports.keys(), map((now - ttl_s).__gt__, map(_RECEIVED_AT, reports.values()))))


_FINDINGS = operator.attrgetter("findings")
_RECEIVED_AT = operator.attrgetter("received_at")


def failing_nodes(fleet: FleetView, settings: ControllerPolicySettings, now: float,
                  since: float | None = None) -> frozenset[str]:
    """Nodes with a fresh report holding an actionable (T1/T2, not user) finding first seen within
    the breaker window (and after `since`, when given)."""
    start = now - settings.breaker_window_s
    if since is not None:
        start = max(start, since)
    out = set()
    for node in fleet.reporting_findings:
        report = fleet.reports[node]
        if now - report.received_at > settings.report_ttl_s:
            continue
        try:
            for f in report.findings:
                if not is_actionable(f):
                    continue
                seen = f.first_seen if f.first_seen is not None else report.received_at
                if start <= seen <= now:
                    out.add(node)
                    break
        except Exception:  # noqa: BLE001 - a node whose data cannot be read is not counted; decide() says why
            continue
    return frozenset(out)


def _none(node: str, key: str, note: str, now: float, tier: int = 3, findings: tuple[Finding, ...] = (),
          incident: str = "") -> Decision:
    return Decision(
        id=f"none:{node}:{key}",
        kind="none",
        node=node,
        reason="",
        tier=tier,
        attribution=findings[0].attribution if findings else "unknown",
        evidence=tuple(e for f in findings for e in f.evidence),
        finding_ids=tuple(f.id for f in findings),
        incident=incident,
        decided_at=now,
        note=note,
    )


def decide(
    fleet: FleetView, ledger: LedgerView, settings: ControllerPolicySettings, now: float
) -> tuple[Decision, ...]:
    """Propose at most one decision per node, sorted by node name.

    - T1/T2 findings not attributed to user code: the strongest action decides the kind (drain,
      drain-and-requeue; inspect-hardware drains; reset-gpu/reboot-when-idle -> reboot-asap, i.e.
      `scontrol reboot ASAP nextstate=RESUME`). Gates decide whether T2 waits for approval.
    - T3 or user-attributed findings only: `none` (recorded, charged to the job, never acts).
    - Already drained/rebooting by healthd: `none` ("already ...").
    - Drained by healthd (ledger) with its reason still `healthd:` and the fault cleared: `none`
      noting that reintegration (validation, then resume) takes it from here.
    - A stale report decides nothing but `none`.
    """
    out: list[Decision] = []
    # a node Slurm lists but no agent reports on has no evidence to decide on; a healthy node that
    # healthd does not hold and whose report is fresh (most of the fleet) has nothing to say
    reports = fleet.reports
    candidates = set(fleet.reporting_findings) | (ledger.holds.keys() & reports.keys())
    candidates.update(stale_nodes(reports, now, settings.report_ttl_s))
    for node in candidates:
        report = reports[node]
        try:
            decision = _decide_node(node, report, fleet, ledger, settings, now)
        except Exception as exc:  # one node's bad data must not stop every other node's decision
            decision = _none(node, "error", f"cannot decide: {type(exc).__name__}: {exc}"[:200], now)
        if decision is not None:
            out.append(decision)
    # one decision per node: sorting the few decisions is cheaper than sorting the whole fleet first
    return tuple(sorted(out, key=lambda d: d.node))


def _decide_node(node: str, report: NodeReport, fleet: FleetView, ledger: LedgerView,
                 settings: ControllerPolicySettings, now: float) -> Decision | None:
    """decide() for one node: its decision, or None when there is nothing to say."""
    if now - report.received_at > settings.report_ttl_s:
        return _none(node, "stale-report", f"report is {now - report.received_at:.0f} s old "
                     f"(ttl {settings.report_ttl_s:.0f} s): not acting on it", now)
    hold = ledger.holds.get(node)
    if not report.findings and hold is None:
        return None  # healthy and not drained by healthd: most of the fleet, nothing to say
    info = fleet.nodes.get(node)
    ours = owned(hold, info)
    drained_incident = "" if hold is None or hold.incident_id is None else str(hold.incident_id)
    actionable = sorted((f for f in report.findings if is_actionable(f)), key=_primary_order)
    if not actionable:
        if ours:
            return _none(node, "cleared", f"fault cleared on a node healthd drained "
                         f"[#{drained_incident}]: awaiting reintegration (validation, then resume)",
                         now, incident=drained_incident)
        if report.findings:
            observed = tuple(sorted(report.findings, key=_primary_order))
            why = "user code" if all(f.attribution == "user" for f in observed) else "T3 or no remedy"
            return _none(node, observed[0].id, f"recorded only ({why}): never acts", now,
                         tier=min(f.tier for f in observed), findings=observed)
        return None
    primary = actionable[0]
    kind = _ACTION_TO_KIND[primary.action]
    incident = ledger.incidents.get((node, primary.id)) or incident_id(node, primary)
    if info is not None and ours:
        if kind in ("drain", "drain-and-requeue") and info.drain_requested:
            return _none(node, primary.id, f"already drained by healthd [#{drained_incident}]", now,
                         tier=primary.tier, findings=tuple(actionable), incident=drained_incident)
        if kind == "reboot-asap" and (info.reboot_requested or info.drain_requested):
            return _none(node, primary.id, f"reboot already requested by healthd [#{drained_incident}]",
                         now, tier=primary.tier, findings=tuple(actionable), incident=drained_incident)
    escalation = ledger.escalations.get((node, primary.id), "")
    cause = f"{ESCALATION_TEXT.get(escalation, escalation)}: {primary.summary}" if escalation else primary.summary
    return Decision(
        id=f"{kind}:{node}:{primary.id}",
        kind=kind,  # type: ignore[arg-type]
        node=node,
        reason=make_reason(cause, incident),
        tier=primary.tier,
        attribution=primary.attribution,
        evidence=tuple(e for f in actionable for e in f.evidence),
        finding_ids=tuple(f.id for f in actionable),
        incident=incident,
        decided_at=now,
        escalation=escalation,
    )
