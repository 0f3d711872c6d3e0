"""Google's ml-goodput-measurement as an oracle: read a job's event log (JSONL) on stdin, compute
each named job's goodput with the library's own GoodputCalculator, offline (its Cloud Logging reader
replaced by the log's entries), and print one JSON object: job -> {"goodput_pct": ..., "badput_pct":
{...}, "last_step": ...}.

Runs under the separate venv `make test` builds (build/venv-mlgp): the library's Google Cloud
dependencies never enter healthd's own environment.

    build/venv-mlgp/bin/python tests/goodput/mlgp_oracle.py JOB [JOB ...] < logs.jsonl
"""

import json
import sys
import tempfile

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
        pct, badput, last = calc.get_job_goodput(include_badput_breakdown=True)
    return {"goodput_pct": pct, "badput_pct": {str(getattr(k, "name", k)): v for k, v in badput.items()},
            "last_step": last}


def main() -> int:
    entries = [json.loads(line) for line in sys.stdin if line.strip()]
    out = {job: goodput_of(job, [e for e in entries if e.get("job_name") == job]) for job in sys.argv[1:]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
