"""The controller's fleet view (healthd.controller.fleetcache): incremental refreshes from the lines
of `scontrol show node -o` (parsed with the real parser), whole reads from a backend without lines,
single-node reads noted between refreshes, failures. The view against a real slurmctld is in
tests/slurm/test_backend_contract.py; at 10,000 nodes in bench/controller_round.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.controller.fleetcache import MIN_LEAD_S, FleetCache, next_refresh_at, out_of_service
from healthd.slurm.backend import NodeInfo, SlurmOutputError, SlurmUnavailable
from healthd.slurm.scontrol import parse_node_addresses, parse_scontrol_node_line
from tests.support.fake_slurm import FakeBackend


def line(name: str, state: str = "IDLE", reason: str = "", partitions: str = "gpu", load: str = "0.10",
         addr: str = "10.0.0.1") -> str:
    text = (f"NodeName={name} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPULoad={load} Gres=gpu:8 "
            f"NodeAddr={addr} State={state} Partitions={partitions} BootTime=2026-12-01T07:34:35")
    return text + (f" Reason={reason} [root@2026-12-02T01:00:00]" if reason else "")


class Lines:
    """A backend that lists lines the way ScontrolBackend.node_lines does; fails on demand."""

    parse_node_addresses = staticmethod(parse_node_addresses)

    def parse_node_line(self, text: str) -> NodeInfo:
        if self.parsing is not None:
            parsing, self.parsing = self.parsing, None
            parsing()
        return parse_scontrol_node_line(text)

    def __init__(self, lines: list[str]):
        self.lines = lines
        self.fail: Exception | None = None
        self.reads = 0
        self.during: Callable[[], list[str]] | None = None
        """Runs while a read is in flight and gives its lines (once)."""
        self.parsing: Callable[[], None] | None = None
        """Runs while the first changed line of a read is parsed (once)."""

    def node_lines(self) -> list[str]:
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        if self.during is not None:
            during, self.during = self.during, None
            return during()
        return list(self.lines)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def expected(lines: list[str]) -> dict[str, NodeInfo]:
    return {i.name: i for i in map(parse_scontrol_node_line, lines)}


def test_only_changed_lines_are_parsed_and_derived_sets_follow():
    src = Lines([line("n1"), line("n2", partitions="gpu,debug"), line("n3", state="IDLE+DRAIN", reason="fan")])
    cache = FleetCache(src)  # type: ignore[arg-type]
    assert cache.snapshot() is None and not cache.healthy
    r = cache.refresh()
    assert (r.parsed, r.changed) == (3, 3)
    snap = cache.snapshot()
    assert dict(snap.nodes) == expected(src.lines)
    assert snap.partitions == {"gpu": frozenset({"n1", "n2", "n3"}), "debug": frozenset({"n2"})}
    assert snap.out_of_service == {"n3"}
    r = cache.refresh()
    assert (r.parsed, r.changed) == (0, 0) and cache.snapshot().version == snap.version
    src.lines[0] = line("n1", state="IDLE+DRAIN", reason="healthd: xid 79")
    src.lines[1] = line("n2", partitions="gpu", load="3.00")
    del src.lines[2]
    src.lines.append(line("n4", state="DOWN+NOT_RESPONDING"))
    r = cache.refresh()
    assert r.parsed == 3 and r.changed == 4
    snap2 = cache.snapshot()
    assert dict(snap2.nodes) == expected(src.lines) and snap2.version == snap.version + 1
    assert snap2.partitions == {"gpu": frozenset({"n1", "n2", "n4"})}
    assert snap2.out_of_service == {"n1", "n4"}
    assert dict(snap.nodes) == expected([line("n1"), line("n2", partitions="gpu,debug"),
                                         line("n3", state="IDLE+DRAIN", reason="fan")])  # snapshots never change


def test_a_failed_read_keeps_the_snapshot_and_says_why_and_garbage_changes_nothing():
    src = Lines([line("n1"), line("n2")])
    cache = FleetCache(src)  # type: ignore[arg-type]
    cache.refresh()
    snap = cache.snapshot()
    src.fail = SlurmUnavailable("slurmctld unreachable")
    with pytest.raises(SlurmUnavailable):
        cache.refresh()
    assert cache.snapshot() is snap and not cache.healthy and "unreachable" in (cache.error or "")
    src.fail = None
    src.lines = [line("n1", state="DOWN"), "NodeName= State=IDLE"]  # the second has no name: the parser refuses it
    with pytest.raises(SlurmOutputError):
        cache.refresh()
    assert cache.snapshot() is snap
    src.lines = [line("n1", state="DOWN"), line("n2")]
    cache.refresh()
    assert cache.healthy and cache.snapshot().out_of_service == {"n1"}


def test_a_single_node_read_newer_than_a_full_read_is_kept_and_parsed_again_next_time():
    clock = Clock()
    src = Lines([line("n1"), line("n2")])
    cache = FleetCache(src, clock=clock)  # type: ignore[arg-type]
    cache.refresh()
    # the executor drains n1 and reads it back while a full read that started before is in flight
    stale_lines = list(src.lines)
    drained = parse_scontrol_node_line(line("n1", state="IDLE+DRAIN", reason="healthd: xid 79"))
    clock.t = 1010.0

    def in_flight() -> list[str]:
        clock.t = 1020.0
        cache.note(drained)  # noted at 1020, after the read began at 1010
        return stale_lines

    src.during = in_flight
    cache.refresh()
    assert cache.snapshot().nodes["n1"] == drained and "n1" in cache.snapshot().out_of_service
    # Slurm shows the drain now; a read started after the note replaces the noted entry with it
    src.lines[0] = line("n1", state="IDLE+DRAIN", reason="healthd: xid 79", load="0.20")
    clock.t = 1030.0
    r = cache.refresh()
    assert r.parsed == 1 and cache.snapshot().nodes["n1"] == parse_scontrol_node_line(src.lines[0])
    # an operator resumed it between the note and a read whose line for it is the one seen before the note
    cache.note(drained)
    src.lines[0] = line("n1")
    clock.t = 1040.0
    cache.refresh()
    assert cache.snapshot().nodes["n1"] == parse_scontrol_node_line(line("n1"))
    assert "n1" not in cache.snapshot().out_of_service


def test_a_node_noted_while_a_read_parses_is_parsed_again_by_the_next_read():
    clock = Clock()
    src = Lines([line("n1"), line("n2")])
    cache = FleetCache(src, clock=clock)  # type: ignore[arg-type]
    cache.refresh()
    drained = parse_scontrol_node_line(line("n1", state="IDLE+DRAIN", reason="healthd: xid 79"))
    src.lines[1] = line("n2", load="0.50")  # n2 changed, n1 did not: n1's line is not parsed by this read
    clock.t = 1010.0

    def note() -> None:
        clock.t = 1020.0
        cache.note(drained)

    src.parsing = note
    cache.refresh()
    assert cache.snapshot().nodes["n1"] == drained
    # the write did not hold (an operator undid it): Slurm shows n1's old line, which must be read again
    clock.t = 1030.0
    cache.refresh()
    assert cache.snapshot().nodes["n1"] == parse_scontrol_node_line(line("n1"))


def test_a_backend_without_lines_is_read_whole_and_compared():
    backend = FakeBackend(["a1", "a2", "a3"], partition=["gpu", "cpu"])
    cache = FleetCache(backend)
    r = cache.refresh()
    assert r.changed == 3 and r.parsed == 0
    assert dict(cache.snapshot().nodes) == {n.name: n for n in backend.nodes()}
    version = cache.snapshot().version
    assert cache.refresh().changed == 0 and cache.snapshot().version == version
    backend.drain("a2", "healthd: test")
    assert cache.refresh().changed == 1
    assert cache.snapshot().out_of_service == {"a2"}
    assert cache.snapshot().nodes["a2"] == backend.node("a2")


def test_the_refresh_thread_reads_until_stopped_and_a_poke_reads_at_once():
    src = Lines([line("n1")])
    cache = FleetCache(src)  # type: ignore[arg-type]
    cache.start(3600.0)
    try:
        deadline = time.monotonic() + 10
        while src.reads < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        src.lines = [line("n1", state="DOWN")]
        cache.poke()
        while "n1" not in (cache.snapshot().out_of_service if cache.snapshot() else ()) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.snapshot().out_of_service == {"n1"} and src.reads >= 2
    finally:
        cache.stop()
    assert not cache.running


def at(now, last=0.0, period=5.0, lead=0.5, *, poked=False, in_round=False, due=None):
    return next_refresh_at(now, last, period, lead, poked=poked, in_round=in_round, round_due=due)


def test_a_read_is_due_a_period_after_the_last_or_at_once_when_poked():
    assert at(1.0) == 5.0 and at(1.0, poked=True) == 1.0
    assert at(1.0, due=9.0) == 5.0  # the next round is far: the period as it is


def test_no_read_starts_while_a_round_runs_not_even_a_poked_one():
    assert at(6.0, in_round=True) is None and at(1.0, poked=True, in_round=True) is None


def test_a_read_that_would_run_into_the_next_round_starts_early_enough_to_end_before_it():
    assert at(1.0, due=5.2) == 4.7  # due at 5.0, 0.2 s before the round: started 0.5 s before it
    assert at(4.8, due=5.2) == 4.7  # inside the lead, but a read begun now still ends before the round
    assert at(5.0, due=5.2) is None and at(5.0, poked=True, due=5.2) is None  # too close: after the round
    assert at(1.0, due=2.6) is None  # early would be within half a period of the last read: after the round


def test_however_busy_the_rounds_a_read_is_never_put_off_past_two_periods():
    assert at(10.0, in_round=True) == 10.0 and at(10.0, due=10.1) == 10.0
    assert at(0.0, last=float("-inf"), in_round=True) == 0.0  # never read: at once


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 20), st.floats(0, 20), st.floats(0.5, 10), st.floats(0.25, 3), st.booleans(), st.booleans(),
       st.one_of(st.none(), st.floats(0, 30)))
def test_a_read_never_starts_in_a_round_or_its_lead_unless_two_periods_overdue(now, last, period, lead, poked,
                                                                                in_round, due):
    start = next_refresh_at(now, last, period, lead, poked=poked, in_round=in_round, round_due=due)
    if now >= last + 2 * period:
        assert start == now
        return
    if start is None:
        assert in_round or due is not None
        return
    assert not in_round and start < last + 2 * period
    if due is not None:  # begun when it says (or now, if that is past), a read of lead/2 ends before the round
        assert max(start, now) <= due - lead / 2


def test_a_slow_read_is_followed_by_the_next_a_period_after_it_ended_not_at_once():
    """A read longer than the period (slurmctld slow, a client hung until its timeout) is not
    followed by another at once: a failure it ends in stays visible to the rounds for a period."""
    src = Lines([line("n1")])
    src.during = lambda: (time.sleep(0.6), [line("n1")])[1]
    cache = FleetCache(src)  # type: ignore[arg-type]
    cache.start(0.3)
    try:
        deadline = time.monotonic() + 10
        while cache.snapshot() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        ended = time.monotonic()
        while src.reads < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert src.reads == 2 and time.monotonic() - ended >= 0.25
    finally:
        cache.stop()


def test_the_lead_before_a_round_follows_the_read_of_slurm_not_a_first_parse_of_every_line():
    src = Lines([line("n1"), line("n2")])
    cache = FleetCache(src)  # type: ignore[arg-type]
    assert cache.lead_s() == MIN_LEAD_S
    src.parsing = lambda: time.sleep(0.3)  # the first read parses every line: slow once
    cache.refresh()
    assert cache.last.seconds >= 0.3 > cache.last.read_s and cache.lead_s() == MIN_LEAD_S
    src.during = lambda: (time.sleep(0.2), [line("n1"), line("n2")])[1]  # a slow read of Slurm
    cache.refresh()
    assert cache.last.parsed == 0 and cache.lead_s() >= 0.6


def test_the_thread_waits_out_a_round_and_reads_before_the_next_one():
    """The daemon's loop: a round runs (no read starts, a poke included), ends, and says when the
    next is due; the read due inside the lead starts before that round instead."""
    src = Lines([line("n1")])
    cache = FleetCache(src)  # type: ignore[arg-type]
    cache.refresh()
    period = 0.6
    cache.round_started()
    cache.start(period)
    try:
        cache.poke()
        time.sleep(period + 0.2)  # past the period: still no read, the round runs
        assert src.reads == 1
        cache.round_ended()
        deadline = time.monotonic() + 5
        while src.reads < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert src.reads == 2  # the poked read, once the round ended
        due = time.monotonic() + period + 0.05  # the next read would be due just before this round
        cache.expect_round(due)
        while src.reads < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        read_ahead = due - time.monotonic()
        assert src.reads == 3 and read_ahead >= MIN_LEAD_S - 0.05
    finally:
        cache.stop()


names = st.sampled_from([f"n{i}" for i in range(8)])
node_state = st.tuples(st.sampled_from(["IDLE", "MIXED", "IDLE+DRAIN", "DOWN+NOT_RESPONDING", "ALLOCATED+DRAIN"]),
                       st.sampled_from(["gpu", "cpu", "gpu,cpu", ""]), st.sampled_from(["", "fan", "healthd: x"]),
                       st.sampled_from(["0.1", "0.2"]))
fleets = st.dictionaries(names, st.tuples(node_state, st.sampled_from(["10.0.0.1", "10.0.0.2", "gpu-a.ib"])),
                         max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(fleets, st.sampled_from([(), ("",), ("", "No nodes in the system")])), min_size=1, max_size=6))
def test_any_sequence_of_fleets_gives_the_snapshot_a_whole_read_would(sequence):
    src = Lines([])
    cache = FleetCache(src)  # type: ignore[arg-type]
    for fleet, stray in sequence:
        nodes = [line(n, state=s, reason=r if "DRAIN" in s or "DOWN" in s else "", partitions=p, load=ld, addr=a)
                 for n, ((s, p, r, ld), a) in fleet.items()]
        src.lines = [*nodes, *stray]  # a line that names no node is not a node (nor an error)
        cache.refresh()
        snap = cache.snapshot()
        want = expected(nodes)
        assert dict(snap.nodes) == want
        parts: dict[str, set[str]] = {}
        for info in want.values():
            for p in info.partitions:
                parts.setdefault(p, set()).add(info.name)
        assert {k: set(v) for k, v in snap.partitions.items()} == parts
        assert snap.out_of_service == {n for n, i in want.items() if out_of_service(i)}
        assert cache.node_addresses() == parse_node_addresses("\n".join(nodes))  # kept from the changed lines
