"""The unit files under a real systemd: PID 1 of a systemd-nspawn container (tests/systemd/nspawn.py).

What is installed in the container, read-only:
  * systemd/healthd.service, systemd/healthd-controller.service and systemd/healthd.tmpfiles.conf,
    bound file by file at /etc/systemd/system/ and /etc/tmpfiles.d/healthd.conf: the product files
    byte for byte, not copies.
  * this repository and its venv at their own paths, and /opt/healthd/current (the units' ExecStart)
    as a venv of the container's python3 over the host venv's site-packages (install_venv_shim).
  * test-only drop-ins in <unit>.d/, each saying what it changes and why: the stand-in NVML's
    environment, a shorter WatchdogSec= (4 s instead of 60 s, so a watchdog restart takes seconds,
    not minutes), and for the hardening probe an ExecStart= replacing the agent by a probe script,
    so the probe runs in the agent unit's own sandbox (every other line of the unit applies).
  * a simulated node: the C stand-in of libnvidia-ml (/srv/nvml), an InfiniBand sysfs tree
    (/srv/sys/class/infiniband), /dev/nvidia* character devices made with mknod and a /proc/devices
    that names the nvidia majors (DeviceAllow=char-nvidia-* is resolved from it); the journal is the
    container's own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Callable
from pathlib import Path

import pytest
import yaml

from tests.support.fake_nvml import build_fake_nvml, healthy_node, write_nvml_config
from tests.support.ib_tree import make_ndr_node
from tests.systemd import nspawn

REPO = nspawn.REPO
UNIT_DIR = REPO / "systemd"
IB_ROOT = "/srv/sys/class/infiniband"
# majors as /proc/devices shows them with the NVIDIA driver loaded (195 is fixed; uvm and caps are
# dynamic, these are typical values)
NVIDIA_MAJORS = {"nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 509}
WATCHDOG_S = 4
CAP_SYSLOG = 34

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def rootfs():
    why = nspawn.nspawn_unusable()
    if why:
        pytest.skip(why)
    root = nspawn.build_rootfs(log=lambda line: print(line, file=sys.stderr))
    have = nspawn.container_python(root)
    if have != sys.version_info[:2]:
        pytest.skip(f"the container's python3 is {have}, the venv's {sys.version_info[:2]}: its compiled "
                    "extensions would not load (make the venv with the system python3)")
    return root


@pytest.fixture(scope="module")
def fake_nvml_lib(tmp_path_factory):
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml")) / "libnvidia-ml.so.1"


def proc_devices() -> str:
    """The host's /proc/devices plus the NVIDIA driver's character majors."""
    lines = Path("/proc/devices").read_text().splitlines()
    at = lines.index("Block devices:") if "Block devices:" in lines else len(lines)
    while at > 0 and not lines[at - 1].strip():  # the character section ends at its blank line
        at -= 1
    extra = [f"{major:3d} {name}" for name, major in NVIDIA_MAJORS.items()]
    return "\n".join(lines[:at] + extra + lines[at:]) + "\n"


class Stage:
    """Host directories bound into one container, and the container once booted."""

    def __init__(self, tmp: Path, rootfs: Path):
        self.tmp = tmp
        self.rootfs = rootfs
        self.etc = tmp / "etc-healthd"
        self.knobs = tmp / "knobs"  # files the test creates to steer stand-ins in the container
        for d in (self.etc, self.knobs):
            d.mkdir()
        nspawn.install_venv_shim(tmp / "opt")
        (self.knobs / "proc-devices").write_text(proc_devices())
        self.binds = nspawn.venv_binds() + [
            (str(tmp / "opt"), "/opt/healthd"),
            (str(self.etc), "/etc/healthd"),
            (str(self.knobs), "/etc/healthd-test"),
            (str(UNIT_DIR / "healthd.tmpfiles.conf"), "/etc/tmpfiles.d/healthd.conf"),
        ]
        self.c: nspawn.Container | None = None

    def unit(self, name: str, **dropins: str) -> Path:
        """Install the product unit `name` and a drop-in directory (file name -> text)."""
        self.binds.append((str(UNIT_DIR / name), f"/etc/systemd/system/{name}"))
        d = self.tmp / f"{name}.d"
        d.mkdir()
        for file, text in dropins.items():
            (d / file).write_text(textwrap.dedent(text))
        self.binds.append((str(d), f"/etc/systemd/system/{name}.d"))
        return d

    def boot(self) -> nspawn.Container:
        self.c = nspawn.Container(self.rootfs, self.tmp, self.binds)
        self.c.start()  # stops the container itself when the boot fails
        # over /proc/devices in the container's mount namespace, where its systemd resolves
        # DeviceAllow=char-nvidia-* (nspawn cannot bind a host file below /proc)
        self.c.run("mount", "--bind", "-o", "ro", "/etc/healthd-test/proc-devices", "/proc/devices")
        return self.c

    def stop(self) -> None:
        if self.c is not None:
            self.c.stop()


@pytest.fixture
def stage(tmp_path, rootfs):
    s = Stage(tmp_path, rootfs)
    try:
        yield s
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------ agent

NVML_ENV = """\
    # test only: the C stand-in of libnvidia-ml and its values file (a node has the real library)
    [Service]
    Environment=LD_LIBRARY_PATH=/srv/nvml FAKE_NVML_CONFIG=/srv/nvml/nvml.conf
    """


def agent_stage(stage: Stage, fake_nvml_lib: Path, nvml_globals: dict | None = None, call_timeout_s: float = 1.0,
                **dropins: str) -> Path:
    """The agent's node: stand-in NVML (healthy, 8 GPUs), an 8-port NDR IB tree, its config.
    Returns the NVML values file (rewrite it with write_nvml_config to change what NVML answers)."""
    nvml = stage.tmp / "nvml"
    nvml.mkdir()
    shutil.copy2(fake_nvml_lib, nvml / "libnvidia-ml.so.1")
    values = nvml / "nvml.conf"
    write_nvml_config(values, healthy_node(8), **(nvml_globals or {}))
    ib = stage.tmp / "ib"
    make_ndr_node(ib, ports=8)
    stage.binds += [(str(nvml), "/srv/nvml"), (str(ib), IB_ROOT)]
    (stage.etc / "healthd.yaml").write_text(yaml.safe_dump({
        "node_name": "node01",
        "interval_s": 0.5,
        "nvml": {"expected_gpus": 8, "call_timeout_s": call_timeout_s},
        "infiniband": {"sysfs_root": IB_ROOT, "expected_ports": 8, "expected_rate_gbps": 400},
    }))
    stage.unit("healthd.service", **{"nvml-env.conf": NVML_ENV, **dropins})
    return values


def hang_until_watchdog(c: nspawn.Container, unit: str, hang: Callable[[], None], timeout: float = 60) -> float:
    """Make `unit` hang (`hang`), then wait for systemd's "Watchdog timeout" on it: seconds it took."""
    hang()
    hung_at = time.monotonic()
    while "Watchdog timeout" not in (journal := c.journal("-u", unit)):
        assert time.monotonic() < hung_at + timeout, journal[-4000:]
        time.sleep(0.2)
    return time.monotonic() - hung_at


