"""Load and validate /etc/healthd/healthd.yaml into healthd.settings.Settings.

The YAML is mapped onto the settings dataclasses by their type hints, so the dataclasses are the
one schema: a key the dataclasses do not have is an error, and every error names the file, the
dotted key, what was expected and what was found.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from healthd.settings import Settings

NODE_CONFIG_PATH = "/etc/healthd/healthd.yaml"
LOG_LEVELS = ("debug", "info", "warning", "error")
START_AT = ("boot", "tail", "head")
GATING = ("off", "local", "controller")


class ConfigError(ValueError):
    """A config problem a person can fix: where, what was expected, what was found."""

    def __init__(self, file: str, key: str, expected: str, found: Any):
        self.file, self.key, self.expected, self.found = file, key, expected, found
        shown = found if isinstance(found, str) and found.startswith("<") else repr(found)
        super().__init__(f"{file}: {key or '(top level)'}: expected {expected}, found {shown}")


def default_node_name() -> str:
    return os.uname().nodename.split(".")[0]  # gethostname(2), without importing socket (hooks start fast)


def read_config_text(file: str, *, must_exist: bool) -> str | None:
    """The file's text; None when it is absent and may be (then every default applies)."""
    try:
        return Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(file, "", "a readable YAML file", "<no such file>") from None
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(file, "", "a readable UTF-8 YAML file", f"<{e}>") from None


