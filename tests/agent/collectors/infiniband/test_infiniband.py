"""InfinibandCollector against fake sysfs trees (tests/support/ib_tree.py) with real file reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from healthd.agent.collectors.infiniband import (
    PMA_WIDTH_BITS,
    InfinibandCollector,
    parse_counter,
    parse_rate,
    parse_state,
)
from healthd.model import CounterDelta
from tests.support import ib_tree
from tests.support.ib_tree import (
    DEFAULT_COUNTERS,
    DEFAULT_HW_COUNTERS,
    flap_step,
    make_ndr_node,
    make_port,
    make_unreadable,
    set_counter,
    set_state,
)

BOOT_A = "0f0e5c1e-aaaa-4c5d-9e1f-000000000001"
BOOT_B = "0f0e5c1e-bbbb-4c5d-9e1f-000000000002"
COUNTERS_PER_PORT = len(DEFAULT_COUNTERS) + len(DEFAULT_HW_COUNTERS) - 1  # lifespan is skipped


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "sys" / "class" / "infiniband"


@pytest.fixture
def boot(tmp_path: Path) -> Path:
    p = tmp_path / "boot_id"
    p.write_text(BOOT_A + "\n")
    return p


def collector(root: Path, boot: Path, baseline=None) -> InfinibandCollector:
    return InfinibandCollector(sysfs_root=str(root), boot_id_path=str(boot), baseline=baseline)


def port(sample, dev: str, n: int = 1):
    (p,) = [p for p in sample.ports if p.device == dev and p.port == n]
    return p


# --------------------------------------------------------------------------- pure parsers


@pytest.mark.parametrize(
    "text,rate",
    [
        ("400 Gb/sec (4X NDR)\n", 400.0),
        ("2.5 Gb/sec (1X SDR)\n", 2.5),
        ("10 Gb/sec (4X SDR)\n", 10.0),
        ("200 Gb/sec (2X NDR)\n", 200.0),
        ("100 Gb/sec (4X EDR)", 100.0),
        ("56 Gb/sec (4X FDR)\n", 56.0),
    ],
)
def test_parse_rate(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["", "\n", "fast\n", "Gb/sec (4X NDR)\n", "400 GB/s\n", "400Gb/secx\n"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.parametrize(
    "text,state",
    [
        ("4: ACTIVE\n", "ACTIVE"),
        ("1: DOWN\n", "DOWN"),
        ("5: ACTIVE_DEFER\n", "ACTIVE_DEFER"),
        ("5: LinkUp\n", "LinkUp"),
        ("7: Phy Test\n", "Phy Test"),
        ("4: PortConfigurationTraining\n", "PortConfigurationTraining"),
    ],
)
def test_parse_state(text, state):
    assert parse_state(text) == state


@pytest.mark.parametrize("text", ["", "ACTIVE\n", "4:\n", ": ACTIVE\n", "x: ACTIVE\n"])
def test_parse_state_rejects(text):
    with pytest.raises(ValueError):
        parse_state(text)


@pytest.mark.parametrize("text,value", [("0\n", 0), ("65535\n", 65535), ("18446744073709551615\n", 2**64 - 1)])
def test_parse_counter(text, value):
    assert parse_counter(text) == value


@pytest.mark.parametrize("text", ["", "\n", "-1\n", "0x10\n", "N/A\n", "1 2\n", "+5\n", "1_000\n", "１２\n", "1.5\n"])
def test_parse_counter_rejects(text):
    with pytest.raises(ValueError):
        parse_counter(text)


def test_width_table_matches_the_kernel():
    assert {n for n, b in PMA_WIDTH_BITS.items() if b == 16} == {
        "symbol_error", "port_rcv_errors", "port_rcv_remote_physical_errors",
        "port_rcv_switch_relay_errors", "port_xmit_discards", "VL15_dropped",
    }
    assert {n for n, b in PMA_WIDTH_BITS.items() if b == 8} == {
        "link_error_recovery", "link_downed", "port_xmit_constraint_errors", "port_rcv_constraint_errors",
    }
    assert {n for n, b in PMA_WIDTH_BITS.items() if b == 4} == {
        "local_link_integrity_errors", "excessive_buffer_overrun_errors",
    }
    assert PMA_WIDTH_BITS["port_xmit_wait"] == 32
    assert "port_xmit_data" not in PMA_WIDTH_BITS  # 32 or 64 bits: the file does not say


# --------------------------------------------------------------------------- scenarios


def test_no_hca(root, boot):
    ib_tree.scenario_no_hca(root)
    s = collector(root, boot).collect(1000.0)
    assert s.status == "no_data"
    assert s.detail == f"no InfiniBand HCA ({root} absent)"
    assert s.ports == ()
    assert s.boot_id == BOOT_A


def test_empty_class_dir_is_no_data(root, boot):
    root.mkdir(parents=True)
    s = collector(root, boot).collect(1000.0)
    assert (s.status, s.ports) == ("no_data", ())


def test_healthy_ndr_node(root, boot):
    ib_tree.scenario_healthy(root)
    s = collector(root, boot).collect(1000.0)
    assert s.status == "ok" and s.detail == ""
    assert [(p.device, p.port) for p in s.ports] == [(f"mlx5_{i}", 1) for i in range(8)]
    for p in s.ports:
        assert (p.state, p.phys_state, p.rate_gbps, p.link_layer, p.up) == ("ACTIVE", "LinkUp", 400.0, "InfiniBand", True)
        assert p.unreadable == {}
        assert len(p.counters) == COUNTERS_PER_PORT
        assert "hw_counters/lifespan" not in p.counters
        assert p.counters["counters/port_xmit_wait"] == CounterDelta(value=2_500_000_000, delta=None, window_s=None)
        assert p.counters["hw_counters/local_ack_timeout_err"] == CounterDelta(value=0, delta=None, window_s=None)
        assert all(c.delta is None and not c.saturated and not c.reset for c in p.counters.values())


def test_deltas_over_a_window(root, boot):
    make_ndr_node(root, ports=2)
    c = collector(root, boot)
    c.collect(1000.0)
    set_counter(root, "mlx5_1", 1, "symbol_error", 7)
    set_counter(root, "mlx5_1", 1, "port_xmit_data", DEFAULT_COUNTERS["port_xmit_data"] + 4_000_000)
    set_counter(root, "mlx5_1", 1, "local_ack_timeout_err", 3, hw=True)
    s = c.collect(1010.0)
    p = port(s, "mlx5_1")
    assert p.counters["counters/symbol_error"] == CounterDelta(value=7, delta=7, window_s=10.0)
    assert p.counters["counters/symbol_error"].rate_per_s == pytest.approx(0.7)
    assert p.counters["counters/port_xmit_data"].delta == 4_000_000
    assert p.counters["hw_counters/local_ack_timeout_err"] == CounterDelta(value=3, delta=3, window_s=10.0)
    assert p.counters["counters/link_downed"] == CounterDelta(value=0, delta=0, window_s=10.0)
    assert all(c.delta == 0 for c in port(s, "mlx5_0").counters.values())
    # the next window starts at the last reading
    set_counter(root, "mlx5_1", 1, "symbol_error", 10)
    s = c.collect(1040.0)
    assert port(s, "mlx5_1").counters["counters/symbol_error"] == CounterDelta(value=10, delta=3, window_s=30.0)


def test_port_down(root, boot):
    ib_tree.scenario_port_down(root)
    s = collector(root, boot).collect(1000.0)
    down = port(s, "mlx5_3")
    assert (down.state, down.phys_state, down.rate_gbps, down.up) == ("DOWN", "Disabled", 10.0, False)
    assert down.counters["counters/link_downed"].value == 1
    assert [p.up for p in s.ports] == [True, True, True, False, True, True, True, True]


def test_roce_port(root, boot):
    make_port(root, dev="mlx5_bond_0", link_layer="Ethernet", rate="100 Gb/sec (2X HDR)")
    (p,) = collector(root, boot).collect(1.0).ports
    assert (p.device, p.link_layer, p.rate_gbps) == ("mlx5_bond_0", "Ethernet", 100.0)


def test_devices_and_ports_in_natural_order(root, boot):
    for dev in ("mlx5_10", "mlx5_2", "mlx5_1"):
        make_port(root, dev=dev)
    make_port(root, dev="mlx5_1", port=2)
    s = collector(root, boot).collect(1.0)
    assert [(p.device, p.port) for p in s.ports] == [("mlx5_1", 1), ("mlx5_1", 2), ("mlx5_2", 1), ("mlx5_10", 1)]


def test_flapping_port(root, boot):
    ib_tree.scenario_flap(root)
    c = collector(root, boot)
    seen = []
    t = 1000.0
    s = c.collect(t)
    seen.append(port(s, "mlx5_5"))
    # down, up, down, up, down, up: the kernel bumps link_downed on each fall
    downs = 0
    for step in range(6):
        up = step % 2 == 1
        if not up:
            downs += 1
        flap_step(root, up=up, link_downed=downs)
        t += 10.0
        seen.append(port(c.collect(t), "mlx5_5"))
    assert [(p.state, p.phys_state) for p in seen] == [
        ("ACTIVE", "LinkUp"),
        ("DOWN", "Polling"),
        ("ACTIVE", "LinkUp"),
        ("DOWN", "Polling"),
        ("ACTIVE", "LinkUp"),
        ("DOWN", "Polling"),
        ("ACTIVE", "LinkUp"),
    ]
    assert [p.counters["counters/link_downed"].delta for p in seen] == [None, 1, 0, 1, 0, 1, 0]
    assert [p.counters["counters/link_downed"].value for p in seen] == [0, 1, 1, 2, 2, 3, 3]
    assert all(p.counters["counters/link_downed"].window_s in (None, 10.0) for p in seen)
    # the other ports never moved
    assert all(p.up for p in c.collect(t + 10).ports if p.device != "mlx5_5")


def test_reset_when_value_goes_down(root, boot):
    make_ndr_node(root, ports=1)
    c = collector(root, boot)
    set_counter(root, "mlx5_0", 1, "symbol_error", 500)
    c.collect(1000.0)
    set_counter(root, "mlx5_0", 1, "symbol_error", 2)  # perfquery -x -R, or a driver reload
    p = c.collect(1010.0).ports[0]
    assert p.counters["counters/symbol_error"] == CounterDelta(value=2, delta=None, window_s=10.0, reset=True)
    assert p.counters["counters/link_downed"] == CounterDelta(value=0, delta=0, window_s=10.0)
    set_counter(root, "mlx5_0", 1, "symbol_error", 5)
    p = c.collect(1020.0).ports[0]
    assert p.counters["counters/symbol_error"] == CounterDelta(value=5, delta=3, window_s=10.0)


def test_boot_id_change_takes_a_new_baseline(root, boot):
    make_ndr_node(root, ports=1)
    c = collector(root, boot)
    set_counter(root, "mlx5_0", 1, "symbol_error", 10)
    c.collect(1000.0)
    boot.write_text(BOOT_B + "\n")
    set_counter(root, "mlx5_0", 1, "symbol_error", 40)  # higher than before, but a different boot
    s = c.collect(1010.0)
    assert s.boot_id == BOOT_B
    assert s.ports[0].counters["counters/symbol_error"] == CounterDelta(value=40, delta=None, window_s=None)
    assert c.state()["boot_id"] == BOOT_B
    set_counter(root, "mlx5_0", 1, "symbol_error", 41)
    assert c.collect(1020.0).ports[0].counters["counters/symbol_error"] == CounterDelta(
        value=41, delta=1, window_s=10.0
    )


def test_baseline_survives_an_agent_restart(root, boot):
    make_ndr_node(root, ports=2)
    first = collector(root, boot)
    set_counter(root, "mlx5_1", 1, "symbol_error", 100)
    first.collect(1000.0)
    saved = json.loads(json.dumps(first.state()))  # what the agent writes to disk and reads back
    assert saved["boot_id"] == BOOT_A
    assert saved["ports"]["mlx5_1/1"]["counters/symbol_error"] == [100, 1000.0]
    first.close()

    set_counter(root, "mlx5_1", 1, "symbol_error", 160)
    second = collector(root, boot, baseline=saved)
    p = port(second.collect(1060.0), "mlx5_1")
    assert p.counters["counters/symbol_error"] == CounterDelta(value=160, delta=60, window_s=60.0)
    assert p.counters["counters/symbol_error"].rate_per_s == pytest.approx(1.0)


def test_restart_after_reboot_does_not_subtract(root, boot):
    make_ndr_node(root, ports=1)
    first = collector(root, boot)
    set_counter(root, "mlx5_0", 1, "symbol_error", 100)
    first.collect(1000.0)
    saved = json.loads(json.dumps(first.state()))
    boot.write_text(BOOT_B + "\n")
    set_counter(root, "mlx5_0", 1, "symbol_error", 150)
    p = collector(root, boot, baseline=saved).collect(2000.0).ports[0]
    assert p.counters["counters/symbol_error"] == CounterDelta(value=150, delta=None, window_s=None)


@pytest.mark.parametrize(
    "bad",
    [
        {"version": 99, "boot_id": BOOT_A, "ports": {}},
        {"version": 1, "boot_id": BOOT_A, "ports": {"mlx5_0/1": {"counters/symbol_error": "x"}}},
        {"version": 1, "boot_id": BOOT_A, "ports": {"mlx5_0/1": {"counters/symbol_error": [-1, 5.0]}}},
        {"version": 1, "boot_id": 7, "ports": {}},
        {"version": 1, "boot_id": BOOT_A, "ports": ["nope"]},
    ],
)
def test_bad_baseline_is_ignored(root, boot, bad, caplog):
    make_ndr_node(root, ports=1)
    set_counter(root, "mlx5_0", 1, "symbol_error", 9)
    with caplog.at_level(logging.WARNING):
        c = collector(root, boot, baseline=bad)
    assert "ignoring saved counter baseline" in caplog.text
    assert c.collect(1.0).ports[0].counters["counters/symbol_error"].delta is None


def test_saturated_counters_are_unknown(root, boot):
    ib_tree.scenario_saturated(root)
    set_counter(root, "mlx5_0", 1, "port_xmit_data", 2**32 - 1)  # width unknown: never "saturated"
    set_counter(root, "mlx5_0", 1, "out_of_buffer", 2**64 - 1, hw=True)
    c = collector(root, boot)
    expected_sat = {
        "counters/symbol_error": 65535,
        "counters/port_rcv_errors": 65535,
        "counters/link_downed": 255,
        "counters/link_error_recovery": 255,
        "counters/local_link_integrity_errors": 15,
        "counters/excessive_buffer_overrun_errors": 15,
        "counters/port_xmit_wait": 4294967295,
    }
    for t in (1000.0, 1010.0):
        p = port(c.collect(t), "mlx5_0")
        sat = {k: d.value for k, d in p.counters.items() if d.saturated}
        assert sat == expected_sat
        assert all(p.counters[k].delta is None for k in expected_sat)
        assert p.counters["counters/port_xmit_data"].saturated is False
        assert p.counters["hw_counters/out_of_buffer"].saturated is False
    # a saturated counter cleared by an admin is a reset, then counts again
    set_counter(root, "mlx5_0", 1, "symbol_error", 0)
    p = port(c.collect(1020.0), "mlx5_0")
    assert p.counters["counters/symbol_error"] == CounterDelta(value=0, delta=None, window_s=10.0, reset=True)
    set_counter(root, "mlx5_0", 1, "symbol_error", 4)
    p = port(c.collect(1030.0), "mlx5_0")
    assert p.counters["counters/symbol_error"] == CounterDelta(value=4, delta=4, window_s=10.0)
    # the healthy port next to it is unaffected
    assert not any(d.saturated for d in port(c.collect(1040.0), "mlx5_1").counters.values())


def test_counter_reaching_saturation_mid_window_is_unknown(root, boot):
    make_ndr_node(root, ports=1)
    c = collector(root, boot)
    set_counter(root, "mlx5_0", 1, "local_link_integrity_errors", 9)
    c.collect(1000.0)
    set_counter(root, "mlx5_0", 1, "local_link_integrity_errors", 15)
    d = c.collect(1010.0).ports[0].counters["counters/local_link_integrity_errors"]
    assert d == CounterDelta(value=15, delta=None, window_s=10.0, saturated=True)
    assert d.rate_per_s is None


def test_garbage_and_unreadable_files(root, boot, caplog):
    for how in ("EIO", "EINVAL"):
        if not ib_tree.unreadable_works(how):
            pytest.skip(f"this kernel does not fail {ib_tree.UNREADABLE_TARGETS[how]} with {how}")
    ib_tree.scenario_garbage(root)
    c = collector(root, boot)
    with caplog.at_level(logging.INFO, logger="healthd.agent.collectors.infiniband"):
        s = c.collect(1000.0)
        s2 = c.collect(1010.0)
        s3 = c.collect(1020.0)
    assert s.status == "ok"
    bad = port(s, "mlx5_1")
    assert bad.unreadable == {
        "state": "unparsable: expected '<n>: <NAME>', got 'ACTIVE'",
        "counters/symbol_error": "unparsable: expected an unsigned decimal, got 'N/A'",
        "counters/port_rcv_errors": "EIO: Input/output error",
        "counters/link_downed": "EISDIR: Is a directory",
        "hw_counters/out_of_buffer": "EINVAL: Invalid argument",
    }
    assert bad.state is None
    assert (bad.phys_state, bad.rate_gbps, bad.link_layer) == ("LinkUp", 400.0, "InfiniBand")
    # every other counter of that port is still read
    assert len(bad.counters) == COUNTERS_PER_PORT - 4
    assert set(bad.unreadable) & set(bad.counters) == set()
    assert bad.counters["counters/link_error_recovery"].value == 0
    assert port(s2, "mlx5_1").counters["counters/link_error_recovery"].delta == 0
    # and every other port in full
    for p in s3.ports:
        if p.device != "mlx5_1":
            assert (p.unreadable, len(p.counters), p.up) == ({}, COUNTERS_PER_PORT, True)
    # one log line per file on the transition, not one per tick
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5
    assert f"{root}/mlx5_1/ports/1/counters/port_rcv_errors: EIO" in caplog.text

    # the files recover: one INFO line each; a counter never read before starts as a baseline
    caplog.clear()
    set_counter(root, "mlx5_1", 1, "port_rcv_errors", 3)
    set_state(root, "mlx5_1", 1, state="4: ACTIVE")
    with caplog.at_level(logging.INFO, logger="healthd.agent.collectors.infiniband"):
        p = port(c.collect(1030.0), "mlx5_1")
    assert p.state == "ACTIVE"
    assert p.counters["counters/port_rcv_errors"] == CounterDelta(value=3, delta=None, window_s=None)
    assert "counters/port_rcv_errors" not in p.unreadable
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]


def test_unreadable_counter_keeps_its_last_good_baseline(root, boot):
    make_ndr_node(root, ports=1)
    c = collector(root, boot)
    set_counter(root, "mlx5_0", 1, "symbol_error", 20)
    c.collect(1000.0)
    make_unreadable(root, "mlx5_0", 1, "counters/symbol_error", "EISDIR")
    p = c.collect(1010.0).ports[0]
    assert p.unreadable == {"counters/symbol_error": "EISDIR: Is a directory"}
    assert "counters/symbol_error" not in p.counters
    # the baseline survives the bad tick (and a restart in between)
    c2 = collector(root, boot, baseline=json.loads(json.dumps(c.state())))
    set_counter(root, "mlx5_0", 1, "symbol_error", 26)
    p = c2.collect(1020.0).ports[0]
    assert p.counters["counters/symbol_error"] == CounterDelta(value=26, delta=6, window_s=20.0)


def test_permission_denied_counter(root, boot):
    if not ib_tree.unreadable_works("EACCES"):
        pytest.skip("no write-only sysfs attribute to read here")
    make_ndr_node(root, ports=1)
    make_unreadable(root, "mlx5_0", 1, "hw_counters/rnr_nak_retry_err", "EACCES")
    p = collector(root, boot).collect(1.0).ports[0]
    assert p.unreadable == {"hw_counters/rnr_nak_retry_err": "EACCES: Permission denied"}
    assert len(p.counters) == COUNTERS_PER_PORT - 1


def test_unreadable_counters_dir_and_missing_files(root, boot):
    make_ndr_node(root, ports=2)
    pdir = ib_tree.port_dir(root, "mlx5_0", 1)
    for f in (pdir / "hw_counters").iterdir():
        f.unlink()
    (pdir / "hw_counters").rmdir()
    (pdir / "hw_counters").write_text("not a dir\n")  # listing fails with ENOTDIR
    (pdir / "link_layer").unlink()  # absent, not unreadable
    s = collector(root, boot).collect(1.0)
    p = port(s, "mlx5_0")
    assert p.unreadable == {"hw_counters": "ENOTDIR: Not a directory"}
    assert p.link_layer is None
    assert len(p.counters) == len(DEFAULT_COUNTERS)
    assert len(port(s, "mlx5_1").counters) == COUNTERS_PER_PORT


def test_removed_port_drops_from_the_baseline(root, boot):
    make_ndr_node(root, ports=2)
    c = collector(root, boot)
    c.collect(1.0)
    assert set(c.state()["ports"]) == {"mlx5_0/1", "mlx5_1/1"}
    import shutil

    shutil.rmtree(root / "mlx5_1")
    s = c.collect(2.0)
    assert [p.device for p in s.ports] == ["mlx5_0"]
    assert set(c.state()["ports"]) == {"mlx5_0/1"}


def test_every_sample_carries_its_read_time(root, boot):
    """The classifier counts a sample's deltas once: it tells a new reading from one it classifies
    again by this time."""
    ib_tree.scenario_no_hca(root)
    assert collector(root, boot).collect(1000.0).time == 1000.0
    ib_tree.scenario_healthy(root)
    c = collector(root, boot)
    assert [c.collect(t).time for t in (1000.0, 1010.0)] == [1000.0, 1010.0]


def test_only_the_named_counters_are_read(tmp_path: Path):
    root = tmp_path / "infiniband"
    make_ndr_node(root, ports=2)
    set_counter(root, "mlx5_0", 1, "symbol_error", 7)
    set_counter(root, "mlx5_0", 1, "rnr_nak_retry_err", 3, hw=True)
    make_unreadable(root, "mlx5_0", 1, "counters/port_xmit_data", "EISDIR")  # not named: not read
    wanted = {"symbol_error", "rnr_nak_retry_err", "link_downed"}
    port = InfinibandCollector(sysfs_root=str(root), counters=wanted).collect(1.0).ports[0]
    assert set(port.counters) == {"counters/symbol_error", "hw_counters/rnr_nak_retry_err", "counters/link_downed"}
    assert port.counters["counters/symbol_error"].value == 7 and port.unreadable == {}
    assert port.state == "ACTIVE" and port.rate_gbps == 400.0
