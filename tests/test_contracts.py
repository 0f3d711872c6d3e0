"""The contracts between processes, each defined once and used by both ends: here every writer's real
output goes through its real reader, and the test names fields, kinds and paths only through the
shared definitions, so a contract changed at its home is changed at both ends or fails here.

- the goodput event log (healthd.goodput_events): the agent (rank 0's ring) and the epilog write a
  node's log, the controller ships and gathers it and adds its own records; healthd.goodput reads all;
- the in-band ring file (healthd_inband.py, the job's client, read through healthd.inband_layout): the
  client writes it, the agent's reader (healthd.agent.inband) parses it;
- the in-band directory (healthd.inband_layout): the prolog makes it, the TaskProlog exports it in the
  variable the client reads, the agent reads the rings in it, the epilog moves it away;
- the agent's state document (healthd.statedoc): the agent writes it, the hooks and the agent's own
  readers read its fields through statedoc's names and accessors.
"""

from __future__ import annotations

import json
import re
import os
import struct
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import healthd_inband
from healthd import goodput, statedoc
from healthd import goodput_events as ev
from healthd import inband_layout as layout
from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.goodput_log import GoodputLog
from healthd.agent.history import History
from healthd.agent.inband import RingView, read_ring
from healthd.agent.inband_jobs import InbandJobs
from healthd.controller import goodput_gather
from healthd.hooks import epilog, inband_dirs, prolog, taskprolog
from healthd.persist import write_json_atomic
from healthd.settings import InbandSettings
from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings, xid
from tests.support.fake_sources import FakeCollector

ROOT = Path(__file__).resolve().parents[1]

JOB = "4242"


class Quiet:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = error = info


def ring_env(rank: int = 0, world: int = 2, job: str = JOB) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "SLURM_JOB_ID": job,
            "CUDA_VISIBLE_DEVICES": "0,1", "HEALTHD_INBAND_CAPACITY": "256"}


# --------------------------------------------------------------------------- the goodput event log


def every_event() -> list[dict]:
    """One entry of each healthd event kind, carrying every field the format gives it."""
    return [ev.event(kind, 100.0 + i, **{f: f"{f}-value" for f in fields})
            for i, (kind, (_, fields)) in enumerate(sorted(ev.EVENTS.items()))]


def test_every_healthd_event_round_trips_through_the_reader():
    text = "".join(ev.log_line(JOB, **e) + "\n" for e in every_event())
    log = goodput.parse_log(text, JOB)
    assert log.problems == () and log.job == JOB
    assert [(e.kind, set(e.data)) for e in log.events] == [(k, set(f)) for k, (_, f) in sorted(ev.EVENTS.items())]
    with pytest.raises(ValueError):
        ev.event("no_such_kind", 1.0)
    with pytest.raises(ValueError):
        ev.event(sorted(ev.NODE_EVENTS)[0], 1.0, no_such_field=1)


def test_the_node_writes_what_the_controller_takes_and_the_reader_accounts(tmp_path: Path):
    run_dir, state_dir = tmp_path / "inband", tmp_path / "state"
    run_dir.mkdir()
    ring = healthd_inband._Ring(str(run_dir), ring_env())
    ring.restored(0)
    for n in range(1, 5):
        ring.step(n)
    with ring.checkpoint(4):
        pass
    ring.checkpoint_durable(4)
    view = read_ring(str(run_dir), os.path.basename(ring.path))
    assert isinstance(view, RingView), view
    agent_log = GoodputLog(str(state_dir), window_steps=4)
    agent_log.take(JOB, view.header, view.records)
    agent_log.flush()
    ctx = types.SimpleNamespace(settings=types.SimpleNamespace(state_dir=str(state_dir)), log=Quiet(),
                                env={"SLURM_JOB_EXIT_CODE2": "0:0"})
    epilog.end_goodput_run(ctx, JOB, view.header.start_wall_ns / 1e9 + 60)
    path = state_dir / ev.LOG_DIR / (JOB + ev.LOG_SUFFIX)
    data = path.read_text()
    kinds = [json.loads(line).get(ev.EVENT) for line in data.splitlines()]
    assert {k for k in kinds if k} == ev.NODE_EVENTS  # allocation, restored, durable from the agent; run_end
    shipped = goodput_gather.parse_shipment(ev.shipment(JOB, 0, data))
    log = goodput.parse_log(shipped.data, JOB)
    assert log.problems == ()
    acc = goodput.account(log)
    assert acc.runs == 1 and acc.problems == () and acc.held_gpu_s == pytest.approx(60 * 2, rel=0.01)
    assert acc.gpu_s["checkpoint"] > 0 and acc.gpu_s["productive"] > 0


