"""healthd-controller: receive signed reports, decide, gate, and (in supervised/auto) act on Slurm.

    healthd-controller [--config FILE] [--dry-run] [--once]

At start: load the config, open the ledger, pick the Slurm backend, finish what a crash left half done
(Controller.recover), then serve HTTP and run a control round every few seconds, its steps in order
(healthd.controller.round): reconcile, in-band, incidents, decide, gate, act, reintegrate, observe.
Observe mode (the default) never calls a Slurm write. SIGTERM stops cleanly.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import grp
import logging
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from healthd import munge, sdnotify
from healthd.controller import admin, goodput_gather, inband
from healthd.controller.config import ControllerSettings, load_controller_settings
from healthd.controller.executor import ExecResult, Executor
from healthd.controller.fleetcache import FleetCache, SlurmSnapshot
from healthd.controller.gates import GateResult
from healthd.controller.goodput_jobs import GoodputAccountant
from healthd.controller.history import History
from healthd.controller.incidents import MAX_OPEN_INCIDENTS_PER_NODE as MAX_OPEN_INCIDENTS_PER_NODE
from healthd.controller.intake import DrainRequest, Intake, NodeAddresses, answer
from healthd.controller.intake import slurm_node_addrs as slurm_node_addrs
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.metrics import ControllerMetrics, RoundFigures
from healthd.controller.policy import NodeReport, parse_topology_conf
from healthd.controller.reconcile import Reconciler
from healthd.controller.recorder import Recorder
from healthd.controller.reintegrate import Reintegrator
from healthd.controller.round import RoundParts, RoundState, figures, run, usable_snapshot
from healthd.controller.server import ControllerHTTPServer
from healthd.controller.verifier import CheckerPool
from healthd.lograte import RateLimitedLog
from healthd.slurm import default_backend
from healthd.slurm.backend import SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller")

ROUND_INTERVAL_S = 5.0
FULL_COLLECT_EVERY_S = 3600.0
"""How often the daemon runs a full garbage collection between rounds (Controller.between_rounds)."""


class Controller:
    """The daemon's composition root: it builds the intake (healthd.controller.intake) and the round's
    parts (healthd.controller.round), keeps what lasts from one round to the next (the in-band view),
    and runs a round on them. The HTTP server, the admin socket, the main loop and the tests drive it."""

    def __init__(self, settings: ControllerSettings, ledger: Ledger, backend: SlurmBackend, *,
                 dry_run: bool = False, metrics: ControllerMetrics | None = None,
                 clock: Callable[[], float] = time.time, decode: Callable[..., Any] = munge.decode,
                 executor: Executor | None = None, topology_text: str = "",
                 node_addrs: Callable[[], Mapping[str, str]] | None = None, slurm_wait_s: float = 20.0,
                 out: Callable[[str], None] | None = None):
        self.settings = settings
        self.policy = settings.policy
        """Policy's settings; each round reads them as it begins."""
        self.ledger = ledger
        self.backend = backend
        self.dry_run = dry_run
        self.metrics = metrics or ControllerMetrics()
        self.clock = clock
        self.executor = executor or Executor(backend, ledger, dry_run=dry_run, requeue_opt_in=settings.requeue_opt_in,
                                             clock=clock, out=out)
        self.fleet = FleetCache(backend, clock=clock)
        """Slurm's node list: refreshed by a thread of its own in the daemon (start_fleet_refresh),
        else read (incrementally) at the start of each round."""
        self.executor.on_node_read = self.fleet.note
        self.executor.on_unreadable = self._unreadable
        self._fleet_period_s: float | None = None
        self._full_collect_at = time.monotonic()
        self._limited = RateLimitedLog(_log)
        self.reconciler = Reconciler(self.executor)
        self.reintegrator = Reintegrator(settings.reintegration, ledger, backend, read_node=self.executor.read_node,
                                         slurm_conf=settings.slurm_conf, dry_run=dry_run,
                                         detector=settings.inband.detector)
        self.topology_text = topology_text
        self.slurm_wait_s = slurm_wait_s
        self.addresses = NodeAddresses(settings.node_addrs, node_addrs)
        self.goodput = settings.goodput.at(settings.ledger)
        """The goodput settings with the directory resolved; None when goodput is not enabled."""
        self.goodput_store = (goodput_gather.GoodputStore(self.goodput.directory, self.goodput.max_log_bytes)
                              if self.goodput is not None and self.goodput.directory else None)
        self.inband_logs = goodput_gather.InbandLogs(self.goodput_store) if self.goodput_store else None
        self.stragglers = self.inband_logs.stragglers if self.inband_logs else None
        """Slow ranks' episodes, written to their jobs' goodput logs as they end."""
        self.windows = self.inband_logs.windows if self.inband_logs else None
        """Each job's rank x window compute time, written to its goodput log for the report's heatmap."""
        self.intake = Intake(settings, ledger, self.metrics, self._limited, addresses=self.addresses,
                             instructions=self.reintegrator.instructions_for, clock=clock, decode=decode,
                             goodput=self.goodput_store)
        self.reports = self.intake.reports
        self.reports_lock = self.intake.lock
        self.wake = self.intake.wake
        """Set by a report that brings a new actionable finding: the main loop runs a round at once."""
        self.hangs = inband.HangResponder(ledger, self.executor.list_jobs, settings.requeue_opt_in)
        self.parts = RoundParts(settings, ledger, self.executor, self.reconciler, self.reintegrator, self.hangs,
                                Recorder(ledger, self.metrics), self.metrics, self._limited, clock, topology_text,
                                self.inband_logs)
        self.round_lock = threading.Lock()  # one round at a time (control loop or a request)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="healthd-eval")
        self.inband_round = inband.InbandRound()
        """What the latest round made of the in-band data (the round gauges and `healthctl inband` read it)."""
        self._inband_started = False
        self.history: History | None = None
        """The rounds' inputs kept for replay (healthd.controller.history), opened at the first round
        (a controller that ran none leaves no file); None when not kept."""
        self._history_wanted = settings.history.enabled and not dry_run and str(ledger.path) != ":memory:"

    def _open_history(self) -> History | None:
        keep = self.settings.history
        self._history_wanted = False  # tried once: a file that cannot be opened is said once
        path = keep.file(str(self.ledger.path))
        try:
            return History(path, keep_days=keep.keep_days, flush_s=keep.flush_s)
        except (sqlite3.Error, OSError) as exc:
            _log.error("the rounds' inputs are not kept for replay: %s: %s", path, exc)
            return None

    def _record(self, now: float, received: Mapping[str, NodeReport], snap: SlurmSnapshot) -> None:
        if self.history is None and self._history_wanted:
            self.history = self._open_history()
        if self.history is None:
            return
        try:
            skipped = self.history.record(now, received, snap.nodes, snap.version, self.policy.report_ttl_s)
        except Exception as exc:  # keeping for replay never stops a round
            self._limited.warning("history", "the round's inputs were not kept for replay: %s", exc)
            return
        if skipped:
            self._limited.warning("history-node", "not kept for replay this round: %s", "; ".join(skipped[:3]))

    # -- node addresses and the fleet view -------------------------------------------------------------

    def node_addrs(self) -> Mapping[str, str]:
        """node -> MUNGE origin address (NodeAddresses): never read from Slurm on a request thread."""
        return self.addresses()

    def refresh_node_addrs(self, now: float) -> None:
        """Re-read NodeAddr from Slurm when the config names none (at most every 5 minutes)."""
        self.addresses.refresh(now, self.backend, self.fleet.node_addresses)

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

    def _unreadable(self, node: str, why: str) -> None:
        """The read before a write failed: the fleet view is not acted on until it reads Slurm again."""
        self.fleet.failed(why)
        self._limited.warning("act-read", "Slurm unreachable, skipping this round: %s", why)

    # -- HTTP entry points (healthd.controller.intake) -------------------------------------------------

    @property
    def checkers(self) -> CheckerPool | None:
        """Worker processes that check reports (start_report_processes); None: checked in-process."""
        return self.intake.checkers

    @checkers.setter
    def checkers(self, pool: CheckerPool | None) -> None:
        self.intake.checkers = pool

    def start_report_processes(self, processes: int) -> None:
        """Check reports in `processes` worker processes from now on: the report server hands them its
        /v1/report bodies (receive_report_later); close() stops them."""
        self.intake.start_processes(processes)

    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        return self.intake.report(body, peer)

    def receive_report_later(self, body: bytes, peer: str, done: Callable[[tuple[int, dict[str, Any]]], None]) -> None:
        """receive_report with the checks in a worker process: call on the report server's event loop;
        done(status, payload) is called there too."""
        self.intake.report_later(body, peer, done)

    def receive_goodput(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        return self.intake.shipment(body, peer)

    def receive_request(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]:
        """A prolog's drain request, decided by a round for its node alone within `slurm_wait_s`."""
        asked = self.intake.request(body, peer)
        if not isinstance(asked, DrainRequest):
            return asked
        future = self._pool.submit(self._decide_request, asked)
        try:
            granted, reason = future.result(timeout=self.slurm_wait_s)
        except concurrent.futures.TimeoutError:
            reason = f"controller could not decide within {self.slurm_wait_s:.0f} s (Slurm slow?)"
            _log.warning("drain request from %s: %s", asked.node, reason)
            return 200, {"granted": False, "reason": reason}
        _log.info("drain request from %s (job %s): granted=%s: %s", asked.node, asked.job, granted, reason)
        return 200, {"granted": granted, "reason": reason}

    def _decide_request(self, asked: DrainRequest) -> tuple[bool, str]:
        self.intake.hold(asked)
        return answer(asked, self.evaluate(asked.at, only=asked.node, jobs=asked.jobs))

    # -- the control round (healthd.controller.round) ----------------------------------------------------

    def evaluate(self, now: float, *, only: str | None = None,
                 jobs: Mapping[str, str] | None = None) -> list[tuple[GateResult, ExecResult | None]] | None:
        """One control round (or the part of it for node `only`): policy's outcomes and what the act step
        did with each. None when Slurm is unreachable: then nothing is decided or applied (nothing stale
        is acted on). A step's failure that stops the round is raised here (a LedgerError: nothing after
        it was applied). The fleet view's reader does not start a read during a whole round
        (FleetCache.round_started)."""
        if only is not None:
            return self._round(now, only, jobs)
        self.fleet.round_started()
        try:
            return self._round(now, None, jobs)
        finally:
            self.fleet.round_ended()

    def _round(self, now: float, only: str | None,
               jobs: Mapping[str, str] | None) -> list[tuple[GateResult, ExecResult | None]] | None:
        started = self.clock()
        with self.round_lock:
            snap = usable_snapshot(self.fleet, self._fleet_period_s, self.clock(), self._limited)
            if snap is None:
                return None
            received = self.intake.snapshot()
            state = run(self.parts, RoundState(
                now=now, started=started, policy=self.policy, snapshot=snap, received=received,
                read_at=snap.read_at if self._fleet_period_s is not None else None, only=only, jobs=jobs,
                inband_round=self.inband_round, inband_started=self._inband_started))
            self.inband_round, self._inband_started = state.inband_round, state.inband_started
            self._record(now, received, snap)
            if state.stopped is not None:
                raise state.stopped
            return list(state.results)

    def round_figures(self, now: float, incidents_since: float | None = None) -> RoundFigures:
        """The fleet gauges' figures (round.figures) over every node's latest report and the latest
        in-band view; incidents created since `incidents_since` (default: the last week)."""
        return figures(self.ledger, self.intake.snapshot().values(), self.inband_round, self.policy.report_ttl_s,
                       now, incidents_since)

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
        history, self.history = self.history, None
        if history is not None:
            try:
                history.close()
            except (sqlite3.Error, OSError) as exc:
                _log.warning("the rounds' inputs kept for replay were not flushed at stop: %s", exc)
        self.fleet.stop()
        self.intake.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.inband_logs is not None:
            try:
                self.inband_logs.close()
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


def _cannot_start(message: str) -> int:
    """Say on stderr why the controller stops (systemd's journal shows it) and give the exit status for it."""
    print(f"healthd-controller: {message}", file=sys.stderr)
    return 2


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
        return _cannot_start(str(exc))
    except OSError as exc:
        return _cannot_start(f"topology_conf: {exc}")
    try:
        ledger = Ledger(settings.ledger)
    except LedgerError as exc:  # the message names the file and says why
        return _cannot_start(str(exc))
    except Exception as exc:
        return _cannot_start(f"ledger {settings.ledger}: {exc}")
    try:
        backend = default_backend(settings.slurm_conf, _log, dry_run=args.dry_run,
                                  prefer_pyslurm=settings.slurm_backend == "pyslurm")
    except SlurmError as exc:
        ledger.close()
        return _cannot_start(f"Slurm: {exc}")
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
        return _cannot_start(str(exc))
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
