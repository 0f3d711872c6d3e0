"""Fixtures shared by the controller's tests on the real local Slurm cluster."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.controller.munge_support import MungeFleet
from tests.support.slurm_cluster import SlurmCluster

NODES = ["node01", "node02", "node03", "node04"]


@pytest.fixture(scope="module")
def cluster():
    """A cluster per module (tests/slurm/conftest.py's make_slurm_cluster is not visible here), under
    /tmp with mode 0755 (munged and slurmctld must traverse it; pytest's own tmp is 0700), always stopped."""
    root = Path(tempfile.mkdtemp(prefix="healthd-ctl-slurm-", dir="/tmp"))
    root.chmod(0o755)
    c = SlurmCluster(root)
    try:
        c.up()
        yield c
    finally:
        try:
            c.down()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet():
    """One munged per node, each with its own --origin address, plus the controller's."""
    with MungeFleet(NODES) as f:
        yield f
