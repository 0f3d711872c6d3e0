"""End to end: the installed `healthd` executable as a subprocess against the C stand-in for
libnvidia-ml (loaded by pynvml's real ctypes path through LD_LIBRARY_PATH), a sysfs fixture tree and
real journal files. Nothing in healthd is patched."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from healthd.report_schema import validate_report
from tests.agent.collectors.nvme.tree import controller, nvme_cli_2, smart_file
from tests.support.agent_node import HEALTHD, Node
from tests.support.fake_nvml import write_nvml_config
from tests.support.ib_tree import set_state
from tests.support.polling import read_text, scrape, wait_for


def xid_count(state: dict, xid: int) -> int:
    return sum(f["count"] for f in state["findings"] if f.get("xid") == xid)


def ticks_later(node: Node, proc: subprocess.Popen, ticks: int = 2) -> dict | None:
    """The state the agent publishes `ticks` ticks from now (each stamps its own generated_at), or None
    if the agent exits first. One tick may already be under way with what it read before now; every
    later one starts after it."""
    seen: list[str] = []

    def later(state: dict) -> bool:
        if proc.poll() is not None:
            return True
        if not seen or state["generated_at"] != seen[-1]:
            seen.append(state["generated_at"])
        return len(seen) > ticks

    state = wait_for(node.state, later)
    return None if proc.poll() is not None else state


@pytest.fixture
def node(tmp_path, fake_nvml_dir):
    n = Node(tmp_path, fake_nvml_dir)
    yield n
    n.close()


def by_id(doc: dict) -> dict[str, dict]:
    return {f["id"]: f for f in doc["findings"]}


def test_healthy_node_exits_0_and_writes_nothing(node):
    rc, doc, err = node.dry_run()
    assert rc == 0, err
    assert doc["verdict"] == "healthy" and doc["findings"] == [] and doc["would_do"] == []
    assert doc["node"] == "node01"
    assert [g["index"] for g in doc["gpus"]] == list(range(8))
    assert len({g["uuid"] for g in doc["gpus"]}) == 8 and all(g["serial"] for g in doc["gpus"])
    assert len(doc["ports"]) == 8 and all(p["state"] == "ACTIVE" and p["rate_gbps"] == 400 for p in doc["ports"])
    assert {s: v["status"] for s, v in doc["sources"].items()} == {
        "nvml": "ok", "kernel_log": "ok", "infiniband": "ok", "host": "ok", "nvme": "no_data"}
    assert doc["sources"]["nvme"]["detail"] == "disabled in config" and doc["nvme"] == []
    # --dry-run touches nothing
    assert not node.state_file.exists() and not node.state_dir.exists()
    assert not (node.root / "healthd.prom").exists()


def test_faulty_node_findings_attributed_tiered_with_evidence(node):
    gpu3 = node.gpus[3]
    node.gpus[5]["remapped_rows.pending"] = 1
    write_nvml_config(node.nvml_values, node.gpus)
    set_state(node.ib, "mlx5_2", 1, state="1: DOWN", phys_state="3: Disabled")
    bus3 = gpu3["bus_id"]
    kernel_bus = bus3[4:].lower().rsplit(".", 1)[0]          # 00000000:5D:00.0 -> 0000:5d:00
    node.xid(kernel_bus, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")

    rc, doc, err = node.dry_run()
    assert rc == 2, err
    assert doc["verdict"] == "failed"
    f = {(x["source"], x["xid"], x["component"]["kind"], x["component"]["index"]): x for x in doc["findings"]}
    xid79 = f[("kernel_log", 79, "gpu", 3)]
    assert (xid79["attribution"], xid79["tier"]) == ("hardware", 1)
    assert xid79["component"]["uuid"] == gpu3["uuid"] and xid79["component"]["serial"] == gpu3["serial"]
    assert any("GPU has fallen off the bus" in e["text"] for e in xid79["evidence"])
    remap = [x for x in doc["findings"] if x["component"]["index"] == 5 and x["source"] == "nvml"]
    assert remap and remap[0]["tier"] == 2 and remap[0]["action"] == "reset-gpu-when-idle"
    port = [x for x in doc["findings"] if x["component"]["kind"] == "port"]
    assert port and port[0]["component"]["device"] == "mlx5_2" and port[0]["attribution"] == "fabric"
    assert doc["would_do"] and doc["would_do"][0]["tier"] == 1
    assert not node.state_file.exists() and not node.state_dir.exists()


def test_text_report_is_readable(node):
    node.xid("0000:18:00", 48, "pid=77, name=python3, An uncorrectable double bit error was detected.")
    p = subprocess.run([HEALTHD, "--dry-run", "--once", "--config", str(node.config)],
                       capture_output=True, text=True, env=node.env(), timeout=60)
    assert p.returncode == 2, p.stderr
    out = p.stdout
    assert "healthd on node01: FAILED" in out and "dry run: nothing changed" in out
    assert "GPUs" in out and "Ports" in out and "xid 48" in out and "Would request" in out
    assert node.gpus[0]["uuid"] in out


def test_node_without_gpu_or_hca_says_no_data_and_exits_0(node):
    node.write_config(nvml={}, infiniband={"sysfs_root": str(node.root / "absent")}, host={})
    rc, doc, err = node.dry_run(with_nvml=False)
    assert rc == 0, err
    assert doc["sources"]["nvml"]["status"] == "no_data"
    assert doc["sources"]["infiniband"]["status"] == "no_data"
    assert doc["gpus"] == [] and doc["ports"] == []


def test_nvme_drives_from_sysfs_and_smart_log_files(node):
    """The NVMe source end to end: turned on in the config, read from a sysfs tree and the JSON files a
    site's timer writes, classified, and sent in a report the controller accepts."""
    sysfs, logs = node.root / "sys/class/nvme", node.root / "smart"
    for name in ("nvme0", "nvme1", "nvme2"):
        controller(sysfs, name)
    smart_file(logs, "nvme0", nvme_cli_2(critical_warning=0x08, percent_used=12))
    smart_file(logs, "nvme1", nvme_cli_2(percent_used=93, media_errors=4))
    smart_file(logs, "nvme2", "Passthru error: No such device")
    node.write_config(nvme={"enabled": True, "sysfs_root": str(sysfs), "smart_log_dir": str(logs)})
    rc, doc, err = node.dry_run()
    assert rc == 1, err
    assert doc["verdict"] == "degraded" and doc["sources"]["nvme"]["status"] == "ok"
    found = {i: (f["tier"], f["attribution"], f["action"], f["source"]) for i, f in by_id(doc).items()}
    assert found == {"nvme.critical_warning:nvme0": (2, "storage", "drain", "nvme"),
                     "nvme.wear:nvme1": (3, "storage", "none", "nvme"),
                     "nvme.unreadable:nvme2": (3, "unknown", "none", "nvme")}
    assert [(d["device"], d["percentage_used"], d["media_errors"]) for d in doc["nvme"]] == [
        ("nvme0", 12, 0), ("nvme1", 93, 4), ("nvme2", None, None)]
    validate_report(doc, "node01")


