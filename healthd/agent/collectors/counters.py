"""Counter deltas: the one place a raw, ever-growing counter (ECC errors, PCIe replays, NVLink and
InfiniBand error counters) becomes "how much it grew since the previous reading". The collector
that reads a counter keeps its baseline here; the classifier only adds deltas up over its windows.

Rules:
- the first reading of a counter is a baseline: delta None;
- a value lower than the previous one means the counter was cleared (a GPU reset, a driver reload,
  `perfquery -x`): delta None, reset=True;
- counters restart at boot, so a baseline from another boot id is dropped, not subtracted;
- a saturating counter at its maximum (2^width - 1) hides new errors: delta None, saturated=True
  (never "no new errors");
- a reading that fails keeps the previous baseline, so the next good reading's delta spans the gap.

A baseline is plain JSON (`to_json` / `from_json`), saved in the agent's memory so deltas continue
across an agent restart. A saved baseline that is not what `to_json` writes is ignored with a
warning: the next reading is a new baseline, nothing else is lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from healthd.model import CounterDelta

log = logging.getLogger(__name__)

VERSION = 1

Reading = tuple[int, float]
"""(value, epoch seconds) of a counter's last good reading."""


def counter_delta(value: int, previous: Reading | None, now: float, width_bits: int | None = None) -> CounterDelta:
    """One counter reading against its previous (value, time). window_s is the time since the
    previous reading (None when there is none, or when the clock went backwards)."""
    saturated = width_bits is not None and value >= (1 << width_bits) - 1
    if previous is None:
        return CounterDelta(value=value, delta=None, window_s=None, saturated=saturated)
    prev_value, prev_time = previous
    window = now - prev_time if now > prev_time else None
    if value < prev_value:
        return CounterDelta(value=value, delta=None, window_s=window, saturated=saturated, reset=True)
    if saturated:
        return CounterDelta(value=value, delta=None, window_s=window, saturated=True)
    return CounterDelta(value=value, delta=value - prev_value, window_s=window)


@dataclass(frozen=True)
class Baseline:
    """The last good reading of each counter, per group (a GPU, a port), taken on one boot."""

    boot_id: str | None = None
    groups: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)
    """Group ('GPU-…', 'mlx5_0/1') -> counter name -> (value, time)."""

    def on_boot(self, boot_id: str | None, what: str) -> Baseline:
        """This baseline when `boot_id` is the boot it was taken on, else an empty one for it."""
        if boot_id == self.boot_id:
            return self
        if self.groups:
            log.info("%s: boot id changed (%s -> %s); counters restarted, taking a new baseline", what, self.boot_id, boot_id)
        return Baseline(boot_id=boot_id)

    def to_json(self, section: str) -> dict[str, Any]:
        return {
            "version": VERSION,
            "boot_id": self.boot_id,
            section: {group: {key: [value, t] for key, (value, t) in counters.items()} for group, counters in self.groups.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping | None, section: str, what: str) -> Baseline:
        """The baseline `to_json(section)` wrote; an empty one (with a warning) for anything else."""
        if not doc:
            return cls()
        try:
            if doc.get("version") != VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {VERSION}")
            boot_id = doc.get("boot_id")
            if boot_id is not None and not isinstance(boot_id, str):
                raise ValueError("boot_id is not a string")
            groups: dict[str, dict[str, Reading]] = {}
            for group, counters in dict(doc.get(section) or {}).items():
                entry: dict[str, Reading] = {}
                for key, pair in dict(counters).items():
                    value, t = pair
                    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                        raise ValueError(f"{group} {key}: value {value!r} is not a counter")
                    if isinstance(t, bool) or not isinstance(t, (int, float)):
                        raise ValueError(f"{group} {key}: time {t!r} is not a number")
                    entry[str(key)] = (value, float(t))
                groups[str(group)] = entry
        except (AttributeError, TypeError, ValueError) as exc:
            log.warning("%s: ignoring saved counter baseline (%s); deltas restart from the next reading", what, exc)
            return cls()
        return cls(boot_id=boot_id, groups=groups)
