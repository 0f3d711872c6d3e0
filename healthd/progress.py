"""Training progress from a job's in-band records: per-rank window summaries, stragglers and hangs.

Pure functions over plain values, shared by the agent (the ranks on its node) and the controller (a
job's ranks across nodes), like classify: no I/O, no clock (times are passed in).

- A rank's **compute time** in a step is its step time minus the time it waited in collectives. In
  synchronous data parallel every rank's step time is the same; the slow rank is the one that waits
  least, so compute, not step time, is what tells ranks apart.
- Steps are grouped into **windows by step number** (`window = step // window_steps`), not by clock,
  so ranks on different nodes are compared over the same steps whatever their clocks say.
- A window's compute figure for a rank is the mean of its steps' compute times once the fastest and
  the slowest fifth are set aside (a trimmed mean: a spike or a save-sized step is dropped like by a
  median, yet a rank slow on every other step shows its whole mean slowdown, which a median hides).
  Ranks are compared by the ratio of their figure to the median figure of the job's other ranks in
  that window (which cancels the batch mix, the job's own phases and fleet-wide slowdowns; leaving
  the rank out keeps a two-rank job's ratio its own slowdown, not half of it).
- **Structure is not onset.** A rank's baseline is the median of its ratios over the job's first
  `baseline_windows` compared windows. A rank's **effect** in a window is its ratio over the larger of
  its baseline and 1, less 1: a rank slower than the others from the job's first windows (a heavier
  pipeline stage, rank 0's extra work) counts only what it lost since, and is never flagged for its
  structure. So the callers keep each rank's first windows with its recent ones (`with_baseline`).
- **Magnitude test:** a rank is slow in a window when its effect is at least
  `max(min_effect, mad_k x sigma)`, sigma the robust spread (1.4826 x MAD) of the ratios across the
  job's ranks (small jobs: pooled over the recent windows too); flagged after `consecutive` slow
  windows in a row.
- **Rank-order test** (small jobs, where a spread across a few ranks means little): in each step the
  rank that waited least arrived last. Under no straggler each rank is last with probability 1/R; a
  rank last in L of W steps with a binomial tail below `rank_order_p`, over `rank_order_consecutive`
  windows in a row, each with an effect of at least `min_effect`, is flagged. So no test flags a rank
  less than `min_effect` slower, whatever the job's size.
- **Hang:** the job's committed progress (the upper median of its ranks' last-step ages, so that one
  rank's ring cannot hide a stall) has not advanced for `max(hang_factor x median step time,
  hang_min_s)` (a save in progress gets `phase_factor` x the longest save seen instead, when that is
  longer, and the first save at least `first_save_s`; ranks that all wait on ranks elsewhere get the
  save bound). The ranks behind, and their phase, are named.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from healthd.settings import DetectorSettings

Phase = Literal["compute", "wait", "checkpoint", "unknown"]


@dataclass(frozen=True)
class StepSample:
    """One committed optimizer step of one rank, from its ring's step record."""

    step: int
    step_s: float
    """Time since the rank's previous step (0: the first step after a start or a restore)."""
    wait_s: float
    """Time the rank spent blocked in collectives during the step."""
    checkpoint: bool = False
    """A save happened between the previous step and this one (its time is not compute)."""


@dataclass(frozen=True)
class RankWindow:
    """One rank's figures over one complete window of steps: what agents send the controller."""

    rank: int
    window: int
    """step // window_steps."""
    steps: int
    """Steps of the window the rank recorded (a full window has window_steps)."""
    compute_s: float
    """Step time minus wait time over the window's steps: their mean once the fastest and the slowest
    fifth are set aside (the median when fewer than five steps)."""
    step_s: float
    """Median step time."""
    wait_s: float
    """Median wait time."""
    waits: tuple[float, ...] | None = None
    """Each step's wait, in step order from window x window_steps (-1.0: not recorded), for the
    rank-order test; only for jobs smaller than min_ranks_spread."""


