"""Coincidence is not corroboration: a slow rank is "hardware" (tier 2) only with out-of-band evidence
that can explain its slowdown. A throttle (clock event reason) counts when it began within a window of
the slowdown's onset and stayed at every read since, never for being present at one read; a finding of
the user's code (an application's Xid) never counts. Real rings and a real Agent over several ticks,
the pure pieces (throttles, findings, the controller's corroborating) over generated inputs."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.agent import inband_jobs
from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.agent.inband_jobs import JobView, RankView, Throttles, throttles
from healthd.controller.inband import corroborating
from healthd.model import Component, Evidence, Finding
from healthd.progress import RankProgress, Straggler, throttle_coincides
from healthd.settings import HookSettings, InbandSettings
from tests.inband.test_agent_jobs import DETECTOR, JOB, W, job_dir, ring, run_steps
from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings, snap
from tests.support.fake_sources import FakeCollector

HOT = 0x40  # hw_thermal
CALM = 0x4  # the software power cap: how a healthy GPU runs


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


def agent_on(run_dir, clock: Clock) -> tuple[Agent, FakeCollector]:
    cfg = settings(hooks=HookSettings(run_dir=str(run_dir)), inband=InbandSettings(detector=DETECTOR))
    gpus = FakeCollector("nvml", nvml(*[gpu(i, clock_event_reasons=CALM) for i in range(4)]))
    sources = Sources(nvml=gpus, kernel=FakeCollector("kernel_log", kernel()))
    return Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=True, clock=clock), gpus


def set_reasons(collector: FakeCollector, hot_gpu: int | None) -> None:
    collector.sample = nvml(*[gpu(i, clock_event_reasons=HOT if i == hot_gpu else CALM) for i in range(4)])


def straggler_finding(agent: Agent, clock: Clock) -> Finding:
    clock.t += 10.0
    (f,) = [f for f in agent.tick().findings if f.id.startswith("inband.straggler")]
    return f


def test_a_throttle_that_began_with_the_slowdown_and_stayed_makes_it_tier_2(tmp_path):
    run_dir, clock = tmp_path / "run", Clock()
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W, end_mono=10**12)  # the job's first windows: each rank's own baseline
    agent, gpus = agent_on(run_dir, clock)
    clock.t += 10.0
    agent.tick()  # read without a throttle, the rank at step 3W - 1
    run_steps(rings, 4 * W, slow={1: 0.10}, start_step=3 * W, seed=2, end_mono=10**12 + 10**10)
    set_reasons(gpus, 1)
    one = straggler_finding(agent, clock)  # the throttle at one read: a coincidence so far
    assert (one.id, one.tier, one.action) == ("inband.straggler:gpu1", 3, "none")
    assert "in-band evidence only" in one.summary
    two = straggler_finding(agent, clock)  # still there at the next read: it began with the slowdown and stayed
    assert (two.tier, two.attribution, two.action) == (2, "hardware", "drain")
    assert any("hw_thermal" in e.text and f"begun between steps {3 * W - 1} and {7 * W - 1}" in e.text
               for e in two.evidence)
    (rank1,) = [r for r in agent.document()["inband"]["jobs"][0]["ranks"] if r["rank"] == 1]
    assert any("clocks held down" in line for line in rank1["corroboration"])  # for the controller to judge
    set_reasons(gpus, None)
    assert straggler_finding(agent, clock).tier == 3  # gone at a read: the run ended


def test_a_throttle_present_since_before_the_agent_knew_the_rank_never_corroborates(tmp_path):
    run_dir, clock = tmp_path / "run", Clock()
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W)
    run_steps(rings, 4 * W, slow={1: 0.10}, start_step=3 * W, seed=2)
    agent, gpus = agent_on(run_dir, clock)
    set_reasons(gpus, 1)
    for _ in range(5):  # at every read, but since when is not known
        assert straggler_finding(agent, clock).tier == 3


def test_a_throttle_that_began_long_after_the_slowdown_does_not_explain_it(tmp_path):
    run_dir, clock = tmp_path / "run", Clock()
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W, end_mono=10**12)
    run_steps(rings, 4 * W, slow={1: 0.10}, start_step=3 * W, seed=2, end_mono=10**12 + 10**10)
    agent, gpus = agent_on(run_dir, clock)
    assert straggler_finding(agent, clock).tier == 3
    run_steps(rings, 4 * W, slow={1: 0.10}, start_step=7 * W, seed=3, end_mono=10**12 + 2 * 10**10)
    set_reasons(gpus, 1)  # first seen 4 windows after the onset's windows: it began after the slowdown
    for _ in range(3):
        assert straggler_finding(agent, clock).tier == 3


# --------------------------------------------------------------------------- the pure pieces

def rank_view(rank: int, gpu_index: int, last_step: int) -> RankView:
    progress = RankProgress(rank=rank, last_step=last_step, last_step_age_s=0.5, phase="compute", phase_age_s=0.1,
                            step_median_s=0.1)
    return RankView(rank, rank, gpu_index, 1000 + rank, progress, (), 0, 0, None, None)


def job_view(last_step: int, onset_window: int) -> JobView:
    flag = Straggler(rank=1, test="magnitude", windows=(onset_window, onset_window + 1), effect=0.1, threshold=0.05)
    return JobView(JOB, 1000, 4, tuple(rank_view(r, r, last_step) for r in range(4)), stragglers=(flag,))


def finding_on(gpu_index: int, attribution: str, tier: int) -> Finding:
    action = "none" if tier == 3 else "drain"
    return Finding(id=f"xid:gpu{gpu_index}:13", component=Component(kind="gpu", index=gpu_index), source="kernel_log",
                   attribution=attribution, tier=tier, action=action,  # type: ignore[arg-type]
                   summary=f"gpu{gpu_index}: Xid 13", evidence=(Evidence("kernel_log", "NVRM: Xid 13"),),
                   first_seen=NOW, last_seen=NOW)


def tier_of(jobs, snapshot, others=(), memory: Throttles | None = None) -> int:
    (f,) = inband_jobs.findings(jobs, snapshot, others, {}, snapshot.time, W, throttles=memory)
    return f.tier


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasons=st.sampled_from([0x8, 0x20, 0x40, 0x80, 0xe8]), onset=st.integers(0, 50),
       last_step=st.integers(-1, 2000), earlier_reads=st.integers(0, 5))
def test_a_throttle_present_at_one_read_never_raises_the_tier(reasons, onset, last_step, earlier_reads):
    job = job_view(last_step, onset)
    memory = Throttles()
    for i in range(earlier_reads):  # reads without it: its start is known, yet it is seen once
        memory = throttles(memory, snap(NOW + i, nv=nvml(*[gpu(g, clock_event_reasons=CALM) for g in range(4)])), [job])
    hot = snap(NOW + 10, nv=nvml(*[gpu(g, clock_event_reasons=reasons if g == 1 else CALM) for g in range(4)]))
    memory = throttles(memory, hot, [job])
    assert memory.runs[1].reads == 1
    calm = snap(NOW + 10, nv=nvml(*[gpu(g, clock_event_reasons=CALM) for g in range(4)]))
    assert tier_of([job], hot, memory=memory) == tier_of([job], calm) == 3
    assert throttles(memory, hot, [job]) is memory  # the same snapshot classified again counts once


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(onset=st.integers(0, 40), before=st.integers(-1, 1200), span=st.integers(0, 200), reads=st.integers(2, 6))
def test_a_throttle_that_stayed_corroborates_exactly_when_it_coincides(onset, before, span, reads):
    since = before + span
    job_before, job_at = job_view(before, onset), job_view(since, onset)
    calm = nvml(*[gpu(g, clock_event_reasons=CALM) for g in range(4)])
    hot = nvml(*[gpu(g, clock_event_reasons=HOT if g == 1 else CALM) for g in range(4)])
    memory = throttles(Throttles(), snap(NOW, nv=calm), [job_before])
    for i in range(reads):
        last = snap(NOW + 10 * (i + 1), nv=hot)
        memory = throttles(memory, last, [job_at])
    coincides = throttle_coincides(onset, before, since, W)
    assert tier_of([job_at], last, memory=memory) == (2 if coincides else 3)
    # the controller reads the same rule back from the line the agent sends
    line = inband_jobs.throttle_line(1, memory.runs[1], (JOB, 1))
    assert line is not None
    flag = job_at.stragglers[0]
    assert corroborating([line], flag, W) == ((line,) if coincides else ())
    assert corroborating([line.split(", begun")[0]], flag, W) == ()  # an agent that does not say when


@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tier=st.sampled_from([1, 2, 3]), onset=st.integers(0, 40), with_hardware=st.booleans())
def test_a_finding_of_the_users_code_never_corroborates(tier, onset, with_hardware):
    job = job_view(500, onset)
    s = snap(NOW, nv=nvml(*[gpu(g, clock_event_reasons=CALM) for g in range(4)]))
    user = finding_on(1, "user", tier)
    assert tier_of([job], s, [user]) == 3
    on_gpu, on_rail = inband_jobs.corroboration(1, s, [user])
    assert on_gpu == [] and on_rail == []
    if with_hardware:  # the same finding, the hardware's: it does
        assert tier_of([job], s, [replace(user, attribution="hardware")]) == 2


def test_pcie_evidence_and_a_hardware_finding_still_corroborate():
    job = job_view(500, 10)
    s = snap(NOW, nv=nvml(*[gpu(g, clock_event_reasons=CALM, pcie_width=8 if g == 1 else 16, pcie_width_max=16)
                            for g in range(4)]))
    assert tier_of([job], s) == 2
