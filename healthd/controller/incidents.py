"""The round's incidents: an open ledger incident for every fresh T1/T2 finding, one per correlated
topology group, the escalation a repeated fault earns, and the alert when an escalated drain is applied.

Functions over the ledger and the round's values; the round (healthd.controller.round) calls them in
its incidents step and, for an escalation, after the act step applied a drain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from healthd.controller.actions import Decision
from healthd.controller.gates import GroupIncident
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.policy import NodeReport, is_actionable
from healthd.controller.reintegrate import ReintegrationSettings
from healthd.lograte import RateLimitedLog

_log = logging.getLogger("healthd.controller")

MAX_OPEN_INCIDENTS_PER_NODE = 8
"""Open incidents one node may have; more findings from it wait until one closes (logged)."""

OpenIncidents = Mapping[tuple[str, str], int]
"""(node, finding id) -> its open ledger incident."""


def ensure(ledger: Ledger, reports: Mapping[str, NodeReport], nodes: Iterable[str], now: float, ttl_s: float,
           jobs: Mapping[str, str] | None, log: RateLimitedLog) -> dict[tuple[str, str], int]:
    """An open incident for every fresh T1/T2 finding of `nodes`, and the jobs a drain request named
    joined to theirs; at most MAX_OPEN_INCIDENTS_PER_NODE per node (a node reporting thousands of faults
    gets a few incidents, not thousands of ledger rows), all written in one transaction. One node's bad
    data is logged and skipped. Returns every open incident, those opened here included: read anew each
    round, so an incident an operator closed (resolved, false positive) is not reused."""
    opened = ledger.open_incident_keys()
    per_node: dict[str, int] = {}
    for node, _finding in opened:
        per_node[node] = per_node.get(node, 0) + 1
    todo = [n for n in nodes if now - reports[n].received_at <= ttl_s and _writes(n, reports[n], opened, jobs)]
    if not todo:
        return opened  # every finding has its incident: a round opens no write transaction for nothing
    with ledger.transaction():
        for node in todo:
            report = reports[node]
            try:
                _ensure_node(ledger, node, report, now, jobs, opened, per_node, log)
            except LedgerError:
                raise  # the ledger itself: the round cannot go on
            except Exception as exc:
                log.warning("incidents", "%s: cannot record its findings (%s: %s); skipped this round",
                            node, type(exc).__name__, exc)
    return opened


def _writes(node: str, report: NodeReport, opened: Mapping[tuple[str, str], int], jobs: Mapping[str, str] | None) -> bool:
    """Whether `_ensure_node` has anything to write for this report (a finding of bad data: yes, so that
    its warning is logged there)."""
    try:
        return any(f.tier in (1, 2) and ((node, f.id) not in opened or bool(jobs and node in jobs))
                   for f in report.findings)
    except Exception:  # noqa: BLE001 - _ensure_node logs it and skips the node
        return True


def _ensure_node(ledger: Ledger, node: str, report: NodeReport, now: float, jobs: Mapping[str, str] | None,
                 opened: dict[tuple[str, str], int], per_node: dict[str, int], log: RateLimitedLog) -> None:
    for f in sorted(report.findings, key=lambda f: (f.tier, f.id)):
        if f.tier not in (1, 2):
            continue
        key = (node, f.id)
        if key in opened:
            if jobs and node in jobs:
                ledger.update_incident(opened[key], add_jobs=[jobs[node]])
            continue
        if per_node.get(node, 0) >= MAX_OPEN_INCIDENTS_PER_NODE:
            log.warning("incident-cap", "%s: %d open incidents already; finding %s not recorded as a new incident",
                        node, MAX_OPEN_INCIDENTS_PER_NODE, f.id[:80])
            continue
        serial = f.component.serial or None  # the board to RMA, for the repeat-offender report
        ledger.record_finding(node, f.id, gpu_serial=serial, attribution=f.attribution, tier=f"T{f.tier}",
                              action=f.action, summary=f.summary, evidence=[e.to_json() for e in f.evidence], at=now)
        inc = ledger.open_incident(
            f.id, attribution=f.attribution, tier=f"T{f.tier}", nodes=[node], gpu_serials=[serial] if serial else (),
            jobs=[jobs[node]] if jobs and node in jobs else (),
            first_evidence_at=f.first_seen if f.first_seen is not None else report.received_at,
            detected_at=report.received_at, at=now)
        opened[key] = inc.id
        per_node[node] = per_node.get(node, 0) + 1


def ensure_groups(ledger: Ledger, groups: Iterable[GroupIncident], now: float) -> None:
    """One ledger incident per correlated topology group (signature `group:<group>`), attributed to the
    shared part; its failing nodes join it as they appear."""
    seen: set[str] = set()
    open_by_signature: dict[str, Any] | None = None  # signature -> its oldest open incident
    for gi in groups:
        if gi.group in seen:
            continue
        seen.add(gi.group)
        signature = f"group:{gi.group}"
        if open_by_signature is None:
            # read once, and only in a round with a group incident: each group below touches its own
            # signature only, so the rows read before it opens or grows one are still current
            open_by_signature = {}
            for incident in ledger.incidents(status="open"):
                open_by_signature.setdefault(incident.signature, incident)
        existing = open_by_signature.get(signature)
        if existing is None:
            kind = gi.group.split(":", 1)[0]
            inc = ledger.open_incident(signature, attribution="fabric" if kind == "switch" else "hardware",
                                       tier="T2", nodes=sorted(gi.failing), detected_at=now, at=now)
            _log.warning("group incident #%s: %s", inc.id, gi.label)
        elif not gi.failing <= set(existing.nodes):
            ledger.update_incident(existing.id, add_nodes=sorted(gi.failing - set(existing.nodes)))


def escalations(ledger: Ledger, reports: Mapping[str, NodeReport], nodes: Iterable[str], now: float, ttl_s: float,
                settings: ReintegrationSettings, log: RateLimitedLog) -> dict[tuple[str, str], str]:
    """(node, finding id) -> escalation for the actionable findings of the fresh reports of `nodes`,
    from the ledger's remediation counts: the same fault after `inspect_after` remediations, or
    `support_after` remediations of the node within the support window."""
    out: dict[tuple[str, str], str] = {}
    per_node: dict[str, int] | None = None  # read once, when the first node needs them
    per_fault: dict[tuple[str, str], int] = {}
    for node in nodes:
        report = reports[node]
        if now - report.received_at > ttl_s:
            continue
        try:
            actionable = [f for f in report.findings if is_actionable(f)][:MAX_OPEN_INCIDENTS_PER_NODE]
        except Exception as exc:  # this node's data: its decision says so; the others go on
            log.warning("escalation", "%s: cannot read its findings: %s: %s", node, type(exc).__name__, exc)
            continue
        if not actionable:
            continue
        if per_node is None:
            per_node = ledger.remediations_per_node(now - settings.support_window_s)
            per_fault = ledger.remediation_counts(now - settings.inspect_window_s)
        on_node = per_node.get(node, 0)
        for f in actionable:
            if on_node + 1 >= settings.support_after:
                out[(node, f.id)] = "contact-support"
            elif per_fault.get((node, f.id), 0) >= settings.inspect_after:
                out[(node, f.id)] = "inspect-hardware"
    return out


def escalate(ledger: Ledger, decision: Decision) -> None:
    """An escalated drain was applied: the incident says so, and one alert line names it."""
    if not decision.incident.isdigit():
        return
    ledger.set_escalation(int(decision.incident), decision.escalation)
    _log.error("ALERT %s: %s [#%s]: %s", decision.node, decision.escalation, decision.incident, decision.reason)
