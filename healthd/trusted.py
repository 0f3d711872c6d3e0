"""The files the hooks and the agent share, reached so that nobody but root can plant or redirect one.

A file is **trusted** only when it and its directory are owned by the trusted uid (root, 0) and
writable by neither group nor others; anything else is refused with an `Untrusted` error that names
the path, the owner and the mode. Every directory below a root (the run directory, the state file's
directory) is opened by itself, without following a link (`O_DIRECTORY|O_NOFOLLOW` relative to its
parent's descriptor), and every check is made on the open descriptor (fstat), never by a separate
stat of a path that could change in between. Files are created, renamed and removed relative to
their directory's descriptor, so a link planted at any level under the root (`jobs -> /etc`) makes
the operation fail instead of writing elsewhere. Above the root, the path is the configuration's
(root's own directories, such as `/run`).

Standard library only: the prolog imports this on the job-launch path.
"""

from __future__ import annotations

import errno
import os
import stat

from healthd import fastjson, persist

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

TRUSTED_UID = 0
"""The owner the hooks and the agent trust: root. A parameter everywhere, for tests only."""
SMALL_MAX_BYTES = 64 << 10
"""Bindings, requests and the checks file are small; anything larger is ignored."""
UNTRUSTED_BITS = stat.S_IWGRP | stat.S_IWOTH
DIR_MODE = 0o755

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


class TooLarge(OSError):
    pass


class Untrusted(OSError):
    """A file or directory that root does not own, that group or others may write, that is a link,
    or that is not the kind of file expected. Its text names the path, the owner and the mode."""


def describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):04o})"


def check(st: os.stat_result, path: str, what: str, trusted_uid: int = TRUSTED_UID) -> None:
    """Untrusted unless owned by `trusted_uid` and writable by neither group nor others."""
    if st.st_uid != trusted_uid or st.st_mode & UNTRUSTED_BITS:
        raise Untrusted(f"{what} {path} is not trusted ({describe(st)}): healthd trusts only what uid "
                        f"{trusted_uid} owns and neither group nor others can write")


def _refused_link(name: str, dir_fd: int | None, path: str, what: str, e: OSError) -> OSError:
    """Why opening `name` without following links failed: a clear Untrusted for a link or a
    non-directory, the original error otherwise. The lstat here only words the message."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return e
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return Untrusted(f"{what} {path} is a symbolic link (to {target!r}, {describe(st)}): not followed")
    if what == "directory" and not stat.S_ISDIR(st.st_mode):
        return Untrusted(f"{path} is not a directory ({describe(st)})")
    if what == "file" and not stat.S_ISREG(st.st_mode):
        return Untrusted(f"{path} is not a regular file ({describe(st)})")
    return e


def _open_dir_at(name: str, dir_fd: int | None, path: str, trusted_uid: int) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise _refused_link(name, dir_fd, path, "directory", e) from None
        raise
    try:
        check(os.fstat(fd), path, "directory", trusted_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p and p != "."]
    if any(p == ".." for p in parts):
        raise ValueError(f"{rel!r} leaves its directory")
    return parts


class TrustedDir:
    """An open, trusted directory `root`/`rel`: `root`'s last component and every component of `rel`
    opened without following a link and checked trusted. `create` makes the missing ones (0755).
    A context manager; the methods take plain file names inside this directory."""

    def __init__(self, root: str, rel: str = "", *, create: bool = False, trusted_uid: int = TRUSTED_UID):
        self.trusted_uid = trusted_uid
        root = os.path.normpath(root)  # a trailing slash would make the kernel follow a link at the root
        self.path = root
        try:
            fd = _open_dir_at(root, None, root, trusted_uid)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(root, DIR_MODE, exist_ok=True)  # above and at the root: the configuration's path
            fd = _open_dir_at(root, None, root, trusted_uid)
        try:
            for part in _parts(rel):
                self.path = os.path.join(self.path, part)
                if create:
                    try:
                        os.mkdir(part, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass
                sub = _open_dir_at(part, fd, self.path, trusted_uid)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "TrustedDir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ------------------------------------------------------------------ reading

    def open_file(self, name: str) -> tuple[int, os.stat_result]:
        """(fd, fstat) of a trusted regular file. Opened non-blocking, so a FIFO cannot hang the
        caller; a link is refused, never followed."""
        return self._open_checked(name, _READ_FLAGS, 0, (errno.ELOOP,))

    def _open_checked(self, name: str, flags: int, mode: int,
                      refused: tuple[int, ...]) -> tuple[int, os.stat_result]:
        """Open `name` in this directory with `flags` (which hold O_NOFOLLOW); an errno in `refused`
        means a link (or a FIFO without a reader) was there. The open file must be a trusted regular
        file, checked on its descriptor."""
        path = self.join(name)
        try:
            fd = os.open(name, flags, mode, dir_fd=self.fd)
        except OSError as e:
            if e.errno in refused:
                raise _refused_link(name, self.fd, path, "file", e) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Untrusted(f"{path} is not a regular file ({describe(st)})")
            check(st, path, "file", self.trusted_uid)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def read(self, name: str, limit: int) -> bytes:
        fd, st = self.open_file(name)
        try:
            return read_fd(fd, st, limit, self.join(name))
        finally:
            os.close(fd)

    def read_json(self, name: str, limit: int) -> dict[str, Any]:
        return json_object(self.read(name, limit))

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.lstat(name, dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        try:
            os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    # ------------------------------------------------------------------ writing

    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Atomic, inside this directory (healthd.persist.write_at): readers see the old file or the new."""
        persist.write_at(self.fd, name, data, mode)

    def write_json(self, name: str, doc: Any, mode: int = 0o644) -> None:
        self.write(name, persist.json_bytes(doc), mode)

    def append(self, name: str, data: bytes, mode: int = 0o640) -> None:
        """One O_APPEND write (concurrent writers never interleave lines) to a trusted regular file,
        created if missing; a link or a FIFO is refused, never followed or waited on."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        fd, _ = self._open_checked(name, flags, mode, (errno.ELOOP, errno.ENXIO))
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def unlink(self, name: str, missing_ok: bool = True) -> bool:
        """Remove `name` from this directory (a link is removed, not followed). True if removed."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if missing_ok:
                return False
            raise
        return True


