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
The in-band rings (healthd.inband_layout) are not fed: the agent reads them from files a job's ranks
write, and this module writes none.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd.agent.classify.catalog import Catalog, load_catalog
from healthd.agent.collectors.counters import Baseline
from healthd.agent.collectors.kernel_log import fold_lines
from healthd.agent.collectors.nvml import with_deltas
from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.model import GpuSample, KernelSample, NvmlSample
from healthd.report_schema import fit_report
from healthd.settings import HookSettings, HostSettings, InbandSettings, InfinibandSettings, NvmlSettings, Settings

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


AgentInput = KernelLines | NvmlReading


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
        self.agent = Agent(agent_settings(node, gpus, self.run_dir), catalog or load_catalog(),
                           Sources(kernel=self.kernel, nvml=self.nvml), Memory(history=History()), dry_run=False,
                           clock=lambda: self.now)
        self.agent.boot_id = self._boot_id()
        self.nvml.boot_id = self.agent.boot_id

    def _boot_id(self) -> str:
        return f"{zlib.crc32(self.node.encode()):08x}{self.boots:024x}"

    def feed(self, inputs: Iterable[AgentInput], now: float) -> dict[str, Any]:
        """One agent tick at `now` with `inputs` (none: a tick on what the node shows already, as the
        agent's periodic pass); the state document as the reporter sends it."""
        self.now = float(now)
        for item in inputs:
            if isinstance(item, KernelLines):
                self.kernel.pending.extend((line, self.now) for line in item.lines for _ in range(max(1, item.repeat)))
            elif isinstance(item, NvmlReading):
                self.nvml.apply(item)
            else:
                raise TypeError(f"not agent input: {type(item).__name__} (KernelLines or NvmlReading)")
        self.agent.tick()
        return json.loads(json.dumps(fit_report(self.agent.document())[0]))

    def reboot(self) -> None:
        """The node rebooted (a repair, a reboot the controller asked for): a new boot id, every GPU
        healthy again; the next tick sees the reboot as a real agent does."""
        self.boots += 1
        self.agent.boot_id = self._boot_id()
        self.nvml = _Nvml(self.nvml.gpus)
        self.nvml.boot_id = self.agent.boot_id
        self.agent.sources.periodic["nvml"] = self.nvml

    @property
    def findings(self) -> int:
        """How many findings the agent holds after its last tick."""
        return len(self.agent.result.findings) if self.agent.result is not None else 0
