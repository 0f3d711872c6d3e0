"""ansible/site.yml rolled out for real into throwaway prefixes on localhost (a head node and two agents, each
its own healthd_prefix): the venvs, configurations, units and hooks, the managed slurm.conf block and one
`scontrol reconfigure` against a real local Slurm cluster, idempotence, --check --diff after the install, and
upgrade then rollback. The systemd units are the tree's own (systemd/). Fixtures: tests/ansible/conftest.py."""

from __future__ import annotations

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_support import BASE_VERSION, NEXT_VERSION, REPO, block_of, ok, playbook, recap, write_inventory
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployed(ansible_env, work, wheels, units_dir, cluster):
    """The first real rollout into fresh prefixes, against the real cluster's slurm.conf."""
    inv, prefixes = write_inventory(work, "site", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=cluster.conf_path, units=units_dir)
    result = playbook(ansible_env, inv, slurm_conf=cluster.conf_path)
    assert result.returncode == 0, ok(result)
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
    assert result.returncode == 0, ok(result)
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in recap(result).values()), ok(result)


def test_check_diff_after_install(deployed, ansible_env, cluster: SlurmCluster) -> None:
    inv, _, _ = deployed
    before = cluster.conf_path.read_text()
    result = playbook(ansible_env, inv, "--check", "--diff", slurm_conf=cluster.conf_path)
    assert result.returncode == 0, ok(result)
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in recap(result).values()), ok(result)
    assert cluster.conf_path.read_text() == before



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
        assert result.returncode == 0, ok(result)
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
    assert len(install) > 1 and all("changed:" not in part.split("TASK [")[0] for part in install[1:]), ok(rollback)
    assert sorted(p.name for p in opt.glob("venv-*")) == [f"venv-{BASE_VERSION}", f"venv-{NEXT_VERSION}"]


