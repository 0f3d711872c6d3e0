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

from healthd.config import ConfigError, read_config_text, yaml_mapping
from healthd.controller.config import ControllerSettings, parse_controller_settings
from healthd.controller.history import History, HistoryError, Span
from healthd.controller.ledger import Ledger, LedgerError
from healthd.controller.policy import NodeReport
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
           topology_text: str = "") -> ReplayResult:
    """Run the record in `history` (and `recorded`, the real controller's ledger) again under
    `settings`; see the module docstring."""
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
    return ReplayResult(start=start, end=end, rounds=rounds, mode=settings.policy.mode,
                        differences=tuple(differences(outcomes, decided, by_hand, slurm.gpus)),
                        candidate=_count(status for _, _, status in
                                         {(o.node, o.kind, _candidate_status(o)) for _, o in outcomes if o.kind != "none"}),
                        recorded=_count([f"{r.outcome}" + (f" by {r.gate}" if r.gate else "") for r in decided]
                                        + [r.kind for r in by_hand]),
                        notes=_notes(recorded, by_hand))


def _notes(recorded: Ledger | None, by_hand: Sequence[Recorded]) -> tuple[str, ...]:
    notes = ["measured: the recorded reports, Slurm's entries, decisions and changes by hand, and the times "
             "the candidate's round would have acted on them",
             "modelled: what the candidate's own writes changed afterwards (the record goes on as it was); "
             "GPU-hours are the time difference times the node's GPUs"]
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
        here = raw
        *path, last = key.split(".")
        for part in path:
            nxt = here.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(config or "<overrides>", key, "a mapping above it", nxt)
            here = nxt
        here[last] = value
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
        rows = [("NODE", "DECISION", "CANDIDATE", "AT", "RECORD", "AT", "EARLIER", "GPU-H (model)")]
        for d in result.differences:
            rows.append((d.node, d.kind, d.candidate, stamp(d.candidate_at) if d.candidate_at else "-",
                         d.recorded, stamp(d.recorded_at) if d.recorded_at else "-",
                         f"{d.earlier_s / 60:+.0f} min" if d.earlier_s is not None else "-",
                         f"{d.gpu_hours:+.1f}" if d.gpu_hours is not None else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.append("evidence:")
        lines += [f"  {d.node} {d.kind}: {'; '.join(d.evidence[:2]) or '-'}" for d in result.differences]
    lines += [f"note: {n}" for n in result.notes]
    return lines


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
    ap.add_argument("--format", choices=("table", "json"), default="table")
    args = ap.parse_args(argv)
    try:
        settings = candidate_settings(args.config, args.mode, args.overrides)
        if not os.path.exists(args.history):
            raise ReplayError(f"{args.history}: no history there (history.enabled, beside the ledger)")
        history = History(args.history, readonly=True)
        ledger = Ledger.open_readonly(args.ledger) if args.ledger else None
        try:
            result = replay(history, settings, recorded=ledger, start=args.since, end=args.until, tick_s=args.tick)
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
