"""Scenario files for healthd-sim: YAML in, frozen dataclasses out.

A scenario says what the simulated fleet is (node groups and their MTBF, leaf and PDU sizes, repair),
what the job is (nodes, GPUs, checkpoints, restart), what fails and how it shows (causes, each with its
share, detection time, whether the node goes to repair, and the agent input the fault produces),
which correlated bursts happen, and how healthd is set up (none: the lab's rule; observe, supervised
or auto: the real controller). docs/sim.md documents every field.

A file may name a `base` scenario (a packaged name or a path next to it) and change only some fields:
`job`, `fleet`, `healthd` and each cause of `node_causes`/`job_causes`/`bursts` are merged key by key,
everything else replaced. Bad input raises ScenarioError with the file and the field, never another
exception.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from healthd.config import set_dotted
from healthd.goodput import daly_interval, young_interval
from healthd.model import GpuSample

ATTRIBUTIONS = ("hardware", "fabric", "storage", "software", "user", "unknown")
MODES = ("none", "observe", "supervised", "auto")
BURST_KINDS = ("leaf", "pdu", "driver")
REPAIR_LAWS = ("exponential", "fixed")
INPUT_KINDS = ("xid", "nvml", "ib_port_down", "host_down", "hang", "straggler", "none")
MAX_NODES = 100_000
MAX_DAYS = 3_650


class ScenarioError(ValueError):
    """A scenario file that cannot be used, saying where and why."""


@dataclass(frozen=True)
class AgentInputSpec:
    """What a fault looks like to the node's agent."""

    kind: str = "none"
    """One of INPUT_KINDS: `xid` (an NVRM Xid kernel line), `nvml` (a GPU reading), `ib_port_down`
    (an InfiniBand port reading), `host_down` (the node stops answering), `hang` (the job's in-band
    ring stops advancing), `straggler` (one rank's compute slows), `none` (nothing on the node)."""
    xid: int | None = None
    """For `xid`: the Xid number written in the kernel line."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific extras (an NVML field and its value, a port name), passed through as given."""


