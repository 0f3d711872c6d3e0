"""Replay: what another configuration (auto mode, a changed threshold) would have done with what a real
controller saw.

The real controller keeps what every round decided on (healthd.controller.history: each node's report
and Slurm's entry for each node, a row per change) and its ledger says what it decided and did. A
replay runs the real control round again (healthd.sim.fleet.SimController: the daemon's own round,
gates, executor and a ledger of its own) under the candidate configuration, on a simulated Slurm
(healthd.sim.slurm.SimSlurm) that starts as the recorded fleet was and takes every change someone
else made (a drain by hand, a resume, a node down or back) when the record shows it, and lists every
decision whose outcome differs from what was recorded, or from what was done by hand.

Rounds run at every recorded change and every `tick_s` between them (the real controller's rounds are
seconds apart; what changes between changes is time alone: a report going stale, a rate limit's
hour). Reports are put before the round as they were kept, each as fresh as the record says it stayed
(a node that stopped reporting goes stale in the replay when it did).

Measured and modelled, said in every result:

* measured: the recorded reports, Slurm's recorded entries and the recorded decisions and actions; the
  candidate's decisions are the real round's on those inputs, and when each would have been made.
* modelled: what the candidate's own writes would have changed afterwards. SimSlurm carries out its
  drains, resumes and reboots as slurmctld would, but nothing recorded says what the node, its jobs
  or the operators would have done next (a drained node's later reports are the recorded ones; jobs
  are not in the record, so no requeue finds a job to requeue). The time gained or lost is the
  difference between the candidate's write and the recorded one (by healthd or by hand); GPU time
  is that difference times the node's GPUs, a model figure, labelled as such.
* measured from the jobs' goodput logs, where they are given (`--goodput`, the controller's
  goodput.directory): for a drain the candidate makes before the record does (or that the record
  never makes: then up to the node's next recorded drain or down, else the replay's end), the
  GPU-seconds that the jobs whose runs held the node spent in that window, by category of their own
  accounts (healthd.goodput): productive, the work an earlier drain would have interrupted, and the
  rest, already lost, at best what it could have saved. For a recorded drain the candidate would not
  make (or makes later), the interruption cost it caused the jobs (their incident charged to the
  node at the drain's time, from the ledger's requeues): what the candidate would have avoided if
  the drain was a false positive. Where no job's log covers the node, the result says so. What a
  job would have done after a drain it did not get is not measured anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sqlite3
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from healthd import goodput
from healthd.config import ConfigError, read_config_text, set_dotted, yaml_mapping
from healthd.controller import goodput_ledger
from healthd.controller.config import ControllerSettings, parse_controller_settings
from healthd.controller.goodput_gather import job_parts
from healthd.controller.goodput_jobs import MAX_LOG_BYTES
from healthd.controller.history import History, HistoryError, Span
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.policy import NodeReport
from healthd.goodput_events import LOG_SUFFIX
from healthd.reason import is_healthd_reason
from healthd.sim.fleet import Outcome, SimController
from healthd.sim.slurm import SimSlurm
from healthd.slurm.backend import NodeInfo, SlurmError
from healthd.text import parse_time, stamp

WRITES = frozenset({"drain", "drain-and-requeue", "reboot-asap", "resume", "release", "requeue"})
"""Decision kinds that write to Slurm when allowed (a `none` decision records only)."""
MATCH_S = 900.0
"""A candidate's write and a recorded one of the same kind on the same node within this many seconds
are the same decision (the candidate's rounds run on a tick, the real ones every few seconds)."""


@dataclass(frozen=True)
class Recorded:
    """One thing the record says happened to a node: a decision of healthd's or a change by hand."""

    at: float
    node: str
    kind: str
    """The decision's kind, or `drain-by-hand` / `resume-by-hand` / `down` / `up` for Slurm's changes."""
    outcome: str
    """allowed / refused / waiting (healthd's decisions), `done` (changes by hand)."""
    gate: str | None = None
    who: str | None = None
    """For a change by hand: the reason's user as Slurm showed it."""
    reason: str = ""


DRAINS = frozenset({"drain", "drain-and-requeue", "reboot-asap"})
"""Decision kinds that take a node out of scheduling: their goodput effect is looked up in the jobs'
logs."""
INTERRUPTS = DRAINS | {"requeue"}
"""Recorded writes whose interruption of a job its log can show (an `interrupt` on the node)."""


@dataclass(frozen=True)
class JobsEffect:
    """Measured, from the jobs' own goodput logs: what the jobs on a node did while a drain that differs
    was or was not in place. Either the window of a candidate's earlier drain, or the interruption a
    recorded drain caused."""

    window: tuple[float, float] | None = None
    """From the candidate's drain to the recorded one (by healthd or by hand), or, with none recorded,
    to the node's next recorded drain or down, else the replay's end. None for a recorded drain the
    candidate would not make, or makes later."""
    gpu_h: Mapping[str, float] = field(default_factory=dict)
    """Category -> GPU-hours that the jobs whose runs held the node spent in the window, with all of
    their GPUs (a synchronous job stops whole when one of its nodes goes)."""
    productive_gpu_h: float | None = None
    """Of gpu_h, the productive time: the work an earlier drain would have interrupted (a drain with a
    requeue at once; a plain drain lets a running job go on)."""
    unproductive_gpu_h: float | None = None
    """Of gpu_h, every other category (lost work, detection, waiting, straggler, checkpoint, ...): the
    time already lost, at best what an earlier drain could have saved."""
    interruption_gpu_h: Mapping[str, float] = field(default_factory=dict)
    """Category -> GPU-hours: the interruption cost of each job's incident the recorded drain caused
    (the job's `interrupt` on the node, from the ledger's requeues), all of it `false_positive` when
    its action was judged wrong. What the candidate would have avoided if the drain was a false
    positive."""
    jobs: tuple[str, ...] = ()
    """The jobs measured."""
    incidents: tuple[str, ...] = ()
    """The incidents whose interruption cost is in interruption_gpu_h."""
    partial: bool = False
    """A job measured has a partial account (a log that could not be read whole)."""
    note: str = ""
    """What was measured, or why nothing was."""


@dataclass(frozen=True)
class Difference:
    """A decision whose outcome under the candidate differs from the record."""

    node: str
    kind: str
    candidate_at: float | None
    candidate: str
    """What the candidate's round did: `applied`, `refused by GATE`, `waiting for approval`, `not decided`."""
    recorded_at: float | None
    recorded: str
    """What the record says: healthd's outcome, a change by hand (with its user), or `nothing`."""
    gate: str | None
    evidence: tuple[str, ...]
    earlier_s: float | None = None
    """Measured: how much earlier (positive) or later the candidate's write is than the recorded one."""
    gpu_hours: float | None = None
    """Modelled: earlier_s times the node's GPUs, in GPU-hours (None when there is no recorded write)."""
    jobs: JobsEffect | None = None
    """Measured, from the jobs' goodput logs: what the node's jobs did while the difference lasted
    (None: not a drain, or the jobs' logs were not given)."""


@dataclass(frozen=True)
class ReplayResult:
    start: float
    end: float
    rounds: int
    mode: str
    differences: tuple[Difference, ...]
    candidate: Mapping[str, int] = field(default_factory=dict)
    """The candidate's decisions by outcome (applied, refused by each gate, waiting), each node and kind
    counted once per outcome however many rounds it came back in."""
    recorded: Mapping[str, int] = field(default_factory=dict)
    """The record's: healthd's decisions by outcome, changes by hand."""
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "rounds": self.rounds, "mode": self.mode,
                "candidate": dict(self.candidate), "recorded": dict(self.recorded), "notes": list(self.notes),
                "differences": [dataclasses.asdict(d) for d in self.differences]}


