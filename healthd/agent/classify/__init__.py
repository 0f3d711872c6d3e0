"""Snapshot + history -> findings and a verdict. A pure function: no I/O, no clock, no logging.

`classify(snapshot, history, catalog, settings)` reads one tick's samples, folds what must be
remembered (counter baselines, Xid occurrences, port states, held findings) into a *new* History
and returns it with the findings. The history it was given is never changed. Every finding carries
evidence a human can check: the kernel line with its journal cursor and count, the counter delta and
its window, the NVML value.

The rules live in one module per source over a shared `context.TickContext`; `engine` runs them
in the order the source registry (healthd.agent.sources) lists the sources. What each kind of finding means for the node
(tier, attribution, action) is data: the rules table in `rules` (documented in docs/agent.md,
"Tiers, attribution and actions") and, for Xids, healthd/data/xid_catalog.yaml.

Ids are stable for the same condition across ticks (`xid:gpu3:79`, `nvml.remap_pending:gpu2`,
`ib.drop:mlx5_0/1`) so the hooks and the controller can follow a finding over time.
"""

from __future__ import annotations

from healthd.agent.classify.engine import Classification, classify
from healthd.agent.classify.infiniband import IB_ERROR_COUNTERS

__all__ = ["IB_ERROR_COUNTERS", "Classification", "classify"]
