"""The playbook tests' module fixtures: a work directory, ansible's environment, the wheels the role installs,
the tree's systemd units and a real one-node Slurm cluster.

The wheels are built once per module: healthd 0.1.0 from this tree with its dependencies and its `journal`
extra (a wheelhouse the role installs from with --no-index), and a 0.1.1 built from a copy with only the
version changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.ansible.playbook_support import BASE_VERSION, NEXT_VERSION, REPO, UNITS, VENV_BIN
from tests.support.slurm_cluster import SlurmCluster, ensure_installed
from tests.support.tmpdirs import shared_tmpdir


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

