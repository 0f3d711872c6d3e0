"""The agent's reader of the in-band ring files a training job's ranks write (healthd_inband).

A ring is the job's own file, in a directory the job owns: everything in it is the job's word about
itself. So the parser (`parse_ring`) takes plain bytes and returns plain numbers or a `RingError`,
never an exception, whatever the bytes are; and the I/O edge (`read_ring`) opens the file without
following a link, refuses anything that is not a regular file of a bounded size, and copies it twice
with no lock: the writer never waits for the agent.

The layout (docs/inband.md), defined once by the writer (healthd_inband, through healthd.inband_layout):
a 128-byte header, then `capacity` records of 64 bytes, record `seq` (from 1) in slot
`(seq - 1) % capacity`, its sequence number at both ends. The writer stores the tail
copy first, then the body, then the head copy. A copy of memory is not made in address order (the
kernel's string copies may load out of order), so one copy alone cannot prove a record whole: a
record is taken only when its two copies of `seq` agree, the number belongs to its slot, and the
second copy of the file (made after the first returned) holds the same 64 bytes. A record whose head
copy the first copy saw was finished before the second copy began, so the second copy sees it whole
or sees a newer record being written there, and differs. Anything else is counted as torn.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import NamedTuple

# the record kinds too: the agent's modules take them from its reader
from healthd.inband_layout import (CKPT_BEGIN, CKPT_END, DURABLE, FLAG_ERROR, HEADER, KINDS,  # noqa: F401
                                   MAGIC, MAX_CAPACITY, PHASES, RECORD, RESTORED, STEP, STEP_ID, STEP_ID_OFFSET,
                                   VERSION, WAIT)
from healthd.trusted import TooLarge, read_fd

MAX_BYTES = HEADER.size + MAX_CAPACITY * RECORD.size
"""The largest ring read: 4 MiB and a header. A larger file is refused before any byte is read."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class RingHeader:
    version: int
    capacity: int
    pid: int
    rank: int
    local_rank: int
    world_size: int
    device: int
    job: str
    start_wall_ns: int
    start_mono_ns: int
    phase: str
    """compute | wait | checkpoint | unknown: what the rank was doing when the header was copied."""
    phase_mono_ns: int
    """When it entered that phase (CLOCK_MONOTONIC ns)."""
    head: int
    """The last sequence number the writer published when the header was copied (records copied
    after it may be newer)."""
    step: int | None = None
    """The Slurm job step the ring belongs to (SLURM_STEP_ID); None when the ring does not say (a
    ring of an earlier client, or one started outside a step)."""


class RingRecord(NamedTuple):
    """One record of a ring, as read (a tuple: a reader makes one per step per rank it reads)."""

    seq: int
    kind: int
    flags: int
    step: int
    mono_ns: int
    wall_ns: int
    dur_ns: int
    wait_ns: int

    @property
    def kind_name(self) -> str:
        return KINDS.get(self.kind, f"kind-{self.kind}")


@dataclass(frozen=True)
class RingView:
    header: RingHeader
    records: tuple[RingRecord, ...]
    """The published records after `after`, oldest first (the last one is the newest)."""
    last_seq: int
    """The newest sequence number seen (0: nothing written yet)."""
    lost: int
    """Records after `after` overwritten before this copy (the reader fell behind: an overrun)."""
    torn: int
    """Slots being rewritten while they were copied, or holding a number that is not theirs."""


@dataclass(frozen=True)
class RingError:
    reason: str


def _job(raw: bytes) -> str:
    """The job id as printable ASCII; anything else in it is replaced."""
    text = raw.split(b"\0", 1)[0].decode("ascii", "replace")
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text)


