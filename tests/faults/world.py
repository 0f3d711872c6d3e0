"""The fault-injection world: a whole healthd fleet, every part real, and the faults injected from outside it.

    with FaultWorld() as w:                 # Slurm + one munged per node + a real agent per node + the controller
        w.scontrol.arm("State=DRAIN", "kill-after")   # the controller's next drain lands, then it is SIGKILLed
        w.inject_xid("node02", 79)          # a kernel journal line on node02: the agent reports it
        w.wait(lambda: w.scontrol.fired()) ; w.restart_controller()
        w.checker.check()                   # the invariants, asserted

Nothing inside healthd is patched. The faults come from where they come in production:
- `ScontrolFaults`: a wrapper first on the controller's PATH in front of the real scontrol. A rule (a
  substring of the arguments and an action, fired once) SIGKILLs the controller (its parent) before the
  write reaches slurmctld or right after it landed, or holds the client past the backend's timeout after
  the write landed (the controller sees a timeout for a write Slurm applied). `slow_reads` makes every
  read of the whole node list answer late with the nodes as they were when asked: a stale fleet view.
- slurmctld stopped (SIGSTOP) with a write in flight, stopped cleanly (SIGTERM) between healthd's read of
  the node and its write, or SIGKILLed right after a write
  and restarted from a state save taken before it (`snapshot_ctld_state` / `kill_ctld_restore`).
- the controller SIGKILLed at any moment (`kill_controller`), restarted with its ledger.

`Checker` asserts after each case, from outside healthd's own records where it can:
- every action exactly once: each healthd reason slurmctld's own log shows written to a node is one
  ledger action that took effect (applied, or later lost/released/completed/undone), and each
  `Requeuing JobId=` one requeue action;
- the ledger matches Slurm: a hold for every node-state action in force and for nothing else, each
  showing exactly in `scontrol show node`; no write Slurm shows left unadopted; nothing left planned;
- no foreign drain touched: the reason, user and time of every drain healthd did not make are unchanged;
- no incident stuck: no closed incident holding a node, no reintegration state without a reintegration;
- another node's drain is not delayed: a T1 fault on a control node is drained within the next rounds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from demo.harness import FleetHarness, HarnessError
from healthd.controller.ownership import owned, shows_write
from healthd.controller.ownership import Hold
from healthd.slurm.backend import NodeInfo
from healthd.slurm.scontrol import ScontrolBackend
from tests.support.fake_nvml import write_nvml_config
from tests.support.polling import poll

T = TypeVar("T")
REAL_SCONTROL = shutil.which("scontrol", path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin") or "/usr/bin/scontrol"
EFFECTIVE = ("applied", "lost", "released", "completed", "undone")
"""Statuses of an action whose write reached Slurm."""
SUITE_POLICY = {
    "mode": "auto",
    # the suite is about the ledger agreeing with Slurm, not the envelope's counting: nothing here may
    # be refused by the breaker or the rate limits (their own tests are in tests/controller)
    "max_actions_per_hour": 100000, "max_actions_per_partition_per_hour": 100000,
    "breaker_nodes": 1000, "breaker_min_nodes": 1000, "breaker_percent": 100.0,
    "report_ttl_s": 60.0,
}


class ScontrolFaults:
    """The scontrol wrapper and its rules (see the module doc). Rules live in `dir/rules`, one per line
    `SUBSTRING|ACTION|ARG`; the first call whose arguments contain SUBSTRING claims the whole file (a
    rename: exactly one caller fires) and does ACTION. Each firing is one line in `dir/fired.log`."""

    ACTIONS = ("kill-before", "kill-after", "hang-after", "stop-ctld-before", "term-ctld-before")

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rules = self.dir / "rules"
        self.fired_log = self.dir / "fired.log"
        script = self.dir / "scontrol"
        self.read_delay = self.dir / "read_delay"
        script.write_text(f"""#!/bin/bash
# healthd fault-injection wrapper (tests/faults/world.py): the real scontrol, except when a rule fires
real={REAL_SCONTROL}
rules={self.rules}
# a slurmctld that answers the whole node list slowly: the answer is as of the call, delivered late
if [ "$*" = "show node -o" ] && [ -s {self.read_delay} ]; then
  out=$("$real" "$@"); rc=$?; sleep "$(cat {self.read_delay})"; printf '%s\n' "$out"; exit $rc
