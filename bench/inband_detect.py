"""The straggler detector (healthd.progress.stragglers) on simulated synchronous data-parallel jobs of 2 to
1,024 ranks: how often it names a healthy rank, how soon it names a slow one, and what one call costs.

The noise model, per rank and step: compute = base x (1 + the rank's own healthy bias, uniform in
+-1.5 %) x lognormal jitter (sigma 5 %) x 3 on 1 % of steps (spikes) x the job's common-mode factor
(episodes covering about 10 % of the steps in which every rank is 10 % slower). Every rank leaves the
step's all-reduce when the slowest arrives, so step times are equal across ranks and a rank's wait is
the slowest arrival minus its own plus a base all-reduce time.

Healthy jobs come in two shapes, and the false flags of both are counted:

- **plain**: the noise above only;
- **structured**: what real jobs do besides. Pipeline stages: a quarter of the ranks each at +0, +4,
  +8 and +12 % from the first step. Rank 0's extra work: +15 % on every step, and 10 times its compute
  on every 50th step (logging, an evaluation batch) while the others wait. Hostile clocks: each rank's
  clock runs up to 500 ppm off, and on 0.05 % of its steps the rank is paused 2 s between two steps
  (a VM or a debugger), which its step time records as compute.

A straggler, from its onset step on, is (1 + effect) times what it was, its healthy bias and its
structure kept (what the detector's effect measures: a rank's slowdown against its own first windows):
**steady** (every step) or **intermittent** (every other step 1 + 2 x effect, the same net slowdown).
"Bias replaced" stragglers are 8 % above the job's median instead (6.4 % to 9.6 % slower than they
were; reported without a target). So are 8 % stragglers whose onset is a window's first step: an onset inside a
window leaves that window partly healthy, so the latency depends on where in a window it falls. A
**later job step** is a job whose first windows are a second `srun` step's (the step numbers go on,
the ranks and their baseline are the step's own). Small jobs (2, 4, 8 ranks) carry each step's waits
for the rank-order test.

Windows are built per rank as healthd.progress.summarize builds them (the trimmed mean of step - wait,
medians of step and wait; vectorized here, and checked against summarize on a few ranks), and each rank
keeps its first baseline_windows windows with its newest history_windows, as the agent does
(healthd.progress.with_baseline). The detector runs the way the controller runs it: at each new window,
over every rank's windows. A false flag is a healthy rank named at any call; an onset's latency is the
steps from its onset step to the step that completes the window that named it.

    .venv/bin/python bench/inband_detect.py [--quick] [--jobs 10] [--windows 100]

Writes bench/results/inband_detect.json. Targets: 0 false flags over >= 2,000,000 healthy 1,024-rank
rank-windows (the default run: half plain, half structured) and in every small job; every steady and
every intermittent 8 % straggler (64 and 1,024 ranks) named, median <= 100 steps after onset, max <= 150;
every straggler named with a measured effect of at least min_effect (one below it is named only when
noise makes its windows measure that much: how often is reported).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque

import numpy as np
from common import save, summary

from healthd.progress import RankWindow, StepSample, stragglers, summarize, with_baseline
from healthd.settings import DetectorSettings

BASE_S = 0.1
"""Median compute time of a step."""
ALLREDUCE_S = 0.02
"""The all-reduce's own time, paid by every rank after the slowest arrives."""
TRIM = 0.2
"""As healthd.progress: the share of a window's steps set aside at each end of its compute figure."""


