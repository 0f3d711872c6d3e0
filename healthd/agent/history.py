"""What the classifier remembers between ticks, and across restarts: an immutable, bounded value.

`classify` takes a History and returns a new one; it never changes the one it was given. The agent
saves `to_json()` next to the kernel-log cursor and reads it back with `History.from_json`, which
raises `HistoryError` on anything it cannot trust (the agent then logs that and starts fresh).

Every collection here is bounded twice: by time (the classifier prunes what its windows no longer
need) and by count (`capped()`, applied on every tick and on load), so a node that emits a million
Xid lines or flaps a port all week keeps a history of the same small size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from healthd.model import ACTIONS, ATTRIBUTIONS, TS_MAX, Component, Evidence, Finding, Source

HISTORY_VERSION = 1

MAX_GPU_IDS = 64
MAX_SERIES_KEYS = 2048
MAX_SERIES_POINTS = 256
MAX_XID_KEYS = 512
MAX_OCCURRENCES = 64
MAX_PORT_RECORDS = 256
MAX_TRANSITIONS = 64
MAX_LATCHES = 512
MAX_TEXT = 2000
"""Longest log line or text kept; kernel lines are short, this only stops a corrupt or hostile file."""

_SOURCES: tuple[str, ...] = get_args(Source)
_KINDS = ("gpu", "port", "node", "filesystem")


class HistoryError(ValueError):
    """A saved history that cannot be used; the message says which part and why."""


@dataclass(frozen=True)
class Occurrence:
    """One folded burst of an Xid on one GPU, kept for the repeat and sympathetic rules."""

    first_ts: float
    last_ts: float
    count: int
    gpc: int | None = None
    tpc: int | None = None


@dataclass(frozen=True)
class XidRecord:
    """One Xid on one GPU: recent occurrences, and the current episode (the finding, while its last
    line is younger than `classify.finding_ttl_s`)."""

    component: Component
    xid: int
    occurrences: tuple[Occurrence, ...] = ()
    first_seen: float | None = None
    last_seen: float | None = None
    count: int = 0
    """Lines in the current episode, accumulated across ticks and restarts."""
    first_text: str = ""
    first_cursor: str | None = None
    last_cursor: str | None = None
    pid: int | None = None
    process: str | None = None
    subcode: int | None = None
    severity: str | None = None
    """NVLink5: the worst severity printed in the episode ('Fatal' beats 'Non-fatal')."""
    primary: int | None = None
    """The Xid this one followed on the same GPU within the sympathetic window (Xid 45, 154)."""
    primary_ts: float | None = None
    detail: str | None = None
    """Xid 154: the recovery action the driver announced last."""
    synthesized: bool = False

    @property
    def live_episode(self) -> bool:
        return self.last_seen is not None and self.count > 0


@dataclass(frozen=True)
class PortRecord:
    """An InfiniBand/RoCE port's state over time, for drops and flaps."""

    up: bool | None = None
    """Last observed state; None before the first observation of this boot."""
    state: str | None = None
    """Last observed 'STATE/PhysState', for evidence."""
    down_since: float | None = None
    seen_up: bool = False
    """Seen ACTIVE/LinkUp at least once this boot. A port never up is only reported while the node
    has fewer ports up than `infiniband.expected_ports` (otherwise it is an unused port)."""
    drop_since: float | None = None
    """down_since of the last drop (down longer than drop_after_s)."""
    recovered_at: float | None = None
    """When a dropped port came back; the drop stays reported for sticky_s after this."""
    transitions: tuple[tuple[float, str], ...] = ()
    """(time, 'down' | 'up') state changes seen, for flap counting."""
    updated: float | None = None


@dataclass(frozen=True)
class Latch:
    """A finding that stays reported until `until` after the condition that raised it was last seen
    (counter bursts, flaps): alerts are not lost between ticks or across a restart."""

    finding: Finding
    until: float


