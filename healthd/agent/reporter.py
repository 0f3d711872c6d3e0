"""The agent's side of the controller transport: signed reports pushed over HTTP.

`Reporter.offer(doc)` is called by the agent after every publish. It never blocks on the network:
the POST to `<controller.url>/v1/report` runs on the reporter's own thread. A document is sent at
once when its verdict or its set of finding ids changed since the last delivered one, otherwise at
most every `controller.heartbeat_s`. Each attempt is signed afresh with the node's munged
(`healthd.envelope.sign_report`), so a retry never replays a credential. What is sent is
fitted to what the controller accepts (`healthd.report_schema.fit_report`): at most 256
findings, the strongest kept and the rest counted in `findings_dropped`, long text shortened; the
state file on the node keeps everything.

When the controller is unreachable or refuses a report, only the LATEST document is kept and the
reporter retries with exponential backoff and jitter, up to `controller.backoff_max_s`. The log gets
one line per change of state (reachable, unreachable, refusing), never one per retry.

Instructions on the response (`clear-finding`, healthd.agent.instructions) are recorded in
`last_instructions`, counted, logged and handed to `on_instruction` (the agent applies them on its
next tick, from its own thread).

The prolog's one-shot drain request (`/v1/request`) is healthd.client.request_drain.
"""

from __future__ import annotations

import atexit
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from healthd.client import (
    REPORT_PATH,
    Poster,
    one_line,
    refusal_reason,
    urllib_post,
)
from healthd import envelope, statedoc
from healthd.report_schema import fit_report
from healthd.settings import ControllerClientSettings

log = logging.getLogger("healthd")

KNOWN_INSTRUCTIONS = ("clear-finding",)


def change_key(doc: Mapping[str, Any]) -> tuple[Any, frozenset[str], tuple]:
    """What makes a report news: the verdict, the set of finding ids, and each in-band job's newest
    complete window and hang (the controller compares a job's ranks across nodes window by window)."""
    return doc.get("verdict"), statedoc.finding_ids(dict(doc)), _inband_key(doc.get("inband"))


def _inband_key(section: Any) -> tuple:
    if not isinstance(section, dict) or not isinstance(section.get("jobs"), list):
        return ()
    key = []
    for job in section["jobs"]:
        if not isinstance(job, dict):
            continue
        newest = max((w.get("window", -1) for r in job.get("ranks") or () if isinstance(r, dict)
                      for w in r.get("windows") or () if isinstance(w, dict) and isinstance(w.get("window"), int)),
                     default=-1)
        key.append((str(job.get("job")), newest, job.get("hang") is not None))
    return tuple(key)


