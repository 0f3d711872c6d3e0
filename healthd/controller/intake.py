"""The controller's intake: what reaches it over HTTP. An agent's report is verified (the MUNGE
credential, the node's origin, every field; in worker processes or in-process), stored as the node's
latest, and answered with the agent's instructions; a prolog's drain request is verified and handed
to the round as a value (DrainRequest) the round decides on alone; a node's goodput shipment is
appended to its job's gathered log.

The reports it keeps are what every round starts from (`snapshot`); a report that brings a new
actionable finding sets `wake`, so the main loop runs a round at once.
"""

from __future__ import annotations

import logging
import socket as _socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from healthd import munge
from healthd.controller import goodput_gather
from healthd.controller.auth import ReportRejected, VerifiedReport, verify_report
from healthd.controller.config import ControllerSettings
from healthd.controller.executor import ExecResult
from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import NodeReport, finding_from_json, is_actionable
from healthd.controller.verifier import Checked, CheckerPool, Refused, check_report
from healthd.lograte import RateLimitedLog
from healthd.model import Finding
from healthd.report_schema import MAX_ERROR_CHARS, validate_request
from healthd.slurm.backend import SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller")

ADDR_REFRESH_S = 300.0
"""How often Slurm's NodeAddr is resolved again when the config names no node addresses."""
Answer = tuple[int, dict[str, Any]]
"""An HTTP status and the JSON document answered."""
Instructions = Callable[[NodeReport, Ledger], list[dict[str, Any]]]
"""The agent's instructions for its report, read from a ledger (Reintegrator.instructions_for)."""


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


class NodeAddresses:
    """node -> the MUNGE origin a report from it must come from: the config's `node_addrs`, else a
    provider handed in (tests), else Slurm's NodeAddr as last resolved (`refresh`, never on a request
    thread)."""

    def __init__(self, configured: Mapping[str, str], provider: Callable[[], Mapping[str, str]] | None = None):
        self.configured = configured
        self.provider = provider
        self._cache: dict[str, str] = {}
        self._read_at = 0.0

    def __call__(self) -> Mapping[str, str]:
        if self.configured:
            return self.configured
        if self.provider is not None:
            return self.provider()
        return self._cache

    def refresh(self, now: float, backend: SlurmBackend, known: Callable[[], Mapping[str, str] | None]) -> None:
        """Resolve Slurm's NodeAddr again, at most every ADDR_REFRESH_S: those the fleet view read with
        the node list (`known`), else a read of its own."""
        if self.configured or self.provider is not None:
            return
        if self._cache and now - self._read_at < ADDR_REFRESH_S:
            return
        addrs = slurm_node_addrs(backend, known())
        if addrs:
            self._cache = addrs
            self._read_at = now


def news(previous: NodeReport | None, report: NodeReport) -> bool:
    """The report carries an actionable finding the previous one from that node did not."""
    known = {f.id for f in previous.findings} if previous is not None else set()
    return any(is_actionable(f) and f.id not in known for f in report.findings)


@dataclass(frozen=True)
class DrainRequest:
    """A prolog's verified request that its node be drained for one finding (gating `controller`)."""

    node: str
    """The node the request came from (its MUNGE credential's), the one it asks to drain."""
    finding: Finding
    """The finding the prolog refuses the job for."""
    job: str | None
    """The job the prolog refuses; it joins the finding's incident."""
    at: float
    """When it was received: the time of the round that decides it."""

    @property
    def jobs(self) -> dict[str, str] | None:
        return {self.node: self.job} if self.job else None


def answer(request: DrainRequest, results: Iterable[tuple[GateResult, ExecResult | None]] | None) -> tuple[bool, str]:
    """(granted, why) for a drain request, from what the round for its node did."""
    if results is None:
        return False, "Slurm is unreachable: not acting"
    for outcome, result in results:
        if outcome.decision.node != request.node:
            continue
        if outcome.status != "allowed":
            return False, f"{outcome.label}: {outcome.reason or outcome.decision.note}"
        if result is not None and result.status in ("applied", "already-applied"):
            return True, f"{outcome.decision.kind} applied: {outcome.decision.reason}"
        return False, f"allowed but not applied: {result.status if result else 'no result'} " \
                      f"{result.detail if result else ''}".strip()
    return False, "no decision for this node"


