"""Other Slurm releases beside the host's: a cached Debian root file system per release of the
version matrix, and running a command (the suite's `matrix` tests) inside one.

API
---
    from tests.support import slurm_roots
    slurm_roots.matrix_releases()            # ['trixie', 'sid'] on a Debian 12 host ('bookworm', 'sid' on 13)
    root = slurm_roots.build_root("trixie")  # Path of the built tree (cached: a no-op when built)
    slurm_roots.root_path("trixie")          # where it is or would be, building nothing
    slurm_roots.unusable()                   # '' or why no root can run here (not root, no nspawn...)
    p = slurm_roots.run_in_root(root, ["scontrol", "--version"], timeout=60)   # CompletedProcess (text)
    argv = slurm_roots.nspawn_argv(root, [...], binds=[(host, inside)], rw_binds=[...], env={...})

CLI (make slurm-roots): `python -m tests.support.slurm_roots build [RELEASE ...]`,
`... path RELEASE`, `... run RELEASE -- CMD ...`.

What a root holds: Debian `<release>` (debootstrap --variant=minbase, from the Debian mirror apt on
this machine is configured with, read from /etc/apt/sources.list*, never hard-coded) with
PACKAGES[release] (Slurm's slurmctld/slurmd/clients, munge, python3, gcc for the fake NVML library),
and a venv at VENV made with `--system-site-packages` (the release's python3-systemd) holding the
project's runtime and test dependencies from pyproject.toml, less PIP_LEFT_OUT, and the project's
console scripts (healthd, healthd-healthcheck, ...). The project itself is not installed: the
checkout is bound into the container at its own path (read-only) and run_in_root() points the venv
at it with a .pth file, so a root serves any revision of the checkout.

Cache: build/slurm-roots/<release>-<key>, <key> a hash of the release, architecture, packages, the
pip requirements and RECIPE; a second build with the same key is a no-op, a new key replaces the old
tree. Each release builds under its own lock (a concurrent build of it waits for this one) into a
temporary directory renamed into place when complete.

Running (run_in_root / nspawn_argv): `systemd-nspawn -D ROOT --register=no --keep-unit
--console=pipe --volatile=overlay --as-pid2 --machine=healthd-<release>` with the host's network
(no --private-network: the Slurm daemons inside listen on 127.0.0.1 ports the host sees, and pick
them under the host's port lock, which is bound in) and no --boot (no systemd inside: the tests
start munged, slurmctld and slurmd themselves). --volatile=overlay: the cached tree is the lower
layer of an overlay whose upper layer is a tmpfs that goes with the container, so a run never
changes the cache. --as-pid2: a stub init as PID 1 reaps what the tests' daemons leave behind.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

from tests.systemd.nspawn import apt_mirror, host_arch, host_release

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "slurm-roots"

# Debian release -> the Slurm release it ships (what the matrix covers; the host's own is tested by
# the ordinary suite)
SLURM_OF = {"bookworm": "22.05", "trixie": "24.11", "sid": "26.05"}
# slurm-wlm: slurmctld, slurmd and the clients; munge: munged; python3-venv: the test venv;
# python3-systemd: the journal binding the venv sees (--system-site-packages) instead of building
# systemd-python; systemd-journal-remote: writes the journal files the agents read
# (tests/support/journal.py); gcc and libc6-dev: the fake NVML library (tests/support/fake_nvml.py);
# procps: ps and kill for a test's diagnostics; slurmdbd and mariadb-server: Slurm's accounting
# (tests/support/slurm_accounting.py)
COMMON_PACKAGES = ("slurm-wlm", "munge", "python3", "python3-venv", "python3-systemd", "systemd-journal-remote",
                   "gcc", "libc6-dev", "procps", "slurmdbd", "mariadb-server")
# what building pyslurm against the release's libslurm needs (pyslurm matches 24.11 only)
PYSLURM_BUILD_PACKAGES = ("libslurm-dev", "python3-dev")
PACKAGES: dict[str, tuple[str, ...]] = {
    "bookworm": COMMON_PACKAGES,
    "trixie": COMMON_PACKAGES + PYSLURM_BUILD_PACKAGES,
    "sid": COMMON_PACKAGES,
}
VARIANT = "minbase"
VENV = "/opt/healthd-test-venv"
# test dependencies the matrix never uses, left out of a root's venv (each costs minutes to fetch or
# build): the playbook's tools, the linter, coverage, and the journal binding (python3-systemd instead)
PIP_LEFT_OUT = frozenset({"ansible-core", "ansible-lint", "ruff", "pytest-cov", "systemd-python"})
# where the host's CA bundle is copied in: pip inside a root reaches PyPI through the host's trust
HOST_CA = "/usr/local/share/healthd/host-ca.crt"
# bump when the build steps below change in a way the key would not see
RECIPE = 1
COMPLETE = ".healthd-root-complete"
PORT_LOCK = Path("/tmp/healthd-slurm-ports.lock")  # tests/support/slurm_cluster.py's, shared with the host
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSIDE_ENV = "HEALTHD_SLURM_ROOT"  # set inside a root to its release: the outer matrix tests skip there


class RootError(RuntimeError):
    """A root could not be built or run; the message holds the tail of what failed."""


def matrix_releases(host: str | None = None) -> list[str]:
    """Every release of the matrix except the host's own (whose Slurm the ordinary suite tests)."""
    host = host or host_release()
    return [r for r in SLURM_OF if r != host]


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pip_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The project's runtime and `test` dependencies (markers kept, for pip to judge), less PIP_LEFT_OUT."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", [])) + list(project.get("optional-dependencies", {}).get("test", []))
    return [r for r in reqs if _requirement_name(r) not in PIP_LEFT_OUT]