@dataclass(frozen=True)
class Straggler:
    """A rank the detector flags, with the evidence for it."""

    rank: int
    test: Literal["magnitude", "rank-order"]
    windows: tuple[int, ...]
    """The consecutive slow windows that flagged it, oldest first."""
    effect: float
    """Compute time above the median of the job's other ranks in the latest of them, beyond the rank's
    own baseline when that is higher: 0.08 is 8 % slower."""
    threshold: float
    """The effect that window needed (magnitude), or the p-value bound (rank-order)."""
    last_in: int = 0
    """Rank-order test: steps of the latest window in which this rank arrived last."""
    of_steps: int = 0
    p_value: float | None = None


@dataclass(frozen=True)
class RankProgress:
    """Where one rank is now: its latest step and phase, for hang detection."""

    rank: int
    last_step: int
    """Highest committed step (-1: none yet)."""
    last_step_age_s: float
    """Seconds since that step was recorded (or since the rank started, with no step)."""
    phase: Phase
    phase_age_s: float
    step_median_s: float | None
    """The rank's median step time over its recent steps (None: too few steps)."""
    longest_save_s: float = 0.0
    """The longest blocking save this rank has recorded."""
    longest_step_s: float = 0.0
    """The longest step this rank has recorded: a rank that waited out another rank's save (a
    rank-0-only save, logging, an evaluation) records a step as long as that save."""


@dataclass(frozen=True)
class Hang:
    """The job's highest committed step has not advanced for longer than its bound."""

    step: int
    """The highest committed step across the ranks."""
    stalled_s: float
    """Seconds since any rank last committed a step."""
    bound_s: float
    behind: tuple[int, ...]
    """Ranks whose last step is below the job's highest, or, when all are at it, the ranks not
    waiting in a collective (the ones the others wait for); empty when every rank given waits (the
    rank behind is not among them), every rank when none does."""
    phases: Mapping[int, Phase]
    """rank -> phase, for every rank considered."""
    elsewhere: bool = False
    """Judged on ranks that all wait on ranks not among them (one node's view of a job whose rank 0
    runs elsewhere), against the save bound."""


# --------------------------------------------------------------------------- the functions

_MAD_SCALE = 1.4826
"""1.4826 x MAD estimates a normal spread's standard deviation, yet one wild rank cannot inflate it."""
_PHASES = ("compute", "wait", "checkpoint", "unknown")


