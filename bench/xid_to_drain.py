"""Xid 79 in a node's kernel journal -> the drain visible in `scontrol show node`, end to end.

One fleet (demo/harness.py: real Slurm, one munged per node, a real `healthd run` per node, the real
`healthd-controller` in auto mode) and N rounds on node02. Each round writes one Xid 79 line into
node02's journal and polls `scontrol show node -o node02` until it shows DRAIN with a `healthd:` reason;
that interval is the sample. The agent's own verdict time (its state file) and the ledger's decision
and action times split it into detection / decision / action. Between rounds node02 is resumed, its
agent restarted with a fresh state directory (so the next line is a new finding, not a repeat of the
old one), and the controller restarted on an empty ledger (so the next Xid opens a new incident
instead of matching the open one).

    .venv/bin/python bench/xid_to_drain.py [-n 10]

Prints median and p99 and saves bench/results/xid_to_drain.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shutil
import sys
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


def _reset(fleet: FleetHarness) -> None:
    """A clean slate for the next round: the controller restarted on an empty ledger, node02 resumed,
    node02's agent restarted with a fresh state directory reading only new journal lines (so the next
    Xid is a new finding and a new incident, not the open one)."""
    fleet.stop_controller(fresh_ledger=True)
    fleet.resume([NODE])
    wait_for(lambda: not _drained(fleet), 30, 0.1, f"{NODE} resumed")
    node = fleet.nodes[NODE]
    shutil.rmtree(node.root / "state", ignore_errors=True)
    node.state_file.unlink(missing_ok=True)
    node.config.write_text(node.config.read_text().replace('"start_at": "head"', '"start_at": "tail"'))
    fleet.start_controller()
    fleet.restart_agent(NODE)
    wait_for(lambda: (fleet.agent_state(NODE) or {}).get("verdict") == "healthy", 30, 0.1, "a healthy agent")
    time.sleep(1.0)  # its first (healthy) report reaches the controller


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10, help="rounds (default 10)")
    args = ap.parse_args(argv)
    samples: list[float] = []
    detection: list[float] = []
    decided: list[float] = []
    applied: list[float] = []
    with FleetHarness(policy=POLICY, round_s=ROUND_S, log=print) as fleet:
        for i in range(args.n):
            if i:
                _reset(fleet)
            t0 = fleet.inject_xid(NODE, 79, gpu=0)
            seen_agent = None
            deadline = time.monotonic() + 30
            while True:
                if seen_agent is None:
                    doc = fleet.agent_state(NODE) or {}
                    if any(f.get("id") == FINDING for f in doc.get("findings", [])):
                        seen_agent = _iso(doc.get("generated_at")) or time.time()
                if _drained(fleet):
                    t_drain = time.time()
                    break
                if time.monotonic() > deadline:
                    raise HarnessError(f"round {i + 1}: no drain within 30 s")
                time.sleep(0.02)
            inc = max((x for x in fleet.healthctl("incidents") if NODE in x["nodes"]), key=lambda x: x["id"])
            samples.append(t_drain - t0)
            if seen_agent is not None:
                detection.append(seen_agent - t0)
            if inc.get("decided_at"):
                decided.append(inc["decided_at"] - t0)
            if inc.get("action_applied_at"):
                applied.append(inc["action_applied_at"] - t0)
            print(f"round {i + 1:2d}: xid 79 -> drain visible {samples[-1]:.3f} s "
                  f"(agent {detection[-1] if detection else float('nan'):.3f} s, decided "
                  f"{decided[-1] if decided else float('nan'):.3f} s, applied {applied[-1] if applied else float('nan'):.3f} s)",
                  flush=True)
    s = summary(samples)
    print(f"xid 79 -> drain visible in scontrol: median {s['median']:.3f} s, p99 {s['p99']:.3f} s, "
          f"max {s['max']:.3f} s over {s['n']} rounds (controller round {ROUND_S} s)")
    save("xid_to_drain", {
        "what": "Xid 79 written to a node's kernel journal -> DRAIN with a healthd: reason in `scontrol show node`",
        "controller_round_s": ROUND_S,
        "rounds": args.n,
        "drain_visible_s": {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()},
        "agent_verdict_s": {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(detection).items()} if detection else None,
        "decided_s": {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(decided).items()} if decided else None,
        "action_applied_s": {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(applied).items()} if applied else None,
        "samples_s": [round(x, 4) for x in samples],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
