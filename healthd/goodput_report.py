"""The goodput report: one self-contained HTML file with inline SVG charts, no script and nothing
fetched (its Content-Security-Policy forbids it), for one job's accounting (healthd.goodput).

Charts, each an `<svg id=...>`: the SLO and its burn (`slo`), GPU-hours by category (`categories`),
a Pareto of lost GPU-hours by cause (`pareto`), the job's time coloured by category, with its runs,
interruptions and restores (`timeline`), each rank's step compute time per window against the window's median (`heatmap`),
GPU serials and nodes by interruptions and GPU-hours lost (`offenders`),
and the goodput curve against the checkpoint interval with the job's own, Young's and Daly's
(`interval`). Every text from the log is escaped: a job can name itself anything.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

from healthd.goodput import Account, IntervalAdvice, Log, efficiency, number, runs_of
from healthd.goodput_categories import TABLE

COLOURS = {c.name: c.colour for c in TABLE}
WIDTH = 900

_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:960px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}svg{display:block;margin:8px 0}
table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #ddd}
.partial{background:#fff3e0;padding:8px;border-left:4px solid #ef6c00}.note{color:#666}"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _svg(chart: str, height: int, body: Iterable[str], title: str) -> str:
    return (f'<svg id="{chart}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_e(title)}">' + "".join(body) + "</svg>")


def _text(x: float, y: float, s: object, *, size: int = 12, anchor: str = "start", fill: str = "#222") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}">{_e(s)}</text>'


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str = "") -> str:
    title = f"<title>{_e(tip)}</title>" if tip else ""
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" fill="{fill}">{title}</rect>'


def _hours(gpu_s: float) -> str:
    return f"{gpu_s / 3600:.2f} GPU-h"


def slo_chart(acc: Account, slo: float) -> str:
    """The job's goodput against the SLO; the burn is the unproductive share over the error budget."""
    good = acc.goodput or 0.0
    budget = max(1e-9, 1 - slo)
    burn = (1 - good) / budget
    body = [_rect(0, 20, WIDTH - 200, 24, "#eee"), _rect(0, 20, (WIDTH - 200) * good, 24, COLOURS["productive"],
                                                          f"goodput {good:.1%}"),
            f'<line x1="{(WIDTH - 200) * slo:.1f}" y1="12" x2="{(WIDTH - 200) * slo:.1f}" y2="52" stroke="#000" '
            f'stroke-width="2"/>', _text((WIDTH - 200) * slo, 66, f"SLO {slo:.1%}", anchor="middle"),
            _text(WIDTH - 190, 38, f"goodput {good:.1%}, burn {burn:.2f}x", size=13,
                  fill="#c62828" if burn > 1 else "#2e7d32")]
    return _svg("slo", 76, body, "goodput against the SLO")


