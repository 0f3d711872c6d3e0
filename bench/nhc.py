"""The real LBNL NHC (1.4.3+4, unpacked by `make nhc` into build/nhc) with and without healthd's
`check_healthd`, and healthd's Slurm hooks against NHC's default check set, interleaved in the same
rounds (every round runs every scenario once, so machine noise lands on all of them alike).

NHC's default check set, as a site starts from it: the checks NHC's sample nhc.conf leaves active
(less `check_ps_service -u root -S sshd`: no sshd here, and -S would start it) and the checks
`nhc-genconf` writes for this machine (mounts, disk and inode use, CPU, memory, swap, network
interfaces), less its load-average check (the load of a shared machine is other jobs'). The exact
lines are saved with the results.

- nhc_default: NHC with that check set. nhc_default_healthd: the same plus `* || check_healthd` (one
  `healthd state` against a realistic state file of 8 GPUs): the difference is the check's own cost.
  nhc_healthd_only: NHC with check_healthd alone.
- healthcheck_idle, healthcheck_busy, prolog: healthd's HealthCheckProgram and Prolog as in
  bench/hooks.py (slurmd's environment, the compiled configuration, sh stand-ins for scontrol).
- floor_I_S: `python3.11 -I -S -c pass`, the least any Python program costs.

NHC runs as slurmd would start it: its own log file (-l), its helpers (it finds `scontrol` on PATH,
so it is in Slurm mode and asks Slurm whether to mark the node online after every passing run,
through `sinfo`: here an sh stand-in, as the hooks' `scontrol` is), the default TIMEOUT of 30 s and
its watchdog. Its parent is not a session leader, so it re-executes itself under setsid first, as
NHC does by default.

    .venv/bin/python bench/nhc.py [--runs 200]

Writes bench/results/nhc.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from common import ROOT, pct, save, summary
from hooks import BIN, REAL_PYTHON, make_node, realistic_state, timed

from tests.support.nhc import NHC_DIR, NhcSite, build, default_checks, genconf_checks, missing_reason

SH_SINFO = "#!/bin/sh\n# NHC's helpers ask `sinfo -o '%t %E' -hn HOST`: an idle node without a reason\necho 'idle none'\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    n = ap.parse_args().runs
    reason = missing_reason()
    if reason and not NHC_DIR.is_dir():
        print(f"bench/nhc.py: skipped: {reason}")  # a user's own clone: `make bench` goes on
        return
    nhc_dir = build()
    tmp = Path(tempfile.mkdtemp(prefix="healthd-bench-nhc-"))
    tmp.chmod(0o755)
    p_node, p_env = make_node(tmp, "prolog", "MIXED")
    b_node, b_env = make_node(tmp, "busy", "MIXED")
    i_node, i_env = make_node(tmp, "idle", "IDLE")
    nodes = (p_node, b_node, i_node)

    def hook(name: str, node) -> list[str]:
        return [str(BIN / name), "--config", str(node.config)]

    site = NhcSite(tmp / "nhc", nhc_dir, tmp / "unused-slurm.conf")
    site.install(extra_scripts=[ROOT / "slurm" / "nhc" / "healthd.nhc"])
    checks = default_checks(nhc_dir) + genconf_checks(nhc_dir, tmp)
    healthd_lines = [f"* || export HEALTHD_NHC_BIN={BIN / 'healthd'} HEALTHD_NHC_CONFIG={p_node.config}",
                     "* || check_healthd"]
    confs = {"nhc_default": checks, "nhc_default_healthd": checks + healthd_lines, "nhc_healthd_only": healthd_lines}
    sinfo = tmp / "sinfo"
    sinfo.write_text(SH_SINFO)
    sinfo.chmod(0o755)
    # p_env names the node's compiled settings, which the agent keeps at /run/healthd on a real node:
    # `healthd state` under check_healthd reads them as the hooks do
    nhc_env = {"SLURM_SINFO": str(sinfo), "SLURM_SCONTROL": str(p_node.fakebin / "scontrol"),
               "SLURMD_NODENAME": p_node.name, **p_env}
    argvs = {}
    for name, lines in confs.items():
        conf = site.etc / f"{name}.conf"
        conf.write_text("\n".join(lines) + "\n")
        argvs[name] = [str(nhc_dir / "nhc"), "-D", str(site.etc), "-c", str(conf), "-l", str(site.log_dir / f"{name}.log"),
                       f"HELPERDIR={nhc_dir / 'helpers'}"]

    for node in nodes:
        node.write_state(realistic_state(node.name))
    # what check_healthd will read must be a healthy verdict (a degraded one passes too, but logs)
    state = subprocess.run([str(BIN / "healthd"), "state", "--format", "nagios", "--config", str(p_node.config)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **p_env})
    if state.returncode not in (0, 1):
        raise SystemExit(f"healthd state exited {state.returncode}: {state.stdout}{state.stderr}")
    # the busy node: one job bound, Slurm asked by the first run
    timed(hook("healthd-prolog", b_node), {**b_node.prolog_env(job="5000", gpus="0"), **b_env})
    timed(hook("healthd-healthcheck", b_node), {"SLURMD_NODENAME": b_node.name, **b_env})
    for name, argv in argvs.items():  # every NHC variant passes here before it is timed
        timed(argv, nhc_env)
        log = (site.log_dir / f"{name}.log").read_text()
        if "Health check failed" in log or "cannot tell" in log:
            raise SystemExit(f"{name}: NHC did not pass on this machine:\n{log[-2000:]}")

    names = ("floor_I_S", "nhc_default", "nhc_default_healthd", "nhc_healthd_only", "prolog", "healthcheck_busy",
             "healthcheck_idle")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}

    def record(name: str, argv: list[str], env: dict[str, str]) -> None:
        w, c, _ = timed(argv, env)
        wall[name].append(w)
        cpu[name].append(c)

    started = time.monotonic()
    for i in range(n):
        fresh = realistic_state(p_node.name)  # every node is node01; keep the state fresh (stale_after_s)
        for node in nodes:
            node.write_state(fresh)
        job = str(1000 + i)
        record("floor_I_S", [REAL_PYTHON, "-I", "-S", "-c", "pass"], {})
        record("nhc_default", argvs["nhc_default"], nhc_env)
        record("prolog", hook("healthd-prolog", p_node), {**p_node.prolog_env(job=job, gpus="0,1,2,3"), **p_env})
        record("nhc_default_healthd", argvs["nhc_default_healthd"], nhc_env)
        record("healthcheck_idle", hook("healthd-healthcheck", i_node), {"SLURMD_NODENAME": i_node.name, **i_env})
        record("nhc_healthd_only", argvs["nhc_healthd_only"], nhc_env)
        record("healthcheck_busy", hook("healthd-healthcheck", b_node), {"SLURMD_NODENAME": b_node.name, **b_env})
        timed(hook("healthd-epilog", p_node), {**p_node.epilog_env(job=job, gpus="0,1,2,3"), **p_env})
    elapsed = time.monotonic() - started
    for name in confs:
        log = (site.log_dir / f"{name}.log").read_text()
        if "Health check failed" in log or "cannot tell" in log:
            raise SystemExit(f"{name}: a run failed or could not tell during the benchmark:\n{log[-2000:]}")

    ms = {}
    for k in names:
        s = {q: (round(v * 1000, 2) if q != "n" else v) for q, v in summary(wall[k]).items()}
        s["cpu_median"] = round(summary(cpu[k])["median"] * 1000, 2)
        s["cpu_p99"] = round(pct(cpu[k], 99) * 1000, 2)
        ms[k] = s
    base, with_check = ms["nhc_default"], ms["nhc_default_healthd"]

    def ratio(a: str, b: str) -> dict[str, float]:
        return {"p50": round(ms[a]["median"] / ms[b]["median"], 2), "p99": round(ms[a]["p99"] / ms[b]["p99"], 2)}

    ratios = {
        "check_healthd_cost": {**ratio("nhc_default_healthd", "nhc_default"),
                               "p50_added_ms": round(with_check["median"] - base["median"], 1),
                               "p99_added_ms": round(with_check["p99"] - base["p99"], 1)},
        "healthcheck_idle_vs_nhc_default": ratio("healthcheck_idle", "nhc_default"),
        "healthcheck_busy_vs_nhc_default": ratio("healthcheck_busy", "nhc_default"),
        "prolog_vs_nhc_default": ratio("prolog", "nhc_default"),
        "healthcheck_idle_vs_nhc_default_healthd": ratio("healthcheck_idle", "nhc_default_healthd"),
    }
    print(f"{n} interleaved rounds in {elapsed:.0f} s; NHC {nhc_dir}, {len(checks)} default checks")
    print(f"{'scenario':22} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'CPU p50':>8}")
    for k in names:
        s = ms[k]
        print(f"{k:22} {s['median']:7.1f} {s['p99']:7.1f} {s['max']:7.1f} {s['cpu_median']:8.1f}")
    for k, r in ratios.items():
        print(f"{k:40} " + "  ".join(f"{q} {v}" for q, v in r.items()))
    save("nhc", {
        "runs": n,
        "interleaved": True,
        "nhc": "LBNL NHC 1.4.3-4-g9c4a38c from ../shared/third_party, run in place (build/nhc)",
        "default_checks": checks,
        "check_healthd_lines": healthd_lines,
        "floor_binary": REAL_PYTHON,
        "milliseconds": ms,
        "ratios": ratios,
    })
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
