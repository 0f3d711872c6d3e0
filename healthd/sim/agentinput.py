"""What a simulated fault looks like to a node's agent, and the agent's own code run on it.

A fault becomes the input a real node would see: kernel log messages in the NVIDIA driver's text
(`KernelLines`, `xid_line`), or an NVML reading of the node's GPUs (`NvmlReading`: a GPU lost, fewer
GPUs, raw ECC or remap counters). `SimAgent` hands that input to the real agent
(healthd.agent.daemon.Agent) through collectors of its own: the kernel lines are parsed and folded by
the kernel log collector's own step (healthd.agent.collectors.kernel_log.fold_lines), the NVML reading
gets its counter deltas from the NVML collector's own step (healthd.agent.collectors.nvml.with_deltas),
and the agent's classification (catalog, rules, history windows, latches) makes the findings. What
`SimAgent.feed` returns is the agent's state document fitted to the controller's limits
(healthd.report_schema.fit_report) and passed through JSON, as the reporter sends it; the controller
side (healthd.sim.fleet) checks and converts it as the controller's intake does.

Nothing here decides what a fault means: a line the catalog calls user code raises a T3 finding and
nothing else, because the agent's rules say so.

Time is the simulator's: each `feed` runs one tick of the agent at the `now` it is given, and the
kernel lines carry that time. A reboot (`SimAgent.reboot`) gives the agent a new boot id, which is
how a real agent learns of one (its history of Xid occurrences stays, as it does across a reboot).

The in-band rings: `JobRanks` says which ranks of the simulated job run on the node, how fast they
step, which GPU's rank computes slower since when (a straggler) and when the ranks stopped (a hang).
At each `feed` the node's rings (`rank-<rank>.ring` in the job's directory under the agent's
hooks.run_dir/inband, in the layout healthd.inband_layout takes from the job's client) get the steps
taken since the last feed, on the simulator's clock, and the agent's own in-band reader and detector
(healthd.agent.inband_jobs, healthd.progress) read them; `JobEnded` is the epilog: the directory goes.
A ring holds the newest `RING_CAPACITY` steps, at least what the agent's reader keeps of a rank
(`history_windows` + 2 windows of steps; its first windows are the first it reads); what happened
before that at the first feed of a run is not written. Nothing here decides what a step time means.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from healthd.agent.classify.catalog import Catalog, load_catalog
from healthd.agent.collectors.counters import Baseline
from healthd.agent.collectors.kernel_log import fold_lines
from healthd.agent.collectors.nvml import with_deltas
from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.inband_layout import HEADER, INBAND_DIR, MAGIC, PHASES, RECORD, STEP, STEP_ID, STEP_ID_OFFSET, VERSION
from healthd.inband_layout import client as layout
from healthd.inband_layout import job_dir, ring_name
from healthd.model import GpuSample, KernelSample, NvmlSample
from healthd.report_schema import fit_report
from healthd.settings import HookSettings, HostSettings, InbandSettings, InfinibandSettings, NvmlSettings, Settings
from healthd.sim.job import COMPUTE_SHARE, slowed_step

GPU_BUS_IDS = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
               "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0")
"""The PCI bus ids of an 8-GPU node (an HGX H100's), GPU index order."""


def bus_id(gpu: int) -> str:
    """GPU `gpu`'s PCI bus id as NVML gives it (`00000000:18:00.0`); past the 8 listed, made up alike."""
    if 0 <= gpu < len(GPU_BUS_IDS):
        return GPU_BUS_IDS[gpu]
    return f"{1 + gpu // 256:08X}:{gpu % 256:02X}:00.0"


def xid_line(xid: int, gpu: int, text: str = "", *, pid: int | None = None, process: str | None = None) -> str:
    """The driver's kernel log message for Xid `xid` on GPU `gpu`, as the journal and /dev/kmsg carry it:
    `NVRM: Xid (PCI:0000:18:00): 79, pid=..., name=..., <text>`."""
    domain, bus, dev = bus_id(gpu).split(":")
    short = f"{domain[-4:]}:{bus}:{dev.split('.')[0]}".lower()
    who = f"pid={pid if pid is not None else chr(39) + '<unknown>' + chr(39)}, name={process or '<unknown>'}"
    return f"NVRM: Xid (PCI:{short}): {int(xid)}, {who}, {text or 'simulated'}"


@dataclass(frozen=True)
class KernelLines:
    """Kernel log messages logged on the node (the NVIDIA driver's text; any `[  12.345]` or syslog
    prefix is ignored as the collector ignores it), all at the time they are fed."""

    lines: tuple[str, ...]
    """The messages, in the order they were logged."""
    repeat: int = 1
    """How many times each is logged (a burst of identical lines folds into one event with a count)."""


@dataclass(frozen=True)
class GpuReading:
    """What NVML answers for one GPU from now on, as GpuSample fields over a healthy GPU's."""

    index: int
    """The GPU's index on the node."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """GpuSample field -> value (`lost`, `ecc_uncorrected_volatile`, `remapped_rows_pending`, ...);
    counters are raw totals, the collector's step makes the deltas."""


@dataclass(frozen=True)
class NvmlReading:
    """An NVML reading of the node: the GPUs that differ from healthy, and how many GPUs NVML counts."""

    gpus: tuple[GpuReading, ...] = ()
    """GPUs whose reading changes (a later reading of the same GPU replaces its fields)."""
    count: int | None = None
    """The GPU count NVML answers; None: every GPU the node has (fewer: GPUs missing from the bus)."""


@dataclass(frozen=True)
class Slowdown:
    """From `since`, one rank of the job computes `factor` x as long as it did."""

    since: float
    """On the agent's clock (the times `feed` is given)."""
    factor: float
    """1.3: 30 % longer; the job's step becomes its slowest rank's (healthd.sim.job.slowed_step)."""
    gpu: int | None
    """The GPU of this node whose rank is slow; None: a rank on another node (this node's ranks wait
    for it)."""


@dataclass(frozen=True)
class JobRanks:
    """The simulated job's ranks on this node from now on: ranks `first_rank` ... on GPUs 0, 1, ...
    (one per GPU), each writing its in-band ring as the job's client does."""

    job: str
    """The Slurm job id (the ring directory's name)."""
    world_size: int
    first_rank: int
    started: float
    """When the run's ranks started stepping (the agent's clock); a later `started` is a new run: new
    rings, as a restarted rank makes."""
    step_s: float
    """A healthy step."""
    slowdowns: tuple[Slowdown, ...] = ()
    stopped: float | None = None
    """When every rank of the job stopped advancing (a hang); None: they advance."""
    stuck_gpu: int | None = None
    """With `stopped`: the GPU of this node whose rank stopped outside the collective (the others
    wait inside it); None: all of this node's ranks wait (the stuck rank is elsewhere)."""
    seed: int = 0
    """Seeds each step's compute noise (3 %, as measured jobs show), so a run is reproducible."""


@dataclass(frozen=True)
class JobEnded:
    """The job left the node (ended, requeued): the epilog moves its rings away."""

    job: str


AgentInput = KernelLines | NvmlReading | JobRanks | JobEnded

RING_CAPACITY = 256
"""Records per simulated ring: at 25 steps a window, the 10 windows (250 steps) the agent's reader keeps
of a rank with the default `history_windows` (8), and no more: every record written is read and parsed,
and a hang's first feed fills the ring (the job's client defaults to 8192)."""
MONO0 = 1_000_000.0
"""CLOCK_MONOTONIC (s) at the agent's clock's 0 (its clock is wall time: Unix seconds in the
simulator): one clock, as the ring's two stamps are."""
NOISE = 0.03
"""Per-step lognormal noise of a rank's compute, clipped to +-10 % (the all-reduce absorbs it)."""


def mono_ns(t: float) -> int:
    """The node's CLOCK_MONOTONIC (ns) at virtual second `t`."""
    return int(round((MONO0 + t) * 1e9))


def _segments(ranks: JobRanks, end: float) -> list[tuple[float, int, float]]:
    """(start time, first step, step seconds) of each stretch of constant step time from the run's
    start to `end`; the step in progress at a slowdown's onset takes the new pace."""
    onsets = sorted({s.since for s in ranks.slowdowns if ranks.started < s.since <= end})
    out = []
    t, n = ranks.started, 0
    for i, a in enumerate([ranks.started, *onsets]):
        factor = max((s.factor for s in ranks.slowdowns if s.since <= a), default=1.0)
        d = slowed_step(ranks.step_s, factor)
        b = min(end, onsets[i] if i < len(onsets) else end)
        out.append((t, n, d))
        k = max(0, math.floor((b - t) / d + 1e-9))
        t, n = t + k * d, n + k
    return out


def _steps_done(segments: list[tuple[float, int, float]], end: float) -> int:
    t, n, d = segments[-1]
    return n + max(0, math.floor((end - t) / d + 1e-9))


def _step_at(segments: list[tuple[float, int, float]], step: int) -> tuple[float, float]:
    """(end time, duration) of step `step` (0-based)."""
    for t, n, d in reversed(segments):
        if step >= n:
            return t + (step - n + 1) * d, d
    raise ValueError(step)


class _Rings:
    """This node's rings of one run, as bytes kept between feeds: each feed adds the new steps."""

    def __init__(self, directory: str, ranks: JobRanks, gpus: int):
        self.directory = directory
        self.ranks = ranks
        self.written = 0
        """Steps written so far (seq = step + 1)."""
        self.data = [bytearray(HEADER.size + RING_CAPACITY * RECORD.size) for _ in range(gpus)]
        job = ranks.job.encode("ascii")
        start = mono_ns(ranks.started)
        for gpu, buf in enumerate(self.data):
            HEADER.pack_into(buf, 0, MAGIC, VERSION, HEADER.size, RECORD.size, 0, RING_CAPACITY, 0,
                             ranks.first_rank + gpu, gpu, ranks.world_size, gpu, int(ranks.started * 1e9),
                             start, job, _PHASE["compute"], 0, start, 0)
            STEP_ID.pack_into(buf, STEP_ID_OFFSET, 1)  # the batch step, SLURM_STEP_ID 0

    def write(self, now: float) -> None:
        """The steps taken by `now` (at most the newest RING_CAPACITY), and the phase words, to the files."""
        ranks = self.ranks
        end = now if ranks.stopped is None else min(now, ranks.stopped)
        segments = _segments(ranks, end)
        done = _steps_done(segments, end)
        first = max(self.written, done - RING_CAPACITY)
        # one noise stream per rank and write (each step is written once, at a time the run's seed fixes)
        noise_of = [random.Random(ranks.seed * 1_000_003 + (ranks.first_rank + gpu) * 7_919 + first * 104_729)
                    for gpu in range(len(self.data))]
        # what a step's record says apart from its rank's compute time is the same on every GPU
        steps = []
        for step in range(first, done):
            at, dur = _step_at(segments, step)
            steps.append((step, at - dur, HEADER.size + (step % RING_CAPACITY) * RECORD.size, mono_ns(at),
                          int(at * 1e9), int(dur * 1e9)))
        healthy = ranks.step_s * COMPUTE_SHARE
        for gpu, buf in enumerate(self.data):
            own_slow = [(s.since, s.factor) for s in ranks.slowdowns if s.gpu == gpu]
            lognormal = noise_of[gpu].lognormvariate
            for step, start, offset, mono, wall, dur_ns in steps:
                own = max((f for since, f in own_slow if since <= start), default=1.0) if own_slow else 1.0
                compute = healthy * own * min(1.1, max(0.9, lognormal(0, NOISE)))
                RECORD.pack_into(buf, offset, step + 1, STEP, 0, 0, step, mono, wall, dur_ns,
                                 max(0, dur_ns - int(compute * 1e9)), step + 1)
        self.written = max(self.written, done)
        for gpu, buf in enumerate(self.data):
            last = mono_ns(_step_at(segments, done - 1)[0]) if done else mono_ns(ranks.started)
            phase = "compute"
            if ranks.stopped is not None and now >= ranks.stopped and gpu != ranks.stuck_gpu:
                phase, last = "wait", max(last, mono_ns(ranks.stopped) - 1)
            _PHASE_WORDS.pack_into(buf, _PHASE_OFFSET, _PHASE[phase], 0, last)
            _HEAD.pack_into(buf, _HEAD_OFFSET, self.written)
            path = os.path.join(self.directory, ring_name(ranks.first_rank + gpu))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)


