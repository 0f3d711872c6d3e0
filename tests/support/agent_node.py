"""One simulated GPU node for running the real `healthd` executable: NVML values for the C stand-in
of libnvidia-ml, an InfiniBand sysfs tree, a journal directory and a config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tests.support.fake_nvml import healthy_node, write_nvml_config
from tests.support.ib_tree import make_ndr_node
from tests.support.journal import write_journal

HEALTHD = str(Path(sys.executable).with_name("healthd"))


class Node:
    """One simulated GPU node: NVML values, an IB tree, a journal directory, a config."""

    def __init__(self, root: Path, nvml_dir: Path):
        self.root = root
        self.nvml_dir = nvml_dir
        self.nvml_values = root / "nvml.conf"
        self.gpus = healthy_node(8)
        write_nvml_config(self.nvml_values, self.gpus)
        self.ib = root / "sys/class/infiniband"
        make_ndr_node(self.ib, ports=8)
        self.journal = root / "journal"
        self.journal.mkdir()
        # /dev/shm is a mount of its own, so the probe sees a mounted filesystem as on a real node
        self.ckpt = Path(tempfile.mkdtemp(prefix="healthd-e2e-ckpt-", dir="/dev/shm"))
        self.state_file = root / "run/state.json"
        self.state_dir = root / "lib"
        self.config = root / "healthd.yaml"
        self.write_config()

    def write_config(self, **extra) -> None:
        doc = {
            "node_name": "node01",
            "state_file": str(self.state_file),
            "state_dir": str(self.state_dir),
            "interval_s": 0.5,
            "nvml": {"expected_gpus": 8},
            "kernel_log": {"journal_dir": str(self.journal), "kmsg_path": None, "start_at": "head"},
            "infiniband": {"sysfs_root": str(self.ib), "expected_ports": 8, "expected_rate_gbps": 400},
            "host": {"filesystems": [{"path": str(self.ckpt), "role": "checkpoint"}]},
            "metrics": {"textfile": str(self.root / "healthd.prom")},
        }
        doc.update(extra)
        self.config.write_text(yaml.safe_dump(doc))

    def env(self, with_nvml: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
        if with_nvml:
            env["LD_LIBRARY_PATH"] = str(self.nvml_dir)
            env["FAKE_NVML_CONFIG"] = str(self.nvml_values)
        return env

    def dry_run(self, *args: str, with_nvml: bool = True) -> tuple[int, dict, str]:
        p = subprocess.run(
            [HEALTHD, "--dry-run", "--once", "--format", "json", "--config", str(self.config), *args],
            capture_output=True, text=True, env=self.env(with_nvml), timeout=60,
        )
        doc = json.loads(p.stdout) if p.stdout.strip() else {}
        return p.returncode, doc, p.stderr

    def state(self) -> dict | None:
        """The state file the agent published, or None while there is none (or it is mid-write)."""
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def close(self) -> None:
        shutil.rmtree(self.ckpt, ignore_errors=True)

    def xid(self, bus: str, code: int, text: str, now: float | None = None, **kw) -> None:
        write_journal(self.journal, [f"NVRM: Xid (PCI:{bus}): {code}, {text}"],
                      start_usec=int((now or time.time()) * 1e6), **kw)
