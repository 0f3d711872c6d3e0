"""Follow the kernel log for NVRM lines: the systemd journal (`_TRANSPORT=kernel`), else /dev/kmsg.

`KernelLogFollower.read(timeout_s)` returns the lines logged since the previous read as a KernelSample:
identical lines folded into one XidEvent with a count, the GPU identities (bus id -> UUID, serial) the
driver announced, and the cursor after the last entry read. The agent persists that cursor with the
history the events were folded into, and passes it back on restart: nothing is lost or counted twice.

Sources, chosen once at the first read that finds one (the follower never switches, which would count
lines twice):

* journal: `journal_dir` (a directory of *.journal files) or, when None, the local system journal.
  Exactly-once resume: `seek_cursor(saved)`, next entry; if it *is*
  the saved entry (`test_cursor`) it was already counted and is skipped, otherwise the saved entry was
  vacuumed: the landing entry is processed and the sample says `gap=True`.
* kmsg: when no journal is readable. One record per read(); cursor `kmsg:<boot_id>:<seq>`; resume on
  the same boot skips seq <= saved; a seq jump or EPIPE (ring overwrote unread records) sets `gap`.

Start without a cursor (`start_at`): "head" everything the source holds; "tail" only lines logged from
now on (from a journal that holds no kernel line yet, all of them: it reads from the head); "boot" this
boot's lines. For an explicit `journal_dir`, "boot" means the entries of this machine's boot id when the
files hold any (a node's own /var/log/journal) and otherwise the head: a directory copied from another
machine has no "this boot", and reading it whole is what a person who points healthd at it expects. On
kmsg "boot" and "head" are the same (the ring holds one boot).

Bounded work per read: at most `max_lines_per_read` entries and `max_events_per_read` distinct lines;
past either bound the read stops (the cursor says exactly where) and `backlog` is True, so the next
read continues at once without waiting. Memory stays flat through an 800,000-line burst.

Status: "ok" reading a source (the detail names it, and why kmsg was used: "kmsg: /dev/kmsg (no
journal: ...)"); "no_data" when no source exists (no journal files, no kmsg device or the fallback
disabled) — not a fault; "error" when a source exists but cannot be read (journal files or /dev/kmsg
denied by permissions, journal_dir not a directory) and nothing else could be read. A journal denied by
permissions while /dev/kmsg is readable reads kmsg, with a warning and the reason in the detail.

Damage: a garbage saved cursor logs one warning and starts at `start_at`. libsystemd skips journal
files it cannot open (a garbage *.journal); inside a corrupt file it stops, which is logged once and
reported as `gap`; later entries and newer files are still read (each read re-seeks after the last
good entry). Nothing here raises out of read().

Speed: the reader's low-level calls (`_next`, `_get("MESSAGE")`, `_get_realtime`, `_get_cursor`)
skip systemd-python's per-field conversion of every field (~14x faster than iterating the Reader);
non-NVRM entries cost one `b"NVRM" in message`; identical lines are folded by a dict lookup on the text,
parsed once. Measured: 100,000 journal entries read, parsed and folded in ~0.18 s.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import time
from dataclasses import dataclass, field

from healthd.config import START_AT
from healthd.agent.collectors.kernel_parse import XID_MARKER, parse_line
from healthd.model import KernelLine, KernelSample, XidEvent
from healthd.persist import read_boot_id

log = logging.getLogger("healthd.kernel_log")

SYSTEM_JOURNAL_DIRS = ("/var/log/journal", "/run/log/journal")
KMSG_BUFFER = 64 * 1024
"""One /dev/kmsg record per read(); a buffer smaller than the record fails with EINVAL."""
PARSE_CACHE_MAX = 4096
IDENTITIES_MAX = 1024

_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
# the details an event carries unchanged from its first line (KernelLine and XidEvent name them alike)
_FROM_LINE = ("bus_id", "pid", "process", "subcode", "nvlink_severity", "gpc", "tpc")


# --------------------------------------------------------------------------- folding


@dataclass(slots=True)
class _Acc:
    """A mutable XidEvent under construction."""

    line: KernelLine
    text: str
    count: int
    first_ts: float
    last_ts: float
    first_cursor: str | None
    last_cursor: str | None

    def freeze(self) -> XidEvent:
        ln = self.line
        return XidEvent(
            xid=ln.xid if ln.xid is not None else 79,
            text=self.text,
            count=self.count,
            first_ts=self.first_ts,
            last_ts=self.last_ts,
            first_cursor=self.first_cursor,
            last_cursor=self.last_cursor,
            synthesized=ln.kind != "xid",
            **{name: getattr(ln, name) for name in _FROM_LINE},
        )


@dataclass
class _Batch:
    """What one read() gathered."""

    events: dict[str, _Acc] = field(default_factory=dict)
    identities: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    lines: int = 0
    malformed: int = 0
    gap: bool = False


class _Folder:
    """Parses messages and folds identical Xid lines (same message text, hence same xid, bus id and
    text). Keeps the one piece of cross-line state: the serial line names the GPU of the identity line
    before it."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self._cache: dict[str, KernelLine | None] = {}
        self.identities: dict[str, tuple[str | None, str | None]] = {}
        self._serial_for: str | None = None
        """Bus id of the last `GPU at PCI:...` line, until a serial line claims it."""

    def parse(self, msg: str) -> KernelLine | None:
        cache = self._cache
        try:
            return cache[msg]
        except KeyError:
            pass
        line = parse_line(msg)
        if len(cache) >= PARSE_CACHE_MAX:
            cache.clear()
        cache[msg] = line
        return line

    def full(self, batch: _Batch, msg: str) -> bool:
        """True when `msg` would add a distinct event past the per-read bound."""
        return len(batch.events) >= self.max_events and msg not in batch.events

    def add(self, batch: _Batch, msg: str, line: KernelLine | None, ts: float, cursor: str | None) -> None:
        if line is None:
            if XID_MARKER in msg:
                batch.malformed += 1
            return
        kind = line.kind
        if kind == "xid" or kind == "fallen_off_bus" or kind == "init_failed":
            acc = batch.events.get(msg)
            if acc is None:
                batch.events[msg] = _Acc(line, msg, 1, ts, ts, cursor, cursor)
            else:
                acc.count += 1
                acc.last_ts = ts
                acc.last_cursor = cursor
            return
        if kind == "gpu_identity" and line.bus_id is not None:
            old = self.identities.get(line.bus_id, (None, None))
            serial = old[1] if old[0] == line.uuid else None
            self._learn(batch, line.bus_id, (line.uuid, serial))
            self._serial_for = line.bus_id
        elif kind == "serial" and self._serial_for is not None:
            bus = self._serial_for
            self._serial_for = None
            uuid = self.identities.get(bus, (None, None))[0]
            self._learn(batch, bus, (uuid, line.serial))

    def _learn(self, batch: _Batch, bus: str, ident: tuple[str | None, str | None]) -> None:
        if self.identities.get(bus) != ident:
            if len(self.identities) >= IDENTITIES_MAX and bus not in self.identities:
                self.identities.pop(next(iter(self.identities)))
            self.identities[bus] = ident
            batch.identities[bus] = ident


