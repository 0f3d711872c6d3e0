"""ansible/site.yml for real: ansible-lint, --syntax-check, a rollout into throwaway prefixes on localhost
(a head node and two agents, each its own healthd_prefix), `scontrol reconfigure` against a real local
Slurm cluster, idempotence, --check --diff, a canary that stops the rollout, upgrade and rollback.

The wheels are built once per module: healthd 0.1.0 from this tree with its dependencies (a wheelhouse the
role installs from with --no-index), and a 0.1.1 built from a copy with only the version changed. The systemd
units are the tree's own (systemd/).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.support.slurm_cluster import SlurmCluster, ensure_installed
from tests.support.tmpdirs import shared_tmpdir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
SITE = ANSIBLE / "site.yml"
VENV_BIN = Path(sys.executable).parent
UNITS = ("healthd.service", "healthd-controller.service", "healthd.tmpfiles.conf")
HOSTS = {"head", "node01", "node02"}
BASE_VERSION = "0.1.0"
NEXT_VERSION = "0.1.1"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def _tool(name: str) -> str:
    path = VENV_BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {VENV_BIN}: pip install -e '.[test]'")
    return str(path)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with shared_tmpdir("healthd-ansible-") as root:  # the Slurm cluster lives below it
        yield root


@pytest.fixture(scope="module")
def ansible_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    for name in ("home", "local_tmp", "remote_tmp"):
        (work / "ansible" / name).mkdir(parents=True, exist_ok=True)
    env.update(
        PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        ANSIBLE_HOME=str(work / "ansible" / "home"),
        ANSIBLE_LOCAL_TEMP=str(work / "ansible" / "local_tmp"),
        ANSIBLE_REMOTE_TEMP=str(work / "ansible" / "remote_tmp"),
        ANSIBLE_PIPELINING="1",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_RETRY_FILES_ENABLED="0",
    )
    return env


@pytest.fixture(scope="module")
def wheels(work: Path) -> dict[str, Path]:
    """version -> healthd wheel; every dependency sits in the same wheelhouse (work/wheels)."""
    house = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", str(REPO), "-w", str(house)], check=True, timeout=300)
    src = work / "src-next"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "healthd", src / "healthd", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    assert f'version = "{BASE_VERSION}"' in text
    pyproject.write_text(text.replace(f'version = "{BASE_VERSION}"', f'version = "{NEXT_VERSION}"', 1))
    init = src / "healthd" / "__init__.py"  # what `healthd --version` prints (the role checks it)
    assert f'__version__ = "{BASE_VERSION}"' in init.read_text()
    init.write_text(init.read_text().replace(f'__version__ = "{BASE_VERSION}"', f'__version__ = "{NEXT_VERSION}"', 1))
    subprocess.run([*pip, "wheel", "-q", "--no-deps", str(src), "-w", str(work / "next")],
                   check=True, timeout=300)
    found = {v: list(house.glob(f"healthd-{v}-*.whl")) + list((work / "next").glob(f"healthd-{v}-*.whl"))
             for v in (BASE_VERSION, NEXT_VERSION)}
    assert all(len(f) == 1 for f in found.values()), found
    return {v: f[0] for v, f in found.items()}


@pytest.fixture(scope="module")
def units_dir() -> Path:
    real = REPO / "systemd"
    assert all((real / name).is_file() for name in UNITS), sorted(p.name for p in real.iterdir())
    return real


@pytest.fixture(scope="module")
def cluster(work: Path) -> Iterator[SlurmCluster]:
    ensure_installed()
    c = SlurmCluster(work / "slurm", nodes=1, gpus_per_node=1)
    try:
        c.up()
        yield c
    finally:
        c.down()


def write_inventory(work: Path, name: str, *, wheel: Path, version: str, slurm_conf: Path, units: Path,
                    host_vars: dict[str, dict] | None = None) -> tuple[Path, dict[str, Path]]:
    """Inventory `name`: head (controller), node01 and node02 (agents), each with its own prefix."""
    base = work / name
    prefixes = {h: base / h for h in ("head", "node01", "node02")}
    hook_dir = prefixes["node01"] / "etc" / "slurm"  # one slurm.conf for all: one set of paths in it
    common = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "healthd_python": sys.executable,
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
            "Prolog": f"{hook_dir}/healthd-prolog",
            "Epilog": f"{hook_dir}/healthd-epilog",
        },
        "healthd_config": {"log_level": "warning", "interval_s": 15,
                           "host": {"filesystems": [{"path": "/dev/shm", "role": "scratch"}]}},
        "healthd_controller_config": {"listen": "127.0.0.1:19841", "policy": {"mode": "observe"}},
    }
    hv = host_vars or {}

    def host(h: str) -> dict:
        return {"healthd_prefix": str(prefixes[h]), **hv.get(h, {})}

    inventory = {
        "all": {
            "vars": common,
            "children": {
                "healthd_controllers": {"hosts": {"head": host("head")}},
                "healthd_agents": {"hosts": {"node01": host("node01"), "node02": host("node02")}},
            },
        }
    }
    path = work / f"{name}.inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path, prefixes


def playbook(env: dict[str, str], inventory: Path, *args: str, timeout: float = 240,
             slurm_conf: Path | None = None) -> subprocess.CompletedProcess[str]:
    run_env = dict(env)
    if slurm_conf is not None:
        run_env["SLURM_CONF"] = str(slurm_conf)
    return subprocess.run([_tool("ansible-playbook"), "-i", str(inventory), str(SITE), *args], env=run_env,
                          capture_output=True, text=True, timeout=timeout, cwd=ANSIBLE)


def recap(result: subprocess.CompletedProcess[str], hosts: set[str] = HOSTS) -> dict[str, dict[str, int]]:
    """PLAY RECAP's counts per host; asserts the recap names at least `hosts` and nothing beyond the
    inventory (a recap that was not found would otherwise make every check over it pass)."""
    counts = {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]), "failed": int(m[5])}
              for m in RECAP.finditer(result.stdout)}
    assert hosts <= set(counts) <= HOSTS, _ok(result)
    return counts


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    return f"rc={result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


def block_of(conf: Path) -> list[str]:
    lines = conf.read_text().splitlines()
    begin = [i for i, line in enumerate(lines) if line.startswith("# BEGIN healthd managed block")]
    end = [i for i, line in enumerate(lines) if line.startswith("# END healthd managed block")]
    assert len(begin) == 1 and len(end) == 1, conf.read_text()
    return lines[begin[0] + 1 : end[0]]


# ----------------------------------------------------------------------------- static checks


def test_ansible_lint_is_clean(ansible_env: dict[str, str]) -> None:
    result = subprocess.run([_tool("ansible-lint"), "--offline"], env=ansible_env, capture_output=True, text=True,
                            timeout=180, cwd=ANSIBLE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


def test_syntax_check(ansible_env: dict[str, str], work: Path, wheels: dict[str, Path], units_dir: Path) -> None:
    conf = work / "syntax-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, _ = write_inventory(work, "syntax", wheel=wheels[BASE_VERSION], version=BASE_VERSION, slurm_conf=conf,
                             units=units_dir)
    result = playbook(ansible_env, inv, "--syntax-check")
    assert result.returncode == 0, _ok(result)


# ----------------------------------------------------------------------------- the rollout


@pytest.fixture(scope="module")
def deployed(ansible_env, work, wheels, units_dir, cluster):
    """The first real rollout into fresh prefixes, against the real cluster's slurm.conf."""
    inv, prefixes = write_inventory(work, "site", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=cluster.conf_path, units=units_dir)
    result = playbook(ansible_env, inv, slurm_conf=cluster.conf_path)
    assert result.returncode == 0, _ok(result)
    return inv, prefixes, result