def _num(v: object) -> float | None:
    """A finite non-negative number, else None: garbage in a record is skipped, never raised on."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and f >= 0.0 else None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _window_steps(settings: DetectorSettings) -> int:
    n = _int(settings.window_steps)
    return n if n else 1


def _count(v: object, default: int) -> int:
    """A count setting of at least 1 (0 would flag on no evidence at all)."""
    n = _int(v)
    return n if n else default


def summarize(rank: int, samples: Sequence[StepSample], settings: DetectorSettings, *,
              with_waits: bool = False) -> tuple[RankWindow, ...]:
    """The complete windows of one rank's step samples, the newest `settings.history_windows`, oldest
    first. A window is complete once the rank has a sample in a later window. Steps out of order or
    repeated (a restart replays steps) are taken as they come: the latest sample of a step wins.
    Samples with step_s 0 (the first after a start) or a checkpoint are not compute and are left out
    of the figures. `with_waits`: fill RankWindow.waits (small jobs)."""
    ws = _window_steps(settings)
    keep = _int(settings.history_windows) or 0
    if keep == 0:
        return ()
    latest: dict[int, object] = {}
    top = -1
    for s in samples:
        step = getattr(s, "step", None)
        # the ring's own samples take the first test; anything else gets the full check
        if not (type(step) is int and step >= 0) and (step := _int(step)) is None:
            continue
        latest[step] = s
        if step > top:
            top = step
    if top < 0:
        return ()
    complete = top // ws  # windows below this one have a sample after them
    by_window: dict[int, list[tuple[int, float, float]]] = {}
    isfinite = math.isfinite
    for step, s in latest.items():
        w = step // ws
        if w >= complete or getattr(s, "checkpoint", False) is not False:
            continue
        step_s, wait_s = getattr(s, "step_s", None), getattr(s, "wait_s", None)
        if not (type(step_s) is float and isfinite(step_s)):
            step_s = _num(step_s)
        if not (type(wait_s) is float and isfinite(wait_s) and wait_s >= 0.0):
            wait_s = _num(wait_s)
        if step_s is None or wait_s is None or step_s <= 0.0 or wait_s > step_s:
            continue  # the first step after a start, or a record no clock could have made
        by_window.setdefault(w, []).append((step - w * ws, step_s, wait_s))
    out: list[RankWindow] = []
    for w in sorted(by_window)[-keep:]:
        rows = by_window[w]
        waits: tuple[float, ...] | None = None
        if with_waits:
            slots = [-1.0] * ws
            for i, _, wait_s in rows:
                slots[i] = wait_s
            waits = tuple(slots)
        out.append(RankWindow(
            rank=rank, window=w, steps=len(rows),
            compute_s=_trimmed([st - wt for _, st, wt in rows]),
            step_s=statistics.median([st for _, st, _ in rows]),
            wait_s=statistics.median([wt for _, _, wt in rows]),
            waits=waits))
    return tuple(out)


_TRIM = 0.2
"""The share of a window's steps set aside at each end before its compute figure is averaged: one
step in five either way is far more than the spikes of a healthy rank (about 1 %), and still keeps
three fifths of an intermittent straggler's slow and fast steps in the figure."""


def _trimmed(values: list[float]) -> float:
    """The mean of `values` without the lowest and highest `_TRIM` share (the median below 5 values)."""
    n = len(values)
    k = int(n * _TRIM)
    if k == 0:
        return statistics.median(values)
    return math.fsum(sorted(values)[k:n - k]) / (n - 2 * k)


def with_baseline(first: Sequence[RankWindow], recent: Sequence[RankWindow],
                  settings: DetectorSettings) -> tuple[tuple[RankWindow, ...], tuple[RankWindow, ...]]:
    """(the rank's first `baseline_windows` windows, those and `recent` as one sequence for
    stragglers): a caller that keeps only a rank's recent windows keeps its first ones with this, so
    that the detector can tell a rank slow from the start (structure) from one that became slow.
    `first`: what the previous call returned (() at the rank's start); a window number in both is
    taken from `recent`."""
    keep = _int(settings.baseline_windows) or 0
    have = {w.window: w for w in first if _int(getattr(w, "window", None)) is not None}
    if len(have) < keep:
        for w in recent:
            n = _int(getattr(w, "window", None))
            if n is not None and n not in have and (len(have) < keep or n < max(have)):
                have[n] = w
                if len(have) > keep:
                    del have[max(have)]
    kept = tuple(have[n] for n in sorted(have))
    newer = {w.window for w in recent if _int(getattr(w, "window", None)) is not None}
    return kept, tuple(w for w in kept if w.window not in newer) + tuple(recent)


THROTTLE_WORDS = "clocks held down"
"""How the agent's corroboration line of a throttle begins after its GPU (`gpu3: clocks held down
(...) at 5 reads in a row, begun between steps 1200 and 1234`): the controller reads the steps back."""


def throttle_coincides(onset_window: int, before_step: int | None, since_step: int, window_steps: int) -> bool:
    """Whether a throttle (clock event) reason that began between `before_step` (the rank's last step
    at the last read without it; None: never read without it) and `since_step` (its last step at the
    first read with it) can explain a slowdown whose first slow window is `onset_window`. The onset
    itself lies in that window or the one before (a window's figure shows a slowdown once most of its
    steps are slow); the throttle must have begun within one window of that, neither long before
    (a GPU throttled while its rank kept pace did not make it slow) nor after."""
    ws = max(1, window_steps)
    if before_step is None:
        return False  # present at the first read: when it began is not known
    return before_step < (onset_window + 2) * ws and since_step >= (onset_window - 2) * ws


