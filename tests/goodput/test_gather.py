"""The goodput logs gathered on the head node: what a node may ship (pure), the store's exactly-once
appends, and the agent's shipper against the real controller's HTTP server with real MUNGE."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd.controller import goodput_gather
from healthd.controller.goodput_gather import GoodputStore, Shipment, ShipmentRefused, parse_shipment
from healthd.goodput import log_line

T0 = 1_790_000_000.0


def job_lines(job: str, steps: int = 6, *, t0: float = T0, end: str | None = "COMPLETED") -> list[str]:
    lines = [log_line(job, job_start_time=t0), log_line(job, healthd_event="allocation", time=t0, gpus=8)]
    for n in range(steps):
        lines.append(log_line(job, step_count=n * 10, step_start_time=t0 + 60 + n * 30))
    lines.append(log_line(job, healthd_event="durable", time=t0 + 60 + steps * 30, step=steps * 10))
    if end:
        lines.append(log_line(job, healthd_event="run_end", time=t0 + 90 + steps * 30, state=end))
    return lines


def shipment(job: str, offset: int, lines: list[str]) -> dict:
    return {"kind": "goodput-lines", "job": job, "offset": offset, "data": "".join(f"{x}\n" for x in lines)}


# ----------------------------------------------------------------------------- what a node may say


def test_a_nodes_lines_are_taken():
    got = parse_shipment(shipment("4242", 0, job_lines("4242")))
    assert got.job == "4242" and got.offset == 0 and got.data.count("\n") == 10


@pytest.mark.parametrize("doc, problem", [
    ({"kind": "goodput-lines", "job": "4242", "offset": 0, "data": "", "extra": 1}, "unknown field"),
    ({"kind": "drain-request", "job": "4242", "offset": 0, "data": ""}, "not a goodput-lines"),
    ({"kind": "goodput-lines", "job": "../etc", "offset": 0, "data": ""}, "not a Slurm job id"),
    ({"kind": "goodput-lines", "job": "4242", "offset": -1, "data": ""}, "not a byte offset"),
    ({"kind": "goodput-lines", "job": "4242", "offset": True, "data": ""}, "not a byte offset"),
    ({"kind": "goodput-lines", "job": "4242", "offset": 0, "data": '{"job_name": "4242"}'}, "whole line"),
    ({"kind": "goodput-lines", "job": "4242", "offset": 0, "data": "not json\n"}, "line 1: not JSON"),
    ({"kind": "goodput-lines", "job": "4242", "offset": 0, "data": "[1]\n"}, "not a JSON object"),
    ({"kind": "goodput-lines", "job": "4242", "offset": 0, "data": log_line("4243", job_start_time=1) + "\n"},
     "job_name is not 4242"),
])
def test_a_bad_shipment_is_refused_whole(doc, problem):
    with pytest.raises(ShipmentRefused) as exc:
        parse_shipment(doc)
    assert exc.value.status == 400 and problem in exc.value.reason


@pytest.mark.parametrize("kind", ["interrupt", "evidence", "detected", "decided", "false_positive", "straggler"])
def test_a_node_cannot_charge_an_interruption(kind):
    """Incidents and their times come from the ledger: a node that could write them could charge a
    job's loss to another node or make a false positive disappear."""
    line = log_line("4242", healthd_event=kind, time=T0, incident="7", cause="xid:79", node="node02")
    with pytest.raises(ShipmentRefused, match="comes from the (ledger|controller), not from a node"):
        parse_shipment(shipment("4242", 0, [line]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["kind", "job", "offset", "data", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=40),
                                 st.just("goodput-lines"), st.just("4242"),
                                 st.lists(st.text(max_size=5), max_size=3))))
def test_any_document_is_a_shipment_or_a_clear_refusal(doc):
    try:
        got = parse_shipment(doc)
    except ShipmentRefused as exc:
        assert exc.status == 400 and exc.reason
    else:
        assert isinstance(got, Shipment)


# ----------------------------------------------------------------------------- the store


