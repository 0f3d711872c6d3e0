"""Atomic JSON files: the verdict the hooks read and the agent's own memory across restarts."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_json_atomic(path: str | os.PathLike[str], doc: Any, mode: int = 0o644) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half of one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"), sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json_or_quarantine(path: str | os.PathLike[str], *, readonly: bool = False) -> dict[str, Any] | None:
    """Read a JSON object; None if absent. A corrupt file is renamed aside (never deleted: it may be
    the only record of something) and reported once, and the caller starts fresh. `readonly`
    (dry-run) reports it and leaves it where it is."""
    target = Path(path)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        log.error("cannot read %s: %s; starting without it", target, e)
        return None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(f"top level is {type(doc).__name__}, not an object")
        return doc
    except (ValueError, UnicodeDecodeError) as e:
        aside = target.with_name(f"{target.name}.corrupt-{int(time.time())}")
        if readonly:
            log.error("%s is corrupt (%s); ignoring it (dry run: left in place)", target, e)
            return None
        try:
            os.replace(target, aside)
            where = f"moved to {aside}"
        except OSError:
            where = "left in place (read-only?)"
        log.error("%s is corrupt (%s); %s; starting fresh", target, e, where)
        return None
