"""Test support for the Slurm hooks: crafted agent state documents, a node directory with a config,
and a fake `scontrol`/`sinfo` pair standing in for a Slurm 22.05 client (unit-level only; the
real-cluster end-to-end tests use tests/support/slurm_cluster.py).

The fake clients keep the node table in `<root>/slurm/nodes.json` and append every call, with
whether SLURM_CONF was in their environment, to `<root>/slurm/calls.jsonl`. `mode` in nodes.json:
ok | unreachable (prints slurmctld's 'Unable to contact' and exits 1) | hang (sleeps 600 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from healthd.text import iso
from tests.support.hook_log import one_line

BIN = Path(sys.executable).parent

FAKE_SLURM = r'''#!{python}
import json, os, sys, time
root = {root!r}
prog = os.path.basename(sys.argv[0])
args = sys.argv[1:]
state_path = os.path.join(root, "nodes.json")
with open(state_path) as f:
    state = json.load(f)
with open(os.path.join(root, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"prog": prog, "args": args, "slurm_conf": os.environ.get("SLURM_CONF"),
                         "path": os.environ.get("PATH")}}) + "\n")
if not os.environ.get("SLURM_CONF"):
    print("fatal: Could not establish a configuration source", file=sys.stderr)
    sys.exit(1)
if args == ["--version"]:
    print("slurm 22.05.8")
    sys.exit(0)
mode = state.get("mode", "ok")
if mode == "hang":
    time.sleep(600)
if mode == "unreachable":
    print(f"{{prog}}: error: Unable to contact slurm controller (connect failure)", file=sys.stderr)
    sys.exit(1)
nodes = state["nodes"]
if prog == "sinfo" and args == ["--json"]:
    out = []
    for name, n in nodes.items():
        out.append({{"name": name, "state": n["state"], "state_flags": n.get("flags", []),
                     "reason": n.get("reason", ""), "reason_set_by_user": n.get("user"),
                     "reason_changed_at": 0, "gres": "gpu:4", "partitions": ["debug"]}})
    print(json.dumps({{"meta": {{"plugin": {{"type": "openapi/v0.0.38"}}, "Slurm": {{"release": "22.05.8"}}}},
                      "errors": [], "nodes": out}}))
    sys.exit(0)
if prog == "scontrol" and args[:3] == ["show", "node", "-o"]:
    name = args[3]
    if name not in nodes:
        print(f"Node {{name}} not found", file=sys.stderr)
        sys.exit(1)
    n = nodes[name]
    st = "+".join([n["state"].upper(), *n.get("flags", [])])
    line = f"NodeName={{name}} Arch=x86_64 CPUTot=4 Gres=gpu:4 State={{st}} Partitions=debug"
    if n.get("reason"):
        line += f" Reason={{n['reason']}} [{{n.get('user') or 'root'}}@2026-11-29T10:00:00]"
    print(line)
    sys.exit(0)
if prog == "scontrol" and args[:1] == ["update"]:
    kv = dict(a.split("=", 1) for a in args[1:])
    n = nodes[kv["NodeName"]]
    if kv.get("State") == "DRAIN":
        n["flags"] = sorted(set(n.get("flags", [])) | {{"DRAIN"}})
        n["reason"], n["user"] = kv["Reason"], "root"  # Slurm overwrites: the hook must not ask
elif prog == "scontrol" and args[:2] == ["reboot", "ASAP"]:
    kv = dict(a.split("=", 1) for a in args[2:-1])
    n = nodes[args[-1]]
    n["flags"] = sorted(set(n.get("flags", [])) | {{"DRAIN", "REBOOT_REQUESTED"}})
    n["reason"], n["user"] = kv["reason"], "root"
else:
    print(f"fake {{prog}}: unsupported {{args}}", file=sys.stderr)
    sys.exit(2)
with open(state_path, "w") as f:
    json.dump(state, f)
'''


def finding(fid: str, gpu: int | None, tier: int = 1, attribution: str = "hardware", action: str = "drain",
            summary: str | None = None, last_seen: float | None = None, xid: int | None = None,
            serial: str | None = None, kind: str | None = None) -> dict[str, Any]:
    t = time.time() if last_seen is None else last_seen
    return {
        "id": fid,
        "component": {"kind": kind or ("gpu" if gpu is not None else "node"), "index": gpu, "uuid": None,
                      "serial": serial, "bus_id": None, "device": None, "port": None},
        "source": "kernel_log",
        "xid": xid,
        "attribution": attribution,
        "tier": tier,
        "action": action,
        "summary": summary or fid,
        "evidence": [],
        "count": 1,
        "first_seen": iso(t),
        "last_seen": iso(t),
        "job": None,
    }


def state_doc(node: str = "node01", findings: list[dict[str, Any]] | None = None, *, age_s: float = 1.0,
              pid: int | None = None, now: float | None = None) -> dict[str, Any]:
    findings = findings or []
    verdict = "failed" if any(f["tier"] == 1 for f in findings) else "degraded" if findings else "healthy"
    return {
        "node": node,
        "verdict": verdict,
        "generated_at": iso((now if now is not None else time.time()) - age_s),
        "dry_run": False,
        "agent": {"version": "0.1.0", "pid": pid if pid is not None else os.getpid(), "started_at": iso(time.time() - 100),
                  "interval_s": 10.0, "boot_id": "b"},
        "sources": {},
        "gpus": [],
        "ports": [],
        "findings": findings,
        "would_do": [],
    }


class Node:
    """A node directory: config, state file, run dir, fake GPU device files, fake Slurm clients."""

    def __init__(self, root: Path, name: str = "node01", gpus: int = 4):
        self.root, self.name = root, name
        self.state_file = root / "run/healthd/state.json"
        self.run_dir = root / "run/healthd"
        self.dev = root / "dev"
        self.dev.mkdir(parents=True)
        for i in range(gpus):
            (self.dev / f"nvidia{i}").touch()
        (self.dev / "nvidiactl").touch()
        self.charges = root / "lib/charges.jsonl"
        self.slurm = root / "slurm"
        self.fakebin = root / "fakebin"
        self.slurm.mkdir()
        self.fakebin.mkdir()
        self.slurm_conf = self.slurm / "slurm.conf"
        self.slurm_conf.write_text("ClusterName=fake\n")
        for prog in ("scontrol", "sinfo"):
            p = self.fakebin / prog
            p.write_text(FAKE_SLURM.format(python=sys.executable, root=str(self.slurm)))
            p.chmod(0o755)
        self.set_slurm()
        self.config = root / "healthd.yaml"
        self.state_dir = root / "state"
        self.write_config()

    def write_config(self, **hooks: Any) -> None:
        doc = {
            "node_name": self.name,
            "state_file": str(self.state_file),
            "state_dir": str(self.state_dir),
            "nvml": {"expected_gpus": 4},
            "hooks": {
                "run_dir": str(self.run_dir),
                "slurm_conf": str(self.slurm_conf),
                "path": f"{self.fakebin}:/usr/bin:/bin",
                "gpu_devices": f"{self.dev}/nvidia[0-9]*",
                "dcgmi": None,
                "charges_file": str(self.charges),
                "timeout_s": 5.0,
                **hooks,
            },
        }
        self.config.write_text(yaml.safe_dump(doc))

    def set_slurm(self, mode: str = "ok", state: str = "idle", flags: list[str] | None = None, reason: str = "",
                  user: str | None = None) -> None:
        doc = {"mode": mode, "nodes": {self.name: {"state": state, "flags": flags or [], "reason": reason, "user": user}}}
        (self.slurm / "nodes.json").write_text(json.dumps(doc))

    def slurm_node(self) -> dict[str, Any]:
        return json.loads((self.slurm / "nodes.json").read_text())["nodes"][self.name]

    def calls(self) -> list[dict[str, Any]]:
        path = self.slurm / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def writes(self) -> list[list[str]]:
        return [c["args"] for c in self.calls() if c["prog"] == "scontrol" and c["args"][:1] in (["update"], ["reboot"])]

    def write_state(self, doc: dict[str, Any] | str | bytes) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(doc, dict):
            doc = json.dumps(doc)
        self.state_file.write_bytes(doc.encode() if isinstance(doc, str) else doc)

    def prolog_env(self, job: str = "7", gpus: str | None = "0,1", user: str = "alice", uid: str = "1000",
                   **extra: str) -> dict[str, str]:
        """What slurmd 22.05 gives the Prolog, with the config path added as the
        one variable a site sets through a wrapper."""
        env = {
            "SLURMD_NODENAME": self.name,
            "SLURM_CLUSTER_NAME": "lab",
            "SLURM_CONF": str(self.slurm_conf),
            "SLURM_JOBID": job,
            "SLURM_JOB_CPUS_PER_NODE": "1",
            "SLURM_JOB_GID": "1000",
            "SLURM_JOB_ID": job,
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_PARTITION": "debug",
            "SLURM_JOB_RESTART_COUNT": "0",
            "SLURM_JOB_UID": uid,
            "SLURM_JOB_USER": user,
            "SLURM_JOB_WORK_DIR": str(self.root),
            "SLURM_NODELIST": self.name,
            "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
            "SLURM_UID": uid,
        }
        if gpus is not None:
            env.update(CUDA_VISIBLE_DEVICES=gpus, GPU_DEVICE_ORDINAL=gpus, ROCR_VISIBLE_DEVICES=gpus, SLURM_JOB_GPUS=gpus)
        env.update(extra)
        return env

    def epilog_env(self, job: str = "7", gpus: str | None = "0,1", **extra: str) -> dict[str, str]:
        env = self.prolog_env(job, gpus, **extra)
        env.update(SLURM_SCRIPT_CONTEXT="epilog_slurmd", SLURM_JOB_EXIT_CODE="0", SLURM_JOB_EXIT_CODE2="0:0",
                   SLURM_JOB_DERIVED_EC="0")
        return env

    def run(self, hook: str, env: dict[str, str], timeout: float = 30.0) -> tuple[int, str, float]:
        """Run an installed hook the way slurmd does: this exact environment, no arguments but the
        config path (a site points at its config with a wrapper or the default path)."""
        start = time.monotonic()
        p = subprocess.run([str(BIN / hook), "--config", str(self.config)], env=env, capture_output=True, text=True,
                           timeout=timeout, cwd=str(self.root))
        return p.returncode, p.stderr, time.monotonic() - start


def prolog_would_refuse(node: Node, job: str, gpus: str, reason: str) -> None:
    """With hooks.gating off and a finding that concerns the job's GPUs: the prolog runs the job, says in
    one line that it would refuse it for `reason`, and asks Slurm nothing."""
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job=job, gpus=gpus))
    assert rc == 0, err
    one_line(err, f"would refuse job {job}: healthd: {reason} [job {job}] (hooks.gating off)")
    assert node.calls() == []


def snapshot(d: Path) -> dict[str, bytes]:
    """Every path under `d` with its bytes (directories as b"dir"): compare before and after."""
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"dir" for p in sorted(d.rglob("*"))}