class Intake:
    """Reports, drain requests and goodput shipments, verified and kept or handed on."""

    def __init__(self, settings: ControllerSettings, ledger: Ledger, metrics: ControllerMetrics, log: RateLimitedLog,
                 *, addresses: NodeAddresses, instructions: Instructions, clock: Callable[[], float] = time.time,
                 decode: Callable[..., Any] = munge.decode, goodput: goodput_gather.GoodputStore | None = None):
        self.settings = settings
        self.ledger = ledger
        self.metrics = metrics
        self.log = log
        self.addresses = addresses
        self.instructions = instructions
        self.clock = clock
        self.decode = decode
        """libmunge's decode; tests hand in their own."""
        self.goodput = goodput
        """Where shipped goodput lines are appended; None when this controller takes none."""
        self.reports: dict[str, NodeReport] = {}
        """node -> its latest report."""
        self.lock = threading.Lock()
        """Held while `reports` is read or changed (the report server's loop and the round)."""
        self.wake = threading.Event()
        """Set by a report that brings a new actionable finding: the main loop runs a round at once."""
        self.checkers: CheckerPool | None = None
        """Worker processes that check reports (start_processes); None: checked in-process."""
        self._reader: Ledger | None = None

    def snapshot(self) -> dict[str, NodeReport]:
        """Every node's latest report, as it stands now."""
        with self.lock:
            return dict(self.reports)

    def verify(self, body: bytes, what: str, peer: str) -> tuple[VerifiedReport, float]:
        now = self.clock()
        try:
            return verify_report(body, socket=self.settings.munge_socket, node_addrs=self.addresses(), now=now,
                                 decode=self.decode), now
        except ReportRejected as exc:
            self.refused(what, peer, exc.http_status, exc.reason)
            raise

    def refused(self, what: str, peer: str, status: int, reason: str) -> None:
        # a flood of forged or replayed reports is one line per status per interval, not one per report
        self.log.warning(f"refused-{status}", "%s from %s refused: %d %s", what, peer or "?", status, reason)
        self.metrics.reports.labels(result=str(status)).inc()

    # -- reports -------------------------------------------------------------------------------------

    def start_processes(self, processes: int) -> None:
        """Check reports in `processes` worker processes (healthd.controller.verifier) from now on; they
        decode through libmunge and the controller's munged."""
        self.checkers = CheckerPool(processes, self.settings.munge_socket)

    def report(self, body: bytes, peer: str = "") -> Answer:
        """Check a report here, store it and answer it."""
        started = time.monotonic()
        now = self.clock()
        out = check_report(body, socket=self.settings.munge_socket, node_addrs=self.addresses(), now=now,
                           decode=self.decode)
        return self._store(out, peer, now, started, self.ledger)

    def report_later(self, body: bytes, peer: str, done: Callable[[Answer], None]) -> None:
        """`report` with the checks in a worker process: call on the report server's event loop; done()
        is called there too. Storing reads the ledger through a read-only connection of its own, so the
        loop never waits behind a round's transaction."""
        assert self.checkers is not None
        started = time.monotonic()
        now = self.clock()

        def checked(out: Checked | Refused) -> None:
            try:
                result = self._store(out, peer, now, started, self._loop_ledger())
            except Exception as exc:  # a bug of ours: answered 500, the loop goes on
                _log.exception("report from %s: storing it failed", peer or "?")
                result = 500, {"error": f"internal error: {type(exc).__name__}"}
            done(result)

        self.checkers.submit(body, now, self.addresses(), checked)

    def _loop_ledger(self) -> Ledger:
        if self._reader is None:
            try:
                self._reader = Ledger.open_readonly(self.ledger.path)
            except LedgerError as exc:
                _log.warning("report intake reads the ledger through the controller's own connection: %s", exc)
                self._reader = self.ledger
        return self._reader

    def _store(self, out: Checked | Refused, peer: str, now: float, started: float, ledger: Ledger) -> Answer:
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
                self.refused("report", peer, out.status, out.reason)
            else:
                self.log.warning("refused-400", "report refused: 400 %s", out.reason)
                self.metrics.reports.labels(result="400").inc()
            return out.status, {"accepted": False, "error": out.reason}
        with self.lock:
            previous = self.reports.get(report.node)
            self.reports[report.node] = report
        if news(previous, report):
            self.wake.set()  # a new actionable finding: decide now, not at the next round
        try:
            instructions = self.instructions(report, ledger)
        except Exception:  # the ledger busy or broken: the report is still accepted
            _log.exception("instructions for %s", report.node)
            instructions = []
        self.metrics.reports.labels(result="accepted").inc()
        self.metrics.report_latency.observe(time.monotonic() - started)
        return 200, {"accepted": True, "instructions": instructions}

    # -- drain requests ------------------------------------------------------------------------------

    def request(self, body: bytes, peer: str = "") -> DrainRequest | Answer:
        """A verified drain request, or the answer refusing it."""
        try:
            verified, now = self.verify(body, "drain request", peer)
        except ReportRejected as exc:
            return exc.http_status, {"granted": False, "reason": exc.reason}
        doc = verified.report
        try:
            validate_request(doc, node=verified.node)  # every field, as for a report
            finding = finding_from_json(doc["finding"], checked=True)
        except (KeyError, ValueError, TypeError) as exc:
            reason = f"drain request from {verified.node!r} is malformed: {str(exc)[:MAX_ERROR_CHARS]}"
            self.log.warning("refused-400-request", "drain request refused: 400 %s", reason)
            self.metrics.reports.labels(result="400").inc()
            return 400, {"granted": False, "reason": reason}
        job = doc.get("job")
        return DrainRequest(verified.node, finding, str(job) if job else None, now)

    def hold(self, request: DrainRequest) -> None:
        """The request's finding becomes part of its node's latest report (a failed verdict), so the
        round for the node decides on it with everything else the node reported."""
        with self.lock:
            previous = self.reports.get(request.node)
            kept = tuple(f for f in (previous.findings if previous else ()) if f.id != request.finding.id)
            self.reports[request.node] = NodeReport(
                node=request.node, verdict="failed", findings=(request.finding, *kept), received_at=request.at,
                inband=previous.inband if previous else ())

    # -- goodput shipments ---------------------------------------------------------------------------

    def shipment(self, body: bytes, peer: str = "") -> Answer:
        """A node's goodput log lines (healthd.controller.goodput_gather), appended to the job's
        gathered log; off the event loop (a disk write and fsync)."""
        if self.goodput is None:
            return 404, {"accepted": False, "error": "this controller takes no goodput logs (goodput.enabled)"}
        try:
            verified, _ = self.verify(body, "goodput shipment", peer)
        except ReportRejected as exc:
            return exc.http_status, {"accepted": False, "error": exc.reason}
        try:
            shipment = goodput_gather.parse_shipment(verified.report)
            through = self.goodput.append(verified.node, shipment)
        except goodput_gather.ShipmentRefused as exc:
            self.log.warning(f"refused-goodput-{exc.status}", "goodput shipment from %s refused: %d %s",
                             verified.node, exc.status, exc.reason)
            self.metrics.goodput_shipments.labels(result=str(exc.status)).inc()
            return exc.status, {"accepted": False, "error": exc.reason}
        except OSError as exc:
            self.log.error("goodput-store", "goodput shipment from %s not stored: %s", verified.node, exc)
            self.metrics.goodput_shipments.labels(result="503").inc()
            return 503, {"accepted": False, "error": f"not stored: {exc.strerror or exc}"}
        self.metrics.goodput_shipments.labels(result="accepted").inc()
        return 200, {"accepted": True, "through": through}

    def close(self) -> None:
        if self.checkers is not None:
            self.checkers.close()
        if self._reader is not None and self._reader is not self.ledger:
            self._reader.close()
