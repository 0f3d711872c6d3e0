"""Reintegration: a node healthd drained comes back only after it proves itself (guilty until proven innocent).

A reintegration starts when an operator runs `healthctl repaired NODE` (trigger `repaired`) or, in
`auto` mode with `auto_on_clear`, when the agent of a node healthd drained reports its fault gone
(trigger `cleared`). Then, one step per control round, each recorded in the ledger before the next:

1. requested: wait until the node is DRAINED (its jobs have ended), create the MAINT reservation
   `healthd_validate_<node>` (users root) on it, and resume it inside the reservation (a ledger
   action keyed `reintegrate:<id>:resume`, after the same ownership re-read as every healthd write).
   Only validation can run there; user jobs cannot land on it.
2. validating: the configured validation commands run one after another (argv templates, no shell,
   each with a hard timeout, on a background thread so control rounds keep going). A controller
   restart re-runs them (validation is repeatable; a result is recorded only when complete).
3. passed validation: the reservation is deleted (the node is back in service: `back_in_service_at`
   on the incident's timeline), probation starts. Failed: the node is drained again with the failing
   step in its reason (`reintegrate:<id>:drain`) and stays drained for a human.
4. probation: a new healthd drain of the node within `probation_s` marks the reintegration `recurred`
   (the escalation counters then turn the next drain into inspect-hardware / contact-support, see
   policy.decide); at the end of the window it is `passed` and the incident `resolved`.

In-band evidence during probation: when a training job reports its step progress with ranks on the
node and on other nodes, the node's ranks are measured against the job's median each round
(healthd.controller.inband.node_ratio) and the latest measurement is the reintegration's detail; at
the end of probation it reads `verified in-band: ...` when they are within the detector's `min_effect`
of it. A job wholly on the node has nothing to compare with (`no peer to compare`). A straggler flag
on the node during probation (the job-wide comparison's or the agent's own `inband.straggler:*`)
never drains anything (in-band evidence alone is T3): it is recorded, once, as `in-band: still slow`
with a warning, and at the end of probation the reintegration still `passed` (healthd did not have to
drain the node again) but its incident is left `in-band-slow`, not closed, for an operator to look at
and close (`healthctl close`). Without in-band data nothing of this happens.

Every write a reintegration makes (the reservation created and deleted, the resume into it, the drain
again after a failed validation) is a decision it proposes to the control round: the round gates it
with the same gates as every other decision (the action table says which apply to each kind,
healthd.controller.actions) and the executor applies what they allow. A reintegration whose writes
the gates hold back waits for a later round; one whose node is no longer healthd's is aborted.

Hot spares (healthd.controller.spares) are revalidated with the same validation: the round hands an
allowed `spare-validate` decision to `validate_spare`, which runs the same commands on the same kind
of background thread with {reservation} the spare's own reservation, and takes the results back with
`finished_spares`; the round records them and drains a spare that failed. A spare whose
revalidation failed waits for `healthctl repaired`, as after a failed reintegration.

While a reintegration is in flight, evidence of the findings it clears that is older than the request
no longer counts (policy.without_cleared), and the agent is told to drop it (a `clear-finding`
instruction on its report's response): a repaired GPU's old Xid 79 line must not re-drain it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from healthd.controller import inband
from healthd.controller.actions import Decision, series_key
from healthd.controller.executor import ExecResult
from healthd.controller.gates import GateResult
from healthd.controller.ledger import INBAND_SLOW_STATUS, Ledger, Reintegration
from healthd.model import is_cleared
from healthd.controller.ownership import Hold, describe_reason, owned
from healthd.controller.policy import FleetView, NodeReport, is_actionable, make_reason
from healthd.controller.spares import FAILED_SIGNATURE
from healthd.settings import DetectorSettings
from healthd.slurm.backend import NodeInfo, SlurmBackend, SlurmError, StepResult

_log = logging.getLogger("healthd.controller.reintegrate")

RESERVATION_PREFIX = "healthd_validate_"
DEFAULT_VALIDATION: tuple[tuple[str, ...], ...] = (
    ("srun", "--reservation={reservation}", "--nodelist={node}", "--nodes=1", "--exclusive", "--time=30",
     "--job-name=healthd-validate", "healthd", "validate", "--dcgm-level=2"),
)
PLACEHOLDERS = ("node", "reservation", "incident", "slurm_conf")
OUTPUT_TAIL = 2000
INBAND_MEASURED = "in-band so far: "
INBAND_VERIFIED = "verified in-band: "
INBAND_NOT_VERIFIED = "in-band, not verified: "
INBAND_NO_PEER = "in-band: no peer to compare"
INBAND_STILL_SLOW = "in-band: still slow"
Gate = Callable[[Sequence[Decision]], Sequence[GateResult]]
"""The round's gates over a batch of proposed decisions (healthd.controller.gates.apply_gates)."""
Act = Callable[[GateResult], ExecResult]
"""The round's act step for one allowed outcome (healthd.controller.executor.Executor.apply)."""
_MEASURE = re.compile(r"ranks at (?P<pct>[0-9.]+) % of job (?P<job>.+)'s median over (?P<n>[0-9]+) windows?$")


