"""The report's optional `inband` section at intake (healthd.report_schema): an honest section passes and
converts, a report without one stays valid, every malformed field is refused with its path, oversize
is refused before it costs anything, arbitrary JSON in any of its fields is refused or harmless, and
the agent's fit leaves the section out before it leaves out a finding."""

from __future__ import annotations

import copy
import json
import math
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd import report_schema as rs
from healthd.controller.inband import jobs_from_json
from healthd.controller.policy import NodeReport
from healthd.report_schema import MAX_DOCUMENT_BYTES, ReportInvalid, fit_report, validate_report
from tests.controller.schema_support import DELETE, JSON, changed, paths

NODE = "gpu001"
NOW = 1_800_000_000.0


def window(w: int, compute: float = 0.081, *, waits: bool = True) -> dict[str, Any]:
    return {"window": w, "steps": 50, "compute_s": compute, "step_s": 0.11, "wait_s": 0.11 - compute,
            "waits": [0.029] * 49 + [-1.0] if waits else None}


def rank(r: int, **kw: Any) -> dict[str, Any]:
    doc = {"rank": r, "local_rank": r, "gpu": r, "pid": 1234 + r, "last_step": 411, "last_step_age_s": 1.2,
           "phase": "wait", "phase_age_s": 0.1, "step_median_s": 0.11, "longest_save_s": 0.0, "lost": 0,
           "torn": 0, "rail": "mlx5_0/1" if r % 2 else None, "corroboration": ["gpu0: clocks throttled (hw_slowdown)"],
           "windows": [window(w) for w in range(1, 9)]}
    doc.update(kw)
    return doc


def section(ranks: int = 4) -> dict[str, Any]:
    return {"jobs": [{
        "job": "123", "world_size": ranks, "ranks_here": ranks, "step_median_s": 0.11,
        "ranks": [rank(r) for r in range(ranks)],
        "stragglers": [{"rank": 3, "test": "magnitude", "windows": [7, 8], "effect": 0.081, "threshold": 0.05,
                        "last_in": 0, "of_steps": 0, "p_value": None},
                       {"rank": 2, "test": "rank-order", "windows": [6, 7, 8], "effect": -0.01, "threshold": 1e-4,
                        "last_in": 40, "of_steps": 49, "p_value": 3e-9}],
        "hang": {"step": 411, "stalled_s": 75.0, "bound_s": 60.0, "behind": [3], "phases": {"0": "wait", "3": "compute"}},
        "errors": ["rank-5.ring: not a ring: bad magic"],
    }]}


def report(inband: Any = None, **kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"node": NODE, "verdict": "healthy", "findings": []}
    if inband is not None:
        doc["inband"] = inband
    doc.update(kw)
    return doc


def refusal(doc: Any) -> ReportInvalid:
    with pytest.raises(ReportInvalid) as info:
        validate_report(doc, node=NODE)
    return info.value


def test_an_honest_section_is_accepted_and_converts():
    doc = report(section())
    validate_report(doc, node=NODE)
    r = NodeReport.from_document(doc, NOW)
    [job] = r.inband
    assert job.job == "123" and job.world_size == 4 and len(job.ranks) == 4
    r0, r1 = job.ranks[0], job.ranks[1]
    assert r0.progress.last_step == 411 and r0.progress.phase == "wait" and r0.gpu == 0 and r1.rail == "mlx5_0/1"
    assert [w.window for w in r0.windows] == list(range(1, 9)) and r0.windows[0].waits[-1] == -1.0
    assert [s.rank for s in job.stragglers] == [3, 2] and job.stragglers[1].p_value == 3e-9
    assert job.hang is not None and job.hang.behind == (3,) and job.hang.phases == {0: "wait", 3: "compute"}


def test_a_report_without_the_section_stays_valid():
    validate_report(report(), node=NODE)
    assert NodeReport.from_document(report(), NOW).inband == ()
    assert jobs_from_json(None) == ()
    validate_report(report({"jobs": []}), node=NODE)


def test_unknown_gpu_and_missing_optional_fields():
    doc = report({"jobs": [{"job": "7", "ranks": [{"rank": 0, "last_step": -1, "last_step_age_s": 3.0,
                                                   "phase": "unknown", "gpu": -1}]}]})
    [job] = NodeReport.from_document(doc, NOW).inband
    [r] = job.ranks
    assert r.gpu is None and r.windows == () and r.corroboration == () and r.progress.step_median_s is None
    assert job.hang is None and job.stragglers == ()


