"""The Slurm hooks' pre-compiled configuration: the settings they read from healthd.yaml, as JSON.

slurmd runs a hook at every job launch and end, and a run that parses the YAML spends most of its
time importing PyYAML and building the settings dataclasses (about 25 ms of a 70 ms run on a 2-core
VM). So the agent (at start and on SIGHUP) and `healthd check-config --write-hook-config` compile
the sections the hooks read -- the top-level values, `hooks`, `inband`, `nvml` and `controller` --
into one small JSON file, `COMPILED_PATH`, written atomically when it is next to the configured state
file (the default, /run/healthd/state.json; a state file elsewhere leaves the hooks on the YAML):

    {"format": 1, "healthd": "<version>", "source": {"path", "size", "mtime_ns", "ino", "dev"},
     "node_name_set": bool, "settings": {...}}

A hook uses it only when all of these hold, and otherwise loads the YAML as before (`load`):
the file is trusted as every file the hooks read is (root's, writable by nobody else, in a
directory of root's, not a link: healthd.trusted), it is a JSON object of this format written by
this healthd version, it names the very YAML the hook was given, that YAML's size, mtime, inode
and device are the ones compiled, and the compiled file is not older than the YAML. A file that is
missing, corrupt, stale, hostile or from another version costs one fallback to the YAML, never a
crash. When healthd.yaml does not set node_name, the hook computes it as the loader would (the
short hostname at the time of the run).

This module is on every hook's start: module level imports os only; healthd.fastjson and
healthd.trusted, and healthd.config (YAML) on the fallback, are imported inside the functions.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from healthd.settings import Settings

FORMAT = 1
"""Bumped whenever the document's layout or meaning changes: an older or newer file is not used."""
COMPILED_PATH = "/run/healthd/hooks-config.json"
"""Where the compiled configuration lives: the runtime directory of the default state file
(/run/healthd, made by tmpfiles and writable by the agent under ProtectSystem=strict)."""
PATH_ENV = "HEALTHD_HOOKS_COMPILED"
"""Environment variable naming another place for it (the tests and benchmarks; both writer and
hooks read it)."""
NODE_CONFIG_PATH = "/etc/healthd/healthd.yaml"
"""healthd.config.NODE_CONFIG_PATH, repeated so that the hooks need not import the loader (a test
checks they agree)."""
SECTIONS = ("hooks", "inband", "nvml", "controller")
"""The settings sections the hooks read, compiled whole (the top-level values come too)."""
MAX_BYTES = 64 * 1024
NUMBER = (int, float)
TYPES: dict[tuple[str, str], tuple[type, ...]] = {
    ("", "node_name"): (str,), ("", "state_file"): (str,), ("", "state_dir"): (str,),
    ("hooks", "gating"): (str,), ("hooks", "stale_after_s"): NUMBER, ("hooks", "timeout_s"): NUMBER,
    ("hooks", "run_dir"): (str,), ("hooks", "slurm_conf"): (str,), ("hooks", "path"): (str,),
    ("hooks", "gpu_devices"): (str,), ("hooks", "dcgmi"): (str, type(None)), ("hooks", "dcgmi_timeout_s"): NUMBER,
    ("hooks", "dcgmi_interval_s"): NUMBER, ("hooks", "charges_file"): (str,),
    ("inband", "enabled"): (bool,), ("inband", "keep_jobs"): (int,), ("nvml", "expected_gpus"): (int, type(None)),
    ("controller", "url"): (str, type(None)), ("controller", "timeout_s"): NUMBER,
    ("controller", "munge_socket"): (str, type(None)),
}
"""The values the hooks read and the JSON types they must have; anything else in the file is ignored
by this check (it came from the same validated settings)."""


class Unusable(ValueError):
    """The YAML itself cannot be used (healthd.config.ConfigError's message)."""


class Section:
    """Read-only attribute access to one compiled mapping, as the hooks read the settings dataclasses
    (`settings.hooks.run_dir`). A nested mapping is a Section too."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", {k: Section(v) if isinstance(v, dict) else v for k, v in values.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"compiled settings are read-only ({name})")

    def __repr__(self) -> str:
        return f"Section({self._values!r})"


def compiled_path(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    return (os.environ if env is None else env).get(PATH_ENV) or COMPILED_PATH


def source_key(st: os.stat_result) -> dict[str, int]:
    """What identifies one version of the YAML file."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _plain(value: Any) -> Any:
    """A settings value as JSON: dataclasses become mappings, tuples lists."""
    import dataclasses  # lazy: only the writer (the agent, check-config) needs it

    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def compile_settings(settings: Settings, path: str, st: os.stat_result, node_name_set: bool) -> dict[str, Any]:
    """The compiled document for `settings`, loaded from the YAML at `path` whose stat is `st`. Pure."""
    import dataclasses  # lazy: only the writer needs it

    from healthd import __version__  # lazy: only the writer needs the version

    doc: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name in SECTIONS or not dataclasses.is_dataclass(value):
            doc[f.name] = _plain(value)
    return {"format": FORMAT, "healthd": __version__, "source": {"path": os.path.abspath(path), **source_key(st)},
            "node_name_set": node_name_set, "settings": doc}


