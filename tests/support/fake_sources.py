"""A fake collector for agent-level tests that are about the agent, not a source: it hands out one
prepared sample (a kernel sample only once, as the real follower does). NVML samples are written with
raw counters, and come out with their deltas through the NVML collector's own pure step."""

from __future__ import annotations

from typing import Any

from healthd.agent.collectors.counters import Baseline
from healthd.agent.collectors.nvml import with_deltas
from healthd.model import NvmlSample
from tests.support.builders import kernel


class FakeCollector:
    def __init__(self, name: str, sample: Any):
        self.name, self.sample = name, sample
        self.baseline = Baseline()

    def collect(self, now: float) -> Any:
        if isinstance(self.sample, NvmlSample):
            sample, self.baseline = with_deltas(self.sample, self.baseline, None, now)
            return sample
        return self.sample

    def read(self, timeout_s: float) -> Any:
        s, self.sample = self.sample, kernel()
        return s

    def state(self) -> None:
        return None

    def close(self) -> None:
        pass
