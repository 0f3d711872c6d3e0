"""The agent's in-band view: real rings written by the client's writer, read by InbandJobs, turned into
findings and the state document's `inband` section by a real Agent."""

from __future__ import annotations

import os
import struct
import random
import time
from pathlib import Path

import healthd_inband
from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.agent import inband_jobs
from healthd.agent.inband_jobs import InbandJobs
from healthd.agent.render import render_text
from healthd.model import Component, Finding
from healthd.settings import DetectorSettings, HookSettings, InbandSettings
from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings
from tests.support.fake_sources import FakeCollector

JOB = "4242"
W = 20  # window steps: small windows keep the tests short
DETECTOR = DetectorSettings(window_steps=W, hang_min_s=5.0)


def job_dir(run_dir: Path, job: str = JOB) -> Path:
    d = run_dir / "inband" / job
    d.mkdir(parents=True, exist_ok=True)
    (run_dir / "inband").chmod(0o755)
    d.chmod(0o700)
    return d


def ring(d: Path, rank: int, world: int, job: str = JOB, capacity: int = 4096):
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "SLURM_JOB_ID": job,
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world))), "HEALTHD_INBAND_CAPACITY": str(capacity)}
    return healthd_inband._Ring(str(d), env)


def run_steps(rings, steps: int, *, slow: dict[int, float] | None = None, start_step: int = 0,
              base_ms: float = 100.0, seed: int = 1, end_mono: int | None = None) -> int:
    """Synchronous data parallel on a virtual clock: every rank's step takes the slowest rank's compute
    plus the all-reduce; each rank waits the difference. Returns the clock at the last step."""
    rnd = random.Random(seed)
    slow = slow or {}
    step_ns = int(base_ms * 1.3e6)
    t = (end_mono or time.monotonic_ns()) - steps * step_ns
    for n in range(start_step, start_step + steps):
        compute = {r: base_ms * 1e6 * rnd.lognormvariate(0, 0.03) * (1 + slow.get(r, 0.0)) for r in range(len(rings))}
        slowest = max(compute.values())
        dur = int(slowest + 0.25 * base_ms * 1e6)
        t += dur
        for r, rg in enumerate(rings):
            rg.record(healthd_inband.STEP, n, dur, int(dur - compute[r]), 0, t)
    return t


def make_agent(run_dir: Path, gpus=None, **inband) -> Agent:
    cfg = settings(hooks=HookSettings(run_dir=str(run_dir)),
                   inband=InbandSettings(detector=DETECTOR, **inband))
    sources = Sources(nvml=FakeCollector("nvml", nvml(*(gpus or [gpu(i) for i in range(4)]))),
                      kernel=FakeCollector("kernel_log", kernel()))
    return Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=True, clock=lambda: NOW)


def test_a_healthy_job_shows_its_ranks_and_no_finding(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 6 * W)
    agent = make_agent(run_dir)
    res = agent.tick()
    assert not [f for f in res.findings if f.source == "inband"]
    doc = agent.document()
    (job,) = doc["inband"]["jobs"]
    assert job["job"] == JOB and job["world_size"] == 4 and job["ranks_here"] == 4
    assert [r["rank"] for r in job["ranks"]] == [0, 1, 2, 3]
    assert all(r["last_step"] == 6 * W - 1 and r["gpu"] == r["rank"] for r in job["ranks"])
    assert all(len(r["windows"]) == 5 for r in job["ranks"])  # the sixth is not complete yet
    assert job["stragglers"] == [] and job["hang"] is None and job["errors"] == []


def test_a_slow_rank_is_a_tier_3_straggler_on_its_gpu_and_never_an_action(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 2 * W)
    run_steps(rings, 4 * W, slow={2: 0.08}, start_step=2 * W, seed=2)
    agent = make_agent(run_dir)
    res = agent.tick()
    (f,) = [f for f in res.findings if f.source == "inband"]
    assert f.id == "inband.straggler:gpu2" and f.tier == 3 and f.action == "none" and f.job == JOB
    assert f.component.uuid == "GPU-00000002" and "in-band evidence only" in f.summary
    assert res.would_do == ()
    assert agent.document()["inband"]["jobs"][0]["stragglers"][0]["rank"] == 2


