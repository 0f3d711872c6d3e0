"""healthctl: the operator's view of the controller's ledger, and its commands.

Reads open the ledger read-only (`file:...?mode=ro`); changes go to the controller's admin socket,
so only the controller writes. Tables by default, `--json` for scripts.

Nodes are Slurm hostlists wherever healthctl takes them (`gpu[001-004]`, `node[01,03-05]`), and node
lists are printed folded and in natural order (node2 before node10): ClusterShell's NodeSet, without
its group resolver. A bad hostlist is a usage error (exit 2) before anything is asked or changed.

Exit codes: 0 ok, 1 refused by the controller, 2 usage, 3 cannot reach the ledger or the controller (or it was
busy or timed the request out: worth trying again);
every failure is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException

from healthd import goodput, goodput_report
from healthd.config import ConfigError
from healthd.controller import goodput_ledger
from healthd.controller.goodput_gather import job_parts, read_parts
from healthd.controller.goodput_jobs import GATHERED_NAME, UNKNOWN, GoodputSettings
from healthd.goodput_categories import CATEGORIES
from healthd.controller.admin import OPERATOR_MODE, AdminUnreachable, call_admin
from healthd.controller.ledger.accounted import ACCOUNTED_NAME, recorded_jobs
from healthd.controller.ledger import (CLOSED_INCIDENT_STATUSES, INBAND_SLOW_STATUS, REMEDIATION_KINDS, Incident,
                                      Ledger, LedgerError)
from healthd.controller.config import CONTROLLER_CONFIG_PATH, load_controller_settings
from healthd.controller.history import HistorySettings
from healthd.slurm.backend import SlurmError, validate_job_id
from healthd.slurm.scontrol import ScontrolBackend
from healthd.text import natural_key, parse_time, stamp, table

DEFAULT_LEDGER = "/var/lib/healthd/ledger.sqlite"  # the controller config's `ledger` default
DEFAULT_SOCKET = "/run/healthd/controller.sock"  # ... and its `admin_socket` default
GATHERED_GOODPUT_LOGS = os.path.join(os.path.dirname(DEFAULT_LEDGER), GATHERED_NAME)
"""Where the controller gathers the jobs' goodput logs by default (on the head node)."""
NODE_GOODPUT_LOGS = "/var/lib/healthd/goodput"  # the agent's `state_dir` default, and its goodput logs
DEFAULT_GOODPUT_LOGS = (GATHERED_GOODPUT_LOGS if GATHERED_GOODPUT_LOGS and os.path.isdir(GATHERED_GOODPUT_LOGS)
                        else NODE_GOODPUT_LOGS)
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class Unreachable(Exception):
    """Exit 3."""


class Refused(Exception):
    """Exit 1."""


def open_readonly(path: str) -> Ledger:
    """The ledger, read-only (Ledger.open_readonly): healthctl never writes it."""
    if not Path(path).is_file():
        raise Unreachable(f"{path}: no ledger there (is the controller running, or is --ledger wrong?)")
    try:
        return Ledger.open_readonly(path)
    except LedgerError as exc:
        raise Unreachable(str(exc)) from exc


# --------------------------------------------------------------------------------------------------
# hostlists

MAX_HOSTLIST_NODES = 100_000
"""A hostlist naming more nodes than this is refused (`node[1-999999999]` is a typo, not a fleet)."""
_HOSTLIST_CHARS = re.compile(r"[A-Za-z0-9._,\[\]-]+")
_PLAIN_NODE = re.compile(r"[A-Za-z0-9._-]+")
def natural_sorted(names: Any) -> list[str]:
    return sorted(set(names), key=natural_key)


def parse_hostlist(text: str) -> list[str]:
    """A Slurm hostlist (`gpu[001-004]`, `node[01,03-05]`, `a,b`) -> its node names, naturally sorted.
    Raises ValueError with a one-line reason. Only the hostlist syntax is taken: no ClusterShell
    group (`@rack1`) and no set operator (`!`, `&`, `^`), which Slurm would not understand either."""
    spec = text.strip()
    if not spec:
        raise ValueError("empty hostlist")
    if not _HOSTLIST_CHARS.fullmatch(spec):
        bad = sorted({c for c in spec if not _HOSTLIST_CHARS.fullmatch(c)})
        raise ValueError(f"bad hostlist {text!r}: character(s) {''.join(bad)!r} not allowed "
                         "(a hostlist is names, ranges in [...] and commas, e.g. gpu[001-004],node07)")
    count = _hostlist_size(spec)
    if count > MAX_HOSTLIST_NODES:
        raise ValueError(f"bad hostlist {text!r}: {count} nodes (at most {MAX_HOSTLIST_NODES})")
    try:
        names = list(NodeSet(spec, resolver=RESOLVER_NOGROUP))
    except NodeSetException as exc:
        raise ValueError(f"bad hostlist {text!r}: {' '.join(str(exc).split())}") from None
    if not names or not all(_PLAIN_NODE.fullmatch(n) for n in names):
        raise ValueError(f"bad hostlist {text!r}: it names no node")
    return natural_sorted(names)


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _hostlist_size(spec: str) -> int:
    """How many names `spec` expands to, counted before anything is expanded (NodeSet would build a
    `node[1-999999999]` in memory). An upper bound: a repeated name counts twice; malformed pieces
    count 1 and are left to NodeSet to refuse."""
    total, depth, start = 0, 0, 0
    pieces = []
    for i, c in enumerate(spec + ","):
        depth += c == "["
        depth -= c == "]"
        if c == "," and depth == 0:
            pieces.append(spec[start:i])
            start = i + 1
    for piece in pieces:
        size = 1
        for group in _BRACKET.findall(piece):
            n = 0
            for part in group.split(","):
                lo, _, hi = part.partition("-")
                n += int(hi) - int(lo) + 1 if lo.isdigit() and hi.isdigit() and int(hi) >= int(lo) else 1
            size *= max(n, 1)
        total += size
    return total


