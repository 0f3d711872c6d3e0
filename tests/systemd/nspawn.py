"""A real systemd as PID 1 for the unit tests: a cached Debian root file system booted with
systemd-nspawn, the project's unit files installed into it unchanged.

Build (once, cached): `python -m tests.systemd.nspawn build` (make nspawn-rootfs) runs
`debootstrap --variant=minbase` for the host's own Debian release with ROOTFS_PACKAGES, from the
Debian mirror apt on this machine is configured with (read from /etc/apt/sources.list*, never
hard-coded). The tree lands in build/nspawn/rootfs-<key>, where <key> is a hash of what it installs
(release, architecture, variant, packages, RECIPE); a second build with the same key is a no-op, a
new key replaces the old tree. The host's release is used so that its python3 is the interpreter the
venv was made for (the compiled extensions in the venv load in the container).

Boot: `Container(rootfs, binds).start()` runs
    systemd-nspawn -D ROOT --boot --register=no --keep-unit --console=pipe --volatile=overlay
                   --private-network --capability=CAP_BPF,CAP_SYSLOG --bind-ro=... </dev/null
with SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 and SYSTEMD_SECCOMP=0, and waits for `systemctl
is-system-running` in it. Why each:
  * --register=no --keep-unit: the host has no systemd/machined to register with.
  * --volatile=overlay: the cached tree is the lower layer of an overlay whose upper layer is a tmpfs
    that goes with the container; a run never changes the cache.
  * --private-network: the container has only its own loopback; nothing leaves it (and nspawn keeps
    CAP_NET_ADMIN in it, which attaching a device-policy BPF program needs).
  * cgroup v2 for the container (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1) and bpf() allowed
    (--capability=CAP_BPF, and SYSTEMD_SECCOMP=0: nspawn's own seccomp filter denies bpf()): only then
    does the container's systemd enforce DevicePolicy=/DeviceAllow= (a BPF program per unit). Without
    them a unit's device list is silently not applied and a device test would prove nothing.
  * CAP_SYSLOG: nspawn leaves it out of the container's bounding set, and healthd.service keeps
    exactly that one (/dev/kmsg); a host's systemd has it to give.
Driving it: `c.run("systemctl", ...)` is `nsenter -t <container's systemd pid> -a ...`.
One difference from a host: nspawn mounts a boot id of its own over /proc/sys/kernel/random/boot_id,
and a unit with ProtectKernelTunables= sees the kernel's again, so "this boot" in the journal (whose
entries carry nspawn's id) matches nothing inside such a unit. The agent's kernel log then reads no
lines of this boot in the container; on a host both ids are the kernel's.
Stop: SIGTERM to the nspawn process (it halts the container), SIGKILL to that same pid after 30 s.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "nspawn"
# systemd + dbus: PID 1 and systemctl's bus; python3: the interpreter of the venv's minor version;
# munge: munged and libmunge for the controller (as on a head node).
ROOTFS_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "munge")
VARIANT = "minbase"
# bump when the build steps below change in a way the key would not see
RECIPE = 1
COMPLETE = ".healthd-rootfs-complete"


def host_release() -> str:
    """VERSION_CODENAME of this machine's Debian (bookworm, trixie)."""
    text = Path("/etc/os-release").read_text()
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)\"?$", text, re.M)
    if not m:
        raise RuntimeError("/etc/os-release names no VERSION_CODENAME: not a Debian release debootstrap knows")
    return m.group(1)


def host_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()


def apt_mirror(release: str) -> str:
    """The URI apt uses for `release` main (deb822 .sources files and one-line .list files)."""
    files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + ["/etc/apt/sources.list"] + \
        sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
    for name in files:
        try:
            text = Path(name).read_text()
        except OSError:
            continue
        if name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    k, _, v = line.partition(":")
                    fields[k.strip().lower()] = v.strip()
                if release in fields.get("suites", "").split() and "main" in fields.get("components", "").split() \
                        and "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                    return fields["uris"].split()[0]
        else:
            for line in text.splitlines():
                parts = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(parts) >= 4 and parts[0] == "deb" and parts[2] == release and "main" in parts[3:]:
                    return parts[1]
    raise RuntimeError(f"no apt source for {release} main in /etc/apt/sources.list*")


