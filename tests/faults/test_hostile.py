"""Hostile input from outside healthd, on a whole real fleet (tests/faults/world.py): poisoned but validly
signed reports, a flood of distinct Xids from a real agent, connection exhaustion of the report port and
of the admin socket, the ledger's disk full or turned read-only, and a node's state directory handed to
another user under the prolog. Nothing inside healthd is patched. After each case the checker's
invariants hold, and another node's T1 fault is drained within the usual rounds.

Measured figures are printed as `hostile: ...` lines (run with -s to see them)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from healthd.controller.admin import ADMIN_MAX_CLIENTS_PER_UID
from healthd.envelope import DEFAULT_MAX_BYTES, sign_report
from healthd.controller.daemon import MAX_OPEN_INCIDENTS_PER_NODE
from healthd.report_schema import MAX_FINDINGS
from healthd.controller.server import DEFAULT_MAX_CONNECTIONS_PER_PEER
from demo.harness import HarnessError, _stop_proc
from tests.controller.munge_support import munged_path
from tests.controller.reliability_support import finding, report_doc
from tests.faults.world import FaultWorld
from tests.support.journal import write_journal
from tests.support.polling import poll
from tests.support.sdnotify import NotifyListener, longest_gap
from tests.support.wire import post_json

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or munged_path() is None or shutil.which("slurmctld") is None,
                       reason="the fault-injection suite runs a real Slurm, munged and agents as root"),
]

BIN = Path(sys.executable).parent
NOBODY = 65534
HOSTILE_ADDR = "127.0.0.9"
"""A source address no agent uses (the agents connect from 127.0.0.1)."""
USER_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
"""An interpreter uid 65534 can run (the venv's may live under a root-only home)."""


def say(msg: str) -> None:
    print(f"hostile: {msg}", flush=True)


@pytest.fixture
def agent_config() -> dict[str, Any]:
    # No incident window on the agents: every distinct Xid is a finding of its own (on by default, the
    # Xids of one GPU within the window are one finding), the largest report a node can send.
    return {"classify": {"sympathetic_window_s": 0.0}}


# ------------------------------------------------------------------------------------ helpers


def log_offset(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def applied_drains(w: FaultWorld, node: str) -> list[dict[str, Any]]:
    return [a for a in w.actions(node) if a["kind"] in ("drain", "drain-and-requeue") and a["status"] == "applied"]


def slurm_reason_writes(w: FaultWorld, node: str) -> list[str]:
    """The reasons slurmctld's log shows written to `node` since the checker started."""
    assert w.checker is not None
    reasons, _ = w.checker.slurm_writes()
    return [r for (n, r), count in reasons.items() if n == node for _ in range(count)]


def not_touched(w: FaultWorld, node: str) -> None:
    """`node` is neither drained nor held, slurmctld logged no reason written to it, no incident names it."""
    info = w.node_info(node)
    assert not info.drain_requested and not info.reason, f"{node}: {info}"
    assert node not in w.holds()
    assert slurm_reason_writes(w, node) == []
    assert w.incidents(node) == []


def post(w: FaultWorld, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST `body` to the report endpoint as an agent does (urllib, the whole body sent)."""
    return post_json(w.url + "/v1/report", body)


def post_expect_continue(w: FaultWorld, body: bytes, timeout_s: float = 10) -> tuple[int, dict[str, Any], bool]:
    """POST with `Expect: 100-continue` (curl's way for large bodies): the body goes out only if the
    controller asks for it. Returns (status, JSON answer, whether the body was sent)."""
    with socket.create_connection(("127.0.0.1", w.port), timeout=timeout_s) as s:
        s.sendall(f"POST /v1/report HTTP/1.1\r\nHost: controller\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        sent = False
        if buf.startswith(b"HTTP/1.1 100"):
            buf = buf.split(b"\r\n\r\n", 1)[1]
            s.sendall(body)
            sent = True
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    head, _, payload = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload or b"{}"), sent


def signed(w: FaultWorld, doc: dict[str, Any], *, claim: str, signer: str) -> bytes:
    """The envelope an agent's root on `signer` makes for `doc`, claiming to be node `claim`: a valid MUNGE
    credential from `signer`'s own munged."""
    assert w.munge is not None
    return sign_report(doc, claim, w.munge.socket(signer))


def xid_line(w: FaultWorld, node: str, xid: int, gpu: int) -> str:
    return (f"NVRM: Xid (PCI:{w.nodes[node].bus(gpu)}): {xid}, pid='<unknown>', name=<unknown>, "
            f"hostile test fault {xid}")


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)


# ------------------------------------------------------------------------------------ a hostile client

HOSTILE_CLIENT = r'''
"""Holds COUNT connections to TARGET (tcp HOST:PORT from 127.0.0.9, or a unix socket path): connects
them all, then every PERIOD seconds looks at each (answered, closed or still open) and replaces every
one the server answered or closed. One JSON line of counts on stdout per look; SIGTERM ends it."""
import json, os, resource, signal, socket, struct, sys, time

mode, target, count, period, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < count + 64:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(count + 64, hard), hard))
stats = {"uid": os.getuid(), "looks": 0, "connects": 0, "connect_errors": 0, "refused": 0, "closed": 0,
         "timed_out": 0, "open": 0, "first": None}
done = False


def stop(*_):
    global done
    done = True


signal.signal(signal.SIGTERM, stop)


def connect():
    if mode == "tcp":
        host, port = target.rsplit(":", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        addr = (host, int(port))
        s.settimeout(5)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = target
        # a blocking connect waits for room in the listen backlog (bounded by SO_SNDTIMEO), where a
        # non-blocking one fails at once with EAGAIN while the backlog is full
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
    try:
        s.connect(addr)
    except OSError:
        s.close()
        stats["connect_errors"] += 1
        return None
    s.setblocking(False)
    stats["connects"] += 1
    return s


def look(s):
    """open | refused (503 / busy) | timed_out (the server's idle timeout) | closed"""
    try:
        data = s.recv(65536)
    except BlockingIOError:
        return "open"
    except OSError:
        return "closed"
    if not data:
        return "closed"
    text = data.decode(errors="replace")
    if text.startswith("HTTP/1.1 503") or '"busy"' in text:
        return "refused"
    if '"timeout"' in text or text.startswith("HTTP/1.1 408"):
        return "timed_out"
    return "closed"


socks = [connect() for _ in range(count)]
time.sleep(period)
while True:
    tally = {"open": 0, "refused": 0, "timed_out": 0, "closed": 0, "connect_errors": 0}
    for i, s in enumerate(socks):
        what = "connect_errors" if s is None else look(s)
        tally[what] += 1
        if what == "open":
            continue
        if s is not None:
            stats[what] += 1
            s.close()
        socks[i] = None if done else connect()
    stats["looks"] += 1
    stats["open"] = tally["open"]
    if stats["first"] is None:
        stats["first"] = tally
    print(json.dumps(stats), flush=True)
    if done:
        break
    time.sleep(period)
'''


class HostileClient:
    """The hostile client above as a process of its own (stopped by PID)."""

    def __init__(self, w: FaultWorld, mode: str, target: str, count: int, *, period_s: float = 2.0,
                 uid: int | None = None):
        script = w.dir / "hostile_client.py"
        script.write_text(HOSTILE_CLIENT)
        script.chmod(0o644)
        self.out = w.dir / f"hostile-{mode}-{time.monotonic_ns()}.jsonl"
        argv = [USER_PYTHON, "-I", str(script), mode, target, str(count), str(period_s), HOSTILE_ADDR]
        if uid is not None:
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        self.err = self.out.with_suffix(".err")
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)

    def stats(self) -> dict[str, Any] | None:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.strip()]
        return json.loads(lines[-1]) if lines else None

    def wait_first(self, w: FaultWorld, timeout_s: float = 60) -> dict[str, Any]:
        def first() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"hostile client exited {self.proc.returncode}: {self.err.read_text()[-2000:]}")
            st = self.stats()
            return st if st and st["first"] else None
        return w.wait(first, timeout_s, "the hostile client's first look")

    def stop(self) -> dict[str, Any] | None:
        _stop_proc(self.proc, grace_s=30)  # SIGTERM: it prints its last counts and exits
        return self.stats()


