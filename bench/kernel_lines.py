"""Kernel-line throughput: lines/s read from real journal files, parsed, matched and folded, against
the floor of merely iterating the same journal in the same process; and memory through a burst.

    .venv/bin/python bench/kernel_lines.py [--lines 100000]

Writes bench/results/kernel_lines.json.
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import tempfile
import time
import tracemalloc
from pathlib import Path

from common import rss_bytes, save, summary

from healthd.agent.collectors.kernel_log import KernelLogFollower
from healthd.agent.collectors.kernel_parse import parse_line
from tests.support.journal import write_journal

XID_LINES = [
    "NVRM: Xid (PCI:0000:18:00): 95, pid=2211, name=python3, Uncontained ECC error",
    "NVRM: Xid (PCI:0000:2a:00): 13, pid=981, name=python, Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): Out Of Range Address",
    "NVRM: Xid (PCI:0000:3a:00): 31, pid=77, name=train.py, MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000",
    "NVRM: Xid (0000:5d:00): 79, GPU has fallen off the bus.",
    "NVRM: GPU 0000:9a:00.0: GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x00000000)",
]
NOISE = [
    "mlx5_core 0000:3b:00.0: mlx5_pcie_event:301: PCIe slot advertised sufficient power (75W).",
    "EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode.",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    "audit: type=1400 audit(1700000000.000:2): apparmor=\"STATUS\"",
]


def mixed_lines(n: int, seed: int = 1) -> list[str]:
    """80% an identical Xid 95 burst, 10% other Xid variants (some distinct by pid), 10% noise."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        r = rnd.random()
        if r < 0.8:
            out.append(XID_LINES[0])
        elif r < 0.9:
            line = rnd.choice(XID_LINES[1:])
            out.append(line.replace("pid=981", f"pid={rnd.randrange(1000, 1100)}"))
        else:
            out.append(rnd.choice(NOISE))
    return out


def read_all(follower: KernelLogFollower) -> tuple[int, int]:
    lines = events = 0
    while True:
        s = follower.read(0.0)
        lines += s.lines_read
        events += sum(e.count for e in s.events)
        if not s.lines_read:
            return lines, events


def raw_iterate(journal_dir: Path) -> int:
    """The floor: open the same journal and pull MESSAGE of every kernel entry, nothing else."""
    from systemd import journal

    r = journal.Reader(path=str(journal_dir))
    r.add_match(_TRANSPORT="kernel")
    r.seek_head()
    n = 0
    while r._next():
        r._get("MESSAGE")
        n += 1
    r.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    lines = mixed_lines(args.lines)
    results: dict[str, object] = {"lines": args.lines}

    # 1. parse + match alone, in memory, against a bare regex search over the same lines
    marker = re.compile(r"NVRM: Xid")
    parse_t, regex_t = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        for line in lines:
            parse_line(line)
        parse_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        for line in lines:
            marker.search(line)
        regex_t.append(time.perf_counter() - t)
    results["parse_lines_per_s"] = args.lines / summary(parse_t)["median"]
    results["bare_regex_lines_per_s"] = args.lines / summary(regex_t)["median"]
    results["parse_vs_bare_regex_time_ratio"] = summary(parse_t)["median"] / summary(regex_t)["median"]

    with tempfile.TemporaryDirectory() as tmp:
        jdir = Path(tmp) / "journal"
        t = time.perf_counter()
        write_journal(jdir, lines, start_usec=int(time.time() * 1e6))
        results["journal_write_s"] = time.perf_counter() - t

        # 2. end to end: journal -> parse -> match -> fold, against raw iteration of the same files
        e2e_t, raw_t = [], []
        for _ in range(args.repeat):
            gc.collect()
            with KernelLogFollower(str(jdir), kmsg_path=None, start_at="head") as f:
                t = time.perf_counter()
                n, events = read_all(f)
                e2e_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            raw_n = raw_iterate(jdir)
            raw_t.append(time.perf_counter() - t)
        assert n == raw_n == args.lines, (n, raw_n)
        results["end_to_end_lines_per_s"] = args.lines / summary(e2e_t)["median"]
        results["end_to_end_p99_s"] = summary(e2e_t)["p99"]
        results["raw_journal_lines_per_s"] = args.lines / summary(raw_t)["median"]
        results["end_to_end_vs_raw_time_ratio"] = summary(e2e_t)["median"] / summary(raw_t)["median"]
        results["xid_lines_counted"] = events

    # 3. memory through bursts of identical lines: 10k vs 100k lines must cost the same
    burst_mem = {}
    for size in (10_000, 100_000):
        with tempfile.TemporaryDirectory() as tmp:
            jdir = Path(tmp) / "j"
            write_journal(jdir, [XID_LINES[0]] * size, start_usec=int(time.time() * 1e6))
            gc.collect()
            rss0 = rss_bytes()
            tracemalloc.start()
            with KernelLogFollower(str(jdir), kmsg_path=None, start_at="head") as f:
                n, events = read_all(f)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            burst_mem[size] = {"lines": n, "count": events, "tracemalloc_peak_bytes": peak,
                               "rss_growth_bytes": rss_bytes() - rss0}
    results["burst_memory"] = burst_mem
    results["rss_bytes_end"] = rss_bytes()

    for k, v in results.items():
        print(f"{k:34} {v:,.3f}" if isinstance(v, float) else f"{k:34} {v}")
    save("kernel_lines", results)


if __name__ == "__main__":
    main()
