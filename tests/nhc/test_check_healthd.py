"""slurm/nhc/healthd.nhc called the way NHC (LBNL Node Health Check) calls a check: the file is sourced by
bash next to minimal `die`, `log` and `dbg` functions with NHC's contract (a check returns 0 when the node
is fine; otherwise it calls `die 1 "message"` and returns 1), then `check_healthd [options]` runs.

NHC itself is not packaged for Debian, so the harness stands in for its driver. The check runs the real
`healthd state` against the state files of a real `healthd run` agent (tests/support/agent_node.py: the
C stand-in NVML, an InfiniBand tree, a journal): healthy, degraded, failed, stale (agent stopped with
SIGSTOP), gone (agent exited) and missing (never ran)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.agent_node import HEALTHD, Node
from tests.support.fake_nvml import write_nvml_config
from tests.support.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
NHC_FILE = REPO / "slurm" / "nhc" / "healthd.nhc"

# What NHC gives a check: die RC MESSAGE (marks the node failed with MESSAGE), log and dbg (log file lines).
# NHC's own die() ends the whole run with RC unless every check is to run (`nhc -a`, NHC_CHECK_ALL=1):
# then it returns and the check returns 1 itself. HARNESS_DIE_EXITS=1 makes the harness's die do the former.
HARNESS = r"""
set -u
die() { echo "DIE $1 $2"; [[ "${HARNESS_DIE_EXITS:-0}" == 1 ]] && exit "$1"; return 0; }
log() { echo "LOG $*"; }
dbg() { echo "DBG $*"; }
. "$NHC_FILE" || { echo "SOURCE FAILED"; exit 99; }
check_healthd "$@"
echo "RC $?"
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="healthd reads only a root-owned state file (as on a node)")


@pytest.fixture
def node(tmp_path, fake_nvml_dir):
    n = Node(tmp_path, fake_nvml_dir)
    n.write_config(hooks={"stale_after_s": 3})
    yield n
    n.close()


def check(node: Node, *args: str, env: dict[str, str] | None = None) -> tuple[int, list[str], list[str], str]:
    """Run check_healthd as NHC would: (its return code, die messages, log lines, whole output)."""
    base = {"PATH": "/usr/bin:/bin", "NHC_FILE": str(NHC_FILE), "HEALTHD_NHC_BIN": HEALTHD,
            "HEALTHD_NHC_CONFIG": str(node.config)}
    p = subprocess.run(["bash", "-c", HARNESS, "nhc-harness", *args], capture_output=True, text=True,
                       env={**base, **(env or {})}, timeout=60)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and lines and lines[-1].startswith("RC "), p.stdout + p.stderr
    dies = [line[len("DIE "):] for line in lines if line.startswith("DIE ")]
    logs = [line[len("LOG "):] for line in lines if line.startswith("LOG ")]
    return int(lines[-1].split()[1]), dies, logs, p.stdout


def test_the_file_defines_check_healthd_only_and_sources_cleanly():
    p = subprocess.run(["bash", "-c", '. "$0" && declare -F', str(NHC_FILE)], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.split() == ["declare", "-f", "check_healthd"]


def test_missing_state_passes_with_a_log_line_and_fails_with_u(node):
    rc, dies, logs, out = check(node)
    assert rc == 0 and dies == [], out
    assert len(logs) == 1 and logs[0].startswith("check_healthd: cannot tell, not failing the check: agent unknown: state file")
    rc, dies, _, out = check(node, "-u")
    assert rc == 1 and len(dies) == 1, out
    assert dies[0].startswith(f"1 check_healthd: agent unknown: state file {node.state_file} is missing"), dies


def test_not_installed_is_unknown(node):
    rc, dies, logs, out = check(node, "-b", "/nonexistent/healthd")
    assert rc == 0 and dies == [] and logs == ["check_healthd: cannot tell, not failing the check: "
                                               "healthd unknown: /nonexistent/healthd is not installed"], out
    rc, dies, _, out = check(node, "-u", "-b", "/nonexistent/healthd")
    assert rc == 1 and dies == ["1 check_healthd: healthd unknown: /nonexistent/healthd is not installed"], out


def test_bad_option_dies(node):
    rc, dies, _, out = check(node, "-x")
    assert rc == 1 and len(dies) == 1 and "unknown option -x" in dies[0], out


def test_running_agent_healthy_degraded_failed_stale_and_gone(node):
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=node.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(node.state, lambda d: d["verdict"] == "healthy" and d["agent"]["pid"] == proc.pid)
        # the config named through -c instead of $HEALTHD_NHC_CONFIG
        rc, dies, logs, out = check(node, "-c", str(node.config), env={"HEALTHD_NHC_CONFIG": "/nonexistent.yaml"})
        assert (rc, dies, logs) == (0, [], []), out
        assert "DBG check_healthd: node01: healthy, no findings" in out

        node.gpus[5]["remapped_rows.pending"] = 1
        write_nvml_config(node.nvml_values, node.gpus)
        wait_for(node.state, lambda d: d["verdict"] == "degraded")
        rc, dies, logs, out = check(node)
        assert rc == 0 and dies == [], out
        assert logs == ["check_healthd: degraded, not failing the check: node01: 1 T2 finding: "
                        "gpu5: row remapping pending (reset the GPU to apply)"], out
        rc, dies, _, out = check(node, "-d")
        assert rc == 1 and dies == ["1 check_healthd: node01: 1 T2 finding: gpu5: row remapping pending "
                                    "(reset the GPU to apply)"], out

        bus = node.gpus[2]["bus_id"][4:].lower().rsplit(".", 1)[0]
        node.xid(bus, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        wait_for(node.state, lambda d: d["verdict"] == "failed")
        rc, dies, _, out = check(node)
        assert rc == 1 and dies == ["1 check_healthd: node01: 1 T1 finding: xid 79 gpu2: fell off the bus"], out
        # as in a default NHC run, where die() ends the run with its code
        p = subprocess.run(["bash", "-c", HARNESS, "nhc-harness"], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "NHC_FILE": str(NHC_FILE), "HEALTHD_NHC_BIN": HEALTHD,
                                "HEALTHD_NHC_CONFIG": str(node.config), "HARNESS_DIE_EXITS": "1"})
        assert p.returncode == 1 and p.stdout.splitlines()[-1] == (
            "DIE 1 check_healthd: node01: 1 T1 finding: xid 79 gpu2: fell off the bus"), p.stdout

        # a stuck agent: alive, but its state older than hooks.stale_after_s (3 s)
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: check(node, "-u"), lambda r: r[0] == 1 and "old (hooks.stale_after_s 3)" in r[1][0],
                     timeout=15)
            rc, dies, logs, out = check(node)
            assert rc == 0 and dies == [] and "the agent is stopped or stuck" in logs[0], out
        finally:
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    # the agent exited; its last (failed) document is no verdict any more
    rc, dies, logs, out = check(node)
    assert rc == 0 and dies == [] and logs == [
        f"check_healthd: cannot tell, not failing the check: agent unknown: agent pid {proc.pid} is not running"], out
    rc, dies, _, out = check(node, "-u")
    assert rc == 1 and dies == [f"1 check_healthd: agent unknown: agent pid {proc.pid} is not running"], out
