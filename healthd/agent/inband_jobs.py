"""The agent's view of the training jobs on its node, from their in-band rings.

Each tick (`InbandJobs.read`) lists the job directories under `<hooks.run_dir>/inband/` (the prolog's,
one per job, owned by the job's user), reads each rank's ring past what it has already read
(healthd.agent.inband), and keeps, per rank, its recent steps; from those it builds the per-rank
window summaries, the stragglers among the ranks on this node and a hang (healthd.progress).

What the job wrote is the job's word about itself: a ring can only make the job look slow or stuck,
never fail the node. So in-band findings (`findings`) are tier 3 and act on nothing, unless
out-of-band evidence on the same GPU or the same network rail says the same (`corroboration`): then
tier 2, which the controller only acts on within its envelope (approval for T2). Stragglers are
flagged here only for a job whose ranks are all on this node; a job across nodes is compared by the
controller from every node's window summaries (`to_json`, the report's `inband` section).
"""

from __future__ import annotations

import logging
import os
import statistics
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from healthd.agent.goodput_log import GoodputLog
from healthd.agent.inband import CKPT_BEGIN, CKPT_END, DURABLE, RESTORED, STEP, RingError, read_ring
from healthd.inband_layout import DONE_DIR, INBAND_DIR, ring_rank, valid_job
from healthd.lograte import WarnOnce
from healthd.model import NODE, Component, Evidence, Finding, GpuSample, Snapshot
from healthd.progress import (Hang, RankProgress, RankWindow, StepSample, Straggler, hang, stall, stragglers, summarize,
                              waits_elsewhere)
from healthd.progress import THROTTLE_WORDS, throttle_coincides, with_baseline
from healthd.settings import InbandSettings
from healthd.text import clean
from healthd.trusted import TRUSTED_UID, TrustedDir

log = logging.getLogger("healthd")

MAX_JOBS = 64
"""Job directories read per tick: a node runs a handful of jobs; more is a leftover or a flood."""
MIN_STEPS_FOR_MEDIAN = 5
MAX_WAITS = 256
MAX_FIRST_WINDOWS = 8
"""A rank's first windows sent besides its newest history_windows (inband.detector.baseline_windows,
up to this many)."""
"""Per-step waits are sent (small jobs' rank-order test) only for windows up to this many steps."""
MAX_LOOK_S = 30.0
"""The longest gap between two reads taken as the agent's tick: a longer one is a hiccup of the
agent's own, and naming stalls that much early would name stalls that are not hangs."""
START_SLACK_NS = 1_000_000_000
"""A process counts as a ring's writer only if it started before the ring did, give or take this:
/proc's start times are in clock ticks, and the two clocks are read at different moments."""
LAUNCH_SPREAD_NS = 60_000_000_000
"""The ranks of one launch on a node set their rings up within this of each other (they start
together and import the client within seconds); a later step starts after the earlier one ran."""
MAX_RETIRED = 64
"""Retired rings listed per job in the state document."""

# NVML clock event (throttle) reasons that slow a GPU down for a reason of its own: hardware
# slowdown, software and hardware thermal slowdown, power brake. Idle, application clocks, the
# software power cap and sync boost are how a healthy GPU runs.
THROTTLE_SLOWING = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


@dataclass
class _Rank:
    """What the agent keeps of one rank's ring between ticks (mutable, this module only)."""

    identity: tuple[int, int]
    """(pid, start monotonic ns) of the ring's writer: a new process of the rank starts a new ring."""
    samples: deque
    after: int = 0
    last_step: int = -1
    last_step_mono: int = 0
    save_since_step: bool = False
    longest_save_s: float = 0.0
    restored: int | None = None
    durable: int | None = None
    longest_step_s: float = 0.0
    last_mono: int = 0
    """The writer's newest record, of any kind (CLOCK_MONOTONIC ns, as the ring says)."""
    seen_mono: int = 0
    """When this agent first saw the rank's current last step (its own clock, ns)."""
    floor_mono: int = 0
    """When this agent last read the ring before that, the step not yet there: the step was committed
    between the two, whatever the ring's stamp says."""
    read_mono: int = 0
    lost: int = 0
    torn: int = 0
    header: Any = None
    summary: tuple = ()
    """(windows, median step time) as last computed; recomputed only when new steps arrived."""
    first: tuple = ()
    """The rank's first windows (progress.with_baseline): sent with its recent ones, so that the
    detector tells a rank slow from its start (structure) from one that became slow."""

    @property
    def known(self) -> tuple[int, int, int]:
        """What the ring's header says when nothing new was written since the last read."""
        return (*self.identity, self.after)


def _identity(header: Any) -> tuple[int, int]:
    return (header.pid, header.start_mono_ns)


@dataclass(frozen=True)
class RankView:
    rank: int
    local_rank: int
    gpu: int
    """The rank's GPU index (-1: unknown), by `gpu_from`."""
    pid: int
    progress: RankProgress
    windows: tuple[RankWindow, ...]
    lost: int
    torn: int
    restored: int | None
    durable: int | None
    rail: str | None = None
    """The HCA behind the same PCIe switch as the rank's GPU (None: unknown)."""
    gpu_from: str = "header"
    """Where `gpu` comes from: "nvml" (the rank's process is on that GPU's compute process list),
    "header" (the ring's header: the rank's CUDA_VISIBLE_DEVICES entry) or "unknown"."""


