"""healthd.sim.fleet and healthd.sim.agentinput: the real agent classification and the real control
round on a virtual clock, against an in-memory Slurm."""

from __future__ import annotations

import base64
import dataclasses
import logging
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd import munge
from healthd.agent.classify.catalog import load_catalog
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.metrics import ControllerMetrics
from healthd.controller.policy import ControllerPolicySettings
from healthd.envelope import sign_report
from healthd.reason import is_healthd_reason
from healthd.sim.agentinput import GpuReading, KernelLines, NvmlReading, SimAgent, xid_line
from healthd.sim.fleet import SimController
from healthd.sim.slurm import SimSlurm
from healthd.slurm.backend import StepResult
from tests.support.fake_slurm import FakeBackend

T0 = 1_200_000_000.0
"""A virtual epoch far from the wall clock: a time the wall clock wrote stands out."""
DAY = 86400.0
FALLEN = "GPU has fallen off the bus."


def names(n: int) -> list[str]:
    return [f"gpu{i:04d}" for i in range(n)]


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def slurm(nodes: list[str], clock: Clock, **kw) -> SimSlurm:
    be = SimSlurm(nodes, clock=clock, **kw)
    be.step = lambda node, argv, timeout_s: StepResult(0, "validation passed (simulated)")
    return be


def controller_settings(mode: str = "auto", **policy) -> ControllerSettings:
    return ControllerSettings(policy=ControllerPolicySettings(mode=mode, **policy))  # type: ignore[arg-type]


@pytest.fixture
def quiet():
    # the agent and the controller log every finding and decision; a month of them is noise here
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def make(n: int = 16, mode: str = "auto", clock: Clock | None = None, topology: dict[str, str] | None = None,
         **policy):
    clock = clock or Clock()
    be = slurm(names(n), clock, topology=topology)
    return SimController(controller_settings(mode, **policy), be, clock,
                         topology_text=be.topology_conf() if topology else ""), be, clock


def xid(node_xid: int, gpu: int = 0, text: str = FALLEN) -> KernelLines:
    return KernelLines((xid_line(node_xid, gpu, text),))


def node_state(be, node: str):
    return be.node(node)


# ------------------------------------------------------------------------------------------ the agent


def test_an_xid_79_line_becomes_the_agents_t1_hardware_finding_with_the_line_as_evidence():
    doc = SimAgent("gpu0001").feed([xid(79, 2)], T0)
    assert doc["verdict"] == "failed"
    (f,) = doc["findings"]
    assert (f["id"], f["tier"], f["attribution"], f["action"]) == ("xid:gpu2:79", 1, "hardware", "drain-and-requeue")
    assert any("NVRM: Xid (PCI:0000:3a:00): 79" in e["text"] for e in f["evidence"])


def test_an_nvml_reading_of_a_lost_gpu_and_of_fewer_gpus_are_the_agents_own_findings():
    agent = SimAgent("gpu0001")
    assert agent.feed([], T0)["verdict"] == "healthy"
    lost = agent.feed([NvmlReading(gpus=(GpuReading(5, {"lost": True}),))], T0 + 10)
    assert [f["id"] for f in lost["findings"]] == ["nvml.lost:gpu5"]
    fewer = SimAgent("gpu0002").feed([NvmlReading(count=7)], T0)
    assert [f["id"] for f in fewer["findings"]] == ["nvml.gpu_count:node"]


def test_a_reboot_is_seen_by_the_agent_and_clears_what_a_reboot_remedies():
    agent = SimAgent("gpu0001")
    agent.feed([NvmlReading(gpus=(GpuReading(1, {"lost": True}),))], T0)
    agent.reboot()
    assert agent.feed([], T0 + 600)["verdict"] == "healthy"


def test_anything_else_is_refused_as_agent_input():
    with pytest.raises(TypeError, match="not agent input"):
        SimAgent("gpu0001").feed(["NVRM: Xid ..."], T0)  # type: ignore[list-item]


# ------------------------------------------------------------------------------------------ the round


def test_xid_79_in_auto_mode_is_drained_by_the_real_round_with_healthds_reason_and_recorded_once(quiet):
    sim, be, clock = make()
    try:
        sim.report("gpu0003", [xid(79)], T0)
        first = sim.round(T0)
        (o,) = first.applied
        assert (o.node, o.kind, o.status) == ("gpu0003", "drain-and-requeue", "allowed")
        info = node_state(be, "gpu0003")
        assert "DRAIN" in info.flags and is_healthd_reason(info.reason) and "xid 79" in info.reason
        assert info.reason == o.slurm_reason and set(first.holds) == {"gpu0003"}
        later = [sim.round(T0 + 5 * i) for i in range(1, 20)]
        assert all(not r.applied and all(o.kind == "none" for o in r.outcomes) for r in later)
        # the drain once; then, once, that the node is already drained (the policy's own `none`)
        assert [(d.node, d.kind, d.outcome) for d in sim.ledger.decisions()] == [
            ("gpu0003", "drain-and-requeue", "allowed"), ("gpu0003", "none", "refused")]
        assert len(sim.ledger.actions(node="gpu0003")) == 1
        assert all(n == "gpu0003" or not node_state(be, n).flags for n in names(16))
    finally:
        sim.close()


