"""ansible/site.yml for real: ansible-lint, --syntax-check, a rollout into throwaway prefixes on localhost
(a head node and two agents, each its own healthd_prefix), the managed slurm.conf block and `scontrol
reconfigure` against a real local Slurm cluster, idempotence, --check --diff, a canary that stops the rollout,
upgrade and rollback; a site Prolog= the manage mode refuses, bad variables refused before any change; and a
rollout with the distribution's python3-systemd onto a root with no compiler on PATH, in print mode.

The wheels are built once per module: healthd 0.1.0 from this tree with its dependencies and its `journal`
extra (a wheelhouse the role installs from with --no-index), and a 0.1.1 built from a copy with only the version
changed. The systemd units are the tree's own (systemd/).
"""

from __future__ import annotations

import glob
import importlib.util
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
    subprocess.run([*pip, "wheel", "-q", f"{REPO}[journal]", "-w", str(house)], check=True, timeout=300)
    src = work / "src-next"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copy(REPO / "healthd_inband.py", src)  # a module of the distribution: the agent loads it
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
    # HealthCheckProgram next to the wrapper; prolog and epilog as entries of the prolog.d / epilog.d globs
    assert os.readlink(hooks / "healthd-healthcheck") == "healthd-hook"
    assert os.readlink(hooks / "prolog.d" / "healthd-prolog") == str(hooks / "healthd-hook")
    assert os.readlink(hooks / "epilog.d" / "healthd-epilog") == str(hooks / "healthd-hook")
    assert not (hooks / "healthd-prolog").exists() and not (hooks / "healthd-epilog").exists()
    assert not (prefixes["head"] / "etc" / "slurm").exists()  # the head only gets the slurm.conf block
    # the probed filesystem is writable for the hardened unit (ProtectSystem=strict)
    dropin = (p / "etc/systemd/system/healthd.service.d/site-paths.conf").read_text()
    assert "[Service]" in dropin and "ReadWritePaths=-/dev/shm" in dropin
    # the wrapper really runs the installed hook (exit 0 always, as slurmd needs)
    ran = subprocess.run([str(hooks / "healthd-healthcheck")], env={"SLURMD_NODENAME": "node01"},
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran
    # what slurmd runs for Prolog=<hooks>/prolog.d/*: the wrapper, as healthd-prolog, records the job's binding
    matches = glob.glob(f"{hooks}/prolog.d/*")
    assert matches == [str(hooks / "prolog.d" / "healthd-prolog")], matches
    job = {"SLURMD_NODENAME": "node01", "SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0",
           "SLURM_JOB_GPUS": "0"}
    ran = subprocess.run(matches, env=job, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and (p / "run" / "healthd" / "jobs" / "4242.json").is_file(), ran


def test_slurm_conf_block_and_one_reconfigure(deployed, cluster: SlurmCluster) -> None:
    _, prefixes, result = deployed
    hooks = prefixes["node01"] / "etc" / "slurm"
    assert block_of(cluster.conf_path) == [
        f"HealthCheckProgram={hooks}/healthd-healthcheck",
        "HealthCheckInterval=0",
        "HealthCheckNodeState=ANY",
        f"Prolog={hooks}/prolog.d/*",
        f"Epilog={hooks}/epilog.d/*",
    ]
    assert result.stdout.count("TASK [slurm_hooks : Reconfigure Slurm") == 1
    assert re.search(r"changed: \[head\]", result.stdout.split("TASK [slurm_hooks : Reconfigure Slurm")[1])
    config = cluster.run(["scontrol", "show", "config"], check=True).stdout
    assert re.search(rf"^HealthCheckProgram\s*=\s*{re.escape(str(hooks))}/healthd-healthcheck$", config, re.M), config
    assert re.search(rf"^Prolog\s*=\s*{re.escape(str(hooks))}/prolog\.d/\*$", config, re.M), config
    assert re.search(rf"^Epilog\s*=\s*{re.escape(str(hooks))}/epilog\.d/\*$", config, re.M), config


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
    assert "node02" not in counts or counts["node02"]["changed"] == 0, _ok(result)
    assert "[node02]" not in result.stdout.split("PLAY [Agents")[1], _ok(result)  # only the first play's checks ran there
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


# ----------------------------------------------------------------------------- slurm.conf: manage and print


def _conflicts_filter():
    path = ANSIBLE / "roles" / "slurm_hooks" / "filter_plugins" / "slurm_conf.py"
    spec = importlib.util.spec_from_file_location("healthd_slurm_conf_filter", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.slurm_conf_conflicts


def test_conflicts_filter_reads_slurm_conf_as_slurm_does() -> None:
    conflicts = _conflicts_filter()
    settings = {"Prolog": "/etc/slurm/prolog.d/*", "PrologFlags": "Alloc", "HealthCheckInterval": 60}
    text = """ClusterName=x
prolog=/etc/slurm/prolog.d/*            # the same value, other case: no conflict
#Epilog=/old/epilog
PrologFlags=Contain  HealthCheckInterval=300
# BEGIN healthd managed block (whatever)
Prolog=/somewhere/else
# END healthd managed block (whatever)
HealthCheckInterval="60"
"""
    assert conflicts(text, settings) == ["PrologFlags=Contain", "HealthCheckInterval=300"]
    assert conflicts("", settings) == []


def test_manage_mode_refuses_a_site_prolog_and_changes_nothing(ansible_env, work, wheels, units_dir) -> None:
    """slurm.conf already names the site's own Prolog: the role stops in its first play with one line saying so,
    rather than add a second Prolog= that would silently replace it; no host is touched."""
    conf = work / "siteprolog-slurm.conf"
    text = "ClusterName=x\nPrologFlags=Alloc\nProlog=/etc/slurm/site-prolog.sh\n"
    conf.write_text(text)
    inv, prefixes = write_inventory(work, "siteprolog", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=conf, units=units_dir)
    result = playbook(ansible_env, inv, slurm_conf=conf)
    assert result.returncode != 0, _ok(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[ERROR]")]
    assert errors and "already sets Prolog=/etc/slurm/site-prolog.sh outside the healthd block" in errors[0], _ok(result)
    assert "PrologFlags" not in errors[0]  # the same value as healthd's: no conflict
    assert "healthd_slurm_conf_mode: print" in errors[0]
    assert conf.read_text() == text
    assert not any(p.exists() for p in prefixes.values())
    assert "PLAY [Controller" not in result.stdout


@pytest.mark.parametrize("extra, named", [
    ({"healthd_slurm_conf_mode": "edit"}, "healthd_slurm_conf_mode"),
    ({"healthd_systemd_python": "pip"}, "healthd_systemd_python"),
    ({"healthd_slurm_manage_conf": True}, "healthd_slurm_manage_conf"),
    ({"healthd_manage_services": "no"}, "booleans"),
])
def test_bad_variable_fails_in_one_line_and_changes_nothing(ansible_env, work, wheels, units_dir, extra: dict,
                                                            named: str) -> None:
    conf = work / f"bad-{named}-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, prefixes = write_inventory(work, f"bad-{named}", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=conf, units=units_dir)
    result = subprocess.run([_tool("ansible-playbook"), "-i", str(inv), str(SITE), "-e", yaml.safe_dump(extra,
                            default_flow_style=True).strip()], env=ansible_env, capture_output=True, text=True,
                            timeout=240, cwd=ANSIBLE)
    assert result.returncode != 0, _ok(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[ERROR]")]
    assert len(set(errors)) == 1 and f"healthd: {named}:" in errors[0], _ok(result)  # one line, the same per host
    assert conf.read_text() == "ClusterName=x\n"
    assert not any(p.exists() for p in prefixes.values())
    assert "PLAY [Controller" not in result.stdout


# ----------------------------------------------------------------------------- no compiler on the nodes

SYSTEM_PYTHON = Path("/usr/bin/python3")
COMPILERS = re.compile(r"^(.+-)?(gcc|g\+\+|c\+\+|cc|c89|c99|cpp|clang|clang\+\+|tcc|ld|ld\..+|as|pkg-config|pkgconf)"
                       r"(-[0-9.]+)?$|^(.+-)?gcc")


def _no_compiler_path(work: Path) -> str:
    """A PATH like a minimal node image: every command of the usual directories, as symlinks in one directory,
    except compilers, linkers and pkg-config."""
    farm = work / "nocc-bin"
    farm.mkdir(exist_ok=True)
    for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if not os.path.isdir(d):
            continue
        for entry in sorted(os.listdir(d)):
            src = os.path.join(d, entry)
            if COMPILERS.match(entry) or (farm / entry).exists() or (farm / entry).is_symlink():
                continue
            if os.path.isfile(src) and os.access(src, os.X_OK):
                (farm / entry).symlink_to(src)
    return f"{VENV_BIN}:{farm}"


@pytest.fixture(scope="module")
def nocc(ansible_env, work, wheels, units_dir):
    """Head and one agent with the distribution's Python and python3-systemd (healthd_systemd_python: distro, the
    role installs the OS packages), from a wheelhouse WITHOUT a systemd-python wheel, with no compiler on PATH,
    and the default healthd_slurm_conf_mode (print)."""
    if not SYSTEM_PYTHON.exists() or not Path("/etc/debian_version").exists():
        pytest.skip("needs Debian's /usr/bin/python3")
    version = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info >= (3, 11))"],
                             capture_output=True, text=True, timeout=30)
    if version.stdout.strip() != "True":
        pytest.skip("/usr/bin/python3 is older than 3.11")
    house = work / "nocc-wheels"
    house.mkdir()
    for whl in (work / "wheels").glob("*.whl"):
        if not whl.name.startswith("systemd_python-"):
            shutil.copy(whl, house)
    path = _no_compiler_path(work)
    env = dict(ansible_env, PATH=path)
    conf = work / "nocc-slurm.conf"
    conf.write_text("ClusterName=x\nProlog=/etc/slurm/site-prolog.sh\n")
    common = {"healthd_python": str(SYSTEM_PYTHON), "healthd_pip_extra_args": ["--no-index", "--find-links", str(house)]}
    for key in ("healthd_systemd_python", "healthd_slurm_conf_mode"):  # the role's defaults
        common[key] = None
    inv, prefixes = write_inventory(work, "nocc", wheel=wheels[BASE_VERSION], version=BASE_VERSION, slurm_conf=conf,
                                    units=units_dir, common_vars=common, agents=("node01",))
    result = playbook(env, inv, timeout=480, slurm_conf=conf)
    return env, conf, prefixes, result


def test_the_no_compiler_path_has_no_compiler(nocc) -> None:
    env, _, _, _ = nocc
    for tool in ("gcc", "cc", "c++", "g++", "cpp", "ld", "as", "pkg-config", "x86_64-linux-gnu-gcc", "clang"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    cc = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_config_var('CC'))"],
                        capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    assert shutil.which(cc, path=env["PATH"]) is None, cc  # the compiler a source build would run
    assert all(shutil.which(t, path=env["PATH"]) for t in ("sh", "sleep", "apt-get", "dpkg-query"))


@pytest.mark.timeout(600)  # the fixture's rollout (OS packages, two venvs) is allowed 480 s
def test_rollout_without_a_compiler_uses_the_distributions_systemd_binding(nocc) -> None:
    env, _, prefixes, result = nocc
    assert result.returncode == 0, _ok(result)
    assert all(r["failed"] == 0 for r in recap(result, {"head", "node01"}).values()), _ok(result)
    for pkg in ("python3-venv", "python3-systemd", "munge", "libmunge2"):  # the role's OS packages
        status = subprocess.run(["dpkg-query", "-W", "-f", "${Status}", pkg], capture_output=True, text=True,
                                timeout=30)
        assert status.stdout == "install ok installed", (pkg, status)
    for prefix in prefixes.values():
        venv = prefix / "opt" / "healthd" / "current"
        assert (venv / "pyvenv.cfg").read_text().count("include-system-site-packages = true") == 1
        assert not list((venv / "lib").glob("python3*/site-packages/systemd*"))  # nothing built or installed
        where = subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import systemd.journal, yaml; print(systemd.journal.__file__); print(yaml.__file__)"],
                               env=env, capture_output=True, text=True, timeout=30)
        journal, yml = where.stdout.split()
        assert journal.startswith("/usr/lib/python3/dist-packages/systemd/"), where
        assert yml.startswith(str(venv)) or yml.startswith(str(venv.resolve())), where  # the rest: the venv's own
        version = subprocess.run([str(venv / "bin" / "healthd"), "--version"], env=env, capture_output=True,
                                 text=True, timeout=30)
        assert version.stdout.split() == ["healthd", BASE_VERSION], version
    node = prefixes["node01"]
    once = subprocess.run([str(node / "opt/healthd/current/bin/healthd"), "--dry-run", "--once", "--config",
                           str(node / "etc/healthd/healthd.yaml")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert once.returncode <= 1, once


def test_print_mode_leaves_slurm_conf_alone_and_prints_the_lines(nocc) -> None:
    _, conf, prefixes, result = nocc
    assert result.returncode == 0, _ok(result)
    assert conf.read_text() == "ClusterName=x\nProlog=/etc/slurm/site-prolog.sh\n"
    hooks = prefixes["node01"] / "etc" / "slurm"
    printed = result.stdout.split("slurm.conf lines to add")[1].split("PLAY RECAP")[0]
    for line in (f"HealthCheckProgram={hooks}/healthd-healthcheck", f"Prolog={hooks}/prolog.d/*",
                 f"Epilog={hooks}/epilog.d/*"):
        assert f'"{line}"' in printed, printed
    assert "It already sets Prolog=/etc/slurm/site-prolog.sh" in printed, printed
    assert "changed: [head]" not in result.stdout.split("TASK [slurm_hooks : Reconfigure Slurm")[1]
    assert os.readlink(hooks / "prolog.d" / "healthd-prolog") == str(hooks / "healthd-hook")
