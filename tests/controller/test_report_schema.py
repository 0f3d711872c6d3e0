"""What the controller accepts from a node (healthd.report_schema).

Every field of the state document and of the drain request is checked at intake, refusals name the
field's path; real agent documents (built by healthd.agent.daemon.Agent from fake collectors) pass; the
agent fits its own reports to the limits (healthd.agent.reporter); arbitrary JSON never makes the validator
raise anything else; and through the real HTTP server with real MUNGE, a poisoned signed report is
refused with 400 while the next control round still drains another node."""

from __future__ import annotations

import copy
import json
import math
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.classify import IB_ERROR_COUNTERS
from healthd import report_schema as rs
from healthd.controller.policy import (
    ControllerPolicySettings,
    FleetView,
    LedgerView,
    NodeReport,
    decide,
    finding_from_json,
)
from healthd.report_schema import (
    MAX_DOCUMENT_BYTES,
    MAX_ERROR_CHARS,
    MAX_EVIDENCE,
    MAX_FINDINGS,
    ReportInvalid,
    fit_report,
    validate_report,
    validate_request,
)
from healthd.agent.history import History
from healthd.agent.reporter import Reporter
from healthd.client import request_drain
from healthd.settings import ControllerClientSettings, FilesystemSpec, HookSettings
from tests.support.builders import (
    CATALOG,
    NOW,
    cd,
    fs,
    gpu,
    host,
    ib,
    kernel,
    nvml,
    port,
    settings,
    xid,
)
from tests.controller.munge_support import munged_path
from tests.controller.schema_support import DELETE, JSON, changed, paths, xid79
from tests.support.fake_sources import FakeCollector

NODE = "gpu001"


# --------------------------------------------------------------------------- real agent documents


class Ticks:
    """An agent fed by fake collectors whose samples change from tick to tick (rates need two)."""

    def __init__(self, tmp: Path, **cfg: Any):
        self.t = NOW
        cfg.setdefault("nvml", {"expected_gpus": 8})
        self.cfg = settings(hooks=HookSettings(run_dir=str(tmp / "run")), state_file=str(tmp / "state.json"),
                            state_dir=str(tmp), **cfg)
        self.sources = Sources(nvml=FakeCollector("nvml", None), kernel=FakeCollector("kernel_log", kernel()),
                               infiniband=FakeCollector("infiniband", None), host=FakeCollector("host", host()))
        self.agent = Agent(self.cfg, CATALOG, self.sources, Memory(history=History()), dry_run=False,
                           clock=lambda: self.t)

    def tick(self, *, nv=None, k=None, i=None, h=None) -> dict[str, Any]:
        if nv is not None:
            self.sources.nvml.sample = nv
        if k is not None:
            self.sources.kernel.sample = k
        if i is not None:
            self.sources.infiniband.sample = i
        if h is not None:
            self.sources.host.sample = h
        self.agent.tick()
        self.t += 10.0
        return json.loads(json.dumps(self.agent.document()))  # exactly what travels (JSON)


def typical_document(tmp: Path) -> dict[str, Any]:
    """An 8-GPU, 8-HCA node with one Xid 79: the common failing report."""
    a = Ticks(tmp)
    return a.tick(nv=nvml(*(gpu(i, temperature_c=40, margin_c=40, pcie_gen=5, pcie_width=16) for i in range(8))),
                  k=kernel(xid(79, 1, NOW - 5)), i=ib(*(port(f"mlx5_{p}") for p in range(8))))


def _sick_gpu(i: int, k: int):
    return gpu(i, temperature_c=90, margin_c=1, slowdown_threshold_c=91, clock_event_reasons=0x8 | 0x40 | 0x80,
               ecc_corrected_volatile=1000 * k, ecc_uncorrected_volatile=5 * k, ecc_corrected_aggregate=1000 * k,
               ecc_uncorrected_aggregate=5 * k, remap_corrected=1, remap_uncorrected=2, remap_pending=True,
               remap_failure=True, retired_pages_sbe=3, retired_pages_dbe=2, retired_pending=True,
               pcie_replay=10000 * k, pcie_gen=3, pcie_gen_max=5, pcie_width=8, pcie_width_max=16,
               nvlink_errors={f"link{n}.{c}": 1000 * k for n in range(18) for c in ("replay", "recovery", "crc_flit", "crc_data")},
               errors={f"field{j}": "NVML_ERROR_UNKNOWN" for j in range(20)}, no_data=("power",))