def _hostlist_arg(text: str) -> list[str]:
    try:
        return parse_hostlist(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fold(names: Any) -> str:
    """Node names as one folded Slurm hostlist (`gpu[001-004],node07`); names a hostlist cannot
    carry (ledger data is not trusted to be tidy) are listed after it, one by one, in natural order."""
    names = natural_sorted(names)
    plain = [n for n in names if _PLAIN_NODE.fullmatch(n)]
    other = [n for n in names if not _PLAIN_NODE.fullmatch(n)]
    parts = []
    if plain:
        try:
            parts.append(str(NodeSet.fromlist(plain, resolver=RESOLVER_NOGROUP)))
        except NodeSetException:
            parts += plain
    return ",".join(parts + other)


# --------------------------------------------------------------------------------------------------
# formatting


def dur(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    if value < 172800:
        return f"{value / 3600:.1f}h"
    return f"{value / 86400:.1f}d"


def tier(value: object) -> str:
    """`1` or `T1` (both spellings reach the ledger) -> `T1`."""
    text = str(value)
    return f"T{text}" if text.isdigit() else text


def _incident_json(inc: Incident) -> dict[str, Any]:
    doc = asdict(inc)
    doc.update(nodes=list(inc.nodes), gpu_serials=list(inc.gpu_serials), jobs=list(inc.jobs),
               detection_latency=inc.detection_latency, decision_latency=inc.decision_latency,
               action_latency=inc.action_latency, recovery_time=inc.recovery_time,
               isolation_granularity={"nodes": inc.isolation_granularity[0], "gpus": inc.isolation_granularity[1]})
    return doc


def _js(obj: Any) -> Any:
    doc = asdict(obj)
    for k, v in doc.items():
        if isinstance(v, tuple):
            doc[k] = list(v)
    return doc


# --------------------------------------------------------------------------------------------------
# read commands: each returns (json document, text lines)


def cmd_status(led: Ledger, args: argparse.Namespace) -> tuple[Any, list[str]]:
    now = time.time() if args.now is None else args.now
    decisions = [d for d in led.decisions() if d.mode != OPERATOR_MODE]
    mode = max(decisions, key=lambda d: (d.decided_at, d.id)).mode if decisions else None
    b = led.breaker_state()
    last_hour = led.actions_applied_since(now - 3600)  # the count the controller holds against its budget
    if args.budget is None:
        args.budget = _configured_budget(args.config)
    waiting = led.waiting_decisions()
    open_incidents = [i for i in led.incidents() if i.status not in CLOSED_INCIDENT_STATUSES]
    drains = {n: h.incident_id for n, h in led.holds().items()}
    doc = {
        "mode": mode,
        "breaker": {"open": b.open, "opened_at": b.opened_at, "cause": b.cause, "nodes": list(b.nodes),
                    "reset_at": b.reset_at, "reset_by": b.reset_by},
        "actions_last_hour": last_hour, "budget_per_hour": args.budget,
        "waiting_approvals": [d.id for d in waiting],
        "open_incidents": [i.id for i in open_incidents],
        "healthd_drained_nodes": natural_sorted(drains),
        "pending_actions": [a.id for a in led.pending_actions()],
    }
    lines = [f"mode:            {mode or 'unknown (no decision recorded yet)'}"]
    if b.open:
        lines.append(f"breaker:         OPEN since {stamp(b.opened_at)}: {b.cause} (nodes: {fold(b.nodes) or '-'})")
        lines.append("                 no automatic action until `healthctl breaker reset --why ...`")
    else:
        lines.append("breaker:         closed" + (f" (last reset {stamp(b.reset_at)} by {b.reset_by}: {b.why})" if b.reset_at else ""))
    lines.append(f"actions (1h):    {last_hour}" + (f" of {args.budget}" if args.budget is not None else " (budget unknown; --budget N)"))
    lines.append(f"open incidents:  {len(open_incidents)}")
    lines.append(f"drained by healthd: {fold(drains) or 'none'}")
    if doc["pending_actions"]:
        lines.append(f"planned, not yet applied: actions {', '.join(map(str, doc['pending_actions']))}")
    lines.append(f"waiting approval: {len(waiting)}")
    if waiting:
        lines += ["", *(table(["decision", "node", "kind", "tier", "decided", "reason"],
                               [[d.id, d.node, d.kind, tier(d.tier), stamp(d.decided_at), d.reason] for d in waiting]))]
    return doc, lines


def cmd_nodes(led: Ledger, args: argparse.Namespace) -> tuple[Any, list[str]]:
    drains = {n: h.incident_id for n, h in led.holds().items()}
    nodes: dict[str, dict[str, Any]] = {}
    for inc in led.incidents():
        for n in inc.nodes:
            e = nodes.setdefault(n, {"node": n, "incidents": 0, "open_incidents": [], "last_incident_at": None,
                                     "gpu_serials": set()})
            e["incidents"] += 1
            if inc.status not in CLOSED_INCIDENT_STATUSES:
                e["open_incidents"].append(inc.id)
            e["last_incident_at"] = max(e["last_incident_at"] or 0, inc.created_at)
            e["gpu_serials"].update(inc.gpu_serials)
    for f in led.findings():
        nodes.setdefault(f.node, {"node": f.node, "incidents": 0, "open_incidents": [], "last_incident_at": None,
                                  "gpu_serials": set()})
    wanted = set(args.hostlist) if getattr(args, "hostlist", None) else None
    if wanted is not None:
        nodes = {n: e for n, e in nodes.items() if n in wanted}
    rows = []
    for n in natural_sorted(nodes):
        e = nodes[n]
        e["gpu_serials"] = sorted(e["gpu_serials"])
        e["healthd_drained"] = n in drains
        e["drain_incident"] = drains.get(n)
        acts = led.actions(node=n)
        e["last_action"] = None if not acts else {"id": acts[-1].id, "kind": acts[-1].kind, "status": acts[-1].status}
        rows.append([n, "drained by healthd" if n in drains else "-", e["incidents"],
                     ",".join(map(str, e["open_incidents"])) or "-", stamp(e["last_incident_at"]),
                     "-" if not acts else f"#{acts[-1].id} {acts[-1].kind} {acts[-1].status}"])
    empty = f"none of {fold(wanted)} in the ledger" if wanted is not None else "no nodes in the ledger"
    lines = table(["node", "healthd", "incidents", "open", "last incident", "last action"], rows) if rows else [empty]
    return [nodes[n] for n in natural_sorted(nodes)], lines


def cmd_incidents(led: Ledger, args: argparse.Namespace) -> tuple[Any, list[str]]:
    incs = led.incidents()
    if args.open:
        incs = [i for i in incs if i.status not in CLOSED_INCIDENT_STATUSES]
    if args.nodes:
        incs = [i for i in incs if set(i.nodes) & set(args.nodes)]
    rows = [[i.id, i.status, i.signature, tier(i.tier), i.attribution,
             fold(i.nodes) or "-", ",".join(i.gpu_serials) or "-", stamp(i.first_evidence_at),
             dur(i.detection_latency), dur(i.recovery_time)] for i in incs]
    lines = table(["id", "status", "signature", "tier", "attribution", "nodes", "gpu serials", "first evidence",
                    "detect", "recovery"], rows) if rows else ["no incidents" + (" open" if args.open else "")]
    return [_incident_json(i) for i in incs], lines


def _next_steps(inc: Incident, decisions: list, actions: list, led: Ledger) -> list[str]:
    steps: list[str] = []
    waiting = [d for d in decisions if d.outcome == "waiting" and led.approval(d.id) is None]
    for d in waiting:
        steps.append(f"decision {d.id} ({d.kind} {d.node}) waits for you: `healthctl approve {d.id}` "
                     f"or `healthctl reject {d.id} --why ...`")
    for a in actions:
        if a.status == "planned":
            steps.append(f"action {a.id} is planned but not applied: the controller adopts it (if Slurm shows it) "
                         "or abandons it and re-decides, on its next round")
        if a.status == "failed":
            steps.append(f"action {a.id} failed ({a.outcome}); check `scontrol show node {a.node}`")
        if a.status == "lost" and a is actions[-1]:
            steps.append(f"Slurm lost action {a.id} ({a.outcome}); the controller applies it again through the gates")
    released = [a for a in actions if a.status == "released"]
    if released and inc.status == "handed-over":
        steps.append(f"{released[-1].node} was taken over ({released[-1].outcome}); healthd will not touch it again "
                     "for this fault")
    drains = {n: h.incident_id for n, h in led.holds().items()}
    for n in inc.nodes:
        if drains.get(n) == inc.id:
            held = [a for a in actions if a.node == n and a.status == "applied" and a.kind in REMEDIATION_KINDS]
            undo = f"`healthctl undo {held[-1].id} --why ...`" if held else "`healthctl undo ACTION --why ...`"
            steps.append(f"{n} is out of service by healthd: fix it (GPU serial {', '.join(inc.gpu_serials) or '-'}), then "
                         f"`healthctl repaired {n}`; if healthd was wrong, {undo}")
    if inc.status == INBAND_SLOW_STATUS:
        steps.append(f"the repair passed validation, but the training job's own step times still show "
                     f"{fold(inc.nodes) or 'the node'} slow (see the reintegration's detail): look at the node, then "
                     f"`healthctl close {inc.id} --why ...`")
    if inc.attribution in ("user", "software"):
        steps.append(f"attribution is {inc.attribution}: look at the job(s) {', '.join(inc.jobs) or '-'} before touching hardware")
    if not steps:
        steps.append("nothing: no decision waits for you and healthd holds no node for this incident")
    return steps


def _configured_budget(path: str | None) -> int | None:
    """max_actions_per_hour from the controller's config (the default file when present)."""
    try:
        return load_controller_settings(path).policy.max_actions_per_hour if path or os.path.exists(CONTROLLER_CONFIG_PATH) else None
    except (ConfigError, OSError):
        return None


def cmd_show(led: Ledger, args: argparse.Namespace) -> tuple[Any, list[str]]:
    inc = led.incident(args.incident)
    if inc is None:
        raise Refused(f"no incident {args.incident} in the ledger")
    decisions = led.decisions(incident_id=inc.id)
    actions = [a for d in decisions for a in led.actions(decision_id=d.id)]
    findings = [f for n in inc.nodes for f in led.findings(n)
                if (not f.gpu_serial or not inc.gpu_serials or f.gpu_serial in inc.gpu_serials)
                and (inc.first_evidence_at is None or f.last_seen >= inc.first_evidence_at - 3600)]
    approvals = {d.id: led.approval(d.id) for d in decisions}
    steps = _next_steps(inc, decisions, actions, led)
    reints = led.reintegrations(incident_id=inc.id)
    doc = {"incident": _incident_json(inc), "findings": [_js(f) for f in findings],
           "decisions": [dict(_js(d), approval=(None if approvals[d.id] is None else _js(approvals[d.id]))) for d in decisions],
           "actions": [_js(a) for a in actions], "reintegrations": [_js(r) for r in reints], "next": steps}
    g_nodes, g_gpus = inc.isolation_granularity
    out = [f"Incident {inc.id}: {inc.signature}  [{inc.status}]",
           f"  what:  {tier(inc.tier)}, attribution {inc.attribution}",
           f"  where: node {fold(inc.nodes) or '-'}; GPU serial {', '.join(inc.gpu_serials) or '-'}"
           + (f"; jobs {', '.join(inc.jobs)}" if inc.jobs else ""),
           "", "Timeline"]
    for label, at in (("first evidence", inc.first_evidence_at), ("detected", inc.detected_at), ("decided", inc.decided_at),
                      ("action applied", inc.action_applied_at), ("back in service", inc.back_in_service_at)):
        out.append(f"  {label:<16} {stamp(at)}")
    out += [f"  detection latency:     {dur(inc.detection_latency)}   (first evidence -> detected)",
            f"  isolation granularity: {g_nodes} node{'s' if g_nodes != 1 else ''}, {g_gpus} GPU{'s' if g_gpus != 1 else ''}",
            f"  recovery time:         {dur(inc.recovery_time)}" + ("" if inc.recovery_time is not None else "   (not back in service yet)"),
            f"  (decision {dur(inc.decision_latency)}, action {dur(inc.action_latency)})",
            "", "Evidence"]
    if not findings:
        out.append("  none recorded")
    for f in findings:
        out.append(f"  {f.node} {f.finding_id}" + (f" gpu {f.gpu_serial}" if f.gpu_serial else "")
                   + f" [{tier(f.tier)} {f.attribution} -> {f.action}]: {f.summary}")
        ev = f.evidence if isinstance(f.evidence, list) else ([] if f.evidence is None else [f.evidence])
        for e in ev[:8]:
            text = e.get("text", json.dumps(e, sort_keys=True)) if isinstance(e, dict) else str(e)
            kind = f"{e['kind']}: " if isinstance(e, dict) and "kind" in e else ""
            out.append(f"      {kind}{text}")
        if len(ev) > 8:
            out.append(f"      ... {len(ev) - 8} more (see --json)")
    out += ["", "Decisions"]
    if not decisions:
        out.append("  none")
    for d in decisions:
        verdict = approvals[d.id]
        state = d.outcome if d.outcome != "refused" else f"REFUSED by {d.refused_gate}: {d.refused_reason}"
        out.append(f"  #{d.id} {stamp(d.decided_at)} {d.kind} {d.node} ({tier(d.tier)}, {d.mode} mode): {state}")
        out.append(f"      reason: {d.reason}")
        if verdict is not None:
            out.append(f"      {verdict.verdict}d by {verdict.operator} at {stamp(verdict.at)}" + (f": {verdict.why}" if verdict.why else ""))
    out += ["", "Actions"]
    if not actions:
        out.append("  none")
    for a in actions:
        when = {"applied": a.applied_at, "failed": a.failed_at, "undone": a.undone_at}.get(a.status, a.planned_at)
        out.append(f"  #{a.id} {a.kind} {a.node}: {a.status} at {stamp(when)}" + (f" ({a.outcome})" if a.outcome else ""))
        out.append(f"      $ {' '.join(_shell_quote(x) for x in a.argv)}")
    out += ["", "Reintegration"]
    if not reints:
        out.append("  none")
    for r in reints:
        who = f" by {r.operator}" + (f" ({r.why})" if r.why else "") if r.operator else ""
        out.append(f"  #{r.id} {r.node}: {r.state}; {r.trigger}{who} at {stamp(r.requested_at)}"
                   + (f"; reservation {r.reservation}" if r.reservation else "")
                   + (f"; probation until {stamp(r.probation_until)}" if r.state == "probation" else ""))
        for res in r.results if isinstance(r.results, list) else []:
            out.append(f"      {'PASS' if res.get('rc') == 0 else 'FAIL'} rc={res.get('rc')} {res.get('seconds', 0):.1f}s "
                       f"$ {' '.join(_shell_quote(str(x)) for x in res.get('argv', []))}")
        if r.detail:
            out.append(f"      {r.detail}")
    if inc.escalation:
        out += ["", f"ESCALATED: {inc.escalation}"]
    out += ["", "Next"] + [f"  - {s}" for s in steps]
    return doc, out


def _shell_quote(arg: str) -> str:
    safe = all(c.isalnum() or c in "-_=./:,[]+@%" for c in arg)
    return arg if safe and arg else "'" + arg.replace("'", "'\\''") + "'"


def cmd_report(led: Ledger, args: argparse.Namespace) -> tuple[Any, list[str]]:
    now = time.time() if args.now is None else args.now
    since = now - args.days * 86400
    by_node = led.repeat_offenders_by_node(since=since)
    by_gpu = led.repeat_offenders_by_gpu(since=since)
    fp = led.false_positive_rate(since=since)
    mtbf = led.mtbf_per_node(start=since, end=now)
    pct = led.latency_percentiles(since=since)
    doc = {"window": {"start": since, "end": now, "days": args.days},
           "repeat_offenders": {"nodes": [_js(o) for o in by_node], "gpus": [_js(o) for o in by_gpu]},
           "false_positive_rate": {"approved": fp.approved, "rejected": fp.rejected, "rate": fp.rate},
           "mtbf": [_js(m) for m in mtbf], "latency": {k: _js(v) for k, v in pct.items()}}
    out = [f"Report over the last {args.days:g} days ({stamp(since)} .. {stamp(now)})", "", "Repeat offenders by node"]
    out += ["  " + r for r in table(["node", "incidents", "last"], [[o.key, o.incidents, stamp(o.last_at)] for o in by_node])] if by_node else ["  none"]
    out += ["", "Repeat offenders by GPU serial"]
    out += ["  " + r for r in table(["gpu serial", "incidents", "last"], [[o.key, o.incidents, stamp(o.last_at)] for o in by_gpu])] if by_gpu else ["  none"]
    rate = "n/a (nothing judged)" if fp.rate is None else f"{fp.rate * 100:.1f}%"
    out += ["", f"False-positive rate of observe-mode proposals: {rate}  ({fp.rejected} rejected, {fp.approved} approved)"]
    out += ["", "MTBF per node"]
    out += ["  " + r for r in table(["node", "failures", "mtbf"], [[m.node, m.failures, dur(m.mtbf_s)] for m in mtbf])] if mtbf else ["  no failures"]
    out += ["", "Latency percentiles (nearest rank)"]
    out += ["  " + r for r in table(["stage", "n", "p50", "p90", "p99"],
                                     [[k, v.n, dur(v.p50), dur(v.p90), dur(v.p99)] for k, v in pct.items()])]
    return doc, out


READS = {"status": cmd_status, "nodes": cmd_nodes, "incidents": cmd_incidents, "show": cmd_show, "report": cmd_report}


# --------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"healthctl: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _why(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("--why must not be empty")
    return value


CHANGE_COMMANDS: tuple[tuple[str, str, Any, bool, str], ...] = (
    ("approve", "id", int, False, "approve a waiting decision"),
    ("reject", "id", int, True, "reject a waiting decision"),
    ("undo", "id", int, True, "reverse an applied healthd action"),
    ("repaired", "node", _hostlist_arg, False, "mark healthd-drained nodes (a Slurm hostlist) repaired: they enter reintegration"),
    ("close", "incident", int, True, "close an incident by hand (its evidence episode no longer counts)"),
    ("release", "node", _hostlist_arg, True, "hand nodes healthd holds (a Slurm hostlist) over to you (Slurm unchanged; never resumed)"),
)
"""The changes healthctl asks the controller for: command, its argument and type, whether --why is
required (every reversal and hand-over says why; an approval or a repair may), help. A `node`
argument is a Slurm hostlist: one request per node, in natural order."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="healthctl", description="Operator CLI over the healthd controller's ledger.")
    p.add_argument("--ledger", default=os.environ.get("HEALTHCTL_LEDGER", DEFAULT_LEDGER), help="the controller's ledger (read-only)")
    p.add_argument("--socket", default=os.environ.get("HEALTHCTL_SOCKET", DEFAULT_SOCKET), help="the controller's admin socket")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--config", default=os.environ.get("HEALTHCTL_CONFIG"),
                   help=f"the controller's config, for its budget (default {CONTROLLER_CONFIG_PATH} when present)")
    p.add_argument("--now", type=float, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    s = sub.add_parser("status", help="fleet summary")
    s.add_argument("--budget", type=int, default=None, help="the controller's max actions per hour, to show against")
    s = sub.add_parser("nodes", help="nodes the ledger knows")
    s.add_argument("hostlist", nargs="?", type=_hostlist_arg, default=None,
                   help="only these nodes (a Slurm hostlist: gpu[001-004],node07)")
    s = sub.add_parser("incidents", help="incidents")
    s.add_argument("--open", action="store_true", help="only those not closed")
    s.add_argument("--nodes", type=_hostlist_arg, default=None, metavar="HOSTLIST",
                   help="only incidents on these nodes (a Slurm hostlist)")
    s = sub.add_parser("show", help="one incident's evidence bundle")
    s.add_argument("incident", type=int)
    s = sub.add_parser("report", help="repeat offenders, false positives, MTBF, latencies")
    s.add_argument("--days", type=float, default=30.0)
    for name, target, kind, why_required, help_text in CHANGE_COMMANDS:
        s = sub.add_parser(name, help=help_text)
        s.add_argument(target, type=kind)
        s.add_argument("--why", type=_why, required=why_required, default=None)
    s = sub.add_parser("goodput", help="where a job's GPU-hours went, by cause, from its event log; or every job's")
    s.add_argument("--log", default=None, help="one job's event log (JSONL, ml-goodput-measurement keys)")
    s.add_argument("--job", default=None, help="this job (its log in --logs, unless --log names one)")
    s.add_argument("--logs", default=os.environ.get("HEALTHCTL_GOODPUT_LOGS", DEFAULT_GOODPUT_LOGS),
                   help="the directory of the jobs' logs: the controller's gathered copies (<job>/<node>.jsonl) "
                        f"or a node's own (<job>.jsonl) (default {GATHERED_GOODPUT_LOGS} when it exists, "
                        f"else {NODE_GOODPUT_LOGS})")
    s.add_argument("--since", type=_since, default=None, metavar="T",
                   help="every job with a run ending after T (RFC 3339, or a number of days: 7d)")
    s.add_argument("--by", choices=("cause", "node", "serial", "partition", "account"), default="cause",
                   help="how the interruptions' cost is grouped (cause, node, serial), or the jobs "
                        "themselves (partition, account: as the controller recorded them) (default cause)")
    s.add_argument("--format", choices=("table", "json", "html"), default="table")
    s.add_argument("-o", "--output", default=None, help="where --format html writes the report (one self-contained file)")
    s.add_argument("--slo", type=_slo, default=0.9, help="the goodput objective the report burns against (default 0.9)")
    s.add_argument("--ettr-window", type=_window, default=goodput.ETTR_WINDOW_S, metavar="D",
                   help="the sliding window of the effective training time ratio: seconds, or 30m, 1h, 2d (default 1h)")
    s.add_argument("--sacct", action="store_true",
                   help="with --job: the job's runs from Slurm's accounting (sacct, where the site runs slurmdbd; "
                        "slurm.conf from the controller's config), as the controller accounts them")
    s = sub.add_parser("what-if", help="what another mode or setting would have done with what the controller saw "
                       "(its history and ledger, replayed by healthd-sim replay; each drain that differs "
                       "measured in the jobs' gathered goodput logs)")
    s.add_argument("--since", default="30d", metavar="T", help="from (RFC 3339, or 7d / 12h ago; default 30d)")
    s.add_argument("--until", default=None, metavar="T", help="to (default: now)")
    s.add_argument("--mode", choices=("observe", "supervised", "auto"), default="auto", help="default auto")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting on top of the controller's, dotted: policy.breaker_min_nodes=3 (repeatable)")
    s.add_argument("--history", default=None, help="the controller's history (default: history.path of its config, "
                   "else history.sqlite beside --ledger)")
    s = sub.add_parser("inband", help="the training jobs' in-band view: ranks, slow ranks, hangs (from the controller)")
    s.add_argument("--job", default=None, help="only this job")
    s = sub.add_parser("breaker", help="the circuit breaker")
    bs = s.add_subparsers(dest="breaker_cmd", required=True, parser_class=_Parser)
    r = bs.add_parser("reset", help="close the breaker")
    r.add_argument("--why", type=_why, required=True)
    return p


def inband_lines(doc: dict[str, Any]) -> list[str]:
    """`healthctl inband` as a person reads it: per job, a line, its slow ranks and hang, then a
    table of its ranks (where they run, how far and how fast)."""
    jobs = doc.get("jobs") or []
    if not jobs:
        return ["no job with in-band data in the controller's latest round"
                + (f" ({stamp(doc['evaluated_at'])})" if doc.get("evaluated_at") else "")]
    lines: list[str] = []
    for job in jobs:
        slow = job.get("stragglers") or []
        hang = job.get("hang")
        state = "HUNG" if hang else f"{len(slow)} slow rank(s)" if slow else "ok"
        world = job.get("world_size")
        lines.append(f"job {job['job']}: {state}; {job['ranks_reported']} of {world if world else '?'} ranks reported "
                     f"from {fold(job.get('nodes') or []) or '-'}")
        for f in slow:
            why = f"; corroborated: {f['corroboration'][0]}" if f.get("corroboration") else "; in-band evidence only"
            lines.append(f"  slow: rank {f['rank']} on {f['node']} gpu {'?' if f.get('gpu') is None else f['gpu']} "
                         f"{f['effect']:+.1%} ({f['test']}, windows {f['windows'][0]}-{f['windows'][-1]}, "
                         f"T{f['tier']}, judged by the {f['judged_by']}){why}")
        if hang:
            lines.append(f"  hang: {hang['summary']}")
        rows = []
        flagged = {f["rank"] for f in slow}
        behind = {b["rank"] for b in (hang or {}).get("behind") or []}
        for r in job.get("ranks") or []:
            note = "SLOW" if r["rank"] in flagged else "BEHIND" if r["rank"] in behind else ""
            rows.append([r["rank"], r["node"], "-" if r.get("gpu") is None else r["gpu"], r.get("rail") or "-",
                         r["last_step"], f"{r['last_step_age_s']:.1f}s", r["phase"],
                         "-" if r.get("step_median_s") is None else f"{r['step_median_s'] * 1000:.1f}",
                         "-" if r.get("compute_s") is None else f"{r['compute_s'] * 1000:.1f}", note])
        lines += ["  " + line for line in table(["rank", "node", "gpu", "rail", "step", "age", "phase", "step_ms",
                                                   "compute_ms", ""], rows)]
    return lines


MAX_GOODPUT_LOG_BYTES = 1 << 30


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _window(text: str) -> float:
    """A duration: seconds, or a number with s, m, h or d."""
    unit = _UNITS.get(text[-1:], None)
    try:
        value = float(text[:-1] if unit else text) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, or a number with s, m, h or d (1h)") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r}: a window longer than 0 s")
    return value


def _slo(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an objective between 0 and 1 (0.9 is 90 %)")
    return value


def goodput_doc(acc: goodput.Account, advice: goodput.IntervalAdvice | None, ettr: goodput.Ettr) -> dict[str, Any]:
    return {"job": acc.job, "held_gpu_s": acc.held_gpu_s, "goodput": acc.goodput, "gpu_s": dict(acc.gpu_s),
            "queued_s": acc.queued_s, "at_risk_gpu_s": acc.at_risk_gpu_s,
            "runs": acc.runs, "interruptions": acc.interruptions, "mtbi_s": acc.mtbi_s,
            "incidents": [{"incident": i.incident, "cause": i.cause, "node": i.node, "gpu": i.gpu,
                           "false_positive": i.false_positive, "gpu_s": dict(i.gpu_s), "cost_gpu_s": i.cost_gpu_s}
                          for i in acc.incidents],
            "ettr": {"cumulative": ettr.cumulative, "window_s": ettr.window_s, "window_min": ettr.window_min,
                     "longest_unproductive_s": ettr.longest_unproductive_s,
                     "longest_unproductive_at": ettr.longest_unproductive_at},
            "checkpoint_interval": None if advice is None else {
                "checkpoint_s": advice.checkpoint_s, "mtbi_s": advice.mtbi_s, "current_s": advice.current_s,
                "young_s": advice.young_s, "daly_s": advice.daly_s, "efficiency_current": advice.efficiency_current,
                "efficiency_daly": advice.efficiency_daly, "gain": advice.gain},
            "partial": acc.partial, "problems": list(acc.problems), "notes": list(acc.notes)}


def _category_table(gpu_s: Mapping[str, float], held: float) -> list[str]:
    """GPU-hours and share by category, in the categories' order, those with time only."""
    return table(["category", "GPU-h", "share"],
                 [[c, f"{gpu_s[c] / 3600:.3f}", f"{gpu_s[c] / held:.1%}" if held else "-"]
                  for c in CATEGORIES if gpu_s.get(c, 0) > 0])


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def goodput_lines(acc: goodput.Account, advice: goodput.IntervalAdvice | None, ettr: goodput.Ettr) -> list[str]:
    """`healthctl goodput` as a person reads it: the share, where the GPU-hours went, the effective
    training time, what each interruption cost (largest first), and the checkpoint interval against
    Young's and Daly's."""
    held = acc.held_gpu_s
    lines = [f"job {acc.job or '?'}: goodput {_share(acc.goodput)} of {held / 3600:.2f} GPU-h held over {acc.runs} run(s), "
             f"{acc.interruptions} interruption(s)" + (f" (MTBI {_duration(acc.mtbi_s)})" if acc.mtbi_s else "")
             + (f"; {_duration(acc.queued_s)} queued between runs (not held)" if acc.queued_s > 0 else "")]
    lines += _category_table(acc.gpu_s, held)
    if acc.at_risk_gpu_s > 0:
        lines.append(f"at risk: {acc.at_risk_gpu_s / 3600:.3f} GPU-h of the productive time came after the last durable "
                     "checkpoint of the run still going (lost if it failed now)")
    lines.append(f"effective training time ratio: {_share(ettr.cumulative)}; lowest over {_duration(ettr.window_s)} "
                 f"{_share(ettr.window_min)}; longest unproductive stretch {_duration(ettr.longest_unproductive_s)}"
                 + (f" from {stamp(ettr.longest_unproductive_at)}" if ettr.longest_unproductive_at else ""))
    if acc.incidents:
        lines.append("interruptions, by interruption cost:")
        lines += table(["incident", "cause", "node", "gpu", "cost GPU-h", "of which"],
                       [[i.incident, i.cause, i.node or "-", i.gpu or "-", f"{i.cost_gpu_s / 3600:.3f}",
                         ("FALSE POSITIVE " if i.false_positive else "")
                         + ", ".join(f"{c} {i.gpu_s[c] / 3600:.3f}" for c in CATEGORIES if i.gpu_s.get(c, 0) > 0)]
                        for i in acc.incidents])
    if advice is not None:
        gain = "" if advice.gain is None else f"; at Daly's interval goodput {advice.gain * 100:+.1f} points"
        lines.append(f"checkpoint interval: now {_duration(advice.current_s)}; blocking save {_duration(advice.checkpoint_s)}, "
                     f"MTBI {_duration(advice.mtbi_s)}: Young {_duration(advice.young_s)}, "
                     f"Daly {_duration(advice.daly_s)}{gain}")
    lines += [f"note: {n}" for n in acc.notes[:20]]
    if acc.problems:
        lines.append(f"PARTIAL: {len(acc.problems)} problem(s) in the log; the figures assume:")
        lines += [f"  {p}" for p in acc.problems[:20]]
    return lines


def _since(text: str) -> float:
    if text.endswith("d"):
        try:
            return time.time() - float(text[:-1]) * 86400
        except ValueError:
            pass
    at = parse_time(text)
    if at is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RFC 3339 with a time zone, or days (7d)")
    return at


def _is_job(name: str) -> bool:
    try:
        validate_job_id(name)
    except ValueError:
        return False
    return True


def _job_paths(logs: str, name: str) -> list[str]:
    """The files of one job's log in `logs`: the controller's gathered parts (`<job>/`) or a node's
    own file (`<job>.jsonl`). Raises OSError."""
    path = os.path.join(logs, name)
    if os.path.isdir(path):
        parts = job_parts(path)
        if not parts:
            raise FileNotFoundError(f"{path}: no part of the log")
        return parts
    return [path if name.endswith(".jsonl") else f"{path}.jsonl"]


def _account_file(paths: list[str], job: str | None, requeues: goodput_ledger.Requeues | None, ledger: str,
                  now: float | None, runs: list | None = None) -> tuple[goodput.Account, goodput.Log, str]:
    """One job's log read (its parts merged), joined with the job's requeues from the ledger when it
    was readable, with its runs from Slurm's accounting when given, and accounted. Raises OSError."""
    log = read_parts(paths, job, MAX_GOODPUT_LOG_BYTES)
    log, joined = goodput_ledger.joined(log, requeues)
    where = (f"ledger {ledger}: {joined} requeue(s) of job {log.job} and their incidents joined" if requeues is not None
             else f"ledger {ledger}: not read (interruptions are charged to their runs)")
    if runs is not None:
        log = goodput.with_runs(log, [goodput.SlurmRun(r.start, r.end, r.state, r.gpus)
                                      for r in runs if r.start is not None])
        where += f"; {len(runs)} run(s) from Slurm's accounting"
    # no `now`: a run without an end (still going, or its end not written) is counted to its last
    # event and the answer says so, rather than stretched to this moment
    return goodput.account(log, now=now), log, where


def _recorded_jobs(logs: str) -> dict[str, tuple[str, str]]:
    """job -> (partition, account) as the controller recorded them beside its gathered logs (empty
    without them)."""
    path = os.path.join(logs, ACCOUNTED_NAME)
    if not os.path.isfile(path):
        return {}
    return recorded_jobs(path)


def _goodput_fleet(args: argparse.Namespace) -> int:
    """Every job's log in --logs (with a run ending after --since): the jobs, the categories over all
    of them, and the interruptions' cost grouped --by cause, node or GPU serial, largest first."""
    if args.format == "html":
        return _fail(EXIT_USAGE, "--format html is one job's report: name it with --job or --log")
    try:
        names = sorted((n for n in os.listdir(args.logs)
                        if n.endswith(".jsonl") or (_is_job(n) and os.path.isdir(os.path.join(args.logs, n)))),
                       key=natural_key)
    except OSError as exc:
        return _fail(EXIT_UNREACHABLE, f"{args.logs}: cannot list the goodput logs: {exc.strerror or exc}")
    requeues = goodput_ledger.ledger_requeues(args.ledger)
    recorded = _recorded_jobs(args.logs) if args.by in ("partition", "account") else {}
    jobs: list[goodput.Account] = []
    totals = dict.fromkeys(CATEGORIES, 0.0)
    groups: dict[str, dict[str, float]] = {}
    unreadable: list[str] = []
    for name in names:
        try:
            acc, log, _ = _account_file(_job_paths(args.logs, name), None if name.endswith(".jsonl") else name,
                                        requeues, args.ledger, args.now)
        except OSError as exc:
            unreadable.append(f"{name}: {exc.strerror or exc}")
            continue
        runs, _ = goodput.runs_of(log)
        if args.since is not None and not any(r.end >= args.since for r in runs):
            continue
        jobs.append(acc)
        for c, v in acc.gpu_s.items():
            totals[c] += v
        if args.by in ("partition", "account"):
            where = recorded.get(acc.job or name.removesuffix(".jsonl"), (UNKNOWN, UNKNOWN))
            g = groups.setdefault(where[0 if args.by == "partition" else 1] or UNKNOWN,
                                  {"jobs": 0, "held_gpu_s": 0.0, "productive_gpu_s": 0.0, "interruptions": 0,
                                   "gpu_s": 0.0})
            g["jobs"] += 1
            g["held_gpu_s"] += acc.held_gpu_s
            g["productive_gpu_s"] += acc.gpu_s["productive"]
            g["interruptions"] += acc.interruptions
            g["gpu_s"] += sum(inc.cost_gpu_s for inc in acc.incidents)
            continue
        for inc in acc.incidents:
            key = {"cause": inc.cause, "node": inc.node, "serial": inc.gpu}[args.by] or "unknown"
            g = groups.setdefault(key, {"interruptions": 0, "gpu_s": 0.0})
            g["interruptions"] += 1
            g["gpu_s"] += inc.cost_gpu_s
    held = sum(totals.values())
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1]["gpu_s"], kv[0]))
    if args.json or args.format == "json":
        print(json.dumps({"jobs": [{"job": a.job, "goodput": a.goodput, "held_gpu_s": a.held_gpu_s,
                                    "interruptions": a.interruptions, "partial": a.partial} for a in jobs],
                          "held_gpu_s": held, "gpu_s": totals, "goodput": totals["productive"] / held if held else None,
                          "by": args.by, "cost": [{args.by: k, **v} for k, v in ranked], "unreadable": unreadable},
                         indent=2, sort_keys=True))
        return EXIT_OK
    share = f"{totals['productive'] / held:.1%}" if held else "-"
    lines = [f"{len(jobs)} job(s) in {args.logs}: goodput {share} of {held / 3600:.2f} GPU-h"]
    if jobs:
        lines += table(["job", "goodput", "GPU-h", "interruptions", ""],
                       [[a.job or "?", "-" if a.goodput is None else f"{a.goodput:.1%}", f"{a.held_gpu_s / 3600:.2f}",
                         a.interruptions, "PARTIAL" if a.partial else ""] for a in jobs])
        lines += _category_table(totals, held)
    if ranked and args.by in ("partition", "account"):
        lines.append(f"by {args.by}:")
        lines += table([args.by, "jobs", "GPU-h", "goodput", "interruptions", "interruption cost GPU-h"],
                       [[k, int(v["jobs"]), f"{v['held_gpu_s'] / 3600:.2f}",
                         f"{v['productive_gpu_s'] / v['held_gpu_s']:.1%}" if v["held_gpu_s"] else "-",
                         int(v["interruptions"]), f"{v['gpu_s'] / 3600:.3f}"] for k, v in ranked])
    elif ranked:
        lines.append(f"interruption cost by {args.by}:")
        lines += table([args.by, "interruptions", "cost GPU-h"],
                       [[k, int(v["interruptions"]), f"{v['gpu_s'] / 3600:.3f}"] for k, v in ranked])
    lines += [f"unreadable: {u}" for u in unreadable]
    print("\n".join(lines))
    return EXIT_OK


