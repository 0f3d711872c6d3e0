"""Collectors: one source each, one file each. They read and return typed samples (healthd.model);
they make no decisions. A source that does not exist on this node returns status "no_data"; a source
that exists but fails returns status "error" with a one-line detail. No collector raises out of
collect(): a failure is data.

Periodic collectors follow `PeriodicCollector`; the kernel log is followed continuously
(healthd.agent.collectors.kernel_log.KernelLogFollower)."""

from __future__ import annotations

from typing import Any, Protocol


class PeriodicCollector(Protocol):
    name: str

    def collect(self, now: float) -> Any:
        """Read the source once and return its sample (NvmlSample, InfinibandSample, HostSample)."""
        ...

    def close(self) -> None: ...
