"""healthd.controller.policy: pure decisions from findings, fleet view and ledger."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from tests.support.holds import holds_for
from healthd.controller.policy import (
    ControllerPolicySettings,
    Decision,
    FleetView,
    LedgerView,
    NodeReport,
    decide,
    failing_nodes,
    finding_from_json,
    incident_id,
    make_reason,
    parse_topology_conf,
)
from healthd.model import Finding
from healthd.reason import MAX_REASON_BYTES as MAX_REASON_CHARS
from tests.support.fleet_inputs import NOW, finding, info, report


def fleet(reports=(), infos=None, topology="", settings=None, names=("node01", "node02", "node03", "node04")):
    infos = infos if infos is not None else [info(n) for n in names]
    return FleetView.build(reports, infos, topology, settings or ControllerPolicySettings())


S = ControllerPolicySettings()


def only(decisions, node) -> Decision:
    [d] = [d for d in decisions if d.node == node]
    return d


# --------------------------------------------------------------------------- rules


def test_t1_drain_and_requeue_with_stable_id_and_owned_reason():
    f = fleet([report("node02", finding())])
    d = only(decide(f, LedgerView(), S, NOW), "node02")
    assert d.kind == "drain-and-requeue"
    assert d.id == "drain-and-requeue:node02:xid:gpu0:79"
    assert d.reason.startswith("healthd: ") and d.reason.endswith(f"[#{d.incident}]")
    assert d.tier == 1 and d.finding_ids == ("xid:gpu0:79",) and d.decided_at == NOW
    assert d.evidence and "Xid" in d.evidence[0].text
    # the same inputs later decide the same id and incident
    again = only(decide(f, LedgerView(), S, NOW + 30), "node02")
    assert (again.id, again.incident) == (d.id, d.incident)


def test_t1_drain_action_and_inspect_hardware_drain():
    f = fleet([report("node01", finding("xid:gpu0:48", action="drain", xid=48)),
               report("node03", finding("xid:gpu0:64", action="inspect-hardware", xid=64))])
    ds = decide(f, LedgerView(), S, NOW)
    assert only(ds, "node01").kind == "drain"
    assert only(ds, "node01").id == "drain:node01:xid:gpu0:48"
    assert only(ds, "node03").kind == "drain"


@pytest.mark.parametrize("action", ["reset-gpu-when-idle", "reboot-when-idle"])
def test_when_idle_actions_become_reboot_asap(action):
    f = fleet([report("node01", finding("remap_pending:gpu0", tier=2, action=action, xid=None))])
    d = only(decide(f, LedgerView(), S, NOW), "node01")
    assert d.kind == "reboot-asap" and d.tier == 2


def test_ledger_incident_id_is_reused():
    f = fleet([report("node02", finding())])
    ledger = LedgerView(incidents={("node02", "xid:gpu0:79"): "I42"})
    d = only(decide(f, ledger, S, NOW), "node02")
    assert d.incident == "I42" and d.reason.endswith("[#I42]")


def test_t3_and_user_findings_never_act():
    f = fleet([
        report("node01", finding("xid:gpu0:13", tier=3, action="none", attribution="user", xid=13)),
        report("node02", finding("xid:gpu1:79", tier=1, action="drain", attribution="user")),
        report("node03", finding("thermal:gpu0", tier=3, action="drain", attribution="hardware", xid=None)),
    ])
    ds = decide(f, LedgerView(), S, NOW)
    assert {d.node: d.kind for d in ds} == {"node01": "none", "node02": "none", "node03": "none"}
    assert "user code" in only(ds, "node01").note


def test_t1_outranks_t2_and_strongest_action_wins():
    f = fleet([report("node01",
                      finding("remap_pending:gpu1", tier=2, action="reset-gpu-when-idle", xid=None),
                      finding("xid:gpu0:48", action="drain", xid=48),
                      finding("xid:gpu2:79", action="drain-and-requeue"))])
    d = only(decide(f, LedgerView(), S, NOW), "node01")
    assert d.kind == "drain-and-requeue" and d.finding_ids[0] == "xid:gpu2:79" and len(d.finding_ids) == 3


def test_cleared_fault_on_healthd_drained_node_is_none_for_reintegration():
    infos = [info("node01", flags={"DRAIN"}, reason="healthd: xid 79 [#7]")]
    f = fleet([report("node01", verdict="healthy")], infos=infos)
    d = only(decide(f, LedgerView(holds=holds_for(infos, {"node01": 7})), S, NOW), "node01")
    assert d.kind == "none" and "reintegration" in d.note and d.incident == "7"


def test_already_drained_by_healthd_is_none():
    infos = [info("node02", flags={"DRAIN"}, reason="healthd: xid 79 [#7]")]
    f = fleet([report("node02", finding())], infos=infos)
    d = only(decide(f, LedgerView(holds=holds_for(infos, {"node02": 7})), S, NOW), "node02")
    assert d.kind == "none" and "already drained" in d.note


def test_a_healthd_looking_reason_healthd_does_not_hold_is_not_healthds():
    """An administrator's `healthd: ...` reason, or healthd's own text re-written later: not 'already drained'."""
    infos = [info("node02", flags={"DRAIN"}, reason="healthd: xid 79 [#7]", user="alice")]
    f = fleet([report("node02", finding())], infos=infos)
    d = only(decide(f, LedgerView(), S, NOW), "node02")
    assert d.kind == "drain-and-requeue"  # proposed; the ownership gate refuses to write over it
    later = holds_for([dataclasses.replace(infos[0], reason_time=NOW - 60)], {"node02": 7})
    d = only(decide(fleet([report("node02", finding())], infos=[dataclasses.replace(infos[0], reason_time=NOW)]),
                    LedgerView(holds=later), S, NOW), "node02")
    assert d.kind == "drain-and-requeue"


def test_stale_report_decides_nothing():
    f = fleet([report("node02", finding(), received_at=NOW - 3600)])
    assert only(decide(f, LedgerView(), S, NOW), "node02").kind == "none"


def test_no_resume_is_decided_here():
    infos = [info(n, flags={"DRAIN"}, reason="healthd: x [#1]") for n in ("node01", "node02")]
    f = fleet([report("node01", verdict="healthy"), report("node02", verdict="healthy")], infos=infos)
    ds = decide(f, LedgerView(holds=holds_for(infos, {"node01": 1, "node02": 2})), S, NOW)
    assert all(d.kind == "none" for d in ds)


# --------------------------------------------------------------------------- values


def test_reason_is_bounded_printable_and_keeps_prefix_and_incident():
    r = make_reason("x" * 500 + "\n\tnewline", "H0123abcd")
    assert len(r) <= MAX_REASON_CHARS and r.startswith("healthd: ") and r.endswith("[#H0123abcd]")
    assert all(32 <= ord(c) < 127 for c in r)


def test_incident_id_deterministic():
    f = finding()
    assert incident_id("node01", f) == incident_id("node01", f) != incident_id("node02", f)


def test_report_accepts_json_findings():
    doc = {
        "node": "node02",
        "verdict": "failed",
        "findings": [{
            "id": "xid:gpu3:79", "component": {"kind": "gpu", "index": 3, "uuid": "GPU-1", "serial": "S",
                                               "bus_id": "00000000:5D:00.0", "device": None, "port": None},
            "source": "kernel_log", "xid": 79, "attribution": "hardware", "tier": 1,
            "action": "drain-and-requeue", "summary": "xid 79 gpu3: fell off the bus",
            "evidence": [{"kind": "log_line", "text": "NVRM: Xid ... 79", "cursor": "c1"}],
            "count": 3, "first_seen": "2026-11-29T10:25:43.225+00:00",
            "last_seen": "2026-11-29T10:25:43.227+00:00", "job": None,
        }],
    }
    r = NodeReport.from_document(doc, received_at=NOW)
    [f] = r.findings
    assert isinstance(f, Finding) and f.tier == 1 and f.evidence[0].data == {"cursor": "c1"}
    expected = dt.datetime(2026, 11, 29, 10, 25, 43, 225000, tzinfo=dt.timezone.utc).timestamp()
    assert f.first_seen == pytest.approx(expected)
    assert f.component.key() == "gpu3"
    with pytest.raises(ValueError, match="malformed finding"):
        finding_from_json({"id": "x"})


def test_values_are_frozen():
    d = only(decide(fleet([report("node02", finding())]), LedgerView(), S, NOW), "node02")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kind = "resume"  # type: ignore[misc]
    with pytest.raises(TypeError):
        S.capacity_floors["gpu"] = 1  # type: ignore[index]


def test_settings_validation():
    with pytest.raises(ValueError, match="mode"):
        ControllerPolicySettings(mode="yolo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_actions_per_hour"):
        ControllerPolicySettings(max_actions_per_hour=-1)
    assert ControllerPolicySettings().mode == "observe"


def test_the_view_counts_every_node_once_and_finds_the_reports_with_findings_once():
    f = fleet([report("node01", finding()), report("node02"), report("node09", finding("xid:gpu1:48"))],
              infos=[info("node01"), info("node02"), info("node03")])
    assert f.node_count == len(f.all_nodes) == 4  # node09 reports but Slurm does not list it
    assert f.reporting_findings == ("node01", "node09")
    # a view made from another (dataclasses.replace) finds them again from its own reports
    g = dataclasses.replace(f, reports={"node02": f.reports["node02"]})
    assert g.reporting_findings == () and g.node_count == 3


def test_failing_nodes_window():
    f = fleet([report("node01", finding(first_seen=NOW - 10)),
               report("node02", finding(first_seen=NOW - 10_000)),
               report("node03", finding("xid:gpu0:13", tier=3, action="none", attribution="user"))])
    assert failing_nodes(f, S, NOW) == {"node01"}


# --------------------------------------------------------------------------- topology


def test_parse_topology_conf_tree():
    text = """
