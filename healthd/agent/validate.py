"""`healthd validate`: the node's side of reintegration, run by the controller through srun inside the
maintenance reservation (controller config `reintegration.validation`).

1. `dcgmi diag -r <level>` when DCGM is installed (level 2 by default: a few minutes of GPU stress
   and memory tests); its exit code decides. Without dcgmi this step is reported as skipped.
2. The agent's own one-shot check (`healthd --dry-run --once`, the node's config and memory, so a
   finding the controller cleared stays cleared): a T1 finding or a node it cannot check fails.

Prints one line per step and exits 0 when every step that ran passed, 1 otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from healthd.agent import daemon as agent_mod
from healthd.agent.classify.catalog import CatalogError
from healthd.config import ConfigError

SAFE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"


def dcgm_step(level: int, timeout_s: float) -> tuple[bool, str]:
    exe = shutil.which("dcgmi", path=os.environ.get("PATH") or SAFE_PATH)
    if exe is None:
        return True, "dcgmi diag: skipped (DCGM not installed on this node)"
    try:
        done = subprocess.run([exe, "diag", "-r", str(level)], capture_output=True, text=True, timeout=timeout_s,
                              check=False, env={"PATH": SAFE_PATH, "LANG": "C"})
    except subprocess.TimeoutExpired:
        return False, f"dcgmi diag -r {level}: did not finish within {timeout_s:.0f} s"
    except OSError as exc:
        return False, f"dcgmi diag -r {level}: cannot run: {exc}"
    tail = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()][-3:]
    what = f"dcgmi diag -r {level}: exit {done.returncode}" + (f" ({' | '.join(tail)})" if tail else "")
    return done.returncode == 0, what


def agent_step(config: str | None) -> tuple[bool, str]:
    try:
        agent = agent_mod.build_agent(config, dry_run=True)
    except (ConfigError, CatalogError) as exc:
        return False, f"healthd check: cannot check: {exc}"
    try:
        agent.tick_all()
    finally:
        agent.sources.close()
    result = agent.result
    t1 = [f for f in result.findings if f.tier == 1]
    if result.verdict == "unknown":
        return False, "healthd check: unknown (no source could be read)"
    if t1:
        return False, "healthd check: failed: " + "; ".join(f.summary for f in t1[:3])
    return True, f"healthd check: {result.verdict} ({len(result.findings)} finding(s), none T1)"


def run(config: str | None, dcgm_level: int, timeout_s: float, out=print) -> int:
    ok = True
    steps = []
    if dcgm_level > 0:
        steps.append(lambda: dcgm_step(dcgm_level, timeout_s))
    steps.append(lambda: agent_step(config))
    for step in steps:
        passed, line = step()
        out(("PASS " if passed else "FAIL ") + line)
        ok = ok and passed
    return 0 if ok else 1

