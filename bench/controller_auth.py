"""Reports per second the controller's report check sustains: auth.verify_report on real signed
reports (JSON parse, canonical digest, libmunge decode through the controller's own munged with its
replay cache, uid/host/age checks). Starts its own munged daemons (one node, one controller, one key)
under /tmp, signs the reports first (not timed), then times verifying them, with 1, 2 and 4 verifier
threads (libmunge's decode releases the GIL; munged runs 2 threads). The baseline in the same run: the
MUNGE decode alone (healthd.munge.decode of distinct credentials, no JSON, no digest, no checks) with
1, 2, 4 and 8 threads. Target: >= 2,000 reports/s.

    .venv/bin/python bench/controller_auth.py [--reports 20000]

Writes bench/results/controller_auth.json. Policy and HTTP are not included here.
"""

from __future__ import annotations

import argparse
import time

from common import save

from healthd import envelope, munge
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


def munge_decode_rates(fleet: MungeFleet, n: int) -> dict[str, float]:
    """libmunge decode alone through the controller's munged, per thread count: distinct credentials
    (each is decoded once: munged's replay cache refuses a second decode)."""
    from concurrent.futures import ThreadPoolExecutor

    sock = fleet.socket(fleet.nodes[0])
    with ThreadPoolExecutor(max_workers=4) as pool:
        creds = list(pool.map(lambda i: munge.encode(b"%032d" % i, sock), range(4 * n)))
    rates = {}
    for k, threads in enumerate((1, 2, 4, 8)):
        part = creds[k * n:(k + 1) * n]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda c: munge.decode(c, fleet.controller_socket), part))
        rates[str(threads)] = round(n / (time.perf_counter() - t0), 1)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=20000)
    args = ap.parse_args()
    runs = []
    with MungeFleet(["node02"]) as fleet:
        measure_verify_rate(fleet, reports=500)  # warm up
        for threads in (1, 2, 4):
            r = measure_verify_rate(fleet, reports=args.reports, threads=threads)
            runs.append(r)
            print(f"verify_report, {threads} thread(s): {r['verify_per_s']:,.0f} reports/s ({r['verify_us_each']} us each; signing ran at {r['sign_per_s']:,.0f}/s)")
        decode_rates = munge_decode_rates(fleet, min(args.reports, 10000))
        print(f"baseline, MUNGE decode alone: {', '.join(f'{t} thread(s) {r:,.0f}/s' for t, r in decode_rates.items())}")
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
            "munge_decode_only_per_s": decode_rates,
            "best_over_munge_decode_only": round(max(r["verify_per_s"] for r in runs) / max(decode_rates.values()), 3),
            "best_verify_per_s": best,
            "pass": best >= TARGET_PER_S,
        },
    )


if __name__ == "__main__":
    main()
