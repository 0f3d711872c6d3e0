"""Atomic files and the boot id: the verdict the hooks read, the agent's memory across restarts, the
controller's and the hooks' small documents. Standard library only."""

from __future__ import annotations

import os
import time

from healthd import fastjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _log_error(msg: str, *args: Any) -> None:
    import logging  # lazy: the hooks import this module for write_at and never log through it

    logging.getLogger(__name__).error(msg, *args)


BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: str | os.PathLike[str] = BOOT_ID_PATH) -> str | None:
    """This boot's id as the kernel prints it (with dashes); None when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """The one atomic write: a temporary file created in the directory `dir_fd` (O_EXCL|O_NOFOLLOW),
    written, given `mode`, fsynced, renamed over `name`, and the directory fsynced so the rename
    survives a crash. A reader sees the old file or the new one, never half of one."""
    tmp = f".{name}.{os.getpid()}.{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.fsync(dir_fd)


def json_bytes(doc: Any) -> bytes:
    """A document as healthd writes it: compact JSON, one trailing newline."""
    return (fastjson.dumps_compact(doc) + "\n").encode()


def write_json_atomic(path: str | os.PathLike[str], doc: Any, mode: int = 0o644) -> None:
    """`doc` at `path` through write_at, creating the directories."""
    directory, name = os.path.split(os.fspath(path))
    directory = directory or "."
    os.makedirs(directory, exist_ok=True)
    data = json_bytes(doc)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_at(dir_fd, name, data, mode)
    finally:
        os.close(dir_fd)


def read_json_or_quarantine(path: str | os.PathLike[str], *, readonly: bool = False) -> dict[str, Any] | None:
    """Read a JSON object; None if absent. A corrupt file is renamed aside (never deleted: it may be
    the only record of something) and reported once, and the caller starts fresh. `readonly`
    (dry-run) reports it and leaves it where it is."""
    target = os.fspath(path)
    try:
        with open(target, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _log_error("cannot read %s: %s; starting without it", target, e)
        return None
    try:
        doc = fastjson.loads(data.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError(f"top level is {type(doc).__name__}, not an object")
        return doc
    except (ValueError, UnicodeDecodeError) as e:
        aside = f"{target}.corrupt-{int(time.time())}"
        if readonly:
            _log_error("%s is corrupt (%s); ignoring it (dry run: left in place)", target, e)
            return None
        try:
            os.replace(target, aside)
            where = f"moved to {aside}"
        except OSError:
            where = "left in place (read-only?)"
        _log_error("%s is corrupt (%s); %s; starting fresh", target, e, where)
        return None