def _goodput(args: argparse.Namespace) -> int:
    """An offline read of one job's event log, or of every job's; nothing is asked of the controller."""
    if args.log is None and args.job is None:
        return _goodput_fleet(args)
    if args.log is None:
        try:
            validate_job_id(args.job)
        except ValueError:
            return _fail(EXIT_USAGE, f"--job {args.job!r}: not a Slurm job id")
    path = args.log or os.path.join(args.logs, args.job)
    runs: list | None = None
    if args.sacct:
        if args.job is None:
            return _fail(EXIT_USAGE, "--sacct needs --job (the job whose runs to ask Slurm for)")
        try:
            runs = ScontrolBackend(load_controller_settings(args.config).slurm_conf).job_runs(args.job)
        except (ConfigError, OSError, SlurmError, ValueError) as exc:
            return _fail(EXIT_UNREACHABLE, f"sacct: {exc}")
        if runs is None:
            return _fail(EXIT_UNREACHABLE, "sacct: Slurm keeps no job accounting here (no slurmdbd)")
    try:
        paths = [args.log] if args.log else _job_paths(args.logs, args.job)
        acc, log, where = _account_file(paths, args.job, goodput_ledger.ledger_requeues(args.ledger), args.ledger,
                                        args.now, runs)
    except OSError as exc:
        return _fail(EXIT_UNREACHABLE, f"{path}: cannot read the event log: {exc.strerror or exc}")
    advice = goodput.interval_advice(acc)
    ettr = goodput.ettr(acc, args.ettr_window)
    if args.format == "html":
        if not args.output:
            return _fail(EXIT_USAGE, "goodput --format html needs -o FILE")
        page = goodput_report.render(acc, log, advice, slo=args.slo, ettr=ettr)
        try:
            write_atomic(args.output, page)
        except OSError as exc:
            return _fail(EXIT_UNREACHABLE, f"{args.output}: cannot write the report: {exc.strerror or exc}")
        print(f"{args.output}: goodput report of job {acc.job or '?'}" + (" (PARTIAL)" if acc.partial else ""))
    elif args.json or args.format == "json":
        print(json.dumps({**goodput_doc(acc, advice, ettr), "ledger": where}, indent=2, sort_keys=True))
    else:
        print("\n".join([*goodput_lines(acc, advice, ettr), where]))
    return EXIT_OK


