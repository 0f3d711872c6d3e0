"""InfiniBand / RoCE ports from sysfs (`/sys/class/infiniband/<dev>/ports/<n>/...`).

Reads, per port, `state`, `phys_state`, `rate`, `link_layer` and every file in `counters/` (PMA
PortCounters) and `hw_counters/` (driver counters; `lifespan` is a setting, skipped), and turns each
counter into a CounterDelta against the previous reading. Given `counters` (the agent passes the
classifier's error counters, 15 of the ~45 files an NDR port has), only files of those names are
read: traffic and packet counters decide nothing, and each read is a MAD to the HCA. No decisions: flaps, drops and thresholds
belong to the classifier, which sees the history of these samples.

Counter deltas follow healthd.agent.collectors.counters (a first reading is a baseline, a value
that went down is a reset, another boot id drops the baseline, a failed read keeps it); PMA counters
saturate at 2^width-1 and stop, so at that value new errors are unknown and the delta says so.
The baseline is exposed by `state()` as plain JSON and accepted back through the constructor, so
deltas continue across an agent restart.

A file that exists but cannot be read (a MAD that fails with EIO/EINVAL, a permission error) or
whose contents are not what the kernel writes goes to PortSample.unreadable; everything else on the
port and every other port is still read. Each such file is logged once when it turns bad and once
when it recovers, not on every tick.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import Any, Collection, Mapping

from healthd.agent.collectors.counters import Baseline, counter_delta
from healthd.model import CounterDelta, InfinibandSample, PortSample
from healthd.persist import read_boot_id
from healthd.text import natural_key

log = logging.getLogger(__name__)

# Widths of the PMA PortCounters as the kernel declares them (PORT_PMA_ATTR in
# drivers/infiniband/core/sysfs.c). The IBA spec makes these saturate at their maximum, not wrap.
# port_{xmit,rcv}_{data,packets} are 32 or 64 bits depending on whether the HCA advertises extended
# counters, which the file does not say, so they are not listed (a 64-bit counter never saturates).
PMA_WIDTH_BITS: Mapping[str, int] = {
    "symbol_error": 16,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "VL15_dropped": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "port_xmit_wait": 32,
}

COUNTER_DIRS = ("counters", "hw_counters")
SKIP = {"hw_counters": frozenset({"lifespan"}), "counters": frozenset()}

_STATE_RE = re.compile(r"(\d+):\s*(\S.*)")
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*Gb/sec(?:\s|$)")


# --------------------------------------------------------------------------- pure parsing


def parse_state(text: str) -> str:
    """`"4: ACTIVE\\n"` -> `"ACTIVE"`, `"7: Phy Test\\n"` -> `"Phy Test"` (state and phys_state)."""
    m = _STATE_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"expected '<n>: <NAME>', got {_clip(text)}")
    return m.group(2)


def parse_rate(text: str) -> float:
    """`"400 Gb/sec (4X NDR)\\n"` -> 400.0, `"2.5 Gb/sec (1X SDR)\\n"` -> 2.5 (Gb/s)."""
    m = _RATE_RE.match(text.strip())
    if m is None:
        raise ValueError(f"expected '<rate> Gb/sec (...)', got {_clip(text)}")
    return float(m.group(1))


def parse_counter(text: str) -> int:
    """`"%u\\n"` / `"%llu\\n"` -> int. Anything else (signs, hex, words, empty) is an error."""
    s = text.strip()
    if not (s and s.isascii() and s.isdigit()):
        raise ValueError(f"expected an unsigned decimal, got {_clip(text)}")
    return int(s)


def describe_error(exc: BaseException) -> str:
    """A short, stable error text: `EIO: Input/output error`, `unparsable: expected ...`."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{errno.errorcode.get(exc.errno, f'errno {exc.errno}')}: {exc.strerror or exc}"
    if isinstance(exc, (ValueError, UnicodeDecodeError)):
        return f"unparsable: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _clip(text: str, n: int = 40) -> str:
    text = text.rstrip("\n")
    return repr(text if len(text) <= n else text[:n] + "...")


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0]


# --------------------------------------------------------------------------- reading


