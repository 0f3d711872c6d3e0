"""Xid 79 in a node's kernel journal -> the drain visible in `scontrol show node`, end to end.

Two fleets, one after the other (demo/harness.py: real Slurm, one munged per node, a real `healthd run`
per node, the real `healthd-controller` in auto mode with its default 5 s round): slurmctld holding the
4 real nodes alone, then holding 10,000 (the 4 and 9,996 declared nodes that never run a slurmd, down
and not responding, as a large fleet's idle view costs slurmctld and every client); N rounds on node02
in each. Each round writes one Xid 79 line into
node02's journal and polls `scontrol show node -o node02` until it shows DRAIN with a `healthd:` reason;
that interval is the sample, and slurmctld's own log says when it set the drain (DrainWatch). The agent's own verdict time (its state file) and the ledger's decision
and action times split it into detection / decision / action. Between rounds node02 is resumed, its
agent restarted with a fresh state directory (so the next line is a new finding, not a repeat of the
old one), and the controller restarted on an empty ledger (so the next Xid opens a new incident
instead of matching the open one).

    .venv/bin/python bench/xid_to_drain.py [-n 10] [--idle-nodes 9996]

Prints median and p99 per fleet and their ratio, and saves bench/results/xid_to_drain.json.
Targets with 10,000 nodes in slurmctld: p50 <= 0.25 s, p99 <= 0.5 s.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import save, summary  # noqa: E402
from demo.harness import FleetHarness, HarnessError, wait_for  # noqa: E402

NODE = "node02"
FINDING = "xid:gpu0:79"
POLICY = {"mode": "auto", "max_actions_per_hour": 1000, "max_actions_per_partition_per_hour": 1000,
          "breaker_nodes": 10, "breaker_percent": 100.0}
ROUND_S = 5.0  # the production default: a new T1 finding wakes the controller at once (daemon.Controller.wake)


def _iso(value: str | None) -> float | None:
    try:
        return _dt.datetime.fromisoformat(value).timestamp() if value else None
    except ValueError:
        return None


def _drained(fleet: FleetHarness) -> bool:
    n = fleet.slurm_node(NODE)
    return "DRAIN" in n.get("State", "") and n.get("Reason", "").startswith("healthd:")


_UPDATE_RE = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})\] update_node: node (\S+) state set to DRAIN")


def drain_applied_at(fleet: FleetHarness, node: str, after: float) -> float | None:
    """When slurmctld set `node` to DRAIN(ED/ING) after `after`, from its own log (milliseconds,
    local time): the moment from which every `scontrol show node` shows the drain."""
    assert fleet.cluster is not None
    for line in fleet.cluster.logs("slurmctld").splitlines():
        m = _UPDATE_RE.match(line)
        if m and m.group(3) == node:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + int(m.group(2)) / 1000
            if at >= after - 0.001:
                return at
    return None


class DrainWatch:
    """POLLERS threads running `scontrol show node -o node02` back to back, as an operator would look.
    `at` is when the first call that shows the drain returned: an upper bound on when it became
    visible, late by up to a call (with 10,000 nodes in slurmctld one takes 50-100 ms: Slurm 22.05
    loads the whole node table to show one node). More pollers would tighten it but load slurmctld
    and the two cores the controller needs; slurmctld's log gives the moment itself."""

    POLLERS = 1

    def __init__(self, fleet: FleetHarness):
        self.fleet = fleet
        self.seen = threading.Event()
        self.at = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._poll, args=(k,), daemon=True) for k in range(self.POLLERS)]
        for t in self._threads:
            t.start()

    def _poll(self, k: int) -> None:
        time.sleep(k * 0.02)
        while not self._stop.is_set() and not self.seen.is_set():
            drained = _drained(self.fleet)
            returned = time.time()
            if drained:
                with self._lock:
                    if not self.seen.is_set() or returned < self.at:
                        self.at = returned
                    self.seen.set()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


def _reset(fleet: FleetHarness) -> None:
    """A clean slate for the next round: the controller restarted on an empty ledger, node02 resumed,
    node02's agent restarted with a fresh state directory reading only new journal lines (so the next
    Xid is a new finding and a new incident, not the open one)."""
    fleet.stop_controller(fresh_ledger=True)
    fleet.resume([NODE])
    wait_for(lambda: not _drained(fleet), 30, 0.1, f"{NODE} resumed")
    node = fleet.nodes[NODE]
    # the agent stopped (and reaped) before its state goes: a running agent would write it back
    fleet.stop_agent(NODE)
    shutil.rmtree(node.root / "state", ignore_errors=True)
    node.state_file.unlink(missing_ok=True)
    node.config.write_text(node.config.read_text().replace('"start_at": "head"', '"start_at": "tail"'))
    fleet.start_controller()
    fleet.start_agent(NODE)
    wait_for(lambda: (fleet.agent_state(NODE) or {}).get("verdict") == "healthy", 30, 0.1, "a healthy agent")
    time.sleep(1.0)  # its first (healthy) report reaches the controller


