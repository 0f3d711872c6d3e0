"""The effective training time ratio (ByteRobust's ETTR) from healthd's categories: cumulative, over a
sliding window, and the longest unproductive stretch, each against a brute-force reading of the
same timeline and against jobs whose figures are known by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd import goodput
from healthd.goodput_categories import CATEGORIES

EFFECTIVE = ("productive", "straggler")


def account_of(pieces: list[tuple[float, str]], gpus: int = 8) -> goodput.Account:
    """An account whose timeline is `pieces` (seconds, category) back to back from t = 1000."""
    timeline, t = [], 1000.0
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for d, c in pieces:
        timeline.append((t, t + d, c))
        totals[c] += d * gpus
        t += d
    return goodput.Account("1", sum(totals.values()), totals, (), 1, 0, t - 1000.0, timeline=tuple(timeline))


def brute(acc: goodput.Account, window: float, step: float) -> tuple[float, float]:
    """The lowest window share over starts every `step` seconds, and the longest stretch, by walking
    the timeline second by second (an implementation of the definitions that shares nothing)."""
    good = [c in EFFECTIVE for a, b, c in acc.timeline for _ in range(int(round(b - a)))]
    total = len(good)
    longest = run = 0
    for g in good:
        run = 0 if g else run + 1
        longest = max(longest, run)
    if total <= window:
        return sum(good) / total, longest
    shares = [sum(good[int(x):int(x) + int(window)]) / window for x in range(0, total - int(window) + 1, int(step))]
    return min(shares), longest


pieces = st.lists(st.tuples(st.integers(1, 900).map(float),
                            st.sampled_from(["productive", "productive", "straggler", "checkpoint", "lost", "waiting",
                                             "restart", "other"])), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(pieces, st.sampled_from([60.0, 600.0, 3600.0]))
def test_ettr_equals_a_brute_force_reading_of_the_timeline(parts, window):
    acc = account_of(parts)
    e = goodput.ettr(acc, window)
    low, longest = brute(acc, window, 1.0)
    assert e.cumulative == pytest.approx(sum(acc.gpu_s[c] for c in EFFECTIVE) / acc.held_gpu_s)
    assert e.window_min == pytest.approx(low, abs=1e-9)
    assert e.longest_unproductive_s == longest
    assert 0.0 <= e.window_min <= 1.0


@settings(max_examples=60, deadline=None)
@given(pieces)
def test_a_window_longer_than_the_job_is_the_whole_job(parts):
    acc = account_of(parts)
    e = goodput.ettr(acc, 10 ** 7)
    assert e.window_min == pytest.approx(e.cumulative)


def test_a_known_job():
    """Three hours of training, a 50-minute failure (detection, waiting, restart), then two hours: ETTR
    5/5.83, the worst hour is the one holding the 50 minutes, the stretch is 50 minutes."""
    acc = account_of([(3 * 3600, "productive"), (600, "lost"), (1200, "waiting"), (1200, "restart"),
                      (2 * 3600, "productive")])
    e = goodput.ettr(acc)
    assert e.cumulative == pytest.approx(5 / (5 + 50 / 60))
    assert e.window_min == pytest.approx(10 / 60)
    assert e.longest_unproductive_s == 3000 and e.longest_unproductive_at == 1000 + 3 * 3600


def test_from_a_log_the_queue_between_runs_is_not_a_stretch():
    """A requeue: the run's tail to the next run's first step is the stretch; the queued hour is not in it."""
    lines = [{"job_start_time": 0}, {"healthd_event": "allocation", "time": 0, "gpus": 4},
             {"step_count": 0, "step_start_time": 10}, {"step_count": 100, "step_start_time": 1010},
             {"healthd_event": "run_end", "time": 1100, "state": "NODE_FAIL"},
             {"job_start_time": 4700}, {"healthd_event": "allocation", "time": 4700, "gpus": 4},
             {"healthd_event": "restored", "time": 4720, "step": 99}, {"step_count": 100, "step_start_time": 4760},
             {"step_count": 200, "step_start_time": 5760}, {"job_end_time": 5770}]
    text = "".join(goodput.log_line("9", **entry) + "\n" for entry in lines)
    acc = goodput.account(goodput.parse_log(text))
    e = goodput.ettr(acc)
    assert acc.queued_s == 3600 and not acc.problems
    assert e.longest_unproductive_s == pytest.approx(90 + 60)  # 1010 -> 1100 lost, 4700 -> 4760 restart
    assert e.longest_unproductive_at == 1010


def test_the_report_and_healthctl_show_the_same_figures(tmp_path, capsys):
    from healthd import goodput_report
    from healthd.controller import healthctl

    acc = account_of([(3 * 3600, "productive"), (600, "lost"), (1200, "waiting"), (1200, "restart"),
                      (2 * 3600, "productive")])
    e = goodput.ettr(acc, 1800)
    page = goodput_report.render(acc, goodput.Log("1", ()), None, ettr=e)
    table = page.split("<h2>Effective training time</h2>", 1)[1].split("</table>", 1)[0]
    assert f"<td>{e.cumulative:.1%}</td>" in table and "<td>lowest over 30.0 min of held time</td><td>0.0%</td>" in table
    assert "<td>50.0 min from 1970-01-01 03:16:40 UTC</td>" in table
    doc = healthctl.goodput_doc(acc, None, e)["ettr"]
    assert (doc["cumulative"], doc["window_s"], doc["window_min"], doc["longest_unproductive_s"]) == (
        e.cumulative, 1800, 0.0, 3000)
