"""The node agent: collect a Snapshot, classify it, publish the verdict.

`Agent.tick()` is one pass; `run()` is the daemon loop the systemd unit starts. The kernel log is
followed on its own thread (an Xid is classified the moment it is read, not at the next interval);
the other sources (healthd.agent.sources) are collected every `interval_s`.

Exactly-once across restarts: the journal cursor and the history the kernel events were folded
into are written in ONE atomic file (`<state_dir>/agent-state.json`), so a crash either keeps both
or neither, and a restart neither loses nor double-counts a line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from healthd import __version__
from healthd import config as config_mod
from healthd import hookconfig
from healthd.agent import sources as registry
from healthd.agent.metrics import Metrics, TickFigures
from healthd.agent.reporter import Reporter
from healthd.agent.classify.catalog import Catalog, load_catalog
from healthd.agent.classify import Classification, classify
from healthd.agent.history import History, HistoryError
from healthd.agent.hookfiles import HookFiles, merge
from healthd.agent import inband_jobs
from healthd.agent.goodput_log import GoodputLog
from healthd.agent.goodput_ship import GoodputShipper
from healthd.agent.inband_jobs import InbandJobs, JobView
from healthd.agent.instructions import apply_clears, carry_episodes, clear_scope, merge_clears, parse_clear
from healthd.model import KernelSample, Snapshot, XidEvent, iso
from healthd.persist import read_boot_id, read_json_or_quarantine, write_json_atomic
from healthd.sdnotify import Notifier, Watchdog, notifier_from_env, stalled_reason, watchdog_period_s
from healthd.settings import Settings

log = logging.getLogger("healthd")

MEMORY_VERSION = 1


class Sources:
    """The agent's I/O seams: a collector per registered source, by source name (`Sources(nvml=...)`,
    `sources.nvml`), and the kernel log's follower as `kernel`. Tests pass collectors pointed at
    fixtures; None (or left out) means disabled."""

    def __init__(self, kernel: Any = None, **collectors: Any):
        unknown = sorted(set(collectors) - {s.name for s in registry.PERIODIC})
        if unknown:
            raise TypeError(f"Sources: no periodic source named {', '.join(unknown)}")
        self.kernel = kernel
        self.periodic: dict[str, Any] = {s.name: collectors.get(s.name) for s in registry.PERIODIC}

    def __getattr__(self, name: str) -> Any:
        periodic = self.__dict__.get("periodic", {})
        if name in periodic:
            return periodic[name]
        raise AttributeError(name)

    def close(self) -> None:
        for c in (*self.periodic.values(), self.kernel):
            if c is not None:
                try:
                    c.close()
                except Exception as e:  # closing must not mask the real exit reason
                    log.warning("closing %s: %s", type(c).__name__, e)


def _times(raw: Any) -> dict[str, float]:
    """A memory file's {finding id: epoch} map; anything else in it is dropped."""
    if not isinstance(raw, dict):
        return {}
    return {str(k): float(v) for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _nvml_baseline_of(history: Any) -> dict | None:
    """The NVML counter baseline an older agent kept in its history (`baselines`:
    'gpu/<identity>/<counter>' -> [time, value]), in the NVML collector's form, so an upgrade does
    not lose the increases of the tick it happens on."""
    if not isinstance(history, dict) or not isinstance(history.get("baselines"), dict):
        return None
    gpus: dict[str, dict[str, list]] = {}
    for key, pair in history["baselines"].items():
        parts = key.split("/", 2) if isinstance(key, str) else []
        if len(parts) != 3 or parts[0] != "gpu" or not isinstance(pair, list) or len(pair) != 2:
            continue
        t, value = pair
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            gpus.setdefault(parts[1], {})[parts[2]] = [int(value), t]
    boot_id = history.get("boot_id") if isinstance(history.get("boot_id"), str) else None
    return {"version": 1, "boot_id": boot_id, "gpus": gpus} if gpus else None


@dataclass
class Memory:
    """What the agent remembers across restarts (`<state_dir>/agent-state.json`)."""

    history: History
    cursor: str | None = None
    saved: dict = dataclasses.field(default_factory=dict)
    """Source name -> what its collector saved last (`state()`: counter baselines), for the sources
    that persist one."""
    cleared: dict = dataclasses.field(default_factory=dict)
    """finding id -> epoch: evidence up to then no longer counts (the controller's clear-finding)."""
    dismissed: dict = dataclasses.field(default_factory=dict)
    """finding id -> epoch: the episode begun by then no longer counts (clear-finding, scope episode)."""
    episodes: dict = dataclasses.field(default_factory=dict)
    """finding id -> first_seen of its current episode (healthd.agent.instructions.carry_episodes)."""

    @classmethod
    def load(cls, state_dir: str, *, readonly: bool = False) -> "Memory":
        path = Path(state_dir) / "agent-state.json"
        doc = read_json_or_quarantine(path, readonly=readonly)
        if doc is None:
            return cls(history=History())
        if doc.get("version") != MEMORY_VERSION:
            log.error("%s has version %r, expected %d; starting fresh", path, doc.get("version"), MEMORY_VERSION)
            return cls(history=History())
        try:
            history = History.from_json(doc.get("history") or {})
        except HistoryError as e:
            log.error("%s: history is unusable (%s); starting a fresh history", path, e)
            history = History()
        cursor = doc.get("cursor") if isinstance(doc.get("cursor"), str) else None
        saved = {s.name: doc[s.name] for s in registry.PERIODIC if s.persists and isinstance(doc.get(s.name), dict)}
        if "nvml" not in saved and (legacy := _nvml_baseline_of(doc.get("history"))) is not None:
            saved["nvml"] = legacy
        return cls(history=history, cursor=cursor, saved=saved, cleared=_times(doc.get("cleared")),
                   dismissed=_times(doc.get("dismissed")), episodes=_times(doc.get("episodes")))

    def save(self, state_dir: str, states: dict[str, dict | None]) -> None:
        """Write the memory file, with each persisting source's collector state from `states`."""
        write_json_atomic(
            Path(state_dir) / "agent-state.json",
            {
                "version": MEMORY_VERSION,
                "saved_at": time.time(),
                "cursor": self.cursor,
                **{s.name: states.get(s.name) for s in registry.PERIODIC if s.persists},
                "history": self.history.to_json(),
                "cleared": self.cleared,
                "dismissed": self.dismissed,
                "episodes": self.episodes,
            },
            mode=0o600,
        )


def build_sources(settings: Settings, memory: Memory) -> Sources:
    """The real collectors of the enabled sources, each pointed at the roots the config names and
    given back what it saved."""
    built = {
        s.name: s.build(settings, memory.cursor if s.followed else memory.saved.get(s.name))
        for s in registry.SOURCES
        if getattr(settings, s.name).enabled
    }
    return Sources(kernel=built.pop(registry.FOLLOWED.name, None), **built)


def _disabled(cls: type) -> Any:
    return cls(status="no_data", detail="disabled in config")


def _collect(collector: Any, cls: type, now: float, timings: dict[str, float]) -> Any:
    if collector is None:
        return _disabled(cls)
    start = time.perf_counter()
    try:
        sample = collector.collect(now)
    except Exception as e:  # a collector bug must not take the others down with it
        log.exception("collector %s raised", collector.name)
        sample = cls(status="error", detail=f"collector crashed: {type(e).__name__}: {e}")
    timings[collector.name] = time.perf_counter() - start
    return sample


def merge_kernel(samples: list[KernelSample]) -> KernelSample:
    """Fold several reads into one sample for a tick (the follower thread may have read twice)."""
    if not samples:
        return KernelSample(status="ok")
    if len(samples) == 1:
        return samples[0]
    events: dict[tuple, XidEvent] = {}
    identities: dict[str, tuple[str | None, str | None]] = {}
    for s in samples:
        identities.update(s.identities)
        for e in s.events:
            key = (e.xid, e.bus_id, e.text)
            old = events.get(key)
            events[key] = e if old is None else replace(
                old, count=old.count + e.count, last_ts=e.last_ts, last_cursor=e.last_cursor
            )
    last = samples[-1]
    return replace(
        last,
        events=tuple(events.values()),
        identities=identities,
        lines_read=sum(s.lines_read for s in samples),
        malformed=sum(s.malformed for s in samples),
        gap=any(s.gap for s in samples),
        cursor=next((s.cursor for s in reversed(samples) if s.cursor), None),
    )


class Agent:
    """One node's agent. `dry_run=True` reads everything and writes nothing."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        sources: Sources,
        memory: Memory,
        *,
        dry_run: bool,
        clock: Callable[[], float] = time.time,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        metrics: Any = None,
        reporter: Any = None,
        shipper: Any = None,
    ):
        self.settings = settings
        self.catalog = catalog
        self.sources = sources
        self.memory = memory
        self.dry_run = dry_run
        self.clock = clock
        self.monotonic_ns = monotonic_ns
        """CLOCK_MONOTONIC in ns, the clock the in-band rings are stamped with (a simulator passes its own)."""
        self.metrics = metrics
        self.reporter = reporter
        """healthd.agent.reporter.Reporter when controller.url is set (never in dry-run): publish offers it
        every document; it sends on change or heartbeat from its own thread."""
        self.boot_id = read_boot_id()
        self.started_at = clock()
        self.last: dict[str, Any] = {s.name: _disabled(s.sample) for s in registry.PERIODIC}
        self.timings: dict[str, float] = {}
        self.kernel_status = KernelSample(status="ok")
        """Status and detail of the follower's latest read, for ticks without new kernel lines."""
        self.result: Classification | None = None
        self.snapshot: Snapshot | None = None
        self.hook_files = HookFiles()
        """Quick-check results and job bindings the Slurm hooks leave in hooks.run_dir (read only)."""
        self.inband = InbandJobs(settings.inband, ib_root=settings.infiniband.sysfs_root,
                                 goodput=None if dry_run or not settings.inband.goodput_log else
                                 GoodputLog(settings.state_dir, settings.inband.detector.window_steps,
                                            settings.inband.goodput_keep_days))
        """The training jobs' in-band rings under hooks.run_dir/inband (read only); rank 0's events go to
        the job's goodput log in state_dir/goodput (not in dry-run)."""
        self.inband_jobs: tuple[JobView, ...] = ()
        self._inband_first: dict[str, float] = {}
        self._throttles = inband_jobs.Throttles()
        """Each GPU's slowing clock event reasons since they began: a throttle corroborates a straggler
        only when it began with the slowdown and stayed."""
        self._dumps: dict[str, tuple[str, ...]] = {}
        """job -> what asking its ranks for a flight recorder dump did (once per hang)."""
        self._clears: list[tuple[str, dict[str, float]]] = []
        self._clears_lock = threading.Lock()
        self.shipper = shipper
        """healthd.agent.goodput_ship.GoodputShipper when the goodput logs go to the controller: nudged
        after each tick's in-band read."""
        if reporter is not None:
            reporter.on_instruction = self.receive_instruction

    def receive_instruction(self, instruction: dict[str, Any]) -> None:
        """The controller's instruction (from the reporter's thread): queued for the next tick."""
        clears = parse_clear(instruction)  # ValueError: logged by the reporter
        scope = clear_scope(instruction)
        with self._clears_lock:
            self._clears.append((scope, clears))

    # ------------------------------------------------------------------ one pass

    def collect_periodic(self) -> None:
        now = self.clock()
        self.last = {s.name: _collect(self.sources.periodic[s.name], s.sample, now, self.timings)
                     for s in registry.PERIODIC}
        start = time.perf_counter()
        try:
            gpus = {g.index: g.bus_id for g in self.last["nvml"].gpus if g.bus_id}
            processes = {g.index: g.compute_pids for g in self.last["nvml"].gpus if g.compute_pids}
            self.inband_jobs = self.inband.read(self.settings.hooks.run_dir, self.monotonic_ns(), gpus, processes)
        except Exception:  # noqa: BLE001 - a job's files must never stop the agent
            log.exception("reading the in-band rings failed")
            self.inband_jobs = ()
        if self.shipper is not None:
            self.shipper.nudge()  # this tick's goodput lines, and the epilog's since the last
        self._request_dumps()
        self.timings["inband"] = time.perf_counter() - start

    def _request_dumps(self) -> None:
        """Once per hang of a job, ask its ranks for a flight recorder dump (never in dry-run)."""
        hung = {j.job: j for j in self.inband_jobs if j.hang is not None}
        self._dumps = {job: notes for job, notes in self._dumps.items() if job in hung}
        if self.dry_run:
            return
        for job, view in hung.items():
            if job not in self._dumps:
                try:
                    self._dumps[job] = inband_jobs.request_dumps(view)
                except Exception:  # noqa: BLE001 - asking for a dump is best effort
                    log.exception("requesting a flight recorder dump of job %s failed", job)
                    self._dumps[job] = ()
                for note in self._dumps[job]:
                    log.warning("job %s hangs: %s", job, note)

    def read_kernel(self, timeout_s: float = 0.0) -> KernelSample:
        start = time.perf_counter()
        if self.sources.kernel is None:
            sample = _disabled(KernelSample)
        else:
            try:
                sample = self.sources.kernel.read(timeout_s)
            except Exception as e:
                log.exception("kernel log follower raised")
                sample = KernelSample(status="error", detail=f"follower crashed: {type(e).__name__}: {e}")
        self.timings[registry.FOLLOWED.name] = time.perf_counter() - start
        self.kernel_status = KernelSample(status=sample.status, detail=sample.detail)
        return sample

    def classify(self, kernel: KernelSample) -> Classification:
        snap = registry.snapshot(self.settings.node_name, self.clock(), self.boot_id,
                                 {**self.last, registry.FOLLOWED.name: kernel}, dict(self.timings))
        before = self.result
        result = classify(snap, self.memory.history, self.catalog, self.settings)
        result = self.hook_files.apply(result, snap.time, self.settings)
        result = self._with_inband(result, snap)
        with self._clears_lock:
            pending, self._clears = self._clears, []
        for scope, clears in pending:
            if scope == "episode":
                self.memory.dismissed = merge_clears(self.memory.dismissed, clears)
                log.warning("controller dismissed finding(s) %s (the episode begun by %s no longer counts)",
                            ", ".join(sorted(clears)), iso(max(clears.values())))
            else:
                self.memory.cleared = merge_clears(self.memory.cleared, clears)
                log.warning("controller cleared finding(s) %s (evidence up to %s no longer counts)",
                            ", ".join(sorted(clears)), iso(max(clears.values())))
        result, self.memory.episodes = carry_episodes(result, self.memory.episodes)
        result, self.memory.cleared, self.memory.dismissed = apply_clears(result, self.memory.cleared,
                                                                         self.memory.dismissed)
        self.snapshot, self.result = snap, result
        self.memory.history = result.history
        if kernel.cursor:
            self.memory.cursor = kernel.cursor
        self._log_changes(before, result)
        return result

    def _with_inband(self, result: Classification, snap: Snapshot) -> Classification:
        """The classification with the in-band findings of the jobs read last (they change with the
        periodic read, not with kernel lines)."""
        try:
            self._throttles = inband_jobs.throttles(self._throttles, snap, self.inband_jobs)
            extra = inband_jobs.findings(self.inband_jobs, snap, result.findings, self._inband_first, snap.time,
                                         self.settings.inband.detector.window_steps, self._dumps,
                                         throttles=self._throttles)
        except Exception:  # noqa: BLE001 - in-band evidence must never stop the node's own verdict
            log.exception("in-band findings failed")
            return result
        self._inband_first = {f.id: f.first_seen or snap.time for f in extra}
        return merge(result, extra)

    def tick_all(self, max_reads: int = 100) -> Classification:
        """One complete pass for `--once`: every collector, and the kernel log read to its end."""
        self.collect_periodic()
        reads = [self.read_kernel(0.0)]
        while reads[-1].lines_read and len(reads) < max_reads:
            reads.append(self.read_kernel(0.0))
        return self.classify(merge_kernel(reads))

    def tick(self, kernel_timeout_s: float = 0.0, periodic: bool = True) -> Classification:
        if periodic:
            self.collect_periodic()
        return self.classify(self.read_kernel(kernel_timeout_s))

    # ------------------------------------------------------------------ publish

    def publish(self) -> None:
        """State file for the hooks, the agent's memory, metrics. Nothing at all in dry-run."""
        if self.dry_run or self.result is None:
            return
        doc = self.document()
        try:
            write_json_atomic(self.settings.state_file, doc)
        except OSError as e:
            log.error("cannot write state file %s: %s", self.settings.state_file, e)
        try:
            states = {s.name: c.state() for s in registry.PERIODIC
                      if s.persists and (c := self.sources.periodic[s.name]) is not None}
            self.memory.save(self.settings.state_dir, states)
        except OSError as e:
            log.error("cannot save agent state in %s: %s", self.settings.state_dir, e)
        if self.metrics is not None:
            self.metrics.update(TickFigures.of(self.snapshot, self.result.verdict, self.result.findings,
                                               self.inband_jobs))
        if self.reporter is not None:
            try:
                self.reporter.offer(doc)  # returns at once: the POST runs on the reporter's thread
            except Exception:  # reporting must never take the local verdict down with it
                log.exception("offering the report to the controller failed")

    def document(self) -> dict[str, Any]:
        """The JSON document: `healthd --dry-run --format json` prints it, the state file holds it."""
        assert self.result is not None and self.snapshot is not None
        snap, res = self.snapshot, self.result
        return {
            "node": snap.node,
            "verdict": res.verdict,
            "generated_at": iso(snap.time),
            "dry_run": self.dry_run,
            "agent": {
                "version": __version__,
                "pid": os.getpid(),
                "started_at": iso(self.started_at),
                "interval_s": self.settings.interval_s,
                "boot_id": snap.boot_id,
            },
            "sources": {
                s.name: {"status": (sample := registry.sample_of(snap, s)).status, "detail": sample.detail,
                         "seconds": round(snap.collect_seconds.get(s.name, 0.0), 6),
                         **(s.notes(sample) if s.notes is not None else {})}
                for s in registry.SOURCES
            },
            **{s.document_key: s.document(registry.sample_of(snap, s)) for s in registry.SOURCES if s.document},
            "findings": [f.to_json() for f in res.findings],
            "would_do": [dict(w) for w in res.would_do],
            "inband": inband_jobs.to_json(self.inband_jobs, snap, res.findings,
                                          self.settings.inband.detector.history_windows, self._throttles),
        }

    def _log_changes(self, before: Classification | None, after: Classification) -> None:
        old = {f.id: f for f in before.findings} if before else {}
        new = {f.id: f for f in after.findings}
        # the dry-run report already shows every finding; the daemon's log is where they are news
        level = logging.INFO if self.dry_run else logging.WARNING
        for fid, f in new.items():
            if fid not in old or old[fid].tier != f.tier:
                log.log(
                    level,
                    "finding %s: T%d %s %s: %s",
                    fid,
                    f.tier,
                    f.attribution,
                    f.action,
                    f.summary,
                    extra=_journal_fields(self.settings.node_name, f),
                )
        for fid in old.keys() - new.keys():
            log.info("finding %s cleared", fid)
        if before is None or before.verdict != after.verdict:
            log.info("verdict %s (%d findings)", after.verdict, len(after.findings))


def _journal_fields(node: str, f: Any) -> dict[str, Any]:
    fields = {"NODE": node, "FINDING": f.id, "TIER": str(f.tier)}
    if f.component.index is not None:
        fields["GPU"] = str(f.component.index)
    if f.xid is not None:
        fields["XID"] = str(f.xid)
    return fields


# --------------------------------------------------------------------------- the daemon loop


class KernelThread(threading.Thread):
    """Follows the kernel log continuously and hands the main loop every read that carries news:
    events, identities, a gap, or a change of the source's status."""

    def __init__(self, agent: Agent, out: "queue.Queue[KernelSample]", stop: threading.Event):
        super().__init__(name="kernel-log", daemon=True)
        self.agent, self.out, self.stop = agent, out, stop

    def run(self) -> None:
        last = (self.agent.kernel_status.status, self.agent.kernel_status.detail)
        while not self.stop.is_set():
            sample = self.agent.read_kernel(timeout_s=1.0)
            status = (sample.status, sample.detail)
            if sample.events or sample.identities or sample.gap or status != last:
                self.out.put(sample)
                last = status
            if sample.status == "no_data":
                self.stop.wait(30.0)  # nothing to follow on this node; look again later


def build_agent(config_path: str | None, *, dry_run: bool) -> Agent:
    """Load config and catalog (ConfigError/CatalogError propagate: exit 3), then the collectors."""
    settings = config_mod.load(config_path)
    catalog = load_catalog(settings.catalog.path, settings.catalog.overrides)
    memory = Memory.load(settings.state_dir, readonly=dry_run)
    sources = build_sources(settings, memory)
    metrics = None if dry_run else Metrics(settings.metrics)
    reporter = shipper = None
    if not dry_run and settings.controller.url:
        reporter = Reporter(settings.controller, settings.node_name)
        if settings.controller.ship_goodput and settings.inband.goodput_log:
            shipper = GoodputShipper(settings.controller, settings.node_name, settings.state_dir)
    return Agent(settings, catalog, sources, memory, dry_run=dry_run, metrics=metrics, reporter=reporter,
                 shipper=shipper)


def run_loop(agent: Agent, config_path: str | None, on_tick: Callable[[Agent], None],
             notifier: Notifier | None = None) -> int:
    """`healthd run`: follow the kernel log, collect every interval, classify, `on_tick` (publish,
    or print in dry-run). SIGTERM/SIGINT stop it; SIGHUP reloads the config.

    Under systemd (Type=notify): READY=1 after the first complete pass has been published, STATUS=
    with the verdict, and WATCHDOG=1 only while ticks complete and no collector has been stuck in
    one call for longer than the watchdog period (healthd.sdnotify.stalled_reason)."""
    settings = agent.settings
    notifier = notifier if notifier is not None else notifier_from_env()
    dog = Watchdog(notifier, watchdog_period_s())
    stop = threading.Event()
    reload_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload_requested.set())
    log.info("healthd %s starting on %s (interval %.1fs%s%s)", __version__, settings.node_name,
             settings.interval_s, ", dry run" if agent.dry_run else "",
             f", watchdog {dog.period_s:g}s" if dog.period_s else "")

    kernel_q: "queue.Queue[KernelSample]" = queue.Queue()
    agent.tick(kernel_timeout_s=0.0)
    on_tick(agent)
    stuck_since: dict[str, float] = {}
    last_tick = time.monotonic()
    status = _note_progress(agent, notifier, stuck_since, last_tick, "")
    notifier.notify("READY=1")
    follower = KernelThread(agent, kernel_q, stop)
    follower.start()
    next_periodic = time.monotonic() + settings.interval_s
    stalled = ""
    try:
        while not stop.is_set():
            now = time.monotonic()
            if dog.enabled:
                reason = stalled_reason(
                    now, last_tick=last_tick, tick_limit_s=agent.settings.interval_s + dog.period_s,
                    stuck_since=stuck_since, stuck_limit_s=dog.period_s)
                if reason and reason != stalled:
                    log.error("not feeding the systemd watchdog: %s; systemd restarts healthd within %gs",
                              reason, dog.period_s)
                stalled = reason
                dog.feed(now, healthy=not reason)
            if reload_requested.is_set():
                reload_requested.clear()
                notifier.notify("RELOADING=1")
                _reload(agent, config_path)
                notifier.notify("READY=1")
            pending: list[KernelSample] = []
            wait = max(0.0, next_periodic - time.monotonic())
            due = dog.next_due(time.monotonic())
            try:
                pending.append(kernel_q.get(timeout=min(1.0, wait, 1.0 if due is None else max(due, 0.05))))
                while True:
                    pending.append(kernel_q.get_nowait())
            except queue.Empty:
                pass
            periodic = time.monotonic() >= next_periodic
            if periodic:
                agent.collect_periodic()
                next_periodic = time.monotonic() + agent.settings.interval_s
            if pending or periodic:
                agent.classify(merge_kernel(pending) if pending else agent.kernel_status)
                on_tick(agent)
                last_tick = time.monotonic()
                status = _note_progress(agent, notifier, stuck_since, last_tick, status)
    finally:
        stop.set()
        notifier.notify("STOPPING=1")
        follower.join(timeout=3.0)
        agent.sources.close()
        if agent.reporter is not None:
            agent.reporter.stop(flush_s=min(2.0, agent.settings.controller.timeout_s))
        if agent.shipper is not None:
            agent.shipper.stop()
        log.info("healthd stopped")
    return 0