def _sick_ports(k: int):
    counters = {f"counters/{n}": cd(1000 * k, 1000 if k else None, 10.0) for n in IB_ERROR_COUNTERS}
    counters.update({f"hw_counters/{n}": cd(1000 * k, 1000 if k else None, 10.0)
                     for n in ("local_ack_timeout_err", "roce_slow_restart", "rnr_nak_retry_err")})
    return ib(*(port(f"mlx5_{p}", 1, up=p % 2 == 0, rate=200.0, counters=counters,
                     unreadable={f"counters/x{j}": "EIO" for j in range(5)}) for p in range(8)))


def worst_documents(tmp: Path, xid_flood: bool) -> dict[str, Any]:
    """Every NVML, IB, host and filesystem rule tripped on every GPU and HCA of an 8-GPU node, over
    four ticks; with `xid_flood`, every catalog Xid on every GPU in the last tick as well."""
    # the flood's Xids a second apart with no incident window: each is a finding of its own (one
    # incident per GPU otherwise), which is what pushes the report over its limits
    apart = {"classify": {"sympathetic_window_s": 0.0}} if xid_flood else {}
    a = Ticks(tmp, nvml={"expected_gpus": 9}, infiniband={"expected_ports": 9, "expected_rate_gbps": 800.0},
              host={"filesystems": (FilesystemSpec("/ckpt"), FilesystemSpec("/data"), FilesystemSpec("/scratch"))}, **apart)
    sick_host = host(mem_available_bytes=2**30, dstate_pids=tuple((p, "python3") for p in range(100)),
                     psi={r: {"full_avg10": 90.0, "some_avg10": 90.0} for r in ("memory", "io", "cpu")},
                     filesystems=(fs("/ckpt", mounted=False, writable=None, latency_s=None), fs("/data", writable=False),
                                  fs("/scratch", latency_s=None, timed_out=True)))
    doc: dict[str, Any] = {}
    for k in range(4):
        flood = xid_flood and k == 3
        events = kernel(*(xid(c, g, a.t - j, count=3) for g in range(8) for j, c in enumerate(CATALOG.xids()))) if flood else kernel()
        doc = a.tick(nv=nvml(*(_sick_gpu(i, k) for i in range(8)), count=8), k=events, i=_sick_ports(k), h=sick_host)
    return doc


@pytest.fixture(scope="module")
def typical(tmp_path_factory) -> dict[str, Any]:
    return typical_document(tmp_path_factory.mktemp("typical"))


@pytest.fixture(scope="module")
def worst(tmp_path_factory) -> dict[str, Any]:
    return worst_documents(tmp_path_factory.mktemp("worst"), xid_flood=False)


@pytest.fixture(scope="module")
def flood(tmp_path_factory) -> dict[str, Any]:
    return worst_documents(tmp_path_factory.mktemp("flood"), xid_flood=True)


def refusal(doc: Any, *, node: str | None = None, request: bool = False) -> ReportInvalid:
    with pytest.raises(ReportInvalid) as info:
        (validate_request if request else validate_report)(doc, node)
    exc = info.value
    assert len(exc.reason) <= MAX_ERROR_CHARS and "\n" not in exc.reason
    assert isinstance(exc, ValueError)
    return exc


# --------------------------------------------------------------------------- real documents pass


def test_a_real_agent_document_is_accepted_and_converts(typical):
    assert len(typical["gpus"]) == 8 and len(typical["ports"]) == 8 and typical["verdict"] == "failed"
    validate_report(typical, node=NODE)
    report = NodeReport.from_document(typical, NOW, checked=True)
    assert report == NodeReport.from_document(typical, NOW)  # validated or not: the same values
    [f] = report.findings
    assert (f.id, f.tier, f.action, f.component.key()) == ("xid:gpu1:79", 1, "drain-and-requeue", "gpu1")
    assert f.first_seen == pytest.approx(NOW - 5) and f.evidence[0].kind == "log_line"


def test_the_worst_honest_node_stays_inside_every_limit(worst):
    """Why the limits are where they are: every rule tripped on every GPU and HCA of an 8-GPU node
    (no Xid flood) stays under MAX_FINDINGS and MAX_EVIDENCE; the agent sends it unchanged."""
    findings = worst["findings"]
    assert 150 < len(findings) < MAX_FINDINGS
    assert max(len(f["evidence"]) for f in findings) == 72 < MAX_EVIDENCE  # 18 NVLinks x 4 counters
    assert max(len(f["summary"]) for f in findings) < rs.MAX_SUMMARY_CHARS
    validate_report(worst, node=NODE)
    assert fit_report(worst) == (worst, "")


