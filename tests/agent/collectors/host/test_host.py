"""HostCollector against a fake /proc tree and real filesystem probes on temporary directories.

The hung filesystem is real: the collector is given a probe that first opens a FIFO the test made
(outside the probed directory) for writing, so the probe thread blocks in the kernel exactly as a
write to a dead NFS server does, until the test opens the read end; then the real write_probe runs.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from healthd.agent.collectors import host
from healthd.agent.collectors.host import (
    PROBE_PREFIX,
    HostCollector,
    find_mount,
    parse_meminfo,
    parse_mounts,
    parse_psi,
    parse_stat,
    write_probe,
)
from healthd.model import FilesystemProbe
from healthd.settings import FilesystemSpec

MEMINFO = """\
MemTotal:       2113290240 kB
MemFree:         101234567 kB
MemAvailable:   1850000000 kB
Buffers:            123456 kB
Cached:          900000000 kB
Active(file):    400000000 kB
Inactive(file):  300000000 kB
SReclaimable:     50000000 kB
HugePages_Total:       0
"""

PSI_MEMORY = "some avg10=1.50 avg60=0.75 avg300=0.10 total=123456\nfull avg10=0.25 avg60=0.05 avg300=0.00 total=7890\n"
PSI_IO = "some avg10=12.00 avg60=8.00 avg300=2.50 total=99999999\nfull avg10=55.10 avg60=40.00 avg300=9.00 total=88888888\n"
PSI_CPU = "some avg10=0.00 avg60=0.00 avg300=0.00 total=42\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def stat_line(pid: int, comm: str, state: str) -> str:
    return f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 1000 0 0 0 12 34 0 0 20 0 1 0 100 0 0\n"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A fake /proc: meminfo, pressure/*, mounts, and processes."""
    p = tmp_path / "proc"
    (p / "pressure").mkdir(parents=True)
    (p / "meminfo").write_text(MEMINFO)
    (p / "pressure" / "memory").write_text(PSI_MEMORY)
    (p / "pressure" / "io").write_text(PSI_IO)
    (p / "pressure" / "cpu").write_text(PSI_CPU)
    procs = {
        1: ("systemd", "S"),
        42: ("my (weird) ) proc", "D"),  # spaces and parentheses in comm: parse from the last ')'
        77: ("kworker/u8:2+flush-0:52", "D"),
        300: ("python3 ", "R"),
        301: ("D", "S"),  # a comm that looks like a state
    }
    for pid, (comm, state) in procs.items():
        (p / str(pid)).mkdir()
        (p / str(pid) / "stat").write_text(stat_line(pid, comm, state))
    # a multi-threaded process whose main thread sleeps while a worker is stuck in D
    (p / "500").mkdir()
    (p / "500" / "stat").write_text(stat_line(500, "pt_main_thread", "S"))
    for tid, comm, state in ((500, "pt_main_thread", "S"), (517, "ckpt_writer", "D"), (518, "pt_data", "S")):
        (p / "500" / "task" / str(tid)).mkdir(parents=True)
        (p / "500" / "task" / str(tid) / "stat").write_text(stat_line(tid, comm, state))
    # not processes, or gone / malformed
    (p / "self").mkdir()
    (p / "self" / "stat").write_text(stat_line(9, "self", "D"))
    (p / "888").mkdir()  # exited between listdir and read: no stat file
    (p / "999").mkdir()
    (p / "999" / "stat").write_text("garbage\n")
    (p / "mounts").write_text(mounts_text(tmp_path))
    return p


def mounts_text(tmp_path: Path) -> str:
    ckpt = str(tmp_path / "ckpt")
    spaced = str(tmp_path / "my data").replace(" ", "\\040")
    return (
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "proc /proc proc rw 0 0\n"
        f"tmpfs {tmp_path}/ck tmpfs rw 0 0\n"  # a prefix of "ckpt" as a string, not as a path
        f"nfs1:/ckpt {ckpt} nfs4 rw,vers=4.2 0 0\n"
        f"10.0.0.5@o2ib:/lustre {spaced} lustre rw,flock 0 0\n"
    )


