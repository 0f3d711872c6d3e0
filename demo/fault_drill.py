"""`make demo`: the fleet fault drill. A real local Slurm cluster (4 nodes, fake GPUs), a real `healthd run`
agent per simulated GPU node and the real `healthd-controller` in `auto` mode (demo/harness.py), then:

1. A batch job that opted in to requeue (`--comment healthd:requeue`, `--requeue`) runs on node02. An
   Xid 79 ("GPU has fallen off the bus") is written to node02's kernel journal. The timeline shows the
   agent's verdict, the controller's decision, the drain in `scontrol show node`, and the job requeued
   and running on another node.
2. Repair: `healthctl repaired node02`; the controller validates node02 in a maintenance reservation,
   resumes it and holds it on probation until the incident is resolved.
3. A correlated event: Xid 79 on 3 of the 4 nodes within the same second. The circuit breaker must open
   and healthd must drain no more nodes than the breaker's configuration lets through.

It ends with one PASS/FAIL line carrying the measured timings; exit 0 on PASS, 1 on FAIL. Everything it
starts is stopped by PID and every temporary directory removed, also on Ctrl-C.

    .venv/bin/python demo/fault_drill.py [--keep-going] [--fail-path]

Why the job is steered by node weight and not pinned with `-w node02`: a requeued job keeps its
requested node list, so a job pinned to node02 would stay pending on the drained node forever. The
drill instead gives node02 the lowest scheduling weight (`scontrol update NodeName=node02 Weight=1`,
node03 50, the others 100) and submits a plain one-node job, which Slurm places on node02; after the
requeue Slurm places it on the next-lightest healthy node (node03) by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from demo.harness import FleetHarness, HarnessError  # noqa: E402

FAULT_NODE = "node02"
CORRELATED = ("node01", "node03", "node04")
FINDING = "xid:gpu0:79"
POLICY: dict[str, Any] = {
    "mode": "auto",
    # breaker: opens when MORE than 40% of the fleet fails (2 of 4 nodes), counting from 2 failing nodes
    "breaker_percent": 40.0,
    "breaker_min_nodes": 2,
    "breaker_nodes": 10,
    "breaker_window_s": 30.0,
    # rate limits out of the way: here the breaker is what must hold the line
    "max_actions_per_hour": 10,
    "max_actions_per_partition_per_hour": 10,
    "report_ttl_s": 60.0,
}
PROBATION_S = 10
ROUND_S = 0.5


def breaker_drain_limit(policy: dict[str, Any], total: int) -> int:
    """The most nodes that can fail (and so be drained) while the breaker stays closed."""
    for count in range(1, total + 1):
        by_count = count > policy["breaker_nodes"]
        by_pct = count >= policy["breaker_min_nodes"] and count * 100.0 / total > policy["breaker_percent"]
        if by_count or by_pct:
            return count - 1
    return total


# --------------------------------------------------------------------------------------------------
# the timeline


class Timeline:
    """`HH:MM:SS +S.SSs [who] what`, seconds relative to the current phase's zero (the injection).

    Events carry their own time (an agent's generated_at, the ledger's decided_at, the moment Slurm
    showed it); inside `buffered()` they are held back `lag_s` and printed in time order, since the
    drill learns some of them (the ledger's) a little after the fact."""

    def __init__(self) -> None:
        self.zero = time.time()
        self.lag_s = 0.0
        self._pending: list[tuple[float, int, float, str, str]] = []
        self._seq = 0

    def phase(self, title: str) -> None:
        self.flush()
        print(f"\n== {title}", flush=True)

    def reset(self, zero: float) -> None:
        self.flush()
        self.zero = zero

    def __call__(self, who: str, what: str, at: float | None = None) -> None:
        at = time.time() if at is None else at
        self._seq += 1
        self._pending.append((at, self._seq, self.zero, who, what))
        self.flush(time.time() - self.lag_s)

    def flush(self, upto: float | None = None) -> None:
        self._pending.sort()
        while self._pending and (upto is None or self._pending[0][0] <= upto):
            at, _, zero, who, what = self._pending.pop(0)
            clock = _dt.datetime.fromtimestamp(at).strftime("%H:%M:%S")
            print(f"{clock} {at - zero:+7.2f}s [{who}] {what}", flush=True)

    @contextlib.contextmanager
    def buffered(self, lag_s: float = 1.0) -> Iterator[None]:
        self.lag_s = lag_s
        try:
            yield
        finally:
            self.lag_s = 0.0
            self.flush()


def _iso(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return _dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


class Failed(Exception):
    """A step of the drill did not happen; the message says which."""


def poll(step: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1,
         tl: Timeline | None = None) -> None:
    """Call `step` until it returns True; Failed(what) after timeout_s. Flushes `tl` as it goes."""
    deadline = time.monotonic() + timeout_s
    while not step():
        if tl is not None:
            tl.flush(time.time() - tl.lag_s)
        if time.monotonic() > deadline:
            raise Failed(f"{what} (not within {timeout_s:.0f} s)")
        time.sleep(interval_s)


# --------------------------------------------------------------------------------------------------
# the drill


class Drill:
    def __init__(self, fleet: FleetHarness, work: Path, tl: Timeline, reintegration: bool):
        self.fleet = fleet
        self.work = work
        self.tl = tl
        self.reintegration = reintegration
        self.results: dict[str, float] = {}
        self.notes: list[str] = []
        self.job = ""
        self.incident: int | None = None
        self.validation_lines: set[str] = set()

    # -- reading the controller's ledger (read-only, as healthctl does) ------------------------------
    def ledger(self):
        from healthd.controller.healthctl import open_readonly

        return open_readonly(str(self.fleet.ledger))

    def read_ledger(self, fn: Callable[[Any], Any]) -> Any:
        try:
            led = self.ledger()
        except Exception:  # not there yet, or being migrated
            return None
        try:
            return fn(led)
        finally:
            led._conn.close()

    # -- phase 1 --------------------------------------------------------------------------------------
    def submit_job(self) -> None:
        f, tl = self.fleet, self.tl
        f.slurm(["scontrol", "update", "NodeName=node01,node04", "Weight=100"])
        f.slurm(["scontrol", "update", "NodeName=node03", "Weight=50"])
        f.slurm(["scontrol", "update", f"NodeName={FAULT_NODE}", "Weight=1"])
        tl("slurm", f"node weights: {FAULT_NODE} 1, node03 50, node01/node04 100 (Slurm fills the lightest node first)")
        out = f.slurm(["sbatch", "--parsable", "-N1", "-n1", "--requeue", "--comment=healthd:requeue training run",
                       "-J", "train", "-o", "/dev/null", "--wrap", "sleep 600"]).stdout.strip()
        self.job = out.split(";")[0]
        tl("slurm", f"sbatch -N1 --requeue --comment='healthd:requeue training run' --wrap 'sleep 600' -> job {self.job}")

        def running() -> bool:
            j = f.job(self.job)
            return j.get("JobState") == "RUNNING"
        poll(running, 30, f"job {self.job} did not start")
        where = f.job(self.job).get("NodeList")
        tl("slurm", f"job {self.job} RUNNING on {where}")
        if where != FAULT_NODE:
            raise Failed(f"job {self.job} started on {where}, not {FAULT_NODE}")

    def fault(self) -> None:
        f, tl = self.fleet, self.tl
        node = f.nodes[FAULT_NODE]
        line = f"NVRM: Xid (PCI:{node.bus(0)}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
        t0 = f.inject_xid(FAULT_NODE, 79, gpu=0)
        tl.reset(t0)
        tl("harness", f"xid 79 written to {FAULT_NODE}'s journal: {line}", at=t0)
        seen: dict[str, float] = {}

        def step() -> bool:
            now = time.time()
            if "agent" not in seen:
                doc = f.agent_state(FAULT_NODE) or {}
                found = [x for x in doc.get("findings", []) if x.get("id") == FINDING]
                if found:
                    x = found[0]
                    at = _iso(doc.get("generated_at")) or now
                    seen["agent"] = at
                    tl(f"agent {FAULT_NODE}", f"verdict {doc.get('verdict')} (T{x['tier']} {x['attribution']}: "
                       f"{x['summary']}; GPU {x['component'].get('index')} bus {x['component'].get('bus_id')} "
                       f"serial {x['component'].get('serial') or '-'}, "
                       f"action {x['action']})", at=at)
            if "decided" not in seen:
                inc = self.read_ledger(lambda led: next((i for i in led.incidents(node=FAULT_NODE)
                                                         if i.signature == FINDING), None))
                if inc is not None and inc.decided_at is not None and inc.action_applied_at is not None:
                    self.incident = inc.id
                    decisions = self.read_ledger(lambda led: led.decisions(incident_id=inc.id)) or []
                    d = next((d for d in decisions if d.outcome == "allowed"), None)
                    acts = self.read_ledger(lambda led: [a for d in decisions for a in led.actions(decision_id=d.id)]) or []
                    seen["detected"], seen["decided"] = inc.detected_at or now, inc.decided_at
                    tl("controller", f"report received, incident #{inc.id} opened ({inc.signature}, "
                       f"{inc.tier} {inc.attribution})", at=inc.detected_at)
                    kind = d.kind if d else "?"
                    tl("controller", f"decided {kind} [#{inc.id}] (mode auto; gates: mode, rate limit, breaker, "
                       f"correlation, capacity, ownership passed)", at=inc.decided_at)
                    for a in acts:
                        tl("controller", f"applied action #{a.id}: {' '.join(a.argv)} -> {a.outcome}",
                           at=a.applied_at or inc.action_applied_at)
            if "drain" not in seen:
                n = f.slurm_node(FAULT_NODE)
                if "DRAIN" in n.get("State", "") and n.get("Reason", "").startswith("healthd:"):
                    seen["drain"] = now
                    tl("slurm", f"scontrol show node: {FAULT_NODE} State={n['State']} Reason=\"{n['Reason']}\"", at=now)
            if "requeued" not in seen:
                j = f.job(self.job)
                if j.get("Restarts", "0") != "0" and j.get("JobState") == "PENDING":
                    seen["requeued"] = now
                    tl("slurm", f"job {self.job} requeued (Restarts={j['Restarts']}): {j.get('JobState')} "
                       f"Reason={j.get('Reason')} (Slurm holds a requeued job for AuthInfo cred_expire="
                       f"{f.requeue_delay_s}s)", at=now)
            if "running" not in seen and "requeued" in seen:
                j = f.job(self.job)
                if j.get("JobState") == "RUNNING" and j.get("NodeList") not in ("", FAULT_NODE):
                    seen["running"] = now
                    tl("slurm", f"job {self.job} RUNNING on {j['NodeList']} (was {FAULT_NODE})", at=now)
            return {"agent", "decided", "drain", "running"} <= set(seen)

        try:
            with tl.buffered():
                poll(step, 60, "drain + requeue", tl=tl)
        finally:
            missing = [k for k in ("agent", "decided", "drain", "requeued", "running") if k not in seen]
            if missing:
                self.notes.append(f"phase 1 did not see: {', '.join(missing)}")
        self.results["detection"] = seen["agent"] - t0
        self.results["decision"] = seen["decided"] - t0
        self.results["drain"] = seen["drain"] - t0
        self.results["requeue"] = seen["running"] - t0
        print()
        print(f.healthctl("show", str(self.incident), json_out=False).rstrip())

    # -- phase 2 --------------------------------------------------------------------------------------
    def repair(self, fail_first: bool) -> None:
        if fail_first:
            self._repair_once(expect_pass=False)
        self._repair_once(expect_pass=True)

    def _reservations(self) -> dict[str, dict[str, str]]:
        from demo.harness import _parse_kv

        out = self.fleet.slurm(["scontrol", "show", "reservation", "-o"], check=False).stdout
        res = [_parse_kv(line) for line in out.splitlines() if line.startswith("ReservationName=")]
        return {r["ReservationName"]: r for r in res}

    def _repair_once(self, expect_pass: bool) -> None:
        f, tl = self.fleet, self.tl
        marker = self.work / f"fail-{FAULT_NODE}"
        if expect_pass:
            marker.unlink(missing_ok=True)
        else:
            marker.touch()
        why = "reseated GPU 0" if expect_pass else "reseated GPU 0 (drill: validation will fail)"
        t0 = time.time()
        tl.reset(t0)
        out = f.healthctl("repaired", FAULT_NODE, "--why", why, json_out=False).strip()
        tl("operator", f"healthctl repaired {FAULT_NODE} --why '{why}': {out}", at=t0)
        resv = f"healthd_validate_{FAULT_NODE}"
        seen: dict[str, float] = {}
        last_status = {"v": "open"}
        last_state = {"v": f.slurm_node(FAULT_NODE).get("State", "")}
        log_lines = self.validation_lines

        def step() -> bool:
            now = time.time()
            inc = self.read_ledger(lambda led: led.incident(self.incident)) if self.incident else None
            if inc is not None and inc.status != last_status["v"]:
                last_status["v"] = inc.status
                tl("controller", f"incident #{inc.id} status -> {inc.status}", at=now)
                seen.setdefault(inc.status, now)
            if inc is not None and inc.back_in_service_at and "back" not in seen:
                seen["back"] = inc.back_in_service_at
                tl("controller", f"incident #{inc.id} back_in_service_at set", at=inc.back_in_service_at)
            r = self._reservations()
            if resv in r and "resv" not in seen:
                seen["resv"] = now
                x = r[resv]
                tl("slurm", f"reservation {resv}: Nodes={x.get('Nodes')} Users={x.get('Users')} "
                   f"Flags={x.get('Flags')}", at=now)
            if "resv" in seen and resv not in r and "resv_gone" not in seen:
                seen["resv_gone"] = now
                tl("slurm", f"reservation {resv} deleted", at=now)
            n = f.slurm_node(FAULT_NODE)
            state = n.get("State", "")
            if state != last_state["v"]:
                last_state["v"] = state
                tl("slurm", f"{FAULT_NODE} State={state} Reason={n.get('Reason') or '-'}"
                   + (f" ReservationName={n['ReservationName']}" if n.get("ReservationName") else ""), at=now)
            if "DRAIN" not in state and "resumed" not in seen:
                seen["resumed"] = now
            if "resumed" in seen and "DRAIN" in state and n.get("Reason", "").startswith("healthd:"):
                seen.setdefault("redrained", now)
            doc = f.agent_state(FAULT_NODE) or {}
            if "cleared" not in seen and not any(x.get("id") == FINDING for x in doc.get("findings", [])):
                seen["cleared"] = now
                tl(f"agent {FAULT_NODE}", f"clear-finding from the controller: {FINDING} dropped, verdict "
                   f"{doc.get('verdict')}", at=_iso(doc.get("generated_at")) or now)
            for line in _read_lines(self.work / "validation.log"):
                if line in log_lines:
                    continue
                log_lines.add(line)
                stamp, _, text = line.partition(" ")
                at = float(stamp) if stamp.replace(".", "").isdigit() else now
                seen.setdefault("val_" + text.split()[0], at)
                tl("validation", text, at=at)
            if expect_pass:
                return last_status["v"] == "resolved"
            return "redrained" in seen or last_status["v"] in ("validation-failed",)

        with tl.buffered():
            poll(step, 60 + PROBATION_S, "reintegration of node02 " + ("to resolved" if expect_pass else "to fail"),
                 interval_s=0.2, tl=tl)
        if expect_pass:
            self.results["validation"] = seen.get("val_pass", seen.get("probation", t0)) - t0
            self.results["resume"] = seen.get("back", seen.get("resumed", t0)) - t0
            self.results["probation"] = seen["resolved"] - seen.get("probation", t0)
            if "cleared" not in seen:
                # the agent drops the finding on the answer to its next report and publishes it at its next
                # tick: up to a heartbeat and an interval after the instruction, whatever probation took
                reach = f.heartbeat_s + f.agent_interval_s + 5.0
                poll(lambda: not any(x.get("id") == FINDING for x in (f.agent_state(FAULT_NODE) or {}).get(
                    "findings", [])), reach, f"agent {FAULT_NODE} dropping {FINDING}", interval_s=0.2, tl=tl)
                seen["cleared"] = time.time()
                tl(f"agent {FAULT_NODE}", f"clear-finding from the controller: {FINDING} dropped after probation")
        else:
            n = f.slurm_node(FAULT_NODE)
            if not n.get("Reason", "").startswith("healthd: validation failed"):
                raise Failed(f"after a failed validation {FAULT_NODE} has Reason={n.get('Reason')!r}")

    # -- phase 3 --------------------------------------------------------------------------------------
    def correlated(self) -> tuple[int, int]:
        f, tl = self.fleet, self.tl
        before = {n for n, x in f.slurm_nodes().items() if x.get("Reason", "").startswith("healthd:")}
        limit = breaker_drain_limit(POLICY, len(f.nodes))
        tl("harness", f"policy: breaker opens when > {POLICY['breaker_percent']:g}% of {len(f.nodes)} nodes "
           f"(from {POLICY['breaker_min_nodes']}) fail within {POLICY['breaker_window_s']:g}s -> at most {limit} drain(s)")
        stamps: dict[str, float] = {}

        def inject(node: str) -> None:
            stamps[node] = f.inject_xid(node, 79, gpu=0)
        threads = [threading.Thread(target=inject, args=(n,)) for n in CORRELATED]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0 = min(stamps.values())
        tl.reset(t0)
        for n in CORRELATED:
            tl("harness", f"xid 79 written to {n}'s journal", at=stamps[n])
        seen: dict[str, float] = {}
        drained: dict[str, float] = {}

        def step() -> bool:
            now = time.time()
            for n in CORRELATED:
                if n in seen:
                    continue
                doc = f.agent_state(n) or {}
                if any(x.get("id") == FINDING for x in doc.get("findings", [])):
                    seen[n] = _iso(doc.get("generated_at")) or now
                    tl(f"agent {n}", f"verdict {doc.get('verdict')} (T1 hardware: xid 79 gpu0)", at=seen[n])
            if "breaker" not in seen:
                b = self.read_ledger(lambda led: led.breaker_state())
                if b is not None and b.open:
                    seen["breaker"] = b.opened_at or now
                    tl("controller", f"circuit breaker OPEN: {b.cause} (nodes {', '.join(b.nodes)})", at=seen["breaker"])
            for n, x in f.slurm_nodes().items():
                if n not in before and n not in drained and x.get("Reason", "").startswith("healthd:"):
                    drained[n] = now
                    tl("slurm", f"{n} State={x.get('State')} Reason=\"{x.get('Reason')}\"", at=now)
            return "breaker" in seen

        with tl.buffered():
            poll(step, 30, "the circuit breaker to open", tl=tl)
            settle = time.time() + max(3.0, 4 * ROUND_S)
            # keep watching a few rounds: no drain may follow the breaker
            poll(lambda: step() and time.time() > settle, 30, "settle", tl=tl)
        refused = self.read_ledger(lambda led: [d for d in led.decisions() if d.refused_gate == "breaker"
                                                and d.decided_at >= t0]) or []
        for d in refused[:3]:
            tl("controller", f"refused {d.kind} {d.node}: {d.refused_reason}", at=d.decided_at)
        status = f.healthctl("status")
        if not status["breaker"]["open"]:
            raise Failed("healthctl status does not show the breaker open")
        tl("healthctl", f"status --json: breaker open={status['breaker']['open']}, cause {status['breaker']['cause']!r}, "
           f"drained by healthd: {', '.join(status['healthd_drained_nodes']) or 'none'}")
        print()
        print(f.healthctl("status", "--budget", str(POLICY["max_actions_per_hour"]), json_out=False).rstrip())
        self.results["breaker"] = seen["breaker"] - t0
        return len(drained), limit


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


VALIDATION_SCRIPT = """#!/bin/sh
# The drill's GPU validation (a site runs dcgmi diag -r 3, nccl-tests, a burn-in here): passes unless the
# drill left a marker file for this node.
node="$1"
echo "$(date +%s.%N) start gpu_check on $node (job $SLURM_JOB_ID, reservation $SLURM_JOB_RESERVATION)" >> {log}
sleep 1
if [ -e {work}/fail-"$node" ]; then
    echo "$(date +%s.%N) fail gpu_check on $node: GPU 0 did not answer (drill marker)" >> {log}
    echo "gpu_check: $node GPU 0 failed"
    exit 1
fi
echo "$(date +%s.%N) pass gpu_check on $node: 4/4 GPUs ok" >> {log}
echo "gpu_check: $node passed"
"""


def reintegration_config(work: Path) -> dict[str, Any]:
    script = work / "gpu_check.sh"
    script.write_text(VALIDATION_SCRIPT.format(log=work / "validation.log", work=work))
    script.chmod(0o755)
    return {
        "reintegration": {
            "auto_on_clear": True,
            "reservation_minutes": 60,
            "validation": [["srun", "--reservation={reservation}",
                            "--nodelist={node}", "--nodes=1", "--time=5", "--job-name=healthd-validate",
                            str(script), "{node}"]],
            "validation_timeout_s": 60,
            "probation_s": PROBATION_S,
            "inspect_after": 2,
            "support_after": 5,
            "support_window_s": 604800,
        }
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fail-path", action="store_true", help="first repair attempt fails validation (re-drain)")
    ap.add_argument("--skip-repair", action="store_true", help="leave out the repair phase")
    args = ap.parse_args(argv)

    def _term(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even when started with SIGINT ignored

    started = time.time()
    tl = Timeline()
    work = Path(tempfile.mkdtemp(prefix="healthd-drill-", dir="/tmp"))
    work.chmod(0o755)  # the validation script runs as a Slurm job step
    fleet: FleetHarness | None = None
    drill: Drill | None = None
    try:
        reint = not args.skip_repair
        extra = reintegration_config(work) if reint else {}
        tl.phase("setup: Slurm cluster, one munged per node, 4 agents, healthd-controller (auto)")
        fleet = FleetHarness(policy=POLICY, extra_config=extra, round_s=ROUND_S, log=lambda m: tl("harness", m))
        fleet.start()
        tl("harness", f"controller {fleet.url}, mode auto, round {ROUND_S}s, ledger {fleet.ledger}")
        drill = Drill(fleet, work, tl, reint)

        tl.phase(f"1. Xid 79 on {FAULT_NODE} under a running job")
        drill.submit_job()
        drill.fault()

        if reint:
            tl.phase(f"2. repair, validation in a reservation, resume, probation ({PROBATION_S}s)")
            drill.repair(fail_first=args.fail_path)
        else:
            tl.phase("2. repair: skipped (--skip-repair); node02 resumed by hand")
            fleet.resume([FAULT_NODE])

        tl.phase(f"3. correlated event: Xid 79 on {', '.join(CORRELATED)} within a second")
        drains, limit = drill.correlated()
        r = drill.results
        if drains > limit:
            raise Failed(f"correlated: {drains} drains > limit {limit}")
        total = time.time() - started
        parts = [f"detection {r['detection']:.2f} s", f"drain visible {r['drain']:.2f} s", f"requeue {r['requeue']:.1f} s"]
        if reint:
            parts += [f"validation {r['validation']:.1f} s", f"resume {r['resume']:.1f} s",
                      f"probation {r['probation']:.1f} s"]
        else:
            parts += ["validation n/a", "resume n/a"]
        line = (f"PASS drill: {', '.join(parts)}; correlated: breaker open after {r['breaker']:.2f} s, "
                f"{drains} drain{'s' if drains != 1 else ''} <= limit {limit} (total {total:.0f} s)")
        if not reint:
            line += " [repair phase skipped]"
        print("\n" + line, flush=True)
        return 0
    except KeyboardInterrupt:
        print("\nFAIL drill: interrupted", flush=True)
        return 1
    except (Failed, HarnessError) as exc:
        _diagnose(fleet)
        print(f"\nFAIL drill: {exc}", flush=True)
        return 1
    except Exception as exc:  # a bug in the drill is a failed drill, with the traceback
        import traceback

        traceback.print_exc()
        _diagnose(fleet)
        print(f"\nFAIL drill: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _diagnose(fleet: FleetHarness | None) -> None:
    if fleet is None or fleet.root is None:
        return
    from demo.harness import _tail

    print("\n--- controller log (tail)", file=sys.stderr)
    print(_tail(fleet.controller_log, 25), file=sys.stderr)
    for n in fleet.nodes.values():
        print(f"--- agent {n.name} log (tail)", file=sys.stderr)
        print(_tail(n.log, 6), file=sys.stderr)
    if os.environ.get("HEALTHD_KEEP_FLEET"):
        print(f"(kept {fleet.root})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