def _spread(ratios: list[float]) -> float:
    if len(ratios) < 2:
        return 0.0
    m = statistics.median(ratios)
    return _MAD_SCALE * statistics.median([abs(x - m) for x in ratios])


def _run(flagged: set[int], last: int) -> tuple[int, ...]:
    """The run of consecutive flagged window numbers ending at `last`, oldest first (empty when `last`
    is not flagged): a rank that has recovered is no longer named."""
    run: list[int] = []
    w = last
    while w in flagged:
        run.append(w)
        w -= 1
    return tuple(reversed(run))


def _tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Bin(n, p), summed in log space so that long windows neither overflow nor
    lose the small tails the test turns on."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def _last_arrivals(held: dict[int, tuple[float, ...]]) -> tuple[dict[int, int], int]:
    """Per rank, the steps of a window in which it waited least (arrived last), and the steps every
    rank recorded. A tie names nobody: equal waits say nothing about who came last."""
    ranks = list(held)
    last = dict.fromkeys(ranks, 0)
    counted = 0
    for i in range(max(len(w) for w in held.values())):
        low, who, tie = math.inf, -1, False
        for r in ranks:
            seq = held[r]
            v = _num(seq[i]) if i < len(seq) else None
            if v is None:
                break
            if v < low:
                low, who, tie = v, r, False
            elif v == low:
                tie = True
        else:
            counted += 1
            if not tie:
                last[who] += 1
    return last, counted


def _positive(v: object) -> float | None:
    """A finite positive float (the common case checked inline, as this runs per rank-window)."""
    if type(v) is float:
        return v if 0.0 < v < math.inf else None
    f = _num(v)
    return f if f else None


