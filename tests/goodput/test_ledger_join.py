"""`healthctl goodput` joins the ledger's requeues of the job and their incidents to the log it reads
(healthd.controller.goodput_ledger): the interruption is charged to its incident (cause, node, GPU
serial), its detection and decision time come from the ledger, and an incident closed as a false
positive is charged whole. A real ledger, written the way the controller writes it."""

from __future__ import annotations

import json

from healthd.controller import healthctl
from healthd.controller.ledger import Ledger
from tests.goodput.test_accounting import ckpt, hd, log, start, step

JOB = "4242"
SERIAL = "1652000003"


def node_log() -> str:
    """The node's log of crash_and_restore(), without the incident: what the agent and the epilog write."""
    return log(*start(0, 4), step(0, 10), step(100, 110), *ckpt(110, 120), hd("durable", 125, step=99),
               step(150, 170), hd("run_end", 210, state="FAILED"), *start(300, 4), hd("restored", 320, step=99),
               step(100, 330), step(300, 530), {"job_end_time": 540})


def ledger(path, *, false_positive: bool = False) -> int:
    with Ledger(path) as led:
        inc = led.open_incident("xid:79", attribution="hardware", tier="1", nodes=["node01"], gpu_serials=[SERIAL],
                                jobs=[JOB], first_evidence_at=175, detected_at=185, at=185)
        dec = led.record_decision(node="node01", kind="drain-and-requeue", tier="1", mode="auto",
                                  reason="healthd: GPU fell off the bus (Xid 79)", outcome="allowed", incident_id=inc.id,
                                  at=190)
        act = led.plan_action(decision_id=dec.id, idempotency_key=f"drain:node01:{inc.id}:requeue:{JOB}",
                              node="node01", kind="requeue", argv=["scontrol", "requeue", JOB],
                              evidence={"job": JOB, "restarts": 0, "attempt": 1}, at=195)
        led.mark_applied(act.id, "requeued", at=200)
        other = led.plan_action(decision_id=dec.id, idempotency_key="drain:node01:other:requeue:77", node="node01",
                                kind="requeue", argv=["scontrol", "requeue", "77"], evidence={"job": "77"}, at=195)
        led.mark_applied(other.id, "requeued", at=200)  # another job's requeue: not this job's
        if false_positive:
            led.close_incident(inc.id, "false_positive", by="alice", why="the GPU was fine", at=400)
        return inc.id


def goodput(capsys, tmp_path, ledger_path) -> dict:
    path = tmp_path / f"{JOB}.jsonl"
    path.write_text(node_log())
    assert healthctl.main(["--ledger", str(ledger_path), "--json", "goodput", "--log", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_ledger_charges_the_interruption_to_its_incident(tmp_path, capsys):
    inc = ledger(tmp_path / "ledger.db")
    doc = goodput(capsys, tmp_path, tmp_path / "ledger.db")
    assert doc["ledger"].endswith(f"1 requeue(s) of job {JOB} and their incidents joined") and not doc["partial"]
    [i] = doc["incidents"]
    assert (i["incident"], i["cause"], i["node"], i["gpu"], i["false_positive"]) == (str(inc), "xid:79", "node01", SERIAL,
                                                                                     False)
    assert i["gpu_s"] == {"lost": 220, "detection": 40, "decision": 60, "waiting": 40, "restart": 120}
    assert doc["gpu_s"]["productive"] == 1240 and doc["held_gpu_s"] == 1800


def test_without_the_ledger_the_interruption_is_its_runs(tmp_path, capsys):
    doc = goodput(capsys, tmp_path, tmp_path / "absent.db")
    assert "not read" in doc["ledger"]
    [i] = doc["incidents"]
    assert (i["incident"], i["cause"]) == ("run-0", "FAILED")
    assert doc["gpu_s"]["detection"] == 0 and doc["gpu_s"]["decision"] == 0
    assert sum(i["gpu_s"].values()) == 480  # the same seconds, not split by the ledger's times


def test_a_false_positive_in_the_ledger_is_charged_whole(tmp_path, capsys):
    ledger(tmp_path / "ledger.db", false_positive=True)
    doc = goodput(capsys, tmp_path, tmp_path / "ledger.db")
    assert doc["gpu_s"]["false_positive"] == 480 and doc["incidents"][0]["false_positive"] is True
