"""healthd.progress: window summaries, the straggler tests (magnitude and rank order) and the hang bound,
on hand-built windows, on garbage (Hypothesis), and on a simulated job with the calibration's noise."""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.progress import Hang, RankProgress, RankWindow, StepSample, Straggler, hang, stragglers, summarize
from healthd.settings import DetectorSettings

S = DetectorSettings(window_steps=50)  # the examples below count in windows of 50 steps
BASE = 0.1


def win(rank: int, window: int, compute: float, wait: float = 0.02, waits: tuple[float, ...] | None = None) -> RankWindow:
    return RankWindow(rank=rank, window=window, steps=50, compute_s=compute, step_s=compute + wait, wait_s=wait,
                      waits=waits)


def healthy(rank: int, window: int) -> float:
    """A fixed spread of -1 % .. +1 % across ranks and windows: well inside the 5 % floor."""
    return BASE * (1 + 0.005 * ((rank * 7 + window * 3) % 5 - 2))


def job(ranks: int = 32, windows: int = 8, slow: dict[int, dict[int, float]] | None = None,
        common: dict[int, float] | None = None) -> dict[int, list[RankWindow]]:
    """rank -> its windows; slow: rank -> window -> factor on its compute; common: window -> factor on all."""
    slow, common = slow or {}, common or {}
    return {r: [win(r, w, healthy(r, w) * slow.get(r, {}).get(w, 1.0) * common.get(w, 1.0)) for w in range(windows)]
            for r in range(ranks)}


# --------------------------------------------------------------------------- magnitude test


def test_a_clean_job_flags_nothing():
    assert stragglers(job(), S) == ()
    assert stragglers(job(ranks=4), S) == ()
    assert stragglers(job(ranks=2), S) == ()


def test_an_8_percent_slow_rank_over_two_windows_is_flagged():
    (s,) = stragglers(job(slow={5: {6: 1.08, 7: 1.08}}), S)
    assert (s.rank, s.test, s.windows) == (5, "magnitude", (6, 7))
    assert 0.06 < s.effect < 0.10
    assert s.threshold == S.min_effect  # the spread across ranks is far below the floor
    assert s.p_value is None


def test_the_run_of_slow_windows_is_reported_whole():
    (s,) = stragglers(job(slow={5: {w: 1.08 for w in range(3, 8)}}), S)
    assert s.windows == (3, 4, 5, 6, 7)


@pytest.mark.parametrize("windows", [{7: 1.08}, {6: 1.08}, {5: 1.08, 7: 1.08}, {5: 1.08, 6: 1.08}])
def test_one_slow_window_or_a_recovered_rank_is_not_flagged(windows):
    assert stragglers(job(slow={5: windows}), S) == ()


def test_a_common_mode_slowdown_of_all_ranks_flags_nothing():
    assert stragglers(job(common={5: 1.3, 6: 1.5, 7: 1.3}), S) == ()
    assert stragglers(job(ranks=4, common={5: 1.3, 6: 1.5, 7: 1.3}), S) == ()


def test_consecutive_setting_is_honoured():
    one = replace(S, consecutive=1)
    (s,) = stragglers(job(slow={5: {7: 1.08}}), one)
    assert s.windows == (7,)
    assert stragglers(job(slow={5: {6: 1.08, 7: 1.08}}), replace(S, consecutive=3)) == ()


def test_a_wide_spread_raises_the_threshold_above_the_floor():
    # ranks spread +-4 %: 4 robust sigmas is well above 5 %, so an 8 % rank is within the job's own noise
    rng = random.Random(5)
    wide = {r: [win(r, w, BASE * (1 + rng.uniform(-0.04, 0.04))) for w in range(8)] for r in range(64)}
    assert stragglers(wide, S) == ()
    wide[3] = [win(3, w, BASE * (1.25 if w >= 5 else 1.0)) for w in range(8)]
    (s,) = stragglers(wide, S)

    def ratios(w: int) -> list[float]:  # each rank against the median of the others
        cs = [wide[r][w].compute_s for r in wide]
        return [c / statistics.median(cs[:i] + cs[i + 1:]) for i, c in enumerate(cs)]

    # each rank's ratio over its own baseline (the median over the first 3 windows); the spread of a
    # window is the robust spread of those, and the job's the median of its later windows' spreads
    base = [statistics.median(x) for x in zip(ratios(0), ratios(1), ratios(2), strict=True)]

    def spread(w: int) -> float:
        devs = [x / b for x, b in zip(ratios(w), base, strict=True)]
        m = statistics.median(devs)
        return 1.4826 * statistics.median([abs(x - m) for x in devs])

    assert s.threshold == pytest.approx(4 * statistics.median([spread(w) for w in range(3, 8)]))
    assert s.threshold > 0.05


