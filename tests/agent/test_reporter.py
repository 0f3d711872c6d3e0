"""The agent's side of the controller transport (healthd.agent.reporter): a real HTTP server on 127.0.0.1
that checks every body with auth.verify_report against real munged daemons (one per "node" plus the
controller's), as the controller does."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from healthd.agent.daemon import Agent, Memory, Sources
from healthd.agent.history import History
from healthd.agent.instructions import parse_clear
from healthd.agent.reporter import Reporter, change_key
from healthd.client import request_drain
from healthd.settings import ControllerClientSettings, HookSettings
from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings, xid
from tests.controller.munge_support import MungeFleet, munged_path
from tests.support.fake_sources import FakeCollector
from tests.support.stub_controller import VerifyingController

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")

NODE = "gpu001"


@pytest.fixture(scope="module")
def fleet():
    with MungeFleet([NODE]) as f:
        yield f


@pytest.fixture
def controller(fleet):
    """A stand-in for healthd-controller's /v1/report: verifies like the real one, records, answers."""
    c = VerifyingController(fleet)
    yield c
    c.close()


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def doc(verdict: str = "healthy", *ids: str, seq: int = 0) -> dict:
    return {"node": NODE, "verdict": verdict, "findings": [{"id": i} for i in ids], "seq": seq}


def reporter(fleet, url, clock=time.monotonic, **kw) -> Reporter:
    c = ControllerClientSettings(url=url, heartbeat_s=kw.pop("heartbeat_s", 30.0), timeout_s=2.0,
                                 munge_socket=fleet.socket(NODE), backoff_max_s=kw.pop("backoff_max_s", 0.4))
    return Reporter(c, NODE, clock, backoff_base_s=kw.pop("backoff_base_s", 0.05), **kw)


def quiet(r: Reporter, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while r.pending() and time.monotonic() < end:
        time.sleep(0.01)


# --------------------------------------------------------------------------- the agent, end to end


def test_the_agents_report_arrives_signed_and_verifies(fleet, controller, tmp_path: Path):
    cfg = settings(nvml={"expected_gpus": 4}, hooks=HookSettings(run_dir=str(tmp_path / "run")),
                   state_file=str(tmp_path / "state.json"), state_dir=str(tmp_path))
    sources = Sources(nvml=FakeCollector("nvml", nvml(*(gpu(i) for i in range(4)))),
                      kernel=FakeCollector("kernel_log", kernel(xid(79, 1, NOW - 5))))
    rep = reporter(fleet, controller.url)
    agent = Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=False, clock=lambda: NOW, reporter=rep)
    try:
        agent.tick()
        agent.publish()
        got = controller.wait(1)
        assert len(got) == 1 and controller.rejections == []
        r = got[0]
        assert r.node == NODE and r.uid == 0 and r.encode_addr == fleet.node_addrs[NODE]
        assert r.report == json.loads(json.dumps(agent.document()))  # every byte of meaning, verified
        assert r.report["verdict"] == agent.result.verdict != "healthy"
        assert any("79" in f["id"] for f in r.report["findings"])
        quiet(rep)
        assert rep.state == "ok" and rep.counters["accepted"] == 1
    finally:
        rep.stop()


def test_clear_finding_drops_old_evidence_until_the_fault_recurs(fleet, controller, tmp_path: Path):
    cfg = settings(nvml={"expected_gpus": 4}, hooks=HookSettings(run_dir=str(tmp_path / "run")),
                   state_file=str(tmp_path / "state.json"), state_dir=str(tmp_path))
    kern = FakeCollector("kernel_log", kernel(xid(79, 1, NOW - 5)))
    sources = Sources(nvml=FakeCollector("nvml", nvml(*(gpu(i) for i in range(4)))), kernel=kern)
    rep = reporter(fleet, controller.url)
    t = [NOW]
    agent = Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=False, clock=lambda: t[0], reporter=rep)
    try:
        agent.tick()
        fid = next(f.id for f in agent.result.findings if f.xid == 79)
        assert agent.result.verdict == "failed"
        # the operator ran `healthctl repaired`: the controller answers the next report with a clear
        controller.answer = {"accepted": True, "instructions": [
            {"kind": "clear-finding", "findings": [fid], "before": NOW + 1, "incident": 4}]}
        agent.publish()
        controller.wait(1)
        quiet(rep)
        t[0] = NOW + 10
        agent.tick()
        assert fid not in {f.id for f in agent.result.findings} and agent.result.verdict == "healthy"
        agent.publish()  # the clear survives a restart: it is in the memory file
        assert Memory.load(str(tmp_path)).cleared == {fid: NOW + 1}
        # the same GPU falls off the bus again after the repair: the finding is back
        kern.sample = kernel(xid(79, 1, NOW + 20))
        t[0] = NOW + 21
        agent.tick()
        assert fid in {f.id for f in agent.result.findings} and agent.result.verdict == "failed"
        assert agent.memory.cleared == {}
    finally:
        rep.stop()


# --------------------------------------------------------------------------- when to send


