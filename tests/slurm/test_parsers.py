"""The pure Slurm parsers and validators: real 22.05, 24.11 and 26.05 output captured from the local
test cluster (tests/slurm/captured/; the last two in the roots of the version matrix), data_parser
v0.0.42 (Slurm 24.11) documents built from Slurm's schema,
the argv every write makes, and property tests that no input crashes a parser."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.slurm.backend import (
    JobInfo,
    NodeInfo,
    SlurmOutputError,
    SlurmRefused,
    SlurmUnavailable,
    parse_state_string,
    requested_nodes,
    reservation_args,
    slurm_hostlist,
    validate_nodes,
    validate_reason,
)
from healthd.slurm.scontrol import (
    CommandResult,
    CommandTimeout,
    ScontrolBackend,
    STEP_PATH,
    parse_node_addresses,
    parse_scontrol_node_line,
    parse_scontrol_show_node,
    parse_sinfo_json,
    parse_sinfo_json_text,
    parse_squeue_jobs,
    parse_version,
    run_command,
)
from tests.slurm.contract import BAD_NODE_NAMES, BAD_REASONS, HOSTILE_REASON

CAPTURED = Path(__file__).parent / "captured"


@pytest.fixture
def utc(monkeypatch):
    """scontrol prints local time; the captures were taken on a UTC machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _captured_json(name: str):
    return json.loads((CAPTURED / name).read_text())


# ----------------------------------------------------------------------------- 22.05, captured


def test_sinfo_json_2205_drained_reboot_draining():
    nodes = {n.name: n for n in parse_sinfo_json(_captured_json("sinfo-22.05-drained-reboot-draining.json"))}
    assert list(nodes) == ["node01", "node02", "node03", "node04"]
    assert nodes["node01"] == NodeInfo("node01", "idle", frozenset(), "", None, None, ("debug",), "gpu:4", None,
                                       boot_time=1795946225.0)
    n2 = nodes["node02"]
    assert n2.reason == HOSTILE_REASON and n2.reason_user == "root" and n2.reason_time == 1795949831.0
    assert n2.drained and not n2.draining and n2.flags == {"DRAIN"}
    n3 = nodes["node03"]  # reboot ASAP nextstate=RESUME on a busy node
    assert (n3.state, n3.flags, n3.next_state) == ("mixed", {"DRAIN", "REBOOT_REQUESTED"}, "RESUME")
    assert n3.reboot_requested and n3.draining and n3.resumable
    n4 = nodes["node04"]  # drained while a job runs
    assert n4.draining and not n4.drained and n4.reason == "healthd: drain while busy [#4]"


def test_sinfo_json_2205_down_not_responding_next_state_down():
    nodes = {n.name: n for n in parse_sinfo_json(_captured_json("sinfo-22.05-down-notresponding-nextdown.json"))}
    assert nodes["node01"].state == "down" and nodes["node01"].resumable and not nodes["node01"].drain_requested
    # just resumed: idle* for about a second; the stale reason_set_by_user is not reported
    assert nodes["node02"].flags == {"NOT_RESPONDING"} and not nodes["node02"].responding
    assert nodes["node02"].reason_user is None and not nodes["node02"].resumable
    assert nodes["node04"].next_state == "DOWN"


@pytest.mark.parametrize("name", ["drained-reboot-draining", "down-notresponding-nextdown"])
def test_scontrol_oneliner_2205_reads_the_same_as_sinfo_json(name, utc):
    as_json = parse_sinfo_json(_captured_json(f"sinfo-22.05-{name}.json"))
    oneliner = parse_scontrol_show_node((CAPTURED / f"scontrol-22.05-{name}.txt").read_text())
    assert oneliner == as_json


def test_sinfo_json_2205_slurmctld_down_is_an_error_not_an_empty_cluster():
    # sinfo exits 0 here; an empty node list must not read as "no nodes"
    with pytest.raises(SlurmOutputError, match=r"from Slurm 22\.05\.8: Slurm reported errors: Unspecified error"):
        parse_sinfo_json(_captured_json("sinfo-22.05-slurmctld-down.json"))


def test_version_strings():
    assert parse_version((CAPTURED / "scontrol-version-22.05.txt").read_text()) == (22, 5)
    assert parse_version((CAPTURED / "scontrol-version-24.11.txt").read_text()) == (24, 11)
    assert parse_version((CAPTURED / "scontrol-version-26.05.txt").read_text()) == (26, 5)
    assert parse_version("slurm 24.11.1") == (24, 11)
    with pytest.raises(SlurmOutputError):
        parse_version("no version here")


# ----------------------------------------------------------------------------- 24.11 and 26.05, captured

# tests/support/capture_slurm.py run in the roots of the version matrix (tests/support/slurm_roots.py):
# node01 idle, node02 drained, node03 busy with a reboot ASAP, node04 busy and drained; then node02
# resumed. Slurm 24.11.5 prints data_parser v0.0.42, 26.05.5 v0.0.45.
CAPTURED_PARSERS = {"24.11": "data_parser/v0.0.42", "26.05": "data_parser/v0.0.45"}
CAPTURED_REASONS = {"node02": "healthd: xid 79 gpu0 fell off the bus [#7]",
                    "node03": "healthd: pending row remap gpu1 [#9]", "node04": "healthd: drain while busy [#4]"}


