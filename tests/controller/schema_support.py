"""Documents changed in one place, for the tests that walk every field of a report and expect the
refusal to name it."""

from __future__ import annotations

import copy
from typing import Any

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
