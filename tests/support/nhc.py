"""LBNL NHC (Node Health Check) from `<repo>/../shared/third_party/`, unpacked under build/nhc and run
in place, and a site's NHC layout for a local test cluster.

    from tests.support.nhc import missing_reason, build, NhcSite
    reason = missing_reason()          # None, or why there is no NHC here (a user's own clone)
    nhc = build()                      # build/nhc: the `nhc` driver, scripts/*.nhc, helpers/ (cached)
    site = NhcSite(root, nhc, slurm_conf)
    site.install(extra_scripts=[REPO / "slurm/nhc/healthd.nhc"])
    site.write_conf(["* || check_healthd"])
    cluster.reconfigure(hooks={"HealthCheckProgram": str(site.program)}, ...)

The source is a `git archive` of NHC 1.4.3+4 (no registry serves it); its sha256 is checked against
the one recorded with it (../shared/third_party/README.md). From git it has no generated configure,
so it is not installed: `nhc` runs where it was unpacked, told where its configuration, checks and
helpers are (its own options and VAR=value arguments, see `nhc -h`). One thing `make install` does
that unpacking does not: it installs helpers/node-mark-{offline,online} executable (Makefile.am's
dist_helper_SCRIPTS); the archive has them 0644, and NHC would then never mark a node offline (it
only logs "Permission denied" and exits 1). build() sets them 0755.

CLI for the Makefile: `python -m tests.support.nhc build` (prints the directory, or the skip reason
and exits 0 when the tarball is absent).
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
TARBALL_NAME = "nhc-1.4.3-4-g9c4a38c.tar.gz"
# recorded in ../shared/third_party/README.md with the tarball
TARBALL_SHA256 = "fc69ed09052b47178831a3099c501256b80d0aaba36178fe8f9cbacbadb56077"
NHC_DIR = REPO / "build" / "nhc"
HELPERS = ("node-mark-offline", "node-mark-online")
# NHC's own reason prefix: its offline helper writes "NHC: <message>", and its online helper resumes
# only a node whose reason starts with exactly this word (helpers/node-mark-online)
NHC_LEADER = "NHC:"


class NhcError(RuntimeError):
    """The tarball is not the recorded one, or unpacking it failed."""


def tarball_path(repo: Path = REPO) -> Path:
    return repo.parent / "shared" / "third_party" / TARBALL_NAME


def missing_reason(repo: Path = REPO) -> str | None:
    """Why NHC cannot be run from this checkout (None when it can): the tarball lives beside the
    repository, in ../shared/third_party/, which a user's own clone does not have."""
    path = tarball_path(repo)
    if not path.is_file():
        return (f"LBNL NHC source not found at {path} (../shared/third_party/ beside the checkout; "
                "a user's own clone has none): no real NHC to test")
    return None


def _stamp(dest: Path) -> Path:
    return dest / f".stamp-{TARBALL_SHA256[:16]}"