class ReplayError(ValueError):
    """The record cannot be replayed (nothing kept in the window asked, a file that is not a record)."""


# --------------------------------------------------------------------------- the record


def recorded_decisions(ledger: Ledger | None, start: float, end: float) -> list[Recorded]:
    """healthd's decisions in [start, end] as the ledger has them (decisions of kind none left out)."""
    if ledger is None:
        return []
    out = []
    for d in ledger.decisions():
        if start <= d.decided_at <= end and d.kind != "none":
            out.append(Recorded(d.decided_at, d.node, d.kind, d.outcome, d.refused_gate, reason=d.reason))
    return sorted(out, key=lambda r: (r.at, r.node))


def _foreign_drain(info: NodeInfo) -> bool:
    """Drained with a reason that is not healthd's: someone else's drain."""
    return info.drain_requested and not is_healthd_reason(info.reason)


def changes_by_hand(spans: Iterable[Span]) -> list[Recorded]:
    """The recorded changes of Slurm's entries that were not healthd's: drains with a reason that is
    not healthd's, resumes of such drains, nodes going down and coming back. A node's first row is
    how it started, not a change."""
    out: list[Recorded] = []
    last: dict[str, NodeInfo] = {}
    for span in sorted(spans, key=lambda s: (s.since, s.node)):
        info: NodeInfo = span.value
        before = last.get(span.node)
        last[span.node] = info
        if before is None:
            continue
        foreign_now, foreign_before = _foreign_drain(info), _foreign_drain(before)
        if foreign_now and (not foreign_before or info.reason != before.reason):
            out.append(Recorded(span.since, span.node, "drain-by-hand", "done", who=info.reason_user, reason=info.reason))
        elif foreign_before and not info.drain_requested:
            out.append(Recorded(span.since, span.node, "resume-by-hand", "done", who=None, reason=before.reason))
        if info.state == "down" and before.state != "down":
            out.append(Recorded(span.since, span.node, "down", "done", reason=info.reason))
        elif before.state == "down" and info.state != "down":
            out.append(Recorded(span.since, span.node, "up", "done"))
    return out