@contextmanager
def hostile_client(w: FaultWorld, mode: str, target: str, count: int, **kw: Any) -> Iterator[HostileClient]:
    client = HostileClient(w, mode, target, count, **kw)
    try:
        yield client
    finally:
        client.stop()


REFUSAL_LINE = re.compile(r"refused: (503|max_connections)")


def refusal_lines(text: str) -> tuple[int, int]:
    """(controller log lines about refused connections, refusals they stand for): a line written at once
    is one refusal plus the count it tells of those the rate limit held back before it; a flush line
    (`...: N more lines suppressed`) is N."""
    lines = [ln for ln in text.splitlines() if REFUSAL_LINE.search(ln)]
    told = 0
    for ln in lines:
        flushed = re.search(r": (\d+) more lines suppressed", ln)
        held = re.search(r"\((\d+) more suppressed in the last", ln)
        told += int(flushed.group(1)) if flushed else 1 + (int(held.group(1)) if held else 0)
    return len(lines), told


# ------------------------------------------------------------------------------------ 1. poisoned reports


def test_poisoned_signed_reports_are_refused_and_do_not_delay_other_drains(w):
    """Reports with a valid MUNGE credential from node01's own munged (root on node01, or its agent gone
    bad) but poisoned content: each refused with 4xx and a line naming the field; none reaches a round."""
    good = finding("xid:gpu0:79")  # every poisoned report also carries a real T1 finding: were it kept, a drain

    def with_bad(bad: dict[str, Any]) -> dict[str, Any]:
        return report_doc("node01", [good, bad])

    cases: list[tuple[str, dict[str, Any], str, int, str]] = []  # name, doc, claimed node, status, text
    bad = finding("xid:gpu1:79")
    bad["tier"] = "1x"
    cases.append(("mistyped tier", with_bad(bad), "node01", 400, 'findings[1].tier: expected an integer 1-3'))
    doc = report_doc("node01", [good])
    doc["findings"] = {"0": good}
    cases.append(("findings not a list", doc, "node01", 400, "findings: expected a list"))
    cases.append(("100 kB finding id", with_bad(finding("x" * 100_000)), "node01", 400,
                  "findings[1].id: expected at most 1024 characters, found 100000"))
    bad = finding("xid:gpu2:79")
    bad["evidence"] = [{"kind": "log_line", "text": 42}]
    cases.append(("evidence text a number", with_bad(bad), "node01", 400,
                  "findings[1].evidence[0].text: expected a string"))
    bad = finding("xid:gpu2:79")
    bad["evidence"] = "NVRM: Xid 79"
    cases.append(("evidence a string", with_bad(bad), "node01", 400, "findings[1].evidence: expected a list"))
    bad = finding("xid:gpu2:79")
    bad["evidence"] = [{"kind": "counter", "text": "x", "value": {"a": [[[[[1]]]]]}}]
    cases.append(("evidence nested too deep", with_bad(bad), "node01", 400, "nested more than 4 levels deep"))
    cases.append((f"{MAX_FINDINGS + 1} findings", report_doc("node01", [finding(f"xid:gpu0:{i}") for i in
                                                                         range(MAX_FINDINGS + 1)]),
                  "node01", 400, f"over the limit of {MAX_FINDINGS}"))
    cases.append(("claims node03", report_doc("node03", [good]), "node03", 403, "cross-node report refused"))

    # a control: the same signing path with a clean document is accepted
    status, answer = post(w, signed(w, report_doc("node01"), claim="node01", signer="node01"))
    assert (status, answer.get("accepted")) == (200, True), answer
    for name, doc, claim, want, text in cases:
        t0 = time.monotonic()
        status, answer = post(w, signed(w, doc, claim=claim, signer="node01"))
        took = time.monotonic() - t0
        say(f"poison {name!r}: {status} in {took * 1000:.0f} ms: {answer.get('error', '')[:150]}")
        assert status == want, (name, status, answer)
        assert answer.get("accepted") is False and text in answer.get("error", ""), (name, answer)

    # 24,000 findings (~10 MB): refused on its Content-Length, before the body is read or parsed
    huge = report_doc("node01", [finding(f"xid:gpu{i % 4}:{i}") for i in range(24_000)])
    body = signed(w, huge, claim="node01", signer="node01")
    assert len(body) > DEFAULT_MAX_BYTES
    t0 = time.monotonic()
    status, answer, sent = post_expect_continue(w, body)
    took = time.monotonic() - t0
    say(f"poison 24,000 findings ({len(body) / 1e6:.1f} MB), Expect: 100-continue: {status} in {took * 1000:.0f} ms, "
        f"body sent: {sent}: {answer.get('error')}")
    assert status == 413 and not sent and "over the" in answer.get("error", "") and took < 2.0
    t0 = time.monotonic()
    try:
        status, answer = post(w, body)
        outcome = f"{status}: {answer.get('error')}"
    except OSError as exc:  # the controller answered 413 and closed while the body was still going out
        status, outcome = None, f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    say(f"poison 24,000 findings, whole body sent: {outcome} in {took * 1000:.0f} ms")
    assert status in (413, None) and took < 5.0

    w.wait_rounds(4)  # were a poisoned report kept, these rounds would act on it
    took = w.checker.drain_not_delayed("node02")
    say(f"poisoned reports: node02's Xid drained in {took:.2f} s")
    for node in ("node01", "node03"):
        not_touched(w, node)
    assert w.controller_pid() is not None
    w.checker.check()


