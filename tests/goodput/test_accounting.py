"""healthd.goodput: golden jobs whose categories are known to the second, a conservation property
over random logs, Young's and Daly's intervals against Daly's published values, and bad logs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.goodput import CATEGORIES, account, daly_interval, efficiency, log_line, parse_log, young_interval

J = "4242"


def log(*entries: dict) -> str:
    return "".join(log_line(J, **e) + "\n" for e in entries)


def start(t, gpus):
    return [{"job_start_time": t}, {"healthd_event": "allocation", "time": t, "gpus": gpus, "nodes": ["node01"]}]


def step(n, t):
    return {"step_count": n, "step_start_time": t}


def ckpt(t0, t1):
    return [{"custom_badput_event_type": "checkpoint_save", "custom_badput_event_start_time": t0},
            {"custom_badput_event_type": "checkpoint_save", "custom_badput_event_end_time": t1}]


def hd(kind, t, **kw):
    return {"healthd_event": kind, "time": t, **kw}


def gpu_s(acc) -> dict[str, float]:
    return {c: round(v, 6) for c, v in acc.gpu_s.items() if v}


def crash_and_restore(decided=200.0, end=210.0, restart=300.0, false_positive=False) -> str:
    """4 GPUs. Run 0: steps 0-99 in [10, 110), a save [110, 120) (durable 99 at 125), steps 100-149
    to 170, incident 7 (evidence 175, detected 185, decided `decided`), the run ends at `end`. Run 1
    starts at `restart`, restores step 99, steps from restart+30 to restart+230, the job ends 10 s later."""
    r = restart
    return log(*start(0, 4), step(0, 10), step(100, 110), *ckpt(110, 120), hd("durable", 125, step=99),
               step(150, 170), hd("evidence", 175, incident="7"),
               hd("interrupt", 180, incident="7", cause="xid:79", node="node01", gpu="1652000003"),
               hd("detected", 185, incident="7"), hd("decided", decided, incident="7"),
               hd("run_end", end, state="NODE_FAIL"), *start(r, 4), hd("restored", r + 20, step=99),
               step(100, r + 30), step(300, r + 230), {"job_end_time": r + 240},
               *([hd("false_positive", r + 300, incident="7")] if false_positive else []))


# --------------------------------------------------------------------------- golden jobs


def test_a_clean_run():
    acc = account(parse_log(log(*start(0, 8), step(0, 60), step(100, 1060), *ckpt(1060, 1090), step(200, 2090),
                                {"job_end_time": 2100})))
    assert gpu_s(acc) == {"productive": 16080, "checkpoint": 240, "other": 480}  # the last 10 s: steps after the last mark
    assert acc.held_gpu_s == 16800 and acc.goodput == pytest.approx(16080 / 16800)
    assert (acc.runs, acc.interruptions, acc.incidents, acc.problems, acc.mtbi_s) == (1, 0, (), (), None)


def test_a_crash_with_requeue_and_restore_is_charged_to_its_incident():
    acc = account(parse_log(crash_and_restore()))
    assert gpu_s(acc) == {"productive": 1240, "checkpoint": 40, "lost": 220, "detection": 40, "decision": 60,
                          "waiting": 40, "restart": 120, "other": 40}
    assert acc.held_gpu_s == 1800 == sum(acc.gpu_s.values())  # allocated time only: not the 90 s queued between runs
    assert acc.queued_s == 90
    [inc] = acc.incidents
    assert (inc.incident, inc.cause, inc.node, inc.gpu, inc.false_positive) == ("7", "xid:79", "node01", "1652000003", False)
    assert inc.gpu_s == {"lost": 220, "detection": 40, "decision": 60, "waiting": 40, "restart": 120}
    assert (acc.runs, acc.interruptions, acc.mtbi_s, acc.problems) == (2, 1, 450.0, ())


def test_a_straggler_costs_its_share_of_the_time_it_was_flagged():
    acc = account(parse_log(log(*start(0, 2), step(0, 0), step(1000, 1000), {"job_end_time": 1000},
                                hd("straggler", 500, end=1000, share=0.25, rank=3, node="node02", gpu=3))))
    assert gpu_s(acc) == {"productive": 1800, "straggler": 200}  # 1.25 x as long: 100 of the 500 s


def test_a_false_positive_is_charged_whole():
    acc = account(parse_log(crash_and_restore(false_positive=True)))
    assert gpu_s(acc) == {"productive": 1240, "checkpoint": 40, "false_positive": 480, "other": 40}
    assert acc.incidents[0].false_positive and acc.incidents[0].cost_gpu_s == 480


def test_a_long_wait_for_approval_is_decision_time():
    acc = account(parse_log(crash_and_restore(decided=3785, end=3795, restart=3885)))
    assert gpu_s(acc)["decision"] == 4 * 3600 and gpu_s(acc)["waiting"] == 4 * 10
    assert acc.held_gpu_s == sum(acc.gpu_s.values()) == 4 * 4035 and acc.queued_s == 90


def test_without_a_restore_everything_of_the_interrupted_run_is_lost():
    text = crash_and_restore().replace(log_line(J, **hd("restored", 320.0, step=99)) + "\n", "")
    assert text != crash_and_restore()
    acc = account(parse_log(text))
    assert gpu_s(acc)["productive"] == 4 * 210 and gpu_s(acc)["lost"] == 4 * 155 and gpu_s(acc)["restart"] == 4 * 30


def test_a_run_still_going_is_alive_at_the_end():
    acc = account(parse_log(log(*start(0, 1), step(0, 0), step(10, 100))), now=150)
    assert gpu_s(acc) == {"productive": 150} and not acc.partial


# --------------------------------------------------------------------------- conservation


events = st.lists(st.one_of(
    st.builds(lambda t: {"job_start_time": t}, st.floats(0, 1e4)),
    st.builds(lambda t, g: hd("allocation", t, gpus=g), st.floats(0, 1e4), st.integers(1, 16)),
    st.builds(step, st.integers(-5, 500), st.floats(0, 1e4)),
    st.builds(lambda a, b: ckpt(a, b)[0], st.floats(0, 1e4), st.floats(0, 1e4)),
    st.builds(lambda a: ckpt(0, a)[1], st.floats(0, 1e4)),
    st.builds(lambda t, n: hd("durable", t, step=n), st.floats(0, 1e4), st.integers(0, 500)),
    st.builds(lambda t, n: hd("restored", t, step=n), st.floats(0, 1e4), st.integers(0, 500)),
    st.builds(lambda t, k: hd(k, t, incident="1"), st.floats(0, 1e4),
              st.sampled_from(["interrupt", "evidence", "detected", "decided", "false_positive"])),
    st.builds(lambda t, s: hd("run_end", t, state=s), st.floats(0, 1e4), st.sampled_from(["FAILED", "COMPLETED"])),
    st.builds(lambda t, d, s: hd("straggler", t, end=t + d, share=s), st.floats(0, 1e4), st.floats(0, 1e3),
              st.floats(0, 2)),
    st.builds(lambda t: {"job_end_time": t}, st.floats(0, 1e4)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(events, st.booleans())
def test_the_categories_always_sum_to_the_held_time_and_none_is_negative(entries, shuffled):
    acc = account(parse_log(log(*(entries if shuffled else sorted(entries, key=_t)))), now=2e4)
    assert set(acc.gpu_s) == set(CATEGORIES)
    assert all(v >= -1e-6 for v in acc.gpu_s.values()), acc.gpu_s
    assert sum(acc.gpu_s.values()) == pytest.approx(acc.held_gpu_s, rel=1e-9, abs=1e-6)
    for inc in acc.incidents:
        assert all(v >= -1e-6 for v in inc.gpu_s.values())


def _t(e: dict) -> float:
    return next(v for k, v in e.items() if k.endswith("time"))


# --------------------------------------------------------------------------- bad logs


def test_bad_logs_give_a_partial_answer_that_says_why():
    good = crash_and_restore()
    lines = good.splitlines()
    truncated = "\n".join(lines[:-1]) + "\n" + lines[-1][:20]  # the job_end line cut: the last run has no end
    acc = account(parse_log(truncated + "\nnot json at all\n[1, 2]\n" + '{"job_name": "4242", "step_count": "x"}'))
    assert acc.partial and any("not JSON" in p for p in acc.problems) and any("not a JSON object" in p for p in acc.problems)
    assert any("step_count" in p for p in acc.problems)
    assert any("no end yet (still running, or its end was never written)" in n for n in acc.notes)
    assert sum(acc.gpu_s.values()) == pytest.approx(acc.held_gpu_s)
    reordered = account(parse_log("\n".join(reversed(lines)) + "\n"))
    assert reordered.problems == ("lines out of the order they were written (step counts go back); runs told apart by time",)
    assert gpu_s(reordered) == gpu_s(account(parse_log(good)))
    nothing = account(parse_log(""))
    assert nothing.held_gpu_s == 0 and nothing.problems == ("no job_start_time entry: no run to account",)
    other_job = account(parse_log(good + log_line("other", job_start_time=5) + "\n", job=J))
    assert gpu_s(other_job) == gpu_s(account(parse_log(good)))
    stepped = account(parse_log(log(*start(100, 1), step(0, 100), {"job_end_time": 200}, *start(150, 1),
                                    {"job_end_time": 300})))
    # the clock stepped back 50 s between the runs: said, each run keeps its own time, and nothing is queued
    assert stepped.runs == 2 and not stepped.problems and stepped.queued_s == 0
    assert any("run 1 starts 50 s before run 0 ends" in n for n in stepped.notes)
    assert sum(stepped.gpu_s.values()) == pytest.approx(stepped.held_gpu_s) and stepped.held_gpu_s == 250


# --------------------------------------------------------------------------- the interval


@pytest.mark.parametrize("mtbi_min, expected", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_matches_dalys_published_values(mtbi_min, expected):
    # Daly 2006, figs. 3-5: checkpoint cost 5 min
    assert daly_interval(5, mtbi_min) == pytest.approx(expected, abs=0.1 if expected < 10 else 0.5)


def test_young_and_daly_at_a_mtbi_of_14_8_hours():
    assert round(young_interval(5, 14.8 * 60)) == 94 and round(daly_interval(5, 14.8 * 60)) == 91
    assert daly_interval(30, 10) == 10  # a checkpoint longer than 2 M: checkpoint every M


def test_the_efficiency_curve_peaks_near_dalys_interval():
    c, m = 5.0, 360.0
    best = max((efficiency(t / 10, c, m), t / 10) for t in range(10, 3000))[1]
    assert best == pytest.approx(daly_interval(c, m), rel=0.02)
    assert efficiency(daly_interval(c, m), c, m) > efficiency(240, c, m) > 0 and math.isclose(efficiency(0, c, m), 0)
