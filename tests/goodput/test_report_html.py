"""The goodput report (healthd.goodput_report through `healthctl goodput --format html`) rendered by a
real headless Chromium (Debian's `chromium`): every chart is in the page Chromium built, the page
logs nothing to the console (a page that fetches anything would: the control proves the check can
fail), a job's hostile name and causes stay text, and a screenshot is kept in build/test-artifacts/."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd import goodput, goodput_report
from healthd.controller import healthctl
from tests.goodput.test_accounting import crash_and_restore, hd, log_line

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHARTS = ("slo", "categories", "pareto", "timeline", "heatmap", "offenders", "interval")
HOSTILE = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium missing: `make test` installs it (APT_PACKAGES)")
    return exe


def browse(chromium: str, page: Path, tmp: Path, *what: str) -> subprocess.CompletedProcess[str]:
    """Chromium on `page`, headless, as root (no sandbox), with a profile of its own; console
    messages go to stderr as `INFO:CONSOLE` lines."""
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0",
                           "--window-size=1000,1500", *what, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def report(tmp_path: Path, text: str, name: str) -> Path:
    log, page = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.html"
    log.write_text(text)
    assert healthctl.main(["goodput", "--log", str(log), "--format", "html", "-o", str(page), "--slo", "0.95"]) == 0
    return page


def test_the_report_renders_in_chromium_with_every_chart_and_no_console_message(chromium, tmp_path, capsys):
    hostile = crash_and_restore().replace('"cause":"xid:79"', f'"cause":{json.dumps(HOSTILE)}')
    assert hostile != crash_and_restore()
    lines = hostile.splitlines()  # the straggler before the job's end: the log stays in time order
    lines.insert(-2, log_line("4242", **hd("straggler", 400, end=500, share=0.1, rank=3, node="node02", gpu=3)))
    # the controller's records of where the 4 ranks ran (one rail named by a hostile agent) and their windows
    lines.insert(-2, log_line("4242", **hd("ranks", 405, ranks=[
        {"rank": r, "node": f"node0{1 + r // 2}", "gpu": r % 2, "rail": HOSTILE if r == 2 else f"mlx5_{r % 2}/1"}
        for r in range(4)])))
    for w in range(12):
        lines.insert(-2, log_line("4242", **hd("windows", 410 + w, window=w,
                                                compute=[[r, 0.1 * (1.3 if r == 3 and w >= 4 else 1.0)] for r in range(4)])))
    hostile = "\n".join(lines) + "\n"
    page = report(tmp_path, hostile, "job")
    html = page.read_text()
    assert "<script" not in html and "onerror=alert" not in html.replace("onerror=alert(2)&gt;", "")
    assert all(f'<svg id="{c}"' in html for c in CHARTS)
    assert [u for u in html.split('"') if u.startswith("http")] == ["http://www.w3.org/2000/svg"] * len(CHARTS)
    dom = browse(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert all(f'id="{c}"' in dom.stdout for c in CHARTS), dom.stdout[:2000]
    assert "<script" not in dom.stdout and "&lt;script&gt;alert(1)&lt;/script&gt;" in dom.stdout
    assert console(dom.stderr) == [], console(dom.stderr)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "goodput-report.png"
    shot.unlink(missing_ok=True)
    done = browse(chromium, page, tmp_path, f"--screenshot={shot}")
    assert done.returncode == 0 and console(done.stderr) == [], done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a page of charts, not a blank one
    assert "(PARTIAL)" not in capsys.readouterr().out
    # the heatmap: a row per rank labelled where it ran, rank 3 red from window 4 on
    assert "rank 3 node02/gpu1/mlx5_1/1" in dom.stdout and "rank 0 node01/gpu0/mlx5_0/1" in dom.stdout
    assert "+30.0% against the window" in dom.stdout and "4 rank(s), 12 window(s)" in dom.stdout


def test_the_console_check_sees_a_page_that_fetches(chromium, tmp_path):
    page = report(tmp_path, crash_and_restore(), "control")
    page.write_text(page.read_text().replace("<h1>", '<img src="http://127.0.0.1:9/x.png"><h1>'))
    done = browse(chromium, page, tmp_path, "--dump-dom")
    assert done.returncode == 0 and any("Content Security Policy" in line for line in console(done.stderr)), \
        done.stderr[-2000:]


def test_an_empty_and_a_partial_log_still_make_a_page(chromium, tmp_path):
    for name, text in (("empty", ""), ("partial", crash_and_restore()[:-30])):
        page = report(tmp_path, text, name)
        html = page.read_text()
        assert all(f'<svg id="{c}"' in html for c in CHARTS)
        assert "PARTIAL" in html  # no run at all, or a cut last line: said on the page
        done = browse(chromium, page, tmp_path, "--dump-dom")
        assert done.returncode == 0 and console(done.stderr) == [], done.stderr[-2000:]


# --------------------------------------------------------------------------- axes, dates, the Pareto, the total
#
# Jobs generated from the event log's format as docs/goodput.md documents it (json.dumps here, not
# healthd's writer): 1-4 runs of 2-15 windows of 5 s to 3 h, saves with their durable records,
# interruptions of a handful of causes with evidence, detection and decision times, each next run
# restoring the last durable step, starting anywhere in 2023-2030 (spans from seconds to days, across
# midnights and month ends).

CAUSES = ("xid:79", "xid:48", "nccl-timeout", "NODE_FAIL", HOSTILE)
WINDOW_S = (5, 30, 60, 300, 1800, 3600, 3 * 3600)


def generated_job(rnd) -> tuple[str, float, float]:
    """A job's log from a `random.Random`, with its first start and its end (Unix seconds)."""
    lines: list[dict] = []

    def put(**entry) -> None:
        lines.append({"job_name": "77", **entry})

    t = first = float(rnd.randrange(1_672_531_200, 1_924_992_000))  # 2023-01-01 .. 2031-01-01
    runs, window, gpus = rnd.randint(1, 4), rnd.choice(WINDOW_S), rnd.choice((1, 8, 64))
    step, durable = 0, -1
    for run in range(runs):
        put(job_start_time=t)
        put(healthd_event="allocation", time=t, gpus=gpus, nodes=[f"node{n:02d}" for n in range(1, 3)])
        if run:
            t += rnd.randint(1, 60)
            put(healthd_event="restored", time=t, step=durable)
            step = durable + 1
        t += rnd.randint(1, 120)
        for w in range(rnd.randint(2, 15)):
            put(step_count=step, step_start_time=t)
            step, t = step + 100, t + window
            if w % 3 == 2:
                save = rnd.randint(1, 30)
                put(custom_badput_event_type="checkpoint_save", custom_badput_event_start_time=t)
                put(custom_badput_event_type="checkpoint_save", custom_badput_event_end_time=t + save)
                put(healthd_event="durable", time=t + save, step=step - 1)
                durable, t = step - 1, t + save
        put(step_count=step, step_start_time=t)
        if run + 1 < runs:
            incident = str(100 + run)
            t += rnd.randint(1, 300)
            put(healthd_event="evidence", time=t, incident=incident)
            put(healthd_event="interrupt", time=t, incident=incident, cause=rnd.choice(CAUSES), node="node02",
                gpu=f"16520000{rnd.randint(10, 99)}", rank=rnd.randint(0, gpus - 1))
            for kind in ("detected", "decided"):
                t += rnd.randint(0, 600)
                put(healthd_event=kind, time=t, incident=incident)
            t += rnd.randint(1, 120)
            put(healthd_event="run_end", time=t, state="NODE_FAIL")
            t += rnd.randint(1, 4 * 3600)
        else:
            t += rnd.randint(1, 60)
            put(job_end_time=t)
    return "".join(json.dumps(entry) + "\n" for entry in lines), first, t