def yaml_mapping(text: str, file: str) -> dict[str, Any]:
    """YAML text -> a top-level mapping (empty text is an empty mapping), or a ConfigError naming the
    line of a syntax error."""
    try:
        # libyaml's loader when present: several times faster, and the hooks parse this file on every run
        raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark else "somewhere"
        raise ConfigError(file, "", "valid YAML", f"<a syntax error at {where}: {getattr(e, 'problem', e)}>") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(file, "", "a mapping of keys", raw)
    return dict(raw)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key`, a dotted path of field names (`policy.spares.gpu.size`), to `value` in the nested
    mapping `raw`, making the mappings on the way that are absent or empty (null). ValueError naming
    the part of the path that is not a mapping, or for an empty field name."""
    parts = key.split(".")
    if not all(parts):
        raise ValueError(f"{key!r}: a dotted path of field names")
    here = raw
    for i, part in enumerate(parts[:-1]):
        nxt = here.get(part)
        if nxt is None:
            nxt = here[part] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"{'.'.join(parts[:i + 1])} is not a mapping")
        here = nxt
    here[parts[-1]] = value


def load(path: str | None = None, *, required: bool | None = None) -> Settings:
    """Read and validate a config file. With path=None the default path is used and may be absent
    (then every default applies); an explicitly named file must exist."""
    file = path or NODE_CONFIG_PATH
    text = read_config_text(file, must_exist=required if required is not None else path is not None)
    if text is None:
        return Settings(node_name=default_node_name())
    return parse(text, file)


def parse(text: str, file: str = "<config>") -> Settings:
    raw = yaml_mapping(text, file)
    raw.setdefault("node_name", default_node_name())
    if isinstance(raw.get("hooks"), dict) and raw["hooks"].get("gating") is False:
        raw["hooks"] = {**raw["hooks"], "gating": "off"}  # YAML 1.1 reads a bare `off` as false
    settings = build(Settings, raw, file, "")
    _check(settings, file)
    return settings


# --------------------------------------------------------------------------- the generic mapper


def build(cls: type, raw: Any, file: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(file, prefix, f"a mapping for {cls.__name__}", raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(file, key, f"one of the known keys ({', '.join(fields)})", f"<unknown key {unknown[0]!r}>")
    values = {}
    for name, value in raw.items():
        values[name] = convert(hints[name], value, file, f"{prefix}.{name}" if prefix else name)
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(file, f"{prefix}.{missing[0]}" if prefix else missing[0], "a value", "<missing>")
    section = cls(**values)
    # A section may say what its types cannot (a range, an absolute path): a new section needs no check here.
    check = getattr(section, "problems", None)
    for key, expected, found in check() if check is not None else ():
        raise ConfigError(file, f"{prefix}.{key}" if prefix else key, expected, found)
    return section


def convert(tp: Any, value: Any, file: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(inner[0], value, file, key)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, file, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, key, "true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(file, key, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, key, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, key, "a string", value)
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(file, key, "a list", value)
        return tuple(convert(args[0], v, file, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (collections.abc.Mapping, dict):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(file, key, "a mapping", value)
        kt, vt = args
        return {convert(kt, k, file, f"{key}.{k}"): convert(vt, v, file, f"{key}.{k}") for k, v in value.items()}
    raise TypeError(f"settings type {tp!r} at {key} has no config mapping")  # a bug in settings.py


# --------------------------------------------------------------------------- value checks


def _check(s: Settings, file: str) -> None:
    """Constraints the types cannot say. Each names the key."""

    def positive(key: str, value: float | None, allow_none: bool = True) -> None:
        if value is None and allow_none:
            return
        if value is None or value <= 0:
            raise ConfigError(file, key, "a number greater than 0", value)

    def non_negative(key: str, value: float) -> None:
        if value < 0:
            raise ConfigError(file, key, "a number of 0 or more", value)

    if not s.node_name or any(c.isspace() for c in s.node_name) or len(s.node_name) > 255:
        raise ConfigError(file, "node_name", "a Slurm node name without spaces", s.node_name)
    positive("interval_s", s.interval_s)
    if s.log_level not in LOG_LEVELS:
        raise ConfigError(file, "log_level", f"one of {', '.join(LOG_LEVELS)}", s.log_level)
    for key in ("state_file", "state_dir"):
        if not str(getattr(s, key)).startswith("/"):
            raise ConfigError(file, key, "an absolute path", getattr(s, key))
    positive("nvml.expected_gpus", s.nvml.expected_gpus)
    positive("nvml.call_timeout_s", s.nvml.call_timeout_s)
    non_negative("nvml.nvlink_counter_interval_s", s.nvml.nvlink_counter_interval_s)
    non_negative("host.dstate_scan_min_load", s.host.dstate_scan_min_load)
    non_negative("host.dstate_scan_interval_s", s.host.dstate_scan_interval_s)
    if s.kernel_log.start_at not in START_AT:
        raise ConfigError(file, "kernel_log.start_at", f"one of {', '.join(START_AT)}", s.kernel_log.start_at)
    ib = s.infiniband
    positive("infiniband.expected_ports", ib.expected_ports)
    positive("infiniband.expected_rate_gbps", ib.expected_rate_gbps)
    positive("infiniband.flap_cycles", ib.flap_cycles, allow_none=False)
    for name in ("flap_window_s", "drop_after_s", "sticky_s"):
        positive(f"infiniband.{name}", getattr(ib, name))
    for f in dataclasses.fields(ib.thresholds):
        non_negative(f"infiniband.thresholds.{f.name}", getattr(ib.thresholds, f.name))
    for i, fs in enumerate(s.host.filesystems):
        if not fs.path.startswith("/"):
            raise ConfigError(file, f"host.filesystems[{i}].path", "an absolute path", fs.path)
        positive(f"host.filesystems[{i}].timeout_s", fs.timeout_s)
        positive(f"host.filesystems[{i}].max_latency_s", fs.max_latency_s)
    for f in dataclasses.fields(s.classify):
        non_negative(f"classify.{f.name}", getattr(s.classify, f.name))
    if s.metrics.listen is not None:
        host, _, port = s.metrics.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(file, "metrics.listen", "HOST:PORT such as 127.0.0.1:9840", s.metrics.listen)
    h = s.hooks
    if h.gating not in GATING:
        raise ConfigError(file, "hooks.gating", f"one of {', '.join(GATING)}", h.gating)
    for name in ("stale_after_s", "timeout_s", "dcgmi_timeout_s", "dcgmi_interval_s"):
        positive(f"hooks.{name}", getattr(h, name), allow_none=False)
    if h.timeout_s + h.dcgmi_timeout_s >= 60:
        raise ConfigError(file, "hooks.dcgmi_timeout_s", f"a number under {60 - h.timeout_s:g} (60 - hooks.timeout_s): "
                          "slurmd kills a HealthCheckProgram after 60 s", h.dcgmi_timeout_s)
    if h.stale_after_s <= s.interval_s:
        raise ConfigError(file, "hooks.stale_after_s", f"a number greater than interval_s ({s.interval_s:g}): "
                          "the agent writes its state once per interval", h.stale_after_s)
    for name in ("run_dir", "slurm_conf", "gpu_devices", "charges_file"):
        if not getattr(h, name).startswith("/"):
            raise ConfigError(file, f"hooks.{name}", "an absolute path", getattr(h, name))
    if not h.path or any(not d.startswith("/") for d in h.path.split(":")):
        raise ConfigError(file, "hooks.path", "a PATH of absolute directories separated by ':'", h.path)
    if h.dcgmi is not None and (not h.dcgmi or any(c.isspace() for c in h.dcgmi)):
        raise ConfigError(file, "hooks.dcgmi", "a dcgmi path or command name without spaces, or null", h.dcgmi)
    c = s.controller
    if c.url is not None:
        scheme, sep, rest = c.url.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or rest.startswith("/") or any(ch.isspace() for ch in c.url):
            raise ConfigError(file, "controller.url", "an http:// or https:// URL such as http://head01:9841, or null", c.url)
    for name in ("heartbeat_s", "timeout_s", "backoff_max_s"):
        positive(f"controller.{name}", getattr(c, name), allow_none=False)
    if c.munge_socket is not None and not c.munge_socket.startswith("/"):
        raise ConfigError(file, "controller.munge_socket", "an absolute path, or null", c.munge_socket)
    if h.gating == "controller" and c.url is None:
        raise ConfigError(file, "hooks.gating", "off or local when controller.url is not set "
                          "(gating controller asks the controller)", h.gating)
    if not s.catalog.overrides:
        return  # the Slurm hooks load this config on every run: skip importing healthd.model
    from healthd.model import ACTIONS, ATTRIBUTIONS  # local: model imports nothing from here

    for xid, o in s.catalog.overrides.items():
        key = f"catalog.overrides.{xid}"
        if o.attribution is not None and o.attribution not in ATTRIBUTIONS:
            raise ConfigError(file, f"{key}.attribution", f"one of {', '.join(ATTRIBUTIONS)}", o.attribution)
        if o.tier is not None and o.tier not in (1, 2, 3):
            raise ConfigError(file, f"{key}.tier", "1, 2 or 3", o.tier)
        if o.action is not None and o.action not in ACTIONS:
            raise ConfigError(file, f"{key}.action", f"one of {', '.join(ACTIONS)}", o.action)
