"""Load and validate the controller's config (/etc/healthd/controller.yaml) into ControllerSettings.

The YAML maps onto the dataclasses below by their type hints through healthd.config's generic mapper,
so an unknown key, a wrong type or a bad value is a ConfigError naming the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


from healthd.config import ConfigError, build, convert, read_config_text, yaml_mapping
from healthd.controller.goodput_jobs import GoodputSettings
from healthd.controller.history import HistorySettings
from healthd.controller.policy import MODES, ControllerPolicySettings
from healthd.controller.reintegrate import ReintegrationSettings
from healthd.controller.spares import SparePool
from healthd.settings import DetectorSettings
from healthd.slurm import BACKENDS
from healthd.controller.verifier import MAX_REPORT_PROCESSES

CONTROLLER_CONFIG_PATH = "/etc/healthd/controller.yaml"
REQUEUE_COMMENT_TAG = "healthd:requeue"


@dataclass(frozen=True)
class ControllerInbandSettings:
    """In-band signals at the controller (healthd.controller.inband), shaped like a node's `inband`
    section so that one `inband.detector` block reads the same in both files."""

    detector: DetectorSettings = field(default_factory=DetectorSettings)
    """The thresholds of healthd.progress: applied here to the jobs that span several nodes (a node's
    agent judges the jobs on it alone with its own), and the hang bound of every job."""


@dataclass(frozen=True)
class ControllerSettings:
    """Everything healthd-controller reads from its config file."""

    listen: str = "127.0.0.1:9841"
    """HOST:PORT the report/request HTTP server binds."""
    max_connections: int = 4096
    """Report/request connections open at once; one more is answered 503 and closed. The unit's
    LimitNOFILE must cover it (the controller warns at start when the open-file limit does not)."""
    max_connections_per_peer: int = 32
    """Connections open at once from one source address (an agent needs one, its prolog another);
    one more from that address is answered 503 and closed, so one address cannot hold the rest out."""
    ledger: str = "/var/lib/healthd/ledger.sqlite"
    """The SQLite ledger (decisions, actions, incidents, breaker)."""
    munge_socket: str | None = None
    """The controller's munged socket; None = libmunge's default socket."""
    slurm_conf: str = "/etc/slurm/slurm.conf"
    """slurm.conf the Slurm client reads."""
    slurm_backend: str = "scontrol"
    """How the controller talks to Slurm: `scontrol` (the Slurm command-line clients, every Slurm
    version) or `pyslurm` (in-process, only when the installed pyslurm is built for this Slurm's
    major.minor; otherwise scontrol all the same). scontrol is the default on every version: pyslurm
    24.11 passes the same contract on a real Slurm 24.11 and reads and writes with less time and CPU,
    but each of its calls holds the controller's interpreter while slurmctld is out of reach (about
    MessageTimeout, 9 s of the default 10), where an scontrol client is killed at the timeout
    (docs/slurm.md, "pyslurm")."""
    fleet_refresh_s: float = 5.0
    """How often a thread of its own re-reads Slurm's node list (only the changed nodes are parsed).
    Control rounds act on the latest read and never wait for one; the node about to be written is
    re-read first all the same. A round is skipped while the latest read failed."""
    report_processes: int = 2
    """Worker processes that check incoming reports (the JSON, the digest, the MUNGE credential and
    every field) so that the intake uses more than one core; the controller's event loop then only
    parses HTTP and stores what they checked. 0: checked in the controller's own process, on its
    report threads (about two thirds of the rate on a 2-core head node)."""
    node_addrs: Mapping[str, str] = field(default_factory=dict)
    """node -> the IPv4 address its munged encodes credentials as. When empty, each node's NodeAddr
    from Slurm is used (read with the fleet view's node list, resolved every 5 minutes)."""
    admin_socket: str = "/run/healthd/controller.sock"
    """Unix socket healthctl talks to."""
    admin_group: str | None = None
    """Group allowed to use the admin socket (None: root only)."""
    topology_conf: str | None = None
    """Slurm topology.conf for correlation groups (None: no switch groups)."""
    requeue_opt_in: str = REQUEUE_COMMENT_TAG
    """How a job opts in to being requeued by a `drain-and-requeue`: a batch job whose `--comment`
    contains this text (default `healthd:requeue`) is requeued; every other job on the node is left to
    finish (the drain still stops new jobs). An empty string disables requeue entirely."""
    policy: ControllerPolicySettings = field(default_factory=ControllerPolicySettings)
    """Mode, rate limits, breaker, correlation and capacity floors (see ControllerPolicySettings)."""
    metrics_listen: str | None = None
    """HOST:PORT for the Prometheus endpoint; None: no metrics endpoint."""
    reintegration: ReintegrationSettings = field(default_factory=ReintegrationSettings)
    """Validation in a maintenance reservation, probation and escalation (see ReintegrationSettings)."""
    inband: ControllerInbandSettings = field(default_factory=ControllerInbandSettings)
    """The job-wide comparison of training jobs' in-band progress (see ControllerInbandSettings)."""
    goodput: GoodputSettings = field(default_factory=GoodputSettings)
    """The jobs' goodput logs gathered from the agents, their accounting and the goodput SLO (see
    GoodputSettings)."""
    history: HistorySettings = field(default_factory=HistorySettings)
    """The rounds' inputs kept for replay (see HistorySettings)."""


# ControllerPolicySettings uses types the generic mapper does not know (Literal, frozenset values):
# map them through these equivalents, then let the dataclass's own __post_init__ check values.
_POLICY_TYPE_OVERRIDES: dict[str, Any] = {
    "mode": str,
    "racks": Mapping[str, tuple[str, ...]],
    "pdus": Mapping[str, tuple[str, ...]],
}


def _build_pool(raw: Any, file: str, key: str) -> SparePool:
    try:
        return build(SparePool, raw, file, key)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(file, key, "a valid spare pool", f"<{exc}>") from None


def _build_policy(raw: Any, file: str, prefix: str) -> ControllerPolicySettings:
    if raw is None:
        return ControllerPolicySettings()
    if not isinstance(raw, dict):
        raise ConfigError(file, prefix, "a mapping for ControllerPolicySettings", raw)
    raw = dict(raw)
    if raw.get("mode") is False:
        raw["mode"] = "off"  # YAML 1.1 reads a bare `off` as false; reported below as a bad mode
    names = [f.name for f in dataclasses.fields(ControllerPolicySettings)]
    unknown = sorted(str(k) for k in raw if k not in names)
    if unknown:
        raise ConfigError(file, f"{prefix}.{unknown[0]}", f"one of the known keys ({', '.join(names)})",
                          f"<unknown key {unknown[0]!r}>")
    hints = typing.get_type_hints(ControllerPolicySettings)
    values: dict[str, Any] = {}
    for name, value in raw.items():
        tp = _POLICY_TYPE_OVERRIDES.get(name, hints[name])
        if name == "spares" and isinstance(value, dict):  # each pool's own check names its partition
            values[name] = {p: _build_pool(v, file, f"{prefix}.spares.{p}") for p, v in value.items()}
            continue
        values[name] = convert(tp, value, file, f"{prefix}.{name}")
    if "mode" in values and values["mode"] not in MODES:
        raise ConfigError(file, f"{prefix}.mode", f"one of {', '.join(MODES)}", values["mode"])
    for name in ("racks", "pdus"):
        if name in values:
            values[name] = {k: frozenset(v) for k, v in values[name].items()}
    try:
        return ControllerPolicySettings(**values)
    except ValueError as exc:
        raise ConfigError(file, prefix, "valid policy values", f"<{exc}>") from None


def _check_hostport(file: str, key: str, value: str | None) -> None:
    if value is None:
        return
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(file, key, "HOST:PORT such as 127.0.0.1:9841", value)


_DETECTOR_COUNTS = ("window_steps", "consecutive", "min_ranks_spread", "rank_order_consecutive", "history_windows")
_DETECTOR_AMOUNTS = ("min_effect", "mad_k", "hang_factor", "hang_min_s", "phase_factor")


def _check_detector(file: str, d: DetectorSettings) -> None:
    for key in _DETECTOR_COUNTS:
        if getattr(d, key) < 1:
            raise ConfigError(file, f"inband.detector.{key}", "a positive integer", getattr(d, key))
    for key in _DETECTOR_AMOUNTS:
        if not 0 <= getattr(d, key) < float("inf"):
            raise ConfigError(file, f"inband.detector.{key}", "a non-negative number", getattr(d, key))
    if not 0 < d.rank_order_p <= 1:
        raise ConfigError(file, "inband.detector.rank_order_p", "a probability in (0, 1]", d.rank_order_p)


def _check_goodput(file: str, g: GoodputSettings) -> None:
    if g.directory is not None and not g.directory.startswith("/"):
        raise ConfigError(file, "goodput.directory", "an absolute path or null (beside the ledger)", g.directory)
    for key, value in (("goodput.objective", g.objective), *((f"goodput.objectives.{p}", v) for p, v in g.objectives.items())):
        if not 0 < value < 1:
            raise ConfigError(file, key, "a share between 0 and 1 (0.9: 90% of the GPU time productive)", value)
    for key in ("interval_s", "keep_days", "ettr_window_s"):
        if not 0 < getattr(g, key) < float("inf"):
            raise ConfigError(file, f"goodput.{key}", "a positive number", getattr(g, key))
    if not 0 <= g.settle_s < float("inf"):
        raise ConfigError(file, "goodput.settle_s", "a non-negative number of seconds", g.settle_s)
    if g.max_log_bytes < 65536:
        raise ConfigError(file, "goodput.max_log_bytes", "at least 65536", g.max_log_bytes)


def parse_controller_settings(text: str, file: str = "<controller config>") -> ControllerSettings:
    raw = yaml_mapping(text, file)
    policy_raw = raw.pop("policy", None)
    policy = _build_policy(policy_raw, file, "policy")
    reintegration_raw = raw.pop("reintegration", None)
    try:
        reintegration = (ReintegrationSettings() if reintegration_raw is None
                         else build(ReintegrationSettings, reintegration_raw, file, "reintegration"))
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(file, "reintegration", "valid reintegration values", f"<{exc}>") from None
    settings = build(ControllerSettings, raw, file, "")
    settings = dataclasses.replace(settings, policy=policy, reintegration=reintegration)
    _check_hostport(file, "listen", settings.listen)
    for key in ("max_connections", "max_connections_per_peer"):
        if getattr(settings, key) < 1:
            raise ConfigError(file, key, "a positive number of connections", getattr(settings, key))
    if settings.max_connections_per_peer > settings.max_connections:
        raise ConfigError(file, "max_connections_per_peer", f"at most max_connections ({settings.max_connections})",
                          settings.max_connections_per_peer)
    _check_hostport(file, "metrics_listen", settings.metrics_listen)
    _check_detector(file, settings.inband.detector)
    _check_goodput(file, settings.goodput)
    for key in ("keep_days", "flush_s"):
        if not 0 < getattr(settings.history, key) < float("inf"):
            raise ConfigError(file, f"history.{key}", "a positive number", getattr(settings.history, key))
    if settings.history.path is not None and not settings.history.path.startswith("/"):
        raise ConfigError(file, "history.path", "an absolute path or null (beside the ledger)", settings.history.path)
    if not 0 <= settings.report_processes <= MAX_REPORT_PROCESSES:
        raise ConfigError(file, "report_processes", f"0 (in-process) to {MAX_REPORT_PROCESSES}", settings.report_processes)
    if not 0.5 <= settings.fleet_refresh_s <= 300:
        raise ConfigError(file, "fleet_refresh_s", "between 0.5 and 300 seconds", settings.fleet_refresh_s)
    if settings.slurm_backend not in BACKENDS:
        raise ConfigError(file, "slurm_backend", f"one of {', '.join(BACKENDS)}", settings.slurm_backend)
    for key in ("ledger", "slurm_conf", "admin_socket"):
        if not getattr(settings, key).startswith("/"):
            raise ConfigError(file, key, "an absolute path", getattr(settings, key))
    for key in ("munge_socket", "topology_conf"):
        value = getattr(settings, key)
        if value is not None and not value.startswith("/"):
            raise ConfigError(file, key, "an absolute path or null", value)
    for node, addr in settings.node_addrs.items():
        parts = addr.split(".")
        if len(parts) != 4 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ConfigError(file, f"node_addrs.{node}", "an IPv4 address such as 10.0.0.12", addr)
    return settings


def load_controller_settings(path: str | None = None) -> ControllerSettings:
    """Read and validate the controller config; a named file must exist, the default may be absent."""
    file = path or CONTROLLER_CONFIG_PATH
    text = read_config_text(file, must_exist=path is not None)
    if text is None:
        return ControllerSettings()
    return parse_controller_settings(text, file)
