"""Gauges served from one immutable set of samples: a prometheus_client custom collector. The agent
publishes one tick's gauges, the controller one round's; `publish` replaces the whole set with a
single assignment and `collect` reads it once, so a scrape gets one tick's (or round's) samples,
every family whole, however the two interleave. Nothing is cleared and refilled."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

Samples = tuple[tuple[tuple[str, ...], float], ...]
"""One gauge family's samples: (label values, value) pairs."""

Family = tuple[str, str, tuple[str, ...]]
"""A gauge family: name, help text, label names."""


class SnapshotGauges:
    """The gauge `families`, showing `initial` until the first publish."""

    def __init__(self, families: tuple[Family, ...], initial: tuple[Samples, ...]) -> None:
        self.families = families
        self._samples = initial
        self.publish(initial)

    def publish(self, samples: tuple[Samples, ...]) -> None:
        if len(samples) != len(self.families):
            raise ValueError(f"{len(samples)} sample sets for {len(self.families)} gauge families")
        self._samples = samples

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, help_text, labels in self.families:
            yield GaugeMetricFamily(name, help_text, labels=labels)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        current = self._samples
        for (name, help_text, labels), samples in zip(self.families, current, strict=True):
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for values, value in samples:
                family.add_metric(values, value)
            yield family
