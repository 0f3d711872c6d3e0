"""The running agent's cost: a real `healthd run` at its DEFAULT interval on a simulated 8-GPU,
8-port node (the C stand-in of libnvidia-ml with 18 NVLinks a GPU, an InfiniBand sysfs tree, a
journal), watched from outside for minutes: its CPU (utime + stime of all its threads and reaped
children, from /proc/<pid>/stat) as a share of one core, its RSS, and what one tick does — NVML
calls (counted inside the stand-in), files opened and /proc/<pid>/stat files read (strace on the
running agent for a few ticks, after the CPU window, since tracing slows it).

Baseline, in the same run and over the same window: a minimal poller started beside the agent at
the same interval, making the raw reads a node poller cannot avoid (every IB file, one NVML handle
and temperature per GPU, /proc/meminfo) with no parsing, history or publishing.

    .venv/bin/python bench/agent_daemon.py [--minutes 3] [--settle-s 25] [--strace-ticks 3]

Writes bench/results/agent_daemon.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from agent_tick import floor_tick
from common import print_and_save

from tests.support.agent_node import HEALTHD, Node
from tests.support.fake_nvml import CallCounter, build_fake_nvml

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
PROC_STAT = re.compile(r"^/proc/\d+/(task/\d+/)?stat$")
OPENAT = re.compile(r'open(?:at)?\((?:[^,]+, )?"([^"]*)"')


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / CLK_TCK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def poller(ib: str, interval_s: float) -> None:
    """The baseline: the raw reads at the agent's interval, nothing else."""
    import pynvml

    pynvml.nvmlInit()
    while True:
        floor_tick(Path(ib), pynvml)  # the in-process benchmark's floor, the same reads
        time.sleep(interval_s)


def watch(pids: dict[str, int], seconds: float, window_s: float) -> dict[str, dict]:
    """Sample CPU and RSS of each process once a second for `seconds`."""
    start = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    rss: dict[str, list[float]] = {k: [] for k in pids}
    load1: list[float] = []
    windows: dict[str, list[float]] = {k: [] for k in pids}
    mark, mark_cpu = t0, dict(start)
    while (now := time.monotonic()) - t0 < seconds:
        for k, p in pids.items():
            rss[k].append(rss_mb(p))
        with open("/proc/loadavg") as f:
            load1.append(float(f.read().split()[0]))
        if now - mark >= window_s:
            for k, p in pids.items():
                c = cpu_seconds(p)
                windows[k].append(100 * (c - mark_cpu[k]) / (now - mark))
                mark_cpu[k] = c
            mark = now
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    out = {}
    for k, p in pids.items():
        out[k] = {
            "cpu_pct_of_one_core": round(100 * (cpu_seconds(p) - start[k]) / elapsed, 4),
            "cpu_pct_per_window": {"window_s": window_s, "median": round(statistics.median(windows[k]), 4),
                                   "max": round(max(windows[k]), 4), "n": len(windows[k])} if windows[k] else None,
            "rss_mb": {"median": round(statistics.median(rss[k]), 1), "max": round(max(rss[k]), 1)},
        }
    out["seconds"] = round(elapsed, 1)
    # The agent's D-state scan opens only under load: the machine's own load says which path ran.
    out["machine_load1"] = {"median": round(statistics.median(load1), 2), "max": max(load1)}
    return out


def trace_opens(pid: int, seconds: float, out: Path, ib_root: str) -> dict[str, int]:
    """Paths the process opens in `seconds`, by kind."""
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=open,openat", "-o", str(out), "-p", str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds)
    tracer.send_signal(signal.SIGINT)  # detaches from the agent, which runs on
    tracer.wait(timeout=30)
    kinds = {"all": 0, "infiniband_sysfs": 0, "proc_pid_stat": 0, "proc_other": 0, "other": 0}
    for line in out.read_text().splitlines():
        m = OPENAT.search(line)
        if m is None:
            continue
        path = m.group(1)
        kinds["all"] += 1
        if path.startswith(ib_root):
            kinds["infiniband_sysfs"] += 1
        elif PROC_STAT.match(path):
            kinds["proc_pid_stat"] += 1
        elif path.startswith("/proc/"):
            kinds["proc_other"] += 1
        else:
            kinds["other"] += 1
    return kinds


