"""Accounting a long job's goodput log: a 30-day job of 1,024 GPUs with a step mark per window of 25
one-second steps, a blocking save every 30 minutes with its durable record, an interruption every
~36 hours with its ledger times and the next run's restore, written line by line from the documented
format (not by healthd's writers). Times `parse_log` + `account` + `ettr` over the file, against
`json.loads` of every line in the same process (the part no reader can skip), and checks the answer
is exact: the categories sum to the held GPU-seconds and the productive time equals the surviving
steps'.

    .venv/bin/python bench/goodput_account.py [--days 30] [--repeat 5]

Writes bench/results/goodput_account.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from common import machine, save, summary

from healthd import goodput

GPUS = 1024
WINDOW = 25
SAVE_EVERY = 1800
MTBI = 36 * 3600


def job_log(days: float) -> tuple[str, float]:
    """The log and its productive GPU-seconds (the steps that survived), counted while writing it."""
    lines: list[dict] = []
    t, step, run, productive = 1.767e9, 0, 0, 0.0
    end = t + days * 86400
    while t < end:
        lines += [{"job_start_time": t, "run": run}, {"healthd_event": "allocation", "time": t, "gpus": GPUS}]
        t += 60
        if run:
            lines.append({"healthd_event": "restored", "time": t - 30, "step": step - 1})
        stop = min(t + MTBI, end)
        last_save, durable_step, run_good = t, step - 1, []
        while t + WINDOW <= stop:
            lines.append({"step_count": step, "step_start_time": t})
            run_good.append((step, WINDOW))
            t += WINDOW
            step += WINDOW
            if t - last_save >= SAVE_EVERY:
                lines += [{"custom_badput_event_type": "checkpoint_save", "custom_badput_event_start_time": t},
                          {"custom_badput_event_type": "checkpoint_save", "custom_badput_event_end_time": t + 20},
                          {"healthd_event": "durable", "time": t + 25, "step": step - 1}]
                t += 20
                last_save, durable_step = t, step - 1
        lines.append({"step_count": step, "step_start_time": t})
        if t + WINDOW >= end:
            productive += sum(d for _, d in run_good) * GPUS
            lines.append({"job_end_time": t})
            break
        incident = f"i{run}"
        lines += [{"healthd_event": "evidence", "time": t + 5, "incident": incident},
                  {"healthd_event": "interrupt", "time": t + 40, "incident": incident, "cause": "xid:79",
                   "node": "node01", "gpu": "1652000003"},
                  {"healthd_event": "detected", "time": t + 15, "incident": incident},
                  {"healthd_event": "decided", "time": t + 40, "incident": incident},
                  {"healthd_event": "run_end", "time": t + 60, "state": "NODE_FAIL"}]
        productive += sum(d for s, d in run_good if s + WINDOW - 1 <= durable_step) * GPUS
        step = durable_step + 1
        t += 600
        run += 1
    return "".join(json.dumps({"job_name": "1", **x}) + "\n" for x in lines), productive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    text, productive = job_log(args.days)
    n = text.count("\n")
    base, full = [], []
    for _ in range(args.repeat):  # interleaved: the baseline and the reader under the same load
        t0 = time.process_time()
        for line in text.splitlines():
            json.loads(line)
        base.append(time.process_time() - t0)
        t0 = time.process_time()
        acc = goodput.account(goodput.parse_log(text))
        goodput.ettr(acc)
        full.append(time.process_time() - t0)
    assert not acc.problems, acc.problems[:3]
    assert abs(sum(acc.gpu_s.values()) - acc.held_gpu_s) < 1e-6 * acc.held_gpu_s
    assert abs(acc.gpu_s["productive"] - productive) < 1e-6 * productive, (acc.gpu_s["productive"], productive)
    doc = {"machine": machine(), "days": args.days, "gpus": GPUS, "lines": n, "runs": acc.runs,
           "json_loads_cpu_s": summary(base), "account_cpu_s": summary(full),
           "ratio_median": summary(full)["median"] / summary(base)["median"],
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "goodput": acc.goodput}
    print(f"{args.days:g} days x {GPUS} GPUs: {n:,} lines, {acc.runs} runs, goodput {acc.goodput:.4f} (exact)")
    print(f"json.loads of every line: median {doc['json_loads_cpu_s']['median']:.2f} s CPU")
    print(f"parse_log + account + ettr: median {doc['account_cpu_s']['median']:.2f} s CPU, p99 "
          f"{doc['account_cpu_s']['p99']:.2f} s ({doc['ratio_median']:.1f}x json.loads); peak RSS "
          f"{doc['peak_rss_mib']:.0f} MiB")
    save("goodput_account", doc)


if __name__ == "__main__":
    main()
