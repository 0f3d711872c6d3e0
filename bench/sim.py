"""healthd-sim's speed and memory: 140 runs of the 28-day, 128-node baseline scenario (seeds 1-140)
in `--jobs` processes (default 2: this machine's cores), each run's log scored by healthd.goodput,
timed on the wall clock and in CPU (the processes' own, summed); and the
peak RSS of a child process running 20 runs of 7 days against one running 20 runs of 28 days (memory
flat in run length: the engine keeps no history, only the run's log until it is scored).

    .venv/bin/python bench/sim.py [--runs 140] [--jobs 2] [--scenario baseline]

Writes bench/results/sim.json (the baseline: the lab's rule), or sim-<scenario>.json for another
scenario (`--scenario baseline-auto`: the same runs through the real controller), which also runs the
lab's rule on the same seeds in the same processes just after and saves the ratio of the two (this
machine's speed varies from hour to hour; the ratio does not).
"""

from __future__ import annotations

import argparse
import os
import dataclasses
import json
import logging
import multiprocessing
import resource
import subprocess
import sys
import time

from common import save

from healthd.sim import engine, scenario


def child(name: str, days: float, runs: int) -> None:
    logging.getLogger("healthd").setLevel(logging.CRITICAL + 1)
    s = dataclasses.replace(scenario.load(name), days=days)
    for seed in range(1, runs + 1):
        engine.run(s, seed)
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def _one(args: tuple[str, int]) -> tuple[float, float]:
    name, seed = args
    logging.getLogger("healthd").setLevel(logging.CRITICAL + 1)  # the controller's own log lines
    t = time.process_time()
    r = engine.run(scenario.load(name), seed)
    return r.goodput, time.process_time() - t


def _timed(pool, name: str, runs: int) -> tuple[list[tuple[float, float]], float, float]:
    """Seeds 1..runs of `name` in the pool: (goodput, CPU s) each, the wall and the CPU seconds."""
    wall0 = time.perf_counter()
    results = pool.map(_one, [(name, seed) for seed in range(1, runs + 1)], chunksize=1)
    return results, time.perf_counter() - wall0, sum(c for _, c in results)


def rss_of(name: str, days: float, runs: int) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", name, str(days), str(runs)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["maxrss_kib"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=140)
    ap.add_argument("--scenario", default="baseline")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("SCENARIO", "DAYS", "RUNS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], float(a.child[1]), int(a.child[2]))
        return
    s = scenario.load(a.scenario)
    with multiprocessing.Pool(a.jobs) as pool:
        pool.map(_one, [("baseline", 0)] * a.jobs, chunksize=1)  # each process's imports, outside the clock
        results, wall, cpu = _timed(pool, a.scenario, a.runs)
        # the lab's rule on the same seeds in the same processes just after: a machine busier now than
        # at another time slows both alike, so their ratio compares across runs
        base = _timed(pool, "baseline", a.runs) if a.scenario != "baseline" else None
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    rss7, rss28 = rss_of(a.scenario, 7, 20), rss_of(a.scenario, 28, 20)
    doc = {
        "scenario": a.scenario, "runs": a.runs, "jobs": a.jobs, "load_average_1m": round(os.getloadavg()[0], 1),
        "days": s.days, "job_nodes": s.job.nodes, "fleet_nodes": s.fleet.size,
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_ms_per_run": round(cpu / a.runs * 1000, 1),
        "peak_rss_mib": round(rss / 1024, 1),
        "child_20_runs_peak_rss_mib": {"7_days": round(rss7 / 1024, 1), "28_days": round(rss28 / 1024, 1)},
        "mean_goodput": round(sum(g for g, _ in results) / len(results), 4),
    }
    if base is not None:
        doc["against_the_labs_rule"] = {"wall_s": round(base[1], 2), "cpu_s": round(base[2], 2),
                                        "cpu_ratio": round(cpu / base[2], 2), "wall_ratio": round(wall / base[1], 2)}
    print(f"{a.runs} runs of {s.days:g} days x {s.job.nodes} nodes ({a.scenario}) in {a.jobs} processes: wall {wall:.1f} s, "
          f"CPU {cpu:.1f} s "
          f"({doc['cpu_ms_per_run']} ms a run), peak RSS {doc['peak_rss_mib']} MiB, load average {doc['load_average_1m']}")
    print(f"peak RSS of 20 runs: 7 days {doc['child_20_runs_peak_rss_mib']['7_days']} MiB, "
          f"28 days {doc['child_20_runs_peak_rss_mib']['28_days']} MiB")
    if base is not None:
        print(f"the lab's rule on the same seeds just after: wall {base[1]:.1f} s, CPU {base[2]:.1f} s; "
              f"{a.scenario} costs {doc['against_the_labs_rule']['cpu_ratio']}x its CPU")
    save("sim" if a.scenario == "baseline" else f"sim-{a.scenario}", doc)


if __name__ == "__main__":
    main()
