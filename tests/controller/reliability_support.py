"""Helpers for tests/controller/test_reliability.py: healthd-controller as a real subprocess against a
real local Slurm cluster (tests/support/slurm_cluster.py) and real munged daemons (munge_support.py).

    proc = ControllerProc(workdir, cluster, fleet, mode="auto")
    proc.start()                       # .venv/bin/healthd-controller --config FILE --interval 0.5
    proc.post(sign_report(...))        # -> (HTTP status, JSON body)
    proc.ledger_rows("SELECT ...")     # plain sqlite3 reads of its ledger
    proc.stop()                        # SIGTERM by PID, then SIGKILL; always reaped

Every process is stopped by its PID (never by name); every Slurm client runs with SLURM_CONF set.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from healthd.envelope import sign_report
from healthd.model import iso
from tests.controller.munge_support import MungeFleet
from tests.support.polling import free_port, poll as wait_until, scrape
from tests.support.slurm_cluster import SAFE_PATH, SlurmCluster, held_view

REPO = Path(__file__).resolve().parents[2]
CONTROLLER_BIN = Path(sys.executable).parent / "healthd-controller"
HEALTHCTL_BIN = Path(sys.executable).parent / "healthctl"
ROUND_S = 0.5
SNAPSHOT_KEYS = ("State", "Reason", "ReasonUser", "ReasonTime")


# ------------------------------------------------------------------------------------ reports


def finding(finding_id: str = "xid:gpu0:79", *, first_seen: float | None = None, tier: int = 1,
            action: str = "drain-and-requeue", attribution: str = "hardware") -> dict[str, Any]:
    """An Xid 79 finding in the README's state-document shape."""
    seen = time.time() if first_seen is None else first_seen
    return {"id": finding_id, "component": {"kind": "gpu", "index": 0}, "source": "kernel_log", "xid": 79,
            "attribution": attribution, "tier": tier, "action": action,
            "summary": "xid 79 gpu0: fell off the bus",
            "evidence": [{"kind": "log", "text": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}],
            "first_seen": iso(seen), "last_seen": iso(time.time())}


def report_doc(node: str, findings: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    return {"node": node, "verdict": "failed" if findings else "healthy", "findings": [dict(f) for f in findings]}


def signed(fleet: MungeFleet, node: str, findings: Sequence[Mapping[str, Any]] = (), *,
           signer: str | None = None) -> bytes:
    """The HTTP body an agent on `signer` (default `node`) sends, claiming to be `node`."""
    return sign_report(report_doc(node, findings), node, fleet.socket(signer or node))


# ------------------------------------------------------------------------------------ Slurm state


def node_view(cluster: SlurmCluster, node: str) -> dict[str, str]:
    """State/Reason/ReasonUser/ReasonTime of `node` from `scontrol show node -o` (SLURM_CONF set):
    what a drain or resume changes (load and free memory drift on their own); the reason only while
    the state holds one (held_view: Slurm 24.11 keeps it after RESUME)."""
    st = held_view(cluster.node_state(node))
    return {k: st.get(k, "") for k in SNAPSHOT_KEYS}


def node_snapshot(cluster: SlurmCluster) -> dict[str, dict[str, str]]:
    """node -> node_view, for every node of the cluster."""
    return {n: node_view(cluster, n) for n in cluster.nodes}


def reset_nodes(cluster: SlurmCluster) -> None:
    """RESUME every node that carries a drain or a reason, then wait until all are idle."""
    cluster.wait_registered(30)
    for node in cluster.nodes:
        st = held_view(cluster.node_state(node))
        if "DRAIN" in st.get("State", "") or st.get("Reason"):
            cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=15)
    cluster.wait_idle(30)


# ------------------------------------------------------------------------------------ the controller


def _pid_alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2:].split()[0] not in ("Z", "X")


