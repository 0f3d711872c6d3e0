"""Faults for healthd-sim: when each node fails and why, and what each fault looks like to the node's
agent.

Every (node, cause) pair, every job-level cause and every burst has its own random stream, seeded from
the run's seed and the pair's names, and its own clock of *running* time: faults arrive while the job
computes or saves (a Poisson process per pair, rate share / MTBF), not while it is down, and a node
that is a spare or in repair does not fail (the goodput lab's assumptions). So two policies run on one
seed see the same faults on the same nodes at the same running times, whatever else they change
(common random numbers): a node's fault times depend only on how long it has run in the job.

A fault becomes agent input (`AgentInput`): an NVRM Xid kernel line in the format healthd's kernel
log collector reads (healthd.agent.collectors.kernel_parse), an NVML or InfiniBand reading, a host that
stops answering, a stalled in-band ring. The controller seam (healthd.sim.seam.Remediation) hands it
to whatever stands for healthd; the simulator itself never decides what a fault means.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd.sim.scenario import Burst, Cause, Scenario

XID_TEXT: Mapping[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_3b000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000008, Reset channel verif error",
    45: "Ch 00000010, Preemptive cleanup, due to previous errors",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 1.",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap a row, error status 0x1.",
    74: "NVLink: fatal error detected on link 6(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL).",
}
"""Message text after `<xid>, pid=..., name=..., ` for the Xids the scenarios use (from NVIDIA's Xid
catalog's examples); an Xid not listed gets a generic text."""

BUS_IDS = ("0000:18:00", "0000:2a:00", "0000:3a:00", "0000:5d:00", "0000:9a:00", "0000:ab:00", "0000:ba:00",
           "0000:db:00")
"""The PCI address of each GPU index on a simulated 8-GPU node."""


@dataclass(frozen=True)
class AgentInput:
    """What one node's agent sees of a fault."""

    node: str
    kind: str
    """kernel (a kernel log line), nvml (a GPU reading), ib (a port reading), host_down (the node stops
    answering), ring (the in-band ring stops or slows), none."""
    gpu: int | None = None
    """The GPU index it concerns, if any."""
    line: str | None = None
    """For kernel: the line, as the kernel log collector reads it."""
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    """One interruption of the job."""

    time: float
    """Virtual seconds since the run began."""
    cause: Cause
    nodes: tuple[str, ...]
    """The nodes it hit (empty for a job-level cause; several for a burst)."""
    detect_s: float
    """Fault -> the job known to be dead."""
    inputs: tuple[AgentInput, ...]
    burst: str | None = None
    gpu: int | None = None


def kernel_line(xid: int, gpu: int, pid: int = 4242) -> str:
    """An NVRM Xid line as the driver prints it."""
    text = XID_TEXT.get(xid, f"Xid {xid} reported by the simulated driver")
    return f"NVRM: Xid (PCI:{BUS_IDS[gpu % len(BUS_IDS)]}): {xid}, pid={pid}, name=python, {text}"


def agent_inputs(cause: Cause, node: str, gpu: int) -> tuple[AgentInput, ...]:
    """The agent input a cause produces on one node."""
    spec = cause.input
    if spec.kind == "xid" and spec.xid is not None:
        return (AgentInput(node, "kernel", gpu, kernel_line(spec.xid, gpu), dict(spec.fields)),)
    if spec.kind == "nvml":
        return (AgentInput(node, "nvml", gpu, None, dict(spec.fields)),)
    if spec.kind == "ib_port_down":
        return (AgentInput(node, "ib", None, None, {"state": "Down", **spec.fields}),)
    if spec.kind == "host_down":
        return (AgentInput(node, "host_down", None, None, dict(spec.fields)),)
    if spec.kind == "straggler":
        ring = AgentInput(node, "ring", gpu, None, {"ring": "straggler", "slowdown": spec.fields.get("slowdown", 1.0)})
        nvml = spec.fields.get("nvml") or {}
        return (ring, AgentInput(node, "nvml", gpu, None, dict(nvml))) if nvml else (ring,)
    if spec.kind == "hang":
        return (AgentInput(node, "ring", gpu, None, {"ring": "hang", **spec.fields}),)
    return ()


def stream(seed: int, *names: object) -> random.Random:
    """The random stream of one purpose: a string seed, so adding a stream never shifts another."""
    return random.Random("/".join(map(str, (seed, *names))))


class FaultClocks:
    """The running time left until each (node, cause), job cause and burst fires next."""

    def __init__(self, scenario: Scenario, seed: int, nodes: Iterable[str], mtbf_hours: Mapping[str, float]):
        self.seed = seed
        self.causes = scenario.node_causes
        self.job_causes = scenario.job_causes
        self.bursts = scenario.bursts
        self._rates: dict[str, tuple[float, ...]] = {
            n: tuple(c.share / (mtbf_hours[n] * 3600) for c in self.causes) for n in nodes}
        self._streams: dict[tuple[str, str], random.Random] = {}
        self._left: dict[str, list[float]] = {
            n: [self._draw(n, c.name, r) for c, r in zip(self.causes, rates, strict=True)]
            for n, rates in self._rates.items()}
        job_rate = 1 / (scenario.job_mtbi_hours * 3600) if math.isfinite(scenario.job_mtbi_hours) else 0.0
        self._job_rates = tuple(c.share * job_rate for c in self.job_causes)
        self._job_left = [self._draw("job", c.name, r) for c, r in zip(self.job_causes, self._job_rates, strict=True)]
        self._burst_rates = tuple(1 / (b.mtbf_hours * 3600) for b in self.bursts)
        self._burst_left = [self._draw("burst", b.name, r) for b, r in zip(self.bursts, self._burst_rates, strict=True)]

    def _draw(self, owner: str, cause: str, rate: float) -> float:
        if rate <= 0:
            return math.inf
        key = (owner, cause)
        rng = self._streams.get(key)
        if rng is None:
            rng = self._streams[key] = stream(self.seed, "fault", owner, cause)
        return rng.expovariate(rate)

    def next(self, in_job: Iterable[str]) -> tuple[float, str, str | None, int]:
        """(running seconds until the next fault, "node"/"job"/"burst", the node, the index of the cause
        or burst) over the nodes in the job."""
        best, which, node, idx = math.inf, "none", None, -1
        for n in in_job:
            left = self._left[n]
            m = min(left)
            if m < best:
                best, which, node, idx = m, "node", n, left.index(m)
        for i, v in enumerate(self._job_left):
            if v < best:
                best, which, node, idx = v, "job", None, i
        for i, v in enumerate(self._burst_left):
            if v < best:
                best, which, node, idx = v, "burst", None, i
        return best, which, node, idx

    def advance(self, in_job: Iterable[str], dt: float) -> None:
        """`dt` running seconds went by for the job and its nodes."""
        if dt <= 0:
            return
        for n in in_job:
            self._left[n] = [v - dt for v in self._left[n]]
        self._job_left = [v - dt for v in self._job_left]
        self._burst_left = [v - dt for v in self._burst_left]

    def fired(self, which: str, node: str | None, idx: int) -> None:
        """Draw the next time of the clock that just fired."""
        if which == "node" and node is not None:
            self._left[node][idx] = self._draw(node, self.causes[idx].name, self._rates[node][idx])
        elif which == "job":
            self._job_left[idx] = self._draw("job", self.job_causes[idx].name, self._job_rates[idx])
        elif which == "burst":
            self._burst_left[idx] = self._draw("burst", self.bursts[idx].name, self._burst_rates[idx])


def burst_nodes(burst: Burst, scenario: Scenario, fleet: list[str], in_job: list[str], rng: random.Random) -> tuple[str, ...]:
    """The nodes one burst hits: the leaf or PDU of a node of the job (drawn), or `size` nodes of the
    fleet for a driver rollout."""
    if burst.kind == "driver":
        size = min(burst.size or 1, len(fleet))
        return tuple(sorted(rng.sample(fleet, size)))
    width = scenario.fleet.leaf_size if burst.kind == "leaf" else scenario.fleet.pdu_size
    anchor = fleet.index(rng.choice(in_job))
    first = anchor - anchor % width
    return tuple(fleet[first:first + width])
