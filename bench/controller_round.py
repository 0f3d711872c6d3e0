"""The controller's control round at fleet scale, with the Slurm part production has.

1. A real slurmctld holding 10,000 nodes: munged + slurmctld + 4 real slurmd (node01..node04) and
   9,996 more nodes declared in slurm.conf that never run a slurmd (they show as down, not
   responding: what a large fleet's idle view costs slurmctld and its clients). The real Controller
   with the real ScontrolBackend, one report per node (about 1 % failing with T1/T2 findings, 0.5 %
   with T3, leaf switches of 32 nodes in topology.conf, a capacity floor), auto mode, its fleet
   view refreshed by its own thread every 5 s as the daemon runs it.
   - baseline, same run: the whole-fleet read the round used to make before acting (`sinfo
     --json` + parse) and a whole `scontrol show node -o` read + parse of every line;
   - the fleet view's refresh: a first read (every line parsed) and steady reads (only changed lines);
   - steady rounds at the daemon's pace (`--round-gap`, its 5 s interval; the refresh thread
     running meanwhile): with the thread's reads kept out of the rounds (the daemon's way) and, in
     alternating blocks of the same run, reading every period whatever the rounds do (before);
     then 100 rounds 0.1 s apart, a pace that leaves a read no gap: median, p99;
   - rounds that drain a node (a new T1 finding on a real node): the round's time with its Slurm
     work (the node re-read before the write, the write), and the drain seen in `scontrol show node`;
   - report intake during a read: the longest a 1 ms ticker thread waits for the interpreter while
     the old whole read + parse runs, and while the fleet view refreshes.
2. Synthetic Slurm at 1,000, 10,000 and 100,000 nodes (a fresh process each): the same controller
   over an in-memory Slurm that lists lines as `scontrol show node -o` does, its refresh thread
   running every second (five times the default), steady rounds (median, p99), SQLite statements
   per steady round, RSS and peak RSS.

    .venv/bin/python bench/controller_round.py [--quick] [--skip real,synthetic]

Writes bench/results/controller_round.json. Targets: a round at 10,000 nodes p99 <= 50 ms with its
Slurm work; at 100,000 nodes p99 <= 500 ms and <= 500 MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, keep_skipped, rss_bytes, save, summary

from controller_path import PARTITIONS, _finding, fleet_reports, node_names, state_document, topology_conf
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import ROUND_INTERVAL_S, Controller
from healthd.controller.executor import Executor
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings, FleetView, NodeReport
from healthd.model import iso
from healthd.slurm.scontrol import ScontrolBackend
from tests.support.fake_slurm import FakeLinesBackend
from tests.support.slurm_cluster import SlurmCluster

TARGET_P99_10K_MS = 50.0
TARGET_P99_100K_MS = 500.0
TARGET_RSS_100K_MIB = 500.0
REAL_NODES = 4
FLEET = 10_000
BLOCK = 10
"""Steady rounds in a row of one kind before the other kind's turn."""

logging.getLogger("healthd").addHandler(logging.NullHandler())
logging.getLogger("healthd").propagate = False


def _ms(values: list[float]) -> dict:
    s = summary(values)
    return {"median": round(s["median"] * 1e3, 2), "p99": round(s["p99"] * 1e3, 2), "max": round(s["max"] * 1e3, 2),
            "n": s["n"]}


class Ticker:
    """A thread that wakes every millisecond and keeps the longest gap between two wakes: how long
    a report thread would have waited for the interpreter meanwhile."""

    def __init__(self):
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def stall_during(fn, runs: int = 5) -> dict:
    """Wall time of fn() and the ticker's longest wait during it, over `runs` runs (medians, max)."""
    walls, stalls = [], []
    for _ in range(runs):
        with Ticker() as t:
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
        stalls.append(t.longest)
    return {"wall_ms": _ms(walls), "longest_wait_ms": _ms(stalls)}


