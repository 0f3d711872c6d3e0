"""The unit files as systemd itself reads them, and the tmpfiles.d entry as systemd-tmpfiles applies it.

`systemd-analyze verify` (systemd 252) fails a unit whose ExecStart binary is missing ("Command ... is
not executable"), and `--root=DIR` looks up every unit it depends on (sysinit.target, ...) and /bin/kill
under DIR as well, so it cannot check our units alone. The test therefore verifies a copy whose
ExecStart points at this venv's real `healthd` / `healthd-controller`; every other line is the file's
own. Any warning (an unknown key, a bad value) fails the test: verify prints those and still exits 0."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
VENV_BIN = Path(sys.executable).parent
UNITS = ("healthd.service", "healthd-controller.service")

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD_DIR / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_both_units_pass_systemd_analyze_verify(tmp_path):
    for unit in UNITS:
        text = (SYSTEMD_DIR / unit).read_text()
        assert "ExecStart=/opt/healthd/current/bin/" in text
        (tmp_path / unit).write_text(text.replace("/opt/healthd/current/bin/", f"{VENV_BIN}/"))
    p = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / u) for u in UNITS)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (p.stdout + p.stderr).strip() == "", p.stdout + p.stderr


def test_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: an unknown key is reported."""
    text = (SYSTEMD_DIR / "healthd.service").read_text().replace("/opt/healthd/current/bin/", f"{VENV_BIN}/")
    (tmp_path / "healthd.service").write_text(text.replace("WatchdogSec=", "WatchdogSecs="))
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "healthd.service")],
                       capture_output=True, text=True, timeout=60)
    assert "WatchdogSecs" in p.stdout + p.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_units_are_notify_watchdog_restart_and_hardened(unit):
    d = directives(unit)
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert int(d["WatchdogSec"][0]) > 0 and d["Restart"] == ["on-failure"]
    assert d["ProtectSystem"] == ["strict"] and d["NoNewPrivileges"] == ["yes"] and d["PrivateTmp"] == ["yes"]
    assert "/run/healthd" in d["ReadWritePaths"] and d["StateDirectory"] == ["healthd"]


def test_agent_unit_keeps_what_the_agent_needs():
    d = directives("healthd.service")
    assert d["CapabilityBoundingSet"] == ["CAP_SYSLOG"]  # /dev/kmsg under dmesg_restrict
    allowed = " ".join(d["DeviceAllow"])
    for dev in ("char-nvidia-frontend", "/dev/nvidiactl", "char-nvidia-uvm", "/dev/kmsg"):
        assert dev in allowed
    assert "-/var/lib/node_exporter/textfile" in d["ReadWritePaths"]
    # ProtectSystem=strict alone leaves /home and /root writable (test_units_real_systemd proves both)
    assert d["ProtectHome"] == ["read-only"]
    # these would break the agent: /dev/kmsg, other processes' /proc, /dev/nvidia*
    assert "ProtectKernelLogs" not in d and "ProtectProc" not in d and "PrivateDevices" not in d
    assert directives("healthd-controller.service")["CapabilityBoundingSet"] == [""]


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles not installed")
def test_tmpfiles_creates_the_shared_directories(tmp_path):
    p = subprocess.run(["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(SYSTEMD_DIR / "healthd.tmpfiles.conf")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for d in ("run/healthd", "run/healthd/jobs", "run/healthd/jobs/done", "run/healthd/requests", "var/lib/healthd"):
        st = (tmp_path / d).stat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755, d