def test_each_line_is_appended_exactly_once(tmp_path):
    store = GoodputStore(str(tmp_path), 1 << 20)
    lines = job_lines("4242")
    blob = "".join(f"{x}\n" for x in lines).encode()
    first, second = "".join(f"{x}\n" for x in lines[:4]), "".join(f"{x}\n" for x in lines[4:])
    assert store.append("node01", Shipment("4242", 0, first)) == len(first)
    # the answer was lost: the node sends the same lines again, then the rest
    assert store.append("node01", Shipment("4242", 0, first)) == len(first)
    assert store.append("node01", Shipment("4242", len(first), second)) == len(blob)
    # a shipment from before the last answer, overlapping what the copy has
    assert store.append("node01", Shipment("4242", 0, first + second)) == len(blob)
    assert (tmp_path / "4242" / "node01.jsonl").read_bytes() == blob
    # past the copy's end (the node's offset is ahead of a copy restored from a backup): nothing is
    # appended and the answer says where to send from
    assert store.append("node01", Shipment("4242", len(blob) + 100, first)) == len(blob)
    assert (tmp_path / "4242" / "node01.jsonl").read_bytes() == blob


def test_a_copy_restored_from_before_its_last_lines_is_caught_up(tmp_path):
    store = GoodputStore(str(tmp_path), 1 << 20)
    data = "".join(f"{x}\n" for x in job_lines("4242"))
    assert store.append("node01", Shipment("4242", 0, data)) == len(data)
    (tmp_path / "4242" / "node01.offset").write_text("0\n")
    (tmp_path / "4242" / "node01.jsonl").write_text("")
    assert store.append("node01", Shipment("4242", len(data), "")) == 0
    assert store.append("node01", Shipment("4242", 0, data)) == len(data)
    assert (tmp_path / "4242" / "node01.jsonl").read_text() == data


def test_each_node_has_its_own_part(tmp_path):
    store = GoodputStore(str(tmp_path), 1 << 20)
    a, b = job_lines("4242", end="NODE_FAIL"), job_lines("4242", t0=T0 + 3600)
    store.append("node01", Shipment("4242", 0, "".join(f"{x}\n" for x in a)))
    store.append("node02", Shipment("4242", 0, "".join(f"{x}\n" for x in b)))
    assert sorted(os.listdir(tmp_path / "4242")) == ["node01.jsonl", "node01.offset", "node02.jsonl", "node02.offset"]
    log = goodput_gather.read_parts(goodput_gather.job_parts(str(tmp_path / "4242")), "4242", 1 << 20)
    assert [e.kind for e in log.events].count("job_start") == 2 and not log.problems


def test_a_copy_stops_at_its_limit_and_the_node_keeps_its_lines(tmp_path):
    store = GoodputStore(str(tmp_path), 2000)
    data = "".join(f"{x}\n" for x in job_lines("4242", steps=40))
    assert len(data) > 2000
    with pytest.raises(ShipmentRefused) as exc:
        store.append("node01", Shipment("4242", 0, data))
    assert exc.value.status == 507
    assert store.through("4242", "node01") == 0


@pytest.mark.parametrize("node", ["../x", "", "a b", "node01/../../etc"])
def test_a_node_name_that_is_not_a_hostname_writes_nothing(tmp_path, node):
    with pytest.raises(ShipmentRefused):
        GoodputStore(str(tmp_path), 1 << 20).append(node, Shipment("4242", 0, ""))
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- over the wire


@pytest.fixture
def gathering(tmp_path):
    """The real controller's HTTP server with real MUNGE: (controller, its url, the fleet, goodput dir)."""
    from tests.controller.munge_support import MungeFleet, munged_path

    if munged_path() is None:
        pytest.fail("munged not installed (make deps installs munge)")
    from healthd.controller.config import ControllerSettings
    from healthd.controller.daemon import Controller
    from healthd.controller.goodput_jobs import GoodputSettings
    from healthd.controller.ledger import Ledger
    from healthd.controller.server import ControllerHTTPServer
    from tests.support.fake_slurm import FakeBackend

    gathered = tmp_path / "gathered"
    with MungeFleet(["node01", "node02", "node03"]) as fleet:
        ledger = Ledger(tmp_path / "ledger.sqlite")
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp_path / "ledger.sqlite"),
                                      munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                      goodput=GoodputSettings(directory=str(gathered)))
        controller = Controller(settings, ledger, FakeBackend(["node01", "node02", "node03"]))
        server = ControllerHTTPServer(settings.listen, controller)
        server.start_background()
        try:
            yield controller, server.url, fleet, gathered
        finally:
            server.shutdown()
            server.server_close()
            controller.close()
            ledger.close()