def test_out_of_band_evidence_on_the_same_gpu_makes_it_tier_2(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W)  # the job's first windows: each rank's own baseline
    run_steps(rings, 4 * W, slow={1: 0.10}, start_step=3 * W, seed=2)
    gpus = [gpu(i, clock_event_reasons=0x4, pcie_width=8 if i == 1 else 16, pcie_width_max=16) for i in range(4)]
    res = make_agent(run_dir, gpus).tick()
    (f,) = [f for f in res.findings if f.source == "inband"]
    assert (f.id, f.tier, f.attribution, f.action) == ("inband.straggler:gpu1", 2, "hardware", "drain")
    assert any("PCIe link x8 of x16" in e.text for e in f.evidence)
    # a throttle seen at one read is a coincidence, not evidence (tests/inband/test_corroboration.py)
    gpus = [gpu(i, clock_event_reasons=0x40 if i == 1 else 0x4) for i in range(4)]
    (f,) = [f for f in make_agent(run_dir, gpus).tick().findings if f.source == "inband"]
    assert (f.tier, f.action) == (3, "none")


def test_a_stopped_rank_is_a_hang_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 2) for r in range(2)]
    stalled_since = time.monotonic_ns() - int(30e9)
    run_steps(rings, 3 * W, end_mono=stalled_since)
    # rank 0 went into the all-reduce; rank 1 never got there (stopped while computing)
    healthd_inband.PHASE.pack_into(rings[0].mm, healthd_inband.PHASE_OFFSET, healthd_inband.PHASE_WAIT, 0,
                                   stalled_since + 10_000_000)
    agent = make_agent(run_dir)
    res = agent.tick()
    (f,) = [f for f in res.findings if f.id == f"inband.hang:{JOB}"]
    assert f.tier == 3 and f.action == "none" and "rank 1 (compute" in f.summary
    hang = agent.document()["inband"]["jobs"][0]["hang"]
    assert hang["behind"] == [1] and hang["phases"] == {"0": "wait", "1": "compute"} and hang["stalled_s"] >= 29


def test_a_replaced_ring_is_read_from_its_start(tmp_path):
    run_dir = tmp_path / "run"
    d = job_dir(run_dir)
    first = ring(d, 0, 1)
    run_steps([first], 50)
    jobs = InbandJobs(InbandSettings(detector=DETECTOR))
    (view,) = jobs.read(str(run_dir), time.monotonic_ns())
    assert view.ranks[0].progress.last_step == 49
    second = ring(d, 0, 1)  # a restarted rank: a new ring renamed over the old one
    second.restored(30)
    run_steps([second], 5, start_step=31)
    (view,) = jobs.read(str(run_dir), time.monotonic_ns())
    assert view.ranks[0].progress.last_step == 35 and view.ranks[0].restored == 30


def test_hostile_directories_and_rings_give_errors_not_findings(tmp_path):
    run_dir = tmp_path / "run"
    d = job_dir(run_dir)
    rings = [ring(d, r, 4) for r in range(3)]
    run_steps(rings, 6 * W, slow={0: 0.3})
    (d / "rank-3.ring").write_bytes(b"HDINBAND" + os.urandom(300))  # garbage in the place of rank 3
    other = tmp_path / "elsewhere"
    other.mkdir()
    (run_dir / "inband" / "999").symlink_to(other)  # a link in the place of a job directory
    (run_dir / "inband" / "..x").mkdir()  # not a job id
    os.chown(d / "rank-2.ring", 65534, 65534)  # not the job user's
    agent = make_agent(run_dir)
    res = agent.tick()
    assert not [f for f in res.findings if f.source == "inband"]  # 2 readable rings of 4: no comparison
    (job,) = agent.document()["inband"]["jobs"]
    assert job["ranks_here"] == 2 and len(job["errors"]) == 2
    assert any("owned by uid 65534" in e for e in job["errors"])


def test_an_untrusted_inband_directory_is_not_read(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 6 * W, slow={0: 0.3})
    (run_dir / "inband").chmod(0o777)  # anyone could plant a job there
    agent = make_agent(run_dir)
    agent.tick()
    assert agent.document()["inband"]["jobs"] == []


def test_disabled_reads_nothing(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 6 * W, slow={0: 0.3})
    agent = make_agent(run_dir, enabled=False)
    agent.tick()
    assert agent.document()["inband"]["jobs"] == []


def test_an_idle_ring_costs_a_header_read(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W)
    jobs = InbandJobs(InbandSettings(detector=DETECTOR))
    first = jobs.read(str(run_dir), time.monotonic_ns())
    again = jobs.read(str(run_dir), time.monotonic_ns())
    assert [r.windows for r in first[0].ranks] == [r.windows for r in again[0].ranks]
    assert all(r.progress.last_step == 3 * W - 1 for r in again[0].ranks)


