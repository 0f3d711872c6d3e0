"""Hand-built samples for the classifier tests: pure data, no collectors. NVML counters are written
raw, as NVML reports them; `run` turns them into deltas with the NVML collector's own pure step."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from healthd.agent.classify.catalog import Catalog, load_catalog
from healthd.agent.classify import Classification, classify
from healthd.agent.collectors.counters import Baseline
from healthd.agent.collectors.nvml import with_deltas
from healthd.agent.history import History
from healthd.model import (
    CounterDelta,
    FilesystemProbe,
    Finding,
    GpuSample,
    HostSample,
    InfinibandSample,
    KernelSample,
    NvmlSample,
    PortSample,
    Snapshot,
    XidEvent,
)
from healthd.agent.sources import SOURCES
from healthd.settings import ClassifySettings, Settings

NOW = 1_750_000_000.0
BUS = [f"00000000:{b:02X}:00.0" for b in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)]
CATALOG = load_catalog()


def settings(**sections: Any) -> Settings:
    """settings(classify={"xid_repeat_count": 2}, nvml={"expected_gpus": 8}, ...)"""
    kinds = {**{s.name: s.settings for s in SOURCES}, "classify": ClassifySettings}
    kw = {name: kinds[name](**values) for name, values in sections.items() if name in kinds}
    rest = {k: v for k, v in sections.items() if k not in kinds}
    return Settings(node_name="gpu001", **kw, **rest)


def gpu(i: int, **kw: Any) -> GpuSample:
    base: dict[str, Any] = {"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08d}", "serial": f"16520000{i:02d}", "bus_id": BUS[i]}
    base.update(kw)
    return GpuSample(**base)


def nvml(*gpus: GpuSample, count: int | None = None, status: str = "ok", **kw: Any) -> NvmlSample:
    return NvmlSample(status=status, count=len(gpus) if count is None and status == "ok" else count, gpus=tuple(gpus), **kw)


def xid(code: int, gpu_index: int | None, t: float, count: int = 1, text: str | None = None, cursor: str | None = None, **kw: Any) -> XidEvent:
    bus = BUS[gpu_index] if gpu_index is not None else kw.pop("bus_id", None)
    short = bus[4:12].lower() if bus else "?"
    return XidEvent(
        xid=code,
        bus_id=bus,
        text=text or f"NVRM: Xid (PCI:{short}): {code}, pid=4242, name=python3, test line",
        count=count,
        first_ts=t,
        last_ts=t + max(0, count - 1) * 0.001,
        first_cursor=cursor or f"s=abc;i={int(t)}",
        last_cursor=(cursor or f"s=abc;i={int(t)}") + f"+{count - 1}",
        **kw,
    )


def kernel(*events: XidEvent, **kw: Any) -> KernelSample:
    return KernelSample(status=kw.pop("status", "ok"), events=tuple(events), lines_read=sum(e.count for e in events), **kw)


def cd(value: int, delta: int | None = 0, window: float | None = 10.0, **kw: Any) -> CounterDelta:
    return CounterDelta(value=value, delta=delta, window_s=window, **kw)


def port(device: str = "mlx5_0", n: int = 1, up: bool = True, rate: float | None = 400.0, counters: dict | None = None, **kw: Any) -> PortSample:
    state, phys = ("ACTIVE", "LinkUp") if up else (kw.pop("state", "DOWN"), kw.pop("phys_state", "Polling"))
    return PortSample(device=device, port=n, state=state, phys_state=phys, rate_gbps=rate, link_layer="InfiniBand",
                      counters=counters or {}, **kw)


def ib(*ports: PortSample, status: str = "ok", detail: str = "", **kw: Any) -> InfinibandSample:
    return InfinibandSample(status=status, detail=detail, ports=tuple(ports), **kw)


def host(**kw: Any) -> HostSample:
    kw.setdefault("status", "ok")
    kw.setdefault("mem_available_bytes", 400 * 2**30)
    kw.setdefault("mem_total_bytes", 2048 * 2**30)
    return HostSample(**kw)


def fs(path: str = "/ckpt", **kw: Any) -> FilesystemProbe:
    base: dict[str, Any] = {"path": path, "role": "checkpoint", "mounted": True, "writable": True, "latency_s": 0.01,
                            "fstype": "lustre", "mount_point": path}
    base.update(kw)
    return FilesystemProbe(**base)


def snap(t: float = NOW, *, nv: NvmlSample | None = None, k: KernelSample | None = None, i: InfinibandSample | None = None,
         h: HostSample | None = None, boot_id: str = "boot-1") -> Snapshot:
    """One tick at `t`. An NVML or InfiniBand sample without a read time is read at `t`, as the
    collectors stamp them; passing the same sample to a later tick is classifying it again."""
    if i is not None and i.time is None:
        i = dataclasses.replace(i, time=t)
    if nv is not None and nv.time is None:
        nv = dataclasses.replace(nv, time=t)
    return Snapshot(
        node="gpu001",
        time=t,
        boot_id=boot_id,
        nvml=nv if nv is not None else NvmlSample(status="no_data", detail="disabled in config"),
        kernel=k if k is not None else kernel(),
        infiniband=i if i is not None else ib(status="no_data", detail="no HCA"),
        host=h if h is not None else host(),
    )


def read_nvml(snaps: Iterable[Snapshot]) -> list[Snapshot]:
    """The ticks with their NVML counters as deltas, the way one NVML collector would have read
    them in this order (a sample already carrying deltas is left as it is)."""
    baseline, last, out = Baseline(), None, []
    for s in snaps:
        nv = s.nvml
        if nv.time is not None and last is not None and nv.time == last[0].time:
            nv = last[1]  # the same read, classified again
        elif not any(g.counters for g in nv.gpus):
            read, baseline = with_deltas(nv, baseline, s.boot_id, nv.time if nv.time is not None else s.time)
            last, nv = (nv, read), read
        out.append(dataclasses.replace(s, nvml=nv))
    return out


def run(*snaps: Snapshot, history: History | None = None, catalog: Catalog = CATALOG, cfg: Settings | None = None) -> list[Classification]:
    """Classify a sequence of ticks, feeding each history to the next (NVML counters as one
    collector reading them in this order would deliver them)."""
    cfg = cfg or settings()
    hist = history or History()
    out = []
    for s in read_nvml(snaps):
        res = classify(s, hist, catalog, cfg)
        hist = res.history
        out.append(res)
    return out


def restart(history: History) -> History:
    """What the agent does across a restart: save as JSON text, read it back."""
    return History.from_json(json.loads(json.dumps(history.to_json())))


def ids(res: Classification) -> set[str]:
    return {f.id for f in res.findings}


def get(res: Classification, fid: str) -> Finding:
    for f in res.findings:
        if f.id == fid:
            return f
    raise AssertionError(f"no finding {fid}; have {sorted(ids(res))}")


def texts(f: Finding) -> str:
    return "\n".join(e.text for e in f.evidence)


def replace(obj: Any, **kw: Any) -> Any:
    return dataclasses.replace(obj, **kw)


def ticks(start: float, n: int, step: float = 10.0) -> Iterable[float]:
    return (start + k * step for k in range(n))
