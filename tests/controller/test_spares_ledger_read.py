"""The hot-spare step reads only each node's latest spare writes and the last windows' (Ledger.latest_actions),
not the whole history: over any history of spare writes, what it derives is what the whole history gives."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.controller import spares
from healthd.controller.ledger import Ledger

NODES = ("node01", "node02", "node03")
NOW = 100_000.0
W = spares.RELEASE_WINDOW_S

holds_st = st.lists(st.tuples(st.sampled_from(NODES), st.floats(NOW - W, NOW)), max_size=3, unique_by=lambda h: h[0])
writes_st = st.lists(st.tuples(st.sampled_from(NODES), st.sampled_from((*spares.KINDS, "drain")),
                               st.sampled_from(("applied", "failed", "planned")), st.floats(0, NOW), st.booleans()),
                     max_size=30)


def _all(ledger: Ledger) -> list:
    # what the step read before: every applied action, and the failed revalidations
    return [*ledger.actions(status="applied"), *(a for a in ledger.actions(status="failed") if a.kind == "spare-validate")]


@settings(max_examples=60, deadline=None)
@given(holds=holds_st, writes=writes_st)
def test_the_latest_writes_give_what_the_whole_history_gives(holds, writes):
    # a memory file system where there is one: the ledger syncs every commit
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        ledger = Ledger(Path(tmp) / "ledger.sqlite")
        try:
            hold_rows = [(node, 100 + i, since) for i, (node, since) in enumerate(holds)]
            for i, (node, kind, status, at, serves) in enumerate(sorted(writes, key=lambda w: w[3])):
                # a write names a removal's incident only once that removal happened
                named = [inc for _, inc, since in hold_rows if since <= at]
                evidence = {"reservation": f"healthd_spare_gpu_{node}", "partition": "gpu", "validated_at": at - 5,
                            "reason": "healthd: validation failed", "incident": str(named[-1] if serves and named else 7)}
                d = ledger.record_decision(node=node, kind=kind, tier="T1", mode="auto", reason="x", outcome="allowed",
                                           evidence={}, at=at)
                a = ledger.plan_action(decision_id=d.id, idempotency_key=f"k{i}", node=node, kind=kind,
                                       argv=["scontrol", "x"], partition="gpu", evidence=evidence, at=at)
                if status == "applied":
                    ledger.mark_applied(a.id, at=at, hold=False)
                elif status == "failed":
                    ledger.mark_failed(a.id, "timed out", at=at)
            whole, latest = _all(ledger), ledger.latest_actions(spares.KINDS, NOW - 2 * W)
            validated = {"node02": 50.0}
            assert spares.recorded_spares(whole, validated) == spares.recorded_spares(latest, validated)
            assert spares.validations(whole) == spares.validations(latest)
            assert spares.owed(hold_rows, whole, NOW) == spares.owed(hold_rows, latest, NOW)
        finally:
            ledger.close()