def test_an_xid_flood_report_is_fitted_by_the_agent_and_then_accepted(flood):
    assert len(flood["findings"]) > MAX_FINDINGS
    assert refusal(flood).path == "findings"
    fitted, note = fit_report(flood)
    validate_report(fitted, node=NODE)
    kept = fitted["findings"]
    assert len(kept) == MAX_FINDINGS and fitted["findings_dropped"] == len(flood["findings"]) - MAX_FINDINGS
    assert f"over the limit of {MAX_FINDINGS}" in note
    # the strongest are kept: every T1 finding, and nothing kept is weaker than anything left out
    assert {f["id"] for f in flood["findings"] if f["tier"] == 1} <= {f["id"] for f in kept}
    left_out = [f for f in flood["findings"] if f["id"] not in {k["id"] for k in kept}]
    assert max(rs.strength(f) for f in kept) < min(rs.strength(f) for f in left_out)
    # in the agent's order, and would_do only for what was kept
    order = [f["id"] for f in flood["findings"]]
    assert [f["id"] for f in kept] == [i for i in order if i in {k["id"] for k in kept}]
    assert {w["finding"] for w in fitted["would_do"]} <= {f["id"] for f in kept}
    assert rs.canonical_size(fitted) <= MAX_DOCUMENT_BYTES


def test_the_reporter_sends_only_what_the_controller_accepts(flood, caplog):
    """The agent's reporter (healthd.agent.reporter.Reporter, its sign/post seams capturing the body) fits
    the document before signing it; one log line says what it left out."""
    sent: list[dict] = []
    done = threading.Event()

    def sign(doc, node, socket):
        sent.append(json.loads(json.dumps(doc)))
        return b"{}"

    def post(url, body, timeout_s):
        done.set()
        return 200, b'{"accepted": true, "instructions": []}'

    rep = Reporter(ControllerClientSettings(url="http://127.0.0.1:9"), NODE, post=post, sign=sign)
    try:
        with caplog.at_level("WARNING", logger="healthd"):
            assert rep.offer(flood)
            assert done.wait(10)
            end = time.monotonic() + 5
            while rep.pending() and time.monotonic() < end:
                time.sleep(0.01)
    finally:
        rep.stop()
    [doc] = sent
    validate_report(doc, node=NODE)
    assert len(doc["findings"]) == MAX_FINDINGS and doc["findings_dropped"] > 0
    assert sum("trimmed to its limits" in m for m in caplog.messages) == 1


def test_long_text_and_evidence_are_shortened_not_refused(typical):
    doc = copy.deepcopy(typical)
    f = doc["findings"][0]
    f["summary"] = "s" * 5000
    f["evidence"] = [dict(f["evidence"][0], text="t" * 9000)] * (MAX_EVIDENCE + 10)
    f["evidence"][1] = dict(f["evidence"][1], deep=[[[[["too deep"]]]]])
    assert refusal(doc).path == "findings[0].summary"
    fitted, _ = fit_report(doc)
    validate_report(fitted)
    g = fitted["findings"][0]
    assert len(g["summary"]) == rs.MAX_SUMMARY_CHARS and g["summary"].endswith("...")
    assert len(g["evidence"]) == MAX_EVIDENCE and g["evidence_dropped"] == 10
    assert "deep" not in g["evidence"][1] and g["evidence"][1]["text"].startswith("ttt")
    assert "findings_dropped" not in fitted  # nothing left out, only shortened


def test_a_report_over_the_size_limit_keeps_its_strongest_findings(typical):
    doc = copy.deepcopy(typical)
    base = doc["findings"][0]
    doc["findings"] = [dict(base, id=f"big:{i}", tier=3 if i else 1, action="none" if i else "drain",
                            summary="x" * 2000, evidence=[{"kind": "state", "text": "y" * 4000}] * 4)
                       for i in range(200)]
    assert refusal(doc).path == "report"  # the size estimate, before the envelope's 413
    fitted, note = fit_report(doc)
    validate_report(fitted)
    assert rs.canonical_size(fitted) <= MAX_DOCUMENT_BYTES and "size limit" in note
    assert fitted["findings"][0]["id"] == "big:0" and 0 < len(fitted["findings"]) < 200
    assert fitted["findings_dropped"] == 200 - len(fitted["findings"])


