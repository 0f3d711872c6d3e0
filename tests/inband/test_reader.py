"""The agent's reader of in-band rings: a pure parser that never raises, whatever the bytes, and an
I/O edge that follows no link, waits on no FIFO and reads nothing oversized. A ring is the job's own
file: hostile rings must yield an error value in bounded time and memory."""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import healthd_inband
from healthd.agent.inband import (HEADER, MAX_BYTES, RECORD, RingError, RingView, parse_ring,
                                  read_ring)

ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "77"}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def new_ring(directory: Path, capacity: int = 64):
    """A writer in this process, as the client makes one (the module itself stays disabled here)."""
    return healthd_inband._Ring(str(directory), ENV | {"HEALTHD_INBAND_CAPACITY": str(capacity)})


def ring_bytes(directory: Path) -> bytes:
    return (directory / "rank-1.ring").read_bytes()


def header(**over) -> bytes:
    fields = dict(magic=b"HDINBAND", version=1, header_size=128, record_size=64, flags=0, capacity=4, pid=1,
                  rank=0, local_rank=0, world=1, device=0, wall=0, mono=0, job=b"1", phase=0, reserved=0,
                  phase_mono=0, head=0)
    fields.update(over)
    return HEADER.pack(*fields.values())


# --------------------------------------------------------------------------- the parser


@SETTINGS
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_never_raise(data: bytes):
    assert isinstance(parse_ring(data), (RingView, RingError))