def test_rollout_installs_venvs_configs_units_and_hooks(deployed, units_dir: Path) -> None:
    _, prefixes, result = deployed
    assert all(r["failed"] == 0 and r["changed"] > 0 for r in recap(result).values()), recap(result)
    for host, prefix in prefixes.items():
        opt = prefix / "opt" / "healthd"
        assert os.readlink(opt / "current") == f"venv-{BASE_VERSION}"
        version = subprocess.run([str(opt / "current" / "bin" / "healthd"), "--version"], capture_output=True,
                                 text=True, timeout=30)
        assert version.returncode == 0 and version.stdout.split() == ["healthd", BASE_VERSION], version
        etc = prefix / "etc"
        assert (etc / "tmpfiles.d" / "healthd.conf").read_text() == (units_dir / "healthd.tmpfiles.conf").read_text()
        unit = "healthd-controller.service" if host == "head" else "healthd.service"
        assert (etc / "systemd" / "system" / unit).read_text() == (units_dir / unit).read_text()
    agent = yaml.safe_load((prefixes["node01"] / "etc/healthd/healthd.yaml").read_text())
    p = prefixes["node01"]
    assert agent == {
        "log_level": "warning",
        "interval_s": 15,
        "host": {"filesystems": [{"path": "/dev/shm", "role": "scratch"}]},
        "state_file": f"{p}/run/healthd/state.json",
        "state_dir": f"{p}/var/lib/healthd",
        "hooks": {"run_dir": f"{p}/run/healthd", "charges_file": f"{p}/var/lib/healthd/charges.jsonl",
                  "slurm_conf": agent["hooks"]["slurm_conf"]},
    }
    ctl = yaml.safe_load((prefixes["head"] / "etc/healthd/controller.yaml").read_text())
    h = prefixes["head"]
    assert ctl["listen"] == "127.0.0.1:19841" and ctl["policy"] == {"mode": "observe"}
    assert ctl["ledger"] == f"{h}/var/lib/healthd/ledger.sqlite" and ctl["admin_socket"] == f"{h}/run/healthd/controller.sock"
    # the hook wrapper: slurm/healthd-hook-wrapper.sh with only its three settings changed
    hooks = p / "etc" / "slurm"
    wrapper = (hooks / "healthd-hook").read_text()
    source = (REPO / "slurm" / "healthd-hook-wrapper.sh").read_text()
    settings = {"HEALTHD_BIN": f"{p}/opt/healthd/current/bin", "HEALTHD_CONFIG": f"{p}/etc/healthd/healthd.yaml",
                "HEALTHD_HOOK_LOG": "''"}
    for key, value in settings.items():
        source = re.sub(rf"(?m)^{key}=.*$", f"{key}={value}", source)
    assert wrapper == source
    assert os.access(hooks / "healthd-hook", os.X_OK)
    for name in ("healthcheck", "prolog", "epilog"):
        assert os.readlink(hooks / f"healthd-{name}") == "healthd-hook"
    assert not (prefixes["head"] / "etc" / "slurm").exists()  # the head only gets the slurm.conf block
    # the probed filesystem is writable for the hardened unit (ProtectSystem=strict)
    dropin = (p / "etc/systemd/system/healthd.service.d/site-paths.conf").read_text()
    assert "[Service]" in dropin and "ReadWritePaths=-/dev/shm" in dropin
    # the wrapper really runs the installed hook (exit 0 always, as slurmd needs)
    ran = subprocess.run([str(hooks / "healthd-healthcheck")], env={"SLURMD_NODENAME": "node01"},
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran


def test_slurm_conf_block_and_one_reconfigure(deployed, cluster: SlurmCluster) -> None:
    _, prefixes, result = deployed
    hooks = prefixes["node01"] / "etc" / "slurm"
    assert block_of(cluster.conf_path) == [
        f"HealthCheckProgram={hooks}/healthd-healthcheck",
        "HealthCheckInterval=0",
        "HealthCheckNodeState=ANY",
        f"Prolog={hooks}/healthd-prolog",
        f"Epilog={hooks}/healthd-epilog",
    ]
    assert result.stdout.count("TASK [slurm_hooks : Reconfigure Slurm") == 1
    assert re.search(r"changed: \[head\]", result.stdout.split("TASK [slurm_hooks : Reconfigure Slurm")[1])
    config = cluster.run(["scontrol", "show", "config"], check=True).stdout
    assert re.search(rf"^HealthCheckProgram\s*=\s*{re.escape(str(hooks))}/healthd-healthcheck$", config, re.M), config
    assert re.search(rf"^Prolog\s*=\s*{re.escape(str(hooks))}/healthd-prolog$", config, re.M)


def test_second_run_changes_nothing(deployed, ansible_env, cluster: SlurmCluster) -> None:
    inv, _, _ = deployed
    result = playbook(ansible_env, inv, slurm_conf=cluster.conf_path)
    assert result.returncode == 0, _ok(result)
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in recap(result).values()), _ok(result)