_PHASE = {name: code for code, name in PHASES.items()}
_PHASE_OFFSET, _PHASE_WORDS, _HEAD_OFFSET, _HEAD = layout.PHASE_OFFSET, layout.PHASE, layout.HEAD_OFFSET, layout.HEAD
"""The header's phase words and head, where the job's client stores them in place."""


@functools.lru_cache(maxsize=64)
def healthy_gpu(index: int) -> GpuSample:
    """A healthy GPU's reading: identity, a cool temperature, every counter at zero."""
    return GpuSample(index=index, name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{index:08x}-5e1a-4c3e-9d7b-000000000000",
                     serial=f"16520{index:08d}", bus_id=bus_id(index), temperature_c=40, ecc_corrected_volatile=0,
                     ecc_uncorrected_volatile=0, remap_pending=False, remap_failure=False, pcie_replay=0)


class _Kernel:
    """The kernel log follower's seat in the agent: hands out the lines fed since the last read."""

    name = "kernel_log"

    def __init__(self) -> None:
        self.pending: list[tuple[str, float]] = []

    def read(self, timeout_s: float) -> KernelSample:
        lines, self.pending = self.pending, []
        return fold_lines(lines, detail="simulated kernel log")

    def close(self) -> None:
        pass


class _Nvml:
    """The NVML collector's seat: the node's current reading, stamped with counter deltas by the
    collector's own step against its baseline."""

    name = "nvml"

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.fields: dict[int, dict[str, Any]] = {}
        self.count: int | None = None
        self.baseline = Baseline()
        self.boot_id: str | None = None
        self._reading: NvmlSample | None = None

    def apply(self, reading: NvmlReading) -> None:
        for g in reading.gpus:
            self.fields.setdefault(g.index, {}).update(g.fields)
        if reading.count is not None:
            self.count = reading.count
        self._reading = None

    def collect(self, now: float) -> NvmlSample:
        if self._reading is None:  # built once per change: a GpuSample checks every field it is given
            count = self.gpus if self.count is None else self.count
            gpus = tuple(dataclasses.replace(healthy_gpu(i), **self.fields[i]) if i in self.fields else healthy_gpu(i)
                         for i in range(count))
            self._reading = NvmlSample(status="ok", count=count, gpus=gpus)
        sample, self.baseline = with_deltas(self._reading, self.baseline, self.boot_id, now)
        return sample

    def state(self) -> None:
        return None

    def close(self) -> None:
        pass


