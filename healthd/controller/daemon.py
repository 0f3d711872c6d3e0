"""healthd-controller: receive signed reports, decide, gate, and (in supervised/auto) act on Slurm.

    healthd-controller [--config FILE] [--dry-run] [--once]

At start: load the config, open the ledger, pick the Slurm backend, finish what a crash left half done
(Executor.recover), then serve HTTP and run a control round every few seconds: fleet view from the
latest reports and Slurm, ledger view, breaker state, decide, gates, record every decision in the ledger,
apply what is allowed. Observe mode (the default) never calls a Slurm write. SIGTERM stops cleanly.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import grp
import logging
import operator
import re
import signal
import socket as _socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from itertools import compress
from pathlib import Path
from types import MappingProxyType
from typing import Any

from healthd import munge, sdnotify
from healthd.controller import admin, goodput_gather, inband
from healthd.controller.auth import ReportRejected, verify_report
from healthd.controller.config import ControllerSettings, load_controller_settings
from healthd.controller.executor import ExecResult, Executor
from healthd.controller.fleetcache import FleetCache, SlurmSnapshot
from healthd.controller.actions import Decision
from healthd.controller.gates import BreakerState, GateContext, GroupIncident, GateResult, build_context, gate_batch
from healthd.controller.goodput_jobs import GoodputAccountant
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.metrics import INCIDENT_WINDOW_S, ControllerMetrics, IncidentTimings, RoundFigures
from healthd.controller.policy import (
    FleetView,
    LedgerView,
    NodeReport,
    decide,
    finding_from_json,
    is_actionable,
    parse_topology_conf,
    without_cleared,
)
from healthd.controller.reconcile import Reconciler
from healthd.lograte import RateLimitedLog
from healthd.controller.reintegrate import Reintegrator
from healthd.report_schema import MAX_ERROR_CHARS, validate_request
from healthd.controller.server import ControllerHTTPServer
from healthd.controller.verifier import Checked, CheckerPool, Refused, check_report
from healthd.slurm import default_backend
from healthd.slurm.backend import SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller")

ROUND_INTERVAL_S = 5.0
MAX_OPEN_INCIDENTS_PER_NODE = 8
"""Open incidents one node may have; more findings from it wait until one closes (logged)."""
_INBAND = operator.attrgetter("inband")
_VERDICT = operator.attrgetter("verdict")
_RECEIVED_AT = operator.attrgetter("received_at")
ADDR_REFRESH_S = 300.0
WRITE_IN_FLIGHT_S = 30.0
"""How long before the fleet view's read a write healthd planned may still have landed after it (a
client that timed out, a slurmctld that answered slowly): such writes whose outcome the ledger does not
know count as out of service and as spent budget in the gates (LedgerView.unsettled)."""
FULL_COLLECT_EVERY_S = 3600.0
"""How often the daemon runs a full garbage collection between rounds (Controller.between_rounds)."""
LEDGER_OUTCOME = {"allowed": "allowed", "waiting-approval": "waiting", "refused": "refused", "recorded": "refused"}
"""gates' GateResult.status -> the ledger's decision outcome (`recorded` is a refusal by policy)."""


def ledger_outcome(outcome: GateResult) -> tuple[str, str | None, str | None]:
    """(outcome, refused_gate, refused_reason) in the ledger's vocabulary."""
    status = LEDGER_OUTCOME[outcome.status]
    if outcome.status == "recorded":
        return status, "policy", outcome.reason or outcome.decision.note or "recorded only"
    if status == "refused":
        return status, outcome.gate or "error", outcome.reason or "refused"
    return status, None, None