def test_check_diff_after_install(deployed, ansible_env, cluster: SlurmCluster) -> None:
    inv, _, _ = deployed
    before = cluster.conf_path.read_text()
    result = playbook(ansible_env, inv, "--check", "--diff", slurm_conf=cluster.conf_path)
    assert result.returncode == 0, _ok(result)
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in recap(result).values()), _ok(result)
    assert cluster.conf_path.read_text() == before


def test_check_diff_on_fresh_hosts_writes_nothing(ansible_env, work, wheels, units_dir) -> None:
    conf = work / "check-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, prefixes = write_inventory(work, "check", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=conf, units=units_dir, host_vars={})
    result = playbook(ansible_env, inv, "--check", "--diff", slurm_conf=conf)
    assert result.returncode == 0, _ok(result)
    assert all(r["failed"] == 0 and r["changed"] > 0 for r in recap(result).values()), _ok(result)
    assert "+HealthCheckProgram=" in result.stdout  # the diff of the block it would add
    assert conf.read_text() == "ClusterName=x\n"
    assert not any(p.exists() for p in prefixes.values())


def test_failing_canary_stops_the_rollout(ansible_env, work, wheels, units_dir) -> None:
    """node01's agent really reports FAILED (a T1: 4 InfiniBand ports expected, none here): node02 is never touched,
    and no `scontrol reconfigure` runs."""
    conf = work / "canary-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, prefixes = write_inventory(
        work, "canary", wheel=wheels[BASE_VERSION], version=BASE_VERSION, slurm_conf=conf, units=units_dir,
        host_vars={"node01": {"healthd_config": {"infiniband": {"expected_ports": 4}}}},
    )
    result = playbook(ansible_env, inv, slurm_conf=conf)
    assert result.returncode != 0, _ok(result)
    counts = recap(result, {"node01"})
    assert counts["node01"]["failed"] == 1, _ok(result)
    assert "FAILED" in result.stdout and "0 of 4 InfiniBand ports present" in result.stdout
    assert "node02" not in counts or counts["node02"]["ok"] == 0, _ok(result)
    assert not prefixes["node02"].exists()
    assert "Reconfigure Slurm" not in result.stdout
    assert (prefixes["node01"] / "opt/healthd/current/bin/healthd").exists()  # the canary itself was changed


