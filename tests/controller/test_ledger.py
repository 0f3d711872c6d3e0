"""The controller's ledger: schema, every write and read, crash-safe actions, WAL readers, report
figures on a hand-computed history, and files it must refuse to touch."""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from healthd.controller import ledger as ledger_mod
from healthd.controller.ledger import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    Action,
    Ledger,
    LedgerError,
    Percentiles,
    migrate,
    percentile,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def led(path: Path):
    with Ledger(path) as lg:
        yield lg


def _decision(led: Ledger, **kw):
    args = dict(node="n1", kind="drain", tier="T1", mode="auto", reason="healthd: xid 79 [#1]", outcome="allowed", evidence={"xid": 79})
    args.update(kw)
    return led.record_decision(**args)


# -- schema and migrations --------------------------------------------------------------------------


def test_fresh_file_gets_current_schema_wal_and_marker(path: Path) -> None:
    with Ledger(path) as led:
        assert led.schema_version() == SCHEMA_VERSION
        assert led.journal_mode() == "wal"
        assert led.check() == []
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"findings", "incidents", "incident_nodes", "incident_gpus", "decisions", "actions", "approvals", "breaker_events"} <= tables
    raw.close()


def test_reopen_keeps_data_and_does_not_remigrate(path: Path) -> None:
    with Ledger(path) as led:
        led.record_finding("n1", "xid-79", attribution="gpu", tier="T1", action="drain", summary="fell off the bus", at=10)
    with Ledger(path) as led:
        assert led.schema_version() == SCHEMA_VERSION
        assert [f.finding_id for f in led.findings()] == ["xid-79"]


def test_failed_migration_step_rolls_back_with_its_version(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Ledger(path).close()

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("step blew up")

    monkeypatch.setitem(ledger_mod.MIGRATIONS, SCHEMA_VERSION + 1, broken)
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(RuntimeError, match="step blew up"):
        migrate(conn, str(path), target=SCHEMA_VERSION + 1)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'half_done'").fetchone()[0] == 0

    monkeypatch.setitem(ledger_mod.MIGRATIONS, SCHEMA_VERSION + 1, lambda c: c.execute("CREATE TABLE extra (x)"))
    assert migrate(conn, str(path), target=SCHEMA_VERSION + 1) == SCHEMA_VERSION + 1
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()


def test_a_schema_2_ledger_migrates_its_drains_into_holds(path: Path) -> None:
    """A ledger written by the previous schema: its actions keep their rows and get their series, the
    drains still in force become holds (unconfirmed until the reconciler reads Slurm), the rest do not."""
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, str(path), target=2)
    q = conn.execute
    q("INSERT INTO incidents (id, signature, attribution, tier, status, created_at) VALUES (1, 'xid', 'hardware', 'T1', 'open', 1)")
    for i, (node, kind, reason) in enumerate([("n1", "drain", "healthd: a [#1]"), ("n2", "drain", "healthd: b [#1]"),
                                              ("n2", "resume", ""), ("n3", "reboot-asap", "healthd: c [#1]")], 1):
        q("INSERT INTO decisions (id, incident_id, node, kind, tier, mode, reason, evidence, decided_at, outcome) "
          "VALUES (?, 1, ?, ?, 'T1', 'auto', ?, '{}', ?, 'allowed')", (i, node, kind, reason, i))
    rows = [(1, 1, "drain:n1#1", "n1", "drain", "applied", 10), (2, 2, "drain:n2#1", "n2", "drain", "applied", 11),
            (3, 3, "resume:n2#1", "n2", "resume", "applied", 12), (4, 4, "reboot:n3#1#try2", "n3", "reboot-asap",
                                                                   "failed", None)]
    for aid, did, key, node, kind, status, applied in rows:
        q("INSERT INTO actions (id, decision_id, idempotency_key, node, kind, argv, evidence, status, planned_at, applied_at) "
          "VALUES (?, ?, ?, ?, ?, '[\"x\"]', '{}', ?, 1, ?)", (aid, did, key, node, kind, status, applied))
    conn.close()
    with Ledger(path) as led:
        assert led.schema_version() == 3
        assert [(a.series, a.attempt, a.reason) for a in led.actions()] == [
            ("drain:n1#1", 1, "healthd: a [#1]"), ("drain:n2#1", 1, "healthd: b [#1]"), ("resume:n2#1", 1, None),
            ("reboot:n3#1", 2, "healthd: c [#1]")]
        (hold,) = led.holds().values()
        assert (hold.node, hold.action_id, hold.incident_id, hold.reason, hold.confirmed) == (
            "n1", 1, 1, "healthd: a [#1]", False)
        assert led.incident(1).closed_at is None and led.clears() == []


