"""The goodput report: one self-contained HTML file with inline SVG charts, no script and nothing
fetched (its Content-Security-Policy forbids it), for one job's accounting (healthd.goodput).

Charts, each an `<svg id=...>`: the SLO and its burn (`slo`), GPU-hours by category (`categories`),
a Pareto of the interruption cost by cause (`pareto`: GPU-hours, each bar split by category, with the
cumulative share on a right-hand axis in % and the total cost, the sum of the incidents' costs in the
table below it), the job's time coloured by category against wall-clock time in UTC, with its runs,
interruptions and restores (`timeline`), each rank's step compute time per window against the
window's median (`heatmap`), GPU serials and nodes by interruptions and interruption cost
(`offenders`), and the goodput curve against the checkpoint interval in minutes with the job's own,
Young's and Daly's (`interval`). An interruption cost is all an incident cost: its lost work,
detection, decision, waiting and restart; `lost` is only the work redone. Every text from the log is
escaped: a job can name itself anything.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from itertools import pairwise

from healthd.goodput import Account, Ettr, IntervalAdvice, Log, efficiency, number, runs_of
from healthd.goodput import ettr as goodput_ettr
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


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#222", extra: str = "") -> str:
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}"{extra}/>'


def _label(x: float, y: float, s: object, cls: str, *, anchor: str = "middle", rotate: bool = False,
           centred: bool = False, size: int = 11) -> str:
    """An axis's tick label or title (`cls` says which, for readers of the page); `rotate`: read
    bottom to top, beside a vertical axis; `centred`: `y` is the middle of the text, not its baseline
    (a vertical axis's label beside its tick)."""
    turn = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    middle = ' dominant-baseline="central"' if centred else ""
    return (f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="#444"{turn}{middle}>{_e(s)}</text>')


def nice_step(span: float, most: int) -> float:
    """The smallest of 1, 2 or 5 times a power of ten that cuts `span` into at most `most` steps."""
    if not math.isfinite(span) or span <= 0:
        return 1.0
    unit = 10.0 ** math.floor(math.log10(span / most))
    return next(m * unit for m in (1, 2, 5, 10) if span / (m * unit) <= most)


def ticks(lo: float, hi: float, step: float) -> list[float]:
    """The multiples of `step` from `lo` to `hi`, both included (as integers times the step, so a
    long axis gathers no rounding)."""
    first, last = math.ceil(lo / step), math.floor(hi / step)
    return [k * step for k in range(first, min(last, first + 1000) + 1) if lo <= k * step <= hi]


def _number(v: float) -> str:
    return f"{v:.6g}"


TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
              2 * 86400, 7 * 86400)
"""The timeline's tick steps (seconds), round in UTC; a longer span takes a round number of days."""
TIME_TICKS = 7
"""At most this many tick labels on the timeline: a dated label ("2026-12-02 14:00") is about 100
pixels wide at the chart's font, and 7 of them fit its 780 pixels with room between them."""
_CALENDAR = (datetime(1, 1, 2, tzinfo=UTC).timestamp(), datetime(9999, 12, 30, tzinfo=UTC).timestamp())


def time_ticks(t0: float, t1: float) -> list[tuple[float, str]]:
    """Ticks from `t0` to `t1` (Unix seconds) on a round UTC step chosen from the span (seconds,
    minutes, hours or days), each labelled with its UTC time: the first, and any on a new date, with
    the date ("2026-12-02 14:00"), the others without ("15:00"); to the second under a minute's step.
    Empty for times no calendar holds (a log's bogus clock)."""
    if not (_CALENDAR[0] <= t0 <= t1 <= _CALENDAR[1]):
        return []
    span = t1 - t0
    # fewer than TIME_TICKS steps: a tick at each end of a whole number of steps makes one more
    step = next((float(s) for s in TIME_STEPS if span / s < TIME_TICKS), None)
    if step is None:
        step = 86400.0 * (math.floor(span / 86400 / TIME_TICKS) + 1)
    at = ticks(t0, t1, step) or [t0]  # a span shorter than a second: its start
    clock = "%H:%M:%S" if step < 60 else "%H:%M"
    out, date = [], ""
    for t in at:
        d = datetime.fromtimestamp(t, UTC)
        day = d.date().isoformat()  # four digits of year always (strftime's %Y drops them before 1000)
        out.append((t, d.strftime(clock) if day == date else f"{day} {d.strftime(clock)}"))
        date = day
    return out


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


PARETO_BARS = 12
"""At most this many causes have a bar of their own; the rest share the last bar."""
COST_COLOUR = "#455a64"
"""The offenders' bars: an interruption cost, not split by category."""


def costs_by_cause(acc: Account) -> list[tuple[str, dict[str, float]]]:
    """Each cause's interruption cost by category (GPU-seconds), largest first; past PARETO_BARS
    causes the smallest share one entry, last, so the bars still add up to the total."""
    by_cause: dict[str, dict[str, float]] = {}
    for inc in acc.incidents:
        got = by_cause.setdefault(inc.cause, {})
        for c, v in inc.gpu_s.items():
            got[c] = got.get(c, 0.0) + v
    ranked = sorted(by_cause.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    if len(ranked) > PARETO_BARS:
        rest: dict[str, float] = {}
        for _, part in ranked[PARETO_BARS - 1:]:
            for c, v in part.items():
                rest[c] = rest.get(c, 0.0) + v
        ranked = [*ranked[:PARETO_BARS - 1], (f"{len(ranked) - PARETO_BARS + 1} more causes", rest)]
    return ranked


def total_cost(acc: Account) -> float:
    """The job's interruption cost: the sum of its incidents' costs (GPU-seconds)."""
    return sum(inc.cost_gpu_s for inc in acc.incidents)


def pareto_chart(acc: Account) -> str:
    """The interruption cost by cause in GPU-hours, largest first, each bar split by category, with
    the cumulative share of the total on a right-hand axis in %, and the total once."""
    title = "interruption cost by cause (GPU-h), largest first, with the cumulative share"
    causes = costs_by_cause(acc)
    total = total_cost(acc)
    stated = _text(0, 14, f"total interruption cost {total / 3600:.3f} GPU-h, {len(acc.incidents)} "
                          "interruption(s)", size=12)
    stated = stated.replace("<text ", '<text id="cost-total" ', 1)
    bars = [(cause, part, sum(part.values())) for cause, part in causes]
    if not bars or total <= 0 or sum(v for _, _, v in bars) <= 0:
        note = "no interruption: no interruption cost" if not bars else "the interruptions cost no measurable time"
        return _svg("pareto", 44, [stated, _text(0, 36, note, size=11, fill="#666")], title)
    left, right, top, bottom = 70.0, WIDTH - 70.0, 40.0, 190.0

    def y(share: float) -> float:
        return bottom - (bottom - top) * share

    peak = max(v for _, _, v in bars) / 3600
    step = nice_step(peak, 5)
    ymax = step * max(1, math.ceil(peak / step - 1e-9))
    body = [stated,
            *(_rect(430 + 5 * i, 4, 5, 12, COLOURS[c]) for i, c in enumerate(("lost", "waiting", "restart"))),
            _text(450, 14, "interruption cost by category (bars, left axis)", size=11),
            _line(700, 10, 724, 10, extra=' stroke-width="2"'), '<circle cx="712" cy="10" r="3" fill="#222"/>',
            _text(730, 14, "cumulative share (right axis)", size=11),
            _line(left, top, left, bottom), _line(right, top, right, bottom), _line(left, bottom, right, bottom),
            _label(16, (top + bottom) / 2, "interruption cost (GPU-h)", "axis-title", rotate=True),
            _label(WIDTH - 10, (top + bottom) / 2, "cumulative share (%)", "axis-title", rotate=True)]
    for v in ticks(0, ymax, step):
        body += [_line(left - 4, y(v / ymax), left, y(v / ymax)),
                 _label(left - 6, y(v / ymax), _number(v), "y-tick", anchor="end", centred=True)]
    for pct in range(0, 101, 20):
        body += [_line(right, y(pct / 100), right + 4, y(pct / 100)),
                 _label(right + 6, y(pct / 100), f"{pct}%", "y2-tick", anchor="start", centred=True)]
    whole = 0.0
    for _, _, v in bars:
        whole += v  # summed as the running share is, so the last point is exactly 100 %
    bw = min((right - left) / len(bars), 140.0)
    points, dots, run = [], [], 0.0
    for i, (cause, part, v) in enumerate(bars):
        x0, mid = left + i * bw + 4, left + i * bw + bw / 2
        base = 0.0
        for c in TABLE:
            got = part.get(c.name, 0.0)
            if got > 0:
                body.append(_rect(x0, y((base + got) / 3600 / ymax), bw - 8, (bottom - top) * got / 3600 / ymax,
                                  c.colour, f"{cause}: {c.name} ({c.help}) {_hours(got)} of {_hours(v)}"))
                base += got
        body.append(_label(mid, bottom + 14, cause[:18], "x-tick", size=11))
        run += v
        share = run / whole
        points.append(f"{mid:.1f},{y(share):.1f}")
        dots.append(f'<circle cx="{mid:.1f}" cy="{y(share):.1f}" r="3" fill="#222">'
                    f"<title>{_e(f'cumulative share {share:.1%} after {cause}')}</title></circle>")
    body.append(f'<polyline class="cumulative" points="{" ".join(points)}" fill="none" stroke="#222" '
                f'stroke-width="2"/>')
    body += dots
    body.append(_label(left + (right - left) / 2, bottom + 30, "cause", "axis-title"))
    return _svg("pareto", int(bottom + 38), body, title)


TIMELINE_LEFT, TIMELINE_RIGHT = 60.0, WIDTH - 60.0
"""The timeline's ends: room for a dated tick label centred on either end."""


def timeline_chart(acc: Account, log: Log) -> str:
    """The job's time coloured by category (GPU-hours by category over time), with its runs,
    interruptions and restores, against wall-clock time in UTC."""
    if not acc.timeline:
        return _svg("timeline", 30, [_text(0, 20, "no run in the log")], "the job's timeline")
    runs, _ = runs_of(log)
    # the timeline is run after run; a clock stepped back between runs need not leave it in time order
    t0, t1 = min(a for a, _, _ in acc.timeline), max(b for _, b, _ in acc.timeline)
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return TIMELINE_LEFT + (TIMELINE_RIGHT - TIMELINE_LEFT) * (t - t0) / span

    body = [_rect(x(a), 22, max(x(b) - x(a), 0.6), 26, COLOURS.get(c, "#9e9e9e"), f"{c}: {b - a:.0f} s")
            for a, b, c in acc.timeline]
    for a, b in pairwise(runs):
        if b.start > a.end:  # in the queue between runs: no GPU held, so no category
            body.append(f'<rect x="{x(a.end):.1f}" y="22" width="{x(b.start) - x(a.end):.1f}" height="26" '
                        f'fill="none" stroke="#999" stroke-dasharray="3 3"><title>queued {b.start - a.end:.0f} s, '
                        "no GPU held</title></rect>")
            if x(b.start) - x(a.end) > 50:
                body.append(_text((x(a.end) + x(b.start)) / 2, 39, "queued", size=10, anchor="middle", fill="#666"))
    for r in runs:
        body.append(_line(x(r.start), 8, x(r.start), 50))
        near_end = x(r.start) > TIMELINE_RIGHT - 160  # written leftwards, so it stays on the chart
        body.append(_text(x(r.start) + (-3 if near_end else 3), 17, f"run {r.index} ({r.gpus} GPU, {r.state})",
                          size=11, anchor="end" if near_end else "start"))
    for e in log.events:
        if e.kind == "interrupt":
            cause = e.data.get("cause") or "?"
            body.append(f'<line x1="{x(e.time):.1f}" y1="18" x2="{x(e.time):.1f}" y2="56" stroke="#000" '
                        f'stroke-width="2"><title>{_e(f"interruption: {cause}")}</title></line>')
            body.append(_text(x(e.time) + 2, 66, str(cause)[:24], size=10))
        elif e.kind == "restored":
            body.append(_text(x(e.time), 78, f"restored {e.data.get('step')}", size=10, fill=COLOURS["restart"]))
    axis = 86.0
    body.append(_line(TIMELINE_LEFT, axis, TIMELINE_RIGHT, axis))
    marks = time_ticks(t0, t1)
    for t, label in marks:
        body += [_line(x(t), axis, x(t), axis + 5), _label(x(t), axis + 17, label, "x-tick")]
    if marks:
        name = "time (UTC)"
    else:  # a clock no calendar holds: hours from the first start instead
        name = "time since the first start (h)"
        step = nice_step(span / 3600, TIME_TICKS)
        for h in ticks(0, span / 3600, step):
            body += [_line(x(t0 + h * 3600), axis, x(t0 + h * 3600), axis + 5),
                     _label(x(t0 + h * 3600), axis + 17, _number(h), "x-tick")]
    body.append(_label((TIMELINE_LEFT + TIMELINE_RIGHT) / 2, axis + 34, name, "axis-title"))
    body.append(_text(TIMELINE_LEFT, axis + 52, f"{span / 3600:.2f} h from the first start to the last end; colours "
                                                "as above", size=11, fill="#666"))
    return _svg("timeline", int(axis + 60), body, "the job's timeline by category in UTC, with runs, "
                                                  "interruptions and restores")


def offenders_chart(acc: Account) -> str:
    rows: dict[str, list[float]] = {}
    for inc in acc.incidents:
        key = f"GPU {inc.gpu}" if inc.gpu else f"node {inc.node}" if inc.node else "unknown"
        got = rows.setdefault(key, [0, 0.0])
        got[0] += 1
        got[1] += inc.cost_gpu_s
    ranked = sorted(rows.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:10]
    title = "GPU serials and nodes by interruptions and interruption cost"
    if not ranked:
        return _svg("offenders", 30, [_text(0, 20, "no interruption: no offender")], title)
    top = max(v[1] for _, v in ranked) or 1.0
    body = []
    for i, (key, (n, cost)) in enumerate(ranked):
        y = 10 + i * 22
        body += [_text(0, y + 13, key[:28], size=11), _rect(230, y, (WIDTH - 560) * cost / top, 16, COST_COLOUR),
                 _text(WIDTH - 320, y + 13, f"{n:.0f} interruption(s), {_hours(cost)} interruption cost", size=11)]
    return _svg("offenders", 14 + 22 * len(ranked), body, title)


def interval_chart(advice: IntervalAdvice | None) -> str:
    """Daly's goodput (share of wall time that is work, %) against the checkpoint interval (the work
    between saves, minutes), with the job's own interval, Young's and Daly's."""
    if advice is None:
        return _svg("interval", 30, [_text(0, 20, "no save and no interruption in the log: no interval to compare")],
                    "goodput against the checkpoint interval")
    c, m = advice.checkpoint_s, advice.mtbi_s
    hi = max(3 * advice.daly_s, (advice.current_s or 0) * 1.5, 10 * c)
    if not math.isfinite(hi) or hi <= 0:
        return _svg("interval", 30, [_text(0, 20, "no interval to compare: the saves take no time")],
                    "goodput against the checkpoint interval")
    xs = [hi * k / 200 for k in range(1, 201)]
    ys = [efficiency(t, c, m) for t in xs]
    best = max(ys)
    left, right, top, bottom = 70.0, WIDTH - 20.0, 20.0, 190.0

    def px(t: float) -> float:
        return left + (right - left) * t / hi

    def py(v: float) -> float:
        return bottom - (bottom - top) * v

    body = [f'<polyline points="{" ".join(f"{px(t):.1f},{py(v):.1f}" for t, v in zip(xs, ys, strict=True))}" '
            f'fill="none" stroke="{COLOURS["productive"]}" stroke-width="2"/>',
            _line(left, top, left, bottom), _line(left, bottom, right, bottom),
            _text(right, top - 6, f"best {best:.1%}", size=11, anchor="end"),
            _label(18, (top + bottom) / 2, "goodput (%)", "axis-title", rotate=True),
            _label((left + right) / 2, bottom + 32, "checkpoint interval (min)", "axis-title")]
    for pct in range(0, 101, 20):
        body += [_line(left - 4, py(pct / 100), left, py(pct / 100)),
                 _label(left - 6, py(pct / 100), f"{pct}", "y-tick", anchor="end", centred=True)]
    step = nice_step(hi / 60, 10)
    for minutes in ticks(0, hi / 60, step):
        body += [_line(px(minutes * 60), bottom, px(minutes * 60), bottom + 4),
                 _label(px(minutes * 60), bottom + 16, _number(minutes), "x-tick")]
    marks = [("Young", advice.young_s, "#1565c0"), ("Daly", advice.daly_s, "#2e7d32")]
    if advice.current_s is not None and advice.current_s > c:
        marks.append(("now", advice.current_s - c, "#c62828"))
    for i, (name, t, colour) in enumerate(marks):
        if t <= hi:
            body += [_line(px(t), top, px(t), bottom, colour, ' stroke-dasharray="4 3"'),
                     _text(px(t) + 3, top + 26 + 14 * i, f"{name} {t / 60:.1f} min", size=11, fill=colour)]
    body.append(_text((left + right) / 2, bottom + 50, f"the work between saves; a blocking save C {c:.0f} s, "
                                                      f"MTBI {m / 3600:.2f} h", size=11, anchor="middle",
                      fill="#666"))
    return _svg("interval", int(bottom + 58), body, "goodput (%) against the checkpoint interval (min)")


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


def _span(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def ettr_table(acc: Account, e: Ettr) -> str:
    """The effective training time as ByteRobust reports it, and the time the figures leave out."""
    def share(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    since = "" if e.longest_unproductive_at is None else f" from {_utc(e.longest_unproductive_at)}"
    rows = [("effective training time ratio", share(e.cumulative), "(productive + straggler) over held"),
            (f"lowest over {_span(e.window_s)} of held time", share(e.window_min), "the sliding window's worst"),
            ("longest unproductive stretch", _span(e.longest_unproductive_s) + since,
             "held time without training, queued time left out"),
            ("queued between runs", _span(acc.queued_s), "no GPU held: outside every figure"),
            ("at risk", f"{acc.at_risk_gpu_s / 3600:.3f} GPU-h",
             "productive work after the last durable checkpoint of a run still going")]
    return ("<table><tr><th>figure</th><th>value</th><th>what</th></tr>"
            + "".join(f"<tr><td>{_e(a)}</td><td>{_e(b)}</td><td>{_e(c)}</td></tr>" for a, b, c in rows) + "</table>")


def _utc(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return f"{t:.0f} s"


def render(acc: Account, log: Log, advice: IntervalAdvice | None, slo: float = 0.9,
           title: str | None = None, ettr: Ettr | None = None) -> str:
    """The whole report, as one HTML document."""
    job = acc.job or "?"
    ettr = ettr if ettr is not None else goodput_ettr(acc)
    held = acc.held_gpu_s
    rows = "".join(f"<tr><td title=\"{_e(c.definition)}\">{_e(c.name)}</td><td>{_e(c.help)}</td>"
                   f"<td>{acc.gpu_s[c.name] / 3600:.3f}</td><td>{(acc.gpu_s[c.name] / held if held else 0):.1%}</td></tr>"
                   for c in TABLE if acc.gpu_s[c.name] > 0)
    incidents = "".join(
        f"<tr><td>{_e(i.incident)}</td><td>{_e(i.cause)}</td><td>{_e(i.node or '-')}</td><td>{_e(i.gpu or '-')}</td>"
        f"<td>{i.cost_gpu_s / 3600:.3f}</td><td>{'false positive' if i.false_positive else ''}</td></tr>"
        for i in acc.incidents)
    notes = "" if not acc.notes else (
        '<p class="note">notes: ' + "; ".join(_e(n) for n in acc.notes[:20]) + "</p>")
    partial = notes + ("" if not acc.problems else (
        '<p class="partial">PARTIAL: the log could not be read whole; the figures assume: '
        + "; ".join(_e(p) for p in acc.problems[:20]) + "</p>"))
    sections: Sequence[tuple[str, str]] = (
        ("Goodput against the SLO", slo_chart(acc, slo)),
        ("GPU-hours by category", category_chart(acc) + "<table><tr><th>category</th><th>what</th><th>GPU-h</th>"
                                  f"<th>share</th></tr>{rows}</table>"),
        ("Interruption cost by cause (GPU-h)", pareto_chart(acc) + (
            "<table><tr><th>incident</th><th>cause</th><th>node</th><th>GPU serial</th>"
            f"<th>interruption cost (GPU-h)</th><th></th></tr>{incidents}</table>" if incidents else "")),
        ("Effective training time", ettr_table(acc, ettr)),
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
            f"<h1>{_e(heading)}</h1><p>goodput {share} of {held / 3600:.2f} GPU-h held over {acc.runs} run(s), "
            f"{acc.interruptions} interruption(s)"
            + (f"; {_span(acc.queued_s)} queued between runs (not held)" if acc.queued_s > 0 else "")
            + f"</p>{partial}{body}"
            "<p class=\"note\">healthd goodput report: the categories sum to the GPU-hours held; an "
            "interruption cost (the incident's lost work, detection, decision, waiting and restart) is "
            "charged to its incident.</p></body></html>\n")