@dataclass(frozen=True)
class JobView:
    job: str
    uid: int
    world_size: int
    """As the ranks' headers say (-1: unknown)."""
    ranks: tuple[RankView, ...]
    stragglers: tuple[Straggler, ...] = ()
    """Flagged among this node's ranks; only when all the job's ranks are here."""
    hang: Hang | None = None
    errors: tuple[str, ...] = ()
    retired: tuple[tuple[str, str], ...] = ()
    """(ring file, why) of each ring no live step of the job owns: left out of everything above."""
    stall: tuple[float, float] | None = None
    """(stalled_s, bound_s) of the job's committed progress here, hang or not (progress.stall)."""
    waits_elsewhere: bool = False
    """Every rank here waits on ranks of other nodes (rank 0 is not here): the controller, which sees
    them, judges the stall; here the bound is the save bound."""

    @property
    def complete(self) -> bool:
        """Every rank of the job writes on this node."""
        return self.world_size > 0 and len(self.ranks) == self.world_size

    @property
    def step_median_s(self) -> float | None:
        values = [r.progress.step_median_s for r in self.ranks if r.progress.step_median_s]
        return statistics.median(values) if values else None


@dataclass
class InbandJobs:
    """Reads the in-band rings of the jobs on this node (I/O), keeping each rank's recent steps."""

    settings: InbandSettings
    trusted_uid: int = TRUSTED_UID
    ib_root: str = "/sys/class/infiniband"
    _ranks: dict[tuple[str, str], _Rank] = field(default_factory=dict)
    _warn: WarnOnce = field(default_factory=lambda: WarnOnce(log))
    _rails: tuple[tuple, dict[int, str]] = ((), {})
    rail: dict[int, str] = field(default_factory=dict)
    """GPU index -> rail, as worked out for the latest read."""
    _gone: set[tuple[str, str, int, int]] = field(default_factory=set)
    """(job, ring, pid, start) of writers found gone: a process that is gone never comes back."""
    _procs: dict[int, dict[int, list[int]]] | None = None
    """uid -> innermost PID -> its processes' start times (monotonic ns), from one scan of /proc per
    read, made only when a ring's writer is looked for there."""
    _logged: set[tuple[str, str, int, int]] = field(default_factory=set)
    """Retired rings already named in the log (once each)."""
    _last_read: int = 0
    look_s: float = 0.0
    """The time between the latest two reads: the agent's tick, by which a hang is named early."""
    _flags: dict[str, tuple[tuple, tuple[Straggler, ...]]] = field(default_factory=dict)
    """job -> (each rank's newest window, the stragglers found then): the detector runs when a
    window completes, not every tick."""
    goodput: GoodputLog | None = None
    """Where rank 0's events of each job go (healthd.agent.goodput_log); None: nowhere."""
    proc_root: str = "/proc"
    pid_gpus: dict[int, frozenset[int]] = field(default_factory=dict)
    """PID (the agent's namespace, and each process's own innermost one) -> the GPUs it holds a
    compute context on, from NVML's process lists of the latest read."""

    def rails_of(self, gpus: Mapping[int, str]) -> dict[int, str]:
        """GPU index -> rail for the GPUs NVML lists (index -> bus id), worked out once per GPU set."""
        key = tuple(sorted(gpus.items()))
        if key != self._rails[0]:
            paths = {i: p for i, bus in gpus.items() if (p := pci_path(self.settings.pci_devices, bus))}
            self._rails = (key, rails(paths, hca_paths(self.ib_root)) if paths else {})
        return self._rails[1]

    def read(self, run_dir: str, now_mono_ns: int, gpus: Mapping[int, str] | None = None,
             processes: Mapping[int, Iterable[int]] | None = None) -> tuple[JobView, ...]:
        """The jobs under `run_dir`/inband now. `gpus`: NVML's GPU index -> bus id (for the rails);
        `processes`: GPU index -> the PIDs NVML lists with a compute context there (for each rank's GPU)."""
        if not self.settings.enabled:
            return ()
        self.rail = self.rails_of(gpus or {})
        self.pid_gpus = pid_gpus(processes or {}, self.proc_root)
        self._procs = None
        if self._last_read:
            self.look_s = min(MAX_LOOK_S, max(0.0, (now_mono_ns - self._last_read) / 1e9))
        self._last_read = now_mono_ns
        base = os.path.join(run_dir, INBAND_DIR)
        try:
            with TrustedDir(run_dir, INBAND_DIR, trusted_uid=self.trusted_uid) as d:
                names = sorted(n for n in d.names() if n != DONE_DIR)
                owners = {}
                for name in names[:MAX_JOBS]:
                    if not valid_job(name):
                        self._warn(f"in-band directory entry {os.path.join(base, name)!r} is not a job id; ignored")
                        continue
                    try:
                        st = d.lstat(name)
                    except OSError:
                        continue
                    if not stat.S_ISDIR(st.st_mode):
                        self._warn(f"{os.path.join(base, name)} is not a directory "
                                   f"({stat.filemode(st.st_mode)}); ignored")
                        continue
                    owners[name] = st.st_uid
        except FileNotFoundError:
            self._ranks.clear()
            return ()
        except OSError as e:
            self._warn(f"in-band directory {base} not read: {clean(e, 200)}")
            return ()
        views = []
        seen: set[tuple[str, str]] = set()
        for job, uid in owners.items():
            views.append(self._read_job(os.path.join(base, job), job, uid, now_mono_ns, seen))
        for key in [k for k in self._ranks if k not in seen]:
            del self._ranks[key]
        self._gone = {g for g in self._gone if g[:2] in seen}
        self._logged = {g for g in self._logged if g[:2] in seen}
        for job in [j for j in self._flags if j not in owners]:
            del self._flags[job]
        if self.goodput is not None:
            self.goodput.flush()
            self.goodput.forget(j for j in self.goodput.known() if j not in owners)
            self.goodput.prune(time.time(), owners)
        return tuple(views)

    def _read_job(self, path: str, job: str, uid: int, now: int, seen: set) -> JobView:
        s = self.settings
        errors: list[str] = []
        try:
            ranked = sorted((rank, n) for n in os.listdir(path) if (rank := ring_rank(n)) is not None)
        except OSError as e:
            return JobView(job, uid, -1, (), errors=(f"{path}: {clean(e, 200)}",))
        if len(ranked) > s.max_ranks:
            errors.append(f"{len(ranked)} rings, read the first {s.max_ranks} (inband.max_ranks)")
        ranks: list[RankView] = []
        worlds = []
        held: list[tuple[str, _Rank]] = []
        for named_rank, name in ranked[:s.max_ranks]:
            key = (job, name)
            state = self._ranks.get(key)
            view = read_ring(path, name, owner=uid, after=state.after if state else 0,
                             known=state.known if state else None)
            if not isinstance(view, RingError) and state is not None and state.identity != _identity(view.header):
                # a new process of the rank replaced the ring (a restart): read the new one from its start
                view = read_ring(path, name, owner=uid, after=0)
            if isinstance(view, RingError):
                errors.append(clean(view.reason, 300))
                continue
            h = view.header
            if state is None or state.identity != _identity(h):
                state = _Rank(_identity(h), deque(maxlen=(s.detector.history_windows + 2) * s.detector.window_steps))
                self._ranks[key] = state
            seen.add(key)
            self._take(state, view, now)
            state.header = h
            if h.rank != named_rank:
                errors.append(f"{name}: header says rank {h.rank}")
                continue
            held.append((name, state))
            if h.rank == 0 and self.goodput is not None:
                self.goodput.take(job, h, view.records)
        infos = {name: RingInfo(name, st.header.step, st.header.world_size, st.header.start_mono_ns,
                                max(st.header.start_mono_ns, st.last_mono, st.header.phase_mono_ns))
                 for name, st in held}
        by_name = dict(held)
        gone = retired(tuple(infos.values()), lambda r: self._writer_gone(job, r.name, by_name[r.name].header, uid))
        for name, why in gone.items():
            h = by_name[name].header
            mark = (job, name, h.pid, h.start_mono_ns)
            if mark not in self._logged:
                self._logged.add(mark)
                log.info("in-band job %s: %s retired: %s", job, name, why)
        for name, state in held:
            if name not in gone:
                worlds.append(state.header.world_size)
                ranks.append(self._rank_view(state, now))
        world = max(set(worlds), key=worlds.count) if worlds else -1
        by_rank = {r.rank: r.windows for r in ranks}
        flagged: tuple[Straggler, ...] = ()
        if world > 0 and len(ranks) == world:
            key = tuple((r.rank, r.windows[-1].window if r.windows else -1) for r in ranks)
            cached = self._flags.get(job)
            if cached is not None and cached[0] == key:
                flagged = cached[1]
            else:
                flagged = tuple(stragglers(by_rank, s.detector))
                self._flags[job] = (key, flagged)
        progress = [r.progress for r in ranks]
        elsewhere = waits_elsewhere(progress)
        stalled = hang(progress, s.detector, elsewhere=elsewhere, early_s=self.look_s) if ranks else None
        return JobView(job, uid, world, tuple(ranks), tuple(flagged), stalled, tuple(errors),
                       retired=tuple(sorted(gone.items(), key=lambda kv: ring_rank(kv[0]) or 0)),
                       stall=stall(progress, s.detector, elsewhere=elsewhere) if ranks else None,
                       waits_elsewhere=elsewhere and bool(ranks))

    def _writer_gone(self, job: str, name: str, header: Any, uid: int) -> bool:
        """No process of the job's user that could have written the ring is running: none with the
        ring's PID (the one the writer saw, its innermost PID in a container) that started before it."""
        mark = (job, name, header.pid, header.start_mono_ns)
        if mark in self._gone:
            return True
        if header.pid <= 0:
            return False  # no PID to look for: never taken for gone
        offset = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()
        latest = header.start_mono_ns + START_SLACK_NS
        own = _process(self.proc_root, header.pid, offset)
        if own is not None and own[0] == uid and own[1] == header.pid and own[2] <= latest:
            return False
        if self._procs is None:
            self._procs = {}
        if uid not in self._procs:
            self._procs[uid] = _processes(self.proc_root, uid, offset)
        if any(start <= latest for start in self._procs[uid].get(header.pid, ())):
            return False
        self._gone.add(mark)
        return True

    def _take(self, state: _Rank, view: Any, now: int) -> None:
        if view.records:
            state.summary = ()
        before = state.last_step
        state.after = max(state.after, view.last_seq)
        state.lost += view.lost
        state.torn += view.torn
        for r in view.records:
            state.last_mono = max(state.last_mono, r.mono_ns)
            if r.kind == STEP:
                state.samples.append(StepSample(r.step, r.dur_ns / 1e9, r.wait_ns / 1e9, state.save_since_step))
                state.longest_step_s = max(state.longest_step_s, r.dur_ns / 1e9)
                state.save_since_step = False
                state.last_step = r.step
                state.last_step_mono = r.mono_ns
            elif r.kind in (CKPT_BEGIN, CKPT_END):
                state.save_since_step = True
                if r.kind == CKPT_END:
                    state.longest_save_s = max(state.longest_save_s, r.dur_ns / 1e9)
            elif r.kind == DURABLE:
                state.durable = r.step
            elif r.kind == RESTORED:
                state.restored = r.step
                state.last_step = r.step
                state.last_step_mono = r.mono_ns
        if view.records and (state.last_step != before or not state.seen_mono):
            state.seen_mono, state.floor_mono = now, state.read_mono
        state.read_mono = now

    def _rank_view(self, state: _Rank, now: int) -> RankView:
        h = state.header
        d = self.settings.detector
        if not state.summary:
            small = 0 < h.world_size < d.min_ranks_spread and d.window_steps <= MAX_WAITS
            samples = list(state.samples)
            times = [x.step_s for x in samples[-d.window_steps * 2:] if x.step_s > 0 and not x.checkpoint]
            median = statistics.median(times) if len(times) >= MIN_STEPS_FOR_MEDIAN else None
            state.first, windows = with_baseline(state.first, summarize(h.rank, samples, d, with_waits=small), d)
            state.summary = (windows, median)
        windows, median = state.summary
        since = state.last_step_mono or h.start_mono_ns
        if state.seen_mono:
            # the step was committed after the read that did not have it and by the read that did:
            # a stamp outside that (a clock ahead, a ring stamped in the future) is not believed
            since = max(min(since, state.seen_mono), state.floor_mono)
        progress = RankProgress(
            rank=h.rank,
            last_step=state.last_step,
            last_step_age_s=max(0.0, (now - since) / 1e9),
            phase=h.phase,
            phase_age_s=max(0.0, (now - h.phase_mono_ns) / 1e9) if h.phase_mono_ns else 0.0,
            step_median_s=median,
            longest_save_s=state.longest_save_s,
            longest_step_s=state.longest_step_s,
        )
        gpu, gpu_from = rank_gpu(h.device, self.pid_gpus.get(h.pid, frozenset()))
        return RankView(h.rank, h.local_rank, gpu, h.pid, progress, windows, state.lost, state.torn,
                        state.restored, state.durable, self.rail.get(gpu), gpu_from)