# ------------------------------------------------------------------------------------ 2. a flood of findings

T1_XIDS = (48, 62, 64, 79, 95, 140, 143, 158)
T2_XIDS = (46, 54, 56, 57, 58, 61, 63, 65, 73, 74, 81, 92, 110, 119, 120, 121, 136, 155, 156, 157)
T3_XIDS = (13, 31)
UNKNOWN_XIDS = tuple(range(200, 240))
"""Codes the catalog does not list (tier 3, recorded only): they take the report past MAX_FINDINGS."""


def test_a_flood_of_distinct_xids_opens_a_bounded_number_of_incidents(w):
    """One journal burst on node02: 30 catalogued Xid codes (28 of them tier 1 or 2) and 40 unknown ones on
    each of its 4 GPUs, a millisecond apart (one finding each: the agents here have no incident window).
    The agent fits its report to the controller's limits; the controller opens at most
    MAX_OPEN_INCIDENTS_PER_NODE incidents for node02 and drains it once; other nodes are not delayed."""
    xids = T1_XIDS + T2_XIDS + T3_XIDS + UNKNOWN_XIDS
    lines = [xid_line(w, "node02", xid, gpu) for xid in xids for gpu in range(w.gpus_per_node)]
    off = log_offset(w.controller_log)
    agent_off = log_offset(w.nodes["node02"].log)
    t0 = time.monotonic()
    write_journal(w.nodes["node02"].journal, lines, name="burst.journal", hostname="node02",
                  start_usec=int(time.time() * 1e6))
    w.wait(lambda: w.held_and_drained("node02"), 90, "node02 drained after the burst")
    took = time.monotonic() - t0

    def state_findings() -> int:
        doc = w.agent_state("node02") or {}
        return len(doc.get("findings", []))
    w.wait(lambda: state_findings() > MAX_FINDINGS, 60, f"node02's state with more than {MAX_FINDINGS} findings")
    w.wait_rounds(6)  # the rounds that would open more incidents and drain again, were the caps not kept
    opened = w.incidents("node02", "open")
    agent_log = log_since(w.nodes["node02"].log, agent_off)
    controller_log = log_since(w.controller_log, off)
    cap_lines = [ln for ln in controller_log.splitlines() if "open incidents already" in ln]
    say(f"xid flood: {len(lines)} journal lines, {state_findings()} findings in node02's state file, drained in "
        f"{took:.2f} s, {len(opened)} open incident(s) for node02 (all: {len(w.incidents('node02'))}), "
        f"{len(cap_lines)} incident-cap log line(s), {len(w.rows('SELECT id FROM decisions WHERE node = ?', ('node02',)))}"
        f" decision row(s)")
    assert "report to the controller trimmed to its limits" in agent_log, agent_log[-3000:]
    assert "refused the report" not in agent_log, agent_log[-3000:]  # the fitted report was accepted
    assert 1 <= len(opened) <= MAX_OPEN_INCIDENTS_PER_NODE, opened
    assert len(applied_drains(w, "node02")) == 1, w.actions("node02")
    assert len(slurm_reason_writes(w, "node02")) == 1
    assert 1 <= len(cap_lines) <= 5, cap_lines
    took = w.checker.drain_not_delayed("node03")
    say(f"xid flood: node03's Xid drained in {took:.2f} s")
    assert len(w.incidents("node02", "open")) <= MAX_OPEN_INCIDENTS_PER_NODE
    w.checker.check()


