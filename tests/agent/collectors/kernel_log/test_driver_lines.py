"""Real driver lines (tests/fixtures/driver_lines/driver_lines.yaml, each with its public source) read the
way a node reads them: parsed as published, written into real journal files by systemd-journal-remote and
read back by the follower, sent through the /dev/kmsg path, then classified. Every line's expectation and
every record's findings must hold on both paths."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from healthd.agent.classify.catalog import load_catalog
from healthd.agent.collectors.kernel_log import KernelLogFollower
from healthd.agent.collectors.kernel_parse import looks_like_xid, parse_line
from healthd.model import KernelSample
from tests.support.builders import run, snap
from tests.support.journal import DEFAULT_START_USEC, KmsgFeed, write_journal

CORPUS = Path(__file__).resolve().parents[3] / "fixtures" / "driver_lines" / "driver_lines.yaml"
DOC = yaml.safe_load(CORPUS.read_text())
SOURCES: dict[str, dict[str, str]] = DOC["sources"]
RECORDS: list[dict[str, Any]] = DOC["records"]
CATALOG = load_catalog()

_DMESG_TIME = re.compile(r"^\[\s*(\d+\.\d+)\]")
_SYSLOG_DMESG_TIME = re.compile(r"kernel: \[\s*(\d+\.\d+)\]")
KINDS = {"xid", "fallen_off_bus", "init_failed", "gpu_identity", "serial", "none", "malformed"}


def lines() -> list[dict[str, Any]]:
    return [ln for r in RECORDS for ln in r["lines"]]


def message(text: str) -> str:
    """What the kernel logged (a journal MESSAGE, a kmsg record): the published line without what dmesg
    or syslog put before `NVRM`, and a dmesg continuation line without its indent."""
    first, *rest = text.split("\n")
    return "\n".join([first[first.index("NVRM"):], *(ln.strip() for ln in rest)])


def times(record: dict[str, Any]) -> list[float]:
    """Seconds after the record's start of each line (the published spacing, else 1 ms apart)."""
    return [float(ln.get("t", i * 0.001)) for i, ln in enumerate(record["lines"])]


def expected_events(record: dict[str, Any]) -> set[tuple[int, str | None]]:
    return {(ln["expect"]["xid"], ln["expect"].get("bus")) for ln in record["lines"]
            if ln["expect"]["kind"] in ("xid", "fallen_off_bus", "init_failed")}


def classify_sample(sample: KernelSample):
    assert sample.status == "ok", sample.detail
    last = max((e.last_ts for e in sample.events if e.last_ts is not None), default=DEFAULT_START_USEC / 1e6)
    return run(snap(last + 5.0, k=sample))[0]


def check(record: dict[str, Any], sample: KernelSample) -> None:
    name = record["name"]
    assert sample.lines_read == len(record["lines"]), name
    assert sample.malformed == sum(ln["expect"]["kind"] == "malformed" for ln in record["lines"]), name
    assert {(e.xid, e.bus_id) for e in sample.events} == expected_events(record), name
    res = classify_sample(sample)
    got = {f.id: f for f in res.findings if f.source == "kernel_log"}
    want = {f["id"]: f for f in record["findings"]}
    assert sorted(got) == sorted(want), name
    for fid, w in want.items():
        f = got[fid]
        assert (f.tier, f.attribution, f.action) == (w["tier"], w["attribution"], w["action"]), f"{name}: {fid}"
        if "uuid" in w:
            assert f.component.uuid == w["uuid"], f"{name}: {fid}"
        # every line of the record that made an event is in the finding's evidence
        logged = {e.data["xid"] for e in f.evidence if e.kind == "log_line" and e.data and "xid" in e.data}
        assert logged == {x for x, bus in expected_events(record) if bus == f.component.bus_id}, f"{name}: {fid}"


# --------------------------------------------------------------------------- the corpus itself


