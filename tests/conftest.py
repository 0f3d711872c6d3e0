"""Fixtures every part of the suite shares, and the test tiers.

Tiers: every test that boots a daemon or a heavy external process is marked `daemon`, and with it
what it boots (`cluster`, `fleet`, `container`, `ansible`, `browser`, `ddp`, `versions`). Apart from
the tiers, the tests named in tests/matrix/core.py are marked `matrix`: the version matrix runs them
with every Slurm release. The marks are derived
here, at collection, from the fixtures each test uses (its whole fixture closure), so a new test on
an existing cluster or fleet fixture lands in the right tier without anyone marking it. `make check`
runs `-m "not daemon"`; `make test` runs everything.

A test outside the daemon tier that starts one of the daemons anyway (a new fixture missing from
the table below, a daemon started in a test's body) fails at once, naming the program: see
`_guard_daemons`.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

from tests.matrix.core import in_core
from tests.support.fake_nvml import build_fake_nvml

REPO = Path(__file__).resolve().parents[1]

TIER_MARKERS = ("cluster", "fleet", "container", "ansible", "browser", "ddp", "versions")

# "<file defining the fixture>::<fixture name>" -> what that fixture boots. Keyed by where the fixture
# is defined, not by its name alone: `fleet` is a munged fleet in most modules but a whole Slurm+DDP
# fleet in tests/inband/test_ddp_job.py, and `world` is a FaultWorld in tests/faults but a ledger file in
# tests/controller/test_healthctl.py.
FIXTURE_TIERS: dict[str, tuple[str, ...]] = {
    # a real Slurm: munged + slurmctld + slurmd (tests/support/slurm_cluster.py)
    "tests/slurm/conftest.py::slurm_cluster": ("cluster",),
    "tests/slurm/conftest.py::make_slurm_cluster": ("cluster",),
    "tests/controller/conftest.py::cluster": ("cluster",),
    "tests/ansible/conftest.py::cluster": ("cluster",),
    # ... with slurmdbd and MariaDB beside it (tests/support/slurm_accounting.py)
    "tests/slurm/test_accounting.py::accounted_cluster": ("cluster",),
    # ... with a healthd agent per node and the hooks installed (tests/slurm/e2e_support.py)
    "tests/slurm/test_e2e_hooks.py::e2e": ("cluster",),
    "tests/slurm/test_e2e_inband.py::e2e": ("cluster",),
    "tests/slurm/test_e2e_prolog_d.py::e2e": ("cluster",),
    # ... with the real LBNL NHC as HealthCheckProgram (tests/nhc/test_real_nhc.py), and munged for its controller
    "tests/nhc/test_real_nhc.py::nhc": ("cluster",),
    "tests/nhc/test_real_nhc.py::fleet": ("fleet",),
    # munged fleets (tests/controller/munge_support.py), alone or under an in-process controller
    "tests/controller/conftest.py::fleet": ("fleet",),
    "tests/controller/test_auth.py::fleet": ("fleet",),
    "tests/controller/test_daemon.py::fleet": ("fleet",),
    "tests/controller/test_intake_concurrency.py::fleet": ("fleet",),
    "tests/controller/test_verifier.py::fleet": ("fleet",),
    "tests/agent/test_reporter.py::fleet": ("fleet",),
    "tests/hooks/test_prolog_controller.py::fleet": ("fleet",),
    "tests/goodput/test_gather.py::gathering": ("fleet",),
    "tests/observability/conftest.py::controller_scrape": ("fleet",),
    # whole fleets: Slurm, a munged and an agent per node, the healthd-controller process
    "tests/faults/conftest.py::world": ("cluster", "fleet"),
    "tests/inband/test_ddp_job.py::fleet": ("cluster", "fleet", "ddp"),
    # systemd as PID 1 of a systemd-nspawn container (and the debootstrap of its root file system)
    "tests/systemd/test_units_real_systemd.py::rootfs": ("container",),
    # ansible-playbook and ansible-lint
    "tests/ansible/conftest.py::ansible_env": ("ansible",),
    # headless chromium
    "tests/goodput/test_report_html.py::chromium": ("browser",),
    # the matrix core run again in a root file system per other Slurm release (tests/support/slurm_roots.py)
    "tests/matrix/test_slurm_versions.py::matrix_runs": ("versions",),
}

# Tests that start a daemon in their own body, where no fixture shows it: node id (or a prefix of it)
# -> what they boot.
BODY_TIERS: dict[str, tuple[str, ...]] = {
    # starts and stops a munged fleet of its own to prove it stops its daemons by PID
    "tests/controller/test_auth.py::test_fleet_stops_its_daemons_by_pid": ("fleet",),
    # signs with a munged fleet of its own, one munged per node of the spread job
    "tests/controller/test_inband.py::test_signed_reports_of_a_spread_job_": ("fleet",),
}

# What a test outside the daemon tier must never start. A healthd agent (`healthd run`) is not here:
# the agent's end-to-end tests run it as their own child, it needs nothing from the machine and dies
# with the test.
DAEMON_PROGRAMS = frozenset({
    "munged", "slurmctld", "slurmd", "slurmdbd", "mariadbd", "mysqld", "healthd-controller",
    "systemd-nspawn", "debootstrap", "chromium", "ansible-playbook", "ansible-lint",
})
VERSION_FLAGS = frozenset({"-V", "--version"})


def _fixture_key(fixturedef: pytest.FixtureDef) -> str | None:
    """Where the fixture's function is written, not where it is visible: tests/systemd/conftest.py
    re-exports tests/controller/conftest.py's cluster and fleet."""
    try:
        where = Path(inspect.getsourcefile(inspect.unwrap(fixturedef.func)) or "").resolve()
        return f"{where.relative_to(REPO).as_posix()}::{fixturedef.argname}"
    except (TypeError, ValueError):  # a plugin's fixture, or one with no source file
        return None