J = ("inband", "jobs", 0)
R = (*J, "ranks", 0)
W = (*R, "windows", 0)

CASES: list[tuple[tuple, Any, str]] = [
    (("inband",), [], "inband"),
    (("inband",), {"jobs": "x"}, "inband.jobs"),
    (("inband", "jobs"), DELETE, "inband.jobs"),
    (("inband", "jobs"), [{"job": str(i), "ranks": []} for i in range(rs.MAX_INBAND_JOBS + 1)], "inband.jobs"),
    ((*J, "job"), 123, "inband.jobs[0].job"),
    ((*J, "job"), None, "inband.jobs[0].job"),
    ((*J, "job"), "12; rm -rf /", "inband.jobs[0].job"),
    ((*J, "job"), DELETE, "inband.jobs[0].job"),
    ((*J, "world_size"), -2, "inband.jobs[0].world_size"),
    ((*J, "world_size"), 2**40, "inband.jobs[0].world_size"),
    ((*J, "ranks_here"), -1, "inband.jobs[0].ranks_here"),
    ((*J, "step_median_s"), math.nan, "inband.jobs[0].step_median_s"),
    ((*J, "step_median_s"), -0.1, "inband.jobs[0].step_median_s"),
    ((*J, "ranks"), DELETE, "inband.jobs[0].ranks"),
    ((*J, "ranks"), {"0": {}}, "inband.jobs[0].ranks"),
    ((*J, "ranks"), [rank(0)] * (rs.MAX_INBAND_RANKS + 1), "inband.jobs[0].ranks"),
    ((*J, "ranks", 1, "rank"), 0, "inband.jobs[0].ranks[1].rank"),
    ((*R, "rank"), -1, "inband.jobs[0].ranks[0].rank"),
    ((*R, "rank"), "0", "inband.jobs[0].ranks[0].rank"),
    ((*R, "rank"), True, "inband.jobs[0].ranks[0].rank"),
    ((*R, "rank"), DELETE, "inband.jobs[0].ranks[0].rank"),
    ((*R, "gpu"), -2, "inband.jobs[0].ranks[0].gpu"),
    ((*R, "gpu"), 5000, "inband.jobs[0].ranks[0].gpu"),
    ((*R, "pid"), -5, "inband.jobs[0].ranks[0].pid"),
    ((*R, "last_step"), -2, "inband.jobs[0].ranks[0].last_step"),
    ((*R, "last_step"), 1.5, "inband.jobs[0].ranks[0].last_step"),
    ((*R, "last_step"), 2**64, "inband.jobs[0].ranks[0].last_step"),
    ((*R, "last_step_age_s"), math.inf, "inband.jobs[0].ranks[0].last_step_age_s"),
    ((*R, "last_step_age_s"), -1.0, "inband.jobs[0].ranks[0].last_step_age_s"),
    ((*R, "last_step_age_s"), DELETE, "inband.jobs[0].ranks[0].last_step_age_s"),
    ((*R, "phase"), "sleeping", "inband.jobs[0].ranks[0].phase"),
    ((*R, "phase"), DELETE, "inband.jobs[0].ranks[0].phase"),
    ((*R, "phase_age_s"), "1", "inband.jobs[0].ranks[0].phase_age_s"),
    ((*R, "step_median_s"), math.nan, "inband.jobs[0].ranks[0].step_median_s"),
    ((*R, "longest_save_s"), -3.0, "inband.jobs[0].ranks[0].longest_save_s"),
    ((*R, "lost"), -1, "inband.jobs[0].ranks[0].lost"),
    ((*R, "torn"), "many", "inband.jobs[0].ranks[0].torn"),
    ((*R, "rail"), 5, "inband.jobs[0].ranks[0].rail"),
    ((*R, "rail"), "r" * 300, "inband.jobs[0].ranks[0].rail"),
    ((*R, "corroboration"), "gpu0 hot", "inband.jobs[0].ranks[0].corroboration"),
    ((*R, "corroboration"), ["x"] * (rs.MAX_INBAND_CORROBORATION + 1), "inband.jobs[0].ranks[0].corroboration"),
    ((*R, "corroboration"), [5], "inband.jobs[0].ranks[0].corroboration[0]"),
    ((*R, "corroboration"), ["x" * 5000], "inband.jobs[0].ranks[0].corroboration[0]"),
    ((*R, "corroboration"), ["\ud800"], "inband.jobs[0].ranks[0].corroboration[0]"),
    ((*R, "windows"), [window(w) for w in range(rs.MAX_INBAND_WINDOWS + 1)], "inband.jobs[0].ranks[0].windows"),
    ((*R, "windows", 1, "window"), 1, "inband.jobs[0].ranks[0].windows[1].window"),
    ((*W, "window"), -1, "inband.jobs[0].ranks[0].windows[0].window"),
    ((*W, "steps"), DELETE, "inband.jobs[0].ranks[0].windows[0].steps"),
    ((*W, "compute_s"), math.nan, "inband.jobs[0].ranks[0].windows[0].compute_s"),
    ((*W, "compute_s"), -0.001, "inband.jobs[0].ranks[0].windows[0].compute_s"),
    ((*W, "step_s"), None, "inband.jobs[0].ranks[0].windows[0].step_s"),
    ((*W, "wait_s"), 1e12, "inband.jobs[0].ranks[0].windows[0].wait_s"),
    ((*W, "waits"), "0.1", "inband.jobs[0].ranks[0].windows[0].waits"),
    ((*W, "waits"), [0.1] * (rs.MAX_INBAND_WAITS + 1), "inband.jobs[0].ranks[0].windows[0].waits"),
    ((*W, "waits", 3), math.nan, "inband.jobs[0].ranks[0].windows[0].waits[3]"),
    ((*W, "waits", 3), -0.5, "inband.jobs[0].ranks[0].windows[0].waits[3]"),
    ((*W, "waits", 3), True, "inband.jobs[0].ranks[0].windows[0].waits[3]"),
    ((*W, "waits", 3), [0.1], "inband.jobs[0].ranks[0].windows[0].waits[3]"),
    ((*J, "stragglers"), {}, "inband.jobs[0].stragglers"),
    ((*J, "stragglers", 0, "test"), "vibes", "inband.jobs[0].stragglers[0].test"),
    ((*J, "stragglers", 0, "windows"), [-1], "inband.jobs[0].stragglers[0].windows[0]"),
    ((*J, "stragglers", 0, "windows"), list(range(40)), "inband.jobs[0].stragglers[0].windows"),
    ((*J, "stragglers", 0, "effect"), math.inf, "inband.jobs[0].stragglers[0].effect"),
    ((*J, "stragglers", 0, "effect"), -2.0, "inband.jobs[0].stragglers[0].effect"),
    ((*J, "stragglers", 0, "threshold"), -0.1, "inband.jobs[0].stragglers[0].threshold"),
    ((*J, "stragglers", 0, "p_value"), 1.5, "inband.jobs[0].stragglers[0].p_value"),
    ((*J, "stragglers", 0, "rank"), DELETE, "inband.jobs[0].stragglers[0].rank"),
    ((*J, "hang"), "stuck", "inband.jobs[0].hang"),
    ((*J, "hang", "step"), "411", "inband.jobs[0].hang.step"),
    ((*J, "hang", "stalled_s"), -1, "inband.jobs[0].hang.stalled_s"),
    ((*J, "hang", "bound_s"), math.nan, "inband.jobs[0].hang.bound_s"),
    ((*J, "hang", "behind"), [3.5], "inband.jobs[0].hang.behind[0]"),
    ((*J, "hang", "behind"), list(range(rs.MAX_INBAND_RANKS + 1)), "inband.jobs[0].hang.behind"),
    ((*J, "hang", "phases"), ["wait"], "inband.jobs[0].hang.phases"),
    ((*J, "hang", "phases", "3"), "napping", "inband.jobs[0].hang.phases[\"3\"]"),
    ((*J, "hang", "phases", "-1"), "wait", "inband.jobs[0].hang.phases"),
    ((*J, "hang", "phases", "99999999999"), "wait", "inband.jobs[0].hang.phases"),
    ((*J, "hang", "phases", "\u0663"), "wait", "inband.jobs[0].hang.phases"),
    ((*J, "hang", "step"), DELETE, "inband.jobs[0].hang.step"),
    ((*J, "errors"), "one", "inband.jobs[0].errors"),
    ((*J, "errors"), ["e"] * (rs.MAX_INBAND_ERRORS + 1), "inband.jobs[0].errors"),
    ((*J, "errors"), [{"e": 1}], "inband.jobs[0].errors[0]"),
    ((*J, "unknown_blob"), "u" * 5000, "inband.jobs[0].unknown_blob"),
    ((*R, "extra"), [[[[["deep"]]]]], "inband.jobs[0].ranks[0].extra[0][0][0]"),
]