def test_the_controllers_records_are_read_and_never_taken_from_a_node():
    written: list[str] = []
    episodes = goodput_gather.StragglerEpisodes(lambda job, lines: written.extend(lines))
    episodes.observe(10.0, [(JOB, 3, "node02", 3, 0.08)])
    episodes.observe(40.0, [(JOB, 3, "node02", 3, 0.1)])
    episodes.observe(70.0, [])
    windows = goodput_gather.WindowRecords(lambda job, lines: written.extend(lines))
    windows.observe(80.0, {JOB: [goodput_gather.RankWindows(r, "node01", r, "mlx5_0", ((0, 0.1 + r / 100),))
                                 for r in range(2)]}, {JOB: 2})
    kinds = {json.loads(line)[ev.EVENT] for line in written}
    assert kinds == {k for k, (writer, _) in ev.EVENTS.items() if writer == ev.CONTROLLER}
    log = goodput.parse_log("".join(f"{x}\n" for x in written), JOB)
    assert log.problems == () and {e.kind for e in log.events} == kinds
    for line in written:
        with pytest.raises(goodput_gather.ShipmentRefused, match="not from a node"):
            goodput_gather.parse_shipment(ev.shipment(JOB, 0, line + "\n"))


# --------------------------------------------------------------------------- the in-band ring file


