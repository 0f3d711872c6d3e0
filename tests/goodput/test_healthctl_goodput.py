"""`healthctl goodput --log FILE`: the accounting of one job's event log, as a table and as JSON, with
the checkpoint interval advice; a partial log says so; a missing file is exit 3."""

from __future__ import annotations

import json

from healthd.controller import healthctl
from tests.goodput.test_accounting import J, ckpt, crash_and_restore, hd, log, start, step


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = healthctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_json(tmp_path, capsys):
    path = tmp_path / "4242.jsonl"
    path.write_text(crash_and_restore())
    code, out, err = run(capsys, "goodput", "--log", str(path))
    assert code == 0 and err == ""
    assert out.startswith("job 4242: goodput 68.9% of 0.50 GPU-h held over 2 run(s), 1 interruption(s) (MTBI 7.5 min); "
                          "1.5 min queued between runs (not held)")
    assert "productive  0.344  68.9%" in out and "waiting     0.011  2.2%" in out
    assert "7         xid:79  node01  1652000003  0.133       lost 0.061, detection 0.011" in out
    assert "blocking save 10 s, MTBI 7.5 min: Young 1.6 min, Daly 88 s" in out and "PARTIAL" not in out
    code, out, _ = run(capsys, "--json", "goodput", "--log", str(path), "--job", J)
    doc = json.loads(out)
    assert code == 0 and doc["held_gpu_s"] == 1800 and doc["gpu_s"]["productive"] == 1240 and not doc["partial"]
    assert doc["queued_s"] == 90 and doc["at_risk_gpu_s"] == 0
    assert doc["incidents"][0]["incident"] == "7" and doc["incidents"][0]["cost_gpu_s"] == 480
    assert doc["checkpoint_interval"]["checkpoint_s"] == 10 and doc["checkpoint_interval"]["current_s"] is None


def test_the_interval_against_dalys_and_what_it_would_gain(tmp_path, capsys):
    """Saves of 60 s every 2 h of a job interrupted every 6 h: Daly's interval is about 26 min."""
    entries = []
    t = 0.0
    for run_no in range(3):
        entries += start(t, 8)
        if run_no:
            entries.append(hd("restored", t + 1, step=0))
        entries.append(step(0, t + 10))
        for k in range(3):
            entries += ckpt(t + 10 + 7200 * k + 7140, t + 10 + 7200 * (k + 1))
        entries.append(step(3, t + 10 + 21600))
        entries.append(hd("interrupt", t + 21610, incident=str(run_no), cause="xid:79"))
        entries.append(hd("run_end", t + 21620, state="NODE_FAIL"))
        t += 21700
    path = tmp_path / "j.jsonl"
    path.write_text(log(*entries))
    code, out, _ = run(capsys, "--json", "goodput", "--log", str(path))
    advice = json.loads(out)["checkpoint_interval"]
    assert code == 0 and advice["checkpoint_s"] == 60 and advice["current_s"] == 7200
    assert 1500 < advice["daly_s"] < 1700 and advice["gain"] > 0.05


def test_a_partial_log_says_what_it_assumed_and_a_missing_one_is_exit_3(tmp_path, capsys):
    path = tmp_path / "cut.jsonl"
    path.write_text(crash_and_restore()[:-30])
    code, out, _ = run(capsys, "goodput", "--log", str(path))
    assert code == 0 and "PARTIAL: 1 problem(s) in the log; the figures assume:" in out
    assert "truncated (the last line, no newline)" in out and "no end yet" in out
    code, out, err = run(capsys, "goodput", "--log", str(tmp_path / "none.jsonl"))
    assert code == 3 and out == "" and err.count("\n") == 1 and "cannot read the event log" in err


def test_every_jobs_log_in_a_directory_with_lost_hours_by_cause_node_or_serial(tmp_path, capsys):
    logs = tmp_path / "goodput"
    logs.mkdir()
    (logs / "4242.jsonl").write_text(crash_and_restore())
    (logs / "77.jsonl").write_text(log(*start(10, 8), step(0, 20), step(100, 1020), {"job_end_time": 1100})
                                   .replace('"4242"', '"77"'))
    other = crash_and_restore(decided=300, end=310, restart=400).replace('"4242"', '"5"').replace("xid:79", "nvlink:down")
    (logs / "5.jsonl").write_text(other.replace('"node01"', '"node02"'))
    (logs / "9.jsonl").mkdir()  # not a file: said, and the others still read
    code, out, err = run(capsys, "--ledger", str(tmp_path / "none.db"), "goodput", "--logs", str(logs))
    assert code == 0 and err == "", err
    assert out.startswith(f"3 job(s) in {logs}: goodput")
    assert [line.split()[0] for line in out.splitlines()[2:5]] == ["5", "77", "4242"]  # natural order
    cost = out[out.index("interruption cost by cause:"):].splitlines()
    assert cost[2].startswith("nvlink:down  1") and cost[3].startswith("xid:79       1"), cost  # the larger first
    assert "unreadable: 9.jsonl" in out
    code, out, _ = run(capsys, "--json", "goodput", "--logs", str(logs), "--by", "node")
    doc = json.loads(out)
    assert [x["node"] for x in doc["cost"]] == ["node02", "node01"] and doc["held_gpu_s"] == sum(doc["gpu_s"].values())
    code, out, _ = run(capsys, "--json", "goodput", "--logs", str(logs), "--since", "2030-01-01T00:00:00+00:00")
    assert code == 0 and json.loads(out)["jobs"] == []  # every run ended long before
    code, out, _ = run(capsys, "--json", "goodput", "--logs", str(logs), "--since", "7d")
    assert code == 0 and json.loads(out)["jobs"] == []  # ... and more than 7 days ago
    code, out, _ = run(capsys, "--json", "goodput", "--logs", str(logs), "--job", "77")
    assert code == 0 and json.loads(out)["job"] == "77" and json.loads(out)["interruptions"] == 0
    code, _, err = run(capsys, "goodput", "--logs", str(logs), "--job", "../77")
    assert code == 2 and "not a Slurm job id" in err
    code, _, err = run(capsys, "goodput", "--logs", str(tmp_path / "none"))
    assert code == 3 and "cannot list the goodput logs" in err
