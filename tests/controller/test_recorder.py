"""The recorder: each gate outcome one ledger row, and a round that repeats what earlier rounds
recorded writes nothing (no transaction: a round every few seconds would otherwise open one for each
batch)."""

from __future__ import annotations

from healthd.controller.gates import GateResult
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import Decision, make_reason
from healthd.controller.recorder import Recorder

NOW = 1_800_000_000.0


def decision(node: str, incident: str) -> Decision:
    return Decision(id=f"drain:{node}:xid:gpu0:79", kind="drain", node=node, reason=make_reason("xid 79 gpu0", incident),
                    tier=1, attribution="hardware", finding_ids=("xid:gpu0:79",), incident=incident, decided_at=NOW)


def test_a_batch_of_outcomes_already_recorded_opens_no_transaction_and_a_new_outcome_is_one_row(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        rec = Recorder(led, ControllerMetrics())
        incidents = [str(led.open_incident("xid:gpu0:79", attribution="hardware", tier="T1", nodes=[n], at=NOW).id)
                     for n in ("node01", "node02")]
        refused = [GateResult(decision(n, i), "refused", gate="mode", reason="observe mode")
                   for n, i in zip(("node01", "node02"), incidents, strict=True)]
        statements: list[str] = []
        led._conn.set_trace_callback(statements.append)  # noqa: SLF001 (what reaches SQLite)
        rec.record_batch(refused, NOW, "observe")
        assert sum(s.startswith("INSERT INTO decisions") for s in statements) == 2
        for later in (NOW + 5, NOW + 10):
            statements.clear()
            rec.record_batch(refused, later, "observe")
            assert statements == []
        statements.clear()
        breaker = GateResult(decision("node01", incidents[0]), "refused", gate="breaker", reason="open")
        rec.record_batch([breaker, refused[1]], NOW + 15, "auto")
        assert sum(s.startswith("INSERT INTO decisions") for s in statements) == 1
        assert [(r.node, r.refused_gate) for r in led.decisions()] == \
            [("node01", "mode"), ("node02", "mode"), ("node01", "breaker")]
