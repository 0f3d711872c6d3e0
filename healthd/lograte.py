"""Log lines that cannot flood the journal: at most one line per reason per interval.

A server under connection exhaustion refuses thousands of connections a second; one line for each
would bury everything else in the journal (and cost more CPU than the refusal itself). A
RateLimitedLog writes the first line for a reason at once, counts the lines the next `interval_s`
would have written, and tells that count on the next line for the reason:

    10.0.0.9 refused: 503, 32 connections open from this address (1841 more suppressed in the last 10 s)

`flush()` (call it every interval, e.g. from the event loop) writes the count for a reason that went
quiet, so no suppressed line goes untold. Keys are reasons ("peer-cap", "timeout"), a small fixed set
chosen by the caller, never a peer's address: a flood from many addresses is still one line per
interval. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 64
"""More distinct keys than this (a caller's mistake) share one window under OVERFLOW_KEY."""
OVERFLOW_KEY = "(other)"


class _Window:
    __slots__ = ("started", "suppressed", "level", "what")

    def __init__(self, started: float, level: int, what: str):
        self.started = started
        self.suppressed = 0
        self.level = level
        self.what = what


class RateLimitedLog:
    """One line per key per `interval_s` on `logger`; the rest are counted and told later."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line for `key` went out less than interval_s ago; True if written."""
        return self._emit(level, key, msg, args)

    def debug(self, key: str, msg: str, *args: object) -> bool:
        return self._emit(logging.DEBUG, key, msg, args)

    def info(self, key: str, msg: str, *args: object) -> bool:
        return self._emit(logging.INFO, key, msg, args)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self._emit(logging.WARNING, key, msg, args)

    def error(self, key: str, msg: str, *args: object) -> bool:
        return self._emit(logging.ERROR, key, msg, args)

    def _emit(self, level: int, key: str, msg: str, args: tuple[object, ...]) -> bool:
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            if key not in self._windows and len(self._windows) >= MAX_KEYS:
                key = OVERFLOW_KEY
            window = self._windows.get(key)
            if window is not None and now - window.started < self.interval_s:
                window.suppressed += 1
                return False
            told = window.suppressed if window is not None else 0
            elapsed = now - window.started if window is not None else 0.0
            self._windows[key] = _Window(now, level, key)
        if told:
            msg = f"{msg} (%d more suppressed in the last %.0f s)"
            args = (*args, told, elapsed)
        self.logger.log(level, msg, *args, stacklevel=3)  # the record names the caller's line
        return True

    def flush(self, *, force: bool = False) -> int:
        """Tell the suppressed counts of windows that have ended (every window with `force`), and
        forget those windows, so the next line for their key is written at once. Returns the number
        of lines written."""
        now = self._clock()
        out: list[tuple[int, str, int, float]] = []
        with self._lock:
            for key, window in list(self._windows.items()):
                if force or now - window.started >= self.interval_s:
                    del self._windows[key]
                    if window.suppressed:
                        out.append((window.level, window.what, window.suppressed, now - window.started))
        for level, what, count, elapsed in out:
            self.logger.log(level, "%s: %d more lines suppressed in the last %.0f s", what, count, elapsed, stacklevel=2)
        return len(out)


class WarnOnce:
    """A warning written once per distinct message (a bad file the agent meets every tick): called
    with the message. The memory is bounded: past `limit` messages it starts over, so a message
    comes back at most once per `limit` new ones."""

    def __init__(self, logger: logging.Logger, limit: int = 1000) -> None:
        self.logger = logger
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, msg: str) -> None:
        if msg in self._seen:
            return
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen.add(msg)
        self.logger.warning("%s", msg, stacklevel=2)