def test_the_corpus_is_large_varied_and_sourced() -> None:
    all_lines = lines()
    assert len(all_lines) >= 60
    xids = {ln["expect"]["xid"] for ln in all_lines if ln["expect"].get("xid") is not None}
    assert len(xids) >= 25, sorted(xids)
    forms = {ln["form"] for ln in all_lines}
    assert forms == {"journal", "dmesg", "syslog"}
    assert any("\n" in ln["text"] for ln in all_lines), "a multi-line record"
    assert any("PCI:" not in ln["text"] and ln["expect"]["kind"] == "xid" for ln in all_lines), "a line without PCI:"
    assert {144, 145, 146, 147, 148, 149, 150, 154, 143} <= xids
    for key, src in SOURCES.items():
        assert "url" in src or {"repository", "path", "commit"} <= set(src), key
        if "url" in src:
            assert src["url"].startswith("https://"), key
        else:
            assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]), key
    for r in RECORDS:
        assert r["source"] in SOURCES, r["name"]
        for ln in r["lines"]:
            assert ln["form"] in ("journal", "dmesg", "syslog") and ln["expect"]["kind"] in KINDS, r["name"]
    assert len({r["name"] for r in RECORDS}) == len(RECORDS)


@pytest.mark.parametrize("line", [ln for ln in lines() if ln["expect"].get("nvidia")], ids=lambda ln: ln["text"][:60])
def test_each_expectation_names_nvidias_bucket_for_the_xid(line: dict[str, Any]) -> None:
    entry = CATALOG.lookup(line["expect"]["xid"])
    assert entry.in_catalog and entry.nvidia_immediate == line["expect"]["nvidia"]


# --------------------------------------------------------------------------- parsed as published


@pytest.mark.parametrize("line", lines(), ids=lambda ln: ln["text"][:60])
def test_every_line_parses_as_expected(line: dict[str, Any]) -> None:
    expect = line["expect"]
    for text in (line["text"], message(line["text"])):
        parsed = parse_line(text)
        if expect["kind"] == "none":
            assert parsed is None and not looks_like_xid(text)
            continue
        if expect["kind"] == "malformed":
            assert parsed is None and looks_like_xid(text)
            continue
        assert parsed is not None, text
        assert parsed.kind == expect["kind"]
        assert parsed.bus_id == expect.get("bus")
        if "xid" in expect:
            assert parsed.xid == expect["xid"]
        assert parsed.nvlink_severity == expect.get("severity")
        if "subcode" in expect:
            assert parsed.subcode == expect["subcode"]


# --------------------------------------------------------------------------- read from a real journal


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["name"])
def test_every_record_through_a_real_journal(tmp_path: Path, record: dict[str, Any]) -> None:
    entries = [
        {"MESSAGE": message(ln["text"]), "__REALTIME_TIMESTAMP": DEFAULT_START_USEC + int(t * 1e6)}
        for ln, t in zip(record["lines"], times(record), strict=True)
    ]
    write_journal(tmp_path, entries)
    with KernelLogFollower(str(tmp_path), kmsg_path=None, start_at="head") as follower:
        sample = follower.read(0)
    assert sample.detail.startswith("journal")
    check(record, sample)


# --------------------------------------------------------------------------- read from /dev/kmsg


def kmsg_ts_usec(line: dict[str, Any], t: float) -> int:
    """The printk time dmesg printed (`[  885.242168]`), else the record's spacing from a fixed start."""
    m = _DMESG_TIME.match(line["text"]) or _SYSLOG_DMESG_TIME.search(line["text"])
    return int(float(m.group(1)) * 1e6) if m else 5_000_000 + int(t * 1e6)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["name"])
def test_every_record_through_kmsg(tmp_path: Path, record: dict[str, Any]) -> None:
    with KmsgFeed() as feed:
        for seq, (ln, t) in enumerate(zip(record["lines"], times(record), strict=True)):
            # /dev/kmsg escapes a newline inside a record as \x0a; the reader turns it back
            feed.send(seq, message(ln["text"]).replace("\n", "\\x0a"), ts_usec=kmsg_ts_usec(ln, t))
        with KernelLogFollower(str(tmp_path / "no-journal"), kmsg_path=feed.fd, boot_id="b" * 32) as follower:
            sample = follower.read(0)
    assert sample.detail.startswith("kmsg")
    check(record, sample)