def measure(fleet: FleetHarness, rounds: int) -> dict:
    """`rounds` injections on one fleet: the samples and the ledger's split of each."""
    samples: list[float] = []
    detection: list[float] = []
    decided: list[float] = []
    applied: list[float] = []
    in_ctld: list[float] = []
    for i in range(rounds):
        if i:
            _reset(fleet)
        watch = DrainWatch(fleet)
        t0 = fleet.inject_xid(NODE, 79, gpu=0)
        seen_agent = None
        deadline = time.monotonic() + 30
        while True:
            if seen_agent is None:
                doc = fleet.agent_state(NODE) or {}
                if any(f.get("id") == FINDING for f in doc.get("findings", [])):
                    seen_agent = _iso(doc.get("generated_at")) or time.time()
            if watch.seen.wait(0.02):
                t_drain = watch.at
                break
            if time.monotonic() > deadline:
                watch.stop()
                raise HarnessError(f"round {i + 1}: no drain within 30 s")
        watch.stop()
        inc = max((x for x in fleet.healthctl("incidents") if NODE in x["nodes"]), key=lambda x: x["id"])
        applied_in_ctld = drain_applied_at(fleet, NODE, t0)
        if applied_in_ctld is not None:
            in_ctld.append(applied_in_ctld - t0)
        samples.append(t_drain - t0)
        if seen_agent is not None:
            detection.append(seen_agent - t0)
        if inc.get("decided_at"):
            decided.append(inc["decided_at"] - t0)
        if inc.get("action_applied_at"):
            applied.append(inc["action_applied_at"] - t0)
        print(f"round {i + 1:2d}: xid 79 -> drain in slurmctld {in_ctld[-1] if in_ctld else float('nan'):.3f} s, "
              f"seen by scontrol {samples[-1]:.3f} s "
              f"(agent {detection[-1] if detection else float('nan'):.3f} s, decided "
              f"{decided[-1] if decided else float('nan'):.3f} s, applied {applied[-1] if applied else float('nan'):.3f} s)",
              flush=True)

    def rounded(values: list[float]) -> dict | None:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(values).items()} if values else None

    return {"drain_in_slurmctld_s": rounded(in_ctld), "drain_seen_by_scontrol_s": rounded(samples),
            "agent_verdict_s": rounded(detection), "decided_s": rounded(decided),
            "action_applied_s": rounded(applied), "samples_s": [round(x, 4) for x in samples]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10, help="rounds per fleet (default 10)")
    ap.add_argument("--idle-nodes", type=int, default=9996,
                    help="nodes without a slurmd declared beside the 4 real ones (default 9996: 10,000 in slurmctld)")
    args = ap.parse_args(argv)
    fleets: dict[str, dict] = {}
    for label, idle in (("4 nodes in slurmctld", 0), (f"{4 + args.idle_nodes:,} nodes in slurmctld", args.idle_nodes)):
        if label in fleets:
            continue
        print(f"--- {label}", flush=True)
        with FleetHarness(policy=POLICY, round_s=ROUND_S, idle_nodes=idle, log=print) as fleet:
            fleets[label] = {"nodes_in_slurmctld": 4 + idle, **measure(fleet, args.n)}
        s, c = fleets[label]["drain_seen_by_scontrol_s"], fleets[label]["drain_in_slurmctld_s"] or {}
        print(f"{label}: xid 79 -> drain set in slurmctld: median {c.get('median', float('nan')):.3f} s, p99 "
              f"{c.get('p99', float('nan')):.3f} s; seen by a scontrol poll: median {s['median']:.3f} s, p99 "
              f"{s['p99']:.3f} s, max {s['max']:.3f} s over {s['n']} rounds (controller round {ROUND_S} s)", flush=True)
    base, large = fleets.values() if len(fleets) == 2 else (None, None)
    save("xid_to_drain", {
        "what": "Xid 79 written to a node's kernel journal -> DRAIN with a healthd: reason in `scontrol show node`",
        "controller_round_s": ROUND_S,
        "rounds": args.n,
        "fleets": fleets,
        "ratio_median_large_over_4": {
            k: round(large[k]["median"] / base[k]["median"], 2) for k in ("drain_in_slurmctld_s", "drain_seen_by_scontrol_s")
            if large.get(k) and base.get(k)} if base and large else None,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