class Reporter:
    """Pushes the agent's document to the controller from a background thread (see the module doc).

    `settings` is `Settings.controller`; `clock` (monotonic seconds) decides heartbeats and backoff;
    `post` and `sign` are seams for tests (default: urllib and envelope.sign_report through munged)."""

    def __init__(
        self,
        settings: ControllerClientSettings,
        node: str,
        clock: Callable[[], float] = time.monotonic,
        post: Poster = urllib_post,
        *,
        sign: Callable[..., bytes] | None = None,
        backoff_base_s: float = 1.0,
        rand: Callable[[], float] = random.random,
        start: bool = True,
        on_instruction: Callable[[dict[str, Any]], None] | None = None,
    ):
        if not settings.url:
            raise ValueError("Reporter needs controller.url")
        self.settings = settings
        self.node = node
        self.clock = clock
        self.post = post
        self.sign = sign
        self.url = settings.url.rstrip("/") + REPORT_PATH
        self.backoff_base_s = backoff_base_s
        self.rand = rand
        self.on_instruction = on_instruction
        """Called (on the reporter's thread) with each known instruction; must not block."""

        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._stop = False
        self._busy = False
        self._last_key: tuple[Any, frozenset[str]] | None = None
        self._last_sent_at: float | None = None
        self._next_try: float = 0.0
        self._failures = 0
        self._fit_note = ""

        self.state = "unknown"
        """unknown (nothing sent yet) | ok | unreachable | refused."""
        self.last_instructions: list[dict[str, Any]] = []
        """The instructions on the last accepted report's response."""
        self.counters: dict[str, int] = {
            "offered": 0,
            "sent": 0,
            "accepted": 0,
            "refused": 0,
            "unreachable": 0,
            "sign_errors": 0,
            "instructions": 0,
        }
        """For metrics: offers, HTTP attempts, accepted, refused (4xx/5xx), no answer, signing failures,
        instructions received."""
        self.last_success_at: float | None = None
        self.last_error: str | None = None

        self._thread = threading.Thread(target=self._run, name="healthd-reporter", daemon=True)
        if start:
            self._thread.start()
            atexit.register(self._atexit)

    # ------------------------------------------------------------------ the agent's side

    def offer(self, doc: Mapping[str, Any]) -> bool:
        """Hand over the agent's latest document. Returns at once; True when it is queued for sending
        (a change, a heartbeat due, or a retry waiting), False when it is not news yet."""
        key = change_key(doc)
        now = self.clock()
        with self._cond:
            self.counters["offered"] += 1
            retrying = self._pending is not None
            due = (
                retrying
                or key != self._last_key
                or self._last_sent_at is None
                or now - self._last_sent_at >= self.settings.heartbeat_s
            )
            if not due:
                return False
            self._pending = dict(doc)  # the latest only: an older undelivered document is dropped
            if not retrying:
                self._next_try = now
            self._cond.notify_all()
            return True

    def pending(self) -> bool:
        with self._cond:
            return self._pending is not None or self._busy

    def stop(self, flush_s: float = 0.0) -> None:
        """Stop the thread. With flush_s > 0, first give a document that is due now (not waiting out a
        backoff) up to flush_s seconds to be delivered."""
        atexit.unregister(self._atexit)
        end = time.monotonic() + flush_s
        with self._cond:
            while (
                flush_s > 0
                and (self._busy or (self._pending is not None and self._failures == 0))
                and time.monotonic() < end
                and self._thread.is_alive()
            ):
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.1, end - time.monotonic()) if flush_s > 0 else 1.0)

    def _atexit(self) -> None:  # `healthd run --once` exits right after its one publish
        self.stop(flush_s=self.settings.timeout_s)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    if self._pending is not None:
                        wait = self._next_try - self.clock()
                        if wait <= 0:
                            break
                        self._cond.wait(min(wait, 1.0))
                    else:
                        self._cond.wait(1.0)
                if self._stop:
                    return
                doc, self._pending = self._pending, None
                self._busy = True
            try:
                ok = self._attempt(doc)
            except Exception as e:  # a bug here must not end reporting for the agent's lifetime
                log.exception("controller report failed unexpectedly")
                self._failed("bug", f"{type(e).__name__}: {e}")
                ok = False
            with self._cond:
                self._busy = False
                now = self.clock()
                if ok:
                    self._failures = 0
                    self._last_key = change_key(doc)
                    self._last_sent_at = now
                else:
                    self._failures += 1
                    if self._pending is None:
                        self._pending = doc  # a newer offer during the attempt wins
                    self._next_try = now + self.backoff(self._failures)
                self._cond.notify_all()

    def backoff(self, failures: int) -> float:
        """Seconds before retry number `failures`: base * 2^(n-1), capped at backoff_max_s, with
        jitter (between half and all of it) so that a fleet does not retry in step."""
        cap = self.settings.backoff_max_s
        delay = min(cap, self.backoff_base_s * (2.0 ** min(failures - 1, 30)))
        return delay * (0.5 + 0.5 * self.rand())

    def _sign(self, doc: Mapping[str, Any]) -> bytes:
        if self.sign is not None:
            return self.sign(doc, self.node, self.settings.munge_socket)
        return envelope.sign_report(doc, self.node, self.settings.munge_socket)

    def _fit(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The document as the controller accepts it (report_schema.fit_report: at most MAX_FINDINGS,
        the strongest kept, `findings_dropped` counting the rest; long text shortened). The local
        state file keeps everything; one log line when what is left out changes."""
        try:
            fitted, note = fit_report(doc)
        except Exception:  # never lose the report over the trimming: the controller says why it refuses
            log.exception("cannot fit the report to the controller's limits")
            return doc
        if note != self._fit_note:
            if note:
                log.warning("report to the controller trimmed to its limits: %s", note)
            self._fit_note = note
        return fitted

    def _attempt(self, doc: dict[str, Any]) -> bool:
        try:
            body = self._sign(self._fit(doc))
        except Exception as e:  # munged down, a node name that is not a hostname, a doc json refuses
            self.counters["sign_errors"] += 1
            self._failed("unsigned", f"cannot sign the report: {type(e).__name__}: {one_line(e)}")
            return False
        self.counters["sent"] += 1
        try:
            status, data = self.post(self.url, body, self.settings.timeout_s)
        except OSError as e:
            self.counters["unreachable"] += 1
            self._failed("unreachable", f"controller {self.settings.url} unreachable: {one_line(e)}")
            return False
        if status != 200:
            self.counters["refused"] += 1
            self._failed("refused", f"controller {self.settings.url} refused the report: HTTP {status}: {refusal_reason(status, data)}")
            return False
        try:
            answer = json.loads(data.decode("utf-8"))
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("accepted") is not True:
            self.counters["refused"] += 1
            self._failed("refused", f"controller {self.settings.url} answered 200 without accepting: {one_line(data[:200])}")
            return False
        self.counters["accepted"] += 1
        self.last_success_at = time.time()
        self.last_error = None
        if self.state != "ok":
            if self.state == "unknown":
                log.info("controller %s reachable; reports accepted", self.settings.url)
            else:
                log.warning("controller %s reachable again; reports accepted", self.settings.url)
            self.state = "ok"
        self._instructions(answer.get("instructions"))
        return True

    def _failed(self, state: str, message: str) -> None:
        self.last_error = message
        if state != self.state:
            log.warning("%s; keeping the latest report and retrying with backoff (up to %gs)",
                        message, self.settings.backoff_max_s)
            self.state = state
        else:
            log.debug("%s (retry %d)", message, self._failures + 1)

    def _instructions(self, raw: Any) -> None:
        items = raw if isinstance(raw, list) else []
        self.last_instructions = [dict(i) for i in items if isinstance(i, dict)]
        for ins in self.last_instructions:
            self.counters["instructions"] += 1
            kind = ins.get("kind") or ins.get("type") or ins.get("action")
            if kind not in KNOWN_INSTRUCTIONS:
                log.warning("controller sent an unknown instruction %s; ignored", one_line(json.dumps(ins, default=str), 200))
                continue
            log.info("controller instruction %s: %s", kind, one_line(json.dumps(ins, default=str), 200))
            if self.on_instruction is not None:
                try:
                    self.on_instruction(ins)
                except Exception as e:  # a bad instruction must not stop the reporter
                    log.warning("controller instruction %s not applied: %s", kind, one_line(e))