def build(repo: Path = REPO, dest: Path = NHC_DIR) -> Path:
    """NHC unpacked into `dest` with its helpers executable; a no-op when the stamp of this tarball is
    there. Unpacked beside `dest` and renamed into place, so a run cut short leaves no half tree."""
    if _stamp(dest).is_file():
        return dest
    reason = missing_reason(repo)
    if reason:
        raise NhcError(reason)
    tarball = tarball_path(repo)
    with open(tarball, "rb") as f:
        got = hashlib.file_digest(f, "sha256").hexdigest()
    if got != TARBALL_SHA256:
        raise NhcError(f"{tarball}: sha256 {got}, expected {TARBALL_SHA256} (../shared/third_party/README.md)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".nhc-", dir=dest.parent))
    try:
        proc = subprocess.run(["tar", "-xzf", str(tarball), "-C", str(work), "--strip-components=1"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise NhcError(f"tar -xzf {tarball} failed: {proc.stderr.strip()}")
        for name in HELPERS:
            (work / "helpers" / name).chmod(0o755)  # as `make install` installs them
        work.chmod(0o755)
        _stamp(work).write_text(got + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def default_checks(nhc: Path) -> list[str]:
    """The check lines NHC's own sample nhc.conf leaves active, less the one that cannot pass on a
    machine without sshd (`check_ps_service -u root -S sshd`, which would also try to start it)."""
    lines = []
    for raw in (nhc / "nhc.conf").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "||" in line and "sshd" not in line:
            lines.append(line)
    return lines


def genconf_checks(nhc: Path, workdir: Path, timeout_s: float = 120) -> list[str]:
    """The checks `nhc-genconf` writes for this machine (mounts, disk use, CPU, memory, swap, network
    interfaces, load) with the host mask `*`, less the load average check: the load of a shared test
    machine is other jobs', not this node's health."""
    nhc, workdir = nhc.resolve(), workdir.resolve()  # nhc-genconf runs in workdir
    out = workdir / "nhc.conf.auto"
    proc = subprocess.run(["bash", str(nhc / "nhc-genconf"), "-D", str(workdir), "-H", "*", "-c", str(out),
                           f"INCDIR={nhc / 'scripts'}"], capture_output=True, text=True, timeout=timeout_s,
                          cwd=workdir)
    # nhc-genconf 1.4.3 exits 1 after writing a complete file (its last test's status): the file decides
    checks = [line.strip() for line in (out.read_text().splitlines() if out.is_file() else [])
              if line.strip() and not line.strip().startswith("#") and "||" in line]
    if not checks:
        raise NhcError(f"nhc-genconf wrote no checks (rc {proc.returncode}): {proc.stdout[-400:]}{proc.stderr[-400:]}")
    return [line for line in checks if "check_ps_loadavg" not in line]


class NhcSite:
    """NHC laid out as a site installs it, under `root`: etc/nhc/scripts/ (NHC's checks and any
    extra ones, as /etc/nhc/scripts/ holds them), etc/nhc/nhc.conf, log/<node>.log, and
    bin/nhc-healthcheck, the HealthCheckProgram.

    That program is a two-line wrapper because this cluster is not a site: every node runs on one
    machine with one host name, and slurmd gives a HealthCheckProgram no SLURM_CONF. It sets
    SLURM_CONF and runs NHC with the node's name as HOSTNAME (NHC reads the kernel's host name and
    asks Slurm about that node) and this tree's directories; everything else is NHC's default
    (TIMEOUT 30, stop at the first failing check, mark offline and online through its helpers)."""

    def __init__(self, root: Path, nhc: Path, slurm_conf: Path):
        self.root = Path(root)
        self.nhc = Path(nhc)
        self.slurm_conf = Path(slurm_conf)
        self.etc = self.root / "etc" / "nhc"
        self.scripts = self.etc / "scripts"
        self.conf = self.etc / "nhc.conf"
        self.log_dir = self.root / "log"
        self.program = self.root / "bin" / "nhc-healthcheck"

    def install(self, extra_scripts: Iterable[Path] = ()) -> None:
        for d in (self.root, self.root / "etc", self.etc, self.scripts, self.log_dir, self.program.parent):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        for script in [*sorted((self.nhc / "scripts").glob("*.nhc")), *extra_scripts]:
            shutil.copyfile(script, self.scripts / script.name)
            (self.scripts / script.name).chmod(0o644)
        self.program.write_text(self.wrapper_text())
        self.program.chmod(0o755)

    def wrapper_text(self) -> str:
        argv = [str(self.nhc / "nhc"), "-D", str(self.etc), "-c", str(self.conf)]
        q = shlex.quote
        return ("#!/bin/sh\n"
                "# NHC as HealthCheckProgram on a one-machine test cluster (tests/support/nhc.py)\n"
                f"export SLURM_CONF={q(str(self.slurm_conf))}\n"
                f'exec {" ".join(q(a) for a in argv)} -l {q(str(self.log_dir))}/"$SLURMD_NODENAME.log" '
                f'HOSTNAME="$SLURMD_NODENAME" HOSTNAME_S="$SLURMD_NODENAME" HELPERDIR={q(str(self.nhc / "helpers"))}\n')

    def write_conf(self, lines: Sequence[str]) -> None:
        """nhc.conf with these lines; NHC reads it again on every run. Written beside and renamed, so
        a run never reads half a file."""
        tmp = self.conf.with_suffix(".tmp")
        tmp.write_text("# written by tests/support/nhc.py\n" + "\n".join(lines) + "\n")
        tmp.chmod(0o644)
        tmp.rename(self.conf)

    def log(self, node: str) -> str:
        try:
            return (self.log_dir / f"{node}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_lines(self, node: str) -> list[str]:
        return self.log(node).splitlines()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="LBNL NHC from ../shared/third_party, unpacked under build/nhc")
    ap.add_argument("command", choices=["build"])
    ap.parse_args(argv)
    reason = missing_reason()
    if reason:
        print(f"nhc: skipped: {reason}")
        return 0
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
