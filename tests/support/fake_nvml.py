"""Build and drive the fake NVML library (tests/fakes/fake_nvml.c), a stand-in for
libnvidia-ml.so.1 that pynvml loads through its real ctypes path.

Using it
--------
    lib_dir = build_fake_nvml(tmp / "lib")                 # -> tmp/lib/libnvidia-ml.so.1
    write_nvml_config(tmp / "nvml.conf", healthy_node(8))
    subprocess.run(["healthd", ...], env=fake_nvml_env(lib_dir, tmp / "nvml.conf"))

A new process finds the fake through LD_LIBRARY_PATH (setting it inside a running process has no
effect). In-process, `ctypes.CDLL(str(lib_dir / "libnvidia-ml.so.1"))` before pynvml's first
nvmlInit makes pynvml's `CDLL("libnvidia-ml.so.1")` resolve to it by SONAME.

Config file format (the file named by $FAKE_NVML_CONFIG)
--------------------------------------------------------
One `key=value` per line; lines that match no key are ignored; the last occurrence of a key wins.
The library re-reads the file on EVERY call, so a test changes a value mid-run by rewriting it
(`write_nvml_config` replaces it atomically). Integers accept 0x prefixes.

Global keys:
    count=8                      what nvmlDeviceGetCount returns (write_nvml_config: len(gpus))
    init_error=9                 nvmlInit fails with this NVML code (9 DriverNotLoaded)
    driver_version=550.54.15     nvml_version=12.550.54.15
    init.sleep_ms=N              nvmlInit sleeps N ms first (a hung init)
    count.error=N  count.sleep_ms=N  driver_version.error=N  nvml_version.error=N

Per-GPU keys, `gpu<N>.<key>`:
    name, uuid, serial           strings
    bus_id=00000000:18:00.0      nvmlPciInfo_t.busId, domain/bus/device are parsed from it
    pci_device_id=0x233010DE     pci_subsystem_id
    temperature=34  margin=48    threshold.slowdown=87  threshold.shutdown=92
    clock_reasons=0x1            bitmask for ClocksEventReasons and ClocksThrottleReasons
    ecc.corrected.volatile  ecc.uncorrected.volatile  ecc.corrected.aggregate
    ecc.uncorrected.aggregate
    remapped_rows.corrected  remapped_rows.uncorrected  remapped_rows.pending=0|1
    remapped_rows.failure=0|1
    retired_pages.sbe=N  retired_pages.dbe=N (page counts)  retired_pages_pending=0|1
    pcie_replay  pcie_gen  pcie_gen_max  pcie_width  pcie_width_max
    nvlink.links=18              number of links (absent/0: no NVLink, every link NotSupported)
    nvlink.down=3,7              links whose state is inactive
    nvlink<L>.replay / .recovery / .crc_flit / .crc_data   error counters (default 0)
    processes=4242:1048576,4243  compute processes (PID[:used bytes]) for
                                 nvmlDeviceGetComputeRunningProcesses_v3 and _v2 (absent: none running)
    lost=1                       every call on this GPU, handle lookup included, returns 15
    sleep_ms=N                   every call on this GPU sleeps N ms first
A value key that is absent makes its read answer NotSupported (code 3): leave out
`remapped_rows.corrected` for a pre-Ampere GPU, `retired_pages.sbe` for an Ampere one.
name/uuid/serial/bus_id have defaults. A read's value key is its function's short name <fn> (below)
or `<fn>.<part>`, except clock_reasons (both clock functions) and the nvlink keys.

Per-function overrides, `gpu<N>.<fn>.error=<NVML code>` and `gpu<N>.<fn>.sleep_ms=<ms>`, with <fn>:
    handle name uuid serial pci_info temperature threshold margin clocks_event_reasons
    clocks_throttle_reasons ecc remapped_rows retired_pages retired_pages_pending pcie_replay
    pcie_gen pcie_gen_max pcie_width pcie_width_max nvlink_state nvlink_error_counter processes
    field_values
e.g. `gpu3.remapped_rows.error=3` (NotSupported), `gpu0.temperature.sleep_ms=2000` (hung call).

Call counts: with $FAKE_NVML_CALLS naming a `CallCounter` file, every call (a field-value batch is
one call) adds one to its <fn>'s count in that file, which another process reads while the caller
runs: `CallCounter(tmp / "calls").read()` -> {"temperature": 80, ...}.

Field values: nvmlDeviceGetFieldValues answers NVML_FI_DEV_NVLINK_GET_STATE (scopeId = link) and
the ECC total, PCIe replay, retired-page and remapped-row fields from the same keys, with the same
per-function `.error` (per entry) and `.sleep_ms` as the functions that read those values; any
other field is NotSupported, and so are the fields of a function left out of the build.

Missing symbols: `build_fake_nvml(dir, omit=["nvmlDeviceGetRemappedRows"])` builds a library
without them (pynvml then raises NVMLError_FunctionNotFound, as with an old driver). A process
keeps the first libnvidia-ml.so.1 it loaded, so such a build is for a subprocess.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

SOURCE = Path(__file__).resolve().parent.parent / "fakes" / "fake_nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"

# PCI buses of the eight H100 SXM5 GPUs in a DGX H100, in NVML index order.
H100_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


def build_fake_nvml(
    out_dir: Path, omit: Sequence[str] = (), nvml_include: Path | None = None
) -> Path:
    """Compile the fake into out_dir/libnvidia-ml.so.1 and return out_dir.

    omit: NVML symbols to leave out (renamed away at compile time).
    nvml_include: a directory holding NVIDIA's nvml.h; compiles with -DREAL_NVML_H so the fake's
    signatures and struct layouts are checked against the real header.
    """
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("building the fake NVML library needs gcc (apt-get install gcc)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [cc, "-O1", "-Wall", "-Wextra", "-shared", "-fPIC"]
    cmd += [f"-Wl,-soname,{LIBRARY_NAME}", "-o", str(out_dir / LIBRARY_NAME)]
    cmd += [f"-D{symbol}=omitted_{symbol}" for symbol in omit]
    if nvml_include is not None:
        # -Werror: a pointer or enum mismatch against the real prototypes is only a warning.
        cmd += ["-Werror", "-DREAL_NVML_H", f"-I{nvml_include}"]
    cmd.append(str(SOURCE))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return out_dir


class CallCounter:
    """The file the stand-in counts its calls in (64 records of a 56-byte NUL-padded <fn> name and a
    native unsigned 64-bit count, as `call_slot_t` in fake_nvml.c). Create it before the process
    that loads the stand-in starts, and pass `env()` to that process."""

    SLOTS = 64
    RECORD = struct.Struct("=56sQ")

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.write_bytes(bytes(self.SLOTS * self.RECORD.size))

    def env(self) -> dict[str, str]:
        return {"FAKE_NVML_CALLS": str(self.path)}

    def read(self) -> dict[str, int]:
        """<fn> -> calls so far."""
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            data = bytes(m)
        counts = {}
        for name, calls in self.RECORD.iter_unpack(data):
            name = name.rstrip(b"\0").decode()
            if name:
                counts[name] = calls
        return counts


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(str(v) for v in value)
    return str(value)


def write_nvml_config(path: Path, gpus: list[dict], **globals: Any) -> Path:
    """Write the fake's config: `gpus[i]` holds GPU i's keys (without the `gpu<i>.` prefix),
    keyword arguments the global keys (`count` defaults to len(gpus); pass dotted keys as
    `**{"init.sleep_ms": 500}`). Written to a temp file and renamed, so a call that re-reads it
    concurrently never sees half a file. A value of None leaves the key out."""
    path = Path(path)
    lines = [f"{k}={_render(v)}" for k, v in {"count": len(gpus), **globals}.items() if v is not None]
    for i, gpu in enumerate(gpus):
        lines += [f"gpu{i}.{k}={_render(v)}" for k, v in gpu.items() if v is not None]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def fake_nvml_env(lib_dir: Path, config: Path, base: Mapping[str, str] | None = None) -> dict:
    """Environment for a subprocess that should load the fake with this config."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["FAKE_NVML_CONFIG"] = str(config)
    return env