@SETTINGS
@given(st.binary(max_size=64 * 4), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_arbitrary_records_behind_a_valid_header_never_raise(body: bytes, head: int, after: int):
    data = header(head=head) + body.ljust(4 * 64, b"\0")
    view = parse_ring(data, after=min(after, 2**63))
    assert isinstance(view, RingView)
    assert view.lost >= 0 and view.torn >= 0 and len(view.records) <= 4
    seqs = [r.seq for r in view.records]
    assert seqs == sorted(set(seqs))


OPS = st.lists(st.tuples(st.sampled_from(["step", "wait", "checkpoint", "durable", "restored"]),
                         st.integers(-(2**63), 2**63 - 1)), max_size=200)


@SETTINGS
@given(OPS, st.sampled_from([64, 100]))
def test_a_ring_written_by_the_client_round_trips_exactly(tmp_path_factory, ops, capacity):
    d = tmp_path_factory.mktemp("ring")
    ring = new_ring(d, capacity)
    expected = []
    for op, n in ops:
        if op == "step":
            ring.step(n)
            expected.append(("step", n))
        elif op == "wait":
            with ring.wait():
                pass
            expected.append(("wait", ring.step_no))
        elif op == "checkpoint":
            with ring.checkpoint(n):
                pass
            expected += [("checkpoint_begin", n), ("checkpoint_end", n)]
        elif op == "durable":
            ring.checkpoint_durable(n)
            expected.append(("durable", n))
        else:
            ring.restored(n)
            expected.append(("restored", n))
    view = parse_ring(ring_bytes(d))
    assert isinstance(view, RingView), view
    kept = expected[-capacity:] if expected else []
    assert [(r.kind_name, r.step) for r in view.records] == kept
    assert [r.seq for r in view.records] == list(range(len(expected) - len(kept) + 1, len(expected) + 1))
    assert view.last_seq == view.header.head == len(expected)
    assert view.lost == len(expected) - len(kept) and view.torn == 0
    assert (view.header.rank, view.header.world_size, view.header.job, view.header.capacity) == (1, 2, "77", capacity)


@SETTINGS
@given(st.integers(1, 300), st.data())
def test_a_record_caught_mid_write_is_torn_not_returned(tmp_path_factory, written, data):
    """The writer stores the tail copy of the sequence number, then the body, then the head copy:
    a copy taken after any prefix of that is either the old record, whole, or detected as torn."""
    d = tmp_path_factory.mktemp("ring")
    ring = new_ring(d, 64)
    for i in range(1, written + 1):
        ring.step(i)
    seq = written + 1
    off = HEADER.size + ((seq - 1) % 64) * RECORD.size
    new = bytearray(RECORD.pack(seq, 1, 0, 0, 999_999, 1, 2, 3, 4, seq))
    before = bytes(ring.mm[off:off + RECORD.size])
    # after the tail, and after some of the body: the head copy still holds the old number
    stored = data.draw(st.integers(0, 56 - 8), label="body bytes stored")
    ring.mm[off + 56:off + 64] = new[56:64]
    ring.mm[off + 8:off + 8 + stored] = new[8:8 + stored]
    view = parse_ring(ring_bytes(d))
    assert isinstance(view, RingView)
    assert all(r.step != 999_999 for r in view.records)
    assert view.torn == 1  # an empty slot half-written is torn too (its two copies differ)
    if before != bytes(64):
        assert all(r.seq != seq - 64 for r in view.records)
    assert [r.step for r in view.records] == [r.seq for r in view.records]


@SETTINGS
@given(st.binary(max_size=1024), st.binary(max_size=1024))
def test_arbitrary_second_copies_never_raise(data: bytes, again: bytes):
    data = header(head=3) + data.ljust(256, b"\0")[:256]
    assert isinstance(parse_ring(data, 0, again), (RingView, RingError))


@SETTINGS
@given(st.integers(1, 64), st.integers(0, 63), st.data())
def test_a_record_that_differs_in_the_second_copy_is_torn(tmp_path_factory, written, byte, data):
    """A copy whose loads ran out of order can hold a record with matching sequence numbers and a
    body that was still being written; the second copy, made after it, differs there."""
    d = tmp_path_factory.mktemp("ring")
    ring = new_ring(d, 64)
    for i in range(1, written + 1):
        ring.step(i)
    first = ring_bytes(d)
    slot = data.draw(st.integers(0, written - 1), label="slot")
    again = bytearray(first)
    again[128 + slot * 64 + byte] ^= 0xFF
    view = parse_ring(first, 0, bytes(again))
    assert isinstance(view, RingView)
    assert view.torn == 1 and [r.seq for r in view.records] == [s for s in range(1, written + 1) if s != slot + 1]
    assert view.lost == 0
    whole = parse_ring(first, 0, first)
    assert isinstance(whole, RingView) and len(whole.records) == written and whole.torn == 0


def test_a_second_copy_of_another_size_is_an_error():
    data = header() + bytes(256)
    got = parse_ring(data, 0, data + b"\0")
    assert isinstance(got, RingError) and "between two copies" in got.reason


def test_records_whose_number_is_not_their_slot_s_are_torn():
    data = bytearray(header(capacity=4, head=2) + bytes(4 * 64))
    RECORD.pack_into(data, 128, 1, 1, 0, 0, 10, 1, 1, 0, 0, 1)          # seq 1 in slot 0: fine
    RECORD.pack_into(data, 128 + 64 * 2, 2, 1, 0, 0, 11, 1, 1, 0, 0, 2)  # seq 2 in slot 2: not its slot
    view = parse_ring(bytes(data))
    assert isinstance(view, RingView)
    assert [r.step for r in view.records] == [10] and view.torn == 1 and view.lost == 0


@pytest.mark.parametrize("data, reason", [
    (b"", "truncated header"),
    (header()[:100], "truncated header"),
    (header(magic=b"NOTARING") + bytes(256), "magic"),
    (header(version=2) + bytes(256), "version 2"),
    (header(header_size=256) + bytes(256), "header size"),
    (header(record_size=48) + bytes(256), "record size"),
    (header(capacity=0), "capacity 0"),
    (header(capacity=2**32 - 1) + bytes(256), "capacity"),
    (header(capacity=8) + bytes(256), "size"),   # capacity lies: the file holds 4
    (header(capacity=2) + bytes(256), "size"),
    (header() + bytes(255), "size"),             # truncated records
])
def test_bad_rings_are_errors_that_say_why(data: bytes, reason: str):
    got = parse_ring(data)
    assert isinstance(got, RingError) and reason in got.reason, got


def test_a_forged_header_is_only_numbers():
    data = header(job=b"\x1b[31mevil\n\xff", rank=-5, pid=-1, head=2**64 - 1) + bytes(256)
    view = parse_ring(data)
    assert isinstance(view, RingView)
    assert view.header.job.isprintable() and "\x1b" not in view.header.job
    assert view.header.rank == -5 and view.records == () and view.last_seq == 2**64 - 1


# --------------------------------------------------------------------------- the file


def write_ring(d: Path, name: str = "rank-1.ring") -> Path:
    ring = new_ring(d, 64)
    ring.step(1)
    return d / name


def bounded(fn):
    """Run `fn`, returning its result; fail if it took more than 2 s or allocated more than 16 MiB."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        got = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 2
    assert peak < 16 << 20, peak
    return got


def test_a_symlinked_ring_is_refused(tmp_path: Path):
    real = write_ring(tmp_path)
    (tmp_path / "rank-2.ring").symlink_to(real)
    (tmp_path / "rank-3.ring").symlink_to("/etc/shadow")
    for name in ("rank-2.ring", "rank-3.ring"):
        got = bounded(lambda name=name: read_ring(str(tmp_path), name))
        assert isinstance(got, RingError) and "symbolic link" in got.reason, got


def test_a_symlinked_job_directory_is_refused(tmp_path: Path):
    (tmp_path / "real").mkdir()
    write_ring(tmp_path / "real")
    (tmp_path / "job").symlink_to(tmp_path / "real")
    got = read_ring(str(tmp_path / "job"), "rank-1.ring")
    assert isinstance(got, RingError) and "symbolic link" in got.reason, got


def test_a_fifo_is_refused_without_waiting(tmp_path: Path):
    os.mkfifo(tmp_path / "rank-0.ring")
    got = bounded(lambda: read_ring(str(tmp_path), "rank-0.ring"))
    assert isinstance(got, RingError) and "not a regular file" in got.reason, got


def test_a_directory_is_refused(tmp_path: Path):
    (tmp_path / "rank-0.ring").mkdir()
    got = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(got, RingError), got


def test_a_huge_ring_is_refused_before_reading(tmp_path: Path):
    with open(tmp_path / "rank-0.ring", "wb") as f:
        f.write(header(capacity=2**20))
        f.truncate(1 << 40)  # sparse: a terabyte that costs nothing to make
    got = bounded(lambda: read_ring(str(tmp_path), "rank-0.ring"))
    assert isinstance(got, RingError) and "limit" in got.reason, got


def test_a_ring_just_over_the_limit_is_refused(tmp_path: Path):
    (tmp_path / "rank-0.ring").write_bytes(bytes(MAX_BYTES + 1))
    got = bounded(lambda: read_ring(str(tmp_path), "rank-0.ring"))
    assert isinstance(got, RingError) and "limit" in got.reason, got


@pytest.mark.parametrize("size", [0, 10, 127, 128, 129, 4096, 128 + 64 * 64])
def test_random_bytes_are_an_error(tmp_path: Path, size: int):
    (tmp_path / "rank-0.ring").write_bytes(os.urandom(size))
    got = bounded(lambda: read_ring(str(tmp_path), "rank-0.ring"))
    assert isinstance(got, RingError) and str(tmp_path) in got.reason, got


def test_a_ring_owned_by_someone_else_is_refused_when_the_owner_is_known(tmp_path: Path):
    path = write_ring(tmp_path)
    got = read_ring(str(tmp_path), path.name, owner=os.geteuid() + 1)
    assert isinstance(got, RingError) and "not the job's uid" in got.reason
    assert isinstance(read_ring(str(tmp_path), path.name, owner=os.geteuid()), RingView)


@pytest.mark.parametrize("name", ["", ".", "..", "../rank-0.ring", "a/b"])
def test_only_plain_names_are_read(tmp_path: Path, name: str):
    assert isinstance(read_ring(str(tmp_path), name), RingError)


def test_a_ring_that_grows_while_read_is_refused(tmp_path: Path):
    path = write_ring(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    got = read_ring(str(tmp_path), path.name)
    assert isinstance(got, RingError) and "size" in got.reason


@SETTINGS
@given(written=st.integers(0, 300), back=st.integers(0, 300), capacity=st.sampled_from([64, 128]))
def test_reading_on_from_a_sequence_number_returns_what_a_full_read_returns_after_it(tmp_path, written, back,
                                                                                     capacity):
    d = tmp_path / f"w{written}-{back}-{capacity}"
    d.mkdir()
    ring = new_ring(d, capacity)
    for i in range(written):
        ring.step(i)
    data = ring_bytes(d)
    after = max(0, written - back)
    full = parse_ring(data, 0)
    onward = parse_ring(data, after)
    assert [r.seq for r in onward.records] == [r.seq for r in full.records if r.seq > after]
    assert onward.last_seq == full.last_seq == written
    assert onward.lost == max(0, written - after - capacity)


def test_the_header_says_what_the_rank_is_doing(tmp_path):
    ring = new_ring(tmp_path)
    phase = lambda: parse_ring(ring_bytes(tmp_path)).header.phase  # noqa: E731
    assert phase() == "compute"
    with ring.wait():
        assert phase() == "wait"
    assert phase() == "compute"
    with ring.checkpoint(3):
        assert phase() == "checkpoint"
    ring.enter_wait(time.monotonic_ns())  # a DDP bucket handed to the all-reduce
    assert phase() == "wait"
    ring.step(1)
    view = parse_ring(ring_bytes(tmp_path))
    assert view.header.phase == "compute" and view.header.phase_mono_ns == view.records[-1].mono_ns