# ------------------------------------------------------------------------------------ 3. report port exhaustion


def test_connection_exhaustion_from_one_address_does_not_keep_agents_out(w):
    """1000 idle TCP connections to the report port from 127.0.0.9, each one the controller closes replaced
    at once: the agents (127.0.0.1) keep reporting and node03's drain is not delayed; the refusals are
    a few rate-limited log lines."""
    off = log_offset(w.controller_log)
    agent_offs = {name: log_offset(node.log) for name, node in w.nodes.items()}
    with hostile_client(w, "tcp", f"127.0.0.1:{w.port}", 1000, period_s=3.0) as client:
        first = client.wait_first(w)["first"]
        say(f"report port, 1000 connections from {HOSTILE_ADDR}: first look {first}")
        assert first["open"] <= DEFAULT_MAX_CONNECTIONS_PER_PEER, first
        assert first["refused"] >= 1000 - DEFAULT_MAX_CONNECTIONS_PER_PEER - first["connect_errors"] - 5, first
        took = w.checker.drain_not_delayed("node03")
        say(f"report port exhaustion: node03's Xid drained in {took:.2f} s")
        # the client's next look: the connections it put in place of the refused ones are refused too
        w.wait(lambda: (st := client.stats()) is not None and st["looks"] >= 2 and st["refused"] > first["refused"],
               60, "the hostile client's replacement connections refused")
        assert client.proc.poll() is None
    final = client.stats()
    text = log_since(w.controller_log, off)
    lines, told = refusal_lines(text)
    say(f"report port exhaustion: client totals {final}; controller log: {lines} line(s) about 503 refusals, "
        f"telling {told} refusal(s)")
    assert final is not None and final["refused"] >= 1000 - DEFAULT_MAX_CONNECTIONS_PER_PEER - 5
    assert final["looks"] >= 2 and final["refused"] > first["refused"], (first, final)  # replacements refused too
    assert 1 <= lines < 20, text[-3000:]
    assert w.controller_pid() is not None
    # the agents were never shut out: none of them logged the controller unreachable or refusing meanwhile
    for name, node in w.nodes.items():
        assert "retrying with backoff" not in log_since(node.log, agent_offs[name]), name
    w.checker.check()