@dataclass(frozen=True)
class Cause:
    """One way the job is interrupted."""

    name: str
    """Its name: the `cause` of the interruption in the event log, and the key of its cost."""
    share: float
    """Share of the interruptions of its kind (node causes sum to 1, job causes sum to 1)."""
    detect_minutes: tuple[float, float]
    """Fault -> job known to be dead, in minutes: (lo, hi), drawn uniformly; lo == hi is fixed."""
    repair: bool
    """The node leaves the job and goes to repair (the lab's `node_down`)."""
    attribution: str = "unknown"
    """hardware, fabric, storage, software, user or unknown: what really failed."""
    repair_hours: float | None = None
    """Mean repair time of this cause; None: the fleet's `repair_hours`."""
    repair_law: str | None = None
    """exponential or fixed; None: the fleet's."""
    input: AgentInputSpec = field(default_factory=AgentInputSpec)
    """The agent input the fault produces on its node when it becomes detectable."""
    description: str = ""


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one kind, named in order after the groups before them."""

    count: int
    """How many nodes."""
    mtbf_hours: float
    """Mean running hours between node-attributable interruptions, per node."""
    label: str = "default"
    pool: bool = True
    """False: the nodes are in the fleet (another partition) but never run this job nor serve as its
    spares."""


@dataclass(frozen=True)
class Burst:
    """A correlated event hitting several nodes at once."""

    name: str
    kind: str
    """leaf (every node behind one leaf switch), pdu (every node on one PDU) or driver (a bad rollout:
    `size` nodes at once)."""
    mtbf_hours: float
    """Mean running hours of the job between two such bursts."""
    cause: str
    """The node cause (a key of node_causes) each hit node suffers."""
    size: int | None = None
    """For driver: how many nodes the rollout reaches (leaf and pdu take the fleet's sizes)."""
    outage_hours: float | None = None
    """The shared part (the switch, the PDU, the driver) is out this long: its nodes fail the job
    whenever it runs on them until then, and work again after without a repair. None: the cause's own
    behaviour (a `repair` cause breaks each node)."""


@dataclass(frozen=True)
class Job:
    """The synchronous training job."""

    name: str = "llm-pretrain"
    """The job name written on every line of its event log."""
    nodes: int = 128
    """Nodes the job runs on; the rest of the fleet are spares."""
    gpus_per_node: int = 8
    checkpoint_minutes: float = 5.0
    """Blocking part of a save (C): training stops for it."""
    checkpoint_interval_minutes: float | str = 30.0
    """Compute time between saves: minutes, or `young`/`daly` for the interval from the scenario's
    nominal MTBI and C."""
    durable_after_minutes: float = 0.0
    """From the end of the blocking part to the save being durable (an asynchronous save's background
    write); 0: durable when the blocking part ends."""
    restart_minutes: float = 20.0
    """Nodes ready -> first step: reschedule, load the checkpoint, warm up."""
    step_seconds: float = 10.0
    """One training step, for the step numbers in the log (marks are written per compute segment)."""
    hold_while_waiting: bool = True
    """The job keeps its allocation while it waits for replacement nodes (held, `waiting`); false: it
    is requeued and the wait is queued time, outside held."""


@dataclass(frozen=True)
class Fleet:
    """The nodes the job can run on."""

    groups: tuple[NodeGroup, ...]
    leaf_size: int = 16
    """Nodes per leaf switch, in node order."""
    pdu_size: int = 8
    """Nodes per PDU, in node order."""
    repair_hours: float = 48.0
    """Mean repair time of a node sent to repair."""
    repair_law: str = "exponential"
    other_work_hours: float | None = None
    """None: the job's spares wait idle for it (the lab's model). A number: the pool's nodes outside
    the job run other users' jobs of this mean length (exponential), one after another; a node the job
    needs comes free when the job on it ends, unless healthd holds it as a hot spare
    (`policy.spares`)."""

    @property
    def size(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def pool_size(self) -> int:
        """Nodes that may run the job (its nodes and its spares)."""
        return sum(g.count for g in self.groups if g.pool)


@dataclass(frozen=True)
class Healthd:
    """How healthd runs in the scenario."""

    mode: str = "none"
    """none: no controller, the lab's rule (a cause with `repair` takes its node out at detection);
    observe, supervised, auto: the real controller in that mode, through the controller seam."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Controller settings overrides (breaker, rate limit, capacity floor, ...), as in its config file."""
    operator_minutes: float | None = 240.0
    """A node a fault broke that nobody took out (healthd in observe mode, or a fault healthd cannot
    see) fails the job each time it runs; this long after the fault a person drains it, at the job's
    next detection. None: nobody does."""
    catalog: Mapping[str, Any] = field(default_factory=dict)
    """The agents' `catalog:` section as in healthd.yaml (`overrides`: Xid -> a site's change to its
    catalog row), checked by the agent's config reader and catalog loader when the scenario is loaded;
    empty: the packaged catalog."""
    approve_minutes: float | None = None
    """A person approves each decision that waits for approval this long after the ledger recorded
    it (healthctl approve's own handler, on the run's ledger), and records the repair of a node
    healthd holds when it comes back (healthctl repaired's). None: nobody approves."""


@dataclass(frozen=True)
class Scenario:
    """One simulated fleet, job and failure model."""

    name: str
    description: str
    days: float
    """Length of each run (the job's wall time)."""
    job: Job
    fleet: Fleet
    job_mtbi_hours: float
    """Mean running hours between interruptions not tied to a node (software, storage)."""
    node_causes: tuple[Cause, ...]
    job_causes: tuple[Cause, ...]
    bursts: tuple[Burst, ...] = ()
    healthd: Healthd = field(default_factory=Healthd)

    @property
    def spares(self) -> int:
        return self.fleet.pool_size - self.job.nodes

    def nominal_mtbi_hours(self) -> float:
        """The job's expected MTBI on nodes drawn evenly from the fleet (bursts left out)."""
        per_node = sum(g.count / g.mtbf_hours for g in self.fleet.groups if g.pool) / self.fleet.pool_size
        return 1 / (self.job.nodes * per_node + 1 / self.job_mtbi_hours)

    def interval_seconds(self) -> float:
        """Compute time between saves, in seconds."""
        v = self.job.checkpoint_interval_minutes
        c, m = self.job.checkpoint_minutes * 60, self.nominal_mtbi_hours() * 3600
        if v == "daly":
            return daly_interval(c, m)
        if v == "young":
            return young_interval(c, m)
        return float(v) * 60

    def cause(self, name: str) -> Cause:
        for c in (*self.node_causes, *self.job_causes):
            if c.name == name:
                return c
        raise KeyError(name)


# --------------------------------------------------------------------------- loading


def packaged() -> dict[str, str]:
    """Name -> YAML text of the scenarios shipped with healthd."""
    out = {}
    for f in (resources.files("healthd.sim") / "scenarios").iterdir():
        if f.name.endswith(".yaml"):
            out[f.name[:-5]] = f.read_text()
    return out


def _source(ref: str | Path) -> tuple[str, str, Path | None]:
    """(YAML text, where, the folder a relative base is looked up in) of a path or a packaged name."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            return path.read_text(), str(ref), path.parent
        except (OSError, UnicodeDecodeError) as e:
            raise ScenarioError(f"{ref}: cannot read: {e}") from None
    shipped = packaged()
    if str(ref) in shipped:
        return shipped[str(ref)], str(ref), None
    raise ScenarioError(f"{ref}: no such file, and no packaged scenario of that name (packaged: {', '.join(sorted(shipped))})")


def load(ref: str | Path) -> Scenario:
    """A scenario from a file path, or a packaged scenario's name."""
    return load_text(*_source(ref))


def load_with(ref: str | Path, sets: Mapping[str, Any]) -> Scenario:
    """`ref` with fields changed: each key a dotted path into the scenario (`fleet.other_work_hours`,
    `healthd.settings.policy.spares.gpu.size`), set after `base` is merged, then checked as a file is."""
    text, where, here = _source(ref)
    raw = _raw(text, where, here, ())
    for key, value in sets.items():
        try:
            set_dotted(raw, key, value)
        except ValueError as e:
            raise ScenarioError(f"{where}: --set {key}: {e}") from None
    return _build(raw, where)


def load_text(text: str, where: str = "<scenario>", here: Path | None = None) -> Scenario:
    """A scenario from YAML text; `here` is where a relative `base` path is looked up."""
    raw = _raw(text, where, here, ())
    return _build(raw, where)


def _raw(text: str, where: str, here: Path | None, seen: tuple[str, ...]) -> dict[str, Any]:
    if where in seen:
        raise ScenarioError(f"{where}: base loop ({' -> '.join((*seen, where))})")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ScenarioError(f"{where}: not YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise ScenarioError(f"{where}: not YAML: {e!r}"[:300]) from None
    if not isinstance(doc, dict):
        raise ScenarioError(f"{where}: a scenario is a mapping, got {type(doc).__name__}")
    base = doc.pop("base", None)
    if base is None:
        return doc
    if not isinstance(base, str) or not base:
        raise ScenarioError(f"{where}: base: a scenario name or path")
    shipped = packaged()
    path = (here / base) if here is not None and not Path(base).is_absolute() else Path(base)
    if path.suffix in (".yaml", ".yml") and path.exists():
        try:
            btext = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ScenarioError(f"{where}: base {base}: cannot read: {e}") from None
        parent = _raw(btext, str(path), path.parent, (*seen, where))
    elif base in shipped:
        parent = _raw(shipped[base], base, None, (*seen, where))
    else:
        raise ScenarioError(f"{where}: base {base!r}: no such file or packaged scenario")
    return _merge(parent, doc)


_MERGED = ("job", "fleet", "healthd")
_MERGED_BY_NAME = ("node_causes", "job_causes", "bursts")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if k in _MERGED and isinstance(v, dict) and isinstance(base.get(k), dict):
            out[k] = {**base[k], **v}
        elif k in _MERGED_BY_NAME and isinstance(v, dict) and isinstance(base.get(k), dict):
            merged = dict(base[k])
            for name, spec in v.items():
                if spec is None:  # `name: null` removes an inherited cause
                    merged.pop(name, None)
                elif isinstance(spec, dict) and isinstance(merged.get(name), dict):
                    merged[name] = {**merged[name], **spec}
                else:
                    merged[name] = spec
            out[k] = merged
        else:
            out[k] = v
    return out


class _Fields:
    """Reads one mapping's fields, naming the path of any bad one."""

    def __init__(self, doc: Any, where: str, allowed: tuple[str, ...]):
        if not isinstance(doc, dict):
            raise ScenarioError(f"{where}: a mapping, got {type(doc).__name__}")
        unknown = [str(k) for k in doc if k not in allowed]
        if unknown:
            raise ScenarioError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} (known: {', '.join(allowed)})")
        self.doc, self.where = doc, where

    def num_(self, key: str, default: float | None = None, *, lo: float = 0.0, lo_open: bool = True,
            hi: float = math.inf) -> float:
        v = self.doc.get(key, default)
        if v is None:
            raise ScenarioError(f"{self.where}.{key}: required")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ScenarioError(f"{self.where}.{key}: a number, got {v!r}"[:200])
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise ScenarioError(f"{self.where}.{key}: {v} out of range ({'>' if lo_open else '>='} {lo}, <= {hi})")
        return float(v)

    def int_(self, key: str, default: int | None = None, *, lo: int = 1, hi: int = MAX_NODES) -> int:
        v = self.doc.get(key, default)
        if v is None:
            raise ScenarioError(f"{self.where}.{key}: required")
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ScenarioError(f"{self.where}.{key}: a whole number from {lo} to {hi}, got {v!r}"[:200])
        return v

    def str_(self, key: str, default: str | None = None, *, choices: tuple[str, ...] | None = None) -> str:
        v = self.doc.get(key, default)
        if v is None:
            raise ScenarioError(f"{self.where}.{key}: required")
        if not isinstance(v, str):
            raise ScenarioError(f"{self.where}.{key}: a string, got {type(v).__name__}")
        if choices is not None and v not in choices:
            raise ScenarioError(f"{self.where}.{key}: {v!r} is not one of {', '.join(choices)}"[:300])
        return v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.doc.get(key, default)
        if not isinstance(v, bool):
            raise ScenarioError(f"{self.where}.{key}: true or false, got {v!r}"[:200])
        return v

    def mapping_(self, key: str) -> dict[str, Any]:
        v = self.doc.get(key, {})
        if v is None:
            return {}
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise ScenarioError(f"{self.where}.{key}: a mapping with string keys")
        return v


def _build(raw: dict[str, Any], where: str) -> Scenario:
    top = _Fields(raw, where, ("name", "description", "days", "job", "fleet", "job_mtbi_hours", "node_causes",
                               "job_causes", "bursts", "healthd"))
    job = _job(_Fields(top.mapping_("job"), f"{where}: job", tuple(Job.__dataclass_fields__)))
    fleet = _fleet(top.doc.get("fleet"), f"{where}: fleet")
    if fleet.pool_size < job.nodes:
        raise ScenarioError(f"{where}: fleet has {fleet.pool_size} nodes in the job's pool, the job needs {job.nodes}")
    node_causes = _causes(top.mapping_("node_causes"), f"{where}: node_causes")
    job_causes = _causes(top.mapping_("job_causes"), f"{where}: job_causes")
    if not node_causes:
        raise ScenarioError(f"{where}: node_causes: at least one cause")
    names = [c.name for c in (*node_causes, *job_causes)]
    if len(set(names)) < len(names):
        raise ScenarioError(f"{where}: a cause name is in both node_causes and job_causes")
    bursts = tuple(_burst(name, spec, f"{where}: bursts.{name}", {c.name for c in node_causes}, fleet)
                   for name, spec in top.mapping_("bursts").items())
    h = _Fields(top.mapping_("healthd"), f"{where}: healthd", ("mode", "settings", "operator_minutes", "catalog",
                                                                "approve_minutes"))
    settings = h.mapping_("settings")
    if settings:
        _check_controller_settings(settings, f"{where}: healthd.settings")
    catalog = h.mapping_("catalog")
    if catalog:
        _check_catalog(catalog, f"{where}: healthd.catalog")
    operator = h.doc.get("operator_minutes", 240.0)
    approve = h.doc.get("approve_minutes")
    healthd = Healthd(h.str_("mode", "none", choices=MODES), settings,
                      None if operator is None else h.num_("operator_minutes", 240.0, hi=1e6), catalog,
                      None if approve is None else h.num_("approve_minutes", lo_open=False, hi=1e6))
    s = Scenario(
        name=top.str_("name"), description=top.str_("description", ""),
        days=top.num_("days", 28.0, hi=MAX_DAYS), job=job, fleet=fleet,
        job_mtbi_hours=top.num_("job_mtbi_hours", math.inf, hi=math.inf) if top.doc.get("job_mtbi_hours") is not None
        else math.inf,
        node_causes=node_causes, job_causes=job_causes, bursts=bursts, healthd=healthd)
    if job_causes and not math.isfinite(s.job_mtbi_hours):
        raise ScenarioError(f"{where}: job_causes need job_mtbi_hours")
    return s


def _check_controller_settings(settings: dict[str, Any], where: str) -> None:
    """The overrides as the controller's own config reader takes them (its errors, as ScenarioError)."""
    from healthd.controller.config import parse_controller_settings  # here: only a scenario with overrides needs it

    try:
        parse_controller_settings(yaml.safe_dump(settings), where)
    except (ValueError, TypeError, yaml.YAMLError) as e:
        raise ScenarioError(f"{where}: {e}"[:500]) from None


def _check_catalog(section: dict[str, Any], where: str) -> None:
    """The agents' catalog section as the agent reads it (its config reader's and catalog loader's
    errors, as ScenarioError)."""
    from healthd.config import ConfigError  # here: only a scenario with a catalog section needs the agent
    from healthd.sim.agentinput import catalog_of

    if "path" in section:
        raise ScenarioError(f"{where}.path: the simulated agents read the packaged catalog; change rows with `overrides`")
    try:
        catalog_of(section)
    except ConfigError as e:
        key = e.key.removeprefix("catalog.") if e.key.startswith("catalog.") else e.key
        found = e.found if isinstance(e.found, str) and e.found.startswith("<") else repr(e.found)
        raise ScenarioError(f"{where}.{key}: expected {e.expected}, found {found}"[:500]) from None
    except (ValueError, TypeError, yaml.YAMLError) as e:
        raise ScenarioError(f"{where}: {e}"[:500]) from None


def _job(f: _Fields) -> Job:
    interval = f.doc.get("checkpoint_interval_minutes", 30.0)
    if isinstance(interval, str):
        if interval not in ("young", "daly"):
            raise ScenarioError(f"{f.where}.checkpoint_interval_minutes: minutes, `young` or `daly`, got {interval!r}"[:200])
    else:
        interval = f.num_("checkpoint_interval_minutes", hi=1e6)
    return Job(name=f.str_("name", "llm-pretrain"), nodes=f.int_("nodes", 128), gpus_per_node=f.int_("gpus_per_node", 8, hi=64),
               checkpoint_minutes=f.num_("checkpoint_minutes", 5.0, hi=1e5), checkpoint_interval_minutes=interval,
               durable_after_minutes=f.num_("durable_after_minutes", 0.0, lo_open=False, hi=1e5),
               restart_minutes=f.num_("restart_minutes", 20.0, lo_open=False, hi=1e5),
               step_seconds=f.num_("step_seconds", 10.0, hi=1e5), hold_while_waiting=f.bool_("hold_while_waiting", True))


def _fleet(doc: Any, where: str) -> Fleet:
    f = _Fields(doc if doc is not None else {}, where, ("groups", "leaf_size", "pdu_size", "repair_hours", "repair_law",
                                                          "other_work_hours"))
    groups_raw = f.doc.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ScenarioError(f"{where}.groups: a list of node groups ({{count, mtbf_hours, label}})")
    groups = []
    for i, g in enumerate(groups_raw):
        gf = _Fields(g, f"{where}.groups[{i}]", ("count", "mtbf_hours", "label", "pool"))
        groups.append(NodeGroup(gf.int_("count"), gf.num_("mtbf_hours", hi=1e9), gf.str_("label", "default"),
                                gf.bool_("pool", True)))
    fleet = Fleet(tuple(groups), f.int_("leaf_size", 16), f.int_("pdu_size", 8), f.num_("repair_hours", 48.0, hi=1e6),
                  f.str_("repair_law", "exponential", choices=REPAIR_LAWS),
                  f.num_("other_work_hours", hi=1e6) if f.doc.get("other_work_hours") is not None else None)
    if fleet.size > MAX_NODES:
        raise ScenarioError(f"{where}: {fleet.size} nodes, more than {MAX_NODES}")
    return fleet


def _causes(doc: dict[str, Any], where: str) -> tuple[Cause, ...]:
    out = []
    for name, spec in doc.items():
        cw = f"{where}.{name}"
        f = _Fields(spec, cw, ("share", "detect_minutes", "repair", "attribution", "repair_hours", "repair_law", "input",
                               "description"))
        d = f.doc.get("detect_minutes")
        if isinstance(d, list) and len(d) == 2:
            lo = _Fields({"lo": d[0], "hi": d[1]}, f"{cw}.detect_minutes", ("lo", "hi"))
            detect = (lo.num_("lo", lo_open=False, hi=1e5), lo.num_("hi", lo_open=False, hi=1e5))
            if detect[1] < detect[0]:
                raise ScenarioError(f"{cw}.detect_minutes: [lo, hi] with lo <= hi")
        else:
            v = f.num_("detect_minutes", lo_open=False, hi=1e5)
            detect = (v, v)
        out.append(Cause(
            name=name, share=f.num_("share", lo_open=False, hi=1.0), detect_minutes=detect, repair=f.bool_("repair", False),
            attribution=f.str_("attribution", "unknown", choices=ATTRIBUTIONS),
            repair_hours=f.num_("repair_hours", hi=1e6) if f.doc.get("repair_hours") is not None else None,
            repair_law=f.str_("repair_law", choices=REPAIR_LAWS) if f.doc.get("repair_law") is not None else None,
            input=_input(f.doc.get("input"), f"{cw}.input"), description=f.str_("description", "")))
    if out and abs(sum(c.share for c in out) - 1) > 1e-6:
        raise ScenarioError(f"{where}: the shares add up to {sum(c.share for c in out):.6g}, not 1")
    return tuple(out)


def _input(doc: Any, where: str) -> AgentInputSpec:
    if doc is None:
        return AgentInputSpec()
    f = _Fields(doc, where, ("kind", "xid", "fields"))
    kind = f.str_("kind", choices=INPUT_KINDS)
    xid = f.int_("xid", lo=1, hi=99999) if kind == "xid" or f.doc.get("xid") is not None else None
    fields = f.mapping_("fields")
    if kind == "straggler":
        # the slow rank's compute factor, and the NVML fields its GPU shows besides (a clock throttle)
        g = _Fields(fields, f"{where}.fields", ("slowdown", "nvml"))
        g.num_("slowdown", lo=1.0, lo_open=False, hi=10.0)
        unknown = sorted(set(g.mapping_("nvml")) - set(GpuSample.__dataclass_fields__) - {"index"})
        if unknown or "index" in g.mapping_("nvml"):
            raise ScenarioError(f"{where}.fields.nvml: not a GPU reading's field: {', '.join(unknown) or 'index'}"[:300])
    return AgentInputSpec(kind, xid, fields)


def _burst(name: str, spec: Any, where: str, causes: set[str], fleet: Fleet) -> Burst:
    f = _Fields(spec, where, ("kind", "mtbf_hours", "cause", "size", "outage_hours"))
    kind = f.str_("kind", choices=BURST_KINDS)
    cause = f.str_("cause")
    if cause not in causes:
        raise ScenarioError(f"{where}.cause: {cause!r} is not a node cause")
    size = f.int_("size", lo=1, hi=fleet.size) if f.doc.get("size") is not None else None
    if kind == "driver" and size is None:
        raise ScenarioError(f"{where}.size: required for a driver burst")
    outage = f.num_("outage_hours", hi=1e6) if f.doc.get("outage_hours") is not None else None
    return Burst(name, kind, f.num_("mtbf_hours", hi=1e9), cause, size, outage)