def pci_tree(root: Path) -> tuple[Path, Path]:
    """Two PCIe switches under one root complex, a GPU and an HCA behind each, linked the way sysfs
    links /sys/bus/pci/devices and /sys/class/infiniband/<hca>/device into /sys/devices."""
    devices, bus, ib = root / "devices", root / "bus", root / "ib"
    layout = {"0000:18:00.0": "pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0",  # gpu0
              "0000:19:00.0": "pci0000:16/0000:16:01.0/0000:17:01.0/0000:19:00.0",  # mlx5_0, same switch
              "0000:2a:00.0": "pci0000:16/0000:16:02.0/0000:29:00.0/0000:2a:00.0",  # gpu1
              "0000:2b:00.0": "pci0000:16/0000:16:02.0/0000:29:01.0/0000:2b:00.0"}  # mlx5_1
    bus.mkdir(parents=True)
    for name, rel in layout.items():
        (devices / rel).mkdir(parents=True)
        (bus / name).symlink_to(devices / rel)
    for hca, name in (("mlx5_0", "0000:19:00.0"), ("mlx5_1", "0000:2b:00.0")):
        (ib / hca).mkdir(parents=True)
        (ib / hca / "device").symlink_to(devices / layout[name])
    return bus, ib


def test_a_gpus_rail_is_the_hca_behind_its_pcie_switch(tmp_path):
    bus, ib = pci_tree(tmp_path)
    jobs = InbandJobs(InbandSettings(pci_devices=str(bus)), ib_root=str(ib))
    assert jobs.rails_of({0: "00000000:18:00.0", 1: "00000000:2A:00.0", 2: "00000000:99:00.0"}) == \
        {0: "mlx5_0", 1: "mlx5_1"}
    # a GPU that shares only the root complex with every HCA gets no rail: no guess
    assert inband_jobs.rails({0: ("", "sys", "devices", "pci0000:16", "0000:16:03.0")},
                             {"mlx5_0": ("", "sys", "devices", "pci0000:16", "0000:16:01.0")}) == {}


def test_a_fabric_finding_on_the_rank_rail_corroborates_and_another_rail_does_not(tmp_path):
    port = Component(kind="port", device="mlx5_1", port=1)
    fabric = Finding(id="ib.symbol_errors:mlx5_1/1", component=port, source="infiniband", attribution="fabric",
                     tier=2, action="drain", summary="symbol errors 40/s", evidence=())
    agent = make_agent(tmp_path)
    agent.tick()
    snap = agent.snapshot
    assert inband_jobs.corroboration(1, snap, [fabric], "mlx5_1")[1]
    assert inband_jobs.corroboration(0, snap, [fabric], "mlx5_0") == ([], [])


