"""healthd.slurm.topology: topology.conf files generated from the documented format (man topology.conf:
SwitchName with Nodes= or Switches=, LinkSpeed, case-insensitive keys, `#` comments, hostlist
expressions; `\\` continuations) read back into the topology they were written from."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from healthd.slurm.topology import TopologyError, expand_hostlist, parse_topology

PREFIXES = ("node", "gpu", "dev", "tux", "r1n", "a-b")


def _fold(prefix: str, numbers: list[int], width: int, rnd: random.Random) -> list[str]:
    """Hostlist pieces naming prefix+number for each number: runs folded into `[a-b]` ranges or left
    as plain names, at the whim of `rnd`: the same names written the many ways Slurm reads them."""
    names = [f"{prefix}{n:0{width}d}" for n in numbers]
    pieces, i = [], 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        run = numbers[i:j + 1]
        style = rnd.randrange(3)
        if style == 0 or len(run) == 1 and rnd.random() < 0.5:
            pieces.extend(names[i:j + 1])
        elif style == 1 and len(run) > 1:
            pieces.append(f"{prefix}[{run[0]:0{width}d}-{run[-1]:0{width}d}]")
        else:
            pieces.append(f"{prefix}[{','.join(f'{n:0{width}d}' for n in run)}]")
        i = j + 1
    return pieces


@st.composite
def topologies(draw):
    """(leaf switch -> its nodes in order, upper switch -> its children, the file's text)."""
    rnd = random.Random(draw(st.integers(0, 2**32)))
    width = draw(st.integers(1, 3))
    n_leaves = draw(st.integers(1, 6))
    pool = [(p, n) for p in draw(st.lists(st.sampled_from(PREFIXES), min_size=1, max_size=3, unique=True))
            for n in range(0, 30)]
    leaves: dict[str, list[str]] = {}
    pieces: dict[str, list[str]] = {}
    for i in range(n_leaves):
        chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=12, unique=True))
        by_prefix: dict[str, list[int]] = {}
        for p, n in sorted(chosen):
            by_prefix.setdefault(p, []).append(n)
        pieces[f"leaf{i}"] = [x for p, ns in by_prefix.items() for x in _fold(p, ns, width, rnd)]
        leaves[f"leaf{i}"] = [f"{p}{n:0{width}d}" for p, ns in by_prefix.items() for n in ns]
    uppers: dict[str, list[str]] = {}
    names = list(leaves)
    for i in range(draw(st.integers(0, 3))):
        kids = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
        uppers[f"spine{i}"] = kids
        names.append(f"spine{i}")

    def key(k: str) -> str:
        return rnd.choice((k, k.lower(), k.upper()))

    lines = []
    if rnd.random() < 0.5:
        lines.append("# Slurm's network topology configuration file for use with the topology/tree plugin")
    for name, parts in [*pieces.items(), *((n, kids) for n, kids in uppers.items())]:
        child = key("Nodes") if name in leaves else key("Switches")
        tokens = [f"{key('SwitchName')}={name}", f"{child}={','.join(parts)}"]
        if rnd.random() < 0.3:
            tokens.insert(rnd.randrange(1, 3), f"{key('LinkSpeed')}={rnd.randrange(1, 400)}")
        line = ""
        for t in tokens:
            line += (rnd.choice((" ", "  ", "\t", " \\\n    ")) if line else rnd.choice(("", " "))) + t
        if rnd.random() < 0.3:
            line += "   # " + rnd.choice(("rack 3", "a#b", "Nodes=fake[1-9]", ""))
        lines.append(line)
        if rnd.random() < 0.2:
            lines.append(rnd.choice(("", "   ", "# ---")))
    return leaves, uppers, "\n".join(lines) + rnd.choice(("", "\n"))


@hsettings(max_examples=300, deadline=None)
@given(topologies())
def test_a_written_topology_reads_back(case):
    leaves, uppers, text = case
    topo = parse_topology(text)
    assert set(topo.switches) == set(leaves) | set(uppers)
    for name, nodes in leaves.items():
        assert topo.switches[name].leaf
        assert topo.nodes_under(name) == frozenset(nodes)
    for node in {n for ns in leaves.values() for n in ns}:
        assert topo.leaves[node] == tuple(s for s, ns in leaves.items() if node in ns)  # the file's order
        assert topo.leaf_of(node) == topo.leaves[node][0]
    for name, kids in uppers.items():
        assert not topo.switches[name].leaf
        assert topo.nodes_under(name) == frozenset().union(*(topo.nodes_under(k) for k in kids))