def _shipper(url: str, fleet, node: str, state_dir):
    from healthd.agent.goodput_ship import GoodputShipper
    from healthd.settings import ControllerClientSettings

    return GoodputShipper(ControllerClientSettings(url=url, munge_socket=fleet.socket(node), timeout_s=10.0),
                          node, str(state_dir), start=False)


def _write(state_dir, job: str, lines: list[str], mode: str = "a") -> None:
    d = state_dir / "goodput"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{job}.jsonl", mode) as f:
        f.write("".join(f"{x}\n" for x in lines))


def test_the_agent_ships_its_logs_and_a_restart_sends_nothing_twice(gathering, tmp_path, monkeypatch):
    controller, url, fleet, gathered = gathering
    node_dir = tmp_path / "node01-state"
    lines = job_lines("4242", steps=30)
    _write(node_dir, "4242", lines[:20])
    # small shipments, so one log takes several
    monkeypatch.setattr("healthd.goodput_events.MAX_SHIPMENT_BYTES", 700)
    shipper = _shipper(url, fleet, "node01", node_dir)
    assert shipper.ship_once()
    assert shipper.counters["shipments"] > 1
    mine = (node_dir / "goodput" / "4242.jsonl").read_bytes()
    assert (gathered / "4242" / "node01.jsonl").read_bytes() == mine
    assert shipper.shipped("4242") == len(mine)
    # the epilog adds the run's end; a new agent process ships only that
    _write(node_dir, "4242", lines[20:])
    again = _shipper(url, fleet, "node01", node_dir)
    assert again.ship_once()
    assert (gathered / "4242" / "node01.jsonl").read_bytes() == (node_dir / "goodput" / "4242.jsonl").read_bytes()
    sent = again.counters["bytes"]
    assert sent == len(("".join(f"{x}\n" for x in lines[20:])).encode())
    # the head node's copy is lost (restored from an old backup): the node sends it all again
    for name in os.listdir(gathered / "4242"):
        os.unlink(gathered / "4242" / name)
    _write(node_dir, "4242", [log_line("4242", job_end_time=T0 + 5000)])
    assert again.ship_once()
    assert (gathered / "4242" / "node01.jsonl").read_bytes() == (node_dir / "goodput" / "4242.jsonl").read_bytes()


def test_a_half_written_line_waits(gathering, tmp_path):
    _, url, fleet, gathered = gathering
    node_dir = tmp_path / "n"
    _write(node_dir, "77", job_lines("77", end=None))
    with open(node_dir / "goodput" / "77.jsonl", "a") as f:
        f.write('{"job_name": "77", "step_cou')
    shipper = _shipper(url, fleet, "node01", node_dir)
    assert shipper.ship_once()
    mine = (node_dir / "goodput" / "77.jsonl").read_text()
    assert (gathered / "77" / "node01.jsonl").read_text() == mine[:mine.rindex("\n") + 1]


