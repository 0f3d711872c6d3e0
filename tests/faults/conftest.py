"""One fault-injection world per test module (a whole real fleet: tests/faults/world.py), reset before each test."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.controller.munge_support import munged_path

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or munged_path() is None or shutil.which("slurmctld") is None,
    reason="the fault-injection suite runs a real Slurm, munged and agents as root",
)


@pytest.fixture(scope="module")
def world():
    from tests.faults.world import FaultWorld

    with FaultWorld() as w:
        yield w


@pytest.fixture
def w(world):
    """The module's world, reset: fresh ledger, controller and agents, every node resumed and idle."""
    world.reset()
    yield world
    world.scontrol.disarm()
