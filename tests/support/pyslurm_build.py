"""pyslurm 24.11.0 built inside a Debian trixie root file system (Slurm 24.11), for the tests that run
PyslurmBackend on a real pyslurm against a real slurmctld.

    from tests.support.pyslurm_build import missing_reason, install
    reason = missing_reason()            # None, or why there is nothing to build (a user's own clone)
    python = install(root)               # /opt/healthd-pyslurm/bin/python inside `root`, pyslurm importable

The source is `<repo>/../shared/third_party/pyslurm-24.11.0.tar.gz` (no registry serves pyslurm for
Slurm 24.11); its sha256 is checked against the one recorded with it before anything is built.
pyslurm refuses any Slurm whose major.minor is not its own (its setup.py reads slurm_version.h), so
it is built in the root that has Slurm 24.11's headers and libslurm, with the root's python3 (3.13):

    python3 -m venv BUILDVENV && BUILDVENV/bin/pip install Cython==3.0.12 setuptools wheel packaging
    SLURM_LIB_DIR=/usr/lib/x86_64-linux-gnu SLURM_INCLUDE_DIR=/usr/include PYSLURM_BUILD_JOBS=2 \\
        BUILDVENV/bin/pip wheel --no-build-isolation --no-deps -w OUT .

(the same build as `pip install --no-build-isolation .`, kept as a wheel). About 250 s on 2 cores,
most of it gcc on one generated file, so the wheel is cached under build/pyslurm/<key>/, the key a
hash of the tarball's sha256, this recipe, and the root's Slurm and python versions: a rebuilt root
of the same versions installs the cached wheel in seconds. The wheel goes into a venv of its own in
the root (VENV_IN_ROOT by default, or a root's test venv; made with --system-site-packages when it
is new); a stamp in the venv holds the key, so a second install() is a no-op.

Commands run in the root with `systemd-nspawn --register=no --keep-unit --console=pipe` (no boot;
the host's network, for PyPI: the host's CA bundle is copied in and PIP_CERT names it).

CLI: `python -m tests.support.pyslurm_build ROOT [--venv VENV]`, or, for the Makefile (`make
pyslurm-root`), `... --matrix-root`: the version matrix's trixie root (tests/support/slurm_roots.py,
built first when missing) and its test venv, so that `pytest -m matrix` there runs PyslurmBackend on
the real pyslurm. `... --host-venv VENV` (`make pyslurm-host`): a host whose own Slurm is 24.11
(Debian 13, where trixie is no root of the matrix) builds the same wheel here, with libslurm-dev's
headers and the venv's python, and installs it into VENV (the project's .venv), so that the host's
own suite runs PyslurmBackend on the real pyslurm; a note and nothing else on any other Slurm.
Prints the venv's python, or the skip reason (exit 0) when the tarball is absent.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
TARBALL_NAME = "pyslurm-24.11.0.tar.gz"
# recorded in ../shared/third_party/README.md with the tarball
TARBALL_SHA256 = "77d97c42bf3639f4babdfcbaa7e674351d974e10d85a7d0015cafd342b15f769"
PYSLURM_VERSION = "24.11.0"
SLURM_MAJOR_MINOR = (24, 11)
MATRIX_RELEASE = "trixie"  # the Debian release whose Slurm is 24.11
CYTHON = "Cython==3.0.12"  # 3.1+ rejects a typo in pyslurm/core/job/submission.pyx of this release
BUILD_REQUIREMENTS = (CYTHON, "setuptools", "wheel", "packaging")
VENV_IN_ROOT = "/opt/healthd-pyslurm"
BUILD_VENV_IN_ROOT = "/opt/healthd-pyslurm-build"
CACHE_DIR = REPO / "build" / "pyslurm"
ROOT_CA = "/etc/ssl/certs/healthd-host-ca.crt"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
NEEDED_IN_ROOT = ("/usr/include/slurm/slurm_version.h", "/usr/bin/gcc", "/usr/bin/python3")
BUILD_ENV = {
    "SLURM_LIB_DIR": "/usr/lib/x86_64-linux-gnu",
    "SLURM_INCLUDE_DIR": "/usr/include",
    "PYSLURM_BUILD_JOBS": "2",
}
# the wheel's build steps, in words: a change to any of them is a new cache key
RECIPE = (
    f"venv {BUILD_VENV_IN_ROOT}; pip install {' '.join(BUILD_REQUIREMENTS)}; "
    f"{' '.join(f'{k}={v}' for k, v in sorted(BUILD_ENV.items()))} "
    "pip wheel --no-build-isolation --no-deps"
)

Runner = Callable[[Path, Sequence[str], dict[str, str], Sequence[tuple[Path, str]]], None]


class PyslurmBuildError(RuntimeError):
    """The tarball is not the recorded one, the root lacks what the build needs, or a step failed."""


def shared_dir(repo: Path = REPO) -> Path:
    return repo.parent / "shared"


def tarball_path(repo: Path = REPO) -> Path:
    return shared_dir(repo) / "third_party" / TARBALL_NAME


def missing_reason(repo: Path = REPO) -> str | None:
    """Why pyslurm cannot be built from this checkout (None when it can): the tarball lives beside
    the repository, in ../shared/third_party/, which a user's own clone does not have."""
    path = tarball_path(repo)
    if not path.is_file():
        return (f"pyslurm {PYSLURM_VERSION} source not found at {path} (../shared/third_party/ beside the "
                "checkout; a user's own clone has none): no real pyslurm to test")
    return None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_tarball(path: Path, expected: str = TARBALL_SHA256) -> str:
    """The tarball's sha256, after checking it is the recorded one (PyslurmBuildError if not)."""
    got = sha256_of(path)
    if got != expected:
        raise PyslurmBuildError(f"{path}: sha256 {got}, expected {expected} (../shared/third_party/README.md)")
    return got