class Job:
    """One simulated job, generated a window at a time so that a run can stop at the first flag."""

    def __init__(self, rng: np.random.Generator, ranks: int, settings: DetectorSettings, *, jitter: float,
                 spike_p: float, spike_x: float, bias: float, common_share: float, common_x: float,
                 structured: bool = False, straggler: int | None = None, onset: int = 0, effect: float = 0.0,
                 replace_bias: bool = False, intermittent: bool = False, first_window: int = 0) -> None:
        self.rng, self.ranks, self.settings = rng, ranks, settings
        self.ws = settings.window_steps
        self.jitter, self.spike_p, self.spike_x = jitter, spike_p, spike_x
        self.bias = 1.0 + rng.uniform(-bias, bias, ranks)
        self.structure = np.ones(ranks)
        self.structured = structured
        if structured:
            self.structure = 1.0 + 0.04 * (np.arange(ranks) * 4 // ranks)  # four pipeline stages
            self.structure[0] *= 1.15
            self.clock = 1.0 + rng.uniform(-500e-6, 500e-6, ranks)
        self.common_share, self.common_x = common_share, common_x
        self.common_left = 0  # steps left in the current common-mode episode
        self.straggler, self.onset, self.intermittent = straggler, onset, intermittent
        self.slow_x = 1.0
        if straggler is not None:  # the factor on the rank's healthy compute from onset on
            self.slow_x = (1.0 + effect) * (1.0 / self.bias[straggler] if replace_bias else 1.0)
        self.effect = effect
        self.window = first_window
        self.history: list[deque[RankWindow]] = [deque(maxlen=settings.history_windows) for _ in range(ranks)]
        self.first: list[tuple[RankWindow, ...]] = [() for _ in range(ranks)]
        self.small = ranks < settings.min_ranks_spread

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

    def steps(self) -> tuple[np.ndarray, np.ndarray]:
        """The next window's recorded (step, wait), each ranks x window_steps."""
        shape = (self.ranks, self.ws)
        first = self.window * self.ws
        numbers = np.arange(first, first + self.ws)
        c = (BASE_S * self.bias[:, None] * self.structure[:, None] * self._common()[None, :]
             * self.rng.lognormal(0.0, self.jitter, shape))
        c *= np.where(self.rng.random(shape) < self.spike_p, self.spike_x, 1.0)
        if self.structured:
            c[0, numbers % 50 == 0] *= 10.0  # rank 0's logging or evaluation batch; the others wait
        if self.straggler is not None:
            slow = numbers >= self.onset
            if self.intermittent:
                c[self.straggler, slow & (numbers % 2 == 1)] *= (1.0 + 2.0 * self.effect) / (1.0 + self.effect)
                c[self.straggler, slow & (numbers % 2 == 0)] *= 1.0 / (1.0 + self.effect)
            c[self.straggler, slow] *= self.slow_x
        step = np.broadcast_to(c.max(axis=0) + ALLREDUCE_S, shape).copy()
        wait = step - c
        if self.structured:  # what each rank's own clock records, and its pauses between steps
            step *= self.clock[:, None]
            wait *= self.clock[:, None]
            step += np.where(self.rng.random(shape) < 0.0005, 2.0, 0.0)
        return step, wait

    def next_window(self) -> tuple[int, np.ndarray, np.ndarray]:
        """Advance one window: its figures join every rank's history. Returns the window number and the
        raw steps (for the check against summarize)."""
        step, wait = self.steps()
        compute = np.sort(step - wait, axis=1)  # what summarize takes: the recorded step minus the recorded wait
        k = int(self.ws * TRIM)
        cm = compute[:, k:self.ws - k].mean(axis=1)
        sm, wm = np.median(step, axis=1), np.median(wait, axis=1)
        w = self.window
        for r in range(self.ranks):
            rw = RankWindow(rank=r, window=w, steps=self.ws, compute_s=float(cm[r]), step_s=float(sm[r]),
                            wait_s=float(wm[r]), waits=tuple(wait[r].tolist()) if self.small else None)
            self.history[r].append(rw)
            if len(self.first[r]) < self.settings.baseline_windows:
                self.first[r] += (rw,)
        self.window += 1
        return w, step, wait

    def view(self) -> dict[int, tuple[RankWindow, ...]]:
        """Every rank's first windows and newest ones, as with_baseline joins them."""
        out = {}
        for r, h in enumerate(self.history):
            newer = h[0].window if h else 0
            out[r] = tuple(x for x in self.first[r] if x.window < newer) + tuple(h)
        return out

    def detect(self) -> tuple[tuple, tuple[float, float]]:
        """The detector over every rank's windows, and its (wall, CPU) seconds: on a shared machine the
        CPU time is the steadier figure."""
        view = self.view()
        t0, c0 = time.perf_counter(), time.process_time()
        found = stragglers(view, self.settings)
        return found, (time.perf_counter() - t0, time.process_time() - c0)


def check_windows(job: Job) -> None:
    """The vectorized windows must be the ones summarize makes from the same steps, and a rank's first
    and newest windows the ones with_baseline keeps."""
    for _ in range(job.settings.baseline_windows + job.settings.history_windows + 2):
        w, step, wait = job.next_window()
    ws = job.ws
    for r in (0, 1, job.ranks - 1):
        samples = [StepSample(step=w * ws + i, step_s=float(step[r, i]), wait_s=float(wait[r, i])) for i in range(ws)]
        samples.append(StepSample(step=(w + 1) * ws, step_s=BASE_S, wait_s=0.0))  # completes the window
        (got,) = summarize(r, samples, job.settings, with_waits=job.small)
        mine = job.history[r][-1]
        for f in ("compute_s", "step_s", "wait_s"):
            if abs(getattr(got, f) - getattr(mine, f)) > 1e-12:
                sys.exit(f"window figures differ from summarize: rank {r} {f} {getattr(got, f)} != {getattr(mine, f)}")
        if (got.window, got.steps, got.waits) != (mine.window, mine.steps, mine.waits):
            sys.exit(f"window numbering or waits differ from summarize: {got} != {mine}")
        first: tuple[RankWindow, ...] = ()
        joined: tuple[RankWindow, ...] = ()
        seen: list[RankWindow] = []
        for x in list(job.first[r]) + list(job.history[r]):  # the windows as they came, a window at a time
            if x not in seen:
                seen.append(x)
            first, joined = with_baseline(first, tuple(seen[-job.settings.history_windows:]), job.settings)
        if joined != job.view()[r]:
            sys.exit(f"a rank's first and newest windows differ from with_baseline: rank {r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a short run (about 30 s): fewer jobs and onsets")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=10, help="healthy jobs of each shape (plain, structured)")
    ap.add_argument("--windows", type=int, default=100, help="windows per healthy job")
    ap.add_argument("--small-jobs", type=int, default=200, help="healthy jobs of each small size and shape")
    ap.add_argument("--onsets", type=int, default=50, help="8 %% stragglers of each kind that has a target")
    ap.add_argument("--onsets-small", type=int, default=20, help="stragglers of each other kind")
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
        args.jobs, args.windows, args.small_jobs, args.onsets, args.onsets_small = 1, 50, 20, 12, 5
    settings = DetectorSettings()
    rng = np.random.default_rng(args.rng)
    noise = dict(jitter=args.jitter, spike_p=args.spike_p, spike_x=args.spike_x, bias=args.bias,
                 common_share=args.common_share, common_x=args.common_x)
    ws, hist, first = settings.window_steps, settings.history_windows, settings.baseline_windows
    started = time.perf_counter()

    check_windows(Job(rng, args.ranks, settings, structured=True, **noise))
    check_windows(Job(rng, 4, settings, structured=True, **noise))

    costs: list[float] = []  # seconds per call on args.ranks ranks with a full history
    cpu: list[float] = []

    def healthy(ranks: int, jobs: int, windows: int, structured: bool) -> dict:
        rank_windows, flags = 0, []
        t0 = time.perf_counter()
        for j in range(jobs):
            job = Job(rng, ranks, settings, structured=structured, **noise)
            for _ in range(windows):
                w, _, _ = job.next_window()
                found, cost = job.detect()
                rank_windows += ranks
                if ranks == args.ranks and w >= hist + first - 1:
                    costs.append(cost[0])
                    cpu.append(cost[1])
                flags += [{"job": j, "window": w, "rank": s.rank, "test": s.test, "effect": round(s.effect, 4)}
                          for s in found]
        shape = "structured" if structured else "plain"
        print(f"healthy {shape} {ranks}-rank jobs: {rank_windows:,} rank-windows ({jobs} jobs x {windows} windows), "
              f"{len(flags)} false flags  [{time.perf_counter() - t0:.0f} s]")
        return {"ranks": ranks, "shape": shape, "jobs": jobs, "windows_per_job": windows,
                "rank_windows": rank_windows, "false_flags": len(flags), "flags": flags[:20]}

    healthy_runs = [healthy(args.ranks, args.jobs, args.windows, s) for s in (False, True)]
    healthy_runs += [healthy(n, args.small_jobs, 100, s) for n in (2, 4, 8) for s in (False, True)]
    big_windows = sum(h["rank_windows"] for h in healthy_runs if h["ranks"] == args.ranks)

    def onsets(ranks: int, effect: float, n: int, *, replace_bias: bool = False, aligned: bool = False,
               intermittent: bool = False, structured: bool = False, later_step: bool = False) -> dict:
        latencies: list[int] = []
        measured: list[float] = []  # the effect the detector reported when it named the straggler
        flags: list[dict] = []
        other = 0
        other_windows = 0
        for _ in range(n):
            # a later job step: its first window is the 40th of the job (the step numbers go on)
            start = 40 if later_step else 0
            rank = int(rng.integers(ranks))
            # a full history before it, at any step of a window
            onset = int(rng.integers((start + hist) * ws, (start + hist + 4) * ws))
            if aligned:
                onset -= onset % ws
            job = Job(rng, ranks, settings, straggler=rank, onset=onset, effect=effect, replace_bias=replace_bias,
                      intermittent=intermittent, structured=structured, first_window=start, **noise)
            while job.window * ws < onset + args.horizon * ws:
                w, _, _ = job.next_window()
                found, cost = job.detect()
                if ranks == args.ranks and w >= start + hist + first - 1:
                    costs.append(cost[0])
                    cpu.append(cost[1])
                other_windows += ranks - (1 if (w + 1) * ws > onset else 0)
                other += sum(1 for s in found if s.rank != rank)
                flags += [{"window": w, "rank": s.rank, "test": s.test, "effect": round(s.effect, 4)}
                          for s in found if s.rank != rank][:5]
                mine = [s for s in found if s.rank == rank]
                if mine:
                    latencies.append((w + 1) * ws - onset)
                    measured.append(mine[0].effect)
                    break
        out: dict = {"ranks": ranks, "effect": effect, "intermittent": intermittent, "structured": structured,
                     "later_step": later_step, "bias_replaced": replace_bias, "onset_at_window_start": aligned,
                     "onsets": n, "named": len(latencies), "rate": len(latencies) / n if n else 0.0,
                     "other_rank_flags": other, "other_rank_windows": other_windows, "other_flags": flags[:10]}
        if measured:
            out["named_effect"] = {"min": round(min(measured), 4), "median": round(statistics.median(measured), 4)}
        if latencies:
            out["steps_to_flag"] = {"median": statistics.median(latencies), "max": max(latencies),
                                    "min": min(latencies)}
        return out

    R = args.ranks
    plan: list[tuple[str, dict, bool]] = [  # name, arguments, has a target (every one named within 150 steps)
        (f"8%_steady_{R}", dict(ranks=R, effect=0.08, n=args.onsets), True),
        ("8%_steady_64", dict(ranks=64, effect=0.08, n=args.onsets), True),
        (f"8%_intermittent_{R}", dict(ranks=R, effect=0.08, n=args.onsets, intermittent=True), True),
        ("8%_intermittent_64", dict(ranks=64, effect=0.08, n=args.onsets, intermittent=True), True),
        (f"8%_onset_at_window_start_{R}", dict(ranks=R, effect=0.08, n=args.onsets, aligned=True), True),
        (f"8%_structured_{R}", dict(ranks=R, effect=0.08, n=args.onsets_small, structured=True), False),
        ("8%_later_step_64", dict(ranks=64, effect=0.08, n=args.onsets_small, later_step=True), False),
        (f"8%_bias_replaced_{R}", dict(ranks=R, effect=0.08, n=args.onsets_small, replace_bias=True), False),
        (f"6%_{R}", dict(ranks=R, effect=0.06, n=args.onsets_small), False),
        (f"5%_{R}", dict(ranks=R, effect=0.05, n=args.onsets_small), False),
        (f"3%_{R}", dict(ranks=R, effect=0.03, n=args.onsets_small), False),
    ]
    for n in (2, 4, 8):
        for e in (0.06, 0.05, 0.04, 0.03):
            plan.append((f"{round(e * 100)}%_small_{n}", dict(ranks=n, effect=e, n=args.onsets_small), False))
    detection = {}
    for name, kw, _ in plan:
        t0 = time.perf_counter()
        d = onsets(**kw)
        detection[name] = d
        lat = d.get("steps_to_flag", {})
        print(f"straggler {name}: named {d['named']}/{d['onsets']} within {args.horizon * ws} steps, steps to flag "
              f"median {lat.get('median', '-')} max {lat.get('max', '-')}, other ranks flagged {d['other_rank_flags']} "
              f"of {d['other_rank_windows']:,}  [{time.perf_counter() - t0:.0f} s]")

    cost_ms = {k: (round(v * 1000, 3) if isinstance(v, float) else v) for k, v in summary(costs).items()}
    cpu_ms = {k: (round(v * 1000, 3) if isinstance(v, float) else v) for k, v in summary(cpu).items()}
    print(f"detector cost, {R} ranks x {first} + {hist} windows: median {cost_ms['median']} ms, p99 {cost_ms['p99']} ms, "
          f"max {cost_ms['max']} ms over {cost_ms['n']} calls; CPU time median {cpu_ms['median']} ms, "
          f"p99 {cpu_ms['p99']} ms")

    missed = []
    if not args.quick and big_windows < 2_000_000:
        missed.append(f"healthy {R}-rank rank-windows {big_windows:,} < 2,000,000")
    if any(h["false_flags"] for h in healthy_runs) or any(d["other_rank_flags"] for d in detection.values()):
        missed.append("false flags")
    for name, _, target in plan:
        d = detection[name]
        lat = d.get("steps_to_flag", {})
        if target and d["named"] < d["onsets"]:
            missed.append(f"{name} named {d['named']}/{d['onsets']}")
        if target and lat and lat["median"] > 100:
            missed.append(f"{name} median {lat['median']} > 100 steps")
        if target and lat and lat["max"] > 150:
            missed.append(f"{name} max {lat['max']} > 150 steps")
        if d.get("named_effect", {}).get("min", 1.0) < settings.min_effect:
            missed.append(f"{name}: named with a measured effect below min_effect")

    results = {
        "quick": args.quick,
        "target": "0 false flags over >= 2,000,000 healthy 1,024-rank rank-windows (plain and structured) and in "
                  "every small job; every steady and intermittent 8 % straggler (64 and 1,024 ranks) named, median "
                  "<= 100 steps after onset, max <= 150; nothing named with a measured effect below min_effect",
        "settings": {f: getattr(settings, f) for f in ("window_steps", "min_effect", "mad_k", "consecutive",
                                                       "history_windows", "baseline_windows", "min_ranks_spread",
                                                       "rank_order_p", "rank_order_consecutive")},
        "noise": {"ranks": R, **noise, "base_s": BASE_S, "allreduce_s": ALLREDUCE_S, "rng": args.rng},
        "healthy": healthy_runs,
        "healthy_rank_windows": sum(h["rank_windows"] for h in healthy_runs),
        "healthy_false_flags": sum(h["false_flags"] for h in healthy_runs),
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
