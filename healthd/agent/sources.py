"""The agent's sources, registered once.

A source is one thing the agent reads: NVML, the kernel log, InfiniBand sysfs, the host's own
signals, the NVMe drives. Everything the agent does with a source comes from its entry in `SOURCES`:
the daemon builds its collector from the settings and hands back what it saved, collects it every
interval (or follows it, for the kernel log), the Snapshot carries its sample, the classifier handles
its status and then runs its rules, history keeps what its rules' windows need, the state document
lists it under `sources` and the metrics label its outcome. Nothing else spells the list of sources,
so a place that iterates `SOURCES` cannot leave one out; `check_registry` refuses an entry that lacks
a part when this module is imported.

Adding a source: docs/architecture.md, "Adding a source".
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from healthd.agent.classify import gpu, host, infiniband, nvme, xid
from healthd.agent.classify.context import HOUR_S, TickContext, finite_or
from healthd.agent.collectors.host import HostCollector
from healthd.agent.collectors.infiniband import InfinibandCollector
from healthd.agent.collectors.kernel_log import KernelLogFollower
from healthd.agent.collectors import nvme as nvme_collector
from healthd.agent.collectors.nvml import NvmlCollector
from healthd.model import (
    GpuSample,
    HostSample,
    InfinibandSample,
    KernelSample,
    NvmlSample,
    Snapshot,
    Source as SourceName,
)
from healthd.settings import HostSettings, InfinibandSettings, KernelLogSettings, NvmeSettings, NvmlSettings, Settings

Rules = Callable[[TickContext, Any], None]


@dataclass(frozen=True)
class Source:
    """One source and every part of the agent that handles it."""

    name: str
    """What the source is called everywhere: a finding's `source`, its settings section
    (`Settings.<name>`, which has an `enabled` flag), the state document's `sources` key, the metrics'
    `collector` label and the rules table's `collector.<name>` row."""
    sample: type
    """The sample its collector returns: a frozen dataclass with `status` (ok | no_data | error) and
    `detail`."""
    settings: type
    """The class of its settings section."""
    build: Callable[[Settings, Any], Any]
    """(settings, what the agent saved for it or None) -> its collector; called only when the section
    is enabled. What was saved is its collector's last `state()` (when `persists`), or the journal
    cursor for the followed source."""
    rules: Rules
    """Its classification rules, given the tick's context and its sample, after its status is handled."""
    keep_s: Callable[[Settings], float]
    """How long its history is kept, in seconds: its windowed series (the keys under `series_prefix`)
    at least as long as the longest window its rules read, or for the kernel log its Xid records."""
    series_prefix: str = ""
    """The history series keys its rules record under (`gpu/`, `port/`); empty: it records none."""
    on_error: Rules | None = None
    """Findings for a sample with status `error`; None: the `collector.<name>` finding (T3 unknown)
    with the sample's detail."""
    on_no_data: Rules | None = None
    """Findings for a sample with status `no_data`: an absent source is no fault unless the config
    expects it. None: none."""
    always: bool = False
    """Its rules run whatever the status (the kernel log's findings live on in history); otherwise
    only on `ok`."""
    field: str | None = None
    """The Snapshot attribute holding its sample; None: `Snapshot.samples[name]`."""
    followed: bool = False
    """Followed continuously on a thread of its own (`read(timeout_s)`) instead of collected once per
    interval (`collect(now)`). One source is: the kernel log."""
    persists: bool = False
    """Its collector's `state()` (counter baselines) is saved in the agent's memory file under its
    name and handed back to `build` at the next start."""
    document: Callable[[Any], list[dict[str, Any]]] | None = None
    """Its own section of the state document (`gpus`, `ports`), under `document_key`: one item per
    thing its sample lists."""
    document_key: str = ""
    notes: Callable[[Any], dict[str, Any]] | None = None
    """Keys its sample adds to its own entry under the state document's `sources`, beside status,
    detail and seconds (NVML: `driver_lacks`)."""
    restart_keys: tuple[str, ...] = ("enabled",)
    """Keys of its settings section that its collector is built from: a reload that changes one
    takes effect at the next start."""


# --------------------------------------------------------------------------- builders


def _nvml(s: Settings, saved: Any) -> NvmlCollector:
    return NvmlCollector(timeout_s=s.nvml.call_timeout_s, expected_gpus=s.nvml.expected_gpus, baseline=saved,
                         nvlink_counter_interval_s=s.nvml.nvlink_counter_interval_s)