# --------------------------------------------------------------------------- sources


class _Unavailable(Exception):
    """A source cannot be used. `status` is "no_data" (absent) or "error" (present, unreadable)."""

    def __init__(self, status: str, detail: str, empty: bool = False) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.empty = empty
        """The journal directory exists and is readable but holds no files yet."""


_PERMISSION_HINT = "run healthd as root or in group systemd-journal"


def _journal_files(root: str) -> list[str]:
    """*.journal and *.journal~ files up to two levels deep (journald keeps them in <machine-id>/)."""
    found: list[str] = []

    def denied(e: OSError) -> None:
        if isinstance(e, PermissionError):
            raise _Unavailable("error", f"cannot list {e.filename}: permission denied; {_PERMISSION_HINT}")

    for base, dirs, files in os.walk(root, onerror=denied):
        depth = base[len(root):].count(os.sep)
        if depth >= 2:
            dirs[:] = []
        found.extend(os.path.join(base, f) for f in files if f.endswith((".journal", ".journal~")))
    return found


def _unreadable(files: list[str]) -> list[str]:
    bad = []
    for f in files:
        try:
            with open(f, "rb"):
                pass
        except PermissionError:
            bad.append(f)
        except OSError:
            pass
    return bad


class _JournalSource:
    name = "journal"

    def __init__(self, journal_dir: str | None, boot_id: str | None, allow_empty: bool = False) -> None:
        self.journal_dir = journal_dir
        self.boot_id = boot_id
        self.allow_empty = allow_empty
        self.reader = self._open()
        self._landing = False
        """The reader stands on an entry that must be processed before calling next."""
        self._resume: str | None = None
        """A cursor to seek to (exclusive) at the next read: the saved cursor until an entry follows it,
        or the last good entry after libsystemd stopped inside a corrupt file."""
        self._good: str | None = None
        """Cursor of the last entry read whose position libsystemd still knew."""
        self._corrupt: str | None = None
        """Set while reading stops at a corrupt entry: the cursor warned about (warn once)."""
        self.where = journal_dir or "system journal"
        self.resumed = False
        self.initial_cursor: str | None = None
        """Where a start at the tail stands, so a restart before any new line resumes there."""

    def _open(self):  # -> systemd.journal.Reader
        try:
            from systemd import journal  # optional dependency: only where a journal is read
        except ImportError as e:  # pragma: no cover - the distribution's python3-systemd or healthd[journal]
            raise _Unavailable("error", f"the systemd binding is not installed ({e}): install python3-systemd and make "
                                        "the venv with --system-site-packages, or pip install 'healthd[journal]'") from None
        d = self.journal_dir
        if d is not None:
            try:
                st = os.stat(d)
            except FileNotFoundError:
                raise _Unavailable("no_data", f"journal directory {d} does not exist") from None
            except PermissionError:
                raise _Unavailable("error", f"cannot access journal directory {d}: permission denied; "
                                   f"{_PERMISSION_HINT}") from None
            except OSError as e:
                raise _Unavailable("error", f"cannot access journal directory {d}: {e.strerror}") from None
            if not stat.S_ISDIR(st.st_mode):
                raise _Unavailable("error", f"journal_dir {d} is not a directory; set kernel_log.journal_dir to a "
                                   "directory of *.journal files")
            files = _journal_files(d)
            if not files and not self.allow_empty:
                raise _Unavailable("no_data", f"no *.journal files in {d}", empty=True)
            bad = _unreadable(files)
            if files and len(bad) == len(files):
                raise _Unavailable("error", f"journal files in {d} are not readable ({bad[0]}: permission denied); "
                                   f"{_PERMISSION_HINT}")
        try:
            reader = journal.Reader(path=d) if d is not None else journal.Reader()
        except OSError as e:
            status = "error" if e.errno in (errno.EACCES, errno.EPERM) else "no_data"
            raise _Unavailable(status, f"cannot open the journal at {d or 'system journal'}: {e}") from None
        try:
            if d is None:
                # Kernel lines live in system*.journal; without the right group libsystemd silently opens
                # only the files it may read (a user's own journal), which would look like a quiet kernel.
                bad = [f for root in SYSTEM_JOURNAL_DIRS if os.path.isdir(root)
                       for f in _unreadable(_journal_files(root)) if os.path.basename(f).startswith("system")]
                if bad:
                    reader.close()
                    raise _Unavailable("error", f"system journal not readable ({bad[0]}: permission denied); "
                                       f"{_PERMISSION_HINT}")
                reader.seek_head()
                if not reader._next(1):
                    reader.close()
                    raise _Unavailable("no_data", "the system journal holds no entries (journald not running?)")
            reader.add_match(_TRANSPORT="kernel")
            reader.data_threshold = 16384
            reader.fileno()  # start inotify now, so files rotated in before the first wait() are seen
        except OSError as e:
            reader.close()
            raise _Unavailable("error", f"cannot read the journal at {d or 'system journal'}: {e}") from None
        return reader

    # ---------------------------------------------------------------- positioning

    def position(self, cursor: str | None, start_at: str) -> bool:
        """Place the reader; returns gap. `cursor` None or unusable: `start_at`."""
        if cursor is not None:
            if cursor.startswith("kmsg:"):
                log.warning("saved kernel log cursor %r is a /dev/kmsg position but the journal is readable now; "
                            "starting at %r", cursor, start_at)
            else:
                try:
                    self.reader.seek_cursor(cursor)
                except (ValueError, OSError) as e:
                    log.warning("saved kernel log cursor %r is not a journal cursor (%s); starting at %r instead",
                                cursor, e, start_at)
                else:
                    self._resume = cursor
                    self.resumed = True
                    return self._land()
        self._start(start_at)
        return False

    def _land(self) -> bool:
        """After seek_cursor(saved): skip the saved entry if it is still there, else keep the landing."""
        saved = self._resume
        r = self.reader
        if not r._next(1):
            return False  # nothing at or after the saved position yet; retry on the next read
        self._resume = None
        if r.test_cursor(saved):
            return False
        if self._corrupt is not None:
            self._landing = True
            return True  # entries after a corrupt one were skipped: a gap, already warned about
        log.warning("kernel log: the entry of the saved cursor is gone (journal vacuumed or rotated away); "
                    "resuming at the next entry %s, lines logged in between may be lost", self._cursor_or_none())
        self._landing = True
        return True

    def _start(self, start_at: str) -> None:
        r = self.reader
        if start_at == "tail":
            self._tail()
            return
        if start_at == "boot" and self.boot_id:
            first = self._first_of_boot(self.boot_id)
            if first is not None:
                r.seek_cursor(first)
                if r._next(1):
                    self._landing = True
                    return
            if self.journal_dir is None:
                # The local journal without a line of this boot yet: everything it holds is older.
                self._tail()
                return
        r.seek_head()

    def _tail(self) -> None:
        r = self.reader
        r.seek_tail()
        if r._previous(1):
            self.initial_cursor = self._cursor_or_none()
            return
        # No kernel entry yet (an empty directory, or only other transports): every kernel line the
        # reader will ever see is new, so the head is the tail. Left at seek_tail(), libsystemd 254 and
        # later stay at the tail for good and next() never returns the entries written afterwards.
        r.seek_head()

    def _first_of_boot(self, boot_id: str) -> str | None:
        r = self.reader
        try:
            r.flush_matches()
            r.add_match(_TRANSPORT="kernel", _BOOT_ID=boot_id)
            r.seek_head()
            return r._get_cursor() if r._next(1) else None
        finally:
            r.flush_matches()
            r.add_match(_TRANSPORT="kernel")

    def _cursor_or_none(self) -> str | None:
        try:
            return self.reader._get_cursor()
        except OSError:
            return None

    # ---------------------------------------------------------------- reading

    def fileno(self) -> int:
        return self.reader.fileno()

    def wait(self, timeout_s: float) -> None:
        self.reader.wait(timeout_s)

    def refresh(self) -> None:
        """Take in files rotated in or removed since the last call (non-blocking)."""
        try:
            self.reader.process()
        except OSError as e:
            log.debug("journal process(): %s", e)

    def pull(self, batch: _Batch, folder: _Folder, max_lines: int) -> tuple[str | None, bool, bool]:
        """Read up to `max_lines` entries into `batch`. Returns (cursor after the last entry processed
        or None when none was, backlog, gap)."""
        gap = False
        if self._resume is not None:
            self.reader.seek_cursor(self._resume)
            gap = self._land()
            if self._resume is not None:
                return None, False, False
        elif self._corrupt == "":
            self.reader.seek_head()  # a corrupt entry before any good one: start over, skipping it if it can
        r = self.reader
        nxt, get, realtime, get_cursor = r._next, r._get, r._get_realtime, r._get_cursor
        landing, self._landing = self._landing, False
        lines = 0
        backlog = False
        moved = False
        last: str | None = None
        try:
            while lines < max_lines:
                if landing:
                    landing = False
                elif not nxt(1):
                    break
                moved = True
                try:
                    raw = get("MESSAGE")
                except KeyError:
                    lines += 1
                    continue
                if b"NVRM" not in raw:
                    lines += 1
                    continue
                msg = raw.decode("utf-8", "replace")
                if folder.full(batch, msg):
                    # Leave this entry for the next read: step back so next() returns it again.
                    r._previous(1)
                    backlog = True
                    break
                ts = realtime() / 1e6
                cur = get_cursor()
                lines += 1
                last = cur
                folder.add(batch, msg, folder.parse(msg), ts, cur)
            else:
                backlog = True
            if not moved and self._corrupt is None:
                return None, backlog, gap
            cursor = get_cursor()
        except OSError as e:
            # libsystemd failed inside a corrupt file, or stopped there and has no current entry left.
            # Resume after the last good entry on every read (exclusive), so entries in other and newer
            # files are still read; the rest of the corrupt file is lost: a gap.
            resume = last or self._good
            if self._corrupt != (resume or ""):
                log.warning("kernel log: journal %s has a corrupt entry after %s (%s); the rest of that file is "
                            "unreadable, later files are still read", self.where, resume, e)
                gap = True
            self._corrupt = resume or ""
            self._resume = resume
            return last, False, gap
        finally:
            batch.lines += lines
        self._corrupt = None
        self._good = cursor
        return (cursor if moved else None), backlog, gap

    def close(self) -> None:
        self.reader.close()


