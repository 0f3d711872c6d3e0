"""The source registry (healthd.agent.sources): every registered source has every part, and every
place that handles sources (the classifier's status handling and verdict, history pruning and
reload, the daemon's collectors and memory file, the state document, the metrics) reaches each one
through the registry, so none can be left out."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from healthd.agent import sources as registry
from healthd.agent.classify import classify
from healthd.agent.classify.rules import rule
from healthd.agent.daemon import Agent, Memory, Sources, build_sources
from healthd.agent.history import History, Latch
from healthd.agent.metrics import Metrics, TickFigures
from healthd.agent.sources import SOURCES, Source, check_registry
from healthd.model import NODE, Evidence, Finding, Source as SourceName
from healthd.report_schema import validate_finding
from healthd.settings import MetricsSettings, Settings
from tests.support.builders import CATALOG, NOW, settings
from tests.support.fake_sources import FakeCollector

IDS = [s.name for s in SOURCES]


def tick(samples: dict, t: float = NOW, boot_id: str = "boot-1"):
    return registry.snapshot("gpu001", t, boot_id, samples, {})


def all_absent(**override) -> dict:
    return {s.name: registry.absent(s, "not here") for s in SOURCES} | override


def rooted(tmp_path: Path) -> Settings:
    """Every source enabled, every root and path it reads pointed at one that does not exist."""
    base, absent = Settings(node_name="gpu001"), str(tmp_path / "absent")
    sections = {}
    for s in SOURCES:
        section = getattr(base, s.name)
        roots = {f.name: absent for f in dataclasses.fields(section) if f.name.endswith(("_root", "_dir", "_path"))}
        sections[s.name] = dataclasses.replace(section, enabled=True, **roots)
    return dataclasses.replace(base, **sections)


def test_every_source_is_a_finding_source_with_a_settings_section():
    assert set(IDS) <= set(typing.get_args(SourceName))
    hints = typing.get_type_hints(Settings)
    for s in SOURCES:
        assert hints[s.name] is s.settings, s.name
        assert isinstance(getattr(Settings(node_name="n"), s.name).enabled, bool), s.name


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_the_builder_makes_a_collector_of_the_source(source, tmp_path):
    collector = source.build(rooted(tmp_path), None)
    try:
        if source.followed:
            assert isinstance(collector.read(0.0), source.sample)
        else:
            assert collector.name == source.name
            assert isinstance(collector.collect(NOW), source.sample)
            if source.persists:
                json.dumps(collector.state())
    finally:
        collector.close()


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_an_error_is_handled_before_the_rules_and_counts_toward_unknown(source):
    broken = source.sample(status="error", detail="reading failed")
    res = classify(tick(all_absent(**{source.name: broken})), History(), CATALOG, settings())
    mine = [f for f in res.findings if f.source == source.name]
    assert mine, f"an error of {source.name} raised no finding"
    assert not [f.summary for f in res.findings if f.id.startswith("classify.error")]
    if source.on_error is None:
        r = rule(f"collector.{source.name}")
        assert [(f.id, f.tier, f.attribution) for f in mine] == [(f"collector.{source.name}:node", r.tier, r.attribution)]
        assert "reading failed" in mine[0].summary
    # no source read and this one failed: the node could not be checked
    assert res.verdict == "unknown"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_a_source_that_reads_keeps_the_node_known(source):
    others_failed = {s.name: s.sample(status="error", detail="x") for s in SOURCES}
    ok = source.sample(status="ok")
    res = classify(tick(others_failed | {source.name: ok}), History(), CATALOG, settings())
    assert res.verdict != "unknown"
    assert not [f.summary for f in res.findings if f.id.startswith("classify.error")]


def test_no_source_read_and_none_failed_is_healthy():
    res = classify(tick(all_absent()), History(), CATALOG, settings())
    assert res.verdict == "healthy" and not res.findings


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_the_history_window_keeps_the_series_the_rules_read(source):
    keep = source.keep_s(settings())
    assert isinstance(keep, float) and math.isfinite(keep) and keep >= 0
    if not source.series_prefix:
        return
    key = f"{source.series_prefix}probe/x"
    hist = History(boot_id="boot-1", time=NOW, series={key: ((NOW, 1.0, 10.0),)})
    kept = classify(tick(all_absent(), NOW + keep - 1), hist, CATALOG, settings()).history
    assert key in kept.series, f"{source.name}'s series pruned before its window of {keep:g}s"
    gone = classify(tick(all_absent(), NOW + keep + 1), hist, CATALOG, settings()).history
    assert key not in gone.series


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_a_latched_finding_of_every_source_survives_a_restart_and_the_controller(source):
    f = Finding(id=f"x:{source.name}", component=NODE, source=source.name, attribution="unknown", tier=3, action="none",
                summary="s", evidence=(Evidence("state", "t"),), first_seen=NOW, last_seen=NOW)
    hist = History(time=NOW, latches={f.id: Latch(f, NOW + 60)})
    assert History.from_json(json.loads(json.dumps(hist.to_json()))) == hist
    validate_finding(f.to_json())


def test_the_registry_refuses_an_entry_without_every_part():
    host = registry.by_name("host")
    with pytest.raises(TypeError):
        Source(name="host", sample=host.sample, settings=host.settings, build=host.build, rules=host.rules)  # type: ignore[call-arg]
    broken = {
        "not a finding source": dataclasses.replace(host, name="toaster"),
        "no such settings section": dataclasses.replace(host, settings=MetricsSettings),
        "restart key it lacks": dataclasses.replace(host, restart_keys=("no_such_key",)),
        "rules not callable": dataclasses.replace(host, rules=None),
        "a history window not callable": dataclasses.replace(host, keep_s=3600.0),
        "no Snapshot field": dataclasses.replace(host, field="hostile"),
        "a document without its key": dataclasses.replace(host, document=lambda s: []),
        "a series prefix another owns": dataclasses.replace(host, series_prefix="gpu/"),
    }
    for why, entry in broken.items():
        with pytest.raises(ValueError):
            check_registry(tuple(s if s.name != "host" else entry for s in SOURCES))
            pytest.fail(why)
    with pytest.raises(ValueError, match="twice"):
        check_registry((*SOURCES, host))
    with pytest.raises(ValueError, match="followed"):
        check_registry(tuple(s for s in SOURCES if not s.followed))
    assert check_registry(SOURCES) is registry.FOLLOWED


def test_a_snapshot_carries_every_source_sample():
    samples = {s.name: s.sample(status="ok", detail=f"read {s.name}") for s in SOURCES}
    snap = tick(samples)
    for s in SOURCES:
        assert registry.sample_of(snap, s) is samples[s.name]


# --------------------------------------------------------------------------- the daemon's places


def agent(collectors: dict, tmp_path: Path, dry_run: bool = True) -> Agent:
    cfg = settings(state_dir=str(tmp_path / "state"), state_file=str(tmp_path / "state.json"))
    kernel = collectors.pop(registry.FOLLOWED.name, None)
    return Agent(cfg, CATALOG, Sources(kernel=kernel, **collectors), Memory(history=History()), dry_run=dry_run,
                 clock=lambda: NOW)


def test_the_state_document_and_the_metrics_list_every_source(tmp_path):
    fakes = {s.name: FakeCollector(s.name, s.sample(status="ok", detail=f"read {s.name}")) for s in SOURCES}
    a = agent(fakes, tmp_path)
    a.tick_all()
    doc = a.document()
    assert list(doc["sources"]) == IDS
    assert {n: (v["status"], v["detail"]) for n, v in doc["sources"].items()} == {n: ("ok", f"read {n}") for n in IDS}
    for s in SOURCES:
        if s.document:
            assert doc[s.document_key] == s.document(registry.sample_of(a.snapshot, s))

    figures = TickFigures.of(a.snapshot, a.result.verdict, a.result.findings)
    assert [c.name for c in figures.collectors] == IDS and all(c.ok for c in figures.collectors)
    m = Metrics(MetricsSettings())
    m.update(figures)
    text = generate_latest(m.registry).decode()
    for name in IDS:
        assert f'healthd_collector_success{{collector="{name}"}} 1.0' in text


def test_a_disabled_source_is_listed_as_no_data(tmp_path):
    a = agent({}, tmp_path)
    a.tick_all()
    assert {n: v["status"] for n, v in a.document()["sources"].items()} == dict.fromkeys(IDS, "no_data")


def test_sources_refuse_a_collector_for_no_registered_source():
    with pytest.raises(TypeError, match="toaster"):
        Sources(toaster=object())
    s = Sources(host="h")
    assert s.host == "h" and s.nvml is None and s.kernel is None


def test_every_persisting_collector_gets_its_saved_state_back(tmp_path, monkeypatch):
    persisting = [s for s in registry.PERIODIC if s.persists]
    assert persisting
    mem = Memory(history=History())
    mem.save(str(tmp_path), {s.name: {"saved": s.name} for s in persisting})
    again = Memory.load(str(tmp_path))
    assert again.saved == {s.name: {"saved": s.name} for s in persisting}

    handed: dict[str, object] = {}
    fake = [dataclasses.replace(s, build=lambda cfg, saved, n=s.name: handed.setdefault(n, saved)) for s in SOURCES]
    monkeypatch.setattr(registry, "SOURCES", tuple(fake))
    build_sources(rooted(tmp_path), again)
    assert {n: handed[n] for n in (s.name for s in persisting)} == again.saved
    assert handed[registry.FOLLOWED.name] is again.cursor


def test_a_reload_that_changes_a_collector_root_waits_for_a_restart():
    base = settings()
    for s in SOURCES:
        section = getattr(base, s.name)
        for key in s.restart_keys:
            value = getattr(section, key)
            other = (not value if isinstance(value, bool) else (*value, "x") if isinstance(value, tuple)
                     else value + 1 if isinstance(value, (int, float)) else "/elsewhere")
            changed = dataclasses.replace(base, **{s.name: dataclasses.replace(section, **{key: other})})
            assert registry.restart_settings(changed) != registry.restart_settings(base), f"{s.name}.{key}"