def _captured_reads(version: str, moment: str) -> tuple[list[NodeInfo], list[NodeInfo], list[NodeInfo]]:
    """The same moment through `scontrol show nodes --json`, `scontrol show node -o` and `sinfo --json`."""
    doc = _captured_json(f"scontrol-json-{version}-{moment}.json")
    assert doc["meta"]["plugin"]["data_parser"] == CAPTURED_PARSERS[version]
    assert doc["meta"]["slurm"]["release"].startswith(version + ".")
    return (parse_sinfo_json(doc), parse_scontrol_show_node((CAPTURED / f"scontrol-{version}-{moment}.txt").read_text()),
            parse_sinfo_json(_captured_json(f"sinfo-{version}-{moment}.json")))


@pytest.mark.parametrize("version", CAPTURED_PARSERS)
def test_captured_drains_reboot_and_draining_read_alike_through_every_reader(version, utc):
    as_json, oneliner, sinfo = _captured_reads(version, "drained")
    assert oneliner == as_json
    nodes = {n.name: n for n in as_json}
    assert (nodes["node01"].state, nodes["node01"].flags, nodes["node01"].reason) == ("idle", frozenset(), "")
    n2, n3, n4 = nodes["node02"], nodes["node03"], nodes["node04"]
    assert n2.drained and n2.flags == {"DRAIN"} and n2.reason_user == "root" and n2.reason_time is not None
    assert (n3.state, n3.flags, n3.next_state, n3.draining) == ("mixed", {"DRAIN", "REBOOT_REQUESTED"}, "RESUME", True)
    assert n4.draining and not n4.drained
    assert {n.name: n.reason for n in as_json if n.reason} == CAPTURED_REASONS
    # sinfo --json groups alike nodes; it gives the same states and reasons (26.05 leaves out the reason's user)
    assert {(n.name, n.state, n.flags, n.reason) for n in sinfo} == {(n.name, n.state, n.flags, n.reason) for n in as_json}


@pytest.mark.parametrize("version", CAPTURED_PARSERS)
def test_a_resumed_node_has_no_reason_whatever_slurm_kept(version, utc):
    """24.11 keeps the old reason, its user and time after RESUME on a node that is plain IDLE again
    (until it runs a job); 26.05 clears them. A reason means something only while the state holds
    DRAIN, DOWN or FAIL: read anywhere else it is history, never a hold nor someone else's drain."""
    kept = {n["name"]: n["reason"] for n in _captured_json(f"scontrol-json-{version}-resumed.json")["nodes"]}
    assert kept["node02"] == (CAPTURED_REASONS["node02"] if version == "24.11" else "")  # what Slurm printed
    as_json, oneliner, sinfo = _captured_reads(version, "resumed")
    assert oneliner == as_json
    for read in (as_json, oneliner, sinfo):
        n2 = {n.name: n for n in read}["node02"]
        assert (n2.state, n2.flags, n2.reason, n2.reason_user, n2.reason_time) == ("idle", frozenset(), "", None, None)
    # the nodes still drained keep theirs
    assert {n.name: n.reason for n in as_json if n.reason} == {k: v for k, v in CAPTURED_REASONS.items() if k != "node02"}


_STATE_FLAGS = ["DRAIN", "NOT_RESPONDING", "COMPLETING", "REBOOT_REQUESTED", "MAINTENANCE", "RESERVED", "FAIL",
                "POWERED_DOWN", "CLOUD", "DYNAMIC_NORM", "PLANNED"]


@hsettings(max_examples=300, deadline=None)
@given(base=st.sampled_from(["IDLE", "MIXED", "ALLOCATED", "DOWN", "FUTURE", "UNKNOWN", "ERROR"]),
       flags=st.lists(st.sampled_from(_STATE_FLAGS), unique=True, max_size=4),
       reason=st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=40)
       .filter(lambda r: r.strip() == r))
def test_a_reason_is_read_only_while_the_state_holds_drain_down_or_fail(base, flags, reason):
    """data_parser's NODE `state` (a base state, then flags) with any reason Slurm may have kept: every
    reader reports the reason exactly when the state holds DRAIN, DOWN or FAIL."""
    doc = {"nodes": [_node_2411("n1", [base, *flags], reason, 1795949831, "root")], "meta": META_2411,
           "errors": [], "warnings": []}
    (node,) = parse_sinfo_json(doc)
    holds = base == "DOWN" or "DRAIN" in flags or "FAIL" in flags
    assert (node.reason, node.reason_user) == ((reason, "root") if holds else ("", None))
    line = (f"NodeName=n1 Arch=x86_64 State={'+'.join([base, *flags])} Partitions=debug "
            f"Reason={reason} [root@2026-11-29T09:22:22]")
    assert parse_scontrol_node_line(line).reason == (reason if holds else "")


# ----------------------------------------------------------------------------- 24.11, built from the schema

# Built from SchedMD/slurm src/plugins/data_parser/v0.0.42/parsers.c (PARSER_ARRAY(NODE),
# PARSER_FLAG_ARRAY(NODE_STATES)): `state` and `next_state_after_reboot` are NODE_STATES flag
# arrays (one base state then flags; "INVALID" when unset), `reason_changed_at` is
# TIMESTAMP_NO_VAL ({"set", "infinite", "number"}), `partitions` a CSV_STRING list. The meta
# block follows a real 25.11 `scontrol show node --json` (data_parser v0.0.44), same layout.
META_2411 = {
    "plugin": {"type": "", "name": "", "data_parser": "data_parser/v0.0.42", "accounting_storage": ""},
    "client": {"source": "/dev/pts/0", "user": "root", "group": "root"},
    "command": ["show", "nodes"],
    "slurm": {"version": {"major": "24", "micro": "1", "minor": "11"}, "release": "24.11.1", "cluster": "lab"},
}


def _ts(n, set_=True, infinite=False):
    return {"set": set_, "infinite": infinite, "number": n}