def test_a_window_held_by_one_rank_is_not_compared():
    j = job(slow={5: {6: 1.08, 7: 1.08}})
    j[5].append(win(5, 8, BASE))  # ahead of the others: its window 8 has nobody to compare with
    (s,) = stragglers(j, S)
    assert s.windows == (6, 7)
    j = job()
    j[3].append(win(3, 8, BASE * 2))
    j[3].append(win(3, 9, BASE * 2))
    assert stragglers(j, S) == ()


def test_windows_in_any_order_and_ranks_sorted():
    j = job(slow={9: {6: 1.1, 7: 1.1}, 2: {6: 1.1, 7: 1.1}})
    j = {r: list(reversed(ws)) for r, ws in reversed(list(j.items()))}
    assert [s.rank for s in stragglers(j, S)] == [2, 9]


def test_small_job_pools_the_spread_over_its_history():
    # a few ranks: as many slow windows in a row as the rank-order test needs
    assert stragglers(job(ranks=4, slow={2: {6: 1.08, 7: 1.08}}), S) == ()
    (s,) = stragglers(job(ranks=4, slow={2: {5: 1.08, 6: 1.08, 7: 1.08}}), S)
    assert (s.rank, s.test, s.windows) == (2, "magnitude", (5, 6, 7))
    # a two-rank job: each rank is the median's other half, so only the rank-order test can tell
    assert stragglers(job(ranks=2, slow={1: {6: 1.08, 7: 1.08}}), S) == ()


def test_empty_and_degenerate_inputs():
    assert stragglers({}, S) == ()
    assert stragglers({0: []}, S) == ()
    assert stragglers({0: [win(0, 0, BASE)]}, S) == ()
    assert stragglers({0: [win(0, 0, BASE)], 1: [win(1, 1, BASE * 2)]}, S) == ()  # no window in common


# --------------------------------------------------------------------------- rank-order test


def waits_last(rank: int, ranks: int, last_in: int, steps: int = 50) -> dict[int, tuple[float, ...]]:
    """Per rank, a window's waits in which `rank` waited least in `last_in` steps and the others took
    turns in the rest."""
    others = [r for r in range(ranks) if r != rank]
    out: dict[int, list[float]] = {r: [] for r in range(ranks)}
    for i in range(steps):
        lastr = rank if i < last_in else others[i % len(others)]
        for r in range(ranks):
            out[r].append(0.001 if r == lastr else 0.02 + 0.001 * r)
    return {r: tuple(v) for r, v in out.items()}


def order_job(ranks: int, late: dict[int, int], slow: float = 1.0, windows: int = 8,
              who: int = 2, spread: float = 0.0) -> dict[int, list[RankWindow]]:
    """Rank `who` at BASE (x slow in late windows), the others spread evenly over BASE x (1 +- spread)
    in turns, whose median is BASE: `who`'s effect is slow - 1, and a spread of 5 % puts the
    magnitude test's threshold far above 8 %. late: window -> steps in which `who` arrived last (the
    other windows: ranks take turns)."""
    out: dict[int, list[RankWindow]] = {r: [] for r in range(ranks)}
    for w in range(windows):
        waits = waits_last(who, ranks, late.get(w, 50 // ranks))
        for r in range(ranks):
            m, i = ranks - 1, r if r < who else r - 1  # the others, and this one's place among them
            # -1 .. 1 evenly (median 0) in each window, shuffled between windows: each rank noisy
            turn = random.Random(w).sample(range(m), m)[i] * 2 / (m - 1) - 1 if m > 1 else 0.0
            c = BASE * (slow if w in late else 1.0) if r == who else BASE * (1 + spread * turn)
            out[r].append(win(r, w, c, waits=waits[r]))
    return out


LATE = {5: 40, 6: 40, 7: 40}
SLOW = dict(slow=1.08, spread=0.05)  # 8 % slower, below the magnitude test's threshold in that spread


def test_rank_order_flags_a_rank_last_40_of_50_steps_for_three_windows():
    assert stragglers(order_job(4, LATE, spread=0.05), S) == ()  # as slow as the others: last, yet no effect
    (s,) = stragglers(order_job(4, LATE, **SLOW), S)
    assert (s.rank, s.test, s.windows) == (2, "rank-order", (5, 6, 7))
    assert (s.last_in, s.of_steps) == (40, 50)
    exact = sum(math.comb(50, k) * 0.25 ** k * 0.75 ** (50 - k) for k in range(40, 51))
    assert s.p_value == pytest.approx(exact, rel=1e-9)
    assert s.p_value < S.rank_order_p and s.threshold == S.rank_order_p
    assert s.effect == pytest.approx(0.08)


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 15])
@pytest.mark.parametrize("slow", [1.0, 1.02, 1.04, 1.049])
def test_rank_order_never_flags_a_rank_less_than_min_effect_slower(ranks, slow):
    # last in 45 of 50 steps: a p-value far below the bound, but the rank is not 5 % slower
    assert stragglers(order_job(ranks, {5: 45, 6: 45, 7: 45}, slow=slow, spread=0.05, who=1), S) == ()
    (s,) = stragglers(order_job(ranks, {5: 45, 6: 45, 7: 45}, slow=1.051, spread=0.05, who=1), S)
    assert s.rank == 1 and s.effect >= S.min_effect


