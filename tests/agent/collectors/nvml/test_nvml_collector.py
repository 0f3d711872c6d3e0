"""NVML collector against the fake libnvidia-ml.so.1, through pynvml's real ctypes path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from healthd.agent.collectors.nvml import LIBRARY_MISSING_DETAIL
from healthd.model import CounterDelta
from tests.support.fake_nvml import (
    build_fake_nvml,
    fake_nvml_env,
    gpu_bus_id,
    gpu_serial,
    gpu_uuid,
    healthy_node,
    write_nvml_config,
)

DGX_H100_BUS_IDS = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
]
NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")


def nvml_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "healthd-nvml" and t.is_alive()]


def wait_for_workers(deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while nvml_threads():
        assert time.monotonic() < end, "NVML worker thread never returned"
        time.sleep(0.02)


# --------------------------------------------------------------------------- healthy node


def test_healthy_node_reads_every_identity_and_counter(nvml_config, make_collector):
    write_nvml_config(nvml_config, healthy_node(8), driver_version="550.54.15")
    sample = make_collector(expected_gpus=8).collect(time.time())

    assert sample.status == "ok", sample.detail
    assert sample.detail == ""
    assert sample.count == 8
    assert sample.driver_version == "550.54.15"
    assert sample.nvml_version == "12.550.54.15"
    assert [g.index for g in sample.gpus] == list(range(8))
    assert [g.bus_id for g in sample.gpus] == DGX_H100_BUS_IDS
    assert len({g.uuid for g in sample.gpus}) == 8
    assert len({g.serial for g in sample.gpus}) == 8
    for i, gpu in enumerate(sample.gpus):
        assert gpu.name == "NVIDIA H100 80GB HBM3"
        assert gpu.uuid == gpu_uuid(i) and gpu.uuid.startswith("GPU-")
        assert gpu.serial == gpu_serial(i)
        assert not gpu.lost and gpu.lost_detail is None
        assert gpu.temperature_c == 31 + i
        assert gpu.margin_c == 56 - i
        assert gpu.slowdown_threshold_c == 87
        assert gpu.clock_event_reasons == 0x1
        assert (gpu.ecc_corrected_volatile, gpu.ecc_uncorrected_volatile) == (0, 0)
        assert (gpu.ecc_corrected_aggregate, gpu.ecc_uncorrected_aggregate) == (0, 0)
        assert (gpu.remap_corrected, gpu.remap_uncorrected) == (0, 0)
        assert gpu.remap_pending is False and gpu.remap_failure is False
        assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pending) == (0, 0, False)
        assert gpu.pcie_replay == 0
        assert (gpu.pcie_gen, gpu.pcie_gen_max, gpu.pcie_width, gpu.pcie_width_max) == (5, 5, 16, 16)
        assert gpu.nvlink_errors == {
            f"link{link}.{c}": 0 for link in range(18) for c in NVLINK_COUNTERS
        }
        assert gpu.no_data == ()
        assert dict(gpu.errors) == {}


def test_fewer_gpus_than_expected_is_stated_not_judged(nvml_config, make_collector):
    write_nvml_config(nvml_config, healthy_node(7))
    sample = make_collector(expected_gpus=8).collect(time.time())
    assert sample.status == "ok"
    assert sample.count == 7
    assert sample.detail == "7 of 8 expected GPUs visible to NVML"


# --------------------------------------------------------------------------- memory health


def test_pending_row_remap(nvml_config, make_collector):
    gpus = healthy_node(8)
    gpus[2].update({"remapped_rows.uncorrected": 1, "remapped_rows.pending": 1, "ecc.uncorrected.aggregate": 1})
    write_nvml_config(nvml_config, gpus)
    sample = make_collector().collect(time.time())
    gpu = sample.gpus[2]
    assert (gpu.remap_corrected, gpu.remap_uncorrected) == (0, 1)
    assert gpu.remap_pending is True
    assert gpu.remap_failure is False
    assert gpu.ecc_uncorrected_aggregate == 1
    assert all(g.remap_pending is False for g in sample.gpus if g.index != 2)


def test_remap_failure(nvml_config, make_collector):
    gpus = healthy_node(8)
    gpus[6].update({"remapped_rows.corrected": 3, "remapped_rows.uncorrected": 9, "remapped_rows.failure": 1})
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[6]
    assert gpu.remap_failure is True
    assert gpu.remap_pending is False
    assert (gpu.remap_corrected, gpu.remap_uncorrected) == (3, 9)


def test_double_bit_ecc_spike_between_two_collects(nvml_config, make_collector):
    gpus = healthy_node(8)
    gpus[4].update({"ecc.corrected.volatile": 12, "ecc.corrected.aggregate": 40})
    gpus[4]["ecc.uncorrected.aggregate"] = 1  # one DBE in an earlier boot
    write_nvml_config(nvml_config, gpus)
    collector = make_collector()
    before = collector.collect(time.time()).gpus[4]
    assert (before.ecc_corrected_volatile, before.ecc_uncorrected_volatile) == (12, 0)
    assert (before.ecc_corrected_aggregate, before.ecc_uncorrected_aggregate) == (40, 1)

    gpus[4].update({"ecc.uncorrected.volatile": 2, "ecc.uncorrected.aggregate": 3})
    write_nvml_config(nvml_config, gpus)
    after = collector.collect(time.time())
    assert after.gpus[4].ecc_uncorrected_volatile == 2
    assert after.gpus[4].ecc_uncorrected_aggregate == 3
    assert (after.gpus[4].ecc_corrected_volatile, after.gpus[4].ecc_corrected_aggregate) == (12, 40)
    assert [g.ecc_uncorrected_volatile for g in after.gpus if g.index != 4] == [0] * 7


def test_retired_pages_use_the_two_call_protocol(nvml_config, make_collector):
    gpus = healthy_node(2)
    gpus[1].update({"retired_pages.sbe": 3, "retired_pages.dbe": 1, "retired_pages_pending": 1})
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[1]
    assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pending) == (3, 1, True)


def test_compute_processes_through_the_two_call_protocol(nvml_config, make_collector):
    """pynvml asks for the count with a NULL array, then passes an array of twice that plus five."""
    gpus = healthy_node(4)
    gpus[1]["processes"] = ["4242:1048576", "77", "4242"]  # the same PID twice (two contexts): once
    gpus[2]["processes"] = [str(1000 + i) for i in range(40)]
    gpus[3]["processes.error"] = 3  # NotSupported
    write_nvml_config(nvml_config, gpus)
    got = make_collector().collect(time.time()).gpus
    assert got[0].compute_pids == ()
    assert got[1].compute_pids == (77, 4242)
    assert got[2].compute_pids == tuple(range(1000, 1040))
    assert got[3].compute_pids is None and "compute_pids" in got[3].no_data


# --------------------------------------------------------------------------- links and clocks


def test_nvlink_counters_only_for_active_links(nvml_config, make_collector):
    gpus = healthy_node(2)
    gpus[1].update({"nvlink.down": [5, 17], "nvlink3.replay": 7, "nvlink3.crc_flit": 2})
    write_nvml_config(nvml_config, gpus)
    nvlink = make_collector().collect(time.time()).gpus[1].nvlink_errors
    assert nvlink["link3.replay"] == 7
    assert nvlink["link3.crc_flit"] == 2
    assert nvlink["link3.recovery"] == 0
    assert not any(k.startswith(("link5.", "link17.")) for k in nvlink)
    assert len(nvlink) == 16 * 4


def test_pcie_downtrain_replays_and_hw_slowdown(nvml_config, make_collector):
    gpus = healthy_node(8)
    gpus[7].update({"pcie_gen": 3, "pcie_width": 8, "pcie_replay": 41, "clock_reasons": 0x48})
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[7]
    assert (gpu.pcie_gen, gpu.pcie_gen_max, gpu.pcie_width, gpu.pcie_width_max) == (3, 5, 8, 16)
    assert gpu.pcie_replay == 41
    assert gpu.clock_event_reasons == 0x48  # HwSlowdown | HwThermalSlowdown


def test_clock_reasons_fall_back_to_throttle_reasons(nvml_config, make_collector):
    gpus = healthy_node(1)
    gpus[0].update({"clock_reasons": 0x8, "clocks_event_reasons.error": 13})  # FunctionNotFound
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[0]
    assert gpu.clock_event_reasons == 0x8
    assert gpu.no_data == ()


def test_negative_thermal_margin(nvml_config, make_collector):
    gpus = healthy_node(1)
    gpus[0].update({"temperature": 91, "margin": -4})
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[0]
    assert (gpu.temperature_c, gpu.margin_c) == (91, -4)


# --------------------------------------------------------------------------- lost GPUs


def test_gpu_lost_mid_run_keeps_its_last_known_identity(nvml_config, make_collector):
    gpus = healthy_node(8)
    write_nvml_config(nvml_config, gpus)
    collector = make_collector()
    first = collector.collect(time.time())
    assert first.status == "ok" and not any(g.lost for g in first.gpus)

    gpus[5]["lost"] = 1
    write_nvml_config(nvml_config, gpus)
    second = collector.collect(time.time())
    assert second.status == "ok"
    assert second.count == 8
    lost = second.gpus[5]
    assert lost.lost is True
    assert lost.lost_detail == "nvmlDeviceGetHandleByIndex: GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    assert (lost.uuid, lost.serial, lost.bus_id) == (gpu_uuid(5), gpu_serial(5), gpu_bus_id(5))
    assert lost.temperature_c is None and lost.remap_pending is None
    assert [g.index for g in second.gpus if g.lost] == [5]
    assert second.gpus[6].temperature_c == 37


def test_gpu_lost_in_the_middle_of_its_reads(nvml_config, make_collector):
    gpus = healthy_node(3)
    gpus[1]["remapped_rows.error"] = 15
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[1]
    assert gpu.lost is True
    assert gpu.lost_detail.startswith("nvmlDeviceGetRemappedRows: GPU is lost")
    assert (gpu.uuid, gpu.bus_id) == (gpu_uuid(1), gpu_bus_id(1))  # read before it went


# --------------------------------------------------------------------------- no data / errors


def test_not_supported_fields_are_no_data(nvml_config, make_collector):
    gpus = healthy_node(4)
    for key in ("remapped_rows.corrected", "margin", "nvlink.links"):
        del gpus[3][key]  # absent value key: the fake answers NotSupported
    gpus[3]["ecc.error"] = 3  # ECC disabled: NotSupported
    write_nvml_config(nvml_config, gpus)
    sample = make_collector().collect(time.time())
    assert sample.status == "ok"
    gpu = sample.gpus[3]
    assert set(gpu.no_data) == {
        "margin_c",
        "ecc_corrected_volatile",
        "ecc_uncorrected_volatile",
        "ecc_corrected_aggregate",
        "ecc_uncorrected_aggregate",
        "remap_corrected",
        "remap_uncorrected",
        "remap_pending",
        "remap_failure",
        "nvlink_errors",
    }
    assert gpu.margin_c is None and gpu.remap_pending is None and gpu.ecc_corrected_volatile is None
    assert gpu.nvlink_errors == {}
    assert dict(gpu.errors) == {}
    assert gpu.temperature_c == 34 and gpu.pcie_gen == 5  # the other reads still happened
    assert sample.gpus[2].no_data == ()


def test_other_read_errors_are_recorded_per_field(nvml_config, make_collector):
    gpus = healthy_node(2)
    gpus[1]["pcie_replay.error"] = 999  # NVML_ERROR_UNKNOWN
    gpus[1]["nvlink2.replay"] = 4
    write_nvml_config(nvml_config, gpus)
    gpu = make_collector().collect(time.time()).gpus[1]
    assert dict(gpu.errors) == {"pcie_replay": "nvmlDeviceGetPcieReplayCounter: Unknown Error"}
    assert gpu.pcie_replay is None
    assert gpu.no_data == ()
    assert gpu.nvlink_errors["link2.replay"] == 4 and gpu.pcie_width == 16


# --------------------------------------------------------------------------- init failures


def test_driver_not_loaded_then_recovers_on_next_collect(nvml_config, make_collector):
    write_nvml_config(nvml_config, healthy_node(8), init_error=9)
    collector = make_collector()
    sample = collector.collect(time.time())
    assert sample.status == "error"
    assert sample.error_kind == "driver_not_loaded"
    assert "Driver Not Loaded" in sample.detail
    assert sample.gpus == () and sample.count is None

    write_nvml_config(nvml_config, healthy_node(8))  # modprobe nvidia
    again = collector.collect(time.time())
    assert again.status == "ok" and again.count == 8


def test_other_init_failure(nvml_config, make_collector):
    write_nvml_config(nvml_config, healthy_node(8), init_error=18)
    sample = make_collector().collect(time.time())
    assert sample.status == "error"
    assert sample.error_kind == "init_failed"
    assert sample.detail == "nvmlInit: RM has detected an NVML/RM version mismatch."


def test_device_count_failure_reinitialises_next_collect(
    nvml_config, make_collector, fake_nvml_loaded
):
    write_nvml_config(nvml_config, healthy_node(8), **{"count.error": 9})
    collector = make_collector()
    inits = fake_nvml_loaded.fake_nvml_init_calls()
    sample = collector.collect(time.time())
    assert (sample.status, sample.error_kind) == ("error", "driver_not_loaded")
    assert sample.detail == "nvmlDeviceGetCount: Driver Not Loaded"
    assert fake_nvml_loaded.fake_nvml_init_calls() == inits + 1

    write_nvml_config(nvml_config, healthy_node(8))
    assert collector.collect(time.time()).count == 8
    assert fake_nvml_loaded.fake_nvml_init_calls() == inits + 2  # initialised afresh
    assert collector.collect(time.time()).count == 8
    assert fake_nvml_loaded.fake_nvml_init_calls() == inits + 2  # and then kept


# --------------------------------------------------------------------------- hung driver calls


def test_hung_call_times_out_and_no_second_worker_starts(nvml_config, make_collector):
    wait_for_workers()
    gpus = healthy_node(8)
    gpus[0]["temperature.sleep_ms"] = 1500
    write_nvml_config(nvml_config, gpus)
    collector = make_collector(timeout_s=0.3)

    start = time.monotonic()
    first = collector.collect(time.time())
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 1.0  # the timeout plus scheduling slack
    assert (first.status, first.error_kind) == ("error", "timeout")
    assert first.detail == "NVML call nvmlDeviceGetTemperature on GPU 0 did not return within 0.3s"
    assert len(nvml_threads()) == 1

    start = time.monotonic()
    second = collector.collect(time.time())
    assert time.monotonic() - start < 0.2  # answered at once, no new wait
    assert (second.status, second.error_kind) == ("error", "timeout")
    assert second.detail.startswith("NVML call nvmlDeviceGetTemperature on GPU 0 still stuck after")
    assert len(nvml_threads()) == 1  # still only the stuck one

    write_nvml_config(nvml_config, healthy_node(8))
    wait_for_workers()
    third = collector.collect(time.time())
    assert third.status == "ok"
    assert third.gpus[0].temperature_c == 31


def test_hung_init_times_out_and_init_is_kept_once_it_returns(nvml_config, make_collector):
    wait_for_workers()
    write_nvml_config(nvml_config, healthy_node(2), **{"init.sleep_ms": 800})
    collector = make_collector(timeout_s=0.2)
    sample = collector.collect(time.time())
    assert (sample.status, sample.error_kind) == ("error", "timeout")
    assert sample.detail == "NVML call nvmlInit did not return within 0.2s"
    wait_for_workers()
    # init is not repeated: a config that would now make nvmlInit fail does not matter
    write_nvml_config(nvml_config, healthy_node(2), init_error=9)
    assert collector.collect(time.time()).status == "ok"


# --------------------------------------------------------------------------- other libraries


def test_missing_symbols_are_no_data_not_a_crash(tmp_path: Path, collect_in_subprocess):
    omit = [
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetMarginTemperature",
        "nvmlDeviceGetCurrentClocksEventReasons",  # pre-R535 driver: throttle-reason name only
    ]
    lib_dir = build_fake_nvml(tmp_path / "lib", omit=omit)
    config = write_nvml_config(tmp_path / "nvml.conf", healthy_node(2))
    sample = collect_in_subprocess(fake_nvml_env(lib_dir, config))
    assert sample["status"] == "ok"
    for gpu in sample["gpus"]:
        assert set(gpu["no_data"]) == {
            "margin_c",
            "remap_corrected",
            "remap_uncorrected",
            "remap_pending",
            "remap_failure",
        }
        assert gpu["remap_pending"] is None and gpu["margin_c"] is None
        assert gpu["clock_event_reasons"] == 0x1  # read through the old symbol
        assert gpu["errors"] == {}
        assert gpu["temperature_c"] is not None


def test_no_library_is_no_data(tmp_path: Path, collect_in_subprocess):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # an empty directory
    sample = collect_in_subprocess(env, mode="require-no-library")
    assert sample["status"] == "no_data"
    assert sample["detail"] == LIBRARY_MISSING_DETAIL
    assert sample["error_kind"] is None
    assert sample["gpus"] == []


def _nvml_include_dir() -> str | None:
    """NVML_INCLUDE_DIR, else the header the test extra `nvidia-nvml-dev-cu12` installs."""
    if os.environ.get("NVML_INCLUDE_DIR"):
        return os.environ["NVML_INCLUDE_DIR"]
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "nvml_dev/include/nvml.h").is_file():
            return str(Path(root) / "nvml_dev/include")
    return None


def test_fake_matches_nvidia_header_when_available(tmp_path: Path):
    """Type-check the fake against NVIDIA's nvml.h (pynvml sets no argtypes, so a wrong signature
    would corrupt memory silently). `make test` installs the header package (x86_64 and aarch64);
    elsewhere point NVML_INCLUDE_DIR at an include directory holding nvml.h."""
    include = _nvml_include_dir()
    if not include or not (Path(include) / "nvml.h").is_file():
        pytest.skip("no nvml.h: install nvidia-nvml-dev-cu12 or set NVML_INCLUDE_DIR")
    assert (build_fake_nvml(tmp_path, nvml_include=Path(include)) / "libnvidia-ml.so.1").is_file()


# --------------------------------------------------------------------------- a real driver


_REAL_LIBRARY_PROBE = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"


@pytest.mark.realgpu
def test_real_driver(collect_in_subprocess):
    # A subprocess: this pytest process may already hold the fake under the same SONAME.
    env = {k: v for k, v in os.environ.items() if k != "FAKE_NVML_CONFIG"}
    probe = subprocess.run([sys.executable, "-c", _REAL_LIBRARY_PROBE], env=env, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no real libnvidia-ml.so.1 on this machine")
    sample = collect_in_subprocess(env, timeout_s=30.0)
    print(sample)
    assert sample["status"] == "ok", sample["detail"]
    assert sample["count"] >= 1 and len(sample["gpus"]) == sample["count"]
    assert sample["driver_version"]
    for gpu in sample["gpus"]:
        assert not gpu["lost"], gpu["lost_detail"]
        assert gpu["uuid"].startswith("GPU-")
        assert gpu["bus_id"] and gpu["bus_id"].startswith("0000")
        assert gpu["name"] and "NVIDIA" in gpu["name"]
        assert isinstance(gpu["temperature_c"], int)
        assert isinstance(gpu["pcie_width_max"], int)
        assert gpu["errors"] == {}, gpu["errors"]


# --------------------------------------------------------------------------- counter deltas


def test_counter_deltas_continue_across_a_restart_and_stop_at_a_reboot(nvml_config, make_collector, tmp_path: Path):
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    gpus = healthy_node(2)
    write_nvml_config(nvml_config, gpus)
    first = make_collector(boot_id_path=str(boot))
    sample = first.collect(1000.0)
    assert sample.time == 1000.0
    assert sample.gpus[0].counters["ecc_uncorrected_volatile"] == CounterDelta(0, None, None)
    assert set(sample.gpus[1].counters) == {"ecc_uncorrected_volatile", "ecc_corrected_volatile", "pcie_replay",
                                            *(f"nvlink/link{n}.{c}" for n in range(18) for c in NVLINK_COUNTERS)}

    gpus[1].update({"ecc.uncorrected.volatile": 2, "pcie_replay": 7, "nvlink5.crc_flit": 3})
    write_nvml_config(nvml_config, gpus)
    g = first.collect(1010.0).gpus[1]
    assert (g.counters["ecc_uncorrected_volatile"], g.counters["pcie_replay"], g.counters["nvlink/link5.crc_flit"]) == (
        CounterDelta(2, 2, 10.0), CounterDelta(7, 7, 10.0), CounterDelta(3, 3, 10.0))

    # the agent restarts: the saved baseline goes through JSON text into a new collector
    gpus[1]["ecc.uncorrected.volatile"] = 3
    write_nvml_config(nvml_config, gpus)
    second = make_collector(boot_id_path=str(boot), baseline=json.loads(json.dumps(first.state())))
    assert second.collect(1030.0).gpus[1].counters["ecc_uncorrected_volatile"] == CounterDelta(3, 1, 20.0)

    # after a reboot the counters started again: no delta against the old boot's values
    boot.write_text("boot-2\n")
    gpus[1]["ecc.uncorrected.volatile"] = 5
    write_nvml_config(nvml_config, gpus)
    assert second.collect(1040.0).gpus[1].counters["ecc_uncorrected_volatile"] == CounterDelta(5, None, None)


def test_a_collection_that_timed_out_moves_no_baseline(nvml_config, make_collector, tmp_path: Path):
    wait_for_workers()
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    gpus = healthy_node(1)
    write_nvml_config(nvml_config, gpus)
    collector = make_collector(timeout_s=0.3, boot_id_path=str(boot))
    collector.collect(1000.0)
    # the driver hangs after reading ECC 4: that read is thrown away with the timed-out collection
    gpus[0].update({"ecc.uncorrected.volatile": 4, "pcie_replay.sleep_ms": 800})
    write_nvml_config(nvml_config, gpus)
    assert collector.collect(1010.0).error_kind == "timeout"
    wait_for_workers()
    del gpus[0]["pcie_replay.sleep_ms"]
    gpus[0]["ecc.uncorrected.volatile"] = 6
    write_nvml_config(nvml_config, gpus)
    assert collector.collect(1020.0).gpus[0].counters["ecc_uncorrected_volatile"] == CounterDelta(6, 6, 20.0)
