"""Fixtures for the NVML collector tests: the fake libnvidia-ml.so.1, built once per session.

In-process tests load the fake by SONAME before pynvml's first nvmlInit, so pynvml's own
`CDLL("libnvidia-ml.so.1")` resolves to it; a process keeps that library for its lifetime, so
tests that need another library (none at all, a symbol missing) run the collector in a subprocess.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pynvml
import pytest

from healthd.agent.collectors.nvml import NvmlCollector
from tests.support.fake_nvml import LIBRARY_NAME

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="session")
def fake_nvml_loaded(fake_nvml_dir: Path) -> ctypes.CDLL:
    """The fake, loaded into this process under the SONAME pynvml asks for."""
    lib = ctypes.CDLL(str(fake_nvml_dir / LIBRARY_NAME))
    by_name = ctypes.CDLL(LIBRARY_NAME)  # what pynvml's own load resolves to
    if not hasattr(by_name, "fake_nvml_init_calls") or (
        pynvml.nvmlLib is not None and not hasattr(pynvml.nvmlLib, "fake_nvml_init_calls")
    ):
        pytest.fail("a real libnvidia-ml.so.1 was loaded in this process before the fake")
    return lib


@pytest.fixture
def nvml_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_nvml_loaded) -> Path:
    """Path of this test's fake config; the C library sees the variable through putenv."""
    path = tmp_path / "nvml.conf"
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(path))
    return path


@pytest.fixture
def make_collector(nvml_config: Path) -> Iterator:
    """Factory for collectors that are closed (nvmlShutdown) after the test."""
    made: list[NvmlCollector] = []

    def make(timeout_s: float = 5.0, expected_gpus: int | None = None, **kw: Any) -> NvmlCollector:
        collector = NvmlCollector(timeout_s=timeout_s, expected_gpus=expected_gpus, **kw)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


# Runs the collector once in a fresh interpreter and prints the sample as JSON.
_CHILD = """
import dataclasses, json, sys
from healthd.agent.collectors.nvml import NvmlCollector, nvml_available
if sys.argv[1] == "require-no-library" and nvml_available():
    print(json.dumps({"skip": "a real libnvidia-ml.so.1 is installed on this machine"}))
    raise SystemExit(0)
collector = NvmlCollector(timeout_s=float(sys.argv[2]))
sample = collector.collect(0.0)
collector.close()
print(json.dumps(dataclasses.asdict(sample)))
"""


def run_collector_subprocess(
    env: dict, mode: str = "plain", timeout_s: float = 10.0
) -> dict:
    """Collect once in a subprocess with `env`; the sample as a dict (asdict form)."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(timeout_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


@pytest.fixture
def collect_in_subprocess():
    return run_collector_subprocess

