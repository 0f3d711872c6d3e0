"""systemd service protocol: sd_notify(3) messages (READY=1, STATUS=, WATCHDOG=1, STOPPING=1) and the
watchdog rule both daemons follow. Outside systemd (no NOTIFY_SOCKET) everything here is a no-op.

    notifier = notifier_from_env()                  # SocketNotifier, or NullNotifier without NOTIFY_SOCKET
    dog = Watchdog(notifier, watchdog_period_s())   # None: WatchdogSec= unset, feed() sends nothing
    notifier.notify("READY=1")
    dog.feed(time.monotonic(), healthy=True)         # sends WATCHDOG=1 at most every period/2

The messages go out as one AF_UNIX datagram each, exactly as libsystemd's sd_notify does: a path, or
'@name' for an abstract-namespace socket (systemd >= 246 hands services '@...' addresses in some
setups). A raw send keeps the address explicit (no reliance on the process environment) and lets tests
own the socket. ref. https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

JOURNAL_SOCKET = "/run/systemd/journal/socket"


class Notifier(Protocol):
    """Sends one sd_notify message ("READY=1", "STATUS=...", "WATCHDOG=1"). Never raises: a lost
    notification must not take the daemon down (systemd then times it out, which is its job)."""

    def notify(self, message: str) -> None: ...


class NullNotifier:
    """Not started by systemd (or Type= is not notify): nothing to tell."""

    def notify(self, message: str) -> None:
        return None


class SocketNotifier:
    """One datagram per message to the NOTIFY_SOCKET address."""

    def __init__(self, address: str) -> None:
        if not address or address[0] not in "/@":
            raise ValueError(f"NOTIFY_SOCKET {address!r}: expected an absolute path or '@abstract-name'")
        self.address = "\0" + address[1:] if address[0] == "@" else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._warned = False

    def notify(self, message: str) -> None:
        try:
            self._sock.sendto(message.encode("utf-8", "replace"), self.address)
        except OSError as exc:
            if not self._warned:  # once: a gone socket would otherwise log on every tick
                log.warning("sd_notify %s failed: %s", message.split("=", 1)[0], exc)
                self._warned = True

    def close(self) -> None:
        self._sock.close()


def notifier_from_env(environ: Mapping[str, str] = os.environ) -> Notifier:
    """SocketNotifier for $NOTIFY_SOCKET; NullNotifier when it is unset or unusable (logged)."""
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return NullNotifier()
    try:
        return SocketNotifier(address)
    except ValueError as exc:
        log.warning("%s; not notifying systemd", exc)
        return NullNotifier()


def watchdog_period_s(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """WatchdogSec= in seconds from $WATCHDOG_USEC, or None when this process has no watchdog: unset,
    not a positive integer, or $WATCHDOG_PID names another process (the variable was inherited)."""
    raw = environ.get("WATCHDOG_USEC", "")
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; no watchdog", raw)
        return None
    return usec / 1e6 if usec > 0 else None


class Watchdog:
    """Feeds systemd's watchdog only while the caller says the daemon is making progress.

    `feed(now, healthy)` sends WATCHDOG=1 when `healthy` and at least half a period has passed since
    the last one (sd_watchdog_enabled(3) asks for twice per period). An unhealthy call sends nothing,
    so systemd restarts the unit one period after the last feed. `period_s` None: never sends."""

    def __init__(self, notifier: Notifier, period_s: float | None) -> None:
        self.notifier = notifier
        self.period_s = period_s
        self._last: float | None = None

    @property
    def enabled(self) -> bool:
        return self.period_s is not None

    def next_due(self, now: float) -> float | None:
        """Seconds until the next feed is due (0 when due now); None without a watchdog."""
        if self.period_s is None:
            return None
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.period_s / 2 - now)

    def feed(self, now: float, healthy: bool) -> bool:
        """True when WATCHDOG=1 was sent."""
        if not healthy or self.next_due(now) != 0.0:
            return False
        self.notifier.notify("WATCHDOG=1")
        self._last = now
        return True


def stalled_reason(now: float, *, last_tick: float, tick_limit_s: float, stuck_since: dict[str, float],
                   stuck_limit_s: float) -> str:
    """Why the agent must stop feeding the watchdog ('' when it may feed), a pure rule:
    no tick completed in `tick_limit_s`, or a collector (NVML) stuck in one call for more than
    `stuck_limit_s`. The NVML collector never blocks the loop (its call runs in a worker with a hard
    timeout), so a wedged driver shows only as a collector that stays stuck; only a restart can
    start a fresh NVML session, and the state file and metrics have said "NVML hung" meanwhile."""
    if now - last_tick > tick_limit_s:
        return f"no tick completed for {now - last_tick:.0f}s"
    for name, since in sorted(stuck_since.items()):
        if now - since > stuck_limit_s:
            return f"{name} stuck for {now - since:.0f}s"
    return ""


def journal_wanted(environ: Mapping[str, str] = os.environ, journal_socket: str = JOURNAL_SOCKET) -> bool:
    """Log through journald (structured fields) rather than stderr: stderr is systemd's journal
    stream ($JOURNAL_STREAM names its device:inode, systemd.exec(5)), or the journal socket exists."""
    stream = environ.get("JOURNAL_STREAM", "")
    if stream:
        try:
            st = os.fstat(sys.stderr.fileno())
            if stream == f"{st.st_dev}:{st.st_ino}":
                return True
        except (OSError, ValueError, AttributeError):
            pass
    try:
        return stat.S_ISSOCK(os.stat(journal_socket).st_mode)
    except OSError:
        return False


def setup_logging(identifier: str, *, level: str = "info", journal: bool | None = None, stderr_format: str,
                  filters: Sequence[logging.Filter] = (), sender: Callable[..., Any] | None = None) -> None:
    """The root logger of a healthd daemon or command: journald with structured fields when systemd
    runs it, else one plain line per record on stderr. `journal`: None decides from the environment
    (journal_wanted); `filters` add journal fields to records; `sender` replaces systemd.journal.send
    (tests)."""
    root = logging.getLogger()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler: logging.Handler
    if journal if journal is not None else journal_wanted():
        from systemd import journal as sd_journal  # optional dependency: only where journald runs

        handler = sd_journal.JournalHandler(SYSLOG_IDENTIFIER=identifier, sender_function=sender or sd_journal.send)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(stderr_format))
    for f in filters:
        handler.addFilter(f)
    root.handlers[:] = [handler]
