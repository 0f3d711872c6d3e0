"""The rules table and the documentation's tier table agree: every row of the table is documented
with its tier, attribution and action, every documented row exists (the `xid` rows in the catalog),
and the rules raise nothing the table does not list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from healthd.agent.classify.catalog import XidOutcome
from healthd.agent.classify.rules import RULES, TABLE, Rule, RulesTableError, _index, quick_check, rule
from healthd.agent.hookfiles import findings_from_checks
from healthd.model import iso
from tests.support.builders import CATALOG, NOW, cd, fs, gpu, host, ib, kernel, nvml, port, run, settings, snap, xid

DOC = Path(__file__).resolve().parents[3] / "docs" / "agent.md"
SECTION = "## Tiers, attribution and actions"
SYMPATHETIC_ATTRIBUTION = "of the Xid it follows"


def doc_rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    assert SECTION in text, f"docs/agent.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| kind |")]
    assert len(lines) == 1, "the section holds one table with a 'kind' column"
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:5] == ["kind", "case", "tier", "attribution", "action"], header
    body = section.split(lines[0], 1)[1].splitlines()[2:]
    rows = []
    for ln in body:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def kind_of(cell: str) -> str:
    m = re.fullmatch(r"`([a-z0-9_.]+)`", cell)
    assert m, f"kind cell {cell!r} is not one `kind`"
    return m.group(1)


def tier_of(cell: str) -> int:
    m = re.fullmatch(r"T([123])", cell)
    assert m, f"tier cell {cell!r} is not T1, T2 or T3"
    return int(m.group(1))


def xids_of(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def catalog_outcome(case: str) -> list[tuple[int, XidOutcome | None, str]]:
    """(xid, outcome, rule) for an `xid` row's case: `<xids>[ <rule>[ <word>]]`."""
    m = re.fullmatch(r"([0-9, -]+?)(?: (repeat|sympathetic|severity|recovery)(?: (\S+))?)?", case)
    assert m, f"xid case {case!r}: expected '<xids>[ repeat | sympathetic | severity <word> | recovery <word>]'"
    numbers, how, word = m.groups()
    out = []
    for x in xids_of(numbers):
        assert x in CATALOG, f"xid row {case!r}: Xid {x} is not in the catalog"
        e = CATALOG.lookup(x)
        if how is None:
            out.append((x, e.outcome, ""))
        elif how == "repeat":
            out.append((x, e.repeat, how))
        elif how == "sympathetic":
            out.append((x, XidOutcome(3, SYMPATHETIC_ATTRIBUTION, "none") if e.sympathetic else None, how))
        elif how == "severity":
            out.append((x, e.severity.get(word or ""), how))
        else:
            out.append((x, next((o for w, o in e.recovery_action if w == word), None), how))
    return out


def test_every_documented_row_exists_with_the_same_outcome():
    rows = doc_rows()
    assert rows
    for r in rows:
        kind, case = kind_of(r["kind"]), r["case"]
        documented = (tier_of(r["tier"]), r["attribution"], r["action"])
        if kind == "xid":
            for x, outcome, how in catalog_outcome(case):
                assert outcome is not None, f"docs row xid {case!r}: Xid {x} has no {how} rule in the catalog"
                assert (outcome.tier, outcome.attribution, outcome.action) == documented, f"docs row xid {case!r}, Xid {x}"
            continue
        assert (kind, case) in TABLE, f"docs/agent.md lists {kind} ({case or 'no case'}), which the rules table lacks"
        t = TABLE[(kind, case)]
        assert (t.tier, t.attribution, t.action) == documented, f"docs row {kind} ({case or 'no case'})"


def test_every_row_of_the_rules_table_is_documented():
    documented = {(kind_of(r["kind"]), r["case"]) for r in doc_rows()}
    missing = [f"{r.kind} ({r.case or 'no case'})" for r in RULES if (r.kind, r.case) not in documented]
    assert not missing, f"docs/agent.md does not list: {missing}"


