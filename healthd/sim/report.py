"""What healthd-sim prints: one scenario's runs summed up over seeds, and two compared seed by seed.

Every figure comes from the runs' RunResult (healthd.goodput's account of each run's log); this module
only averages and formats.
"""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from healthd.goodput_categories import CATEGORIES
from healthd.sim.engine import RunResult


def _pct(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * q / 100
    i = int(k)
    return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (k - i)


@dataclass(frozen=True)
class Summary:
    """One scenario over its seeds."""

    scenario: str
    remediation: str
    seeds: int
    goodput: float
    """Mean goodput (share of held GPU time that is productive)."""
    p10: float
    p90: float
    shares: dict[str, float]
    """Category -> mean share of held GPU time."""
    cost_gpu_h: dict[str, float]
    """Cause -> mean interruption cost per run, GPU-hours, largest first."""
    false_positive_gpu_h: float
    """Mean false-positive tax per run, GPU-hours."""
    interruptions: float
    taken: dict[str, int]
    """Action -> total applied over all seeds."""
    refused: dict[str, int]
    """Gate -> total refused over all seeds."""
    would: dict[str, int]
    partial_runs: int
    """Runs whose log healthd.goodput could not read whole (0 expected)."""
    slurm_refused: int = 0
    """Job starts Slurm refused, over all seeds."""
    fleet_goodput: float | None = None
    """Mean share of the pool's GPU time that produced work: the job's productive time and other users'
    jobs (RunResult.fleet_goodput); None when the scenario has no other work."""


def summarize(results: Sequence[RunResult]) -> Summary:
    if not results:
        raise ValueError("no runs to summarize")
    g = [r.goodput for r in results]
    n = len(results)
    shares = {c: statistics.fmean(r.gpu_s.get(c, 0.0) / r.held_gpu_s if r.held_gpu_s else 0.0 for r in results)
              for c in CATEGORIES}
    cost: Counter[str] = Counter()
    taken: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    would: Counter[str] = Counter()
    for r in results:
        for k, v in r.cost_by_cause.items():
            cost[k] += v / 3600 / n
        taken.update(r.taken)
        refused.update(r.refused)
        would.update(r.would)
    return Summary(results[0].scenario, results[0].remediation, n, statistics.fmean(g), _pct(g, 10), _pct(g, 90),
                   shares, dict(cost.most_common()),
                   statistics.fmean(r.gpu_s.get("false_positive", 0.0) for r in results) / 3600,
                   statistics.fmean(r.interruptions for r in results), dict(taken), dict(refused), dict(would),
                   sum(1 for r in results if r.partial), sum(r.slurm_refused for r in results),
                   None if any(r.fleet_goodput is None for r in results)
                   else statistics.fmean(r.fleet_goodput or 0.0 for r in results))


@dataclass(frozen=True)
class Paired:
    """B against A, seed by seed (the same faults on both: common random numbers)."""

    a: Summary
    b: Summary
    diff: float
    """Mean of B's goodput less A's, per seed."""
    p10: float
    p90: float
    better: int
    """Seeds where B's goodput is higher."""
    worse: int


def paired(a: Sequence[RunResult], b: Sequence[RunResult]) -> Paired:
    by_seed = {r.seed: r for r in a}
    d = [r.goodput - by_seed[r.seed].goodput for r in b if r.seed in by_seed]
    if not d:
        raise ValueError("no seed in common")
    return Paired(summarize(a), summarize(b), statistics.fmean(d), _pct(d, 10), _pct(d, 90),
                  sum(1 for x in d if x > 1e-12), sum(1 for x in d if x < -1e-12))


def _p(x: float) -> str:
    return f"{x * 100:.1f}%"


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"


def table(summaries: Sequence[Summary]) -> str:
    shown = [c for c in CATEGORIES if any(s.shares.get(c, 0) > 0 for s in summaries)]
    fleet = any(s.fleet_goodput is not None for s in summaries)
    head = ["scenario", "seeds", "goodput", "p10-p90", *(["fleet goodput"] if fleet else []), "interruptions", *shown]
    rows = [[s.scenario, str(s.seeds), _p(s.goodput), f"{_p(s.p10)}-{_p(s.p90)}",
             *([_p(s.fleet_goodput) if s.fleet_goodput is not None else "-"] if fleet else []),
             f"{s.interruptions:.1f}", *(_p(s.shares[c]) for c in shown)] for s in summaries]
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = ["  ".join(x.ljust(w[i]) for i, x in enumerate(r)).rstrip() for r in [head, *rows]]
    for s in summaries:
        out.append("")
        out.append(f"{s.scenario} ({s.remediation}): interruption cost per run by cause (GPU-h): "
                   + (", ".join(f"{k} {v:.0f}" for k, v in s.cost_gpu_h.items()) or "none"))
        out.append(f"  false-positive tax {s.false_positive_gpu_h:.1f} GPU-h per run; actions taken: {_counts(s.taken)}; "
                   f"refused by gate: {_counts(s.refused)}" + (f"; recorded only: {_counts(s.would)}" if s.would else ""))
        if s.slurm_refused:
            out.append(f"  Slurm refused {s.slurm_refused} job start(s) on a node that had just gone out of service")
        if s.partial_runs:
            out.append(f"  PARTIAL: {s.partial_runs} run(s) whose log the accounting could not read whole")
    return "\n".join(out) + "\n"


def best(summaries: Sequence[Summary], values: Sequence[str], field: str) -> str:
    """The sweep's answer: the value whose runs had the best mean goodput (the pool's where there is
    other work), and by how much over the next best."""
    def score(s: Summary) -> float:
        return s.fleet_goodput if s.fleet_goodput is not None else s.goodput
    ranked = sorted(zip(summaries, values, strict=True), key=lambda sv: -score(sv[0]))
    what = "fleet goodput" if ranked[0][0].fleet_goodput is not None else "goodput"
    line = f"\nbest {field}: {ranked[0][1]} ({what} {_p(score(ranked[0][0]))}"
    if len(ranked) > 1:
        line += f"; next {ranked[1][1]}: {(score(ranked[0][0]) - score(ranked[1][0])) * 100:+.2f} points"
    return line + ")\n"


def compare_table(p: Paired) -> str:
    out = table([p.a, p.b])
    out += (f"\n{p.b.scenario} - {p.a.scenario}, paired by seed: {p.diff * 100:+.2f} points "
            f"(p10 {p.p10 * 100:+.2f}, p90 {p.p90 * 100:+.2f}); better on {p.better}, worse on {p.worse} of {p.b.seeds} seeds\n")
    return out


def as_json(obj: Summary | Paired | Sequence[Summary]) -> str:
    doc = [asdict(s) for s in obj] if isinstance(obj, (list, tuple)) else asdict(obj)  # type: ignore[arg-type]
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def as_html(summaries: Sequence[Summary], pair: Paired | None = None) -> str:
    """One self-contained page: the goodput table and each scenario's costs; every text escaped."""
    e = html.escape
    shown = [c for c in CATEGORIES if any(s.shares.get(c, 0) > 0 for s in summaries)]
    rows = "".join(
        "<tr>" + "".join(f"<td>{e(x)}</td>" for x in (s.scenario, str(s.seeds), _p(s.goodput), f"{_p(s.p10)}-{_p(s.p90)}",
                                                        f"{s.interruptions:.1f}", *(_p(s.shares[c]) for c in shown)))
        + "</tr>" for s in summaries)
    head = "".join(f"<th>{e(h)}</th>" for h in ("scenario", "seeds", "goodput", "p10-p90", "interruptions", *shown))
    details = "".join(
        f"<h2>{e(s.scenario)}</h2><p>remediation: {e(s.remediation)}; false-positive tax {s.false_positive_gpu_h:.1f} GPU-h per run; "
        f"actions taken: {e(_counts(s.taken))}; refused by gate: {e(_counts(s.refused))}</p><table><tr><th>cause</th><th>interruption cost per run (GPU-h)</th></tr>"
        + "".join(f"<tr><td>{e(k)}</td><td>{v:.1f}</td></tr>" for k, v in s.cost_gpu_h.items()) + "</table>"
        for s in summaries)
    extra = ""
    if pair is not None:
        extra = (f"<h2>paired difference</h2><p>{e(pair.b.scenario)} - {e(pair.a.scenario)}: {pair.diff * 100:+.2f} points "
                 f"(p10 {pair.p10 * 100:+.2f}, p90 {pair.p90 * 100:+.2f}); better on {pair.better}, worse on {pair.worse}</p>")
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            "<title>healthd-sim</title><style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}"
            "td:first-child,th:first-child{text-align:left}</style></head><body><h1>healthd-sim</h1>"
            f"<table><tr>{head}</tr>{rows}</table>{details}{extra}</body></html>\n")