@pytest.mark.parametrize(("path", "value", "where"), CASES,
                         ids=[f"{'.'.join(map(str, p[2:] or p))[:40]}={str(v)[:12]!r}" for p, v, _ in CASES])
def test_every_inband_field_is_checked_and_named(path, value, where):
    exc = refusal(changed(report(section()), path, value))
    assert exc.path == where, exc.reason
    assert exc.reason.startswith(f"{where}: ")


def test_the_messages_read_well():
    doc = changed(report(section()), (*W, "waits", 3), math.nan)
    assert refusal(doc).reason == "inband.jobs[0].ranks[0].windows[0].waits[3]: expected a number 0-1e+09 or -1, found nan"
    doc = changed(report(section()), (*J, "ranks", 1, "rank"), 0)
    assert refusal(doc).reason == "inband.jobs[0].ranks[1].rank: duplicates inband.jobs[0].ranks[0].rank 0"
    two = report({"jobs": [section()["jobs"][0]] * 2})
    assert refusal(two).reason == 'inband.jobs[1].job: duplicates inband.jobs[0].job "123"'


def test_an_oversized_section_is_refused_by_its_counts_at_once():
    """A section with a million waits is refused on its first oversized list, before a walk over it."""
    r = rank(0, windows=[dict(window(w), waits=[0.1] * 1_000_000) for w in range(2)])
    doc = report({"jobs": [{"job": "1", "ranks": [r]}]})
    t0 = time.perf_counter()
    exc = refusal(doc)
    assert (time.perf_counter() - t0) < 0.05 and exc.path == "inband.jobs[0].ranks[0].windows[0].waits"


