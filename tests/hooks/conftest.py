"""Fixtures shared by the hooks' tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def decoy(tmp_path: Path) -> Path:
    """Where a planted link points: a real, root-owned directory that must stay exactly as it is."""
    d = tmp_path / "decoy"
    d.mkdir(mode=0o755)
    (d / "keep.txt").write_text("untouched\n")
    return d
