"""incidents.ensure: an incident per fresh T1/T2 finding, each opened once; a round whose findings all
have theirs writes nothing (no write transaction), and a drain request's job still joins its incident."""

from __future__ import annotations

import logging

from healthd.controller.incidents import ensure
from healthd.controller.ledger import Ledger
from healthd.lograte import RateLimitedLog
from tests.support.fleet_inputs import NOW, finding, report

TTL = 600.0


def test_findings_with_their_incident_open_no_transaction_and_a_named_job_still_joins(tmp_path):
    log = RateLimitedLog(logging.getLogger("test"))
    reports = {"node01": report("node01", finding()), "node02": report("node02", finding(tier=3)),
               "node03": report("node03")}
    with Ledger(tmp_path / "ledger.sqlite") as led:
        statements: list[str] = []
        led._conn.set_trace_callback(statements.append)  # noqa: SLF001 (what reaches SQLite)
        first = ensure(led, reports, list(reports), NOW, TTL, None, log)
        assert list(first) == [("node01", "xid:gpu0:79")]
        assert statements.count("BEGIN IMMEDIATE") == 1
        for later in (NOW + 5, NOW + 10):
            statements.clear()
            assert ensure(led, reports, list(reports), later, TTL, None, log) == first
            assert not any(s.startswith(("BEGIN", "INSERT", "UPDATE")) for s in statements), statements
        statements.clear()
        ensure(led, reports, list(reports), NOW + 15, TTL, {"node01": "4242"}, log)
        assert statements.count("BEGIN IMMEDIATE") == 1
        assert led.incident(first[("node01", "xid:gpu0:79")]).jobs == ("4242",)
        assert len(led.incidents(status="open")) == 1