# ------------------------------------------------------------------------------------ 4. admin socket exhaustion


def test_admin_socket_exhaustion_by_a_local_user_does_not_lock_out_root(w):
    """uid 65534 holds 1000 connections to the admin socket (each one closed replaced at once); root's
    healthctl status and an undo of a real drain still work within seconds, and drains are not delayed."""
    w.inject_xid("node02", 48)
    w.wait(lambda: w.held_and_drained("node02"), 30, "node02 drained")
    (drain,) = applied_drains(w, "node02")
    off = log_offset(w.controller_log)
    with hostile_client(w, "unix", str(w.admin_socket), 1000, period_s=3.0, uid=NOBODY) as client:
        st = client.wait_first(w)
        first = st["first"]
        say(f"admin socket, 1000 connections from uid {st['uid']}: first look {first}")
        assert st["uid"] == NOBODY
        assert first["open"] <= ADMIN_MAX_CLIENTS_PER_UID, first
        t0 = time.monotonic()
        status = w.healthctl("status")  # exit 0, or HarnessError
        took_status = time.monotonic() - t0
        assert status["healthd_drained_nodes"] == ["node02"], status
        t0 = time.monotonic()
        w.healthctl("undo", str(drain["id"]), "--why", "operator: the admin socket is under attack, not the GPU",
                    json_out=False)
        took_undo = time.monotonic() - t0
        w.wait(lambda: not w.node_info("node02").drain_requested, 30, "the undo's resume")
        took_resume = time.monotonic() - t0
        say(f"admin socket exhaustion: healthctl status {took_status:.2f} s, undo answered in {took_undo:.2f} s, "
            f"node02 resumed {took_resume:.2f} s after the undo")
        assert took_status < 10 and took_undo < 10
        took = w.checker.drain_not_delayed("node03")
        say(f"admin socket exhaustion: node03's Xid drained in {took:.2f} s")
        assert client.proc.poll() is None
    final = client.stats()
    text = log_since(w.controller_log, off)
    lines = [ln for ln in text.splitlines() if "admin socket: uid" in ln]
    say(f"admin socket exhaustion: client totals {final}; {len(lines)} admin-socket refusal/timeout log line(s)")
    assert first["refused"] >= 1000 - ADMIN_MAX_CLIENTS_PER_UID - first["connect_errors"] - 5, first
    assert first["connect_errors"] < 50, first
    # the counts are running totals: the replacements for what the first look found refused were refused too
    assert final is not None and final["looks"] >= 2 and final["refused"] > first["refused"], (first, final)
    assert len(lines) < 20, lines
    assert [a["status"] for a in w.actions("node02") if a["id"] == drain["id"]] == ["undone"]
    w.checker.check()


ADMIN_FLOOD = r'''
"""connect() to the unix socket PATH and close, in a loop, for SECONDS: keeps the listen backlog full.
After its first connect it leaves a file named by its PID in MARKS."""
import os, socket, struct, sys, time

path, seconds, marks = sys.argv[1], float(sys.argv[2]), sys.argv[3]
end = time.monotonic() + seconds
started = False
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
    try:
        s.connect(path)
    except OSError:
        pass
    s.close()
    if not started:  # the test probes once every flooder is under way
        open(f"{marks}/{os.getpid()}", "w").close()
        started = True
'''
FLOODERS = 8


