"""A stand-in for systemd's end of the sd_notify protocol: a datagram socket that records every
message with its arrival time, and waits on them with deadlines (protocol, never speed)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    at: float
    """time.monotonic() at arrival."""
    text: str
    seen: object = None
    """What `on_message` returned when it arrived (a test's observation at that instant)."""


class NotifyListener:
    """Binds `address` (a path, or '@name' for the abstract namespace) and records datagrams from a
    reader thread. `on_message(text)` runs on arrival; its return value is kept with the message."""

    def __init__(self, address: str, on_message: Callable[[str], object] | None = None) -> None:
        self.address = address
        self.on_message = on_message
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode("utf-8", "replace").splitlines():
                seen = self.on_message(line) if self.on_message else None
                with self._lock:
                    self.messages.append(Message(time.monotonic(), line, seen))

    def snapshot(self) -> list[Message]:
        with self._lock:
            return list(self.messages)

    def texts(self) -> list[str]:
        return [m.text for m in self.snapshot()]

    def wait_for(self, pred: Callable[[Message], bool], timeout: float, what: str, after: int = 0) -> tuple[int, Message]:
        """The first message at index >= `after` matching `pred`: (index, message)."""
        deadline = time.monotonic() + timeout
        while True:
            msgs = self.snapshot()
            for i in range(after, len(msgs)):
                if pred(msgs[i]):
                    return i, msgs[i]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g}s; messages: {[m.text for m in msgs][-40:]}")
            time.sleep(0.05)

    def watchdogs(self, since: float = 0.0) -> list[float]:
        return [m.at for m in self.snapshot() if m.text == "WATCHDOG=1" and m.at >= since]

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2)


def watchdog_silence(listener: NotifyListener, alive: Callable[[], bool], silence_s: float, timeout: float) -> float:
    """Wait until no WATCHDOG=1 has arrived for `silence_s` while `alive()` stays true; returns the
    time of the last one. Raises if the process dies first or the feeding never stops."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        assert alive(), "the daemon exited while it should be alive and merely not feeding the watchdog"
        now = time.monotonic()
        last = max(listener.watchdogs(), default=start)
        if now - max(last, start) >= silence_s:
            return last
        if now > deadline:
            raise AssertionError(f"WATCHDOG=1 kept arriving for {timeout:g}s: {listener.texts()[-20:]}")
        time.sleep(0.1)


def longest_gap(feeds: list[float], start: float, end: float) -> float:
    """The longest stretch of [start, end] without a time in `feeds` (each a time.monotonic())."""
    points = [start, *[t for t in feeds if start <= t <= end], end]
    return max(b - a for a, b in zip(points, points[1:], strict=False))
