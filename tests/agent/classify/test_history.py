"""History: JSON round trip, corrupt input, bounded size, restarts."""

from __future__ import annotations

import json

import pytest

from healthd.agent.history import (
    MAX_LATCHES,
    MAX_OCCURRENCES,
    MAX_SERIES_POINTS,
    MAX_XID_KEYS,
    History,
    HistoryError,
    Occurrence,
    XidRecord,
)
from healthd.model import Component
from tests.support.builders import (
    NOW,
    cd,
    gpu,
    ib,
    kernel,
    nvml,
    port,
    restart,
    run,
    settings,
    snap,
    xid,
)


def busy_history() -> History:
    cfg = settings(infiniband={"drop_after_s": 20.0})
    snaps = []
    for k in range(12):
        t = NOW + k * 10
        snaps.append(snap(
            t,
            nv=nvml(gpu(0, ecc_corrected_volatile=k * 50, ecc_uncorrected_volatile=k // 4, clock_event_reasons=0x8, pcie_replay=k * 30,
                        nvlink_errors={"link1.crc_data": k}), gpu(1)),
            k=kernel(xid(13, 0, t - 1, gpc=1, tpc=2), xid(45, 0, t - 0.5, count=3), xid(149, 1, t - 1, nvlink_severity="Fatal", subcode=7)),
            i=ib(port("mlx5_0", up=k % 2 == 0, counters={"counters/symbol_error": cd(k * 100, 100 if k else None)}), port("mlx5_1")),
        ))
    return run(*snaps, cfg=cfg)[-1].history


def test_round_trip_through_json_text_is_exact():
    h = busy_history()
    assert h.xids and h.ports and h.latches and h.series and h.gpu_ids and h.nvml_read and h.ib_read
    text = json.dumps(h.to_json(), allow_nan=False)
    assert History.from_json(json.loads(text)) == h


def test_empty_input_is_a_fresh_history():
    assert History.from_json({}) == History()
    assert History.from_json(History().to_json()) == History()


def corrupt(mutate):
    d = json.loads(json.dumps(busy_history().to_json()))
    mutate(d)
    return d


def first(d: dict) -> str:
    return next(iter(d))


@pytest.mark.parametrize(
    "doc, fragment",
    [
        ([1, 2], "history: expected a JSON object, found [1, 2]"),
        ({"version": 99}, "history.version: expected 1, found 99"),
        (corrupt(lambda d: d.update(time="yesterday")), "history.time: expected a finite number, found 'yesterday'"),
        (corrupt(lambda d: d["xids"][first(d["xids"])].update(count="x")), ".count: expected an integer, found 'x'"),
        (corrupt(lambda d: d["xids"][first(d["xids"])]["occurrences"].append([1.0])), "].occurrences[12]: expected [first_ts, last_ts, count, gpc, tpc], found [1.0]"),
        (corrupt(lambda d: d["ports"][first(d["ports"])]["transitions"].append([1.0, "sideways"])), "expected [time, 'down' | 'up']"),
        (corrupt(lambda d: d["latches"][first(d["latches"])]["finding"].update(tier=7)), ".finding.tier: expected 1, 2 or 3, found 7"),
        (corrupt(lambda d: d["latches"][first(d["latches"])]["finding"].update(action="explode")), ".finding.action: expected one of none"),
        (corrupt(lambda d: d["series"].update(k=[[1.0, 2.0]])), "history.series['k'][0]: expected [time, amount, span_s]"),
        (corrupt(lambda d: d.update(nvml_read="soon")), "history.nvml_read: expected a finite number, found 'soon'"),
        (corrupt(lambda d: d["gpu_ids"].update(x={"kind": "toaster"})), "history.gpu_ids['x'].kind: expected one of gpu, port, node, filesystem"),
        ({"version": 1, "xids": []}, "history.xids: expected an object, found []"),
        (corrupt(lambda d: d.update(time=1e12)), "history.time: expected epoch seconds between 1970 and 2100, found 1000000000000.0"),
    ],
)
def test_corrupt_history_raises_history_error_naming_the_part(doc, fragment):
    with pytest.raises(HistoryError) as err:
        History.from_json(doc)
    assert fragment in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_nan_is_rejected_not_loaded():
    d = busy_history().to_json()
    d["time"] = float("nan")
    with pytest.raises(HistoryError, match="finite number"):
        History.from_json(d)


def test_an_xid_storm_keeps_the_history_small():
    # 700 ticks, each with a burst on every GPU and a new Xid code: bounded by count and time
    h = History()
    cfg = settings(classify={"finding_ttl_s": 30.0})  # few live findings per tick; records kept 24 h for repeats
    for k in range(0, 2100, 3):
        t = NOW + k
        events = [xid(13, g, t, count=800) for g in range(8)] + [xid(200 + k % 997, k % 8, t)]
        h = run(snap(t + 1, nv=nvml(*(gpu(g) for g in range(8))), k=kernel(*events)), history=h, cfg=cfg)[0].history
    assert len(h.xids) <= MAX_XID_KEYS
    assert all(len(r.occurrences) <= MAX_OCCURRENCES for r in h.xids.values())
    assert h.xids[f"{'00000000:18:00.0'}:13"].count == 800 * 700  # the count keeps accumulating
    assert len(json.dumps(h.to_json())) < 600_000


def test_windows_prune_old_entries():
    h = busy_history()
    later = run(snap(NOW + 10 * 86400), history=h)[0].history
    assert later.xids == {} and later.series == {} and later.latches == {}


def test_capped_cuts_an_oversized_history():
    comp = Component(kind="gpu", index=0, bus_id="00000000:18:00.0")
    big = History(
        series={"s": tuple((float(i), 1.0, 1.0) for i in range(5000))},
        xids={f"b{i}:13": XidRecord(component=comp, xid=13, occurrences=tuple(Occurrence(float(j), float(j), 1) for j in range(100)))
              for i in range(600)},
    )
    small = big.capped()
    assert len(small.series["s"]) == MAX_SERIES_POINTS and sum(p[1] for p in small.series["s"]) == 5000.0
    assert len(small.xids) == MAX_XID_KEYS and all(len(r.occurrences) == MAX_OCCURRENCES for r in small.xids.values())
    assert MAX_LATCHES >= len(small.latches)
    # and from_json caps too: a hostile file cannot blow the agent's memory up
    assert len(History.from_json(big.to_json()).xids) == MAX_XID_KEYS


def test_restart_mid_drop_keeps_down_since():
    cfg = settings(infiniband={"drop_after_s": 100.0})
    a = run(snap(NOW, i=ib(port())), snap(NOW + 10, i=ib(port(up=False))), cfg=cfg)
    b = run(snap(NOW + 150, i=ib(port(up=False))), history=restart(a[-1].history), cfg=cfg)
    f = next(f for f in b[0].findings if f.id == "ib.drop:mlx5_0/1")
    assert f.first_seen == NOW + 10 and f.tier == 1