def test_bad_config_exits_3_naming_the_key(node):
    node.config.write_text("nvml: {expected_gpus: eight}\n")
    rc, doc, err = node.dry_run()
    assert rc == 3
    assert f"{node.config}: nvml.expected_gpus: expected an integer, found 'eight'" in err


def test_daemon_follows_the_journal_publishes_and_resumes_exactly_once(node):
    env = node.env()
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        state = wait_for(node.state, lambda d: d["verdict"] == "healthy")
        assert state["node"] == "node01"
        t0 = time.time()
        node.xid("0000:18:00", 95, "pid=1, name=python, Uncontained ECC error")
        state = wait_for(node.state, lambda d: any(f["xid"] == 95 for f in d["findings"]))
        detection = time.time() - t0
        assert detection < 5.0
        x95 = [f for f in state["findings"] if f["xid"] == 95][0]
        assert x95["count"] == 1 and x95["component"]["index"] == 0
        prom = wait_for(lambda: read_text(node.root / "healthd.prom"),
                        lambda t: 'healthd_kernel_xid_lines_total{xid="95"} 1.0' in t)
        assert 'healthd_collector_success{collector="nvml"} 1.0' in prom
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err

    # Restart: the line already counted is not counted again; a new one is.
    node.xid("0000:18:00", 95, "pid=1, name=python, Uncontained ECC error")
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(node.state, lambda d: d["agent"]["pid"] == proc.pid and xid_count(d, 95) >= 2)
        state = ticks_later(node, proc)  # a line read again would be counted by then
        assert state is not None and xid_count(state, 95) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def test_corrupt_agent_state_is_set_aside_and_the_agent_runs(node):
    node.state_dir.mkdir(parents=True)
    (node.state_dir / "agent-state.json").write_text('{"version": 1, "history": {"xid')
    p = subprocess.run([HEALTHD, "run", "--once", "--config", str(node.config)],
                       capture_output=True, text=True, env=node.env(), timeout=60)
    assert p.returncode == 0, p.stderr
    assert "is corrupt" in p.stderr
    assert list(node.state_dir.glob("agent-state.json.corrupt-*"))
    assert json.loads((node.state_dir / "agent-state.json").read_text())["version"] == 1
    assert node.state()["verdict"] == "healthy"