def test_a_section_within_every_count_but_over_the_byte_limit_is_refused():
    ranks = [rank(r, corroboration=["c" * 2000] * 8) for r in range(100)]
    doc = report({"jobs": [{"job": "1", "ranks": ranks}]})
    exc = refusal(doc)
    assert exc.path == "report" and str(MAX_DOCUMENT_BYTES) in exc.reason


def test_an_honest_big_node_fits_well_inside_the_limits():
    """8 jobs of 15 ranks (waits for every window) on one node: every count inside its limit, the
    canonical JSON a small part of the document budget."""
    jobs = [dict(section(15)["jobs"][0], job=str(100 + j)) for j in range(8)]
    doc = report({"jobs": jobs})
    validate_report(doc, node=NODE)
    assert rs.canonical_size(doc) < MAX_DOCUMENT_BYTES // 2


def test_the_agents_fit_leaves_out_the_section_before_any_finding():
    finding = {"id": "xid:gpu1:79", "component": {"kind": "gpu", "index": 1}, "source": "kernel_log", "xid": 79,
               "attribution": "hardware", "tier": 1, "action": "drain", "summary": "xid 79",
               "evidence": [{"kind": "log_line", "text": "x" * 4000}] * 100, "first_seen": None, "last_seen": None}
    findings = [dict(finding, id=f"xid:gpu{i}:79") for i in range(2)]
    ranks = [rank(r, corroboration=["c" * 2000] * 8) for r in range(60)]
    doc = report({"jobs": [{"job": "1", "ranks": ranks}]}, findings=findings, verdict="failed")
    fitted, note = fit_report(doc)
    validate_report(fitted, node=NODE)
    assert "inband" not in fitted and len(fitted["findings"]) == 2 and "inband" in note
    bad = report({"jobs": [{"job": "x", "ranks": []}]})
    fitted, note = fit_report(bad)
    assert "inband" not in fitted and "inband" in note
    validate_report(fitted, node=NODE)


def test_inband_findings_and_evidence_are_accepted():
    f = {"id": "inband.straggler:gpu3", "component": {"kind": "gpu", "index": 3}, "source": "inband",
         "attribution": "unknown", "tier": 3, "action": "none", "summary": "rank 3 of job 123 slow",
         "evidence": [{"kind": "inband", "text": "rank 3 ...", "job": "123", "rank": 3, "windows": [7, 8]}],
         "job": "123"}
    validate_report(report(findings=[f]), node=NODE)
    [got] = NodeReport.from_document(report(findings=[f]), NOW).findings
    assert got.source == "inband" and got.evidence[0].kind == "inband"


BASE = report(section(2))
PATHS = [p for p in paths(BASE, items=2) if p[0] == "inband"]