def _node_2411(name, state, reason="", when=0, user="", next_state=("INVALID",)):
    return {
        "architecture": "x86_64", "boards": 1, "boot_time": _ts(1795940000), "cluster_name": "", "cores": 1,
        "cpus": 4, "effective_cpus": 4, "free_mem": _ts(23000), "gres": "gpu:4", "gres_drained": "N/A",
        "gres_used": "gpu:0", "features": [], "active_features": [], "name": name,
        "next_state_after_reboot": list(next_state), "address": "127.0.0.1", "hostname": "localhost",
        "state": list(state), "operating_system": "Linux", "owner": "", "partitions": ["debug", "gpu"],
        "port": 17001, "real_memory": 1000, "comment": "", "reason": reason, "reason_changed_at": _ts(when),
        "reason_set_by_user": user, "resume_after": _ts(0), "reservation": "", "alloc_memory": 0,
        "alloc_cpus": 0, "alloc_idle_cpus": 4, "tres_used": "", "tres_weighted": 0.0,
        "slurmd_start_time": _ts(1795940000), "sockets": 4, "threads": 1, "temporary_disk": 0, "weight": 1,
        "tres": "cpu=4,mem=1000M,billing=4", "version": "24.11.1",
    }


SCONTROL_NODES_2411 = {
    "nodes": [
        _node_2411("node01", ["IDLE"]),
        _node_2411("node02", ["IDLE", "DRAIN"], HOSTILE_REASON, 1795949831, "root"),
        _node_2411(
            "node03", ["MIXED", "DRAIN", "REBOOT_REQUESTED"], "healthd: pending row remap gpu1 [#9]",
            1795949832, "root", next_state=("UNKNOWN", "RESUME"),
        ),
        _node_2411("node04", ["DOWN", "NOT_RESPONDING"], "Not responding", 1795949833, "slurm"),
        _node_2411("node05", ["IDLE", "NOT_RESPONDING"], "", 0, "root"),
    ],
    "last_update": _ts(1795949900),
    "meta": META_2411,
    "errors": [],
    "warnings": [],
}


def test_scontrol_nodes_json_2411_data_parser_shape():
    nodes = {n.name: n for n in parse_sinfo_json(SCONTROL_NODES_2411)}
    assert nodes["node01"] == NodeInfo("node01", "idle", frozenset(), "", None, None, ("debug", "gpu"), "gpu:4", None,
                                       boot_time=1795940000.0)
    assert nodes["node02"].reason == HOSTILE_REASON and nodes["node02"].drained
    assert (nodes["node02"].reason_user, nodes["node02"].reason_time) == ("root", 1795949831.0)
    n3 = nodes["node03"]
    assert (n3.state, n3.flags, n3.next_state, n3.draining) == ("mixed", {"DRAIN", "REBOOT_REQUESTED"}, "RESUME", True)
    assert nodes["node04"].state == "down" and nodes["node04"].reason_user == "slurm"
    assert nodes["node05"].reason_user is None and nodes["node05"].reason_time is None  # stale user, no reason


def test_2411_wrapped_numbers_unset_and_infinite_are_none():
    doc = json.loads(json.dumps(SCONTROL_NODES_2411))
    doc["nodes"][1]["reason_changed_at"] = _ts(0, set_=False)
    doc["nodes"][2]["reason_changed_at"] = _ts(0, infinite=True)
    nodes = parse_sinfo_json(doc)
    assert nodes[1].reason_time is None and nodes[2].reason_time is None


def test_a_real_2511_scontrol_json_node_parses():
    # data_parser v0.0.44 as printed by a Slurm 25.11.0 `scontrol show node --json` (a capture in the
    # unit-test constants of Canonical's `slurm-ops` package), trimmed to the fields NodeInfo reads
    doc = {
        "nodes": [{
            "name": "compute-0", "next_state_after_reboot": ["INVALID"], "state": ["DOWN", "DYNAMIC_NORM"],
            "partitions": ["compute"], "gres": "", "reason": "Not responding",
            "reason_changed_at": {"set": True, "infinite": False, "number": 1769096589},
            "reason_set_by_user": "slurm",
        }],
        "meta": {"slurm": {"release": "25.11.0"}}, "errors": [], "warnings": [],
    }
    (node,) = parse_sinfo_json(doc)
    assert node == NodeInfo(
        "compute-0", "down", frozenset({"DYNAMIC_NORM"}), "Not responding", "slurm", 1769096589.0, ("compute",), None, None
    )


SINFO_2411 = {
    # data_parser v0.0.42 PARSER_ARRAY(SINFO_DATA): one entry per group of alike nodes per partition
    "sinfo": [
        {
            "port": 17001, "node": {"state": ["IDLE"]},
            "nodes": {"allocated": 0, "idle": 2, "other": 0, "total": 2, "hostnames": [], "addresses": [],
                      "nodes": ["node01", "node03"]},
            "cpus": {"allocated": 0, "idle": 8, "other": 0, "total": 8},
            "gres": {"total": "gpu:4", "used": "gpu:0"},
            "reason": {"description": "", "time": 0, "user": ""},
            "partition": {"name": "debug"},
        },
        {
            "port": 17002, "node": {"state": ["IDLE", "DRAIN"]},
            "nodes": {"nodes": ["node02"]},
            "gres": {"total": "gpu:4", "used": "gpu:0"},
            "reason": {"description": "healthd: xid 79 [#7]", "time": 1795949831, "user": "root"},
            "partition": {"name": "debug"},
        },
        {
            "node": {"state": ["IDLE", "DRAIN"]}, "nodes": {"nodes": ["node02"]},
            "gres": {"total": "gpu:4"},
            "reason": {"description": "healthd: xid 79 [#7]", "time": 1795949831, "user": "root"},
            "partition": {"name": "gpu"},
        },
    ],
    "meta": META_2411,
    "errors": [],
    "warnings": [],
}


