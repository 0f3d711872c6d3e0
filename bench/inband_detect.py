"""The straggler detector (healthd.progress.stragglers) on simulated 1,024-rank synchronous data-parallel
jobs: how often it names a healthy rank, how soon it names a slow one, and what one call costs.

The noise model, per rank and step: compute = base x (1 + the rank's own healthy bias, uniform in
+-1.5 %) x lognormal jitter (sigma 5 %) x 3 on 1 % of steps (spikes) x the job's common-mode factor
(episodes covering about 10 % of the steps in which every rank is 10 % slower). Every rank leaves the
step's all-reduce when the slowest arrives, so step times are equal across ranks and a rank's wait is
the slowest arrival minus its own plus a base all-reduce time. From its onset step on, a straggler's
compute is (1 + effect) times the job's base, its own healthy bias replaced: an 8 % straggler is a rank
8 % slower than the job's median, which is what the detector's effect measures. The same 8 % on top of
the rank's bias (anywhere from 6.4 % to 9.6 % above the median) is run too and reported, without a
target. So are 8 % stragglers whose onset is a window's first step: an onset inside a window leaves that
window partly healthy, and its median shows the straggler only when most of its steps are slow (with a
5 % floor, more than about 60 % of them), so the latency depends on where in a window the onset falls.

Windows are built per rank as healthd.progress.summarize builds them (medians over the window's steps
of step - wait, step and wait; vectorized here, and checked against summarize on a few ranks), and the
detector runs the way the controller runs it: at each new window, over the last history_windows windows
of every rank. A false flag is a healthy rank named at any call; an onset's latency is the steps from
its onset step to the step that completes the window that named it.

    .venv/bin/python bench/inband_detect.py [--quick] [--jobs 20] [--windows 100]

Writes bench/results/inband_detect.json. Targets: 0 false flags over >= 2,000,000 healthy rank-windows
(the default run); every 8 % straggler named, median <= 100 steps after onset, max <= 150.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque

import numpy as np
from common import save, summary

from healthd.progress import RankWindow, StepSample, stragglers, summarize
from healthd.settings import DetectorSettings

BASE_S = 0.1
"""Median compute time of a step."""
ALLREDUCE_S = 0.02
"""The all-reduce's own time, paid by every rank after the slowest arrives."""