def stragglers(windows: Mapping[int, Sequence[RankWindow]], settings: DetectorSettings) -> tuple[Straggler, ...]:
    """The ranks flagged slow, given each rank's recent windows (rank -> windows, any order). Only
    windows held by at least two ranks are compared, each against the ranks that hold it. A rank is
    flagged by the magnitude test or (fewer than settings.min_ranks_spread ranks) the rank-order
    test; a rank flagged by both is returned once, magnitude first. Sorted by rank."""
    # window -> rank -> compute; a window number repeated in one rank's list: the later one wins
    by_window: dict[int, dict[int, float]] = {}
    ranks: list[int] = []
    for rank, seq in windows.items():
        if _int(rank) is None:
            continue
        any_held = False
        for rw in seq:
            w = getattr(rw, "window", None)
            if type(w) is not int or w < 0:
                w = _int(w)
                if w is None:
                    continue
            c = _positive(getattr(rw, "compute_s", None))
            if c is None:
                continue
            got = by_window.get(w)
            if got is None:
                got = by_window[w] = {}
            got[rank] = c
            any_held = True
        if any_held:
            ranks.append(rank)
    spread_ranks = _count(settings.min_ranks_spread, 1)
    small = len(ranks) < spread_ranks
    min_effect = _num(settings.min_effect) or 0.0
    mad_k = _num(settings.mad_k) or 0.0

    # window -> rank -> ratio to the median of the other ranks that hold it, and the window's own
    # spread (None: too few ranks in it for a spread of their own)
    ratios: dict[int, dict[int, float]] = {}
    for w, got in by_window.items():
        if len(got) < 2:
            continue
        mine = {r: x for r, c, med in _others_medians(got) if (x := c / med) < math.inf}
        if len(mine) >= 2:
            ratios[w] = mine
    # rank -> its structure: the median of its ratios over the job's first compared windows. Its
    # effect is measured from the larger of that and 1 (a rank faster than the others from the start
    # is judged against the others); the spread, from that alone (each rank against itself: a job's
    # pipeline stages widen the ratios, not the noise a slow rank must stand out of).
    first = sorted(ratios)[:_int(settings.baseline_windows) or 0]
    base: dict[int, float] = {}
    for r in ranks:
        held = [ratios[w][r] for w in first if r in ratios[w]]
        base[r] = statistics.median(held) if held else 1.0
    effects: dict[int, dict[int, float]] = {}
    devs: dict[int, dict[int, float]] = {}
    spreads: dict[int, float | None] = {}  # None: too few ranks in it for a spread of their own
    for w, mine in ratios.items():
        effects[w] = {r: x / max(1.0, base[r]) - 1.0 for r, x in mine.items()}
        devs[w] = {r: x / base[r] for r, x in mine.items()}
        spreads[w] = None if small or len(mine) < spread_ranks else _spread(list(devs[w].values()))
    # One spread for every window: the median of the windows' own (leaving out the baseline windows
    # when there are others, as each rank's baseline is made of them, which narrows theirs). A
    # window's own spread from a few dozen ranks is a rough estimate: a threshold that moved with it
    # would name one straggler a window after its onset and another many windows later.
    own = [x for w, x in spreads.items() if x is not None and w not in first] or \
        [x for x in spreads.values() if x is not None]
    if own:
        job_spread = statistics.median(own)
        spreads = {w: None if x is None else job_spread for w, x in spreads.items()}
    pooled: float | None = None
    others: dict[int, float] = {}  # small jobs: rank -> the spread of every other rank's ratios
    slow: dict[int, dict[int, tuple[float, float]]] = {}  # rank -> slow window -> (effect, threshold)
    for w, mine in ratios.items():
        sigma = spreads[w]
        if sigma is None and not small:
            if pooled is None:
                pooled = _spread([x for g in devs.values() for x in g.values()])
            sigma = pooled
        for r in mine:
            if sigma is None:
                # A few ranks: the spread is pooled over their recent windows, leaving out the rank
                # being judged, whose own slow windows would otherwise raise the bar it has to clear.
                if r not in others:
                    others[r] = _spread([y for g in devs.values() for q, y in g.items() if q != r])
                threshold = max(min_effect, mad_k * others[r])
            else:
                threshold = max(min_effect, mad_k * sigma)
            effect = effects[w][r]
            if effect >= threshold:
                slow.setdefault(r, {})[w] = (effect, threshold)

    newest_first = sorted(ratios, reverse=True)
    need = _count(settings.consecutive, 2)
    if small:  # a few ranks' spread is a rough estimate of their noise: as many windows as rank order
        need = max(need, _count(settings.rank_order_consecutive, 3))
    found: dict[int, Straggler] = {}
    for r, mine_slow in slow.items():
        latest = next(w for w in newest_first if r in ratios[w])  # the rank's newest compared window
        run = _run(set(mine_slow), latest)
        if len(run) >= need:
            effect, threshold = mine_slow[run[-1]]
            found[r] = Straggler(rank=r, test="magnitude", windows=run, effect=effect, threshold=threshold)

    if small:
        found.update(_rank_order(windows, effects, found, settings))
    return tuple(found[r] for r in sorted(found))


