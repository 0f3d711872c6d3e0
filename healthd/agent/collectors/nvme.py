"""The node's NVMe drives: each controller in sysfs and its SMART / Health Information log (NVMe log
page 02h), read from a JSON file the site writes or, when configured, from a command's output.

Sysfs (`/sys/class/nvme/<controller>/`): `model`, `serial` and `firmware_rev` (the Identify
Controller strings, padded with spaces) and `state` (`live`, `resetting`, `dead`, ...). The kernel
keeps these; reading them sends the drive nothing. Sysfs has no SMART values, so these come as JSON:

* files (`nvme.smart_log_dir`): `<dir>/<controller>.json`, what `nvme smart-log -o json
  /dev/<controller>` prints, written by a site's timer. The agent runs nothing; a file's age is its
  modification time.
* a command (`nvme.smart_log_command`): its argument list with `/dev/<controller>` appended, no shell,
  a fixed PATH, at most `command_timeout_s` and 64 KiB of output. A run past its time is killed;
  one stuck in the driver (uninterruptible) cannot die, so no second run for that controller starts
  until it has exited.

`parse_smart_log` reads the JSON of nvme-cli 1.x (numbers), nvme-cli 2.x (128-bit counters as decimal
strings; `critical_warning` an object with `value` in verbose mode) and smartctl's `-j`
(`nvme_smart_health_information_log`). It is pure and never raises: what it cannot use is an error
value that says why.

The media errors counter only grows over a drive's life (it survives reboots); its delta is taken
here against the collector's own baseline per drive (by serial, as controller names may change at
boot), saved in the agent's memory with the other counter baselines. Decisions (worn, warning,
stale) are the classifier's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping

from healthd.agent.collectors.counters import Baseline, Reading, counter_delta
from healthd.agent.collectors.infiniband import describe_error
from healthd.model import CounterDelta, Status
from healthd.text import natural_key

log = logging.getLogger(__name__)

CONTROLLER = re.compile(r"nvme[0-9]{1,4}")
MAX_CONTROLLERS = 64
SMART_LOG_MAX_BYTES = 64 * 1024
"""A SMART log's JSON is about 1 KiB; more is not one."""
COUNTER_MAX = (1 << 63) - 1
"""The largest count kept: the controller refuses larger integers in a report, and no drive logs this
many errors."""
COMMAND_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
SYSFS_FIELDS = {"model": "model", "serial": "serial", "firmware": "firmware_rev", "state": "state"}
"""NvmeController field -> its sysfs attribute file."""


# --------------------------------------------------------------------------- the samples


@dataclass(frozen=True)
class SmartLog:
    """The SMART / Health Information values the rules read. A field is None when the log lacks it or
    holds something that is not a count of its range."""

    critical_warning: int | None = None
    """Bit field: 0 available spare below its threshold, 1 temperature outside its thresholds, 2 NVM
    subsystem reliability degraded, 3 media read-only, 4 volatile memory backup failed, 5 persistent
    memory region read-only."""
    percentage_used: int | None = None
    """The drive's estimate of its rated endurance used, 0-255 (past 100 on a drive used beyond it)."""
    media_errors: int | None = None
    """Unrecovered data integrity errors over the drive's life."""
    available_spare: int | None = None
    """Remaining spare capacity, percent."""
    available_spare_threshold: int | None = None
    error: str = ""
    """Why the log could not be used at all (every value None); empty when it could."""


@dataclass(frozen=True)
class NvmeController:
    """One controller as sysfs and its SMART log showed it this tick."""

    name: str
    """The kernel's name: nvme0."""
    model: str | None = None
    serial: str | None = None
    firmware: str | None = None
    state: str | None = None
    """The controller's state in sysfs: live, resetting, connecting, deleting, dead, ..."""
    smart: SmartLog | None = None
    """None: no SMART source is configured."""
    smart_at: float | None = None
    """When the SMART log was written (its file's modification time) or read (the command's run)."""
    media_errors: CounterDelta | None = None
    """The media errors counter against the collector's previous reading of this drive."""


@dataclass(frozen=True)
class NvmeSample:
    status: Status
    detail: str = ""
    controllers: tuple[NvmeController, ...] = ()
    time: float | None = None
    """When the collector read the drives: classifying the same sample again does not count its
    media errors twice."""


