"""Agent tick cost on a simulated 8-GPU, 8-port node: collect (NVML through pynvml's real ctypes
path into the C stand-in, InfiniBand sysfs tree, host /proc and one filesystem probe) + classify +
publish (state file, agent memory, metrics textfile). Reports wall and CPU per tick (median, p99),
CPU share of one core at the default 10 s interval, RSS after N ticks, NVML calls per tick (counted
in the stand-in), and the ratio against a floor run in the same process: the raw reads a minimal
poller would make (every IB file read, one NVML handle + temperature per GPU, /proc/meminfo), with
no parsing, history or publishing.

Every tick here is a FULL tick: the NVLink error counters (read every 120 s by default) and the
per-thread D-state scan (gated on /proc/stat and the load average) are forced on every tick, so
this is the upper bound of one tick. What the running daemon averages over its ticks is measured by
bench/agent_daemon.py.

    .venv/bin/python bench/agent_tick.py [--ticks 10000]

Writes bench/results/agent_tick.json. Note: the C stand-in re-reads its values file on every NVML
call, so the NVML share here is an upper bound on what the real driver's calls cost in Python.
"""

from __future__ import annotations

import argparse
from array import array
import ctypes
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import print_and_save, rss_bytes, summary

from tests.support.fake_nvml import CallCounter, build_fake_nvml, healthy_node, write_nvml_config
from tests.support.ib_tree import make_ndr_node


def build(tmp: Path):
    lib_dir = build_fake_nvml(tmp / "lib")
    ctypes.CDLL(str(lib_dir / "libnvidia-ml.so.1"))  # pynvml's CDLL("libnvidia-ml.so.1") now resolves here
    values = tmp / "nvml.conf"
    write_nvml_config(values, healthy_node(8))
    os.environ["FAKE_NVML_CONFIG"] = str(values)
    calls = CallCounter(tmp / "nvml.calls")
    os.environ.update(calls.env())  # before the stand-in's first call, which opens the file
    ib = tmp / "infiniband"
    make_ndr_node(ib, ports=8)
    (tmp / "journal").mkdir()
    ckpt = Path(tempfile.mkdtemp(prefix="healthd-bench-", dir="/dev/shm"))
    cfg = tmp / "healthd.yaml"
    cfg.write_text(
        f"""
node_name: bench01
state_file: {tmp}/run/state.json
state_dir: {tmp}/lib
nvml: {{expected_gpus: 8, nvlink_counter_interval_s: 0}}
kernel_log: {{journal_dir: {tmp}/journal, kmsg_path: null, start_at: head}}
infiniband: {{sysfs_root: {ib}, expected_ports: 8, expected_rate_gbps: 400}}
host: {{filesystems: [{{path: {ckpt}, role: checkpoint}}], dstate_scan_min_load: 0}}
metrics: {{textfile: {tmp}/healthd.prom}}
"""
    )
    return cfg, ib, ckpt, calls


def floor_tick(ib: Path, pynvml) -> None:
    for dirpath, _, files in os.walk(ib):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                f.read()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    with open("/proc/meminfo", "rb") as f:
        f.read()


def measure(fn, n: int) -> tuple[list[float], list[float]]:
    # Preallocated arrays of doubles: storing a float per tick in a list would itself grow the RSS
    # being measured (32 bytes a sample).
    wall, cpu = array("d", bytes(8 * n)), array("d", bytes(8 * n))
    for i in range(n):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpu[i] = time.process_time() - c
        wall[i] = time.perf_counter() - w
    return list(wall), list(cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=10_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="healthd-bench-"))
    cfg, ib, ckpt, calls = build(tmp)
    try:
        import pynvml

        from healthd.agent.daemon import build_agent

        agent = build_agent(str(cfg), dry_run=False)

        stages = {name: array("d", bytes(8 * args.ticks)) for name in ("collect", "classify", "publish")}
        rss_trace: list[tuple[int, float]] = []
        done = [0]

        def tick() -> None:
            t0 = time.process_time()
            agent.collect_periodic()
            kernel = agent.read_kernel(0.0)
            t1 = time.process_time()
            agent.classify(kernel)
            t2 = time.process_time()
            agent.publish()
            t3 = time.process_time()
            i = done[0]
            if i < args.ticks:
                stages["collect"][i], stages["classify"][i], stages["publish"][i] = t1 - t0, t2 - t1, t3 - t2
            done[0] = i + 1
            if done[0] % 1000 == 0:
                rss_trace.append((done[0], round(rss_bytes() / 2**20, 2)))

        tick()
        assert agent.result is not None and agent.result.verdict == "healthy", agent.document()["findings"]
        gc.collect()
        rss_start = rss_bytes()
        warm = max(1, args.ticks // 100)
        calls_before = calls.read()
        wall, cpu = measure(tick, args.ticks)
        calls_after = calls.read()
        rss_end = rss_bytes()
        parts = {name: round(sec * 1e3, 3) for name, sec in agent.timings.items()}

        floor_wall, floor_cpu = measure(lambda: floor_tick(ib, pynvml), max(200, args.ticks // 10))
        w, c = summary(wall[warm:]), summary(cpu[warm:])
        fw, fc = summary(floor_wall), summary(floor_cpu)
        interval = agent.settings.interval_s
        results = {
            "ticks": args.ticks,
            "tick_wall_ms": {k: round(v * 1e3, 3) if k != "n" else v for k, v in w.items()},
            "tick_cpu_ms": {k: round(v * 1e3, 3) if k != "n" else v for k, v in c.items()},
            "last_tick_collector_ms": parts,
            "nvml_calls_per_tick": round((sum(calls_after.values()) - sum(calls_before.values())) / args.ticks, 1),
            "stage_cpu_ms_median": {k: round(summary(list(v)[warm:])["median"] * 1e3, 3) for k, v in stages.items()},
            "rss_mb_every_1000_ticks": rss_trace,
            "cpu_share_of_one_core_at_interval_pct": round(100 * c["median"] / interval, 4),
            "interval_s": interval,
            "rss_mb_after_ticks": round(rss_end / 2**20, 1),
            "rss_growth_mb_over_ticks": round((rss_end - rss_start) / 2**20, 2),
            "floor_wall_ms": {k: round(v * 1e3, 3) if k != "n" else v for k, v in fw.items()},
            "floor_cpu_ms": {k: round(v * 1e3, 3) if k != "n" else v for k, v in fc.items()},
            "tick_vs_floor_wall_ratio": round(w["median"] / fw["median"], 2),
            "tick_vs_floor_cpu_ratio": round(c["median"] / fc["median"], 2),
        }
        agent.sources.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    print_and_save("agent_tick", results, 40)


if __name__ == "__main__":
    main()