@dataclass(frozen=True)
class ReintegrationSettings:
    """How a node healthd drained is validated and put back (controller.yaml `reintegration:`)."""

    auto_on_clear: bool = True
    """In `auto` mode, start reintegration by itself when the agent of a node healthd drained reports
    the fault cleared (never for an escalated incident or after a failed validation; those wait for
    `healthctl repaired`)."""
    reservation_minutes: int = 120
    """Length of the MAINT reservation the validation runs in (it is deleted as soon as validation ends)."""
    validation: tuple[tuple[str, ...], ...] = DEFAULT_VALIDATION
    """Commands run in order by the controller, each an argv list (no shell) with the placeholders
    {node}, {reservation}, {incident}, {slurm_conf}; all must exit 0. The default runs
    `healthd validate --dcgm-level=2` on the node through srun in the reservation (dcgmi diag -r 2
    when DCGM is installed there). Add the site's all-reduce test as another entry."""
    validation_timeout_s: float = 1800.0
    """Hard limit for each validation command; a command still running then is killed and fails."""
    probation_s: float = 86400.0
    """After a passed validation, a recurrence within this many seconds counts against the repair."""
    inspect_after: int = 2
    """The same fault (finding signature) on a node after this many remediations within
    `inspect_window_s` escalates the next drain to inspect-hardware."""
    inspect_window_s: float = 30 * 86400.0
    """Window for `inspect_after`."""
    support_after: int = 5
    """This many remediations of a node (any fault) within `support_window_s` escalate to contact-support."""
    support_window_s: float = 7 * 86400.0
    """Window for `support_after` (7 days)."""

    def __post_init__(self) -> None:
        if not self.validation or not all(self.validation):
            raise ValueError("reintegration validation: expected at least one non-empty command")
        for argv in self.validation:
            for arg in argv:
                for name in re.findall(r"{([^{}]*)}", arg):
                    if name not in PLACEHOLDERS:
                        raise ValueError(f"reintegration validation: unknown placeholder {{{name}}} in {arg!r}; "
                                         f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
        for name in ("reservation_minutes", "inspect_after", "support_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reintegration {name}: expected an integer of 1 or more, found {value!r}")
        for name in ("validation_timeout_s", "probation_s", "inspect_window_s", "support_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"reintegration {name}: expected a number greater than 0")


def reservation_name(node: str, rid: int) -> str:
    """`healthd_validate_<node>`, or `healthd_validate_r<id>` when the node name has characters a
    reservation name cannot take."""
    name = f"{RESERVATION_PREFIX}{node}"
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        return name
    return f"{RESERVATION_PREFIX}r{rid}"


def expand(argv: tuple[str, ...], values: Mapping[str, str]) -> list[str]:
    """Fill the placeholders of one validation command (pure; unknown ones were refused at load)."""
    return [re.sub(r"{(" + "|".join(PLACEHOLDERS) + r")}", lambda m: values[m.group(1)], a) for a in argv]


def run_validation(commands: list[list[str]], backend: SlurmBackend, timeout_s: float) -> list[dict[str, Any]]:
    """Run the commands in order through the backend (its Slurm environment; 124 when one is killed
    at `timeout_s`, 127 when one cannot start), stopping at the first failure. One result per
    command run."""
    results = []
    for argv in commands:
        started = time.monotonic()
        try:
            done = backend.run_step(argv, timeout_s)
        except (SlurmError, ValueError) as exc:  # not even handed to Slurm: a failed step, not a dead thread
            done = StepResult(127, f"{type(exc).__name__}: {exc}")
        results.append({"argv": argv, "rc": done.returncode, "seconds": round(time.monotonic() - started, 3),
                        "output": done.output[-OUTPUT_TAIL:]})
        if done.returncode != 0:
            break
    return results


def failure_summary(results: list[dict[str, Any]]) -> str:
    """One line naming the failed command and the last line it printed."""
    failed = next((r for r in results if r.get("rc") != 0), None)
    if failed is None:
        return "no command failed"
    argv = failed.get("argv") or ["?"]
    name = next((a.rsplit("/", 1)[-1] for a in argv if not a.startswith("-") and a.rsplit("/", 1)[-1] != "srun"), argv[0])
    lines = [ln.strip() for ln in str(failed.get("output", "")).splitlines() if ln.strip()]
    last = f": {lines[-1]}" if lines else ""
    return f"{name} rc={failed.get('rc')}{last}"


def measured(node: str, m: inband.NodeRatio) -> str:
    """The text of one in-band measurement (what the probation records and decides on)."""
    return f"{node}'s ranks at {m.ratio * 100:.1f} % of job {m.job}'s median over {m.windows} window{'s' * (m.windows != 1)}"


def still_slow(job: str, effect: float | None) -> str:
    return f"{INBAND_STILL_SLOW} ({effect * 100:+.1f} % in job {job})" if effect is not None else \
        f"{INBAND_STILL_SLOW} (in job {job})"


def probation_verdict(detail: str | None, min_effect: float) -> tuple[str | None, bool]:
    """(the detail a probation ends with, whether the incident is resolved) from the in-band evidence
    recorded during it (the reintegration's detail): a measurement within `min_effect` of the job's
    median is `verified in-band`, one above it is said so (the detector did not flag it: resolved);
    a straggler flag leaves the incident open; no in-band evidence changes nothing."""
    if not detail:
        return detail, True
    if detail.startswith(INBAND_STILL_SLOW):
        return f"{detail}; probation over, incident left open for an operator", False
    if detail.startswith(INBAND_MEASURED):
        what = detail[len(INBAND_MEASURED):]
        m = _MEASURE.search(what)
        if m is not None and float(m.group("pct")) / 100.0 - 1.0 < min_effect:
            return INBAND_VERIFIED + what, True
        return f"{INBAND_NOT_VERIFIED}{what} (more than {min_effect:.0%} above it, not flagged)", True
    return detail, True


def cleared_findings(reintegrations: list[Reintegration]) -> dict[str, dict[str, float]]:
    """node -> finding id -> the time before which its evidence no longer counts."""
    out: dict[str, dict[str, float]] = {}
    for r in reintegrations:
        for fid in r.findings:
            per = out.setdefault(r.node, {})
            per[fid] = max(per.get(fid, 0.0), r.requested_at)
    return out


class Reintegrator:
    """Moves reintegrations on, one step per control round (called from the daemon under its round lock)."""

    def __init__(self, settings: ReintegrationSettings, ledger: Ledger, backend: SlurmBackend, *,
                 read_node: Callable[[str], NodeInfo], slurm_conf: str, dry_run: bool = False,
                 detector: DetectorSettings | None = None):
        self.settings = settings
        self.detector = detector or DetectorSettings()
        """The in-band detector's settings: a node on probation within `min_effect` of its job's median is
        verified in-band."""
        self.ledger = ledger
        self.backend = backend
        """Runs the validation commands and reads whether a reservation exists; writes nothing."""
        self.read_node = read_node
        """One node, fresh from Slurm."""
        self.slurm_conf = slurm_conf
        """The {slurm_conf} of the validation commands."""
        self.dry_run = dry_run
        # keyed by reintegration id, or by a spare validation's series (validate_spare)
        self._threads: dict[int | str, threading.Thread] = {}
        self._results: dict[int | str, list[dict[str, Any]]] = {}
        self._spares: dict[str, GateResult] = {}
        self._lock = threading.Lock()
        self._gate: Gate = lambda decisions: ()
        self._act: Act | None = None
        self._round: tuple[Mapping[str, NodeReport], tuple[inband.Flag, ...], float] = ({}, (), 0.0)
        self._views: dict[str, inband.JobView] | None = None

    # -- what other parts ask ------------------------------------------------------------------------

    def cleared(self, now: float) -> dict[str, dict[str, float]]:
        """Findings whose older evidence no longer counts: those of reintegrations in flight, and of
        those that ended within the support window (a finding the agent still echoes must not
        re-drain a node that passed)."""
        # read from SQL, not the whole table: reintegrations accumulate for as long as the ledger lives
        recent = (self.ledger.reintegrations(state="active")
                  + self.ledger.reintegrations(state="passed", since=now - self.settings.support_window_s))
        return cleared_findings(recent)

    def instructions_for(self, report: NodeReport, ledger: Ledger | None = None) -> list[dict[str, Any]]:
        """`clear-finding` for the agent while its report still carries evidence a reintegration cleared
        (scope `evidence`), or the episode of a finding an operator dismissed (undo, close, hand-over:
        scope `episode`). Read from `ledger` (default: the reintegrator's own)."""
        ledger = ledger or self.ledger
        out = []
        active = ledger.active_reintegration(report.node)
        if active is not None and active.findings:
            clears = dict.fromkeys(active.findings, active.requested_at)
            stale = [f.id for f in report.findings if is_cleared(f, clears)]
            if stale:
                out.append({"kind": "clear-finding", "findings": sorted(stale), "before": active.requested_at,
                            "incident": active.incident_id, "reintegration": active.id})
        if report.findings:
            since = report.received_at - self.settings.support_window_s
            dismissed: dict[str, float] = {}
            for c in ledger.clears(node=report.node, since=since):
                if c.scope == "episode":
                    dismissed[c.finding_id] = max(dismissed.get(c.finding_id, 0.0), c.before)
            same = [f.id for f in report.findings if dismissed and is_cleared(f, {}, dismissed)]
            if same:
                out.append({"kind": "clear-finding", "scope": "episode", "findings": sorted(same),
                            "before": max(dismissed[f] for f in same)})
        return out

    # -- hot spares ----------------------------------------------------------------------------------

    def validate_spare(self, outcome: GateResult) -> None:
        """Run the validation commands on a spare inside its own reservation (`outcome`: an allowed
        `spare-validate` decision, its reservation the decision's target), on the same background
        thread as a reintegration's; `finished_spares` hands back the results. Once per series."""
        d = outcome.decision
        with self._lock:
            if d.series in self._spares:
                return
            self._spares[d.series] = outcome
        self._launch(d.series, d.node, d.target, None)

    def spares_validating(self) -> frozenset[str]:
        """The spares whose validation was launched and is not handed back yet."""
        with self._lock:
            return frozenset(o.decision.node for o in self._spares.values())

    def finished_spares(self) -> list[tuple[GateResult, list[dict[str, Any]]]]:
        """The spare validations that completed since the last call: (the decision's outcome, one result
        per command run), each handed back once."""
        out = []
        with self._lock:
            for series in [k for k in self._spares if k in self._results]:
                self._threads.pop(series, None)
                out.append((self._spares.pop(series), self._results.pop(series)))
        return out

    # -- the round ---------------------------------------------------------------------------------

    def auto_requests(self, fleet: FleetView, holds: Mapping[str, Hold], mode: str, now: float,
                      report_ttl_s: float) -> list[Reintegration]:
        """In auto mode, queue the nodes healthd drained whose agent now reports nothing actionable
        (evidence cleared by a reintegration already filtered out of `fleet`)."""
        if mode != "auto" or not self.settings.auto_on_clear:
            return []
        started = []
        for node, hold in holds.items():
            incident_id = hold.incident_id
            report, info = fleet.reports.get(node), fleet.nodes.get(node)
            if incident_id is None or report is None or info is None or now - report.received_at > report_ttl_s:
                continue
            if not owned(hold, info) or not info.drain_requested or info.reboot_requested:
                continue
            if report.verdict == "unknown" or any(is_actionable(f) for f in report.findings):
                continue
            incident = self.ledger.incident(incident_id)
            if incident is None or incident.escalation is not None or incident.signature.startswith(FAILED_SIGNATURE):
                continue  # escalated, or a spare that failed its revalidation: a human looks at it first
            if incident.action_applied_at is not None and report.received_at <= incident.action_applied_at:
                continue  # no observation since the drain yet
            if self.ledger.active_reintegration(node) is not None:
                continue
            if any(r.state in ("failed", "aborted") for r in self.ledger.reintegrations(incident_id=incident_id)):
                continue  # a human looks at it first (`healthctl repaired`)
            r = self.ledger.request_reintegration(node, incident_id=incident_id, trigger="cleared", at=now)
            _log.info("%s: fault cleared on a node healthd drained [#%s]: reintegration %s requested", node,
                      incident_id, r.id)
            started.append(r)
        return started

    def step(self, now: float, mode: str, *, gate: Gate, act: Act, reports: Mapping[str, NodeReport] | None = None,
             flags: Iterable[inband.Flag] = (), report_ttl_s: float = 0.0) -> list[tuple[Reintegration, str]]:
        """Advance every reintegration in flight by at most one step. Returns (reintegration, what
        happened) for those that moved. Nothing is written in observe mode; every write is proposed to
        the round: `gate` gates a batch of decisions, `act` applies one it allowed. `reports` (fresh
        within `report_ttl_s`) and the round's in-band straggler `flags` are the in-band evidence
        probation records; none: none is recorded."""
        if mode == "observe":
            return []
        self._gate, self._act = gate, act
        self._round = (reports or {}, tuple(flags), report_ttl_s)
        self._views = None
        moved = []
        for r in self.ledger.reintegrations(state="active"):
            try:
                what = {"requested": self._start, "validating": self._validating, "probation": self._probation}[r.state](r, now, mode)
            except SlurmError as exc:
                _log.warning("%s: reintegration %s waits: Slurm: %s", r.node, r.id, exc)
                what = None
            if what:
                moved.append((self.ledger.reintegration(r.id) or r, what))
        return moved

    # -- steps -------------------------------------------------------------------------------------

    def _abort(self, r: Reintegration, why: str, now: float) -> str:
        self.ledger.update_reintegration(r.id, state="aborted", detail=why, stamp="ended_at",
                                         incident_status="open" if r.incident_id is not None else None, at=now)
        _log.warning("%s: reintegration %s aborted: %s", r.node, r.id, why)
        return f"aborted: {why}"

    def _decision(self, r: Reintegration, key: str, kind: str, reason: str, now: float, **kw: Any) -> Decision:
        return Decision(id=f"reintegrate:{r.id}:{key}", kind=kind, node=r.node, reason=reason, tier=1,  # type: ignore[arg-type]
                        incident="" if r.incident_id is None else str(r.incident_id), decided_at=now, **kw)

    def _reservation(self, r: Reintegration, kind: str, name: str, now: float) -> Decision:
        detail = {"minutes": self.settings.reservation_minutes} if kind == "reservation-create" else {}
        return self._decision(r, kind, kind, f"reintegration {r.id}: {kind} {name}", now, target=name, detail=detail)

    def _applied(self, decision: Decision) -> bool:
        # applied before a restart: the fresh read would refuse it as already done
        return any(a.status == "applied" for a in self.ledger.series(series_key(decision)))

    def _propose(self, decisions: Sequence[Decision]) -> tuple[GateResult, ...] | str:
        """The round's outcomes of `decisions`, all allowed; else why not (they wait for a later round)."""
        outcomes = tuple(self._gate(decisions))
        held = next((o for o in outcomes if o.status != "allowed"), None)
        if held is not None or len(outcomes) != len(decisions):
            return f"{held.label}: {held.reason}" if held is not None else "not gated"
        return outcomes

    def _write(self, outcome: GateResult) -> tuple[bool | None, str]:
        """(True: done now or before, None: a dry run, False: failed or refused on the fresh read; detail)."""
        assert self._act is not None
        result = self._act(outcome)
        if result.status in ("applied", "already-applied"):
            return True, result.detail
        if result.status == "dry-run":
            return None, "dry run"
        return False, result.detail or result.status

    def _start(self, r: Reintegration, now: float, mode: str) -> str | None:
        fresh = self.read_node(r.node)
        name = reservation_name(r.node, r.id)
        resume = self._decision(r, "resume", "resume", f"reintegration {r.id}: resume inside {name} for validation",
                                now)
        if not self._applied(resume):
            if not owned(self.ledger.hold(r.node), fresh):
                return self._abort(r, f"{r.node} is no longer healthd's by record ({fresh.state}, "
                                      f"{describe_reason(fresh)})", now)
            if not fresh.drained:
                return None  # jobs still running on the draining node: validation waits for them
            proposed = [self._reservation(r, "reservation-create", name, now), resume]
            if not self.dry_run and self.backend.reservation_exists(name):
                # left by a controller that died after creating it: start from a clean one
                proposed.insert(0, self._reservation(r, "reservation-delete", name, now))
            outcomes = self._propose(proposed)
            if isinstance(outcomes, str):
                if outcomes.startswith("refused-by-ownership"):
                    return self._abort(r, f"cannot resume {r.node} for validation: {outcomes}", now)
                _log.info("%s: reintegration %s waits: %s", r.node, r.id, outcomes)
                return None
            for outcome in outcomes[:-1]:
                done, detail = self._write(outcome)
                if not done:
                    if done is False:
                        _log.warning("%s: reintegration %s waits: %s", r.node, r.id, detail)
                    return None
            done, detail = self._write(outcomes[-1])
            if done is None:
                return None
            if not done:
                self._delete_reservation(r, name, now)
                return self._abort(r, f"cannot resume {r.node} for validation: {detail}", now)
        self.ledger.update_reintegration(r.id, state="validating", reservation=name, stamp="started_at", at=now)
        self._launch(r.id, r.node, name, r.incident_id)
        _log.info("%s: reintegration %s: resumed inside reservation %s; validating", r.node, r.id, name)
        return f"validating in reservation {name}"

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait for the validations running now to finish (at most `timeout_s` each): a caller on a
        virtual clock, whose validation steps return at once, then finds their results at its next
        round whatever the threads' timing."""
        with self._lock:
            running = list(self._threads.values())
        for thread in running:
            thread.join(timeout_s)

    def _launch(self, rid: int | str, node: str, reservation: str, incident_id: int | None) -> None:
        values = {"node": node, "reservation": reservation, "incident": "" if incident_id is None else str(incident_id),
                  "slurm_conf": self.slurm_conf}
        commands = [expand(argv, values) for argv in self.settings.validation]

        def run() -> None:
            results = run_validation(commands, self.backend, self.settings.validation_timeout_s)
            with self._lock:
                self._results[rid] = results

        with self._lock:
            if rid in self._threads:
                return
            thread = threading.Thread(target=run, name=f"healthd-validate-{node}", daemon=True)
            self._threads[rid] = thread
        thread.start()

    def _create_reservation(self, r: Reintegration, name: str, now: float) -> bool:
        """The MAINT reservation validation runs in (one that exists already is done); False: not now."""
        return self._carry_out(self._reservation(r, "reservation-create", name, now))

    def _delete_reservation(self, r: Reintegration, name: str | None, now: float) -> bool:
        """The reservation gone (gone already is done); False: not now, tried again next round."""
        return not name or self._carry_out(self._reservation(r, "reservation-delete", name, now))

    def _carry_out(self, decision: Decision) -> bool:
        outcomes = self._propose([decision])
        if isinstance(outcomes, str):
            _log.info("%s: %s waits: %s", decision.node, decision.kind, outcomes)
            return False
        done, detail = self._write(outcomes[0])
        if done is False:
            _log.warning("%s: %s not done (retrying next round): %s", decision.node, decision.kind, detail)
        return bool(done)

    def _validating(self, r: Reintegration, now: float, mode: str) -> str | None:
        if r.validated_at is not None and r.results:
            results = list(r.results)  # recorded, only the finishing step failed before
        else:
            with self._lock:
                results = self._results.pop(r.id, None)
                running = r.id in self._threads
            if results is None:
                name = r.reservation or reservation_name(r.node, r.id)
                if not self.dry_run and not self.backend.reservation_exists(name):
                    # gone while the node is resumed for validation (deleted by someone, or slurmctld came
                    # back from an older state save): user jobs could land on it, so it comes back first
                    _log.warning("%s: reservation %s is gone during validation; creating it again", r.node, name)
                    self._create_reservation(r, name, now)
                if not running:  # a restart: validation is repeatable, run it again
                    self._launch(r.id, r.node, name, r.incident_id)
                return None
            with self._lock:
                self._threads.pop(r.id, None)
            r = self.ledger.update_reintegration(r.id, results=results, stamp="validated_at", at=now)
        passed = bool(results) and all(x.get("rc") == 0 for x in results)
        if passed:
            if not self._delete_reservation(r, r.reservation, now):
                return None
            self.ledger.update_reintegration(r.id, state="probation", probation_until=now + self.settings.probation_s,
                                             incident_status="probation", at=now)
            if r.incident_id is not None:
                self.ledger.mark_timeline(r.incident_id, "back_in_service_at", now)
            _log.info("%s: reintegration %s: validation passed (%d command(s)); back in service, probation %.0f s",
                      r.node, r.id, len(results), self.settings.probation_s)
            return "validation passed: back in service, probation"
        summary = failure_summary(results)
        reason = make_reason(f"validation failed: {summary}", "" if r.incident_id is None else str(r.incident_id))
        redrain = self._decision(r, "drain", "redrain", reason, now)
        outcomes = self._propose([redrain])
        if isinstance(outcomes, str) and not outcomes.startswith("refused-by-ownership"):
            _log.info("%s: reintegration %s: the drain after the failed validation waits: %s", r.node, r.id, outcomes)
            return None
        done, detail = (False, outcomes) if isinstance(outcomes, str) else self._write(outcomes[0])
        if not done:
            if done is None:
                return None
            self._delete_reservation(r, r.reservation, now)
            return self._abort(r, f"validation failed ({summary}) but the node could not be drained again: {detail}", now)
        self._delete_reservation(r, r.reservation, now)
        self.ledger.update_reintegration(r.id, state="failed", detail=summary, stamp="ended_at",
                                         incident_status="validation-failed", at=now)
        _log.error("%s: reintegration %s: validation failed: %s; drained again", r.node, r.id, summary)
        return f"validation failed: {summary}"

    def _probation(self, r: Reintegration, now: float, mode: str) -> str | None:
        if self.ledger.hold(r.node) is not None:
            self.ledger.update_reintegration(r.id, state="recurred", detail="drained again by healthd during probation",
                                             stamp="ended_at", incident_status="recurred", at=now)
            _log.error("%s: reintegration %s: the node failed again during probation", r.node, r.id)
            return "recurred during probation"
        r = self._inband_probation(r, now)
        if r.probation_until is not None and now >= r.probation_until:
            detail, resolved = probation_verdict(r.detail, self.detector.min_effect)
            if not resolved:
                self.ledger.update_reintegration(r.id, state="passed", detail=detail, stamp="ended_at",
                                                 incident_status=INBAND_SLOW_STATUS, at=now)
                _log.warning("%s: reintegration %s: probation over; %s", r.node, r.id, detail)
                return f"probation passed: {detail}"
            self.ledger.update_reintegration(r.id, state="passed", detail=detail if detail != r.detail else None,
                                             stamp="ended_at", incident_status="resolved", at=now)
            _log.info("%s: reintegration %s: probation over; incident resolved%s", r.node, r.id,
                      f" ({detail})" if detail else "")
            return "probation passed: resolved" + (f"; {detail}" if detail else "")
        return None

    def _inband_probation(self, r: Reintegration, now: float) -> Reintegration:
        """Record this round's in-band evidence about the node on probation (the reintegration's detail):
        a straggler flag on it (kept from then on), else the node's ranks against their job's median,
        else that its jobs run on it alone. Only a report of the node received since its validation
        counts. Never drains: in-band evidence alone is T3."""
        reports, flags, ttl = self._round
        report = reports.get(r.node)
        since = r.validated_at if r.validated_at is not None else r.requested_at
        if report is None or report.received_at < since or now - report.received_at > ttl:
            return r
        if r.detail and r.detail.startswith(INBAND_STILL_SLOW):
            return r  # recorded once; the end of probation leaves the incident open
        slow = inband.slowest_on(r.node, flags, report.findings)
        if slow is not None:
            detail = still_slow(*slow)
            _log.warning("%s: reintegration %s: %s during probation (in-band evidence only: no action; "
                         "the incident stays open at the end of probation)", r.node, r.id, detail)
            return self.ledger.update_reintegration(r.id, detail=detail, at=now)
        if not report.inband:
            return r
        if self._views is None:
            self._views = inband.merge(reports.values(), now, ttl)
        ratio = inband.node_ratio(self._views, r.node)
        if ratio is not None:
            detail = INBAND_MEASURED + measured(r.node, ratio)
        else:
            alone = inband.alone_on(self._views, r.node)
            if not alone or (r.detail and r.detail.startswith(INBAND_MEASURED)):
                return r  # a measurement made earlier in the probation stays the evidence
            detail = f"{INBAND_NO_PEER} (job{'s' * (len(alone) > 1)} {', '.join(alone)} on {r.node} alone)"
        if detail == r.detail:
            return r
        return self.ledger.update_reintegration(r.id, detail=detail, at=now)

    def close(self) -> None:
        """Validation threads are daemons: a stopping controller does not wait for them (a restart re-runs)."""
