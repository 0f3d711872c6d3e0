"""The values that flow through the agent: samples (what collectors saw) and findings (what they mean).

Collectors return samples and make no decisions. `healthd.agent.classify.classify` turns a Snapshot plus
history into Findings. Everything here is a frozen dataclass so a tick's data cannot be changed
after it was read, and every type renders to the stable JSON shape documented in the README.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, get_args

from healthd.reason import build_reason

Attribution = Literal["hardware", "fabric", "storage", "software", "user", "unknown"]
Source = Literal["nvml", "kernel_log", "infiniband", "host", "nvme", "inband"]
Action = Literal[
    "none",
    "reset-gpu-when-idle",
    "reboot-when-idle",
    "drain",
    "drain-and-requeue",
    "inspect-hardware",
]
ComponentKind = Literal["gpu", "port", "node", "filesystem"]
Verdict = Literal["healthy", "degraded", "failed", "unknown"]
Tier = Literal[1, 2, 3]

TIERS: tuple[int, ...] = get_args(Tier)
VERDICTS: tuple[str, ...] = get_args(Verdict)
TS_MAX = 4102444800.0
"""2100-01-01: a timestamp outside [0, TS_MAX] is garbage (and would not render as RFC 3339)."""

ATTRIBUTIONS: tuple[str, ...] = ("hardware", "fabric", "storage", "software", "user", "unknown")
ACTIONS: tuple[str, ...] = (
    "none",
    "reset-gpu-when-idle",
    "reboot-when-idle",
    "drain",
    "drain-and-requeue",
    "inspect-hardware",
)
# How strongly an action takes a node out of service; the verdict's would_do keeps the strongest.
ACTION_SEVERITY: Mapping[str, int] = {a: i for i, a in enumerate(ACTIONS)}

# A collector's outcome for one tick: "ok" it read data; "no_data" the source does not exist on this
# node (no driver, no HCA) and that is not a fault; "error" the source exists but could not be read.
Status = Literal["ok", "no_data", "error"]


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> RFC 3339 UTC with milliseconds, the one time format of the JSON output."""
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="milliseconds")


def normalize_bus_id(raw: str) -> str | None:
    """Any PCI address spelling -> NVML's `00000000:3B:00.0`, the one key GPUs are joined on.

    Kernel lines print `0000:3b:00` (no function) or `PCI:0018:01:00`, NVML prints
    `00000000:3B:00.0`, sysfs prints `0000:3b:00.0`. Returns None for text that is not an address.
    """
    text = raw.strip()
    if text[:4].upper() == "PCI:":
        text = text[4:]
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    domain, bus, rest = parts
    dev, _, fn = rest.partition(".")
    fn = fn or "0"
    try:
        d, b, v, f = int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None
    if d > 0xFFFFFFFF or b > 0xFF or v > 0x1F or f > 0x7:
        return None
    return f"{d:08X}:{b:02X}:{v:02X}.{f:X}"


def _epoch(value: Any) -> float | None:
    """A document's time (RFC 3339 text or epoch seconds) -> epoch seconds; None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class Component:
    """The thing a finding is about. Unused fields stay None."""

    kind: ComponentKind
    index: int | None = None
    """GPU index as NVML numbers it."""
    uuid: str | None = None
    serial: str | None = None
    bus_id: str | None = None
    """PCI bus id, normalised to NVML's form `00000000:3B:00.0`."""
    device: str | None = None
    """HCA name (`mlx5_0`) for ports, mount point for filesystems."""
    port: int | None = None

    def key(self) -> str:
        """A short stable name used in finding ids and logs: gpu0, mlx5_0/1, node, fs:/ckpt."""
        if self.kind == "gpu":
            return f"gpu{self.index}" if self.index is not None else f"gpu[{self.bus_id}]"
        if self.kind == "port":
            return f"{self.device}/{self.port}"
        if self.kind == "filesystem":
            return f"fs:{self.device}"
        return "node"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NODE = Component(kind="node")