def parse_header(data: bytes, size: int | None = None) -> RingHeader | RingError:
    """The header at the start of `data`, checked against the file's `size` (default: `data` is the
    whole file)."""
    size = len(data) if size is None else size
    if len(data) < HEADER.size:
        return RingError(f"truncated header: {len(data)} bytes, a ring has at least {HEADER.size}")
    (magic, version, header_size, record_size, _flags, capacity, pid, rank, local_rank, world_size,
     device, start_wall_ns, start_mono_ns, job, phase, _reserved, phase_mono_ns, head) = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return RingError(f"not a ring: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        return RingError(f"ring version {version} not supported (this reader knows {VERSION})")
    if header_size != HEADER.size:
        return RingError(f"header size {header_size}, version {VERSION} has {HEADER.size}")
    if record_size != RECORD.size:
        return RingError(f"record size {record_size}, version {VERSION} has {RECORD.size}")
    if not 1 <= capacity <= MAX_CAPACITY:
        return RingError(f"capacity {capacity} outside 1..{MAX_CAPACITY}")
    expected = HEADER.size + capacity * RECORD.size
    if size != expected:
        return RingError(f"size {size} bytes, a ring of capacity {capacity} has {expected}")
    (step_id,) = STEP_ID.unpack_from(data, STEP_ID_OFFSET)
    return RingHeader(version, capacity, pid, rank, local_rank, world_size, device, _job(job), start_wall_ns,
                      start_mono_ns, PHASES.get(phase, "unknown"), phase_mono_ns, head,
                      step_id - 1 if step_id else None)


def parse_ring(data: bytes, after: int = 0, again: bytes | None = None) -> RingView | RingError:
    """The ring in `data` (a copy of the whole file), or why it is not one. `after`: the last
    sequence number already read (0: none); only newer records are returned, and `lost` counts
    those newer ones that were overwritten before this copy. `again`: a second copy of the file made
    after `data`; a record not byte-for-byte the same in both is torn (without it, a record is
    judged by its own two sequence numbers only)."""
    header = parse_header(data)
    if isinstance(header, RingError):
        return header
    capacity = header.capacity
    if again is not None and len(again) != len(data):
        return RingError(f"size changed between two copies ({len(data)}, then {len(again)} bytes)")
    newer = _newer(data, after, header) if after else None
    valid: list[tuple[int, ...]] = [] if newer is None else newer
    torn = 0
    for slot, raw in enumerate(RECORD.iter_unpack(memoryview(data)[HEADER.size:]) if newer is None else ()):
        seq, tail = raw[0], raw[9]
        if seq == 0 and tail == 0:
            continue  # never written
        if seq != tail or seq == 0 or (seq - 1) % capacity != slot:
            torn += 1
            continue
        valid.append(raw)
    head = header.head
    last_seq = max(head, max(r[0] for r in valid)) if valid else head
    # The newest `capacity` sequence numbers are the only ones a ring can hold; a slot outside that
    # window is a leftover (or a lie) and is not returned. Values are made only for what is returned.
    low = max(after, last_seq - capacity)
    wanted = sorted(r for r in valid if r[0] > low)
    if again is not None and again != data:  # equal copies (the usual idle ring): nothing to compare
        whole = []
        for r in wanted:
            start = HEADER.size + ((r[0] - 1) % capacity) * RECORD.size
            if again[start:start + RECORD.size] == data[start:start + RECORD.size]:
                whole.append(r)
            else:
                torn += 1
        wanted = whole
    records = tuple(RingRecord(seq, kind, flags, step, mono, wall, dur, wait)
                    for seq, kind, flags, _r, step, mono, wall, dur, wait, _t in wanted)
    window_torn = min(torn, max(0, last_seq - low - len(records)))
    lost = max(0, last_seq - max(after, 0) - len(records) - window_torn)
    return RingView(header, records, last_seq, lost, torn)


def _newer(data: bytes, after: int, header: RingHeader) -> list[tuple[int, ...]] | None:
    """The records after `after`, found by walking the slots forward from the one after `after`'s
    (a reader that keeps up reads only what is new, not every slot); None when the ring may have
    been lapped since (the writer's head is a whole ring ahead) or a slot holds a number from the
    future: then every slot is looked at."""
    capacity, head = header.capacity, header.head
    if head < after or head - after >= capacity - 1:
        return None
    out = []
    for seq in range(after + 1, after + capacity):
        raw = RECORD.unpack_from(data, HEADER.size + ((seq - 1) % capacity) * RECORD.size)
        if raw[0] == seq and raw[9] == seq:
            out.append(raw)
            continue
        if raw[0] > seq or raw[9] > seq:
            return None  # lapped while this copy was made
        break  # an older record not yet overwritten, or the newest one being written
    return out


def read_ring(directory: str, name: str, *, owner: int | None = None,
              limit: int = MAX_BYTES, after: int = 0, known: tuple[int, int, int] | None = None) -> RingView | RingError:
    """Read and parse ring `name` in `directory` (a job's in-band directory). The directory's last
    component and the file are opened without following a link; the file must be a regular file of
    at most `limit` bytes and, when `owner` is given, owned by that uid (the job's user). Every
    failure is a RingError naming the path. `known`: (pid, start monotonic ns, head) as last read:
    when the header still says so, nothing was written since and only the header is read (an idle or
    hung rank costs one small read a tick, not a copy of its ring)."""
    path = os.path.join(directory, name)
    if "/" in name or name in ("", ".", ".."):
        return RingError(f"{name!r} is not a file name")
    try:
        dfd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        return RingError(f"directory {directory}: {_why(e)}")
    try:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError as e:
            return RingError(f"{path}: {_why(e)}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return RingError(f"{path}: not a regular file ({stat.filemode(st.st_mode)})")
            if owner is not None and st.st_uid != owner:
                return RingError(f"{path}: owned by uid {st.st_uid}, not the job's uid {owner}")
            if known is not None:
                same = _unchanged(os.pread(fd, HEADER.size, 0), st.st_size, known)
                if same is not None:
                    return same
            data = read_fd(fd, st, limit, path)
            # The second copy starts after the first returned: see the module's docstring.
            again = os.pread(fd, len(data) + 1, 0)
        except TooLarge as e:
            return RingError(str(e))
        except OSError as e:
            return RingError(f"{path}: {_why(e)}")
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    view = parse_ring(data, after, again)
    if isinstance(view, RingError):
        return RingError(f"{path}: {view.reason}")
    return view


def _unchanged(head: bytes, size: int, known: tuple[int, int, int]) -> RingView | None:
    """The ring as a view with no new records when its header names the same writer and head as
    `known` (and the file still has its size); None: read the whole ring."""
    if len(head) != HEADER.size or size > MAX_BYTES:
        return None
    fields = HEADER.unpack(head)
    if (fields[6], fields[12], fields[17]) != known:
        return None
    header = parse_header(head, size)
    return None if isinstance(header, RingError) else RingView(header, (), header.head, 0, 0)


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "a symbolic link, not followed"
    if e.errno == errno.ENOTDIR:
        return "not a directory (or a symbolic link, not followed)"
    return e.strerror or str(e)