def test_rank_order_tells_the_slow_one_of_two_ranks():
    (s,) = stragglers(order_job(2, {5: 45, 6: 45, 7: 45}, slow=1.06, who=1), S)
    assert s.rank == 1
    assert s.effect == pytest.approx(0.06)  # against the other rank: its own slowdown, not half of it
    assert stragglers(order_job(2, {5: 35, 6: 35, 7: 35}, who=1), S) == ()


def test_rank_order_needs_three_windows_in_a_row():
    assert stragglers(order_job(4, {6: 40, 7: 40}, **SLOW), S) == ()
    assert stragglers(order_job(4, {4: 40, 6: 40, 7: 40}, **SLOW), S) == ()
    assert stragglers(order_job(4, {4: 40, 5: 40, 6: 40}, **SLOW), S) == ()  # recovered in the latest


def test_rank_order_tolerates_the_scheduling_bias_of_a_small_machine():
    # last in 22 of 50 on 4 ranks (expected 12.5) is what 2 busy cores do to a healthy rank
    assert stragglers(order_job(4, {w: 22 for w in range(3, 8)}, **SLOW), S) == ()


def test_rank_order_runs_only_for_small_jobs():
    assert stragglers(order_job(16, LATE, **SLOW), S) == ()
    assert [s.test for s in stragglers(order_job(15, LATE, **SLOW), S)] == ["rank-order"]


def test_a_rank_flagged_by_both_tests_is_returned_once_magnitude_first():
    (s,) = stragglers(order_job(4, LATE, slow=1.08), S)
    assert (s.rank, s.test, s.windows) == (2, "magnitude", (5, 6, 7))


def test_rank_order_skips_unrecorded_steps_and_ties():
    j = order_job(4, LATE, **SLOW)
    # equal waits name nobody; a step one rank did not record is not counted
    for r in range(4):
        j[r][7] = replace(j[r][7], waits=(0.01,) * 50)
    assert stragglers(j, S) == ()
    j = order_job(4, LATE, **SLOW)
    j[0][7] = replace(j[0][7], waits=(-1.0,) * 10 + j[0][7].waits[10:])
    (s,) = stragglers(j, S)
    assert (s.last_in, s.of_steps) == (30, 40)


def test_rank_order_without_waits_does_nothing():
    j = order_job(4, LATE, **SLOW)
    j = {r: [replace(w, waits=None) for w in ws] for r, ws in j.items()}
    assert stragglers(j, S) == ()


# --------------------------------------------------------------------------- summarize


def samples(steps, step_s: float = 0.12, wait_s: float = 0.02, **kw) -> list[StepSample]:
    return [StepSample(step=i, step_s=step_s, wait_s=wait_s, **kw) for i in steps]


def test_summarize_keeps_complete_windows_only():
    got = summarize(3, samples(range(120)), S)
    assert [(w.rank, w.window, w.steps) for w in got] == [(3, 0, 50), (3, 1, 50)]
    assert got[0].compute_s == pytest.approx(0.1) and got[0].step_s == 0.12 and got[0].wait_s == 0.02
    assert got[0].waits is None
    assert [w.window for w in summarize(3, samples(range(100)), S)] == [0]
    assert [w.window for w in summarize(3, samples(range(101)), S)] == [0, 1]  # step 100 completes window 1
    assert summarize(3, samples(range(50)), S) == ()
    assert summarize(3, [], S) == ()


