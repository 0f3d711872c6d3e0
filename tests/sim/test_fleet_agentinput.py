"""healthd.sim.agentinput's input paths against the collectors' own: kernel lines folded by
`kernel_log.fold_lines` equal what the follower folds from /dev/kmsg, and the driver's text that
`xid_line` writes parses back to the Xid, GPU, pid and process it was made from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd.agent.collectors.kernel_log import KernelLogFollower, fold_lines
from healthd.agent.collectors.kernel_parse import parse_line
from healthd.model import normalize_bus_id
from healthd.sim.agentinput import bus_id, xid_line
from tests.support.journal import KmsgFeed

HEX = st.sampled_from("0123456789abcdef")
BUS = st.builds(lambda a, b: f"0000:{a}{b}:00", HEX, HEX)
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,12}", fullmatch=True)


def _xid(bus: str, code: int, pid: int | None, name: str | None, rest: str) -> str:
    who = "" if pid is None else f"pid={pid}, name={name or '<unknown>'}, "
    return f"NVRM: Xid (PCI:{bus}): {code}, {who}{rest}"


# The variants the kernel_parse module docstring lists, built from their documented parts.
LINES = st.one_of(
    st.builds(_xid, BUS, st.integers(1, 160), st.none() | st.integers(1, 2**22), st.none() | NAME,
              st.sampled_from(["GPU has fallen off the bus.", "Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0)",
                               "Row Remapper: New row marked for remapping", "Ch 00000010"])),
    st.builds(lambda b: f"NVRM: GPU {b}.0: GPU has fallen off the bus.", BUS),
    st.builds(lambda b: f"NVRM: GPU {b}.0: RmInitAdapter failed! (0x62:0x40:2393)", BUS),
    st.builds(lambda b, u: f"NVRM: GPU at PCI:{b}: GPU-{u}", BUS, st.uuids().map(str)),
    st.builds(lambda s: f"NVRM: GPU Board Serial Number: {s}", st.integers(10**12, 10**13 - 1)),
    st.sampled_from(["NVRM: Xid (PCI:0000:3b:00): , broken", "usb 1-1: new high-speed USB device",
                     "NVRM: loading NVIDIA UNIX x86_64 Kernel Module"]),
)

FIELDS = ("xid", "bus_id", "text", "count", "pid", "process", "subcode", "nvlink_severity", "gpc", "tpc", "synthesized")


def _events(sample) -> list[tuple]:
    return sorted(tuple(getattr(e, f) for f in FIELDS) for e in sample.events)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINES, max_size=40).flatmap(lambda ls: st.permutations(ls + ls[: len(ls) // 2])))
def test_fold_lines_folds_as_the_follower_folds_the_same_lines_from_kmsg(tmp_path: Path, lines: list[str]):
    with KmsgFeed() as feed:
        for seq, line in enumerate(lines):
            feed.send(seq, line)
        read = KernelLogFollower(str(tmp_path / "no-journal"), kmsg_path=feed.fd).read(0)
    folded = fold_lines([(line, 1000.0 + i) for i, line in enumerate(lines)])
    assert read.status == folded.status == "ok"
    assert _events(folded) == _events(read)
    assert folded.identities == read.identities
    assert (folded.lines_read, folded.malformed) == (read.lines_read, read.malformed)


def test_fold_lines_keeps_each_lines_own_time_and_stops_at_the_bound():
    line = xid_line(79, 0, "GPU has fallen off the bus.")
    (e,) = fold_lines([(line, 10.0), (line, 20.0), (line, 30.0)]).events
    assert (e.count, e.first_ts, e.last_ts, e.first_cursor) == (3, 10.0, 30.0, None)
    bounded = fold_lines([(xid_line(x, 0), 1.0) for x in (13, 31, 43)], max_events=2)
    assert [ev.xid for ev in bounded.events] == [13, 31] and bounded.lines_read == 2


@given(code=st.integers(0, 99999), gpu=st.integers(0, 300), pid=st.none() | st.integers(0, 2**31),
       process=st.none() | NAME, text=st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=80))
def test_xid_line_parses_back_to_what_it_was_made_from(code, gpu, pid, process, text):
    parsed = parse_line(xid_line(code, gpu, text, pid=pid, process=process))
    assert parsed is not None and parsed.kind == "xid"
    assert parsed.xid == code and parsed.pid == pid
    assert parsed.bus_id == normalize_bus_id(bus_id(gpu).rsplit(".", 1)[0])
    if process is not None:
        assert parsed.process == process


def test_gpu_bus_ids_are_distinct_and_in_nvmls_form():
    ids = [bus_id(i) for i in range(300)]
    assert len(set(ids)) == len(ids)
    assert all(normalize_bus_id(b) == b for b in ids)
    assert dataclasses.is_dataclass(fold_lines([]))