class Page(HTMLParser):
    """The elements of each chart (`<svg id>`: tag, attributes, text) and the rows of the page's tables."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.charts: dict[str, list[tuple[str, dict[str, str], list[str]]]] = {}
        self.tables: list[list[list[str]]] = []
        self.chart: str | None = None
        self.open: list[tuple[str, list[str]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self.chart = a.get("id", "")
            self.charts[self.chart] = []
        elif self.chart is not None:
            got: list[str] = []
            self.charts[self.chart].append((tag, a, got))
            self.open.append((tag, got))
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self.tables[-1][-1].append("")
            self.open.append((tag, []))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.chart = None
        while self.open:
            name, _ = self.open.pop()
            if name == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.open:
            self.open[-1][1].append(data)
            if self.open[-1][0] in ("td", "th"):
                self.tables[-1][-1][-1] += data

    def texts(self, chart: str, cls: str) -> list[tuple[dict[str, str], str]]:
        return [(a, "".join(t)) for tag, a, t in self.charts[chart] if tag == "text" and a.get("class") == cls]


def tick_times(labels: list[str]) -> list[datetime]:
    """The timeline's tick labels as UTC times: a label without a date is on the previous label's date."""
    out: list[datetime] = []
    for label in labels:
        if re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d(:\d\d)?", label):
            out.append(datetime.fromisoformat(label).replace(tzinfo=UTC))
        else:
            assert re.fullmatch(r"\d\d:\d\d(:\d\d)?", label), label
            assert out, f"the first tick {label!r} has no date"
            clock = datetime.strptime(label, "%H:%M:%S" if label.count(":") == 2 else "%H:%M").time()
            out.append(datetime.combine(out[-1].date(), clock, UTC))
    return out


def check_page(page: Page, log: goodput.Log, acc: goodput.Account, first: float, end: float) -> None:
    """The axes with their units, the timeline's UTC ticks within the job's span and in order, the
    Pareto's cumulative line ending at 100 %, and the one total of the interruption cost."""
    titles = {chart: [t for _, t in page.texts(chart, "axis-title")] for chart in ("timeline", "pareto", "interval")}
    assert titles["timeline"] == ["time (UTC)"]
    total = sum(i.cost_gpu_s for i in acc.incidents) / 3600
    if total > 0:
        assert set(titles["pareto"]) == {"interruption cost (GPU-h)", "cumulative share (%)", "cause"}
    if goodput.interval_advice(acc) is not None:
        assert sorted(titles["interval"]) == ["checkpoint interval (min)", "goodput (%)"]
        assert len(page.texts("interval", "x-tick")) >= 2 and len(page.texts("interval", "y-tick")) == 6
    else:
        assert titles["interval"] == []  # no save or no interruption: nothing to compare, said in words
    # the timeline: UTC times, the first with its date, in order, within the job, placed in proportion
    ticks = page.texts("timeline", "x-tick")
    times = tick_times([t for _, t in ticks])
    assert len(times) >= 2 and re.match(r"\d{4}-\d\d-\d\d ", ticks[0][1])
    seconds = [t.timestamp() for t in times]
    assert all(first <= s <= end for s in seconds), (first, seconds, end)
    assert seconds == sorted(set(seconds))
    xs = [float(a["x"]) for a, _ in ticks]
    scale = (xs[-1] - xs[0]) / (seconds[-1] - seconds[0])
    assert all(abs(x - (xs[0] + scale * (s - seconds[0]))) < 0.2 for x, s in zip(xs, seconds, strict=True))
    queued = ["".join(t) for tag, _, t in page.charts["timeline"] if tag == "title" and "".join(t).startswith("queued")]
    assert sum(float(t.split()[1]) for t in queued) == pytest.approx(acc.queued_s, abs=len(queued))
    dates = {t.date() for t in times}
    assert sum(bool(re.match(r"\d{4}-", t)) for _, t in ticks) == len({*dates}), "one dated label per date"
    # the total: once on the page, the sum of the incidents' costs, and the table's column adds up to it
    [(_, stated)] = [(a, "".join(t)) for tag, a, t in page.charts["pareto"] if a.get("id") == "cost-total"]
    assert stated.startswith("total interruption cost ") and stated.endswith(f" GPU-h, {len(acc.incidents)} "
                                                                             "interruption(s)"), stated
    half = 0.0005 + 1e-9  # the page rounds to 0.001 GPU-h
    assert float(stated.split()[3]) == pytest.approx(total, abs=half)
    assert sum(text.count("total interruption cost") for _, _, t in page.charts["pareto"] for text in t) == 1
    tables = [t for t in page.tables if t and "interruption cost (GPU-h)" in t[0]]
    if acc.incidents:
        [table] = tables
        column = table[0].index("interruption cost (GPU-h)")
        assert sum(float(row[column]) for row in table[1:]) == pytest.approx(total, abs=half * len(acc.incidents))
    # the Pareto: a cumulative line over the causes, largest first, ending at the right axis's 100 %
    if total <= 0:
        return
    right = {t: float(a["y"]) for a, t in page.texts("pareto", "y2-tick")}
    [line] = [a for tag, a, _ in page.charts["pareto"] if tag == "polyline" and a.get("class") == "cumulative"]
    ys = [float(p.split(",")[1]) for p in line["points"].split()]
    by_cause: dict[str, float] = {}
    for i in acc.incidents:
        by_cause[i.cause] = by_cause.get(i.cause, 0.0) + i.cost_gpu_s
    shares = [sum(sorted(by_cause.values(), reverse=True)[:k + 1]) / (total * 3600) for k in range(len(by_cause))]
    got = [(right["0%"] - y) / (right["0%"] - right["100%"]) for y in ys]
    assert got == pytest.approx(shares, abs=0.002) and abs(ys[-1] - right["100%"]) < 0.05
    assert any(t == "cumulative share (right axis)" for _, _, tx in page.charts["pareto"] for t in tx)
    assert len(page.texts("pareto", "y-tick")) >= 2 and len(page.texts("pareto", "x-tick")) == len(by_cause)


