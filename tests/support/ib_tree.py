"""Fake `/sys/class/infiniband` trees for tests, written the way the kernel presents them.

Layout (drivers/infiniband/core/sysfs.c): `<root>/<dev>/ports/<n>/`
holds `state` ("4: ACTIVE"), `phys_state` ("5: LinkUp"), `rate` ("400 Gb/sec (4X NDR)"),
`link_layer`, `counters/` (PMA) and `hw_counters/` (driver). Every value ends with "\\n".

Scenario builders at the bottom (`SCENARIOS`) write the trees the tests and the end-to-end test
share: a healthy 8-port NDR node, a port down, saturated counters, garbage and unreadable counter
files; "no HCA" is a root that does not exist; a flapping port is `make_ndr_node` followed by
`set_state`/`set_counter` between collects (`flap`). To look at one:
`python -m tests.support.ib_tree OUTDIR healthy`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Mapping

# PMA PortCounters an mlx5 port exposes (extended table), with healthy-looking values.
DEFAULT_COUNTERS: Mapping[str, int] = {
    "symbol_error": 0,
    "link_error_recovery": 0,
    "link_downed": 0,
    "port_rcv_errors": 0,
    "port_rcv_remote_physical_errors": 0,
    "port_rcv_switch_relay_errors": 0,
    "local_link_integrity_errors": 0,
    "excessive_buffer_overrun_errors": 0,
    "VL15_dropped": 0,
    "port_xmit_discards": 0,
    "port_xmit_wait": 2_500_000_000,
    "port_xmit_constraint_errors": 0,
    "port_rcv_constraint_errors": 0,
    "port_xmit_data": 123_456_789_012,
    "port_rcv_data": 98_765_432_109,
    "port_xmit_packets": 1_234_567_890,
    "port_rcv_packets": 987_654_321,
    "unicast_xmit_packets": 1_234_000_000,
    "unicast_rcv_packets": 987_000_000,
    "multicast_xmit_packets": 12,
    "multicast_rcv_packets": 34,
}

# mlx5 driver counters (64-bit); `lifespan` is a setting in ms, not a counter.
DEFAULT_HW_COUNTERS: Mapping[str, int] = {
    "duplicate_request": 0,
    "implied_nak_seq_err": 0,
    "local_ack_timeout_err": 0,
    "out_of_buffer": 0,
    "out_of_sequence": 0,
    "packet_seq_err": 0,
    "req_cqe_error": 0,
    "req_cqe_flush_error": 0,
    "req_remote_access_errors": 0,
    "req_remote_invalid_request": 0,
    "resp_cqe_error": 0,
    "resp_cqe_flush_error": 0,
    "resp_local_length_error": 0,
    "resp_remote_access_errors": 0,
    "rnr_nak_retry_err": 0,
    "roce_adp_retrans": 0,
    "roce_adp_retrans_to": 0,
    "roce_slow_restart": 0,
    "roce_slow_restart_cnps": 0,
    "roce_slow_restart_trans": 0,
    "rx_atomic_requests": 0,
    "rx_read_requests": 0,
    "rx_write_requests": 0,
    "lifespan": 10,
}

# Real kernel files whose read() fails, as a counter MAD can: `/proc/self/mem` at offset 0 gives
# EIO, `/proc/self/clear_refs` (write-only, no read op) gives EINVAL even for root, a write-only
# sysfs attribute gives EACCES even for root. A symlink to one puts that exact failure in the tree.
UNREADABLE_TARGETS: Mapping[str, str] = {
    "EIO": "/proc/self/mem",
    "EINVAL": "/proc/self/clear_refs",
    "EACCES": "/sys/bus/pci/rescan",
}


def _write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = value if isinstance(value, str) else str(value)
    if not text.endswith("\n"):
        text += "\n"
    # replace, don't rewrite in place, so a symlink or directory planted earlier is gone too
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.write_text(text)


def port_dir(root: str | os.PathLike, dev: str = "mlx5_0", port: int = 1) -> Path:
    return Path(root) / dev / "ports" / str(port)


def make_port(
    root: str | os.PathLike,
    dev: str = "mlx5_0",
    port: int = 1,
    state: str = "4: ACTIVE",
    phys_state: str = "5: LinkUp",
    rate: str = "400 Gb/sec (4X NDR)",
    link_layer: str = "InfiniBand",
    counters: Mapping[str, object] | None = None,
    hw_counters: Mapping[str, object] | None = None,
) -> Path:
    """Write one port (and its device's identity files). `counters`/`hw_counters` override or add
    to DEFAULT_COUNTERS/DEFAULT_HW_COUNTERS; a str value is written as is (garbage on purpose), with
    the kernel's "\\n" appended. Returns the port directory."""
    pdir = port_dir(root, dev, port)
    devdir = Path(root) / dev
    for name, value in (
        ("node_guid", "b83f:d203:00a1:b2c4"),
        ("fw_ver", "28.41.1000"),
        ("hca_type", "MT4129"),
        ("node_type", "1: CA"),
        ("board_id", "MT_0000000838"),
    ):
        if not (devdir / name).exists():
            _write(devdir / name, value)
    _write(pdir / "state", state)
    _write(pdir / "phys_state", phys_state)
    _write(pdir / "rate", rate)
    _write(pdir / "link_layer", link_layer)
    _write(pdir / "lid", f"0x{port + 0x10:x}")
    for name, value in {**DEFAULT_COUNTERS, **(counters or {})}.items():
        _write(pdir / "counters" / name, value)
    for name, value in {**DEFAULT_HW_COUNTERS, **(hw_counters or {})}.items():
        _write(pdir / "hw_counters" / name, value)
    return pdir


def make_ndr_node(root: str | os.PathLike, ports: int = 8, **port_kwargs: object) -> list[tuple[str, int]]:
    """An H100/H200-style node: `ports` single-port NDR HCAs mlx5_0..mlx5_{n-1}, port 1 each.
    Returns [(dev, port)]."""
    made = []
    for i in range(ports):
        make_port(root, dev=f"mlx5_{i}", port=1, **port_kwargs)  # type: ignore[arg-type]
        made.append((f"mlx5_{i}", 1))
    return made


def set_counter(root: str | os.PathLike, dev: str, port: int, name: str, value: object, hw: bool = False) -> None:
    """Overwrite `counters/<name>` (or `hw_counters/<name>` with hw=True)."""
    _write(port_dir(root, dev, port) / ("hw_counters" if hw else "counters") / name, value)


def set_state(
    root: str | os.PathLike,
    dev: str,
    port: int,
    state: str | None = None,
    phys_state: str | None = None,
    rate: str | None = None,
) -> None:
    """Change a port's state / phys_state / rate (full kernel text, e.g. "1: DOWN")."""
    pdir = port_dir(root, dev, port)
    if state is not None:
        _write(pdir / "state", state)
    if phys_state is not None:
        _write(pdir / "phys_state", phys_state)
    if rate is not None:
        _write(pdir / "rate", rate)


def make_unreadable(root: str | os.PathLike, dev: str, port: int, relpath: str, how: str = "EIO") -> Path:
    """Make `<port>/<relpath>` (e.g. "counters/symbol_error") fail to read.

    how: "EIO" | "EINVAL" | "EACCES" — a symlink to a real kernel file whose read() fails that way;
    "EISDIR" — a directory in place of the file. Works as root (chmod 000 would not)."""
    path = port_dir(root, dev, port) / relpath
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "EISDIR":
        path.mkdir()
    else:
        os.symlink(UNREADABLE_TARGETS[how], path)
    return path


def unreadable_works(how: str) -> bool:
    """Whether this kernel fails a read of UNREADABLE_TARGETS[how] the expected way."""
    import errno

    if how == "EISDIR":
        return True
    target = UNREADABLE_TARGETS[how]
    try:
        fd = os.open(target, os.O_RDONLY)
    except OSError as exc:
        return exc.errno == getattr(errno, how)
    try:
        os.read(fd, 64)
    except OSError as exc:
        return exc.errno == getattr(errno, how)
    finally:
        os.close(fd)
    return False


# --------------------------------------------------------------------------- scenarios


def scenario_healthy(root: str | os.PathLike) -> None:
    """8 ACTIVE/LinkUp 400 Gb/s NDR ports, clean counters."""
    make_ndr_node(root, ports=8)


def scenario_port_down(root: str | os.PathLike) -> None:
    """8 ports; mlx5_3/1 DOWN/Disabled, rate fallen back to SDR, link_downed 1."""
    make_ndr_node(root, ports=8)
    make_port(
        root, dev="mlx5_3", state="1: DOWN", phys_state="3: Disabled", rate="10 Gb/sec (4X SDR)",
        counters={"link_downed": 1},
    )


def scenario_flap(root: str | os.PathLike) -> None:
    """The starting point of a flap: 8 healthy ports. Drive it with flap_step()."""
    make_ndr_node(root, ports=8)


def flap_step(root: str | os.PathLike, up: bool, link_downed: int, dev: str = "mlx5_5", port: int = 1) -> None:
    """One half-cycle of a flapping port: DOWN/Polling or ACTIVE/LinkUp, with link_downed set."""
    if up:
        set_state(root, dev, port, state="4: ACTIVE", phys_state="5: LinkUp")
    else:
        set_state(root, dev, port, state="1: DOWN", phys_state="2: Polling")
    set_counter(root, dev, port, "link_downed", link_downed)


def scenario_saturated(root: str | os.PathLike) -> None:
    """2 ports; mlx5_0/1 has its 16-, 8-, 4- and 32-bit PMA counters at their maxima."""
    make_ndr_node(root, ports=2)
    make_port(
        root, dev="mlx5_0",
        counters={
            "symbol_error": 65535,
            "port_rcv_errors": 65535,
            "link_downed": 255,
            "link_error_recovery": 255,
            "local_link_integrity_errors": 15,
            "excessive_buffer_overrun_errors": 15,
            "port_xmit_wait": 4294967295,
        },
    )


def scenario_garbage(root: str | os.PathLike) -> None:
    """4 ports; mlx5_1/1 has a garbage symbol_error, an EIO port_rcv_errors, a directory for
    link_downed, an EINVAL hw_counters/out_of_buffer and a garbage state; the rest is healthy."""
    make_ndr_node(root, ports=4)
    set_counter(root, "mlx5_1", 1, "symbol_error", "N/A")
    make_unreadable(root, "mlx5_1", 1, "counters/port_rcv_errors", "EIO")
    make_unreadable(root, "mlx5_1", 1, "counters/link_downed", "EISDIR")
    make_unreadable(root, "mlx5_1", 1, "hw_counters/out_of_buffer", "EINVAL")
    _write(port_dir(root, "mlx5_1", 1) / "state", "ACTIVE")


def scenario_no_hca(root: str | os.PathLike) -> None:
    """No HCA: the class directory does not exist."""
    p = Path(root)
    if p.exists():
        shutil.rmtree(p)


SCENARIOS: Mapping[str, Callable[[str | os.PathLike], None]] = {
    "healthy": scenario_healthy,
    "port_down": scenario_port_down,
    "flap": scenario_flap,
    "saturated": scenario_saturated,
    "garbage": scenario_garbage,
    "no_hca": scenario_no_hca,
}


if __name__ == "__main__":  # python -m tests.support.ib_tree OUTDIR SCENARIO
    if len(sys.argv) != 3 or sys.argv[2] not in SCENARIOS:
        sys.exit(f"usage: python -m tests.support.ib_tree OUTDIR {{{'|'.join(SCENARIOS)}}}")
    SCENARIOS[sys.argv[2]](sys.argv[1])
    print(sys.argv[1])