class ControllerProc:
    """One healthd-controller subprocess (restartable) with its config, ledger and log in `workdir`."""

    def __init__(self, workdir: Path, cluster: SlurmCluster, fleet: MungeFleet, *, mode: str = "auto",
                 policy: Mapping[str, Any] | None = None, interval: float = ROUND_S):
        self.workdir = Path(workdir)
        self.cluster = cluster
        self.fleet = fleet
        self.mode = mode
        self.policy = dict(policy or {})
        self.interval = interval
        self.ledger = self.workdir / "ledger.sqlite"
        self.admin_socket = self.workdir / "admin.sock"
        self.config = self.workdir / "controller.yaml"
        self.log = self.workdir / "controller.log"
        self.port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def write_config(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        policy = {"mode": self.mode, **self.policy}
        lines = [
            f"listen: 127.0.0.1:{self.port}",
            # the rounds' figures: wait_rounds() counts rounds by them
            f"metrics_listen: 127.0.0.1:{self.metrics_port}",
            f"ledger: {self.ledger}",
            f"munge_socket: {self.fleet.controller_socket}",
            f"slurm_conf: {self.cluster.conf_path}",
            f"node_addrs: {json.dumps(self.fleet.node_addrs)}",
            f"admin_socket: {self.admin_socket}",
            "policy:",
            *(f"  {k}: {json.dumps(v)}" for k, v in policy.items()),
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self, *, path_prefix: str | None = None, timeout: float = 30) -> None:
        """Start it (a fresh port each time) and wait until /healthz answers. `path_prefix` goes first
        on PATH (the scontrol backend looks scontrol up on the daemon's PATH)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.write_config()
        env = dict(self.cluster.env)  # SLURM_CONF set, fixed PATH
        if path_prefix:
            env["PATH"] = f"{path_prefix}:{SAFE_PATH}"
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"==== start {self.starts} ====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [str(CONTROLLER_BIN), "--config", str(self.config), "--interval", str(self.interval)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                start_new_session=True,
            )
        def up() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"controller exited (rc={self.proc and self.proc.poll()}):\n{self.log_text()[-4000:]}")
            return scrape(f"{self.url}/healthz") is not None

        wait_until(up, timeout, "the controller's /healthz", interval=0.1,
                   diagnostics=lambda: self.log_text()[-4000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash): no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        """SIGTERM by PID, 15 s, then SIGKILL; reaped. Returns the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    # -- talking to it ---------------------------------------------------------------------------

    def post(self, body: bytes, path: str = "/v1/report") -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def healthctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(HEALTHCTL_BIN), "--ledger", str(self.ledger), "--socket", str(self.admin_socket),
                               *args], capture_output=True, text=True, timeout=30, env=self.cluster.env)

    def ledger_rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """A plain sqlite3 read of the ledger (WAL: never blocks the controller)."""
        if not self.ledger.exists():
            return []
        conn = sqlite3.connect(str(self.ledger), timeout=10)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def actions(self, node: str | None = None) -> list[dict[str, Any]]:
        sql = ("SELECT id, decision_id, idempotency_key, node, kind, status, outcome, argv FROM actions"
               + (" WHERE node = ?" if node else "") + " ORDER BY id")
        cols = ("id", "decision_id", "idempotency_key", "node", "kind", "status", "outcome", "argv")
        return [dict(zip(cols, r, strict=True)) for r in self.ledger_rows(sql, (node,) if node else ())]

    def decisions(self, node: str | None = None) -> list[dict[str, Any]]:
        sql = ("SELECT id, incident_id, node, kind, mode, reason, evidence, outcome, refused_gate, refused_reason "
               "FROM decisions" + (" WHERE node = ?" if node else "") + " ORDER BY id")
        cols = ("id", "incident_id", "node", "kind", "mode", "reason", "evidence", "outcome", "refused_gate",
                "refused_reason")
        out = []
        for r in self.ledger_rows(sql, (node,) if node else ()):
            row = dict(zip(cols, r, strict=True))
            row["evidence"] = json.loads(row["evidence"]) if row["evidence"] else None
            out.append(row)
        return out

    def incidents(self, node: str | None = None) -> list[dict[str, Any]]:
        sql = ("SELECT i.id, i.signature, i.status, i.first_evidence_at, i.detected_at FROM incidents i"
               + (" JOIN incident_nodes n ON n.incident_id = i.id WHERE n.node = ?" if node else "")
               + " ORDER BY i.id")
        cols = ("id", "signature", "status", "first_evidence_at", "detected_at")
        return [dict(zip(cols, r, strict=True)) for r in self.ledger_rows(sql, (node,) if node else ())]

    def last_round(self) -> float | None:
        """When the last full control round (Slurm reachable) was, from the controller's metrics; None
        before the first one or when it does not answer."""
        body = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics") if self.metrics_port else None
        for line in (body or "").splitlines():
            if line.startswith("healthd_controller_last_round_timestamp_seconds "):
                return float(line.split()[1]) or None
        return None

    def wait_rounds(self, rounds: int = 4, timeout: float | None = None) -> None:
        """Until `rounds` more full control rounds have completed: what a test waits for before it asserts
        that nothing (more) happened. On a busy machine a round takes longer than `interval`; counting
        them keeps the test's meaning where a fixed sleep would let fewer rounds pass."""
        after = self.last_round() or 0.0
        seen: set[float] = set()

        def counted() -> bool:
            t = self.last_round()
            if t is not None and t > after:
                seen.add(t)
            return len(seen) >= rounds

        wait_until(counted, timeout if timeout is not None else 30 + rounds * self.interval,
                   f"{rounds} more control rounds", interval=0.05, diagnostics=lambda: self.log_text()[-3000:])


# ------------------------------------------------------------------------------------ scontrol wrapper


def write_scontrol_wrapper(directory: Path, *, write_first: bool, real: str = "/usr/bin/scontrol") -> dict[str, Path]:
    """`directory/scontrol`: passes every call to the real scontrol, except `update ... State=DRAIN`:
    it writes its PID (its own process group: the backend starts clients in a new session) and a
    marker, then sleeps. write_first=False: it sleeps BEFORE the real call (killed there, the write
    never happens). write_first=True: the real write happens first, then the marker, then the sleep
    (killed there, the write happened but the controller never saw it finish)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"pid": directory / "drain.pid", "marker": directory / "drain.marker", "rc": directory / "drain.rc"}
    if write_first:
        body = (f'echo $$ > "{files["pid"]}"\n'
                f'"{real}" "$@"; echo $? > "{files["rc"]}"\n'
                f'touch "{files["marker"]}"\n'
                "exec sleep 300\n")
    else:
        body = (f'echo $$ > "{files["pid"]}"\n'
                f'touch "{files["marker"]}"\n'
                "sleep 300\n"
                f'exec "{real}" "$@"\n')
    script = directory / "scontrol"
    script.write_text(
        "#!/bin/bash\n"
        "# test wrapper: hold `scontrol update ... State=DRAIN` (tests/controller/reliability_support.py)\n"
        f'if [ "$1" = update ] && [[ " $* " == *" State=DRAIN "* ]]; then\n'
        f"{body}"
        "fi\n"
        f'exec "{real}" "$@"\n'
    )
    script.chmod(0o755)
    return files


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (the wrapper and its sleep), and wait until it is gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_until(lambda: not _pid_alive(pid), 10, f"process group {pid} to die")
