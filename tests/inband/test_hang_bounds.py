"""healthd.progress.hang and stall over generated jobs: hostile clocks (rings stamped in the future or
the past), the bound as a deadline a look every tick keeps, and rank-0-only phases of any length
(pure functions; tests/inband/test_job_steps.py drives the same through real rings)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.progress import RankProgress, hang, stall, waits_elsewhere
from healthd.settings import DetectorSettings

S = DetectorSettings()


def prog(rank: int, age: float, *, step: int = 100, phase: str = "wait", median: float = 1.0,
         save: float = 0.0, longest: float = 0.0) -> RankProgress:
    return RankProgress(rank=rank, last_step=step, last_step_age_s=age, phase=phase, phase_age_s=max(age, 0.0),
                        step_median_s=median, longest_save_s=save, longest_step_s=longest)


@st.composite
def stalled_jobs(draw):
    """A job of 1-64 ranks stalled for `stalled` seconds (each rank's age within a step of it), with up
    to half of its rings hostile: a fresh stamp (a clock ahead: the agent clamps a stamp from the
    future to now, age 0), a claimed later step, or an age no clock makes (negative, NaN)."""
    n = draw(st.integers(1, 64))
    median = draw(st.floats(0.05, 20.0))
    stalled = draw(st.floats(0.0, 3600.0))
    hostile = draw(st.integers(0, n // 2))
    ranks = []
    for r in range(n):
        age = stalled + draw(st.floats(0.0, median))
        ranks.append(prog(r, age, median=median * draw(st.floats(0.9, 1.1)), phase=draw(st.sampled_from(
            ["wait", "compute"]))))
    lies = draw(st.lists(st.sampled_from(["fresh", "ahead", "negative", "nan"]), min_size=hostile, max_size=hostile))
    for r, lie in zip(draw(st.permutations(range(n)))[:hostile], lies, strict=False):
        p = ranks[r]
        ranks[r] = {"fresh": prog(r, 0.0, median=median), "ahead": prog(r, 0.0, step=10**9, median=median),
                    "negative": prog(r, -draw(st.floats(1.0, 1e6)), median=median),
                    "nan": prog(r, math.nan, median=median)}[lie] if p else p
    return ranks, stalled, median


@hsettings(max_examples=250, deadline=None)
@given(stalled_jobs())
def test_no_minority_of_hostile_rings_hides_a_hang(job):
    ranks, stalled, median = job
    got = stall(ranks, S)
    assert got is not None
    seconds, bound = got
    assert bound >= max(10 * median * 0.9, 60.0) - 1e-9
    # the stall is never below the honest ranks' freshest age: a lie cannot make the job look alive
    assert seconds >= stalled - 1e-9
    h = hang(ranks, S)
    if stalled > bound:
        assert h is not None and h.stalled_s >= stalled - 1e-9
    elif seconds <= bound:
        assert h is None


@st.composite
def healthy_jobs(draw):
    """A job of 3-64 ranks whose steps advance (ages under a step), fewer than half of its rings
    stamped in the past (a clock behind: an age far too large)."""
    n = draw(st.integers(3, 64))
    median = draw(st.floats(0.05, 5.0))
    ranks = [prog(r, draw(st.floats(0.0, median)), median=median) for r in range(n)]
    for r in draw(st.permutations(range(n)))[:(n - 1) // 2]:
        ranks[r] = prog(r, draw(st.floats(61.0, 1e7)), median=median)
    return ranks


@hsettings(max_examples=300, deadline=None)
@given(healthy_jobs())
def test_no_minority_of_rings_stamped_in_the_past_makes_a_hang(ranks):
    assert hang(ranks, S) is None


@hsettings(max_examples=250, deadline=None)
@given(st.floats(0.01, 30.0), st.floats(1.0, 30.0), st.floats(0.0, 1.0, exclude_max=True), st.integers(1, 16),
       st.sampled_from([0.0, 60.0, 120.0]))
def test_a_hang_is_named_within_its_bound_by_a_look_every_tick(median, tick, phase, n, floor):
    """Looks every `tick` seconds (the agent's, 10 s by default; at most the bound), starting at a random
    point of the tick after the last step: the first look that names the hang sees a stall of at most
    the bound and more than the bound less one tick, and no look before it names one."""
    settings = DetectorSettings(hang_min_s=floor)
    bound = max(10 * median, floor)
    tick = min(tick, bound)
    first = None
    for k in range(int(bound / tick) + 3):
        t = (phase + k) * tick
        h = hang([prog(r, t, median=median) for r in range(n)], settings, early_s=tick)
        if h is not None:
            first = t
            assert h.bound_s == bound
            break
    assert first is not None
    assert bound - tick - 1e-6 < first <= bound + 1e-6


@hsettings(max_examples=250, deadline=None)
@given(st.integers(1, 32), st.floats(0.05, 5.0), st.floats(0.0, 1.0), st.sampled_from(["wait", "compute"]),
       st.floats(0.0, 1800.0), st.integers(0, 3))
def test_ranks_waiting_on_rank_0_elsewhere_are_held_to_the_save_bound(n, median, frac, phase, seen_save, saves):
    """One node's ranks (1..n of a job whose rank 0 runs elsewhere) all at one step, all waiting (or all
    in an unwrapped barrier): a rank-0-only phase of any length up to the save bound is not a hang; the
    save bound is at least first_save_s and phase_factor x the longest step they waited out."""
    longest = seen_save if saves else 0.0
    save_bound = max(S.first_save_s, S.phase_factor * longest, 10 * median, S.hang_min_s)
    length = frac * save_bound
    ranks = [prog(r, length, phase=phase, median=median, longest=longest) for r in range(1, n + 1)]
    assert waits_elsewhere(ranks)
    assert hang(ranks, S, elsewhere=True) is None
    assert stall(ranks, S, elsewhere=True)[1] == save_bound
    h = hang([prog(r, save_bound + 1, phase=phase, median=median, longest=longest) for r in range(1, n + 1)], S,
             elsewhere=True)
    assert h is not None and h.elsewhere
    # a rank behind the others here, or one computing while the others wait, is this node's to judge
    if n >= 2:
        assert not waits_elsewhere([*ranks[:-1], prog(n, length, step=99, phase=phase, median=median)])
        assert not waits_elsewhere([*ranks[:-1], prog(n, length, phase="compute" if phase == "wait" else "wait")])
    assert not waits_elsewhere([prog(0, length, phase=phase), *ranks])


@hsettings(max_examples=300, deadline=None)
@given(st.integers(2, 64), st.floats(0.05, 5.0), st.floats(0.0, 1.0), st.sampled_from(["checkpoint", "compute"]),
       st.floats(0.0, 300.0))
def test_the_whole_job_in_view_a_rank_0_only_phase_is_held_to_the_save_bound(n, median, frac, phase, seen):
    """Every rank in view (the controller's merge): rank 0 saving (or logging, evaluating: compute)
    while every other rank waits at its step. The first such phase may last first_save_s; once the
    job has waited one out, phase_factor x the longest; past it, the hang names rank 0."""
    save = seen if phase == "checkpoint" else 0.0
    bound = max(S.first_save_s, S.phase_factor * seen, 10 * median, S.hang_min_s)
    length = frac * bound
    ranks = [prog(0, length, phase=phase, median=median, save=save, longest=seen),
             *(prog(r, length, median=median, longest=seen) for r in range(1, n))]
    assert hang(ranks, S) is None
    h = hang([prog(0, bound + 1, phase=phase, median=median, save=save, longest=seen),
              *(prog(r, bound + 1, median=median, longest=seen) for r in range(1, n))], S)
    assert h is not None and h.behind == (0,) and h.bound_s == bound
    # another rank holding the job up is the ordinary bound
    other = [prog(0, 61 + 10 * median, median=median), prog(1, 61 + 10 * median, phase="compute", median=median),
             *(prog(r, 61 + 10 * median, median=median) for r in range(2, n))]
    assert hang(other, S).behind == (1,)
