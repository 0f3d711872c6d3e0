"""ansible/site.yml for real, apart from the rollout onto the shared cluster (test_rollout.py): ansible-lint,
--syntax-check, --check --diff on fresh hosts, a canary that stops the rollout; a site Prolog= the manage mode
refuses, bad variables refused before any change; and a rollout with the distribution's python3-systemd onto a
root with no compiler on PATH, in print mode. Fixtures: tests/ansible/conftest.py."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_support import ANSIBLE, BASE_VERSION, SITE, VENV_BIN, ok, playbook, recap, tool, write_inventory

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- static checks


def test_ansible_lint_is_clean(ansible_env: dict[str, str]) -> None:
    result = subprocess.run([tool("ansible-lint"), "--offline"], env=ansible_env, capture_output=True, text=True,
                            timeout=180, cwd=ANSIBLE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


def test_syntax_check(ansible_env: dict[str, str], work: Path, wheels: dict[str, Path], units_dir: Path) -> None:
    conf = work / "syntax-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, _ = write_inventory(work, "syntax", wheel=wheels[BASE_VERSION], version=BASE_VERSION, slurm_conf=conf,
                             units=units_dir)
    result = playbook(ansible_env, inv, "--syntax-check")
    assert result.returncode == 0, ok(result)


def test_check_diff_on_fresh_hosts_writes_nothing(ansible_env, work, wheels, units_dir) -> None:
    conf = work / "check-slurm.conf"
    conf.write_text("ClusterName=x\n")
    inv, prefixes = write_inventory(work, "check", wheel=wheels[BASE_VERSION], version=BASE_VERSION,
                                    slurm_conf=conf, units=units_dir, host_vars={})
    result = playbook(ansible_env, inv, "--check", "--diff", slurm_conf=conf)
    assert result.returncode == 0, ok(result)
    assert all(r["failed"] == 0 and r["changed"] > 0 for r in recap(result).values()), ok(result)
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
    assert result.returncode != 0, ok(result)
    counts = recap(result, {"node01"})
    assert counts["node01"]["failed"] == 1, ok(result)
    assert "FAILED" in result.stdout and "0 of 4 InfiniBand ports present" in result.stdout
    assert "node02" not in counts or counts["node02"]["changed"] == 0, ok(result)
    assert "[node02]" not in result.stdout.split("PLAY [Agents")[1], ok(result)  # only the first play's checks ran there
    assert not prefixes["node02"].exists()
    assert "Reconfigure Slurm" not in result.stdout
    assert (prefixes["node01"] / "opt/healthd/current/bin/healthd").exists()  # the canary itself was changed


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
    assert result.returncode != 0, ok(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[ERROR]")]
    assert errors and "already sets Prolog=/etc/slurm/site-prolog.sh outside the healthd block" in errors[0], ok(result)
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
    result = subprocess.run([tool("ansible-playbook"), "-i", str(inv), str(SITE), "-e", yaml.safe_dump(extra,
                            default_flow_style=True).strip()], env=ansible_env, capture_output=True, text=True,
                            timeout=240, cwd=ANSIBLE)
    assert result.returncode != 0, ok(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[ERROR]")]
    assert len(set(errors)) == 1 and f"healthd: {named}:" in errors[0], ok(result)  # one line, the same per host
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
    for program in ("gcc", "cc", "c++", "g++", "cpp", "ld", "as", "pkg-config", "x86_64-linux-gnu-gcc", "clang"):
        assert shutil.which(program, path=env["PATH"]) is None, program
    cc = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_config_var('CC'))"],
                        capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    assert shutil.which(cc, path=env["PATH"]) is None, cc  # the compiler a source build would run
    assert all(shutil.which(t, path=env["PATH"]) for t in ("sh", "sleep", "apt-get", "dpkg-query"))


@pytest.mark.timeout(600)  # the fixture's rollout (OS packages, two venvs) is allowed 480 s
def test_rollout_without_a_compiler_uses_the_distributions_systemd_binding(nocc) -> None:
    env, _, prefixes, result = nocc
    assert result.returncode == 0, ok(result)
    assert all(r["failed"] == 0 for r in recap(result, {"head", "node01"}).values()), ok(result)
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
    assert result.returncode == 0, ok(result)
    assert conf.read_text() == "ClusterName=x\nProlog=/etc/slurm/site-prolog.sh\n"
    hooks = prefixes["node01"] / "etc" / "slurm"
    printed = result.stdout.split("slurm.conf lines to add")[1].split("PLAY RECAP")[0]
    for line in (f"HealthCheckProgram={hooks}/healthd-healthcheck", f"Prolog={hooks}/prolog.d/*",
                 f"Epilog={hooks}/epilog.d/*"):
        assert f'"{line}"' in printed, printed
    assert "It already sets Prolog=/etc/slurm/site-prolog.sh" in printed, printed
    assert "changed: [head]" not in result.stdout.split("TASK [slurm_hooks : Reconfigure Slurm")[1]
    assert os.readlink(hooks / "prolog.d" / "healthd-prolog") == str(hooks / "healthd-hook")