def test_summarize_takes_the_latest_sample_of_a_repeated_step():
    ss = samples(range(60)) + [StepSample(step=i, step_s=1.0, wait_s=0.0) for i in range(10, 40)]
    (w,) = summarize(0, ss, S)
    assert w.steps == 50
    # 30 replayed steps of the 50 now take 1 s: the middle three fifths are 10 steps of 0.1 s and 20 of 1 s
    assert w.compute_s == pytest.approx(0.7)
    # out of order: the same windows
    shuffled = samples(range(120))
    random.Random(1).shuffle(shuffled)
    assert summarize(0, shuffled, S) == summarize(0, samples(range(120)), S)


def test_summarize_leaves_out_restarts_and_saves():
    ss = samples(range(120))
    ss[0] = StepSample(step=0, step_s=0.0, wait_s=0.0)
    ss[7] = StepSample(step=7, step_s=30.0, wait_s=0.02, checkpoint=True)
    w0 = summarize(0, ss, S)[0]
    assert w0.steps == 48 and w0.compute_s == pytest.approx(0.1) and w0.step_s == 0.12


def test_summarize_keeps_the_newest_history_windows():
    got = summarize(0, samples(range(1000)), S)
    assert [w.window for w in got] == list(range(11, 19))
    assert [w.window for w in summarize(0, samples(range(1000)), replace(S, history_windows=3))] == [16, 17, 18]


def test_summarize_with_waits():
    ss = [StepSample(step=i, step_s=0.12, wait_s=0.001 * i) for i in range(51) if i != 3]
    ss[5] = replace(ss[5], checkpoint=True)  # step 6
    (w,) = summarize(0, ss, S, with_waits=True)
    assert len(w.waits) == 50
    assert w.waits[3] == -1.0 and w.waits[6] == -1.0 and w.waits[7] == pytest.approx(0.007)
    assert w.steps == 48


def test_summarize_skips_garbage():
    ss = samples(range(120))
    bad = [StepSample(step=5, step_s=math.nan, wait_s=0.0), StepSample(step=6, step_s=math.inf, wait_s=0.0),
           StepSample(step=7, step_s=-1.0, wait_s=0.0), StepSample(step=8, step_s=0.1, wait_s=-0.5),
           StepSample(step=9, step_s=0.1, wait_s=0.2), StepSample(step=-4, step_s=0.1, wait_s=0.0)]
    (w0, w1) = summarize(0, ss + bad, S)
    assert w0.steps == 45 and w0.compute_s == pytest.approx(0.1)
    assert w1.steps == 50


def _reference_summarize(rank, samples, settings, *, with_waits=False):
    """summarize as first written, every field through its full check: the oracle for the one with
    fast paths for the ring's own samples."""
    from healthd.progress import _int, _num, _trimmed, _window_steps

    ws = _window_steps(settings)
    keep = _int(settings.history_windows) or 0
    if keep == 0:
        return ()
    latest, top = {}, -1
    for s in samples:
        step = _int(getattr(s, "step", None))
        if step is None:
            continue
        latest[step] = s
        top = max(top, step)
    if top < 0:
        return ()
    complete = top // ws
    by_window = {}
    for step, s in latest.items():
        w = step // ws
        if w >= complete or getattr(s, "checkpoint", False) is not False:
            continue
        step_s, wait_s = _num(getattr(s, "step_s", None)), _num(getattr(s, "wait_s", None))
        if step_s is None or wait_s is None or step_s <= 0.0 or wait_s > step_s:
            continue
        by_window.setdefault(w, []).append((step - w * ws, step_s, wait_s))
    out = []
    for w in sorted(by_window)[-keep:]:
        rows = by_window[w]
        waits = None
        if with_waits:
            slots = [-1.0] * ws
            for i, _, wait_s in rows:
                slots[i] = wait_s
            waits = tuple(slots)
        out.append(RankWindow(rank=rank, window=w, steps=len(rows), compute_s=_trimmed([st - wt for _, st, wt in rows]),
                              step_s=statistics.median([st for _, st, _ in rows]),
                              wait_s=statistics.median([wt for _, _, wt in rows]), waits=waits))
    return tuple(out)


