"""Real munged daemons for the controller's authentication tests: one per fake node plus one for the
controller, all sharing one key, each with its own socket and its own `--origin=127.0.0.N` (so the
credential's encode address says which "node" made it).

    with MungeFleet(["node02", "node03"]) as fleet:
        fleet.socket("node02")        # the node's munged socket (the agent encodes through it)
        fleet.controller_socket       # the controller's munged (it decodes; replay cache lives here)
        fleet.node_addrs              # {"node02": "127.0.0.2", "node03": "127.0.0.3"}

Everything lives in one directory directly under /tmp with mode 0755 (munged and a setuid-nobody
encoder need to traverse it; pytest's tmp tree is 0700). Daemons run with --foreground as our own
children, are stopped by PID (SIGTERM, then SIGKILL) and reaped by us: PID 1 here does not reap, and a
zombie (state Z) counts as stopped.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CONTROLLER = "controller"
CONTROLLER_ADDR = "127.0.0.1"


class MungeSetupError(RuntimeError):
    pass


def munged_path() -> str | None:
    return shutil.which("munged") or next((p for p in ("/usr/sbin/munged", "/sbin/munged") if os.access(p, os.X_OK)), None)


def _state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


class MungeFleet:
    def __init__(self, nodes: list[str], *, first_addr: int = 2, num_threads: int = 2):
        self.nodes = list(nodes)
        self.node_addrs = {n: f"127.0.0.{first_addr + i}" for i, n in enumerate(self.nodes)}
        self.num_threads = num_threads
        self.root: Path | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ paths
    def _dir(self) -> Path:
        if self.root is None:
            raise MungeSetupError("MungeFleet not started")
        return self.root

    def socket(self, name: str) -> str:
        return str(self._dir() / f"{name}.sock")

    @property
    def controller_socket(self) -> str:
        return self.socket(CONTROLLER)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self._procs.items()}

    def log(self, name: str) -> str:
        try:
            return (self._dir() / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "MungeFleet":
        exe = munged_path()
        if exe is None:
            raise MungeSetupError("munged is not installed: apt-get install munge")
        self.root = Path(tempfile.mkdtemp(prefix="healthd-munge-", dir="/tmp"))
        os.chmod(self.root, 0o755)
        key = self.root / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(1024))
        atexit.register(self.stop)  # a test session that dies between start and stop leaves no daemons
        try:
            for name, addr in [(CONTROLLER, CONTROLLER_ADDR), *self.node_addrs.items()]:
                self._spawn(exe, name, addr)
            for name in self._procs:
                self._wait_socket(name)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, exe: str, name: str, addr: str) -> None:
        d = self._dir()
        argv = [
            exe,
            "--foreground",
            f"--socket={d / f'{name}.sock'}",
            f"--key-file={d / 'munge.key'}",
            f"--pid-file={d / f'{name}.pid'}",
            f"--seed-file={d / f'{name}.seed'}",
            f"--log-file={d / f'{name}.log'}",
            f"--origin={addr}",
            f"--num-threads={self.num_threads}",
        ]
        with open(d / f"{name}.stdout", "ab") as out:
            self._procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
            )

    def _wait_socket(self, name: str, timeout_s: float = 10.0) -> None:
        sock = Path(self.socket(name))
        proc = self._procs[name]
        deadline = time.monotonic() + timeout_s
        while not sock.exists():
            if proc.poll() is not None:
                out = (self._dir() / f"{name}.stdout").read_text(errors="replace")
                raise MungeSetupError(f"munged for {name} exited with {proc.returncode}:\n{out}\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise MungeSetupError(f"munged for {name} did not create {sock} within {timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM each daemon by PID, SIGKILL what is still running after 5 s, reap, remove the dir."""
        atexit.unregister(self.stop)
        for proc in self._procs.values():
            if proc.poll() is None and _alive(proc.pid):
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self._procs.values():
            while proc.poll() is None and _alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None and _alive(proc.pid):
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=5)  # reap: nobody else will
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "MungeFleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def encode_as_user(payload: bytes, socket: str, uid: int, gid: int, *, ttl: int | None = None) -> str:
    """A credential encoded by a forked child that dropped to uid/gid first (so munged sees that user on
    the socket, as it would a non-root user on a compute node). Raises the child's error text."""
    from healthd import munge

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no Python cleanup, no pytest teardown, just the credential on the pipe
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            msg = b"OK " + munge.encode(payload, socket, ttl=ttl).encode()
        except Exception as exc:  # anything goes back to the parent as text
            msg = b"ERR " + repr(exc).encode()
            code = 1
        try:
            os.write(w, msg)
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = b"".join(chunks).decode(errors="replace")
    if not out.startswith("OK "):
        raise MungeSetupError(f"encoding as uid {uid} failed: {out}")
    return out[3:]


def measure_verify_rate(fleet: MungeFleet, *, reports: int = 5000, node: str | None = None, threads: int = 1) -> dict:
    """Reports per second that auth.verify_report sustains against the fleet's controller munged: signs
    `reports` distinct reports through a node's munged first (not timed), then times verifying them all
    (`threads` concurrent verifiers). A helper for bench/controller_auth.py, not a timed test."""
    from concurrent.futures import ThreadPoolExecutor

    from healthd import envelope
    from healthd.controller import auth

    node = node or fleet.nodes[0]
    sock = fleet.socket(node)
    doc = {"verdict": "healthy", "findings": [], "gpus": 8, "seq": 0}

    def sign(i: int) -> bytes:
        return envelope.sign_report({**doc, "seq": i}, node, sock)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as pool:
        bodies = list(pool.map(sign, range(reports)))
    sign_s = time.perf_counter() - t0
    addrs = fleet.node_addrs

    def verify(body: bytes) -> None:
        auth.verify_report(body, socket=fleet.controller_socket, node_addrs=addrs, now=time.time())

    t0 = time.perf_counter()
    if threads <= 1:
        for body in bodies:
            verify(body)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(verify, bodies))
    verify_s = time.perf_counter() - t0
    return {
        "reports": reports,
        "threads": threads,
        "body_bytes": len(bodies[0]),
        "verify_s": round(verify_s, 4),
        "verify_per_s": round(reports / verify_s, 1),
        "verify_us_each": round(verify_s / reports * 1e6, 1),
        "sign_per_s": round(reports / sign_s, 1),
    }