def rootfs_key(release: str, arch: str) -> str:
    spec = {"release": release, "arch": arch, "variant": VARIANT, "packages": sorted(ROOTFS_PACKAGES),
            "recipe": RECIPE}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def rootfs_path() -> Path:
    return BUILD_DIR / f"rootfs-{rootfs_key(host_release(), host_arch())}"


def build_rootfs(log=print) -> Path:
    """The cached root file system, built first when it is missing (under a lock: a concurrent
    build waits for this one). Returns its path."""
    release, arch = host_release(), host_arch()
    root = BUILD_DIR / f"rootfs-{rootfs_key(release, arch)}"
    if (root / COMPLETE).exists():
        return root
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / COMPLETE).exists():
            return root
        tmp = BUILD_DIR / f".tmp-{root.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        cmd = ["debootstrap", f"--variant={VARIANT}", f"--arch={arch}", f"--include={','.join(ROOTFS_PACKAGES)}",
               release, str(tmp), apt_mirror(release)]
        log(f"nspawn rootfs: {' '.join(cmd[:-1])} <apt's {release} mirror>")
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"debootstrap failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
        # no getty on the pipe console; nothing else in a minbase tree waits for hardware
        for unit in ("console-getty.service", "getty@.service"):
            link = tmp / "etc/systemd/system" / unit
            link.unlink(missing_ok=True)
            link.symlink_to("/dev/null")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (tmp / cache).glob("*"):
                if f.is_file():
                    f.unlink()
        (tmp / COMPLETE).write_text(json.dumps({"release": release, "arch": arch, "packages": ROOTFS_PACKAGES,
                                                 "seconds": round(time.monotonic() - started, 1)}) + "\n")
        os.rename(tmp, root)
        for old in BUILD_DIR.glob("rootfs-*"):
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
        log(f"nspawn rootfs: {root} built in {time.monotonic() - started:.0f} s")
    return root


def nspawn_unusable() -> str:
    """Why no container can run here ('' when one can): the tool missing or not root."""
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is not installed (apt-get install systemd-container; make test installs it)"
    if shutil.which("nsenter") is None:
        return "nsenter is not installed (util-linux)"
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    return ""


def container_python(root: Path) -> tuple[int, int] | None:
    """major.minor of the rootfs's /usr/bin/python3 (from its stdlib directory name)."""
    target = os.readlink(root / "usr/bin/python3") if (root / "usr/bin/python3").is_symlink() else ""
    m = re.fullmatch(r"python(\d+)\.(\d+)", target)
    return (int(m.group(1)), int(m.group(2))) if m else None


HIDDEN_PATHS = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")  # what ProtectHome= and PrivateTmp= hide


def container_path(path: str | Path, alias: str) -> str:
    """Where a host directory is bound in the container: at its own path, unless the units' sandbox
    would hide it from them (a checkout under /root, /home or /tmp), then at `alias`."""
    path = str(path)
    return alias if any(path == h or path.startswith(h + "/") for h in HIDDEN_PATHS) else path


def venv_binds() -> list[tuple[str, str]]:
    """(host, container) read-only binds for this repository and its venv."""
    binds = [(str(REPO), container_path(REPO, "/srv/healthd-src"))]
    if not Path(sys.prefix).is_relative_to(REPO):
        binds.append((sys.prefix, container_path(sys.prefix, "/srv/healthd-venv")))
    return binds


def _in_container(path: str) -> str:
    for host, inside in venv_binds():
        if path == host or path.startswith(host + "/"):
            return inside + path[len(host):]
    return path