def run_once(node: Node, rc: int = 0) -> dict:
    p = subprocess.run([HEALTHD, "run", "--once", "--config", str(node.config)],
                       capture_output=True, text=True, env=node.env(), timeout=60)
    assert p.returncode == rc, p.stderr
    return node.state()


def test_gpu_counter_increases_count_across_restarts_and_an_upgrade(node):
    """Each `run --once` is a whole agent lifetime: the NVML baseline is saved and read back. An
    agent-state.json from an earlier version kept that baseline in its history; it is carried over."""
    gpu2 = node.gpus[2]
    assert run_once(node)["verdict"] == "healthy"
    saved = json.loads((node.state_dir / "agent-state.json").read_text())
    assert saved["nvml"]["gpus"][gpu2["uuid"]]["ecc_uncorrected_volatile"][0] == 0 and "baselines" not in saved["history"]
    gpu2["ecc.uncorrected.volatile"] = 2
    write_nvml_config(node.nvml_values, node.gpus)
    f = by_id(run_once(node, rc=2))["nvml.ecc_uncorrected:gpu2"]
    assert f["tier"] == 1 and "(+2)" in f["summary"]

    # the earlier format: the baseline in the history, as 'gpu/<uuid>/<counter>' -> [time, value]
    old = json.loads((node.state_dir / "agent-state.json").read_text())
    del old["nvml"]
    old["history"]["baselines"] = {f"gpu/{g['uuid']}/ecc_uncorrected_volatile": [time.time() - 10, g.get("ecc.uncorrected.volatile", 0)]
                                   for g in node.gpus}
    old["history"]["latches"] = {}
    (node.state_dir / "agent-state.json").write_text(json.dumps(old))
    gpu2["ecc.uncorrected.volatile"] = 7
    write_nvml_config(node.nvml_values, node.gpus)
    f = by_id(run_once(node, rc=2))["nvml.ecc_uncorrected:gpu2"]
    assert "(+5)" in f["summary"] and "2 -> 7 (+5)" in f["evidence"][0]["text"]


def test_bad_config_on_reload_keeps_the_last_good_one_and_metrics_serve_on_loopback(node):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node.write_config(metrics={"listen": f"127.0.0.1:{port}"})
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=node.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(node.state, lambda d: d["verdict"] == "healthy")
        # the state file is written before the metrics are updated: wait for the healthy verdict there too
        body = wait_for(lambda: scrape(f"http://127.0.0.1:{port}/metrics"),
                        lambda t: 'healthd_verdict{verdict="healthy"} 1.0' in t)
        assert 'healthd_ib_port_up{device="mlx5_0",port="1"} 1.0' in body

        node.config.write_text("interval_s: soon\n")
        proc.send_signal(signal.SIGHUP)
        ticks_later(node, proc)  # the loop takes a reload before its next tick: two ticks on, this one was taken
        assert proc.poll() is None, "a bad config on reload must not stop the agent"
        # still running on the old config: a new Xid is still detected and published
        node.xid("0000:18:00", 48, "pid=9, name=python3, DBE")
        state = wait_for(node.state, lambda d: any(f["xid"] == 48 for f in d["findings"]))
        assert state["verdict"] == "failed"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    assert f"reload refused, keeping the running configuration: {node.config}: interval_s: expected a number" in err