@dataclass(frozen=True)
class Evidence:
    """One verifiable fact behind a finding: a log line and its cursor, a counter delta over a window,
    an NVML value. `text` is what a human reads; `data` is the same fact as machine-readable fields."""

    kind: str
    """log_line | counter | nvml_value | probe | state | history | config."""
    text: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, **dict(self.data)}


@dataclass(frozen=True)
class Finding:
    """An attributed, tiered statement about one component, with the evidence that produced it."""

    id: str
    """Stable across ticks for the same condition: `<rule>:<component key>[:xid]`."""
    component: Component
    source: Source
    attribution: Attribution
    tier: Tier
    action: Action
    summary: str
    evidence: tuple[Evidence, ...]
    xid: int | None = None
    count: int = 1
    first_seen: float | None = None
    last_seen: float | None = None
    job: str | None = None
    """Slurm job id the finding is charged to, when known (set by the Slurm hooks' binding)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "component": self.component.to_json(),
            "source": self.source,
            "xid": self.xid,
            "attribution": self.attribution,
            "tier": self.tier,
            "action": self.action,
            "summary": self.summary,
            "evidence": [e.to_json() for e in self.evidence],
            "count": self.count,
            "first_seen": iso(self.first_seen),
            "last_seen": iso(self.last_seen),
            "job": self.job,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Finding:
        """The inverse of to_json, for a finding whose shape is already checked
        (healthd.report_schema.validate_finding names what is malformed)."""
        comp = doc["component"]
        return cls(
            id=doc["id"],
            component=Component(
                kind=comp["kind"],
                index=comp.get("index"),
                uuid=comp.get("uuid"),
                serial=comp.get("serial"),
                bus_id=comp.get("bus_id"),
                device=comp.get("device"),
                port=comp.get("port"),
            ),
            source=doc["source"],
            attribution=doc["attribution"],
            tier=doc["tier"],
            action=doc["action"],
            summary=doc["summary"],
            evidence=tuple(
                Evidence(kind=e["kind"], text=e["text"], data={k: v for k, v in e.items() if k not in ("kind", "text")})
                for e in doc["evidence"]
            ),
            xid=doc.get("xid"),
            count=doc.get("count") or 1,
            first_seen=_epoch(doc.get("first_seen")),
            last_seen=_epoch(doc.get("last_seen")),
            job=doc.get("job"),
        )


# --------------------------------------------------------------------------- rules over findings


def verdict(findings: Iterable[Finding], *, unreadable: bool) -> Verdict:
    """The node's verdict, the one rule the agent and the hooks apply: any T1 finding is failed; a
    node none of whose sources could be read (`unreadable`) stays unknown; findings make it
    degraded; none, healthy."""
    findings = list(findings)
    if any(f.tier == 1 for f in findings):
        return "failed"
    if unreadable:
        return "unknown"
    return "degraded" if findings else "healthy"


def would_do(findings: Iterable[Finding]) -> tuple[dict[str, Any], ...]:
    """One request per distinct (action, component): the most certain finding behind it, strongest
    action first. Each reason is the Slurm reason healthd would write (healthd.reason): it starts
    with `healthd:`, which is how the hooks tell healthd's drains from everyone else's."""
    best: dict[tuple[str, str], Finding] = {}
    for f in findings:
        if f.action == "none":
            continue
        k = (f.action, f.component.key())
        cur = best.get(k)
        if cur is None or (f.tier, f.id) < (cur.tier, cur.id):
            best[k] = f
    ordered = sorted(best.values(), key=lambda f: (-ACTION_SEVERITY[f.action], f.tier, f.component.key(), f.id))
    return tuple(
        {"action": f.action, "component": f.component.key(), "reason": build_reason(f.summary), "finding": f.id, "tier": f.tier}
        for f in ordered
    )


def same_episode(f: Finding, before: float) -> bool:
    """The finding is the episode that had begun by `before`, with no kernel log line after it."""
    if f.first_seen is None or f.first_seen > before:
        return False
    return not (f.source == "kernel_log" and f.last_seen is not None and f.last_seen > before)


def is_cleared(f: Finding, cleared: Mapping[str, float], dismissed: Mapping[str, float] | None = None) -> bool:
    """A finding whose latest evidence is not newer than its `evidence` clear (finding id -> before),
    or that is the same episode as its `episode` clear (`dismissed`), no longer counts. The agent and
    the controller judge by this one rule."""
    before = cleared.get(f.id)
    last = f.last_seen if f.last_seen is not None else f.first_seen
    if before is not None and (last is None or last <= before):
        return True
    episode = dismissed.get(f.id) if dismissed else None
    return episode is not None and same_episode(f, episode)


# --------------------------------------------------------------------------- samples: checks

# Samples are checked once, where they are built, so the classifier's rules can trust every field.
# A reading that is not of its declared type (a bool or NaN where a number belongs, text where a
# flag belongs) is no data: None, or the empty value of a field that cannot be None. A field that
# names the thing sampled (a GPU's index, a port's device) and is not of its type is a collector bug
# and raises TypeError.


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _real(v: Any) -> float | None:
    """A finite number, or None."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _time(v: Any) -> float | None:
    """Epoch seconds in [0, TS_MAX], or None."""
    t = _real(v)
    return t if t is not None and 0.0 <= t <= TS_MAX else None