def write(config_path: str | None, env: dict[str, str] | os._Environ[str] | None = None) -> tuple[str, str]:
    """Compile the YAML at `config_path` (default NODE_CONFIG_PATH) and write the result atomically
    to `compiled_path(env)` when that is next to the configured state file: ('path written', '').
    ('', why not) when the state file is elsewhere (the hooks then read the YAML). ConfigError when
    the YAML is unusable, OSError when the file cannot be written, ValueError when the YAML changed
    while it was read (try again)."""
    from healthd import config  # lazy: the writer (the agent, check-config), never a hook
    from healthd.persist import write_json_atomic  # lazy: the writer

    file = config_path or config.NODE_CONFIG_PATH
    st = os.stat(file)
    text = config.read_config_text(file, must_exist=True) or ""
    settings = config.parse(text, file)
    if source_key(os.stat(file)) != source_key(st):
        raise ValueError(f"{file} changed while it was compiled")
    out = compiled_path(env)
    if os.path.dirname(os.path.abspath(settings.state_file)) != os.path.dirname(os.path.abspath(out)):
        return "", (f"state_file {settings.state_file} is not in {os.path.dirname(out)}, where the hooks look for "
                    f"their compiled configuration ({PATH_ENV} names another place)")
    node_name_set = "node_name" in config.yaml_mapping(text, file)
    write_json_atomic(out, compile_settings(settings, file, st, node_name_set))
    return out, ""


def read_compiled(config_path: str | None, trusted_uid: int, env: dict[str, str] | os._Environ[str] | None = None,
                  ) -> tuple[Section | None, str]:
    """(settings, '') from the compiled file when it is usable for the YAML at `config_path`, else
    (None, why not). Never raises for a bad file."""
    file = config_path or NODE_CONFIG_PATH
    out = compiled_path(env)
    try:
        yaml_st = os.stat(file)
    except OSError as e:
        return None, f"config {file}: {e.strerror or e}"
    from healthd import fastjson, trusted  # lazy: after the stat that may spare it

    try:
        top, rel, name = trusted.split_path(out)
        with trusted.TrustedDir(top, rel, trusted_uid=trusted_uid) as d:
            fd, st = d.open_file(name)
            try:
                data = trusted.read_fd(fd, st, MAX_BYTES, out)
            finally:
                os.close(fd)
        doc = fastjson.loads(data)
    except (OSError, ValueError, RecursionError) as e:  # missing, untrusted, a link, too large, not JSON
        return None, f"{out}: {type(e).__name__ if isinstance(e, RecursionError) else ''}{e}"
    return check(doc, st, os.path.abspath(file), yaml_st)


def check(doc: Any, st: os.stat_result, file: str, yaml_st: os.stat_result) -> tuple[Section | None, str]:
    """Is `doc` (read from a file whose stat is `st`) the compilation of the YAML `file` as it is now
    (`yaml_st`)? Pure but for the healthd version and, when the YAML leaves node_name unset, the
    hostname."""
    from healthd import __version__  # lazy: only when a compiled file is read

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, "not a compiled configuration of this format"
    if doc.get("healthd") != __version__:
        return None, f"compiled by healthd {str(doc.get('healthd'))[:40]}, this is {__version__}"
    source = doc.get("source")
    if not isinstance(source, dict) or source.get("path") != file:
        return None, f"compiled from another file, not {file}"
    if any(source.get(k) != v or type(source.get(k)) is not int for k, v in source_key(yaml_st).items()):
        return None, f"{file} changed since it was compiled"
    if st.st_mtime_ns < yaml_st.st_mtime_ns:
        return None, f"older than {file}"
    values = doc.get("settings")
    if not isinstance(values, dict) or not all(isinstance(values.get(s), dict) for s in SECTIONS):
        return None, "no settings in it"
    values = dict(values)
    if doc.get("node_name_set") is not True:
        values["node_name"] = os.uname().nodename.split(".")[0]  # healthd.config.default_node_name
    for (section, key), types in TYPES.items():
        value = (values if not section else values[section]).get(key)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return None, f"{section + '.' if section else ''}{key} is {type(value).__name__}, not as compiled"
    return Section(values), ""


def load(config_path: str | None, trusted_uid: int, env: dict[str, str] | os._Environ[str] | None = None,
         ) -> tuple[Any, str]:
    """The hooks' settings: (settings, '') from the compiled file; else (settings loaded from the YAML
    by healthd.config.load, why the compiled file was not used). Unusable when the YAML is unusable."""
    settings, why = read_compiled(config_path, trusted_uid, env)
    if settings is not None:
        return settings, ""
    from healthd import config  # lazy: the fallback (PyYAML and the settings dataclasses)

    try:
        return config.load(config_path), why
    except config.ConfigError as e:
        raise Unusable(str(e)) from None
