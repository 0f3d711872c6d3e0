"""Google's ml-goodput-measurement as an oracle: read the event logs of many jobs (JSONL) on stdin,
compute each named job's goodput with the library's own GoodputCalculator, offline (its Cloud Logging
reader replaced by the job's entries, in the order they were written), and print one JSON object:
job -> {"goodput_pct", "productive_s", "total_s", "badput_pct", "last_step", "error"}.

`productive_s` and `total_s` are the calculator's own productive training time and job time (first
`job_start_time` to last `job_end_time`); goodput_pct is their ratio. Where the calculator refuses
(its productive time is negative or longer than its job time: a clock stepped back), `error` holds
its message and the two times are those it refused, taken from the same calculator.

Runs under the separate venv `make test` builds (build/venv-mlgp): the library's Google Cloud
dependencies never enter healthd's own environment.

    build/venv-mlgp/bin/python tests/goodput/mlgp_oracle.py JOB [JOB ...] < logs.jsonl
"""

import datetime
import json
import sys
import tempfile
from collections import defaultdict

from ml_goodput_measurement.src import goodput


class _Entries:
    """Stands in for the library's _CloudLogger: every entry at once, then nothing new."""

    def __init__(self, entries):
        self.entries = entries
        self.job_start_time = None
        self.served = False

    def read_cloud_logging_entries(self, start_time=None, end_time=None, last_entry_info=None):
        if self.served:
            return [], last_entry_info
        self.served = True
        return list(self.entries), None

    def write_cloud_logging_entry(self, entry):
        raise AssertionError("the oracle writes nothing")


def goodput_of(job, entries):
    with tempfile.TemporaryDirectory() as cache:
        calc = goodput.GoodputCalculator(job_name=job, logger_name="offline", cloud_logger=_Entries(entries),
                                         cache_dir=cache)
        try:
            pct, badput, last = calc.get_job_goodput(include_badput_breakdown=True)
        except ValueError as e:
            # get_job_goodput computes these two before it refuses; the same private steps, in its order
            total = calc._get_total_job_time(datetime.datetime.now(datetime.timezone.utc))
            productive = calc._get_current_productive_and_unproductive_time()[0]
            return {"goodput_pct": None, "productive_s": productive, "total_s": total, "badput_pct": {},
                    "last_step": None, "error": str(e)}
        info = calc._goodput_cache.get_goodput_info()
    return {"goodput_pct": pct, "productive_s": info.total_productive_time, "total_s": info.total_elapsed_time,
            "badput_pct": {str(getattr(k, "name", k)): v for k, v in badput.items()}, "last_step": last,
            "error": None}


def main() -> int:
    by_job = defaultdict(list)
    for line in sys.stdin:
        if line.strip():
            entry = json.loads(line)
            by_job[entry.get("job_name")].append(entry)
    out = {job: goodput_of(job, by_job[job]) for job in sys.argv[1:]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