def console_scripts(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """name -> 'module:function' of [project.scripts]."""
    return dict(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))


def root_key(release: str, arch: str) -> str:
    spec = {"release": release, "arch": arch, "variant": VARIANT, "packages": sorted(PACKAGES[release]),
            "pip": pip_requirements(), "scripts": console_scripts(), "venv": VENV, "recipe": RECIPE}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _check_release(release: str) -> None:
    if release not in SLURM_OF:
        raise RootError(f"{release!r} is not a release of the matrix ({', '.join(SLURM_OF)})")


def root_path(release: str) -> Path:
    """Where `release`'s root is (or will be once built)."""
    _check_release(release)
    return BUILD_DIR / f"{release}-{root_key(release, host_arch())}"


def machine_name(release: str) -> str:
    """The container's name: nspawn makes it the host name inside, so /etc/hosts names it."""
    return f"healthd-{release}"


def unusable() -> str:
    """Why no root can run here ('' when one can)."""
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is not installed (apt-get install systemd-container; make test installs it)"
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    return ""


def _site_packages(root: Path) -> str:
    """The venv's site-packages inside the root (its python3 minor version is the release's)."""
    found = sorted((root / VENV.lstrip("/") / "lib").glob("python3.*/site-packages"))
    if not found:
        raise RootError(f"{root}: no {VENV}/lib/python3.*/site-packages")
    return "/" + str(found[0].relative_to(root))