def catalog_of(section: Mapping[str, Any]) -> Catalog:
    """The Xid catalog an agent loads from its config's `catalog:` section (`section`: `overrides`, as
    in healthd.yaml), read by the agent's own config reader and catalog loader: a bad section raises
    their ConfigError or CatalogError (both ValueError). Loaded once per distinct section."""
    return _catalog(yaml.safe_dump({"catalog": dict(section)}, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _catalog(text: str) -> Catalog:
    from healthd.config import parse  # here: only a run with a catalog section reads the agent's config

    settings = parse(text, "the agents' config")
    return load_catalog(settings.catalog.path, settings.catalog.overrides)


def agent_settings(node: str, gpus: int, run_dir: str) -> Settings:
    """A node's agent settings in the simulator: NVML (expecting `gpus` GPUs) and the kernel log; the
    sources the simulator does not feed (InfiniBand, the host) off; no goodput log written; the
    hooks' directory an empty one, so no quick-check result or binding is read."""
    return Settings(node_name=node, state_dir=run_dir, state_file=f"{run_dir}/state.json",
                    nvml=NvmlSettings(expected_gpus=gpus), infiniband=InfinibandSettings(enabled=False),
                    host=HostSettings(enabled=False), hooks=HookSettings(run_dir=f"{run_dir}/run"),
                    inband=InbandSettings(goodput_log=False))


class SimAgent:
    """One node's real agent, fed simulated input on the simulator's clock."""

    def __init__(self, node: str, *, gpus: int = 8, catalog: Catalog | None = None, run_dir: str | None = None,
                 now: float = 0.0):
        """`run_dir`: an empty directory for the agent's hooks' files (none is read); `now`: when the
        agent starts."""
        self.node = node
        self.now = float(now)
        self.boots = 0
        self.kernel = _Kernel()
        self.nvml = _Nvml(gpus)
        self.run_dir = run_dir or tempfile.gettempdir()
        self._hooks_dir: str | None = None
        self.trimmed = ""
        """What fit_report left out of the latest document ("": nothing, it passed the schema's checks)."""
        self.rings: _Rings | None = None
        """The rings of the job's ranks on this node (None: no job writes any)."""
        self.agent = Agent(agent_settings(node, gpus, self.run_dir), catalog or load_catalog(),
                           Sources(kernel=self.kernel, nvml=self.nvml), Memory(history=History()), dry_run=False,
                           clock=lambda: self.now, monotonic_ns=lambda: mono_ns(self.now))
        self.agent.boot_id = self._boot_id()
        self.nvml.boot_id = self.agent.boot_id

    def _boot_id(self) -> str:
        return f"{zlib.crc32(self.node.encode()):08x}{self.boots:024x}"

    def feed(self, inputs: Iterable[AgentInput], now: float) -> dict[str, Any]:
        """One agent tick at `now` with `inputs` (none: a tick on what the node shows already, as the
        agent's periodic pass); the state document as the reporter sends it (fitted to the
        controller's limits by report_schema.fit_report, which checks it against the schema the
        intake checks; `trimmed` says what it left out, "" when nothing: the document passed)."""
        self.now = float(now)
        for item in inputs:
            if isinstance(item, KernelLines):
                self.kernel.pending.extend((line, self.now) for line in item.lines for _ in range(max(1, item.repeat)))
            elif isinstance(item, NvmlReading):
                self.nvml.apply(item)
            elif isinstance(item, JobRanks):
                self._job_ranks(item)
            elif isinstance(item, JobEnded):
                self._job_ended(item.job)
            else:
                raise TypeError(f"not agent input: {type(item).__name__} (KernelLines, NvmlReading, JobRanks "
                                "or JobEnded)")
        if self.rings is not None:
            self.rings.write(self.now)
        self.agent.tick()
        doc, self.trimmed = fit_report(self.agent.document())
        return doc

    def _inband_root(self) -> str:
        """The agent's own hooks directory (made at the first ring: agents of one simulation share
        `run_dir`, and each must read only its node's rings), trusted as root's is on a node."""
        if self._hooks_dir is None:
            self._hooks_dir = tempfile.mkdtemp(prefix="agent-", dir=self.run_dir)
            os.mkdir(os.path.join(self._hooks_dir, INBAND_DIR), 0o755)
            self.agent.settings = dataclasses.replace(self.agent.settings, hooks=HookSettings(run_dir=self._hooks_dir))
            self.agent.inband.trusted_uid = os.getuid()
        return self._hooks_dir

    def _job_ranks(self, ranks: JobRanks) -> None:
        if self.rings is not None and (self.rings.ranks.job, self.rings.ranks.started) == (ranks.job, ranks.started):
            self.rings.ranks = ranks
            return
        if self.rings is not None:
            self._job_ended(self.rings.ranks.job)
        directory = job_dir(self._inband_root(), ranks.job)
        os.mkdir(directory, 0o700)
        self.rings = _Rings(directory, ranks, self.nvml.gpus)

    def _job_ended(self, job: str) -> None:
        if self.rings is not None and self.rings.ranks.job == job:
            shutil.rmtree(self.rings.directory, ignore_errors=True)
            self.rings = None

    def close(self) -> None:
        """Remove the agent's own directory (its rings)."""
        if self._hooks_dir is not None:
            shutil.rmtree(self._hooks_dir, ignore_errors=True)
            self._hooks_dir = None
            self.rings = None

    def reboot(self) -> None:
        """The node rebooted (a repair, a reboot the controller asked for): a new boot id, every GPU
        healthy again; the next tick sees the reboot as a real agent does."""
        self.boots += 1
        if self.rings is not None:  # the rings lived on the node's tmpfs
            self._job_ended(self.rings.ranks.job)
        self.agent.boot_id = self._boot_id()
        self.nvml = _Nvml(self.nvml.gpus)
        self.nvml.boot_id = self.agent.boot_id
        self.agent.sources.periodic["nvml"] = self.nvml

    @property
    def findings(self) -> int:
        """How many findings the agent holds after its last tick."""
        return len(self.agent.result.findings) if self.agent.result is not None else 0
