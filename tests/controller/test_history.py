"""The rounds' inputs kept for replay (healthd.controller.history): what a round saw can be read back
as it was for every round time kept, a row per change (not per round), bounded by age, and a damaged
file is a clear error."""

from __future__ import annotations

import dataclasses
import sqlite3
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.controller.history import History, HistoryError, HistorySettings
from healthd.model import Finding
from tests.controller.test_daemon import rig_factory as rig_factory  # noqa: F401 (a fixture)
from tests.support.fleet_inputs import NOW, finding, info, report

NODES = ("node01", "node02", "node03")

# what a node's report may hold at a round: healthy, a T1 Xid 79, a T3 user-code Xid 13
REPORTS = (
    lambda node, at: report(node, received_at=at),
    lambda node, at: report(node, finding(), received_at=at),
    lambda node, at: report(node, finding("xid:gpu0:13", tier=3, action="none", attribution="user", xid=13),
                            received_at=at),
)
ENTRIES = (
    lambda node: info(node),
    lambda node: info(node, flags=("DRAIN",), reason="healthd: Xid 79 [#1]", user="root"),
    lambda node: info(node, state="allocated"),
)


def at_time(spans, t: float) -> dict:
    """node -> the value kept for round time `t`."""
    return {s.node: s.value for s in spans if s.since <= t <= s.until}


