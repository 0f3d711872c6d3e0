"""What the playbook tests share: the tree's paths, an inventory of throwaway prefixes on localhost (a head
node and two agents), running ansible-playbook, and reading its recap and the managed slurm.conf block."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
SITE = ANSIBLE / "site.yml"
VENV_BIN = Path(sys.executable).parent
UNITS = ("healthd.service", "healthd-controller.service", "healthd.tmpfiles.conf")
HOSTS = {"head", "node01", "node02"}
BASE_VERSION = "0.1.0"
NEXT_VERSION = "0.1.1"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)



def tool(name: str) -> str:
    path = VENV_BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {VENV_BIN}: pip install -e '.[test]'")
    return str(path)



def write_inventory(work: Path, name: str, *, wheel: Path, version: str, slurm_conf: Path, units: Path,
                    host_vars: dict[str, dict] | None = None, common_vars: dict | None = None,
                    agents: tuple[str, ...] = ("node01", "node02")) -> tuple[Path, dict[str, Path]]:
    """Inventory `name`: head (controller) and the agents (node01, node02), each with its own prefix. The
    venvs use this interpreter and the wheelhouse's systemd-python wheel, and the slurm.conf block is managed,
    unless `common_vars` says otherwise (a None value leaves the variable to the role's default)."""
    base = work / name
    prefixes = {h: base / h for h in ("head", *agents)}
    hook_dir = prefixes["node01"] / "etc" / "slurm"  # one slurm.conf for all: one set of paths in it
    common = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "healthd_python": sys.executable,
        "healthd_systemd_python": "wheel",  # this interpreter is not the one Debian's python3-systemd is built for
        "healthd_slurm_conf_mode": "manage",
        "healthd_version": version,
        "healthd_wheel": str(wheel),
        "healthd_pip_extra_args": ["--no-index", "--find-links", str(work / "wheels")],
        "healthd_manage_services": False,
        "healthd_systemd_src_dir": str(units),
        "healthd_slurm_conf": str(slurm_conf),
        "healthd_slurm_settings": {
            "HealthCheckProgram": f"{hook_dir}/healthd-healthcheck",
            "HealthCheckInterval": 0,
            "HealthCheckNodeState": "ANY",
            "Prolog": f"{hook_dir}/prolog.d/*",
            "Epilog": f"{hook_dir}/epilog.d/*",
        },
        "healthd_config": {"log_level": "warning", "interval_s": 15,
                           "host": {"filesystems": [{"path": "/dev/shm", "role": "scratch"}]}},
        "healthd_controller_config": {"listen": "127.0.0.1:19841", "policy": {"mode": "observe"}},
        **(common_vars or {}),
    }
    common = {k: v for k, v in common.items() if v is not None}
    hv = host_vars or {}

    def host(h: str) -> dict:
        return {"healthd_prefix": str(prefixes[h]), **hv.get(h, {})}

    inventory = {
        "all": {
            "vars": common,
            "children": {
                "healthd_controllers": {"hosts": {"head": host("head")}},
                "healthd_agents": {"hosts": {a: host(a) for a in agents}},
            },
        }
    }
    path = work / f"{name}.inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path, prefixes


def playbook(env: dict[str, str], inventory: Path, *args: str, timeout: float = 240,
             slurm_conf: Path | None = None) -> subprocess.CompletedProcess[str]:
    run_env = dict(env)  # a fixture's env stays as it is
    if slurm_conf is not None:
        run_env["SLURM_CONF"] = str(slurm_conf)
    return subprocess.run([tool("ansible-playbook"), "-i", str(inventory), str(SITE), *args], env=run_env,
                          capture_output=True, text=True, timeout=timeout, cwd=ANSIBLE)


def recap(result: subprocess.CompletedProcess[str], hosts: set[str] = HOSTS) -> dict[str, dict[str, int]]:
    """PLAY RECAP's counts per host; asserts the recap names at least `hosts` and nothing beyond the
    inventory (a recap that was not found would otherwise make every check over it pass)."""
    counts = {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
              for m in RECAP.finditer(result.stdout)}
    assert hosts <= set(counts) <= HOSTS, ok(result)
    return counts


def ok(result: subprocess.CompletedProcess[str]) -> str:
    return f"rc={result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


def block_of(conf: Path) -> list[str]:
    lines = conf.read_text().splitlines()
    begin = [i for i, line in enumerate(lines) if line.startswith("# BEGIN healthd managed block")]
    end = [i for i, line in enumerate(lines) if line.startswith("# END healthd managed block")]
    assert len(begin) == 1 and len(end) == 1, conf.read_text()
    return lines[begin[0] + 1 : end[0]]

