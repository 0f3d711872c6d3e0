"""`make demo`: the node agent's drill on one simulated GPU node, no GPU needed.

It builds a node the way the test suite does (the C stand-in for libnvidia-ml loaded by pynvml's
real ctypes path, an 8-port NDR InfiniBand sysfs tree, real journal files), then runs the real
`healthd run --once` (the daemon's first pass), then `healthd --dry-run --once` three times: healthy, after a user's bad kernel (Xid 13 on
two GPUs: charged to user code, no action), and after hardware faults (Xid 79, a pending row remap,
an IB port down). Each report is printed as an operator sees it, with the exit code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.fake_nvml import build_fake_nvml, healthy_node, write_nvml_config  # noqa: E402
from tests.support.ib_tree import make_ndr_node, set_state  # noqa: E402
from tests.support.journal import write_journal  # noqa: E402

HEALTHD = str(Path(sys.executable).with_name("healthd"))


def kernel_bus(nvml_bus: str) -> str:
    """00000000:5D:00.0 -> 0000:5d:00, as the driver prints it."""
    return nvml_bus[4:].lower().rsplit(".", 1)[0]


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="healthd-demo-"))
    ckpt = Path(tempfile.mkdtemp(prefix="healthd-demo-ckpt-", dir="/dev/shm"))
    try:
        lib = build_fake_nvml(tmp / "lib")
        gpus = healthy_node(8)
        values = write_nvml_config(tmp / "nvml.conf", gpus)
        ib = tmp / "sys/class/infiniband"
        make_ndr_node(ib, ports=8)
        journal = tmp / "journal"
        journal.mkdir()
        config = tmp / "healthd.yaml"
        config.write_text(
            f"""node_name: gpu-node-07
state_file: {tmp}/run/state.json
state_dir: {tmp}/state
nvml: {{expected_gpus: 8}}
kernel_log: {{journal_dir: {journal}, kmsg_path: null, start_at: head}}
infiniband: {{sysfs_root: {ib}, expected_ports: 8, expected_rate_gbps: 400}}
host: {{filesystems: [{{path: {ckpt}, role: checkpoint}}]}}
"""
        )
        env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "FAKE_NVML_CONFIG": str(values)}

        def report(title: str) -> None:
            print(f"\n=== {title} ===\n$ healthd --dry-run --once --config {config.name}", flush=True)
            p = subprocess.run([HEALTHD, "--dry-run", "--once", "--config", str(config)], env=env,
                               capture_output=True, text=True, timeout=120)
            print(p.stdout, end="")
            if p.stderr.strip():
                print(p.stderr, end="")
            print(f"(exit {p.returncode})", flush=True)

        # The daemon's first pass (what systemd runs, once): it learns this node's GPUs (index, bus id,
        # UUID, serial), so later faults are named even when NVML can no longer answer for a GPU.
        first = subprocess.run([HEALTHD, "run", "--once", "--format", "json", "--config", str(config)],
                               env=env, capture_output=True, text=True, timeout=120)
        print(f"$ healthd run --once   # the daemon's first pass: exit {first.returncode}, state in {tmp}/run/state.json")
        state_before = {p: p.read_bytes() for p in sorted((tmp / "run").glob("*")) + sorted((tmp / "state").glob("*"))}

        report("1. a healthy node")

        now = int(time.time() * 1e6)
        write_journal(journal, [
            f"NVRM: Xid (PCI:{kernel_bus(gpus[1]['bus_id'])}): 13, pid=4121, name=python3, Graphics SM Warp "
            "Exception on (GPC 2, TPC 1, SM 0): Out Of Range Address",
            f"NVRM: Xid (PCI:{kernel_bus(gpus[6]['bus_id'])}): 13, pid=4122, name=python3, Graphics SM Warp "
            "Exception on (GPC 0, TPC 4, SM 1): Out Of Range Address",
        ], start_usec=now)
        report("2. a user's kernel faults on two GPUs (Xid 13): user code, nothing drained")

        gpus[3]["lost"] = 1
        gpus[5]["remapped_rows.pending"] = 1
        write_nvml_config(values, gpus)
        set_state(ib, "mlx5_3", 1, state="1: DOWN", phys_state="2: Polling")
        write_journal(journal, [
            f"NVRM: Xid (PCI:{kernel_bus(gpus[3]['bus_id'])}): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus."
        ] * 3, start_usec=now + 5_000_000)
        report("3. hardware: GPU 3 fell off the bus, GPU 5 has a pending row remap, an IB port is down")
        after = {p: p.read_bytes() for p in sorted((tmp / "run").glob("*")) + sorted((tmp / "state").glob("*"))}
        print("\nThe dry runs changed nothing: state file and agent state are byte-identical:", after == state_before)
        print("healthd-controller acts on such findings fleet-wide (drain, requeue, reboot when idle): `make demo`.")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