def test_the_table_refuses_a_row_no_finding_may_carry():
    for bad in (Rule("x.y", 3, "hardware", "drain"), Rule("x.y", 1, "hardware", "none"), Rule("x.y", 2, "cosmic", "none")):
        with pytest.raises(RulesTableError):
            _index((bad,))
    with pytest.raises(RulesTableError, match="listed twice"):
        _index((Rule("x.y", 3, "unknown", "none"), Rule("x.y", 3, "unknown", "none")))
    with pytest.raises(KeyError):
        rule("nvml.no_such_rule")


def test_quick_checks_take_their_outcome_from_the_table():
    assert quick_check("gpu_count") == ("hooks.gpu_count:node", rule("hooks.gpu_count"))
    assert quick_check("dcgmi_diag") == ("hooks.dcgmi_diag:node", rule("hooks.dcgmi_diag"))
    assert quick_check("check") == ("hooks.check:check", rule("hooks.check"))
    assert quick_check("memtest") == ("hooks.check:memtest", rule("hooks.check"))
    doc = {"node": "gpu001", "results": [{"name": "dcgmi_diag", "ok": False, "time": iso(NOW)}]}
    (f,), problem = findings_from_checks(doc, "gpu001", NOW, 600.0)
    assert problem == "" and (f.tier, f.attribution, f.action) == (2, "hardware", "drain")


def test_every_finding_the_rules_raise_has_a_row():
    cfg = settings(nvml={"expected_gpus": 3}, infiniband={"expected_ports": 3, "expected_rate_gbps": 800.0, "drop_after_s": 5.0})
    sick = [gpu(0, remap_failure=True, remap_pending=True, retired_pending=True, ecc_uncorrected_volatile=0, pcie_width=8,
                pcie_width_max=16, pcie_gen=3, pcie_gen_max=5, clock_event_reasons=0x40, margin_c=1, pcie_replay=0,
                nvlink_errors={"link0.replay": 0}, errors={"power": "NVML_ERROR_UNKNOWN"}),
            gpu(1, lost=True)]
    worse = [gpu(0, ecc_uncorrected_volatile=5, pcie_replay=500, nvlink_errors={"link0.replay": 9}, clock_event_reasons=0x40,
                 ecc_corrected_volatile=0)]
    counters = {"counters/link_downed": cd(3, 3), "counters/symbol_error": cd(65535, None, saturated=True)}
    res = run(
        snap(NOW, nv=nvml(*sick), i=ib(port(), port("mlx5_1", rate=200.0, unreadable={"counters/x": "EIO"})),
             h=host(mem_available_bytes=1, psi={"memory": {"full_avg10": 99.0}, "io": {"full_avg10": 99.0}},
                    dstate_pids=tuple((p, "x") for p in range(9)),
                    filesystems=(fs("/a", mounted=False), fs("/b", timed_out=True), fs("/c", writable=False),
                                 fs("/d", latency_s=9.0), fs("/e", error="EIO", writable=None, latency_s=None)))),
        snap(NOW + 10, nv=nvml(*worse), k=kernel(xid(79, 0, NOW + 9), status="error", gap=True),
             i=ib(port(counters=counters), port("mlx5_1", up=False))),
        snap(NOW + 20, nv=nvml(status="error", error_kind="timeout"), i=ib(port(up=False), port("mlx5_1", up=False))),
        cfg=cfg,
    )
    kinds = {f.id.split(":", 1)[0] for r in res for f in r.findings}
    assert {"nvml.lost", "nvml.ecc_uncorrected", "ib.counter", "ib.saturated", "fs.hung", "host.dstate", "kernel.gap"} <= kinds
    assert not [f.summary for r in res for f in r.findings if f.id.startswith("classify.error")]
    unknown = sorted(k for k in kinds if k != "xid" and not any(r.kind == k for r in RULES))
    assert not unknown, unknown
    for r in res:
        for f in r.findings:
            kind = f.id.split(":", 1)[0]
            if kind != "xid":
                assert (f.tier, f.attribution, f.action) in {(t.tier, t.attribution, t.action) for t in RULES if t.kind == kind}, f.id
