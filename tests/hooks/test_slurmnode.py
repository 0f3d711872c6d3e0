"""The hooks' own Slurm client (healthd.hooks.slurmnode) against healthd.slurm's ScontrolBackend: the
same lines parse to the same state, flags and reason, and both clients, run against the same fake
22.05 scontrol, read, drain, ask for reboots and fail the same way."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from healthd.hooks import slurmnode
from healthd.slurm import scontrol
from healthd.slurm.backend import SlurmRefused, SlurmUnavailable
from tests.hooks.support import Node

CAPTURED = Path(__file__).resolve().parent.parent / "slurm" / "captured"

CRAFTED = [
    "NodeName=n1 Arch=x86_64 State=IDLE Partitions=debug",
    "NodeName=n1 State=MIXED+DRAIN Reason=healthd: xid 79 gpu1: fell off the bus [job 7] [root@2026-11-29T09:22:22]",
    "NodeName=n1 State=IDLE+DRAIN+REBOOT_REQUESTED Reason=maintenance: PSU [alice@2026-11-29T09:22:22] Comment=x y",
    "NodeName=n1 State=DOWN* Reason=Not responding [slurm@2026-11-29T09:22:22]",
    "NodeName=n1 State=COMPLETING Partitions=a,b",
    "NodeName=n1 State=ALLOCATED+DRAIN Reason=a [fake@2026-01-01T00:00:00] inside [root@2026-11-29T09:22:22]",
    "NodeName=n1 State=IDLE+DRAIN Reason=no suffix at all Extra=something",
    "NodeName=n1 OS=Linux 6.1 #1 SMP State=MIXED Reason=",
]


def lines() -> list[str]:
    out = list(CRAFTED)
    for path in sorted(CAPTURED.glob("scontrol-22.05-*.txt")):
        out += [line for line in path.read_text().splitlines() if line.strip()]
    return out


@pytest.mark.parametrize("line", lines())
def test_the_same_line_parses_to_the_same_node(line: str) -> None:
    full = scontrol.parse_scontrol_node_line(line)
    mine = slurmnode.parse_node_line(line)
    assert (mine.name, mine.state, mine.flags, mine.reason) == (full.name, full.state, full.flags, full.reason)


@pytest.mark.parametrize("line", ["State=IDLE NodeName=n1", "Arch=x86_64", "NodeName=n1 State=", "NodeName=n1 State=+"])
def test_a_line_both_refuse_is_refused(line: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the full parser's error type differs; that both refuse matters
        scontrol.parse_scontrol_node_line(line)
    with pytest.raises(slurmnode.SlurmRefused):
        slurmnode.parse_node_line(line)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    n = Node(tmp_path)
    monkeypatch.setenv("PATH", f"{n.fakebin}:/usr/bin:/bin")
    return n


def clients(node: Node, timeout_s: float = 10.0) -> tuple[slurmnode.Client, scontrol.ScontrolBackend]:
    return (slurmnode.Client(str(node.slurm_conf), f"{node.fakebin}:/usr/bin:/bin", timeout_s),
            scontrol.ScontrolBackend(slurm_conf=str(node.slurm_conf), timeout_s=timeout_s))


def test_both_clients_read_a_node_alike(node: Node) -> None:
    node.set_slurm(state="mixed", flags=["DRAIN"], reason="maintenance: PSU swap", user="alice")
    mine, full = clients(node)
    a, b = mine.node(node.name), full.node(node.name)
    assert (a.state, a.flags, a.reason) == (b.state, b.flags, b.reason) == ("mixed", frozenset({"DRAIN"}), "maintenance: PSU swap")
    calls = node.calls()
    assert calls[0]["args"] == calls[1]["args"] == ["show", "node", "-o", node.name]
    assert calls[0]["slurm_conf"] == calls[1]["slurm_conf"] == str(node.slurm_conf)


def test_both_clients_drain_and_ask_for_a_reboot_with_the_same_command(node: Node) -> None:
    mine, full = clients(node)
    mine.drain([node.name], "healthd: xid 79 gpu1 [job 3]")
    full.drain([node.name], "healthd: xid 79 gpu1 [job 3]")
    mine.reboot_asap([node.name], reason="healthd: row remap pending gpu0")
    full.reboot_asap([node.name], reason="healthd: row remap pending gpu0")
    writes = node.writes()
    assert writes[0] == writes[1] and writes[2] == writes[3] and len(writes) == 4
    with pytest.raises(ValueError):
        mine.drain([node.name], "two\nlines")
    with pytest.raises(ValueError):
        mine.drain([node.name, "node02"], "healthd: x")


def test_unreachable_and_unknown_are_the_same_kind_of_error(node: Node) -> None:
    mine, full = clients(node)
    node.set_slurm(mode="unreachable")
    with pytest.raises(slurmnode.SlurmUnavailable, match="unreachable"):
        mine.node(node.name)
    with pytest.raises(SlurmUnavailable):
        full.node(node.name)
    node.set_slurm()
    with pytest.raises(slurmnode.SlurmRefused, match="node07"):
        mine.node("node07")
    with pytest.raises(SlurmRefused):
        full.node("node07")


def children() -> set[int]:
    """This process's children, running or left to reap (zombies), from /proc."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            out.add(int(entry.name))
    return out


