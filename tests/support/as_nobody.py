"""Run a piece of this test's code as `nobody`, for real: a forked child drops to uid/gid 65534 (no
supplementary groups) and runs it; its JSON answer comes back through a pipe. Forked, not exec'd:
`nobody` may not be able to run this venv's python. Needs root."""

from __future__ import annotations

import json
import os
import pwd
import signal
from collections.abc import Callable
from typing import Any

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a child as nobody needs root")


class AsNobody:
    """`work()` in a child that became `nobody`; `.answer` is what it returned (JSON-able). With
    `hold=True` the child stays alive after answering, keeping whatever `work` opened, until
    release(). A child that raised fails the test with its exception's repr."""

    def __init__(self, work: Callable[[], Any], *, hold: bool = False):
        nobody = pwd.getpwnam("nobody")
        out_r, out_w = os.pipe()
        hold_r, hold_w = os.pipe() if hold else (-1, -1)
        pid = os.fork()
        if pid == 0:  # child: the work, then os._exit; never back into pytest
            code = 0
            try:
                os.close(out_r)
                if hold:
                    os.close(hold_w)
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                answer = work()
                os.write(out_w, json.dumps({"answer": answer}).encode() + b"\n")
                if hold:
                    os.read(hold_r, 1)  # until the parent lets go (or dies)
            except BaseException as exc:  # noqa: BLE001 - whatever it was, the parent reports it
                os.write(out_w, json.dumps({"child-error": repr(exc)}).encode() + b"\n")
                code = 1
            finally:
                os._exit(code)
        os.close(out_w)
        if hold:
            os.close(hold_r)
        self.pid = pid
        self._hold: int | None = hold_w if hold else None
        self._reaped = False
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                chunk = os.read(out_r, 65536)
                if not chunk:
                    break
                buf += chunk
        except BaseException:  # interrupted (the test's time limit): the child goes too
            os.kill(pid, signal.SIGKILL)
            self.release()
            raise
        finally:
            os.close(out_r)
        got = json.loads(buf) if buf else {"child-error": "no answer"}
        if "child-error" in got or not hold:
            self.release()
        if "child-error" in got:
            raise AssertionError(f"the child running as nobody failed: {got['child-error']}")
        self.answer = got["answer"]

    def release(self) -> int:
        """Let a holding child go and reap it; its exit status."""
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None
        if not self._reaped:
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
            self.status = os.waitstatus_to_exitcode(status)
        return self.status


def as_nobody(work: Callable[[], Any]) -> Any:
    """Run `work` as nobody and return its answer (the child has exited)."""
    child = AsNobody(work)
    assert child.status == 0, f"the child running as nobody exited {child.status}"
    return child.answer
