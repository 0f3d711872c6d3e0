"""The ledger's circuit breaker: its opening and reset events; its state is the latest of them."""

from __future__ import annotations

import json
from collections.abc import Iterable

from healthd.controller.ledger.core import LedgerCore, at_or_now, dump_json
from healthd.controller.ledger.records import BreakerRecord, LedgerError


class BreakerStore(LedgerCore):
    """The circuit breaker."""

    def breaker_state(self) -> BreakerRecord:
        with self._lock:
            last_open = self.query_one("SELECT id, at, cause, nodes FROM breaker_events WHERE event = 'open' ORDER BY id DESC LIMIT 1")
            last_reset = self.query_one("SELECT id, at, by, why FROM breaker_events WHERE event = 'reset' ORDER BY id DESC LIMIT 1")
        is_open = last_open is not None and (last_reset is None or last_reset[0] < last_open[0])
        return BreakerRecord(
            open=is_open,
            opened_at=last_open[1] if last_open else None,
            cause=last_open[2] if last_open else None,
            reset_at=last_reset[1] if last_reset else None,
            reset_by=last_reset[2] if last_reset else None,
            why=last_reset[3] if last_reset else None,
            nodes=tuple(json.loads(last_open[3])) if last_open else (),
        )

    def open_breaker(self, cause: str, *, nodes: Iterable[str] = (), at: float | None = None) -> BreakerRecord:
        """Open the breaker; a no-op (keeping the first cause and nodes) if it is already open."""
        with self.transaction():
            if not self.breaker_state().open:
                self._exec(
                    "INSERT INTO breaker_events (event, at, cause, nodes) VALUES ('open', ?, ?, ?)",
                    (at_or_now(at), cause, dump_json(sorted(set(nodes)))),
                )
        return self.breaker_state()

    def reset_breaker(self, *, by: str, why: str, at: float | None = None) -> BreakerRecord:
        """Close the breaker (only ever by an operator, with a why). A no-op if already closed."""
        if not by or not why:
            raise LedgerError(f"{self.path}: a breaker reset needs who and why")
        with self.transaction():
            if self.breaker_state().open:
                self._exec("INSERT INTO breaker_events (event, at, by, why) VALUES ('reset', ?, ?, ?)", (at_or_now(at), by, why))
        return self.breaker_state()