def _flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _text_map(v: Any) -> dict[str, str]:
    """name -> message: keys and values as text."""
    return {str(k): str(x) for k, x in v.items()} if hasattr(v, "items") else {}


def _need(owner: str, name: str, value: Any, kind: type, expected: str) -> None:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"{owner}.{name}: expected {expected}, found {value!r}")


def _check(obj: Any, **checks: Any) -> None:
    """Replace each named field by its check's result (the dataclasses are frozen)."""
    for name, check in checks.items():
        old = getattr(obj, name)
        new = check(old)
        if new is not old:
            object.__setattr__(obj, name, new)


def _fields(names: tuple[str, ...], check: Any) -> dict[str, Any]:
    return dict.fromkeys(names, check)


MAX_COMPUTE_PIDS = 256
"""A GPU's compute processes kept, at most (a real GPU holds a few; more is a broken answer)."""


def _pids(v: Any) -> tuple[int, ...] | None:
    """Positive integers, sorted, without repeats; None stays no data."""
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        return ()
    return tuple(sorted({p for p in v if isinstance(p, int) and not isinstance(p, bool) and 0 < p < 1 << 32}))[
        :MAX_COMPUTE_PIDS]


def _deltas(v: Any) -> dict[str, Any]:
    """name -> CounterDelta; anything else is dropped."""
    return {k: c for k, c in v.items() if isinstance(k, str) and isinstance(c, CounterDelta)} if hasattr(v, "items") else {}


# --------------------------------------------------------------------------- samples: counters


@dataclass(frozen=True)
class CounterDelta:
    """A counter's change since the previous reading, over `window_s` seconds. The collector that
    reads the counter computes the delta against its own baseline (healthd.agent.collectors.counters);
    nothing else does."""

    value: int
    delta: int | None
    """None on the first reading, after a reset (value went down) or when saturated."""
    window_s: float | None
    """Seconds since the previous reading; None when there is none or the clock went backwards."""
    saturated: bool = False
    """A saturating counter (InfiniBand's 16/8/4-bit PMA counters) sits at its maximum: new errors
    are unknown, not zero."""
    reset: bool = False
    """The value went down: the counter was cleared (a GPU reset, a driver reload, `perfquery -x`)."""

    def __post_init__(self) -> None:
        _need("CounterDelta", "value", self.value, int, "an integer")
        _check(
            self,
            delta=lambda v: v if _int(v) is not None and v >= 0 else None,
            window_s=lambda v: v if _real(v) is not None and v >= 0 else None,
            saturated=bool,
            reset=bool,
        )

    @property
    def rate_per_s(self) -> float | None:
        if self.delta is None or not self.window_s:
            return None
        return self.delta / self.window_s


# --------------------------------------------------------------------------- samples: NVML


