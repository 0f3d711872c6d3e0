"""The agent's side: job bindings set Finding.job, failed quick checks become findings merged into
the classification before publishing; bad files are skipped with one log line; dry-run writes
nothing. And the hooks' hard deadline, in a real child process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.checks import merged_doc, result
from healthd.text import iso
from healthd.settings import HookSettings
from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings, xid
from tests.support.fake_sources import FakeCollector

ROOT = Path(__file__).resolve().parents[2]


def make_agent(run_dir: Path, *events) -> Agent:
    cfg = settings(nvml={"expected_gpus": 4}, hooks=HookSettings(run_dir=str(run_dir)))
    sources = Sources(nvml=FakeCollector("nvml", nvml(*(gpu(i) for i in range(4)))),
                      kernel=FakeCollector("kernel_log", kernel(*events)))
    return Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=True, clock=lambda: NOW)


def write(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))


def bind(run_dir: Path, job: str, gpus, start: float, end: float | None = None) -> None:
    doc = {"job": job, "user": "alice", "uid": 1000, "node": "gpu001", "gpus": gpus, "start": iso(start)}
    if end is not None:
        doc["end"] = iso(end)
    write(run_dir / ("jobs/done" if end else "jobs") / f"{job}.json", doc)


def test_bindings_set_the_job_and_failed_checks_fail_the_node(tmp_path, caplog):
    run_dir = tmp_path / "run"
    bind(run_dir, "41", [0, 1], NOW - 60)
    bind(run_dir, "39", [3], NOW - 900, NOW - 100)        # closed: its epilog already ran
    bind(run_dir, "40", [2], NOW - 60)
    write(run_dir / "jobs/40.json", {"job": "40", "node": "gpu002", "gpus": [2], "start": iso(NOW - 60)})  # another node
    write(run_dir / "checks.json", merged_doc(None, "gpu001", NOW - 5, [
        result("gpu_count", False, "3 of 4 GPU device files present", NOW - 5, "healthd-healthcheck")]))
    before = sorted(str(p) for p in run_dir.rglob("*"))
    agent = make_agent(run_dir, xid(13, 0, NOW - 5), xid(13, 3, NOW - 200), xid(13, 2, NOW - 5))
    res = agent.tick()
    jobs = {f.id: f.job for f in res.findings}
    assert jobs["xid:gpu0:13"] == "41" and jobs["xid:gpu3:13"] == "39" and jobs["xid:gpu2:13"] is None
    assert jobs["hooks.gpu_count:node"] is None
    assert res.verdict == "failed" and res.would_do[0]["action"] == "drain"
    assert res.would_do[0]["finding"] == "hooks.gpu_count:node"
    doc = agent.document()
    assert {f["id"]: f["job"] for f in doc["findings"]}["xid:gpu0:13"] == "41" and doc["verdict"] == "failed"
    assert sorted(str(p) for p in run_dir.rglob("*")) == before  # the agent only reads


def test_bad_files_are_skipped_with_one_log_line_each(tmp_path, caplog):
    run_dir = tmp_path / "run"
    bind(run_dir, "41", [0], NOW - 60)
    write(run_dir / "jobs/42.json", '{"job": "42", "gpus": [')
    write(run_dir / "jobs/43.json", json.dumps({"job": "43", "node": "gpu001", "gpus": [1], "start": iso(NOW - 60),
                                                "pad": "x" * 70_000}))
    write(run_dir / "jobs/notes.txt", "ignored: not a binding name")
    write(run_dir / "checks.json", "{not json")
    agent = make_agent(run_dir, xid(13, 0, NOW - 5), xid(13, 1, NOW - 5))
    with caplog.at_level(logging.WARNING, logger="healthd"):
        agent.tick()
        agent.sources.kernel.sample = kernel(xid(13, 1, NOW - 4))
        res = agent.tick()
    msgs = [r.getMessage() for r in caplog.records if r.name == "healthd"]
    assert sum("jobs/42.json is unusable" in m for m in msgs) == 1
    assert sum("jobs/43.json is" in m and "limit 65536" in m for m in msgs) == 1
    assert sum("checks.json unreadable" in m for m in msgs) == 1
    assert {f.id: f.job for f in res.findings}["xid:gpu0:13"] == "41"
    assert {f.id: f.job for f in res.findings}["xid:gpu1:13"] is None


def test_checks_are_reread_when_the_file_changes(tmp_path):
    run_dir = tmp_path / "run"
    path = run_dir / "checks.json"
    write(path, merged_doc(None, "gpu001", NOW, [result("gpu_count", False, "3 of 4", NOW, "hc")]))
    agent = make_agent(run_dir)
    assert agent.tick().verdict == "failed"
    write(path, merged_doc(None, "gpu001", NOW, [result("gpu_count", True, "4 of 4", NOW, "hc")]))
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert agent.tick().verdict == "healthy"
    path.unlink()
    assert agent.tick().verdict == "healthy"


# --------------------------------------------------------------------------- the hard deadline

CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from healthd.hooks.common import run_hook

def body(ctx):
    if {block!r}:
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})  # a thread no signal reaches
    time.sleep(30)
    return 1

sys.exit(run_hook("healthd-prolog", [], 7, body))
"""


@pytest.mark.parametrize("block, said", [(False, "timed out after 0.5s (hooks.timeout_s); exiting 7"),
                                         (True, "hard timeout: still running 1s after the 0.5s deadline; exiting 7")])
def test_the_deadline_ends_a_stuck_hook_with_its_safe_code(tmp_path, block, said):
    cfg = tmp_path / "healthd.yaml"
    cfg.write_text(f"node_name: node01\nstate_file: {tmp_path}/state.json\nhooks: {{timeout_s: 0.5}}\n")
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD.format(root=str(ROOT), block=block))],
                       env={"SLURMD_NODENAME": "node01", "HEALTHD_CONFIG": str(cfg)},
                       capture_output=True, text=True, timeout=20)
    wall = time.monotonic() - start
    assert p.returncode == 7, p.stderr
    assert said in p.stderr
    assert wall < 0.5 + 1.0 + 2.0