def install_venv_shim(dest: Path) -> None:
    """dest (bound at /opt/healthd in the container) becomes /opt/healthd/current: a venv of the
    container's /usr/bin/python3 whose site-packages is this host venv's (bound read-only), with the
    same console scripts. The host venv's own interpreter may live outside /usr (a pyenv build under
    /root, which ProtectHome= hides), so the container's python3 of the same minor version runs the
    venv's packages and compiled extensions."""
    cur = dest / "current"
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = cur / "lib" / ver / "site-packages"
    (cur / "bin").mkdir(parents=True)
    site.mkdir(parents=True)
    (cur / "bin/python3").symlink_to("/usr/bin/python3")
    (cur / "bin/python").symlink_to("python3")
    (cur / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n"
                                    f"version = {sys.version_info[0]}.{sys.version_info[1]}\n")
    host_site = _in_container(sysconfig.get_paths()["purelib"])
    repo = _in_container(str(REPO))
    # the venv's own .pth files (the editable install's path entry among them), and the checkout
    # itself in case that entry names a path the container has under another name
    (site / "healthd-host-venv.pth").write_text(
        f"import site, sys; site.addsitedir({host_site!r}); {repo!r} in sys.path or sys.path.append({repo!r})\n")
    for script in ("healthd", "healthd-controller", "healthctl"):
        src = Path(sys.executable).with_name(script)
        if src.exists():
            body = src.read_text().split("\n", 1)[1]
            (cur / "bin" / script).write_text("#!/opt/healthd/current/bin/python3\n" + body)
            (cur / "bin" / script).chmod(0o755)


class Container:
    """One booted container. `binds`: (host path, container path) pairs, mounted read-only;
    `rw_binds` the same, writable."""

    def __init__(self, rootfs: Path, workdir: Path, binds: list[tuple[str, str]],
                 rw_binds: list[tuple[str, str]] = ()):
        self.rootfs = rootfs
        self.workdir = workdir
        self.binds = binds
        self.rw_binds = list(rw_binds)
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # the container's systemd, as the host sees it
        self.log = workdir / "nspawn.log"
        self.boot_s = 0.0

    def start(self, timeout: float = 60) -> "Container":
        name = f"healthd-test-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
        cmd = ["systemd-nspawn", "-D", str(self.rootfs), "--boot", "--register=no", "--keep-unit",
               "--console=pipe", "--volatile=overlay", "--private-network", "--capability=CAP_BPF,CAP_SYSLOG",
               f"--machine={name}"]
        cmd += [f"--bind-ro={src}:{dst}" for src, dst in self.binds]
        cmd += [f"--bind={src}:{dst}" for src, dst in self.rw_binds]
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1", "SYSTEMD_SECCOMP": "0"}
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_booted(started, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_booted(self, started: float, timeout: float) -> None:
        deadline = started + timeout
        while not self.pid:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no systemd in the container after {timeout} s: {self.log.read_text()[-3000:]}")
            for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
                try:
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        self.pid = int(child)
                except OSError:
                    pass
            time.sleep(0.05)
        while True:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"container never finished booting ({state}): {self.journal()[-3000:]}")
            time.sleep(0.1)
        self.boot_s = time.monotonic() - started

    def run(self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None,
            namespaces: tuple[str, ...] = ("-a",)) -> subprocess.CompletedProcess:
        p = subprocess.run(["nsenter", "-t", str(self.pid), *namespaces, *argv], capture_output=True, text=True,
                           timeout=timeout, input=input)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} in the container: exit {p.returncode}\n{p.stdout}{p.stderr}")
        return p

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> str:
        return self.run("journalctl", "--no-pager", "-b", "-o", "short-monotonic", *args, check=False).stdout

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("command", choices=["build", "path"])
    args = ap.parse_args(argv)
    if args.command == "path":
        print(rootfs_path())
        return 0
    started = time.monotonic()
    root = build_rootfs()
    size = subprocess.run(["du", "-sm", str(root)], capture_output=True, text=True).stdout.split()[0]
    print(f"nspawn rootfs: {root} ({size} MB, {platform.machine()}), ready in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
