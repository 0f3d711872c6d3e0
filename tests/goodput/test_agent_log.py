"""The agent's side of the goodput log (healthd.agent.goodput_log): real rings written by the client,
read by InbandJobs, turned into log entries by the node holding rank 0, appended once per read; an
agent restart writes nothing twice; the log accounts (healthd.goodput) as the job ran."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from pytest import approx

import healthd_inband
from healthd.agent.goodput_log import GoodputLog, entries
from healthd.agent.inband import read_ring
from healthd.agent.inband_jobs import InbandJobs
from healthd.goodput import account, parse_log
from healthd.settings import DetectorSettings, InbandSettings
from tests.inband.test_agent_jobs import job_dir, ring

JOB = "4242"
W = 10


def jobs(state_dir: Path) -> InbandJobs:
    return InbandJobs(InbandSettings(detector=DetectorSettings(window_steps=W)),
                      goodput=GoodputLog(str(state_dir), W))


def steps(rg, first: int, n: int, t0: int, step_ns: int = 1_000_000_000) -> int:
    """`n` steps of 1 s from step `first` on the ring's clocks (monotonic and wall alike, ns) from
    `t0`; returns the clock after them."""
    t = t0
    for k in range(first, first + n):
        t += step_ns
        rg.wall = lambda t=t: t  # the writer reads its wall clock here: the test's clock instead
        rg.record(healthd_inband.STEP, k, step_ns, 0, 0, t)
    return t


def at(rg, t: int, kind: int, step: int, dur: int = 0) -> None:
    rg.wall = lambda: t
    rg.record(kind, step, dur, 0, 0, t)


def started(rg, wall_ns: int) -> None:
    """The ring's header says its process started at `wall_ns` (the start wall time is at offset 40)."""
    struct.pack_into("<Q", rg.mm, 40, wall_ns)


def test_entries_mark_windows_saves_and_restores(tmp_path):
    rg = ring(tmp_path, 0, 2)
    t = steps(rg, 0, 25, time.time_ns())
    at(rg, t, healthd_inband.CKPT_BEGIN, 24)
    at(rg, t + 5 * 10**9, healthd_inband.CKPT_END, 24, 5 * 10**9)
    at(rg, t + 6 * 10**9, healthd_inband.DURABLE, 24)
    view = read_ring(str(tmp_path), "rank-0.ring")
    got, first = entries(view.header, view.records, W, new_run=True, first_step=True)
    assert list(got[0]) == ["job_start_time"] and got[1]["healthd_event"] == "allocation" and got[1]["gpus"] == 2
    assert [e["step_count"] for e in got if "step_count" in e] == [0, 10, 20]  # the first step, then each window
    mark = next(e for e in got if e.get("step_count") == 10)
    wall = {r.step: r.wall_ns for r in view.records if r.kind == healthd_inband.STEP}
    assert mark["step_start_time"] == (wall[10] - 10**9) / 1e9  # a step starts its duration before it is recorded
    saves = [e for e in got if "custom_badput_event_type" in e]
    assert saves == [{"custom_badput_event_type": "checkpoint_save", "custom_badput_event_start_time": t / 1e9},
                     {"custom_badput_event_type": "checkpoint_save", "custom_badput_event_end_time": t / 1e9 + 5}]
    assert got[-1] == {"healthd_event": "durable", "time": t / 1e9 + 6, "step": 24} and first is False


