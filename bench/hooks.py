"""Wall time, CPU and peak RSS of each Slurm hook as slurmd runs it, interleaved with the floors and a
node health check of the NHC kind, in the same rounds.

Each hook runs as the installed console script in a subprocess with slurmd's exact environment
(HealthCheckProgram: only SLURMD_NODENAME; Prolog/Epilog: the variables of testbed §3d), against a
realistic state file (8 GPUs, a few findings with evidence). Every round runs every scenario once, so
machine noise lands on all of them alike:

- floor_I_S: the real interpreter binary (not a version manager's shim) doing nothing,
  `python3.11 -I -S -c pass`: the least any Python hook can cost. floor_venv: the venv's python
  `-c pass` with site, which is what a console script's shebang starts.
- nhc: bench/nhc/nhc-standin with bench/nhc/nhc.conf, 13 typical non-GPU checks (mounts, df, ps,
  cpuinfo, meminfo, loadavg, a file test, a forked command). nhc_slurm: the same plus the check
  that asks Slurm, `check_cmd_output -m /State=/ scontrol show node -o $HOSTNAME`, through the same
  stand-in client the idle health check uses. LBNL NHC itself is not packaged for Debian 12 and the
  machine has no network: the stand-in runs NHC's kind of driver and checks in bash and leaves out
  its watchdog and helpers, so it is a lower bound for NHC's time (README in bench/nhc/).
- prolog (gating off, healthy node): write the binding, read and judge the state, gate, make the
  in-band directory. prolog_yaml: the same with no compiled configuration, so the hook parses the
  YAML (what every run did before healthd.hookconfig).
- prolog_refusing (gating local, T1 on an allocated GPU): plus one node read and one drain through
  /bin/sh stand-ins for scontrol (a real client's round trip to slurmctld comes on top).
- epilog: read the binding, charge, close it, post-job GPU count, checks.json, archive in-band.
- healthcheck_busy: judge the state; Slurm not asked (jobs bound, asked recently).
- healthcheck_idle: ask Slurm (the sh stand-in), GPU count, write checks.json.

    .venv/bin/python bench/hooks.py [--runs 200]

Writes bench/results/hooks.json. Targets: every hook's p99 <= 3 x floor_I_S's p99 and <= 0.4 x NHC's;
the idle health check no slower than nhc_slurm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, pct, save, summary

from healthd import hookconfig
from tests.hooks.support import Node, finding, state_doc

BIN = Path(sys.executable).parent
REAL_PYTHON = os.path.realpath(sys.executable)
NHC_DIR = ROOT / "bench" / "nhc"

SH_SCONTROL = """#!/bin/sh
case "$1" in
  --version) echo "slurm 22.05.8" ;;
  show) cat {nodeline} ;;
  update|reboot) exit 0 ;;
  *) exit 2 ;;
