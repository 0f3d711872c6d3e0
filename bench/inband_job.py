"""Straggler detection on a real data-parallel job: tests/inband/ddp_job.py (torch.distributed, gloo on
CPU, 4 ranks, each pinned to a CPU) launched with srun on the local Slurm test cluster, in two
layouts: `nodes` (`srun -N4 -n4`, one rank per node: the controller compares them) and `node`
(`srun -N1 -n4`: the node's agent does); each rank writes its in-band ring; then healthd.progress
runs over the recorded rings as the agents and the controller would, window by window.

Runs: one healthy job, and one job per onset with rank 3 slowed by --fraction (8 %) of its own
compute from that step on (ddp_job.py --straggle; --straggle-by sleep, the default, has the rank wait
as it would on a slow GPU, leaving its core to the rank that shares it on this machine; spin keeps the
core busy, which slows that other rank too). Reports
- steps from onset to flag: the first step at which healthd.progress.stragglers, given every rank's
  complete windows so far (a window is complete once a rank has a step in the next), flags rank 3
  (target <= 200); the agent and the controller add at most one tick on top;
- false flags: any rank flagged in the healthy job, any other rank in the slowed ones (target 0);
- the slowdown the job really had: rank 3's compute against the other ranks', per window, before
  and after the onset (from the rings), and ddp_job.py's own before/after figure;
- step time median and p99 (from the rings), and the cost of an `hd.step()` call inside the loaded
  job (ddp_job.py times it, and an empty call the same way; target <= 20 us median).

    .venv/bin/python bench/inband_job.py [--steps 600] [--onsets 150,250,350] [--layouts nodes,node]
        [--launcher srun|local] [--straggle-by sleep|spin]

Needs torch (`pip install -e '.[inband]'`); srun needs root and slurm-wlm (tests/support/slurm_cluster.py
starts a cluster of its own on free ports and stops it at the end); `--launcher local` starts the 4
ranks as plain processes instead. Writes bench/results/inband_job.json (another --fraction:
inband_job_<percent>pct.json, such as inband_job_12pct.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, pct, save

from healthd.agent.inband import CKPT_BEGIN, CKPT_END, STEP, RingError, read_ring
from healthd import progress
from healthd.progress import StepSample, stragglers, summarize
from healthd.settings import DetectorSettings

JOB = ROOT / "tests" / "inband" / "ddp_job.py"
RANKS = 4
SLOW_RANK = 3


# --------------------------------------------------------------------------- running the job


class Launcher:
    def __init__(self, kind: str, work: Path, job: Path):
        self.kind = kind
        self.work = work
        self.job = job
        self.cluster = None
        if kind == "srun":
            from tests.support.slurm_cluster import SlurmCluster, ensure_installed

            ensure_installed()
            root = Path(tempfile.mkdtemp(prefix="healthd-bench-slurm-", dir="/tmp"))
            root.chmod(0o755)
            self.cluster = SlurmCluster(root)
            self.cluster.up()

    def run(self, name: str, args: list[str], timeout: float, layout: str = "nodes") -> tuple[Path, list[dict], float]:
        """Run the job (layout `nodes`: one rank per node; `node`: the 4 ranks on one node); returns its
        in-band directory, each rank's DDP_JOB report and the wall time."""
        ring_dir = self.work / layout / name
        ring_dir.mkdir(parents=True)
        nodes = RANKS if layout == "nodes" else 1
        argv = [sys.executable, str(self.job), *args]
        started = time.monotonic()
        if self.cluster is not None:
            env = dict(self.cluster.env, HEALTHD_INBAND_DIR=str(ring_dir))
            out = subprocess.run(["srun", "-N", str(nodes), "-n", str(RANKS), f"--ntasks-per-node={RANKS // nodes}",
                                  "--export=ALL", *argv], env=env, capture_output=True, text=True,
                                 timeout=timeout, cwd="/tmp")
            text, rc = out.stdout + out.stderr, out.returncode
        else:
            port = str(29000 + os.getpid() % 1000)
            procs = []
            for rank in range(RANKS):
                env = dict(os.environ, HEALTHD_INBAND_DIR=str(ring_dir), RANK=str(rank), WORLD_SIZE=str(RANKS),
                           LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
            text, rc = "", 0
            for p in procs:
                text += p.communicate(timeout=timeout)[0]
                rc = rc or p.returncode
        wall = time.monotonic() - started
        if rc != 0:
            raise SystemExit(f"job {name} exited {rc}:\n{text[-3000:]}")
        reports = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("DDP_JOB ")]
        return ring_dir, sorted(reports, key=lambda r: r["rank"]), wall

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.down()
            shutil.rmtree(self.cluster.root, ignore_errors=True)