class Job:
    """One simulated job, generated a window at a time so that a run can stop at the first flag."""

    def __init__(self, rng: np.random.Generator, ranks: int, settings: DetectorSettings, *, jitter: float,
                 spike_p: float, spike_x: float, bias: float, common_share: float, common_x: float,
                 straggler: int | None = None, onset: int = 0, effect: float = 0.0, keep_bias: bool = False) -> None:
        self.rng, self.ranks, self.settings = rng, ranks, settings
        self.ws = settings.window_steps
        self.jitter, self.spike_p, self.spike_x = jitter, spike_p, spike_x
        self.bias = 1.0 + rng.uniform(-bias, bias, ranks)
        self.common_share, self.common_x = common_share, common_x
        self.common_left = 0  # steps left in the current common-mode episode
        self.straggler, self.onset = straggler, onset
        if straggler is not None:  # the factor on the rank's healthy compute from onset on
            self.slow_x = (1.0 + effect) * (1.0 if keep_bias else 1.0 / self.bias[straggler])
        self.window = 0
        self.history: list[deque[RankWindow]] = [deque(maxlen=settings.history_windows) for _ in range(ranks)]

    def _common(self) -> np.ndarray:
        """Per step of the next window: 1, or common_x inside an episode. Episodes last 20-200 steps and
        start at a rate that makes them cover common_share of the steps."""
        out = np.ones(self.ws)
        mean_len = 110.0
        start_p = self.common_share / (mean_len * (1.0 - self.common_share))
        for i in range(self.ws):
            if self.common_left == 0 and self.rng.random() < start_p:
                self.common_left = int(self.rng.integers(20, 201))
            if self.common_left > 0:
                out[i] = self.common_x
                self.common_left -= 1
        return out

    def steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next window's (compute, step, wait), each ranks x window_steps."""
        shape = (self.ranks, self.ws)
        c = BASE_S * self.bias[:, None] * self._common()[None, :] * self.rng.lognormal(0.0, self.jitter, shape)
        c *= np.where(self.rng.random(shape) < self.spike_p, self.spike_x, 1.0)
        if self.straggler is not None:
            first = self.window * self.ws
            slow = np.arange(first, first + self.ws) >= self.onset
            c[self.straggler, slow] *= self.slow_x
        step = np.broadcast_to(c.max(axis=0) + ALLREDUCE_S, shape)
        wait = step - c
        return c, step, wait

    def next_window(self) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Advance one window: its figures join every rank's history. Returns the window number and the
        raw steps (for the check against summarize)."""
        _, step, wait = self.steps()
        compute = step - wait  # what summarize takes: the recorded step minus the recorded wait
        cm, sm, wm = np.median(compute, axis=1), np.median(step, axis=1), np.median(wait, axis=1)
        w = self.window
        for r in range(self.ranks):
            self.history[r].append(RankWindow(rank=r, window=w, steps=self.ws, compute_s=float(cm[r]),
                                              step_s=float(sm[r]), wait_s=float(wm[r])))
        self.window += 1
        return w, step, wait

    def detect(self) -> tuple[tuple, tuple[float, float]]:
        """The detector over every rank's history, and its (wall, CPU) seconds: on a shared machine the
        CPU time is the steadier figure."""
        view = {r: tuple(h) for r, h in enumerate(self.history)}
        t0, c0 = time.perf_counter(), time.process_time()
        found = stragglers(view, self.settings)
        return found, (time.perf_counter() - t0, time.process_time() - c0)


def check_summarize(job: Job) -> None:
    """The vectorized windows must be the ones summarize makes from the same steps."""
    w, step, wait = job.next_window()
    ws = job.ws
    for r in (0, 1, job.ranks - 1):
        samples = [StepSample(step=w * ws + i, step_s=float(step[r, i]), wait_s=float(wait[r, i])) for i in range(ws)]
        samples.append(StepSample(step=(w + 1) * ws, step_s=BASE_S, wait_s=0.0))  # completes the window
        (got,) = summarize(r, samples, job.settings)
        mine = job.history[r][-1]
        for f in ("compute_s", "step_s", "wait_s"):
            if abs(getattr(got, f) - getattr(mine, f)) > 1e-12:
                sys.exit(f"window figures differ from summarize: rank {r} {f} {getattr(got, f)} != {getattr(mine, f)}")
        if (got.window, got.steps) != (mine.window, mine.steps):
            sys.exit(f"window numbering differs from summarize: {got} != {mine}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a short run (about 20 s): fewer jobs and onsets")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=20, help="healthy jobs")
    ap.add_argument("--windows", type=int, default=100, help="windows per healthy job")
    ap.add_argument("--onsets", type=int, default=50, help="8 %% stragglers")
    ap.add_argument("--onsets-small", type=int, default=20, help="stragglers of each smaller effect")
    ap.add_argument("--horizon", type=int, default=20, help="windows after onset a straggler has to be named")
    ap.add_argument("--rng", type=int, default=20261201, help="the random generator's start, to repeat a run")
    ap.add_argument("--jitter", type=float, default=0.05)
    ap.add_argument("--spike-p", type=float, default=0.01)
    ap.add_argument("--spike-x", type=float, default=3.0)
    ap.add_argument("--bias", type=float, default=0.015)
    ap.add_argument("--common-share", type=float, default=0.10)
    ap.add_argument("--common-x", type=float, default=1.10)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.windows, args.onsets, args.onsets_small = 2, 50, 12, 5
    settings = DetectorSettings()
    rng = np.random.default_rng(args.rng)
    noise = dict(jitter=args.jitter, spike_p=args.spike_p, spike_x=args.spike_x, bias=args.bias,
                 common_share=args.common_share, common_x=args.common_x)
    ws, hist = settings.window_steps, settings.history_windows
    started = time.perf_counter()

    check_summarize(Job(rng, args.ranks, settings, **noise))

    costs: list[float] = []  # seconds per call with a full history
    cpu: list[float] = []
    healthy_windows = 0
    false_flags: list[dict] = []
    for j in range(args.jobs):
        job = Job(rng, args.ranks, settings, **noise)
        for _ in range(args.windows):
            w, _, _ = job.next_window()
            found, cost = job.detect()
            healthy_windows += args.ranks
            if w >= hist - 1:
                costs.append(cost[0])
                cpu.append(cost[1])
            false_flags += [{"job": j, "window": w, "rank": s.rank, "effect": round(s.effect, 4)} for s in found]
    t_healthy = time.perf_counter() - started
    print(f"healthy: {healthy_windows:,} rank-windows ({args.jobs} jobs x {args.windows} windows x {args.ranks} "
          f"ranks), {len(false_flags)} false flags  [{t_healthy:.0f} s]")

    def onsets(effect: float, n: int, keep_bias: bool = False, aligned: bool = False) -> dict:
        latencies: list[int] = []
        other = 0
        other_windows = 0
        for _ in range(n):
            rank = int(rng.integers(args.ranks))
            onset = int(rng.integers(hist * ws, (hist + 4) * ws))  # a full history before it, any step of a window
            if aligned:
                onset -= onset % ws
            job = Job(rng, args.ranks, settings, straggler=rank, onset=onset, effect=effect,
                      keep_bias=keep_bias, **noise)
            while job.window * ws < onset + args.horizon * ws:
                w, _, _ = job.next_window()
                found, cost = job.detect()
                if w >= hist - 1:
                    costs.append(cost[0])
                    cpu.append(cost[1])
                other_windows += args.ranks - (1 if (w + 1) * ws > onset else 0)
                other += sum(1 for s in found if s.rank != rank)
                if any(s.rank == rank for s in found):
                    latencies.append((w + 1) * ws - onset)
                    break
        out: dict = {"effect": effect, "on_top_of_bias": keep_bias, "onset_at_window_start": aligned, "onsets": n,
                     "named": len(latencies), "rate": len(latencies) / n if n else 0.0, "other_rank_flags": other,
                     "other_rank_windows": other_windows}
        if latencies:
            out["steps_to_flag"] = {"median": statistics.median(latencies), "max": max(latencies),
                                    "min": min(latencies)}
        return out

    detection = {}
    for name, effect, n, keep_bias, aligned in (
            ("8%", 0.08, args.onsets, False, False),
            ("8%_onset_at_window_start", 0.08, args.onsets, False, True),
            ("8%_on_top_of_bias", 0.08, args.onsets_small, True, False),
            ("6%", 0.06, args.onsets_small, False, False),
            ("5%", 0.05, args.onsets_small, False, False),
            ("3%", 0.03, args.onsets_small, False, False)):
        t0 = time.perf_counter()
        d = onsets(effect, n, keep_bias, aligned)
        detection[name] = d
        lat = d.get("steps_to_flag", {})
        print(f"straggler {name}: named {d['named']}/{n} within {args.horizon * ws} steps, steps to flag "
              f"median {lat.get('median', '-')} max {lat.get('max', '-')}, other ranks flagged {d['other_rank_flags']} "
              f"of {d['other_rank_windows']:,}  [{time.perf_counter() - t0:.0f} s]")

    cost_ms = {k: (round(v * 1000, 3) if isinstance(v, float) else v) for k, v in summary(costs).items()}
    cpu_ms = {k: (round(v * 1000, 3) if isinstance(v, float) else v) for k, v in summary(cpu).items()}
    print(f"detector cost, {args.ranks} ranks x {hist} windows: median {cost_ms['median']} ms, p99 {cost_ms['p99']} ms, "
          f"max {cost_ms['max']} ms over {cost_ms['n']} calls; CPU time median {cpu_ms['median']} ms, "
          f"p99 {cpu_ms['p99']} ms")

    eight = detection["8%"]
    lat8 = eight.get("steps_to_flag", {})
    missed = []
    if not args.quick and healthy_windows < 2_000_000:
        missed.append(f"healthy rank-windows {healthy_windows:,} < 2,000,000")
    if false_flags or any(d["other_rank_flags"] for d in detection.values()):
        missed.append("false flags")
    if eight["named"] < eight["onsets"]:
        missed.append(f"8 % straggler named {eight['named']}/{eight['onsets']}")
    if lat8 and lat8["median"] > 100:
        missed.append(f"8 % median {lat8['median']} > 100 steps")
    if lat8 and lat8["max"] > 150:
        missed.append(f"8 % max {lat8['max']} > 150 steps")

    results = {
        "quick": args.quick,
        "target": "0 false flags over >= 2,000,000 healthy rank-windows; every 8 % straggler named, median <= 100 "
                  "steps after onset, max <= 150",
        "settings": {f: getattr(settings, f) for f in ("window_steps", "min_effect", "mad_k", "consecutive",
                                                       "history_windows")},
        "noise": {"ranks": args.ranks, **noise, "base_s": BASE_S, "allreduce_s": ALLREDUCE_S, "rng": args.rng},
        "healthy": {"jobs": args.jobs, "windows_per_job": args.windows, "rank_windows": healthy_windows,
                    "false_flags": len(false_flags), "flags": false_flags[:20]},
        "detection": detection,
        "horizon_steps": args.horizon * ws,
        "detector_ms_per_call": cost_ms,
        "detector_cpu_ms_per_call": cpu_ms,
        "wall_s": round(time.perf_counter() - started, 1),
        "missed": missed,
    }
    save("inband_detect", results)
    if missed:
        sys.exit("missed: " + "; ".join(missed))


if __name__ == "__main__":
    main()