def test_sinfo_json_2411_grouped_entries_are_expanded_and_merged():
    nodes = {n.name: n for n in parse_sinfo_json(SINFO_2411)}
    assert sorted(nodes) == ["node01", "node02", "node03"]
    assert nodes["node02"].partitions == ("debug", "gpu") and nodes["node02"].drained
    assert nodes["node02"].reason_time == 1795949831.0 and nodes["node02"].reason_user == "root"
    assert nodes["node03"].state == "idle" and nodes["node03"].reason_user is None


@pytest.mark.parametrize(
    "doc, where",
    [
        ([], "document is list"),
        ({"meta": META_2411}, "no 'nodes' or 'sinfo' list"),
        ({"nodes": [{"state": ["IDLE"]}], "meta": META_2411}, r"nodes\[0\]\.name is missing"),
        ({"nodes": [{"name": "n1", "state": 3}], "meta": META_2411}, r"nodes\[0\]\.state is int"),
        ({"nodes": [{"name": "n1", "state": ["DRAIN"]}], "meta": META_2411}, "has no base state"),
        ({"nodes": [{"name": "n1", "state": ["IDLE"], "reason_changed_at": {"number": "x"}}], "meta": META_2411},
         r"reason_changed_at\.number is str"),
        ({"nodes": [{"name": "n1", "state": ["IDLE"], "partitions": [1]}], "meta": META_2411}, r"partitions\[0\]"),
        ({"sinfo": [{"node": {"state": ["IDLE"]}}], "meta": META_2411}, r"sinfo\[0\]\.nodes is missing"),
    ],
)
def test_unexpected_json_is_a_clear_error(doc, where):
    with pytest.raises(SlurmOutputError, match="unexpected sinfo --json shape from Slurm") as info:
        parse_sinfo_json(doc)
    assert __import__("re").search(where, str(info.value)), str(info.value)
    if isinstance(doc, dict):
        assert "24.11.1" in str(info.value)


def test_json_text_that_does_not_parse():
    with pytest.raises(SlurmOutputError, match="does not parse"):
        parse_sinfo_json_text('{"nodes": [')


# ----------------------------------------------------------------------------- scontrol show node -o


LINE = (
    "NodeName=node03 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.97 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:4 NodeAddr=127.0.0.1 NodeHostName=localhost "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 "
    "State=IDLE+DRAIN ThreadsPerCore=1 Partitions=debug,gpu  BootTime=2026-11-29T09:57:05 "
    "CurrentWatts=0 AveWatts=0 Reason={reason}"
)


def test_oneliner_reason_with_fake_suffix_and_fields(utc):
    node = parse_scontrol_node_line(LINE.format(reason=HOSTILE_REASON + " [root@2026-11-29T10:57:11]"))
    assert node.reason == HOSTILE_REASON
    assert (node.reason_user, node.reason_time) == ("root", 1795949831.0)
    assert node.partitions == ("debug", "gpu") and node.gres == "gpu:4"
    assert (node.state, node.flags) == ("idle", {"DRAIN"})


def test_oneliner_fields_after_the_reason(utc):
    line = LINE.format(reason="healthd: x [slurm@2026-11-29T10:57:11] Comment=rack 7 ReservationName=maint")
    node = parse_scontrol_node_line(line)
    assert (node.reason, node.reason_user) == ("healthd: x", "slurm")
    no_suffix = parse_scontrol_node_line(LINE.format(reason="old reason Comment=c"))
    assert (no_suffix.reason, no_suffix.reason_user, no_suffix.reason_time) == ("old reason", None, None)


def test_oneliner_without_reason_and_with_next_state():
    line = LINE.format(reason="x").replace(" Reason=x", "").replace("State=IDLE+DRAIN", "State=MIXED+DRAIN+REBOOT_REQUESTED")
    node = parse_scontrol_node_line(line.replace("Partitions=", "NextState=RESUME Partitions="))
    assert node.reason == "" and node.reason_user is None and node.next_state == "RESUME"
    assert node.flags == {"DRAIN", "REBOOT_REQUESTED"} and node.draining


@pytest.mark.parametrize("line", ["", "garbage", "State=IDLE", "NodeName= State=IDLE", "NodeName=n1 Arch=x", "NodeName=n1 State=+"])
def test_oneliner_garbage_is_a_clear_error(line):
    with pytest.raises(SlurmOutputError):
        parse_scontrol_node_line(line)


def test_state_strings():
    assert parse_state_string("IDLE+DRAIN+NOT_RESPONDING") == ("idle", {"DRAIN", "NOT_RESPONDING"})
    assert parse_state_string("idle*") == ("idle", {"NOT_RESPONDING"})
    assert parse_state_string("DOWN+DRAIN+REBOOT_ISSUED") == ("down", {"DRAIN", "REBOOT_ISSUED"})
    assert parse_state_string("completing") == ("allocated", {"COMPLETING"})


# ----------------------------------------------------------------------------- property tests

_LINE_PIECES = st.sampled_from(
    ["NodeName=", "node01", " ", "State=", "IDLE", "+DRAIN", "*", " Reason=", " [root@2026-11-29T10:57:11]",
     " [x@0000-99-99T99:99:99]", " Comment=", "=", "[", "]", "@", "Partitions=", ",", "NextState=", "\n", "ü"]
)


@hsettings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(_LINE_PIECES, max_size=30).map("".join)))
def test_no_string_crashes_the_oneliner_parser(line):
    try:
        node = parse_scontrol_node_line(line)
    except SlurmOutputError:
        return
    assert isinstance(node, NodeInfo) and node.name and node.state