def test_admin_socket_connect_flood_by_a_local_user_does_not_lock_out_root(w):
    """uid 65534 runs FLOODERS processes that connect to the admin socket and close, in a loop: root's
    healthctl commands still reach the controller (answered, here refused for an unknown action: exit 1),
    and drains are not delayed."""
    script = w.dir / "admin_flood.py"
    script.write_text(ADMIN_FLOOD)
    script.chmod(0o644)
    marks = w.dir / f"admin-flood-{time.monotonic_ns()}"
    marks.mkdir()
    marks.chmod(0o1777)  # the flooders run as uid 65534
    procs = []
    codes: list[tuple[int, str]] = []
    try:
        for _ in range(FLOODERS):
            procs.append(subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", USER_PYTHON, "-I",
                 str(script), str(w.admin_socket), "120", str(marks)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        w.wait(lambda: len(list(marks.iterdir())) == FLOODERS, 60, "every flooder connecting")
        for _ in range(5):
            p = run([str(BIN / "healthctl"), "--ledger", str(w.ledger), "--socket", str(w.admin_socket), "undo",
                     "999999", "--why", "probe"], env=w.env)
            codes.append((p.returncode, (p.stderr or p.stdout).strip()[:120]))
        say(f"admin socket connect flood ({FLOODERS} processes of uid {NOBODY}): healthctl undo exit codes {codes}")
        took = w.checker.drain_not_delayed("node03")
        say(f"admin socket connect flood: node03's Xid drained in {took:.2f} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    w.checker.check()
    assert [rc for rc, _ in codes] == [1] * len(codes), codes


# ------------------------------------------------------------------------------------ 5 and 6. the ledger's disk


@contextmanager
def ledger_on(w: FaultWorld, mount_dir: Path, umount: list[str]) -> Iterator[None]:
    """Restart the controller with its ledger in `mount_dir` (mounted by the caller); at the end stop it,
    unmount, and leave the world's ledger where the reset expects it."""
    w.stop_controller()
    w.ledger_dir = mount_dir
    try:
        w.start_controller()
        yield
    finally:
        w.stop_controller()
        w.ledger_dir = None
        w.controller_extra_env = None
        # the stopped controller's last file handles may keep it busy for a moment
        poll(lambda: run(umount).returncode == 0 or not os.path.ismount(mount_dir), 10, f"{mount_dir} unmounted",
             interval=0.5)


def mount_tmpfs(mnt: Path, size: str) -> Path:
    """A fresh tmpfs of `size` mounted at `mnt` (ledger_on unmounts it); the test is skipped where this
    machine does not allow the mount."""
    mnt.mkdir()
    mounted = run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)])
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    return mnt


def fill(directory: Path) -> Path:
    """A file that takes every free block of `directory`'s file system (until ENOSPC)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1):
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0
    return filler


def nothing_written_while_the_ledger_fails(w: FaultWorld, pid: int | None, seconds: float) -> tuple[float, str, float]:
    """An Xid on node02 while the ledger cannot record: the controller says so, stays up, and writes
    nothing to Slurm for `seconds`; healthctl status still reads. Returns (seconds to the first ledger
    error, the controller's log meanwhile, seconds healthctl status took)."""
    off = log_offset(w.controller_log)
    t0 = time.monotonic()
    w.inject_xid("node02", 48)
    w.wait(lambda: ledger_errors(log_since(w.controller_log, off)), 30, "the controller's ledger error")
    took_error = time.monotonic() - t0
    time.sleep(seconds)
    text = log_since(w.controller_log, off)
    assert not w.node_info("node02").drain_requested, "drained while the ledger could not record it"
    assert slurm_reason_writes(w, "node02") == []
    assert w.controller_pid() == pid, "the controller exited"
    t1 = time.monotonic()
    status = w.healthctl("status")  # exit 0, or HarnessError
    assert status["healthd_drained_nodes"] == [] and status["breaker"]["open"] is False, status
    return took_error, text, time.monotonic() - t1


def drained_once_when_the_ledger_records(w: FaultWorld, case: str, since: float, after: str) -> None:
    """The ledger records again (since `since`, `after` says what happened then): node02's pending Xid is
    drained exactly once and node03's Xid is not delayed; the checker finds no Slurm write it objects to."""
    assert w.checker is not None
    w.wait(lambda: w.held_and_drained("node02"), 60, f"node02 drained {after}")
    say(f"{case}: drained {time.monotonic() - since:.2f} s {after}")
    assert len(applied_drains(w, "node02")) == 1
    w.checker.check()
    took = w.checker.drain_not_delayed("node03")
    say(f"{case}: node03's Xid drained in {took:.2f} s afterwards")
    w.checker.check()


def ledger_errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "ledger.sqlite" in ln and ("full" in ln or "read" in ln.lower()
                                                                         or "I/O" in ln)]


