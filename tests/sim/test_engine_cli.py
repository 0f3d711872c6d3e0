"""healthd-sim's command line: run, compare, list, its formats, and a bad scenario's exit."""

from __future__ import annotations

import json
import logging

from healthd.sim import cli, engine, scenario


def test_run_prints_the_mean_of_the_runs_and_json_says_the_same(capsys, tmp_path):
    assert cli.main(["run", "no-spares", "--seeds", "2", "--format", "json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    runs = [engine.run(scenario.load("no-spares"), seed) for seed in (1, 2)]
    assert doc["scenario"] == "no-spares" and doc["seeds"] == 2
    assert doc["goodput"] == sum(r.goodput for r in runs) / 2
    assert abs(sum(doc["shares"].values()) - 1) < 1e-9
    assert cli.main(["run", "no-spares", "--seeds", "2"]) == 0
    table = capsys.readouterr().out
    assert f"{doc['goodput'] * 100:.1f}%" in table and "interruption cost per run by cause" in table


def test_compare_pairs_by_seed_and_html_is_one_escaped_page(capsys, tmp_path):
    assert cli.main(["compare", "no-spares", "no-spares", "--seeds", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["diff"] == 0 and doc["better"] == doc["worse"] == 0
    path = tmp_path / "x.yaml"
    path.write_text("base: no-spares\nname: '<script>x</script>'\n")
    out = tmp_path / "r.html"
    assert cli.main(["run", str(path), "--seeds", "1", "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_a_bad_scenario_exits_2_saying_why(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base: baseline\nname: bad\njob: {nodes: 1000}\n")
    assert cli.main(["run", str(path)]) == 2
    assert "the job needs 1000" in capsys.readouterr().err
    assert cli.main(["run", "no-such-scenario"]) == 2


def test_list_names_every_packaged_scenario(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in scenario.packaged())


def test_replay_is_the_replays_own_command(capsys, tmp_path):
    assert cli.main(["replay", "--history", str(tmp_path / "none.sqlite")]) == 2
    assert "healthd-sim replay:" in capsys.readouterr().err


def test_the_command_gives_the_healthd_loggers_level_back():
    """It silences the real controller's log lines while it runs; a caller in the same process (these
    tests) keeps its own level after."""
    before = logging.getLogger("healthd").level
    assert cli.main(["run", "no-spares", "--seeds", "1", "--format", "json"]) == 0
    assert cli.main(["run", "baseline", "--seeds", "1", "--set", "fleet.no_such=1"]) == 2
    assert logging.getLogger("healthd").level == before
