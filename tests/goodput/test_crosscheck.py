"""The differential check: for event logs both can read (a mark per step), healthd's productive
share is within 0.5 percentage points of Google's ml-goodput-measurement's own calculator, run
offline on the same file (tests/goodput/mlgp_oracle.py, in the separate venv `make test` builds).

The logs are realistic jobs from a seeded generator: a startup, lognormal step times, a blocking
save every few hundred steps followed by its durable record, interruptions at random steps with
detection and decision delays, each next run restoring the last durable step and logging the steps
after it again, and a last run that completes."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from healthd.goodput import account, parse_log
from tests.goodput.test_accounting import ckpt, hd, log_line

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / "build" / "venv-mlgp" / "bin" / "python"
ORACLE = Path(__file__).with_name("mlgp_oracle.py")
JOBS = 24


def job_log(job: str, seed: int) -> str:
    rnd = random.Random(seed)
    step_s = rnd.uniform(0.5, 8.0)
    every = rnd.choice((50, 100, 200, 400))
    save_s = rnd.uniform(2.0, 60.0)
    total = rnd.randint(600, 3000)
    runs = rnd.randint(1, 4)
    out: list[dict] = []
    t, step, durable = 1_700_000_000.0 + seed * 1e6, 0, -1
    for r in range(runs):
        last = r == runs - 1
        out += [{"job_start_time": t}, hd("allocation", t, gpus=1)]
        if r:
            out.append(hd("restored", t + 5, step=durable))
            step = durable + 1
        t += rnd.uniform(20, 300)  # startup, or a restart's load
        # an interrupted run stops at least 2 steps past its last save: its lost steps are logged again
        stop = total if last else min(total - 1, step + rnd.randint(every // 2, 3 * every))
        while step <= stop:
            out.append({"step_count": step, "step_start_time": t})
            t += step_s * rnd.lognormvariate(0, 0.05)
            if step % every == every - 1 and step < stop - 2:
                out += ckpt(t, t + save_s)
                t += save_s
                durable = step
                out.append(hd("durable", t, step=step))
            step += 1
        if last:
            out.append({"job_end_time": t})
            break
        inc = f"{seed}-{r}"
        out += [hd("interrupt", t + 1, incident=inc, cause="xid:79", node="node01"),
                hd("detected", t + rnd.uniform(5, 120), incident=inc)]
        t += rnd.uniform(130, 900)
        out += [hd("decided", t, incident=inc), hd("run_end", t + 10, state="NODE_FAIL")]
        t += rnd.uniform(60, 1800)  # waiting for the next run
    return "".join(log_line(job, **e) + "\n" for e in out)


@pytest.fixture(scope="module")
def oracle_python() -> Path:
    if not ORACLE_PY.exists():
        pytest.fail(f"{ORACLE_PY} missing: `make test` builds it (the mlgp-venv target)")
    return ORACLE_PY


def test_productive_share_within_half_a_point_of_ml_goodput_measurement(oracle_python):
    logs = {f"job{seed}": job_log(f"job{seed}", seed) for seed in range(JOBS)}
    done = subprocess.run([str(oracle_python), str(ORACLE), *logs], input="".join(logs.values()),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)
    rows = []
    for job, text in logs.items():
        acc = account(parse_log(text))
        assert not acc.partial, acc.problems
        ours = 100 * acc.goodput
        rows.append((job, acc.runs, round(ours, 3), round(theirs[job]["goodput_pct"], 3)))
    print("\n".join(f"{j}: {n} run(s), healthd {a} %, ml-goodput-measurement {b} %" for j, n, a, b in rows))
    assert {n for _, n, _, _ in rows} >= {1, 2, 3, 4}  # clean jobs and jobs interrupted up to 3 times
    worst = max(abs(a - b) for _, _, a, b in rows)
    assert worst <= 0.5, rows