def controller_for(tmp: Path, names: list[str], backend, partitions: tuple[str, ...],
                   floors: bool = True) -> tuple[Controller, Ledger]:
    tmp.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(tmp / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp / "ledger.sqlite"),
                                  policy=ControllerPolicySettings(
                                      mode="auto", max_actions_per_hour=10_000,
                                      max_actions_per_partition_per_hour=10_000,
                                      capacity_floors={p: len(names) // (8 * len(partitions)) for p in partitions}
                                      if floors else {}))
    executor = Executor(backend, ledger, list_jobs=lambda node: [], out=lambda line: None)
    ctl = Controller(settings, ledger, backend, executor=executor, topology_text=topology_conf(names),
                     node_addrs=lambda: {})
    return ctl, ledger


def churn(ctl: Controller, names: list[str], start: int, count: int, now: float) -> int:
    """Fresh reports from `count` healthy nodes from `start` on, parsed as receive_report parses them
    (the heartbeats arriving between two rounds: 10,000 nodes at 30 s send 333 a second); returns
    where the next batch starts."""
    fresh = {}
    for k in range(count):
        i = (start + k) % len(names)
        old = ctl.reports.get(names[i])
        if old is not None and not old.findings:
            fresh[names[i]] = NodeReport.from_document(state_document(names[i], i, now, []), now)
    with ctl.reports_lock:
        ctl.reports.update(fresh)
    return (start + count) % len(names)


def t1_report(node: str, i: int, gpu: int, now: float) -> NodeReport:
    """The node's report with one new T1 hardware finding (an Xid 48 on `gpu`), as receive_report stores it."""
    finding = dict(_finding("xid48", i, now), id=f"xid:gpu{gpu}:48", first_seen=iso(now), last_seen=iso(now))
    return NodeReport.from_document(state_document(node, i, now, [finding]), now)


# --------------------------------------------------------------------------- 1. a real slurmctld


@dataclasses.dataclass
class Steady:
    """Steady rounds of one kind, gathered over the blocks they ran in."""

    gap_s: float
    rounds: list[float] = dataclasses.field(default_factory=list)
    node_reads: list[int] = dataclasses.field(default_factory=list)
    overlapped: list[bool] = dataclasses.field(default_factory=list)
    refreshes: int = 0
    longest_wait_s: float = 0.0

    def figures(self, node_reads: list[str]) -> dict:
        steady, overlapped = self.rounds, self.overlapped
        out = {"rounds": len(steady), "gap_s": self.gap_s, "steady_round_ms": _ms(steady)}
        out["steady_rounds_single_node_reads"] = {"total": sum(self.node_reads), "rounds_with_any": sum(
            1 for n in self.node_reads if n), "nodes": sorted(set(node_reads))[:20]}
        # the fleet view's refresh shares the two cores with scontrol and slurmctld packing 10,000 nodes
        out["steady_round_ms_while_the_fleet_view_refreshed"] = _ms(
            [t for t, o in zip(steady, overlapped, strict=True) if o] or [0.0])
        out["steady_rounds_overlapping_a_refresh"] = sum(overlapped)
        out["steady_round_ms_otherwise"] = _ms([t for t, o in zip(steady, overlapped, strict=True) if not o] or [0.0])
        out["steady_rounds_fleet_refreshes_meanwhile"] = self.refreshes
        out["steady_rounds_longest_wait_ms"] = round(self.longest_wait_s * 1e3, 2)
        return out


def steady_rounds(ctl: Controller, names: list[str], node_reads: list[str], rounds: int, into: Steady, at: int,
                  *, keep_clear: bool) -> int:
    """`rounds` steady rounds `into.gap_s` apart as the daemon's loop runs them (the agents' reports
    arriving between them), the fleet view's thread reading meanwhile; `keep_clear`: the loop says
    when its next round is due and the thread keeps its reads out of the rounds (what the daemon
    does), else the thread reads every period whatever the rounds do (before). Returns the churn
    position."""
    gap_s = into.gap_s
    own = ctl.fleet.round_started
    if not keep_clear:
        ctl.fleet.round_started = lambda: None  # type: ignore[method-assign]
    refreshes_before = ctl.fleet.refreshes
    try:
        with Ticker() as ticker:
            for _ in range(rounds):
                at = churn(ctl, names, at, round(FLEET / 30 * gap_s), time.time())
                t = time.perf_counter()
                before = len(node_reads)
                refreshing = ctl.fleet.busy_since is not None
                count = ctl.fleet.refreshes
                assert ctl.evaluate(time.time()) is not None
                into.rounds.append(time.perf_counter() - t)
                into.node_reads.append(len(node_reads) - before)
                into.overlapped.append(refreshing or ctl.fleet.refreshes != count or ctl.fleet.busy_since is not None)
                ctl.between_rounds(time.monotonic(), gap_s if keep_clear else None)  # as the daemon's loop does
                time.sleep(gap_s)
    finally:
        ctl.fleet.round_started = own  # type: ignore[method-assign]
    into.refreshes += ctl.fleet.refreshes - refreshes_before
    into.longest_wait_s = max(into.longest_wait_s, ticker.longest)
    return at


