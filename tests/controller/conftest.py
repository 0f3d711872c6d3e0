"""Fixtures shared by the controller's tests on the real local Slurm cluster and real munged daemons:
the session's ones (tests/support/shared_daemons.py), which tests/systemd/conftest.py re-exports."""

from __future__ import annotations

import pytest

from tests.controller.munge_support import MungeFleet
from tests.support.shared_daemons import session_cluster, session_munge_fleet
from tests.support.slurm_cluster import SlurmCluster

NODES = ["node01", "node02", "node03", "node04"]


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> SlurmCluster:
    """The session's cluster (node01..node04), cleaned for this module: no job, no drain, all idle."""
    return session_cluster(request.config).use(request.module.__name__)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> MungeFleet:
    """The session's munged fleet of node01..node04: one munged per node, each with its own --origin
    address, plus the controller's."""
    return session_munge_fleet(request.config, NODES)