def _kernel_log(s: Settings, cursor: Any) -> KernelLogFollower:
    k = s.kernel_log
    return KernelLogFollower(journal_dir=k.journal_dir, kmsg_path=k.kmsg_path, cursor=cursor, start_at=k.start_at)


def _infiniband(s: Settings, saved: Any) -> InfinibandCollector:
    return InfinibandCollector(sysfs_root=s.infiniband.sysfs_root, baseline=saved, counters=infiniband.IB_ERROR_COUNTERS)


def _host(s: Settings, saved: Any) -> HostCollector:
    h = s.host
    return HostCollector(proc_root=h.proc_root, filesystems=h.filesystems, dstate_scan_min_load=h.dstate_scan_min_load,
                         dstate_scan_interval_s=h.dstate_scan_interval_s)


def _nvme(s: Settings, saved: Any) -> nvme_collector.NvmeCollector:
    n = s.nvme
    return nvme_collector.NvmeCollector(sysfs_root=n.sysfs_root, smart_log_dir=n.smart_log_dir,
                                        smart_log_command=n.smart_log_command, command_timeout_s=n.command_timeout_s,
                                        baseline=saved)


# --------------------------------------------------------------------------- state document sections


def _gpus(n: NvmlSample) -> list[dict[str, Any]]:
    return [_gpu_json(g) for g in n.gpus]


def _gpu_json(g: GpuSample) -> dict[str, Any]:
    return {
        "index": g.index,
        "name": g.name,
        "uuid": g.uuid,
        "serial": g.serial,
        "bus_id": g.bus_id,
        "state": "lost" if g.lost else "ok",
        "temperature_c": g.temperature_c,
        "margin_c": g.margin_c,
        "ecc_uncorrected_volatile": g.ecc_uncorrected_volatile,
        "remap_pending": g.remap_pending,
        "remap_failure": g.remap_failure,
        "pcie": f"gen{g.pcie_gen}x{g.pcie_width}" if g.pcie_gen is not None and g.pcie_width is not None else None,
        "no_data": list(g.no_data),
    }


def _nvml_notes(n: NvmlSample) -> dict[str, Any]:
    return {"driver_lacks": {fn: list(readings) for fn, readings in n.driver_lacks.items()}} if n.driver_lacks else {}


def _ports(ib: InfinibandSample) -> list[dict[str, Any]]:
    return [{"device": p.device, "port": p.port, "state": p.state, "phys_state": p.phys_state, "rate_gbps": p.rate_gbps,
             "link_layer": p.link_layer} for p in ib.ports]


# --------------------------------------------------------------------------- the registry


SOURCES: tuple[Source, ...] = (
    Source(
        name="nvml", sample=NvmlSample, settings=NvmlSettings, build=_nvml, rules=gpu.evaluate,
        keep_s=lambda s: max(gpu.SBE_WINDOW_S, gpu.PCIE_REPLAY_WINDOW_S, finite_or(s.classify.hw_slowdown_window_s, 0.0)),
        series_prefix="gpu/", on_error=gpu.unreadable, on_no_data=gpu.absent, field="nvml", persists=True,
        document=_gpus, document_key="gpus", notes=_nvml_notes,
    ),
    Source(
        name="kernel_log", sample=KernelSample, settings=KernelLogSettings, build=_kernel_log, rules=xid.evaluate,
        keep_s=lambda s: max(s.classify.xid_repeat_window_s, s.classify.finding_ttl_s, s.classify.sympathetic_window_s),
        always=True, field="kernel", followed=True,
        restart_keys=("enabled", "journal_dir", "kmsg_path", "start_at"),
    ),
    Source(
        name="infiniband", sample=InfinibandSample, settings=InfinibandSettings, build=_infiniband,
        rules=infiniband.evaluate, keep_s=lambda s: max(finite_or(s.infiniband.flap_window_s, 0.0), HOUR_S),
        series_prefix="port/", on_no_data=infiniband.absent, field="infiniband", persists=True,
        document=_ports, document_key="ports", restart_keys=("enabled", "sysfs_root"),
    ),
    Source(
        name="host", sample=HostSample, settings=HostSettings, build=_host, rules=host.evaluate,
        keep_s=lambda s: 0.0, field="host", restart_keys=("enabled", "proc_root", "filesystems"),
    ),
    Source(
        name="nvme", sample=nvme_collector.NvmeSample, settings=NvmeSettings, build=_nvme, rules=nvme.evaluate,
        keep_s=lambda s: finite_or(s.nvme.media_errors_window_s, 0.0), series_prefix="nvme/", persists=True,
        document=nvme_collector.document, document_key="nvme",
        restart_keys=("enabled", "sysfs_root", "smart_log_dir", "smart_log_command", "command_timeout_s"),
    ),
)
"""Every source, in the order the agent collects and classifies them."""