def cache_key(tarball_sha256: str, slurm_version: str, python_version: str, recipe: str = RECIPE) -> str:
    """What the built wheel depends on, hashed (pure): the source, the recipe, the root's Slurm
    (pyslurm links libslurm and compiles against its headers) and python (the wheel's ABI)."""
    text = "\n".join((tarball_sha256, recipe, slurm_version, python_version))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_slurm_version_h(text: str) -> str:
    """'24.11.5' from slurm_version.h's `#define SLURM_VERSION_NUMBER 0x180b05` (major, minor and
    micro a byte each, as its SLURM_VERSION_NUM macro packs them); PyslurmBuildError when absent."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[:2] == ["#define", "SLURM_VERSION_NUMBER"]:
            try:
                n = int(parts[2], 0)
            except ValueError:
                break
            return f"{n >> 16 & 0xFF}.{n >> 8 & 0xFF:02d}.{n & 0xFF}"
    raise PyslurmBuildError("slurm_version.h has no SLURM_VERSION_NUMBER")


def nspawn(root: Path, argv: Sequence[str], env: dict[str, str], binds: Sequence[tuple[Path, str]]) -> None:
    """Run argv in `root` under systemd-nspawn (no boot, the host's network); raise on failure."""
    cmd = ["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit", "--console=pipe"]
    cmd += [f"--setenv={k}={v}" for k, v in env.items()]
    # a source file is only read; a directory is where a step leaves its output
    cmd += [f"--bind-ro={src}:{dst}" if src.is_file() else f"--bind={src}:{dst}" for src, dst in binds]
    proc = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise PyslurmBuildError(f"in {root}: {' '.join(argv)[:200]} exited {proc.returncode}:\n{tail}")


def _root_versions(root: Path) -> tuple[str, str]:
    for needed in NEEDED_IN_ROOT:
        if not (root / needed.lstrip("/")).exists():
            raise PyslurmBuildError(
                f"{root} has no {needed}: the root needs slurm-wlm libslurm-dev python3-dev python3-venv gcc libc6-dev")
    slurm = parse_slurm_version_h((root / NEEDED_IN_ROOT[0].lstrip("/")).read_text(encoding="latin-1"))
    if tuple(int(x) for x in slurm.split(".")[:2]) != SLURM_MAJOR_MINOR:
        raise PyslurmBuildError(f"{root} has Slurm {slurm}; pyslurm {PYSLURM_VERSION} builds only against 24.11")
    pythons = sorted(p.name for p in (root / "usr/bin").glob("python3.*") if p.name[len("python3."):].isdigit())
    if not pythons:
        raise PyslurmBuildError(f"{root} has no /usr/bin/python3.N")
    return slurm, pythons[-1]


def install(root: Path, venv: str = VENV_IN_ROOT, *, repo: Path = REPO, cache_dir: Path = CACHE_DIR,
            run: Runner = nspawn, log: Callable[[str], None] = print) -> str:
    """pyslurm 24.11.0 installed in the venv `venv` inside `root` (built, or taken from the cache;
    the venv is made, with --system-site-packages, when it does not exist yet: pass a root's test
    venv to install into it); returns the venv's python as a path inside the root.
    PyslurmBuildError when the tarball is absent or not the recorded one, or the root cannot build it."""
    root = Path(root).absolute()
    reason = missing_reason(repo)
    if reason:
        raise PyslurmBuildError(reason)
    tarball = tarball_path(repo)
    sha = verify_tarball(tarball)
    slurm, python = _root_versions(root)
    key = cache_key(sha, slurm, python)
    stamp = root / venv.lstrip("/") / f".pyslurm-stamp-{key}"
    inside_python = f"{venv}/bin/python"
    if stamp.exists():
        return inside_python
    out = cache_dir / key
    wheels = sorted(out.glob("pyslurm-*.whl"))
    shutil.copyfile(HOST_CA, root / ROOT_CA.lstrip("/"))
    env = {"PIP_CERT": ROOT_CA, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if not wheels:
        log(f"pyslurm {PYSLURM_VERSION}: building for Slurm {slurm}, {python} in {root} (about 4 minutes)")
        scratch = out.with_name(out.name + ".tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        script = (
            "set -e; rm -rf /tmp/pyslurm-src; mkdir -p /tmp/pyslurm-src; "
            "tar xzf /mnt/pyslurm-src.tar.gz -C /tmp/pyslurm-src; "
            f"python3 -m venv {BUILD_VENV_IN_ROOT}; "
            f"{BUILD_VENV_IN_ROOT}/bin/pip install -q {' '.join(repr(r) for r in BUILD_REQUIREMENTS)}; "
            f"cd /tmp/pyslurm-src/pyslurm-{PYSLURM_VERSION}; "
            f"{' '.join(f'{k}={v}' for k, v in BUILD_ENV.items())} "
            f"{BUILD_VENV_IN_ROOT}/bin/pip wheel -q --no-build-isolation --no-deps -w /mnt/out .; "
            "rm -rf /tmp/pyslurm-src"
        )
        run(root, ["/bin/sh", "-c", script], env, [(tarball, "/mnt/pyslurm-src.tar.gz"), (scratch, "/mnt/out")])
        wheels = sorted(scratch.glob("pyslurm-*.whl"))
        if len(wheels) != 1:
            raise PyslurmBuildError(f"the build left {[w.name for w in wheels]} in {scratch}, not one wheel")
        shutil.rmtree(out, ignore_errors=True)
        scratch.rename(out)
        wheels = sorted(out.glob("pyslurm-*.whl"))
    wheel = wheels[-1]
    script = (
        f"set -e; [ -x {venv}/bin/python ] || python3 -m venv --system-site-packages {venv}; "
        f"rm -f {venv}/.pyslurm-stamp-*; "
        f"{venv}/bin/pip install -q --no-deps --force-reinstall /mnt/wheels/{wheel.name}; "
        # the import checks that the build links against the root's libslurm; pyslurm 24.11 runs
        # slurm_init() on import, which wants a slurm.conf (without one: a DNS SRV lookup, then a fatal exit)
        "printf 'ClusterName=check\\nSlurmctldHost=localhost\\n' > /tmp/pyslurm-check.conf; "
        f"cd /; SLURM_CONF=/tmp/pyslurm-check.conf {venv}/bin/python -c "
        "'import pyslurm; assert pyslurm.__version__ == \"" + PYSLURM_VERSION + "\", pyslurm.__version__'; "
        f"touch {venv}/.pyslurm-stamp-{key}"
    )
    run(root, ["/bin/sh", "-c", script], env, [(out, "/mnt/wheels")])
    log(f"pyslurm {PYSLURM_VERSION}: installed in {root}{venv} ({wheel.name})")
    return inside_python


def host_skip_reason(root: Path = Path("/")) -> str | None:
    """Why pyslurm is not built for this host's own Slurm (None when it is): only a host whose Slurm
    is 24.11 (Debian 13) builds it; elsewhere the trixie root of the version matrix has it."""
    header = root / NEEDED_IN_ROOT[0].lstrip("/")
    if not header.is_file():
        return f"no {header} (libslurm-dev): this host's Slurm cannot be built against"
    slurm = parse_slurm_version_h(header.read_text(encoding="latin-1"))
    if tuple(int(x) for x in slurm.split(".")[:2]) != SLURM_MAJOR_MINOR:
        return f"this host's Slurm is {slurm}; pyslurm {PYSLURM_VERSION} builds only against 24.11 (the trixie root has it)"
    return None


def _run_here(argv: Sequence[str], env: dict[str, str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise PyslurmBuildError(f"{' '.join(argv)[:200]} exited {proc.returncode}:\n{tail}")


def install_on_host(venv: Path, *, repo: Path = REPO, cache_dir: Path = CACHE_DIR,
                    log: Callable[[str], None] = print) -> Path:
    """pyslurm 24.11.0 built with this host's Slurm 24.11 and installed in the host venv `venv` (the
    project's .venv on a Debian 13 host), the same recipe as in a root but run here: a build venv made
    by the venv's own python (the wheel's ABI is that python's), the wheel cached under
    build/pyslurm/<key>/ beside the roots' and a stamp in `venv` holding the key. Returns the venv's
    python. PyslurmBuildError when the tarball or the host's Slurm does not fit (host_skip_reason)."""
    venv = Path(venv).absolute()
    reason = missing_reason(repo) or host_skip_reason()
    if reason:
        raise PyslurmBuildError(reason)
    sha = verify_tarball(tarball_path(repo))
    slurm, _ = _root_versions(Path("/"))
    python = venv / "bin" / "python"
    minor = subprocess.run([str(python), "-c", "import sys; print(sys.version_info[1])"], capture_output=True,
                           text=True, check=True).stdout.strip()
    key = cache_key(sha, slurm, f"python3.{minor}")
    stamp = venv / f".pyslurm-stamp-{key}"
    if stamp.exists():
        return python
    out = cache_dir / key
    if not sorted(out.glob("pyslurm-*.whl")):
        log(f"pyslurm {PYSLURM_VERSION}: building for this host's Slurm {slurm}, python3.{minor} (about 4 minutes)")
        scratch = out.with_name(out.name + ".tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "src").mkdir(parents=True)
        build_venv = cache_dir / "host-build-venv"
        _run_here(["tar", "xzf", str(tarball_path(repo)), "-C", str(scratch / "src")], {})
        if not (build_venv / "bin" / "python").exists():
            _run_here([str(python), "-m", "venv", str(build_venv)], {})
        _run_here([str(build_venv / "bin" / "pip"), "install", "-q", *BUILD_REQUIREMENTS],
                  {"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        src = scratch / "src" / f"pyslurm-{PYSLURM_VERSION}"
        _run_here(["sh", "-c", f"cd {src} && {build_venv}/bin/pip wheel -q --no-build-isolation --no-deps "
                               f"-w {scratch} ."], {**BUILD_ENV, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        shutil.rmtree(scratch / "src")
        wheels = sorted(scratch.glob("pyslurm-*.whl"))
        if len(wheels) != 1:
            raise PyslurmBuildError(f"the build left {[w.name for w in wheels]} in {scratch}, not one wheel")
        shutil.rmtree(out, ignore_errors=True)
        scratch.rename(out)
    wheel = sorted(out.glob("pyslurm-*.whl"))[-1]
    for old in venv.glob(".pyslurm-stamp-*"):
        old.unlink()
    _run_here([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
              {"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    # as in a root: the import checks the build links against this libslurm; slurm_init() wants a slurm.conf
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:
        conf.write("ClusterName=check\nSlurmctldHost=localhost\n")
        conf.flush()
        _run_here(["sh", "-c", f"cd / && {python} -c 'import pyslurm; assert pyslurm.__version__ == "
                               f"\"{PYSLURM_VERSION}\", pyslurm.__version__'"], {"SLURM_CONF": conf.name})
    stamp.touch()
    log(f"pyslurm {PYSLURM_VERSION}: installed in {venv} ({wheel.name})")
    return python


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", type=Path, help="a Debian trixie root with slurm-wlm, libslurm-dev, "
                                                       "python3-dev, python3-venv, gcc and libc6-dev")
    ap.add_argument("--venv", default=VENV_IN_ROOT, help=f"the venv inside the root (default {VENV_IN_ROOT})")
    ap.add_argument("--matrix-root", action="store_true",
                    help="the version matrix's trixie root (tests/support/slurm_roots.py, built when missing) and "
                         "its test venv; nothing to do where trixie is not in the matrix (a Debian 13 host)")
    ap.add_argument("--host-venv", type=Path, metavar="VENV",
                    help="build against this host's own Slurm and install into the host venv VENV (the project's "
                         ".venv); nothing to do unless the host's Slurm is 24.11 (a Debian 13 host)")
    args = ap.parse_args(argv)
    if sum((args.root is not None, args.matrix_root, args.host_venv is not None)) != 1:
        ap.error("give one of ROOT, --matrix-root, --host-venv")
    reason = missing_reason()
    if reason:
        print(f"pyslurm: skipped: {reason}")
        return 0
    try:
        if args.host_venv is not None:
            reason = host_skip_reason()
            if reason:
                print(f"pyslurm: nothing to build on this host: {reason}")
                return 0
            print(install_on_host(args.host_venv))
            return 0
        if args.matrix_root:
            from tests.support import slurm_roots  # noqa: PLC0415 - only this CLI mode builds a matrix root

            if MATRIX_RELEASE not in slurm_roots.matrix_releases():
                print(f"pyslurm: nothing to build: {MATRIX_RELEASE} is this host's release, not a root of the matrix")
                return 0
            args.root, args.venv = slurm_roots.build_root(MATRIX_RELEASE), slurm_roots.VENV
        python = install(args.root, args.venv)
    except PyslurmBuildError as exc:
        print(f"pyslurm: {exc}", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
