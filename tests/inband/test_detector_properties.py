"""The straggler detector (healthd.progress.stragglers) over generated jobs: structure is not onset, one
floor (min_effect) at every job size and by either test, an intermittent straggler is named like a
steady one, and a rank's first windows are kept however its windows arrive (with_baseline)."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.progress import RankWindow, StepSample, stragglers, summarize, with_baseline
from healthd.settings import DetectorSettings

S = DetectorSettings()  # the defaults: 25-step windows, 5 % floor, 3 baseline windows
WS = S.window_steps
BASE = 0.1
PROPS = hsettings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def windows_of(compute: dict[int, list[float]], waits: dict[int, list[tuple[float, ...]]] | None = None,
               ) -> dict[int, list[RankWindow]]:
    return {r: [RankWindow(rank=r, window=w, steps=WS, compute_s=c, step_s=c + 0.02, wait_s=0.02,
                           waits=waits[r][w] if waits else None) for w, c in enumerate(cs)]
            for r, cs in compute.items()}


def last_every_step(slow: int, ranks: int, windows: int) -> dict[int, list[tuple[float, ...]]]:
    """Waits in which rank `slow` arrives last in every step: the rank-order test's strongest case."""
    return {r: [tuple(0.001 if r == slow else 0.02 for _ in range(WS)) for _ in range(windows)] for r in range(ranks)}