def make_dirs(tmp_path: Path) -> dict[str, Path]:
    d = {name: tmp_path / name for name in ("ckpt", "local", "my data")}
    for p in d.values():
        p.mkdir(exist_ok=True)
    return d


def probe_threads(path: Path) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"healthd-fsprobe:{path}" and t.is_alive()]


class Hang:
    """A probe for HostCollector(probe=...) that hangs chosen directories for real: it first opens a
    FIFO for writing, which sleeps in the kernel until release() opens the read end (the "server"
    answers), and then runs the real write_probe. Once released, the FIFO keeps its reader, so later
    probes of that directory pass straight through."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.fifos: dict[str, Path] = {}
        self.readers: dict[str, int] = {}
        self.calls: list[str] = []
        self.threads: list[threading.Thread] = []

    def hang(self, directory: Path) -> None:
        fifo = self.tmp_path / f"gate-{len(self.fifos)}"
        os.mkfifo(fifo)
        self.fifos[str(directory)] = fifo

    def probe(self, directory: str):
        self.calls.append(directory)
        self.threads.append(threading.current_thread())
        fifo = self.fifos.get(directory)
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY))  # blocks until a reader appears
        return write_probe(directory)

    def release(self, directory: Path) -> None:
        if str(directory) not in self.readers:
            self.readers[str(directory)] = os.open(self.fifos[str(directory)], os.O_RDONLY | os.O_NONBLOCK)

    def close(self) -> None:
        """Release everything (a failed assertion must not leave threads blocked) and wait for them."""
        for d in self.fifos:
            self.release(Path(d))
        for t in self.threads:
            t.join(timeout=5.0)
        for fd in self.readers.values():
            os.close(fd)


@pytest.fixture
def hang(tmp_path: Path):
    h = Hang(tmp_path)
    yield h
    h.close()


# --------------------------------------------------------------------------- pure parsers


def test_parse_meminfo():
    assert parse_meminfo(MEMINFO) == (1850000000 * 1024, 2113290240 * 1024)


def test_parse_meminfo_without_memavailable_estimates_like_psutil():
    text = "\n".join(line for line in MEMINFO.splitlines() if not line.startswith("MemAvailable"))
    assert parse_meminfo(text) == ((101234567 + 400000000 + 300000000 + 50000000) * 1024, 2113290240 * 1024)


def test_parse_psi():
    assert parse_psi(PSI_MEMORY) == {
        "some_avg10": 1.5, "some_avg60": 0.75, "some_avg300": 0.1, "some_total": 123456.0,
        "full_avg10": 0.25, "full_avg60": 0.05, "full_avg300": 0.0, "full_total": 7890.0,
    }
    # /proc/pressure/cpu had no "full" line before Linux 5.13
    assert parse_psi("some avg10=0.10 avg60=0.00 avg300=0.00 total=5\n") == {
        "some_avg10": 0.1, "some_avg60": 0.0, "some_avg300": 0.0, "some_total": 5.0,
    }
    with pytest.raises(ValueError):
        parse_psi("some avg10=abc\n")


@pytest.mark.parametrize(
    "line,expected",
    [
        (stat_line(1, "systemd", "S"), ("systemd", "S")),
        (stat_line(42, "my (weird) ) proc", "D"), ("my (weird) ) proc", "D")),
        (stat_line(7, ") D (", "R"), (") D (", "R")),
        (stat_line(8, "", "Z"), ("", "Z")),
    ],
)
def test_parse_stat(line, expected):
    assert parse_stat(line) == expected


def test_parse_mounts_and_find_mount():
    mounts = parse_mounts(
        "/dev/vda / ext4 rw 0 0\n"
        "srv:/a /mnt/a nfs4 rw 0 0\n"
        "srv:/b /mnt/a\\040b nfs rw 0 0\n"
        "tmpfs /mnt/a tmpfs rw 0 0\n"  # over-mounts the NFS mount
        "short line\n"
    )
    assert mounts == [("/", "ext4"), ("/mnt/a", "nfs4"), ("/mnt/a b", "nfs"), ("/mnt/a", "tmpfs")]
    assert find_mount("/mnt/a/x/y", mounts) == ("/mnt/a", "tmpfs")
    assert find_mount("/mnt/a b/", mounts) == ("/mnt/a b", "nfs")
    assert find_mount("/mnt/ab", mounts) == ("/", "ext4")
    assert find_mount("/", mounts) == ("/", "ext4")
    assert find_mount("/x", []) is None


# --------------------------------------------------------------------------- proc


def test_memory_psi_and_dstate(proc):
    s = HostCollector(proc_root=str(proc)).collect(1000.0)
    assert (s.status, s.detail) == ("ok", "")
    assert s.mem_available_bytes == 1850000000 * 1024
    assert s.mem_total_bytes == 2113290240 * 1024
    assert set(s.psi) == {"cpu", "memory", "io"}
    assert s.psi["io"]["full_avg10"] == 55.1
    assert s.psi["memory"]["some_total"] == 123456.0
    assert s.psi["cpu"]["some_total"] == 42.0
    assert s.dstate_pids == ((42, "my (weird) ) proc"), (77, "kworker/u8:2+flush-0:52"), (500, "pt_main_thread"))
    assert s.filesystems == ()


def test_no_psi_is_empty_not_an_error(proc, caplog):
    for f in (proc / "pressure").iterdir():
        f.unlink()
    (proc / "pressure").rmdir()
    with caplog.at_level(logging.WARNING):
        s = HostCollector(proc_root=str(proc)).collect(1.0)
    assert (s.status, s.psi) == ("ok", {})
    assert caplog.records == []


def test_partial_and_malformed_psi(proc, caplog):
    (proc / "pressure" / "cpu").unlink()
    (proc / "pressure" / "io").write_text("some avg10=oops\n")
    c = HostCollector(proc_root=str(proc))
    with caplog.at_level(logging.WARNING):
        s = c.collect(1.0)
        c.collect(2.0)
    assert set(s.psi) == {"memory"}
    assert s.status == "ok"
    assert len(caplog.records) == 1  # logged once, not per tick
    assert "pressure/io" in caplog.text


def test_missing_meminfo_is_an_error_but_the_rest_is_read(proc):
    (proc / "meminfo").unlink()
    s = HostCollector(proc_root=str(proc)).collect(1.0)
    assert s.status == "error"
    assert s.detail == f"cannot read {proc}/meminfo: ENOENT: No such file or directory"
    assert (s.mem_available_bytes, s.mem_total_bytes) == (None, None)
    assert len(s.dstate_pids) == 3 and "memory" in s.psi


def test_real_proc_reads():
    s = HostCollector().collect(time.time())
    assert s.status == "ok"
    assert 0 < s.mem_available_bytes <= s.mem_total_bytes
    assert all(isinstance(pid, int) and isinstance(comm, str) for pid, comm in s.dstate_pids)


def _gate_files(proc: Path, blocked: int, load1: float) -> None:
    (proc / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nprocs_running 1\nprocs_blocked {blocked}\n")
    (proc / "loadavg").write_text(f"{load1:.2f} 0.10 0.05 1/300 4242\n")


def test_dstate_scan_skipped_on_a_quiet_node(proc):
    # The fake's D tasks contradict its quiet /proc/stat and load: they stay unseen, proving no scan.
    _gate_files(proc, blocked=0, load1=0.02)
    c = HostCollector(proc_root=str(proc), dstate_scan_min_load=0.5, dstate_scan_interval_s=30.0)
    assert c.collect(1.0).dstate_pids == () and c.dstate_scans == 0


def test_dstate_scan_runs_while_tasks_are_blocked_and_while_some_were_found(proc):
    _gate_files(proc, blocked=2, load1=0.02)
    c = HostCollector(proc_root=str(proc), dstate_scan_min_load=0.5, dstate_scan_interval_s=30.0)
    assert len(c.collect(1.0).dstate_pids) == 3
    _gate_files(proc, blocked=0, load1=0.02)  # the blocked count is instantaneous; the D tasks remain
    assert len(c.collect(2.0).dstate_pids) == 3 and c.dstate_scans == 2
    for pid in (42, 77):
        (proc / str(pid) / "stat").write_text(stat_line(pid, "x", "S"))
    (proc / "500" / "task" / "517" / "stat").write_text(stat_line(517, "ckpt_writer", "S"))
    assert c.collect(3.0).dstate_pids == () and c.dstate_scans == 3  # cleared: seen by a scan
    assert c.collect(4.0).dstate_pids == () and c.dstate_scans == 3


def test_dstate_scan_under_load_runs_at_most_every_interval(proc, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("healthd.agent.collectors.host.time.monotonic", lambda: clock[0])
    for pid in (42, 77):
        (proc / str(pid) / "stat").write_text(stat_line(pid, "x", "S"))
    (proc / "500" / "task" / "517" / "stat").write_text(stat_line(517, "ckpt_writer", "S"))
    _gate_files(proc, blocked=0, load1=3.5)
    c = HostCollector(proc_root=str(proc), dstate_scan_min_load=0.5, dstate_scan_interval_s=30.0)
    c.collect(1.0)
    clock[0] += 10
    c.collect(2.0)
    assert c.dstate_scans == 1
    (proc / "42" / "stat").write_text(stat_line(42, "nfs_writer", "D"))
    clock[0] += 20
    assert c.collect(3.0).dstate_pids == ((42, "nfs_writer"),) and c.dstate_scans == 2


def test_unreadable_gate_files_scan_every_tick(proc):
    (proc / "loadavg").write_text("garbage\n")
    (proc / "stat").write_text("procs_blocked 0\n")
    c = HostCollector(proc_root=str(proc), dstate_scan_min_load=0.5, dstate_scan_interval_s=30.0)
    assert len(c.collect(1.0).dstate_pids) == 3 and c.dstate_scans == 1


# --------------------------------------------------------------------------- filesystems


def test_probes_on_real_directories(tmp_path, proc):
    d = make_dirs(tmp_path)
    specs = [
        FilesystemSpec(path=str(d["ckpt"]), role="checkpoint", timeout_s=5.0),
        FilesystemSpec(path=str(d["local"]), role="scratch", timeout_s=5.0),
        FilesystemSpec(path=str(d["my data"]) + "/", role="dataset", timeout_s=5.0),
    ]
    c = HostCollector(proc_root=str(proc), filesystems=specs)
    s = c.collect(1000.0)
    ckpt, local, data = s.filesystems
    assert (ckpt.path, ckpt.role, ckpt.mounted, ckpt.fstype, ckpt.mount_point) == (
        str(d["ckpt"]), "checkpoint", True, "nfs4", str(d["ckpt"])
    )
    assert (ckpt.writable, ckpt.timed_out, ckpt.error) == (True, False, None)
    assert 0 < ckpt.latency_s < 5.0
    # a plain directory on the root filesystem is not a mount of its own
    assert (local.mounted, local.fstype, local.mount_point, local.writable) == (False, "ext4", "/", True)
    assert (data.mounted, data.fstype, data.mount_point) == (True, "lustre", str(d["my data"]))
    assert data.writable is True
    # the probe cleans up after itself
    assert [list(p.iterdir()) for p in d.values()] == [[], [], []]
    assert probe_threads(d["ckpt"]) == []


def test_non_writable_paths(tmp_path, proc):
    missing = tmp_path / "ckpt" / "not-there"
    a_file = tmp_path / "local"
    a_file.write_text("I am a file\n")
    c = HostCollector(
        proc_root=str(proc),
        filesystems=[FilesystemSpec(path=str(missing)), FilesystemSpec(path=str(a_file))],
    )
    gone, notdir = c.collect(1.0).filesystems
    assert gone == FilesystemProbe(
        path=str(missing), role="filesystem", mounted=True, writable=False, latency_s=None,
        error=f"cannot stat {missing}: ENOENT: No such file or directory",
        fstype="nfs4", mount_point=str(tmp_path / "ckpt"),
    )
    assert (notdir.writable, notdir.latency_s, notdir.timed_out) == (False, None, False)
    assert notdir.error == f"{a_file} is not a directory"


def test_planted_files_do_not_affect_the_probe(tmp_path, proc):
    """A user who can write the directory plants FIFOs, symlinks and hard links at the old fixed name
    and at guesses of the pattern: the probe never opens them, so it neither blocks nor writes."""
    d = make_dirs(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    guess = f"{PROBE_PREFIX}.{os.getpid()}."
    os.mkfifo(d["ckpt"] / PROBE_PREFIX)
    os.mkfifo(d["ckpt"] / (guess + "0" * 16))
    os.symlink(victim, d["ckpt"] / (guess + "f" * 16))
    os.symlink(victim, d["local"] / PROBE_PREFIX)
    os.link(victim, d["local"] / (guess + "0" * 16))
    os.mkfifo(d["local"] / (guess + "1" * 16))
    planted = {p: sorted(p.iterdir()) for p in (d["ckpt"], d["local"])}
    c = HostCollector(
        proc_root=str(proc),
        filesystems=[FilesystemSpec(path=str(p), timeout_s=5.0) for p in planted],
    )
    for tick in (1.0, 2.0):
        t0 = time.monotonic()
        probes = c.collect(tick).filesystems
        assert time.monotonic() - t0 < 2.0
        assert [(p.writable, p.timed_out, p.error) for p in probes] == [(True, False, None)] * 2
        assert victim.read_text() == "precious\n"
        # nothing planted changed, and no probe file is left behind
        assert {p: sorted(p.iterdir()) for p in planted} == planted
        assert [p.is_fifo() for p in planted[d["ckpt"]]] == [True, True, False]
        assert all(probe_threads(p) == [] for p in planted)


def test_even_a_correct_guess_never_opens_the_planted_file(tmp_path, proc, monkeypatch):
    """O_EXCL, not only the random name: were the name guessed, the probe fails at once with EEXIST
    instead of blocking on a FIFO or writing through a symlink."""
    monkeypatch.setattr(host.secrets, "token_hex", lambda n: "ab" * n)
    d = make_dirs(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    name = f"{PROBE_PREFIX}.{os.getpid()}.{'ab' * 8}"
    os.mkfifo(d["ckpt"] / name)
    os.symlink(victim, d["local"] / name)
    c = HostCollector(
        proc_root=str(proc),
        filesystems=[FilesystemSpec(path=str(d["ckpt"]), timeout_s=2.0), FilesystemSpec(path=str(d["local"]), timeout_s=2.0)],
    )
    try:
        fifo, sym = c.collect(1.0).filesystems
    finally:  # were the FIFO opened, release the thread blocked on it
        os.close(os.open(d["ckpt"] / name, os.O_RDONLY | os.O_NONBLOCK))
    assert (fifo.writable, fifo.timed_out) == (False, False)
    assert fifo.error == f"cannot create {d['ckpt'] / name}: EEXIST: File exists"
    assert (sym.writable, sym.timed_out) == (False, False)
    assert sym.error == f"cannot create {d['local'] / name}: EEXIST: File exists"
    assert victim.read_text() == "precious\n"
    assert (d["ckpt"] / name).is_fifo() and (d["local"] / name).is_symlink()


def test_failed_write_leaves_no_probe_file(tmp_path, monkeypatch):
    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(host.os, "fsync", eio)
    writable, latency, error = write_probe(str(tmp_path))
    assert (writable, latency) == (False, None)
    assert error.startswith(f"write+fsync of {tmp_path}/{PROBE_PREFIX}.{os.getpid()}.")
    assert error.endswith(" failed: EIO: Input/output error")
    assert list(tmp_path.iterdir()) == []


def test_unreadable_mount_table(tmp_path, proc):
    (proc / "mounts").unlink()
    d = make_dirs(tmp_path)
    (fs,) = HostCollector(proc_root=str(proc), filesystems=[FilesystemSpec(path=str(d["ckpt"]))]).collect(1.0).filesystems
    assert (fs.mounted, fs.mount_point, fs.fstype, fs.writable) == (False, None, None, True)
    assert fs.error == f"cannot read {proc}/mounts: ENOENT: No such file or directory"


def test_hung_filesystem_times_out_and_is_not_probed_again(tmp_path, proc, hang):
    d = make_dirs(tmp_path)
    hang.hang(d["ckpt"])
    specs = [
        FilesystemSpec(path=str(d["ckpt"]), role="checkpoint", timeout_s=0.5),
        FilesystemSpec(path=str(d["local"]), role="scratch", timeout_s=0.5),
    ]
    c = HostCollector(proc_root=str(proc), filesystems=specs, probe=hang.probe)
    t0 = time.monotonic()
    hung, ok = c.collect(1000.0).filesystems
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 1.5, elapsed
    assert hung == FilesystemProbe(
        path=str(d["ckpt"]), role="checkpoint", mounted=True, writable=None, latency_s=None,
        timed_out=True, error=f"write+fsync probe in {d['ckpt']} did not finish within 0.5s",
        fstype="nfs4", mount_point=str(d["ckpt"]),
    )
    assert (ok.writable, ok.timed_out) == (True, False)  # the healthy filesystem is unaffected
    (stuck,) = probe_threads(d["ckpt"])

    # next tick: no second probe, no wait, "still hung since" the first tick
    t0 = time.monotonic()
    hung2, ok2 = c.collect(1010.0).filesystems
    assert time.monotonic() - t0 < 0.4
    assert hung2.timed_out is True and hung2.writable is None and hung2.latency_s is None
    assert hung2.error == (
        "previous probe still hung since 1970-01-01T00:16:40.000+00:00 (10s); not starting another"
    )
    assert hung2.mounted is True
    assert probe_threads(d["ckpt"]) == [stuck]
    assert hang.calls.count(str(d["ckpt"])) == 1
    assert ok2.writable is True

    # the "server" answers: open the read end, the stuck open() returns, the real probe runs and the
    # thread ends, leaving no probe file behind
    hang.release(d["ckpt"])
    stuck.join(timeout=5.0)
    assert not stuck.is_alive()
    assert list(d["ckpt"].iterdir()) == []

    # the stuck probe is gone: the next tick probes afresh and the filesystem is healthy
    again, _ = c.collect(1020.0).filesystems
    assert (again.writable, again.timed_out, again.error) == (True, False, None)
    assert hang.calls.count(str(d["ckpt"])) == 2
    assert probe_threads(d["ckpt"]) == []


def test_hung_probes_wait_in_parallel(tmp_path, proc, hang):
    dirs = [tmp_path / f"hung{i}" for i in range(3)]
    for p in dirs:
        p.mkdir()
        hang.hang(p)
    c = HostCollector(
        proc_root=str(proc), filesystems=[FilesystemSpec(path=str(p), timeout_s=0.5) for p in dirs], probe=hang.probe
    )
    t0 = time.monotonic()
    probes = c.collect(1.0).filesystems
    elapsed = time.monotonic() - t0
    assert [p.timed_out for p in probes] == [True, True, True]
    assert elapsed < 1.2, f"collect took {elapsed:.2f}s: probes waited one after another"
    for p in dirs:
        hang.release(p)
    for p in dirs:
        for t in probe_threads(p):
            t.join(timeout=5.0)
        assert probe_threads(p) == []
        assert list(p.iterdir()) == []