def test_a_crash_and_restore_is_logged_once_across_an_agent_restart_and_accounts(tmp_path):
    run_dir, state = tmp_path / "run", tmp_path / "state"
    d = job_dir(run_dir, JOB)
    r0, r1 = ring(d, 0, 2, JOB), ring(d, 1, 2, JOB)
    base = time.time_ns() - 1000 * 10**9  # run 0 ran in the past; the requeued run's process starts now
    started(r0, base)
    for rg in (r0, r1):
        t = steps(rg, 0, 30, base + 10 * 10**9)
    at(r0, t, healthd_inband.CKPT_BEGIN, 29)
    at(r0, t + 10**9, healthd_inband.CKPT_END, 29, 10**9)
    at(r0, t + 10**9, healthd_inband.DURABLE, 29)
    end0 = steps(r0, 30, 15, t + 10**9)
    agent = jobs(state)
    agent.read(str(run_dir), 0)
    log = state / "goodput" / f"{JOB}.jsonl"
    first = log.read_text()
    assert first.count('"job_start_time"') == 1 and '"step_count":40' in first
    agent.read(str(run_dir), 0)
    assert log.read_text() == first  # nothing new, nothing written
    # the agent restarts: a new reader over the same rings writes nothing twice
    jobs(state).read(str(run_dir), 0)
    assert log.read_text() == first
    # rank 0 crashes; the requeued run's new process restores step 29 and goes on
    with open(log, "a") as f:
        f.write(json.dumps({"job_name": JOB, "healthd_event": "run_end", "time": end0 / 1e9 + 5, "state": "FAILED"})
                + "\n")
    new0 = ring(d, 0, 2, JOB)
    now = time.time_ns()
    at(new0, now + 20 * 10**9, healthd_inband.RESTORED, 29)
    steps(new0, 30, 40, now + 20 * 10**9)
    agent.read(str(run_dir), 0)
    text = log.read_text()
    assert text.startswith(first) and text.count('"job_start_time"') == 2 and '"healthd_event":"restored"' in text
    acc = account(parse_log(text), now=(now + 61 * 10**9) / 1e9)  # the requeued run still going 1 s after its last step
    assert acc.runs == 2 and acc.interruptions == 1
    assert acc.gpu_s["productive"] > 0 and acc.gpu_s["lost"] > 0 and acc.gpu_s["checkpoint"] > 0
    assert not acc.partial, acc.problems
    # run 0: 10 s to its first step, steps 0-29 kept (restored), the 1 s save, steps 30-44 lost and 5 s to its end
    assert acc.gpu_s["checkpoint"] == approx(2 * 1) and acc.gpu_s["lost"] == approx(2 * (15 + 5))
    assert acc.gpu_s["restart"] == approx(2 * 20, abs=0.5) and acc.gpu_s["productive"] == approx(2 * (30 + 41), abs=0.5)
    assert sum(acc.gpu_s.values()) == approx(acc.held_gpu_s)


def test_no_log_in_dry_run_or_when_disabled(tmp_path):
    from tests.inband.test_agent_jobs import make_agent, run_steps
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 2) for r in range(2)]
    run_steps(rings, 40)
    make_agent(run_dir).tick()  # make_agent is a dry-run agent
    assert not any(tmp_path.rglob("*.jsonl"))
    quiet = InbandJobs(InbandSettings(goodput_log=False))
    quiet.read(str(run_dir), 0)
    assert quiet.goodput is None and not any(tmp_path.rglob("*.jsonl"))


def test_old_logs_are_pruned_once_an_hour_and_a_running_jobs_is_kept(tmp_path):
    import os
    g = GoodputLog(str(tmp_path), W, keep_days=30)
    d = tmp_path / "goodput"
    d.mkdir()
    now = time.time()
    for name, age_days in (("1.jsonl", 40), ("1.cursor", 40), ("2.jsonl", 10), ("3.jsonl", 40), ("notes.txt", 90)):
        (d / name).write_text("x")
        os.utime(d / name, (now - age_days * 86400,) * 2)
    assert sorted(g.prune(now, running=["3"])) == ["1.cursor", "1.jsonl"]
    assert sorted(p.name for p in d.iterdir()) == ["2.jsonl", "3.jsonl", "notes.txt"]
    os.utime(d / "2.jsonl", (now - 40 * 86400,) * 2)
    assert g.prune(now + 60) == []  # not again within the hour
    assert g.prune(now + 3601, running=["3"]) == ["2.jsonl"]
