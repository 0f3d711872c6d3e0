"""Slurm's topology.conf as values: the switches, the nodes under each, and each node's leaf switch.

The format (man topology.conf, topology/tree): one line per switch, `SwitchName=<name>` with its
children, `Nodes=<hostlist>` for a leaf switch, `Switches=<hostlist>` for an upper one, and an optional
`LinkSpeed=` (unused by Slurm, ignored here). Parameter names are case-insensitive, `#` starts a comment
that runs to the end of the line, a trailing `\\` continues a line, and node and switch names are
Slurm hostlist expressions (`tux[0-3,12,18-20]`). topology/block's `BlockName=<name> Nodes=...` lines
are read as leaf switches and its `BlockSizes=` line is skipped. topology.yaml (Slurm 24.05+) is not read.

A node a leaf switch lists is under that switch; a node two leaf switches list (Slurm logs it and goes
on) is under both, and `leaves[node]` names both, in the file's order.

Pure: `parse_topology(text)` reads nothing but its argument and raises TopologyError (a ValueError)
naming the line for what cannot be read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ClusterShell.NodeSet import NodeSet, NodeSetException
from ClusterShell.RangeSet import RangeSetException

# ClusterShell reads these as set operators and group names; Slurm's hostlists have none of them
_NOT_SLURM = frozenset("@!&^")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_BRACKET_COMMA = re.compile(r",(?![^\[]*\])")
MAX_HOSTLIST = 1_000_000
"""More names than this in one expression is a typo (`n[0-99999999]`), not a fleet."""


class TopologyError(ValueError):
    """topology.conf cannot be read; the message names the line."""


@dataclass(frozen=True)
class Switch:
    """One `SwitchName=` (or `BlockName=`) of topology.conf."""

    name: str
    nodes: frozenset[str] = frozenset()
    """The nodes it lists itself (`Nodes=`): non-empty for a leaf switch."""
    switches: tuple[str, ...] = ()
    """Its child switches (`Switches=`), in the file's order."""
    line: int = 0
    """The line of its (first) definition."""

    @property
    def leaf(self) -> bool:
        return bool(self.nodes)


@dataclass(frozen=True)
class Topology:
    """The switches of one topology.conf, and what follows from them."""

    switches: Mapping[str, Switch] = field(default_factory=dict)
    """switch name -> the switch, in the file's order."""
    leaves: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """node -> the leaf switches that list it (one, unless the file lists it under several)."""
    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """switch -> every node under it (the union of its children's for an upper switch)."""

    def leaf_of(self, node: str) -> str | None:
        """The node's (first) leaf switch; None for a node the file does not list."""
        found = self.leaves.get(node)
        return found[0] if found else None

    def same_leaf(self, a: str, b: str) -> bool:
        """`a` and `b` hang off one leaf switch."""
        return not set(self.leaves.get(a, ())).isdisjoint(self.leaves.get(b, ()))

    def nodes_under(self, name: str) -> frozenset[str]:
        """Every node under the switch, through its child switches too (KeyError for an unknown switch)."""
        return self.groups[name]


def _groups(switches: Mapping[str, Switch]) -> dict[str, frozenset[str]]:
    """switch -> every node under it (the union of its children's for an upper switch)."""
    out: dict[str, frozenset[str]] = {}

    def under(name: str, path: tuple[str, ...]) -> frozenset[str]:
        if name in path:
            loop = " -> ".join((*path[path.index(name):], name))
            raise TopologyError(f"topology.conf: switch {name!r} contains itself ({loop})")
        if name in out:
            return out[name]
        sw = switches.get(name)
        if sw is None:
            return frozenset()  # a child switch the file never defines: no nodes under it
        nodes = set(sw.nodes)
        for child in sw.switches:
            nodes |= under(child, (*path, name))
        out[name] = frozenset(nodes)
        return out[name]

    for name in switches:
        under(name, ())
    return out


def expand_hostlist(expr: str, where: str = "hostlist") -> list[str]:
    """A Slurm hostlist expression (`tux[0-3,12]`, `a,b`, `r[1-2]n[01-04]`) -> its names, in order.
    Raises TopologyError naming `where` for one that is not a hostlist."""
    bad = sorted(set(expr) & _NOT_SLURM)
    if not expr or bad:
        why = "empty" if not expr else f"{''.join(bad)!r} is not hostlist syntax"
        raise TopologyError(f"{where}: invalid hostlist {expr!r}: {why}")
    count = _upper_bound(expr)
    if count > MAX_HOSTLIST:  # counted first: ClusterShell builds every number of a range before its length is known
        raise TopologyError(f"{where}: hostlist {expr!r} names up to {count} nodes, more than {MAX_HOSTLIST}")
    try:
        return list(NodeSet(expr))
    except (NodeSetException, RangeSetException, ValueError, IndexError, TypeError) as exc:
        raise TopologyError(f"{where}: invalid hostlist {expr!r}: {exc}") from None


def _upper_bound(expr: str) -> int:
    """At most how many names `expr` expands to: per comma-separated term (outside brackets), the
    product of its bracket groups' sizes, each the sum of its ranges' lengths."""
    total = 0
    for term in _BRACKET_COMMA.split(expr):
        product = 1
        for group in _BRACKETS.findall(term):
            size = 0
            for part in group.split(","):
                lo, _, hi = part.partition("-")
                if lo.isdigit() and hi.isdigit():
                    size += max(0, int(hi) - int(lo)) + 1
                else:
                    size += 1
            product *= max(size, 1)
        total += product
    return total


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first physical line number, text) of each non-blank line once comments are cut and `\\`
    continuations joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = lineno
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip():
            out.append((start, line))
    if pending.strip():
        out.append((start, pending))
    return out


def parse_topology(text: str) -> Topology:
    """topology.conf text -> Topology. A switch named twice gets the union of its lines' children."""
    nodes: dict[str, list[str]] = {}
    children: dict[str, list[str]] = {}
    first_line: dict[str, int] = {}
    for lineno, line in logical_lines(text):
        where = f"topology.conf line {lineno}"
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep or not key:
                raise TopologyError(f"{where}: expected KEY=VALUE, found {token!r}")
            fields[key.lower()] = value
        name = fields.get("switchname") or fields.get("blockname")
        if not name:
            if "blocksizes" in fields and "nodes" not in fields and "switches" not in fields:
                continue
            raise TopologyError(f"{where}: no SwitchName= (or BlockName=) in {line.strip()!r}")
        first_line.setdefault(name, lineno)
        found = nodes.setdefault(name, [])
        if "nodes" in fields:
            found.extend(expand_hostlist(fields["nodes"], where))
        if "switches" in fields:
            children.setdefault(name, []).extend(expand_hostlist(fields["switches"], where))
    switches = {name: Switch(name, frozenset(found), tuple(dict.fromkeys(children.get(name, ()))), first_line[name])
                for name, found in nodes.items()}
    leaves: dict[str, list[str]] = {}
    for sw in switches.values():
        for node in nodes[sw.name]:
            if sw.name not in leaves.setdefault(node, []):
                leaves[node].append(sw.name)
    return Topology(MappingProxyType(switches), MappingProxyType({n: tuple(s) for n, s in leaves.items()}),
                    MappingProxyType(_groups(switches)))


@functools.lru_cache(maxsize=4)
def topology_of(text: str) -> Topology:
    """parse_topology, cached: the controller hands the same text every round."""
    return parse_topology(text)
