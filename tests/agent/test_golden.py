"""The golden agent document: one fixed node (a sysfs fixture tree, the NVML stand-in and a kernel
journal) through the installed `healthd --dry-run --once --format json`, compared field by field with
tests/fixtures/golden/agent_state.json. Every change to what the agent publishes shows here as a diff
a reviewer reads, the way node_exporter keeps its e2e output.

    HEALTHD_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/agent/test_golden.py   # rewrite it

What differs from run to run (the process id, wall-clock times of this run, durations, the fixture's
temporary directory, the machine's boot id, the journal file's random seqnum id and its entries' times in the cursors) is replaced by a placeholder first. The
Xid line is logged a minute before the run (the agent looks back a bounded window), so its times are
this run's too; a time more than an hour away is kept as it is.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from healthd.persist import read_boot_id
from tests.support.agent_node import Node
from tests.support.fake_nvml import write_nvml_config
from tests.support.ib_tree import set_state

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "agent_state.json"
_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?\+00:00")
_SEQNUM = re.compile(r"\bs=[0-9a-f]{32}")
_CURSOR_TIME = re.compile(r";t=[0-9a-f]+")
VOLATILE_KEYS = {"pid": "<pid>", "seconds": "<seconds>"}


def normalize(value: Any, root: str, now: float) -> Any:
    """The document with this run's own values replaced by placeholders."""
    if isinstance(value, dict):
        return {k: VOLATILE_KEYS[k] if k in VOLATILE_KEYS else normalize(v, root, now) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, root, now) for v in value]
    if isinstance(value, str):
        def stamp(m: re.Match[str]) -> str:
            at = datetime.fromisoformat(m.group(0)).timestamp()
            return "<now>" if abs(at - now) < 3600 else m.group(0)

        text = _ISO.sub(stamp, value.replace(root, "<root>"))
        return _CURSOR_TIME.sub(";t=<usec>", _SEQNUM.sub("s=<seqnum>", text))
    return value


@pytest.fixture
def faulty_node(tmp_path, fake_nvml_dir) -> Node:
    """Xid 79 on GPU 3, a pending row remap on GPU 5, InfiniBand port mlx5_2/1 down."""
    node = Node(tmp_path, fake_nvml_dir)
    node.gpus[5]["remapped_rows.pending"] = 1
    write_nvml_config(node.nvml_values, node.gpus)
    set_state(node.ib, "mlx5_2", 1, state="1: DOWN", phys_state="3: Disabled")
    bus = node.gpus[3]["bus_id"][4:].lower().rsplit(".", 1)[0]
    node.xid(bus, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", now=time.time() - 60)
    yield node
    node.close()


def test_the_agent_document_matches_the_golden_one(faulty_node):
    rc, doc, err = faulty_node.dry_run()
    assert rc == 2, err
    # the machine's own boot id (a container's is its own too): the agent's must be the one the kernel
    # gives here, and the golden file holds a placeholder, not the id of the machine that wrote it
    assert doc["agent"]["boot_id"] == read_boot_id() is not None, doc["agent"]
    doc["agent"]["boot_id"] = "<boot_id>"
    got = normalize(doc, str(faulty_node.root), time.time())
    if os.environ.get("HEALTHD_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got == want, "the agent's document changed: read the diff, then rewrite the golden file with " \
                        "HEALTHD_UPDATE_GOLDEN=1 if the change is meant"


def test_normalize_keeps_fixture_times_and_replaces_this_runs_own():
    now = 1_800_000_000.0
    doc = {"pid": 12, "generated_at": "2027-01-15T08:00:00.000+00:00", "at": "2023-11-14T22:13:20.000+00:00",
           "detail": "journal: /tmp/x/journal", "cursor": "s=" + "ab" * 16 + ";i=1;t=5f3a", "seconds": 0.1}
    assert normalize(doc, "/tmp/x", now) == {
        "pid": "<pid>", "generated_at": "<now>", "at": "2023-11-14T22:13:20.000+00:00",
        "detail": "journal: <root>/journal", "cursor": "s=<seqnum>;i=1;t=<usec>", "seconds": "<seconds>"}