fi
if [ -s "$rules" ] && mv -f "$rules" "$rules.$$" 2>/dev/null; then
  fired=""
  while IFS='|' read -r pat action arg; do
    if [ -z "$fired" ] && [ -n "$pat" ] && [[ " $* " == *"$pat"* ]]; then fired="$action|$arg"; fi
  done < "$rules.$$"
  if [ -z "$fired" ]; then mv -f "$rules.$$" "$rules"; exec "$real" "$@"; fi
  rm -f "$rules.$$"
  action="${{fired%%|*}}"; arg="${{fired#*|}}"
  echo "$action $*" >> {self.fired_log}
  case "$action" in
    kill-before) kill -9 "$PPID"; exit 1;;
    kill-after) "$real" "$@"; rc=$?; kill -9 "$PPID"; exit $rc;;
    hang-after) "$real" "$@"; rc=$?; sleep "$arg"; exit $rc;;
    stop-ctld-before) kill -STOP "$arg"; exec "$real" "$@";;
    term-ctld-before) kill -TERM "$arg"; while [ -d /proc/"$arg" ] && ! grep -q '^State:.*Z' /proc/"$arg"/status; do sleep 0.05; done
                      exec "$real" "$@";;
  esac
fi
exec "$real" "$@"
""")
        script.chmod(0o755)

    def arm(self, pattern: str, action: str, arg: str = "") -> None:
        assert action in self.ACTIONS, action
        assert "|" not in pattern
        tmp = self.dir / "rules.new"
        tmp.write_text(f"{pattern}|{action}|{arg}\n")
        tmp.replace(self.rules)

    def disarm(self) -> None:
        self.rules.unlink(missing_ok=True)
        self.read_delay.unlink(missing_ok=True)

    def slow_reads(self, seconds: float) -> None:
        """Every read of the whole node list (the controller's fleet view) answers `seconds` late, with
        the nodes as they were when it was asked: the view the rounds act on is always that stale."""
        self.read_delay.write_text(f"{seconds:g}\n")

    def fired(self) -> list[str]:
        try:
            return self.fired_log.read_text().splitlines()
        except FileNotFoundError:
            return []


class FaultWorld(FleetHarness):
    """FleetHarness (demo/harness.py) with the fault injectors and the checker."""

    def __init__(self, *, policy: dict[str, Any] | None = None, **kw: Any):
        kw.setdefault("agent_interval_s", 1.0)
        kw.setdefault("heartbeat_s", 1.0)
        kw.setdefault("round_s", 0.5)
        super().__init__(policy=dict(SUITE_POLICY, **(policy or {})), **kw)
        self.base_policy = dict(self.policy)
        """The envelope `reset` restores (a test may start the controller with its own)."""
        self.base_agent_config = dict(self.agent_config)
        """The agents' configuration `reset` restores unless it is given another for the test."""
        self.scontrol: ScontrolFaults | None = None
        self.checker: Checker | None = None
        self.kills = 0

    def start(self) -> FaultWorld:
        super().start()
        assert self.cluster is not None
        self.scontrol = ScontrolFaults(self.dir / "faults")
        self.backend = ScontrolBackend(self.slurm_conf, timeout_s=15)
        self.controller_path_prefix = str(self.scontrol.dir)
        # reintegration validates with a script whose exit status the test sets (validation_rc), after a
        # short sleep that leaves time to arm a fault while it runs
        self.validation_rc = self.dir / "validation.rc"
        script = self.dir / "validate.sh"
        script.write_text(f"#!/bin/sh\nsleep 2\necho \"validated $1\"\nexit $(cat {self.validation_rc} 2>/dev/null || echo 0)\n")
        script.chmod(0o755)
        self.extra_config.setdefault("reintegration", {"validation": [[str(script), "{node}"]], "probation_s": 2.0,
                                                       "auto_on_clear": False})
        self.restart_controller()
        self.checker = Checker(self)
        return self

    # -- the controller ---------------------------------------------------------------------------

    def controller_pid(self) -> int | None:
        return self.controller.pid if self.controller is not None and self.controller.poll() is None else None

    def kill_controller(self) -> None:
        """SIGKILL by PID: a crash, no shutdown code runs."""
        if self.controller is not None and self.controller.poll() is None:
            os.kill(self.controller.pid, signal.SIGKILL)
            self.controller.wait(timeout=10)
            self.kills += 1

    def reap_controller(self, timeout_s: float = 30) -> None:
        """Wait until the controller is gone (killed by a wrapper rule)."""
        assert self.controller is not None
        self.controller.wait(timeout=timeout_s)

    def restart_controller(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.stop_controller()
        self.controller = None
        self.start_controller()

    # -- slurmctld ---------------------------------------------------------------------------------

    def ctld_pid(self) -> int:
        assert self.cluster is not None
        return self.cluster.pids()["slurmctld"]

    def stop_ctld_process(self, sig: int = signal.SIGSTOP) -> None:
        os.kill(self.ctld_pid(), sig)

    def snapshot_ctld_state(self) -> Path:
        """A copy of slurmctld's state save as it is now (what a restart from an older save comes back to)."""
        assert self.cluster is not None
        src = self.cluster.root / "spool" / "ctld"
        dst = self.dir / f"ctld-state-{time.monotonic_ns()}"
        shutil.copytree(src, dst)
        return dst

    def kill_ctld_restore(self, snapshot: Path) -> None:
        """SIGKILL slurmctld, put back the state save `snapshot`, start it again: slurmctld comes back
        without everything it did after the snapshot."""
        assert self.cluster is not None
        os.kill(self.ctld_pid(), signal.SIGKILL)
        poll(lambda: not self.cluster._running("slurmctld"), 10, "slurmctld to die")  # noqa: SLF001
        state = self.cluster.root / "spool" / "ctld"
        owner = state.stat()
        shutil.rmtree(state)
        shutil.copytree(snapshot, state)
        for path in (state, *state.rglob("*")):  # slurmctld refuses a state save its SlurmUser does not own
            os.chown(path, owner.st_uid, owner.st_gid)
        state.chmod(owner.st_mode & 0o7777)
        self.cluster.start_ctld()

    # -- reading Slurm and the ledger ----------------------------------------------------------------

    def node_info(self, name: str) -> NodeInfo:
        """`scontrol show node -o NAME` through the scontrol backend's reader (reason time and user)."""
        return self.backend.node(name)

    def rows(self, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
        if not self.ledger.exists():
            return []
        conn = sqlite3.connect(f"file:{self.ledger}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql, tuple(params)).fetchall()
        finally:
            conn.close()

    def actions(self, node: str | None = None) -> list[dict[str, Any]]:
        cols = ("id", "series", "attempt", "node", "kind", "status", "outcome", "reason", "evidence", "planned_at")
        sql = f"SELECT {', '.join(cols)} FROM actions" + (" WHERE node = ?" if node else "") + " ORDER BY id"
        return [dict(zip(cols, r, strict=True)) for r in self.rows(sql, (node,) if node else ())]

    def holds(self) -> dict[str, Hold]:
        return {r[0]: Hold(*r) for r in self.rows(
            "SELECT node, action_id, incident_id, kind, reason, reason_time, reason_user, since, planned_at, "
            "verified_at FROM holds")}

    def wait(self, probe: Callable[[], T], timeout_s: float = 30, what: str = "condition",
             node: str | None = None) -> T:
        """Poll `probe`; a timeout says what the ledger, Slurm and the controller's log show (of
        `node`, when given)."""
        return poll(probe, timeout_s, what, interval=0.1, error=HarnessError,
                    diagnostics=lambda: self.diagnostics(node))

    def diagnostics(self, node: str | None = None) -> str:
        """The ledger's actions, decisions and incidents (of `node`), what Slurm shows of it, and the
        tail of the controller's log: why a wait timed out."""
        out = [f"actions: {[(a['id'], a['kind'], a['attempt'], a['status'], a['outcome']) for a in self.actions(node)]}",
               f"decisions: {self.rows('SELECT id, kind, outcome, refused_gate, refused_reason FROM decisions' + (' WHERE node = ?' if node else ''), (node,) if node else ())}",
               f"incidents: {self.incidents(node)}"]
        if node is not None:
            try:
                out.append(f"slurm: {self.node_info(node)}")
            except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the timeout
                out.append(f"slurm: cannot read {node}: {exc}")
        out.append(f"--- controller log\n{_tail(self.controller_log, 40)}")
        return "\n".join(out)

    def healthctl_run(self, *args: str) -> tuple[int, str]:
        """`healthctl ARGS` as an operator runs it: (exit status, stdout + stderr)."""
        import subprocess

        from demo.harness import HEALTHCTL

        p = subprocess.run([HEALTHCTL, "--ledger", str(self.ledger), "--socket", str(self.admin_socket), *args],
                           capture_output=True, text=True, timeout=30, env=self.env)
        return p.returncode, p.stdout + p.stderr

    def lose_gpu(self, node: str, gpu: int, lost: bool = True) -> None:
        """NVML on `node` reports GPU `gpu` lost (every call answers GPU_IS_LOST) until `lost=False`."""
        sim = self.nodes[node]
        gpus = [dict(g) for g in sim.gpus]
        gpus[gpu]["lost"] = 1 if lost else None
        write_nvml_config(sim.nvml_values, gpus)

    def incidents(self, node: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """The incidents (naming `node`, in `status`, when given), oldest first."""
        cols = ("id", "signature", "status", "closed_by", "close_why")
        where = [w for w, v in (("n.node = ?", node), ("i.status = ?", status)) if v is not None]
        sql = (f"SELECT {', '.join('i.' + c for c in cols)} FROM incidents i"
               + (" JOIN incident_nodes n ON n.incident_id = i.id" if node is not None else "")
               + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY i.id")
        return [dict(zip(cols, r, strict=True)) for r in self.rows(sql, [v for v in (node, status) if v is not None])]

    def held_and_drained(self, node: str) -> bool:
        hold = self.holds().get(node)
        return hold is not None and owned(hold, self.node_info(node))

    def drained_once(self, node: str, timeout_s: float = 30) -> None:
        """Wait until healthd holds `node` and Slurm shows exactly its drain."""
        self.wait(lambda: self.held_and_drained(node), timeout_s, f"{node} drained by healthd", node)

    def submit_opted_in(self, node: str) -> str:
        """A job on `node` that opted in to being requeued, running; its id."""
        out = self.slurm(["sbatch", "--parsable", "-w", node, "--comment", "healthd:requeue please", "--requeue",
                          "-o", "/dev/null", "--wrap", "sleep 600"]).stdout
        job = out.strip().split(";")[0]
        self.wait(lambda: self.job(job).get("JobState") == "RUNNING", 30, f"job {job} running on {node}")
        return job

    # -- resetting between tests --------------------------------------------------------------------

    def park(self) -> None:
        """Stop the agents and the controller (by PID) until the next reset: a world shared by a whole
        test session costs nothing while other tests run."""
        self.stop_processes()

    def reset(self, *, agent_config: dict[str, Any] | None = None) -> None:
        """A fresh controller and ledger with the world's own envelope (its ledger in its own directory,
        no extra environment), fresh agents (no memory, a new journal) with the world's own configuration
        and `agent_config`'s keys on top, every node resumed and idle, no rules armed and no slow reads,
        no job, slurmctld running; the checker forgets what it allowed and the wrapper what fired (a world
        serves a whole session: a test waiting for its rule to fire must not see another test's)."""
        assert self.cluster is not None and self.scontrol is not None
        self.scontrol.disarm()
        self.scontrol.fired_log.unlink(missing_ok=True)
        try:
            os.kill(self.ctld_pid(), signal.SIGCONT)
        except (KeyError, ProcessLookupError):
            pass
        if not self.cluster._running("slurmctld"):  # noqa: SLF001
            self.cluster.start_ctld()
        self.stop_processes()  # the controller and every agent at once: their shutdowns overlap
        self.ledger_dir = None
        self.controller_extra_env = None
        self.stop_controller(fresh_ledger=True)
        self.policy = dict(self.base_policy)
        self.agent_config = {**self.base_agent_config, **(agent_config or {})}
        self.validation_rc.write_text("0\n")
        jobs = self.slurm(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self.slurm(["scancel", *jobs], check=False)
        for node in self.nodes.values():
            self.write_agent_config(node)
            write_nvml_config(node.nvml_values, node.gpus)  # healthy GPUs again
            shutil.rmtree(node.root / "state", ignore_errors=True)
            node.state_file.unlink(missing_ok=True)
            for f in node.journal.glob("*"):
                f.unlink()
        self.cluster.wait_registered(30)
        for name, st in self.slurm_nodes().items():
            if "DRAIN" in st.get("State", "") or st.get("Reason") or "REBOOT" in st.get("State", ""):
                self.slurm(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
        self.cluster.wait_idle(60)
        from tests.support.journal import write_journal

        for name, node in self.nodes.items():
            write_journal(node.journal, ["Linux version 6.1.0-28-amd64", "NVRM: loading NVIDIA UNIX Kernel Module"],
                          hostname=name, start_usec=int(time.time() * 1e6) - 60_000_000)
        self.start_controller()
        for node in self.nodes.values():
            self._start_agent(node)
        self.wait_reported(self.nodes, timeout_s=60)
        self.checker = Checker(self)


# ------------------------------------------------------------------------------------ the checker


@dataclass
class Foreign:
    node: str
    reason: str
    user: str | None
    time: float | None
    drained: bool


_REASON_SET = re.compile(r"update_node: node (\S+) reason set to: (.*)$")
_REQUEUE = re.compile(r"\bRequeuing JobId=(\d+)")


class Checker:
    """The invariants after a fault (see the module doc). `problems()` lists what is wrong; `check()`
    asserts there is nothing."""

    def __init__(self, world: FaultWorld):
        self.w = world
        assert world.cluster is not None
        self.log = world.cluster.root / "log" / "slurmctld.log"
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        self.foreign: dict[str, Foreign] = {}
        self.own_writes: Counter[tuple[str, str]] = Counter()
        """(node, reason) written by the test itself (an administrator copying healthd's text)."""

    def foreign_drain(self, node: str, reason: str, user: str = "root") -> None:
        """Drain `node` as an administrator would and remember it: it must never be touched."""
        self.w.slurm(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
        self.own_writes[(node, reason)] += 1
        self.remember_foreign(node)

    def remember_foreign(self, node: str) -> None:
        """`node`'s drain as it is now belongs to someone else: from here on it must never change."""
        info = self.w.node_info(node)
        self.foreign[node] = Foreign(node, info.reason, info.reason_user, info.reason_time, info.drain_requested)

    def admin_write(self, node: str, reason: str) -> None:
        """The test writes a reason itself (not counted against healthd)."""
        self.w.slurm(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
        self.own_writes[(node, reason)] += 1

    def slurm_writes(self) -> tuple[Counter[tuple[str, str]], Counter[str]]:
        """(node, reason) -> how often slurmctld logged setting that reason; job -> requeues logged."""
        reasons: Counter[tuple[str, str]] = Counter()
        requeues: Counter[str] = Counter()
        with open(self.log, "rb") as fh:
            fh.seek(self.log_from)
            for raw in fh:
                line = raw.decode(errors="replace").rstrip("\n")
                m = _REASON_SET.search(line)
                if m:
                    reasons[(m.group(1), m.group(2))] += 1
                m = _REQUEUE.search(line)
                if m:
                    requeues[m.group(1)] += 1
        return reasons, requeues

    def problems(self) -> list[str]:
        w = self.w
        out: list[str] = []
        actions = w.actions()
        # 1. every action exactly once
        reasons, requeues = self.slurm_writes()
        healthd_reasons = {a["reason"] for a in actions if a["reason"]}
        wrote: Counter[tuple[str, str]] = Counter(
            (a["node"], a["reason"]) for a in actions if a["reason"] and a["status"] in EFFECTIVE)
        for key in set(wrote) | {k for k in reasons if k[1] in healthd_reasons}:
            seen = reasons.get(key, 0) - self.own_writes.get(key, 0)
            if seen != wrote.get(key, 0):
                out.append(f"{key[0]}: slurmctld logged {seen} write(s) of {key[1]!r}, the ledger has "
                           f"{wrote.get(key, 0)} that took effect")
        requeued: Counter[str] = Counter()
        for a in actions:
            if a["kind"] == "requeue" and a["status"] in EFFECTIVE:
                import json

                requeued[str(json.loads(a["evidence"]).get("job"))] += 1
        for job in set(requeued) | set(requeues):
            if requeues.get(job, 0) != requeued.get(job, 0):
                out.append(f"job {job}: slurmctld logged {requeues.get(job, 0)} requeue(s), the ledger has "
                           f"{requeued.get(job, 0)}")
        # 2. the ledger matches Slurm
        holds = w.holds()
        infos = {n: w.node_info(n) for n in w.nodes}
        latest: dict[str, dict[str, Any]] = {}  # node -> healthd's latest applied node-state write or resume
        for a in actions:
            if a["status"] == "planned":
                out.append(f"action {a['id']} ({a['kind']} {a['node']}) is still planned")
            if a["kind"] in ("drain", "drain-and-requeue", "reboot-asap", "resume") and a["status"] == "applied":
                latest[a["node"]] = a
        for node, a in latest.items():
            h = holds.get(node)
            if a["kind"] != "resume" and (h is None or h.action_id != a["id"]):
                out.append(f"action {a['id']} ({a['kind']} {node}) is in force but healthd holds "
                           f"{'nothing' if h is None else f'action {h.action_id}'} on {node}")
            if a["kind"] == "resume" and h is not None and h.action_id < a["id"]:
                out.append(f"{node}: resumed by action {a['id']} but still held by action {h.action_id}")
        for node, h in holds.items():
            if not owned(h, infos.get(node)):
                info = infos.get(node)
                out.append(f"{node}: the ledger holds action {h.action_id} ({h.reason!r} @{h.reason_time}) but Slurm "
                           f"shows {info.reason if info else None!r} @{info.reason_time if info else None}")
        for a in actions:
            if a["status"] in ("failed", "abandoned") and a["reason"] and a["node"] not in holds:
                info = infos.get(a["node"])
                if info is not None and shows_write(info, a["reason"], a["kind"], a["planned_at"]) \
                        and self.own_writes.get((a["node"], a["reason"]), 0) == 0:
                    out.append(f"{a['node']}: Slurm shows action {a['id']}'s write but the ledger says {a['status']}")
        # 3. no foreign drain touched
        for node, f in self.foreign.items():
            info = infos[node]
            now = Foreign(node, info.reason, info.reason_user, info.reason_time, info.drain_requested)
            if now != f:
                out.append(f"{node}: an administrator's drain was touched: {f} -> {now}")
        # 4. no incident stuck
        closed = ("closed", "false_positive", "handed-over", "resolved")
        status = dict(w.rows("SELECT id, status FROM incidents"))
        for node, h in holds.items():
            if h.incident_id is not None and status.get(h.incident_id) in closed:
                out.append(f"{node}: held for incident {h.incident_id}, which is {status[h.incident_id]}")
        active = {r[0] for r in w.rows("SELECT incident_id FROM reintegrations WHERE state IN "
                                       "('requested', 'validating', 'probation')")}
        for iid, st in status.items():
            if st in ("reintegrating", "probation") and iid not in active:
                out.append(f"incident {iid} is {st} without a reintegration in flight")
        return out

    def check(self, settle_s: float = 20.0) -> None:
        """Assert the invariants, allowing `settle_s` for the controller's rounds to converge."""
        deadline = time.monotonic() + settle_s
        problems = self.problems()
        while problems and time.monotonic() < deadline:
            time.sleep(0.5)
            problems = self.problems()
        if problems:
            raise AssertionError("invariants broken:\n- " + "\n- ".join(problems) + "\n" + self.w.diagnostics())

    def drain_not_delayed(self, node: str, *, rounds: int = 4, xid: int = 48, gpu: int = 3) -> float:
        """A T1 fault on `node`: healthd's drain must be visible in Slurm within `rounds` rounds of the
        agent's report (plus the agent's detection). Returns the seconds it took."""
        t0 = time.monotonic()
        self.w.inject_xid(node, xid, gpu=gpu)
        bound = rounds * self.w.round_s + 3.0 * self.w.agent_interval_s + 2.0
        self.w.wait(lambda: self.w.held_and_drained(node), bound, f"{node}'s drain within {bound:.1f} s", node)
        return time.monotonic() - t0


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