def test_the_same_in_observe_mode_writes_nothing_and_records_what_it_would_do(quiet):
    sim, be, clock = make(mode="observe")
    try:
        sim.report("gpu0003", [xid(79)], T0)
        r = sim.round(T0)
        assert not r.applied and not r.holds
        (w,) = r.would_do
        assert (w.node, w.kind, w.gate) == ("gpu0003", "drain-and-requeue", "mode")
        assert all(not node_state(be, n).flags and not node_state(be, n).reason for n in names(16))
        assert be.write_count == 0
        (d,) = r.recorded
        assert (d.node, d.kind, d.mode, d.outcome, d.refused_gate) == ("gpu0003", "drain-and-requeue", "observe",
                                                                       "refused", "mode")
        assert not sim.ledger.actions()
    finally:
        sim.close()


CATALOG = load_catalog()
USER_XIDS = [x for x in CATALOG.xids() if CATALOG.lookup(x).attribution == "user" and CATALOG.lookup(x).tier == 3]


def test_the_catalog_has_user_code_xids_to_test():
    assert {13, 31, 43} <= set(USER_XIDS)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(code=st.sampled_from(USER_XIDS), gpu=st.integers(0, 7), pid=st.integers(1, 4_000_000),
       process=st.from_regex(r"[a-z][a-z0-9_.]{0,14}", fullmatch=True), text=st.sampled_from(
           ["Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): Out Of Range Address",
            "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1c_00000000", "Ch 00000010", ""]))
def test_a_user_code_xid_once_never_drains(quiet, code, gpu, pid, process, text):
    sim, be, clock = make(n=4)
    try:
        line = xid_line(code, gpu, text, pid=pid, process=process)
        report = sim.report("gpu0001", [KernelLines((line,))], T0)
        assert [(f.xid, f.attribution, f.tier) for f in report.findings] == [(code, "user", 3)]
        r = sim.round(T0)
        assert not r.applied and not r.would_do and not r.holds
        assert all(o.kind == "none" for o in r.outcomes)
        assert be.write_count == 0
        assert not node_state(be, "gpu0001").flags
    finally:
        sim.close()


def test_a_16_node_leaf_switch_burst_is_refused_by_the_envelope_naming_the_gate(quiet):
    sim, be, clock = make(n=128, topology={n: f"leaf{i // 16}" for i, n in enumerate(names(128))})
    try:
        for i, node in enumerate(names(16)):  # leaf0: every node's link drops its GPUs within a minute
            sim.report(node, [xid(79, i % 8)], T0 + i * 3)
        r = sim.round(T0 + 60)
        assert not r.applied and not r.holds
        assert {o.node for o in r.refused} == set(names(16))
        gates = {o.gate for o in r.refused}
        assert gates and gates <= {"breaker", "correlation"}, gates
        assert all(o.reason for o in r.refused)
        assert sim.ledger.breaker_state().open
        assert be.write_count == 0
    finally:
        sim.close()


def test_a_rate_limit_refusal_is_shown_with_its_gate_and_a_deadline_to_look_again(quiet):
    sim, be, clock = make(n=64, max_actions_per_hour=1)
    try:
        lost = NvmlReading(gpus=(GpuReading(4, {"lost": True}),))  # lasts until repaired, unlike one line
        sim.report("gpu0001", [lost], T0)
        sim.report("gpu0002", [lost], T0)
        r = sim.round(T0)
        assert len(r.applied) == 1
        (refused,) = r.refused
        assert refused.gate == "rate-limit" and refused.reason
        assert sim.next_deadline() is not None and sim.next_deadline() > T0
        assert not sim.round(sim.next_deadline()).applied  # still within the hour
        clock.t = T0 + 3700
        later = sim.round(clock.t)
        assert {o.node for o in later.applied} == {refused.node}
    finally:
        sim.close()


# ------------------------------------------------------------------------------- time and determinism