_json = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
        st.sampled_from(["IDLE", "DRAIN", "MIXED", "idle", "INVALID", "RESUME", "node01", "node[01-02]"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(
                st.sampled_from(["nodes", "sinfo", "name", "state", "state_flags", "reason", "reason_changed_at",
                                 "reason_set_by_user", "partitions", "gres", "next_state_after_reboot",
                                 "next_state_after_reboot_flags", "node", "partition", "time", "user",
                                 "description", "set", "infinite", "number", "errors", "meta", "total"]),
                st.text(max_size=6),
            ),
            children,
            max_size=6,
        ),
    ),
    max_leaves=30,
)


@hsettings(max_examples=400, deadline=None)
@given(_json)
def test_no_json_value_crashes_the_json_parser(doc):
    try:
        nodes = parse_sinfo_json(doc)
    except SlurmOutputError as exc:
        assert "unexpected sinfo --json shape from Slurm" in str(exc)
        return
    assert all(isinstance(n, NodeInfo) and n.name for n in nodes)


@hsettings(max_examples=200, deadline=None)
@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9\-_.]{0,20}(\[[0-9]{1,3}(-[0-9]{1,3})?(,[0-9]{1,3})*\])?", fullmatch=True))
def test_valid_hostnames_and_hostlists_are_accepted(name):
    try:
        assert len(validate_nodes(name)) >= 1
    except ValueError as exc:  # a reversed range (n[5-2]), mixed padding, or the ClusterShell/Slurm ambiguity
        assert "invalid hostlist" in str(exc) or "ambiguous hostlist" in str(exc)


@hsettings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=50))
def test_node_names_with_anything_outside_the_alphabet_are_refused(text):
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.[],")
    if set(text) <= allowed:
        return
    with pytest.raises(ValueError):
        validate_nodes(text)


@pytest.mark.parametrize("bad", BAD_NODE_NAMES)
def test_bad_node_names(bad):
    with pytest.raises(ValueError):
        validate_nodes(bad)


@pytest.mark.parametrize("bad", BAD_REASONS)
def test_bad_reasons(bad):
    with pytest.raises(ValueError):
        validate_reason(bad)


def test_hostlists_clustershell_and_slurm_read_differently_are_refused():
    # ClusterShell 1.9 reads n1[9,10] as n[19-110] (92 names); Slurm reads n19,n110
    for ambiguous in ("n1[9,10]", "gpu1[1-16]", "70[0-100]"):
        with pytest.raises(ValueError, match="ambiguous hostlist"):
            validate_nodes(ambiguous)
    assert len(validate_nodes("gpu1[01-16]")) == 16  # equal widths mean the same to both


def test_hostlists_fold_through_clustershell():
    assert str(validate_nodes(["node03", "node01", "node02"])) == "node[01-03]"
    assert str(validate_nodes("gpu[001-128]")) == "gpu[001-128]" and len(validate_nodes("gpu[001-128]")) == 128


def test_the_nodes_a_read_asks_for():
    """Both backends' nodes() and node_addresses() take names the same way: None is every node, an
    empty list none (nothing is read), anything else is validated before a read."""
    assert requested_nodes(None) is None
    assert requested_nodes([]) == [] and requested_nodes(iter(())) == []
    assert requested_nodes("gpu[01-02]") == ["gpu[01-02]"]
    assert requested_nodes(("n1", "n2")) == ["n1", "n2"]
    with pytest.raises(ValueError):
        requested_nodes(["n1", "bad name"])


def test_reservation_arguments_are_validated_in_order():
    assert reservation_args("maint-1", ["n2", "n1"], 30, ("root",), ("MAINT",)) == ("maint-1", "n[1-2]", 30, ["root"],
                                                                                  ["MAINT"])
    with pytest.raises(ValueError, match="reservation name"):
        reservation_args("bad name", "bad node", 0, (), ("NOPE",))
    with pytest.raises(ValueError, match="node"):
        reservation_args("ok", "bad node", 0, (), ("NOPE",))
    with pytest.raises(ValueError, match="duration"):
        reservation_args("ok", "n1", 0, (), ("NOPE",))
    with pytest.raises(ValueError, match="user"):
        reservation_args("ok", "n1", 5, (), ("NOPE",))
    with pytest.raises(ValueError, match="flag"):
        reservation_args("ok", "n1", 5, ("root",), ("NOPE",))


# ----------------------------------------------------------------------------- ScontrolBackend with a fake runner