# --------------------------------------------------------------------------- the replay


def _gpus(info: NodeInfo) -> int:
    gres = info.gres or ""
    for part in gres.split(","):
        bits = part.split(":")
        if bits[0] == "gpu" and bits[-1].split("(")[0].isdigit():
            return int(bits[-1].split("(")[0])
    return 0


class _Slurm:
    """The simulated Slurm of a replay, made to show every change by hand when the record does."""

    def __init__(self, first: Mapping[str, NodeInfo], clock):
        partitions: dict[str, list[str]] = defaultdict(list)
        for name, info in first.items():
            for p in info.partitions or ("gpu",):
                partitions[p].append(name)
        self.sim = SimSlurm(sorted(first), clock=clock, partitions=dict(partitions))
        self.gpus = {name: _gpus(info) for name, info in first.items()}
        for name, info in first.items():
            self.show(name, None, info)

    def show(self, node: str, before: NodeInfo | None, info: NodeInfo) -> None:
        """What someone else did to `node`, as the record shows it (healthd's own reasons are left to
        the candidate's round)."""
        try:
            if info.state == "down" and (before is None or before.state != "down"):
                self.sim.node_down(node, info.reason or "Not responding")
            elif before is not None and before.state == "down" and info.state != "down":
                self.sim.node_up(node)
            foreign, was_foreign = _foreign_drain(info), before is not None and _foreign_drain(before)
            if foreign and (not was_foreign or before.reason != info.reason):
                self.sim.drain(node, info.reason or "drained")
            elif was_foreign and not info.drain_requested:
                self.sim.resume(node)
        except SlurmError:
            pass  # the candidate's own write already put the node where Slurm refuses this one


def _as_of(span: Span, now: float) -> NodeReport:
    """The kept report as the round at `now` had it: received just then while the node kept sending
    it, else when it last did."""
    report: NodeReport = span.value
    return dataclasses.replace(report, received_at=now if span.fresh else min(report.received_at, now))


