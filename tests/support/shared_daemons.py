"""The daemons a whole test session shares: one real Slurm cluster (tests/support/slurm_cluster.py) and
one munged fleet per set of node names (tests/controller/munge_support.py).

    shared = session_cluster(request.config)
    cluster = shared.use("tests/slurm/test_cluster.py")            # up, base configuration, clean
    cluster = shared.use("e2e hooks", extra_conf="RebootProgram=/bin/true")
    fleet = session_munge_fleet(request.config, ["node01", "node02", "node03", "node04"])

Starting a cluster costs seconds; dozens of modules each starting their own cost minutes. So the
session has one cluster, node01..node04 with gpu:4 each, that every fixture takes through `use(owner)`:
when the owner differs from the last one, the cluster is cleaned first (SlurmCluster.clean: every
daemon running, no job, no reservation, no reboot pending, every node resumed, weight 1 and idle), so
each module (or the fault world) starts from what a fresh cluster shows. Its configuration is the base
one (BASE_EXTRA_CONF) unless the owner asks for another `extra_conf`; a different one restarts
slurmctld and the slurmd (SlurmCluster.reconfigure), and hooks are installed by their owner with
`cluster.reconfigure(hooks=...)` (tests/slurm/e2e_support.py), taken at once.

A test that needs a cluster of its own (its own node count, slurmdbd, a cluster it stops for good)
says so by its fixture: tests/slurm/conftest.py's make_slurm_cluster, tests/slurm/test_accounting.py's
accounted_cluster.

Everything is created on first use and stopped (by PID) and removed when the session ends
(`config.add_cleanup`), after every session fixture has been torn down. Each pytest process (each
xdist worker) has its own.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import pytest

from tests.controller.munge_support import MungeFleet
from tests.support.slurm_cluster import SlurmCluster, ensure_installed

REBOOT_PROGRAM = "RebootProgram=/bin/true"
"""`scontrol reboot` is refused outright without a RebootProgram ("RebootProgram isn't defined"); the
tests that ask for a reboot keep the node busy and cancel it, so /bin/true never runs."""


def base_extra_conf(cluster: SlurmCluster, requeue_delay_s: int = 10, sched_interval_s: int = 2) -> str:
    """The shared cluster's own slurm.conf lines (demo/harness.py's FleetHarness asks for the same): a
    RebootProgram, and a requeued job that may start again after `requeue_delay_s` (AuthInfo's
    cred_expire, 120 s by default) at the next pass of the main scheduler (sched_interval, 60 s by
    default), so a job healthd requeued runs again within seconds."""
    return (f"{REBOOT_PROGRAM}\n"
            f"AuthInfo=socket={cluster.munge_socket},cred_expire={requeue_delay_s}\n"
            f"SchedulerParameters=nohold_on_prolog_fail,sched_interval={sched_interval_s}\n")


class SessionCluster:
    """The session's cluster (see the module doc)."""

    def __init__(self, root: Path):
        self.root = root
        self.cluster = SlurmCluster(root)  # ports: the first free block, picked by up()
        self.cluster.extra_conf = base_extra_conf(self.cluster)
        self.cluster.write_config()  # SLURM_CONF may point here before anything starts
        self.owner: str | None = None
        self.failed = False
        """Set when the session ends with a failed test: the directories are kept for their logs."""
        self._leftovers: list[Path] = []

    def use(self, owner: str, *, extra_conf: str | None = None, timeout_s: float = 60) -> SlurmCluster:
        """The cluster, up, with `extra_conf` (default: base_extra_conf) and no hooks; cleaned first when
        the last owner was another one."""
        cluster = self.cluster
        wanted = base_extra_conf(cluster) if extra_conf is None else extra_conf
        if self.owner is None:
            cluster.extra_conf = wanted
        if not cluster.is_up():
            cluster.up(timeout_s, idle=False)  # the first start, or daemons a test stopped and left stopped
        if owner != self.owner:
            cluster.reconfigure(hooks={}, health_check_interval=0, extra_conf=wanted, timeout_s=timeout_s)
            cluster.clean(timeout_s)
            self.owner = owner
        elif cluster.extra_conf != wanted:
            cluster.reconfigure(extra_conf=wanted, timeout_s=timeout_s)
            cluster.wait_idle(timeout_s)
        return cluster

    def remove_at_end(self, path: Path) -> None:
        """Remove `path` once the cluster has stopped (what its slurmd may still run from: an owner's hooks)."""
        self._leftovers.append(path)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.failed = session.testsfailed > 0

    def stop(self) -> None:
        try:
            self.cluster.down()
        finally:
            if self.failed:
                print(f"\nthe session's Slurm cluster: kept {self.root} (logs: log/)"
                      + "".join(f", {path}" for path in self._leftovers))
            else:
                for path in (*self._leftovers, self.root):
                    shutil.rmtree(path, ignore_errors=True)


_CLUSTER = pytest.StashKey[SessionCluster]()
_FLEETS = pytest.StashKey[dict]()


def session_cluster(config: pytest.Config) -> SessionCluster:
    """This session's SessionCluster, created (not started) on first call. Its directory is directly under
    /tmp with mode 0755, not under pytest's tmp tree: munged wants every directory above its socket
    searchable by all, slurmctld (SlurmUser=slurm) must reach its state and that socket, and every pytest
    session that starts on this machine chmods /tmp/pytest-of-root back to 0700."""
    shared = config.stash.get(_CLUSTER, None)
    if shared is None:
        ensure_installed()
        root = Path(tempfile.mkdtemp(prefix="healthd-slurm-", dir="/tmp"))
        root.chmod(0o755)
        shared = config.stash[_CLUSTER] = SessionCluster(root)
        config.pluginmanager.register(shared)  # its pytest_sessionfinish: were there failures
        config.add_cleanup(shared.stop)
    return shared


def session_munge_fleet(config: pytest.Config, nodes: Sequence[str]) -> MungeFleet:
    """This session's munged fleet for exactly these node names (one munged per node, --origin
    127.0.0.2 on, and the controller's), started on first call. A test that stops or replaces one of
    its daemons makes a MungeFleet of its own."""
    fleets = config.stash.setdefault(_FLEETS, {})
    key = tuple(nodes)
    fleet = fleets.get(key)
    if fleet is None:
        fleet = fleets[key] = MungeFleet(list(nodes)).start()
        config.add_cleanup(fleet.stop)
    return fleet
