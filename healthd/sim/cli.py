"""healthd-sim: run scenarios over seeds and print goodput with its spread, or compare two.

    healthd-sim run SCENARIO... [--seeds N] [--first-seed S] [--healthd MODE] [--format table|json|html] [-o FILE]
    healthd-sim compare A B [--seeds N] [--first-seed S] [--healthd MODE] [--format table|json|html] [-o FILE]
    healthd-sim sweep SCENARIO FIELD VALUE... [--seeds N] [--first-seed S] [--format table|json] [-o FILE]
    healthd-sim list
    healthd-sim replay --history FILE [...]      (healthd.sim.replay: a recorded controller history)

A SCENARIO is a YAML file or the name of a packaged one (`healthd-sim list`). `--set FIELD=VALUE`
changes a field of every scenario given (a dotted path, `healthd.settings.policy.rate_limit_per_hour`;
the value read as YAML); `sweep` runs one scenario with FIELD at each VALUE on the same seeds and names
the value with the best mean goodput (the pool's, where the scenario has other users' work). `--jobs N`
runs seeds in N processes. Exit 0; 2 for a bad scenario or arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import sys
from collections.abc import Sequence

import yaml

from healthd.sim import report
from healthd.sim.engine import RunResult, run
from healthd.sim.scenario import MODES, Scenario, ScenarioError, load, load_with, packaged


def _one(job: tuple[Scenario, int]) -> RunResult:
    logging.getLogger("healthd").setLevel(logging.CRITICAL + 1)
    return run(*job)


def _runs(s: Scenario, seeds: int, first: int, jobs: int = 1) -> list[RunResult]:
    work = [(s, seed) for seed in range(first, first + seeds)]
    if jobs <= 1 or seeds == 1:
        return [_one(w) for w in work]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_one, work, chunksize=1)


def _value(text: str) -> object:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


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
    for name in ("run", "compare", "sweep"):
        sp = sub.add_parser(name)
        if name == "sweep":
            sp.add_argument("scenarios", nargs=1, metavar="SCENARIO")
            sp.add_argument("field", metavar="FIELD", help="a dotted path: healthd.settings.policy.spares.gpu.size")
            sp.add_argument("values", nargs="+", metavar="VALUE")
        else:
            sp.add_argument("scenarios", nargs="+" if name == "run" else 2, metavar="SCENARIO")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change a field of the scenario (a dotted path; the value read as YAML)")
        sp.add_argument("--jobs", type=int, default=1, help="processes to run seeds in (default 1)")
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
    # the real controller logs and alerts on every decision of every simulated run: not the output
    # here; the level is given back after, for a caller in the same process (a test, a notebook)
    quiet = logging.getLogger("healthd")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL + 1)
    try:
        return _command(p, a)
    finally:
        quiet.setLevel(level)


def _command(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if a.cmd == "list":
        for name in sorted(packaged()):
            s = load(name)
            print(f"{name:24s} {s.description}")
        return 0
    if not 1 <= a.seeds <= 100_000:
        p.error("--seeds: 1 to 100000")
    if not 1 <= a.jobs <= 64:
        p.error("--jobs: 1 to 64")
    sets = {}
    for item in a.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            p.error(f"--set {item!r}: FIELD=VALUE")
        sets[key] = _value(value)
    try:
        if a.cmd == "sweep":
            scenarios = [dataclasses.replace(s := load_with(a.scenarios[0], {**sets, a.field: _value(v)}),
                                             name=f"{s.name} {a.field.rsplit('.', 1)[-1]}={v}") for v in a.values]
        else:
            scenarios = [load_with(ref, sets) if sets else load(ref) for ref in a.scenarios]
        if a.healthd is not None:
            scenarios = [dataclasses.replace(s, healthd=dataclasses.replace(s.healthd, mode=a.healthd)) for s in scenarios]
        results = [_runs(s, a.seeds, a.first_seed, a.jobs) for s in scenarios]
    except ScenarioError as e:
        print(f"healthd-sim: {e}", file=sys.stderr)
        return 2
    if a.cmd in ("run", "sweep"):
        summaries = [report.summarize(r) for r in results]
        text = {"table": report.table, "json": report.as_json, "html": report.as_html}[a.format](summaries)
        if a.cmd == "sweep" and a.format == "table":
            text += report.best(summaries, a.values, a.field)
    else:
        pair = report.paired(results[0], results[1])
        text = {"table": lambda: report.compare_table(pair), "json": lambda: report.as_json(pair),
                "html": lambda: report.as_html([pair.a, pair.b], pair)}[a.format]()
    _out(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