def _tiers(item: pytest.Item) -> set[str]:
    tiers: set[str] = set()
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames:
        # the fixture this test resolves `name` to is the last definition (the closest override)
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs:
            tiers.update(FIXTURE_TIERS.get(_fixture_key(defs[-1]) or "", ()))
    for prefix, marks in BODY_TIERS.items():
        if item.nodeid.startswith(prefix):
            tiers.update(marks)
    return tiers


# Modules run longest first, judged by what they boot: `make test` hands whole modules to its workers
# (pytest-xdist, --dist loadfile, in this order), and a long module started last is the run's tail.
MODULE_ORDER = ("versions", "ansible", "ddp", "world", "container", "cluster", "fleet", "browser")


def _module_rank(tiers: set[str]) -> int:
    if {"cluster", "fleet"} <= tiers:
        tiers = tiers | {"world"}  # Slurm, agents and the controller together: a whole fault world
    return min((MODULE_ORDER.index(t) for t in tiers if t in MODULE_ORDER), default=len(MODULE_ORDER))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank: dict[str, int] = {}
    for item in items:
        tiers = _tiers(item)
        for name in sorted(tiers):
            item.add_marker(name)
        if tiers:
            item.add_marker("daemon")
        if in_core(item.nodeid):  # tests/matrix/core.py: run on every Slurm release of the matrix
            item.add_marker("matrix")
        module = item.nodeid.split("::", 1)[0]
        rank[module] = min(rank.get(module, len(MODULE_ORDER)), _module_rank(tiers))
    # stable: the tests of a module keep their order, and modules of one rank keep theirs
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


# --- the guard: a test outside the daemon tier that starts a daemon fails, naming it -------------------

_running: list[pytest.Item] = []  # the test whose setup, call or teardown runs now
_UNMARKED = pytest.StashKey[list]()  # what it tried to start; fails it even where the error was caught


def _program(executable: object, args: object) -> tuple[str, list[str]]:
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = [os.fsdecode(args)]
    else:
        argv = [os.fsdecode(a) for a in args if isinstance(a, (str, bytes, os.PathLike))]
    exe = os.fsdecode(executable) if executable is not None else (argv[0].split()[0] if argv and argv[0].split() else "")
    return os.path.basename(exe), argv


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or not _running:
        return
    item = _running[-1]
    if item.get_closest_marker("daemon") is not None:
        return
    program, argv = _program(args[0], args[1])
    if program in DAEMON_PROGRAMS and not VERSION_FLAGS.intersection(argv[1:2]):
        what = program
    elif "healthd.controller.daemon" in argv:
        what = "healthd-controller"
    else:
        return
    problem = (f"{item.nodeid} starts {what} but is not in the daemon tier: add the fixture that starts it "
               "to FIXTURE_TIERS in tests/conftest.py (or the test to BODY_TIERS)")
    item.stash.setdefault(_UNMARKED, []).append(problem)
    raise RuntimeError(problem)  # before the daemon exists: nothing to stop, nothing left running


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    problems = item.stash.get(_UNMARKED, None)
    if not problems:
        return report
    if report.when != "teardown":
        if report.failed:  # the RuntimeError surfaced: once is enough
            problems.clear()
    elif not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(problems)
    return report


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C stand-in for libnvidia-ml.so.1, compiled once per run (the directory to put on
    LD_LIBRARY_PATH)."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))