def test_a_hung_client_is_killed_with_its_process_group_at_the_timeout(node: Node) -> None:
    node.set_slurm(mode="hang")
    mine = slurmnode.Client(str(node.slurm_conf), f"{node.fakebin}:/usr/bin:/bin", 0.5)
    before = children()  # the session's shared daemons may be children of this process too
    started = time.monotonic()
    with pytest.raises(slurmnode.SlurmUnavailable, match="timed out after 0.5 s"):
        mine.node(node.name)
    assert time.monotonic() - started < 3.0
    assert children() - before == set()  # nothing left behind, running or to reap


def test_no_client_without_a_slurm_conf_or_the_program(node: Node, tmp_path: Path) -> None:
    with pytest.raises(slurmnode.SlurmUnavailable, match="does not exist"):
        slurmnode.Client(str(tmp_path / "nope.conf"), "/usr/bin", 1.0)
    with pytest.raises(slurmnode.SlurmUnavailable, match="not found on PATH"):
        slurmnode.Client(str(node.slurm_conf), str(tmp_path / "empty"), 1.0).node(node.name)


PIECES = ["NodeName=n1", "State=IDLE", "State=MIXED+DRAIN", "State=DOWN*+DRAIN", " ", "  ", "\u00a0", "\t",
          "Reason=", " Reason=", "healthd: xid 79", " [root@2026-11-29T09:22:22]", " [al ice@2026-11-29T09:22:22]",
          " [a@2026-11-29T09:22]", " [a@\u0661\u0662\u0663\u0664-11-29T09:22:22]", " [@2026-11-29T09:22:22]",
          " [a@b@2026-11-29T09:22:22]", " [[x]@2026-11-29T09:22:22]", " Comment=x", " Extra=y", " InstanceType=z",
          "OS=Linux 6.1 #1", "Gres=gpu:4", "a=b=c", "_k9=", "9k=v", "k-x=v", "]", "[", "@", "é=1"]


def random_lines(n: int) -> list[str]:
    import random

    rng = random.Random(20261202)
    out = []
    for _ in range(n):
        parts = ["NodeName=n1 State=IDLE"] + [rng.choice(PIECES) for _ in range(rng.randint(1, 9))]
        out.append("".join(p if rng.random() < 0.5 else " " + p for p in parts))
    return out


def test_random_lines_parse_alike_or_are_refused_by_both() -> None:
    for line in random_lines(3000):
        try:
            full = scontrol.parse_scontrol_node_line(line)
        except Exception:  # noqa: BLE001 - the full parser's error types differ; that both refuse matters
            with pytest.raises(slurmnode.SlurmRefused):
                slurmnode.parse_node_line(line)
            continue
        mine = slurmnode.parse_node_line(line)
        assert (mine.name, mine.state, mine.flags, mine.reason) == (full.name, full.state, full.flags, full.reason), line