_ODD = st.one_of(st.none(), st.booleans(), st.integers(-3, 400), st.floats(-1.0, 2.0), st.floats(allow_nan=True),
                 st.just(math.inf), st.text(max_size=2))


@hsettings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(top=st.integers(1, 300), data=st.data(), window=st.integers(1, 30), keep=st.integers(0, 12), waits=st.booleans())
def test_summarize_equals_the_fully_checked_reference(top, data, window, keep, waits):
    """Whatever the samples hold (the ring's own, or garbage in any field), the same windows."""
    steps = st.integers(-3, top)
    rows = data.draw(st.lists(st.one_of(
        st.builds(StepSample, steps, st.floats(-0.5, 2.0), st.floats(-0.5, 2.0), st.just(False)),
        st.builds(StepSample, steps, st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.booleans()),
        st.builds(StepSample, steps, _ODD, _ODD, st.just(False)),
        st.builds(StepSample, _ODD, _ODD, _ODD, _ODD)), max_size=300))
    settings = replace(S, window_steps=window, history_windows=keep)
    assert summarize(2, rows, settings, with_waits=waits) == _reference_summarize(2, rows, settings, with_waits=waits)


# --------------------------------------------------------------------------- hang


def prog(rank: int, last_step: int = 100, age: float = 1.0, phase: str = "wait", median: float | None = 1.0,
         save: float = 0.0) -> RankProgress:
    return RankProgress(rank=rank, last_step=last_step, last_step_age_s=age, phase=phase, phase_age_s=age,
                        step_median_s=median, longest_save_s=save)


def test_no_hang_while_steps_advance():
    assert hang([prog(r, age=2.0) for r in range(4)], S) is None
    assert hang([], S) is None


def test_hang_bound_is_a_multiple_of_the_median_step_time_and_at_least_the_floor():
    # median step 1 s: the floor of 60 s
    assert hang([prog(r, age=59.0) for r in range(4)], S) is None
    h = hang([prog(r, age=61.0) for r in range(4)], S)
    assert isinstance(h, Hang) and h.bound_s == 60.0 and h.stalled_s == 61.0 and h.step == 100
    # median of the medians 10 s: 100 s
    ranks = [prog(0, age=99, median=9.0), prog(1, age=99, median=10.0), prog(2, age=99, median=12.0)]
    assert hang(ranks, S) is None
    h = hang([replace(p, last_step_age_s=101.0) for p in ranks], S)
    assert h.bound_s == 100.0


def test_stalled_is_the_job_s_committed_progress_not_its_freshest_ring():
    # one rank claiming a fresh step (its clock ahead, or a ring stamped in the future) does not hide
    # the stall the others show: in synchronous training no rank commits a step the others do not
    h = hang([prog(0, age=500.0), prog(1, age=500.0), prog(2, last_step=101, age=0.0)], S)
    assert h is not None and h.stalled_s == 500.0 and h.step == 101 and h.behind == (0, 1)
    # of two ranks the older age counts; most ranks fresh: no hang
    assert hang([prog(0, age=0.0), prog(1, age=90.0)], S).stalled_s == 90.0
    assert hang([prog(0, age=500.0), prog(1, age=2.0), prog(2, age=2.0)], S) is None
    # ranks that never committed a step do not count while others did
    assert hang([prog(0, age=2.0), prog(1, last_step=-1, age=900.0), prog(2, age=2.0)], S) is None


def test_no_median_step_time_means_no_verdict():
    assert hang([prog(r, age=1e6, median=None) for r in range(4)], S) is None


def test_hang_names_the_ranks_behind():
    ranks = [prog(0, age=100), prog(1, age=100), prog(2, last_step=99, age=100, phase="compute"), prog(3, age=100)]
    h = hang(ranks, S)
    assert h.behind == (2,)
    assert h.phases == {0: "wait", 1: "wait", 2: "compute", 3: "wait"}


def test_hang_all_at_the_same_step_names_the_ranks_not_waiting():
    ranks = [prog(0, age=100), prog(1, age=100, phase="compute"), prog(2, age=100), prog(3, age=100)]
    assert hang(ranks, S).behind == (1,)
    # every rank given waits (one node's view of a job across nodes): the rank behind is elsewhere
    assert hang([prog(r, age=100) for r in range(4)], S).behind == ()
    assert hang([prog(r, age=100, phase="unknown") for r in range(4)], S).behind == (0, 1, 2, 3)


