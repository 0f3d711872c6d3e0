"""A scratch directory other users and daemons can reach: under /tmp with mode 0755 (pytest's own
tmp_path lies below a 0700 parent, which munged, slurmctld and a child that became `nobody` cannot
traverse) and with a short path (a unix socket's sun_path holds 107 bytes); always removed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def shared_tmpdir(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