def write_atomic(path: str, text: str) -> None:
    """`text` into `path` through a temporary file and a rename: a reader never sees half a report."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _change_requests(args: argparse.Namespace) -> list[tuple[str | None, dict[str, Any]]]:
    """(node or None, admin request) for each request the command makes: a hostlist makes one per node."""
    if args.cmd in ("repaired", "release"):
        return [(node, _change_request(args, node)) for node in args.node]
    return [(None, _change_request(args))]


def _change_request(args: argparse.Namespace, node: str | None = None) -> dict[str, Any]:
    if args.cmd in ("approve", "reject"):
        return {"cmd": args.cmd, "args": {"decision_id": args.id, "why": args.why}}
    if args.cmd == "undo":
        return {"cmd": "undo", "args": {"action_id": args.id, "why": args.why}}
    if args.cmd == "repaired":
        return {"cmd": "repaired", "args": {"node": node, "why": args.why}}
    if args.cmd == "close":
        return {"cmd": "close", "args": {"incident_id": args.incident, "why": args.why}}
    if args.cmd == "release":
        return {"cmd": "release", "args": {"node": node, "why": args.why}}
    return {"cmd": "breaker-reset", "args": {"why": args.why}}


def _fail(code: int, message: str) -> int:
    sys.stderr.write(f"healthctl: {message}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.cmd in READS:
            led = open_readonly(args.ledger)
            try:
                doc, lines = READS[args.cmd](led, args)
            except LedgerError as exc:
                raise Unreachable(str(exc)) from exc
            except sqlite3.Error as exc:
                raise Unreachable(f"{args.ledger}: cannot read the ledger: {exc}") from exc
            finally:
                led.close()
            if args.json:
                print(json.dumps(doc, indent=2, sort_keys=True))
            else:
                print("\n".join(lines))
            return EXIT_OK
        if args.cmd == "inband":
            return _inband(args)
        if args.cmd == "goodput":
            return _goodput(args)
        if args.cmd == "what-if":
            return _what_if(args)
        requests = _change_requests(args)
        if len(requests) > 1:
            return _change_many(args, requests)
        reply = call_admin(args.socket, requests[0][1])
    except Unreachable as exc:
        return _fail(EXIT_UNREACHABLE, str(exc))
    except AdminUnreachable as exc:
        return _fail(EXIT_UNREACHABLE, str(exc))
    except Refused as exc:
        return _fail(EXIT_REFUSED, str(exc))
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    if not reply.get("ok") and reply.get("error") in ("busy", "timeout"):
        return _fail(EXIT_UNREACHABLE, str(reply.get("message") or reply.get("error")))  # worth trying again
    if not reply.get("ok"):
        return _fail(EXIT_REFUSED, str(reply.get("message", "refused")).splitlines()[0] if reply.get("message") else "refused")
    if not args.json:
        print(reply.get("message", "ok"))
    return EXIT_OK


def _what_if(args: argparse.Namespace) -> int:
    """`healthd-sim replay` over the live controller's record, under its own configuration with
    --mode and --set on top. The replay runs the controller's round in a process of its own (the
    simulator is not part of the controller); its output and exit status are healthctl's."""
    config = args.config or (CONTROLLER_CONFIG_PATH if os.path.exists(CONTROLLER_CONFIG_PATH) else None)
    live = load_controller_settings(config) if config else None
    history = args.history
    if history is None:
        history = str((live.history if live else HistorySettings()).file(args.ledger))
    argv = [sys.executable, "-m", "healthd.sim.replay", "--history", history, "--ledger", args.ledger,
            "--mode", args.mode, "--since", args.since, "--format", "json" if args.json else "table"]
    # the jobs' gathered goodput logs, where the controller keeps them, for the measured figures
    gathered = (live.goodput if live else GoodputSettings()).at(args.ledger)
    if gathered is not None and gathered.directory and os.path.isdir(gathered.directory):
        argv += ["--goodput", gathered.directory]
    if config:
        argv += ["--config", config]
    if args.until:
        argv += ["--until", args.until]
    for item in args.overrides:
        argv += ["--set", item]
    return subprocess.run(argv, check=False).returncode


