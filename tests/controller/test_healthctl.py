"""healthctl over a ledger populated through Ledger's API with a realistic history: Xid 79 on
node02's GPU 1650923012345, a drain refused by the rate limit then allowed and applied; an older
incident on the same GPU; observe-mode proposals judged by operators. Every command's table and
--json output is checked on concrete content; report figures against hand-computed values."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from healthd.controller import healthctl
from healthd.controller.admin import serve_admin_socket
from healthd.controller.ledger import Ledger
from tests.support.tmpdirs import shared_tmpdir

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
NOW = T0 + 100
DAY = 86400.0
SERIAL = "1650923012345"
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
DRAIN_ARGV = ["scontrol", "update", "NodeName=node02", "State=DRAIN", "Reason=healthd: GPU fell off the bus (Xid 79) [#2]"]


def populate(led: Ledger) -> dict[str, int]:
    ids: dict[str, int] = {}
    # incident 1: the same GPU two days ago, repaired and back in service after an hour
    old = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=["node02"], gpu_serials=[SERIAL],
                            first_evidence_at=T0 - 2 * DAY, detected_at=T0 - 2 * DAY + 3, at=T0 - 2 * DAY + 3)
    for stage, dt in (("decided_at", 5), ("action_applied_at", 6), ("back_in_service_at", 3600)):
        led.mark_timeline(old.id, stage, T0 - 2 * DAY + dt)
    led.update_incident(old.id, status="closed")
    # incident 2: today's Xid 79 on node02
    led.record_finding("node02", "xid:gpu1:79", gpu_serial=SERIAL, attribution="hardware", tier="1", action="drain",
                       summary="GPU 1 fell off the bus (Xid 79)", evidence=[{"kind": "kernel", "text": XID_LINE}], at=T0 + 0.2)
    inc = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=["node02"], gpu_serials=[SERIAL], jobs=["4242"],
                            first_evidence_at=T0, detected_at=T0 + 1.5, at=T0 + 1.5)
    ids["incident"] = inc.id
    refused = led.record_decision(node="node02", kind="drain", tier="1", mode="auto", reason="healthd: GPU fell off the bus (Xid 79) [#2]",
                                  outcome="refused", incident_id=inc.id, refused_gate="rate-limit",
                                  refused_reason="10 node-removing actions in the last hour (max 10)", at=T0 + 2)
    allowed = led.record_decision(node="node02", kind="drain", tier="1", mode="auto", reason="healthd: GPU fell off the bus (Xid 79) [#2]",
                                  outcome="allowed", incident_id=inc.id, at=T0 + 4)
    led.mark_timeline(inc.id, "decided_at", T0 + 4)
    act = led.plan_action(decision_id=allowed.id, idempotency_key=f"drain:node02:{inc.id}", node="node02", partition="gpu",
                          kind="drain", argv=DRAIN_ARGV, at=T0 + 4.5)
    led.mark_applied(act.id, "scontrol rc=0", at=T0 + 5.5)
    led.mark_timeline(inc.id, "action_applied_at", T0 + 5.5)
    ids.update(refused=refused.id, allowed=allowed.id, action=act.id)
    # incident 3: node03 ECC, open, waiting for approval (supervised)
    ecc = led.open_incident("ecc:dbe", attribution="hardware", tier="2", nodes=["node03"], gpu_serials=["1650923099999"],
                            first_evidence_at=T0 - 7200, detected_at=T0 - 7190, at=T0 - 7190)
    ids["waiting"] = led.record_decision(node="node03", kind="drain", tier="2", mode="supervised", reason="healthd: ECC DBE [#3]",
                                         outcome="waiting", incident_id=ecc.id, at=T0 - 7000).id
    # incident 4: node01, judged a false positive (left out of MTBF and offenders)
    fp = led.open_incident("pcie:aer", attribution="unknown", tier="2", nodes=["node01"], first_evidence_at=T0 - 3600,
                           detected_at=T0 - 3590, at=T0 - 3590)
    led.update_incident(fp.id, status="false_positive")
    # observe-mode proposals: one rejected, one approved -> false-positive rate 50 %
    p1 = led.record_decision(node="node01", kind="drain", tier="2", mode="observe", reason="healthd: PCIe AER [#4]", outcome="refused",
                             incident_id=fp.id, refused_gate="mode", refused_reason="observe mode: decided and recorded, not applied", at=T0 - 3500)
    p2 = led.record_decision(node="node04", kind="drain", tier="1", mode="observe", reason="healthd: Xid 48", outcome="refused",
                             refused_gate="mode", refused_reason="observe mode: decided and recorded, not applied", at=T0 - 3400)
    led.record_approval(p1.id, operator="alice", verdict="reject", why="AER storm from a BIOS setting", at=T0 - 3000)
    led.record_approval(p2.id, operator="bob", verdict="approve", at=T0 - 2900)
    return ids


@pytest.fixture(scope="module")
def world():
    with shared_tmpdir("healthctl-") as d:  # nobody reads it in test_any_local_user_may_read
        path = d / "ledger.db"
        with Ledger(path) as led:
            ids = populate(led)
        yield path, ids


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = healthctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_status(world, capsys):
    path, ids = world
    code, out, err = run(capsys, "--ledger", str(path), "--now", str(NOW), "status", "--budget", "10")
    assert code == 0 and err == ""
    assert "mode:            auto" in out  # the latest policy decision's mode (observe proposals are older)
    assert "breaker:         closed" in out
    assert "actions (1h):    1 of 10" in out
    assert "drained by healthd: node02" in out
    assert "waiting approval: 1" in out and "healthd: ECC DBE [#3]" in out
    code, out, _ = run(capsys, "--ledger", str(path), "--now", str(NOW), "--json", "status")
    doc = json.loads(out)
    assert doc["waiting_approvals"] == [ids["waiting"]] and doc["actions_last_hour"] == 1 and doc["budget_per_hour"] is None
    assert doc["breaker"]["open"] is False and doc["healthd_drained_nodes"] == ["node02"]


def test_status_reads_the_budget_from_the_controller_config(world, capsys, tmp_path):
    path, _ = world
    cfg = tmp_path / "controller.yaml"
    cfg.write_text("policy:\n  mode: auto\n  max_actions_per_hour: 7\n")
    code, out, _ = run(capsys, "--ledger", str(path), "--config", str(cfg), "--now", str(NOW), "status")
    assert code == 0 and "actions (1h):    1 of 7" in out


def test_show_tells_the_reintegration_and_the_escalation(world, capsys, tmp_path):
    src, _ = world
    path = tmp_path / "copy.sqlite"  # the world is shared by the module's tests: change a copy
    with sqlite3.connect(src) as a, sqlite3.connect(path) as b:
        a.backup(b)
    with Ledger(path) as led:
        inc = led.hold("node02").incident_id
        r = led.request_reintegration("node02", incident_id=inc, trigger="repaired", operator="root", why="GPU 0 reseated",
                                      findings=["xid:gpu0:79"], at=NOW)
        led.update_reintegration(r.id, state="failed", detail="gpu_check.sh rc=3: GPU 0 bad", at=NOW,
                                 results=[{"argv": ["/opt/gpu_check.sh", "node02"], "rc": 3, "seconds": 1.5, "output": "bad"}])
        led.set_escalation(inc, "inspect-hardware")
    code, out, _ = run(capsys, "--ledger", str(path), "--now", str(NOW), "show", str(inc))
    assert code == 0
    assert f"#{r.id} node02: failed; repaired by root (GPU 0 reseated)" in out
    assert "FAIL rc=3 1.5s $ /opt/gpu_check.sh node02" in out and "gpu_check.sh rc=3: GPU 0 bad" in out
    assert "ESCALATED: inspect-hardware" in out
    doc = json.loads(run(capsys, "--ledger", str(path), "--json", "show", str(inc))[1])
    assert doc["reintegrations"][0]["state"] == "failed" and doc["incident"]["escalation"] == "inspect-hardware"


def test_nodes(world, capsys):
    path, ids = world
    code, out, _ = run(capsys, "--ledger", str(path), "nodes")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["node", "healthd", "incidents", "open", "last", "incident", "last", "action"]
    node02 = next(line for line in lines if line.startswith("node02"))
    assert "drained by healthd" in node02 and f"#{ids['action']} drain applied" in node02
    code, out, _ = run(capsys, "--ledger", str(path), "--json", "nodes")
    doc = {n["node"]: n for n in json.loads(out)}
    assert doc["node02"]["incidents"] == 2 and doc["node02"]["gpu_serials"] == [SERIAL]
    assert doc["node02"]["healthd_drained"] and not doc["node03"]["healthd_drained"]


def test_incidents(world, capsys):
    path, ids = world
    code, out, _ = run(capsys, "--ledger", str(path), "incidents", "--open")
    assert code == 0
    rows = out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [str(ids["incident"]), "3"]
    assert "xid:79" in rows[0] and SERIAL in rows[0] and "1.5s" in rows[0]
    code, out, _ = run(capsys, "--ledger", str(path), "--json", "incidents")
    doc = json.loads(out)
    assert [i["status"] for i in doc] == ["closed", "open", "open", "false_positive"]
    assert doc[0]["recovery_time"] == 3600 and doc[1]["detection_latency"] == 1.5


def test_show(world, capsys):
    path, ids = world
    code, out, err = run(capsys, "--ledger", str(path), "show", str(ids["incident"]))
    assert code == 0 and err == ""
    assert f"where: node node02; GPU serial {SERIAL}; jobs 4242" in out
    assert "detection latency:     1.5s" in out
    assert "isolation granularity: 1 node, 1 GPU" in out
    assert "recovery time:         -   (not back in service yet)" in out
    assert "first evidence   2023-11-14T22:13:20Z" in out
    assert XID_LINE in out
    assert "REFUSED by rate-limit: 10 node-removing actions in the last hour (max 10)" in out
    assert f"#{ids['action']} drain node02: applied at 2023-11-14T22:13:25Z (scontrol rc=0)" in out
    assert "$ scontrol update NodeName=node02 State=DRAIN 'Reason=healthd: GPU fell off the bus (Xid 79) [#2]'" in out
    assert f"`healthctl repaired node02`; if healthd was wrong, `healthctl undo {ids['action']} --why ...`" in out
    code, out, _ = run(capsys, "--ledger", str(path), "--json", "show", str(ids["incident"]))
    doc = json.loads(out)
    assert doc["actions"][0]["argv"] == DRAIN_ARGV
    assert doc["incident"]["isolation_granularity"] == {"nodes": 1, "gpus": 1}
    assert [d["outcome"] for d in doc["decisions"]] == ["refused", "allowed"]
    assert doc["decisions"][0]["refused_gate"] == "rate-limit"
    code, _, err = run(capsys, "--ledger", str(path), "show", "99")
    assert code == 1 and err == "healthctl: no incident 99 in the ledger\n"


def test_report_matches_hand_computed(world, capsys):
    path, _ = world
    code, out, _ = run(capsys, "--ledger", str(path), "--now", str(NOW), "--json", "report")
    assert code == 0
    doc = json.loads(out)
    assert [(o["key"], o["incidents"]) for o in doc["repeat_offenders"]["nodes"]] == [("node02", 2)]
    assert [(o["key"], o["incidents"]) for o in doc["repeat_offenders"]["gpus"]] == [(SERIAL, 2)]
    assert doc["false_positive_rate"] == {"approved": 1, "rejected": 1, "rate": 0.5}
    # 30-day window = 2,592,000 s; node02 2 failures, node03 1; node01 was a false positive
    assert [(m["node"], m["failures"], m["mtbf_s"]) for m in doc["mtbf"]] == [("node02", 2, 1_296_000.0), ("node03", 1, 2_592_000.0)]
    lat = doc["latency"]
    # detection: [1.5, 3, 10] -> nearest rank p50 = 3, p90 = p99 = 10
    assert (lat["detection"]["n"], lat["detection"]["p50"], lat["detection"]["p90"], lat["detection"]["p99"]) == (3, 3.0, 10.0, 10.0)
    assert (lat["decision"]["n"], lat["decision"]["p50"]) == (2, 2.0)  # [2, 2.5]
    assert (lat["recovery"]["n"], lat["recovery"]["p50"]) == (1, 3600.0)
    code, out, _ = run(capsys, "--ledger", str(path), "--now", str(NOW), "report")
    assert "False-positive rate of observe-mode proposals: 50.0%  (1 rejected, 1 approved)" in out
    assert any(line.split() == ["node02", "2", "15.0d"] for line in out.splitlines())
    assert any(line.split()[:3] == ["detection", "3", "3.0s"] for line in out.splitlines())


def test_reads_leave_the_ledger_untouched(world, capsys):
    path, _ = world
    before = path.stat().st_mtime_ns
    os.chmod(path, 0o444)
    try:
        assert run(capsys, "--ledger", str(path), "status")[0] == 0
    finally:
        os.chmod(path, 0o644)
    assert path.stat().st_mtime_ns == before


def test_missing_and_corrupt_ledger_exit_3(tmp_path: Path, capsys):
    code, out, err = run(capsys, "--ledger", str(tmp_path / "nope.db"), "status")
    assert code == 3 and out == "" and err.count("\n") == 1 and "no ledger there" in err
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    code, out, err = run(capsys, "--ledger", str(bad), "incidents")
    assert code == 3 and out == "" and err.count("\n") == 1 and str(bad) in err
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    code, _, err = run(capsys, "--ledger", str(other), "report")
    assert code == 3 and "not a healthd ledger" in err


def test_usage_exit_2(capsys):
    code, out, err = run(capsys, "reject", "5")
    assert code == 2 and err.startswith("healthctl: ") and err.count("\n") == 1 and "--why" in err
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "breaker", "reset", "--why", " ")[0] == 2


def test_changes_go_through_the_socket(tmp_path: Path, capsys):
    with shared_tmpdir("healthctl-sock-") as sockdir, Ledger(tmp_path / "ledger.db") as led:
        ids = populate(led)
        led.open_breaker("switch:leaf3", nodes=["node01", "node02", "node03"], at=T0 + 50)
        with serve_admin_socket(str(sockdir / "admin.sock"), led) as srv:
            sock = ["--socket", srv.path]
            code, out, err = run(capsys, *sock, "approve", str(ids["waiting"]))
            assert code == 0 and "approved" in out and led.approval(ids["waiting"]) is not None
            code, out, err = run(capsys, *sock, "reject", str(ids["allowed"]), "--why", "x")
            assert code == 1 and out == "" and err.count("\n") == 1 and "is allowed" in err
            code, out, _ = run(capsys, *sock, "--json", "undo", str(ids["action"]), "--why", "GPU reseated, false alarm")
            assert code == 0 and json.loads(out)["data"]["argv"] == ["scontrol", "update", "NodeName=node02", "State=RESUME"]
            code, out, _ = run(capsys, *sock, "repaired", "node02", "--why", "GPU swapped")
            assert code == 0 and "node02 enters reintegration" in out
            code, out, _ = run(capsys, *sock, "breaker", "reset", "--why", "leaf3 replaced")
            assert code == 0 and not led.breaker_state().open
            code, _, err = run(capsys, *sock, "breaker", "reset", "--why", "again")
            assert code == 1 and "already closed" in err
    code, _, err = run(capsys, "--socket", str(sockdir / "admin.sock"), "approve", "1")
    assert code == 3 and err.startswith("healthctl: cannot reach the controller") and err.count("\n") == 1


def test_console_script_installed():
    exe = Path(sys.executable).with_name("healthctl")
    assert exe.exists()
    proc = subprocess.run([str(exe), "--ledger", "/nonexistent/ledger.db", "status"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1


def test_reads_while_the_controller_writes(tmp_path: Path, capsys):
    """The controller holds the ledger open (WAL files present) and is mid-transaction: healthctl
    reads the last committed state and never waits for the writer."""
    with Ledger(tmp_path / "ledger.db") as led:
        ids = populate(led)
        with led.transaction():
            led.open_breaker("rack:r12", nodes=["node01", "node02", "node03"], at=NOW)
            code, out, _ = run(capsys, "--ledger", str(led.path), "--json", "status")
            assert code == 0 and json.loads(out)["breaker"]["open"] is False  # not committed yet
        code, out, _ = run(capsys, "--ledger", str(led.path), "--json", "status")
        assert json.loads(out)["breaker"]["cause"] == "rack:r12"
        assert json.loads(out)["waiting_approvals"] == [ids["waiting"]]


@pytest.mark.skipif(os.geteuid() != 0, reason="setuid to nobody needs root")
def test_any_local_user_may_read(world):
    """A user who cannot write the ledger (nor its -shm) still reads it."""
    path, ids = world
    with Ledger(path):  # the controller is running: -wal and -shm exist, owned by root
        code = subprocess.run(
            [sys.executable, "-c",
             # import (and build the parser) first: this interpreter's own files are unreadable to nobody here
             "import os, pwd, sys; from healthd.controller.healthctl import build_parser, main; build_parser().format_help();"
             "n = pwd.getpwnam('nobody');"
             "os.setgroups([]); os.setgid(n.pw_gid); os.setuid(n.pw_uid); sys.exit(main(sys.argv[1:]))",
             "--ledger", str(path), "--json", "show", str(ids["incident"])],
            capture_output=True, text=True, timeout=60, cwd="/",
        )
    assert code.returncode == 0, code.stderr
    assert json.loads(code.stdout)["actions"][0]["argv"] == DRAIN_ARGV


# ----------------------------------------------------------------------------- Slurm hostlists


def test_parse_hostlist_expands_slurm_hostlists_in_natural_order():
    assert healthctl.parse_hostlist("gpu[001-004]") == ["gpu001", "gpu002", "gpu003", "gpu004"]
    assert healthctl.parse_hostlist("node[01,03-05]") == ["node01", "node03", "node04", "node05"]
    assert healthctl.parse_hostlist(" node10,node2,node[1-2] ") == ["node1", "node2", "node10"]
    assert healthctl.parse_hostlist("rack[1-2]-gpu[1-2]") == ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]
    assert healthctl.parse_hostlist("login.cluster") == ["login.cluster"]


@pytest.mark.parametrize("spec, says", [
    ("gpu[001-", "missing bracket"),
    ("gpu[3-1]", "invalid values in range"),
    ("gpu[a-b]", "bad range"),
    ("node]", "illegal closing bracket"),
    ("a,,b", "missing nodeset operand"),
    ("", "empty hostlist"),
    ("@rack1", "character(s) '@' not allowed"),
    ("node[1-3]!node2", "character(s) '!' not allowed"),
    ("node1;reboot", "character(s) ';' not allowed"),
    ("node 1", "character(s) ' ' not allowed"),
    ("node[1-999999999]", "999999999 nodes (at most 100000)"),
])
def test_bad_hostlists_are_refused_with_one_line(spec, says):
    with pytest.raises(ValueError) as exc:
        healthctl.parse_hostlist(spec)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_fold_prints_node_lists_folded_and_naturally_sorted():
    assert healthctl.fold(["node10", "node2", "node3", "node1"]) == "node[1-3,10]"
    assert healthctl.fold(["gpu004", "gpu001", "gpu002", "gpu003", "login1"]) == "gpu[001-004],login1"
    assert healthctl.fold([]) == ""
    # a name a hostlist cannot carry is listed as it is, after the folded ones
    assert healthctl.fold(["node2", "odd[name", "node1"]) == "node[1-2],odd[name"
    assert healthctl.natural_sorted(["node10", "node9", "node1", "node10"]) == ["node1", "node9", "node10"]


@pytest.mark.parametrize("argv", [
    ["repaired", "node[02-"],
    ["release", "node[3-1]", "--why", "x"],
    ["nodes", "@all"],
    ["incidents", "--nodes", "node[1-2"],
])
def test_a_bad_hostlist_is_a_usage_error_and_asks_nothing(argv, capsys, tmp_path):
    # the socket and ledger do not exist: exit 2 (not 3) shows nothing was opened or sent
    code, out, err = run(capsys, "--socket", str(tmp_path / "none.sock"), "--ledger", str(tmp_path / "none.db"), *argv)
    assert code == 2 and out == "", err
    assert err.startswith("healthctl: argument ") and "bad hostlist" in err and err.count("\n") == 1, err


def _drain(led: Ledger, node: str, at: float) -> None:
    inc = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=[node], gpu_serials=[f"S-{node}"],
                            first_evidence_at=at, detected_at=at, at=at)
    d = led.record_decision(node=node, kind="drain", tier="1", mode="auto", reason=f"healthd: xid 79 [#{inc.id}]",
                            outcome="allowed", incident_id=inc.id, at=at)
    act = led.plan_action(decision_id=d.id, idempotency_key=f"drain:{node}:{inc.id}", node=node, partition="gpu",
                          kind="drain", argv=["scontrol", "update", f"NodeName={node}", "State=DRAIN"], at=at)
    led.mark_applied(act.id, "scontrol rc=0", at=at)


def test_hostlists_in_reads_and_changes(tmp_path: Path, capsys):
    with shared_tmpdir("healthctl-hl-") as sockdir, Ledger(tmp_path / "ledger.db") as led:
        populate(led)
        for node in ("node10", "node09"):
            _drain(led, node, T0 + 10)
        path = str(tmp_path / "ledger.db")
        code, out, _ = run(capsys, "--ledger", path, "--now", str(NOW), "status")
        assert code == 0 and "drained by healthd: node[02,09-10]" in out
        doc = json.loads(run(capsys, "--ledger", path, "--now", str(NOW), "--json", "status")[1])
        assert doc["healthd_drained_nodes"] == ["node02", "node09", "node10"]

        code, out, _ = run(capsys, "--ledger", path, "nodes")
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["node01", "node02", "node03", "node09", "node10"]
        code, out, _ = run(capsys, "--ledger", path, "nodes", "node[09-10,99]")
        assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["node09", "node10"]
        code, out, _ = run(capsys, "--ledger", path, "--json", "nodes", "node[09-10]")
        assert [n["node"] for n in json.loads(out)] == ["node09", "node10"]
        code, out, _ = run(capsys, "--ledger", path, "nodes", "node[98-99]")
        assert code == 0 and out.strip() == "none of node[98-99] in the ledger"
        code, out, _ = run(capsys, "--ledger", path, "--json", "incidents", "--nodes", "node[03,09]")
        assert sorted(n for i in json.loads(out) for n in i["nodes"]) == ["node03", "node09"]

        with serve_admin_socket(str(sockdir / "admin.sock"), led) as srv:
            code, out, err = run(capsys, "--socket", srv.path, "--json", "release", "node[09-10]", "--why", "vendor RMA")
            assert code == 0 and err == ""
            assert [r["node"] for r in json.loads(out)] == ["node09", "node10"]
            assert all(r["reply"]["ok"] for r in json.loads(out))
            code, out, err = run(capsys, "--socket", srv.path, "repaired", "node[10-11],node02", "--why", "GPUs swapped")
            # one request per node, in natural order: node02 is healthd's and enters reintegration; node10
            # was just released and node11 never was healthd's: both refused, each in one line
            assert code == 1
            assert out.startswith("node02: node02 enters reintegration") and out.count("\n") == 1, out
            assert err.splitlines() == ["healthctl: node10: node10 is not drained by healthd; healthd never resumes a drain it did not make",
                                        "healthctl: node11: node11 is not drained by healthd; healthd never resumes a drain it did not make"], err
            assert [n for n in ("node02", "node10", "node11") if led.active_reintegration(n)] == ["node02"]
        code, out, _ = run(capsys, "--ledger", path, "--now", str(NOW), "status")
        assert "drained by healthd: node02" in out
    # the controller gone: exit 3, and the nodes not asked are named
    code, _, err = run(capsys, "--socket", str(sockdir / "admin.sock"), "repaired", "node[01-03]")
    assert code == 3 and err.count("\n") == 1 and "(not sent for node[01-03])" in err, err