def month(seed: int, clock: Clock, days: int = 30) -> tuple[list, list, SimController]:
    """`days` virtual days: a GPU falls off the bus on a node a day, the node repaired two days later; a
    user-code Xid on another; rounds only when a report changes or the controller names a deadline."""
    rng = random.Random(seed)
    be = slurm(names(32), clock)
    sim = SimController(controller_settings("auto"), be, clock)
    events: list[tuple[float, str, str]] = []
    for day in range(days):
        events.append((T0 + day * DAY + rng.uniform(0, DAY / 2), "fault", f"gpu{rng.randrange(32):04d}"))
        events.append((T0 + day * DAY + rng.uniform(0, DAY), "user", f"gpu{rng.randrange(32):04d}"))
    events.sort()
    repairs: list[tuple[float, str]] = []
    outcomes, rounds = [], 0
    end = T0 + days * DAY
    while clock.t < end:
        deadline = sim.next_deadline()
        upcoming = [t for t, _, _ in events[:1]] + [t for t, _ in repairs[:1]] + ([deadline] if deadline else [])
        if not upcoming:
            break
        clock.t = max(clock.t, min(upcoming))
        while events and events[0][0] <= clock.t:
            _, what, node = events.pop(0)
            sim.report(node, [xid(79, 1) if what == "fault" else xid(31, 2, "MMU Fault")], clock.t)
            if what == "fault":
                repairs.append((clock.t + 2 * DAY, node))
                repairs.sort()
        while repairs and repairs[0][0] <= clock.t:
            _, node = repairs.pop(0)
            sim.reboot(node, clock.t)
        r = sim.round(clock.t)
        rounds += 1
        outcomes.append([(o.node, o.kind, o.status, o.gate, o.applied) for o in r.outcomes])
    return outcomes, [(dict(be.writes), [be.node(n) for n in names(32)])], sim


def test_thirty_virtual_days_run_on_the_injected_clock_alone(quiet):
    clock = Clock()
    started = time.process_time()  # CPU time: a machine busy with other work must not fail it
    outcomes, writes, sim = month(7, clock)
    took = time.process_time() - started
    try:
        assert clock.t >= T0 + 29 * DAY
        assert took < 10.0, f"30 virtual days took {took:.1f} s of CPU (about 4 s when measured)"
        assert any(o for o in outcomes), "the month decided something"
        # every time the ledger keeps is the virtual clock's: none anywhere near the wall clock
        wall = time.time()
        for (table,) in sim.ledger.query("SELECT name FROM sqlite_master WHERE type = 'table'"):
            for row in sim.ledger.query(f"SELECT * FROM {table}"):  # noqa: S608 - names from sqlite_master
                for v in row:
                    if isinstance(v, float):
                        assert not wall - 400 * DAY < v < wall + 400 * DAY, (table, row)
    finally:
        sim.close()


def test_the_same_inputs_give_the_same_outputs(quiet):
    a, wa, sa = month(11, Clock(), days=8)
    b, wb, sb = month(11, Clock(), days=8)
    try:
        assert a == b and wa == wb
        assert [dataclasses.astuple(d) for d in sa.ledger.decisions()] == \
               [dataclasses.astuple(d) for d in sb.ledger.decisions()]
    finally:
        sa.close()
        sb.close()


# -------------------------------------------------------------------------------- against the daemon


class FakeMunge:
    """A credential that carries its payload: the daemon's intake checks everything else as for real."""

    def __init__(self, clock: Clock, addrs: dict[str, str]):
        self.clock, self.addrs = clock, addrs
        self.next_addr = ""

    def encode(self, payload, socket=None, ttl=None) -> str:
        return "MUNGE:" + base64.b64encode(payload).decode() + ":" + self.next_addr

    def decode(self, cred, socket=None):
        _, payload, addr = cred.split(":")
        return munge.Decoded(payload=base64.b64decode(payload), uid=0, gid=0, encode_addr=addr,
                             encode_time=int(self.clock()), ttl=300)