def _note_progress(agent: Agent, notifier: Notifier, stuck_since: dict[str, float], now: float, status: str) -> str:
    """After a tick: track how long each collector has been stuck (a `timeout` sample means its call
    is still running; the call began at least call_timeout_s before the first such sample), and send
    STATUS= when the one-line summary changed. Returns the summary sent last."""
    for name, sample in agent.last.items():
        if getattr(sample, "error_kind", None) == "timeout":
            began = now - (agent.settings.nvml.call_timeout_s if name == "nvml" else 0.0)
            stuck_since.setdefault(name, began)
        else:
            stuck_since.pop(name, None)
    res = agent.result
    line = f"verdict {res.verdict}, {len(res.findings)} finding(s)" if res is not None else "no verdict yet"
    if stuck_since:
        line += "; stuck: " + ", ".join(sorted(stuck_since))
    if line != status:
        notifier.notify(f"STATUS={line}")
    return line


def _reload(agent: Agent, config_path: str | None) -> None:
    """SIGHUP: a bad new config keeps the last good one and says why. Thresholds, expectations and
    the catalog apply at once; changed collector roots (sysfs, journal) need a restart."""
    try:
        settings = config_mod.load(config_path)
        catalog = load_catalog(settings.catalog.path, settings.catalog.overrides)
    except ValueError as e:  # ConfigError and CatalogError are ValueErrors
        log.error("reload refused, keeping the running configuration: %s", e)
        return
    def roots(s: Settings) -> tuple:
        return (registry.restart_settings(s), s.state_file, s.state_dir, s.metrics, s.controller)

    if roots(settings) != roots(agent.settings):
        log.warning("reload: collector roots, state paths, metrics or controller changed; they take effect at restart")
    agent.settings, agent.catalog = settings, catalog
    log.info("configuration reloaded from %s", config_path or config_mod.NODE_CONFIG_PATH)
    publish_hook_config(config_path)  # the hooks' compiled copy follows the reload


def publish_hook_config(config: str | None) -> str:
    """Compile the config for the Slurm hooks (healthd.hookconfig); the path written, or '' when it
    could not be: the hooks then read the YAML, which is slower but the same."""
    try:
        path, why = hookconfig.write(config)
    except (OSError, ValueError) as e:  # ConfigError too; the agent validated the same file just before
        path, why = "", str(e)
    if not path:
        log.warning("configuration not compiled for the Slurm hooks (they read the YAML): %s", why)
    return path