# --------------------------------------------------------------------------- the rings


def samples_of(ring_dir: Path) -> dict[int, list[StepSample]]:
    """rank -> its step samples, as the agent makes them (a save marks the next step)."""
    out: dict[int, list[StepSample]] = {}
    for rank in range(RANKS):
        view = read_ring(str(ring_dir), f"rank-{rank}.ring")
        if isinstance(view, RingError):
            raise SystemExit(f"rank {rank}: {view.reason}")
        if view.lost or view.torn:
            raise SystemExit(f"rank {rank}: {view.lost} records lost, {view.torn} torn")
        samples, saved = [], False
        for r in view.records:
            if r.kind == STEP:
                samples.append(StepSample(r.step, r.dur_ns / 1e9, r.wait_ns / 1e9, saved))
                saved = False
            elif r.kind in (CKPT_BEGIN, CKPT_END):
                saved = True
        out[rank] = samples
    return out


def detect(samples: dict[int, list[StepSample]], settings: DetectorSettings) -> tuple[list[dict], list[dict]]:
    """Every flag, at the first step it is raised: healthd.progress over what the rings held when the
    job had committed each step (windows complete as they would be for a reader then). And a trace,
    per completed window: the slow rank's compute ratio in it, the magnitude test's bar then (the
    spread pooled over the held windows, as healthd.progress pools it for a small job) and the steps
    of the window in which the slow rank arrived last."""
    small = RANKS < settings.min_ranks_spread
    last = min(s[-1].step for s in samples.values())
    first: dict[int, dict] = {}
    trace: list[dict] = []
    for upto in range(settings.window_steps, last + 1):
        if upto % settings.window_steps:
            continue  # a window completes only when a step of the next one is recorded
        windows = {rank: summarize(rank, [x for x in s if x.step <= upto], settings, with_waits=small)
                   for rank, s in samples.items()}
        for flag in stragglers(windows, settings):
            if flag.rank not in first:
                first[flag.rank] = {"rank": flag.rank, "step": upto, "test": flag.test,
                                    "windows": list(flag.windows), "effect": round(flag.effect, 4)}
        held: dict[int, dict[int, float]] = {}
        for rank, ws in windows.items():
            for w in ws:
                held.setdefault(w.window, {})[rank] = w.compute_s
        ratios = {w: {r: c / statistics.median(g.values()) for r, c in g.items()} for w, g in held.items()}
        pooled = progress._spread([x for g in ratios.values() for x in g.values()])
        newest = max(ratios)
        latest = {r: ws[-1] for r, ws in windows.items() if ws and ws[-1].window == newest}
        last_in = 0
        if len(latest) == RANKS and all(w.waits for w in latest.values()):
            for i in range(settings.window_steps):
                got = {r: w.waits[i] for r, w in latest.items() if i < len(w.waits) and w.waits[i] >= 0}
                if len(got) == RANKS and min(got, key=got.get) == SLOW_RANK:
                    last_in += 1
        trace.append({"window": newest, "ratio": round(ratios[newest].get(SLOW_RANK, 0.0), 4),
                      "bar": round(1 + max(settings.min_effect, settings.mad_k * pooled), 4),
                      "last_in": last_in})
    return sorted(first.values(), key=lambda f: f["step"]), trace