def test_a_node_cannot_write_another_nodes_part(gathering, tmp_path):
    """The envelope binds the node name to the munged that signed it: node03's munged cannot sign
    for node02, so a shipment claiming to be node02's is refused and nothing is written."""
    from healthd.envelope import sign_report

    _, url, fleet, gathered = gathering
    body = sign_report(shipment("4242", 0, job_lines("4242")), "node02", fleet.socket("node03"))
    req = urllib.request.Request(url + "/v1/goodput", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code in (401, 403)
    assert not (gathered / "4242").exists()


def test_a_malformed_log_is_refused_once_and_left_until_it_grows(gathering, tmp_path, caplog):
    controller, url, fleet, gathered = gathering
    node_dir = tmp_path / "n"
    _write(node_dir, "9", [log_line("9", healthd_event="interrupt", time=T0, incident="1", cause="x")])
    shipper = _shipper(url, fleet, "node02", node_dir)
    assert shipper.ship_once()
    assert shipper.ship_once()
    assert shipper.counters["refused"] == 1  # not sent again while the file is unchanged
    assert "comes from the ledger" in caplog.text
    assert not (gathered / "9" / "node02.jsonl").exists()


def test_a_report_is_not_a_shipment_and_a_shipment_is_not_a_report(gathering):
    from healthd.envelope import sign_report

    _, url, fleet, _ = gathering
    for path, doc in (("/v1/goodput", {"node": "node01", "verdict": "healthy", "findings": []}),
                      ("/v1/report", shipment("4242", 0, job_lines("4242")))):
        req = urllib.request.Request(url + path, data=sign_report(doc, "node01", fleet.socket("node01")), method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 400, path
        assert json.loads(exc.value.read())["accepted"] is False


# ----------------------------------------------------------------------------- the controller's part


def test_a_straggler_episode_is_one_record_from_its_first_flag_to_its_last():
    from healthd import goodput

    written: dict[str, list[str]] = {}
    eps = goodput_gather.StragglerEpisodes(lambda job, lines: written.setdefault(job, []).extend(lines))
    assert eps.observe(100.0, [("4242", 3, "node02", 1, 0.08)]) == []
    assert eps.observe(110.0, [("4242", 3, "node02", 1, 0.12), ("77", 0, "node01", None, 0.3)]) == []
    # rank 3 is still flagged, job 77's rank was flagged in one round only (no time to charge)
    assert eps.observe(120.0, [("4242", 3, "node02", 1, 0.05)]) == [("77", 0)]
    assert written == {}
    assert eps.observe(130.0, []) == [("4242", 3)]
    [line] = written["4242"]
    log = goodput.parse_log(line + "\n", "4242")
    [e] = log.events
    assert (e.kind, e.time, e.data["end"], e.data["share"], e.data["rank"], e.data["node"], e.data["gpu"]) == (
        "straggler", 100.0, 120.0, 0.12, 3, "node02", 1)


def test_open_episodes_are_written_when_the_controller_stops():
    written: dict[str, list[str]] = {}
    eps = goodput_gather.StragglerEpisodes(lambda job, lines: written.setdefault(job, []).extend(lines))
    eps.observe(100.0, [("4242", 3, "node02", 1, 0.08)])
    eps.observe(160.0, [("4242", 3, "node02", 1, 0.08)])
    eps.close()
    assert len(written["4242"]) == 1 and '"end":160.0' in written["4242"][0]


def test_the_controllers_part_is_read_with_the_nodes_and_no_node_can_write_it(tmp_path):
    from healthd import goodput

    store = GoodputStore(str(tmp_path), 1 << 20)
    data = "".join(f"{x}\n" for x in job_lines("4242", steps=10))
    store.append("node01", Shipment("4242", 0, data))
    goodput_gather.append_own(store, "4242", [log_line("4242", healthd_event="straggler", time=T0 + 100, end=T0 + 300,
                                                        share=0.25, rank=3, node="node02", gpu=1)])
    with pytest.raises(ShipmentRefused):
        store.append(goodput_gather.CONTROLLER_PART, Shipment("4242", 0, data))
    log = goodput_gather.read_parts(goodput_gather.job_parts(str(tmp_path / "4242")), "4242", 1 << 20)
    acc = goodput.account(log)
    assert acc.gpu_s["straggler"] > 0 and not acc.problems


def test_window_records_follow_the_slowest_rank_and_where_ranks_run():
    from healthd import goodput
    from healthd.controller.goodput_gather import RankWindows, WindowRecords

    written: list[str] = []
    rec = WindowRecords(lambda job, lines: written.extend(lines))

    def ranks(newest: dict[int, int], gpu_of_3: int = 3) -> dict:
        return {"4242": [RankWindows(r, "node01" if r < 2 else "node02", gpu_of_3 if r == 3 else r, "mlx5_0/1",
                                     tuple((w, 0.1 + r / 100) for w in range(max(0, n - 7), n + 1)))
                         for r, n in newest.items()]}

    rec.observe(5.0, {"4242": ranks({0: 2, 1: 2, 2: 1, 3: 2})["4242"][:3]}, {"4242": 4})  # rank 3 not reported yet
    assert [json.loads(x)["healthd_event"] for x in written] == ["ranks"]
    rec.observe(10.0, ranks({0: 2, 1: 2, 2: 1, 3: 2}), {"4242": 4})
    rec.observe(20.0, ranks({0: 3, 1: 3, 2: 3, 3: 3}))  # rank 2 caught up: windows 2 and 3 complete
    rec.observe(30.0, ranks({0: 3, 1: 3, 2: 3, 3: 3}, gpu_of_3=5))  # nothing new but where rank 3 runs
    events = goodput.parse_log("".join(f"{x}\n" for x in written), "4242").events
    kinds = [(e.kind, e.data.get("window")) for e in events]
    assert kinds == [("ranks", None), ("ranks", None), ("windows", 0), ("windows", 1), ("windows", 2), ("windows", 3),
                     ("ranks", None)]
    assert events[2].data["compute"] == [[0, 0.1], [1, 0.11], [2, 0.12], [3, 0.13]]
    assert events[-1].data["ranks"] == [{"rank": 3, "node": "node02", "gpu": 5, "rail": "mlx5_0/1"}]  # only what moved
    # ranks gone from the reports (the job ending node by node) are not a move
    written.clear()
    rec.observe(35.0, {"4242": ranks({0: 3, 1: 3, 2: 3, 3: 3}, gpu_of_3=5)["4242"][:2]})
    assert written == []
    # the job leaves the reports (requeued): its windows are written again from the start
    rec.observe(40.0, {})
    written.clear()
    rec.observe(50.0, ranks({0: 0, 1: 0, 2: 0, 3: 0}))
    assert [json.loads(x).get("window") for x in written] == [None, 0]


def test_the_report_heatmap_reads_the_gathered_records(tmp_path):
    from healthd import goodput, goodput_report

    store = GoodputStore(str(tmp_path), 1 << 20)
    store.append("node01", Shipment("4242", 0, "".join(f"{x}\n" for x in job_lines("4242", steps=10))))
    goodput_gather.append_own(store, "4242", [
        log_line("4242", healthd_event="ranks", time=T0 + 61, ranks=[{"rank": 0, "node": "node01", "gpu": 0, "rail": None},
                                                                    {"rank": 1, "node": "node02", "gpu": 7, "rail": None}]),
        log_line("4242", healthd_event="windows", time=T0 + 90, window=0, compute=[[0, 0.1], [1, 0.2]])])
    log = goodput_gather.read_parts(goodput_gather.job_parts(str(tmp_path / "4242")), "4242", 1 << 20)
    assert not goodput.account(log).problems  # the controller's records are read, not accounted
    svg = goodput_report.heatmap_chart(log)
    assert "rank 1 node02/gpu7" in svg and "2 rank(s), 1 window(s)" in svg


def test_the_gathered_logs_live_beside_the_ledger_unless_configured(tmp_path):
    from healthd.controller.config import parse_controller_settings

    s = parse_controller_settings(f"ledger: {tmp_path}/lib/ledger.sqlite\n")
    assert s.goodput.at(s.ledger).directory == f"{tmp_path}/lib/goodput-gathered"
    s = parse_controller_settings(f"ledger: {tmp_path}/l.sqlite\ngoodput: {{directory: /srv/goodput}}\n")
    assert s.goodput.at(s.ledger).directory == "/srv/goodput"
    s = parse_controller_settings("goodput: {enabled: false}\n")
    assert s.goodput.at(s.ledger) is None


def test_a_controller_without_goodput_takes_no_shipment(tmp_path):
    from healthd.controller.config import ControllerSettings
    from healthd.controller.daemon import Controller
    from healthd.controller.goodput_jobs import GoodputSettings
    from healthd.controller.ledger import Ledger
    from tests.support.fake_slurm import FakeBackend

    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        c = Controller(ControllerSettings(ledger=str(tmp_path / "ledger.sqlite"), goodput=GoodputSettings(enabled=False)),
                       ledger, FakeBackend())
        assert c.receive_goodput(b"{}")[0] == 404
        assert c.stragglers is None and c.windows is None
        c.close()
    finally:
        ledger.close()
    assert sorted(os.listdir(tmp_path)) == ["ledger.sqlite"]


def test_a_round_with_no_new_window_builds_nothing():
    from healthd.controller.goodput_gather import RankWindows, WindowRecords

    written: list[str] = []
    rec = WindowRecords(lambda job, lines: written.extend(lines))
    assert rec.wants("4242", 3)  # a job not seen yet
    rec.observe(1.0, {"4242": [RankWindows(r, "node01", r, None, ((3, 0.1),)) for r in range(2)]}, {"4242": 2})
    assert not rec.wants("4242", 3) and rec.wants("4242", 4)
    # the job is still in the reports but had nothing new: it is not forgotten
    rec.observe(2.0, {}, present=["4242"])
    assert not rec.wants("4242", 3)
    rec.observe(3.0, {}, present=[])
    assert rec.wants("4242", 3)