# --------------------------------------------------------------------------- the job's steps


@dataclass(frozen=True)
class RingInfo:
    """What tells the launch a ring belongs to from another (the pure input of `retired`)."""

    name: str
    step: int | None
    """The Slurm job step the header names (None: not said)."""
    world_size: int
    start_mono_ns: int
    last_mono_ns: int
    """The writer's latest sign of life in the ring: its newest record or phase change, else its start."""


def superseded_by(ring: RingInfo, rings: Iterable[RingInfo]) -> RingInfo | None:
    """A ring of a later launch than `ring`'s, if there is one. Rings of one launch share a step and a
    world size: a ring that differs in either (its step known to both) and started after `ring` is of
    a later launch. Without step ids, of the same world size, a ring is of a later launch only when it
    started after `ring`'s writer last wrote and more than LAUNCH_SPREAD_NS after `ring` started: a
    rank that died inside the job's current step (the evidence of a hang) is never superseded by its
    peers."""
    for other in rings:
        if other.name == ring.name:
            continue
        known = ring.step is not None and other.step is not None
        another = ring.world_size != other.world_size or (known and ring.step != other.step)
        if known and not another:
            continue  # one step, one world size: one launch
        if another:
            if other.start_mono_ns > ring.start_mono_ns:
                return other
        elif other.start_mono_ns > max(ring.last_mono_ns, ring.start_mono_ns + LAUNCH_SPREAD_NS):
            return other
    return None


