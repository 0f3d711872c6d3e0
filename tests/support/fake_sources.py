"""A fake collector for agent-level tests that are about the agent, not a source: it hands out one
prepared sample (a kernel sample only once, as the real follower does)."""

from __future__ import annotations

from typing import Any

from tests.support.builders import kernel


class FakeCollector:
    def __init__(self, name: str, sample: Any):
        self.name, self.sample = name, sample

    def collect(self, now: float) -> Any:
        return self.sample

    def read(self, timeout_s: float) -> Any:
        s, self.sample = self.sample, kernel()
        return s

    def state(self) -> None:
        return None

    def close(self) -> None:
        pass