@pytest.mark.timeout(600)  # two rollouts, each a playbook run allowed 240 s; about 100 s here
def test_upgrade_then_rollback_switches_without_reinstalling(deployed, ansible_env, work, wheels, units_dir,
                                                             cluster: SlurmCluster) -> None:
    _, prefixes, _ = deployed
    opt = prefixes["node01"] / "opt" / "healthd"
    old_healthd = opt / f"venv-{BASE_VERSION}" / "bin" / "healthd"
    stamp = old_healthd.stat()

    def rollout(version: str) -> subprocess.CompletedProcess[str]:
        inv, _ = write_inventory(work, "site", wheel=wheels[version], version=version,
                                 slurm_conf=cluster.conf_path, units=units_dir)
        result = playbook(ansible_env, inv, slurm_conf=cluster.conf_path)
        assert result.returncode == 0, _ok(result)
        return result

    def installed() -> str:
        out = subprocess.run([str(opt / "current" / "bin" / "healthd"), "--version"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip()

    upgrade = rollout(NEXT_VERSION)
    assert os.readlink(opt / "current") == f"venv-{NEXT_VERSION}"
    assert os.readlink(opt / "previous") == f"venv-{BASE_VERSION}"
    assert installed() == f"healthd {NEXT_VERSION}"
    assert "Reconfigure Slurm" in upgrade.stdout and not re.search(
        r"changed: \[head\]", upgrade.stdout.split("TASK [slurm_hooks : Reconfigure Slurm")[1].split("PLAY RECAP")[0]
    )  # slurm.conf did not change: no reconfigure

    rollback = rollout(BASE_VERSION)
    assert os.readlink(opt / "current") == f"venv-{BASE_VERSION}"
    assert os.readlink(opt / "previous") == f"venv-{NEXT_VERSION}"
    assert installed() == f"healthd {BASE_VERSION}"
    again = old_healthd.stat()
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)  # the old venv, not a new one
    install = rollback.stdout.split("TASK [healthd : Install healthd into venv-")
    assert len(install) > 1 and all("changed:" not in part.split("TASK [")[0] for part in install[1:]), _ok(rollback)
    assert sorted(p.name for p in opt.glob("venv-*")) == [f"venv-{BASE_VERSION}", f"venv-{NEXT_VERSION}"]