class _KmsgSource:
    name = "kmsg"

    def __init__(self, path: str | int, boot_id: str | None) -> None:
        self.where = path if isinstance(path, str) else f"fd {path}"
        self.boot_id = boot_id or "unknown"
        self._own = isinstance(path, str)
        if isinstance(path, str):
            if not os.path.exists(path):
                raise _Unavailable("no_data", f"{path} does not exist")
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except PermissionError as e:
                raise _Unavailable("error", f"cannot read {path}: {e.strerror} (needs root or CAP_SYSLOG when "
                                   "kernel.dmesg_restrict=1)") from None
            except OSError as e:
                raise _Unavailable("error", f"cannot open {path}: {e.strerror}") from None
        else:
            self.fd = path
            os.set_blocking(path, False)
        self.boot_epoch = time.time() - time.monotonic()
        """printk timestamps count from boot; this turns them into epoch seconds."""
        self.initial_cursor: str | None = None
        self.skip_upto = -1
        """Records with seq <= this were handled before this process started (same boot)."""
        self.last_seq: int | None = None
        """Seq of the last record handled: the cursor."""
        self.expect_seq: int | None = None
        """Seq the next record should have; a larger one means records were lost. None: unknown."""
        self._pending: tuple[str, float, int] | None = None
        """A record read but left for the next read (the distinct-events bound was reached)."""

    def position(self, cursor: str | None, start_at: str) -> bool:
        if cursor is not None:
            parts = cursor.split(":")
            if len(parts) == 3 and parts[0] == "kmsg" and parts[2].isdigit():
                if parts[1] == self.boot_id:
                    self.skip_upto = self.last_seq = int(parts[2])
                    self.expect_seq = self.skip_upto + 1
                    self.initial_cursor = cursor
                else:
                    # A new boot: all of its records are new; a first seq above 0 means some are gone.
                    self.expect_seq = 0
                return False
            log.warning("saved kernel log cursor %r is not a /dev/kmsg cursor ('kmsg:<boot_id>:<seq>'); "
                        "starting at %r", cursor, start_at)
        if start_at == "tail":
            try:
                os.lseek(self.fd, 0, os.SEEK_END)
            except OSError:
                pass  # not seekable (a socket in tests): read what is queued
        return False

    def fileno(self) -> int:
        return self.fd

    def wait(self, timeout_s: float) -> None:
        try:
            select.select([self.fd], [], [], max(0.0, timeout_s))
        except (OSError, ValueError):
            pass

    def refresh(self) -> None:
        pass

    def cursor(self) -> str | None:
        return None if self.last_seq is None else f"kmsg:{self.boot_id}:{self.last_seq}"

    def pull(self, batch: _Batch, folder: _Folder, max_lines: int) -> tuple[str | None, bool, bool]:
        gap = False
        lines = 0
        backlog = False
        moved = False
        try:
            while lines < max_lines:
                if self._pending is not None:
                    msg, ts, seq = self._pending
                    if folder.full(batch, msg):
                        backlog = True
                        break
                    self._pending = None
                    lines += 1
                    moved = True
                    self.last_seq = seq
                    folder.add(batch, msg, folder.parse(msg), ts, f"kmsg:{self.boot_id}:{seq}")
                    continue
                try:
                    rec = os.read(self.fd, KMSG_BUFFER)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    log.warning("kmsg: records were overwritten in the ring before they were read (EPIPE)")
                    gap = True
                    self.expect_seq = None
                    continue
                except InterruptedError:
                    continue
                if not rec:
                    break
                parsed = _parse_kmsg(rec)
                if parsed is None:
                    log.debug("kmsg: malformed record %r", rec[:120])
                    batch.malformed += 1
                    lines += 1
                    self.expect_seq = None  # its seq is unknown: do not call the next one a gap
                    continue
                facility, seq, ts_us, raw = parsed
                if seq <= self.skip_upto:
                    continue
                if self.expect_seq is not None and seq > self.expect_seq:
                    gap = True
                self.expect_seq = seq + 1
                moved = True
                if facility != 0 or b"NVRM" not in raw:
                    self.last_seq = seq
                    lines += 1
                    continue
                if b"\\x" in raw:
                    raw = _KMSG_ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw)
                msg = raw.decode("utf-8", "replace")
                ts = self.boot_epoch + ts_us / 1e6
                if folder.full(batch, msg):
                    self._pending = (msg, ts, seq)
                    backlog = True
                    break
                self.last_seq = seq
                lines += 1
                folder.add(batch, msg, folder.parse(msg), ts, f"kmsg:{self.boot_id}:{seq}")
            else:
                backlog = True
        finally:
            batch.lines += lines
        return (self.cursor() if moved else None), backlog, gap

    def close(self) -> None:
        if self._own:
            try:
                os.close(self.fd)
            except OSError:
                pass


