"""Real journal files and a fake /dev/kmsg for tests.

Journal files are written by systemd's own `systemd-journal-remote`, fed the journal export format on
stdin, so the code under test reads them with the real `systemd.journal.Reader` — nothing is mocked.

    from tests.support.journal import write_journal, KmsgFeed
    path = write_journal(tmp_path, ["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."])
    write_journal(tmp_path, more_lines, name="batch2.journal")   # a second file; times continue

`messages` items are either a string (a kernel-transport entry with that MESSAGE) or a dict of fields
that override the defaults of a kernel entry, e.g. `{"MESSAGE": "...", "_TRANSPORT": "syslog"}`.
A dict may set `__REALTIME_TIMESTAMP` (µs) itself; entries without one get consecutive times.

The kmsg double is a `socketpair(AF_UNIX, SOCK_SEQPACKET)`: one record per read() and EAGAIN when
drained, the same semantics as /dev/kmsg. Give `feed.fd` to the follower as its kmsg path.
"""

from __future__ import annotations

import socket
import struct
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"

DEFAULT_BOOT_ID = "3f1c2a9e8b7d4c6fa1e2d3c4b5a69788"
DEFAULT_MACHINE_ID = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
DEFAULT_START_USEC = 1_700_000_000_000_000
"""2023-11-14T22:13:20Z, in µs since the epoch."""
DEFAULT_MONOTONIC_USEC = 10_000_000
STEP_USEC = 1_000
"""Time between consecutive entries of one batch."""


def _field(name: str, value: object) -> bytes:
    data = value if isinstance(value, bytes) else str(value).encode()
    if b"\n" in data:
        # Export format's binary form: name, newline, 64-bit little-endian length, data, newline.
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


def _last_times(directory: Path) -> tuple[int, int] | None:
    """(realtime, monotonic) µs of the newest entry already in `directory`, to continue after it."""
    if not any(directory.glob("*.journal")):
        return None
    from systemd import journal

    reader = journal.Reader(path=str(directory))
    try:
        reader.seek_tail()
        if not reader._previous(1):
            return None
        rt = reader._get_realtime()
        mono = reader._get_monotonic()[0]
        return rt, mono
    finally:
        reader.close()


def export_entries(
    messages: Iterable[str | Mapping[str, object]],
    *,
    hostname: str = "gpu-node-01",
    boot_id: str = DEFAULT_BOOT_ID,
    machine_id: str = DEFAULT_MACHINE_ID,
    start_usec: int = DEFAULT_START_USEC,
    monotonic_usec: int = DEFAULT_MONOTONIC_USEC,
    noise: bool = False,
) -> Iterable[bytes]:
    """Journal export format, one bytes chunk per entry (blank line included)."""
    rt, mono = start_usec, monotonic_usec
    for item in messages:
        fields: dict[str, object] = {
            "__REALTIME_TIMESTAMP": rt,
            "__MONOTONIC_TIMESTAMP": mono,
            "_BOOT_ID": boot_id,
            "_MACHINE_ID": machine_id,
            "_HOSTNAME": hostname,
            "_TRANSPORT": "kernel",
            "SYSLOG_IDENTIFIER": "kernel",
            "SYSLOG_FACILITY": 0,
            "PRIORITY": 4,
            "_SOURCE_MONOTONIC_TIMESTAMP": mono,
        }
        if isinstance(item, str):
            fields["MESSAGE"] = item
        else:
            fields.update(item)
            if "__REALTIME_TIMESTAMP" in item:
                rt = int(item["__REALTIME_TIMESTAMP"])  # type: ignore[arg-type]
        yield b"".join(_field(k, v) for k, v in fields.items()) + b"\n"
        rt += STEP_USEC
        mono += STEP_USEC
        if noise:
            # Same text through syslog: must never be counted (the reader matches _TRANSPORT=kernel).
            text = fields["MESSAGE"] if isinstance(fields["MESSAGE"], str) else "noise"
            sshd = {
                "__REALTIME_TIMESTAMP": rt,
                "__MONOTONIC_TIMESTAMP": mono,
                "_BOOT_ID": boot_id,
                "_MACHINE_ID": machine_id,
                "_HOSTNAME": hostname,
                "_TRANSPORT": "syslog",
                "SYSLOG_IDENTIFIER": "sshd",
                "SYSLOG_FACILITY": 4,
                "PRIORITY": 6,
                "_PID": 4242,
                "_COMM": "sshd",
                "MESSAGE": f"Invalid user echo from 10.0.0.7: {text}",
            }
            yield b"".join(_field(k, v) for k, v in sshd.items()) + b"\n"
            rt += STEP_USEC
            mono += STEP_USEC


