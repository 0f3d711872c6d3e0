"""What a collection costs in NVML calls: link states in one field-value call per GPU, NVLink error
counters only every `nvlink_counter_interval_s`, and the same findings either way."""

from __future__ import annotations

import time
from pathlib import Path

from healthd.model import CounterDelta
from tests.support.fake_nvml import (
    CallCounter,
    build_fake_nvml,
    fake_nvml_env,
    healthy_node,
    write_nvml_config,
)

NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")


def test_counters_and_link_states_come_in_field_value_calls(tmp_path: Path, fake_nvml_dir: Path, collect_in_subprocess):
    gpus = healthy_node(2)
    gpus[1].update({"nvlink.down": [2], "nvlink3.replay": 5})
    config = write_nvml_config(tmp_path / "nvml.conf", gpus)
    calls = CallCounter(tmp_path / "calls")
    sample = collect_in_subprocess({**fake_nvml_env(fake_nvml_dir, config), **calls.env()})
    counts = calls.read()
    assert counts["field_values"] == 2 * 2  # per GPU: the counters, the link states
    assert not {"nvlink_state", "ecc", "pcie_replay", "remapped_rows", "retired_pages", "retired_pages_pending"} & set(counts)
    assert sample["gpus"][0]["ecc_corrected_volatile"] == 0 and sample["gpus"][0]["remap_pending"] is False
    assert sample["gpus"][0]["retired_pages_sbe"] == 0 and sample["gpus"][0]["no_data"] == []
    assert counts["nvlink_error_counter"] == (18 + 17) * 4
    nvlink = sample["gpus"][1]["nvlink_errors"]
    assert nvlink["link3.replay"] == 5 and not any(k.startswith("link2.") for k in nvlink)
    assert len(nvlink) == 17 * 4


def test_a_driver_without_field_values_reads_each_link_state(tmp_path: Path, collect_in_subprocess):
    lib_dir = build_fake_nvml(tmp_path / "lib", omit=["nvmlDeviceGetFieldValues"])
    gpus = healthy_node(1)
    gpus[0].update({"nvlink.down": [2], "nvlink3.crc_data": 4})
    config = write_nvml_config(tmp_path / "nvml.conf", gpus)
    calls = CallCounter(tmp_path / "calls")
    sample = collect_in_subprocess({**fake_nvml_env(lib_dir, config), **calls.env()})
    gpu = sample["gpus"][0]
    assert gpu["errors"] == {} and "nvlink_errors" not in gpu["no_data"]
    assert gpu["nvlink_errors"]["link3.crc_data"] == 4 and len(gpu["nvlink_errors"]) == 17 * 4
    assert calls.read()["nvlink_state"] == 19  # 18 links, then InvalidArgument past the last


def test_a_link_state_error_is_recorded_per_link(nvml_config, make_collector):
    gpus = healthy_node(1)
    gpus[0]["nvlink_state.error"] = 999
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[0]
    assert gpu.nvlink_errors == {}
    assert set(gpu.errors) == {f"nvlink_errors.link{n}" for n in range(36)}


def test_nvlink_counters_are_read_at_their_own_interval(nvml_config, make_collector):
    gpus = healthy_node(1)
    write_nvml_config(nvml_config, gpus)
    collector = make_collector(nvlink_counter_interval_s=60.0)
    first = collector.collect(1000.0).gpus[0]
    assert len(first.nvlink_errors) == 18 * 4

    gpus[0].update({"nvlink4.crc_flit": 3, "nvlink.down": [9]})
    write_nvml_config(nvml_config, gpus)
    between = collector.collect(1030.0).gpus[0]
    # not due: no counters, and that is neither missing data nor an error; the rest is read
    assert between.nvlink_errors == {} and not any(k.startswith("nvlink/") for k in between.counters)
    assert "nvlink_errors" not in between.no_data and between.errors == {}
    assert between.counters["pcie_replay"] == CounterDelta(0, 0, 30.0)

    due = collector.collect(1060.0).gpus[0]
    assert due.counters["nvlink/link4.crc_flit"] == CounterDelta(3, 3, 60.0)  # spans the interval
    assert len(due.nvlink_errors) == 17 * 4


def test_a_clock_that_went_back_reads_the_counters(nvml_config, make_collector):
    write_nvml_config(nvml_config, healthy_node(1))
    collector = make_collector(nvlink_counter_interval_s=60.0)
    collector.collect(1000.0)
    assert len(collector.collect(900.0).gpus[0].nvlink_errors) == 18 * 4


def test_static_fields_are_read_once_per_initialisation(nvml_config, make_collector):
    gpus = healthy_node(1)
    write_nvml_config(nvml_config, gpus)
    collector = make_collector()
    collector.collect(1000.0)

    gpus[0].update({"name.error": 999, "threshold.slowdown": 80, "pcie_gen_max": 4, "temperature": 70})
    write_nvml_config(nvml_config, gpus)
    g = collector.collect(1010.0).gpus[0]
    assert (g.name, g.slowdown_threshold_c, g.pcie_gen_max) == ("NVIDIA H100 80GB HBM3", 87, 5)
    assert g.errors == {} and g.temperature_c == 70  # everything else is read on every tick

    write_nvml_config(nvml_config, gpus, **{"count.error": 999})  # a node-wide failure: NVML shut down
    assert collector.collect(1020.0).status == "error"
    write_nvml_config(nvml_config, gpus)
    g = collector.collect(1030.0).gpus[0]  # initialised afresh: read again
    assert (g.name, g.slowdown_threshold_c, g.pcie_gen_max) == (None, 80, 4)
    assert set(g.errors) == {"name"}


def test_counter_fields_carry_the_values_and_fall_back_where_not_answered(nvml_config, make_collector):
    gpus = healthy_node(2)
    gpus[0].update({"ecc.uncorrected.volatile": 3, "remapped_rows.pending": 1, "retired_pages.dbe": 2,
                    "retired_pages_pending": 1, "pcie_replay": 9})
    gpus[1]["pcie_replay.error"] = 999  # answered per field: read again by its own function
    write_nvml_config(nvml_config, gpus)
    g0, g1 = make_collector().collect(time.time()).gpus
    assert (g0.ecc_uncorrected_volatile, g0.remap_pending, g0.retired_pages_dbe, g0.retired_pending, g0.pcie_replay) == (
        3, True, 2, True, 9)
    assert g1.errors == {"pcie_replay": "nvmlDeviceGetPcieReplayCounter: Unknown Error"}
