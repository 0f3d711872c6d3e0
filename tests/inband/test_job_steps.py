"""A job's in-band view through real rings (healthd_inband's writer) and the agent's real reader: several
`srun` steps in one job directory, rank-0-only phases on a node without rank 0, and rings stamped
in the future, each generated many times with Hypothesis."""

from __future__ import annotations

import logging
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import healthd_inband
from healthd.agent.inband_jobs import InbandJobs, RingInfo, retired, superseded_by
from healthd.agent.render import render_text
from healthd.settings import DetectorSettings, InbandSettings
from tests.inband.test_agent_jobs import JOB, W, job_dir, make_agent, run_steps

DETECTOR = DetectorSettings(window_steps=W, hang_min_s=5.0)
START = 48
"""The header's start time, CLOCK_MONOTONIC ns (docs/inband.md)."""
PID = 20


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def step_ring(d: Path, rank: int, world: int, local: int, step_id: int | None):
    env = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "SLURM_JOB_ID": JOB,
           "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "HEALTHD_INBAND_CAPACITY": "256"}
    if step_id is not None:
        env["SLURM_STEP_ID"] = str(step_id)
    return healthd_inband._Ring(str(d), env)


def set_phase(rg, phase: int, since_ns: int) -> None:
    healthd_inband.PHASE.pack_into(rg.mm, healthd_inband.PHASE_OFFSET, phase, 0, since_ns)


@st.composite
def job_steps(draw):
    """2-4 steps run one after another on this node: each with its own ranks here (1-8, the ranks
    `first..first+n-1` of a world of at least n), its step id written or not (an older client), its
    length; the last step runs (its writers alive), the earlier ones ended (their writers gone)."""
    steps = []
    for i in range(draw(st.integers(2, 4))):
        n = draw(st.integers(1, 8))
        world = n if draw(st.booleans()) else n + draw(st.integers(1, 8))
        steps.append({"n": n, "world": world, "id": i if draw(st.booleans()) else None,
                      "length_s": draw(st.floats(61.0, 3600.0)), "windows": draw(st.integers(2, 4))})
    return steps


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(job_steps(), st.booleans(), st.data())
def test_only_the_live_step_is_judged_and_earlier_rings_are_retired(steps, hung, data):
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        d = job_dir(run_dir)
        now = time.monotonic_ns()
        # the steps' start times, oldest first, each after the previous one ended
        starts, t = [], now - int(sum(s["length_s"] for s in steps) * 1e9) - int(60e9)
        for s in steps:
            starts.append(t)
            t += int(s["length_s"] * 1e9) + int(data.draw(st.floats(0.5, 120.0)) * 1e9)  # srun's start-up
        gone = dead_pid()
        for i, s in enumerate(steps):
            last = i == len(steps) - 1
            rings = [step_ring(d, r, s["world"], r, s["id"]) for r in range(s["n"])]
            for rg in rings:
                struct.pack_into("<Q", rg.mm, START, starts[i])
                set_phase(rg, healthd_inband.PHASE_COMPUTE, starts[i])  # the writer's phase since its start
                if not last:
                    struct.pack_into("<i", rg.mm, PID, gone)
            end = starts[i] + int(s["length_s"] * 1e9) if not last else now - (int(30e9) if hung else 0)
            run_steps(rings, s["windows"] * W, end_mono=end, seed=i)
            if last and hung and s["n"] >= 2:
                # the others went into the collective; one rank never got there
                behind = data.draw(st.integers(0, s["n"] - 1))
                for r, rg in enumerate(rings):
                    set_phase(rg, healthd_inband.PHASE_COMPUTE if r == behind else healthd_inband.PHASE_WAIT, end)
        last = steps[-1]
        jobs = InbandJobs(InbandSettings(detector=DETECTOR))
        (view,) = jobs.read(str(run_dir), time.monotonic_ns())
        assert sorted(r.rank for r in view.ranks) == list(range(last["n"]))
        assert view.world_size == last["world"]
        assert view.complete == (last["world"] == last["n"])
        left = {r for s in steps[:-1] for r in range(s["n"])} - set(range(last["n"]))
        assert {name for name, _ in view.retired} == {healthd_inband.ring_name(r) for r in left}
        assert all("writer is gone" in why for _, why in view.retired)
        if hung and last["n"] >= 2 and behind == 0:
            # rank 0 alone not waiting: a rank-0-only phase until the save bound
            assert view.hang is None and view.stall[1] == DETECTOR.first_save_s
        elif hung:
            assert view.hang is not None and set(view.hang.behind) <= set(range(last["n"]))
            assert set(view.hang.phases) == set(range(last["n"]))
            if last["n"] >= 2:
                assert view.hang.behind == (behind,)
        else:
            assert view.hang is None


def test_a_straggler_in_a_later_smaller_step_is_named(tmp_path, caplog):
    """Step 0 ran 8 ranks here and ended; step 1 runs 4, rank 2 of them 15 % slow from its fifth
    window: the job is complete again, rank 2 is named, the four leftovers are retired, said once in
    the log, in the state document and in the dry-run table."""
    run_dir = tmp_path / "run"
    d = job_dir(run_dir)
    now = time.monotonic_ns()
    gone = dead_pid()
    old = [step_ring(d, r, 8, r, 0) for r in range(8)]
    for rg in old:
        struct.pack_into("<Q", rg.mm, START, now - int(7200e9))
        set_phase(rg, healthd_inband.PHASE_COMPUTE, now - int(7200e9))
        struct.pack_into("<i", rg.mm, PID, gone)
    run_steps(old, 3 * W, end_mono=now - int(3600e9))
    new = [step_ring(d, r, 4, r, 1) for r in range(4)]
    run_steps(new, 4 * W, end_mono=now - int(60e9), seed=2)
    run_steps(new, 4 * W, slow={2: 0.15}, start_step=4 * W, seed=3)
    agent = make_agent(run_dir)
    with caplog.at_level(logging.INFO, logger="healthd"):
        res = agent.tick()
        agent.tick()
    (f,) = [f for f in res.findings if f.source == "inband"]
    assert f.id == "inband.straggler:gpu2"
    (job,) = agent.document()["inband"]["jobs"]
    assert job["world_size"] == 4 and job["ranks_here"] == 4
    assert [r["ring"] for r in job["retired"]] == [f"rank-{r}.ring" for r in range(4, 8)]
    assert sum("retired" in rec.getMessage() for rec in caplog.records) == 4  # once each, not every tick
    assert "retired: rank-7.ring" in render_text(agent.document())


