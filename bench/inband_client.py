"""Per-call cost of the in-band client's `hd.step()`: disabled (no HEALTHD_INBAND_DIR) and enabled
(writing its ring on tmpfs), each timed call by call over N calls (median, p99), against an empty
Python function call timed the same way in the same process; the `net` figures subtract the
baseline's median (the call itself and the two clock reads around it). A tight loop without
per-call clocks gives the mean of each as well.

Then the system call check: the same child process with 0 and with N steps under `strace -f -c`;
the difference in system calls, divided by N, is the number per step (target 0).

    .venv/bin/python bench/inband_client.py [--calls 1000000]

Writes bench/results/inband_client.json. Targets: <= 2 us a step() disabled or idle, <= 20 us median
enabled.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from common import ROOT, save, summary

import healthd_inband as hd

CHILD = """
import sys, healthd_inband as hd
assert hd.enabled
for i in range(int(sys.argv[1])):
    hd.step(i)
"""


def empty(n: int) -> None:
    return None


def per_call(fn, n: int) -> list[float]:
    """Microseconds of each of `n` calls of fn(i), clock reads included."""
    out = array("q", bytes(8 * n))
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        fn(i)
        out[i] = clock() - t0
    return [v / 1000 for v in out]


def mean_tight(fn, n: int) -> float:
    """Mean microseconds per call over `n` calls with no clock inside the loop, less the loop."""
    t0 = time.perf_counter_ns()
    for i in range(n):
        fn(i)
    t1 = time.perf_counter_ns()
    for _ in range(n):
        pass
    t2 = time.perf_counter_ns()
    return ((t1 - t0) - (t2 - t1)) / n / 1000


def syscalls(directory: str, steps: int) -> tuple[int, str]:
    """Total system calls of a child that sets the ring up and calls step() `steps` times."""
    out = os.path.join(directory, f"strace-{steps}.txt")
    env = dict(os.environ, HEALTHD_INBAND_DIR=directory, RANK="0", PYTHONPATH=str(ROOT))
    subprocess.run(["strace", "-f", "-c", "-o", out, sys.executable, "-c", CHILD, str(steps)], env=env, check=True,
                   capture_output=True, timeout=600)
    text = Path(out).read_text()
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[-1] == "total":
            return int(parts[3]), text  # % time, seconds, usecs/call, calls, [errors,] total
    raise RuntimeError(f"no total in strace output:\n{text}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--strace-steps", type=int, default=200_000)
    args = ap.parse_args()
    if hd.enabled:
        sys.exit("run without HEALTHD_INBAND_DIR: the disabled path is measured first")
    n = args.calls
    runs: dict[str, list[float]] = {}
    means: dict[str, float] = {}
    runs["baseline_empty_function"] = per_call(empty, n)
    means["baseline_empty_function"] = mean_tight(empty, n)
    runs["step_disabled"] = per_call(hd.step, n)
    means["step_disabled"] = mean_tight(hd.step, n)

    tmp = tempfile.mkdtemp(prefix="healthd-bench-inband-", dir="/dev/shm")  # tmpfs, as /run is
    try:
        env = dict(os.environ, HEALTHD_INBAND_DIR=tmp, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if not hd._setup(env):
            sys.exit("could not set up the ring")
        runs["step_enabled"] = per_call(hd.step, n)
        means["step_enabled"] = mean_tight(hd.step, n)

        def wait_and_step(i: int) -> None:
            with hd.wait():
                pass
            hd.step(i)

        runs["wait_block_and_step_enabled"] = per_call(wait_and_step, n // 4)

        strace: dict[str, object]
        if shutil.which("strace") is None:
            strace = {"available": False, "note": "strace is not installed: system calls not counted"}
        else:
            try:
                base, _ = syscalls(tmp, 0)
                loaded, _ = syscalls(tmp, args.strace_steps)
                strace = {"available": True, "steps": args.strace_steps, "syscalls_0_steps": base,
                          f"syscalls_{args.strace_steps}_steps": loaded,
                          "syscalls_per_step": (loaded - base) / args.strace_steps}
            except (subprocess.SubprocessError, OSError, RuntimeError) as e:
                strace = {"available": False, "note": f"strace failed: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base_median = summary(runs["baseline_empty_function"])["median"]
    micro = {k: {**summary(v), "net_median": summary(v)["median"] - base_median, "tight_loop_mean": means.get(k)}
             for k, v in runs.items()}
    results = {
        "calls": n,
        "target": "step() <= 2 us disabled or idle, <= 20 us median enabled, 0 system calls per step",
        "microseconds": {k: {f: (round(x, 3) if isinstance(x, float) else x) for f, x in v.items()}
                         for k, v in micro.items()},
        "strace": strace,
        "note": "per-call figures include two perf_counter_ns reads; net_median subtracts the baseline's "
                "median. wait_block_and_step is one `with hd.wait()` block and one step() (n/4 calls).",
    }
    for k, v in results["microseconds"].items():
        print(f"{k:32} {v}")
    print(f"{'strace':32} {strace}")
    save("inband_client", results)


if __name__ == "__main__":
    main()