def write_journal(
    directory: Path,
    messages: Iterable[str | Mapping[str, object]],
    *,
    name: str = "kernel.journal",
    hostname: str = "gpu-node-01",
    boot_id: str = DEFAULT_BOOT_ID,
    machine_id: str = DEFAULT_MACHINE_ID,
    start_usec: int | None = None,
    noise: bool = False,
) -> Path:
    """Write `messages` as kernel-transport entries into the journal file `directory/name` and return it.

    A `name` that already exists is appended to (journal-remote reopens it); a new `name` in the same
    directory makes a second file, as journald's rotation does. `start_usec` (realtime of the first
    entry, µs since the epoch) None continues 1 ms after the newest entry already in `directory` (or
    starts at DEFAULT_START_USEC); monotonic time always continues, so batches stay ordered.
    `noise=True` adds an sshd (_TRANSPORT=syslog) entry repeating each message's text.
    """
    if not name.endswith(".journal"):
        raise ValueError(f"journal file name must end in .journal (journal-remote insists): {name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Monotonic time always continues after the newest entry (same boot), even with an explicit
    # start_usec: libsystemd orders entries of one boot across files by it.
    last = _last_times(directory)
    mono = DEFAULT_MONOTONIC_USEC if last is None else last[1] + STEP_USEC
    if start_usec is None:
        start_usec = DEFAULT_START_USEC if last is None else last[0] + STEP_USEC
    out = directory / name
    proc = subprocess.Popen(
        [JOURNAL_REMOTE, "-o", str(out), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    chunk: list[bytes] = []
    size = 0
    for entry in export_entries(
        messages,
        hostname=hostname,
        boot_id=boot_id,
        machine_id=machine_id,
        start_usec=start_usec,
        monotonic_usec=mono,
        noise=noise,
    ):
        chunk.append(entry)
        size += len(entry)
        if size > 1 << 20:
            proc.stdin.write(b"".join(chunk))
            chunk, size = [], 0
    proc.stdin.write(b"".join(chunk))
    proc.stdin.close()
    stderr = proc.stderr.read() if proc.stderr else b""
    if proc.wait() != 0:
        raise RuntimeError(f"systemd-journal-remote failed (rc={proc.returncode}): {stderr.decode(errors='replace')}")
    return out


# --------------------------------------------------------------------------- /dev/kmsg double


def kmsg_record(seq: int, message: str, *, ts_usec: int | None = None, level: int = 4, facility: int = 0,
                props: Mapping[str, str] | None = None) -> bytes:
    """One /dev/kmsg record: `prival,seq,ts_usec,flags;message\\n` plus ` KEY=value` continuation lines."""
    ts = ts_usec if ts_usec is not None else 1_000_000 + seq * 1_000
    head = f"{(facility << 3) | level},{seq},{ts},-;{message}\n"
    tail = "".join(f" {k}={v}\n" for k, v in (props or {}).items())
    return (head + tail).encode()


class KmsgFeed:
    """A SOCK_SEQPACKET socketpair that behaves like /dev/kmsg for the reading end (`fd`).

    `send(seq, message)` queues one record; `send_raw(b"...")` queues arbitrary bytes (a malformed
    record). The reading end is non-blocking: a drained feed answers EAGAIN like a caught-up kmsg.
    """

    def __init__(self) -> None:
        self._writer, self._reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._reader.setblocking(False)
        self._writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    @property
    def fd(self) -> int:
        return self._reader.fileno()

    def send(self, seq: int, message: str, **kwargs: object) -> None:
        self._writer.send(kmsg_record(seq, message, **kwargs))  # type: ignore[arg-type]

    def send_raw(self, record: bytes) -> None:
        self._writer.send(record)

    def close(self) -> None:
        self._writer.close()
        self._reader.close()

    def __enter__(self) -> "KmsgFeed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_boot_id() -> str:
    """This machine's boot id, as the kmsg reader keys its cursor by it."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


__all__ = [
    "DEFAULT_BOOT_ID",
    "DEFAULT_START_USEC",
    "KmsgFeed",
    "export_entries",
    "kmsg_record",
    "read_boot_id",
    "write_journal",
]