def accounted(text: str) -> tuple[goodput.Log, goodput.Account]:
    log = goodput.parse_log(text)
    return log, goodput.account(log)


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_charts_axes_dates_cumulative_line_and_total_hold_for_generated_jobs(rnd):
    text, first, end = generated_job(rnd)
    log, acc = accounted(text)
    assert not acc.problems, acc.problems
    page = goodput_report.render(acc, log, goodput.interval_advice(acc))
    check_page(Page(page), log, acc, first, end)


@pytest.mark.parametrize("seed", [0, 11, 17, 32])  # 2, 1, 3 and 1 cause(s); 102, 7, 127 and 0.7 h
def test_chromium_shows_the_axes_dates_cumulative_line_and_total(chromium, tmp_path, seed):
    import random

    text, first, end = generated_job(random.Random(seed))
    log, acc = accounted(text)
    assert acc.incidents and not acc.problems  # these seeds interrupt the job: the Pareto has bars
    page = report(tmp_path, text, f"job{seed}")
    dom = browse(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0 and console(dom.stderr) == [], dom.stderr[-2000:]
    check_page(Page(dom.stdout), log, acc, first, end)


YEAR_1, YEAR_2, YEAR_9999, YEAR_10000 = -62_135_596_800, -62_104_060_800, 253_370_764_800, 253_402_300_800


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.floats(-3e11, 3e11, allow_nan=False), st.floats(1.6e9, 2e9)),
       st.one_of(st.floats(0, 400 * 86400), st.floats(0, 120)))
