"""healthd.agent.collectors.nvme.NvmeCollector over sysfs trees and SMART logs built in tmp dirs as the
kernel and nvme-cli write them, and over real commands: what it reads, what it reports when it cannot,
and the media errors baseline that survives a restart and a renamed controller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from healthd.agent.collectors.nvme import NvmeCollector, SmartLog, document
from tests.agent.collectors.nvme.tree import controller, nvme_cli_1, nvme_cli_2, smart_file

NOW = 1_750_000_000.0


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "class" / "nvme"
    controller(root, "nvme0")
    controller(root, "nvme1", model="INTEL SSDPF2KX076TZ", serial="PHAX1234005G7P6DGN", firmware="JCV10100")
    return root


def test_no_class_directory_is_no_data_and_an_unlistable_one_an_error(tmp_path):
    s = NvmeCollector(sysfs_root=str(tmp_path / "absent")).collect(NOW)
    assert (s.status, s.controllers) == ("no_data", ()) and "absent" in s.detail
    (tmp_path / "empty").mkdir()
    assert NvmeCollector(sysfs_root=str(tmp_path / "empty")).collect(NOW).status == "no_data"
    (tmp_path / "file").write_text("")
    s = NvmeCollector(sysfs_root=str(tmp_path / "file")).collect(NOW)
    assert s.status == "error" and "ENOTDIR" in s.detail


def test_sysfs_alone_names_each_controller_and_reads_no_smart(sysfs):
    (sysfs / "nvme-subsys0").mkdir()  # not a controller
    controller(sysfs, "nvme10")
    s = NvmeCollector(sysfs_root=str(sysfs)).collect(NOW)
    assert s.status == "ok" and s.time == NOW
    assert [c.name for c in s.controllers] == ["nvme0", "nvme1", "nvme10"]
    c = s.controllers[1]
    assert (c.model, c.serial, c.firmware, c.state) == ("INTEL SSDPF2KX076TZ", "PHAX1234005G7P6DGN", "JCV10100", "live")
    assert all(c.smart is None and c.media_errors is None for c in s.controllers)


def test_smart_log_files_of_each_tool_and_what_is_wrong_with_the_others(sysfs, tmp_path):
    logs = tmp_path / "smart"
    controller(sysfs, "nvme2")
    controller(sysfs, "nvme3")
    controller(sysfs, "nvme4")
    written = smart_file(logs, "nvme0", nvme_cli_2(critical_warning=8, percent_used=91, media_errors=2))
    os.utime(written, (NOW - 120, NOW - 120))
    smart_file(logs, "nvme1", nvme_cli_1(percent_used=4))
    smart_file(logs, "nvme2", "Passthru error: No such device\n")
    os.mkfifo(logs / "nvme3.json")  # never blocks the agent
    os.symlink(written, logs / "nvme4.json")
    s = NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(logs)).collect(NOW)
    by = {c.name: c for c in s.controllers}
    assert by["nvme0"].smart == SmartLog(critical_warning=8, percentage_used=91, media_errors=2, available_spare=100,
                                         available_spare_threshold=10)
    assert by["nvme0"].smart_at == NOW - 120
    assert by["nvme1"].smart.percentage_used == 4
    assert "not JSON" in by["nvme2"].smart.error
    assert "not a regular file" in by["nvme3"].smart.error
    assert "ELOOP" in by["nvme4"].smart.error
    os.unlink(logs / "nvme4.json")
    s = NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(logs)).collect(NOW)
    assert "no SMART log file" in s.controllers[-1].smart.error and s.controllers[-1].smart_at is None


def test_media_errors_rise_against_the_baseline_which_survives_a_restart_and_a_new_name(sysfs, tmp_path):
    logs = tmp_path / "smart"
    smart_file(logs, "nvme0", nvme_cli_2(media_errors=5))
    c = NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(logs))
    first = c.collect(NOW).controllers[0].media_errors
    assert (first.value, first.delta) == (5, None)
    smart_file(logs, "nvme0", nvme_cli_2(media_errors=9))
    d = c.collect(NOW + 10).controllers[0].media_errors
    assert (d.value, d.delta, d.window_s) == (9, 4, 10.0)

    saved = json.loads(json.dumps(c.state()))
    # after a reboot the drive came back as nvme1: its baseline follows its serial
    serial = (sysfs / "nvme0" / "serial").read_text()
    (sysfs / "nvme1" / "serial").write_text(serial)
    (sysfs / "nvme0" / "serial").write_text("OTHER\n")
    smart_file(logs, "nvme1", nvme_cli_2(media_errors=11))
    again = NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(logs), baseline=saved).collect(NOW + 20)
    d = again.controllers[1].media_errors
    assert (d.value, d.delta) == (11, 2)
    assert NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(logs), baseline={"garbage": 1}).collect(NOW).status == "ok"


def test_the_state_document_section(sysfs, tmp_path):
    smart_file(tmp_path / "smart", "nvme0", nvme_cli_2(percent_used=17, media_errors=1))
    s = NvmeCollector(sysfs_root=str(sysfs), smart_log_dir=str(tmp_path / "smart")).collect(NOW)
    assert document(s) == [
        {"device": "nvme0", "model": "SAMSUNG MZQL23T8HCLS-00A07", "serial": "S64HNE0T000000", "firmware": "GDC5602Q",
         "state": "live", "percentage_used": 17, "critical_warning": 0, "media_errors": 1, "available_spare": 100,
         "smart_error": None},
        {"device": "nvme1", "model": "INTEL SSDPF2KX076TZ", "serial": "PHAX1234005G7P6DGN", "firmware": "JCV10100",
         "state": "live", "percentage_used": None, "critical_warning": None, "media_errors": None, "available_spare": None,
         "smart_error": f"no SMART log file {tmp_path / 'smart' / 'nvme1.json'}"},
    ]


# --------------------------------------------------------------------------- the command


def command(tmp_path: Path, body: str) -> tuple[str, ...]:
    """A stand-in for `nvme smart-log -o json`: a Python program that logs its arguments, then runs `body`."""
    script = tmp_path / "bin" / "nvme"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!{sys.executable}\nimport json, sys, time\n"
                      f"open({str(tmp_path / 'runs')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n" + body)
    script.chmod(0o755)
    return (str(script), "smart-log", "-o", "json")


def runs(tmp_path: Path) -> list[str]:
    p = tmp_path / "runs"
    return p.read_text().splitlines() if p.exists() else []


def test_the_command_gets_the_device_and_its_json_is_read(sysfs, tmp_path):
    doc = json.dumps(nvme_cli_2(critical_warning=4, media_errors=3))
    c = NvmeCollector(sysfs_root=str(sysfs), smart_log_command=command(tmp_path, f"print({doc!r})"))
    s = c.collect(NOW)
    assert runs(tmp_path) == ["smart-log -o json /dev/nvme0", "smart-log -o json /dev/nvme1"]
    assert [(x.smart.critical_warning, x.smart.media_errors, x.smart_at) for x in s.controllers] == [(4, 3, NOW)] * 2


def test_a_failing_command_says_why(sysfs, tmp_path):
    body = "sys.stderr.write('NVMe status: Invalid Field in Command(0x2)\\n'); sys.exit(22)"
    s = NvmeCollector(sysfs_root=str(sysfs), smart_log_command=command(tmp_path, body)).collect(NOW)
    assert s.controllers[0].smart.error == "nvme exited 22: NVMe status: Invalid Field in Command(0x2)"
    s = NvmeCollector(sysfs_root=str(sysfs), smart_log_command=(str(tmp_path / "no-such-nvme"), "smart-log")).collect(NOW)
    assert "cannot run no-such-nvme: ENOENT" in s.controllers[0].smart.error


def test_a_command_that_prints_too_much_is_stopped(sysfs, tmp_path):
    c = NvmeCollector(sysfs_root=str(sysfs), smart_log_command=command(tmp_path, "sys.stdout.write('x' * 10**7)"))
    assert "printed more than 65536 bytes (killed)" in c.collect(NOW).controllers[0].smart.error


def test_a_hung_command_is_killed_at_its_timeout_and_never_run_twice_while_stuck(sysfs, tmp_path, monkeypatch):
    c = NvmeCollector(sysfs_root=str(sysfs), smart_log_command=command(tmp_path, "time.sleep(60)"),
                      command_timeout_s=0.3)
    start = time.monotonic()
    s = c.collect(NOW)
    assert time.monotonic() - start < 3.0
    assert s.controllers[0].smart.error == "nvme did not finish in 0.3s (killed)"
    assert len(runs(tmp_path)) == 2
    # the next tick runs it again: the killed runs have exited
    c.collect(NOW + 10)
    assert len(runs(tmp_path)) == 4

    # a run in the driver's uninterruptible sleep outlives SIGKILL: as if every run were one
    monkeypatch.setattr(subprocess.Popen, "wait", lambda self, timeout=None: (_ for _ in ()).throw(
        subprocess.TimeoutExpired(self.args, timeout)))
    monkeypatch.setattr(subprocess.Popen, "poll", lambda self: None)
    c.collect(NOW + 20)
    assert len(runs(tmp_path)) == 6
    s = c.collect(NOW + 30)
    assert len(runs(tmp_path)) == 6, "a second run started while the first had not exited"
    assert "has not exited; not run again" in s.controllers[0].smart.error and "started 10s ago" in s.controllers[0].smart.error
    monkeypatch.undo()
    c.collect(NOW + 40)
    assert len(runs(tmp_path)) == 8