def test_ledger_disk_full_means_no_slurm_write_until_it_can_be_recorded(w):
    """The ledger on a 2 MiB tmpfs filled to ENOSPC: node02's Xid is not drained while the ledger cannot
    record it (write-ahead), the controller keeps running and says why; once space is freed the drain
    happens exactly once."""
    mnt = mount_tmpfs(w.dir / "ledger-tmpfs", "2m")
    dog = NotifyListener(str(w.dir / "notify.sock"))  # systemd's side of sd_notify
    w.controller_extra_env = {"NOTIFY_SOCKET": str(w.dir / "notify.sock"), "WATCHDOG_USEC": "4000000"}
    try:
        with ledger_on(w, mnt, ["umount", str(mnt)]):
            pid = w.controller_pid()
            w.wait_rounds(6)  # rounds recorded on the tmpfs before it is full
            filler = fill(mnt)
            t_full = time.monotonic()
            took_error, text, took_status = nothing_written_while_the_ledger_fails(w, pid, 8.0)  # 16 rounds
            t_free = time.monotonic()
            gap = longest_gap(dog.watchdogs(), t_full, t_free)
            failed_rounds = text.count("control round not recorded")
            # the loop goes on (a restart would not help): systemd's watchdog stays fed, the log stays readable
            assert gap < 4.0, f"no WATCHDOG=1 for {gap:.1f} s while the ledger was full"
            assert 1 <= failed_rounds <= 3, f"{failed_rounds} 'control round not recorded' lines in ~8 s"
            say(f"ledger disk full: first ledger error {took_error:.2f} s after the Xid; in {t_free - t_full:.1f} s "
                f"full: {len(text.splitlines())} controller log lines, {failed_rounds} 'control round not recorded', "
                f"{len(ledger_errors(text))} naming the ledger, e.g. {ledger_errors(text)[0][-160:]!r}; "
                f"longest watchdog gap {gap:.1f} s (WatchdogSec 4 s); healthctl status {took_status:.2f} s")
            filler.unlink()
            drained_once_when_the_ledger_records(w, "ledger disk full", t_free, "after the disk was freed")
            assert w.controller_pid() == pid, "the controller exited"
    finally:
        dog.close()