def _parse_kmsg(rec: bytes) -> tuple[int, int, int, bytes] | None:
    """`prival,seq,ts_usec,flags[,...];message\\n[ KEY=value\\n...]` -> (facility, seq, ts_usec, message)."""
    head, sep, body = rec.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 3:
        return None
    try:
        prival, seq, ts_us = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    if prival < 0 or seq < 0 or ts_us < 0:
        return None
    msg = body.split(b"\n", 1)[0]
    return prival >> 3, seq, ts_us, msg


def _read_boot_id() -> str | None:
    """The boot id as the journal writes it (no dashes)."""
    boot_id = read_boot_id()
    return boot_id.replace("-", "") if boot_id else None


# --------------------------------------------------------------------------- the follower


def fold_lines(lines: "list[tuple[str, float]] | tuple[tuple[str, float], ...]", detail: str = "replayed lines",
               max_events: int = 1024) -> KernelSample:
    """Messages read elsewhere (a replayed journal, the simulator), each with its epoch time, parsed
    and folded exactly as a read of the follower folds them: one KernelSample, no cursor. Past
    `max_events` distinct lines the rest are left out, as a read leaves them for the next."""
    folder, batch = _Folder(max(1, int(max_events))), _Batch()
    for msg, ts in lines:
        if folder.full(batch, msg):
            break
        batch.lines += 1
        folder.add(batch, msg, folder.parse(msg), ts, None)
    return KernelSample(status="ok", detail=detail, events=tuple(acc.freeze() for acc in batch.events.values()),
                        identities=dict(batch.identities), lines_read=batch.lines, malformed=batch.malformed)