def _nspawn(root: Path, release: str, argv: Sequence[str], *, volatile: bool, binds: Sequence[tuple[str, str]] = (),
            rw_binds: Sequence[tuple[str, str]] = (), env: Mapping[str, str] | None = None,
            chdir: str | None = None) -> list[str]:
    cmd = ["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit", "--console=pipe", "--as-pid2",
           "--quiet", f"--machine={machine_name(release)}"]
    if volatile:
        cmd.append("--volatile=overlay")
    cmd += [f"--bind-ro={src}:{dst}" for src, dst in binds]
    cmd += [f"--bind={src}:{dst}" for src, dst in rw_binds]
    base = {"PATH": SAFE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", INSIDE_ENV: release}
    cmd += [f"--setenv={k}={v}" for k, v in {**base, **(env or {})}.items()]
    if chdir:
        cmd.append(f"--chdir={chdir}")
    return cmd + ["--", *argv]


def release_of(root: Path) -> str:
    info = json.loads((Path(root) / COMPLETE).read_text())
    return info["release"]


def nspawn_argv(root: Path, argv: Sequence[str], *, binds: Sequence[tuple[str, str]] = (),
                rw_binds: Sequence[tuple[str, str]] = (), env: Mapping[str, str] | None = None,
                chdir: str | None = None, repo: Path = REPO) -> list[str]:
    """The command line that runs `argv` in a throwaway overlay of the built `root`, with the checkout
    bound read-only at its own path and made importable by the root's venv, the host's Slurm port
    lock bound in, and only `env` (plus PATH, HOME, the locale and HEALTHD_SLURM_ROOT) in its
    environment. `binds`/`rw_binds`: more (host path, container path) pairs, read-only / writable."""
    root = Path(root)
    release = release_of(root)
    if not PORT_LOCK.exists():
        fd = os.open(PORT_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        os.close(fd)
    pth = f"{_site_packages(root)}/healthd-checkout.pth"
    # the venv finds the checkout (agents and hooks that slurmd starts import healthd from it)
    setup = f'echo {repo} > {pth} && exec "$@"'
    return _nspawn(root, release, ["/bin/sh", "-c", setup, "sh", *argv], volatile=True,
                   binds=[(str(repo), str(repo)), *binds], rw_binds=[(str(PORT_LOCK), str(PORT_LOCK)), *rw_binds],
                   env={"PYTHONDONTWRITEBYTECODE": "1", **(env or {})}, chdir=chdir or str(repo))


def run_in_root(root: Path, argv: Sequence[str], *, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """nspawn_argv(root, argv, **kwargs) run to its end; stdout and stderr captured (text)."""
    return subprocess.run(nspawn_argv(root, argv, **kwargs), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------- build


def _build_step(tmp: Path, release: str, script: str, env: Mapping[str, str], log, what: str,
                timeout: float = 1800) -> None:
    started = time.monotonic()
    p = subprocess.run(_nspawn(tmp, release, ["/bin/sh", "-ec", script], volatile=False, env=env),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RootError(f"{release} root: {what} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    log(f"slurm root {release}: {what} ({time.monotonic() - started:.0f} s)")


def _write_console_scripts(tmp: Path) -> None:
    bindir = tmp / VENV.lstrip("/") / "bin"
    for name, target in console_scripts().items():
        module, _, func = target.partition(":")
        script = bindir / name
        script.write_text(f"#!{VENV}/bin/python3\nimport sys\nfrom {module} import {func}\n"
                          f"sys.exit({func}())\n")
        script.chmod(0o755)


def build_root(release: str, log=print) -> Path:
    """`release`'s root, built first when it is missing (see the module doc). Returns its path."""
    root = root_path(release)
    if (root / COMPLETE).exists():
        return root
    if shutil.which("debootstrap") is None:
        raise RootError("debootstrap is not installed (apt-get install debootstrap; make test installs it)")
    why = unusable()
    if why:
        raise RootError(why)
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / f".lock-{release}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / COMPLETE).exists():
            return root
        tmp = BUILD_DIR / f".tmp-{root.name}-{os.getpid()}"
        try:
            _build(tmp, release, log)
            os.rename(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in BUILD_DIR.glob(f"{release}-*"):
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
    return root


def _build(tmp: Path, release: str, log) -> None:
    started = time.monotonic()
    arch = host_arch()
    shutil.rmtree(tmp, ignore_errors=True)
    # the archive apt here uses for the host's release serves every release of the matrix
    mirror = apt_mirror(host_release())
    cmd = ["debootstrap", f"--variant={VARIANT}", f"--arch={arch}", release, str(tmp), mirror]
    log(f"slurm root {release}: {' '.join(cmd[:-1])} <apt's mirror>")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RootError(f"debootstrap {release} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    log(f"slurm root {release}: debootstrap ({time.monotonic() - started:.0f} s)")
    # no package's postinst may start its daemon (munge's would start a munged that outlives the build)
    policy = tmp / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    # minbase has no /etc/hosts; slurmctld with NoCtldInAddrAny resolves the host name, which nspawn
    # sets to the machine name
    (tmp / "etc/hosts").write_text(f"127.0.0.1\tlocalhost {machine_name(release)}\n::1\tlocalhost ip6-localhost\n")
    ca = tmp / HOST_CA.lstrip("/")
    ca.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", ca)
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    # sid's Release file on a frozen mirror has expired: its Valid-Until is not checked
    _build_step(tmp, release, "apt-get -o Acquire::Check-Valid-Until=false update -qq\n"
                f"apt-get install -y -qq --no-install-recommends {' '.join(PACKAGES[release])}\n", env, log,
                f"apt-get install {' '.join(PACKAGES[release])}")
    reqs = tmp / "root/healthd-test-requirements.txt"
    reqs.write_text("".join(f"{r}\n" for r in pip_requirements()))
    _build_step(tmp, release, f"python3 -m venv --system-site-packages {VENV}\n"
                f"{VENV}/bin/pip install -q -r /root/{reqs.name}\nrm /root/{reqs.name}\n",
                {"PIP_CERT": HOST_CA, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}, log,
                "venv and pip install")
    _write_console_scripts(tmp)
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (tmp / cache).glob("*"):
            if f.is_file():
                f.unlink()
    # slurmctld -V: from 24.11 on, `scontrol --version` reads slurm.conf first
    version = subprocess.run(_nspawn(tmp, release, ["slurmctld", "-V"], volatile=True),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120).stdout.strip()
    (tmp / COMPLETE).write_text(json.dumps({"release": release, "arch": arch, "packages": PACKAGES[release],
                                            "slurm": version, "seconds": round(time.monotonic() - started, 1)}) + "\n")
    log(f"slurm root {release}: {version}, built in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.slurm_roots", description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or find cached) the roots of the matrix")
    b.add_argument("releases", nargs="*", help="default: every release of the matrix but the host's")
    p = sub.add_parser("path", help="where a release's root is")
    p.add_argument("release")
    r = sub.add_parser("run", help="run a command in a release's root (with the checkout bound in)")
    r.add_argument("release")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    try:
        if args.command == "path":
            print(root_path(args.release))
        elif args.command == "build":
            # side by side: a build mostly waits on the mirror and dpkg (two took 200 s together, 170 s alone)
            started = time.monotonic()
            releases = args.releases or matrix_releases()
            with ThreadPoolExecutor(max_workers=len(releases) or 1) as pool:
                for release, root in zip(releases, pool.map(build_root, releases), strict=True):
                    print(f"slurm root {release}: {root}, ready in {time.monotonic() - started:.1f} s")
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return subprocess.run(nspawn_argv(build_root(args.release), cmd or ["/bin/bash"])).returncode
    except RootError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
