"""SIGKILL of the controller at each spare move (tests/faults/world.py: the real controller daemon, agents,
Slurm and munged), before the call reaches slurmctld and right after it landed: after the restart the
ledger's spares equal Slurm's reservations, each reservation was made (or deleted) once, and the
checker's invariants hold. The drain after a spare's failed revalidation too: drained once, under the
incident the failure opened, and the pool refilled."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.faults.test_kill_points import WHEN, kill_at
from tests.faults.world import FaultWorld

pytestmark = pytest.mark.slow

PREFIX = "healthd_spare_debug_"


def _spare_actions(w: FaultWorld) -> list[dict[str, Any]]:
    return [a for a in w.actions() if a["kind"] in ("spare-reserve", "spare-release")]


def _recorded(w: FaultWorld) -> set[str]:
    """The spares by the ledger's record: nodes whose latest applied spare action is a reserve."""
    latest: dict[str, str] = {}
    for a in sorted(_spare_actions(w), key=lambda a: a["id"]):
        if a["status"] == "applied":
            latest[a["node"]] = a["kind"]
    return {n for n, k in latest.items() if k == "spare-reserve"}


def _in_slurm(w: FaultWorld) -> set[str]:
    out = w.slurm(["scontrol", "show", "reservation", "-o"], check=False).stdout
    return {line.split("ReservationName=", 1)[1].split()[0][len(PREFIX):]
            for line in out.splitlines() if f"ReservationName={PREFIX}" in line}


def _with_pool(w: FaultWorld) -> None:
    w.policy["spares"] = {"debug": {"size": 1}}
    w.restart_controller()


def _cleanup(w: FaultWorld) -> None:
    # a spare's reservation outlives the test's controller: the next test's jobs need every node
    w.policy.pop("spares", None)
    w.extra_config.pop("topology_conf", None)
    w.slurm(["scontrol", "delete", "ReservationName=admin_hold"], check=False)
    w.restart_controller()
    for node in _in_slurm(w):
        w.slurm(["scontrol", "delete", f"ReservationName={PREFIX}{node}"], check=False)


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_spare_reserve(w, when):
    try:
        w.policy["spares"] = {"debug": {"size": 1}}
        kill_at(w, f"ReservationName={PREFIX}", when, w.restart_controller)
        w.wait(lambda: len(_recorded(w)) == 1 and _recorded(w) == _in_slurm(w), 30, "one spare, in Slurm and the ledger")
        reserves = [a for a in _spare_actions(w) if a["kind"] == "spare-reserve"]
        assert [a["status"] for a in reserves].count("applied") == 1, reserves
        if when == "before":
            assert reserves[0]["status"] == "abandoned", reserves  # never applied blindly after the restart
        w.checker.check()
    finally:
        _cleanup(w)


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_spare_release(w, when):
    try:
        _with_pool(w)
        w.wait(lambda: len(_recorded(w)) == 1 and _recorded(w) == _in_slurm(w), 30, "the pool's spare")
        (spare,) = _recorded(w)
        # the spare's own GPU fails: it is no longer fit and its reservation is deleted
        kill_at(w, f"delete ReservationName={PREFIX}{spare}", when, lambda: w.inject_xid(spare, 48))
        w.wait(lambda: spare not in _recorded(w) and spare not in _in_slurm(w), 30, f"{spare} given back")
        w.wait(lambda: _recorded(w) == _in_slurm(w) and len(_recorded(w)) == 1, 30, "the pool refilled")
        releases = [a for a in _spare_actions(w) if a["kind"] == "spare-release" and a["node"] == spare]
        assert [a["status"] for a in releases].count("applied") == 1, releases
        w.drained_once(spare)
        w.checker.check()
    finally:
        _cleanup(w)


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_release_for_a_removed_node(w, when):
    """node01 validated by a reintegration becomes the pool's spare; node02's GPU fails and its drain
    releases node01 (same leaf switch): killed at that delete, the release is still made once, under
    node02's incident."""
    try:
        w.inject_xid("node01", 48)
        w.drained_once("node01")
        w.healthctl("repaired", "node01", "--why", "reseated GPU", json_out=False)
        w.wait(lambda: w.rows("SELECT state FROM reintegrations WHERE node = 'node01'") == [("passed",)], 60,
               "node01's reintegration to pass")
        topology = w.dir / "topology.conf"
        topology.write_text("SwitchName=s1 Nodes=node[01-02]\nSwitchName=s2 Nodes=node[03-04]\n")
        w.extra_config["topology_conf"] = str(topology)
        # an administrator's reservation holds the other nodes while the pool fills (a restarted controller
        # takes the first healthy nodes it hears from): node01 is the one node it may take
        w.slurm(["scontrol", "create", "reservation", "ReservationName=admin_hold", "Nodes=node[02-04]",
                 "StartTime=now", "Duration=30", "Users=root", "Flags=MAINT,IGNORE_JOBS"])
        w.wait(lambda: all("RESERVED" in w.node_info(n).flags for n in ("node02", "node03", "node04")), 30,
               "the administrator's reservation in force")
        _with_pool(w)
        w.wait(lambda: _recorded(w) == _in_slurm(w) == {"node01"}, 30, "node01, validated, as the spare")
        w.slurm(["scontrol", "delete", "ReservationName=admin_hold"])
        kill_at(w, f"delete ReservationName={PREFIX}node01", when, lambda: w.inject_xid("node02", 48))
        w.drained_once("node02")
        w.wait(lambda: "node01" not in _recorded(w) | _in_slurm(w), 30, "node01 released")
        (incident,) = [i["id"] for i in w.incidents("node02")]
        releases = [a for a in _spare_actions(w) if a["kind"] == "spare-release" and a["status"] == "applied"]
        assert len(releases) == 1 and json.loads(releases[0]["evidence"])["incident"] == str(incident), releases
        w.checker.check()
    finally:
        _cleanup(w)


@pytest.mark.parametrize("when", WHEN)
def test_kill_at_the_drain_after_a_failed_revalidation(w, when):
    """The pool's spare is due at once (never validated) and fails its revalidation (the validation
    script exits 3): killed right before or after the drain that follows, the spare is drained once,
    under the incident its failure opened, its reservation given back, and the pool refills with a node
    whose revalidation passes."""
    try:
        w.validation_rc.write_text("3\n")
        kill_at(w, "validation failed", when, lambda: _with_pool(w))
        w.validation_rc.write_text("0\n")
        (spare,) = {a["node"] for a in w.actions() if a["kind"] == "spare-validate"}
        w.drained_once(spare)
        (incident,) = w.incidents(spare)
        assert incident["signature"] == f"spare-validation:{spare}" and incident["status"] == "validation-failed"
        assert w.node_info(spare).reason.startswith("healthd: validation failed: ")
        assert w.node_info(spare).reason.endswith(f"[#{incident['id']}]")
        drains = [a for a in w.actions(spare) if a["kind"] == "drain"]
        assert [a["status"] for a in drains].count("applied") == 1, drains
        if when == "before":
            assert drains[0]["status"] == "abandoned", drains  # decided again after the restart, not replayed
        w.wait(lambda: spare not in _recorded(w) | _in_slurm(w), 30, f"{spare} given back")
        w.wait(lambda: _recorded(w) == _in_slurm(w) and len(_recorded(w)) == 1, 30, "the pool refilled")
        (other,) = _recorded(w)
        w.wait(lambda: any(a["node"] == other and a["status"] == "applied" for a in w.actions(other)
                           if a["kind"] == "spare-validate"), 60, f"{other}'s revalidation to pass")
        w.checker.check()
    finally:
        _cleanup(w)
