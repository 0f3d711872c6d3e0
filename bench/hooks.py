"""Wall time of each Slurm hook as slurmd runs it: the installed console script as a subprocess with
slurmd's exact environment (HealthCheckProgram: only SLURMD_NODENAME; Prolog/Epilog: the variables
of testbed §3d), a realistic state file (8 GPUs, a few findings with evidence), N runs each. The
floor is the same interpreter doing nothing: `python -c pass` (with site, as a console script
starts) and `python -S -c pass` (no site at all).

Scenarios:
- prolog (gating off, healthy node): write the binding, read and judge the state, gate. The job
  launch path.
- prolog refusing (gating local, T1 on an allocated GPU): plus one node read and one drain through
  the Slurm backend, against tiny /bin/sh stand-ins for scontrol/sinfo (a real client's round trip to
  slurmctld comes on top).
- epilog (healthy): read the binding, charge, close it, post-job GPU count, checks.json.
- healthcheck (busy node): judge the state; Slurm not asked (jobs bound, asked recently).
- healthcheck (idle node): ask Slurm (the sh stand-ins), GPU count, write checks.json.

    .venv/bin/python bench/hooks.py [--runs 200]

Writes bench/results/hooks.json. The editable install used in development adds an import hook to
every start; compare the hooks with the `python -c pass` floor of the same interpreter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import save, summary

from tests.hooks.support import Node, finding, state_doc

BIN = Path(sys.executable).parent

SH_SCONTROL = """#!/bin/sh
case "$1" in
  --version) echo "slurm 22.05.8" ;;
  show) cat {nodeline} ;;
  update|reboot) exit 0 ;;
  *) exit 2 ;;
esac
"""
SH_SINFO = """#!/bin/sh
cat {nodes}
"""


def sinfo_json(name: str, state: str) -> str:
    return json.dumps({"meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}, "errors": [],
                       "nodes": [{"name": name, "state": state, "state_flags": [], "reason": "",
                                  "reason_set_by_user": None, "reason_changed_at": 0, "gres": "gpu:8"}]})


def realistic_state(node: str, extra: list | None = None) -> dict:
    doc = state_doc(node, [
        finding("xid:gpu5:13", 5, tier=3, attribution="user", action="none", xid=13,
                summary="xid 13 gpu5: graphics engine exception"),
        finding("nvml.pcie_replay:gpu2", 2, tier=2, attribution="hardware", action="none",
                summary="gpu2: 14 PCIe replays/min"),
        *(extra or []),
    ])
    for f in doc["findings"]:
        f["evidence"] = [{"kind": "log_line", "text": "NVRM: Xid (PCI:0000:5d:00): 13, pid=4242, name=python3, " + "x" * 200}] * 3
    doc["gpus"] = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:032x}", "serial": f"16520000{i:02d}",
                    "bus_id": f"00000000:{0x18 + i:02X}:00.0", "state": "ok", "temperature_c": 34, "margin_c": 50,
                    "ecc_uncorrected_volatile": 0, "remap_pending": False, "remap_failure": False,
                    "pcie": "gen5x16", "no_data": []} for i in range(8)]
    return doc


def timed(argv: list[str], env: dict[str, str], expect: int = 0) -> float:
    start = time.perf_counter()
    p = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if p.returncode != expect:
        raise SystemExit(f"{argv[0]} exited {p.returncode}, expected {expect}: {p.stderr}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    n = ap.parse_args().runs
    tmp = Path(tempfile.mkdtemp(prefix="healthd-bench-hooks-"))
    node = Node(tmp, gpus=8)
    nodes_json = tmp / "sinfo.json"
    node_line = tmp / "node.line"
    for prog, text in (("scontrol", SH_SCONTROL.format(nodeline=node_line)), ("sinfo", SH_SINFO.format(nodes=nodes_json))):
        (node.fakebin / prog).write_text(text)
    node.write_config()
    cfg = str(node.config)
    hook = {name: [str(BIN / name), "--config", cfg] for name in ("healthd-prolog", "healthd-epilog", "healthd-healthcheck")}
    hc_env = {"SLURMD_NODENAME": node.name}
    results: dict[str, list[float]] = {k: [] for k in (
        "floor_python_c_pass", "floor_python_S_c_pass", "prolog", "prolog_refusing", "epilog",
        "healthcheck_busy", "healthcheck_idle")}

    node.write_state(realistic_state(node.name))
    state_bytes = node.state_file.stat().st_size
    for i in range(n):
        results["floor_python_c_pass"].append(timed([sys.executable, "-c", "pass"], {}))
        results["floor_python_S_c_pass"].append(timed([sys.executable, "-S", "-c", "pass"], {}))
        node.write_state(realistic_state(node.name))  # keep it fresh (stale_after_s)
        job = str(1000 + i)
        results["prolog"].append(timed(hook["healthd-prolog"], node.prolog_env(job=job, gpus="0,1,2,3")))
        results["epilog"].append(timed(hook["healthd-epilog"], node.epilog_env(job=job, gpus="0,1,2,3")))

    # health check: busy (bindings present, Slurm asked recently) and idle (Slurm asked every run)
    nodes_json.write_text(sinfo_json(node.name, "mixed"))
    node_line.write_text(f"NodeName={node.name} Gres=gpu:8 State=MIXED Partitions=debug\n")
    timed(hook["healthd-prolog"], node.prolog_env(job="5000", gpus="0"))
    timed(hook["healthd-healthcheck"], hc_env)
    for _ in range(n):
        node.write_state(realistic_state(node.name))
        results["healthcheck_busy"].append(timed(hook["healthd-healthcheck"], hc_env))
    timed(hook["healthd-epilog"], node.epilog_env(job="5000", gpus="0"))
    nodes_json.write_text(sinfo_json(node.name, "idle"))
    node_line.write_text(f"NodeName={node.name} Gres=gpu:8 State=IDLE Partitions=debug\n")
    for _ in range(n):
        node.write_state(realistic_state(node.name))
        results["healthcheck_idle"].append(timed(hook["healthd-healthcheck"], hc_env))

    # prolog refusing: gating local, T1 hardware on GPU 1
    node.write_config(gating="local")
    for i in range(n):
        node.write_state(realistic_state(node.name, [finding("xid:gpu1:79", 1, xid=79, summary="xid 79 gpu1: fell off the bus")]))
        results["prolog_refusing"].append(timed(hook["healthd-prolog"], node.prolog_env(job=str(6000 + i), gpus="0,1"), expect=1))

    ms = {k: {q: (round(v * 1000, 2) if q != "n" else v) for q, v in summary(vals).items()} for k, vals in results.items()}
    floor = ms["floor_python_c_pass"]["median"]
    print(f"{'scenario':24} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p50 - floor':>12}")
    for k, s in ms.items():
        print(f"{k:24} {s['median']:8.1f} {s['p99']:8.1f} {s['max']:8.1f} {s['median'] - floor:12.1f}")
    save("hooks", {
        "runs": n,
        "state_file_bytes": state_bytes,
        "target": "p99 <= 100 ms as slurmd runs the hook",
        "milliseconds": ms,
        "p50_over_floor_ms": {k: round(s["median"] - floor, 2) for k, s in ms.items()},
    })
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