def per_tick(before: dict[str, int], after: dict[str, int], ticks: int) -> dict[str, float]:
    return {k: round((after.get(k, 0) - before.get(k, 0)) / ticks, 1)
            for k in sorted(after) if after.get(k, 0) != before.get(k, 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=3.0, help="length of the CPU/RSS window")
    ap.add_argument("--settle-s", type=float, default=25.0, help="run this long before measuring")
    ap.add_argument("--strace-ticks", type=int, default=3, help="ticks to trace for the open() counts (0: none)")
    ap.add_argument("--poller", nargs=2, metavar=("IB_ROOT", "INTERVAL_S"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.poller:
        poller(args.poller[0], float(args.poller[1]))
        return

    tmp = Path(tempfile.mkdtemp(prefix="healthd-bench-daemon-"))
    node = Node(tmp, build_fake_nvml(tmp / "lib"))
    procs: list[subprocess.Popen] = []
    try:
        doc = yaml.safe_load(node.config.read_text())
        doc.pop("interval_s")  # the default interval, as a site runs it
        node.config.write_text(yaml.safe_dump(doc))
        from healthd.settings import Settings

        interval = Settings.__dataclass_fields__["interval_s"].default
        calls = CallCounter(tmp / "nvml.calls")
        env = {**node.env(), **calls.env()}
        log = open(tmp / "agent.log", "wb")
        agent = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=log)
        procs.append(agent)
        base = subprocess.Popen([sys.executable, __file__, "--poller", str(node.ib), str(interval)],
                                env={**node.env(), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        procs.append(base)
        deadline = time.monotonic() + 60
        while node.state() is None:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"agent did not publish:\n{(tmp / 'agent.log').read_text()[-3000:]}")
            time.sleep(0.2)
        verdict = node.state().get("verdict")
        time.sleep(args.settle_s)

        c0 = calls.read()
        seen = watch({"agent": agent.pid, "poller": base.pid}, args.minutes * 60, window_s=30.0)
        c1 = calls.read()
        ticks = c1.get("count", 0) - c0.get("count", 0)  # one nvmlDeviceGetCount a collection
        results: dict = {
            "interval_s": interval,
            "verdict_at_start": verdict,
            "window_s": seen["seconds"],
            "machine_load1_in_window": seen["machine_load1"],
            "ticks_in_window": ticks,
            "agent": seen["agent"],
            "baseline_poller": seen["poller"],
            "agent_vs_poller_cpu_ratio": round(seen["agent"]["cpu_pct_of_one_core"]
                                               / max(seen["poller"]["cpu_pct_of_one_core"], 1e-9), 2),
            "nvml_calls_per_tick": sum(c1.values()) - sum(c0.values()) and round(
                (sum(c1.values()) - sum(c0.values())) / max(ticks, 1), 1),
            "nvml_calls_per_tick_by_function": per_tick(c0, c1, max(ticks, 1)),
        }
        if args.strace_ticks and shutil.which("strace"):
            s0 = calls.read()
            opens = trace_opens(agent.pid, args.strace_ticks * interval, tmp / "strace.out", str(node.ib))
            traced = calls.read().get("count", 0) - s0.get("count", 0)
            results["strace_ticks"] = traced
            results["opens_per_tick"] = {k: round(v / max(traced, 1), 1) for k, v in opens.items()}
        if agent.poll() is not None:
            raise SystemExit(f"agent exited with {agent.returncode}:\n{(tmp / 'agent.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        node.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print_and_save("agent_daemon", results, 36)


if __name__ == "__main__":
    main()