def document(sample: NvmeSample) -> list[dict[str, Any]]:
    """The state document's `nvme` section: one item per controller."""
    out = []
    for c in sample.controllers:
        s = c.smart
        out.append({
            "device": c.name, "model": c.model, "serial": c.serial, "firmware": c.firmware, "state": c.state,
            "percentage_used": s.percentage_used if s else None, "critical_warning": s.critical_warning if s else None,
            "media_errors": s.media_errors if s else None, "available_spare": s.available_spare if s else None,
            "smart_error": (s.error or None) if s else None,
        })
    return out


# --------------------------------------------------------------------------- the parser


_FIELDS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("critical_warning", ("critical_warning",), 0xFF),
    ("percentage_used", ("percent_used", "percentage_used"), 0xFF),
    ("media_errors", ("media_errors",), COUNTER_MAX),
    ("available_spare", ("avail_spare", "available_spare"), 0xFF),
    ("available_spare_threshold", ("spare_thresh", "available_spare_threshold"), 0xFF),
)
"""SmartLog field -> its keys in nvme-cli's and smartctl's JSON, and its largest value."""
_DECIMAL = re.compile(r"[0-9]{1,20}")


def _count(value: Any, top: int) -> int | None:
    """A count in [0, top]: an integer, a decimal string (nvme-cli 2.x's 128-bit counters), or
    nvme-cli's verbose {"value": n}."""
    if isinstance(value, dict):
        value = value.get("value")
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        return None
    return value


def parse_smart_log(raw: bytes | str) -> SmartLog:
    """One SMART / Health log as JSON -> its values; an error value (never an exception) for anything
    that is not one."""
    if len(raw) > SMART_LOG_MAX_BYTES:
        return SmartLog(error=f"{len(raw)} bytes, more than a SMART log's {SMART_LOG_MAX_BYTES}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return SmartLog(error=f"not JSON: {str(exc)[:120]}")
    if isinstance(doc, dict) and isinstance(doc.get("nvme_smart_health_information_log"), dict):
        doc = doc["nvme_smart_health_information_log"]  # smartctl -j
    if not isinstance(doc, dict):
        return SmartLog(error=f"expected a JSON object, found {type(doc).__name__}")
    values = {}
    for name, keys, top in _FIELDS:
        key = next((k for k in keys if k in doc), None)
        values[name] = _count(doc[key], top) if key is not None else None
    if all(values[k] is None for k in ("critical_warning", "percentage_used", "media_errors")):
        return SmartLog(error="no critical_warning, percent_used or media_errors count in it")
    return SmartLog(**values)


# --------------------------------------------------------------------------- reading


def _attribute(path: str) -> str | None:
    """A sysfs attribute's text, stripped of its padding; None when absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace").strip()
    return text or None


def read_smart_file(path: str) -> tuple[bytes | None, float | None, str]:
    """(content, modification time, '') or (None, None, why): a regular file only, opened without
    following a link or waiting on a FIFO, read up to the size limit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None, f"no SMART log file {path}"
    except OSError as exc:
        return None, None, f"cannot open {path}: {describe_error(exc)}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, None, f"{path} is not a regular file"
        chunks, size = [], 0
        while size <= SMART_LOG_MAX_BYTES:
            chunk = os.read(fd, SMART_LOG_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), st.st_mtime, ""
    except OSError as exc:
        return None, None, f"cannot read {path}: {describe_error(exc)}"
    finally:
        os.close(fd)


def _drain(proc: subprocess.Popen, timeout_s: float, limit: int) -> tuple[bytes, bytes, str]:
    """The process's stdout and stderr until it has closed both and exited; with why it was stopped
    early ('' when it was not): past `timeout_s`, or more than `limit` bytes on either."""
    out, err = bytearray(), bytearray()
    buffers = {proc.stdout: out, proc.stderr: err}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for pipe in buffers:
            sel.register(pipe, selectors.EVENT_READ)  # type: ignore[arg-type]
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), f"did not finish in {timeout_s:g}s"
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = buffers[key.fileobj]  # type: ignore[index]
                buf += chunk
                if len(buf) > limit:
                    return bytes(out), bytes(err), f"printed more than {limit} bytes"
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(out), bytes(err), f"did not exit in {timeout_s:g}s"
    return bytes(out), bytes(err), ""