# leaf switches
SwitchName=s0 Nodes=node[01-04] LinkSpeed=100
switchname=s1 nodes=node[05-06],gpu07
SwitchName=spine Switches=s[0-1] \\
    LinkSpeed=400
SwitchName=empty
"""
    groups = parse_topology_conf(text)
    assert groups["s0"] == {"node01", "node02", "node03", "node04"}
    assert groups["s1"] == {"node05", "node06", "gpu07"}
    assert groups["spine"] == groups["s0"] | groups["s1"]
    assert groups["empty"] == frozenset()
    assert parse_topology_conf("") == {}


def test_parse_topology_conf_errors_name_the_line():
    with pytest.raises(ValueError, match="line 2"):
        parse_topology_conf("SwitchName=s0 Nodes=n1\nNodes=n[1-2]\n")
    with pytest.raises(ValueError, match="line 1: invalid hostlist"):
        parse_topology_conf("SwitchName=s0 Nodes=n[1-\n")
    with pytest.raises(ValueError, match="contains itself"):
        parse_topology_conf("SwitchName=a Switches=b\nSwitchName=b Switches=a\n")


def test_fleet_view_groups_and_partitions():
    s = ControllerPolicySettings(racks={"r1": frozenset({"node01", "node02"})}, pdus={"p1": {"node03"}})
    f = fleet([], topology="SwitchName=leaf1 Nodes=node[01-04]", settings=s,
              infos=[info("node01", partitions=("gpu", "debug")), info("node02")])
    assert set(f.groups) == {"switch:leaf1", "rack:r1", "pdu:p1"}
    assert f.partitions == {"gpu": {"node01", "node02"}, "debug": {"node01"}}
    assert f.partitions_of("node01") == ("gpu", "debug")
