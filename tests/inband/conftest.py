"""Helpers for the in-band tests: run a job-like writer in a child process with a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB_ENV = ("HEALTHD_INBAND_DIR", "HEALTHD_INBAND_CAPACITY", "RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID",
           "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")


def run_job(script: str, timeout: float = 60, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Run `script` (Python source, dedented) in a child whose job environment is exactly `env`."""
    full = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    full["PYTHONPATH"] = str(ROOT)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=full, capture_output=True,
                          text=True, timeout=timeout, cwd=str(cwd))