def test_metrics_show_the_jobs_ranks_and_stragglers(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from healthd.agent.metrics import Metrics, TickFigures
    from healthd.settings import MetricsSettings

    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    run_steps(rings, 3 * W)  # the job's first windows: each rank's own baseline
    run_steps(rings, 4 * W, slow={3: 0.1}, start_step=3 * W, seed=2)
    agent = make_agent(run_dir)
    res = agent.tick()
    m = Metrics(MetricsSettings(), CollectorRegistry())
    m.update(TickFigures.of(agent.snapshot, res.verdict, res.findings, agent.inband_jobs))
    text = generate_latest(m.registry).decode()
    assert f'healthd_inband_ranks{{job="{JOB}"}} 4.0' in text
    assert f'healthd_inband_stragglers{{job="{JOB}"}} 1.0' in text
    assert f'healthd_inband_hung{{job="{JOB}"}} 0.0' in text


def test_a_hang_asks_each_rank_for_a_flight_recorder_dump_through_its_fifo(tmp_path):
    """A stand-in for a PyTorch rank: a real process whose environment names the FIFO stem, holding the
    FIFO `<stem><rank>.pipe` open for reading as PyTorch's NCCL process group does."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    d = job_dir(run_dir)
    stem = str(tmp_path / "fr-")
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
         f"p = {stem!r} + '0.pipe'\nos.mkfifo(p, 0o666)\nfd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)\n"
         "print('ready', flush=True)\nwhile True:\n"
         "    try:\n        b = os.read(fd, 128)\n    except BlockingIOError:\n        b = b''\n"
         "    if b:\n        print('dump', flush=True)\n        break\n    time.sleep(0.05)\n"],
        env={"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem, "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        rings = [ring(d, r, 2) for r in range(2)]
        run_steps(rings, 3 * W, end_mono=time.monotonic_ns() - int(30e9))
        # the rings say rank 0 is the child; rank 1 names a pid that is not the job user's (pid 1)
        struct.pack_into("<i", rings[0].mm, 20, child.pid)
        struct.pack_into("<i", rings[1].mm, 20, 1)
        os.chown(d, 0, 0)  # the job's user is root here, like the child
        agent = make_agent(run_dir)
        agent.dry_run = False
        agent.collect_periodic()
        assert child.wait(timeout=10) == 0 and child.stdout.read().strip() == "dump"
        notes = agent._dumps[JOB]
        assert any("rank 0: flight recorder dump requested" in n for n in notes)
        res = agent.classify(kernel())
        (f,) = [f for f in res.findings if f.id == f"inband.hang:{JOB}"]
        assert any("dump requested" in e.text for e in f.evidence)
        agent.collect_periodic()  # once per hang, not every tick
        assert agent._dumps[JOB] == notes
    finally:
        child.kill()
        child.wait()


def test_a_dry_run_asks_for_no_dump(tmp_path):
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 2) for r in range(2)]
    run_steps(rings, 3 * W, end_mono=time.monotonic_ns() - int(30e9))
    agent = make_agent(run_dir)
    agent.collect_periodic()
    assert agent._dumps == {} and agent.inband_jobs[0].hang is not None


# --------------------------------------------------------------------------- the rank's GPU


def set_header_pid(rg, pid: int) -> None:
    # the layout: magic (8 bytes), four u16, the u32 capacity, then the pid (i32) at offset 20
    struct.pack_into("<i", rg.mm, 20, pid)


def test_nvml_process_lists_place_each_rank_on_its_gpu(tmp_path):
    """The header's GPU is the rank's CUDA_VISIBLE_DEVICES entry, a guess; NVML's compute process list
    is where the process really runs. A stray context on a second GPU keeps the header's GPU when it
    is one of them; a rank on no list keeps the header's, marked as such."""
    run_dir = tmp_path / "run"
    rings = [ring(job_dir(run_dir), r, 4) for r in range(4)]
    for r, rg in enumerate(rings):
        set_header_pid(rg, 7001 + r)
    run_steps(rings, 3 * W)  # the job's first windows: each rank's own baseline
    run_steps(rings, 4 * W, slow={2: 0.10}, start_step=3 * W, seed=2)
    pids = {0: (7001,), 1: (7003,), 2: (7002,), 3: (7001,)}  # rank 0 also on GPU 3; rank 3 nowhere
    gpus = [gpu(i, compute_pids=pids[i]) for i in range(4)]
    agent = make_agent(run_dir, gpus)
    res = agent.tick()
    ranks = {r["rank"]: (r["gpu"], r["gpu_from"]) for r in agent.document()["inband"]["jobs"][0]["ranks"]}
    assert ranks == {0: (0, "nvml"), 1: (2, "nvml"), 2: (1, "nvml"), 3: (3, "header")}
    (f,) = [f for f in res.findings if f.source == "inband"]
    assert f.id == "inband.straggler:gpu1" and f.component.uuid == "GPU-00000001"
    assert "rank 2 (gpu 1 by NVML's process list)" in f.evidence[0].text
    assert f.evidence[0].data["gpu_from"] == "nvml"
    table = render_text(agent.document())
    assert " 3? " in table, table


def test_a_containers_pid_is_found_through_nspid(tmp_path):
    proc = tmp_path / "proc"
    for host, inner in ((500, 12), (600, 12), (700, 31), (800, None)):
        (proc / str(host)).mkdir(parents=True)
        ns = f"NSpid:\t{host}\t{inner}\n" if inner else f"NSpid:\t{host}\n"
        (proc / str(host) / "status").write_text(f"Name:\tpython\nPid:\t{host}\n{ns}")
    (proc / "900").mkdir()
    (proc / "900" / "status").write_text("NSpid:\tnine hundred\n")
    got = inband_jobs.pid_gpus({0: [500], 1: [600], 2: [700, 900], 3: [800, 4000]}, str(proc))
    assert got[700] == got[31] == frozenset({2})  # the container's own PID 31 is GPU 2's
    assert 12 not in got  # two containers' PID 12: ambiguous, left out
    assert got[500] == frozenset({0}) and got[800] == got[4000] == frozenset({3}) and got[900] == frozenset({2})
    assert inband_jobs.rank_gpu(5, frozenset()) == (5, "header")
    assert inband_jobs.rank_gpu(-1, frozenset()) == (-1, "unknown")
    assert inband_jobs.rank_gpu(-1, frozenset({0, 4})) == (-1, "unknown")
    assert inband_jobs.rank_gpu(4, frozenset({0, 4})) == (4, "nvml")
