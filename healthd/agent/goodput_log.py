"""The in-band part of a job's goodput event log (healthd.goodput), written by the agent of the node
that runs the job's rank 0, from that rank's ring: a run's start (a new process of rank 0, by the
ring's pid and start), step marks (a window's first step, and the first step of a run), the blocking
part of saves, durable checkpoints and restores. The epilog adds the run's end to the same file.

One file per job, `<state_dir>/goodput/<job>.jsonl`, appended once per tick with one write. What was
written is remembered in `<job>.cursor` (the ring's identity and the last sequence number), so an
agent restart does not write it again; a crash between the two writes repeats a few lines at most,
which the reader drops as exact repeats.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from healthd.agent.inband import CKPT_BEGIN, CKPT_END, DURABLE, RESTORED, STEP, RingHeader, RingRecord
from healthd import goodput_events as ev
from healthd.lograte import WarnOnce
from healthd.persist import write_json_atomic
from healthd.text import clean

log = logging.getLogger("healthd")

MAX_CURSOR_BYTES = 256
CURSOR_SUFFIX = ".cursor"
"""`<job>.cursor` beside the job's log: how far into rank 0's ring the log reaches."""
SHIPPED_SUFFIX = ".shipped"
"""`<job>.shipped` beside the job's log: how far the controller's copy reaches (healthd.agent.goodput_ship)."""


def entries(header: RingHeader, records: Iterable[RingRecord], window_steps: int, *,
            new_run: bool, first_step: bool) -> tuple[list[dict[str, Any]], bool]:
    """Log entries for rank 0's new `records` (pure). `new_run`: the ring is a new process of rank 0
    (a job_start_time and its allocation first); `first_step`: no step of this run was marked yet.
    Returns the entries and whether the run's first step is still to come."""
    out: list[dict[str, Any]] = []
    if new_run:
        start = header.start_wall_ns / 1e9
        out.append(ev.job_start(start))
        if header.world_size > 0:
            # one rank per GPU: what a data-parallel job holds
            out.append(ev.event("allocation", start, gpus=header.world_size))
    for r in records:
        wall = r.wall_ns / 1e9
        if r.kind == STEP:
            if first_step or (window_steps > 0 and r.step % window_steps == 0):
                out.append(ev.step_mark(r.step, (r.wall_ns - r.dur_ns) / 1e9))
                first_step = False
        elif r.kind == CKPT_BEGIN:
            out.append(ev.checkpoint_start(wall))
        elif r.kind == CKPT_END:
            out.append(ev.checkpoint_end(wall))
        elif r.kind == DURABLE:
            out.append(ev.event("durable", wall, step=r.step))
        elif r.kind == RESTORED:
            out.append(ev.event("restored", wall, step=r.step))
            first_step = True  # the first step after a restore ends the restart
    return out, first_step


@dataclass
class _Cursor:
    identity: tuple[int, int]
    seq: int
    first_step: bool


PRUNE_EVERY_S = 3600.0


@dataclass
class GoodputLog:
    """Appends rank 0's events of each job on this node to the job's log (I/O at the edge)."""

    state_dir: str
    window_steps: int
    keep_days: float = 30.0
    """Logs not written for this long are deleted (prune)."""
    _pruned_at: float | None = None
    _cursors: dict[str, _Cursor] = field(default_factory=dict)
    _pending: dict[str, list[str]] = field(default_factory=dict)
    _warn: WarnOnce = field(default_factory=lambda: WarnOnce(log))

    @property
    def directory(self) -> str:
        return os.path.join(self.state_dir, ev.LOG_DIR)

    def take(self, job: str, header: RingHeader, records: Iterable[RingRecord]) -> None:
        """Rank 0's records read this tick (all of them after a new ring; the new ones otherwise)."""
        identity = (header.pid, header.start_mono_ns)
        cursor = self._cursors.get(job) or self._load(job)
        new_run = cursor is None or cursor.identity != identity
        if new_run:
            cursor = _Cursor(identity, 0, True)
        fresh = [r for r in records if r.seq > cursor.seq]  # type: ignore[union-attr]
        if not fresh and not new_run:
            return
        got, first = entries(header, fresh, self.window_steps, new_run=new_run, first_step=cursor.first_step)  # type: ignore[union-attr]
        self._cursors[job] = _Cursor(identity, max([cursor.seq, *(r.seq for r in fresh)]), first)  # type: ignore[union-attr]
        if got:
            self._pending.setdefault(job, []).extend(ev.log_line(job, **e) for e in got)

    def flush(self) -> None:
        """Append what this tick found, one write per job, then remember how far it got."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
        except OSError as e:
            self._warn(f"goodput log directory {self.directory} not made: {clean(e, 200)}")
            return
        for job, lines in pending.items():
            path = os.path.join(self.directory, job + ev.LOG_SUFFIX)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
                try:
                    os.write(fd, ("\n".join(lines) + "\n").encode())
                finally:
                    os.close(fd)
                self._save(job)
            except OSError as e:
                self._warn(f"goodput log {path} not written: {clean(e, 200)}")

    def prune(self, now: float, running: Iterable[str] = ()) -> list[str]:
        """Delete the logs, cursors and shipped offsets not written for `keep_days` (a job in `running` keeps its
        own), at most once per PRUNE_EVERY_S. Returns the files deleted."""
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return []
        self._pruned_at = now
        suffixes = (ev.LOG_SUFFIX, CURSOR_SUFFIX, SHIPPED_SUFFIX)
        keep = {job + suffix for job in running for suffix in suffixes}
        gone = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as e:
            self._warn(f"goodput log directory {self.directory} not listed: {clean(e, 200)}")
            return []
        for name in names:
            if name in keep or not name.endswith(suffixes):
                continue
            path = os.path.join(self.directory, name)
            try:
                st = os.lstat(path)
                if now - st.st_mtime > self.keep_days * 86400:
                    os.unlink(path)
                    gone.append(name)
            except OSError:
                continue
        if gone:
            log.info("goodput logs older than %g days deleted: %d file(s)", self.keep_days, len(gone))
        return gone

    def forget(self, jobs: Iterable[str]) -> None:
        """Jobs no longer on this node: their cursors leave memory (the files stay)."""
        for job in list(jobs):
            self._cursors.pop(job, None)

    def known(self) -> Mapping[str, _Cursor]:
        return self._cursors

    def _cursor_path(self, job: str) -> str:
        return os.path.join(self.directory, job + CURSOR_SUFFIX)

    def _load(self, job: str) -> _Cursor | None:
        try:
            fd = os.open(self._cursor_path(job), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                raw = os.read(fd, MAX_CURSOR_BYTES)
            finally:
                os.close(fd)
            doc = json.loads(raw)
            identity = (int(doc["pid"]), int(doc["start_mono_ns"]))
            return _Cursor(identity, int(doc["seq"]), bool(doc["first_step"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._warn(f"goodput cursor {self._cursor_path(job)} unusable ({clean(e, 120)}); the ring is logged "
                       "from its start again")
            return None

    def _save(self, job: str) -> None:
        c = self._cursors.get(job)
        if c is None:
            return
        path = self._cursor_path(job)
        doc = {"pid": c.identity[0], "start_mono_ns": c.identity[1], "seq": c.seq, "first_step": c.first_step}
        try:
            write_json_atomic(path, doc, mode=0o640)
        except OSError as e:
            self._warn(f"goodput cursor {path} not written: {clean(e, 200)}")