def test_unchanged_documents_wait_for_the_heartbeat_and_a_change_goes_at_once(fleet, controller):
    clock = Clock()
    r = reporter(fleet, controller.url, clock, heartbeat_s=30.0)
    try:
        assert r.offer(doc("healthy", seq=1))
        assert len(controller.wait(1)) == 1
        quiet(r)
        for s in range(2, 6):  # the agent publishes every interval; nothing changed
            clock.t += 5
            assert not r.offer(doc("healthy", seq=s))
        time.sleep(0.3)
        assert len(controller.verified) == 1

        clock.t += 1  # a finding appears: sent at once, whatever the heartbeat says
        assert r.offer(doc("degraded", "xid:gpu1:79", seq=6))
        got = controller.wait(2)
        assert [g.report["seq"] for g in got] == [1, 6]
        quiet(r)

        clock.t += 1  # same verdict, another finding id: news too
        assert r.offer(doc("degraded", "xid:gpu1:79", "ib:mlx5_0:1:drop", seq=7))
        assert [g.report["seq"] for g in controller.wait(3)] == [1, 6, 7]
        quiet(r)

        clock.t += 29.9  # heartbeat not yet due
        assert not r.offer(doc("degraded", "xid:gpu1:79", "ib:mlx5_0:1:drop", seq=8))
        clock.t += 0.2
        assert r.offer(doc("degraded", "ib:mlx5_0:1:drop", "xid:gpu1:79", seq=9))  # heartbeat
        assert [g.report["seq"] for g in controller.wait(4)] == [1, 6, 7, 9]
        quiet(r)
        assert r.counters["accepted"] == 4 and r.counters["offered"] == 9
    finally:
        r.stop()


def test_change_key_is_the_verdict_and_the_set_of_ids():
    assert change_key(doc("failed", "a", "b")) == change_key(doc("failed", "b", "a", seq=3))
    assert change_key(doc("failed", "a")) != change_key(doc("degraded", "a"))


# --------------------------------------------------------------------------- controller down


def test_controller_down_backs_off_keeps_only_the_latest_and_never_blocks(fleet, caplog):
    first = VerifyingController(fleet)
    port, url = first.port, first.url
    first.close()  # nothing listens on the port now: connection refused
    caplog.set_level(logging.DEBUG, logger="healthd")
    r = reporter(fleet, url, backoff_base_s=0.05, backoff_max_s=0.4)
    try:
        times = []
        for s in range(1, 6):
            t0 = time.monotonic()
            r.offer(doc("degraded", f"f{s}", seq=s))
            times.append(time.monotonic() - t0)
            time.sleep(0.15)
        assert max(times) < 0.5  # the agent's publish never waits on the network (a bound, not a benchmark)
        end = time.monotonic() + 5
        while r.counters["unreachable"] < 4 and time.monotonic() < end:
            time.sleep(0.02)
        assert r.counters["unreachable"] >= 4 and r.counters["accepted"] == 0 and r.state == "unreachable"
        down = [m for m in caplog.messages if "unreachable" in m and "retrying with backoff" in m]
        assert len(down) == 1, caplog.messages  # one line per state change, not one per retry

        # the backoff grows (with jitter: each delay lies between half and all of base * 2^(n-1), capped)
        assert [r.backoff(n) <= min(0.4, 0.05 * 2 ** (n - 1)) for n in range(1, 8)] == [True] * 7
        assert r.backoff(10) >= 0.2

        back = VerifyingController(fleet, port=port)
        try:
            got = back.wait(1, timeout=10)
            time.sleep(0.6)  # a full backoff period: nothing else arrives
            assert [g.report["seq"] for g in back.verified] == [5]  # only the latest document
            assert r.state == "ok"
            assert any("reachable again" in m for m in caplog.messages)
            assert len(got) == 1
        finally:
            back.close()
    finally:
        r.stop()


def test_a_refused_report_is_retried_signed_afresh(fleet, controller, caplog):
    """A controller that does not know the node answers 403; the reporter keeps retrying (one log
    line) and each attempt carries a new credential (never a 409 replay)."""
    controller.node_addrs = {}
    r = reporter(fleet, controller.url, backoff_base_s=0.02, backoff_max_s=0.05)
    try:
        r.offer(doc("failed", "x"))
        end = time.monotonic() + 5
        while r.counters["refused"] < 3 and time.monotonic() < end:
            time.sleep(0.02)
        assert r.counters["refused"] >= 3 and r.state == "refused"
        rejections, credentials = list(controller.rejections), list(controller.credentials)
        assert len(rejections) >= 3 and all("does not know" in reason for reason in rejections), rejections
        # an unknown node is refused before its credential is decoded, so a reused credential would never
        # show as a 409 here: the credentials the attempts carried are compared instead
        assert all(isinstance(c, str) and c.startswith("MUNGE:") for c in credentials), credentials
        assert len(set(credentials)) == len(credentials) >= 3
        assert sum("refused the report: HTTP 403" in m for m in caplog.messages) == 1
    finally:
        r.stop()


