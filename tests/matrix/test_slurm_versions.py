"""The version matrix: the real-cluster core (tests/matrix/core.py, marked `matrix`) run again with
every other Slurm release, each in its Debian root file system (tests/support/slurm_roots.py,
built by `make slurm-roots`): `pytest -m matrix` inside the root, with that release's Slurm, munge
and python3, the checkout bound in read-only.

Every release's run starts at once when the first test asks (they mostly wait on daemons, so side by
side they take about as long as the longest); each test waits for its release's run and fails with
the tail of its output. It also fails when a test of the core did not run there (renamed away, or
skipped), so the core cannot shrink unseen. `make test-matrix` runs this module alone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

import pytest

from tests.matrix.core import CORE, ONLY_ON, applies, in_core
from tests.support import pyslurm_build
from tests.support import slurm_roots

RELEASES = slurm_roots.matrix_releases()
OUT = "/healthd-matrix-out"  # where a run's junit file and log land, inside the root
RUN_LIMIT_S = 900
# two workers per root (pytest-xdist, whole modules each): the core mostly waits on its daemons
INNER_WORKERS = os.environ.get("HEALTHD_MATRIX_WORKERS", "2")

pytestmark = [
    pytest.mark.skipif(slurm_roots.INSIDE_ENV in os.environ, reason="already inside a root of the matrix"),
    pytest.mark.skipif(bool(slurm_roots.unusable()), reason=slurm_roots.unusable() or "usable"),
]


def core_files() -> list[str]:
    """The files the core's tests are in: only those are collected inside a root."""
    return sorted({c.split("::", 1)[0] for c in CORE})


class Run:
    def __init__(self, release: str, out: Path):
        self.release = release
        self.out = out
        self.log = out / "pytest.log"
        self.root = slurm_roots.build_root(release)
        argv = [f"{slurm_roots.VENV}/bin/python", "-m", "pytest", "-m", "matrix", "-q", "-p", "no:cacheprovider",
                f"--junitxml={OUT}/junit.xml", "-o", "junit_family=xunit1", *core_files()]
        if INNER_WORKERS != "0":
            argv += ["-n", INNER_WORKERS, "--dist", "loadfile", "--no-loadscope-reorder"]
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(slurm_roots.nspawn_argv(self.root, argv, rw_binds=[(str(out), OUT)]),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.seconds: float | None = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.release}: the matrix run took over {timeout:.0f} s\n{self.tail()}") from None
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        return rc

    def stop(self) -> None:
        """SIGTERM to systemd-nspawn (it stops the container and everything in it), SIGKILL after 30 s."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def results(self) -> dict[str, str]:
        """node id -> passed / failed / skipped / error, from the run's junit file."""
        out: dict[str, str] = {}
        for case in ET.parse(self.out / "junit.xml").getroot().iter("testcase"):
            # xunit1 names the file; the core holds no test classes, so file::name is the node id
            module = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            name = case.get("name", "")
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
            out[f"{module}::{name}"] = outcome
        return out


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    runs: dict[str, Run] = {}
    try:
        for release in RELEASES:
            out = tmp_path_factory.mktemp(f"matrix-{release}")
            runs[release] = Run(release, out)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.timeout(RUN_LIMIT_S + 120)
@pytest.mark.parametrize("release", RELEASES)
def test_the_core_passes_on(release: str, matrix_runs: dict[str, Run]) -> None:
    run = matrix_runs[release]
    rc = run.wait(RUN_LIMIT_S)
    slurm = (run.root / slurm_roots.COMPLETE).read_text()
    assert rc == 0, f"{release} ({slurm.strip()}): `pytest -m matrix` exited {rc} after {run.seconds:.0f} s\n{run.tail()}"
    results = run.results()
    assert all(in_core(nodeid) for nodeid in results), sorted(n for n in results if not in_core(n))
    # the real-pyslurm entries need pyslurm's source from ../shared, which a user's own clone lacks
    # (they then skip, saying so): required only where that source is
    no_pyslurm = pyslurm_build.missing_reason() is not None
    missing = [c for c in CORE if applies(c, release) and not (no_pyslurm and c in ONLY_ON) and not any(
        in_core(n) and (n == c or n.startswith(c.rstrip(":"))) for n, outcome in results.items() if outcome == "passed")]
    assert not missing, f"{release}: tests of the core that did not pass there: {missing}\n{run.tail(30)}"
    passed = sum(outcome == "passed" for outcome in results.values())
    print(f"{release}: {passed} passed, {len(results) - passed} skipped in {run.seconds:.0f} s")