def test_the_decisions_equal_the_daemons_round_on_the_same_reports(quiet, tmp_path):
    """The same agent documents signed and received by the daemon's intake, its round run by
    Controller.evaluate over a FakeBackend, decide exactly what SimController decides."""
    nodes = names(40)  # two failing of 40 stays under the breaker's 10 %
    script = [(T0, "gpu0001", [xid(79)]), (T0 + 2, "gpu0002", [xid(13, 3, "Graphics SM Warp Exception")]),
              (T0 + 4, "gpu0003", [NvmlReading(gpus=(GpuReading(6, {"lost": True}),))]),
              (T0 + 6, "gpu0004", [xid(79, 5)])]
    round_at = [T0 + 1, T0 + 5, T0 + 7, T0 + 60, T0 + 3700]
    policy = {"max_actions_per_hour": 2}

    def run_sim():
        clock = Clock()
        be = FakeBackend(nodes, clock=clock)
        sim = SimController(controller_settings("auto", **policy), be, clock)
        out = []
        try:
            for at in round_at:
                for t, node, inputs in script:
                    if at - 1 <= t < at:
                        clock.t = t
                        sim.report(node, inputs, t)
                clock.t = at
                out.append([(o.node, o.kind, o.status, o.gate, o.reason, o.slurm_reason, o.applied)
                            for o in sim.round(at).outcomes])
            return out, be.writes
        finally:
            sim.close()

    def run_daemon():
        clock = Clock()
        addrs = {n: f"10.0.0.{i + 1}" for i, n in enumerate(nodes)}
        fake = FakeMunge(clock, addrs)
        be = FakeBackend(nodes, clock=clock)
        ledger = Ledger(tmp_path / "daemon.sqlite")
        c = Controller(ControllerSettings(ledger=str(tmp_path / "daemon.sqlite"),
                                          policy=ControllerPolicySettings(mode="auto", **policy)),
                       ledger, be, metrics=ControllerMetrics(), clock=clock, decode=fake.decode,
                       node_addrs=lambda: addrs)
        agents = {n: SimAgent(n) for n in nodes}

        def send(node, inputs, t):
            fake.next_addr = addrs[node]
            status, answer = c.receive_report(sign_report(agents[node].feed(inputs, t), node, None,
                                                          encode=fake.encode))
            assert status == 200, answer

        out = []
        try:
            for n in nodes:
                send(n, [], T0)
            for at in round_at:
                for t, node, inputs in script:
                    if at - 1 <= t < at:
                        clock.t = t
                        send(node, inputs, t)
                clock.t = at
                for n in nodes:  # the heartbeat: every agent reports again
                    if at - T0 > 30:
                        send(n, [], at)
                results = c.evaluate(at) or []
                out.append([(o.decision.node, o.decision.kind, o.status, o.gate, o.reason or o.decision.note,
                             o.decision.reason, r.status if r else None) for o, r in results])
            return out, be.writes
        finally:
            c.close()
            ledger.close()

    sim_out, sim_writes = run_sim()
    daemon_out, daemon_writes = run_daemon()
    assert sim_out == daemon_out
    assert sim_writes == daemon_writes
    assert any(row[2] == "refused" for rnd in sim_out for row in rnd), "the scenario has a refusal"
    assert len(sim_writes) >= 2


# ------------------------------------------------------------------------------ deadlines and the agent


def test_a_silenced_nodes_report_goes_stale_at_the_deadline_the_controller_names(quiet):
    sim, be, clock = make(n=32)
    try:
        sim.round(T0)
        assert sim.next_deadline() is None  # nothing can change without new input
        sim.silence("gpu0005")
        clock.t = T0 + 10
        sim.round(clock.t)
        ttl = sim.controller.policy.report_ttl_s
        assert sim.next_deadline() == T0 + ttl + 1
        clock.t = sim.next_deadline()
        (o,) = sim.round(clock.t).outcomes
        assert (o.node, o.kind) == ("gpu0005", "none") and "old" in o.reason
    finally:
        sim.close()


def test_a_repaired_node_returns_through_the_real_reintegration_with_rounds_only_at_deadlines(quiet):
    sim, be, clock = make(n=32)
    try:
        sim.report("gpu0007", [NvmlReading(gpus=(GpuReading(2, {"lost": True}),))], T0)
        sim.round(T0)
        assert "DRAIN" in node_state(be, "gpu0007").flags
        clock.t = T0 + DAY
        sim.reboot("gpu0007", clock.t)  # repaired: the agent starts on a new boot, the GPU back
        sim.round(clock.t)
        rounds = 0
        while (deadline := sim.next_deadline()) is not None and rounds < 100:
            clock.t = deadline
            sim.round(deadline)
            rounds += 1
        (r,) = sim.ledger.reintegrations(node="gpu0007")
        assert r.state == "passed" and r.probation_until is not None and clock.t >= r.probation_until
        assert not node_state(be, "gpu0007").flags and not sim.ledger.holds()
        assert rounds < 20, f"{rounds} rounds for one reintegration"
    finally:
        sim.close()


def test_with_slurmctld_down_the_round_decides_nothing_and_asks_to_look_again(quiet):
    sim, be, clock = make(n=8)
    try:
        sim.report("gpu0001", [xid(79)], T0)
        be.ctld_down()
        r = sim.round(T0)
        assert not r.ran and not r.outcomes and not r.holds
        assert sim.next_deadline() == T0 + sim.recheck_s
        be.ctld_up()
        clock.t = T0 + 10
        assert [o.node for o in sim.round(clock.t).applied] == ["gpu0001"]
    finally:
        sim.close()
