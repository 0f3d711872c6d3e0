"""healthd.sdnotify's pieces, and the controller's INCIDENT journal field."""

from __future__ import annotations

import logging
import os

from healthd.controller.daemon import IncidentField, setup_logging
from healthd.sdnotify import NullNotifier, SocketNotifier, Watchdog, notifier_from_env, stalled_reason, watchdog_period_s
from tests.support.sdnotify import NotifyListener


def test_abstract_namespace_address_works():
    name = f"@healthd-test-{os.getpid()}"
    lst = NotifyListener(name)
    try:
        n = notifier_from_env({"NOTIFY_SOCKET": name})
        assert isinstance(n, SocketNotifier)
        n.notify("READY=1")
        lst.wait_for(lambda m: m.text == "READY=1", 10, "READY=1 on the abstract socket")
    finally:
        lst.close()


def test_no_socket_is_a_no_op_and_watchdog_parsing():
    assert isinstance(notifier_from_env({}), NullNotifier)
    assert isinstance(notifier_from_env({"NOTIFY_SOCKET": "relative"}), NullNotifier)
    assert watchdog_period_s({"WATCHDOG_USEC": "2000000"}) == 2.0
    assert watchdog_period_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "7"}, pid=7) == 2.0
    assert watchdog_period_s({"WATCHDOG_USEC": "x"}) is None and watchdog_period_s({}) is None


def test_watchdog_feeds_twice_a_period_only_when_healthy():
    sent: list[str] = []

    class Rec:
        def notify(self, message: str) -> None:
            sent.append(message)

    dog = Watchdog(Rec(), 2.0)
    assert dog.feed(0.0, healthy=True) and not dog.feed(0.5, healthy=True) and dog.feed(1.0, healthy=True)
    assert not dog.feed(5.0, healthy=False) and sent == ["WATCHDOG=1", "WATCHDOG=1"]
    assert not Watchdog(Rec(), None).feed(0.0, healthy=True)
    assert stalled_reason(10.0, last_tick=9.0, tick_limit_s=3, stuck_since={}, stuck_limit_s=2) == ""
    assert stalled_reason(10.0, last_tick=5.0, tick_limit_s=3, stuck_since={}, stuck_limit_s=2).startswith("no tick")
    assert stalled_reason(10.0, last_tick=9.0, tick_limit_s=3, stuck_since={"nvml": 7.0}, stuck_limit_s=2) == \
        "nvml stuck for 3s"


def test_controller_decision_lines_carry_incident_to_journald():
    sent: list[dict] = []
    saved = logging.getLogger().handlers[:]
    try:
        setup_logging(journal=True, sender=lambda MESSAGE, **fields: sent.append({"MESSAGE": MESSAGE, **fields}))
        log = logging.getLogger("healthd.controller")
        log.info("%s: applied %s: %s", "node01", "scontrol update NodeName=node01 State=DRAIN",
                 "reason=healthd: xid 79 gpu0 [#12]")
        log.warning("incident %s: cannot set %s: %s", 7, "resolved", "locked")
        log.info("nothing to do")
    finally:
        logging.getLogger().handlers[:] = saved
    assert [m.get("INCIDENT") for m in sent] == ["12", "7", None]
    assert all(m["SYSLOG_IDENTIFIER"] == "healthd-controller" for m in sent)
    rec = logging.LogRecord("x", logging.INFO, "f", 1, "group incident #%s: %s", (3, "leaf"), None)
    assert IncidentField().filter(rec) and rec.INCIDENT == "3"
