"""Scenario files: every packaged one loads, every field is checked, and malformed YAML gives a
ScenarioError naming the problem, never another exception."""

from __future__ import annotations

import string

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.sim import scenario

PACKAGED = scenario.packaged()


def test_every_packaged_scenario_loads_and_says_what_it_is():
    assert {"baseline", "daly-interval", "async-checkpoint", "fast-hang-detection", "no-spares",
            "firmware-regression", "combined"} <= set(PACKAGED)
    for name in PACKAGED:
        s = scenario.load(name)
        assert s.name == name and s.description


def test_a_derived_scenario_changes_only_what_it_names():
    base, fast = scenario.load("baseline"), scenario.load("fast-hang-detection")
    assert fast.job == base.job and fast.fleet == base.fleet
    changed = {c.name for c, d in zip(base.node_causes + base.job_causes, fast.node_causes + fast.job_causes,
                                      strict=True) if c != d}
    assert changed == {"fabric_link", "collective_hang", "storage_stall"}


@pytest.mark.parametrize(("text", "says"), [
    ("- 1\n- 2\n", "a scenario is a mapping"),
    ("base: baseline\nname: x\nbogus: 1\n", "unknown field(s) bogus"),
    ("base: baseline\nname: x\njob: {nodes: 200}\n", "the job needs 200"),
    ("base: baseline\nname: x\nnode_causes: {host: {share: 0.5}}\n", "add up to"),
    ("base: baseline\nname: x\njob: {checkpoint_interval_minutes: soon}\n", "young"),
    ("base: baseline\nname: x\njob: {checkpoint_minutes: -1}\n", "out of range"),
    ("base: baseline\nname: x\nhealthd: {mode: yolo}\n", "not one of"),
    ("base: nowhere\nname: x\n", "no such file or packaged scenario"),
    ("name: x\n[", "not YAML"),
    ("base: baseline\nname: x\nbursts: {leaf: {kind: leaf, mtbf_hours: 100, cause: nope}}\n", "not a node cause"),
])
def test_bad_files_say_why(text, says):
    with pytest.raises(scenario.ScenarioError, match=None) as e:
        scenario.load_text(text, "f.yaml")
    assert says in str(e.value) and "f.yaml" in str(e.value)


def test_a_base_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\n")
    with pytest.raises(scenario.ScenarioError, match="base loop"):
        scenario.load(tmp_path / "a.yaml")


values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
                      | st.text(max_size=8), lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
                      max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=string.printable, max_size=200))
def test_any_text_is_a_scenario_or_a_scenario_error(text):
    try:
        scenario.load_text(text)
    except scenario.ScenarioError:
        pass


BASE_DOC = yaml.safe_load(PACKAGED["baseline"])
PATHS = [(k,) for k in BASE_DOC] + [(k, j) for k, v in BASE_DOC.items() if isinstance(v, dict) for j in v]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PATHS), values)
def test_any_field_set_to_anything_is_a_scenario_or_a_scenario_error(path, value):
    doc = yaml.safe_load(PACKAGED["baseline"])
    target = doc
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    try:
        scenario.load_text(yaml.safe_dump(doc))
    except scenario.ScenarioError:
        pass
