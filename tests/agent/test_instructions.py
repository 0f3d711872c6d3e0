"""The agent's handling of the controller's clear-finding instruction (pure parts)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthd.agent.instructions import (
    MAX_CLEARS,
    apply_clears,
    carry_episodes,
    clear_scope,
    merge_clears,
    parse_clear,
)
from healthd.model import is_cleared

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["kind", "findings", "before", "incident"]), json_values))
def test_parse_clear_accepts_or_says_why(doc):
    try:
        out = parse_clear(doc)
    except ValueError as exc:
        assert str(exc)
        return
    assert out and all(isinstance(k, str) and v > 0 for k, v in out.items())


def test_parse_clear_examples():
    assert parse_clear({"kind": "clear-finding", "findings": ["xid:gpu0:79"], "before": 5}) == {"xid:gpu0:79": 5.0}
    for bad in ({"kind": "clear-finding", "findings": [], "before": 5},
                {"kind": "clear-finding", "findings": ["a"], "before": True},
                {"kind": "clear-finding", "findings": ["a"], "before": float("nan")},
                {"kind": "clear-finding", "findings": [3], "before": 5},
                {"kind": "run-validation"}):
        with pytest.raises(ValueError):
            parse_clear(bad)


def test_merge_keeps_the_later_clear_and_a_bounded_number():
    assert merge_clears({"a": 5.0}, {"a": 3.0, "b": 1.0}) == {"a": 5.0, "b": 1.0}
    many = merge_clears({}, {f"f{i}": float(i) for i in range(MAX_CLEARS + 10)})
    assert len(many) == MAX_CLEARS and "f0" not in many and f"f{MAX_CLEARS + 9}" in many


# --------------------------------------------------------------------------- episodes


def _f(fid="nvml:gpu_lost:gpu0", source="nvml", first=100.0, last=200.0):
    from healthd.model import NODE, Evidence, Finding

    return Finding(id=fid, component=NODE, source=source, attribution="hardware", tier=1, action="drain",  # type: ignore[arg-type]
                   summary="x", evidence=(Evidence("state", "x"),), first_seen=first, last_seen=last)


def test_clear_scope_defaults_to_evidence_and_refuses_others():
    assert clear_scope({"kind": "clear-finding"}) == "evidence"
    assert clear_scope({"kind": "clear-finding", "scope": "episode"}) == "episode"
    with pytest.raises(ValueError, match="scope"):
        clear_scope({"kind": "clear-finding", "scope": "forever"})


def test_an_episode_clear_holds_for_a_persistent_condition_and_not_for_a_new_episode_or_log_line():
    """An undo (healthd was wrong) holds while the condition lasts, though it is re-observed every tick; a
    repair-style clear would not (the condition still observed after it is new evidence)."""
    persistent = _f(first=100.0, last=500.0)  # observed every tick since 100, dismissed at 300
    assert is_cleared(persistent, {}, {persistent.id: 300.0})
    assert not is_cleared(persistent, {persistent.id: 300.0})  # evidence scope: still observed, so it counts
    new_episode = _f(first=400.0, last=500.0)  # it went away and came back at 400
    assert not is_cleared(new_episode, {}, {new_episode.id: 300.0})
    line = _f("xid:gpu0:79", source="kernel_log", first=100.0, last=450.0)  # a new Xid line after the dismissal
    assert not is_cleared(line, {}, {line.id: 300.0})
    old_line = _f("xid:gpu0:79", source="kernel_log", first=100.0, last=250.0)
    assert is_cleared(old_line, {}, {old_line.id: 300.0})


def test_carry_episodes_keeps_the_first_seen_of_a_finding_that_stays():
    from healthd.agent.classify import Classification
    from healthd.agent.history import History

    def tick(*findings):
        return Classification(findings=tuple(findings), history=History(), verdict="failed", would_do=())

    out, episodes = carry_episodes(tick(_f(first=100.0)), {})
    assert episodes == {"nvml:gpu_lost:gpu0": 100.0}
    out, episodes = carry_episodes(tick(_f(first=110.0, last=110.0)), episodes)  # re-observed: same episode
    assert out.findings[0].first_seen == 100.0 and episodes == {"nvml:gpu_lost:gpu0": 100.0}
    _, episodes = carry_episodes(tick(), episodes)  # gone for a tick: the episode ended
    out, episodes = carry_episodes(tick(_f(first=130.0, last=130.0)), episodes)
    assert out.findings[0].first_seen == 130.0


def test_apply_clears_keeps_an_episode_clear_only_while_its_episode_lasts():
    from healthd.agent.classify import Classification
    from healthd.agent.history import History

    c = Classification(findings=(_f(first=100.0),), history=History(), verdict="failed", would_do=())
    out, cleared, dismissed = apply_clears(c, {}, {"nvml:gpu_lost:gpu0": 300.0})
    assert out.findings == () and dismissed == {"nvml:gpu_lost:gpu0": 300.0} and cleared == {}
    c = Classification(findings=(_f(first=400.0),), history=History(), verdict="failed", would_do=())
    out, _, dismissed = apply_clears(c, {}, {"nvml:gpu_lost:gpu0": 300.0})
    assert len(out.findings) == 1 and dismissed == {}