@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), value=JSON)
def test_arbitrary_json_in_any_inband_field_is_refused_or_harmless(data, value):
    """Refused with ReportInvalid (a one-line reason), or accepted, converted and safe for the
    controller's in-band round; the agent's fit is always accepted."""
    from healthd.controller import inband
    from healthd.settings import DetectorSettings

    doc = changed(BASE, data.draw(st.sampled_from(PATHS)), value)
    try:
        validate_report(doc, node=NODE)
    except ReportInvalid as exc:
        assert "\n" not in exc.reason and len(exc.reason) <= rs.MAX_ERROR_CHARS
    else:
        r = NodeReport.from_document(doc, NOW, checked=True)
        other = NodeReport.from_document(changed(report(section(2)), ("node",), "gpu002"), NOW, checked=True)
        inband.evaluate([r, other], {"switch:s1": frozenset({NODE, "gpu002"})}, DetectorSettings(), NOW + 1, 120.0)
        json.dumps([f.to_json() for fs in inband.evaluate([r], {}, DetectorSettings(), NOW, 120.0).findings.values()
                    for f in fs], allow_nan=False)
    fitted, _ = fit_report(doc)
    validate_report(fitted, node=NODE)


# --------------------------------------------------------------------------- the agent's own section


def _agent_section(**job_kw: Any) -> dict[str, Any]:
    """The section as the agent writes it (healthd.agent.inband_jobs.to_json) for 4 ranks of a job,
    rank 3 flagged and the job hung, GPU 1 throttled by hardware."""
    from healthd.agent.inband_jobs import JobView, RankView, to_json
    from healthd.progress import Hang, RankProgress, RankWindow, Straggler
    from tests.support.builders import gpu, nvml, snap

    ranks = tuple(
        RankView(rank=r, local_rank=r, gpu=r if r < 3 else -1, pid=4000 + r,
                 progress=RankProgress(rank=r, last_step=411 - (r == 3), last_step_age_s=75.0, phase="wait",
                                       phase_age_s=70.0, step_median_s=0.11, longest_save_s=2.5),
                 windows=tuple(RankWindow(rank=r, window=w, steps=50, compute_s=0.08, step_s=0.11, wait_s=0.03,
                                          waits=tuple([0.03] * 49 + [-1.0])) for w in range(10)),
                 lost=0, torn=1, restored=None if r else 350, durable=400, rail="mlx5_0" if r == 1 else None)
        for r in range(4))
    job = JobView(job="123", uid=1000, world_size=4, ranks=ranks,
                  stragglers=(Straggler(rank=3, test="rank-order", windows=(7, 8, 9), effect=0.01, threshold=1e-4,
                                        last_in=45, of_steps=49, p_value=1e-12),),
                  hang=Hang(step=411, stalled_s=75.0, bound_s=60.0, behind=(3,), phases={0: "wait", 3: "compute"}),
                  errors=("rank-5.ring: not a ring: magic b'xxxxxxxx', expected b'HDINBND1'",), **job_kw)
    snapshot = snap(nv=nvml(gpu(0), gpu(1, clock_event_reasons=0x8), gpu(2)))
    return to_json([job], snapshot, [], history_windows=8)


def test_the_agents_section_is_accepted_and_converts():
    doc = report(_agent_section())
    validate_report(doc, node=NODE)
    [job] = NodeReport.from_document(doc, NOW).inband
    # every window the agent holds goes: a rank's first ones (its baseline) with its newest history_windows
    assert [r.gpu for r in job.ranks] == [0, 1, 2, None] and len(job.ranks[0].windows) == 10
    assert job.hang is not None and job.stragglers[0].test == "rank-order"
    unknown = report({"jobs": [dict(_agent_section()["jobs"][0], world_size=-1)]})
    [job] = NodeReport.from_document(unknown, NOW).inband
    assert job.world_size is None


def test_one_jobs_garbage_costs_the_agent_that_job_only():
    """A job writes its own step records: a header with a GPU index no node has is that job's
    entry left out by the agent's fit, never the other jobs' or the findings."""
    good = _agent_section()["jobs"][0]
    bad = copy.deepcopy(good)
    bad["job"] = "124"
    bad["ranks"][0]["gpu"] = 70_000
    doc = report({"jobs": [good, bad]})
    assert refusal(doc).path == "inband.jobs[1].ranks[0].gpu"
    fitted, note = fit_report(doc)
    validate_report(fitted, node=NODE)
    assert [j["job"] for j in fitted["inband"]["jobs"]] == ["123"] and "1 in-band job(s)" in note
