"""The contracts between processes, each defined once and used by both ends: here every writer's real
output goes through its real reader, and the test names fields, kinds and paths only through the
shared definitions, so a contract changed at its home is changed at both ends or fails here.

- the goodput event log (healthd.goodput_events): the agent (rank 0's ring) and the epilog write a
  node's log, the controller ships and gathers it and adds its own records; healthd.goodput reads all;
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from healthd import goodput
from healthd import goodput_events as ev
from healthd.agent.goodput_log import GoodputLog
from healthd.agent.inband import read_ring
from healthd.controller import goodput_gather
from healthd.hooks import epilog

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
    import healthd_inband

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
    assert not isinstance(view, Exception) and hasattr(view, "records"), view
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
