"""One fault-injection world for the whole test session (a whole real fleet: tests/faults/world.py) on the
session's Slurm cluster and munged fleet (tests/support/shared_daemons.py), reset before each test.
Between modules its agents and controller are stopped; the next test's reset starts them afresh."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import pytest

from tests.controller.munge_support import munged_path
from tests.support.shared_daemons import session_cluster, session_munge_fleet

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or munged_path() is None or shutil.which("slurmctld") is None,
    reason="the fault-injection suite runs a real Slurm, munged and agents as root",
)

OWNER = "fault world"
"""The world's name as the shared cluster's owner: the cluster is cleaned when another owner had it."""


@pytest.fixture(scope="session")
def fault_world(request: pytest.FixtureRequest) -> Iterator[Any]:
    from tests.faults.world import FaultWorld

    shared = session_cluster(request.config)
    w = FaultWorld(cluster=shared.cluster, munge=session_munge_fleet(request.config, shared.cluster.nodes))
    shared.use(OWNER, extra_conf=w.slurm_extra_conf(shared.cluster))
    with w:
        yield w


@pytest.fixture(scope="module")
def world(fault_world: Any) -> Iterator[Any]:
    """The session's world; parked (agents and controller stopped) when the module ends."""
    yield fault_world
    fault_world.park()


@pytest.fixture
def agent_config() -> dict[str, Any]:
    """Keys a module puts on top of every agent's configuration for its tests (override this fixture)."""
    return {}


@pytest.fixture
def w(request: pytest.FixtureRequest, world: Any, agent_config: dict[str, Any]) -> Iterator[Any]:
    """The world, reset: fresh ledger, controller and agents, every node resumed and idle."""
    session_cluster(request.config).use(OWNER, extra_conf=world.slurm_extra_conf(world.cluster))
    world.reset(agent_config=agent_config)
    yield world
    world.scontrol.disarm()
