"""The text and time forms every healthd document, reason and refusal uses."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from healthd.text import clean, iso, natural_key, parse_time, stamp


def test_stamp_is_utc_iso_to_the_second():
    assert stamp(1_800_000_000.0) == "2027-01-15T08:00:00Z"
    assert stamp(1_800_000_000.999) == "2027-01-15T08:00:00Z"
    assert stamp(None) == "-"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_stamp_never_raises(t):
    text = stamp(t)
    assert "\n" not in text and (text.endswith("Z") or text.startswith("<time "))


def test_iso_and_parse_time_round_trip():
    assert parse_time(iso(1_800_000_000.25)) == 1_800_000_000.25
    assert parse_time("2027-01-15T08:00:00") is None  # no time zone is not a time
    assert parse_time(math.nan) is None


def test_clean_is_one_printable_line():
    assert clean("a\nb\x00c" + "x" * 300, 10) == "a?b?cxx..."


def test_natural_key_orders_numbers_by_value():
    names = ["node10", "node2", "mlx5_10", "mlx5_2", "node01", "node1", "node10a", "a"]
    assert sorted(names, key=natural_key) == ["a", "mlx5_2", "mlx5_10", "node01", "node1", "node2", "node10", "node10a"]
