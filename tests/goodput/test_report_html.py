"""The goodput report (healthd.goodput_report through `healthctl goodput --format html`) rendered by a
real headless Chromium (Debian's `chromium`): every chart is in the page Chromium built, the page
logs nothing to the console (a page that fetches anything would: the control proves the check can
fail), a job's hostile name and causes stay text, and a screenshot is kept in build/test-artifacts/."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

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
