"""healthd-sim: run scenarios over seeds and print goodput with its spread, or compare two.

    healthd-sim run SCENARIO... [--seeds N] [--first-seed S] [--healthd MODE] [--format table|json|html] [-o FILE]
    healthd-sim compare A B [--seeds N] [--first-seed S] [--healthd MODE] [--format table|json|html] [-o FILE]
    healthd-sim list
    healthd-sim replay --history FILE [...]      (healthd.sim.replay: a recorded controller history)

A SCENARIO is a YAML file or the name of a packaged one (`healthd-sim list`). Exit 0; 2 for a bad
scenario or arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from healthd.sim import report
from healthd.sim.engine import RunResult, run
from healthd.sim.scenario import MODES, Scenario, ScenarioError, load, packaged


def _runs(s: Scenario, seeds: int, first: int) -> list[RunResult]:
    return [run(s, seed) for seed in range(first, first + seeds)]


def _out(text: str, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["replay"]:
        from healthd.sim.replay import main as replay  # here: the replay's imports only for a replay

        return replay(args[1:])
    p = argparse.ArgumentParser(prog="healthd-sim", description="healthd's policy simulator")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "compare"):
        sp = sub.add_parser(name)
        sp.add_argument("scenarios", nargs="+" if name == "run" else 2, metavar="SCENARIO")
        sp.add_argument("--seeds", type=int, default=20, help="runs per scenario (default 20)")
        sp.add_argument("--first-seed", type=int, default=1, help="seeds are FIRST..FIRST+N-1 (default 1)")
        sp.add_argument("--healthd", choices=MODES, help="run with healthd in this mode instead of the scenario's "
                        "(none: the lab's rule; observe, supervised, auto: the real controller)")
        sp.add_argument("--format", choices=("table", "json", "html"), default="table")
        sp.add_argument("-o", "--output", help="write to this file instead of stdout")
    sub.add_parser("list")
    sub.add_parser("replay", help="replay a recorded controller history under another configuration "
                   "(healthd-sim replay --help)")
    a = p.parse_args(args)
    # the real controller logs and alerts on every decision of every simulated run: not the output here
    logging.getLogger("healthd").setLevel(logging.CRITICAL + 1)
    if a.cmd == "list":
        for name in sorted(packaged()):
            s = load(name)
            print(f"{name:24s} {s.description}")
        return 0
    if not 1 <= a.seeds <= 100_000:
        p.error("--seeds: 1 to 100000")
    try:
        scenarios = [load(ref) for ref in a.scenarios]
        if a.healthd is not None:
            scenarios = [dataclasses.replace(s, healthd=dataclasses.replace(s.healthd, mode=a.healthd)) for s in scenarios]
        results = [_runs(s, a.seeds, a.first_seed) for s in scenarios]
    except ScenarioError as e:
        print(f"healthd-sim: {e}", file=sys.stderr)
        return 2
    if a.cmd == "run":
        summaries = [report.summarize(r) for r in results]
        text = {"table": report.table, "json": report.as_json, "html": report.as_html}[a.format](summaries)
    else:
        pair = report.paired(results[0], results[1])
        text = {"table": lambda: report.compare_table(pair), "json": lambda: report.as_json(pair),
                "html": lambda: report.as_html([pair.a, pair.b], pair)}[a.format]()
    _out(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
