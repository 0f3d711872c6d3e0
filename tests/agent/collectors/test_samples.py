"""Samples are checked where they are built: a reading that is not of its type is no data, a field
that names what was sampled and is not of its type is a collector bug."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthd.model import TS_MAX, CounterDelta, GpuSample, PortSample, XidEvent
from tests.support.builders import fs, gpu, host, ib, kernel, nvml, port, snap


def test_gpu_readings_that_are_not_of_their_type_are_no_data():
    g = gpu(0, uuid=7, temperature_c=True, margin_c=math.nan, pcie_width=8.5, remap_pending="yes",
            nvlink_errors={"link0.replay": 3, "link1.replay": None, 2: 5, "link2.crc_flit": False},
            errors={"power": 3})
    assert (g.uuid, g.temperature_c, g.margin_c, g.pcie_width, g.remap_pending) == (None, None, None, None, None)
    assert g.nvlink_errors == {"link0.replay": 3} and g.errors == {"power": "3"}
    good = gpu(1, temperature_c=40, remap_pending=False, nvlink_errors={"link0.replay": 0})
    assert (good.temperature_c, good.remap_pending, good.nvlink_errors) == (40, False, {"link0.replay": 0})


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(), st.text(max_size=8))


@given(fields=st.fixed_dictionaries({}, optional={
           "uuid": _ANY, "temperature_c": _ANY, "ecc_corrected_volatile": _ANY, "remap_pending": _ANY,
           "nvlink_errors": st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), _ANY, max_size=3),
           "counters": st.dictionaries(st.text(max_size=6), st.builds(CounterDelta, st.integers(0, 99),
                                                                        st.none() | st.integers(0, 9)), max_size=3)}),
       counters=st.dictionaries(st.one_of(st.text(max_size=12), st.integers()),
                                st.one_of(_ANY, st.builds(CounterDelta, st.integers(0, 99), st.none() | st.integers(0, 9),
                                                          st.none() | st.floats(0, 100))), max_size=4))
def test_a_sample_with_new_counters_is_the_sample_replace_would_build(fields, counters):
    """with_counters checks only the new field; every other was checked when the sample was built."""
    g = GpuSample(index=3, **fields)
    assert g.with_counters(counters) == dataclasses.replace(g, counters=counters)
    assert g.with_counters(counters).counters == dataclasses.replace(g, counters=counters).counters


@pytest.mark.parametrize("build", [
    lambda: GpuSample(index="0"),  # type: ignore[arg-type]
    lambda: GpuSample(index=True),  # type: ignore[arg-type]
    lambda: GpuSample(index=0, lost=None),  # type: ignore[arg-type]
    lambda: XidEvent(xid="79", bus_id=None, text="", count=1, first_ts=1.0, last_ts=1.0, first_cursor=None, last_cursor=None),  # type: ignore[arg-type]
    lambda: CounterDelta(value=1.5, delta=None, window_s=None),  # type: ignore[arg-type]
    lambda: PortSample(device=None, port=1, state=None, phys_state=None, rate_gbps=None, link_layer=None),  # type: ignore[arg-type]
    lambda: snap(math.nan),
])
def test_a_field_naming_what_was_sampled_must_be_of_its_type(build):
    with pytest.raises(TypeError):
        build()


def test_xid_events_hold_a_positive_count_and_usable_times():
    e = XidEvent(xid=13, bus_id=3, text=None, count=0, first_ts=math.inf, last_ts=TS_MAX + 1,  # type: ignore[arg-type]
                 first_cursor=None, last_cursor=None, gpc="1", tpc=2, synthesized=1)  # type: ignore[arg-type]
    assert (e.bus_id, e.text, e.count, e.first_ts, e.last_ts, e.gpc, e.tpc, e.synthesized) == (None, "", 1, None, None, None, 2, True)
    k = kernel(identities={"00000000:18:00.0": ("GPU-a", 5), "x": "junk", 3: ("a", "b")})
    assert k.identities == {"00000000:18:00.0": ("GPU-a", None)}


def test_counter_deltas_are_never_negative_and_windows_never_broken():
    assert CounterDelta(value=5, delta=-2, window_s=-1.0) == CounterDelta(value=5, delta=None, window_s=None)
    assert CounterDelta(value=5, delta=2, window_s=math.nan).rate_per_s is None
    p = port(rate=math.inf,
             counters={"counters/x": CounterDelta(1, 1, 10.0), "counters/y": 4},
             unreadable={"counters/z": OSError("EIO")})
    assert p.rate_gbps is None and list(p.counters) == ["counters/x"] and p.unreadable == {"counters/z": "EIO"}
    assert ib(time=-5.0).time is None


def test_host_readings():
    h = host(mem_available_bytes=1.5, psi={"memory": {"full_avg10": math.nan, "some_avg10": 3.0}, "io": 7},
             dstate_pids=((1, "a"), (2,), ("3", "c"), (4, "d")))
    assert h.mem_available_bytes is None and h.psi == {"memory": {"some_avg10": 3.0}} and h.dstate_pids == ((1, "a"), (4, "d"))
    f = fs(writable="no", latency_s=math.nan)
    assert (f.writable, f.latency_s) == (None, None)
    assert nvml(count=True).count is None