def _inband(args: argparse.Namespace) -> int:
    """A read the controller answers from memory (the ledger does not hold it)."""
    try:
        reply = call_admin(args.socket, {"cmd": "inband", "args": {"job": args.job}})
    except AdminUnreachable as exc:
        return _fail(EXIT_UNREACHABLE, str(exc))
    if not reply.get("ok"):
        if reply.get("error") in ("busy", "timeout"):
            return _fail(EXIT_UNREACHABLE, str(reply.get("message") or reply.get("error")))
        return _fail(EXIT_REFUSED, str(reply.get("message") or "refused").splitlines()[0])
    doc = reply.get("data") or {}
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else "\n".join(inband_lines(doc)))
    return EXIT_OK


def _change_many(args: argparse.Namespace, requests: list[tuple[str | None, dict[str, Any]]]) -> int:
    """One request per node, in order. Each answer is one line (`node: message`, or the refusal on
    stderr); the exit code is the worst: 3 when the controller could not be reached or was busy (the
    nodes not sent are named), else 1 when any node was refused, else 0."""
    results: list[dict[str, Any]] = []
    worst = EXIT_OK
    for i, (node, request) in enumerate(requests):
        try:
            reply = call_admin(args.socket, request)
        except AdminUnreachable as exc:
            rest = [n for n, _ in requests[i:] if n]
            if args.json:
                print(json.dumps(results, indent=2, sort_keys=True))
            return _fail(EXIT_UNREACHABLE, f"{exc} (not sent for {fold(rest)})")
        results.append({"node": node, "reply": reply})
        message = str(reply.get("message") or reply.get("error") or ("ok" if reply.get("ok") else "refused"))
        message = message.splitlines()[0] if message else message
        if reply.get("ok"):
            if not args.json:
                print(f"{node}: {message}")
            continue
        if reply.get("error") in ("busy", "timeout"):
            worst = EXIT_UNREACHABLE
        elif worst == EXIT_OK:
            worst = EXIT_REFUSED
        sys.stderr.write(f"healthctl: {node}: {message}\n")
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
