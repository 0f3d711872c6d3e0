"""Fixtures for the systemd tests: a notify socket the test owns, and (re-exported) the real local
Slurm cluster and munged fleet of tests/controller/conftest.py for the controller's run."""

from __future__ import annotations

import pytest

from tests.controller.conftest import cluster, fleet  # noqa: F401  (fixtures, used by name)
from tests.support.sdnotify import NotifyListener
from tests.support.tmpdirs import shared_tmpdir


@pytest.fixture
def listener():
    """A bound AF_UNIX datagram socket under /tmp (a short path: sun_path holds 107 bytes)."""
    with shared_tmpdir("healthd-notify-") as d:
        lst = NotifyListener(str(d / "notify.sock"))
        try:
            yield lst
        finally:
            lst.close()
