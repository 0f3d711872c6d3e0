"""Fixtures every part of the suite shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fake_nvml import build_fake_nvml


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C stand-in for libnvidia-ml.so.1, compiled once per run (the directory to put on
    LD_LIBRARY_PATH)."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))