def test_a_save_in_progress_gets_phase_factor_times_the_longest_save():
    ranks = [prog(0, age=100, phase="checkpoint", save=30.0), prog(1, age=100, phase="checkpoint", save=20.0)]
    assert hang(ranks, S) is None  # 5 x 30 s = 150 s
    h = hang([replace(p, last_step_age_s=151.0) for p in ranks], S)
    assert h.bound_s == 150.0 and h.phases == {0: "checkpoint", 1: "checkpoint"}
    # a short save does not lower the bound; no save in progress: the ordinary bound
    assert hang([prog(0, age=61, phase="checkpoint", save=2.0)], S).bound_s == 60.0
    assert hang([prog(0, age=61, phase="compute", save=30.0)], S).bound_s == 60.0


def test_hang_skips_garbage_ranks():
    ranks = [prog(0, age=100), prog(1, age=math.nan), prog(2, age=-5.0), prog(3, age=100, median=math.inf),
             prog(4, age=100, median=-1.0)]
    h = hang(ranks, S)
    assert h.bound_s == 60.0 and set(h.phases) == {0, 3, 4}


# --------------------------------------------------------------------------- properties

garbage = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.0), st.just(-1.0))


@st.composite
def garbage_windows(draw):
    out = {}
    for r in range(draw(st.integers(0, 6))):
        out[r] = [RankWindow(rank=r, window=draw(st.integers(-2, 10)), steps=draw(st.integers(-1, 60)),
                             compute_s=draw(garbage), step_s=draw(garbage), wait_s=draw(garbage),
                             waits=draw(st.one_of(st.none(), st.lists(garbage, max_size=8).map(tuple))))
                  for _ in range(draw(st.integers(0, 5)))]
    return out


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage_windows(), st.lists(st.builds(StepSample, st.integers(-5, 400), garbage, garbage, st.booleans()),
                                   max_size=60),
       st.lists(st.builds(RankProgress, st.integers(-2, 8), st.integers(-3, 500), garbage,
                          st.sampled_from(["compute", "wait", "checkpoint", "unknown", "bogus"]), garbage,
                          st.one_of(st.none(), garbage), garbage), max_size=10))
def test_garbage_never_raises(windows, steps, ranks):
    for s in stragglers(windows, S):
        assert isinstance(s, Straggler)
    for s in stragglers(windows, replace(S, min_ranks_spread=100)):
        assert isinstance(s, Straggler)
    short = replace(S, window_steps=5, history_windows=4)
    for w in summarize(0, steps, short, with_waits=True):
        assert math.isfinite(w.compute_s) and w.compute_s >= 0 and len(w.waits) == 5
    h = hang(ranks, S)
    assert h is None or (isinstance(h, Hang) and set(h.behind) <= set(h.phases))


@st.composite
def jobs(draw):
    """A job of 2-24 ranks with a few slow (rank, window) cells and, for small jobs, waits that often
    name one rank last (ties and unrecorded steps included)."""
    ranks = draw(st.integers(2, 24))
    windows = draw(st.integers(1, 8))
    rnd = draw(st.randoms(use_true_random=False))
    compute = {(r, w): rnd.uniform(0.099, 0.101) for r in range(ranks) for w in range(windows)}
    for r, w in draw(st.lists(st.tuples(st.integers(0, ranks - 1), st.integers(0, windows - 1)), max_size=12)):
        compute[r, w] *= draw(st.floats(1.0, 1.3))
    slow, since = draw(st.integers(0, ranks - 1)), draw(st.integers(0, windows))
    factor = draw(st.sampled_from([1.0, 1.04, 1.06, 1.08, 1.12, 1.2]))
    for w in range(since, windows):
        compute[slow, w] *= factor
    late, often = draw(st.integers(0, ranks - 1)), draw(st.floats(0.0, 1.0))
    out = {}
    for r in range(ranks):
        out[r] = []
        for w in range(windows):
            waits = None
            if ranks < 16:
                waits = tuple(0.0005 if r == late and rnd.random() < often else rnd.choice([0.001, 0.01, 0.02, -1.0])
                              for _ in range(50))
            out[r].append(win(r, w, compute[r, w], waits=waits))
    return out


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(), st.randoms(use_true_random=False))
def test_permuting_ranks_permutes_flags(j, rnd):
    perm = list(j)
    rnd.shuffle(perm)
    moved = {perm[r]: [replace(w, rank=perm[r]) for w in ws] for r, ws in j.items()}
    before = {perm[s.rank]: replace(s, rank=perm[s.rank]) for s in stragglers(j, S)}
    after = {s.rank: s for s in stragglers(moved, S)}
    assert after == before


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(), st.integers(-10, 10))
def test_scaling_all_times_changes_nothing(j, k):
    # a power of two scales every float exactly, so the comparison can be exact too
    f = 2.0 ** k
    scaled = {r: [replace(w, compute_s=w.compute_s * f, step_s=w.step_s * f, wait_s=w.wait_s * f,
                          waits=None if w.waits is None else tuple(x * f if x >= 0 else x for x in w.waits))
                  for w in ws] for r, ws in j.items()}
    assert stragglers(scaled, S) == stragglers(j, S)


