"""healthd-taskprolog: slurmd's TaskProlog. slurmstepd runs it as the job's user, with the task's
environment, before every task of every job step; each `export NAME=value` line it prints on
stdout is set in the task's environment.

It prints `export HEALTHD_INBAND_DIR=<hooks.run_dir>/inband/<SLURM_JOB_ID>` when `inband.enabled`
and that path is a directory (not a link) owned by the user it runs as -- the one the prolog made
for this job (healthd.hooks.inband_dirs). Otherwise it prints nothing on stdout and one line on
stderr saying why. It always exits 0, whatever happens (a broken config, a bug, a hang: SIGALRM
after TIMEOUT_S): a TaskProlog failure must never cost a task.

The config: `--config FILE`, else HEALTHD_CONFIG, else /etc/healthd/healthd.yaml (absent: the
defaults). It runs once per task, so it does not load healthd.config (PyYAML and the settings
dataclasses, ~35 ms): `quick_settings` reads the two values it needs from a plain block-style file
and hands anything else (flow style, quotes, anchors, tags, odd indentation) to the full loader.
Module level: os, sys and healthd.inband_layout (the directory's name, the variable's, the job id
rule: what the prolog makes and the job's client reads).
"""

import os
import sys

from healthd.inband_layout import ENV_DIR, job_dir, valid_job

HOOK = "healthd-taskprolog"
VAR = ENV_DIR
NODE_CONFIG_PATH = "/etc/healthd/healthd.yaml"
"""healthd.config.NODE_CONFIG_PATH (a test checks they agree)."""
DEFAULT_RUN_DIR = "/run/healthd"
DEFAULT_ENABLED = True
"""HookSettings.run_dir and InbandSettings.enabled (a test checks they agree)."""
TIMEOUT_S = 5
MAX_CONFIG_BYTES = 1 << 20

_TRUE = ("true", "True", "TRUE")
_FALSE = ("false", "False", "FALSE")
_PLAIN_START = set("-?:,[]{}#&*!|>'\"%@`")


class Skip(Exception):
    """No export, and why."""


class Unsure(Exception):
    """quick_settings cannot be sure how YAML reads the file: the full loader decides."""


def _key_value(line: str) -> tuple[str, str]:
    """`key: value  # comment` -> (key, value) for a plain key and a plain one-line value (or none)."""
    key, sep, rest = line.partition(":")
    if not sep or not key or not (key.replace("_", "a").isalnum() and key.isascii()):
        raise Unsure
    if rest and not rest.startswith(" "):
        raise Unsure
    value = rest.strip()
    if " #" in value:
        value = value.split(" #", 1)[0].rstrip()
    if value.startswith("#"):
        value = ""
    if value and (value[0] in _PLAIN_START or ": " in value or "\t" in value):
        raise Unsure
    return key, value


_PAIRS = {'"': '"', "'": "'", "[": "]", "{": "}"}


def _closed(body: str) -> None:
    """Unsure when a quoted or flow value on this line may go on to the next ones, where a line
    would look like a key and is not."""
    while body.startswith("- "):
        body = body[2:].lstrip(" ")
    value = body.partition(": ")[2].strip() if ": " in body else body
    if value and value[0] in _PAIRS:
        if " #" in value and not value.endswith(_PAIRS[value[0]]):
            value = value.split(" #", 1)[0].rstrip()
        if len(value) < 2 or not value.endswith(_PAIRS[value[0]]):
            raise Unsure