class KernelLogFollower:
    """Follows the kernel log; see the module docstring. Not thread-safe: one reader thread."""

    def __init__(
        self,
        journal_dir: str | None,
        kmsg_path: str | int | None = "/dev/kmsg",
        cursor: str | None = None,
        start_at: str = "boot",
        max_lines_per_read: int = 200_000,
        *,
        max_events_per_read: int = 1024,
        boot_id: str | None = None,
    ) -> None:
        """`kmsg_path` may be an open file descriptor (a SOCK_SEQPACKET socket in tests; not closed by
        close()). `boot_id` overrides /proc/sys/kernel/random/boot_id (kmsg cursors, start_at "boot")."""
        if start_at not in START_AT:
            log.warning("kernel_log start_at %r is not one of %s; using 'boot'", start_at, "/".join(START_AT))
            start_at = "boot"
        self.journal_dir = journal_dir
        self.kmsg_path = kmsg_path
        self.start_at = start_at
        self.max_lines = max(1, int(max_lines_per_read))
        self.boot_id = (boot_id or _read_boot_id() or "").replace("-", "") or None
        self._saved = cursor
        self._cursor = cursor
        self._source: _JournalSource | _KmsgSource | None = None
        self._folder = _Folder(max(1, int(max_events_per_read)))
        self._pending_gap = False
        self._fallback_note = ""
        self.backlog = False
        """The last read stopped at a bound with more lines waiting; the next read will not wait."""
        self._closed = False

    @property
    def source(self) -> str | None:
        """'journal' or 'kmsg' once a source is open."""
        return self._source.name if self._source else None

    def _open(self) -> KernelSample | None:
        """Open a source if none is; returns the sample to report when none can be opened."""
        if self._source is not None:
            return None
        try:
            return self._open_journal(allow_empty=False)
        except _Unavailable as e:
            journal_err = e
        if self.kmsg_path is None:
            kmsg_err = _Unavailable("no_data", "kmsg fallback disabled")
        else:
            try:
                src = _KmsgSource(self.kmsg_path, self.boot_id)
            except _Unavailable as e:
                kmsg_err = e
            else:
                return self._use_kmsg(src, journal_err)
        if journal_err.empty:
            # The journal directory exists but has no files yet and there is no fallback: watch it, so
            # the first file written there is read as soon as it appears.
            return self._open_journal(allow_empty=True)
        status = "error" if "error" in (journal_err.status, kmsg_err.status) else "no_data"
        return KernelSample(status=status, detail=f"{journal_err.detail}; {kmsg_err.detail}", cursor=self._cursor)

    def _open_journal(self, allow_empty: bool) -> KernelSample | None:
        """Open and position the journal; _Unavailable when there is none to read."""
        src = _JournalSource(self.journal_dir, self.boot_id, allow_empty=allow_empty)
        try:
            self._pending_gap = src.position(self._saved, self.start_at)
        except OSError as e:
            src.close()
            return KernelSample(status="error", detail=f"cannot position the journal at {src.where}: {e}",
                                cursor=self._cursor)
        self._source = src
        self._fallback_note = ""
        self._cursor = src.initial_cursor or self._cursor_if_usable(src)
        return None

    def _use_kmsg(self, src: "_KmsgSource", journal_err: _Unavailable) -> None:
        self._pending_gap = src.position(self._saved, self.start_at)
        self._source = src
        self._fallback_note = f" (no journal: {journal_err.detail})"
        self._cursor = src.initial_cursor or self._cursor_if_usable(src)
        # A journal that exists but cannot be read is a misconfiguration worth a warning even when kmsg works.
        log.log(logging.WARNING if journal_err.status == "error" else logging.INFO,
                "kernel log: reading %s%s", src.where, self._fallback_note)
        return None

    def _cursor_if_usable(self, src: "_JournalSource | _KmsgSource") -> str | None:
        """Keep reporting the saved cursor until the first line is read, unless the source could not use it
        (then the start position stands and a restart must not retry the bad cursor)."""
        if self._saved is None:
            return None
        if isinstance(src, _JournalSource) and src.resumed:
            return self._saved
        return None

    def fileno(self) -> int:
        """The descriptor to select/poll on for new lines; OSError when no source is readable."""
        if self._open() is not None or self._source is None:
            raise OSError(errno.ENOENT, "no kernel log source is readable")
        return self._source.fileno()

    def read(self, timeout_s: float) -> KernelSample:
        """Lines since the previous read, folded. Waits at most `timeout_s` when nothing is new."""
        if self._closed:
            return KernelSample(status="error", detail="kernel log follower is closed", cursor=self._cursor)
        failed = self._open()
        if failed is not None:
            if timeout_s > 0:
                time.sleep(min(timeout_s, 1.0))
            return failed
        src = self._source
        assert src is not None
        batch = _Batch()
        gap, self._pending_gap = self._pending_gap, False
        detail = ""
        try:
            src.refresh()
            cursor, backlog, g = src.pull(batch, self._folder, self.max_lines)
            gap |= g
            deadline = time.monotonic() + timeout_s
            while cursor is None and not backlog and not gap:
                # Nothing new: wait. A wakeup can bring nothing (the journal's first wait() always
                # returns INVALIDATE; a kmsg record may be one already seen), so wait until the deadline.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                src.wait(remaining)
                src.refresh()
                cursor, backlog, g = src.pull(batch, self._folder, self.max_lines)
                gap |= g
        except OSError as e:
            # Sources handle corrupt entries themselves; this is a failure around them (seek, wait).
            log.warning("kernel log: reading %s failed: %s", src.where, e)
            detail = f"read error on {src.where}: {e}"
            cursor, backlog = None, False
        if cursor is not None:
            self._cursor = cursor
        self.backlog = backlog
        batch.gap = gap
        return KernelSample(
            status="ok",
            detail=detail or f"{src.name}: {src.where}{self._fallback_note}",
            events=tuple(acc.freeze() for acc in batch.events.values()),
            identities=dict(batch.identities),
            lines_read=batch.lines,
            malformed=batch.malformed,
            gap=batch.gap,
            cursor=self._cursor,
        )

    def close(self) -> None:
        self._closed = True
        if self._source is not None:
            self._source.close()
            self._source = None

    def __enter__(self) -> "KernelLogFollower":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