@hsettings(max_examples=150, deadline=None)
@given(topologies(), st.randoms(use_true_random=False))
def test_the_order_of_the_lines_changes_no_group(case, rnd):
    _leaves, _uppers, text = case
    blocks = text.replace("\\\n", "\0").split("\n")
    rnd.shuffle(blocks)
    shuffled = parse_topology("\n".join(blocks).replace("\0", "\\\n"))
    original = parse_topology(text)
    assert shuffled.groups == original.groups
    assert {n: set(s) for n, s in shuffled.leaves.items()} == {n: set(s) for n, s in original.leaves.items()}


@hsettings(max_examples=150, deadline=None)
@given(topologies(), st.data())
def test_same_leaf_is_sharing_a_listing_leaf(case, data):
    leaves, _uppers, text = case
    topo = parse_topology(text)
    nodes = sorted({n for ns in leaves.values() for n in ns})
    a, b = data.draw(st.sampled_from(nodes)), data.draw(st.sampled_from(nodes))
    assert topo.same_leaf(a, b) == any(a in ns and b in ns for ns in leaves.values())
    assert not topo.same_leaf(a, "not-in-the-file")


@hsettings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("SwitchNamesNode=[]-,0123 \t\n#\\abc@!"), max_size=80))
def test_any_text_reads_or_fails_with_a_clear_error(text):
    try:
        parse_topology(text)
    except TopologyError as exc:
        assert "topology.conf" in str(exc)


def test_the_man_page_example():
    text = """##################################################################
# Slurm's network topology configuration file for use with the
# topology/tree plugin
##################################################################
SwitchName=s0 Nodes=dev[0-5]
SwitchName=s1 Nodes=dev[6-11]
SwitchName=s2 Nodes=dev[12-17]
SwitchName=s3 Switches=s[0-2]
"""
    topo = parse_topology(text)
    assert topo.leaf_of("dev7") == "s1"
    assert topo.same_leaf("dev0", "dev5") and not topo.same_leaf("dev5", "dev6")
    assert topo.nodes_under("s3") == frozenset(f"dev{i}" for i in range(18))
    assert topo.leaf_of("dev18") is None


def test_block_topology_lines():
    topo = parse_topology("BlockName=b1 Nodes=n[1-4]\nBlockName=b2 Nodes=n[5-8]\nBlockSizes=4,8\n")
    assert topo.leaf_of("n6") == "b2" and set(topo.switches) == {"b1", "b2"}


@pytest.mark.parametrize("text, message", [
    ("SwitchName=s0 Nodes=n1\nNodes=n[1-2]\n", "line 2: no SwitchName"),
    ("SwitchName=s0 Nodes=n[1-\n", "line 1: invalid hostlist"),
    ("SwitchName=s0 Nodes=@all\n", "line 1: invalid hostlist '@all'"),
    ("SwitchName=s0 Nodes=n1 n2\n", "line 1: expected KEY=VALUE, found 'n2'"),
    ("# c\n\nSwitchName=s0 \\\n Nodes=n[1-2] =x\n", "line 3: expected KEY=VALUE"),
    ("SwitchName=a Switches=b\nSwitchName=b Switches=c\nSwitchName=c Switches=a\n", "contains itself"),
    ("SwitchName=s0 Nodes=\n", "invalid hostlist '': empty"),
    ("SwitchName=s0 Nodes=n[0-99999999]\n", "names up to 100000000 nodes, more than 1000000"),
])
def test_errors_name_the_line(text, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[")):
        parse_topology(text)


def test_a_node_under_two_leaves_is_under_both():
    topo = parse_topology("SwitchName=a Nodes=n[1-3]\nSwitchName=b Nodes=n[3-4]\n")
    assert topo.leaves["n3"] == ("a", "b")
    assert topo.same_leaf("n1", "n3") and topo.same_leaf("n3", "n4") and not topo.same_leaf("n1", "n4")


def test_expand_hostlist_is_slurms():
    assert expand_hostlist("tux[0-3,12,18-20]") == [f"tux{i}" for i in (0, 1, 2, 3, 12, 18, 19, 20)]
    assert expand_hostlist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