def test_the_prologs_drain_request_is_accepted(typical):
    """request_drain (the prolog's call) builds the request; the controller's check accepts it."""
    got: list[dict] = []

    def sign(doc, node, socket):
        got.append(json.loads(json.dumps(doc)))
        raise OSError("captured")

    finding = dict(typical["findings"][0], evidence=[typical["findings"][0]["evidence"][0]] * (MAX_EVIDENCE + 5))
    granted, why = request_drain(ControllerClientSettings(url="http://127.0.0.1:9"), NODE, finding, "4242", 1.0,
                                 sign=sign)
    assert not granted and "captured" in why
    [req] = got
    validate_request(req, node=NODE)
    assert req["finding"]["evidence_dropped"] == 5
    assert refusal(req, node="gpu002", request=True).path == "node"


# --------------------------------------------------------------------------- every field refused

# (path to change, new value, the path the refusal names)
REPORT_CASES: list[tuple[tuple, Any, str]] = [
    (("node",), DELETE, "node"),
    (("node",), 5, "node"),
    (("node",), "bad name!", "node"),
    (("verdict",), "sick", "verdict"),
    (("verdict",), DELETE, "verdict"),
    (("findings",), DELETE, "findings"),
    (("findings",), "none", "findings"),
    (("generated_at",), "yesterday", "generated_at"),
    (("dry_run",), "no", "dry_run"),
    (("agent",), "0.1.0", "agent"),
    (("agent", "pid"), -1, "agent.pid"),
    (("agent", "version"), 1, "agent.version"),
    (("agent", "started_at"), "2026-13-01T00:00:00+00:00", "agent.started_at"),
    (("agent", "interval_s"), "10", "agent.interval_s"),
    (("agent", "boot_id"), ["b"], "agent.boot_id"),
    (("sources",), [], "sources"),
    (("sources", "nvml", "status"), "fine", "sources.nvml.status"),
    (("sources", "nvml", "status"), DELETE, "sources.nvml.status"),
    (("sources", "nvml", "detail"), 5, "sources.nvml.detail"),
    (("sources", "nvml", "seconds"), -1, "sources.nvml.seconds"),
    (("sources", "Bad Source"), {"status": "ok"}, "sources"),
    (("gpus",), {}, "gpus"),
    (("gpus",), [{"index": 0}] * 65, "gpus"),
    (("gpus", 0, "index"), -1, "gpus[0].index"),
    (("gpus", 0, "index"), DELETE, "gpus[0].index"),
    (("gpus", 0, "name"), 5, "gpus[0].name"),
    (("gpus", 0, "state"), "gone", "gpus[0].state"),
    (("gpus", 0, "temperature_c"), "hot", "gpus[0].temperature_c"),
    (("gpus", 0, "ecc_uncorrected_volatile"), 1.5, "gpus[0].ecc_uncorrected_volatile"),
    (("gpus", 0, "remap_pending"), "yes", "gpus[0].remap_pending"),
    (("gpus", 0, "pcie"), "g" * 65, "gpus[0].pcie"),
    (("gpus", 0, "no_data"), "power", "gpus[0].no_data"),
    (("gpus", 0, "no_data"), [5], "gpus[0].no_data[0]"),
    (("ports", 0, "port"), 300, "ports[0].port"),
    (("ports", 0, "device"), "", "ports[0].device"),
    (("ports", 0, "rate_gbps"), "fast", "ports[0].rate_gbps"),
    (("ports", 0, "state"), 1, "ports[0].state"),
    (("ports", 0, "link_layer"), True, "ports[0].link_layer"),
    (("would_do",), [{"action": "drain", "finding": "x"}] * (MAX_FINDINGS + 1), "would_do"),
    (("would_do", 0, "action"), "explode", "would_do[0].action"),
    (("would_do", 0, "tier"), 7, "would_do[0].tier"),
    (("would_do", 0, "reason"), "r" * 300, "would_do[0].reason"),
    (("would_do", 0, "finding"), DELETE, "would_do[0].finding"),
    (("findings_dropped",), -1, "findings_dropped"),
    (("findings_dropped",), "3", "findings_dropped"),
    (("extra",), [[[[["deep"]]]]], "extra[0][0][0]"),
    (("x" * 200,), 1, "report"),
    # the finding
    (("findings", 0), "xid:gpu1:79", "findings[0]"),
    (("findings", 0, "id"), 5, "findings[0].id"),
    (("findings", 0, "id"), "", "findings[0].id"),
    (("findings", 0, "id"), "x" * 100_000, "findings[0].id"),
    (("findings", 0, "id"), "xid:\ngpu1", "findings[0].id"),
    (("findings", 0, "id"), DELETE, "findings[0].id"),
    (("findings", 0, "component"), "gpu", "findings[0].component"),
    (("findings", 0, "component"), DELETE, "findings[0].component"),
    (("findings", 0, "component", "kind"), "toaster", "findings[0].component.kind"),
    (("findings", 0, "component", "kind"), DELETE, "findings[0].component.kind"),
    (("findings", 0, "component", "index"), "1", "findings[0].component.index"),
    (("findings", 0, "component", "index"), 5000, "findings[0].component.index"),
    (("findings", 0, "component", "uuid"), 1, "findings[0].component.uuid"),
    (("findings", 0, "component", "serial"), "s" * 300, "findings[0].component.serial"),
    (("findings", 0, "component", "bus_id"), [], "findings[0].component.bus_id"),
    (("findings", 0, "component", "device"), "d" * 2000, "findings[0].component.device"),
    (("findings", 0, "component", "port"), 256, "findings[0].component.port"),
    (("findings", 0, "source"), "dmesg", "findings[0].source"),
    (("findings", 0, "source"), DELETE, "findings[0].source"),
    (("findings", 0, "xid"), "79", "findings[0].xid"),
    (("findings", 0, "xid"), 100_000, "findings[0].xid"),
    (("findings", 0, "attribution"), "cosmic rays", "findings[0].attribution"),
    (("findings", 0, "tier"), "1x", "findings[0].tier"),
    (("findings", 0, "tier"), 0, "findings[0].tier"),
    (("findings", 0, "tier"), 4, "findings[0].tier"),
    (("findings", 0, "tier"), 1.0, "findings[0].tier"),
    (("findings", 0, "tier"), True, "findings[0].tier"),
    (("findings", 0, "tier"), DELETE, "findings[0].tier"),
    (("findings", 0, "action"), ["drain"], "findings[0].action"),
    (("findings", 0, "action"), "reboot", "findings[0].action"),
    (("findings", 0, "summary"), 5, "findings[0].summary"),
    (("findings", 0, "summary"), "s" * 3000, "findings[0].summary"),
    (("findings", 0, "summary"), "fell off the bus \ud800", "findings[0].summary"),
    (("findings", 0, "evidence"), "a log line", "findings[0].evidence"),
    (("findings", 0, "evidence"), [1, 2], "findings[0].evidence[0]"),
    (("findings", 0, "evidence"), [{"kind": "state", "text": ""}] * (MAX_EVIDENCE + 1), "findings[0].evidence"),
    (("findings", 0, "evidence", 0, "kind"), "Log Line", "findings[0].evidence[0].kind"),
    (("findings", 0, "evidence", 0, "kind"), DELETE, "findings[0].evidence[0].kind"),
    (("findings", 0, "evidence", 0, "text"), DELETE, "findings[0].evidence[0].text"),
    (("findings", 0, "evidence", 0, "text"), 5, "findings[0].evidence[0].text"),
    (("findings", 0, "evidence", 0, "text"), "t" * 5000, "findings[0].evidence[0].text"),
    (("findings", 0, "evidence", 0, "cursor"), {"a": {"b": {"c": {"d": 1}}}}, "findings[0].evidence[0].cursor.a.b.c"),
    (("findings", 0, "evidence", 0, "cells"), list(range(2000)), "findings[0].evidence[0].cells"),
    (("findings", 0, "evidence", 0, "nan"), math.nan, "findings[0].evidence[0].nan"),
    (("findings", 0, "evidence", 0, "huge"), 2**70, "findings[0].evidence[0].huge"),
    (("findings", 0, "evidence", 0, "k" * 200), 1, "findings[0].evidence[0]"),
    (("findings", 0, "count"), -1, "findings[0].count"),
    (("findings", 0, "count"), "3", "findings[0].count"),
    (("findings", 0, "first_seen"), [], "findings[0].first_seen"),
    (("findings", 0, "first_seen"), "2026-01-01T00:00:00", "findings[0].first_seen"),
    (("findings", 0, "first_seen"), "not a time", "findings[0].first_seen"),
    (("findings", 0, "first_seen"), -5, "findings[0].first_seen"),
    (("findings", 0, "first_seen"), 1e12, "findings[0].first_seen"),
    (("findings", 0, "last_seen"), "9999-12-31T00:00:00+00:00", "findings[0].last_seen"),
    (("findings", 0, "last_seen"), True, "findings[0].last_seen"),
    (("findings", 0, "job"), 4242, "findings[0].job"),
    (("findings", 0, "job"), "4242; rm -rf /", "findings[0].job"),
    (("findings", 0, "job"), "1" * 21, "findings[0].job"),
    (("findings", 0, "evidence_dropped"), -1, "findings[0].evidence_dropped"),
    (("findings", 0, "unknown_blob"), "u" * 5000, "findings[0].unknown_blob"),
]