class FakeRunner:
    """Records every argv and answers from a script of CommandResults (or raises CommandTimeout)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, argv, env, timeout_s):
        self.calls.append((list(argv), dict(env)))
        answer = self.answers.pop(0) if self.answers else CommandResult(0, "", "")
        if isinstance(answer, Exception):
            raise answer
        return answer


def _backend(*answers, **kw):
    runner = FakeRunner(*answers)
    return ScontrolBackend("/etc/slurm/test.conf", runner=runner, **kw), runner


def test_no_client_without_slurm_conf(monkeypatch):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    with pytest.raises(SlurmUnavailable, match="DNS SRV"):
        ScontrolBackend()
    with pytest.raises(SlurmUnavailable, match="does not exist"):
        ScontrolBackend("/nonexistent/slurm.conf")
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    with pytest.raises(SlurmUnavailable, match="does not exist"):
        ScontrolBackend()


def test_every_client_gets_slurm_conf_and_a_clean_environment(monkeypatch):
    monkeypatch.setenv("SINFO_PARTITION", "other")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    backend, runner = _backend()
    backend.drain("node01", "healthd: x")
    (argv, env), = runner.calls
    assert env["SLURM_CONF"] == "/etc/slurm/test.conf" and env["SLURM_TIME_FORMAT"] == "standard"
    assert "SINFO_PARTITION" not in env


def test_reason_is_one_argv_element_exactly():
    backend, runner = _backend()
    backend.drain(["node02", "node01"], HOSTILE_REASON)
    assert runner.calls[0][0] == ["scontrol", "update", "NodeName=node[01-02]", "State=DRAIN", f"Reason={HOSTILE_REASON}"]
    assert backend.describe("drain", nodes="node[01-02]", reason=HOSTILE_REASON) == runner.calls[0][0]


def test_write_argv():
    backend, runner = _backend(bin_dir="/opt/slurm/bin")
    backend.reboot_asap("gpu[001-004]", "healthd: remap [#9]", next_state="DOWN")
    backend.requeue(1234)
    backend.requeue("1234_7")
    backend.create_reservation("healthd-val-9", ["gpu001"], 45, users=["root", "slurm"], flags=["MAINT"])
    backend.delete_reservation("healthd-val-9")
    assert [a for a, _ in runner.calls] == [
        ["/opt/slurm/bin/scontrol", "reboot", "ASAP", "nextstate=DOWN", "reason=healthd: remap [#9]", "gpu[001-004]"],
        ["/opt/slurm/bin/scontrol", "requeue", "1234"],
        ["/opt/slurm/bin/scontrol", "requeue", "1234_7"],
        ["/opt/slurm/bin/scontrol", "create", "reservation", "ReservationName=healthd-val-9", "Nodes=gpu001",
         "StartTime=now", "Duration=45", "Users=root,slurm", "Flags=MAINT"],
        ["/opt/slurm/bin/scontrol", "delete", "ReservationName=healthd-val-9"],
    ]


def test_dry_run_records_and_runs_nothing():
    backend, runner = _backend(dry_run=True)
    backend.drain("node01", "healthd: x")
    backend.reboot_asap("node01", "healthd: y")
    assert runner.calls == []
    assert backend.planned == [
        ["scontrol", "update", "NodeName=node01", "State=DRAIN", "Reason=healthd: x"],
        ["scontrol", "reboot", "ASAP", "nextstate=RESUME", "reason=healthd: y", "node01"],
    ]


def test_timeout_is_unavailable_with_command_and_hint():
    backend, _ = _backend(CommandTimeout("x"), timeout_s=2)
    with pytest.raises(SlurmUnavailable, match=r"scontrol update NodeName=node01 .*timed out after 2 s.*scontrol ping") as info:
        backend.drain("node01", "healthd: x")
    assert info.value.argv[:2] == ["scontrol", "update"] and info.value.returncode is None


def test_unreachable_controller_is_unavailable_and_refusal_is_refused():
    backend, _ = _backend(
        CommandResult(1, "", "slurm_update error: Unable to contact slurm controller (connect failure)\n"),
        CommandResult(1, "", "slurm_update error: Invalid node name specified\n"),
    )
    with pytest.raises(SlurmUnavailable, match="unreachable"):
        backend.drain("node01", "healthd: x")
    with pytest.raises(SlurmRefused, match="Invalid node name specified") as info:
        backend.drain("node99", "healthd: x")
    assert info.value.returncode == 1 and "Invalid node name" in info.value.stderr


def _sinfo_answer(doc):
    return CommandResult(0, json.dumps(doc), "")


def test_reads_by_version_and_json_errors_mean_unavailable():
    v2205 = CommandResult(0, "slurm-wlm 22.05.8\n", "")
    backend, runner = _backend(v2205, _sinfo_answer(_captured_json("sinfo-22.05-slurmctld-down.json")))
    with pytest.raises(SlurmUnavailable, match="Unspecified error"):
        backend.nodes()
    assert [a for a, _ in runner.calls] == [["scontrol", "--version"], ["sinfo", "--json"]]
    backend, runner = _backend(CommandResult(0, "slurm 24.11.1\n", ""), _sinfo_answer(SCONTROL_NODES_2411))
    assert [n.name for n in backend.nodes(["node0[2-3]"])] == ["node02", "node03"]
    assert runner.calls[1][0] == ["scontrol", "show", "nodes", "--json"]


def test_unusable_json_falls_back_to_the_oneliner(utc):
    backend, runner = _backend(
        CommandResult(0, "slurm-wlm 22.05.8\n", ""),
        CommandResult(0, '{"surprise": true}', ""),
        CommandResult(0, LINE.format(reason="healthd: x [root@2026-11-29T10:57:11]") + "\n", ""),
    )
    (node,) = backend.nodes()
    assert node.reason == "healthd: x"
    assert runner.calls[2][0] == ["scontrol", "show", "node", "-o"]
    assert backend._effective_read_mode == "oneliner"


def test_resume_skips_nodes_that_need_none_and_tolerates_a_race():
    def line(name: str, drained: bool) -> str:
        text = LINE.replace("node03", name)
        if drained:
            return text.format(reason="healthd: x [root@2026-11-29T10:57:11]") + "\n"
        return text.replace("State=IDLE+DRAIN", "State=IDLE").replace(" Reason={reason}", "") + "\n"

    show = [["scontrol", "show", "node", "-o", n] for n in ("node01", "node02")]
    backend, runner = _backend(
        CommandResult(0, line("node01", False), ""),
        CommandResult(0, line("node02", True), ""),
        CommandResult(1, "", "slurm_update error: Invalid node state specified\n"),
        CommandResult(0, line("node02", False), ""),
    )
    backend.resume("node[01-02]")  # node01 is idle: only node02 is resumed; the refusal was a race
    # a few nodes are read one by one, never the whole fleet
    assert [a for a, _ in runner.calls] == [*show, ["scontrol", "update", "NodeName=node02", "State=RESUME"], show[1]]
    backend2, runner2 = _backend(CommandResult(0, line("node01", False), ""))
    backend2.resume("node01")
    assert [a for a, _ in runner2.calls] == [show[0]]  # the read, no write
    many = [f"node{i:02d}" for i in range(1, 12)]
    backend3, runner3 = _backend(CommandResult(0, "slurm-wlm 22.05.8\n", ""),
                                 _sinfo_answer(_captured_json("sinfo-22.05-drained-reboot-draining.json")))
    with pytest.raises(SlurmRefused, match="no node named"):
        backend3.resume(many)  # more than a few: one read of the fleet (which has only some of them)
    assert [a for a, _ in runner3.calls] == [["scontrol", "--version"], ["sinfo", "--json"]]


def test_run_command_kills_the_process_group_on_timeout(tmp_path):
    script = tmp_path / "hang.sh"
    script.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")
    script.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(CommandTimeout):
        run_command([str(script)], {"PATH": os.defpath}, 0.5)
    assert time.monotonic() - started < 4
    with pytest.raises(FileNotFoundError):
        run_command(["surely-not-a-slurm-client"], {"PATH": str(tmp_path)}, 1)
    assert run_command(["echo", "ünï"], {"PATH": os.defpath}, 5).stdout == "ünï\n"


# ----------------------------------------------------------------------------- ClusterShell vs Slurm hostlists

_number = st.integers(0, 120).flatmap(lambda n: st.sampled_from([str(n), f"{n:02d}", f"{n:03d}"]))
_bracket = st.lists(
    st.one_of(_number, st.tuples(_number, _number).map(lambda t: f"{t[0]}-{t[1]}")), min_size=1, max_size=3
).map(lambda parts: "[" + ",".join(parts) + "]")
_hostlist_item = st.tuples(
    st.sampled_from(["n", "gpu", "node", "n1", "rack2-n", "a.b", "x_"]),
    st.one_of(st.just(""), _number, _bracket),
    st.sampled_from(["", "-ib", "x"]),
).map("".join)
_hostlists = st.lists(_hostlist_item, min_size=1, max_size=3).map(",".join)


def _slurm_hostnames(hostlist: str) -> list[str] | None:
    """Slurm's own expansion (`scontrol show hostnames` parses locally, no slurmctld needed);
    None when Slurm rejects the expression (22.05 prints "Invalid hostlist: ..." and exits 0)."""
    res = run_command(["scontrol", "show", "hostnames", hostlist], {"PATH": os.defpath, "SLURM_CONF": os.environ["SLURM_CONF"]}, 10)
    if res.returncode != 0 or "Invalid hostlist" in res.stdout + res.stderr:
        return None
    return res.stdout.split()


@pytest.mark.skipif(not any(Path(p, "scontrol").exists() for p in os.defpath.split(":") + ["/usr/bin"]), reason="no scontrol")
@hsettings(max_examples=150, deadline=None)
@given(_hostlists)
def test_accepted_hostlists_mean_the_same_nodes_to_clustershell_and_slurm(hostlist):
    """The hostlist healthd hands to Slurm names exactly the nodes validate_nodes accepted, and
    where Slurm itself accepts the caller's expression it means the same nodes too."""
    try:
        accepted = set(validate_nodes(hostlist))
    except ValueError:
        return
    rendered = slurm_hostlist(hostlist)
    assert set(_slurm_hostnames(rendered) or ()) == accepted, (hostlist, rendered)
    slurm_reads = _slurm_hostnames(hostlist)
    if slurm_reads is not None:
        assert set(slurm_reads) == accepted, hostlist