def test_ledger_file_system_turned_read_only_under_the_controller(w):
    """The ledger on an ext4 file system (a loop device, errors=remount-ro) that the kernel turns read-only
    under the running controller, as after an I/O error (tmpfs cannot be remounted read-only while the
    controller holds the ledger open for writing: the kernel answers EBUSY). No Slurm write without a
    record, a clear error, healthctl status still reads; after the operator's repair (stop the controller,
    unmount, fsck, mount, start) the drain happens exactly once."""
    img = w.dir / "ledger-ext4.img"
    mnt = w.dir / "ledger-ext4"
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(32 << 20)
    made = run(["mkfs.ext4", "-q", "-F", str(img)])
    mounted = run(["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)]) if made.returncode == 0 else made
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image on a loop device here: {mounted.stderr.strip()}")
    dev = run(["findmnt", "-no", "SOURCE", str(mnt)]).stdout.strip()
    trigger = Path("/sys/fs/ext4") / os.path.basename(dev) / "trigger_fs_error"
    if not trigger.exists():
        run(["umount", str(mnt)])
        pytest.skip(f"{trigger} is missing: cannot make the kernel turn the file system read-only")
    with ledger_on(w, mnt, ["umount", str(mnt)]):
        pid = w.controller_pid()
        w.wait_rounds(4)  # rounds recorded on the ext4 before it fails
        trigger.write_text("healthd fault test: the ledger's disk failed\n")
        with pytest.raises(OSError) as refused:
            (mnt / "probe").write_text("x")
        assert refused.value.errno == errno.EROFS
        t_ro = time.monotonic()
        took_error, text, took_status = nothing_written_while_the_ledger_fails(w, pid, 6.0)
        say(f"ledger read-only: first ledger error {took_error:.2f} s after the Xid, "
            f"{text.count('control round not recorded')} 'control round not recorded' in {time.monotonic() - t_ro:.1f} s, e.g. "
            f"{ledger_errors(text)[0][-160:]!r}; healthctl status {took_status:.2f} s")
        # the operator's repair: the kernel keeps an ext4 that failed read-only until it is unmounted
        t_repair = time.monotonic()
        w.stop_controller()
        assert run(["umount", str(mnt)]).returncode == 0
        fsck = run(["e2fsck", "-fy", str(img)])
        assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr
        assert run(["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)]).returncode == 0
        w.start_controller()
        drained_once_when_the_ledger_records(w, "ledger read-only", t_repair,
                                             "after the repair began (controller restart included)")


def test_ledger_read_only_when_the_controller_starts(w):
    """The tmpfs under the ledger remounted read-only while the controller is stopped (a restart finds it
    so): the controller refuses to start with a line naming the ledger and writes nothing to Slurm;
    remounted read-write, it starts and node02's pending Xid is drained exactly once. healthctl status
    against the read-only ledger works (a read-only file system has no writer: the ledger is read as
    immutable)."""
    mnt = mount_tmpfs(w.dir / "ledger-tmpfs-ro", "8m")
    with ledger_on(w, mnt, ["umount", str(mnt)]):
        busy = run(["mount", "-o", "remount,ro", str(mnt)])
        say(f"ledger read-only at start: remount,ro under the running controller: rc {busy.returncode} "
            f"{busy.stderr.strip()[:80]!r}")
        if busy.returncode == 0:
            assert run(["mount", "-o", "remount,rw", str(mnt)]).returncode == 0
        w.stop_controller()
        assert run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
        w.inject_xid("node02", 48)
        off = log_offset(w.controller_log)
        with pytest.raises(HarnessError, match="healthd-controller exited"):
            w.start_controller()
        text = log_since(w.controller_log, off)
        say(f"ledger read-only at start: the controller said {text.strip().splitlines()[-1]!r}")
        assert str(w.ledger) in text and "read-only" in text, text
        time.sleep(3.0)
        assert not w.node_info("node02").drain_requested
        assert slurm_reason_writes(w, "node02") == []
        status = run([str(BIN / "healthctl"), "--ledger", str(w.ledger), "--socket", str(w.admin_socket), "status"],
                     env=w.env)
        say(f"ledger read-only at start: healthctl status exit {status.returncode}: "
            f"{(status.stderr or status.stdout).strip()[:200]!r}")
        assert run(["mount", "-o", "remount,rw", str(mnt)]).returncode == 0
        t_rw = time.monotonic()
        w.start_controller()
        drained_once_when_the_ledger_records(w, "ledger read-only at start", t_rw, "after the remount and start")
    assert status.returncode == 0, status.stderr


# ------------------------------------------------------------------------------------ 7. hostile state directory


def test_state_directory_owned_by_another_user_makes_the_prolog_let_the_job_run(w):
    """node01's agent state directory handed to uid 65534 and group-writable while node01 has a T1 Xid on
    GPU 0: the real prolog (gating controller) does not trust the state file, lets the job run (exit 0)
    and sends the controller no drain request. A control run with the directory restored does ask."""
    node = w.nodes["node01"]
    state_dir = node.state_file.parent
    hook_run = node.root / "hook-run"
    hook_run.mkdir(mode=0o755, exist_ok=True)
    doc = json.loads(node.config.read_text())
    doc["hooks"] = {"gating": "controller", "run_dir": str(hook_run), "slurm_conf": w.slurm_conf}
    config = node.root / "healthd-hooks.yaml"
    config.write_text(json.dumps(doc, indent=2) + "\n")

    def prolog(job: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": w.slurm_conf, "HEALTHD_CONFIG": str(config),
               "SLURMD_NODENAME": "node01", "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "0", "SLURM_JOB_USER": "root",
               "SLURM_JOB_UID": "0"}
        return run([str(BIN / "healthd-prolog")], env=env)

    def t1_on_gpu0() -> bool:
        return any(f.get("tier") == 1 and f.get("component", {}).get("index") == 0
                   for f in (w.agent_state("node01") or {}).get("findings", []))

    st = state_dir.stat()
    try:
        os.chown(state_dir, NOBODY, NOBODY)
        state_dir.chmod(0o775)
        w.inject_xid("node01", 79, gpu=0)
        w.wait(t1_on_gpu0, 30, "node01's state with the Xid on GPU 0")
        off = log_offset(w.controller_log)
        done = prolog("4242")
        say(f"hostile state dir: prolog exit {done.returncode}: {done.stderr.strip()[-300:]!r}")
        assert done.returncode == 0, done.stderr
        assert "state file refused" in done.stderr and str(state_dir) in done.stderr, done.stderr
        w.wait_rounds(4)
        assert "drain request" not in log_since(w.controller_log, off)
        assert not w.rows("SELECT id FROM incidents WHERE jobs LIKE '%4242%'")
        # the control: the same prolog with the directory back to root's 0755 asks the controller
        os.chown(state_dir, 0, 0)
        state_dir.chmod(0o755)
        w.wait(t1_on_gpu0, 30, "node01's state with the Xid on GPU 0")
        control = prolog("4243")
        text = log_since(w.controller_log, off)
        say(f"hostile state dir: control prolog exit {control.returncode}: {control.stderr.strip()[-200:]!r}")
        assert "drain request from node01 (job 4243)" in text, text[-2000:]
        assert "job 4242" not in text
    finally:
        os.chown(state_dir, st.st_uid, st.st_gid)
        state_dir.chmod(st.st_mode & 0o7777)
    w.wait(lambda: w.held_and_drained("node01"), 30, "node01 drained for its Xid (from the agent's report)")
    assert len(applied_drains(w, "node01")) == 1
    took = w.checker.drain_not_delayed("node03")
    say(f"hostile state dir: node03's Xid drained in {took:.2f} s")
    w.checker.check()
