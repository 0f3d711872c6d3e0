"""The per-job in-band directory: `<run_dir>/inband/<job>`, where a job's ranks write their rings
(healthd_inband; docs/inband.md). Its names are healthd.inband_layout's, which the TaskProlog and the
agent read too; this module makes, checks and moves the directories.

- The prolog (root) `create`s it for the job's user: `<run_dir>/inband` is root's, 0755 and trusted
  (healthd.trusted), so nobody else can create, swap or remove an entry in it; the job's directory
  is the job user's, mode 0700.
- The TaskProlog (as the job's user, healthd.hooks.taskprolog) exports it as HEALTHD_INBAND_DIR
  when it is a directory of that user's.
- The epilog (root) `archive`s it into `<run_dir>/inband/done/<job>`: done/ is root's and 0700, so
  the user can no longer reach their rings by path once the job has ended, while the agent still
  can; the oldest beyond `keep` are removed.

Every step works on directory descriptors opened without following a link, so a link planted at any
level (inband, the job's directory, anything the user left inside it) is refused or removed, never
followed. Standard library only: the prolog and epilog import this.
"""

from __future__ import annotations

import errno
import os
import stat

from healthd.inband_layout import DONE_DIR, INBAND_DIR, valid_job
from healthd.trusted import TRUSTED_UID, TrustedDir, Untrusted, check, describe

JOB_MODE = 0o700
DONE_MODE = 0o700

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _job_name(job: str) -> str:
    if not valid_job(job):
        raise ValueError(f"not a job id: {job!r}")
    return job


def _open_dir(name: str, dir_fd: int, path: str) -> int:
    """`name` in `dir_fd` opened as a directory without following a link; Untrusted for a link or a
    non-directory, saying which."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except OSError:
            raise e from None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=dir_fd)
            except OSError:
                target = "?"
            raise Untrusted(f"{path} is a symbolic link (to {target!r}, {describe(st)}): not followed") from None
        raise Untrusted(f"{path} is not a directory ({describe(st)})") from None


def create(run_dir: str, job: str, uid: int, gid: int = -1, *, trusted_uid: int = TRUSTED_UID) -> str:
    """Make `<run_dir>/inband/<job>` the job user's directory, mode 0700 (and `<run_dir>/inband`
    root's, 0755, if missing). gid -1 leaves the group root's: at 0700 the group grants nothing.
    An existing directory of that user's (or one this function made and had not yet handed over) is
    reused: Slurm runs the prolog again for a requeued job. A link, a non-directory or a directory
    of another user's is refused (Untrusted). Returns a line for the log."""
    name = _job_name(job)
    if not isinstance(uid, int) or uid < 0:
        raise ValueError(f"not a uid: {uid!r}")
    with TrustedDir(run_dir, INBAND_DIR, create=True, trusted_uid=trusted_uid) as inband:
        path = inband.join(name)
        made = True
        try:
            os.mkdir(name, JOB_MODE, dir_fd=inband.fd)
        except FileExistsError:
            made = False
        fd = _open_dir(name, inband.fd, path)
        try:
            st = os.fstat(fd)
            if st.st_uid not in (uid, trusted_uid):
                raise Untrusted(f"{path} already exists and is not the job user's (uid {uid}): {describe(st)}; "
                                "not reused")
            os.fchown(fd, uid, gid)
            os.fchmod(fd, JOB_MODE)  # after the chown, which may clear mode bits
        finally:
            os.close(fd)
    return f"{'created' if made else 'reused'} {path} (uid {uid}, mode 0700)"


def _open_done(inband: TrustedDir) -> int:
    """inband/done, root's and 0700 (made so, or made so again), opened without following a link."""
    path = inband.join(DONE_DIR)
    try:
        os.mkdir(DONE_DIR, DONE_MODE, dir_fd=inband.fd)
    except FileExistsError:
        pass
    fd = _open_dir(DONE_DIR, inband.fd, path)
    try:
        st = os.fstat(fd)
        check(st, path, "directory", inband.trusted_uid)
        if stat.S_IMODE(st.st_mode) != DONE_MODE:
            os.fchmod(fd, DONE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_entry(name: str, dir_fd: int) -> None:
    """Remove `name` from `dir_fd`, a whole tree when it is a directory, never following a link in
    it: the walk goes by descriptors, every directory is opened with O_NOFOLLOW and checked against
    the entry it listed (a link found inside is unlinked, its target untouched). What shutil.rmtree
    does with a dir_fd, without importing shutil (re, fnmatch, bz2, lzma: ~5-10 ms of the epilog
    that prunes inband/done)."""
    st = os.lstat(name, dir_fd=dir_fd)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    _remove_tree(name, dir_fd, st)


def _remove_tree(name: str, dir_fd: int, listed: os.stat_result) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
            raise OSError(errno.EBUSY, "replaced while it was being removed; not following it", name)
        with os.scandir(fd) as entries:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for child, is_dir in children:
            if is_dir:
                _remove_tree(child, fd, os.lstat(child, dir_fd=fd))
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def archive(run_dir: str, job: str, keep: int, *, trusted_uid: int = TRUSTED_UID) -> str:
    """Move `<run_dir>/inband/<job>` to `<run_dir>/inband/done/<job>` (replacing the one an earlier
    run of a requeued job left there), then remove the oldest entries of done/ beyond `keep`.
    Whatever is at inband/<job> moves, a link included (moved, not followed). FileNotFoundError when
    there is nothing to archive; returns a line for the log."""
    name = _job_name(job)
    with TrustedDir(run_dir, INBAND_DIR, trusted_uid=trusted_uid) as inband:
        path = inband.join(name)
        try:
            st = os.lstat(name, dir_fd=inband.fd)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no in-band directory", path) from None
        done = _open_done(inband)
        try:
            target = os.path.join(inband.path, DONE_DIR, name)
            replaced = ""
            try:
                remove_entry(name, done)
                replaced = ", replacing an earlier run's"
            except FileNotFoundError:
                pass
            os.rename(name, name, src_dir_fd=inband.fd, dst_dir_fd=done)
            what = "" if stat.S_ISDIR(st.st_mode) else f" ({_kind(st)}, not followed)"
            text = f"moved {path}{what} to {target}{replaced}"
            removed, failed = prune(done, keep)
            if removed:
                text += f"; removed {removed} older"
            if failed:
                text += f"; could not remove done/{failed}"
            return text
        finally:
            os.close(done)


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    return "not a directory"


def prune(done_fd: int, keep: int) -> tuple[int, str]:
    """Remove the entries of done/ beyond the newest `keep` (by ctime: the rename into done/ sets it).
    Returns (how many were removed, the first failure's text or '')."""
    keep = max(0, int(keep))
    names = [n for n in os.listdir(done_fd) if valid_job(n)]
    if len(names) <= keep:
        return 0, ""
    aged = []
    for n in names:
        try:
            st = os.lstat(n, dir_fd=done_fd)
        except OSError:
            continue
        aged.append((st.st_ctime_ns, int(n), n))
    aged.sort()
    removed, failed = 0, ""
    for _, _, n in aged[: max(0, len(aged) - keep)]:
        try:
            remove_entry(n, done_fd)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            failed = failed or f"{n}: {e.strerror or e}"
    return removed, failed