def test_hostlists_slurm_rejects_are_rendered_so_it_accepts_them():
    assert slurm_hostlist("rack[1-3]-node01") == "rack1-node01,rack2-node01,rack3-node01"
    assert slurm_hostlist("gpu[1-2]-ib") == "gpu1-ib,gpu2-ib"
    assert slurm_hostlist("rack[1-2]-node[01-02]") == "rack1-node[01-02],rack2-node[01-02]"
    assert slurm_hostlist(["node03", "node01", "node02"]) == "node[01-03]"


# ----------------------------------------------------------------------------- jobs, addresses, validation steps

SQUEUE_LINES = (
    f"{'41':<40}|{'1':<4}|{'0':<10}|{'RUNNING':<24}|{'gpu':<64}|{'ml':<64}|{'x healthd:requeue y|z':<1000}\n"
    f"{'42_3':<40}|{'0':<4}|{'2':<10}|{'COMPLETED':<24}|{'debug':<64}|{'':<64}|{'':<1000}\n"
    "\n"
    "not a job line\n"
)


def test_squeue_lines_are_jobs():
    assert parse_squeue_jobs(SQUEUE_LINES) == [
        JobInfo("41", True, "x healthd:requeue y|z", 0, "RUNNING", "gpu", "ml"),
        JobInfo("42_3", False, "", 2, "COMPLETED", "debug", "")]


SACCT_LINES = (
    "41|REQUEUED|2026-11-30T10:00:00|2026-11-30T10:05:00|gpu|ml|billing=8,cpu=8,gres/gpu=8,node=1|node01|\n"
    "41|CANCELLED by 0|2026-11-30T10:06:00|2026-11-30T10:07:00|gpu|ml|billing=8,cpu=8,gres/gpu:a100=8,gres/gpu=8|node02|"
    "healthd: goodput=50% | x\n"
    "41|PENDING|Unknown|Unknown|gpu|ml||None assigned|\n"
    "not a run\n"
)


