"""Capture what a real Slurm prints about nodes, for the parser tests (tests/slurm/captured/): run
inside a root of the version matrix (or on the host) with

    python -m tests.support.capture_slurm OUTDIR

It starts a 4-node test cluster (tests/support/slurm_cluster.py) under /tmp, puts its nodes in the
states the readers must tell apart, and writes, for each moment, `scontrol show node -o`,
`scontrol show nodes --json` and `sinfo --json` as the clients print them (TZ=UTC,
SLURM_TIME_FORMAT=standard: the parser tests read them in UTC):

- `drained`: node01 idle; node02 drained by root (REASON_DRAINED); node03 busy with a reboot ASAP
  (nextstate=RESUME, REASON_REBOOT); node04 busy and drained (draining, REASON_DRAINING).
- `resumed`: then node02 resumed and idle again, no job run on it since (Slurm 24.11 still shows
  its old reason there; 22.05 and 26.05 do not).

Files: scontrol-<V>-<moment>.txt, scontrol-json-<V>-<moment>.json, sinfo-<V>-<moment>.json and
scontrol-version-<V>.txt, where <V> is the Slurm major.minor."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from tests.support.slurm_cluster import SlurmCluster, slurm_version

REASON_DRAINED = "healthd: xid 79 gpu0 fell off the bus [#7]"
REASON_REBOOT = "healthd: pending row remap gpu1 [#9]"
REASON_DRAINING = "healthd: drain while busy [#4]"


def capture(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    version = ".".join(f"{p:02d}" if i else str(p) for i, p in enumerate(slurm_version()))
    root = Path(tempfile.mkdtemp(prefix="healthd-capture-", dir="/tmp"))
    root.chmod(0o755)
    cluster = SlurmCluster(root, extra_conf="RebootProgram=/bin/true")
    written: list[Path] = []
    env_extra = {"TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}

    def client(argv: list[str]) -> str:
        import subprocess

        done = subprocess.run(argv, env={**cluster.env, **env_extra}, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{argv}: exit {done.returncode}: {done.stderr}")
        return done.stdout

    def save(name: str, text: str) -> None:
        path = out / name
        path.write_text(text)
        written.append(path)

    def snapshot(moment: str) -> None:
        save(f"scontrol-{version}-{moment}.txt", client(["scontrol", "show", "node", "-o"]))
        save(f"scontrol-json-{version}-{moment}.json", client(["scontrol", "show", "nodes", "--json"]))
        save(f"sinfo-{version}-{moment}.json", client(["sinfo", "--json"]))

    def busy(node: str) -> str:
        job = client(["sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", "sleep 300"]).strip()
        cluster.wait_for(lambda: client(["squeue", "-h", "-j", job, "-o", "%T"]).strip() == "RUNNING", 30,
                         what=f"job {job} to run")
        return job

    try:
        cluster.up()
        save(f"scontrol-version-{version}.txt", client(["scontrol", "--version"]))
        client(["scontrol", "update", "NodeName=node02", "State=DRAIN", f"Reason={REASON_DRAINED}"])
        busy("node03")
        client(["scontrol", "reboot", "ASAP", "nextstate=RESUME", f"reason={REASON_REBOOT}", "node03"])
        busy("node04")
        client(["scontrol", "update", "NodeName=node04", "State=DRAIN", f"Reason={REASON_DRAINING}"])
        snapshot("drained")
        client(["scontrol", "update", "NodeName=node02", "State=RESUME"])
        cluster.wait_idle(30, nodes=["node02"])
        snapshot("resumed")
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
    return written


if __name__ == "__main__":
    for path in capture(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd())):
        print(path)