@st.composite
def structured_jobs(draw):
    """A job of 2-64 ranks, each at its own fixed speed from the first window (pipeline stages, rank 0's
    extra work: up to 40 % slower, or 10 % faster) with at most +-0.5 % noise per window."""
    ranks = draw(st.integers(2, 64))
    windows = draw(st.integers(4, 14))
    rnd = draw(st.randoms(use_true_random=False))
    stages = draw(st.lists(st.floats(0.9, 1.4), min_size=1, max_size=4))
    structure = [stages[r * len(stages) // ranks] for r in range(ranks)]
    structure[0] *= draw(st.floats(1.0, 1.3))  # rank 0's extra work
    compute = {r: [BASE * structure[r] * rnd.uniform(0.995, 1.005) for _ in range(windows)] for r in range(ranks)}
    return compute, rnd.randrange(ranks)


@PROPS
@given(structured_jobs())
def test_a_rank_slower_from_the_first_window_is_structure_and_never_flagged(job):
    compute, slowest = job
    ranks, windows = len(compute), len(compute[0])
    # even when the slowest of them arrives last in every step, for the rank-order test
    assert stragglers(windows_of(compute, last_every_step(slowest, ranks, windows)), S) == ()
    assert stragglers(windows_of(compute), S) == ()


@PROPS
@given(structured_jobs(), st.integers(0, 63), st.floats(1.07, 1.3), st.integers(3, 8))
def test_a_structured_rank_that_becomes_slower_is_named_for_what_it_lost_since(job, who, factor, onset):
    compute, _ = job
    ranks, windows = len(compute), len(compute[0])
    assume(onset + 3 <= windows)
    # one of the slowest ranks from the start (a rank faster than the others is judged against them:
    # it is named once 5 % slower than they are, however much it lost)
    top = max(cs[0] for cs in compute.values())
    slowest = [r for r in range(ranks) if compute[r][0] >= top * 0.99]
    who = slowest[who % len(slowest)]
    for w in range(onset, windows):
        compute[who][w] *= factor
    # arriving last once slow, as a slower rank does: in a two-rank job the magnitude test's spread is
    # the other rank's, which mirrors the slow one, and the rank-order test names it
    waits = {r: [tuple(0.001 if r == who and w >= onset else 0.02 for _ in range(WS)) for w in range(windows)]
             for r in range(ranks)}
    (s,) = stragglers(windows_of(compute, waits), S)
    assert s.rank == who and s.effect >= S.min_effect
    assert s.windows[0] >= onset


@st.composite
def slight_slowdowns(draw):
    """A job of 2-64 ranks at +-0.2 % noise, one rank slower by less than the floor from window 3 on,
    arriving last in every step."""
    ranks = draw(st.integers(2, 64))
    windows = draw(st.integers(6, 14))
    rnd = draw(st.randoms(use_true_random=False))
    who = draw(st.integers(0, ranks - 1))
    factor = draw(st.floats(1.0, 1.045))
    bias = [rnd.uniform(0.97, 1.03) for _ in range(ranks)]
    compute = {r: [BASE * bias[r] * rnd.uniform(0.998, 1.002) * (factor if r == who and w >= 3 else 1.0)
                   for w in range(windows)] for r in range(ranks)}
    return compute, who, factor


@PROPS
@given(slight_slowdowns())
def test_no_test_flags_a_slowdown_below_min_effect_at_any_job_size(job):
    compute, who, _ = job
    ranks, windows = len(compute), len(compute[0])
    assert stragglers(windows_of(compute, last_every_step(who, ranks, windows)), S) == ()


@PROPS
@given(slight_slowdowns(), st.floats(1.07, 1.2))
def test_a_slowdown_above_min_effect_is_named_at_any_job_size(job, factor):
    compute, who, _ = job
    ranks, windows = len(compute), len(compute[0])
    for w in range(3, windows):  # the rank 7 % or more above every other rank and its own first windows
        compute[who][w] = factor * max(max(cs[w] for cs in compute.values()), max(compute[who][:3]))
    (s,) = stragglers(windows_of(compute, last_every_step(who, ranks, windows)), S)
    assert s.rank == who and s.effect >= S.min_effect


def job_steps(rnd: random.Random, ranks: int, windows: int, who: int, effect: float, onset: int,
              intermittent: bool) -> dict[int, list[StepSample]]:
    """Per rank, a synchronous job's step samples (2 % lognormal jitter, spikes x3 on 1 % of steps): rank
    `who` from step `onset` on is (1 + effect) x slower on every step, or (1 + 2 x effect) x on every
    other step."""
    out: dict[int, list[StepSample]] = {r: [] for r in range(ranks)}
    for step in range(windows * WS + 1):
        c = [BASE * rnd.lognormvariate(0, 0.02) * (3.0 if rnd.random() < 0.01 else 1.0) for _ in range(ranks)]
        if step >= onset:
            c[who] *= (1 + 2 * effect if step % 2 else 1.0) if intermittent else 1 + effect
        top = max(c) + 0.02
        for r in range(ranks):
            out[r].append(StepSample(step=step, step_s=top, wait_s=top - c[r]))
    return out


@hsettings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(0, 63), st.floats(0.07, 0.12), st.integers(0, 2 * WS - 1))
def test_a_rank_slow_on_every_other_step_is_named_like_a_steady_one(seed, who, effect, offset):
    ranks, onset, rnd = 64, 4 * WS + offset, random.Random(seed)
    settings = S
    samples = job_steps(rnd, ranks, 10, who, effect, onset, intermittent=True)
    made = {r: summarize(r, ss, replace(settings, history_windows=10)) for r, ss in samples.items()}
    named = None
    for w in range(S.baseline_windows, 10):  # the detector at each window, as the controller runs it
        got = {r: with_baseline(made[r][:S.baseline_windows], made[r][max(0, w + 1 - S.history_windows):w + 1],
                                settings)[1] for r in made}
        if any(s.rank == who for s in stragglers(got, settings)):
            named = (w + 1) * WS - onset
            break
    assert named is not None and named <= 150
    # its windows' compute figure shows the net slowdown, where their median showed a fraction of it:
    # over the four windows after any onset (one window alone read as low as 0.76 of the effect in
    # 300 draws, its noise; four together 0.88 at the lowest)
    seen = statistics.mean(made[who][w].compute_s / statistics.median(made[r][w].compute_s for r in range(ranks)
                                                                      if r != who) - 1 for w in (6, 7, 8, 9))
    assert seen > 0.8 * effect


@PROPS
@given(st.integers(0, 6), st.integers(1, 12), st.integers(1, 40), st.randoms(use_true_random=False))
def test_with_baseline_keeps_the_first_windows_however_they_arrive(keep, history, total, rnd):
    settings = DetectorSettings(baseline_windows=keep, history_windows=history)
    made = [RankWindow(rank=0, window=w, steps=WS, compute_s=BASE, step_s=0.12, wait_s=0.02) for w in range(total)]
    first: tuple[RankWindow, ...] = ()
    upto = 0
    while upto < total:  # the windows in chunks of any size: what each read adds
        upto = min(total, upto + rnd.randint(1, history))
        first, joined = with_baseline(first, tuple(made[max(0, upto - history):upto]), settings)
    assert first == tuple(made[:keep])
    assert [w.window for w in joined] == sorted({*range(min(keep, total)), *range(max(0, total - history), total)})
