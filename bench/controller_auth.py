"""Reports per second the controller's report check sustains: auth.verify_report on real signed
reports (JSON parse, canonical digest, libmunge decode through the controller's own munged with its
replay cache, uid/host/age checks). Starts its own munged daemons (one node, one controller, one key)
under /tmp, signs the reports first (not timed), then times verifying them, with 1 and 2 verifier
threads (libmunge calls release the GIL; munged runs 2 threads). Target: >= 2,000 reports/s.

    .venv/bin/python bench/controller_auth.py [--reports 20000]

Writes bench/results/controller_auth.json. Policy and HTTP are not included here.
"""

from __future__ import annotations

import argparse
import time

from common import save

from healthd import envelope
from healthd.controller import auth
from tests.controller.munge_support import MungeFleet, measure_verify_rate

TARGET_PER_S = 2000


def envelope_only_rate(n: int = 20000) -> float:
    """The Python share alone: parse + canonical digest of a typical report, no munged round trip."""
    doc = {"verdict": "healthy", "findings": [], "gpus": 8, "seq": 0}
    body = envelope.sign_report(doc, "node02", None, encode=lambda payload, socket, ttl=None: "MUNGE:x:")
    t0 = time.perf_counter()
    for _ in range(n):
        node, report, _cred = auth.parse_envelope(body, envelope.DEFAULT_MAX_BYTES)
        envelope.payload_digest(node, report)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=20000)
    args = ap.parse_args()
    runs = []
    with MungeFleet(["node02"]) as fleet:
        measure_verify_rate(fleet, reports=500)  # warm up
        for threads in (1, 2):
            r = measure_verify_rate(fleet, reports=args.reports, threads=threads)
            runs.append(r)
            print(f"verify_report, {threads} thread(s): {r['verify_per_s']:,.0f} reports/s ({r['verify_us_each']} us each; signing ran at {r['sign_per_s']:,.0f}/s)")
    py = envelope_only_rate()
    print(f"envelope parse + digest alone: {py:,.0f}/s")
    best = max(r["verify_per_s"] for r in runs)
    print(f"{'PASS' if best >= TARGET_PER_S else 'FAIL'}: {best:,.0f} reports/s verified (target >= {TARGET_PER_S:,})")
    save(
        "controller_auth",
        {
            "what": "auth.verify_report on signed reports through a real controller munged (libmunge via ctypes)",
            "target_per_s": TARGET_PER_S,
            "runs": runs,
            "envelope_parse_digest_per_s": round(py, 1),
            "best_verify_per_s": best,
            "pass": best >= TARGET_PER_S,
        },
    )


if __name__ == "__main__":
    main()