@dataclass(frozen=True)
class History:
    boot_id: str | None = None
    time: float | None = None
    """Snapshot time of the tick that produced this history."""
    gpu_ids: Mapping[str, Component] = field(default_factory=dict)
    """Normalised bus id -> the GPU NVML last reported there (maps Xids of a GPU NVML lost since)."""
    series: Mapping[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)
    """Windowed amounts -> ((time, amount, span_s), ...): counter increases and observed seconds."""
    xids: Mapping[str, XidRecord] = field(default_factory=dict)
    """'<bus id>:<xid>' -> record."""
    ports: Mapping[str, PortRecord] = field(default_factory=dict)
    """'mlx5_0/1' -> record."""
    latches: Mapping[str, Latch] = field(default_factory=dict)
    """Finding id -> latched finding."""
    ib_read: float | None = None
    """Read time of the last InfiniBand sample whose counter deltas were counted."""
    nvml_read: float | None = None
    """Read time of the last NVML sample whose counter deltas were counted."""
    reads: Mapping[str, float] = field(default_factory=dict)
    """Source -> read time of its last sample whose counter deltas were counted, for the sources
    `ib_read` and `nvml_read` do not name (TickContext.fresh)."""

    # ------------------------------------------------------------------ bounds

    def capped(self) -> History:
        """The same history cut to the hard size limits (oldest entries go first)."""

        def newest(items: Mapping[str, Any], limit: int, ts: Any) -> dict[str, Any]:
            if len(items) <= limit:
                return dict(items)
            keep = sorted(items.items(), key=lambda kv: ts(kv[1]), reverse=True)[:limit]
            return dict(keep)

        series = {k: _cap_points(v) for k, v in self.series.items()}
        xids = {
            k: dataclasses.replace(r, occurrences=r.occurrences[-MAX_OCCURRENCES:])
            if len(r.occurrences) > MAX_OCCURRENCES
            else r
            for k, r in self.xids.items()
        }
        ports = {
            k: dataclasses.replace(p, transitions=p.transitions[-MAX_TRANSITIONS:])
            if len(p.transitions) > MAX_TRANSITIONS
            else p
            for k, p in self.ports.items()
        }
        return dataclasses.replace(
            self,
            gpu_ids=dict(list(self.gpu_ids.items())[-MAX_GPU_IDS:]),
            series=newest(series, MAX_SERIES_KEYS, lambda s: s[-1][0] if s else -math.inf),
            xids=newest(xids, MAX_XID_KEYS, lambda r: _xid_last(r)),
            ports=newest(ports, MAX_PORT_RECORDS, lambda p: p.updated if p.updated is not None else -math.inf),
            latches=newest(self.latches, MAX_LATCHES, lambda la: la.until),
        )

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "version": HISTORY_VERSION,
            "boot_id": self.boot_id,
            "time": self.time,
            "gpu_ids": {bus: _component_json(c) for bus, c in self.gpu_ids.items()},
            "series": {k: [list(p) for p in pts] for k, pts in self.series.items()},
            "xids": {k: _xid_json(r) for k, r in self.xids.items()},
            "ports": {k: _port_json(p) for k, p in self.ports.items()},
            "latches": {k: {"until": la.until, "finding": finding_to_json(la.finding)} for k, la in self.latches.items()},
            "ib_read": self.ib_read,
            "nvml_read": self.nvml_read,
            "reads": dict(self.reads),
        }

    @classmethod
    def from_json(cls, d: Any) -> History:
        """Rebuild a saved history. `{}` is an empty history; anything malformed is a HistoryError
        naming the part (`history.xids['…'].count: expected an integer, found 'x'`)."""
        if not isinstance(d, dict):
            raise HistoryError(f"history: expected a JSON object, found {_show(d)}")
        if not d:
            return cls()
        version = d.get("version")
        if version != HISTORY_VERSION:
            raise HistoryError(f"history.version: expected {HISTORY_VERSION}, found {_show(version)}")
        r = _Reader()

        def section(name: str, read: Any) -> dict[str, Any]:
            where = f"history.{name}"
            return {r.str_(k, f"{where} key"): read(v, f"{where}[{k!r}]") for k, v in r.obj(d.get(name, {}), where).items()}

        hist = cls(
            boot_id=r.opt_str(d.get("boot_id"), "history.boot_id"),
            time=r.opt_time(d.get("time"), "history.time"),
            gpu_ids=section("gpu_ids", r.component),
            series=section("series", r.points),
            xids=section("xids", r.xid),
            ports=section("ports", r.port),
            latches=section("latches", r.latch),
            ib_read=r.opt_time(d.get("ib_read"), "history.ib_read"),
            nvml_read=r.opt_time(d.get("nvml_read"), "history.nvml_read"),
            reads=section("reads", r.time),
        )
        return hist.capped()