rounds = st.lists(st.fixed_dictionaries({n: st.tuples(st.integers(0, 2), st.integers(0, 2),
                                                       st.booleans()) for n in NODES}),
                  min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(rounds=rounds, flush_s=st.sampled_from([1.0, 7.0, 1e9]))
def test_every_round_reads_back_as_it_was(tmp_path_factory, rounds, flush_s):
    """Whatever the rounds saw, the kept rows give back, for each round's time, each node's report and
    Slurm entry as that round had them; a node whose report is gone has none; rows are made only by changes."""
    history = History(tmp_path_factory.mktemp("h") / "history.sqlite", flush_s=flush_s)
    seen = []
    changes = 0
    last: dict = {}
    for i, kinds in enumerate(rounds):
        now = NOW + 5 * i
        reports = {n: REPORTS[r](n, now - 1) for n, (r, _, present) in kinds.items() if present}
        nodes = {n: ENTRIES[e](n) for n, (_, e, _) in kinds.items()}
        key = {n: (r if present else None, e) for n, (r, e, present) in kinds.items()}
        changes += sum(1 for n in NODES if n not in last or last[n][0] != key[n][0] and key[n][0] is not None) + \
            sum(1 for n in NODES if n not in last or last[n][1] != key[n][1])
        last = key
        history.record(now, reports, nodes, fleet_version=i)
        seen.append((now, reports, nodes))
    history.flush(seen[-1][0])
    kept_reports, kept_nodes = list(history.reports()), list(history.slurm_nodes())
    for now, reports, nodes in seen:
        got = at_time(kept_reports, now)
        assert {n: (r.verdict, r.findings) for n, r in got.items()} == \
            {n: (r.verdict, r.findings) for n, r in reports.items()}
        assert at_time(kept_nodes, now) == nodes
    assert len(kept_reports) + len(kept_nodes) <= changes


def test_an_unchanged_report_makes_no_row_and_keeps_its_received_time(tmp_path):
    history = History(tmp_path / "h.sqlite", flush_s=1.0)
    for i in range(100):
        now = NOW + 5 * i
        history.record(now, {"node01": report("node01", finding(), received_at=now - 1)}, {"node01": info("node01")},
                       fleet_version=0)
    history.flush(NOW + 500)
    (span,) = history.reports()
    assert (span.since, span.until, span.fresh) == (NOW, NOW + 495, True)
    assert len(list(history.slurm_nodes())) == 1


def test_a_report_that_stops_coming_goes_stale_in_the_record_when_it_did(tmp_path):
    history = History(tmp_path / "h.sqlite")
    r = report("node01", finding(), received_at=NOW - 1)
    for i in range(60):  # sent once, then nothing: the controller goes on holding it
        history.record(NOW + 5 * i, {"node01": r}, {"node01": info("node01")}, 0, stale_after_s=120.0)
    again = report("node01", finding(), received_at=NOW + 300)
    history.record(NOW + 300, {"node01": again}, {"node01": info("node01")}, 0, stale_after_s=120.0)
    history.flush(NOW + 300)
    first, second = history.reports()
    assert (first.fresh, first.value.received_at, first.until) == (False, NOW - 1, NOW + 295)
    assert (second.since, second.fresh) == (NOW + 300, True)


def test_a_round_where_nothing_changed_writes_nothing(tmp_path):
    history = History(tmp_path / "h.sqlite", flush_s=1e9)
    reports = {"node01": report("node01", finding(), received_at=NOW)}
    history.record(NOW, reports, {"node01": info("node01")}, 0)
    statements = []
    history._db.set_trace_callback(statements.append)  # noqa: SLF001 (what reaches SQLite)
    for i in range(1, 50):
        history.record(NOW + 5 * i, reports, {"node01": info("node01")}, 0)
    assert statements == []


def test_rows_a_stopped_controller_left_open_end_at_its_last_round_kept(tmp_path):
    history = History(tmp_path / "h.sqlite", flush_s=30.0)
    for i in range(10):
        history.record(NOW + 5 * i, {"node01": report("node01", received_at=NOW + 5 * i)}, {"node01": info("node01")}, 0)
    history._db.close()  # noqa: SLF001 (killed: no flush at stop)
    again = History(tmp_path / "h.sqlite")
    (span,) = again.reports()
    assert (span.since, span.until) == (NOW, NOW + 30)  # the last flush: at most flush_s lost


def test_rows_past_keep_days_are_removed_and_the_rest_kept(tmp_path):
    history = History(tmp_path / "h.sqlite", keep_days=1.0, flush_s=60.0)
    history.record(NOW, {"node01": report("node01", finding(), received_at=NOW)}, {"node01": info("node01")}, 0)
    history.record(NOW + 10, {"node01": report("node01", received_at=NOW + 10)}, {"node01": info("node01")}, 0)
    history.record(NOW + 2 * 86400, {"node01": report("node01", received_at=NOW + 2 * 86400)}, {"node01": info("node01")}, 0)
    kept = list(history.reports())
    # the Xid 79 report ended at NOW + 10, more than a day before: gone; the healthy one goes on
    assert [s.value.verdict for s in kept] == ["healthy"] and kept[0].until == NOW + 2 * 86400
    assert history.span() == (NOW, NOW + 2 * 86400)  # Slurm's entry for node01 never changed


def test_a_damaged_row_is_a_clear_error(tmp_path):
    path = tmp_path / "h.sqlite"
    history = History(path)
    history.record(NOW, {"node01": report("node01", finding(), received_at=NOW)}, {"node01": info("node01")}, 0)
    history.close(NOW)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE reports SET doc = ?", ('{"node": "node01", "verdict": "molten", "findings": []}',))
        db.execute("UPDATE slurm_nodes SET entry = ?", ("{not json",))
    history = History(path, readonly=True)
    with pytest.raises(HistoryError, match="node01"):
        list(history.reports())
    with pytest.raises(HistoryError, match="node01"):
        list(history.slurm_nodes())


def test_the_controller_keeps_what_its_rounds_saw_in_observe_mode(rig_factory):  # noqa: F811
    rig = rig_factory("observe")
    assert rig.report("node02")[0] == 200
    now = time.time()
    rig.controller.evaluate(now)
    rig.controller.evaluate(now + 5)
    history = rig.controller.history
    assert history is not None and history.path == HistorySettings().file(str(rig.ledger.path))
    (kept,) = [s for s in history.reports() if s.node == "node02"]
    assert kept.since == now and kept.value.findings[0].xid == 79
    assert {s.node for s in history.slurm_nodes()} == set(rig.backend.state)
    assert rig.backend.writes == []  # observe mode: kept, nothing done


class _Poisoned(Finding):
    def to_json(self):
        raise RuntimeError("poisoned finding")


def test_one_nodes_bad_report_is_skipped_and_the_others_kept(tmp_path):
    from healthd.controller.policy import NodeReport

    history = History(tmp_path / "h.sqlite")
    good = finding()
    poisoned = _Poisoned(**{f.name: getattr(good, f.name) for f in dataclasses.fields(good)})
    bad = NodeReport(node="node01", verdict="failed", findings=(poisoned,), received_at=NOW)
    skipped = history.record(NOW, {"node01": bad, "node02": report("node02", finding(), received_at=NOW)},
                             {"node01": info("node01"), "node02": info("node02")}, 0)
    assert skipped == ["node01: RuntimeError: poisoned finding"]
    assert [s.node for s in history.reports()] == ["node02"]
    assert {s.node for s in history.slurm_nodes()} == {"node01", "node02"}


def test_a_reader_changes_nothing_in_a_record_being_kept(tmp_path):
    path = tmp_path / "h.sqlite"
    keeper = History(path, flush_s=5.0)
    for i in range(3):
        keeper.record(NOW + 5 * i, {"node01": report("node01", received_at=NOW + 5 * i)}, {"node01": info("node01")}, 0)
    before = path.read_bytes(), (tmp_path / "h.sqlite-wal").read_bytes()
    reader = History(path, readonly=True)
    assert [s.until for s in reader.reports()] == [NOW + 10]
    reader.close()
    assert (path.read_bytes(), (tmp_path / "h.sqlite-wal").read_bytes()) == before
    with pytest.raises(sqlite3.OperationalError):
        History(path, readonly=True).record(NOW + 20, {}, {}, 0)


def test_a_large_fleet_is_taken_in_over_rounds_and_a_node_that_leaves_is_seen_whenever(tmp_path, monkeypatch):
    from healthd.controller import history as module

    monkeypatch.setattr(module, "NEW_ROWS_PER_ROUND", 3)
    history = History(tmp_path / "h.sqlite")
    nodes = [f"node{i:02d}" for i in range(1, 8)]
    reports = {n: report(n, received_at=NOW) for n in nodes}
    entries = {n: info(n) for n in nodes}
    for i in range(3):  # 3 + 3 + 1 nodes taken in
        history.record(NOW + 5 * i, reports, entries, i)
    # node01 leaves while node08 comes: the counts are equal, the departure is still seen
    reports = {**{n: r for n, r in reports.items() if n != "node01"}, "node08": report("node08", received_at=NOW)}
    history.record(NOW + 15, reports, entries, 2)
    history.flush()
    kept = {s.node: (s.since, s.until) for s in history.reports()}
    assert kept["node01"] == (NOW, NOW + 10) and kept["node08"] == (NOW + 15, NOW + 15)
    assert [kept[n][0] for n in nodes] == [NOW] * 3 + [NOW + 5] * 3 + [NOW + 10]


def test_a_history_that_cannot_be_opened_is_said_once_and_the_rounds_go_on(tmp_path, caplog):
    from healthd.controller.config import ControllerSettings
    from healthd.controller.daemon import Controller
    from healthd.controller.ledger import Ledger
    from tests.support.fake_slurm import FakeBackend

    ledger = Ledger(tmp_path / "ledger.sqlite")
    settings = ControllerSettings(ledger=str(tmp_path / "ledger.sqlite"),
                                  history=HistorySettings(path=str(tmp_path / "missing" / "history.sqlite")))
    c = Controller(settings, ledger, FakeBackend(["node01"]), clock=lambda: NOW)
    try:
        for i in range(3):
            assert c.evaluate(NOW + 5 * i) is not None
        assert c.history is None
        said = [r for r in caplog.records if "not kept for replay" in r.getMessage()]
        assert len(said) == 1 and "missing" in said[0].getMessage()
    finally:
        c.close()
        ledger.close()