def test_sacct_lines_are_runs(utc):
    from healthd.slurm.backend import JobRun
    from healthd.slurm.scontrol import parse_sacct_runs

    t = 1796032800.0  # 2026-11-30T10:00:00Z
    assert parse_sacct_runs(SACCT_LINES) == [
        JobRun("41", "REQUEUED", t, t + 300, "gpu", "ml", 8, "node01", ""),
        JobRun("41", "CANCELLED", t + 360, t + 420, "gpu", "ml", 8, "node02", "healthd: goodput=50% | x"),
        JobRun("41", "PENDING", None, None, "gpu", "ml", None, "None assigned", ""),
    ]


@hsettings(max_examples=300)
@given(st.text(alphabet=st.sampled_from("41|REQUEDPNGIKWco-:T0123456789 ,=/gpu\n"), max_size=300))
def test_sacct_parser_never_raises(text):
    from healthd.slurm.scontrol import parse_sacct_runs

    for run in parse_sacct_runs(text):
        assert run.job_id and (run.gpus is None or run.gpus >= 0)


def test_job_runs_reads_accounting_and_says_when_there_is_none():
    from healthd.slurm.scontrol import SACCT_FORMAT

    backend, runner = _backend(
        CommandResult(0, SACCT_LINES, ""),
        CommandResult(1, "", "sacct: error: Slurm accounting storage is disabled\n"),
        CommandResult(1, "", "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection "
                             "to host:127.0.0.1:6819: Connection refused\nsacct: error: Problem talking to the database: "
                             "Connection refused\n"),
    )
    assert [r.state for r in backend.job_runs("41")] == ["REQUEUED", "CANCELLED", "PENDING"]
    assert backend.job_runs(41) is None
    with pytest.raises(SlurmUnavailable):
        backend.job_runs("41")
    assert runner.calls[0][0] == ["sacct", "--jobs=41", "--duplicates", "--allocations", "--parsable2", "--noheader",
                                  SACCT_FORMAT]


@pytest.mark.parametrize("text", ["", "a\nb", "x" * 201, "\u00fcn\u00efcode", "a\x00b", "a\tb"])
def test_an_admin_comment_that_is_not_one_printable_line_never_reaches_sacctmgr(text):
    backend, runner = _backend()
    with pytest.raises(ValueError):
        backend.set_admin_comment("41", text)
    assert runner.calls == []


def test_the_admin_comment_is_one_argv_word():
    backend, runner = _backend(CommandResult(0, " Modified jobs...\n", ""))
    backend.set_admin_comment("41", "healthd: goodput=57.4%; $(reboot) `x` 'y'")
    assert runner.calls[0][0] == ["sacctmgr", "--immediate", "modify", "job", "where", "jobid=41", "set",
                                  "AdminComment=healthd: goodput=57.4%; $(reboot) `x` 'y'"]


def test_node_addresses_come_from_before_the_reason():
    line = LINE.format(reason="healthd: moved NodeAddr=10.9.9.9 [root@2026-11-29T09:22:22]")
    assert parse_node_addresses(line + "\n" + line.replace("node03", "node04")) == {
        "node03": "127.0.0.1", "node04": "127.0.0.1"}
    assert parse_node_addresses("No nodes in the system\n") == {}


def test_job_reads_argv_and_a_forgotten_job():
    backend, runner = _backend(
        CommandResult(0, SQUEUE_LINES, ""),
        CommandResult(0, SQUEUE_LINES, ""),
        CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified\n"),
        CommandResult(1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"),
    )
    assert [j.job_id for j in backend.jobs_on("node02")] == ["41", "42_3"]
    assert backend.job("42_3") == JobInfo("42_3", False, "", 2, "COMPLETED", "debug", "")
    assert backend.job(7) is None
    with pytest.raises(SlurmUnavailable):
        backend.job(8)
    fmt = "--Format=JobID:40|,BatchFlag:4|,RestartCnt:10|,State:24|,Partition:64|,Account:64|,Comment:1000"
    assert [a for a, _ in runner.calls] == [
        ["squeue", "--noheader", "--nodelist=node02", "--states=RUNNING", fmt],
        ["squeue", "--noheader", "--jobs=42_3", "--states=all", fmt],
        ["squeue", "--noheader", "--jobs=7", "--states=all", fmt],
        ["squeue", "--noheader", "--jobs=8", "--states=all", fmt],
    ]
    assert all(env["SLURM_CONF"] == "/etc/slurm/test.conf" for _, env in runner.calls)


def test_run_step_gets_a_minimal_environment_and_never_raises_for_how_it_ended(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "x")
    backend, runner = _backend(CommandResult(3, "out\n", "err\n"), CommandTimeout("srun did not finish within 5 s"),
                               FileNotFoundError("srun not found"), bin_dir="/opt/slurm/bin")
    argv = ["srun", "--nodelist=node02", "healthd", "validate"]
    first = backend.run_step(argv, timeout_s=5)
    assert (first.returncode, first.output) == (3, "out\nerr\n")
    assert backend.run_step(argv, timeout_s=5).returncode == 124
    missing = backend.run_step(argv, timeout_s=5)
    assert missing.returncode == 127 and missing.output == "FileNotFoundError: srun not found"
    (called, env), *_ = runner.calls
    assert called == argv
    assert env == {"PATH": f"/opt/slurm/bin:{STEP_PATH}", "LANG": "C", "SLURM_CONF": "/etc/slurm/test.conf"}


def test_run_step_in_a_dry_run_is_planned():
    backend, runner = _backend(dry_run=True)
    assert backend.run_step(["srun", "true"], timeout_s=5).returncode == 0
    assert runner.calls == [] and backend.planned == [["srun", "true"]]