def _xid_last(r: XidRecord) -> float:
    times = [o.last_ts for o in r.occurrences]
    if r.last_seen is not None:
        times.append(r.last_seen)
    return max(times) if times else -math.inf


def _cap_points(points: tuple[tuple[float, float, float], ...]) -> tuple[tuple[float, float, float], ...]:
    """Keep at most MAX_SERIES_POINTS by merging the oldest points pairwise (sums are preserved)."""
    if len(points) <= MAX_SERIES_POINTS:
        return points
    pts = list(points)
    while len(pts) > MAX_SERIES_POINTS:
        (_, a0, s0), (t1, a1, s1) = pts[0], pts[1]
        pts[0:2] = [(t1, a0 + a1, s0 + s1)]
    return tuple(pts)


# --------------------------------------------------------------------------- encoding


def _component_json(c: Component) -> dict[str, Any]:
    return dataclasses.asdict(c)


def finding_to_json(f: Finding) -> dict[str, Any]:
    """A finding as history keeps it (raw epoch times, unlike the RFC 3339 of Finding.to_json)."""
    return {
        "id": f.id,
        "component": _component_json(f.component),
        "source": f.source,
        "attribution": f.attribution,
        "tier": f.tier,
        "action": f.action,
        "summary": f.summary,
        "evidence": [{"kind": e.kind, "text": e.text, "data": dict(e.data)} for e in f.evidence],
        "xid": f.xid,
        "count": f.count,
        "first_seen": f.first_seen,
        "last_seen": f.last_seen,
        "job": f.job,
    }


def _xid_json(r: XidRecord) -> dict[str, Any]:
    d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    d["component"] = _component_json(r.component)
    d["occurrences"] = [[o.first_ts, o.last_ts, o.count, o.gpc, o.tpc] for o in r.occurrences]
    return d