def gpu_uuid(i: int) -> str:
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"healthd-fake-gpu/{i}"))


def gpu_serial(i: int) -> str:
    return f"16549220{17 + 7 * i:05d}"


def gpu_bus_id(i: int) -> str:
    bus = H100_BUS_IDS[i] if i < len(H100_BUS_IDS) else f"{0xE0 + i - len(H100_BUS_IDS):02X}"
    return f"00000000:{bus}:00.0"


def healthy_gpu(i: int) -> dict:
    """An idle, healthy H100 SXM5 80GB on an NVLink4 baseboard: every counter readable and zero."""
    gpu: dict[str, Any] = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": gpu_uuid(i),
        "serial": gpu_serial(i),
        "bus_id": gpu_bus_id(i),
        "temperature": 31 + i,
        "margin": 56 - i,
        "threshold.slowdown": 87,
        "threshold.shutdown": 92,
        "clock_reasons": 0x1,  # GpuIdle
        "ecc.corrected.volatile": 0,
        "ecc.uncorrected.volatile": 0,
        "ecc.corrected.aggregate": 0,
        "ecc.uncorrected.aggregate": 0,
        "remapped_rows.corrected": 0,
        "remapped_rows.uncorrected": 0,
        "remapped_rows.pending": 0,
        "remapped_rows.failure": 0,
        "retired_pages.sbe": 0,
        "retired_pages.dbe": 0,
        "retired_pages_pending": 0,
        "pcie_replay": 0,
        "pcie_gen": 5,
        "pcie_gen_max": 5,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "nvlink.links": 18,
    }
    return gpu


def healthy_node(n: int = 8) -> list[dict]:
    return [healthy_gpu(i) for i in range(n)]
