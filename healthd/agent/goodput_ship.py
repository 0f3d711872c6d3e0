"""Ships the goodput logs this node writes (`<state_dir>/goodput/<job>.jsonl`: rank 0's events, the
epilog's run ends) to the controller, which gathers each job's parts on the head node
(healthd.controller.goodput_gather).

On its own thread, woken after each tick: for every log longer than what the controller has, the
next whole lines (at most MAX_SHIPMENT_BYTES of healthd.goodput_events, the shipment's format) go to
`POST /v1/goodput`, signed by munged like a report, from the byte offset the controller last
acknowledged. That offset is kept in
`<job>.shipped`, so a restart sends nothing twice and a lost answer only repeats lines the
controller skips. The controller answers how far its copy reaches; a copy that is behind (the head
node's disk was restored from a backup) is sent again from there. Failures back off exponentially
(up to `controller.backoff_max_s`) and the lines stay on the node; a log the controller refuses as
malformed (400) is left until it grows again, with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from healthd import envelope
from healthd.agent.goodput_log import SHIPPED_SUFFIX
from healthd.inband_layout import valid_job
from healthd.client import Poster, one_line, refusal_reason, urllib_post
from healthd.lograte import WarnOnce
from healthd.persist import write_json_atomic
from healthd import goodput_events as ev
from healthd.settings import ControllerClientSettings

log = logging.getLogger("healthd")

MAX_SHIPPED_BYTES = 64
MAX_SHIPMENTS_PER_PASS = 64
"""Shipments of one log in one pass (32 MiB); the rest goes at the next tick."""


class GoodputShipper:
    """See the module doc. `post` and `sign` are seams for tests."""

    def __init__(self, settings: ControllerClientSettings, node: str, state_dir: str, *,
                 post: Poster = urllib_post, sign: Callable[..., bytes] | None = None,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random,
                 start: bool = True):
        if not settings.url:
            raise ValueError("GoodputShipper needs controller.url")
        self.settings = settings
        self.node = node
        self.directory = os.path.join(state_dir, ev.LOG_DIR)
        self.url = settings.url.rstrip("/") + ev.SHIPMENT_PATH
        self.post = post
        self.sign = sign
        self.clock = clock
        self.rand = rand
        self.counters = {"shipments": 0, "bytes": 0, "refused": 0, "unreachable": 0}
        self._shipped: dict[str, int] = {}
        """job -> the shipped offset, once read from its file (or written)."""
        self._refused_at: dict[str, int] = {}
        """job -> the size of its log when the controller refused it as malformed."""
        self._failures = 0
        self._next_try = 0.0
        self._warn = WarnOnce(log)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthd-goodput-ship", daemon=True)
        if start:
            self._thread.start()

    def nudge(self) -> None:
        """Look for new lines now (the agent calls this after each tick)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.settings.timeout_s + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(30.0)
            self._wake.clear()
            if self._stop.is_set() or self.clock() < self._next_try:
                continue
            try:
                ok = self.ship_once()
            except Exception:  # a bug here must not end shipping for the agent's lifetime
                log.exception("goodput log shipping failed unexpectedly")
                ok = False
            if ok:
                self._failures = 0
                self._next_try = 0.0
            else:
                self._failures += 1
                delay = min(self.settings.backoff_max_s, 2.0 ** min(self._failures - 1, 30))
                self._next_try = self.clock() + delay * (0.5 + 0.5 * self.rand())

    def ship_once(self) -> bool:
        """Send what the controller lacks of every log, a shipment at a time; False when the
        controller could not be reached or did not take one (the rest waits for the backoff)."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(ev.LOG_SUFFIX))
        except FileNotFoundError:
            return True
        except OSError as exc:
            self._warn(f"goodput logs in {self.directory} not listed: {one_line(exc)}")
            return True
        jobs = [n.removesuffix(ev.LOG_SUFFIX) for n in names]
        for gone in set(self._shipped) - set(jobs):  # deleted by the agent's pruning
            del self._shipped[gone]
            self._refused_at.pop(gone, None)
        for job in jobs:
            if not valid_job(job):
                continue
            for _ in range(MAX_SHIPMENTS_PER_PASS):
                sent = self._ship(job)
                if sent is None:
                    return False
                if not sent:
                    break
        return True

    def _ship(self, job: str) -> bool | None:
        """One shipment of `job`'s log: True when one was taken and more may follow, False when there
        is nothing (more) to send, None when the controller did not take it."""
        path = os.path.join(self.directory, job + ev.LOG_SUFFIX)
        shipped = self.shipped(job)
        try:
            size = os.lstat(path).st_size  # one call for a log with nothing new: the usual case
        except OSError:
            return False
        if size <= shipped or self._refused_at.get(job) == size:
            return False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, min(ev.MAX_SHIPMENT_BYTES, size - shipped), shipped)
        finally:
            os.close(fd)
        cut = raw.rfind(b"\n") + 1
        if cut == 0:
            if len(raw) >= ev.MAX_SHIPMENT_BYTES:
                self._refused(job, size, "a line longer than a shipment")
            return False  # the rest of a line still being written
        try:
            data = raw[:cut].decode("utf-8")
        except UnicodeDecodeError:
            self._refused(job, size, "not UTF-8")
            return False
        answer = self._post(ev.shipment(job, shipped, data))
        if answer is None:
            return None
        status, doc = answer
        if status == 400:
            self._refused(job, size, str(doc.get("error", ""))[:200])
            return False
        if status != 200:
            return None
        through = doc.get("through")
        if not isinstance(through, int) or isinstance(through, bool) or through < 0:
            self._warn(f"controller {self.settings.url} answered a goodput shipment without an offset")
            return None
        self.counters["shipments"] += 1
        self.counters["bytes"] += max(0, through - shipped)
        self._save(job, min(through, size))
        return through != shipped and through < size

    def _post(self, doc: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        try:
            body = (self.sign(doc, self.node, self.settings.munge_socket) if self.sign is not None
                    else envelope.sign_report(doc, self.node, self.settings.munge_socket))
        except Exception as exc:  # munged down
            self._warn(f"goodput shipment not signed: {type(exc).__name__}: {one_line(exc)}")
            return None
        try:
            status, data = self.post(self.url, body, self.settings.timeout_s)
        except OSError as exc:
            self.counters["unreachable"] += 1
            self._warn(f"controller {self.settings.url} unreachable for goodput logs: {one_line(exc)}")
            return None
        if status != 200:
            self.counters["refused"] += 1
            self._warn(f"controller {self.settings.url} refused a goodput shipment: HTTP {status}: "
                       f"{refusal_reason(status, data)}")
        try:
            answer = json.loads(data.decode("utf-8"))
        except ValueError:
            answer = {}
        return status, answer if isinstance(answer, dict) else {}

    def _refused(self, job: str, size: int, why: str) -> None:
        self._refused_at[job] = size
        log.warning("goodput log of job %s not shipped (%s); left until it grows", job, one_line(why))

    def shipped(self, job: str) -> int:
        """How far into the job's log the controller has it (0 when unknown)."""
        if job in self._shipped:
            return self._shipped[job]
        self._shipped[job] = offset = self._read_shipped(job)
        return offset

    def _read_shipped(self, job: str) -> int:
        try:
            fd = os.open(self._shipped_path(job), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            text = os.read(fd, MAX_SHIPPED_BYTES).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return int(text) if text.isdigit() else 0

    def _shipped_path(self, job: str) -> str:
        return os.path.join(self.directory, job + SHIPPED_SUFFIX)

    def _save(self, job: str, through: int) -> None:
        self._shipped[job] = through
        path = self._shipped_path(job)
        try:
            write_json_atomic(path, through, mode=0o640)
        except OSError as exc:
            self._warn(f"goodput shipped offset {path} not written: {one_line(exc)}")
