"""The drain-reason rules (healthd.reason): prefix, ownership by text, building, the limit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from healthd.reason import MAX_REASON_BYTES, REASON_PREFIX, build_reason, is_healthd_reason, printable, reason_bytes


def test_a_short_reason_is_written_as_given():
    assert build_reason("xid 79 gpu3: fell off the bus") == "healthd: xid 79 gpu3: fell off the bus"
    assert build_reason("xid 79 gpu3", "[job 12]") == "healthd: xid 79 gpu3 [job 12]"
    assert build_reason("", "[#7]") == "healthd:  [#7]"


def test_a_long_text_is_shortened_never_the_prefix_or_the_suffix():
    r = build_reason("x" * 1000, "[#H0123abcd]")
    assert len(r) == MAX_REASON_BYTES and r.startswith("healthd: xxx") and r.endswith("... [#H0123abcd]")
    assert build_reason("y" * (MAX_REASON_BYTES - len("healthd: "))) == "healthd: " + "y" * (MAX_REASON_BYTES - 9)


def test_control_characters_and_non_ascii_become_question_marks():
    assert build_reason("a\nb\tc ünï", "[job\x07]") == "healthd: a?b?c ?n? [job?]"
    assert printable("ok ✓") == "ok ?"


@given(st.text(), st.text(max_size=400))
def test_every_built_reason_is_one_owned_printable_line_within_the_limit(text, suffix):
    r = build_reason(text, suffix)
    assert r.startswith(f"{REASON_PREFIX} ") and is_healthd_reason(r)
    assert reason_bytes(r) == len(r) <= MAX_REASON_BYTES and r.isprintable() and r.isascii()


def test_ownership_by_text_and_the_byte_count():
    assert is_healthd_reason("healthd: x") and is_healthd_reason("healthd:x")
    assert not is_healthd_reason("admin: healthd: x") and not is_healthd_reason(None) and not is_healthd_reason(7)
    assert reason_bytes("é" * 10) == 20 and reason_bytes("\ud800") == 3