def test_daemon_keeps_reporting_the_kernel_sources_status_between_kernel_reads(node):
    node.write_config(kernel_log={"journal_dir": str(node.root / "no-such-journal"), "kmsg_path": None})
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=node.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = wait_for(node.state, lambda d: True)
        later = wait_for(node.state, lambda d: d["generated_at"] != first["generated_at"])
        for doc in (first, later):
            assert doc["sources"]["kernel_log"]["status"] == "no_data"
            assert "no-such-journal" in doc["sources"]["kernel_log"]["detail"]
        assert later["verdict"] == "healthy"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def _validate(node, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = node.env()
    if path is not None:
        env["PATH"] = path
    return subprocess.run([HEALTHD, "validate", "--config", str(node.config), *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_validate_passes_a_healthy_node_and_fails_one_with_a_t1_finding(node, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    dcgmi = fake_bin / "dcgmi"
    dcgmi.write_text("#!/bin/sh\necho \"diag $*\"\nexit ${DCGMI_RC:-0}\n")
    dcgmi.chmod(0o755)
    path = f"{fake_bin}:/usr/bin:/bin"
    p = _validate(node, path=path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS dcgmi diag -r 2: exit 0 (diag diag -r 2)" in p.stdout and "PASS healthd check: healthy" in p.stdout
    assert "skipped (DCGM not installed" in _validate(node, "--dcgm-level", "1", path="/nonexistent").stdout

    dcgmi.write_text("#!/bin/sh\necho 'Memory test: Fail'\nexit 226\n")
    p = _validate(node, path=path)
    assert p.returncode == 1 and "FAIL dcgmi diag -r 2: exit 226 (Memory test: Fail)" in p.stdout

    bus = node.gpus[2]["bus_id"][4:].lower().rsplit(".", 1)[0]
    node.xid(bus, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    p = _validate(node, "--dcgm-level", "0", path=path)
    assert p.returncode == 1 and "FAIL healthd check: failed: xid 79" in p.stdout, p.stdout
    assert "dcgmi" not in p.stdout
    assert not node.state_dir.exists()  # validation writes nothing on the node


# ----------------------------------------------------------------------------- --format nagios, `healthd state`


def _nagios(node: Node, *args: str, with_nvml: bool = True) -> tuple[int, str, str]:
    p = subprocess.run([HEALTHD, *args, "--format", "nagios", "--config", str(node.config)],
                       capture_output=True, text=True, env=node.env(with_nvml), timeout=60)
    return p.returncode, p.stdout, p.stderr


def _one_plugin_line(out: str) -> tuple[str, str]:
    """The plugin output is exactly one line with exactly one `|`: (text, perfdata)."""
    assert out.endswith("\n") and out.count("\n") == 1, repr(out)
    assert out.count("|") == 1, repr(out)
    text, perf = out.rstrip("\n").split(" | ")
    return text, perf


def test_once_format_nagios_prints_one_plugin_line_with_perfdata_per_verdict(node):
    rc, out, err = _nagios(node, "--dry-run", "--once")
    assert rc == 0, err
    assert _one_plugin_line(out) == ("HEALTHD OK - node01: healthy, no findings",
                                     "findings=0;;; t1=0;;; t2=0;;; t3=0;;; gpus=8;;;")

    node.gpus[5]["remapped_rows.pending"] = 1
    write_nvml_config(node.nvml_values, node.gpus)
    rc, out, err = _nagios(node, "--dry-run", "--once")
    assert rc == 1, err
    assert _one_plugin_line(out) == ("HEALTHD WARNING - node01: 1 T2 finding: gpu5: row remapping pending (reset the GPU to apply)",
                                     "findings=1;;; t1=0;;; t2=1;;; t3=0;;; gpus=8;;;")

    bus3 = node.gpus[3]["bus_id"][4:].lower().rsplit(".", 1)[0]
    node.xid(bus3, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    node.xid("0000:18:00", 31, "pid=1, name=python3, Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS")
    # a finding whose text comes from outside: a filesystem path with a `|` and a newline in it
    node.write_config(host={"filesystems": [{"path": "/nonexistent/ck|pt\nHEALTHD OK - fine", "role": "checkpoint"}]})
    # `healthd --once` (not a dry run): one real pass, the state file written, the same single line
    rc, out, err = _nagios(node, "--once")
    assert rc == 2, err
    text, perf = _one_plugin_line(out)
    assert text.startswith("HEALTHD CRITICAL - node01: 2 T1 findings: "), text
    assert "checkpoint filesystem /nonexistent/ck/pt?HEALTHD OK - fine is not mounted" in text, text
    assert "xid 79 gpu3: fell off the bus" in text and "xid 31" not in text  # the worst tier is named
    assert perf == "findings=4;;; t1=2;;; t2=1;;; t3=1;;; gpus=8;;;"
    assert node.state()["verdict"] == "failed"


def test_once_format_nagios_unknown_on_a_bad_config_is_still_one_line(node):
    node.config.write_text("nvml: {expected_gpus: eight}\n")
    rc, out, err = _nagios(node, "--dry-run", "--once")
    assert rc == 3
    assert out.count("\n") == 1 and "|" not in out, repr(out)
    assert out.startswith("HEALTHD UNKNOWN - cannot check: ") and "nvml.expected_gpus" in out, out


def test_state_reports_the_running_agent_and_unknown_when_it_is_gone(node):
    """`healthd state` reads only the state file (no NVML library in its environment here)."""
    rc, out, _ = _nagios(node, "state", with_nvml=False)
    assert rc == 3 and out.startswith("HEALTHD UNKNOWN - agent unknown: state file ") and "is missing" in out, out
    assert "|" not in out  # no document, no perfdata

    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=node.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(node.state, lambda d: d["verdict"] == "healthy" and d["agent"]["pid"] == proc.pid)
        rc, out, err = _nagios(node, "state", with_nvml=False)
        assert rc == 0, err
        assert _one_plugin_line(out)[0] == "HEALTHD OK - node01: healthy, no findings"
        p = subprocess.run([HEALTHD, "state", "--format", "json", "--config", str(node.config)],
                           capture_output=True, text=True, env=node.env(False), timeout=60)
        doc = json.loads(p.stdout)
        assert p.returncode == 0 and doc["known"] is True and doc["verdict"] == "healthy", p.stdout
        assert doc["state"]["agent"]["pid"] == proc.pid

        bus = node.gpus[2]["bus_id"][4:].lower().rsplit(".", 1)[0]
        node.xid(bus, 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        wait_for(node.state, lambda d: d["verdict"] == "failed")
        rc, out, _ = _nagios(node, "state", with_nvml=False)
        assert rc == 2 and _one_plugin_line(out)[0] == "HEALTHD CRITICAL - node01: 1 T1 finding: xid 79 gpu2: fell off the bus"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)
    # the agent is gone, its last document stays: unknown (as the hooks judge it), with its perfdata
    rc, out, _ = _nagios(node, "state", with_nvml=False)
    text, perf = _one_plugin_line(out)
    assert rc == 3 and text == f"HEALTHD UNKNOWN - agent unknown: agent pid {proc.pid} is not running", out
    assert perf == "findings=1;;; t1=1;;; t2=0;;; t3=0;;; gpus=8;;;"
    p = subprocess.run([HEALTHD, "state", "--config", str(node.config)], capture_output=True, text=True,
                       env=node.env(False), timeout=60)
    assert p.returncode == 3 and f"agent unknown: agent pid {proc.pid} is not running" in p.stdout


def test_render_nagios_never_lets_a_document_break_the_line():
    from healthd.agent.render import render_nagios

    hostile = {"node": "n|1\nx", "verdict": "failed", "gpus": [{}, {}],
               "findings": [{"tier": 1, "id": "a", "summary": "bad | thing\r\nHEALTHD OK - all fine | t1=0"},
                            {"tier": "1", "id": "b"}, "not a finding", {"tier": True, "summary": "x" * 5000}]}
    line, code = render_nagios(hostile)
    assert code == 2 and "\n" not in line and "\r" not in line and line.count("|") == 1, line
    assert line.startswith("HEALTHD CRITICAL - n/1?x: 1 T1 finding: bad / thing??HEALTHD OK - all fine / t1=0 | ")
    assert line.endswith(" | findings=3;;; t1=1;;; t2=0;;; t3=0;;; gpus=2;;;") and len(line) < 800
    many = {"node": "n", "verdict": "degraded", "findings": [{"tier": 2, "id": f"f{i}", "summary": f"s{i}"} for i in range(5)]}
    assert render_nagios(many) == ("HEALTHD WARNING - n: 5 T2 findings: s0; s1; s2; and 2 more | "
                                   "findings=5;;; t1=0;;; t2=5;;; t3=0;;;", 1)
    assert render_nagios({"node": "n", "verdict": ["x"], "findings": None})[1] == 3
    assert render_nagios({"node": "n", "verdict": "unknown", "findings": []}) == (
        "HEALTHD UNKNOWN - n: unknown, no source could be read | findings=0;;; t1=0;;; t2=0;;; t3=0;;;", 3)
    assert render_nagios(None, "agent unknown: x | y\nz") == ("HEALTHD UNKNOWN - agent unknown: x / y?z", 3)
