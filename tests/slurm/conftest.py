"""Fixtures for tests against a real local Slurm (tests/support/slurm_cluster.py).

- `slurm_cluster`: the session's one cluster (tests/support/shared_daemons.py: node01..node04, gpu:4
  each, no hooks), up before the first test that asks for it and stopped at the end of the session;
  cleaned at the start of each module that uses it (no job, no drain, every node idle). Tests that
  change it (drain, stop slurmctld) put it back as they found it.
- `shared_slurm`: the same cluster's SessionCluster, for a fixture that installs hooks on it or needs
  another configuration (tests/slurm/e2e_support.py's running_cluster).
- `make_slurm_cluster(**kwargs)`: a cluster of your own (fewer nodes, a cluster the test stops...), up
  when returned; each gets its own free port range (picked by up() under a machine-wide lock), so it
  runs next to `slurm_cluster` and next to clusters of another test session on the machine. All are
  stopped at the end of the session; call `.down()` yourself to stop one earlier.
- SLURM_CONF is set in os.environ for the whole session (to the session cluster's slurm.conf, written
  at once even if the cluster is never started): a Slurm client run without it would make a DNS SRV
  query off the machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.support.shared_daemons import SessionCluster, session_cluster
from tests.support.slurm_cluster import SlurmCluster


_roots: list[Path] = []


def _new_root(name: str) -> Path:
    """A cluster directory directly under /tmp, mode 0755. Not under pytest's tmp tree: pytest keeps
    /tmp/pytest-of-<user> at 0700 (and resets it when another session starts), but munged wants
    every directory above its socket searchable by all and slurmctld, which drops to
    SlurmUser=slurm, must reach its state dir and that socket."""
    root = Path(tempfile.mkdtemp(prefix=f"healthd-{name}-", dir="/tmp"))
    root.chmod(0o755)
    _roots.append(root)
    return root


@pytest.fixture(scope="session", autouse=True)
def _remove_roots() -> Iterator[None]:
    yield
    for root in _roots:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_slurm(request: pytest.FixtureRequest) -> SessionCluster:
    return session_cluster(request.config)


@pytest.fixture(scope="session", autouse=True)
def slurm_conf_env(shared_slurm: SessionCluster) -> Iterator[Path]:
    """SLURM_CONF in os.environ for the session, pointing at a real file (P1 defence); the cluster's
    up() rewrites it with the ports it picks."""
    conf = shared_slurm.cluster.conf_path
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="module")
def slurm_cluster(request: pytest.FixtureRequest, shared_slurm: SessionCluster,
                  slurm_conf_env: Path) -> SlurmCluster:
    return shared_slurm.use(request.module.__name__)


@pytest.fixture(scope="session")
def make_slurm_cluster(slurm_conf_env: Path) -> Iterator[Callable[..., SlurmCluster]]:
    made: list[SlurmCluster] = []

    def make(**kwargs: Any) -> SlurmCluster:
        cluster = SlurmCluster(_new_root(f"slurm-{len(made) + 1}"), **kwargs)
        made.append(cluster)
        cluster.up()
        return cluster

    try:
        yield make
    finally:
        errors = []
        for cluster in made:
            try:
                cluster.down()
            except Exception as exc:  # stop the others anyway
                errors.append(f"{cluster.root}: {exc}")
        if errors:
            raise RuntimeError("; ".join(errors))