def retired(rings: Sequence[RingInfo], gone: Callable[[RingInfo], bool]) -> dict[str, str]:
    """ring name -> why, for the rings no live step owns: a later launch's ring is in the job's
    directory (`superseded_by`) and the ring's own writer is gone (`gone`, asked only then). A ring of
    an earlier step whose writer still runs (steps running side by side) is kept."""
    out = {}
    for ring in rings:
        later = superseded_by(ring, rings)
        if later is not None and gone(ring):
            step = f"step {ring.step}" if ring.step is not None else "an earlier step"
            out[ring.name] = (f"its writer is gone and {later.name} "
                              f"({'step ' + str(later.step) if later.step is not None else 'a later start'}, "
                              f"world size {later.world_size}) started after it; {step}, world size "
                              f"{ring.world_size}")
    return out


def _process(proc_root: str, pid: int, boot_minus_mono_ns: int) -> tuple[int, int, int] | None:
    """(owner uid, innermost PID, start as CLOCK_MONOTONIC ns) of process `pid` under `proc_root`;
    None when it is not there or not readable."""
    base = os.path.join(proc_root, str(pid))
    try:
        uid = os.stat(base).st_uid
        with open(os.path.join(base, "stat"), "rb") as f:
            fields = f.read(4096).rpartition(b")")[2].split()
        start_ns = int(fields[19]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK") - boot_minus_mono_ns
    except (OSError, ValueError, IndexError):
        return None
    inner = _innermost_pid(proc_root, pid)
    return uid, inner if inner is not None else pid, start_ns


def _processes(proc_root: str, uid: int, boot_minus_mono_ns: int) -> dict[int, list[int]]:
    """Innermost PID -> the start times of the processes of `uid` that have it (a writer in a container
    wrote the PID it sees)."""
    out: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return out
    for e in entries:
        try:
            if e.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        got = _process(proc_root, int(e.name), boot_minus_mono_ns)
        if got is not None and got[0] == uid:
            out.setdefault(got[1], []).append(got[2])
    return out


# --------------------------------------------------------------------------- the rank's GPU

MAX_NS_DEPTH = 32


def pid_gpus(processes: Mapping[int, Iterable[int]], proc_root: str = "/proc") -> dict[int, frozenset[int]]:
    """PID -> the GPUs it has a compute context on, from NVML's per-GPU process lists (PIDs of the
    agent's namespace). A process in a container (its own PID namespace) wrote its ring with the PID
    it sees, the last one of its `NSpid:` line: that one is added too, unless two processes on the
    node share it (two containers), which would make it ambiguous."""
    out: dict[int, set[int]] = {}
    inner: dict[int, set[int]] = {}
    clash: set[int] = set()
    for gpu, pids in processes.items():
        for pid in pids:
            out.setdefault(pid, set()).add(gpu)
    for pid, gpus in list(out.items()):
        own = _innermost_pid(proc_root, pid)
        if own is not None and own != pid:
            if own in inner and inner[own] is not gpus:
                clash.add(own)
            inner[own] = gpus
    for own, gpus in inner.items():
        if own not in clash and own not in out:
            out[own] = gpus
    return {pid: frozenset(gpus) for pid, gpus in out.items()}


def _innermost_pid(proc_root: str, pid: int) -> int | None:
    try:
        with open(os.path.join(proc_root, str(pid), "status"), "rb") as f:
            status = f.read(16384)
    except OSError:
        return None  # gone, or not visible here
    for line in status.split(b"\n"):
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:MAX_NS_DEPTH + 1]
            try:
                return int(fields[-1]) if fields else None
            except ValueError:
                return None
    return None