esac
"""
SLURM_CHECK = "* || check_cmd_output -t 5 -m /State=/ scontrol show node -o $HOSTNAME\n"


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


def timed(argv: list[str], env: dict[str, str], expect: int = 0) -> tuple[float, float, int]:
    """(wall s, CPU s, ru_maxrss bytes) of one run; the run must exit `expect`. The child's ru_maxrss
    counts the benchmark's own pages it was forked with, so peak RSS is measured apart (peak_rss_kb)."""
    start = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read() if p.stderr is not None else b""
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - start
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.stderr is not None:
        p.stderr.close()
    if p.returncode != expect:
        raise SystemExit(f"{argv[0]} exited {p.returncode}, expected {expect}: {err.decode(errors='replace')}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def make_node(tmp: Path, tag: str, node_state: str, compiled: bool = True, **hooks: object) -> tuple[Node, dict[str, str]]:
    """A node directory with sh stand-ins for scontrol; its compiled configuration (when `compiled`)
    next to its state file, written as the agent writes it. Returns the node and the environment
    variable naming that file (a real node uses the default path, /run/healthd/hooks-config.json)."""
    node = Node(tmp / tag, gpus=8)
    line = node.root / "node.line"
    line.write_text(f"NodeName={node.name} Arch=x86_64 Gres=gpu:8 State={node_state} Partitions=debug\n")
    (node.fakebin / "scontrol").write_text(SH_SCONTROL.format(nodeline=line))
    node.write_config(**hooks)
    compiled_env = {hookconfig.PATH_ENV: str(node.run_dir / "hooks-config.json")}
    node.run_dir.mkdir(parents=True, exist_ok=True)
    node.run_dir.chmod(0o755)
    if compiled:
        path, why = hookconfig.write(str(node.config), compiled_env)
        if not path:
            raise SystemExit(f"cannot compile {node.config}: {why}")
    return node, compiled_env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    n = ap.parse_args().runs
    tmp = Path(tempfile.mkdtemp(prefix="healthd-bench-hooks-"))
    tmp.chmod(0o755)
    p_node, p_env = make_node(tmp, "prolog", "MIXED")
    y_node, y_env = make_node(tmp, "yaml", "MIXED", compiled=False)
    b_node, b_env = make_node(tmp, "busy", "MIXED")
    i_node, i_env = make_node(tmp, "idle", "IDLE")
    r_node, r_env = make_node(tmp, "refusing", "MIXED", gating="local")

    def hook(name: str, node: Node) -> list[str]:
        return [str(BIN / name), "--config", str(node.config)]

    t1 = [finding("xid:gpu1:79", 1, xid=79, summary="xid 79 gpu1: fell off the bus")]
    for node in (p_node, y_node, b_node, i_node):
        node.write_state(realistic_state(node.name))
    r_node.write_state(realistic_state(r_node.name, t1))
    # the busy node: one job bound, Slurm asked by the first run
    timed(hook("healthd-prolog", b_node), {**b_node.prolog_env(job="5000", gpus="0"), **b_env})
    timed(hook("healthd-healthcheck", b_node), {"SLURMD_NODENAME": b_node.name, **b_env})

    nhc_log = str(tmp / "nhc.log")
    nhc_conf = NHC_DIR / "nhc.conf"
    nhc_slurm_conf = tmp / "nhc-slurm.conf"
    nhc_slurm_conf.write_text(nhc_conf.read_text() + SLURM_CHECK)
    nhc = [str(NHC_DIR / "nhc-standin"), "-c", str(nhc_conf), "-D", str(NHC_DIR / "scripts"), "-l", nhc_log]
    nhc_slurm = [*nhc[:2], str(nhc_slurm_conf), *nhc[3:]]
    nhc_slurm_env = {"SLURMD_NODENAME": i_node.name, "NHC_PATH": f"{i_node.fakebin}:/usr/bin:/bin"}

    names = ("floor_I_S", "floor_venv", "nhc", "nhc_slurm", "prolog", "prolog_yaml", "prolog_refusing", "epilog",
             "healthcheck_busy", "healthcheck_idle")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}

    def record(name: str, argv: list[str], env: dict[str, str], expect: int = 0) -> None:
        w, c, _ = timed(argv, env, expect)
        wall[name].append(w)
        cpu[name].append(c)

    started = time.monotonic()
    for i in range(n):
        fresh = realistic_state(p_node.name)  # every node is node01; keep the states fresh (stale_after_s)
        for node in (p_node, y_node, b_node, i_node):
            node.write_state(fresh)
        r_node.write_state(realistic_state(r_node.name, t1))
        job = str(1000 + i)
        record("floor_I_S", [REAL_PYTHON, "-I", "-S", "-c", "pass"], {})
        record("nhc", nhc, {"SLURMD_NODENAME": p_node.name})
        record("prolog", hook("healthd-prolog", p_node), {**p_node.prolog_env(job=job, gpus="0,1,2,3"), **p_env})
        record("healthcheck_idle", hook("healthd-healthcheck", i_node), {"SLURMD_NODENAME": i_node.name, **i_env})
        record("floor_venv", [sys.executable, "-c", "pass"], {})
        record("nhc_slurm", nhc_slurm, nhc_slurm_env)
        record("epilog", hook("healthd-epilog", p_node), {**p_node.epilog_env(job=job, gpus="0,1,2,3"), **p_env})
        record("healthcheck_busy", hook("healthd-healthcheck", b_node), {"SLURMD_NODENAME": b_node.name, **b_env})
        record("prolog_yaml", hook("healthd-prolog", y_node), {**y_node.prolog_env(job=job, gpus="0,1,2,3"), **y_env})
        record("prolog_refusing", hook("healthd-prolog", r_node),
               {**r_node.prolog_env(job=str(6000 + i), gpus="0,1"), **r_env}, expect=1)
    elapsed = time.monotonic() - started
    if (b_node.run_dir / "hooks-config.json").stat().st_mtime_ns < b_node.config.stat().st_mtime_ns:
        raise SystemExit("the compiled configuration went stale during the run")

    rss_kb: dict[str, int] = {}
    if shutil.which("time", path="/usr/bin"):
        # GNU time forks from a small process: its %M is the hook's own peak RSS
        argvs = {"floor_I_S": ([REAL_PYTHON, "-I", "-S", "-c", "pass"], {}, 0),
                 "floor_venv": ([sys.executable, "-c", "pass"], {}, 0),
                 "nhc": (nhc, {"SLURMD_NODENAME": p_node.name}, 0), "nhc_slurm": (nhc_slurm, nhc_slurm_env, 0),
                 "prolog": (hook("healthd-prolog", p_node), {**p_node.prolog_env(job="7000", gpus="0"), **p_env}, 0),
                 "prolog_yaml": (hook("healthd-prolog", y_node), {**y_node.prolog_env(job="7000", gpus="0"), **y_env}, 0),
                 "prolog_refusing": (hook("healthd-prolog", r_node), {**r_node.prolog_env(job="7001", gpus="0,1"), **r_env}, 1),
                 "epilog": (hook("healthd-epilog", p_node), {**p_node.epilog_env(job="7000", gpus="0"), **p_env}, 0),
                 "healthcheck_busy": (hook("healthd-healthcheck", b_node), {"SLURMD_NODENAME": b_node.name, **b_env}, 0),
                 "healthcheck_idle": (hook("healthd-healthcheck", i_node), {"SLURMD_NODENAME": i_node.name, **i_env}, 0)}
        for k, (argv, env, code) in argvs.items():
            for node in (p_node, y_node, b_node, i_node):
                node.write_state(realistic_state(node.name))
            r_node.write_state(realistic_state(r_node.name, t1))
            p = subprocess.run(["/usr/bin/time", "-f", "RSS %M", *argv], env=env, capture_output=True, text=True)
            if p.returncode != code:
                raise SystemExit(f"{k} exited {p.returncode} under /usr/bin/time: {p.stderr}")
            rss_kb[k] = int(p.stderr.strip().splitlines()[-1].split()[-1])

    ms = {}
    for k in names:
        s = {q: (round(v * 1000, 2) if q != "n" else v) for q, v in summary(wall[k]).items()}
        s["cpu_median"] = round(summary(cpu[k])["median"] * 1000, 2)
        s["cpu_p99"] = round(pct(cpu[k], 99) * 1000, 2)
        if k in rss_kb:
            s["peak_rss_mb"] = round(rss_kb[k] / 1024, 1)
        ms[k] = s
    floor, nhc_s, nhc_slurm_s = ms["floor_I_S"], ms["nhc"], ms["nhc_slurm"]
    hooks = ("prolog", "prolog_yaml", "prolog_refusing", "epilog", "healthcheck_busy", "healthcheck_idle")
    ratios = {k: {"p50_over_floor": round(ms[k]["median"] / floor["median"], 2),
                  "p99_over_floor_p99": round(ms[k]["p99"] / floor["p99"], 2),
                  "p50_over_nhc": round(ms[k]["median"] / nhc_s["median"], 2),
                  "p99_over_nhc_p99": round(ms[k]["p99"] / nhc_s["p99"], 2)} for k in hooks}
    ratios["healthcheck_idle"]["p50_over_nhc_slurm"] = round(ms["healthcheck_idle"]["median"] / nhc_slurm_s["median"], 2)
    ratios["healthcheck_idle"]["p99_over_nhc_slurm_p99"] = round(ms["healthcheck_idle"]["p99"] / nhc_slurm_s["p99"], 2)

    print(f"{n} interleaved rounds in {elapsed:.0f} s; floor = {REAL_PYTHON} -I -S -c pass")
    print(f"{'scenario':18} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'CPU p50':>8} {'RSS MB':>7} "
          f"{'p50/floor':>9} {'p99/floor':>9} {'p99/nhc':>8}")
    for k in names:
        s, r = ms[k], ratios.get(k, {})
        print(f"{k:18} {s['median']:7.1f} {s['p99']:7.1f} {s['max']:7.1f} {s['cpu_median']:8.1f} {s.get('peak_rss_mb', 0):7.1f} "
              f"{r.get('p50_over_floor', s['median'] / floor['median']):9.2f} "
              f"{r.get('p99_over_floor_p99', s['p99'] / floor['p99']):9.2f} {r.get('p99_over_nhc_p99', s['p99'] / nhc_s['p99']):8.2f}")
    idle = ratios["healthcheck_idle"]
    print(f"healthcheck_idle / nhc_slurm: p50 {idle['p50_over_nhc_slurm']:.2f}, p99 {idle['p99_over_nhc_slurm_p99']:.2f}")
    met = {k: ratios[k]["p99_over_floor_p99"] <= 3.0 for k in hooks if k != "prolog_yaml"}
    save("hooks", {
        "runs": n,
        "interleaved": True,
        "floor_binary": REAL_PYTHON,
        "nhc": "bench/nhc/nhc-standin (a stand-in for LBNL NHC's driver, 13 checks; nhc_slurm: plus scontrol show node)",
        "targets": "every hook p99 <= 3 x floor_I_S p99 and <= 0.4 x NHC p99; healthcheck_idle <= nhc_slurm",
        "milliseconds": ms,
        "ratios": ratios,
        "p99_within_3x_floor": met,
    })
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