def _port_json(p: PortRecord) -> dict[str, Any]:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    d["transitions"] = [[t, s] for t, s in p.transitions]
    return d


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Reader:
    """Strict decoding with the path of the offending value in every error."""

    def fail(self, path: str, expected: str, value: Any) -> HistoryError:
        return HistoryError(f"{path}: expected {expected}, found {_show(value)}")

    def obj(self, v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(path, "an object", v)
        return v

    def list_(self, v: Any, path: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(path, "a list", v)
        return v

    def str_(self, v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise self.fail(path, "a string", v)
        return v[:MAX_TEXT]

    def opt_str(self, v: Any, path: str) -> str | None:
        return None if v is None else self.str_(v, path)

    def num(self, v: Any, path: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(path, "a finite number", v)
        return float(v)

    def opt_num(self, v: Any, path: str) -> float | None:
        return None if v is None else self.num(v, path)

    def time(self, v: Any, path: str) -> float:
        t = self.num(v, path)
        if not 0.0 <= t <= TS_MAX:
            raise self.fail(path, "epoch seconds between 1970 and 2100", v)
        return t

    def opt_time(self, v: Any, path: str) -> float | None:
        return None if v is None else self.time(v, path)

    def int_(self, v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(path, "an integer", v)
        return v

    def opt_int(self, v: Any, path: str) -> int | None:
        return None if v is None else self.int_(v, path)

    def bool_(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(path, "true or false", v)
        return v

    def each(self, d: dict[str, Any], path: str, read: Callable[[Any, str], Any], *names: str) -> dict[str, Any]:
        """The fields `names` that `d` holds, each read by `read`. One it does not hold is left out,
        so the record's own default applies: a file written before the field existed still loads."""
        return {k: read(d[k], f"{path}.{k}") for k in names if k in d}

    def points(self, v: Any, path: str) -> tuple[tuple[float, float, float], ...]:
        out = []
        for i, p in enumerate(self.list_(v, path)):
            items = self.list_(p, f"{path}[{i}]")
            if len(items) != 3:
                raise self.fail(f"{path}[{i}]", "[time, amount, span_s]", p)
            out.append((self.time(items[0], f"{path}[{i}][0]"), self.num(items[1], f"{path}[{i}][1]"), self.num(items[2], f"{path}[{i}][2]")))
        return tuple(out)  # type: ignore[arg-type]

    def component(self, v: Any, path: str) -> Component:
        d = self.obj(v, path)
        kind = d.get("kind")
        if kind not in _KINDS:
            raise self.fail(path + ".kind", f"one of {', '.join(_KINDS)}", kind)
        return Component(kind=kind, **self.each(d, path, self.opt_int, "index", "port"),
                         **self.each(d, path, self.opt_str, "uuid", "serial", "bus_id", "device"))

    def xid(self, v: Any, path: str) -> XidRecord:
        d = self.obj(v, path)
        occ = []
        for i, o in enumerate(self.list_(d.get("occurrences", []), path + ".occurrences")):
            p = f"{path}.occurrences[{i}]"
            items = self.list_(o, p)
            if len(items) != 5:
                raise self.fail(p, "[first_ts, last_ts, count, gpc, tpc]", o)
            occ.append(
                Occurrence(
                    self.time(items[0], p + "[0]"),
                    self.time(items[1], p + "[1]"),
                    self.int_(items[2], p + "[2]"),
                    self.opt_int(items[3], p + "[3]"),
                    self.opt_int(items[4], p + "[4]"),
                )
            )
        return XidRecord(
            component=self.component(d.get("component"), path + ".component"),
            xid=self.int_(d.get("xid"), path + ".xid"),
            occurrences=tuple(occ),
            **self.each(d, path, self.int_, "count"),
            **self.each(d, path, self.str_, "first_text"),
            **self.each(d, path, self.bool_, "synthesized"),
            **self.each(d, path, self.opt_time, "first_seen", "last_seen", "primary_ts"),
            **self.each(d, path, self.opt_int, "pid", "subcode", "primary"),
            **self.each(d, path, self.opt_str, "first_cursor", "last_cursor", "process", "severity", "detail"),
        )

    def port(self, v: Any, path: str) -> PortRecord:
        d = self.obj(v, path)
        up = d.get("up")
        if up is not None:
            up = self.bool_(up, path + ".up")
        trans = []
        for i, t in enumerate(self.list_(d.get("transitions", []), path + ".transitions")):
            p = f"{path}.transitions[{i}]"
            items = self.list_(t, p)
            if len(items) != 2 or items[1] not in ("down", "up"):
                raise self.fail(p, "[time, 'down' | 'up']", t)
            trans.append((self.time(items[0], p + "[0]"), items[1]))
        return PortRecord(
            up=up,
            transitions=tuple(trans),
            **self.each(d, path, self.opt_str, "state"),
            **self.each(d, path, self.bool_, "seen_up"),
            **self.each(d, path, self.opt_time, "down_since", "drop_since", "recovered_at", "updated"),
        )

    def latch(self, v: Any, path: str) -> Latch:
        d = self.obj(v, path)
        return Latch(finding=self.finding(d.get("finding"), path + ".finding"), until=self.time(d.get("until"), path + ".until"))

    def finding(self, v: Any, path: str) -> Finding:
        d = self.obj(v, path)
        source, attribution, tier, action = d.get("source"), d.get("attribution"), d.get("tier"), d.get("action")
        if source not in _SOURCES:
            raise self.fail(path + ".source", f"one of {', '.join(_SOURCES)}", source)
        if attribution not in ATTRIBUTIONS:
            raise self.fail(path + ".attribution", f"one of {', '.join(ATTRIBUTIONS)}", attribution)
        if isinstance(tier, bool) or tier not in (1, 2, 3):
            raise self.fail(path + ".tier", "1, 2 or 3", tier)
        if action not in ACTIONS:
            raise self.fail(path + ".action", f"one of {', '.join(ACTIONS)}", action)
        evidence = []
        for i, e in enumerate(self.list_(d.get("evidence", []), path + ".evidence")):
            p = f"{path}.evidence[{i}]"
            ed = self.obj(e, p)
            evidence.append(
                Evidence(
                    kind=self.str_(ed.get("kind"), p + ".kind"),
                    text=self.str_(ed.get("text"), p + ".text"),
                    data=self.obj(ed.get("data", {}), p + ".data"),
                )
            )
        return Finding(
            id=self.str_(d.get("id"), path + ".id"),
            component=self.component(d.get("component"), path + ".component"),
            source=source,
            attribution=attribution,
            tier=tier,
            action=action,
            summary=self.str_(d.get("summary"), path + ".summary"),
            evidence=tuple(evidence),
            **self.each(d, path, self.opt_int, "xid"),
            **self.each(d, path, self.int_, "count"),
            **self.each(d, path, self.opt_time, "first_seen", "last_seen"),
            **self.each(d, path, self.opt_str, "job"),
        )
