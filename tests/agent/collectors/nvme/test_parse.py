"""healthd.agent.collectors.nvme.parse_smart_log: the SMART / Health log as nvme-cli 1.x, nvme-cli 2.x and
smartctl print it, with exact values; no input crashes it, and anything that is not a log is an error
value that says why."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.agent.collectors.nvme import COUNTER_MAX, SMART_LOG_MAX_BYTES, SmartLog, parse_smart_log
from tests.agent.collectors.nvme.tree import nvme_cli_1, nvme_cli_2, smartctl


@pytest.mark.parametrize("doc", [
    nvme_cli_2(critical_warning=0x0C, percent_used=97, media_errors=12, avail_spare=8),
    nvme_cli_2(critical_warning=0x0C, percent_used=97, media_errors=12, avail_spare=8, verbose=True),
], ids=["nvme-cli-2", "nvme-cli-2-verbose"])
def test_nvme_cli_2(doc):
    assert parse_smart_log(json.dumps(doc)) == SmartLog(critical_warning=0x0C, percentage_used=97, media_errors=12,
                                                        available_spare=8, available_spare_threshold=10)


def test_nvme_cli_1_and_smartctl_and_bytes():
    expected = SmartLog(critical_warning=1, percentage_used=255, media_errors=7, available_spare=100,
                        available_spare_threshold=10)
    assert parse_smart_log(json.dumps(nvme_cli_1(critical_warning=1, percent_used=255, media_errors=7))) == expected
    assert parse_smart_log(json.dumps(smartctl(critical_warning=1, percentage_used=255, media_errors=7)).encode()) == expected


def test_a_128_bit_counter_past_what_a_report_carries_is_no_value():
    doc = nvme_cli_2(media_errors=COUNTER_MAX + 1)
    assert parse_smart_log(json.dumps(doc)).media_errors is None
    assert parse_smart_log(json.dumps(nvme_cli_2(media_errors=COUNTER_MAX))).media_errors == COUNTER_MAX


@pytest.mark.parametrize("field, value", [
    ("critical_warning", 256), ("critical_warning", -1), ("critical_warning", True), ("critical_warning", 1.5),
    ("critical_warning", "0x04"), ("percent_used", "97%"), ("percent_used", None), ("percent_used", [97]),
    ("media_errors", "1,024"), ("media_errors", " 12 x"),
])
def test_a_value_that_is_not_a_count_of_its_range_is_no_value(field, value):
    doc = nvme_cli_2(critical_warning=4, percent_used=50, media_errors=3)
    doc[field] = value
    parsed = parse_smart_log(json.dumps(doc))
    assert parsed.error == ""
    name = {"percent_used": "percentage_used"}.get(field, field)
    assert getattr(parsed, name) is None
    assert sum(getattr(parsed, f) is None for f in ("critical_warning", "percentage_used", "media_errors")) == 1


@pytest.mark.parametrize("raw, why", [
    ("", "not JSON"),
    ("NVMe status: INVALID_FIELD: A reserved coded value or an unsupported value in a defined field(0x2)", "not JSON"),
    (b"\xff\xfe\x00garbage", "not JSON"),
    ("[1, 2, 3]", "expected a JSON object, found list"),
    ('"critical_warning"', "expected a JSON object, found str"),
    ('{"temperature": 310, "power_on_hours": "17532"}', "no critical_warning, percent_used or media_errors"),
    ('{"critical_warning": "many", "percent_used": -3, "media_errors": null}', "no critical_warning"),
    ("[" * 60_000, "not JSON"),
    (" " * (SMART_LOG_MAX_BYTES + 1), "more than a SMART log"),
    ("NaN", "expected a JSON object, found float"),
])
def test_garbage_is_an_error_value_saying_why(raw, why):
    parsed = parse_smart_log(raw)
    assert why in parsed.error
    assert (parsed.critical_warning, parsed.percentage_used, parsed.media_errors) == (None, None, None)


def _is_well_formed(parsed: SmartLog) -> bool:
    values = (parsed.critical_warning, parsed.percentage_used, parsed.media_errors, parsed.available_spare,
              parsed.available_spare_threshold)
    if parsed.error:
        return all(v is None for v in values)
    counts_ok = all(v is None or (type(v) is int and 0 <= v <= COUNTER_MAX) for v in values)
    return counts_ok and any(v is not None for v in values[:3])


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=2048))
def test_no_bytes_crash_it(raw):
    assert _is_well_formed(parse_smart_log(raw))


@settings(max_examples=1500, deadline=None)
@given(st.text(max_size=2048))
def test_no_text_crashes_it(raw):
    assert _is_well_formed(parse_smart_log(raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    | st.from_regex(r"[0-9]{1,25}", fullmatch=True),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
smart_keys = st.sampled_from(["critical_warning", "percent_used", "percentage_used", "media_errors", "avail_spare",
                              "available_spare", "spare_thresh", "available_spare_threshold", "value",
                              "nvme_smart_health_information_log", "temperature"])


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(smart_keys | st.text(max_size=12), json_values, max_size=8) | json_values)
def test_no_json_document_crashes_it(doc):
    assert _is_well_formed(parse_smart_log(json.dumps(doc)))


@settings(max_examples=500, deadline=None)
@given(warning=st.integers(0, 255), used=st.integers(0, 255), errors=st.integers(0, COUNTER_MAX),
       as_text=st.booleans(), verbose=st.booleans())
def test_every_count_in_range_reads_back(warning, used, errors, as_text, verbose):
    doc = nvme_cli_2(critical_warning=warning, percent_used=used, media_errors=errors, verbose=verbose)
    if not as_text:
        doc["media_errors"] = errors
    parsed = parse_smart_log(json.dumps(doc))
    assert (parsed.critical_warning, parsed.percentage_used, parsed.media_errors) == (warning, used, errors)
