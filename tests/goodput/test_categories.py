"""The goodput categories are one table (healthd.goodput_categories). Every category in it is accounted,
shown by the HTML report and by `healthctl goodput` (one job and many), exported by the controller's
metrics, and listed by docs/goodput.md with the table's own definition: a category added to the table
and missing from any of them fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from healthd import goodput, goodput_report
from html import escape
from healthd.controller import healthctl
from healthd.controller.goodput_jobs import AccountedJobs, GoodputSettings
from healthd.controller.metrics import GoodputCollector
from healthd.goodput_categories import CATEGORIES, INCIDENT_CATEGORIES, TABLE, Category

DOCS = Path(__file__).resolve().parents[2] / "docs" / "goodput.md"
HOUR = 3600.0


def docs_rows() -> list[tuple[str, str]]:
    """The rows of docs/goodput.md's table under "The categories": (category, what)."""
    section = DOCS.read_text().split("\n## The categories\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == ["category", "what"] and set(rows[1][0]) <= set("-:")
    return [(r[0], r[1]) for r in rows[2:]]


def only(category: Category) -> goodput.Account:
    """An account of one GPU-hour, all of it in `category`."""
    gpu_s = {c: (HOUR if c == category.name else 0.0) for c in CATEGORIES}
    incidents = (goodput.Incident("7", "xid:79", "node01", "1652000003", False, {category.name: HOUR}),)
    return goodput.Account("4242", HOUR, gpu_s, incidents if category.incident else (), 1, 1 if category.incident else 0,
                           HOUR, (), ((0.0, HOUR, category.name),))


def test_the_table_is_well_formed():
    assert len(set(CATEGORIES)) == len(TABLE) and all(re.fullmatch(r"[a-z_]+", c) for c in CATEGORIES)
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c.colour) for c in TABLE)
    assert len({c.colour for c in TABLE}) == len(TABLE)  # told apart on every chart
    assert all(c.help and c.definition and "\n" not in c.definition and "|" not in c.definition for c in TABLE)
    assert set(INCIDENT_CATEGORIES) < set(CATEGORIES)


def test_the_docs_list_exactly_the_tables_categories_with_their_definitions():
    assert docs_rows() == [(c.name, c.definition) for c in TABLE]


def test_every_account_has_every_category():
    empty = goodput.account(goodput.parse_log(""))
    assert tuple(empty.gpu_s) == CATEGORIES
    acc = goodput.account(goodput.parse_log(goodput.log_line("1", job_start_time=0.0) + "\n"
                                            + goodput.log_line("1", job_end_time=10.0) + "\n"))
    assert tuple(acc.gpu_s) == CATEGORIES and sum(acc.gpu_s.values()) == acc.held_gpu_s


@pytest.mark.parametrize("category", TABLE, ids=CATEGORIES)
def test_the_html_report_shows_every_category(category: Category):
    page = goodput_report.render(only(category), goodput.Log("4242", ()), None)
    chart = page.split('<svg id="categories"', 1)[1].split("</svg>", 1)[0]
    assert f'fill="{category.colour}"' in chart and category.name in chart
    assert f"<td>{escape(category.help)}</td>" in page
    assert f'title="{escape(category.definition)}">{category.name}</td>' in page
    timeline = page.split('<svg id="timeline"', 1)[1].split("</svg>", 1)[0]
    assert f'fill="{category.colour}"' in timeline


@pytest.mark.parametrize("category", TABLE, ids=CATEGORIES)
def test_healthctl_shows_every_category(category: Category, tmp_path, capsys):
    lines = healthctl.goodput_lines(only(category), None, goodput.ettr(only(category)))
    assert any(re.match(rf"{category.name}\s+1\.000\s+100\.0%$", line) for line in lines), lines
    if category.incident:
        assert any(f"{category.name} 1.000" in line for line in lines), lines
    assert healthctl.goodput_doc(only(category), None, goodput.ettr(only(category)))["gpu_s"] == {c: only(category).gpu_s[c] for c in CATEGORIES}


def test_healthctl_over_many_jobs_totals_every_category(tmp_path, capsys):
    (tmp_path / "1.jsonl").write_text("")
    assert healthctl.main(["--json", "--ledger", str(tmp_path / "none.db"), "goodput", "--logs", str(tmp_path)]) == 0
    assert set(json.loads(capsys.readouterr().out)["gpu_s"]) == set(CATEGORIES)


def test_the_metrics_export_every_category(tmp_path):
    jobs = AccountedJobs(str(tmp_path / "accounted.sqlite"))
    try:
        for i, category in enumerate(TABLE):
            jobs.accounted(str(4242 + i), "gpu", "ml", 1.0, 1.0, only(category))
        figures = jobs.figures(GoodputSettings())
    finally:
        jobs.close()
    collector = GoodputCollector()
    collector.publish(figures)
    (family,) = [f for f in collector.collect() if f.name == "healthd_goodput_gpu_seconds"]
    assert {s.labels["category"]: s.value for s in family.samples if s.name.endswith("_total")} == \
        dict.fromkeys(CATEGORIES, HOUR)
    assert all(c in family.documentation for c in CATEGORIES)