# --------------------------------------------------------------------------- one-call forms


def split_path(path: str, root: str | None = None) -> tuple[str, str, str]:
    """(root, rel dir, name) for a file `path`: under `root` (the run directory) every directory
    between root and the file is walked without following links; elsewhere only the file's own
    directory is (its last component not a link)."""
    path = os.path.normpath(path)
    directory, name = os.path.split(path)
    if root is not None:
        root = os.path.normpath(root)
        if directory == root or directory.startswith(root.rstrip("/") + "/"):
            return root, os.path.relpath(directory, root), name
    return directory or ".", "", name


def read_file(path: str, limit: int, *, root: str | None = None, trusted_uid: int = TRUSTED_UID) -> bytes:
    top, rel, name = split_path(path, root)
    with TrustedDir(top, rel, trusted_uid=trusted_uid) as d:
        return d.read(name, limit)


def read_json(path: str, limit: int, *, root: str | None = None, trusted_uid: int = TRUSTED_UID) -> dict[str, Any]:
    """A small trusted JSON object. OSError (TooLarge, Untrusted) or ValueError with a reason."""
    return json_object(read_file(path, limit, root=root, trusted_uid=trusted_uid))


def write_json(path: str, doc: Any, mode: int = 0o644, *, root: str | None = None,
               trusted_uid: int = TRUSTED_UID) -> None:
    """Atomically write `doc` at `path`, creating the directories (trusted, 0755, no links followed)."""
    top, rel, name = split_path(path, root)
    with TrustedDir(top, rel, create=True, trusted_uid=trusted_uid) as d:
        d.write_json(name, doc, mode)


def unlink(path: str, *, root: str | None = None, trusted_uid: int = TRUSTED_UID) -> bool:
    top, rel, name = split_path(path, root)
    with TrustedDir(top, rel, trusted_uid=trusted_uid) as d:
        return d.unlink(name)


# --------------------------------------------------------------------------- plain reads


def read_fd(fd: int, st: os.stat_result, limit: int, path: str) -> bytes:
    if st.st_size > limit:
        raise TooLarge(f"{path} is {st.st_size} bytes (limit {limit})")
    data = os.read(fd, st.st_size + 1 if st.st_size else limit + 1)
    while len(data) <= limit:
        more = os.read(fd, limit + 1 - len(data))
        if not more:
            break
        data += more
    if len(data) > limit:
        raise TooLarge(f"{path} is larger than {limit} bytes")
    return data


def read_bounded(path: str, limit: int) -> bytes:
    """A regular file's bytes, at most `limit`, without any ownership check. Opened non-blocking, so
    a FIFO planted at the path cannot hang the caller; anything that is not a regular file is refused."""
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        return read_fd(fd, st, limit, path)
    finally:
        os.close(fd)


def json_object(data: bytes) -> dict[str, Any]:
    doc = fastjson.loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"top level is {type(doc).__name__}, not an object")
    return doc