def slurm_node_addrs(backend: SlurmBackend, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """node -> IPv4 of its NodeAddr, resolved here: from `known` (the fleet view's, read with the node
    list) or else from backend.node_addresses(); empty when Slurm cannot be read."""
    if known is not None:
        addrs = known
    else:
        try:
            addrs = backend.node_addresses()
        except SlurmError as exc:
            _log.warning("cannot read NodeAddr from Slurm: %s", exc)
            return {}
    out = {}
    for node, addr in addrs.items():
        try:
            out[node] = _socket.gethostbyname(addr)
        except OSError:
            _log.warning("node %s: NodeAddr %s does not resolve", node, addr)
    return out


def _news(previous: NodeReport | None, report: NodeReport) -> bool:
    """The report carries an actionable finding the previous one from that node did not."""
    known = {f.id for f in previous.findings} if previous is not None else set()
    return any(is_actionable(f) and f.id not in known for f in report.findings)


class Controller:
    """The daemon's state and logic, independent of the HTTP server and the main loop (tests drive it)."""

    def __init__(self, settings: ControllerSettings, ledger: Ledger, backend: SlurmBackend, *,
                 dry_run: bool = False, metrics: ControllerMetrics | None = None,
                 clock: Callable[[], float] = time.time, decode: Callable[..., Any] = munge.decode,
                 executor: Executor | None = None, topology_text: str = "",
                 node_addrs: Callable[[], Mapping[str, str]] | None = None, slurm_wait_s: float = 20.0,
                 out: Callable[[str], None] | None = None):
        self.settings = settings
        self.policy = settings.policy
        self.ledger = ledger
        self.backend = backend
        self.dry_run = dry_run
        self.metrics = metrics or ControllerMetrics()
        self.clock = clock
        self.decode = decode
        self.executor = executor or Executor(backend, ledger, dry_run=dry_run, requeue_opt_in=settings.requeue_opt_in,
                                             clock=clock, out=out)
        self.checkers: CheckerPool | None = None
        """Worker processes that check reports (start_report_processes); None: checked in-process."""
        self._reader: Ledger | None = None
        self.fleet = FleetCache(backend, clock=clock)
        """Slurm's node list: refreshed by a thread of its own in the daemon (start_fleet_refresh),
        else read (incrementally) at the start of each round."""
        self.executor.on_node_read = self.fleet.note
        self.executor.on_unreadable = self._unreadable
        self._fleet_period_s: float | None = None
        self._full_collect_at = time.monotonic()
        self.reconciler = Reconciler(self.executor)
        self._limited = RateLimitedLog(_log)
        self.reintegrator = Reintegrator(settings.reintegration, ledger, backend, read_node=self.executor.read_node,
                                         slurm_conf=settings.slurm_conf, dry_run=dry_run,
                                         detector=settings.inband.detector)
        self.topology_text = topology_text
        self._node_addrs = node_addrs
        self._addr_cache: dict[str, str] = {}
        self._addr_read_at = 0.0
        self.slurm_wait_s = slurm_wait_s
        self.reports: dict[str, NodeReport] = {}
        self.reports_lock = threading.Lock()
        self.wake = threading.Event()
        """Set by a report that brings a new actionable finding: the main loop runs a round at once."""
        self.round_lock = threading.Lock()  # one evaluation at a time (control loop or a request)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="healthd-eval")
        # (decision id, incident) -> (ledger outcome, refusing gate, ledger row id): the same decision id
        # recurs for a later incident of the same fault, which is a new ledger row; so is a refusal by
        # another gate (the ledger says why a decision waits now)
        self._recorded: dict[tuple[str, str], tuple[str, str | None, int]] = {}
        self._incidents: dict[tuple[str, str], int] = {}
        self._load_incidents()
        self.hangs = inband.HangResponder(ledger, self.executor.list_jobs, settings.requeue_opt_in)
        self.inband_round = inband.InbandRound()
        """What the latest round made of the in-band data (the round gauges read it)."""
        self._inband_started = False
        self.goodput = settings.goodput.at(settings.ledger)
        """The goodput settings with the directory resolved; None when goodput is not enabled."""
        self.goodput_store = (goodput_gather.GoodputStore(self.goodput.directory, self.goodput.max_log_bytes)
                              if self.goodput is not None and self.goodput.directory else None)
        self.stragglers = goodput_gather.StragglerEpisodes(self._write_own) if self.goodput_store else None
        """Slow ranks' episodes, written to their jobs' goodput logs as they end."""
        self.windows = goodput_gather.WindowRecords(self._write_own) if self.goodput_store else None
        """Each job's rank x window compute time, written to its goodput log for the report's heatmap."""

    # -- node addresses ------------------------------------------------------------------------------

    def node_addrs(self) -> Mapping[str, str]:
        """node -> MUNGE origin address: the config's `node_addrs`, else Slurm's NodeAddr as last read by
        the control loop (never read from Slurm on a request thread)."""
        if self.settings.node_addrs:
            return self.settings.node_addrs
        if self._node_addrs is not None:
            return self._node_addrs()
        return self._addr_cache

    def refresh_node_addrs(self, now: float) -> None:
        """Re-read NodeAddr from Slurm when the config names none (at most every 5 minutes)."""
        if self.settings.node_addrs or self._node_addrs is not None:
            return
        if self._addr_cache and now - self._addr_read_at < ADDR_REFRESH_S:
            return
        addrs = slurm_node_addrs(self.backend, self.fleet.node_addresses())
        if addrs:
            self._addr_cache = addrs
            self._addr_read_at = now

    def start_fleet_refresh(self, period_s: float) -> None:
        """Read Slurm's node list once now, then every `period_s` in a thread of its own (which also
        refreshes NodeAddr when due): from then on a round acts on the latest read and never waits
        for Slurm. A first read that fails is retried by the thread; rounds wait for it."""
        try:
            self.fleet.refresh()
        except SlurmError as exc:
            _log.warning("cannot read Slurm's node list yet (retried every %.1f s): %s", period_s, exc)
        self._fleet_period_s = period_s
        # the refresh right after a write confirms its hold (the reconciler): the round does not wait for it
        self.executor.read_back = False
        self.executor.on_write = lambda _node: self.fleet.poke()
        self.fleet.start(period_s, after=lambda: self.refresh_node_addrs(self.clock()))

    def _fleet_snapshot(self) -> SlurmSnapshot | None:
        """The fleet as the round may act on it; None when Slurm could not be read (latest read failed,
        or none succeeded for three refresh periods)."""
        if self._fleet_period_s is None:
            try:
                self.fleet.refresh()
            except SlurmError as exc:
                _log.warning("Slurm unreachable, skipping this round: %s", exc)
                return None
            return self.fleet.snapshot()
        snap = self.fleet.snapshot()
        if snap is None or not self.fleet.healthy:
            self._limited.warning("fleet", "Slurm unreachable, skipping this round: %s",
                                  self.fleet.error or "its node list not read yet")
            return None
        if self.clock() - snap.read_at > max(3 * self._fleet_period_s, 30.0):
            self._limited.warning("fleet-stale", "Slurm unreachable, skipping this round: its node list was last "
                                  "read %.0f s ago", self.clock() - snap.read_at)
            return None
        return snap

    # -- HTTP entry points -----------------------------------------------------------------------------

    def _verify(self, body: bytes, what: str, peer: str):
        now = self.clock()
        try:
            return verify_report(body, socket=self.settings.munge_socket, node_addrs=self.node_addrs(), now=now,
                                 decode=self.decode), now
        except ReportRejected as exc:
            self._refused(what, peer, exc.http_status, exc.reason)
            raise

    def _refused(self, what: str, peer: str, status: int, reason: str) -> None:
        # a flood of forged or replayed reports is one line per status per interval, not one per report
        self._limited.warning(f"refused-{status}", "%s from %s refused: %d %s", what, peer or "?", status, reason)
        self.metrics.reports.labels(result=str(status)).inc()

    def start_report_processes(self, processes: int) -> None:
        """Check reports in `processes` worker processes (healthd.controller.verifier) from now on:
        the report server hands them its /v1/report bodies (receive_report_later); close() stops them.
        The workers decode through libmunge and the controller's munged."""
        self.checkers = CheckerPool(processes, self.settings.munge_socket)

    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        started = time.monotonic()
        now = self.clock()
        out = check_report(body, socket=self.settings.munge_socket, node_addrs=self.node_addrs(), now=now,
                           decode=self.decode)
        return self._store_checked(out, peer, now, started, self.ledger)

    def receive_report_later(self, body: bytes, peer: str, done: Callable[[tuple[int, dict[str, Any]]], None]) -> None:
        """receive_report with the checks in a worker process (start_report_processes): call on the report
        server's event loop; done(status, payload) is called there too. The store step reads the ledger
        through a read-only connection of its own, so the loop never waits behind a round's transaction."""
        assert self.checkers is not None
        started = time.monotonic()
        now = self.clock()

        def checked(out: Checked | Refused) -> None:
            try:
                result = self._store_checked(out, peer, now, started, self._loop_ledger())
            except Exception as exc:  # a bug of ours: answered 500, the loop goes on
                _log.exception("report from %s: storing it failed", peer or "?")
                result = 500, {"error": f"internal error: {type(exc).__name__}"}
            done(result)

        self.checkers.submit(body, now, self.node_addrs(), checked)

    def _loop_ledger(self) -> Ledger:
        if self._reader is None:
            try:
                self._reader = Ledger.open_readonly(self.ledger.path)
            except LedgerError as exc:
                _log.warning("report intake reads the ledger through the controller's own connection: %s", exc)
                self._reader = self.ledger
        return self._reader

    def _store_checked(self, out: Checked | Refused, peer: str, now: float, started: float,
                       ledger: Ledger) -> tuple[int, dict[str, Any]]:
        """Store a checked report (or log and count its refusal) and answer it."""
        report = None
        if isinstance(out, Checked):
            try:
                report = NodeReport.from_document(out.doc, now, checked=True)
            except (KeyError, ValueError, TypeError) as exc:
                out = Refused(400, f"report from {out.node!r} is not a state document: {str(exc)[:MAX_ERROR_CHARS]}",
                              False)
        if report is None:
            assert isinstance(out, Refused)
            if out.credential:
                self._refused("report", peer, out.status, out.reason)
            else:
                self._limited.warning("refused-400", "report refused: 400 %s", out.reason)
                self.metrics.reports.labels(result="400").inc()
            return out.status, {"accepted": False, "error": out.reason}
        with self.reports_lock:
            previous = self.reports.get(report.node)
            self.reports[report.node] = report
        if _news(previous, report):
            self.wake.set()  # a new actionable finding: decide now, not at the next round
        try:
            instructions = self.reintegrator.instructions_for(report, ledger)
        except Exception:  # the ledger busy or broken: the report is still accepted
            _log.exception("instructions for %s", report.node)
            instructions = []
        self.metrics.reports.labels(result="accepted").inc()
        self.metrics.report_latency.observe(time.monotonic() - started)
        return 200, {"accepted": True, "instructions": instructions}

    def receive_request(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        try:
            verified, now = self._verify(body, "drain request", peer)
        except ReportRejected as exc:
            return exc.http_status, {"granted": False, "reason": exc.reason}
        doc = verified.report
        try:
            validate_request(doc, node=verified.node)  # every field, as for a report
            finding = finding_from_json(doc["finding"], checked=True)
        except (KeyError, ValueError, TypeError) as exc:
            reason = f"drain request from {verified.node!r} is malformed: {str(exc)[:MAX_ERROR_CHARS]}"
            self._limited.warning("refused-400-request", "drain request refused: 400 %s", reason)
            self.metrics.reports.labels(result="400").inc()
            return 400, {"granted": False, "reason": reason}
        future = self._pool.submit(self._evaluate_request, verified.node, finding, doc.get("job"), now)
        try:
            granted, reason = future.result(timeout=self.slurm_wait_s)
        except concurrent.futures.TimeoutError:
            reason = f"controller could not decide within {self.slurm_wait_s:.0f} s (Slurm slow?)"
            _log.warning("drain request from %s: %s", verified.node, reason)
            return 200, {"granted": False, "reason": reason}
        _log.info("drain request from %s (job %s): granted=%s: %s", verified.node, doc.get("job"), granted, reason)
        return 200, {"granted": granted, "reason": reason}

    def receive_goodput(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        """A node's goodput log lines (healthd.controller.goodput_gather), appended to the job's
        gathered log; off the event loop (a disk write and fsync)."""
        if self.goodput_store is None:
            return 404, {"accepted": False, "error": "this controller takes no goodput logs (goodput.enabled)"}
        try:
            verified, _ = self._verify(body, "goodput shipment", peer)
        except ReportRejected as exc:
            return exc.http_status, {"accepted": False, "error": exc.reason}
        try:
            shipment = goodput_gather.parse_shipment(verified.report)
            through = self.goodput_store.append(verified.node, shipment)
        except goodput_gather.ShipmentRefused as exc:
            self._limited.warning(f"refused-goodput-{exc.status}", "goodput shipment from %s refused: %d %s",
                                  verified.node, exc.status, exc.reason)
            self.metrics.goodput_shipments.labels(result=str(exc.status)).inc()
            return exc.status, {"accepted": False, "error": exc.reason}
        except OSError as exc:
            self._limited.error("goodput-store", "goodput shipment from %s not stored: %s", verified.node, exc)
            self.metrics.goodput_shipments.labels(result="503").inc()
            return 503, {"accepted": False, "error": f"not stored: {exc.strerror or exc}"}
        self.metrics.goodput_shipments.labels(result="accepted").inc()
        return 200, {"accepted": True, "through": through}

    def _evaluate_request(self, node: str, finding: Any, job: Any, now: float) -> tuple[bool, str]:
        with self.reports_lock:
            previous = self.reports.get(node)
            kept = tuple(f for f in (previous.findings if previous else ()) if f.id != finding.id)
            report = NodeReport(node=node, verdict="failed", findings=(finding, *kept), received_at=now,
                                inband=previous.inband if previous else ())
            self.reports[node] = report
        results = self.evaluate(now, only=node, jobs={node: str(job)} if job else None)
        if results is None:
            return False, "Slurm is unreachable: not acting"
        for outcome, result in results:
            if outcome.decision.node != node:
                continue
            if outcome.status != "allowed":
                return False, f"{outcome.label}: {outcome.reason or outcome.decision.note}"
            if result is not None and result.status in ("applied", "already-applied"):
                return True, f"{outcome.decision.kind} applied: {outcome.decision.reason}"
            return False, f"allowed but not applied: {result.status if result else 'no result'} " \
                          f"{result.detail if result else ''}".strip()
        return False, "no decision for this node"

    # -- the control round -----------------------------------------------------------------------------

    def _load_incidents(self) -> None:
        """(node, finding id) -> open ledger incident, re-read each round so an incident an operator
        closed (resolved, false positive) is not reused."""
        self._incidents = self.ledger.open_incident_keys()

    def _ensure_incidents(self, reports: Mapping[str, NodeReport], reporting_findings: Iterable[str], now: float,
                          jobs: Mapping[str, str] | None) -> None:
        """An open incident for every fresh T1/T2 finding of the `reporting_findings` nodes; at most
        MAX_OPEN_INCIDENTS_PER_NODE per node (a node reporting thousands of faults gets a few incidents,
        not thousands of ledger rows), all written in one transaction. One node's bad data is logged
        and skipped."""
        per_node: dict[str, int] = {}
        for node, _finding in self._incidents:
            per_node[node] = per_node.get(node, 0) + 1
        with self.ledger.transaction():
            for node in reporting_findings:
                report = reports[node]
                if now - report.received_at > self.policy.report_ttl_s:
                    continue
                try:
                    self._ensure_node_incidents(node, report, now, jobs, per_node)
                except LedgerError:
                    raise  # the ledger itself: the round cannot go on
                except Exception as exc:
                    self._limited.warning("incidents", "%s: cannot record its findings (%s: %s); skipped this round",
                                          node, type(exc).__name__, exc)

    def _ensure_node_incidents(self, node: str, report: NodeReport, now: float, jobs: Mapping[str, str] | None,
                               per_node: dict[str, int]) -> None:
        for f in sorted(report.findings, key=lambda f: (f.tier, f.id)):
            if f.tier not in (1, 2):
                continue
            key = (node, f.id)
            if key in self._incidents:
                if jobs and node in jobs:
                    self.ledger.update_incident(self._incidents[key], add_jobs=[jobs[node]])
                continue
            if per_node.get(node, 0) >= MAX_OPEN_INCIDENTS_PER_NODE:
                self._limited.warning("incident-cap", "%s: %d open incidents already; finding %s not recorded as "
                                      "a new incident", node, MAX_OPEN_INCIDENTS_PER_NODE, f.id[:80])
                continue
            serial = f.component.serial or None  # the board to RMA, for the repeat-offender report
            self.ledger.record_finding(node, f.id, gpu_serial=serial, attribution=f.attribution, tier=f"T{f.tier}",
                                       action=f.action, summary=f.summary,
                                       evidence=[e.to_json() for e in f.evidence], at=now)
            inc = self.ledger.open_incident(
                f.id, attribution=f.attribution, tier=f"T{f.tier}", nodes=[node],
                gpu_serials=[serial] if serial else (),
                jobs=[jobs[node]] if jobs and node in jobs else (),
                first_evidence_at=f.first_seen if f.first_seen is not None else report.received_at,
                detected_at=report.received_at, at=now)
            self._incidents[key] = inc.id
            per_node[node] = per_node.get(node, 0) + 1

    def _group_incidents(self, groups: Iterable[GroupIncident], now: float) -> None:
        """One ledger incident per correlated topology group (signature `group:<group>`), attributed
        to the shared part; its failing nodes join it as they appear."""
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
                for incident in self.ledger.incidents(status="open"):
                    open_by_signature.setdefault(incident.signature, incident)
            existing = open_by_signature.get(signature)
            if existing is None:
                kind = gi.group.split(":", 1)[0]
                inc = self.ledger.open_incident(signature, attribution="fabric" if kind == "switch" else "hardware",
                                                tier="T2", nodes=sorted(gi.failing), detected_at=now, at=now)
                _log.warning("group incident #%s: %s", inc.id, gi.label)
            elif not gi.failing <= set(existing.nodes):
                self.ledger.update_incident(existing.id, add_nodes=sorted(gi.failing - set(existing.nodes)))

    def _verdicts(self) -> tuple[set[str], dict[str, str]]:
        """Decision ids an operator approved, and those one rejected (-> who), for incidents still open
        (a verdict never carries over to a later incident with the same decision id)."""
        approved: set[str] = set()
        rejected: dict[str, str] = {}
        open_incidents = set(self._incidents.values())
        for row in self.ledger.decisions(outcome="waiting"):
            if row.incident_id is not None and row.incident_id not in open_incidents:
                continue
            verdict = self.ledger.approval(row.id)
            if verdict is None or not isinstance(row.evidence, dict):
                continue
            if verdict.verdict == "approve":
                approved.add(str(row.evidence.get("decision", "")))
            else:
                rejected[str(row.evidence.get("decision", ""))] = verdict.operator
        return approved, rejected

    def _record(self, outcome: GateResult, now: float) -> int:
        d = outcome.decision
        status, gate, reason = ledger_outcome(outcome)
        prev = self._recorded.get((d.id, d.incident))
        if prev is not None and prev[:2] == (status, gate):
            return prev[2]
        if prev is not None and prev[0] == "waiting" and status == "allowed":
            self.ledger.set_decision_outcome(prev[2], "allowed")
            row_id = prev[2]
        else:
            row = self.ledger.record_decision(
                node=d.node, kind=d.recorded_kind, tier=f"T{d.tier}", mode=self.policy.mode, reason=d.reason or d.note,
                outcome=status, incident_id=int(d.incident) if d.incident.isdigit() else None,
                evidence={"decision": d.id, "findings": list(d.finding_ids), **d.detail},
                refused_gate=gate, refused_reason=reason, at=now)
            row_id = row.id
        self._recorded[(d.id, d.incident)] = (status, gate, row_id)
        if status == "refused" and outcome.status == "refused":
            self.metrics.refusals.labels(gate=gate or "error").inc()
        return row_id

    def _record_batch(self, outcomes: list[GateResult], now: float) -> None:
        """Record the outcomes nothing is applied for in ONE transaction: when a whole fleet's agents
        go silent, 10,000 stale-report decisions were 10,000 fsynced commits under the round lock."""
        before = dict(self._recorded)
        try:
            with self.ledger.transaction():
                for outcome in outcomes:
                    self._record(outcome, now)
        except BaseException:
            self._recorded = before  # rolled back: forget the row ids that no longer exist
            raise

    def _breaker(self) -> BreakerState:
        b = self.ledger.breaker_state()
        return BreakerState(open=b.open, opened_at=b.opened_at, reset_at=b.reset_at, cause=b.cause or "",
                            nodes=frozenset(b.nodes))

    def cleared(self, now: float) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
        """node -> (evidence clears, episode clears): finding id -> before. Evidence clears come from
        reintegrations (a repair) and completed reboots; episode clears from undo, close and hand-over.
        Read from SQL within the support window: clears accumulate for as long as the ledger lives."""
        since = now - self.settings.reintegration.support_window_s
        out: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        for node, findings in self.reintegrator.cleared(now).items():
            out.setdefault(node, ({}, {}))[0].update(findings)
        for c in self.ledger.clears(since=since):
            per = out.setdefault(c.node, ({}, {}))[0 if c.scope == "evidence" else 1]
            per[c.finding_id] = max(per.get(c.finding_id, 0.0), c.before)
        return out

    def evaluate(self, now: float, *, only: str | None = None,
                 jobs: Mapping[str, str] | None = None) -> list[tuple[GateResult, ExecResult | None]] | None:
        """One control round (or the part of it for node `only`). None when Slurm is unreachable:
        then nothing is decided or applied (nothing stale is acted on).

        Order: read the fleet; reconcile the ledger with it (adopt writes that landed, notice writes
        Slurm lost or someone took over); then decide from the reports, gate, record and apply. One
        node's bad data is logged and skipped; every other node's decisions still happen. The fleet
        view's reader does not start a read during a whole round (FleetCache.round_started)."""
        if only is not None:
            return self._evaluate(now, only, jobs)
        self.fleet.round_started()
        try:
            return self._evaluate(now, None, jobs)
        finally:
            self.fleet.round_ended()

    def _evaluate(self, now: float, only: str | None,
                  jobs: Mapping[str, str] | None) -> list[tuple[GateResult, ExecResult | None]] | None:
        started = self.clock()

        def moment() -> float:
            """`now` moved on by the time this round has taken: when a decision or a write really
            happened, on the round's own clock (tests hand in a `now` of their own)."""
            return now + max(0.0, self.clock() - started)

        with self.round_lock:
            snap = self._fleet_snapshot()
            if snap is None:
                return None
            mode = self.policy.mode
            if only is None:
                for change in self.reconciler.round(snap.nodes, now, mode, read_at=(
                        snap.read_at if self._fleet_period_s is not None else None)):
                    self.metrics.actions.labels(kind="reconcile", status=change.what).inc()
            with self.reports_lock:
                reports = dict(self.reports)
            cleared = self.cleared(now)
            inb = self._inband(reports, cleared, now)
            for n, extra in inb.findings.items():
                if n in reports:
                    reports[n] = dataclasses.replace(reports[n],
                                                     findings=inband.with_findings(reports[n].findings, extra))
            # only the few nodes with a clear have findings to filter out
            for n, (evidence, episodes) in cleared.items():
                if n in reports:
                    reports[n] = without_cleared(reports[n], evidence, episodes)
            fleet = FleetView.of(MappingProxyType(reports), snap, self.topology_text, self.policy)
            self._load_incidents()
            self._ensure_incidents(reports, fleet.reporting_findings, now, jobs)
            lview = LedgerView(holds=self.ledger.holds(), incidents={k: str(v) for k, v in self._incidents.items()},
                               escalations=self._escalations(reports, fleet.reporting_findings, now),
                               unsettled=self.ledger.unsettled_removals(snap.read_at - WRITE_IN_FLIGHT_S))
            hour = now - 3600.0
            by_part = {p: self.ledger.actions_applied_since(hour, p) for p in fleet.partitions}
            approved, rejected = self._verdicts()
            hang_decisions = self._hang_decisions(inb.hangs, rejected, now) if only is None else ()
            requeues = self.hangs.requeues_since(hour) if any(d.acts for d in hang_decisions) else 0
            ctx, alert = build_context(fleet, lview, self.policy, now, self._breaker(),
                                       actions_last_hour=self.ledger.actions_applied_since(hour),
                                       actions_last_hour_by_partition=by_part, approved=approved,
                                       out_of_service=snap.out_of_service, hang_requeues_last_hour=requeues)
            self._group_incidents(ctx.correlated.values(), now)
            if alert is not None:
                self.ledger.open_breaker(alert.cause, nodes=alert.nodes, at=now)
                _log.error("ALERT %s", alert.text)
            self.metrics.breaker_open.set(1 if ctx.breaker.open else 0)
            decisions = decide(fleet, lview, self.policy, moment())
            if only is not None:
                decisions = tuple(d for d in decisions if d.node == only)
            if only is None and mode != "observe":
                undos, ctx = gate_batch(self.executor.undos(now), ctx)  # operators' undos, planned already
                for outcome in undos:
                    self.metrics.actions.labels(kind="undo", status=self.executor.undo(outcome, now).status).inc()
            # every decision of the round through the same gates and the same act step: policy's, then the
            # hang responder's, then the reintegrator's as it proposes them
            results, ctx = self._carry_out(decisions, ctx, mode, moment)
            if hang_decisions:
                try:
                    self._carry_out(hang_decisions, ctx, mode, moment)
                except LedgerError:
                    raise
                except Exception:  # a hang's requeue must not stop drains or reintegration
                    _log.exception("in-band hangs not handled this round")
            if only is None and mode != "observe":
                self._reintegrate(fleet, lview, ctx, mode, moment)
            if only is None:
                self._observe_round(now)
                self._limited.flush()  # tell the counts of refusals it kept out of the log
            return results

    def _inband(self, reports: Mapping[str, NodeReport],
                cleared: Mapping[str, tuple[dict[str, float], dict[str, float]]], now: float) -> inband.InbandRound:
        """The round's in-band view: findings for the slow ranks of jobs on several nodes, hangs.
        A straggler's episode is carried from round to round; on the first round after a start, one
        still flagged that an operator had dismissed (undo, close) keeps the dismissed episode."""
        if not any(map(_INBAND, reports.values())):
            self.inband_round = inband.InbandRound()
            self._straggler_episodes(now)
            return self.inband_round
        carried = dict(self.inband_round.first_seen)
        if not self._inband_started:
            for node, (_evidence, episodes) in cleared.items():
                for fid, before in episodes.items():
                    if fid.startswith(inband.STRAGGLER_PREFIX):
                        carried.setdefault((node, fid), before)
        self._inband_started = True
        groups = FleetView.build((), (), self.topology_text, self.policy).groups
        try:
            self.inband_round = inband.evaluate(reports.values(), groups, self.settings.inband.detector, now,
                                                self.policy.report_ttl_s, carried)
        except Exception as exc:  # the in-band view must never stop the round's other decisions
            self._limited.warning("inband", "in-band signals not evaluated this round: %s: %s", type(exc).__name__, exc)
            self.inband_round = inband.InbandRound(first_seen=self.inband_round.first_seen)
            return self.inband_round
        self._straggler_episodes(now)
        for node, found in sorted(self.inband_round.findings.items()):
            for f in found:
                if (node, f.id) not in carried:  # a new episode: said once, whatever the tier decides
                    _log.warning("%s: in-band straggler (T%d%s): %s", node, f.tier,
                                 ", recorded only" if f.tier == 3 else "", f.summary)
        return self.inband_round

    def _straggler_episodes(self, now: float) -> None:
        """The round's slow ranks and rank windows, to the jobs' goodput logs."""
        if self.stragglers is None or self.windows is None:
            return
        try:
            self.stragglers.observe(now, [(f.job, f.state.rank, f.node, f.state.gpu, f.straggler.effect)
                                          for f in self.inband_round.flags])
            views = self.inband_round.views
            # only the jobs with a window every rank has newly completed (O(ranks) for the others)
            changed = {job: view for job, view in views.items()
                       if self.windows.wants(job, min((p.state.windows[-1].window if p.state.windows else -1)
                                                      for p in view.ranks.values()) if view.ranks else -1)}
            self.windows.observe(now, {
                job: [goodput_gather.RankWindows(rank, p.node, p.state.gpu, p.state.rail,
                                                 tuple((w.window, w.compute_s) for w in p.state.windows))
                      for rank, p in view.ranks.items()]
                for job, view in changed.items()},
                {job: view.world_size for job, view in changed.items()}, present=views)
        except Exception as exc:  # the goodput log must never stop the round
            self._limited.warning("straggler-log", "in-band records not written to the goodput logs: %s", exc)

    def _write_own(self, job: str, lines: list[str]) -> None:
        assert self.goodput_store is not None
        try:
            goodput_gather.append_own(self.goodput_store, job, lines)
        except ValueError:  # a job id a report carried that is not Slurm's: nothing to charge it to
            _log.debug("straggler episodes of %r not written: not a job id", job)

    def _hang_decisions(self, cases: Iterable[inband.HangCase], rejected: Mapping[str, str],
                        now: float) -> tuple[Decision, ...]:
        """What the hang responder proposes this round (nothing when it cannot say: logged)."""
        try:
            return self.hangs.propose(cases, now, rejected)
        except LedgerError:
            raise
        except Exception:  # a hang's requeue must not stop drains or reintegration
            _log.exception("in-band hangs not handled this round")
            return ()

    def _carry_out(self, decisions: Iterable[Decision], ctx: GateContext, mode: str, moment: Callable[[], float]
                   ) -> tuple[list[tuple[GateResult, ExecResult | None]], GateContext]:
        """Gate a batch of decisions with the round's context, record the outcomes nothing is applied for
        (one transaction), apply the allowed ones (outside observe); and the context after the batch."""
        outcomes, ctx = gate_batch(decisions, ctx)
        acts = [mode != "observe" and o.status == "allowed" for o in outcomes]
        self._record_batch([o for o, a in zip(outcomes, acts, strict=True) if not a], moment())
        return [(o, self._act(o, moment(), mode) if a else None) for o, a in zip(outcomes, acts, strict=True)], ctx

    def round_figures(self, now: float, incidents_since: float | None = None) -> RoundFigures:
        """The fleet gauges' figures at the end of a full round: the reports by freshness and verdict,
        and the ledger's waiting approvals, open incidents, reintegrations and the incidents created
        since `incidents_since` (default: the last week)."""
        ttl = self.policy.report_ttl_s
        with self.reports_lock:
            reports = list(self.reports.values())
        # counted in C: at 100,000 nodes a Python loop here was a fifth of the round
        fresh = dict(Counter(compress(map(_VERDICT, reports), map((now - ttl).__le__, map(_RECEIVED_AT, reports)))))
        waiting = self.ledger.waiting_decisions()
        open_by = self.ledger.open_incident_counts()

        def diff(later: float | None, earlier: float | None) -> float | None:
            return None if later is None or earlier is None else later - earlier

        recent = tuple(IncidentTimings(iid, created, diff(detected, first), diff(decided, detected),
                                       diff(applied, decided), diff(back, first))
                       for iid, created, first, detected, decided, applied, back in self.ledger.incident_stage_times(
                           now - INCIDENT_WINDOW_S if incidents_since is None else incidents_since))
        return RoundFigures(at=now, nodes_reporting=fresh, nodes_stale=len(reports) - sum(fresh.values()),
                            approvals_waiting=len(waiting),
                            oldest_waiting_since=min((d.decided_at for d in waiting), default=None),
                            incidents_open=open_by, reintegrations=self.ledger.reintegration_counts(),
                            incidents=recent, inband_jobs=self.inband_round.jobs,
                            inband_stragglers=self.inband_round.flagged_by_tier(),
                            inband_hangs=len(self.inband_round.hangs))

    def between_rounds(self, monotonic_now: float, next_round_in: float | None = None) -> None:
        """Keep the collector's full passes and the fleet view's reads out of the rounds.

        At 10,000 nodes the reports and the fleet view are about a million long-lived objects, and
        each automatic full collection walked them all, 40-140 ms in the middle of whatever ran (a
        round, a report). So after each round the young generations are collected and every
        survivor is moved out of the collector's sight (gc.freeze): its reference count still frees
        it when it is replaced (reports and node entries are not in reference cycles), and a full
        collection here, between rounds, once every FULL_COLLECT_EVERY_S frees whatever old object
        a cycle kept. `next_round_in`: seconds until the loop's next round, which the fleet view's
        reader keeps clear of (FleetCache.expect_round)."""
        if monotonic_now - self._full_collect_at >= FULL_COLLECT_EVERY_S:
            gc.unfreeze()
            gc.collect()
            self._full_collect_at = monotonic_now
        else:
            gc.collect(1)
        gc.freeze()
        if next_round_in is not None:
            self.fleet.expect_round(time.monotonic() + next_round_in)

    def _observe_round(self, now: float) -> None:
        """Hand this full round's figures to the metrics. Never raises: a metrics problem (the ledger
        busy) must not fail a control round."""
        try:
            self.metrics.observe_round(self.round_figures(now, self.metrics.incidents_since(now)))
        except Exception:
            _log.exception("controller metrics not updated this round")

    def _act(self, outcome: GateResult, now: float, mode: str) -> ExecResult:
        """Apply one allowed outcome through the act step (Executor.apply), the decision recorded by the
        round (each on its own commit, before its Slurm call); a failure of this write never stops the
        round."""
        try:
            result = self.executor.apply(outcome, now, mode=mode, record=lambda: self._record(outcome, now))
        except LedgerError:
            raise  # the ledger itself is broken: nothing can be recorded, so nothing may be done
        except Exception as exc:
            self._limited.warning("act", "%s: %s not applied: %s: %s", outcome.decision.node,
                                  outcome.decision.kind, type(exc).__name__, exc)
            result = ExecResult("failed", f"{type(exc).__name__}: {exc}"[:300])
        self.metrics.actions.labels(kind=outcome.decision.kind, status=result.status).inc()
        if result.status == "applied" and outcome.decision.escalation:
            self._escalate(outcome.decision)
        return result

    def _escalations(self, reports: Mapping[str, NodeReport], reporting_findings: Iterable[str],
                     now: float) -> dict[tuple[str, str], str]:
        """(node, finding id) -> escalation for the actionable findings of fresh reports (of the
        `reporting_findings` nodes), from the
        ledger's remediation counts (the same fault after `inspect_after` remediations, or
        `support_after` remediations of the node within the support window)."""
        rs = self.settings.reintegration
        out: dict[tuple[str, str], str] = {}
        per_node: dict[str, int] | None = None  # read once, when the first node needs them
        per_fault: dict[tuple[str, str], int] = {}
        for node in reporting_findings:
            report = reports[node]
            if now - report.received_at > self.policy.report_ttl_s:
                continue
            try:
                actionable = [f for f in report.findings if is_actionable(f)][:MAX_OPEN_INCIDENTS_PER_NODE]
            except Exception as exc:  # this node's data: its decision says so; the others go on
                self._limited.warning("escalation", "%s: cannot read its findings: %s: %s", node,
                                      type(exc).__name__, exc)
                continue
            if not actionable:
                continue
            if per_node is None:
                per_node = self.ledger.remediations_per_node(now - rs.support_window_s)
                per_fault = self.ledger.remediation_counts(now - rs.inspect_window_s)
            on_node = per_node.get(node, 0)
            for f in actionable:
                if on_node + 1 >= rs.support_after:
                    out[(node, f.id)] = "contact-support"
                elif per_fault.get((node, f.id), 0) >= rs.inspect_after:
                    out[(node, f.id)] = "inspect-hardware"
        return out

    def _escalate(self, decision) -> None:
        if not decision.incident.isdigit():
            return
        self.ledger.set_escalation(int(decision.incident), decision.escalation)
        _log.error("ALERT %s: %s [#%s]: %s", decision.node, decision.escalation, decision.incident, decision.reason)

    def _reintegrate(self, fleet: FleetView, lview: LedgerView, ctx: GateContext, mode: str,
                     moment: Callable[[], float]) -> None:
        """Queue nodes whose fault cleared (auto mode, breaker closed), then move every reintegration on,
        each write it proposes gated with the round's context and applied by the act step."""
        held = [ctx]

        def gate(decisions: Iterable[Decision]) -> tuple[GateResult, ...]:
            outcomes, held[0] = gate_batch(decisions, held[0])
            self._record_batch([o for o in outcomes if o.status != "allowed"], moment())
            return outcomes

        now = ctx.now
        try:
            if not ctx.breaker.open:
                self.reintegrator.auto_requests(fleet, lview.holds, self.policy.mode, now, self.policy.report_ttl_s)
            for r, what in self.reintegrator.step(now, self.policy.mode, gate=gate,
                                                  act=lambda outcome: self._act(outcome, moment(), mode),
                                                  reports=fleet.reports, flags=self.inband_round.flags,
                                                  report_ttl_s=self.policy.report_ttl_s):
                self.metrics.actions.labels(kind="reintegrate", status=r.state).inc()
                _log.info("%s: reintegration %s: %s", r.node, r.id, what)
        except Exception:  # a reintegration problem must not stop drains
            _log.exception("reintegration step failed")

    def _unreadable(self, node: str, why: str) -> None:
        """The read before a write failed: the fleet view is not acted on until it reads Slurm again."""
        self.fleet.failed(why)
        self._limited.warning("act-read", "Slurm unreachable, skipping this round: %s", why)

    def recover(self, now: float) -> None:
        """At start, before the first round: settle what a crash left planned against Slurm (adopted
        when Slurm shows it, abandoned otherwise: re-decided by the next round through every gate).
        Recording the truth is not an action, so this runs in observe mode too."""
        try:
            for change in self.reconciler.at_start(now, self.policy.mode):
                _log.info("recover: action %s: %s %s", change.action_id, change.what, change.detail)
        except LedgerError as exc:
            _log.error("recover: %s", exc)

    def close(self) -> None:
        self.fleet.stop()
        if self.checkers is not None:
            self.checkers.close()
        if self._reader is not None and self._reader is not self.ledger:
            self._reader.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.stragglers is not None:
            try:
                self.stragglers.close()
            except OSError as exc:
                _log.warning("open straggler episodes not written to the goodput logs: %s", exc)


# --------------------------------------------------------------------------- main


def _serve_admin(settings: ControllerSettings, ledger: Ledger, controller: Controller):
    """healthctl's unix socket (healthd.controller.admin): changes for root and `admin_group`; the
    reads include the in-band view the controller holds in memory."""
    gid = None
    if settings.admin_group:
        try:
            gid = grp.getgrnam(settings.admin_group).gr_gid
        except KeyError:
            raise KeyError(f"admin_group {settings.admin_group!r}: no such group") from None
    Path(settings.admin_socket).parent.mkdir(parents=True, exist_ok=True)
    handlers = {**admin.DEFAULT_HANDLERS,
                "inband": admin.inband_handler(lambda job: inband.summary(controller.inband_round, time.time(), job))}
    return admin.serve_admin_socket(settings.admin_socket, ledger, handlers, admin_gid=gid)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthd-controller", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="controller config (default /etc/healthd/controller.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the exact Slurm calls instead of making them")
    p.add_argument("--once", action="store_true", help="recover, run one control round and exit (no server)")
    p.add_argument("--interval", type=float, default=ROUND_INTERVAL_S, help=argparse.SUPPRESS)
    return p


_INCIDENT_RE = re.compile(r"\[#(\d+)\]|\bincident #?(\d+)")
"""Where an incident id appears in the controller's decision and action lines: the Slurm reason's
`[#12]` (policy.reason), `incident 12: ...` (executor), `group incident #12` (this module)."""


class IncidentField(logging.Filter):
    """Adds the journal field INCIDENT to a record that names an incident (`journalctl INCIDENT=12`
    lists a decision, its Slurm call and its outcome). An INCIDENT passed as `extra` wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "INCIDENT", None) is None:
            m = _INCIDENT_RE.search(record.getMessage())
            if m:
                record.INCIDENT = m.group(1) or m.group(2)
        return True


def setup_logging(*, journal: bool | None = None, sender: Callable[..., Any] | None = None) -> None:
    """journald with structured fields (INCIDENT) when systemd runs the controller, else stderr lines.
    `journal`: None decides from the environment; `sender` replaces systemd.journal.send (tests)."""
    sdnotify.setup_logging("healthd-controller", journal=journal, sender=sender, filters=(IncidentField(),),
                           stderr_format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _status(controller: Controller, slurm_ok: bool) -> str:
    """The one-line STATUS= systemd shows: mode, breaker, reports held, and Slurm when unreachable."""
    with controller.reports_lock:
        reports = len(controller.reports)
    try:
        breaker = "open" if controller.ledger.breaker_state().open else "closed"
    except Exception:  # a status line never fails a round
        breaker = "unknown"
    line = f"mode {controller.policy.mode}, breaker {breaker}, {reports} report(s)"
    return line if slurm_ok else line + ", Slurm unreachable"


def main(argv: list[str] | None = None) -> int:
    """Under systemd (Type=notify): READY=1 once the ledger is open, the HTTP server bound and the
    first control round has returned (Slurm unreachable counts: the controller is up and will
    retry); WATCHDOG=1 after each control round that returned, never while one is hung or while the
    fleet view's read of Slurm has been stuck for half a watchdog period."""
    args = _parser().parse_args(argv)
    setup_logging()
    notifier = sdnotify.notifier_from_env()
    dog = sdnotify.Watchdog(notifier, sdnotify.watchdog_period_s())
    try:
        settings = load_controller_settings(args.config)
        topology_text = Path(settings.topology_conf).read_text() if settings.topology_conf else ""
        parse_topology_conf(topology_text)
    except ValueError as exc:  # ConfigError, or a topology.conf that cannot be read
        print(f"healthd-controller: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"healthd-controller: topology_conf: {exc}", file=sys.stderr)
        return 2
    try:
        ledger = Ledger(settings.ledger)
    except LedgerError as exc:  # the message names the file and says why
        print(f"healthd-controller: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"healthd-controller: ledger {settings.ledger}: {exc}", file=sys.stderr)
        return 2
    try:
        backend = default_backend(settings.slurm_conf, _log, dry_run=args.dry_run,
                                  prefer_pyslurm=settings.slurm_backend == "pyslurm")
    except SlurmError as exc:
        print(f"healthd-controller: Slurm: {exc}", file=sys.stderr)
        ledger.close()
        return 2
    controller = Controller(settings, ledger, backend, dry_run=args.dry_run, topology_text=topology_text)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stop.set(), controller.wake.set()))
    _log.info("healthd-controller starting: mode %s, listen %s, ledger %s%s", settings.policy.mode, settings.listen,
              settings.ledger, " (dry run)" if args.dry_run else "")
    controller.refresh_node_addrs(time.time())
    controller.recover(time.time())
    if not args.once:
        # never staler than a round: a harness running rounds faster than the refresh gets reads as often
        controller.start_fleet_refresh(min(settings.fleet_refresh_s, args.interval))
    server = admin_server = accountant = None
    try:
        if args.once:
            controller.evaluate(time.time())
            return 0
        admin_server = _serve_admin(settings, ledger, controller)
        if settings.report_processes:
            controller.start_report_processes(settings.report_processes)
        server = ControllerHTTPServer(settings.listen, controller, max_connections=settings.max_connections,
                                      max_connections_per_peer=settings.max_connections_per_peer)
        server.start_background()
        if settings.metrics_listen:
            controller.metrics.serve(settings.metrics_listen)
        if controller.goodput is not None:
            accountant = GoodputAccountant(controller.goodput, backend, settings.ledger,
                                           controller.metrics.goodput.publish)
            accountant.start()
        ready = False
        status = ""
        # a round at least every quarter watchdog period: with feeds at most every half period, the
        # longest gap between two is then 3/4 of a period plus one round
        interval = args.interval if dog.period_s is None else min(args.interval, dog.period_s / 4)
        while not stop.is_set():
            controller.wake.clear()
            completed = False
            ledger_error = ""
            try:
                slurm_ok = controller.evaluate(time.time()) is not None
                completed = True
            except LedgerError as exc:
                # the ledger cannot record (disk full, read-only, I/O error): nothing is applied without a
                # record, the loop goes on, and a restart would not help, so the watchdog is still fed
                ledger_error = str(exc)
                controller._limited.error("round-ledger", "control round not recorded, nothing applied: %s", exc)
                completed, slurm_ok = True, True
            except Exception as exc:
                controller._limited.error("round", "control round failed: %s: %s", type(exc).__name__, exc)
                _log.debug("control round failed", exc_info=True)
            if completed:
                line = _status(controller, slurm_ok)
                if ledger_error:
                    line += f", ledger cannot record: {ledger_error[:120]}"
                if line != status:
                    notifier.notify(f"STATUS={line}")
                    status = line
                if not ready:
                    notifier.notify("READY=1")
                    ready = True
                # only after a round that returned, and while no read of the fleet has been stuck for half
                # a period (rounds no longer wait for that read: a wedged one would otherwise go unseen)
                stuck = controller.fleet.stuck_for(time.monotonic())
                fed = dog.period_s is None or stuck < dog.period_s / 2
                if not fed:
                    controller._limited.warning("watchdog", "not feeding the systemd watchdog: the read of Slurm's "
                                                "node list has been stuck for %.0f s", stuck)
                dog.feed(time.monotonic(), healthy=fed)
            controller.between_rounds(time.monotonic(), interval)
            # every `interval`, or at once when a report brings a new actionable finding
            controller.wake.wait(interval)
        _log.info("healthd-controller stopping")
        notifier.notify("STOPPING=1")
        return 0
    except (OSError, KeyError) as exc:
        print(f"healthd-controller: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if admin_server is not None:
            admin_server.close()
        if accountant is not None:
            accountant.stop()
        controller.close()
        ledger.close()


if __name__ == "__main__":
    sys.exit(main())