def rank_gpu(header_gpu: int, nvml_gpus: frozenset[int]) -> tuple[int, str]:
    """The rank's GPU and where it comes from. NVML's process list wins over the header's guess
    from CUDA_VISIBLE_DEVICES; a process on several GPUs (a stray context on GPU 0 is common) is on
    the header's one when that is among them, else on none for sure: the header's stands."""
    if len(nvml_gpus) == 1:
        return next(iter(nvml_gpus)), "nvml"
    if header_gpu in nvml_gpus:
        return header_gpu, "nvml"
    return header_gpu, "header" if header_gpu >= 0 else "unknown"


# --------------------------------------------------------------------------- flight recorder

FR_PIPE_VAR = b"TORCH_NCCL_DEBUG_INFO_PIPE_FILE="
"""PyTorch's NCCL process group makes a FIFO `<value><rank>.pipe` when the job sets this (and a trace
buffer): anything written to it makes that rank dump its flight recorder (the last collectives)."""
MAX_ENVIRON = 256 * 1024


def request_dumps(job: JobView, proc_root: str = "/proc") -> tuple[str, ...]:
    """Ask each of the job's ranks here for a flight recorder dump, through the FIFO PyTorch made for
    it, and say what was done per rank. Only a FIFO owned by the job's user, named by the environment
    of a process that is the job user's, is written (one byte, non-blocking: a FIFO nobody reads is
    skipped); the ring's pid is the job's word, so both are checked before anything is written."""
    out = []
    for r in job.ranks:
        if r.pid <= 0:
            continue
        proc = os.path.join(proc_root, str(r.pid))
        try:
            if os.stat(proc).st_uid != job.uid:
                out.append(f"rank {r.rank}: pid {r.pid} is not the job user's; no dump requested")
                continue
            fd = os.open(os.path.join(proc, "environ"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                environ = os.read(fd, MAX_ENVIRON)
            finally:
                os.close(fd)
        except OSError:
            continue  # the rank's process is gone: nothing to dump
        stem = next((v[len(FR_PIPE_VAR):] for v in environ.split(b"\0") if v.startswith(FR_PIPE_VAR)), None)
        if not stem:
            continue
        pipe = os.fsdecode(stem) + f"{r.rank}.pipe"
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            out.append(f"rank {r.rank}: flight recorder pipe {clean(pipe, 200)}: {e.strerror}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != job.uid:
                out.append(f"rank {r.rank}: {clean(pipe, 200)} is not the job user's FIFO; not written")
                continue
            os.write(fd, b"1")
            out.append(f"rank {r.rank}: flight recorder dump requested through {clean(pipe, 200)}")
        except OSError as e:
            out.append(f"rank {r.rank}: flight recorder pipe {clean(pipe, 200)}: {e.strerror}")
        finally:
            os.close(fd)
    return tuple(out)


# --------------------------------------------------------------------------- network rails


def pci_path(pci_devices: str, bus_id: str) -> tuple[str, ...] | None:
    """The device's place in the PCIe tree (the components of its real sysfs path), from NVML's bus
    id form `00000000:3B:00.0`; None when it is not there."""
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return None
    name = f"{domain[-4:]}:{rest}".lower()
    try:
        return tuple(os.path.realpath(os.path.join(pci_devices, name), strict=True).split("/"))
    except (OSError, ValueError):
        return None


def hca_paths(ib_root: str) -> dict[str, tuple[str, ...]]:
    """HCA name -> its place in the PCIe tree (`<ib_root>/<hca>/device`)."""
    out = {}
    try:
        names = sorted(os.listdir(ib_root))[:64]
    except OSError:
        return out
    for name in names:
        try:
            out[name] = tuple(os.path.realpath(os.path.join(ib_root, name, "device"), strict=True).split("/"))
        except (OSError, ValueError):
            continue
    return out


def rails(gpus: Mapping[int, tuple[str, ...]], hcas: Mapping[str, tuple[str, ...]]) -> dict[int, str]:
    """GPU index -> its rail: the one HCA sharing the deepest PCIe ancestor with it, below the root
    complex (a GPU and a NIC behind one PCIe switch). None for a GPU two HCAs are equally near, or
    that shares only the root complex: a guess would blame the wrong rail."""
    out = {}
    for index, gpath in gpus.items():
        best: list[tuple[int, str]] = []
        for name, hpath in hcas.items():
            shared = 0
            for a, b in zip(gpath, hpath, strict=False):
                if a != b:
                    break
                shared += 1
            best.append((shared, name))
        best.sort(reverse=True)
        # /sys/devices/pci0000:3a is 4 components; a shared PCIe port or switch is deeper
        if best and best[0][0] > 4 and (len(best) == 1 or best[1][0] < best[0][0]):
            out[index] = best[0][1]
    return out


# --------------------------------------------------------------------------- findings (pure)


@dataclass(frozen=True)
class ThrottleRun:
    """One GPU's slowing clock event reasons (THROTTLE_SLOWING), present at every read since they
    began: a reason seen at one read is a coincidence; one that began with a rank's slowdown and
    stayed can explain it."""

    names: tuple[str, ...]
    """The reasons seen during the run."""
    since: float
    """The snapshot time of the first read with one."""
    reads: int
    """Reads in a row with one."""
    began: Mapping[tuple[str, int], tuple[int | None, int]] = field(default_factory=dict)
    """(job, rank) of each rank on the GPU at the run's first read -> (its last step at the read
    before, None when not read there; its last step at that first read): the run began between."""


@dataclass(frozen=True)
class Throttles:
    """What the agent remembers of its GPUs' clock event reasons between reads (see `throttles`)."""

    runs: Mapping[int, ThrottleRun] = field(default_factory=dict)
    """GPU index -> its current run."""
    steps: Mapping[int, Mapping[tuple[str, int], int]] = field(default_factory=dict)
    """GPU index -> (job, rank) -> the rank's last step at the latest read."""
    at: float | None = None
    """The latest read's snapshot time."""


def throttles(prev: Throttles, snapshot: Snapshot, jobs: Iterable[JobView]) -> Throttles:
    """`prev` brought to `snapshot`: a GPU with a slowing reason continues its run or starts one
    (remembering each of its ranks' steps just before and at the start); a GPU read without one (or
    not read) ends it. The same snapshot twice (classified again between kernel reads) counts once."""
    if prev.at == snapshot.time:
        return prev
    steps: dict[int, dict[tuple[str, int], int]] = {}
    for job in jobs:
        for r in job.ranks:
            if r.gpu >= 0:
                steps.setdefault(r.gpu, {})[(job.job, r.rank)] = r.progress.last_step
    runs: dict[int, ThrottleRun] = {}
    for g in snapshot.nvml.gpus:
        reasons = g.clock_event_reasons or 0
        names = tuple(name for bit, name in THROTTLE_SLOWING.items() if reasons & bit)
        if not names:
            continue
        old = prev.runs.get(g.index)
        if old is None:
            before = prev.steps.get(g.index, {})
            runs[g.index] = ThrottleRun(names, snapshot.time, 1,
                                        {k: (before.get(k), step) for k, step in steps.get(g.index, {}).items()})
        else:
            runs[g.index] = ThrottleRun(tuple(dict.fromkeys(old.names + names)), old.since, old.reads + 1, old.began)
    return Throttles(runs, steps, snapshot.time)


def throttle_line(gpu: int, run: ThrottleRun, key: tuple[str, int]) -> str | None:
    """The corroboration line of a throttle run for the rank `key`, with the steps it began between
    (what the controller checks against the slowdown's onset), or None: seen at one read only, or
    begun before the agent knew the rank's step."""
    before, since = run.began.get(key, (None, 0))
    if run.reads < 2 or before is None:
        return None
    return (f"gpu{gpu}: {THROTTLE_WORDS} ({', '.join(run.names)}) at {run.reads} reads in a row, "
            f"begun between steps {before} and {since}")


def corroboration(gpu: int, snapshot: Snapshot, findings: Iterable[Finding],
                  rail: str | None = None, throttle: str | None = None) -> tuple[list[str], list[str]]:
    """(about the GPU, about the rail): out-of-band evidence on this node that a rank on GPU `gpu`
    is slow for a reason of the hardware's: its clocks held down since about the slowdown
    (`throttle`, a `throttle_line`: the reasons one read shows are no evidence by themselves), PCIe
    replays, a narrower PCIe link, or a current finding on that GPU that is not the user code's (an
    application's Xid explains nothing about the hardware); a current fabric finding on a port of the
    GPU's rail (`rail`, the HCA; unknown: the node's only HCA, if it has one)."""
    if rail is None:
        devices = {p.device for p in snapshot.infiniband.ports}
        rail = next(iter(devices)) if len(devices) == 1 else None
    on_gpu: list[str] = [throttle] if throttle else []
    sample: GpuSample | None = next((g for g in snapshot.nvml.gpus if g.index == gpu), None)
    if sample is not None:
        replay = sample.counters.get("pcie_replay")
        if replay is not None and replay.delta:
            on_gpu.append(f"gpu{gpu}: {replay.delta} PCIe replays since the last reading")
        if sample.pcie_width and sample.pcie_width_max and sample.pcie_width < sample.pcie_width_max:
            on_gpu.append(f"gpu{gpu}: PCIe link x{sample.pcie_width} of x{sample.pcie_width_max}")
    on_rail: list[str] = []
    for f in findings:
        if f.source == "inband" or f.attribution == "user":
            continue
        if f.component.kind == "gpu" and f.component.index == gpu:
            on_gpu.append(f"gpu{gpu}: {clean(f.summary, 120)} ({f.id})")
        elif f.component.kind == "port" and f.attribution == "fabric" and rail and f.component.device == rail:
            on_rail.append(f"{f.component.key()}: {clean(f.summary, 120)} ({f.id})")
    return on_gpu[:4], on_rail[:4]


def _throttle_for(throttles: Throttles | None, gpu: int, key: tuple[str, int], onset_window: int | None,
                  window_steps: int) -> str | None:
    """The throttle line of the rank `key` on `gpu`, when its run can explain a slowdown first seen in
    `onset_window` (None: any onset, for the controller to judge from the line's steps)."""
    run = throttles.runs.get(gpu) if throttles is not None and gpu >= 0 else None
    line = throttle_line(gpu, run, key) if run is not None else None
    if line is None or onset_window is None:
        return line
    before, since = run.began[key]  # type: ignore[union-attr]
    return line if throttle_coincides(onset_window, before, since, window_steps) else None


def _gpu_component(gpu: int, snapshot: Snapshot) -> Component:
    sample = next((g for g in snapshot.nvml.gpus if g.index == gpu), None)
    if gpu < 0:
        return NODE
    if sample is None:
        return Component(kind="gpu", index=gpu)
    return Component(kind="gpu", index=gpu, uuid=sample.uuid, serial=sample.serial, bus_id=sample.bus_id)


def findings(jobs: Iterable[JobView], snapshot: Snapshot, others: Iterable[Finding],
             first_seen: Mapping[str, float], now: float, window_steps: int,
             dumps: Mapping[str, tuple[str, ...]] | None = None,
             throttles: Throttles | None = None) -> tuple[Finding, ...]:
    """In-band findings: a straggler per flagged rank of a job wholly on this node (tier 2 with
    out-of-band corroboration, else tier 3), and a hang per stalled job (tier 3: the controller
    decides a job's requeue from every node's view). `first_seen`: finding id -> when first made."""
    others = tuple(others)
    out: list[Finding] = []
    for job in jobs:
        by_rank = {r.rank: r for r in job.ranks}
        for flag in job.stragglers:
            rank = by_rank.get(flag.rank)
            if rank is None:
                continue
            component = _gpu_component(rank.gpu, snapshot)
            throttle = _throttle_for(throttles, rank.gpu, (job.job, rank.rank), flag.windows[0] if flag.windows else -1,
                                     window_steps)
            on_gpu, rail = (corroboration(rank.gpu, snapshot, others, rank.rail, throttle) if rank.gpu >= 0
                            else ([], []))
            tier, attribution, action = 3, "unknown", "none"
            if on_gpu:
                tier, attribution, action = 2, "hardware", "drain"
            elif rail:
                tier, attribution, action = 2, "fabric", "drain"
            fid = f"inband.straggler:{component.key()}"
            last_step = (flag.windows[-1] + 1) * window_steps - 1
            how = (f"compute {flag.effect:+.1%} against the job's median over windows "
                   f"{flag.windows[0]}-{flag.windows[-1]} (needed {flag.threshold:.1%})"
                   if flag.test == "magnitude" else
                   f"last to arrive in {flag.last_in} of {flag.of_steps} steps (p={flag.p_value:.1e})")
            where = f"gpu {rank.gpu}" + (" by NVML's process list" if rank.gpu_from == "nvml" else "")
            evidence = [Evidence("inband", f"job {job.job} rank {flag.rank} ({where}): {how}",
                                 {"job": job.job, "rank": flag.rank, "gpu": rank.gpu, "gpu_from": rank.gpu_from,
                                  "test": flag.test,
                                  "effect": round(flag.effect, 4), "windows": list(flag.windows),
                                  "step": last_step})]
            evidence += [Evidence("nvml_value" if e.startswith("gpu") else "state", e) for e in (*on_gpu, *rail)]
            corroborated = f"; corroborated: {on_gpu[0] if on_gpu else rail[0]}" if tier == 2 else \
                "; in-band evidence only"
            out.append(Finding(
                id=fid, component=component, source="inband", attribution=attribution,  # type: ignore[arg-type]
                tier=tier, action=action,  # type: ignore[arg-type]
                summary=clean(f"straggler: job {job.job} rank {flag.rank} on {component.key()} "
                              f"{flag.effect:+.1%} compute{corroborated}", 300),
                evidence=tuple(evidence), first_seen=first_seen.get(fid, now), last_seen=now, job=job.job))
        if job.hang is not None:
            h = job.hang
            fid = f"inband.hang:{job.job}"
            behind = ", ".join(f"rank {r} ({h.phases.get(r, 'unknown')}, gpu {by_rank[r].gpu})"
                               for r in h.behind[:8] if r in by_rank)
            if h.elsewhere:
                behind = f"not here (every rank here waits on ranks of other nodes past the save bound; {behind})"
            out.append(Finding(
                id=fid, component=NODE, source="inband", attribution="unknown", tier=3, action="none",
                summary=clean(f"hang: job {job.job} at step {h.step} for {h.stalled_s:.0f} s "
                              f"(bound {h.bound_s:.0f} s); behind: "
                              f"{behind or 'not here (every rank here waits in a collective)'}", 300),
                evidence=(Evidence("inband", f"job {job.job}: no rank committed a step after {h.step} for "
                                   f"{h.stalled_s:.0f} s", {"job": job.job, "step": h.step,
                                                            "stalled_s": round(h.stalled_s, 1),
                                                            "bound_s": round(h.bound_s, 1),
                                                            "behind": list(h.behind)}),
                          *(Evidence("probe", note) for note in (dumps or {}).get(job.job, ())[:8])),
                first_seen=first_seen.get(fid, now), last_seen=now, job=job.job))
    return tuple(out)


# --------------------------------------------------------------------------- the report's section


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def to_json(jobs: Iterable[JobView], snapshot: Snapshot, others: Iterable[Finding],
            history_windows: int, throttles: Throttles | None = None) -> dict[str, Any]:
    """The `inband` section of the state document (and of the report to the controller)."""
    others = tuple(others)
    out = []
    for job in jobs:
        ranks = []
        for r in job.ranks:
            p = r.progress
            throttle = _throttle_for(throttles, r.gpu, (job.job, r.rank), None, 0)
            on_gpu, rail = corroboration(r.gpu, snapshot, others, r.rail, throttle) if r.gpu >= 0 else ([], [])
            ranks.append({
                # the header's numbers are the job's: out of range is unknown, as the controller reads them
                "rank": r.rank, "local_rank": r.local_rank if 0 <= r.local_rank < 1 << 24 else None,
                "gpu": r.gpu if -1 <= r.gpu <= 1023 else -1, "gpu_from": r.gpu_from,
                "pid": r.pid if r.pid > 0 else None,
                "last_step": p.last_step, "last_step_age_s": _r(p.last_step_age_s, 3),
                "phase": p.phase, "phase_age_s": _r(p.phase_age_s, 3), "step_median_s": _r(p.step_median_s),
                "longest_save_s": _r(p.longest_save_s), "longest_step_s": _r(p.longest_step_s),
                "lost": r.lost, "torn": r.torn,
                "restored": r.restored, "durable": r.durable, "rail": r.rail,
                "corroboration": (on_gpu + rail)[:8],
                "windows": [{"window": w.window, "steps": w.steps, "compute_s": _r(w.compute_s),
                             "step_s": _r(w.step_s), "wait_s": _r(w.wait_s),
                             "waits": [_r(x) for x in w.waits] if w.waits is not None else None}
                            for w in r.windows[-(history_windows + MAX_FIRST_WINDOWS):]],
            })
        h = job.hang
        out.append({
            "job": job.job, "world_size": job.world_size, "ranks_here": len(job.ranks),
            "step_median_s": _r(job.step_median_s),
            "ranks": ranks,
            "stragglers": [{"rank": f.rank, "test": f.test, "windows": list(f.windows), "effect": _r(f.effect, 4),
                            "threshold": _r(f.threshold, 6), "last_in": f.last_in, "of_steps": f.of_steps,
                            "p_value": f.p_value} for f in job.stragglers],
            "hang": None if h is None else {"step": h.step, "stalled_s": _r(h.stalled_s, 1),
                                            "bound_s": _r(h.bound_s, 1), "behind": list(h.behind),
                                            "phases": {str(k): v for k, v in h.phases.items()},
                                            "elsewhere": h.elsewhere},
            "stall": None if job.stall is None else {"stalled_s": _r(job.stall[0], 1), "bound_s": _r(job.stall[1], 1),
                                                     "waits_elsewhere": job.waits_elsewhere},
            "retired": [{"ring": name, "why": why} for name, why in job.retired[:MAX_RETIRED]],
            "errors": list(job.errors[:16]),
        })
    return {"jobs": out}