_GPU_COUNTS = (
    "temperature_c", "margin_c", "slowdown_threshold_c", "clock_event_reasons",
    "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate",
    "remap_corrected", "remap_uncorrected", "retired_pages_sbe", "retired_pages_dbe",
    "pcie_replay", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max",
)
_GPU_FLAGS = ("remap_pending", "remap_failure", "retired_pending")
_GPU_TEXTS = ("name", "uuid", "serial", "bus_id", "lost_detail")


@dataclass(frozen=True)
class GpuSample:
    """One GPU as NVML reported it this tick. A None field means "no data" (NotSupported, symbol
    missing in this driver); the field names of such reads are listed in `no_data`."""

    index: int
    name: str | None = None
    uuid: str | None = None
    serial: str | None = None
    bus_id: str | None = None
    lost: bool = False
    """NVML answered GPU_IS_LOST for this device: fell off the bus or otherwise gone."""
    lost_detail: str | None = None
    temperature_c: int | None = None
    margin_c: int | None = None
    """Distance to the nearest slowdown threshold (nvmlDeviceGetMarginTemperature)."""
    slowdown_threshold_c: int | None = None
    clock_event_reasons: int | None = None
    """Bitmask of nvmlClocksEventReason* (NVML's clock event, or throttle, reasons)."""
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remap_corrected: int | None = None
    remap_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pending: bool | None = None
    pcie_replay: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_errors: Mapping[str, int] = field(default_factory=dict)
    """`link<N>.<replay|recovery|crc_flit|crc_data>` -> counter, for links NVML reports active."""
    compute_pids: tuple[int, ...] | None = None
    """Processes with a compute context on this GPU (nvmlDeviceGetComputeRunningProcesses), as PIDs
    of the agent's PID namespace, sorted; None: no data. What joins a training rank to its GPU."""
    counters: Mapping[str, CounterDelta] = field(default_factory=dict)
    """The ever-growing counters above as deltas since the collector's previous reading:
    `ecc_uncorrected_volatile`, `ecc_corrected_volatile`, `pcie_replay`, `nvlink/link<N>.<name>`."""
    no_data: tuple[str, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    """field -> NVML error text for reads that failed with something other than NotSupported."""

    def __post_init__(self) -> None:
        _need("GpuSample", "index", self.index, int, "an integer")
        _need("GpuSample", "lost", self.lost, bool, "true or false")
        _check(self, **_GPU_CHECKS)

    def with_counters(self, counters: Mapping[str, CounterDelta]) -> GpuSample:
        """This sample with `counters` (the collector's deltas): only the new field is checked, the
        others were when this one was built (a replace() checks every field again, per GPU per tick)."""
        out = object.__new__(GpuSample)
        out.__dict__.update(self.__dict__, counters=_deltas(counters))
        return out


def _nvlink_counts(v: Any) -> dict[str, int]:
    return {k: n for k, n in v.items() if isinstance(k, str) and _int(n) is not None} if hasattr(v, "items") else {}


# built once: a collector builds a GpuSample per GPU per tick (and again for its counter deltas)
_GPU_CHECKS: dict[str, Any] = {**_fields(_GPU_COUNTS, _int), **_fields(_GPU_FLAGS, _flag), **_fields(_GPU_TEXTS, _text),
                               "nvlink_errors": _nvlink_counts, "counters": _deltas, "errors": _text_map,
                               "compute_pids": _pids}


@dataclass(frozen=True)
class NvmlSample:
    status: Status
    detail: str = ""
    """Why no_data or error: 'libnvidia-ml.so.1 not found', 'driver not loaded', the NVML error."""
    error_kind: str | None = None
    """For status=error: library_not_found | driver_not_loaded | init_failed | driver_too_old (its
    NVML lacks a function nothing can be read without) | timeout | other."""
    driver_version: str | None = None
    nvml_version: str | None = None
    count: int | None = None
    gpus: tuple[GpuSample, ...] = ()
    time: float | None = None
    """When the collector read the GPUs (epoch seconds). Classifying the same sample again (the
    kernel follower ticks between collections) does not count its counter deltas twice."""
    driver_lacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """NVML function the loaded driver lacks (an older driver) -> the readings (GpuSample field
    names, also in each GPU's `no_data`) it leaves without data on every GPU. No fault of the node."""

    def __post_init__(self) -> None:
        _check(self, count=_int, time=_time, driver_lacks=_lacks)


def _lacks(v: Any) -> dict[str, tuple[str, ...]]:
    """function -> readings, as text; anything else is nothing lacking."""
    if not hasattr(v, "items"):
        return {}
    return {str(k): tuple(str(r) for r in x) for k, x in v.items()
            if isinstance(x, (list, tuple)) and not isinstance(x, (str, bytes))}


# --------------------------------------------------------------------------- samples: kernel log


@dataclass(frozen=True)
class KernelLine:
    """One parsed NVRM line (pure parse of the message text; no I/O)."""

    kind: Literal["xid", "fallen_off_bus", "init_failed", "gpu_identity", "serial"]
    bus_id: str | None
    """Normalised to NVML's form `00000000:3B:00.0`."""
    xid: int | None = None
    pid: int | None = None
    process: str | None = None
    text: str = ""
    """The free text after the code (or the whole message for non-Xid kinds)."""
    subcode: int | None = None
    """NVLink5 (Xid 144-150) subcode: bits 20-25 of the first hex word."""
    nvlink_unit: str | None = None
    nvlink_severity: str | None = None
    """'Fatal' | 'Non-fatal' as printed in NVLink lines (Xid 74 "NVLink: fatal error", NVLink5 144-150)."""
    gpc: int | None = None
    tpc: int | None = None
    sm: int | None = None
    uuid: str | None = None
    serial: str | None = None


@dataclass(frozen=True)
class XidEvent:
    """Identical kernel lines folded together: one GPU can emit 800,000 copies of the same Xid 95
    line, so a burst is one event with a count, the first line and cursor, and the last cursor."""

    xid: int
    bus_id: str | None
    text: str
    """The first line's message, as logged."""
    count: int
    """Lines folded, at least 1."""
    first_ts: float | None
    """Epoch seconds of the first line; None when the line's time is not a usable time."""
    last_ts: float | None
    first_cursor: str | None
    last_cursor: str | None
    pid: int | None = None
    process: str | None = None
    subcode: int | None = None
    nvlink_severity: str | None = None
    gpc: int | None = None
    tpc: int | None = None
    synthesized: bool = False
    """True for a line without an Xid number read as one: "GPU has fallen off the bus" as 79, a GPU
    that failed to initialise ("RmInitAdapter failed!") as 143."""

    def __post_init__(self) -> None:
        _need("XidEvent", "xid", self.xid, int, "an integer")
        _check(
            self,
            bus_id=_text,
            text=lambda v: v if isinstance(v, str) else "",
            count=lambda v: v if _int(v) is not None and v > 0 else 1,
            first_ts=_time,
            last_ts=_time,
            **_fields(("first_cursor", "last_cursor", "process", "nvlink_severity"), _text),
            **_fields(("pid", "subcode", "gpc", "tpc"), _int),
            synthesized=bool,
        )


@dataclass(frozen=True)
class KernelSample:
    status: Status
    detail: str = ""
    events: tuple[XidEvent, ...] = ()
    """Events read since the previous tick (the follower hands each event over exactly once)."""
    identities: Mapping[str, tuple[str | None, str | None]] = field(default_factory=dict)
    """bus_id -> (uuid, serial) learned from `NVRM: GPU at PCI:...` / `GPU Board Serial Number` lines."""
    lines_read: int = 0
    malformed: int = 0
    gap: bool = False
    """The saved cursor's entry was vacuumed: lines between it and the next entry may be lost."""
    cursor: str | None = None
    """Position after the last line read (journal cursor, or 'kmsg:<boot_id>:<seq>'); the agent
    persists it together with the history the events were folded into, so a restart resumes
    exactly once."""

    def __post_init__(self) -> None:
        _check(
            self,
            identities=lambda v: {
                k: (_text(pair[0]), _text(pair[1]))
                for k, pair in v.items()
                if isinstance(k, str) and isinstance(pair, (tuple, list)) and len(pair) == 2
            } if hasattr(v, "items") else {},
        )


# --------------------------------------------------------------------------- samples: InfiniBand


@dataclass(frozen=True)
class PortSample:
    device: str
    port: int
    state: str | None
    """'ACTIVE', 'DOWN', ... (text after 'N: ')."""
    phys_state: str | None
    """'LinkUp', 'Disabled', 'Polling', ..."""
    rate_gbps: float | None
    link_layer: str | None
    counters: Mapping[str, CounterDelta] = field(default_factory=dict)
    """Keys are 'counters/<name>' and 'hw_counters/<name>'."""
    unreadable: Mapping[str, str] = field(default_factory=dict)
    """File -> error for files that exist but could not be read or parsed (EIO, EINVAL, garbage)."""

    def __post_init__(self) -> None:
        _need("PortSample", "device", self.device, str, "a device name")
        _need("PortSample", "port", self.port, int, "a port number")
        _check(
            self,
            **_fields(("state", "phys_state", "link_layer"), _text),
            rate_gbps=_real,
            counters=_deltas,
            unreadable=_text_map,
        )

    @property
    def up(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


@dataclass(frozen=True)
class InfinibandSample:
    status: Status
    detail: str = ""
    ports: tuple[PortSample, ...] = ()
    boot_id: str | None = None
    time: float | None = None
    """When the collector read the ports (epoch seconds). Classifying the same sample again (the
    kernel follower ticks between collections) does not count its counter deltas twice."""

    def __post_init__(self) -> None:
        _check(self, time=_time)


# --------------------------------------------------------------------------- samples: host


@dataclass(frozen=True)
class FilesystemProbe:
    path: str
    role: str
    """What the operator calls it in config: checkpoint, dataset, scratch."""
    mounted: bool
    """The path lies on a filesystem of its own (its longest mount prefix is not `/`), or is `/`."""
    writable: bool | None
    latency_s: float | None
    """Write + fsync of a small file; None when it did not complete."""
    timed_out: bool = False
    error: str | None = None
    fstype: str | None = None
    mount_point: str | None = None
    """The mount holding `path` (longest prefix in /proc/mounts): `/` for a directory that is not
    mounted; None when the mount table could not be read."""

    def __post_init__(self) -> None:
        _check(self, writable=_flag, latency_s=_real, **_fields(("error", "fstype", "mount_point"), _text))


@dataclass(frozen=True)
class HostSample:
    status: Status
    detail: str = ""
    mem_available_bytes: int | None = None
    mem_total_bytes: int | None = None
    psi: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """'memory'|'io'|'cpu' -> {'some_avg10': .., 'full_avg10': .., ...} from /proc/pressure."""
    dstate_pids: tuple[tuple[int, str], ...] = ()
    """(pid, comm) of processes in uninterruptible sleep."""
    filesystems: tuple[FilesystemProbe, ...] = ()

    def __post_init__(self) -> None:
        _check(
            self,
            mem_available_bytes=_int,
            mem_total_bytes=_int,
            psi=lambda v: {
                str(res): {str(k): x for k, x in values.items() if _real(x) is not None}
                for res, values in v.items()
                if hasattr(values, "items")
            } if hasattr(v, "items") else {},
            dstate_pids=lambda v: tuple(
                (p[0], p[1]) for p in (v or ())
                if isinstance(p, (tuple, list)) and len(p) == 2 and _int(p[0]) is not None and isinstance(p[1], str)
            ),
        )


# --------------------------------------------------------------------------- one tick


@dataclass(frozen=True)
class Snapshot:
    node: str
    time: float
    boot_id: str | None
    nvml: NvmlSample
    kernel: KernelSample
    infiniband: InfinibandSample
    host: HostSample
    collect_seconds: Mapping[str, float] = field(default_factory=dict)
    samples: Mapping[str, Any] = field(default_factory=dict)
    """The samples of the sources the fields above do not name, by source name (the agent's source
    registry, healthd.agent.sources, says where each source's sample is)."""

    def __post_init__(self) -> None:
        if _real(self.time) is None:
            raise TypeError(f"Snapshot.time: expected epoch seconds, found {self.time!r}")
