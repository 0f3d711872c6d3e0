"""Documents changed in one place, and arbitrary JSON to put there, for the tests that walk every
field of a report and expect the refusal to name it."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from healthd.model import iso

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=40,
)
"""Any JSON value, NaN and infinities included: what a hostile or broken agent could send."""

DELETE = object()
"""As the new value: remove the field instead."""


def changed(doc: Any, path: tuple, value: Any) -> Any:
    """A deep copy of `doc` with the field at `path` (keys and list indexes) set to `value`, or removed
    when `value` is DELETE; `doc` itself is left as it was, so a fixture can be changed again."""
    doc = copy.deepcopy(doc)
    *parents, last = path
    target = doc
    for p in parents:
        target = target[p]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return doc


def paths(doc: Any, *, items: int, prefix: tuple = ()) -> list[tuple]:
    """Every field's path in `doc`, parents before children; of each list only the first `items`
    elements, which keeps a hypothesis search over the paths small."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, items=items, prefix=(*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:items]):
            out += paths(v, items=items, prefix=(*prefix, i))
    return out


def xid79(now: float, *, evidence_kind: str = "log_line") -> dict:
    """The agent's JSON for a GPU that fell off the bus (Xid 79): tier 1, drain, first and last seen at `now`."""
    return {"id": "xid:gpu0:79", "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
            "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79 gpu0: fell off the bus",
            "evidence": [{"kind": evidence_kind, "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
            "first_seen": iso(now), "last_seen": iso(now)}