def quick_settings(text: str) -> tuple[bool, str]:
    """(inband.enabled, hooks.run_dir) from YAML in the plain block style, as PyYAML reads it; Unsure
    for anything else. Only what the two values depend on is checked: the top-level keys, and the
    direct children of `hooks:` and `inband:`."""
    enabled, run_dir = DEFAULT_ENABLED, DEFAULT_RUN_DIR
    section = None  # the top-level key whose children are being read ("" for one not needed)
    child = 0  # that section's child indentation, once seen
    last_value = False  # the previous line in a needed section was `key: value`
    seen: set[str] = set()
    empty: set[str] = set()  # needed sections with no child yet: YAML reads `hooks:` alone as null
    for raw in text.split("\n"):
        line = raw.rstrip(" \r")
        body = line.lstrip(" ")
        if "\t" in line[: len(line) - len(body) + 1] or line.startswith(("---", "...", "%")):
            raise Unsure
        if not body or body.startswith("#"):
            continue
        indent = len(line) - len(body)
        if indent == 0:
            key = body.partition(":")[0]
            if key in seen:
                raise Unsure  # PyYAML keeps the last one whole
            seen.add(key)
            if key in ("hooks", "inband"):
                if _key_value(body)[1]:
                    raise Unsure
                section, child, last_value = key, 0, False
                empty.add(key)
            else:
                plain_key = key.replace("_", "a").isalnum() and key.isascii()
                if not plain_key or body[len(key):len(key) + 2] not in (":", ": "):
                    raise Unsure
                _closed(body)
                section = ""
            continue
        if not section:
            _closed(body)  # a value of a key this does not read, unless it runs on to other lines
            continue
        if child == 0:
            child = indent
            empty.discard(section)
        if indent < child:
            raise Unsure
        if indent > child:
            if last_value:
                raise Unsure  # a value continued on the next line
            continue  # inside a nested mapping (inband.detector)
        key, value = _key_value(body)
        last_value = bool(value)
        if section == "hooks" and key == "run_dir":
            run_dir = value
        elif section == "inband" and key == "enabled":
            if value in _TRUE:
                enabled = True
            elif value in _FALSE:
                enabled = False
            else:
                raise Unsure
    if not run_dir or empty:
        raise Unsure
    return enabled, run_dir


def settings(path: str | None) -> tuple[bool, str]:
    file = path or NODE_CONFIG_PATH
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        if path is None:
            return DEFAULT_ENABLED, DEFAULT_RUN_DIR
        raise Skip(f"config {file} does not exist") from None
    except OSError as e:
        raise Skip(f"cannot read config {file}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise Skip(f"config {file} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return quick_settings(data.decode("utf-8"))
    except (Unsure, UnicodeDecodeError):
        pass
    from healthd import config  # lazy: the file is not plain enough for quick_settings

    try:
        s = config.load(file)
    except config.ConfigError as e:
        raise Skip(f"config unusable: {e}") from None
    return s.inband.enabled, s.hooks.run_dir


def config_path(argv: list[str], env: dict[str, str] | os._Environ[str]) -> str | None:
    for i, a in enumerate(argv):
        if a in ("--config", "-c") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return env.get("HEALTHD_CONFIG") or None


def _printable(value: str) -> bool:
    """Safe as the value of slurmstepd's `export NAME=value` line: one line, no spaces."""
    return value.isprintable() and " " not in value


def inband_dir(enabled: bool, run_dir: str, env: dict[str, str] | os._Environ[str], uid: int) -> str:
    """The directory to export; Skip with the reason otherwise."""
    if not enabled:
        raise Skip("inband.enabled is false")
    job = env.get("SLURM_JOB_ID", "")
    if not valid_job(job):
        raise Skip(f"SLURM_JOB_ID {job[:40]!r} is not a job id")
    if not run_dir.startswith("/") or not _printable(run_dir):
        raise Skip(f"hooks.run_dir {run_dir[:200]!r} is not a plain absolute path")
    path = job_dir(run_dir, job)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Skip(f"{path} does not exist (the prolog did not make it)") from None
    except OSError as e:
        raise Skip(f"{path}: {e.strerror or e}") from None
    if (st.st_mode & 0o170000) != 0o040000:
        raise Skip(f"{path} is not a directory (a link is not followed)")
    if st.st_uid != uid:
        raise Skip(f"{path} belongs to uid {st.st_uid}, not {uid}")
    return path


def _alarm(signum: int, frame: object) -> None:
    raise Skip(f"no answer within {TIMEOUT_S} s")


def run(argv: list[str], env: dict[str, str] | os._Environ[str]) -> str:
    """The line for stdout ('' for none); Skip with the reason."""
    enabled, run_dir = settings(config_path(argv, env))
    return f"export {VAR}={inband_dir(enabled, run_dir, env, os.getuid())}\n"


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            import _signal as signal  # the C module: `signal` imports enum, about 4 ms of every task's start
        except ImportError:
            import signal  # type: ignore[no-redef]

        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(TIMEOUT_S)
        try:
            line = run(list(sys.argv[1:] if argv is None else argv), os.environ)
        finally:
            signal.alarm(0)
        sys.stdout.write(line)
        sys.stdout.flush()
    except Skip as e:
        _say(f"no {VAR}: {e}")
    except BaseException as e:  # noqa: BLE001 - a TaskProlog failure would cost the task
        _say(f"no {VAR}: internal error {type(e).__name__}: {str(e)[:300]}")
    return 0


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"{HOOK}: {''.join(c if c.isprintable() else '?' for c in msg)}\n")
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001, S110 - nowhere left to say it
        pass


if __name__ == "__main__":
    raise SystemExit(main())