def test_the_time_ticks_are_round_utc_times_within_any_span_in_order(t0, span):
    t1 = t0 + span
    got = goodput_report.time_ticks(t0, t1)
    if t0 < YEAR_1 or t1 >= YEAR_10000:
        assert got == []  # no calendar date: the chart counts hours from the start instead
        return
    if not YEAR_2 <= t0 <= t1 < YEAR_9999:
        return  # the calendar's first and last year: either
    times = [t for t, _ in got]
    assert 1 <= len(times) <= goodput_report.TIME_TICKS and times == sorted(set(times))
    assert all(t0 <= t <= t1 for t in times)
    labelled = tick_times([label for _, label in got])
    assert all(abs(d.timestamp() - t) < 1 for d, (t, _) in zip(labelled, got, strict=True))
    if span >= 2:
        assert len(times) >= 2 or span / goodput_report.TIME_TICKS > 1, (t0, span)  # a whole step fits twice


def test_a_clock_no_calendar_holds_still_gets_an_axis():
    text = "".join(json.dumps({"job_name": "9", **e}) + "\n" for e in (
        {"job_start_time": 1e13}, {"healthd_event": "allocation", "time": 1e13, "gpus": 2},
        {"step_count": 0, "step_start_time": 1e13 + 5}, {"job_end_time": 1e13 + 7200}))
    log, acc = accounted(text)
    page = Page(goodput_report.render(acc, log, None))
    assert [t for _, t in page.texts("timeline", "axis-title")] == ["time since the first start (h)"]
    assert [t for _, t in page.texts("timeline", "x-tick")] == ["0", "0.5", "1", "1.5", "2"]