def replay(history: History, settings: ControllerSettings, *, recorded: Ledger | None = None,
           start: float | None = None, end: float | None = None, tick_s: float = 60.0,
           topology_text: str = "", jobs: JobLogs | None = None) -> ReplayResult:
    """Run the record in `history` (and `recorded`, the real controller's ledger) again under
    `settings`, with each drain that differs looked up in the jobs' goodput logs (`jobs`, None: not
    given); see the module docstring."""
    span = history.span()
    if span is None:
        raise ReplayError(f"{history.path}: nothing kept")
    start = span[0] if start is None else max(start, span[0])
    end = span[1] if end is None else min(end, span[1])
    if start > end:
        raise ReplayError(f"{history.path}: nothing kept between the times asked (kept: {span[0]:.0f}-{span[1]:.0f})")
    reports = sorted(history.reports(start, end), key=lambda s: (s.since, s.node))
    nodes = sorted(history.slurm_nodes(start, end), key=lambda s: (s.since, s.node))
    if not nodes:
        raise ReplayError(f"{history.path}: no Slurm entries kept in the window")
    first = {s.node: s.value for s in nodes if s.since <= start <= s.until}
    for s in nodes:
        first.setdefault(s.node, s.value)

    clock = [start]
    slurm = _Slurm(first, lambda: clock[0])
    sim = SimController(settings, slurm.sim, lambda: clock[0], topology_text=topology_text)
    times = sorted({start, end, *(s.since for s in reports + nodes if start <= s.since <= end),
                    *(s.until + 1e-3 for s in reports if s.until + 1e-3 <= end)} |
                   {start + i * tick_s for i in range(int((end - start) // tick_s) + 1)})
    shown: dict[str, NodeInfo] = dict(first)
    outcomes: list[tuple[float, Outcome]] = []
    rounds = 0
    try:
        ri = ni = 0
        live: dict[str, Span] = {}
        for now in times:
            clock[0] = now
            while ni < len(nodes) and nodes[ni].since <= now:
                s = nodes[ni]
                ni += 1
                if s.node in shown and shown[s.node] is not s.value and s.since > start:
                    slurm.show(s.node, shown[s.node], s.value)
                shown[s.node] = s.value
            while ri < len(reports) and reports[ri].since <= now:
                live[reports[ri].node] = reports[ri]
                ri += 1
            current = {n: _as_of(sp, now) for n, sp in live.items() if sp.until >= now}
            with sim.controller.reports_lock:
                sim.controller.reports.clear()
                sim.controller.reports.update(current)
            result = sim.controller.evaluate(now)
            rounds += 1
            outcomes += [(now, Outcome.of(o, r)) for o, r in result or ()]
    finally:
        sim.close()

    decided = recorded_decisions(recorded, start, end)
    by_hand = changes_by_hand(nodes)
    diffs = differences(outcomes, decided, by_hand, slurm.gpus)
    if jobs is not None and jobs.read:
        stops: dict[str, list[float]] = defaultdict(list)
        for r in [*decided, *by_hand]:
            if r.kind in ("drain-by-hand", "down") or r.kind in DRAINS and r.outcome == "allowed":
                stops[r.node].append(r.at)
        effects = jobs_effects(diffs, jobs.records, stops, end)
        diffs = [dataclasses.replace(d, jobs=e) for d, e in zip(diffs, effects, strict=True)]
    return ReplayResult(start=start, end=end, rounds=rounds, mode=settings.policy.mode,
                        differences=tuple(diffs),
                        candidate=_count(status for _, _, status in
                                         {(o.node, o.kind, _candidate_status(o)) for _, o in outcomes if o.kind != "none"}),
                        recorded=_count([f"{r.outcome}" + (f" by {r.gate}" if r.gate else "") for r in decided]
                                        + [r.kind for r in by_hand]),
                        notes=_notes(recorded, jobs))


def _notes(recorded: Ledger | None, jobs: JobLogs | None) -> tuple[str, ...]:
    notes = ["measured: the recorded reports, Slurm's entries, decisions and changes by hand, and the times "
             "the candidate's round would have acted on them",
             "modelled: what the candidate's own writes changed afterwards (the record goes on as it was); "
             "GPU-H (model) is the time difference times the node's GPUs"]
    if jobs is None:
        notes.append("the jobs' goodput logs were not given (--goodput DIR): no goodput figure is measured")
    elif jobs.read:
        notes.append(f"measured, from the jobs' goodput logs in {jobs.source} ({len(jobs.records)} job(s)): for a "
                     "drain the candidate makes earlier, the GPU-hours that the jobs on the node spent until the "
                     "recorded drain (with none: the node's next recorded drain or down, else the replay's end), "
                     "productive (what an earlier drain would have interrupted) and unproductive (what it could "
                     "at best have saved); for a recorded drain the candidate would not make (or makes later), "
                     "the interruption cost it caused the jobs; what a job would have done after a drain it did "
                     "not get is not measured")
    notes += jobs.notes if jobs is not None else ()
    if recorded is None:
        notes.append("no ledger given: healthd's recorded decisions are not compared, only changes by hand")
    return tuple(notes)


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for i in items:
        out[i] += 1
    return dict(sorted(out.items()))


def _candidate_status(o: Outcome) -> str:
    if o.status == "allowed":
        return "applied" if o.applied is not None or o.kind not in WRITES else "allowed, not applied"
    if o.status == "waiting-approval":
        return "waiting for approval"
    if o.status == "refused":
        return f"refused by {o.gate}"
    return o.status


def differences(outcomes: Sequence[tuple[float, Outcome]], decided: Sequence[Recorded], by_hand: Sequence[Recorded],
                gpus: Mapping[str, int]) -> list[Difference]:
    """The candidate's outcomes (each with its round's time) against the record, per node and kind: a
    write the candidate makes that the record has not (or has later, earlier, or only by hand), a
    recorded write the candidate would not make, and a refusal by another gate. Per node and kind the
    candidate's first write counts, else its first outcome."""
    out: list[Difference] = []
    first: dict[tuple[str, str], tuple[float, Outcome]] = {}
    for when, o in outcomes:
        if o.kind == "none":
            continue
        key = (o.node, o.kind)
        if key not in first or (first[key][1].status != "allowed" and o.status == "allowed"):
            first[key] = (when, o)
    recorded_writes = {(r.node, r.kind): r for r in decided if r.outcome == "allowed"}
    recorded_any = {}
    for r in decided:
        recorded_any.setdefault((r.node, r.kind), r)
    hand_drains = {}
    for r in by_hand:
        if r.kind == "drain-by-hand":
            hand_drains.setdefault(r.node, r)
    for (node, kind), (when, o) in sorted(first.items()):
        mine = _candidate_status(o)
        rec = recorded_writes.get((node, kind))
        if o.status == "allowed" and kind in WRITES:
            if rec is not None and abs(rec.at - when) <= MATCH_S:
                continue
            hand = hand_drains.get(node) if kind.startswith("drain") else None
            if rec is not None:
                earlier = rec.at - when
                out.append(Difference(node, kind, when, mine, rec.at, f"healthd applied it {_ago(earlier)}",
                                      None, o.evidence, earlier, _gpu_h(earlier, gpus.get(node, 0))))
            elif hand is not None:
                earlier = hand.at - when
                out.append(Difference(node, kind, when, mine, hand.at,
                                      f"drained by hand{f' by {hand.who}' if hand.who else ''}: {hand.reason}",
                                      None, o.evidence, earlier, _gpu_h(earlier, gpus.get(node, 0))))
            else:
                other = recorded_any.get((node, kind))
                said = (f"healthd decided it: {other.outcome}" + (f" by {other.gate}" if other.gate else "")
                        if other is not None else "nothing")
                out.append(Difference(node, kind, when, mine, other.at if other else None, said, None, o.evidence))
        else:
            other = recorded_any.get((node, kind))
            if other is not None and other.outcome == ("refused" if o.status == "refused" else "waiting") and \
                    other.gate == o.gate:
                continue
            if other is None and o.status in ("refused", "waiting-approval"):
                said = "nothing"
            elif other is not None:
                said = f"healthd decided it: {other.outcome}" + (f" by {other.gate}" if other.gate else "")
            else:
                continue
            out.append(Difference(node, kind, when, mine, other.at if other else None, said, o.gate, o.evidence))
    for (node, kind), rec in sorted(recorded_writes.items()):
        found = first.get((node, kind))
        if found is None or found[1].status != "allowed":
            mine = "not decided" if found is None else _candidate_status(found[1])
            out.append(Difference(node, kind, found[0] if found else None, mine, rec.at, "healthd applied it",
                                  found[1].gate if found else None, found[1].evidence if found else ()))
    return sorted(out, key=lambda d: (d.candidate_at if d.candidate_at is not None else d.recorded_at or 0, d.node))


def _ago(earlier_s: float) -> str:
    return f"{abs(earlier_s) / 60:.0f} min {'later' if earlier_s > 0 else 'earlier'}"


def _gpu_h(earlier_s: float, gpus: int) -> float | None:
    return round(earlier_s * gpus / 3600.0, 3) if gpus else None


# --------------------------------------------------------------------------- the jobs' goodput logs


NOT_A_NODE = frozenset({"", "ledger", "accounting"})
"""Parts of a job's log that no node wrote (the controller's own part starts with `_`)."""


@dataclass(frozen=True)
class JobRecord:
    """One job as its own goodput log has it, read once for every difference."""

    job: str
    runs: tuple[tuple[float, float, int, frozenset[str]], ...]
    """(start, end, GPUs, the nodes the log says it held) of each run, in order."""
    account: goodput.Account
    interrupts: tuple[tuple[float, str, str], ...] = ()
    """(time, node, incident) of each `interrupt` record: an action healthd applied to the job."""

    @classmethod
    def of(cls, job: str, log: goodput.Log, now: float | None = None) -> JobRecord:
        """The record of `log` (accounted at `now`, as healthd.goodput.account takes it)."""
        runs, _ = goodput.runs_of(log, now)
        interrupts = tuple((e.time, str(e.data["node"]), str(e.data.get("incident"))) for r in runs for e in r.events
                           if e.kind == "interrupt" and isinstance(e.data.get("node"), str))
        return cls(job, tuple((r.start, r.end, r.gpus, run_nodes(r)) for r in runs), goodput.account(log, now),
                   interrupts)


def run_nodes(run: goodput.Run) -> frozenset[str]:
    """The nodes a run's log says it held: its allocation record's `nodes`, the controller's `ranks`
    record, the node whose part of the gathered log holds its lines (rank 0's), and the node an
    interrupt or a straggler record names."""
    out: set[str] = set()
    for e in run.events:
        if e.part not in NOT_A_NODE and not e.part.startswith("_"):
            out.add(e.part)
        if e.kind == "allocation" and isinstance(e.data.get("nodes"), list):
            out.update(n for n in e.data["nodes"] if isinstance(n, str))
        elif e.kind == "ranks" and isinstance(e.data.get("ranks"), list):
            out.update(r["node"] for r in e.data["ranks"] if isinstance(r, dict) and isinstance(r.get("node"), str))
        elif e.kind in ("interrupt", "straggler") and isinstance(e.data.get("node"), str):
            out.add(e.data["node"])
    return frozenset(out)


def window_gpu_s(record: JobRecord, node: str, start: float, end: float) -> dict[str, float] | None:
    """Category -> GPU-seconds of the job's runs that held `node`, inside [start, end], from its own
    account's timeline; None when no run of it held the node then."""
    held = [(max(a, start), min(b, end), gpus) for a, b, gpus, nodes in record.runs
            if node in nodes and min(b, end) > max(a, start)]
    if not held:
        return None
    out: dict[str, float] = defaultdict(float)
    for lo, hi, gpus in held:
        for a, b, category in record.account.timeline:
            inside = min(b, hi) - max(a, lo)
            if inside > 0:
                out[category] += inside * gpus
    return dict(out)


def _hours(gpu_s: Mapping[str, float]) -> dict[str, float]:
    return {c: round(v / 3600.0, 6) for c, v in sorted(gpu_s.items()) if v > 0}


def _window_effect(node: str, start: float, end: float, records: Sequence[JobRecord]) -> JobsEffect:
    total: dict[str, float] = defaultdict(float)
    jobs, partial = [], False
    for rec in records:
        got = window_gpu_s(rec, node, start, end)
        if got is None:
            continue
        jobs.append(rec.job)
        partial = partial or rec.account.partial
        for c, v in got.items():
            total[c] += v
    if not jobs:
        return JobsEffect(window=(start, end), note=f"no job's log covers {node} in the window")
    productive = total.get("productive", 0.0)
    unproductive = sum(v for c, v in total.items() if c != "productive")
    return JobsEffect(window=(start, end), gpu_h=_hours(total), productive_gpu_h=round(productive / 3600.0, 6),
                      unproductive_gpu_h=round(unproductive / 3600.0, 6), jobs=tuple(jobs), partial=partial,
                      note=f"measured: {len(jobs)} job(s) on {node} in the window")


def _interruption_effect(node: str, at: float, records: Sequence[JobRecord]) -> JobsEffect:
    total: dict[str, float] = defaultdict(float)
    jobs, incidents, partial = [], [], False
    for rec in records:
        keys = {key for t, n, key in rec.interrupts if n == node and at - 1.0 <= t <= at + MATCH_S}
        found = [i for i in rec.account.incidents if i.incident in keys]
        if not found:
            continue
        jobs.append(rec.job)
        partial = partial or rec.account.partial
        for inc in found:
            incidents.append(inc.incident)
            for c, v in inc.gpu_s.items():
                total[c] += v
    if not jobs:
        return JobsEffect(note=f"no job's log has an interruption on {node} at the recorded drain (one is named "
                               "by node where the ledger's requeues are joined to the job's log)")
    return JobsEffect(interruption_gpu_h=_hours(total), jobs=tuple(jobs), incidents=tuple(incidents), partial=partial,
                      note=f"measured: the interruption the recorded drain caused to {len(jobs)} job(s)")


def jobs_effects(diffs: Sequence[Difference], records: Sequence[JobRecord], stops: Mapping[str, Sequence[float]],
                 end: float) -> tuple[JobsEffect | None, ...]:
    """For each difference, what the jobs' logs measured (None: not a drain, or the candidate's drain
    was refused or is the same as the record's). A candidate's drain before the recorded one (or with
    none recorded): the window from it to the recorded one, else to the node's next time in `stops`
    (its recorded drains and downs), else `end`. A recorded drain the candidate would not make, or
    makes later: the interruption it caused. Pure."""
    out: list[JobsEffect | None] = []
    for d in diffs:
        applied = d.candidate == "applied" and d.candidate_at is not None
        recorded_write = d.recorded_at is not None and d.earlier_s is not None
        if d.kind in DRAINS and applied and (d.earlier_s is None or d.earlier_s > 0):
            at = d.candidate_at
            assert at is not None
            until = d.recorded_at if recorded_write and d.recorded_at is not None else \
                min([t for t in stops.get(d.node, ()) if t > at], default=end)
            out.append(_window_effect(d.node, at, until, records))
        elif d.kind in INTERRUPTS and d.recorded_at is not None and \
                (d.recorded == "healthd applied it" or recorded_write and (d.earlier_s or 0.0) < 0):
            out.append(_interruption_effect(d.node, d.recorded_at, records))
        else:
            out.append(None)
    return tuple(out)


@dataclass(frozen=True)
class JobLogs:
    """The jobs' goodput logs as read for a replay (the edge: healthd.sim.replay.read_job_logs)."""

    source: str
    """The directory they were read from."""
    records: tuple[JobRecord, ...] = ()
    notes: tuple[str, ...] = ()
    """What could not be read, and the logs that are partial."""
    read: bool = True
    """False: the directory itself could not be read, so nothing is measured."""


MAX_NOTED = 8
"""Notes about single jobs' logs kept in a result; the rest are counted."""


def read_job_logs(directory: str, *, ledger: str | None = None, since: float | None = None) -> JobLogs:
    """Every job's gathered log under `directory` (`<job>/<node>.jsonl`, the controller's
    goodput.directory, or a node's own `<job>.jsonl`) whose newest part was written at or after
    `since`, with the ledger's requeues and their incidents joined where `ledger` can be read. A
    directory, a job or a part that cannot be read is a note, never an exception."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return JobLogs(directory, notes=(f"{directory}: the jobs' goodput logs not read: {exc.strerror or exc}",),
                       read=False)
    requeues = goodput_ledger.ledger_requeues(ledger) if ledger else None
    records: list[JobRecord] = []
    notes: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                job, paths = name, job_parts(path)
            elif name.endswith(LOG_SUFFIX) and os.path.isfile(path):
                job, paths = name.removesuffix(LOG_SUFFIX), [path]
            else:
                continue
            if not paths or (since is not None and max(os.stat(p).st_mtime for p in paths) < since):
                continue
            # not goodput_gather.read_parts: that leaves a one-part log unnamed, and a part's name is the
            # node a run held (run_nodes)
            parts = []
            for p in paths:
                with open(p, "rb") as f:
                    text = f.read(MAX_LOG_BYTES).decode("utf-8", errors="replace")
                part = os.path.basename(p).removesuffix(LOG_SUFFIX) if p != path else ""
                parts.append((part, goodput.parse_log(text, job, part)))
            log, _ = goodput_ledger.joined(goodput.merge(parts), requeues)
            rec = JobRecord.of(job, log)
        except (OSError, ValueError) as exc:
            notes.append(f"job {name}: its goodput log not read: {getattr(exc, 'strerror', None) or exc}")
            continue
        if rec.account.partial:
            notes.append(f"job {job}: its goodput log is partial ({rec.account.problems[0]})")
        if rec.runs:
            records.append(rec)
    if len(notes) > MAX_NOTED:
        notes = [*notes[:MAX_NOTED], f"and {len(notes) - MAX_NOTED} more job(s) with a log not read whole"]
    return JobLogs(directory, tuple(records), tuple(notes))


# --------------------------------------------------------------------------- the command


def _when(text: str) -> float:
    """RFC 3339 with a time zone, or a number of days or hours before now (7d, 12h)."""
    if text[-1:] in ("d", "h"):
        try:
            return time.time() - float(text[:-1]) * (86400 if text.endswith("d") else 3600)
        except ValueError:
            pass
    at = parse_time(text)
    if at is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RFC 3339 with a time zone, or days or hours (7d, 12h)")
    return at


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. policy.breaker_min_nodes=3")
    return key, yaml.safe_load(value)


def candidate_settings(config: str | None, mode: str | None, overrides: Sequence[tuple[str, Any]]) -> ControllerSettings:
    """The controller's configuration (`config`, a YAML file; None: the defaults) with `mode` and each
    dotted KEY=VALUE put on top, read by the controller's own config parser (a bad key or value is
    its error)."""
    raw: dict[str, Any] = {}
    if config is not None:
        text = read_config_text(config, must_exist=True) or ""
        raw = yaml_mapping(text, config)
    for key, value in [*overrides, *((("policy.mode", mode),) if mode else ())]:
        try:
            set_dotted(raw, key, value)
        except ValueError as e:
            raise ConfigError(config or "<overrides>", key, "a mapping above it", str(e)) from None
    return parse_controller_settings(yaml.safe_dump(raw), config or "<overrides>")


def table(result: ReplayResult) -> list[str]:
    """The replay as a person reads it."""
    lines = [f"replay {stamp(result.start)} .. {stamp(result.end)}: {result.rounds} rounds, candidate mode "
             f"{result.mode}",
             "candidate: " + (", ".join(f"{k} {v}" for k, v in result.candidate.items()) or "no decision"),
             "record:    " + (", ".join(f"{k} {v}" for k, v in result.recorded.items()) or "no decision, nothing by hand")]
    if not result.differences:
        lines.append("no decision differs from the record")
    else:
        rows = [("NODE", "DECISION", "CANDIDATE", "AT", "RECORD", "AT", "EARLIER", "GPU-H (model)",
                 "JOBS GPU-H (measured) productive/unproductive")]
        for d in result.differences:
            rows.append((d.node, d.kind, d.candidate, stamp(d.candidate_at) if d.candidate_at else "-",
                         d.recorded, stamp(d.recorded_at) if d.recorded_at else "-",
                         f"{d.earlier_s / 60:+.0f} min" if d.earlier_s is not None else "-",
                         f"{d.gpu_hours:+.1f}" if d.gpu_hours is not None else "-", _measured(d.jobs)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.append("evidence:")
        lines += [f"  {d.node} {d.kind}: {'; '.join(d.evidence[:2]) or '-'}" for d in result.differences]
        measured = [d for d in result.differences if d.jobs is not None]
        if measured:
            lines.append("measured in the jobs' goodput logs (GPU-hours):")
            lines += [f"  {d.node} {d.kind}: {_detail(d.jobs)}" for d in measured if d.jobs is not None]
    lines += [f"note: {n}" for n in result.notes]
    return lines


def _measured(e: JobsEffect | None) -> str:
    """A difference's measured cell."""
    if e is None:
        return "-"
    partial = " (partial)" if e.partial else ""
    if e.productive_gpu_h is not None and e.unproductive_gpu_h is not None:
        return f"{_h(e.productive_gpu_h)}/{_h(e.unproductive_gpu_h)}{partial}"
    if e.interruption_gpu_h:
        wrong = " (false positive)" if "false_positive" in e.interruption_gpu_h else ""
        return f"interruption {_h(sum(e.interruption_gpu_h.values()))}{wrong}{partial}"
    return "no job's log covers it"


def _h(gpu_h: float) -> str:
    """GPU-hours to two decimals, or four where two would show a small figure as none."""
    return f"{gpu_h:.2f}" if gpu_h == 0 or abs(gpu_h) >= 0.1 else f"{gpu_h:.4f}"


def _detail(e: JobsEffect) -> str:
    where = f"{stamp(e.window[0])} .. {stamp(e.window[1])}, " if e.window is not None else ""
    figures = e.gpu_h or e.interruption_gpu_h
    what = ", ".join(f"{c} {_h(v)}" for c, v in figures.items())
    if not e.jobs:
        return f"{where}{e.note}"
    held = f"incident(s) {', '.join(e.incidents)}: " if e.incidents else ""
    return f"{where}job(s) {', '.join(e.jobs)}: {held}{what or 'nothing held'}{' (partial)' if e.partial else ''}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="healthd-sim replay", description="What another configuration would have "
                                 "done with what a real controller saw (its history and ledger).")
    ap.add_argument("--history", required=True, help="the controller's history.sqlite (history.path)")
    ap.add_argument("--ledger", default=None, help="the controller's ledger, to compare its decisions (read-only)")
    ap.add_argument("--config", default=None, help="the configuration to replay under (a controller.yaml; "
                    "default: the built-in defaults)")
    ap.add_argument("--mode", choices=("observe", "supervised", "auto"), default=None, help="policy.mode on top")
    ap.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="KEY=VALUE",
                    help="a setting on top, dotted: policy.breaker_min_nodes=3 (repeatable)")
    ap.add_argument("--since", type=_when, default=None, help="from (RFC 3339, or 7d / 12h ago)")
    ap.add_argument("--until", type=_when, default=None, help="to (default: the end of the record)")
    ap.add_argument("--tick", type=float, default=60.0, help="seconds between rounds when nothing changes (default 60)")
    ap.add_argument("--goodput", default=None, metavar="DIR", help="the jobs' gathered goodput logs "
                    "(goodput.directory), to measure what the node's jobs did in each drain that differs "
                    "(default: not given, nothing measured)")
    ap.add_argument("--format", choices=("table", "json"), default="table")
    args = ap.parse_args(argv)
    try:
        settings = candidate_settings(args.config, args.mode, args.overrides)
        if not os.path.exists(args.history):
            raise ReplayError(f"{args.history}: no history there (history.enabled, beside the ledger)")
        history = History(args.history, readonly=True)
        ledger = Ledger.open_readonly(args.ledger) if args.ledger else None
        jobs = read_job_logs(args.goodput, ledger=args.ledger, since=args.since) if args.goodput else None
        try:
            result = replay(history, settings, recorded=ledger, start=args.since, end=args.until, tick_s=args.tick,
                            jobs=jobs)
        finally:
            history.close()
            if ledger is not None:
                ledger.close()
    except (ReplayError, ConfigError, HistoryError, LedgerError, sqlite3.Error, OSError) as exc:
        print(f"healthd-sim replay: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    else:
        print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