class NvmeCollector:
    """Reads every controller under `sysfs_root` once per collect(), with its SMART log from
    `smart_log_dir` or `smart_log_command` (neither: sysfs only)."""

    name = "nvme"

    def __init__(
        self,
        sysfs_root: str = "/sys/class/nvme",
        smart_log_dir: str | None = None,
        smart_log_command: tuple[str, ...] = (),
        command_timeout_s: float = 5.0,
        baseline: Mapping | None = None,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.smart_log_dir = smart_log_dir
        self.smart_log_command = tuple(smart_log_command)
        self.command_timeout_s = command_timeout_s
        saved = Baseline.from_json(baseline, "drives", "nvme")
        self._last: dict[str, dict[str, Reading]] = {d: dict(c) for d, c in saved.groups.items()}
        """Drive (serial, else controller name) -> {"media_errors": (value, time)}."""
        self._stuck: dict[str, tuple[subprocess.Popen, float]] = {}
        """Controller -> the run of the command that was killed but has not exited, and when it began."""

    def state(self) -> dict[str, Any]:
        """The media errors baseline as JSON; pass it back as `baseline` after a restart."""
        return Baseline(None, self._last).to_json("drives")

    def close(self) -> None:
        """Nothing to release: a stuck run is left to exit on its own (waiting could hang the agent)."""

    def collect(self, now: float) -> NvmeSample:
        root = self.sysfs_root
        try:
            names = sorted((n for n in os.listdir(root) if CONTROLLER.fullmatch(n)), key=natural_key)
        except FileNotFoundError:
            return NvmeSample(status="no_data", detail=f"no NVMe controller ({root} absent)", time=now)
        except OSError as exc:
            return NvmeSample(status="error", detail=f"cannot list {root}: {describe_error(exc)}", time=now)
        if not names:
            return NvmeSample(status="no_data", detail=f"no NVMe controller under {root}", time=now)
        detail = f"{len(names)} controllers, read the first {MAX_CONTROLLERS}" if len(names) > MAX_CONTROLLERS else ""
        controllers = tuple(self._controller(n, now) for n in names[:MAX_CONTROLLERS])
        return NvmeSample(status="ok", detail=detail, controllers=controllers, time=now)

    def _controller(self, name: str, now: float) -> NvmeController:
        attrs = {f: _attribute(f"{self.sysfs_root}/{name}/{a}") for f, a in SYSFS_FIELDS.items()}
        smart, smart_at = self._smart(name, now)
        delta = None
        if smart is not None and smart.media_errors is not None:
            drive = attrs["serial"] or name
            counters = self._last.setdefault(drive, {})
            delta = counter_delta(smart.media_errors, counters.get("media_errors"), now)
            counters["media_errors"] = (smart.media_errors, now)
        return NvmeController(name=name, **attrs, smart=smart, smart_at=smart_at, media_errors=delta)

    def _smart(self, name: str, now: float) -> tuple[SmartLog | None, float | None]:
        if self.smart_log_dir is not None:
            raw, written, why = read_smart_file(f"{self.smart_log_dir}/{name}.json")
            return (parse_smart_log(raw), written) if raw is not None else (SmartLog(error=why), None)
        if self.smart_log_command:
            raw, why = self._run(name, now)
            return (parse_smart_log(raw), now) if raw is not None else (SmartLog(error=why), None)
        return None, None

    def _run(self, name: str, now: float) -> tuple[bytes | None, str]:
        argv = [*self.smart_log_command, f"/dev/{name}"]
        what = os.path.basename(argv[0])
        stuck = self._stuck.get(name)
        if stuck is not None:
            proc, began = stuck
            if proc.poll() is None:
                return None, f"{what} (pid {proc.pid}) started {now - began:.0f}s ago has not exited; not run again"
            del self._stuck[name]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=COMMAND_ENV, close_fds=True, start_new_session=True)
        except OSError as exc:
            return None, f"cannot run {what}: {describe_error(exc)}"
        try:
            out, err, stopped = _drain(proc, self.command_timeout_s, SMART_LOG_MAX_BYTES)
        finally:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        if stopped:
            proc.kill()
            try:
                proc.wait(0.1)
            except subprocess.TimeoutExpired:
                self._stuck[name] = (proc, now)
                log.warning("%s for %s %s and is not dying (stuck in the driver?)", what, name, stopped)
            return None, f"{what} {stopped} (killed)"
        if proc.returncode != 0:
            first = err.decode("utf-8", "replace").strip().splitlines()[:1]
            return None, f"{what} exited {proc.returncode}{': ' + first[0][:200] if first else ''}"
        return out, ""

