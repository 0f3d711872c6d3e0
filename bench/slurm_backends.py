"""The two Slurm backends side by side against a real slurmctld holding 10,000 nodes.

The cluster is controller_round.py's: munged + slurmctld + 4 real slurmd (node01..node04) and 9,996
more nodes in slurm.conf that never run a slurmd. In one process, interleaved (one of each in turn,
so the machine's moods land on both), with the same slurmctld:
- reading the fleet: ScontrolBackend.nodes() (the reader its version picks: `scontrol show nodes
  --json` from 23.02, `sinfo --json` before), the fleet view's `scontrol show node -o` read with every
  line parsed, and PyslurmBackend.nodes() (pyslurm.Nodes.load() and a NodeInfo per node);
- one write and its read-back: a drain of node02 with a reason and `node("node02")` showing it, then
  the resume and its read-back;
- slurmctld stopped: one node read, with timeout_s 3 s, until it fails (SlurmUnavailable);
- CPU on the head node for each: this process (pyslurm's RPCs run in it), the Slurm clients it
  started (reaped children) and slurmctld (from /proc), in CPU milliseconds per call; and the
  longest another thread of the process (a 1 ms ticker: the controller's report intake) waited for
  the interpreter during the call.
Median and p99 of each, and pyslurm's figures over scontrol's (the ratios).

pyslurm is measured where the interpreter has a pyslurm built for this Slurm (the Debian trixie root
with Slurm 24.11 and pyslurm 24.11.0: tests/support/pyslurm_build.py); elsewhere only scontrol is,
and the results say why.

    .venv/bin/python bench/slurm_backends.py [--quick]                  # the Slurm here
    .venv/bin/python bench/slurm_backends.py --in-root trixie [--quick] # Slurm 24.11, with pyslurm
                                                                        # (make pyslurm-root first)

Writes bench/results/slurm_backends-<major.minor>.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from common import RESULTS, machine, summary

from controller_path import node_names
from controller_round import Ticker
from healthd.slurm.backend import SlurmUnavailable
from healthd.slurm.nodeparse import parse_version
from healthd.slurm.scontrol import ScontrolBackend
from tests.support.slurm_cluster import SlurmCluster, slurm_version

FLEET = 10_000
REAL_NODES = 4
NODE = "node02"
REASON = "healthd: xid 79 gpu3 fell off the bus [#bench]"
CLK_TCK = os.sysconf("SC_CLK_TCK")
DOWN_TIMEOUT_S = 3.0

logging.getLogger("healthd").addHandler(logging.NullHandler())
logging.getLogger("healthd").propagate = False


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14 and 15); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Meter:
    """Wall time and head-node CPU of calls of one kind."""

    def __init__(self, ctld_pid: int):
        self.ctld_pid = ctld_pid
        self.wall: list[float] = []
        self.own: list[float] = []
        self.clients: list[float] = []
        self.ctld: list[float] = []
        self.stall: list[float] = []

    def __call__(self, fn: Callable[[], object]) -> object:
        c0, k0, d0 = time.process_time(), children_cpu_s(), proc_cpu_s(self.ctld_pid)
        with Ticker() as ticker:
            t0 = time.perf_counter()
            value = fn()
            self.wall.append(time.perf_counter() - t0)
        self.stall.append(ticker.longest)
        # slurmctld's accounting of the work it did for this call lands within a tick or two
        self.own.append(time.process_time() - c0)
        self.clients.append(children_cpu_s() - k0)
        self.ctld.append(proc_cpu_s(self.ctld_pid) - d0)
        return value

    def figures(self) -> dict:
        def ms(values: list[float]) -> dict:
            s = summary(values)
            return {"median": round(s["median"] * 1e3, 1), "p99": round(s["p99"] * 1e3, 1), "n": s["n"]}

        head = [a + b + c for a, b, c in zip(self.own, self.clients, self.ctld, strict=True)]
        return {"wall_ms": ms(self.wall), "cpu_ms_this_process": ms(self.own), "cpu_ms_slurm_clients": ms(self.clients),
                "cpu_ms_slurmctld": ms(self.ctld), "cpu_ms_head_node": ms(head),
                "longest_interpreter_wait_ms": ms(self.stall)}


def pyslurm_here() -> tuple[object | None, str]:
    """(the pyslurm module, '') when one built for this Slurm is installed, else (None, why not)."""
    here = slurm_version()
    try:
        version = importlib.metadata.version("pyslurm")
    except importlib.metadata.PackageNotFoundError:
        return None, f"no pyslurm installed for Slurm {here[0]}.{here[1]:02d}"
    if parse_version(version) != here:
        return None, f"pyslurm {version} is not built for Slurm {here[0]}.{here[1]:02d}"
    return True, version


def expect_unavailable(backend) -> None:
    try:
        backend.node(NODE)
    except SlurmUnavailable:
        return
    raise AssertionError("a node read with slurmctld stopped did not raise SlurmUnavailable")


def ratio(a: dict, b: dict, key: str) -> float | None:
    if key not in a or key not in b:
        return None
    x, y = a[key]["median"], b[key]["median"]
    return round(x / y, 3) if y else None


def run(args, tmp: Path) -> dict:
    ghosts = node_names(FLEET - REAL_NODES)
    cluster = SlurmCluster(tmp / "slurm", nodes=REAL_NODES, gpus_per_node=4, extra_conf=(
        f"NodeName={ghosts[0][:3]}[{ghosts[0][3:]}-{ghosts[-1][3:]}] NodeHostname=localhost "
        "NodeAddr=127.0.0.1 Port=1 CPUs=4 RealMemory=1000 Gres=gpu:4 State=UNKNOWN\n"))
    t0 = time.monotonic()
    cluster.up(timeout_s=300)
    print(f"slurmctld with {FLEET} nodes ({REAL_NODES} real slurmd) up in {time.monotonic() - t0:.1f} s", flush=True)
    conf = str(cluster.conf_path)
    os.environ["SLURM_CONF"] = conf
    out: dict = {"nodes_in_slurmctld": FLEET, "real_slurmd": REAL_NODES, "reads": args.reads,
                 "writes": args.writes}
    try:
        ctld_pid = cluster.pids()["slurmctld"]
        scontrol = ScontrolBackend(conf, timeout_s=60)
        out["slurm"] = scontrol.version()
        out["scontrol_read_mode"] = scontrol._mode()
        backends: dict[str, object] = {"scontrol": scontrol}
        have, why = pyslurm_here()
        if have:
            from healthd.slurm import _import_pyslurm
            from healthd.slurm.pyslurm_backend import PyslurmBackend

            backends["pyslurm"] = PyslurmBackend(_import_pyslurm(conf), fallback=scontrol, timeout_s=60)
            out["pyslurm"] = why
        else:
            out["pyslurm"] = None
            out["pyslurm_not_measured"] = why
        for name, b in backends.items():
            assert len(b.nodes()) == FLEET, name  # warm: the first read pays for imports and caches

        reads = {name: Meter(ctld_pid) for name in backends}
        reads["scontrol_lines_parse_all"] = Meter(ctld_pid)
        for k in range(args.reads):
            for name, b in backends.items():
                assert len(reads[name](b.nodes)) == FLEET
            assert len(reads["scontrol_lines_parse_all"](
                lambda: [scontrol.parse_node_line(x) for x in scontrol.node_lines()])) == FLEET
            print(f"read {k + 1}/{args.reads}", flush=True)
        out["fleet_read"] = {name: m.figures() for name, m in reads.items()}

        drains = {name: Meter(ctld_pid) for name in backends}
        resumes = {name: Meter(ctld_pid) for name in backends}

        def drain_and_read(b) -> None:
            b.drain(NODE, REASON)
            got = b.node(NODE)
            assert got.reason == REASON and got.drain_requested, got

        def resume_and_read(b) -> None:
            b.resume(NODE)
            assert not b.node(NODE).drain_requested

        for _ in range(args.writes):
            for name, b in backends.items():
                drains[name](lambda b=b: drain_and_read(b))
                resumes[name](lambda b=b: resume_and_read(b))
        out["drain_and_read_back"] = {name: m.figures() for name, m in drains.items()}
        out["resume_and_read_back"] = {name: m.figures() for name, m in resumes.items()}
        # slurmctld stopped: how long one node read takes to fail, and how long the process's other
        # threads wait meanwhile (last: slurmctld then restarts with 10,000 nodes in its state)
        cluster.stop_ctld()
        down = {name: Meter(ctld_pid) for name in backends}
        for b in backends.values():
            b.timeout_s = DOWN_TIMEOUT_S
        for _ in range(args.down_calls):
            for name, b in backends.items():
                down[name](lambda b=b: expect_unavailable(b))
        out["slurmctld_down_one_read"] = {name: {k: v for k, v in m.figures().items()
                                                 if k in ("wall_ms", "longest_interpreter_wait_ms")}
                                          for name, m in down.items()}
        out["slurmctld_down_timeout_s"] = DOWN_TIMEOUT_S
        if "pyslurm" in backends:
            out["pyslurm_over_scontrol"] = {
                f"{part}_{key}": ratio(out[part]["pyslurm"], out[part]["scontrol"], key)
                for part in ("fleet_read", "drain_and_read_back", "resume_and_read_back", "slurmctld_down_one_read")
                for key in ("wall_ms", "cpu_ms_head_node", "cpu_ms_slurmctld", "longest_interpreter_wait_ms")
            }
    finally:
        cluster.down()
    return out


def in_root(release: str, quick: bool) -> int:
    """This benchmark run again inside the version matrix's root of `release` (its Slurm, and pyslurm
    where `make pyslurm-root` put it there), writing its results file here."""
    import subprocess  # noqa: PLC0415 - only this mode starts a container

    from tests.support import slurm_roots  # noqa: PLC0415

    if release not in slurm_roots.matrix_releases():
        print(f"{release} is this host's release: the run above is its figures")
        return 0
    root = slurm_roots.build_root(release)
    argv = [f"{slurm_roots.VENV}/bin/python", str(Path(__file__).resolve()), *(["--quick"] if quick else [])]
    RESULTS.mkdir(parents=True, exist_ok=True)
    return subprocess.run(slurm_roots.nspawn_argv(root, argv, rw_binds=[(str(RESULTS), str(RESULTS))])).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reads and writes")
    ap.add_argument("--in-root", metavar="RELEASE", help="run inside the version matrix's root of RELEASE "
                                                         "(tests/support/slurm_roots.py), e.g. trixie for Slurm 24.11")
    args = ap.parse_args()
    if args.in_root:
        sys.exit(in_root(args.in_root, args.quick))
    args.reads = 5 if args.quick else 21
    args.writes = 5 if args.quick else 21
    args.down_calls = 2 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="healthd-backends-", dir="/tmp") as d:
        tmp = Path(d)
        tmp.chmod(0o755)  # slurmctld runs as SlurmUser and must reach its state under here
        results = run(args, tmp)
    doc = {"machine": machine(), **results}
    text = json.dumps(doc, indent=2) + "\n"
    print(text)
    major, minor = parse_version(results["slurm"])
    path = RESULTS / f"slurm_backends-{major}.{minor:02d}.json"
    try:
        path.write_text(text)
        print(f"saved {path}")
    except OSError as exc:
        print(f"not saved ({exc}): the JSON above is the result", file=sys.stderr)


if __name__ == "__main__":
    main()