def job(script: str, **env: str) -> subprocess.CompletedProcess:
    """`script` in a child whose environment has none of the job's variables but `env`."""
    clean = {k: v for k, v in os.environ.items()
             if k not in (layout.ENV_DIR, "RANK", "SLURM_PROCID", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def test_the_reader_takes_the_layout_from_the_client_file():
    assert Path(layout.client.__file__).resolve() == Path(healthd_inband.__file__).resolve()
    for name in ("ENV_DIR", "MAGIC", "VERSION", "HEADER", "RECORD", "MAX_CAPACITY", "KINDS", "PHASES", "FLAG_ERROR",
                 "RING_PREFIX", "RING_SUFFIX"):
        mine, theirs = getattr(layout, name), getattr(healthd_inband, name)
        if isinstance(theirs, struct.Struct):
            mine, theirs = mine.format, theirs.format
        assert mine == theirs, name
    assert layout.client is not sys.modules.get("healthd_inband")  # loaded apart: the client's own import is untouched


def test_every_record_the_client_writes_is_read_back_field_for_field(tmp_path: Path):
    ring = healthd_inband._Ring(str(tmp_path), ring_env(rank=1, world=2))
    ring.step(7)
    with ring.wait():
        pass
    with ring.checkpoint(7):
        pass
    ring.checkpoint_durable(7)
    ring.restored(7)
    try:
        with ring.wait():
            raise KeyError
    except KeyError:
        pass
    name = layout.ring_name(1)
    assert os.path.basename(ring.path) == name and layout.ring_rank(name) == 1
    view = read_ring(str(tmp_path), name, owner=os.getuid())
    assert isinstance(view, RingView), view
    h = view.header
    assert (h.version, h.capacity, h.pid, h.rank, h.local_rank, h.world_size, h.device, h.job) == \
        (layout.VERSION, 256, os.getpid(), 1, 1, 2, 1, JOB)
    assert (h.start_wall_ns, h.start_mono_ns, h.phase) == (ring.start_wall_ns, ring.start_mono_ns, layout.PHASES[1])
    assert [(r.seq, r.kind_name) for r in view.records] == list(enumerate(
        ["step", "wait", "checkpoint_begin", "checkpoint_end", "durable", "restored", "wait"], 1))
    assert [r.kind for r in view.records] == [layout.STEP, layout.WAIT, layout.CKPT_BEGIN, layout.CKPT_END,
                                              layout.DURABLE, layout.RESTORED, layout.WAIT]
    assert [r.step for r in view.records][:6] == [7] * 6
    assert [r.flags for r in view.records] == [0] * 6 + [layout.FLAG_ERROR]
    assert view.last_seq == h.head == 7 and view.lost == view.torn == 0
    raw = (tmp_path / name).read_bytes()
    assert layout.HEADER.unpack_from(raw)[0] == layout.MAGIC
    assert len(raw) == layout.HEADER.size + 256 * layout.RECORD.size
    assert layout.RECORD.unpack_from(raw, layout.HEADER.size)[0] == layout.RECORD.unpack_from(raw, layout.HEADER.size)[-1] == 1
    assert read_ring(str(tmp_path), layout.ring_name(-1)).reason.endswith("No such file or directory")


def test_healthd_loads_the_layout_without_setting_a_ring_up(tmp_path: Path):
    """A healthd process where the job's variable is set (`srun healthd --dry-run`, a TaskProlog of a
    job step) reads the client's definitions and writes no ring; the client imported as itself still
    sets one up."""
    p = job("""
        import os, sys
        import healthd.agent.inband, healthd.hooks.taskprolog, healthd.inband_layout as layout
        assert not os.listdir(os.environ[layout.ENV_DIR]) and not layout.client.enabled
        assert "healthd_inband" not in sys.modules
        import healthd_inband
        print(healthd_inband.enabled, sorted(os.listdir(os.environ[layout.ENV_DIR])))
    """, **{layout.ENV_DIR: str(tmp_path), "RANK": "0"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", f"['{layout.ring_name(0)}']"]


# --------------------------------------------------------------------------- the in-band directory


def test_the_directory_the_prolog_makes_is_the_one_the_taskprolog_exports_and_the_agent_reads(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    me = os.getuid()
    inband_dirs.create(str(run_dir), JOB, me, trusted_uid=me)
    config = tmp_path / "healthd.yaml"
    config.write_text(f"hooks:\n  run_dir: {run_dir}\n")
    line = taskprolog.run(["--config", str(config)], {"SLURM_JOB_ID": JOB})
    name, _, value = line.removeprefix("export ").rstrip("\n").partition("=")
    assert (name, value) == (layout.ENV_DIR, layout.job_dir(str(run_dir), JOB))
    p = job("import healthd_inband as hd; hd.step(1); hd.step(2)", **{name: value}, RANK="0", WORLD_SIZE="1",
            SLURM_JOB_ID=JOB)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert os.listdir(value) == [layout.ring_name(0)]
    agent = InbandJobs(InbandSettings(), trusted_uid=me)
    (view,) = agent.read(str(run_dir), 0)
    assert view.job == JOB and [r.rank for r in view.ranks] == [0] and view.errors == ()
    inband_dirs.archive(str(run_dir), JOB, keep=4, trusted_uid=me)
    assert os.listdir(layout.done_dir(str(run_dir), JOB)) == [layout.ring_name(0)]
    assert agent.read(str(run_dir), 0) == ()  # an ended job's directory is not read
    for bad in ("done", "1a", "1" * (layout.MAX_JOB_ID + 1)):
        assert not layout.valid_job(bad)
        with pytest.raises(ValueError):
            layout.job_dir(str(run_dir), bad)


# --------------------------------------------------------------------------- the agent's state document


def test_the_agents_state_document_is_read_through_the_shared_names(tmp_path: Path):
    agent = Agent(settings(nvml={"expected_gpus": 4}),
                  CATALOG, Sources(nvml=FakeCollector("nvml", nvml(*(gpu(i) for i in range(4)))),
                                   kernel=FakeCollector("kernel_log", kernel(xid(79, 1, NOW - 5), xid(13, 2, NOW - 5)))),
                  Memory(history=History()), dry_run=True, clock=lambda: NOW)
    res = agent.tick()
    path = tmp_path / "state" / "state.json"
    path.parent.mkdir(mode=0o755)
    write_json_atomic(str(path), agent.document())
    doc, error = statedoc.load_state(str(path), trusted_uid=os.getuid())
    assert error == "" and doc is not None
    assert set(statedoc.DOCUMENT_FIELDS) <= set(doc) and statedoc.AGENT_PID in doc[statedoc.AGENT]
    judged = statedoc.judge(doc, NOW, agent.settings, pid_alive=lambda pid: pid == os.getpid())
    assert judged.known, judged.reason
    assert statedoc.generated_at(doc) == NOW and statedoc.agent_pid(doc) == os.getpid()
    assert doc[statedoc.VERDICT] == res.verdict and doc[statedoc.NODE] == agent.settings.node_name
    assert len(judged.findings) == len(res.findings) >= 2
    for f, written in zip(judged.findings, res.findings, strict=True):
        assert set(statedoc.FINDING_FIELDS) <= set(f)
        assert (statedoc.f_id(f), statedoc.f_tier(f), statedoc.f_action(f), f[statedoc.ATTRIBUTION]) == \
            (written.id, written.tier, written.action, written.attribution)
        assert statedoc.summary(f, 10_000) == written.summary
        assert statedoc.f_gpu(f) == (written.component.index if written.component.kind == "gpu" else None)
        assert statedoc.component_label(f[statedoc.COMPONENT]).startswith(written.component.kind[:2])
    assert statedoc.finding_ids(doc) == {f.id for f in res.findings}
    t1 = [f for f in res.findings if f.tier == 1 and f.attribution == "hardware"]
    assert [statedoc.f_id(f) for f in judged.findings if statedoc.is_t1_hardware(f)] == [f.id for f in t1]
    assert prolog.gate(judged, [t1[0].component.index]).refuse  # the prolog's decision, on the written document
    assert not prolog.gate(judged, [0]).refuse


# --------------------------------------------------------------------------- the docs say the same


def test_the_docs_list_the_goodput_events_and_who_may_ship_them():
    text = (ROOT / "docs" / "goodput.md").read_text()
    table = text.split("\n## The event log\n", 1)[1].split("\n## ", 1)[0]
    kinds = set()
    for row in (line for line in table.splitlines() if f'"{ev.EVENT}":' in line):
        named = re.search(rf'"{ev.EVENT}": ("[a-z_]+"(?: / "[a-z_]+")*)', row).group(1)
        kinds |= set(re.findall(r'"([a-z_]+)"', named))
    assert kinds == set(ev.EVENTS)
    shipping = text.split("\nA node may only send what its agent and epilog write", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", shipping))
    assert ev.NODE_EVENTS <= named and set(ev.EVENTS) <= named


def test_the_docs_give_the_rings_record_kinds_phases_and_sizes():
    text = (ROOT / "docs" / "inband.md").read_text()
    layout_doc = text.split("\n## The ring layout\n", 1)[1].split("\n## ", 1)[0]
    kinds = re.search(r"\| kind: ([^|]+) \|", layout_doc).group(1)
    assert kinds.strip() == ", ".join(f"{k} {name}" for k, name in sorted(layout.KINDS.items()))
    phases = re.search(r"\| phase: ([^|]+) \|", layout_doc).group(1)
    assert re.findall(r"(?:^|, )(\d) ([a-z]+)", phases.split(";")[0]) == \
        [(str(k), name) for k, name in sorted(layout.PHASES.items())]
    assert f"**Header** ({layout.HEADER.size} bytes" in layout_doc
    assert f"**Records** ({layout.RECORD.size} bytes each" in layout_doc
    assert f"magic `{layout.MAGIC.decode()}`" in layout_doc and f"Version {layout.VERSION}." in layout_doc
