"""Fixtures for the systemd tests: a notify socket the test owns, and (re-exported) the real local
Slurm cluster and munged fleet of tests/controller/conftest.py for the controller's run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.controller.conftest import cluster, fleet  # noqa: F401  (fixtures, used by name)
from tests.systemd.support import NotifyListener


@pytest.fixture
def listener():
    """A bound AF_UNIX datagram socket under /tmp (a short path: sun_path holds 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="healthd-notify-", dir="/tmp"))
    lst = NotifyListener(str(d / "notify.sock"))
    try:
        yield lst
    finally:
        lst.close()
        shutil.rmtree(d, ignore_errors=True)