def test_known_instructions_reach_the_agent_unknown_ones_are_only_logged(fleet, controller, caplog):
    caplog.set_level(logging.INFO, logger="healthd")
    clear = {"kind": "clear-finding", "findings": ["xid:gpu1:79"], "before": 1_800_000_000.0}
    instructions = [{"kind": "run-validation", "id": 7}, clear, {"kind": "clear-finding", "findings": []}]
    controller.answer = {"accepted": True, "instructions": instructions}
    got: list[dict] = []

    def take(ins: dict) -> None:
        parse_clear(ins)  # what the agent does first: a malformed one raises
        got.append(ins)

    r = reporter(fleet, controller.url, on_instruction=take)
    try:
        r.offer(doc("healthy"))
        controller.wait(1)
        quiet(r)
        assert r.last_instructions == instructions and r.counters["instructions"] == 3
        assert got == [clear]
        assert sum("unknown instruction" in m for m in caplog.messages) == 1
        assert sum("not applied" in m for m in caplog.messages) == 1
    finally:
        r.stop()


def test_a_proxy_in_the_environment_never_applies(fleet, controller, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    r = reporter(fleet, controller.url)
    try:
        r.offer(doc("healthy"))
        assert len(controller.wait(1)) == 1
    finally:
        r.stop()


# --------------------------------------------------------------------------- the prolog's request


def test_request_drain_reports_every_failure_as_not_granted(fleet):
    c = ControllerClientSettings(url="http://127.0.0.1:9", munge_socket=fleet.socket(NODE))
    finding = {"id": "xid:gpu1:79"}

    def answer(status, body):
        return lambda url, data, timeout: (status, body)

    assert request_drain(c, NODE, finding, "7", 1.0, post=answer(200, b'{"granted": true, "reason": "drained"}')) == (True, "drained")
    assert request_drain(c, NODE, finding, "7", 1.0, post=answer(200, b'{"granted": false, "reason": "breaker open"}')) == (False, "breaker open")
    assert request_drain(c, NODE, finding, "7", 1.0, post=answer(200, b'{"granted": "yes"}'))[0] is False
    assert request_drain(c, NODE, finding, "7", 1.0, post=answer(200, b"not json"))[0] is False
    granted, why = request_drain(c, NODE, finding, "7", 1.0, post=answer(403, b'{"error": "cross-node report refused"}'))
    assert not granted and "HTTP 403: cross-node report refused" in why
    granted, why = request_drain(c, NODE, finding, "7", 1.0)  # nothing listens on port 9
    assert not granted and "unreachable" in why
    bad = ControllerClientSettings(url="http://127.0.0.1:9", munge_socket="/nonexistent/munge.sock")
    granted, why = request_drain(bad, NODE, finding, "7", 1.0)
    assert not granted and "cannot sign" in why


# --------------------------------------------------------------------------- the settings


@pytest.mark.parametrize(("text", "key"), [
    ("controller: {url: 'head01:9841'}", "controller.url"),
    ("controller: {url: 'ftp://head01'}", "controller.url"),
    ("controller: {url: 'http://head01', heartbeat_s: 0}", "controller.heartbeat_s"),
    ("controller: {url: 'http://head01', timeout_s: -1}", "controller.timeout_s"),
    ("controller: {url: 'http://head01', backoff_max_s: 0}", "controller.backoff_max_s"),
    ("controller: {munge_socket: 'run/munge.sock'}", "controller.munge_socket"),
    ("hooks: {gating: controller}", "hooks.gating"),
    ("hooks: {gating: remote}", "hooks.gating"),
])
def test_bad_controller_settings_name_their_key(text, key):
    from healthd.config import ConfigError, parse

    with pytest.raises(ConfigError) as e:
        parse(text, "healthd.yaml")
    assert e.value.key == key


def test_controller_settings_load():
    from healthd.config import parse

    s = parse("hooks: {gating: controller}\ncontroller: {url: 'http://head01:9841', munge_socket: /run/munge/munge.socket.2}\n")
    assert s.hooks.gating == "controller"
    assert s.controller == ControllerClientSettings(url="http://head01:9841", munge_socket="/run/munge/munge.socket.2")
    assert parse("").controller.url is None and parse("").controller.heartbeat_s == 30.0


def test_build_agent_reports_only_with_a_url_and_never_in_dry_run(tmp_path: Path):
    from healthd.agent.daemon import build_agent

    cfg = tmp_path / "healthd.yaml"
    base = (f"node_name: {NODE}\nstate_file: {tmp_path}/state.json\nstate_dir: {tmp_path}\n"
            "nvml: {enabled: false}\nkernel_log: {enabled: false}\ninfiniband: {enabled: false}\nhost: {enabled: false}\n")
    cfg.write_text(base + "controller: {url: 'http://127.0.0.1:9'}\n")
    assert build_agent(str(cfg), dry_run=True).reporter is None
    agent = build_agent(str(cfg), dry_run=False)
    try:
        assert isinstance(agent.reporter, Reporter) and agent.reporter.url == "http://127.0.0.1:9/v1/report"
    finally:
        agent.reporter.stop()
    cfg.write_text(base)
    assert build_agent(str(cfg), dry_run=False).reporter is None