def _read(path: str) -> str:
    """One sysfs read: a single read() as the kernel serves attributes (each counter read is a MAD)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return data.decode("utf-8")


class InfinibandCollector:
    """Reads every port of every HCA under `sysfs_root` once per collect()."""

    name = "infiniband"

    def __init__(
        self,
        sysfs_root: str = "/sys/class/infiniband",
        boot_id_path: str = "/proc/sys/kernel/random/boot_id",
        baseline: Mapping | None = None,
        counters: Collection[str] | None = None,
    ) -> None:
        self.sysfs_root = sysfs_root
        self.boot_id_path = boot_id_path
        self.counters = None if counters is None else frozenset(counters)
        """Counter file names to read in counters/ and hw_counters/; None: every file."""
        self._boot_id: str | None = None
        # "mlx5_0/1" -> {"counters/link_downed": (value, time)}
        self._last: dict[str, dict[str, tuple[int, float]]] = {}
        # "mlx5_0/1/counters/x" -> error text, for files currently unreadable (log on transitions)
        self._bad: dict[str, str] = {}
        if baseline:
            self._load_baseline(baseline)

    # ------------------------------------------------------------------ baseline

    def _load_baseline(self, baseline: Mapping) -> None:
        saved = Baseline.from_json(baseline, "ports", "infiniband")
        self._boot_id = saved.boot_id
        self._last = {port: dict(counters) for port, counters in saved.groups.items()}

    def state(self) -> dict[str, Any]:
        """The counter baseline as JSON-serialisable data; pass it back as `baseline` after a restart."""
        return Baseline(self._boot_id, self._last).to_json("ports")

    def _read_boot_id(self) -> str | None:
        return read_boot_id(self.boot_id_path)

    # ------------------------------------------------------------------ collect

    def collect(self, now: float) -> InfinibandSample:
        boot_id = self._read_boot_id()
        if boot_id != self._boot_id:
            self._last = {port: dict(c) for port, c in Baseline(self._boot_id, self._last).on_boot(boot_id, "infiniband").groups.items()}
            self._boot_id = boot_id

        root = self.sysfs_root
        try:
            devices = sorted(os.listdir(root), key=natural_key)
        except FileNotFoundError:
            return InfinibandSample(status="no_data", detail=f"no InfiniBand HCA ({root} absent)", boot_id=boot_id, time=now)
        except OSError as exc:
            return InfinibandSample(
                status="error", detail=f"cannot list {root}: {describe_error(exc)}", boot_id=boot_id, time=now
            )

        ports: list[PortSample] = []
        problems: list[str] = []
        new_last: dict[str, dict[str, tuple[int, float]]] = {}
        new_bad: dict[str, str] = {}
        for dev in devices:
            ports_dir = f"{root}/{dev}/ports"
            try:
                names = sorted(os.listdir(ports_dir), key=natural_key)
            except FileNotFoundError:
                continue
            except OSError as exc:
                problems.append(f"cannot list {ports_dir}: {describe_error(exc)}")
                # keep what we knew about this device's ports for when it is readable again
                prefix = f"{dev}/"
                new_last.update({k: v for k, v in self._last.items() if k.startswith(prefix)})
                continue
            for name in names:
                if not name.isdigit():
                    continue
                port_key = f"{dev}/{name}"
                sample, last = self._read_port(dev, int(name), f"{ports_dir}/{name}", now, new_bad)
                ports.append(sample)
                new_last[port_key] = last

        self._log_transitions(new_bad, seen=new_last.keys())
        self._bad = new_bad
        self._last = new_last

        if ports:
            return InfinibandSample(status="ok", detail="; ".join(problems), ports=tuple(ports), boot_id=boot_id, time=now)
        if problems:
            return InfinibandSample(status="error", detail="; ".join(problems), boot_id=boot_id, time=now)
        return InfinibandSample(status="no_data", detail=f"no InfiniBand ports under {root}", boot_id=boot_id, time=now)

    def _read_port(
        self, dev: str, port: int, port_dir: str, now: float, bad: dict[str, str]
    ) -> tuple[PortSample, dict[str, tuple[int, float]]]:
        port_key = f"{dev}/{port}"
        unreadable: dict[str, str] = {}
        attrs: dict[str, Any] = {}
        for attr, parse in (
            ("state", parse_state),
            ("phys_state", parse_state),
            ("rate", parse_rate),
            ("link_layer", str.strip),
        ):
            try:
                attrs[attr] = parse(_read(f"{port_dir}/{attr}"))
            except FileNotFoundError:
                attrs[attr] = None
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                attrs[attr] = None
                unreadable[attr] = describe_error(exc)

        previous = self._last.get(port_key, {})
        last: dict[str, tuple[int, float]] = {}
        counters: dict[str, CounterDelta] = {}
        for sub in COUNTER_DIRS:
            sub_dir = f"{port_dir}/{sub}"
            try:
                names = sorted(os.listdir(sub_dir))
            except FileNotFoundError:
                continue
            except OSError as exc:
                unreadable[sub] = describe_error(exc)
                # a listing failure says nothing about the counters: keep their baselines
                last.update({k: v for k, v in previous.items() if k.startswith(sub + "/")})
                continue
            skip = SKIP[sub]
            widths = PMA_WIDTH_BITS if sub == "counters" else {}
            only = self.counters
            for cname in names:
                if cname in skip or (only is not None and cname not in only):
                    continue
                key = f"{sub}/{cname}"
                try:
                    value = parse_counter(_read(f"{sub_dir}/{cname}"))
                except FileNotFoundError:
                    continue
                except (OSError, ValueError, UnicodeDecodeError) as exc:
                    unreadable[key] = describe_error(exc)
                    if key in previous:
                        # the next good reading's delta spans the gap from the last good one
                        last[key] = previous[key]
                    continue
                counters[key] = counter_delta(value, previous.get(key), now, widths.get(cname))
                last[key] = (value, now)

        for f, err in unreadable.items():
            bad[f"{port_key}/{f}"] = err
        sample = PortSample(
            device=dev,
            port=port,
            state=attrs["state"],
            phys_state=attrs["phys_state"],
            rate_gbps=attrs["rate"],
            link_layer=attrs["link_layer"] or None,
            counters=counters,
            unreadable=unreadable,
        )
        return sample, last

    def _log_transitions(self, new_bad: Mapping[str, str], seen: Any) -> None:
        root = self.sysfs_root
        for f, err in new_bad.items():
            old = self._bad.get(f)
            if old is None or _error_kind(old) != _error_kind(err):
                log.warning("infiniband: unreadable %s/%s: %s", root, _port_path(f), err)
        for f in self._bad.keys() - new_bad.keys():
            if "/".join(f.split("/", 2)[:2]) not in seen:
                continue  # the port itself is gone; that is the classifier's news, not a recovery
            log.info("infiniband: %s/%s is readable again", root, _port_path(f))

    def close(self) -> None:
        """Nothing is held open between ticks."""


def _port_path(key: str) -> str:
    """`mlx5_0/1/counters/x` -> `mlx5_0/ports/1/counters/x` (the sysfs path below the root)."""
    dev, port, rest = key.split("/", 2)
    return f"{dev}/ports/{port}/{rest}"
