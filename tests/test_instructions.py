"""The agent's handling of the controller's clear-finding instruction (pure parts)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthd.instructions import MAX_CLEARS, merge_clears, parse_clear

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["kind", "findings", "before", "incident"]), json_values))
def test_parse_clear_accepts_or_says_why(doc):
    try:
        out = parse_clear(doc)
    except ValueError as exc:
        assert str(exc)
        return
    assert out and all(isinstance(k, str) and v > 0 for k, v in out.items())


def test_parse_clear_examples():
    assert parse_clear({"kind": "clear-finding", "findings": ["xid:gpu0:79"], "before": 5}) == {"xid:gpu0:79": 5.0}
    for bad in ({"kind": "clear-finding", "findings": [], "before": 5},
                {"kind": "clear-finding", "findings": ["a"], "before": True},
                {"kind": "clear-finding", "findings": ["a"], "before": float("nan")},
                {"kind": "clear-finding", "findings": [3], "before": 5},
                {"kind": "run-validation"}):
        with pytest.raises(ValueError):
            parse_clear(bad)


def test_merge_keeps_the_later_clear_and_a_bounded_number():
    assert merge_clears({"a": 5.0}, {"a": 3.0, "b": 1.0}) == {"a": 5.0, "b": 1.0}
    many = merge_clears({}, {f"f{i}": float(i) for i in range(MAX_CLEARS + 10)})
    assert len(many) == MAX_CLEARS and "f0" not in many and f"f{MAX_CLEARS + 9}" in many
