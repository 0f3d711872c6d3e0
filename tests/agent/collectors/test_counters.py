"""Counter deltas and their baseline: the rules every counter-reading collector follows, and the
NVML collector's pure step (a sample and a baseline in, the sample with deltas and the next
baseline out)."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthd.agent.collectors.counters import Baseline, counter_delta
from healthd.agent.collectors.nvml import BASELINE_MAX_AGE_S, with_deltas
from healthd.model import CounterDelta, GpuSample, NvmlSample
from tests.support.builders import NOW, gpu, nvml


def test_counter_delta_rules():
    assert counter_delta(5, None, 100.0, 16) == CounterDelta(value=5, delta=None, window_s=None)
    assert counter_delta(12, (5, 90.0), 100.0, 16) == CounterDelta(value=12, delta=7, window_s=10.0)
    assert counter_delta(3, (5, 90.0), 100.0, 16) == CounterDelta(value=3, delta=None, window_s=10.0, reset=True)
    assert counter_delta(65535, (65000, 90.0), 100.0, 16) == CounterDelta(
        value=65535, delta=None, window_s=10.0, saturated=True
    )
    assert counter_delta(65535, None, 100.0, 16).saturated is True
    assert counter_delta(65535, (1, 90.0), 100.0, None) == CounterDelta(value=65535, delta=65534, window_s=10.0)
    assert counter_delta(255, (255, 90.0), 100.0, 8).saturated is True
    assert counter_delta(254, (250, 90.0), 100.0, 8) == CounterDelta(value=254, delta=4, window_s=10.0)
    # a clock that went backwards gives no window (so no rate), but the delta is still known
    assert counter_delta(9, (5, 100.0), 95.0, 16) == CounterDelta(value=9, delta=4, window_s=None)
    # NVML's counters do not saturate: no width, never saturated
    assert counter_delta(2**64 - 1, (0, 90.0), 100.0) == CounterDelta(value=2**64 - 1, delta=2**64 - 1, window_s=10.0)


def test_baseline_round_trips_through_json_text():
    b = Baseline(boot_id="boot-1", groups={"GPU-1": {"pcie_replay": (7, NOW)}, "mlx5_0/1": {"counters/x": (0, NOW - 1)}})
    assert Baseline.from_json(json.loads(json.dumps(b.to_json("gpus"))), "gpus", "nvml") == b
    assert Baseline.from_json(None, "gpus", "nvml") == Baseline() == Baseline.from_json({}, "gpus", "nvml")


@pytest.mark.parametrize("bad", [
    {"version": 2, "gpus": {}},
    {"version": 1, "boot_id": 7},
    {"version": 1, "gpus": {"GPU-1": {"pcie_replay": [-1, NOW]}}},
    {"version": 1, "gpus": {"GPU-1": {"pcie_replay": [True, NOW]}}},
    {"version": 1, "gpus": {"GPU-1": {"pcie_replay": [1, "now"]}}},
    {"version": 1, "gpus": {"GPU-1": {"pcie_replay": [1]}}},
    {"version": 1, "gpus": {"GPU-1": "x"}},
    {"version": 1, "gpus": ["GPU-1"]},
])
def test_a_bad_saved_baseline_is_ignored_with_a_warning(bad, caplog):
    with caplog.at_level(logging.WARNING):
        assert Baseline.from_json(bad, "gpus", "nvml") == Baseline()
    assert "nvml: ignoring saved counter baseline" in caplog.text


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=12)


@given(st.dictionaries(st.sampled_from(["version", "boot_id", "gpus", "x"]), json_values, max_size=4))
def test_any_saved_document_loads_or_is_ignored_never_raises(doc):
    b = Baseline.from_json(doc, "gpus", "nvml")
    assert all(isinstance(v, int) and v >= 0 for counters in b.groups.values() for v, _ in counters.values())


def test_another_boot_drops_the_baseline():
    b = Baseline(boot_id="boot-1", groups={"GPU-1": {"pcie_replay": (7, NOW)}})
    assert b.on_boot("boot-1", "nvml") is b
    assert b.on_boot("boot-2", "nvml") == Baseline(boot_id="boot-2")


def read(sample: NvmlSample, baseline: Baseline, t: float, boot: str = "boot-1") -> tuple[NvmlSample, Baseline]:
    return with_deltas(sample, baseline, boot, t)


def test_nvml_deltas_from_the_second_reading_on():
    first, b = read(nvml(gpu(0, ecc_uncorrected_volatile=2, pcie_replay=None, nvlink_errors={"link0.replay": 1})), Baseline(), NOW)
    assert first.time == NOW
    assert first.gpus[0].counters == {"ecc_uncorrected_volatile": CounterDelta(2, None, None),
                                      "nvlink/link0.replay": CounterDelta(1, None, None)}
    second, b = read(nvml(gpu(0, ecc_uncorrected_volatile=5, pcie_replay=3, nvlink_errors={"link0.replay": 1})), b, NOW + 10)
    assert second.gpus[0].counters == {"ecc_uncorrected_volatile": CounterDelta(5, 3, 10.0), "pcie_replay": CounterDelta(3, None, None),
                                       "nvlink/link0.replay": CounterDelta(1, 0, 10.0)}
    # a GPU reset clears the volatile counters: a reset, not a negative increase
    third, _ = read(nvml(gpu(0, ecc_uncorrected_volatile=0)), b, NOW + 20)
    assert third.gpus[0].counters["ecc_uncorrected_volatile"] == CounterDelta(0, None, 10.0, reset=True)


def test_a_counter_that_could_not_be_read_keeps_its_baseline():
    _, b = read(nvml(gpu(0, pcie_replay=4)), Baseline(), NOW)
    _, b = read(nvml(gpu(0, pcie_replay=None, errors={"pcie_replay": "Unknown Error"})), b, NOW + 10)
    later, _ = read(nvml(gpu(0, pcie_replay=9)), b, NOW + 20)
    assert later.gpus[0].counters["pcie_replay"] == CounterDelta(9, 5, 20.0)  # spans the bad tick


def test_lost_and_absent_gpus_keep_their_baseline_for_a_while():
    _, b = read(nvml(gpu(0, pcie_replay=4), gpu(1, pcie_replay=1)), Baseline(), NOW)
    lost, b = read(nvml(gpu(0, pcie_replay=4), GpuSample(index=1, lost=True)), b, NOW + 10)
    assert lost.gpus[1].counters == {}
    _, b = read(nvml(gpu(0, pcie_replay=4)), b, NOW + 20)  # GPU 1 fell off the bus and is gone
    back, b = read(nvml(gpu(0, pcie_replay=4), gpu(1, pcie_replay=6)), b, NOW + 30)
    assert back.gpus[1].counters["pcie_replay"] == CounterDelta(6, 5, 30.0)
    _, b = read(nvml(gpu(0, pcie_replay=4)), b, NOW + 30 + BASELINE_MAX_AGE_S)
    assert set(b.groups) == {"GPU-00000000"}  # a GPU not read for a week is forgotten


def test_a_failed_collection_moves_no_baseline_and_a_reboot_drops_it():
    _, b = read(nvml(gpu(0, pcie_replay=4)), Baseline(), NOW)
    failed, b2 = read(NvmlSample(status="error", error_kind="timeout", detail="hung"), b, NOW + 10)
    assert b2 == b and failed.time == NOW + 10
    after_reboot, b3 = read(nvml(gpu(0, pcie_replay=9)), b, NOW + 20, boot="boot-2")
    assert after_reboot.gpus[0].counters["pcie_replay"] == CounterDelta(9, None, None)
    assert b3.boot_id == "boot-2"