@pytest.mark.parametrize(("path", "value", "where"), REPORT_CASES,
                         ids=[f"{'.'.join(map(str, p))[:40]}={str(v)[:12]!r}" for p, v, _ in REPORT_CASES])
def test_every_field_is_checked_and_named(typical, path, value, where):
    exc = refusal(changed(typical, path, value), node=NODE)
    assert exc.path == where, exc.reason
    assert exc.reason.startswith(f"{where}: ")


def test_the_messages_read_well(typical):
    assert refusal(changed(typical, ("findings", 0, "tier"), "1x")).reason == \
        'findings[0].tier: expected an integer 1-3, found "1x"'
    assert refusal(typical, node="gpu002").reason == 'node: report is for "gpu001", its credential for "gpu002"'
    assert refusal(changed(typical, ("findings",), [{"id": "f"}] * 24_000)).reason == \
        f"findings: 24000 findings, over the limit of {MAX_FINDINGS}"
    dup = changed(typical, ("findings",), typical["findings"] * 2)
    assert refusal(dup).reason == 'findings[1].id: duplicates findings[0].id "xid:gpu1:79"'
    many = dict(typical, **{f"extra{i}": i for i in range(rs.MAX_EXTRA_KEYS + 1)})
    assert refusal(many).reason == f"report: more than {rs.MAX_EXTRA_KEYS} unknown fields"
    assert refusal([]).reason == "report: expected an object, found a list of 0 items"
    long_id = refusal(changed(typical, ("findings", 0, "id"), "\x1b[31m" + "x" * 50)).reason
    assert "\x1b" not in long_id and long_id.startswith("findings[0].id: control character in")