def category_chart(acc: Account) -> str:
    held = acc.held_gpu_s or 1.0
    body, x = [], 0.0
    shown = [c for c in TABLE if acc.gpu_s[c.name] > 0]
    for c in shown:
        v = acc.gpu_s[c.name]
        w = (WIDTH - 20) * v / held
        body.append(_rect(x, 10, w, 30, c.colour, f"{c.name} ({c.help}): {_hours(v)} ({v / held:.1%})"))
        x += w
    for i, c in enumerate(shown):
        lx, ly = (i % 4) * 220, 60 + (i // 4) * 20
        body += [_rect(lx, ly - 10, 12, 12, c.colour, c.help),
                 _text(lx + 18, ly, f"{c.name} {_hours(acc.gpu_s[c.name])} ({acc.gpu_s[c.name] / held:.1%})")]
    return _svg("categories", 70 + 20 * math.ceil(max(len(shown), 1) / 4), body, "GPU-hours by category")


def pareto_chart(acc: Account) -> str:
    by_cause: dict[str, float] = {}
    for inc in acc.incidents:
        by_cause[inc.cause] = by_cause.get(inc.cause, 0.0) + inc.total_gpu_s
    causes = sorted(by_cause.items(), key=lambda kv: -kv[1])[:12]
    if not causes:
        return _svg("pareto", 30, [_text(0, 20, "no interruption: nothing lost to a cause")], "lost GPU-hours by cause")
    top = causes[0][1] or 1.0
    total = sum(v for _, v in causes) or 1.0
    bw = min((WIDTH - 80) / len(causes), 140)
    body, points, run = [], [], 0.0
    for i, (cause, v) in enumerate(causes):
        h = 160 * v / top
        body.append(_rect(40 + i * bw + 4, 180 - h, bw - 8, h, COLOURS["lost"], f"{cause}: {_hours(v)}"))
        body.append(_text(40 + i * bw + bw / 2, 196, cause[:18], size=11, anchor="middle"))
        run += v
        points.append(f"{40 + i * bw + bw / 2:.1f},{180 - 160 * run / total:.1f}")
    body.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#222" stroke-width="2"/>')
    body.append(_text(0, 14, f"{_hours(top)} (largest)", size=11))
    return _svg("pareto", 206, body, "lost GPU-hours by cause, largest first, with the cumulative share")


def timeline_chart(acc: Account, log: Log) -> str:
    """The job's time coloured by category (GPU-hours by category over time), with its runs,
    interruptions and restores."""
    if not acc.timeline:
        return _svg("timeline", 30, [_text(0, 20, "no run in the log")], "the job's timeline")
    runs, _ = runs_of(log)
    t0, t1 = acc.timeline[0][0], acc.timeline[-1][1]
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return 10 + (WIDTH - 20) * (t - t0) / span

    body = [_rect(x(a), 22, max(x(b) - x(a), 0.6), 26, COLOURS[c], f"{c}: {b - a:.0f} s")
            for a, b, c in acc.timeline]
    for r in runs:
        body.append(f'<line x1="{x(r.start):.1f}" y1="8" x2="{x(r.start):.1f}" y2="50" stroke="#222"/>')
        body.append(_text(x(r.start) + 3, 17, f"run {r.index} ({r.gpus} GPU, {r.state})", size=11))
    for e in log.events:
        if e.kind == "interrupt":
            cause = e.data.get("cause") or "?"
            body.append(f'<line x1="{x(e.time):.1f}" y1="18" x2="{x(e.time):.1f}" y2="56" stroke="#000" '
                        f'stroke-width="2"><title>{_e(f"interruption: {cause}")}</title></line>')
            body.append(_text(x(e.time) + 2, 66, str(cause)[:24], size=10))
        elif e.kind == "restored":
            body.append(_text(x(e.time), 78, f"restored {e.data.get('step')}", size=10, fill=COLOURS["restart"]))
    body.append(_text(10, 96, f"{span / 3600:.2f} h from the first start to the last end; colours as above", size=11,
                      fill="#666"))
    return _svg("timeline", 104, body, "the job's timeline by category, with runs, interruptions and restores")


def offenders_chart(acc: Account) -> str:
    rows: dict[str, list[float]] = {}
    for inc in acc.incidents:
        key = f"GPU {inc.gpu}" if inc.gpu else f"node {inc.node}" if inc.node else "unknown"
        got = rows.setdefault(key, [0, 0.0])
        got[0] += 1
        got[1] += inc.total_gpu_s
    ranked = sorted(rows.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:10]
    if not ranked:
        return _svg("offenders", 30, [_text(0, 20, "no interruption: no offender")], "repeat offenders")
    top = max(v[1] for _, v in ranked) or 1.0
    body = []
    for i, (key, (n, lost)) in enumerate(ranked):
        y = 10 + i * 22
        body += [_text(0, y + 13, key[:28], size=11), _rect(230, y, (WIDTH - 480) * lost / top, 16, COLOURS["lost"]),
                 _text(WIDTH - 240, y + 13, f"{n:.0f} interruption(s), {_hours(lost)}", size=11)]
    return _svg("offenders", 14 + 22 * len(ranked), body, "GPU serials and nodes by interruptions and GPU-hours lost")


def interval_chart(advice: IntervalAdvice | None) -> str:
    if advice is None:
        return _svg("interval", 30, [_text(0, 20, "no save and no interruption in the log: no interval to compare")],
                    "goodput against the checkpoint interval")
    c, m = advice.checkpoint_s, advice.mtbi_s
    hi = max(3 * advice.daly_s, (advice.current_s or 0) * 1.5, 10 * c)
    xs = [hi * k / 200 for k in range(1, 201)]
    ys = [efficiency(t, c, m) for t in xs]
    top = max(ys) or 1.0

    def px(t: float) -> float:
        return 50 + (WIDTH - 70) * t / hi

    def py(v: float) -> float:
        return 190 - 170 * v / top

    body = [f'<polyline points="{" ".join(f"{px(t):.1f},{py(v):.1f}" for t, v in zip(xs, ys, strict=True))}" '
            f'fill="none" stroke="{COLOURS["productive"]}" stroke-width="2"/>',
            _text(0, 14, f"best {top:.1%}", size=11)]
    marks = [("Young", advice.young_s, "#1565c0"), ("Daly", advice.daly_s, "#2e7d32")]
    if advice.current_s is not None and advice.current_s > c:
        marks.append(("now", advice.current_s - c, "#c62828"))
    for i, (name, t, colour) in enumerate(marks):
        if t <= hi:
            body += [f'<line x1="{px(t):.1f}" y1="20" x2="{px(t):.1f}" y2="190" stroke="{colour}" stroke-dasharray="4 3"/>',
                     _text(px(t) + 3, 32 + 14 * i, f"{name} {t / 60:.1f} min", size=11, fill=colour)]
    body.append(_text(WIDTH / 2, 208, f"interval between saves (C {c:.0f} s, MTBI {m / 3600:.2f} h)", size=11,
                      anchor="middle", fill="#666"))
    return _svg("interval", 214, body, "goodput against the checkpoint interval")


HEAT_COLUMNS = 180
HEAT_ROWS = 128
"""At most this many columns (windows) and rows (ranks); past them a cell holds several, the slowest."""
HEAT_SCALE = 0.3
"""A cell's colour is full at this much faster (blue) or slower (red) than its window's median."""


def _heat_colour(ratio: float) -> str:
    k = max(-1.0, min(1.0, (ratio - 1.0) / HEAT_SCALE))
    base, far = (245, 245, 245), ((198, 40, 40) if k > 0 else (21, 101, 192))
    r, g, b = (round(a + (z - a) * abs(k)) for a, z in zip(base, far, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_chart(log: Log) -> str:
    """Each rank's step compute time in each window against the window's median (the controller's
    `windows` records), rows labelled rank, node, GPU and rail (its `ranks` records): a slow GPU or
    rail is a red row, a job-wide slowdown a column that stays pale."""
    cells: dict[tuple[int, int], float] = {}
    where: dict[int, str] = {}
    for e in log.events:
        if e.kind == "ranks" and isinstance(e.data.get("ranks"), list):
            for r in e.data["ranks"]:
                if isinstance(r, dict) and isinstance(r.get("rank"), int):
                    place = "/".join(str(v) for v in (r.get("node"), None if r.get("gpu") is None else f"gpu{r['gpu']}",
                                                        r.get("rail")) if v)
                    where[r["rank"]] = place[:40]
        elif e.kind == "windows" and isinstance(e.data.get("window"), int) and isinstance(e.data.get("compute"), list):
            for pair in e.data["compute"]:
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and \
                        (c := number(pair[1])) is not None and c >= 0:
                    cells[(e.data["window"], pair[0])] = c
    if not cells:
        return _svg("heatmap", 30, [_text(0, 20, "no rank windows in this log (the controller writes them while the "
                                                 "job runs)")], "step compute time by rank and window")
    windows = sorted({w for w, _ in cells})
    ranks = sorted({r for _, r in cells})
    medians = {}
    for w in windows:
        values = sorted(c for (cw, _), c in cells.items() if cw == w)
        medians[w] = values[len(values) // 2] or 1e-9
    ncol, nrow = min(len(windows), HEAT_COLUMNS), min(len(ranks), HEAT_ROWS)
    col = {w: i * ncol // len(windows) for i, w in enumerate(windows)}
    row = {r: i * nrow // len(ranks) for i, r in enumerate(ranks)}
    worst: dict[tuple[int, int], float] = {}
    for (w, r), c in cells.items():
        key = (col[w], row[r])
        ratio = c / medians[w]
        if abs(ratio - 1) >= abs(worst.get(key, 1.0) - 1):
            worst[key] = ratio
    left, top = 220, 16
    cw = (WIDTH - left - 10) / ncol
    ch = max(3.0, min(16.0, 420.0 / nrow))
    tips = ncol * nrow <= 4000
    body = [_text(left, 11, f"window {windows[0]}", size=10, fill="#666"),
            _text(WIDTH - 10, 11, f"window {windows[-1]}", size=10, anchor="end", fill="#666")]
    for (cx, ry), ratio in sorted(worst.items()):
        body.append(_rect(left + cx * cw, top + ry * ch, cw + 0.3, ch + 0.3, _heat_colour(ratio),
                          f"{ratio - 1:+.1%} against the window's median" if tips else ""))
    labelled = nrow == len(ranks) and ch >= 9
    for r in ranks:
        if labelled:
            body.append(_text(left - 6, top + row[r] * ch + ch - 2, f"rank {r} {where.get(r, '')}".strip(), size=10,
                              anchor="end"))
    if not labelled:
        body.append(_text(left - 6, top + 12, f"ranks {ranks[0]}-{ranks[-1]}", size=10, anchor="end"))
    y = top + nrow * ch + 16
    body.append(_text(left, y, f"blue: faster, red: slower than the window's median (full colour at "
                               f"{HEAT_SCALE:.0%}); {len(ranks)} rank(s), {len(windows)} window(s)", size=11, fill="#666"))
    return _svg("heatmap", int(y + 8), body, "step compute time by rank and window")


def render(acc: Account, log: Log, advice: IntervalAdvice | None, slo: float = 0.9,
           title: str | None = None) -> str:
    """The whole report, as one HTML document."""
    job = acc.job or "?"
    held = acc.held_gpu_s
    rows = "".join(f"<tr><td title=\"{_e(c.definition)}\">{_e(c.name)}</td><td>{_e(c.help)}</td>"
                   f"<td>{acc.gpu_s[c.name] / 3600:.3f}</td><td>{(acc.gpu_s[c.name] / held if held else 0):.1%}</td></tr>"
                   for c in TABLE if acc.gpu_s[c.name] > 0)
    incidents = "".join(
        f"<tr><td>{_e(i.incident)}</td><td>{_e(i.cause)}</td><td>{_e(i.node or '-')}</td><td>{_e(i.gpu or '-')}</td>"
        f"<td>{i.total_gpu_s / 3600:.3f}</td><td>{'false positive' if i.false_positive else ''}</td></tr>"
        for i in acc.incidents)
    partial = "" if not acc.problems else (
        '<p class="partial">PARTIAL: the log could not be read whole; the figures assume: '
        + "; ".join(_e(p) for p in acc.problems[:20]) + "</p>")
    sections: Sequence[tuple[str, str]] = (
        ("Goodput against the SLO", slo_chart(acc, slo)),
        ("GPU-hours by category", category_chart(acc) + "<table><tr><th>category</th><th>what</th><th>GPU-h</th>"
                                  f"<th>share</th></tr>{rows}</table>"),
        ("Lost GPU-hours by cause", pareto_chart(acc) + (
            "<table><tr><th>incident</th><th>cause</th><th>node</th><th>GPU serial</th><th>GPU-h</th><th></th></tr>"
            f"{incidents}</table>" if incidents else "")),
        ("Timeline", timeline_chart(acc, log)),
        ("Step compute time by rank and window", heatmap_chart(log)),
        ("Repeat offenders", offenders_chart(acc)),
        ("Checkpoint interval", interval_chart(advice)),
    )
    body = "".join(f"<h2>{_e(h)}</h2>{chart}" for h, chart in sections)
    heading = title or f"Goodput of job {job}"
    share = "-" if acc.goodput is None else f"{acc.goodput:.1%}"
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            f"<title>{_e(heading)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_e(heading)}</h1><p>goodput {share} of {held / 3600:.2f} GPU-h over {acc.runs} run(s), "
            f"{acc.interruptions} interruption(s)</p>{partial}{body}"
            "<p class=\"note\">healthd goodput report: the categories sum to the GPU-hours held; an "
            "interruption's cost is charged to its incident.</p></body></html>\n")