def _others_medians(got: Mapping[int, float]) -> list[tuple[int, float, float]]:
    """(rank, its value, the median of every other rank's value) for each rank of `got` (two or more):
    one sort, then each rank's median of the others is read off by position (equal values are
    interchangeable, so which of them is left out does not matter)."""
    order = sorted(got.items(), key=lambda rc: rc[1])
    vals = [c for _, c in order]
    m = len(vals) - 1  # the others of each rank

    def other(j: int, i: int) -> float:  # the j-th smallest of the values without the i-th
        return vals[j] if j < i else vals[j + 1]

    if m % 2:
        return [(r, c, other(m // 2, i)) for i, (r, c) in enumerate(order)]
    return [(r, c, (other(m // 2 - 1, i) + other(m // 2, i)) / 2.0) for i, (r, c) in enumerate(order)]


def _rank_order(windows: Mapping[int, Sequence[RankWindow]], effects: Mapping[int, Mapping[int, float]],
                found: Mapping[int, Straggler], settings: DetectorSettings) -> dict[int, Straggler]:
    """The rank-order test over the compared windows (the ones two ranks or more hold), for the
    ranks the magnitude test has not flagged. A window counts for a rank only when its effect there
    reaches min_effect too: arriving last is evidence of who is slowest, not of by how much."""
    floor = _num(settings.min_effect) or 0.0
    waits: dict[int, dict[int, tuple[float, ...]]] = {}  # window -> rank -> its waits
    for rank, seq in windows.items():
        if _int(rank) is None:
            continue
        for rw in seq:
            w = _int(getattr(rw, "window", None))
            if w is not None and w in effects and rank in effects[w]:
                got = getattr(rw, "waits", None)
                # the later of a repeated window wins, as for the magnitude test
                waits.setdefault(w, {})[rank] = tuple(got) if isinstance(got, (tuple, list)) else ()
    bound = _num(settings.rank_order_p) or 0.0
    late: dict[int, set[int]] = {}
    tested: dict[int, dict[int, tuple[int, int, float]]] = {}  # rank -> window -> (last in, of steps, p)
    for w, mine in waits.items():
        held = {r: seq for r, seq in mine.items() if seq}
        if len(held) < 2:
            continue
        last, counted = _last_arrivals(held)
        if counted == 0:
            continue
        p = 1.0 / len(held)
        for r, n in last.items():
            pv = _tail(counted, n, p)
            tested.setdefault(r, {})[w] = (n, counted, pv)
            if pv < bound and effects[w][r] >= floor:
                late.setdefault(r, set()).add(w)
    need = _count(settings.rank_order_consecutive, 3)
    out: dict[int, Straggler] = {}
    for r, mine_late in late.items():
        if r in found:
            continue
        run = _run(mine_late, max(tested[r]))
        if len(run) >= need:
            n, counted, pv = tested[r][run[-1]]
            effect = effects[run[-1]][r]
            out[r] = Straggler(rank=r, test="rank-order", windows=run, effect=effect, threshold=bound, last_in=n,
                               of_steps=counted, p_value=pv)
    return out


def _age(p: object) -> float | None:
    """A rank's last-step age when it is a number a clock could have made (finite, not negative):
    a stamp from the future is no evidence of progress."""
    return _num(getattr(p, "last_step_age_s", None))


def _rank0_alone(ranks: Sequence[RankProgress]) -> bool:
    """Rank 0 is the one rank not waiting, every other rank waits at its step: what a rank-0-only
    phase (a save, logging, an evaluation, the others in a barrier) looks like."""
    if len(ranks) < 2 or len({p.last_step for p in ranks}) != 1:
        return False
    return all((p.phase == "wait") == (p.rank != 0) for p in ranks)


def waits_elsewhere(ranks: Sequence[RankProgress]) -> bool:
    """The ranks given (one node's) may all be waiting on ranks that are not among them: rank 0 is not
    one of them, they stand at one step, and they are all in the same kind of phase (all waiting in
    a collective, or none, as in a barrier the job does not wrap in `wait()`). A rank behind the
    others here, or one computing while the others wait, is this node's own to judge."""
    valid = [p for p in ranks if _int(getattr(p, "rank", None)) is not None]
    if not valid or any(p.rank == 0 for p in valid) or len({p.last_step for p in valid}) != 1:
        return False
    return len({p.phase == "wait" for p in valid}) == 1


def stall(ranks: Sequence[RankProgress], settings: DetectorSettings, *,
          elsewhere: bool = False) -> tuple[float, float] | None:
    """(stalled_s, bound_s): how long the job's committed progress has stood still, and how long it
    may (see the module docstring); None before any rank has a median step time.

    The stall is the upper median of the ages of the ranks that committed a step: in synchronous
    training every rank commits each step, so one rank's ring cannot hide a stall that the others
    show (a ring stamped in the future, a rank that claims a fresh step), and of two ranks the older
    age counts. `elsewhere`: the ranks given all wait on ranks that are not among them (one node's
    view of a job whose rank 0 runs on another node, `waits_elsewhere`): then a rank-0-only phase
    there (a save, logging, an evaluation) is indistinguishable from a hang. Then, and when rank 0
    is the one rank not waiting (`_rank0_alone`), the bound is the save bound: `phase_factor` x the
    longest step or save these ranks have seen (a rank that waited out a save records a step as long
    as it), at least `first_save_s`."""
    valid: list[RankProgress] = []
    for p in ranks:
        rank, age = _int(getattr(p, "rank", None)), _age(p)
        step = getattr(p, "last_step", None)
        if rank is None or age is None or isinstance(step, bool) or not isinstance(step, int) or step < -1:
            continue
        valid.append(p)
    medians = [m for p in valid if (m := _num(p.step_median_s)) and m > 0.0]
    if not medians:
        return None
    bound = max((_num(settings.hang_factor) or 0.0) * statistics.median(medians), _num(settings.hang_min_s) or 0.0)
    factor = _num(settings.phase_factor) or 0.0
    first = _num(settings.first_save_s) or 0.0
    if any(p.phase == "checkpoint" for p in valid):
        saves = [s for p in valid if (s := _num(p.longest_save_s))]
        if saves:  # a save blocks every rank; only a save far longer than any seen is a hang
            bound = max(bound, factor * max(saves))
        else:  # the first save: nothing learned yet
            bound = max(bound, first)
    if elsewhere or _rank0_alone(valid):
        seen = [s for p in valid for s in (_num(p.longest_save_s), _num(getattr(p, "longest_step_s", 0.0))) if s]
        bound = max(bound, first, factor * max(seen, default=0.0))
    committed = [float(p.last_step_age_s) for p in valid if p.last_step >= 0] or \
        [float(p.last_step_age_s) for p in valid]
    return statistics.median_high(committed), bound


def hang(ranks: Sequence[RankProgress], settings: DetectorSettings, *, elsewhere: bool = False,
         early_s: float = 0.0) -> Hang | None:
    """A hang when the job's committed progress has stood still for longer than its bound (`stall`);
    None while it advances, or before any rank has a median step time. `early_s`: how long until the
    caller looks again (the agent's tick): a stall that will pass its bound before then is named now,
    so that a hang is named within its bound, not up to one look after it. `elsewhere`: see `stall`."""
    got = stall(ranks, settings, elsewhere=elsewhere)
    if got is None:
        return None
    stalled, bound = got
    if stalled + (_num(early_s) or 0.0) <= bound:
        return None
    valid: dict[int, RankProgress] = {}
    for p in ranks:
        rank, step = _int(getattr(p, "rank", None)), getattr(p, "last_step", None)
        if rank is None or _age(p) is None or isinstance(step, bool) or not isinstance(step, int) or step < -1:
            continue
        valid[rank] = p
    phases: dict[int, Phase] = {r: (p.phase if p.phase in _PHASES else "unknown") for r, p in sorted(valid.items())}
    highest = max(p.last_step for p in valid.values())
    behind = [r for r, p in valid.items() if p.last_step < highest]
    if not behind:
        # all at the same step: the ranks the others wait for are the ones not waiting in a collective;
        # when every rank given waits, the one they wait for is not among them (another node's)
        busy = [r for r in phases if phases[r] != "wait"]
        behind = busy if len(busy) < len(phases) else list(phases)
    return Hang(step=highest, stalled_s=stalled, bound_s=bound, behind=tuple(sorted(behind)), phases=phases,
                elsewhere=elsewhere)