def wait_active(c: nspawn.Container, unit: str, timeout: float = 60, not_pid: str = "") -> tuple[list[str], dict]:
    """Poll until `unit` is active (with a MainPID other than `not_pid`); the states seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        p = c.show(unit, "ActiveState", "SubState", "MainPID", "NRestarts")
        state = f"{p['ActiveState']}/{p['SubState']}"
        if not seen or seen[-1] != state:
            seen.append(state)
        if p["ActiveState"] == "active" and p["MainPID"] not in ("0", not_pid):
            return seen, p
        assert p["ActiveState"] != "failed", (seen, c.journal("-u", unit)[-4000:])
        assert time.monotonic() < deadline, (seen, c.journal("-u", unit)[-4000:])
        time.sleep(0.05)


def timing(c: nspawn.Container, unit: str) -> dict[str, float]:
    p = c.show(unit, "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic",
               "InactiveExitTimestampMonotonic")
    return {k.removesuffix("TimestampMonotonic"): int(v) / 1e6 for k, v in p.items()}


def test_agent_active_only_after_ready(stage, fake_nvml_lib):
    """Type=notify: with nvmlInit taking 3 s the unit stays `activating` for those 3 s and becomes
    `active` only when READY=1 came, after the first complete pass was published."""
    agent_stage(stage, fake_nvml_lib, nvml_globals={"init.sleep_ms": 3000}, call_timeout_s=10)
    c = stage.boot()
    print(f"container booted in {c.boot_s:.2f} s")
    c.run("systemctl", "start", "--no-block", "healthd.service")
    seen, props = wait_active(c, "healthd.service")
    t = timing(c, "healthd.service")
    ready_after = t["ActiveEnter"] - t["ExecMainStart"]
    print(f"states {seen}; READY {ready_after:.2f} s after ExecStart")
    assert "activating/start" in seen and seen[-1] == "active/running", seen
    assert 3.0 <= ready_after < 30, t

    doc = json.loads(c.run("cat", "/run/healthd/state.json").stdout)
    assert doc["verdict"] == "healthy", doc
    assert {name: src["status"] for name, src in doc["sources"].items()} == \
        {"nvml": "ok", "kernel_log": "ok", "infiniband": "ok", "host": "ok", "nvme": "no_data"}, doc["sources"]
    show = c.show("healthd.service", "StatusText", "WatchdogUSec", "ActiveEnterTimestamp", "Type")
    assert show["StatusText"] == "verdict healthy, 0 finding(s)", show
    assert show["WatchdogUSec"] == "1min" and show["Type"] == "notify", show
    # the state file was written before systemd saw READY=1 (its mtime, in the container's clock)
    mtime = float(c.run("stat", "-c", "%.Y", "/run/healthd/state.json").stdout)
    active_at = time.time() - (time.monotonic() - t["ActiveEnter"])  # one CLOCK_MONOTONIC for both
    assert mtime <= active_at + 0.05, (mtime, active_at)
    # the agent's own process: only CAP_SYSLOG can ever be raised, no new privileges
    status = c.run("cat", f"/proc/{props['MainPID']}/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert int(fields["CapBnd"], 16) == 1 << CAP_SYSLOG and fields["NoNewPrivs"].strip() == "1", fields
    assert c.run("ls", "/var/lib/healthd").stdout.strip(), "nothing persisted in the StateDirectory"
    journal = c.journal("-u", "healthd.service")
    assert journal.index("starting on node01") < journal.index("Started healthd.service"), journal[-3000:]


def test_hung_nvml_call_stops_the_watchdog_and_systemd_restarts_the_agent(stage, fake_nvml_lib):
    """A call into NVML that never returns (GPU 0's temperature read sleeps 10 minutes): the agent
    keeps ticking but stops feeding the watchdog once NVML has been stuck a whole period; systemd
    sees no WATCHDOG=1 for WatchdogSec, aborts it (faulthandler logs where it hung) and restarts it."""
    values = agent_stage(stage, fake_nvml_lib, call_timeout_s=1.0, **{"watchdog.conf": f"""\
        # test only: a 4 s watchdog instead of 60 s (still > interval_s 0.5 + call_timeout_s 1)
        [Service]
        WatchdogSec={WATCHDOG_S}
        """})
    c = stage.boot()
    c.run("systemctl", "start", "healthd.service")
    _, first = wait_active(c, "healthd.service")
    fed = c.show("healthd.service", "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"]
    time.sleep(WATCHDOG_S)
    assert c.show("healthd.service", "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"] != fed, \
        "the watchdog was not fed while healthy"
    assert c.show("healthd.service", "NRestarts")["NRestarts"] == "0"

    gpus = healthy_node(8)
    gpus[0]["temperature.sleep_ms"] = 600_000
    hung_at = time.monotonic()
    timeout_after = hang_until_watchdog(c, "healthd.service", lambda: write_nvml_config(values, gpus))
    write_nvml_config(values, healthy_node(8))  # the next agent finds a working NVML
    _, again = wait_active(c, "healthd.service", not_pid=first["MainPID"])
    restarted_after = time.monotonic() - hung_at
    print(f"hang -> 'Watchdog timeout' {timeout_after:.1f} s, -> active again {restarted_after:.1f} s")
    assert int(again["NRestarts"]) >= 1, again
    journal = c.journal("-u", "healthd.service")
    assert "not feeding the systemd watchdog: nvml stuck" in journal, journal[-4000:]
    assert "Watchdog timeout" in journal and "(limit 4s)" in journal, journal[-4000:]
    assert re.search(r"Main process exited, code=(killed|dumped), status=6/ABRT", journal), journal[-4000:]
    assert "Failed with result 'watchdog'" in journal, journal[-4000:]
    # PYTHONFAULTHANDLER=1: the SIGABRT prints every thread's stack, the hung NVML call among them
    stacks = journal.split("Watchdog timeout", 1)[1].split("Main process exited", 1)[0]
    assert "nvml" in stacks and "Fatal Python error: Aborted" in stacks, stacks[-4000:]
    assert timeout_after < 3 * WATCHDOG_S + 5, timeout_after
    # and it stays up once NVML answers again
    time.sleep(2 * WATCHDOG_S)
    assert c.show("healthd.service", "NRestarts", "ActiveState") == \
        {"NRestarts": again["NRestarts"], "ActiveState": "active"}


PROBE = r'''
import ctypes, errno, json, os, socket, sys

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def read(path):
    return lambda: open(path, "rb").read(1)

def write(path):
    def w():
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
    return w

def dev(path, flags):
    return lambda: os.close(os.open(path, flags))

def journal():
    # every entry, not this_boot(): nspawn mounts a boot id of its own over
    # /proc/sys/kernel/random/boot_id, which ProtectKernelTunables= hides again from the service
    from systemd import journal as j
    if j.Reader().get_next() == {}:
        raise OSError(errno.ENODATA, "empty journal")

def sock(family, kind):
    return lambda: socket.socket(family, kind).close()

def unshare():
    if ctypes.CDLL(None, use_errno=True).unshare(0x04000000) != 0:  # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), "unshare")

r = {
    "journal": attempt(journal),
    "ib sysfs": attempt(read("/srv/sys/class/infiniband/mlx5_0/ports/1/state")),
    "sysfs": attempt(read("/sys/devices/system/cpu/online")),
    "proc of pid 1": attempt(read("/proc/1/stat")),
    "nvml library": attempt(read("/srv/nvml/libnvidia-ml.so.1")),
    "config": attempt(read("/etc/healthd/healthd.yaml")),
    "write /run/healthd": attempt(write("/run/healthd/probe")),
    "write /var/lib/healthd": attempt(write("/var/lib/healthd/probe")),
    "write /tmp": attempt(write("/tmp/probe")),
    "other /tmp": attempt(read("/tmp/other-service-file")),
    "write /etc": attempt(write("/etc/probe")),
    "write /usr": attempt(write("/usr/probe")),
    "write /home": attempt(write("/home/probe")),
    "write /root": attempt(write("/root/probe")),
    "write /opt": attempt(write("/opt/probe")),
    "write /var/lib": attempt(write("/var/lib/probe")),
    "write /srv": attempt(write("/srv/probe-file")),
    "write /proc/sys": attempt(write("/proc/sys/kernel/domainname")),
    "munge key": attempt(read("/etc/munge/munge.key")),
    "/dev/nvidia0 rw": attempt(dev("/dev/nvidia0", os.O_RDWR)),
    "/dev/nvidiactl rw": attempt(dev("/dev/nvidiactl", os.O_RDWR)),
    "/dev/nvidia-uvm rw": attempt(dev("/dev/nvidia-uvm", os.O_RDWR)),
    "/dev/nvidia-caps/nvidia-cap1 r": attempt(dev("/dev/nvidia-caps/nvidia-cap1", os.O_RDONLY)),
    "/dev/nvidia-caps/nvidia-cap1 rw": attempt(dev("/dev/nvidia-caps/nvidia-cap1", os.O_RDWR)),
    "/dev/null rw": attempt(dev("/dev/null", os.O_RDWR)),
    "block device": attempt(dev("/dev/probe-sda", os.O_RDONLY)),
    "other char device": attempt(dev("/dev/probe-tun", os.O_RDWR)),
    "AF_INET": attempt(sock(socket.AF_INET, socket.SOCK_STREAM)),
    "AF_UNIX": attempt(sock(socket.AF_UNIX, socket.SOCK_DGRAM)),
    "AF_NETLINK": attempt(sock(socket.AF_NETLINK, socket.SOCK_RAW)),
    "AF_PACKET": attempt(sock(socket.AF_PACKET, socket.SOCK_RAW)),
    "unshare": attempt(unshare),
    "sethostname": attempt(lambda: socket.sethostname("probe")),
}
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
r["CapBnd"], r["CapEff"], r["NoNewPrivs"] = status["CapBnd"].strip(), status["CapEff"].strip(), status["NoNewPrivs"].strip()
print("PROBE " + json.dumps(r, sort_keys=True), flush=True)
'''

# what the agent's sandbox must allow ("ok"), and what it must refuse (the errno)
EXPECTED = {
    "journal": "ok", "ib sysfs": "ok", "sysfs": "ok", "proc of pid 1": "ok", "nvml library": "ok", "config": "ok",
    "write /run/healthd": "ok", "write /var/lib/healthd": "ok", "write /tmp": "ok",
    "other /tmp": "ENOENT",  # PrivateTmp: another service's /tmp is not there
    "write /etc": "EROFS", "write /usr": "EROFS", "write /home": "EROFS", "write /root": "EROFS",
    "write /opt": "EROFS", "write /var/lib": "EROFS", "write /srv": "EROFS", "write /proc/sys": "EROFS",
    "munge key": "EACCES",  # root without CAP_DAC_OVERRIDE cannot read munged's 0600 key
    # allowed by the device policy: open() reaches the (absent) driver, ENXIO; refused: EPERM
    "/dev/nvidia0 rw": "ENXIO", "/dev/nvidiactl rw": "ENXIO", "/dev/nvidia-uvm rw": "ENXIO",
    "/dev/nvidia-caps/nvidia-cap1 r": "ENXIO", "/dev/nvidia-caps/nvidia-cap1 rw": "EPERM",
    "/dev/null rw": "ok", "block device": "EPERM", "other char device": "EPERM",
    "AF_INET": "ok", "AF_UNIX": "ok", "AF_NETLINK": "EAFNOSUPPORT", "AF_PACKET": "EAFNOSUPPORT",
    "unshare": "EPERM", "sethostname": "EPERM",
    "CapBnd": f"{1 << CAP_SYSLOG:016x}", "CapEff": f"{1 << CAP_SYSLOG:016x}", "NoNewPrivs": "1",
}


def test_agent_sandbox_reads_what_it_needs_and_writes_nothing_else(stage, fake_nvml_lib):
    """healthd.service itself, with only ExecStart= replaced by a probe (a drop-in): every sandbox line
    of the unit applies to the probe as it does to the agent. The probe needs no notify: a READY=1
    is sent by python's `systemd.daemon` only if present, so the probe sends it by hand."""
    (stage.tmp / "probe").mkdir()
    (stage.tmp / "probe/probe.py").write_text(PROBE + textwrap.dedent("""
        from healthd.sdnotify import notifier_from_env
        notifier_from_env().notify("READY=1")
        """))
    stage.binds.append((str(stage.tmp / "probe"), "/srv/probe"))
    agent_stage(stage, fake_nvml_lib, **{"probe.conf": """\
        # test only: the same unit, its ExecStart replaced by the sandbox probe
        [Service]
        ExecStart=
        ExecStart=/opt/healthd/current/bin/python3 /srv/probe/probe.py
        """})
    c = stage.boot()
    for name, kind, major, minor in (("nvidia0", "c", 195, 0), ("nvidiactl", "c", 195, 255),
                                     ("nvidia-uvm", "c", NVIDIA_MAJORS["nvidia-uvm"], 0),
                                     ("nvidia-caps/nvidia-cap1", "c", NVIDIA_MAJORS["nvidia-caps"], 1),
                                     ("probe-sda", "b", 8, 0), ("probe-tun", "c", 10, 200)):
        c.run("mkdir", "-p", os.path.dirname(f"/dev/{name}"))
        c.run("mknod", "-m", "0666", f"/dev/{name}", kind, str(major), str(minor))
    c.run("touch", "/tmp/other-service-file")
    # the unit's device list as systemd resolved it (char-nvidia-* from /proc/devices)
    allow = c.show("healthd.service", "DeviceAllow", "DevicePolicy")
    assert allow["DevicePolicy"] == "closed", allow
    c.run("systemctl", "start", "healthd.service")
    deadline = time.monotonic() + 60
    while "PROBE " not in (journal := c.journal("-u", "healthd.service", "-o", "cat")):
        assert time.monotonic() < deadline, journal[-4000:]
        time.sleep(0.1)
    got = json.loads(journal.split("PROBE ", 1)[1].splitlines()[0])
    print(json.dumps(got, indent=1, sort_keys=True))
    assert got == EXPECTED
    # systemd's own rating of the same sandbox ("Overall exposure level for healthd.service: 2.6 OK")
    security = c.run("systemd-analyze", "security", "--no-pager", "healthd.service", check=False).stdout
    overall = [ln for ln in security.splitlines() if ln.startswith("→ Overall exposure level")]
    print(overall)
    assert overall and float(overall[0].split(":")[1].split()[0]) <= 3.0, security[-3000:]


# ------------------------------------------------------------------------------------- controller

SLURM_STUB = """#!/bin/sh
# test only: a Slurm client whose slurmctld is unreachable, slowly when the test says so
if [ -e /etc/healthd-test/slurm-sleep ]; then sleep "$(cat /etc/healthd-test/slurm-sleep)"; fi
echo "slurm_load_node: Unable to contact slurm controller (connect failure)" >&2
exit 1
"""


def controller_stage(stage: Stage, **dropins: str) -> None:
    slurm_bin = stage.tmp / "slurm-bin"
    slurm_bin.mkdir()
    for tool in ("scontrol", "sinfo", "squeue"):
        (slurm_bin / tool).write_text(SLURM_STUB)
        (slurm_bin / tool).chmod(0o755)
    etc_slurm = stage.tmp / "etc-slurm"
    etc_slurm.mkdir()
    (etc_slurm / "slurm.conf").write_text("ClusterName=test\nSlurmctldHost=head(127.0.0.1)\n")
    stage.binds += [(str(slurm_bin), "/usr/local/bin"), (str(etc_slurm), "/etc/slurm")]
    (stage.etc / "controller.yaml").write_text(yaml.safe_dump({"listen": "127.0.0.1:9841",
                                                               "policy": {"mode": "observe"}}))
    stage.unit("healthd-controller.service", **dropins)


def test_controller_active_after_ready_and_watchdog_restart(stage):
    """READY=1 only after the first control round returned (each Slurm call takes 3 s at start: the
    unit is `activating` meanwhile); then rounds hung in Slurm (8 s per call, under the client's 10 s
    timeout) stop the feeding and systemd restarts the controller."""
    controller_stage(stage, **{"watchdog.conf": f"""\
        # test only: a 4 s watchdog instead of 60 s
        [Service]
        WatchdogSec={WATCHDOG_S}
        """})
    knob = stage.knobs / "slurm-sleep"
    knob.write_text("3")
    c = stage.boot()
    c.run("systemctl", "start", "--no-block", "healthd-controller.service")
    seen, first = wait_active(c, "healthd-controller.service")
    knob.unlink()
    t = timing(c, "healthd-controller.service")
    ready_after = t["ActiveEnter"] - t["ExecMainStart"]
    print(f"controller states {seen}; READY {ready_after:.2f} s after ExecStart")
    assert "activating/start" in seen and 3.0 <= ready_after < 60, (seen, t)
    assert c.run("test", "-s", "/var/lib/healthd/ledger.sqlite", check=False).returncode == 0
    assert "Slurm unreachable" in c.show("healthd-controller.service", "StatusText")["StatusText"]
    limits = c.run("cat", f"/proc/{first['MainPID']}/limits").stdout
    assert [ln.split()[3:5] for ln in limits.splitlines() if ln.startswith("Max open files")] == [["8192", "8192"]]

    hung_at = time.monotonic()
    timeout_after = hang_until_watchdog(c, "healthd-controller.service", lambda: knob.write_text("8"))
    knob.unlink()
    _, again = wait_active(c, "healthd-controller.service", not_pid=first["MainPID"], timeout=90)
    print(f"controller: hung round -> 'Watchdog timeout' {timeout_after:.1f} s, "
          f"-> active again {time.monotonic() - hung_at:.1f} s")
    assert int(again["NRestarts"]) >= 1
    journal = c.journal("-u", "healthd-controller.service")
    assert re.search(r"Main process exited, code=(killed|dumped), status=6/ABRT", journal), journal[-4000:]
    assert "Failed with result 'watchdog'" in journal, journal[-4000:]


FLOOD = r'''
import json, resource, select, socket, sys, time
port, addrs, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks, errors = [], []
t0 = time.monotonic()
# all at once, non-blocking: the controller's accept loop is the only pace (its 15 s idle timeout
# would close the first ones while a sequential loop still connected the last)
pending = {}
for a in range(addrs):
    src = f"127.0.{1 + a // 250}.{2 + a % 250}"
    for _ in range(per):
        s = socket.socket()
        s.bind((src, 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        pending[s.fileno()] = s
poller = select.poll()
for fd in pending:
    poller.register(fd, select.POLLOUT)
deadline = time.monotonic() + 30
while pending and time.monotonic() < deadline:
    for fd, _ in poller.poll(1000):
        s = pending.pop(fd)
        poller.unregister(fd)
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            errors.append(err)
            s.close()
        else:
            socks.append(s)
errors += ["pending"] * len(pending)
connect_s = time.monotonic() - t0
# the controller works through the accept queue at its own pace (a loaded machine takes seconds):
# read answers until every connection past the expected limit has one, or 10 s (under its 15 s idle
# timeout, so a held connection is never closed by that while this looks)
expect_refused = len(socks) - int(sys.argv[4]) if len(sys.argv) > 4 else None
open_socks = {s.fileno(): s for s in socks}
poller = select.poll()
for fd in open_socks:
    poller.register(fd, select.POLLIN)
refused, other = 0, []


def read_answers(wait_ms):
    global refused
    for fd, _ in poller.poll(wait_ms):
        s = open_socks.pop(fd)
        poller.unregister(fd)
        try:
            data = s.recv(4096)
        except OSError as e:
            data = repr(e).encode()
        if data.startswith(b"HTTP/1.1 503"):
            refused += 1
        else:
            other.append(data[:80].decode("latin-1"))
        s.close()


if expect_refused is None:
    time.sleep(2)
else:
    deadline = time.monotonic() + 10
    while refused + len(other) < expect_refused and time.monotonic() < deadline:
        read_answers(200)
    time.sleep(0.5)  # a little longer: a held connection must stay unanswered
read_answers(0)
held = list(open_socks.values())
# one more, from an address with nothing open: over max_connections, so refused at once
extra = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.9.9", 0))
try:
    extra_answer = extra.recv(4096).split(b"\r\n", 1)[0].decode()
except OSError as e:
    extra_answer = repr(e)
extra.close()
check_s = time.monotonic() - t0 - connect_s
print(json.dumps({"connected": len(socks), "errors": errors[:5], "n_errors": len(errors), "held": len(held),
                  "refused": refused, "other": other[:5], "n_other": len(other), "extra": extra_answer,
                  "connect_s": round(connect_s, 2), "check_s": round(check_s, 2)}), flush=True)
sys.stdin.readline()  # hold them until the test has looked at the controller
for s in held:
    s.close()
'''


def test_controller_connection_limit_fits_its_open_file_limit(stage):
    """max_connections (4096 by default, 32 per source address) against the unit's LimitNOFILE=8192:
    4096 connections held open from 128 loopback addresses plus 385 more. The controller keeps
    exactly 4096, answers every other one 503 at once, never fails an accept() (EMFILE), and stays
    up. MUNGE: no report is signed here; a connection is admitted or refused before any credential
    is read, so the limits are exercised without munged."""
    controller_stage(stage)
    c = stage.boot()
    c.run("systemctl", "start", "healthd-controller.service")
    _, props = wait_active(c, "healthd-controller.service")
    pid = props["MainPID"]
    # the listening socket's backlog (ss's Send-Q) is the server's 1024, not asyncio's default 100:
    # with 100, a burst of connections overflows the accept queue and the kernel drops their final ACKs
    listen = subprocess.run(["nsenter", "-t", str(c.pid), "-n", "ss", "-Hltn", "sport = :9841"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert listen[0] == "LISTEN" and listen[2] == "1024", listen
    flood = subprocess.Popen(["nsenter", "-t", str(c.pid), "-n", sys.executable, "-c", FLOOD, "9841", "140", "32", "4096"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = flood.stdout.readline()
        assert line, flood.stderr.read()
        got = json.loads(line)
        fds = int(c.run("sh", "-c", f"ls /proc/{pid}/fd | wc -l").stdout)
        print(f"flood: {got}; controller fds while held: {fds}")
        assert got["connected"] == 140 * 32 and got["n_errors"] == 0, got
        assert got["held"] == 4096 and got["refused"] == 140 * 32 - 4096 and got["n_other"] == 0, got
        assert got["extra"] == "HTTP/1.1 503 Service Unavailable", got
        assert 4096 < fds < 8192, fds
        assert c.show("healthd-controller.service", "MainPID", "ActiveState", "NRestarts") == \
            {"MainPID": pid, "ActiveState": "active", "NRestarts": "0"}
    finally:
        flood.stdin.close()
        flood.wait(timeout=60)
    # all closed: it serves again
    health = c.run("python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                   "'http://127.0.0.1:9841/healthz', timeout=5).status)", namespaces=("-n", "-m", "-p")).stdout
    assert health.strip() == "200"
    journal = c.journal("-u", "healthd-controller.service", "-o", "cat")
    assert "refused: 503" in journal and "(max_connections)" in journal, journal[-4000:]
    assert "accepting a connection failed" not in journal and "Too many open files" not in journal, journal[-4000:]
    assert "open-file limit" not in journal, journal[-4000:]


def test_controller_under_the_default_open_file_limit_fails_accepts(stage):
    """The control for the test above: the same flood with systemd's default soft limit (1024, here
    also the hard limit so the controller cannot raise it) makes accept() fail with EMFILE, and the
    controller says so at start and when it happens. What LimitNOFILE=8192 in the unit prevents."""
    controller_stage(stage, **{"nofile.conf": """\
        # test only: systemd's default soft open-file limit instead of the unit's LimitNOFILE=8192
        [Service]
        LimitNOFILE=1024
        """})
    c = stage.boot()
    c.run("systemctl", "start", "healthd-controller.service")
    _, props = wait_active(c, "healthd-controller.service")
    flood = subprocess.Popen(["nsenter", "-t", str(c.pid), "-n", sys.executable, "-c", FLOOD, "9841", "40", "32"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = flood.stdout.readline()
        assert line, flood.stderr.read()
        fds = int(c.run("sh", "-c", f"ls /proc/{props['MainPID']}/fd | wc -l").stdout)
        print(f"flood under LimitNOFILE=1024: {line.strip()}; controller fds: {fds}")
        assert fds <= 1024
    finally:
        flood.stdin.close()
        flood.wait(timeout=60)
    journal = c.journal("-u", "healthd-controller.service", "-o", "cat")
    assert "open-file limit (RLIMIT_NOFILE soft 1024, hard 1024)" in journal, journal[-4000:]
    assert "accepting a connection failed" in journal and "Too many open files" in journal, journal[-4000:]