def test_missing_migration_step_is_an_error(path: Path) -> None:
    Ledger(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(LedgerError, match="no migration"):
        migrate(conn, str(path), target=SCHEMA_VERSION + 5)
    conn.close()


def test_newer_schema_is_refused_untouched(path: Path) -> None:
    Ledger(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    with pytest.raises(LedgerError, match=str(path)) as err:
        Ledger(path)
    assert "newer" in str(err.value)


# -- files it must refuse ---------------------------------------------------------------------------


def test_garbage_file_is_a_clear_error_and_left_alone(path: Path) -> None:
    blob = os.urandom(8192)
    path.write_bytes(blob)
    with pytest.raises(LedgerError) as err:
        Ledger(path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == blob


def test_ledger_with_smashed_header_is_a_clear_error(path: Path) -> None:
    with Ledger(path) as led:
        led.record_finding("n1", "xid-79", attribution="gpu", tier="T1", action="drain", summary="s", at=1)
    for extra in ("-wal", "-shm"):
        Path(str(path) + extra).unlink(missing_ok=True)
    data = bytearray(path.read_bytes())
    data[0:16] = b"definitely nope!"
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerError, match=str(path)):
        Ledger(path)
    assert path.read_bytes() == bytes(data)


def test_foreign_sqlite_database_is_refused_untouched(path: Path) -> None:
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE accounts (name TEXT)")
    raw.execute("INSERT INTO accounts VALUES ('alice')")
    raw.commit()
    raw.close()
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="not a healthd ledger") as err:
        Ledger(path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == before


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="not a regular file"):
        Ledger(tmp_path)


# -- writes and reads -------------------------------------------------------------------------------


def test_findings_upsert_keeps_first_seen(led: Ledger) -> None:
    f1 = led.record_finding("n1", "xid-79", gpu_serial="S1", attribution="gpu", tier="T1", action="drain", summary="a", evidence={"n": 1}, at=10)
    f2 = led.record_finding("n1", "xid-79", gpu_serial="S1", attribution="gpu", tier="T2", action="drain", summary="b", evidence={"n": 2}, at=20)
    led.record_finding("n2", "ib-down", attribution="fabric", tier="T2", action="none", summary="c", at=15)
    assert (f1.first_seen, f1.last_seen) == (10, 10)
    assert (f2.first_seen, f2.last_seen, f2.tier, f2.summary, f2.evidence) == (10, 20, "T2", "b", {"n": 2})
    node_level = led.finding("n2", "ib-down")
    assert node_level is not None and node_level.gpu_serial is None
    assert [f.node for f in led.findings()] == ["n1", "n2"]
    assert [f.node for f in led.findings("n2")] == ["n2"]
    assert [f.node for f in led.findings(since=16)] == ["n1"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f2.tier = "T3"  # type: ignore[misc]


def test_incident_members_status_and_timeline(led: Ledger) -> None:
    inc = led.open_incident("xid79", attribution="gpu", tier="T1", nodes=["n1"], gpu_serials=["S1"], jobs=["42"], first_evidence_at=100, detected_at=101, at=101)
    assert (inc.status, inc.nodes, inc.gpu_serials, inc.jobs) == ("open", ("n1",), ("S1",), ("42",))
    inc = led.update_incident(inc.id, status="mitigated", add_nodes=["n2", "n1"], add_gpu_serials=["S2"], add_jobs=["43", "42"])
    assert (inc.status, inc.nodes, inc.gpu_serials, inc.jobs) == ("mitigated", ("n1", "n2"), ("S1", "S2"), ("42", "43"))
    led.mark_timeline(inc.id, "decided_at", 103)
    led.mark_timeline(inc.id, "decided_at", 999)  # first stamp wins
    led.mark_timeline(inc.id, "action_applied_at", 104)
    inc = led.mark_timeline(inc.id, "back_in_service_at", 200)
    assert inc.decided_at == 103
    assert (inc.detection_latency, inc.decision_latency, inc.action_latency, inc.recovery_time) == (1, 2, 1, 100)
    assert inc.isolation_granularity == (2, 2)
    assert led.mark_timeline(inc.id, "decided_at", 102, overwrite=True).decided_at == 102
    with pytest.raises(LedgerError, match="unknown timeline stage"):
        led.mark_timeline(inc.id, "decided_at = 0; --", 1)
    with pytest.raises(LedgerError, match="no incident"):
        led.mark_timeline(9999, "detected_at", 1)
    other = led.open_incident("ib", attribution="fabric", tier="T2", nodes=["n3"], at=300)
    assert [i.id for i in led.incidents()] == [inc.id, other.id]
    assert [i.id for i in led.incidents(node="n3")] == [other.id]
    assert [i.id for i in led.incidents(status="mitigated")] == [inc.id]
    assert [i.id for i in led.incidents(since=250)] == [other.id]


def test_decisions_outcomes_and_refusals(led: Ledger) -> None:
    inc = led.open_incident("xid79", attribution="gpu", tier="T1", nodes=["n1"], at=1)
    d1 = _decision(led, incident_id=inc.id, at=5)
    d2 = _decision(led, incident_id=inc.id, outcome="refused", refused_gate="rate_limit", refused_reason="12/10 actions this hour", at=6)
    d3 = _decision(led, outcome="waiting", tier="T2", at=7)
    assert d1.evidence == {"xid": 79} and d1.refused_gate is None
    assert (d2.refused_gate, d2.refused_reason) == ("rate_limit", "12/10 actions this hour")
    assert [d.id for d in led.decisions(incident_id=inc.id)] == [d1.id, d2.id]
    assert [d.id for d in led.decisions(outcome="waiting")] == [d3.id]
    assert [d.id for d in led.waiting_decisions()] == [d3.id]
    with pytest.raises(LedgerError, match="refusing gate"):
        _decision(led, outcome="refused")
    with pytest.raises(LedgerError, match="outcome"):
        _decision(led, outcome="maybe")
    d3 = led.set_decision_outcome(d3.id, "allowed")
    assert d3.outcome == "allowed"
    assert led.waiting_decisions() == []


def test_approvals_once_per_decision_and_reject_needs_why(led: Ledger) -> None:
    d = _decision(led, outcome="waiting")
    with pytest.raises(LedgerError, match="why"):
        led.record_approval(d.id, operator="root", verdict="reject")
    with pytest.raises(LedgerError, match="verdict"):
        led.record_approval(d.id, operator="root", verdict="maybe")
    a = led.record_approval(d.id, operator="alice", verdict="approve", at=50)
    assert (a.operator, a.verdict, a.why, a.at) == ("alice", "approve", None, 50)
    assert led.approval(d.id) == a
    with pytest.raises(LedgerError, match="already approved"):
        led.record_approval(d.id, operator="bob", verdict="reject", why="no")
    with pytest.raises(LedgerError, match="no decision"):
        led.record_approval(9999, operator="bob", verdict="approve")


def test_action_lifecycle(led: Ledger) -> None:
    d = _decision(led)
    argv = ["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=healthd: xid 79 [#1]"]
    a = led.plan_action(decision_id=d.id, idempotency_key="d1:drain", node="n1", partition="gpu", kind="drain", argv=argv, evidence={"xid": 79}, at=10)
    assert isinstance(a, Action)
    assert (a.status, a.argv, a.partition, a.planned_at, a.applied_at) == ("planned", tuple(argv), "gpu", 10, None)
    assert led.pending_actions() == [a]
    a = led.mark_applied(a.id, "drained", at=11)
    assert (a.status, a.outcome, a.applied_at) == ("applied", "drained", 11)
    assert led.mark_applied(a.id, at=99).applied_at == 11  # repeating is a no-op
    with pytest.raises(LedgerError, match="cannot mark it failed"):
        led.mark_failed(a.id, "late")
    a = led.mark_undone(a.id, "resumed by healthctl undo", at=20)
    assert (a.status, a.undone_at, a.applied_at) == ("undone", 20, 11)
    assert led.pending_actions() == []

    b = led.plan_action(decision_id=d.id, idempotency_key="d1:requeue", node="n1", kind="requeue", argv=["scontrol", "requeue", "42"], at=12)
    b = led.mark_failed(b.id, "scontrol: error: Invalid job id", at=13)
    assert (b.status, b.failed_at, b.outcome) == ("failed", 13, "scontrol: error: Invalid job id")
    with pytest.raises(LedgerError, match="cannot mark it undone"):
        led.mark_undone(b.id)
    with pytest.raises(LedgerError, match="cannot mark it abandoned"):
        led.mark_abandoned(b.id, "x")
    assert led.action_by_key("d1:requeue") == b
    assert [x.id for x in led.actions(decision_id=d.id)] == [a.id, b.id]
    assert [x.id for x in led.actions(status="failed")] == [b.id]
    with pytest.raises(LedgerError, match="argv"):
        led.plan_action(decision_id=d.id, idempotency_key="k", node="n1", kind="drain", argv=[])
    with pytest.raises(LedgerError):
        led.plan_action(decision_id=9999, idempotency_key="orphan", node="n1", kind="drain", argv=["true"])
    assert led.action_by_key("orphan") is None
    # a write whose client reported failure but which Slurm shows: adopted, once
    b = led.mark_applied(b.id, "adopted: Slurm shows it", at=14)
    assert (b.status, b.failed_at, b.applied_at) == ("applied", 13, 14)


def test_plan_action_same_key_returns_existing_row(led: Ledger) -> None:
    d = _decision(led)
    a = led.plan_action(decision_id=d.id, idempotency_key="k1", node="n1", kind="drain", argv=["scontrol", "a"], at=1)
    again = led.plan_action(decision_id=d.id, idempotency_key="k1", node="n1", kind="drain", argv=["scontrol", "b"], at=2)
    assert again == a and again.argv == ("scontrol", "a")
    led.mark_applied(a.id, at=3)
    assert led.plan_action(decision_id=d.id, idempotency_key="k1", node="n1", kind="drain", argv=["scontrol", "a"]).status == "applied"
    assert len(led.actions()) == 1


def test_transaction_groups_writes_and_rolls_back(led: Ledger) -> None:
    with pytest.raises(RuntimeError, match="crash inside"):
        with led.transaction():
            d = _decision(led)
            led.plan_action(decision_id=d.id, idempotency_key="k", node="n1", kind="drain", argv=["x"])
            raise RuntimeError("crash inside")
    assert led.decisions() == [] and led.actions() == []


def test_breaker_open_reset(led: Ledger) -> None:
    s = led.breaker_state()
    assert not s.open and s.opened_at is None
    s = led.open_breaker("3/4 nodes failing within 30 s: leaf switch sw1", nodes=["n3", "n1", "n2"], at=100)
    assert (s.open, s.opened_at, s.cause, s.nodes) == (True, 100, "3/4 nodes failing within 30 s: leaf switch sw1", ("n1", "n2", "n3"))
    assert led.open_breaker("another", at=110).cause.startswith("3/4")  # already open: first cause kept
    with pytest.raises(LedgerError, match="why"):
        led.reset_breaker(by="root", why="")
    s = led.reset_breaker(by="root", why="sw1 replaced", at=200)
    assert (s.open, s.reset_at, s.reset_by, s.why) == (False, 200, "root", "sw1 replaced")
    s = led.open_breaker("PDU 7", at=300)
    assert (s.open, s.opened_at, s.cause, s.nodes) == (True, 300, "PDU 7", ())


def test_budget_counts_applied_actions_by_window_and_partition(led: Ledger) -> None:
    d = _decision(led)
    for i, (part, applied_at, fate) in enumerate(
        [("gpu", 100, "applied"), ("gpu", 200, "applied"), ("cpu", 250, "applied"), ("gpu", 300, "undone"), ("gpu", None, "failed"), ("gpu", None, "planned")]
    ):
        a = led.plan_action(decision_id=d.id, idempotency_key=f"k{i}", node=f"n{i}", partition=part, kind="drain", argv=["x"], at=50)
        if fate in ("applied", "undone"):
            led.mark_applied(a.id, at=applied_at)
        if fate == "undone":
            led.mark_undone(a.id, at=400)
        if fate == "failed":
            led.mark_failed(a.id, "boom", at=260)
    assert led.actions_applied_since(0) == 4
    assert led.actions_applied_since(200) == 3
    assert led.actions_applied_since(200, partition="gpu") == 2
    assert led.actions_applied_since(0, partition="cpu") == 1
    assert led.actions_applied_since(301) == 0
    resume = led.plan_action(decision_id=d.id, idempotency_key="r1", node="n0", partition="gpu", kind="resume", argv=["x"], at=50)
    led.mark_applied(resume.id, at=500)
    assert led.actions_applied_since(450) == 0  # a resume gives capacity back: not charged to the budget


def test_requeues_applied_since_counts_one_series_prefix(led: Ledger) -> None:
    d = _decision(led, kind="requeue-hang")
    for key, applied_at, fate in [("requeue-hang:1:5", 100, "applied"), ("requeue-hang:2:5", 200, "lost"),
                                  ("requeue-hang:3:5", None, "failed"), ("drain:n1#7:requeue:4", 300, "applied"),
                                  ("requeue-hangover:5", 300, "applied")]:
        a = led.plan_action(decision_id=d.id, idempotency_key=key, node="n1", kind="requeue", argv=["x"], at=50)
        if fate == "failed":
            led.mark_failed(a.id, "boom", at=260)
            continue
        led.mark_applied(a.id, at=applied_at)
        if fate == "lost":
            led.mark_ended(a.id, "lost", "restored state", at=250)
    assert led.requeues_applied_since(0, "requeue-hang:") == 2  # made: a lost one counts, a failed one not
    assert led.requeues_applied_since(150, "requeue-hang:") == 1
    assert led.requeues_applied_since(0, "drain:") == 1
    assert led.requeues_applied_since(0, "requeue-hang%") == 0  # a prefix, not a pattern


def test_latest_decision_finds_a_proposal_by_its_key(led: Ledger) -> None:
    assert led.latest_decision("requeue-hang", "requeue-hang:1:5") is None
    first = _decision(led, kind="requeue-hang", outcome="waiting", evidence={"decision": "requeue-hang:1:5"})
    _decision(led, kind="requeue-hang", evidence={"decision": "requeue-hang:2:5"})
    _decision(led, kind="drain", evidence={"decision": "requeue-hang:1:5"})
    assert led.latest_decision("requeue-hang", "requeue-hang:1:5") == first
    later = _decision(led, kind="requeue-hang", outcome="refused", refused_gate="policy", refused_reason="x",
                      evidence={"decision": "requeue-hang:1:5"})
    assert led.latest_decision("requeue-hang", "requeue-hang:1:5") == later


def test_remediation_count_for_escalation(led: Ledger) -> None:
    def remediate(sig: str, node: str, kinds: list[tuple[str, str]], at: float) -> None:
        inc = led.open_incident(sig, attribution="gpu", tier="T1", nodes=[node], at=at)
        d = _decision(led, incident_id=inc.id, node=node, at=at)
        for kind, fate in kinds:
            a = led.plan_action(decision_id=d.id, idempotency_key=f"{inc.id}:{kind}", node=node, kind=kind, argv=["x"], at=at)
            if fate != "failed":
                led.mark_applied(a.id, at=at + 1)
            if fate == "undone":
                led.mark_undone(a.id, at=at + 2)
            if fate == "failed":
                led.mark_failed(a.id, "boom", at=at + 1)

    remediate("xid79", "n1", [("drain", "applied"), ("requeue", "applied")], 100)
    remediate("xid79", "n1", [("drain", "applied"), ("reboot-asap", "applied")], 1000)  # one incident, counts once
    remediate("xid79", "n1", [("drain", "undone")], 2000)  # operator undid it: not a remediation
    remediate("xid79", "n1", [("drain", "failed")], 3000)  # never happened
    remediate("ib-down", "n1", [("drain", "applied")], 4000)  # another signature
    remediate("xid79", "n2", [("resume", "applied")], 5000)  # resume is not a remediation
    assert led.remediation_count("n1", "xid79", since=0) == 2
    assert led.remediation_count("n1", "xid79", since=500) == 1
    assert led.remediation_count("n1", "ib-down", since=0) == 1
    assert led.remediation_count("n2", "xid79", since=0) == 0
    # the batch reads a round makes agree with the one-at-a-time counters, pair by pair
    for since in (0, 500, 1500, 4500):
        batch = led.remediation_counts(since)
        per_node = led.remediations_per_node(since)
        for node in ("n1", "n2", "n3"):
            assert per_node.get(node, 0) == led.remediations_on_node(node, since)
            for sig in ("xid79", "ib-down"):
                assert batch.get((node, sig), 0) == led.remediation_count(node, sig, since)
    assert led.remediation_counts(0) == {("n1", "xid79"): 2, ("n1", "ib-down"): 1}
    assert led.remediations_per_node(0) == {"n1": 3}


def test_holds_follow_healthd_writes_and_how_they_end(led: Ledger) -> None:
    def act(node: str, kind: str, at: float, fate: str = "applied", incident: bool = True, **claim):
        inc = led.open_incident("sig", attribution="gpu", tier="T1", nodes=[node], at=at) if incident else None
        d = _decision(led, incident_id=inc.id if inc else None, node=node, kind=kind, at=at)
        a = led.plan_action(decision_id=d.id, idempotency_key=f"{node}:{kind}:{at}", node=node, kind=kind, argv=["x"],
                            reason=f"healthd: {node} [#{inc.id if inc else '-'}]" if kind != "resume" else None, at=at)
        if fate == "planned":
            return a
        if fate == "failed":
            return led.mark_failed(a.id, "boom", at=at)
        a = led.mark_applied(a.id, at=at, **claim)
        if fate == "undone":
            a = led.mark_undone(a.id, at=at + 1)
        elif fate in ("lost", "released", "completed"):
            a = led.mark_ended(a.id, fate, "because", at=at + 1)
        return a

    n1 = act("n1", "drain", 10, reason_time=10.0, reason_user="root")  # still drained, confirmed
    act("n2", "drain", 10)
    act("n2", "resume", 20)  # resumed by healthd
    act("n3", "drain-and-requeue", 10, fate="undone")  # operator undid it
    act("n4", "reboot-asap", 10)
    act("n4", "resume", 20, fate="failed")  # resume failed: still healthd's
    act("n5", "drain", 10, fate="planned")  # never applied
    act("n6", "resume", 10)
    act("n6", "drain", 30, incident=False)
    act("n7", "drain", 10, fate="released")  # an administrator took it over
    act("n8", "drain", 10, fate="lost")  # slurmctld lost it
    holds = led.holds()
    assert set(holds) == {"n1", "n4", "n6"}
    assert holds["n6"].incident_id is None and not holds["n6"].confirmed
    h1 = holds["n1"]
    assert (h1.action_id, h1.incident_id, h1.kind, h1.reason, h1.reason_time, h1.reason_user, h1.since) == (
        n1.id, led.incidents(node="n1")[0].id, "drain", n1.reason, 10.0, "root", 10)
    assert (n1.slurm_reason_time, n1.slurm_reason_user) == (10.0, "root")
    led.confirm_hold("n6", holds["n6"].action_id, 31.0, "slurm", at=40)
    assert led.hold("n6").confirmed and led.hold("n6").verified_at == 40
    led.verify_holds({"n1": 50.0, "n4": 45.0})
    assert led.hold("n1").verified_at == 50 and led.hold("n4").verified_at == 45
    led.verify_holds({"n1": 20.0})  # never moved back
    assert led.hold("n1").verified_at == 50
    # lost and abandoned writes do not spend the rate-limit budget; the others do
    assert led.actions_applied_since(0) == 6


def test_series_attempts_and_writes_that_may_still_land(led: Ledger) -> None:
    d = _decision(led)
    first = led.plan_action(decision_id=d.id, idempotency_key="k", node="n1", kind="drain", argv=["x"], reason="r", at=1)
    led.mark_failed(first.id, "timed out", at=2)
    second = led.plan_action(decision_id=d.id, idempotency_key="k#try2", series="k", attempt=2, node="n1", kind="drain",
                             argv=["x"], reason="r", at=3)
    led.mark_abandoned(second.id, "planned before a restart", at=4)
    assert [(a.attempt, a.status) for a in led.series("k")] == [(1, "failed"), (2, "abandoned")]
    assert [a.id for a in led.unresolved_since(2)] == [first.id, second.id]
    assert [a.id for a in led.unresolved_since(3)] == [second.id]
    adopted = led.mark_applied(second.id, "adopted", at=5, reason_time=4.0, reason_user="root")
    assert adopted.status == "applied" and led.hold("n1").action_id == second.id


def test_close_incident_clears_its_episode(led: Ledger) -> None:
    inc = led.open_incident("xid:gpu0:79", attribution="hardware", tier="T1", nodes=["n1"], at=1)
    closed = led.close_incident(inc.id, "closed", by="alice", why="handled by the vendor", at=10)
    assert (closed.status, closed.closed_at, closed.closed_by, closed.close_why) == ("closed", 10, "alice",
                                                                                   "handled by the vendor")
    (c,) = led.clears(node="n1")
    assert (c.finding_id, c.before, c.scope, c.incident_id, c.by) == ("xid:gpu0:79", 10, "episode", inc.id, "alice")
    assert led.clears(since=11) == []
    with pytest.raises(LedgerError, match="not one of"):
        led.close_incident(inc.id, "gone", by=None, why="x")
    with pytest.raises(LedgerError, match="scope"):
        led.add_clears("n1", ["f"], before=1, scope="forever")


# -- crash safety -----------------------------------------------------------------------------------

_CRASH_CHILD = """
import sys, time
from healthd.controller.ledger import Ledger
led = Ledger(sys.argv[1])
d = led.record_decision(node="n1", kind="drain", tier="T1", mode="auto", reason="r", outcome="allowed")
a = led.plan_action(decision_id=d.id, idempotency_key="inc7:n1:drain", node="n1", kind="drain",
                    argv=["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=healthd: xid 79 [#7]"])
print(a.id, flush=True)
time.sleep(60)  # "executing" scontrol: killed here, before mark_applied
led.mark_applied(a.id)
"""


def test_crash_between_plan_and_apply_loses_nothing_and_duplicates_nothing(path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line.strip(), "child did not plan its action"
            planned_id = int(line)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL

    with Ledger(path) as led:
        pending = led.pending_actions()
        assert [p.id for p in pending] == [planned_id]
        assert pending[0].status == "planned" and pending[0].argv[-1] == "Reason=healthd: xid 79 [#7]"
        again = led.plan_action(decision_id=pending[0].decision_id, idempotency_key="inc7:n1:drain", node="n1", kind="drain", argv=["scontrol", "other"])
        assert again == pending[0]
        assert len(led.actions()) == 1
        led.mark_applied(again.id, "drained after restart")
    with Ledger(path) as led:
        assert led.pending_actions() == []
        assert [a.status for a in led.actions()] == ["applied"]


_KILLED_MID_TRANSACTION = """
import sys, time
from healthd.controller.ledger import Ledger
led = Ledger(sys.argv[1])
led.record_decision(node="n0", kind="drain", tier="T1", mode="auto", reason="committed", outcome="allowed")
with led.transaction():
    d = led.record_decision(node="n1", kind="drain", tier="T1", mode="auto", reason="r", outcome="allowed")
    led.plan_action(decision_id=d.id, idempotency_key="half", node="n1", kind="drain", argv=["scontrol"])
    print("inside", flush=True)
    time.sleep(60)
"""


def test_killed_inside_a_transaction_leaves_no_trace_and_a_sound_file(path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with subprocess.Popen([sys.executable, "-c", _KILLED_MID_TRANSACTION, str(path)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "inside"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
    with Ledger(path) as led:
        assert led.check() == []
        assert [d.reason for d in led.decisions()] == ["committed"]
        assert led.actions() == [] and led.action_by_key("half") is None


_WRITER = """
import sys
from healthd.controller.ledger import Ledger
led = Ledger(sys.argv[1], busy_timeout_s=10)
for i in range(40):
    d = led.record_decision(node=sys.argv[2], kind="drain", tier="T1", mode="auto", reason=str(i), outcome="allowed")
    led.plan_action(decision_id=d.id, idempotency_key=f"{sys.argv[2]}:{i}", node=sys.argv[2], kind="drain", argv=["x"])
"""


def test_two_writer_processes_wait_for_each_other(path: Path) -> None:
    Ledger(path).close()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    with Ledger(path) as led:
        assert len(led.decisions()) == 80
        assert len(led.actions()) == 80
        assert len(led.pending_actions()) == 80


# -- concurrency (WAL) ------------------------------------------------------------------------------


def test_reader_is_not_blocked_by_an_open_write_and_sees_only_commits(path: Path) -> None:
    writer = Ledger(path)
    reader = Ledger(path, busy_timeout_s=0.2)
    try:
        writer.record_finding("n0", "f0", attribution="gpu", tier="T1", action="drain", summary="s", at=1)
        with writer.transaction():
            writer.record_finding("n1", "f1", attribution="gpu", tier="T1", action="drain", summary="s", at=2)
            t0 = time.monotonic()
            seen = [f.node for f in reader.findings()]
            assert time.monotonic() - t0 < 0.15, "reader waited on the writer"
            assert seen == ["n0"]
        assert [f.node for f in reader.findings()] == ["n0", "n1"]
    finally:
        reader.close()
        writer.close()


def test_reader_thread_during_many_writes(path: Path) -> None:
    writer = Ledger(path)
    errors: list[BaseException] = []
    counts: list[int] = []
    done = threading.Event()

    def read() -> None:
        try:
            with Ledger(path, busy_timeout_s=0.5) as reader:
                while not done.is_set():
                    counts.append(len(reader.findings()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(200):
            writer.record_finding(f"n{i}", "f", attribution="gpu", tier="T1", action="drain", summary="s", at=i)
    finally:
        done.set()
        t.join(timeout=10)
        writer.close()
    assert not errors
    assert counts and counts == sorted(counts), "a reader saw the count go backwards"


def test_ledger_refuses_use_after_fork(led: Ledger) -> None:
    pid = os.fork()
    if pid == 0:  # child
        try:
            led.findings()
        except LedgerError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- report figures on a hand-computed history ------------------------------------------------------


@pytest.fixture
def history(led: Ledger) -> Ledger:
    """Six incidents (created at first evidence):
    id sig      nodes      gpus first det  dec  applied back  status
    I1 xid79    n1         S1   100   101  103  104     200   resolved
    I2 xid79    n1         S1   1000  1002 1003 1010    1500  resolved
    I3 ib-down  n2         -    2000  2004 2010 -       -     open
    I4 switch   n1,n2,n3   -    3000  3001 3002 3003    3300  resolved
    I5 xid79    n3         S2   4000  4001 4002 4003    4100  false_positive (left out)
    I6 xid79    n4         S1   5000  5003 5004 5005    5100  resolved   (S1 moved to n4)
    """
    rows = [
        ("xid79", ["n1"], ["S1"], (100, 101, 103, 104, 200), "resolved"),
        ("xid79", ["n1"], ["S1"], (1000, 1002, 1003, 1010, 1500), "resolved"),
        ("ib-down", ["n2"], [], (2000, 2004, 2010, None, None), "open"),
        ("switch", ["n1", "n2", "n3"], [], (3000, 3001, 3002, 3003, 3300), "resolved"),
        ("xid79", ["n3"], ["S2"], (4000, 4001, 4002, 4003, 4100), "false_positive"),
        ("xid79", ["n4"], ["S1"], (5000, 5003, 5004, 5005, 5100), "resolved"),
    ]
    for sig, nodes, gpus, (fe, det, dec, app, back), status in rows:
        inc = led.open_incident(sig, attribution="gpu", tier="T1", nodes=nodes, gpu_serials=gpus, first_evidence_at=fe, detected_at=det, status=status, at=fe)
        led.mark_timeline(inc.id, "decided_at", dec)
        if app is not None:
            led.mark_timeline(inc.id, "action_applied_at", app)
        if back is not None:
            led.mark_timeline(inc.id, "back_in_service_at", back)
    return led


def test_repeat_offenders(history: Ledger) -> None:
    by_node = history.repeat_offenders_by_node()
    assert [(o.key, o.incidents, o.last_at) for o in by_node] == [("n1", 3, 3000), ("n2", 2, 3000)]
    by_gpu = history.repeat_offenders_by_gpu()
    assert [(o.key, o.incidents, o.last_at) for o in by_gpu] == [("S1", 3, 5000)]
    assert [(o.key, o.incidents) for o in history.repeat_offenders_by_node(since=500)] == [("n1", 2), ("n2", 2)]
    assert [(o.key, o.incidents) for o in history.repeat_offenders_by_node(min_incidents=1)] == [("n1", 3), ("n2", 2), ("n4", 1), ("n3", 1)]


def test_mtbf_per_node(history: Ledger) -> None:
    got = {m.node: (m.failures, m.mtbf_s) for m in history.mtbf_per_node(start=0, end=6000)}
    assert got == {"n1": (3, 2000.0), "n2": (2, 3000.0), "n3": (1, 6000.0), "n4": (1, 6000.0)}
    got = {m.node: (m.failures, m.mtbf_s) for m in history.mtbf_per_node(start=0, end=2500)}
    assert got == {"n1": (2, 1250.0), "n2": (1, 2500.0)}
    with pytest.raises(LedgerError):
        history.mtbf_per_node(start=10, end=10)


def test_latency_percentiles(history: Ledger) -> None:
    p = history.latency_percentiles()
    # detection [1, 1, 2, 3, 4]; decision [1, 1, 1, 2, 6]; action [1, 1, 1, 7]; recovery [100, 100, 300, 500]
    assert p["detection"] == Percentiles(n=5, p50=2, p90=4, p99=4)
    assert p["decision"] == Percentiles(n=5, p50=1, p90=6, p99=6)
    assert p["action"] == Percentiles(n=4, p50=1, p90=7, p99=7)
    assert p["recovery"] == Percentiles(n=4, p50=100, p90=500, p99=500)
    late = history.latency_percentiles(since=4500)
    assert late["detection"] == Percentiles(n=1, p50=3, p90=3, p99=3)


def test_percentile_nearest_rank() -> None:
    vals = list(range(1, 101))
    assert (percentile(vals, 50), percentile(vals, 90), percentile(vals, 99)) == (50, 90, 99)
    assert percentile([], 50) is None
    assert percentile([7], 99) == 7


def test_false_positive_rate_of_observe_proposals(led: Ledger) -> None:
    verdicts = [("observe", "approve"), ("observe", "reject"), ("observe", "reject"), ("observe", "approve"), ("observe", "approve"),
                ("auto", "reject"), ("observe", None)]
    for mode, verdict in verdicts:
        d = _decision(led, mode=mode, outcome="waiting")
        if verdict:
            led.record_approval(d.id, operator="alice", verdict=verdict, why="not a GPU fault" if verdict == "reject" else None)
    fp = led.false_positive_rate()
    assert (fp.approved, fp.rejected, fp.rate) == (3, 2, 0.4)
    assert led.false_positive_rate(mode="auto").rate == 1.0
    assert led.false_positive_rate(mode="supervised").rate is None


def test_open_readonly_reads_and_refuses_writes(tmp_path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.open_incident("xid:gpu0:79", attribution="hardware", tier="T1", nodes=["node02"], at=5)
    ro = Ledger.open_readonly(path)
    try:
        assert [i.signature for i in ro.incidents()] == ["xid:gpu0:79"]
        with pytest.raises(LedgerError):
            ro.open_incident("x", attribution="hardware", tier="T1")
    finally:
        ro.close()
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(LedgerError, match="not a healthd ledger"):
        Ledger.open_readonly(other)
    with pytest.raises(LedgerError, match="no ledger"):
        Ledger.open_readonly(tmp_path / "absent.sqlite")