def compute_ratios(samples: dict[int, list[StepSample]], settings: DetectorSettings) -> dict[int, list[float]]:
    """rank -> its window median compute over the median of the ranks' (1.0: the job's median)."""
    windows = {rank: {w.window: w.compute_s for w in summarize(rank, s, DetectorSettings(
        window_steps=settings.window_steps, history_windows=10_000))} for rank, s in samples.items()}
    common = sorted(set.intersection(*(set(w) for w in windows.values())))
    out: dict[int, list[float]] = {rank: [] for rank in windows}
    for w in common:
        med = statistics.median(windows[r][w] for r in windows)
        for r in windows:
            out[r].append(round(windows[r][w] / med, 4))
    return out


def step_times(samples: dict[int, list[StepSample]]) -> dict[str, float]:
    values = [x.step_s for s in samples.values() for x in s if x.step_s > 0 and not x.checkpoint]
    return {"median_ms": round(statistics.median(values) * 1e3, 2), "p99_ms": round(pct(values, 99) * 1e3, 2),
            "n": len(values)}


def analyse(name: str, ring_dir: Path, reports: list[dict], wall: float, settings: DetectorSettings,
            onset: int | None) -> dict:
    samples = samples_of(ring_dir)
    flags, trace = detect(samples, settings)
    ratios = compute_ratios(samples, settings)
    ws = settings.window_steps
    doc: dict = {"wall_s": round(wall, 1), "steps": {r: len(s) for r, s in samples.items()},
                 "step_time": step_times(samples), "flags": flags,
                 "compute_ratio_by_window": {str(r): v for r, v in ratios.items()},
                 "rank3_by_window": trace,
                 "hd_step_us": {"median_first": round(statistics.median(r["hd_step_first_ns"] for r in reports) / 1e3, 2),
                                "median_after_empty_call": round(statistics.median(r["hd_step_second_ns"] for r in reports) / 1e3, 2),
                                "empty_call_first": round(statistics.median(r["empty_first_ns"] for r in reports) / 1e3, 2),
                                "empty_call_second": round(statistics.median(r["empty_second_ns"] for r in reports) / 1e3, 2)}}
    slow = ratios[SLOW_RANK]
    others = [statistics.median(ratios[r][i] for r in ratios if r != SLOW_RANK) for i in range(len(slow))]
    rel = [s / o for s, o in zip(slow, others, strict=True)]
    if onset is None:
        doc["false_flags"] = len(flags)
        doc["rank3_relative_compute"] = {"median": round(statistics.median(rel), 4)}
    else:
        first_after = -(-onset // ws)  # the first window wholly after the onset
        before = rel[:onset // ws]
        after = rel[first_after:]
        doc["onset"] = onset
        doc["rank3_relative_compute"] = {"before": round(statistics.median(before[1:] or before), 4),
                                         "after": round(statistics.median(after), 4) if after else None}
        doc["slowdown_measured_in_rings"] = (round(doc["rank3_relative_compute"]["after"]
                                                   / doc["rank3_relative_compute"]["before"] - 1, 4)
                                             if after else None)
        job = next((r for r in reports if r["rank"] == SLOW_RANK), {})
        doc["slowdown_measured_by_job"] = round(job["straggle_measured"], 4) if job.get("straggle_measured") else None
        hit = next((f for f in flags if f["rank"] == SLOW_RANK and f["step"] > onset), None)
        doc["flagged_at_step"] = hit["step"] if hit else None
        doc["steps_onset_to_flag"] = hit["step"] - onset if hit else None
        doc["flag_test"] = hit["test"] if hit else None
        doc["false_flags"] = len([f for f in flags if f["rank"] != SLOW_RANK or f["step"] <= onset])
    print(f"{name:10} {json.dumps({k: v for k, v in doc.items() if k not in ('compute_ratio_by_window', 'rank3_by_window')})}")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--onsets", default="150,250,350")
    ap.add_argument("--fraction", type=float, default=0.08)
    ap.add_argument("--device-ms", type=float, default=30.0,
                    help="ms of each step the ranks wait as on a GPU (ddp_job.py --device-ms; 0: a CPU-bound job)")
    ap.add_argument("--batch", type=int, default=32,
                    help="samples per rank per step with --device-ms: small, so that ranks sharing a core on "
                         "this machine do not hand a slow rank's delay back to it through the scheduler")
    ap.add_argument("--straggle-by", choices=("sleep", "spin"), default="sleep",
                    help="sleep (default): the slow rank waits as on a slow device and leaves its core to the "
                         "rank sharing it; spin: it keeps its core busy, which also slows that rank")
    ap.add_argument("--layouts", default="nodes,node",
                    help="nodes: one rank per node (the controller compares them); node: all 4 on one node (its agent does)")
    ap.add_argument("--launcher", choices=("srun", "local"), default="srun" if os.geteuid() == 0 else "local")
    ap.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned (default: rank r on CPU r mod N)")
    ap.add_argument("--job", type=Path, default=JOB, help="the job script (default tests/inband/ddp_job.py)")
    args = ap.parse_args()
    onsets = [int(x) for x in args.onsets.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    settings = DetectorSettings()
    # a SIGTERM (a timeout, an impatient operator) stops the cluster and the jobs like Ctrl-C does
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="healthd-bench-inband-job-", dir="/dev/shm"))
    launcher = None
    runs: dict[str, dict] = {}
    try:
        launcher = Launcher(args.launcher, work, args.job.resolve())
        timeout = args.steps * 1.0 + 120
        pin = [] if args.no_pin else ["--pin"]
        if args.device_ms:
            pin += ["--device-ms", str(args.device_ms), "--batch", str(args.batch)]
        for layout in layouts:
            d, reports, wall = launcher.run("healthy", ["--steps", str(args.steps), *pin], timeout, layout)
            runs[f"{layout}/healthy"] = analyse(f"{layout}/healthy", d, reports, wall, settings, None)
            for onset in onsets:
                steps = max(args.steps, onset + 300)
                name = f"onset-{onset}"
                d, reports, wall = launcher.run(name, ["--steps", str(steps), *pin, "--straggle",
                                                       f"{SLOW_RANK}:{onset}:{args.fraction}",
                                                       "--straggle-by", args.straggle_by], timeout, layout)
                runs[f"{layout}/{name}"] = analyse(f"{layout}/{name}", d, reports, wall, settings, onset)
    finally:
        if launcher is not None:
            launcher.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for layout in layouts:
        slowed = [r for k, r in runs.items() if k.startswith(f"{layout}/onset-")]
        latencies = [r["steps_onset_to_flag"] for r in slowed]
        healthy = runs[f"{layout}/healthy"]
        summary[layout] = {
            "steps_onset_to_flag": latencies,
            "all_flagged_within_200": all(x is not None and x <= 200 for x in latencies),
            "false_flags": sum(r["false_flags"] for k, r in runs.items() if k.startswith(f"{layout}/")),
            "slowdown_measured_in_rings": [r["slowdown_measured_in_rings"] for r in slowed],
            "step_time_ms": healthy["step_time"],
            "hd_step_us_median": healthy["hd_step_us"]["median_after_empty_call"],
        }
    print(json.dumps(summary))
    # The default 8 % keeps the plain name; another fraction is saved beside it, not over it.
    name = "inband_job" if args.fraction == 0.08 else f"inband_job_{round(args.fraction * 100)}pct"
    save(name, {
        "launcher": args.launcher, "layouts": layouts, "pinned": not args.no_pin, "ranks": RANKS,
        "slow_rank": SLOW_RANK, "fraction": args.fraction, "straggle_by": args.straggle_by,
        "device_ms": args.device_ms, "batch": args.batch if args.device_ms else 1024,
        "detector": {"window_steps": settings.window_steps, "min_effect": settings.min_effect,
                     "mad_k": settings.mad_k, "consecutive": settings.consecutive,
                     "rank_order_p": settings.rank_order_p,
                     "rank_order_consecutive": settings.rank_order_consecutive},
        "target": "flagged <= 200 steps after onset, 0 false flags, hd.step() <= 20 us median in the job",
        "summary": summary, "runs": runs,
        "note": "flag steps are the step at which the rings held enough for healthd.progress to flag; a "
                "running agent or controller adds at most one tick. hd_step_us: median ns per call timed "
                "with perf_counter_ns in the loop; 'first' is the first call after the optimizer step, "
                "'after_empty_call' follows an empty call timed the same way (empty_call_* are those).",
    })


if __name__ == "__main__":
    main()