def test_bounded_unknown_fields_are_accepted_and_ignored(typical):
    """A newer agent may add fields anywhere; each object may carry a few, each bounded."""
    doc = changed(typical, ("agent", "build"), {"commit": "abc123", "dirty": False})
    doc = changed(doc, ("findings", 0, "confidence"), 0.97)
    doc = changed(doc, ("findings", 0, "component", "slot"), "SXM3")
    doc = changed(doc, ("sources", "steptime"), {"status": "ok", "detail": "", "seconds": 0.1, "ranks": 8})
    doc = changed(doc, ("findings", 0, "evidence", 0, "kind"), "steptime_sample")  # a new evidence kind
    doc["schema"] = 2
    validate_report(doc, node=NODE)
    [f] = NodeReport.from_document(doc, NOW).findings
    assert f.id == "xid:gpu1:79" and f.evidence[0].kind == "steptime_sample"


def test_epoch_times_are_still_accepted(typical):
    doc = changed(typical, ("findings", 0, "first_seen"), NOW - 5)
    [f] = NodeReport.from_document(doc, NOW).findings
    assert f.first_seen == NOW - 5


REQUEST_CASES: list[tuple[tuple, Any, str]] = [
    (("kind",), "drain", "kind"),
    (("kind",), DELETE, "kind"),
    (("node",), 5, "node"),
    (("node",), DELETE, "node"),
    (("finding",), DELETE, "finding"),
    (("finding",), [], "finding"),
    (("finding", "tier"), "1x", "finding.tier"),
    (("finding", "evidence"), [1], "finding.evidence[0]"),
    (("job",), 4242, "job"),
    (("job",), "12a", "job"),
    (("extra",), [[[[["deep"]]]]], "extra[0][0][0]"),
]


@pytest.mark.parametrize(("path", "value", "where"), REQUEST_CASES,
                         ids=[f"{'.'.join(map(str, p))}={str(v)[:12]!r}" for p, v, _ in REQUEST_CASES])
def test_every_field_of_a_drain_request_is_checked(typical, path, value, where):
    request = {"kind": "drain-request", "node": NODE, "finding": typical["findings"][0], "job": "4242"}
    validate_request(request, node=NODE)
    assert refusal(changed(request, path, value), node=NODE, request=True).path == where