def test_a_dead_rank_of_the_current_step_is_never_retired(tmp_path):
    """A rank that died inside the running step (its peers stuck waiting for it) is the hang's
    evidence, with or without step ids in the headers."""
    for step_id in (None, 3):
        run_dir = tmp_path / f"run{step_id}"
        d = job_dir(run_dir)
        rings = [step_ring(d, r, 4, r, step_id) for r in range(4)]
        end = time.monotonic_ns() - int(30e9)
        run_steps(rings, 3 * W, end_mono=end)
        run_steps(rings[:3], 1, start_step=3 * W, end_mono=end + int(1e8))
        struct.pack_into("<i", rings[3].mm, PID, dead_pid())
        for rg in rings[:3]:
            set_phase(rg, healthd_inband.PHASE_WAIT, end)
        (view,) = InbandJobs(InbandSettings(detector=DETECTOR)).read(str(run_dir), time.monotonic_ns())
        assert view.retired == () and view.hang is not None and view.hang.behind == (3,)


@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 0, 1, 2]), st.integers(1, 16), st.integers(0, 10**12),
                          st.integers(0, 10**12), st.booleans()), min_size=1, max_size=12))
def test_retired_rings_are_superseded_and_gone(rings):
    infos = [RingInfo(f"rank-{i}.ring", step, world, start, start + extra) for i, (step, world, start, extra, _) in
             enumerate(rings)]
    dead = {f"rank-{i}.ring" for i, r in enumerate(rings) if r[4]}
    out = retired(infos, lambda r: r.name in dead)
    for ring in infos:
        later = superseded_by(ring, infos)
        assert (ring.name in out) == (later is not None and ring.name in dead)
        if later is not None:
            assert later.start_mono_ns > ring.start_mono_ns
            # one launch (one known step and world size) never supersedes itself
            assert not (ring.step is not None and ring.step == later.step and ring.world_size == later.world_size)
    # the newest ring is never retired: some live step always owns the job's latest launch
    newest = max(infos, key=lambda r: r.start_mono_ns)
    assert newest.name not in out or any(r.start_mono_ns == newest.start_mono_ns and r.name != newest.name
                                         for r in infos)


# --------------------------------------------------------------------------- rank 0 elsewhere


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6), st.integers(1, 6), st.floats(0.0, 1.0), st.sampled_from(["wait", "compute"]))
def test_a_node_without_rank_0_waits_out_a_rank_0_only_phase(here, first, frac, phase):
    """This node hosts ranks first..first+here-1 of a job whose rank 0 runs elsewhere; rank 0 saves
    (or logs, or evaluates) alone for any time up to the save bound while these ranks wait in a
    barrier (wrapped in wait() or not): no hang here, and the view says it is waiting elsewhere; past
    the bound, a hang that says so."""
    settings = DetectorSettings(window_steps=W)  # the real bounds: 60 s, first_save_s
    bound = settings.first_save_s
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        d = job_dir(run_dir)
        for length_s, hung in ((frac * (bound - 30), False), (bound + 5, True)):
            rings = [step_ring(d, r, first + here + 1, r - first, 0) for r in range(first, first + here)]
            end = time.monotonic_ns() - int(length_s * 1e9)
            run_steps(rings, 2 * W, end_mono=end)
            for rg in rings:
                set_phase(rg, healthd_inband.PHASE_WAIT if phase == "wait" else healthd_inband.PHASE_COMPUTE, end)
            (view,) = InbandJobs(InbandSettings(detector=settings)).read(str(run_dir), time.monotonic_ns())
            assert view.waits_elsewhere and view.stall is not None and view.stall[1] == bound
            assert (view.hang is not None) == hung
            if hung:
                assert view.hang.elsewhere


def test_a_ring_stamped_in_the_future_cannot_hide_the_hang(tmp_path):
    """Two of three ranks stopped 30 s ago; the third ring's records are stamped an hour ahead. The
    agent believes no stamp later than its own first sight of the step: the hang is named."""
    run_dir = tmp_path / "run"
    d = job_dir(run_dir)
    rings = [step_ring(d, r, 3, r, 0) for r in range(3)]
    now = time.monotonic_ns()
    run_steps(rings[:2], 3 * W, end_mono=now - int(30e9))
    run_steps(rings[2:], 3 * W, end_mono=now + int(3600e9))
    jobs = InbandJobs(InbandSettings(detector=DETECTOR))
    (view,) = jobs.read(str(run_dir), time.monotonic_ns())
    assert view.hang is not None and view.hang.stalled_s >= 30
    time.sleep(0.2)
    (view,) = jobs.read(str(run_dir), time.monotonic_ns())
    ahead = next(r for r in view.ranks if r.rank == 2)
    assert 0.1 < ahead.progress.last_step_age_s < 5  # aged from the agent's first sight, not its stamp
    assert view.hang is not None and 0.1 < jobs.look_s < 5