def bench_real(args, tmp: Path) -> dict:
    ghosts = FLEET - REAL_NODES
    ghost_names = node_names(ghosts)
    cluster = SlurmCluster(tmp / "slurm", nodes=REAL_NODES, gpus_per_node=4, extra_conf=(
        f"NodeName={ghost_names[0][:3]}[{ghost_names[0][3:]}-{ghost_names[-1][3:]}] NodeHostname=localhost "
        "NodeAddr=127.0.0.1 Port=1 CPUs=4 RealMemory=1000 Gres=gpu:4 State=UNKNOWN\n"))
    t0 = time.monotonic()
    cluster.up(timeout_s=180)
    print(f"slurm: slurmctld with {FLEET} nodes ({REAL_NODES} real slurmd) up in {time.monotonic() - t0:.1f} s",
          flush=True)
    out: dict = {"nodes_in_slurmctld": FLEET, "real_slurmd": REAL_NODES}
    try:
        backend = ScontrolBackend(str(cluster.conf_path), timeout_s=30)
        names = list(cluster.nodes) + ghost_names
        assert len(backend.node_lines()) == FLEET
        now = time.time()
        reports = fleet_reports(names, now)
        # the real nodes start healthy: the drains timed below are the only writes to them
        for n in cluster.nodes:
            reports[n] = dataclasses.replace(reports[n], findings=())

        # baselines, same run: the whole read the round made before acting, and a whole line read
        json_backend = ScontrolBackend(str(cluster.conf_path), timeout_s=30, read_mode="sinfo-json")
        out["baseline_sinfo_json_read_and_parse"] = stall_during(
            lambda: FleetView.build(reports.values(), json_backend.nodes()), args.reads)
        out["baseline_scontrol_lines_read_and_parse_all"] = stall_during(
            lambda: [backend.parse_node_line(x) for x in backend.node_lines()], args.reads)
        out["scontrol_lines_read_only"] = stall_during(backend.node_lines, args.reads)
        t = time.perf_counter()
        backend.node("node02")
        out["one_node_read_ms"] = round((time.perf_counter() - t) * 1e3, 1)

        # no capacity floor: the 9,996 nodes without a slurmd are down, so any floor would refuse every drain
        ctl, ledger = controller_for(tmp / "ctl", names, backend, ("debug",), floors=False)
        ctl.reports.update(reports)
        first_refresh = stall_during(ctl.fleet.refresh, 1)
        first_refresh["parsed"] = ctl.fleet.last.parsed if ctl.fleet.last else None
        out["fleet_view_first_refresh"] = first_refresh
        steady_refresh = stall_during(ctl.fleet.refresh, args.reads)
        steady_refresh["parsed_last"] = ctl.fleet.last.parsed if ctl.fleet.last else None
        out["fleet_view_steady_refresh"] = steady_refresh

        ctl.start_fleet_refresh(5.0)  # the daemon's default
        t = time.perf_counter()
        first = ctl.evaluate(time.time())
        out["first_round_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        out["first_round_outcomes"] = sorted({o.status for o, _ in first or []})
        fresh_at = time.time()  # the agents' heartbeats: every report stays inside report_ttl_s
        with ctl.reports_lock:
            ctl.reports.update({n: dataclasses.replace(r, received_at=fresh_at) for n, r in ctl.reports.items()})
        node_reads: list[str] = []
        counted = ctl.executor.read_node

        def read_node(name: str):
            node_reads.append(name)
            return counted(name)

        ctl.executor.read_node = read_node  # type: ignore[method-assign]
        at = 0
        # before (the view's thread reading every 5 s whatever the rounds do) and now, in alternating
        # blocks of the same run so that the machine's moods land on both
        before, now_ = Steady(args.round_gap_s), Steady(args.round_gap_s)
        for _ in range(args.rounds // BLOCK):
            at = steady_rounds(ctl, names, node_reads, BLOCK, before, at, keep_clear=False)
            at = steady_rounds(ctl, names, node_reads, BLOCK, now_, at, keep_clear=True)
        out["steady_before_reads_ignored_rounds"] = before.figures(node_reads)
        out.update(now_.figures(node_reads))
        back_to_back = Steady(0.1)
        at = steady_rounds(ctl, names, node_reads, 100, back_to_back, at, keep_clear=True)
        out["steady_rounds_0_1_s_apart"] = back_to_back.figures(node_reads)

        # rounds that drain: a new T1 finding on a real node, the round applies the drain
        acting: list[float] = []
        visible: list[float] = []
        for k in range(args.drains):
            node = cluster.nodes[1 + k % (REAL_NODES - 1)]
            with ctl.reports_lock:
                ctl.reports[node] = t1_report(node, names.index(node), k % 8, time.time())
            t = time.perf_counter()
            results = ctl.evaluate(time.time())
            acting.append(time.perf_counter() - t)
            ctl.between_rounds(time.monotonic())
            applied = [r for o, r in results or [] if r is not None and r.status == "applied" and o.decision.node == node]
            assert applied, f"round {k}: no drain of {node}: {[(o.decision.node, o.status, r) for o, r in results or []]}"
            t = time.perf_counter()
            while "DRAIN" not in cluster.run(["scontrol", "show", "node", "-o", node]).stdout:
                if time.perf_counter() - t > 10:
                    raise SystemExit(f"{node}: drain not visible in scontrol")
            visible.append(time.perf_counter() - t)
            with ctl.reports_lock:  # the agent's next report: the fault is gone; an operator resumes the node
                ctl.reports[node] = dataclasses.replace(reports[node], received_at=time.time())
            cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
            ctl.fleet.poke()
            time.sleep(0.5)
            ctl.evaluate(time.time())  # the reconciler hands the incident over
        out["drain_round_ms"] = _ms(acting)
        out["drain_visible_after_round_ms"] = _ms(visible)
        ctl.close()
        ledger.close()
    finally:
        cluster.down()
    return out


# --------------------------------------------------------------------------- 2. synthetic Slurm


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def synthetic_child(n: int, rounds: int, tmp: str) -> None:
    """One size in a fresh process: prints one JSON line."""
    gc.collect()
    base = rss_bytes()
    names = node_names(n)
    backend = FakeLinesBackend(names, partition=PARTITIONS)
    ctl, ledger = controller_for(Path(tmp) / f"synthetic-{n}", names, backend, PARTITIONS)
    now = time.time()
    ctl.reports.update(fleet_reports(names, now))
    gc.collect()
    loaded = rss_bytes()
    ctl.start_fleet_refresh(1.0)
    t = time.perf_counter()
    ctl.evaluate(now)
    first = time.perf_counter() - t
    statements = [0]
    ledger._conn.set_trace_callback(lambda _s: statements.__setitem__(0, statements[0] + 1))
    steady = []
    counts = []
    at = 0
    for k in range(1, rounds + 1):
        at = churn(ctl, names, at, n // 30, now + k * 0.2)  # a second's heartbeats at a 30 s interval
        statements[0] = 0
        t = time.perf_counter()
        ctl.evaluate(now + k * 0.2)  # every report stays fresh through every round
        steady.append(time.perf_counter() - t)
        counts.append(statements[0])
        ctl.between_rounds(time.monotonic())  # as the daemon's loop does
        time.sleep(0.05)
    ledger._conn.set_trace_callback(None)
    gc.collect()
    rss_steady, hwm_steady = rss_bytes(), _vm_hwm_mib()
    # a prolog's drain request (/v1/request) runs evaluate(only=node): the cost for one node
    only = []
    for k in range(10):
        t = time.perf_counter()
        ctl.evaluate(now + (rounds + 1) * 0.2, only=names[5 + k])
        only.append(time.perf_counter() - t)
    # every agent silent for longer than report_ttl_s (a network partition): each node gets a
    # `none: stale-report` decision, recorded in the ledger once
    stale_at = now + ctl.policy.report_ttl_s + 60
    t = time.perf_counter()
    stale = ctl.evaluate(stale_at)
    stale_first = time.perf_counter() - t
    t = time.perf_counter()
    ctl.evaluate(stale_at + 1)
    stale_next = time.perf_counter() - t
    refresh = ctl.fleet.last
    ctl.close()
    gc.collect()
    print(json.dumps({
        "nodes": n, "first_round_ms": round(first * 1e3, 1), "steady_round_ms": _ms(steady),
        "sql_statements_per_steady_round_median": sorted(counts)[len(counts) // 2],
        "evaluate_only_one_node_ms": _ms(only),
        "all_stale_first_round_ms": round(stale_first * 1e3, 1), "all_stale_decisions": len(stale or ()),
        "all_stale_next_round_ms": round(stale_next * 1e3, 1),
        "fleet_refresh_ms_last": round(refresh.seconds * 1e3, 2) if refresh else None,
        "fleet_refresh_parsed_last": refresh.parsed if refresh else None,
        "rss_after_imports_mib": round(base / 2**20, 1), "rss_loaded_mib": round(loaded / 2**20, 1),
        "rss_after_steady_rounds_mib": round(rss_steady / 2**20, 1), "vm_hwm_steady_mib": round(hwm_steady, 1),
        "rss_after_all_stale_mib": round(rss_bytes() / 2**20, 1), "vm_hwm_mib": round(_vm_hwm_mib(), 1)}))
    ledger.close()


def bench_synthetic(sizes: list[int], rounds: int, tmp: Path) -> list[dict]:
    out = []
    for n in sizes:
        proc = subprocess.run([sys.executable, __file__, "--synthetic-child", str(n), str(rounds), str(tmp)],
                              capture_output=True, text=True, check=False, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"synthetic child {n} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"synthetic {n:>7,} nodes: steady round median {row['steady_round_ms']['median']} ms, p99 "
              f"{row['steady_round_ms']['p99']} ms; first {row['first_round_ms']} ms; "
              f"{row['sql_statements_per_steady_round_median']} SQL statements; peak RSS {row['vm_hwm_steady_mib']} MiB "
              f"({row['vm_hwm_mib']} MiB after every report went stale)",
              flush=True)
        out.append(row)
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--synthetic-child":
        synthetic_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and reads (a few minutes)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: real,synthetic")
    ap.add_argument("--round-gap", type=float, default=ROUND_INTERVAL_S, dest="round_gap_s",
                    help="seconds between steady rounds against the real slurmctld (the daemon's interval)")
    args = ap.parse_args()
    args.rounds = 20 if args.quick else 60
    args.reads = 3 if args.quick else 5
    args.drains = 4 if args.quick else 10
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {"targets": {"round_p99_10k_ms": TARGET_P99_10K_MS, "round_p99_100k_ms": TARGET_P99_100K_MS,
                                 "rss_100k_mib": TARGET_RSS_100K_MIB}}
    with tempfile.TemporaryDirectory(prefix="healthd-round-", dir="/tmp") as d:
        tmp = Path(d)
        tmp.chmod(0o755)  # slurmctld runs as SlurmUser and must reach its state under here
        if "real" not in skip:
            real = bench_real(args, tmp)
            results["real_slurmctld_10k"] = real
            print(json.dumps(real, indent=1), flush=True)
        if "synthetic" not in skip:
            results["synthetic"] = bench_synthetic([1_000, 10_000, 100_000], 15 if args.quick else 40, tmp)
    parts = {"real": "real_slurmctld_10k", "synthetic": "synthetic"}
    save("controller_round", keep_skipped("controller_round", results, [parts[p] for p in parts if p in skip]))


if __name__ == "__main__":
    main()