@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(), st.floats(1e-3, 1e3))
def test_scaling_by_any_constant_names_the_same_ranks(j, f):
    scaled = {r: [replace(w, compute_s=w.compute_s * f, step_s=w.step_s * f, wait_s=w.wait_s * f,
                          waits=None if w.waits is None else tuple(x * f if x >= 0 else x for x in w.waits))
                  for w in ws] for r, ws in j.items()}
    got, want = stragglers(scaled, S), stragglers(j, S)
    assert [(s.rank, s.test, s.windows, s.last_in) for s in got] == [(s.rank, s.test, s.windows, s.last_in) for s in want]
    assert [s.effect for s in got] == pytest.approx([s.effect for s in want], abs=1e-9)


# --------------------------------------------------------------------------- simulated job


def simulate(rng: random.Random, ranks: int, windows: int, straggler: int | None = None, onset: int = 0,
             effect: float = 0.08):
    """Yield (window, flags) after each window of a synchronous data-parallel job with the calibration's
    noise: per rank a healthy bias of +-1.5 %, per step lognormal jitter (sigma 5 %), spikes x3 on 1 % of
    steps, common-mode episodes slowing every rank by 10 %; each rank waits for the slowest. The windows
    come from summarize, fed each window's steps and the next window's first step, and the detector sees
    the last history_windows windows of every rank, as the controller does."""
    ws = S.window_steps
    bias = [1 + rng.uniform(-0.015, 0.015) for _ in range(ranks)]
    history: dict[int, list[RankWindow]] = {r: [] for r in range(ranks)}
    common_left = 0
    for w in range(windows):
        per_step = []
        for i in range(ws + 1):  # the extra step completes the window
            if common_left == 0 and rng.random() < 0.001:
                common_left = rng.randint(20, 200)
            common = 1.1 if common_left > 0 else 1.0
            common_left = max(0, common_left - 1)
            step = w * ws + i
            c = []
            for r in range(ranks):
                x = BASE * common * rng.lognormvariate(0.0, 0.05) * (3.0 if rng.random() < 0.01 else 1.0)
                c.append(x * ((1 + effect) if r == straggler and step >= onset else bias[r]))
            slowest = max(c) + 0.02
            per_step.append([StepSample(step=step, step_s=slowest, wait_s=slowest - x) for x in c])
        for r in range(ranks):
            (rw,) = summarize(r, [s[r] for s in per_step], S)
            history[r] = (history[r] + [rw])[-S.history_windows:]
        yield w, stragglers(history, S)


def test_simulated_job_flags_no_healthy_rank_and_names_an_8_percent_straggler():
    ranks, windows, onset, straggler = 256, 40, 30 * 50 + 10, 77
    t0 = time.perf_counter()
    named_at = None
    for w, found in simulate(random.Random(20261201), ranks, windows, straggler=straggler, onset=onset):
        assert [s.rank for s in found if s.rank != straggler] == []
        if (w + 1) * 50 <= onset:
            assert found == ()
        elif named_at is None and found:
            named_at = (w + 1) * 50 - onset
    assert named_at is not None and named_at <= 150
    assert time.perf_counter() - t0 < 30  # about 5 s on a 2-core machine


def test_detector_cost_on_a_1024_rank_job():
    rng = random.Random(3)
    hist = {r: [win(r, w, BASE * rng.lognormvariate(0, 0.012)) for w in range(S.history_windows)]
            for r in range(1024)}
    stragglers(hist, S)
    costs = []
    for _ in range(5):
        t0 = time.perf_counter()
        stragglers(hist, S)
        costs.append(time.perf_counter() - t0)
    assert min(costs) < 0.25  # about 10 ms; a controller round has seconds