def test_finding_from_json_validates_unless_told_it_is_checked(typical):
    with pytest.raises(ValueError, match=r"malformed finding 'x': finding.component: missing"):
        finding_from_json({"id": "x"})
    with pytest.raises(ValueError, match=r"malformed finding \?: finding: expected an object"):
        finding_from_json(["x"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"findings\[0\].tier"):
        NodeReport.from_document(changed(typical, ("findings", 0, "tier"), "1x"), NOW)
    f = finding_from_json(typical["findings"][0], checked=True)
    assert f == finding_from_json(typical["findings"][0])


# --------------------------------------------------------------------------- fuzzing

SLOW_MS = 50.0  # a bound for a loaded 2-core test machine; these documents take well under 1 ms


def _timed(fn, *args) -> tuple[float, ReportInvalid | None]:
    """The fastest of three calls, in ms, and what the call raised. A hostile document is slow every
    time; a call that only lost the CPU to another process on a loaded machine is not."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            fn(*args)
            err = None
        except ReportInvalid as exc:
            err = exc
        best = min(best, (time.perf_counter() - t0) * 1000)
        if best < SLOW_MS:
            break
    return best, err


@hsettings(max_examples=400, deadline=None)
@given(JSON)
def test_arbitrary_json_only_ever_raises_report_invalid(value):
    for fn in (validate_report, validate_request, rs.validate_finding):
        ms, err = _timed(fn, value)
        assert ms < SLOW_MS
        assert err is None or (len(err.reason) <= MAX_ERROR_CHARS and "\n" not in err.reason)


def _round_safe(report: NodeReport) -> None:
    """What a control round does with an accepted report's values, minus the Slurm calls: decide on
    it, write its strings and evidence to SQLite as the ledger does."""
    decide(FleetView.build([report], []), LedgerView(), ControllerPolicySettings(mode="auto"), NOW)
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE f (id TEXT, serial TEXT, attribution TEXT, tier TEXT, action TEXT, summary TEXT, "
               "evidence TEXT, job TEXT)")
    for f in report.findings:
        db.execute("INSERT INTO f VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (f.id, f.component.serial, f.attribution, f"T{f.tier}", f.action, f.summary,
                    json.dumps([e.to_json() for e in f.evidence], allow_nan=False), f.job))
    db.close()


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data(), value=JSON)
def test_a_poisoned_field_is_refused_or_harmless(typical, data, value):
    """Any field of a real document replaced by arbitrary JSON: refused with ReportInvalid, or
    accepted and then safe for a control round. And the agent's fit of it is always accepted
    while its node and verdict are (what the agent cannot repair, it cannot send)."""
    path = data.draw(st.sampled_from(paths(typical, items=3)))
    doc = changed(typical, path, value)
    ms, err = _timed(validate_report, doc, NODE)
    assert ms < SLOW_MS
    if err is None:
        _round_safe(NodeReport.from_document(doc, NOW, checked=True))
    fitted, _ = fit_report(doc)  # never raises
    if path[0] not in ("node", "verdict") and "findings" in doc:
        validate_report(fitted, node=NODE)


@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 3), st.sampled_from(rs.ACTIONS), st.integers(0, 10_000)),
                min_size=0, max_size=400))
def test_fit_keeps_the_strongest_findings(typical, spec):
    base = typical["findings"][0]
    findings = [dict(base, id=f"f{n}:{i}", tier=t, action=a) for i, (t, a, n) in enumerate(spec)]
    fitted, _ = fit_report(dict(typical, findings=findings))
    validate_report(fitted, node=NODE)
    kept = {f["id"] for f in fitted["findings"]}
    assert len(kept) == min(len(findings), MAX_FINDINGS)
    assert fitted.get("findings_dropped", 0) == len(findings) - len(kept)
    if len(kept) < len(findings):
        worst_kept = max(rs.strength(f) for f in findings if f["id"] in kept)
        assert all(rs.strength(f) > worst_kept for f in findings if f["id"] not in kept)


def test_the_validator_is_cheap(typical, flood):
    """Not a benchmark (bench/ is): bounds that hold on a loaded test machine."""
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        validate_report(typical)
    typical_us = (time.perf_counter() - t0) / n * 1e6
    fitted, _ = fit_report(flood)
    t0 = time.perf_counter()
    validate_report(fitted)
    full_ms = (time.perf_counter() - t0) * 1000
    huge = dict(typical, findings=[{"id": f"f{i}"} for i in range(24_000)])
    t0 = time.perf_counter()
    refusal(huge)
    huge_ms = (time.perf_counter() - t0) * 1000
    assert typical_us < 5_000 and full_ms < 500 and huge_ms < 10, (typical_us, full_ms, huge_ms)


# --------------------------------------------------------------------------- end to end: HTTP + MUNGE

e2e = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")


class Rig:
    """The real Controller behind the real HTTP server, real MUNGE on both sides, fake Slurm."""

    def __init__(self, fleet, tmp_path: Path):
        from healthd.controller.config import ControllerSettings
        from healthd.controller.daemon import Controller
        from healthd.controller.ledger import Ledger
        from healthd.controller.server import ControllerHTTPServer
        from tests.support.fake_slurm import FakeBackend

        self.fleet = fleet
        self.backend = FakeBackend(fleet.nodes)
        self.ledger = Ledger(tmp_path / "ledger.sqlite")
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                      munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                      policy=ControllerPolicySettings(mode="auto"))
        self.controller = Controller(settings, self.ledger, self.backend)
        self.server = ControllerHTTPServer(settings.listen, self.controller)
        self.server.start_background()

    def post(self, path: str, doc: dict, node: str) -> tuple[int, dict, float]:
        import urllib.error
        import urllib.request

        from healthd.envelope import sign_report

        body = sign_report(doc, node, self.fleet.socket(node))
        req = urllib.request.Request(self.server.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, payload = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            status, payload = exc.code, json.loads(exc.read() or b"{}")
        return status, payload, time.perf_counter() - t0

    def refused_400(self) -> float:
        return self.controller.metrics.registry.get_sample_value("healthd_controller_reports_total",
                                                                 {"result": "400"}) or 0.0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.controller.close()
        self.ledger.close()


@pytest.fixture
def rig(fleet, tmp_path):
    r = Rig(fleet, tmp_path)
    yield r
    r.close()


def _poisons(now: float) -> list[tuple[str, dict, str]]:
    """(what, a state document from node03, the path its refusal must name)."""
    good = {"node": "node03", "verdict": "failed", "findings": [xid79(now)]}

    def bad(path: tuple, value: Any) -> dict:
        return changed(good, path, value)

    return [
        ("tier", bad(("findings", 0, "tier"), "1x"), "findings[0].tier"),
        ("first_seen", bad(("findings", 0, "first_seen"), []), "findings[0].first_seen"),
        ("component", bad(("findings", 0, "component"), "gpu"), "findings[0].component"),
        ("evidence", bad(("findings", 0, "evidence"), [1, 2]), "findings[0].evidence[0]"),
        ("node", bad(("node",), 5), "node"),
        ("action", bad(("findings", 0, "action"), ["drain"]), "findings[0].action"),
        ("surrogate", bad(("findings", 0, "summary"), "bus \ud800"), "findings[0].summary"),
        ("id", bad(("findings", 0, "id"), "x" * 100_000), "findings[0].id"),
        ("other node", bad(("node",), "node02"), "node"),
    ]


@e2e
def test_a_poisoned_signed_report_is_refused_and_the_next_round_still_drains(rig):
    now = time.time()
    for what, doc, where in _poisons(now):
        status, payload, _ = rig.post("/v1/report", doc, "node03")
        assert status == 400 and payload["accepted"] is False, what
        assert f"{where}: " in payload["error"], (what, payload)
        assert len(payload["error"]) < 400
    assert rig.refused_400() == len(_poisons(now))
    assert rig.controller.reports == {}  # nothing reached the report table
    status, payload, _ = rig.post("/v1/report", {"node": "node02", "verdict": "failed", "findings": [xid79(now)]},
                                  "node02")
    assert (status, payload["accepted"]) == (200, True)
    results = rig.controller.evaluate(time.time())
    assert results is not None
    assert [w[:2] for w in rig.backend.writes] == [("drain", "node02")]


@e2e
def test_a_report_of_24000_findings_is_refused_at_once(rig):
    doc = {"node": "node01", "verdict": "failed", "findings": [{"id": f"f{i}", "tier": 1} for i in range(24_000)]}
    status, payload, seconds = rig.post("/v1/report", doc, "node01")
    assert status == 400 and payload["error"].endswith(f"findings: 24000 findings, over the limit of {MAX_FINDINGS}")
    assert seconds < 1.0, seconds
    assert rig.controller.reports == {} and rig.refused_400() == 1


@e2e
def test_a_fitted_agent_flood_report_is_accepted_end_to_end(rig, flood):
    fitted, _ = fit_report(dict(flood, node="node04"))
    status, payload, _ = rig.post("/v1/report", fitted, "node04")
    assert (status, payload["accepted"]) == (200, True), payload
    assert len(rig.controller.reports["node04"].findings) == MAX_FINDINGS


@e2e
def test_a_poisoned_drain_request_is_refused(rig):
    now = time.time()
    request = {"kind": "drain-request", "node": "node03", "finding": changed(xid79(now), ("tier",), "1x"),
               "job": "4242"}
    status, payload, _ = rig.post("/v1/request", request, "node03")
    assert status == 400 and payload["granted"] is False and "finding.tier: " in payload["reason"]
    assert rig.refused_400() == 1 and rig.backend.writes == []