PERIODIC: tuple[Source, ...] = tuple(s for s in SOURCES if not s.followed)
"""The sources collected once per interval."""


def check_registry(sources: tuple[Source, ...]) -> Source:
    """Refuse a registry that would let a place drop a source silently; return the followed source."""
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source registered twice: {names}")
    settings_hints = typing.get_type_hints(Settings)
    snapshot_fields = {f.name for f in dataclasses.fields(Snapshot)}
    prefixes: list[str] = []
    for s in sources:
        where = f"source {s.name!r}"
        if s.name not in typing.get_args(SourceName):
            raise ValueError(f"{where}: not a finding source in healthd.model.Source")
        if settings_hints.get(s.name) is not s.settings or "enabled" not in {f.name for f in dataclasses.fields(s.settings)}:
            raise ValueError(f"{where}: Settings.{s.name} is not a {s.settings.__name__} with an `enabled` flag")
        missing = [k for k in s.restart_keys if k not in {f.name for f in dataclasses.fields(s.settings)}]
        if missing:
            raise ValueError(f"{where}: restart_keys {missing} are not keys of its settings")
        if {"status", "detail"} - {f.name for f in dataclasses.fields(s.sample)}:
            raise ValueError(f"{where}: its sample {s.sample.__name__} has no status and detail")
        if not all(callable(f) for f in (s.build, s.rules, s.keep_s)):
            raise ValueError(f"{where}: build, rules and keep_s must be callables")
        if s.field is not None and s.field not in snapshot_fields:
            raise ValueError(f"{where}: Snapshot has no field {s.field!r}")
        if bool(s.document) != bool(s.document_key):
            raise ValueError(f"{where}: a state document section needs both `document` and `document_key`")
        if s.series_prefix:
            clash = [p for p in prefixes if p.startswith(s.series_prefix) or s.series_prefix.startswith(p)]
            if clash or not s.series_prefix.endswith("/"):
                raise ValueError(f"{where}: series prefix {s.series_prefix!r} is not a key prefix of its own")
            prefixes.append(s.series_prefix)
    followed = [s for s in sources if s.followed]
    if len(followed) != 1:
        raise ValueError(f"one source is followed (the kernel log); found {[s.name for s in followed]}")
    return followed[0]


FOLLOWED: Source = check_registry(SOURCES)
"""The source followed on its own thread: the kernel log."""


def by_name(name: str) -> Source:
    """The registered source `name`; a KeyError names a source that is not registered."""
    for s in SOURCES:
        if s.name == name:
            return s
    raise KeyError(name)


def absent(source: Source, detail: str) -> Any:
    """A sample of `source` that read nothing: status no_data with `detail`."""
    return source.sample(status="no_data", detail=detail)


def sample_of(snapshot: Snapshot, source: Source) -> Any:
    """`source`'s sample in the snapshot; a snapshot built without it holds a no_data sample."""
    if source.field is not None:
        return getattr(snapshot, source.field)
    found = snapshot.samples.get(source.name)
    return found if found is not None else absent(source, "not collected")


def snapshot(node: str, time: float, boot_id: str | None, samples: Mapping[str, Any],
             collect_seconds: Mapping[str, float]) -> Snapshot:
    """One tick's Snapshot from every source's sample, by source name."""
    named = {s.field: samples[s.name] for s in SOURCES if s.field is not None}
    others = {s.name: samples[s.name] for s in SOURCES if s.field is None}
    return Snapshot(node=node, time=time, boot_id=boot_id, **named, samples=others, collect_seconds=collect_seconds)


def restart_settings(settings: Settings) -> tuple[Any, ...]:
    """The values of every source's `restart_keys`: a reload that changes one takes effect at restart."""
    return tuple(getattr(getattr(settings, s.name), k) for s in SOURCES for k in s.restart_keys)
