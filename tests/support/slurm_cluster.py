"""A real Slurm cluster on one machine for tests: munged + slurmctld + N slurmd on 127.0.0.1.

    from tests.support.slurm_cluster import SlurmCluster, ensure_installed
    ensure_installed()                                   # apt-get slurm-wlm munge, only if missing
    cluster = SlurmCluster(tmp_path / "slurm", hooks={"Prolog": "/path/prolog.sh"})
    cluster.up()                                         # returns when node01..node04 are idle
    cluster.run(["scontrol", "update", "NodeName=node02", "State=DRAIN", "Reason=healthd: x"])
    cluster.node_state("node02")["State"]                # 'IDLE+DRAIN'
    cluster.down()                                       # TERM, 5 s, KILL: only the PIDs it started

Everything lives under `root`: etc/ (slurm.conf, gres.conf), munge/, log/, run/, spool/, dev/<node>/.
Every daemon and client runs with `cluster.env` (SLURM_CONF set, fixed PATH): a Slurm client without
SLURM_CONF falls back to a DNS SRV lookup. Daemons are started with start_new_session=True and
recorded as "pid starttime" in run/<name>.mypid, so `down()` from another process (the CLI) stops
exactly those processes and never a reused PID. PID 1 on the CI machines does not reap orphans, so a
zombie (state Z) counts as dead.

Clusters run side by side on distinct ports (slurmctld on port_base, the nodes on port_base+1..+N).
Left as None, port_base is picked at up() from the first free block (16817, 16917, ...) while holding
a machine-wide lock (/tmp/healthd-slurm-ports.lock) until the daemons have bound their ports, so two
test sessions on one machine cannot pick the same block.

CLI for the Makefile: `python -m tests.support.slurm_cluster up|down|status [--root DIR]`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

from healthd.slurmtext import parse_state_string, reason_holds
from tests.support.polling import poll

T = TypeVar("T")

DEFAULT_PORT_BASE = 16817
DEFAULT_ROOT = Path("/tmp/healthd-slurm")
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DAEMONS = ("slurmctld", "slurmd", "munged")
# slurm.conf keys a caller may point at an executable; the first three and TaskProlog are the ones healthd ships.
HOOK_KEYS = ("HealthCheckProgram", "Prolog", "Epilog", "PrologSlurmctld", "EpilogSlurmctld", "TaskProlog")
NVIDIA_MAJOR = 195  # character-device major of /dev/nvidiaN
STOP_GRACE_S = 5.0
# slurm.conf keys `scontrol reconfigure` applies to running daemons at once (slurmctld triggers the health
# checks with its own interval; each slurmd reads its hooks again): changing only these needs no restart.
RELOADED_KEYS = (*HOOK_KEYS, "HealthCheckInterval", "HealthCheckNodeState")
STATE_FILE = "cluster.json"
PORT_LOCK = Path("/tmp/healthd-slurm-ports.lock")
PORT_STRIDE = 100


class SlurmClusterError(RuntimeError):
    """The cluster could not be started, stopped or asked; the message says what and shows log tails."""


class SlurmCommandError(SlurmClusterError):
    """A Slurm client exited non-zero (with check=True)."""

    def __init__(self, message: str, result: subprocess.CompletedProcess[str]):
        super().__init__(message)
        self.result = result


class SlurmCommandTimeout(SlurmClusterError):
    """A Slurm client did not answer within its timeout (typically: slurmctld is down)."""


# ----------------------------------------------------------------------------- installation, version


def _which(name: str) -> str | None:
    return shutil.which(name, path=SAFE_PATH)


def _base_env() -> dict[str, str]:
    """The environment every Slurm/munge process gets: nothing inherited but HOME and the locale."""
    env = {"PATH": SAFE_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return env


def ensure_installed() -> None:
    """apt-get install slurm-wlm munge, only when slurmctld, slurmd or munged is missing."""
    missing = [name for name in DAEMONS if _which(name) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmClusterError(
            f"{', '.join(missing)} not installed and this process is not root: "
            "run `apt-get install slurm-wlm munge` as root (or `make deps`)"
        )
    env = dict(_base_env(), DEBIAN_FRONTEND="noninteractive")
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"],
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmClusterError(
                f"`{' '.join(argv)}` failed (rc={proc.returncode}):\n{_tail(proc.stdout + proc.stderr, 30)}"
            )
    still = [name for name in DAEMONS if _which(name) is None]
    if still:
        raise SlurmClusterError(f"installed slurm-wlm and munge, but {', '.join(still)} is still not on {SAFE_PATH}")


@lru_cache(maxsize=None)
def slurm_version() -> tuple[int, int]:
    """(major, minor) of the installed Slurm, e.g. (22, 5) on Debian 12 and (24, 11) on Debian 13."""
    for argv in (["slurmctld", "-V"], ["scontrol", "--version"]):
        exe = _which(argv[0])
        if exe is None:
            continue
        # -V/--version print and exit before reading slurm.conf; SLURM_CONF is set anyway.
        env = dict(_base_env(), SLURM_CONF="/nonexistent/slurm.conf")
        try:
            proc = subprocess.run([exe, *argv[1:]], env=env, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            continue
        match = re.search(r"(\d+)\.(\d+)\.\d+", proc.stdout + proc.stderr)
        if match:
            return int(match.group(1)), int(match.group(2))
    raise SlurmClusterError("cannot tell the Slurm version: neither `slurmctld -V` nor `scontrol --version` answered")


# ----------------------------------------------------------------------------- configuration


def version_specific_config(version: tuple[int, int]) -> tuple[list[str], str | None]:
    """All Slurm-version-dependent configuration, in one place: (extra slurm.conf lines, cgroup.conf or None).

    The generated slurm.conf is otherwise valid unchanged on 22.05 (Debian 12), 24.11 (Debian 13) and 26.05
    (Debian sid), each run by the version matrix (tests/matrix):
    - it names only options present in both (SlurmctldHost, CommunicationParameters=NoCtldInAddrAny,NoInAddrAny,
      PrologFlags=Alloc, SchedulerParameters=nohold_on_prolog_fail, ProctrackType=proctrack/linuxproc,
      SelectType=select/cons_tres, MpiDefault=none, CredType=cred/munge, SlurmdParameters=config_overrides);
    - it leaves out options that only restate the default "none" (AccountingStorageType=
      accounting_storage/none, JobAcctGatherType=jobacct_gather/none, TaskPlugin=task/none): unset means
      none in every release, while the current man page no longer lists accounting_storage/none at all;
    - SelectTypeParameters=CR_Core is explicit because the current man page gives CR_Core_Memory as the
      cons_tres default, which would give a job without --mem the whole node's memory (one job per node).
    """
    slurm_conf: list[str] = []
    cgroup_conf: str | None = None
    if version >= (23, 2):
        # No systemd here (PID 1 is not systemd): without a cgroup.conf, slurmd 24.11 and 26.05 refuse to
        # start ("No filesystem mounted on /sys/fs/cgroup"), even with proctrack/linuxproc and task/none.
        # `CgroupPlugin=disabled` (valid from 23.02) keeps cgroups out; proctrack/linuxproc needs none.
        # 22.05 does not know `disabled` and runs here without any cgroup.conf.
        cgroup_conf = "CgroupPlugin=disabled\n"
    return slurm_conf, cgroup_conf


def is_glob(path: str) -> bool:
    """A hook path that is a glob(7) pattern (`Prolog=/etc/slurm/prolog.d/*`): slurmd runs every match."""
    return any(c in str(path) for c in "*?[")


def _checked_hooks(hooks: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(hooks or {})
    unknown = sorted(set(out) - set(HOOK_KEYS))
    if unknown:
        raise ValueError(f"hooks: unknown key(s) {unknown}; known: {', '.join(HOOK_KEYS)}")
    for key, path in out.items():
        if not Path(path).is_absolute():
            raise ValueError(f"hooks[{key!r}] = {path!r}: Slurm needs an absolute path")
    return out


def _restart_lines(conf_text: str) -> list[str]:
    """The slurm.conf lines a running cluster only takes by restarting (every line but the comments and
    those `scontrol reconfigure` applies at once: RELOADED_KEYS)."""
    reloaded = {k.lower() for k in RELOADED_KEYS}
    return [line for line in conf_text.splitlines()
            if not line.startswith("#") and line.partition("=")[0].strip().lower() not in reloaded]


def _node_names(count: int) -> list[str]:
    return [f"node{i:02d}" for i in range(1, count + 1)]


# ----------------------------------------------------------------------------- process bookkeeping


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live /proc entry, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


def _alive(pid: int, starttime: int | None = None) -> bool:
    """True for a running (not zombie) process that is still the one recorded (same start time)."""
    info = _proc_stat(pid)
    if info is None or info[0] in ("Z", "X"):
        return False
    return starttime is None or info[1] == starttime


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _port_free(port: int, *, lingering_ok: bool = True) -> bool:
    """Whether 127.0.0.1:`port` can be bound. lingering_ok=False: also not while connections of an
    earlier listener linger there (TIME_WAIT), which a daemon binding without SO_REUSEADDR is refused on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if lingering_ok:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(nodes: int = 4, start: int = DEFAULT_PORT_BASE, stride: int = PORT_STRIDE) -> int:
    """The first port base from `start` (in steps of `stride`) whose ports base..base+nodes are all free
    on 127.0.0.1. Free now, not reserved: SlurmCluster(port_base=None) calls it under PORT_LOCK."""
    for base in range(start, 65535 - stride, stride):
        # a block a stopped cluster's connections still linger on is passed over: all three daemons of a
        # Slurm 24.11 cluster started on one were refused their ports ("Address already in use")
        if all(_port_free(p, lingering_ok=False) for p in range(base, base + nodes + 1)):
            return base
    raise SlurmClusterError(f"no free block of {nodes + 1} ports on 127.0.0.1 from {start} on")


@contextlib.contextmanager
def _port_lock(timeout_s: float):
    """Machine-wide lock around "pick free ports, start daemons, wait until they listen"."""
    fd = os.open(PORT_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SlurmClusterError(f"{PORT_LOCK} held by another cluster start for {timeout_s:.0f} s") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


class SlurmCluster:
    """munged + slurmctld + `nodes` slurmd on 127.0.0.1, all state under `root`.

    nodes: node01..nodeNN, each `cpus_per_node` CPUs, 1000 MB and gpu:`gpus_per_node` (fake devices).
    hooks: slurm.conf key -> absolute path of an executable, for the keys in HOOK_KEYS; a key left
        out is not configured. health_check_interval: HealthCheckInterval when a HealthCheckProgram is
        given (0: only when slurmd starts).
        A hook path may also be a glob (`<dir>/prolog.d/*`, for Prolog and Epilog): it is written as
        is and slurmd runs every match (see is_glob); only its directory has to exist.
    extra_conf: slurm.conf lines; `Key=Value` for a generated key replaces its value, others are added.
    port_base: slurmctld's port; node k listens on port_base+k. None: the first free block, picked by
        up() under a machine-wide lock (until then port_base is a provisional value). slurm_user: SlurmUser (drains made by
        slurmctld itself, e.g. "Prolog error", then show this user, drains by root show root).
    """

    def __init__(
        self,
        root: Path,
        nodes: int = 4,
        gpus_per_node: int = 4,
        hooks: Mapping[str, str] | None = None,
        health_check_interval: int = 0,
        extra_conf: str = "",
        *,
        port_base: int | None = None,
        cpus_per_node: int = 4,
        slurm_user: str = "slurm",
    ):
        if nodes < 1 or gpus_per_node < 0 or cpus_per_node < 1:
            raise ValueError(f"nodes={nodes}, gpus_per_node={gpus_per_node}, cpus_per_node={cpus_per_node}: need >=1, >=0, >=1")
        self.root = Path(root).absolute()
        self.nodes = _node_names(nodes)
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.hooks = _checked_hooks(hooks)
        self.health_check_interval = health_check_interval
        self.extra_conf = extra_conf
        self.auto_port = port_base is None
        self.port_base = DEFAULT_PORT_BASE if port_base is None else port_base
        self.slurm_user = slurm_user
        self._popen: dict[int, subprocess.Popen[bytes]] = {}
        self.up_seconds: float | None = None  # how long the last up() took

    # --------------------------------------------------------------- paths
    @property
    def conf_path(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    @property
    def ctld_port(self) -> int:
        return self.port_base

    def node_port(self, node: str) -> int:
        return self.port_base + 1 + self.nodes.index(node)

    def device_dir(self, node: str) -> Path:
        """Where `node`'s fake GPUs live: nvidia0..N-1, character devices c 195 i."""
        return self.root / "dev" / node

    def _log(self, name: str) -> Path:
        return self.root / "log" / f"{name}.log"

    def _mypid(self, name: str) -> Path:
        return self.root / "run" / f"{name}.mypid"

    # --------------------------------------------------------------- environment and clients
    @property
    def env(self) -> dict[str, str]:
        """Environment for any process that may call a Slurm client: SLURM_CONF and a fixed PATH.

        Built from scratch (not os.environ) so no SLURM_* of an outer job, and no resolver variable
        (LOCALDOMAIN, RES_OPTIONS, HOSTALIASES), reaches the clients.
        """
        return dict(_base_env(), SLURM_CONF=str(self.conf_path))

    def run(
        self, argv: Sequence[str], timeout: float = 15, check: bool = False, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (argv list, no shell) with `env`; a client that hangs raises SlurmCommandTimeout."""
        argv = [str(a) for a in argv]
        try:
            result = subprocess.run(
                argv, env=self.env, capture_output=True, text=True, timeout=timeout, input=input, cwd=self.root
            )
        except subprocess.TimeoutExpired as exc:
            ctld = "running" if self._running("slurmctld") else "NOT running"
            raise SlurmCommandTimeout(
                f"`{' '.join(argv)}` gave no answer within {timeout:g} s (slurmctld is {ctld}, port {self.ctld_port})"
            ) from exc
        if check and result.returncode != 0:
            raise SlurmCommandError(
                f"`{' '.join(argv)}` exited {result.returncode}: {(result.stderr or result.stdout).strip()}", result
            )
        return result

    # --------------------------------------------------------------- configuration files
    def slurm_conf_text(self) -> str:
        r = self.root
        version_lines, _ = version_specific_config(slurm_version())
        settings: dict[str, str] = {
            "ClusterName": "healthd",
            "SlurmctldHost": "localhost(127.0.0.1)",
            "SlurmUser": self.slurm_user,
            "SlurmdUser": "root",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmdPort": str(self.node_port(self.nodes[0])),
            "AuthType": "auth/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "CredType": "cred/munge",
            # every daemon binds 127.0.0.1, not 0.0.0.0 (NoInAddrAny alone leaves slurmctld on 0.0.0.0)
            "CommunicationParameters": "NoCtldInAddrAny,NoInAddrAny",
            "StateSaveLocation": f"{r}/spool/ctld",
            "SlurmdSpoolDir": f"{r}/spool/d/%n",
            "SlurmctldPidFile": f"{r}/run/ctld/slurmctld.pid",
            "SlurmdPidFile": f"{r}/run/slurmd-%n.pid",
            "SlurmctldLogFile": str(self._log("slurmctld")),
            "SlurmdLogFile": f"{r}/log/slurmd-%n.log",
            "MailProg": "/bin/true",
            "ProctrackType": "proctrack/linuxproc",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            # a fake node is what slurm.conf says, whatever the CI machine's CPU count
            "SlurmdParameters": "config_overrides",
            "ReturnToService": "2",
            "SlurmdTimeout": "30",
            "KillWait": "5",
            "GresTypes": "gpu",
            "PrologFlags": "Alloc",
            # a job refused by a prolog is requeued without a hold
            "SchedulerParameters": "nohold_on_prolog_fail",
        }
        for key in HOOK_KEYS:
            if key in self.hooks:
                settings[key] = str(self.hooks[key])
        if "HealthCheckProgram" in self.hooks:
            settings["HealthCheckInterval"] = str(self.health_check_interval)
            settings["HealthCheckNodeState"] = "ANY"
        # extra_conf: a `Key=Value` line whose key is generated above replaces that value (keys are
        # case-insensitive, as in Slurm); every other line is appended before the node lines.
        by_lower = {k.lower(): k for k in settings}
        extra_lines: list[str] = []
        for line in self.extra_conf.splitlines():
            stripped = line.strip()
            key, _, value = stripped.partition("=")
            if value and key.strip().lower() in by_lower:
                settings[by_lower[key.strip().lower()]] = value.strip()
            elif stripped:
                extra_lines.append(stripped)
        lines = ["# generated by tests/support/slurm_cluster.py; do not edit (rewritten by up())"]
        lines += [f"{k}={v}" for k, v in settings.items()]
        if version_lines:
            lines.append(f"# Slurm {'.'.join(map(str, slurm_version()))} specific")
            lines += version_lines
        lines += extra_lines
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={self.node_port(node)} "
                f"CPUs={self.cpus_per_node} RealMemory=1000"
                + (f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else "")
                + " State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def gres_conf_text(self) -> str:
        lines = ["AutoDetect=off"]
        if self.gpus_per_node:
            last = self.gpus_per_node - 1
            files = "nvidia0" if last == 0 else f"nvidia[0-{last}]"
            for node in self.nodes:
                lines.append(f"NodeName={node} Name=gpu File={self.device_dir(node)}/{files}")
        return "\n".join(lines) + "\n"

    def write_config(self) -> Path:
        """Write etc/slurm.conf, gres.conf (and cgroup.conf where the version needs it); return slurm.conf."""
        etc = self.root / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self.slurm_conf_text())
        (etc / "gres.conf").write_text(self.gres_conf_text())
        _, cgroup_conf = version_specific_config(slurm_version())
        cgroup = etc / "cgroup.conf"
        if cgroup_conf is not None:
            cgroup.write_text(cgroup_conf)
        elif cgroup.exists():
            cgroup.unlink()
        for path in (etc, self.conf_path, etc / "gres.conf"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        (self.root / STATE_FILE).write_text(
            json.dumps(
                {
                    "nodes": len(self.nodes),
                    "gpus_per_node": self.gpus_per_node,
                    "cpus_per_node": self.cpus_per_node,
                    "hooks": self.hooks,
                    "health_check_interval": self.health_check_interval,
                    "extra_conf": self.extra_conf,
                    "port_base": self.port_base,
                    "slurm_user": self.slurm_user,
                },
                indent=1,
            )
        )
        return self.conf_path

    @classmethod
    def from_root(cls, root: Path) -> "SlurmCluster":
        """The cluster described by root/cluster.json (written by up()), for the CLI's down/status."""
        root = Path(root)
        try:
            saved = json.loads((root / STATE_FILE).read_text())
        except FileNotFoundError:
            return cls(root)
        return cls(root, **saved)

    # --------------------------------------------------------------- process records
    def _record(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self._popen[proc.pid] = proc
        info = _proc_stat(proc.pid)
        start = info[1] if info else 0
        self._mypid(name).write_text(f"{proc.pid} {start}\n")

    def _recorded(self, name: str) -> tuple[int, int] | None:
        try:
            pid, start = self._mypid(name).read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return int(pid), int(start)

    def _running(self, name: str) -> bool:
        rec = self._recorded(name)
        if rec is None:
            return False
        proc = self._popen.get(rec[0])
        if proc is not None:
            proc.poll()  # reaps our own exited child, so it does not linger as a zombie
        return _alive(*rec)

    def _names(self) -> list[str]:
        return ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)]

    def pids(self) -> dict[str, int]:
        """PIDs this cluster started (recorded under run/), running or not."""
        out = {}
        for name in self._names():
            rec = self._recorded(name)
            if rec:
                out[name] = rec[0]
        return out

    def is_up(self) -> bool:
        """All daemons recorded and running (does not ask Slurm anything)."""
        return all(self._running(name) for name in self._names())

    # --------------------------------------------------------------- logs
    def logs(self, name: str) -> str:
        """Log text of 'slurmctld', 'munged', 'slurmd-node01' (or just 'node01'), plus its stdout/stderr."""
        if name in self.nodes:
            name = f"slurmd-{name}"
        text = ""
        for path in (self._log(name), self.root / "log" / f"{name}.stdout"):
            try:
                content = path.read_text(errors="replace")
            except FileNotFoundError:
                continue
            if content.strip():
                text += (f"--- {path.name} ---\n" if text else "") + content
        return text

    def _diagnostics(self, names: Sequence[str] | None = None, lines: int = 25) -> str:
        parts = []
        for name in names or self._names():
            text = self.logs(name)
            if text.strip():
                parts.append(f"==== {name} (last {lines} lines) ====\n{_tail(text, lines)}")
        return "\n".join(parts) or "(no log output)"

    # --------------------------------------------------------------- start
    def _preflight(self) -> None:
        for name in DAEMONS:
            if _which(name) is None:
                raise SlurmClusterError(f"{name} is not installed: call ensure_installed() or `make deps`")
        if os.geteuid() != 0:
            raise SlurmClusterError("a Slurm test cluster must be started as root (slurmd runs jobs as any user)")
        # munged refuses a socket below a directory that is not searchable by all, and
        # slurmctld, dropped to SlurmUser, must reach its state dir and that socket.
        for parent in [self.root, *self.root.parents]:
            mode = parent.stat().st_mode
            if mode & 0o111 != 0o111:
                raise SlurmClusterError(
                    f"{parent} (mode {oct(mode & 0o777)}) is not searchable by all, so munged and slurmctld "
                    f"(SlurmUser={self.slurm_user}) cannot use {self.root}: chmod a+x {parent}, or pick a root "
                    "whose parents are searchable (e.g. under /tmp)"
                )
        for key, path in self.hooks.items():
            if is_glob(path):
                # Prolog=/etc/slurm/prolog.d/* style: slurmd runs every match; the directory must exist
                if not Path(path).parent.is_dir():
                    raise SlurmClusterError(f"hooks[{key!r}] = {path}: {Path(path).parent} is not a directory")
                continue
            if not os.access(path, os.X_OK):
                raise SlurmClusterError(f"hooks[{key!r}] = {path}: not an executable file")
        busy = [p for p in (self.ctld_port, *(self.node_port(n) for n in self.nodes)) if not _port_free(p)]
        if busy:
            raise SlurmClusterError(
                f"127.0.0.1 port(s) {busy} already in use (another cluster? `python -m tests.support.slurm_cluster "
                f"status`); give this one another port_base (now {self.port_base}) or port_base=None"
            )

    def _prepare_dirs(self, fresh: bool) -> None:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        r.chmod(r.stat().st_mode | 0o755)
        if fresh:
            for sub in ("spool", "log"):
                shutil.rmtree(r / sub, ignore_errors=True)
        for sub in ("etc", "log", "run", "run/ctld", "spool/ctld", "munge", "dev"):
            (r / sub).mkdir(parents=True, exist_ok=True)
            (r / sub).chmod(0o755)
        for node in self.nodes:
            (r / "spool" / "d" / node).mkdir(parents=True, exist_ok=True)
            self._make_devices(node)
        if self.slurm_user != "root":
            try:
                uid = pwd.getpwnam(self.slurm_user).pw_uid
            except KeyError as exc:
                raise SlurmClusterError(
                    f"SlurmUser {self.slurm_user!r} does not exist (the slurm-wlm package creates 'slurm'); "
                    "pass slurm_user='root'"
                ) from exc
            ctld_log = self._log("slurmctld")
            ctld_log.touch()
            for path in (r / "spool" / "ctld", r / "run" / "ctld", ctld_log):
                os.chown(path, uid, -1)

    def _make_devices(self, node: str) -> None:
        ddir = self.device_dir(node)
        ddir.mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus_per_node):
            dev = ddir / f"nvidia{i}"
            if dev.exists():
                if stat.S_ISCHR(dev.stat().st_mode):
                    continue
                dev.unlink()
            try:
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
            except OSError as exc:
                raise SlurmClusterError(
                    f"mknod {dev} c {NVIDIA_MAJOR} {i} failed ({exc.strerror}): slurmd only accepts character "
                    "devices as GPU files; this needs root with CAP_MKNOD"
                ) from exc

    def _write_munge_key(self) -> None:
        key = self.root / "munge" / "munge.key"
        if key.exists():
            return
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(1024))

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        try:
            proc = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()
        self._record(name, proc)
        return proc

    def _start_munged(self) -> None:
        sock = self.munge_socket
        for stale in (sock, Path(f"{sock}.lock")):
            if stale.exists():
                stale.unlink()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                f"--socket={sock}",
                f"--key-file={m / 'munge.key'}",
                f"--log-file={self._log('munged')}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not sock.exists():
            if not self._running("munged"):
                raise SlurmClusterError(f"munged exited at start:\n{self._diagnostics(['munged'])}")
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"munged did not create {sock} within 10 s:\n{self._diagnostics(['munged'])}")
            time.sleep(0.05)

    def _start_ctld_process(self) -> None:
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf_path)])

    def _start_slurmd_process(self, node: str) -> None:
        self._spawn(f"slurmd-{node}", [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf_path)])

    def up(self, timeout_s: float = 60, *, idle: bool = True) -> None:
        """Start munged, slurmctld and every slurmd; return when all nodes are idle.

        Already up: does nothing. Nothing running: a fresh cluster (state and logs wiped). Partly up:
        starts what is missing, keeping slurmctld's state. On failure everything is stopped and the
        error shows the tail of each log. idle=False returns once every node has registered, drained
        or not (for a HealthCheckProgram that drains a node as soon as slurmd starts).
        """
        if self.is_up():
            return
        fresh = not any(self._running(name) for name in self._names())
        started = time.monotonic()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # every fresh start holds the lock, so an automatic pick never takes ports being bound
            with _port_lock(timeout_s) if fresh else contextlib.nullcontext():
                if fresh and self.auto_port:
                    self.port_base = free_port_base(len(self.nodes))
                if fresh:
                    self._preflight()
                self._prepare_dirs(fresh)
                self.write_config()
                self._write_munge_key()
                if not self._running("munged"):
                    self._start_munged()
                if not self._running("slurmctld"):
                    self._start_ctld_process()
                for node in self.nodes:
                    if not self._running(f"slurmd-{node}"):
                        self._start_slurmd_process(node)
                left = timeout_s - (time.monotonic() - started)
                self.wait_idle(left) if idle else self.wait_registered(left)
        except BaseException:
            try:
                self.down()
            except SlurmClusterError:
                pass  # the original error says more
            raise
        self.up_seconds = time.monotonic() - started

    def _check_daemons(self, names: Sequence[str]) -> None:
        dead = [name for name in names if not self._running(name)]
        if dead:
            raise SlurmClusterError(f"{', '.join(dead)} exited:\n{self._diagnostics(dead)}")

    def sinfo_states(self, timeout: float = 3) -> dict[str, str]:
        """node -> sinfo %T state ('idle', 'drained', 'idle*', 'down*', 'mixed', ...)."""
        result = self.run(["sinfo", "-h", "-N", "-o", "%N|%T"], timeout=timeout, check=True)
        states = {}
        for line in result.stdout.splitlines():
            if "|" in line:
                node, state = line.strip().split("|", 1)
                states[node] = state
        return states

    def wait_idle(self, timeout_s: float = 30, nodes: Sequence[str] | None = None) -> None:
        """Poll (sinfo bounded by 3 s, daemons checked each round) until `nodes` (default all) are exactly idle.

        Exactly 'idle': not 'idle*' (not responding) and not drained (sinfo -t idle would count those).
        """
        self._wait_nodes(lambda state: state == "idle", "idle", timeout_s, nodes)

    def wait_registered(self, timeout_s: float = 30, nodes: Sequence[str] | None = None) -> None:
        """Like wait_idle, but any state of a node whose slurmd has registered and responds will do
        (idle, drained, mixed...; not 'unknown', not 'down', no trailing '*')."""
        self._wait_nodes(
            lambda state: not state.endswith("*") and not state.startswith(("unknown", "down")),
            "registered",
            timeout_s,
            nodes,
        )

    def _wait_nodes(
        self, good: Callable[[str], bool], what: str, timeout_s: float, nodes: Sequence[str] | None
    ) -> None:
        nodes = list(nodes or self.nodes)
        deadline = time.monotonic() + max(timeout_s, 1)
        last: object = "no answer yet"
        while True:
            self._check_daemons(["munged", "slurmctld", *(f"slurmd-{n}" for n in nodes)])
            try:
                states = self.sinfo_states()
                last = {n: states.get(n, "missing") for n in nodes}
                if all(n in states and good(states[n]) for n in nodes):
                    return
            except SlurmClusterError as exc:
                last = exc
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"nodes not {what} within {timeout_s:.0f} s (last: {last}):\n{self._diagnostics()}"
                )
            time.sleep(0.2)

    # --------------------------------------------------------------- stop
    def _stop(self, names: Sequence[str]) -> None:
        """TERM the recorded PIDs, wait up to 5 s, KILL what is left; zombies count as dead."""
        targets = []
        for name in names:
            rec = self._recorded(name)
            if rec and self._running(name):
                targets.append((name, rec))
                try:
                    os.kill(rec[0], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        while any(self._running(n) for n, _ in targets) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name, (pid, _) in targets:
            if self._running(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        while any(self._running(n) for n, _ in targets) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _name, (pid, _) in targets:
            proc = self._popen.pop(pid, None)
            if proc is not None:
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
        still = [n for n, _ in targets if self._running(n)]
        if still:
            raise SlurmClusterError(f"{', '.join(still)} survived SIGKILL")

    def job_processes(self) -> list[int]:
        """Running slurmstepd processes of this cluster (their SLURM_CONF is ours, or, from Slurm 24.11 on,
        whose environment has none, their working directory is our root, slurmd's) and everything below
        them: what a job leaves behind when its slurmd dies (proctrack/linuxproc keeps steps running)."""
        marker = f"SLURM_CONF={self.conf_path}".encode()
        children: dict[int, list[int]] = {}
        steps = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(pid)
                if (entry / "comm").read_text().strip() == "slurmstepd" and (
                    marker in (entry / "environ").read_bytes().split(b"\0")
                    or Path(os.readlink(entry / "cwd")) == self.root
                ):
                    steps.append(pid)
            except (OSError, IndexError, ValueError):
                continue
        found, todo = [], list(steps)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.append(pid)
                todo.extend(children.get(pid, []))
        return [p for p in found if _alive(p)]

    def down(self) -> None:
        """Stop everything this cluster started: jobs (scancel), slurmd, slurmctld, munged. Never by name."""
        if self._running("slurmctld"):
            try:
                jobs = self.run(["squeue", "-h", "-o", "%i"], timeout=5).stdout.split()
                if jobs:
                    self.run(["scancel", *jobs], timeout=5)
                    self.wait_for(
                        lambda: not self.run(["squeue", "-h", "-t", "R,CG", "-o", "%i"], timeout=3).stdout.split(),
                        timeout=10,
                        what="cancelled jobs to end",
                    )
            except SlurmClusterError:
                pass  # stopping must not depend on Slurm answering
        errors = []
        for step in (
            lambda: self._stop([f"slurmd-{n}" for n in self.nodes]),
            self._kill_job_processes,
            lambda: self._stop(["slurmctld"]),
            lambda: self._stop(["munged"]),
            self._stop_munged_by_pidfile,
        ):
            try:
                step()
            except (SlurmClusterError, OSError) as exc:  # stop the rest anyway
                errors.append(str(exc))
        if errors:
            raise SlurmClusterError("down() left something running: " + "; ".join(errors))

    def _kill_job_processes(self) -> None:
        for pid in self.job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stop_munged_by_pidfile(self) -> None:
        """munged's own pidfile, for a munged not started through _spawn (only if it serves our socket)."""
        try:
            pid = int((self.root / "munge" / "munged.pid").read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
            return
        if not _alive(pid) or not any(arg.endswith(str(self.munge_socket).encode()) for arg in cmdline):
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)

    # --------------------------------------------------------------- another configuration, a clean slate
    def reconfigure(
        self,
        *,
        hooks: Mapping[str, str] | None = None,
        health_check_interval: int | None = None,
        extra_conf: str | None = None,
        timeout_s: float = 60,
    ) -> str:
        """Run the cluster with another configuration (arguments as the constructor's; None keeps the
        current value); a cluster that is not up only gets its slurm.conf written. Only hooks and
        HealthCheckInterval changed: `scontrol reconfigure` (slurmd runs the new hooks from the next job
        or health check on; a caller that must know when waits for one of its own hooks to run).
        Anything else: slurmctld and every slurmd restart on their saved state (munged, node states and
        jobs' records stay), like a site's restart after a slurm.conf change, and this returns once every
        node has registered. Returns what it did: "" (nothing changed), "written" (not running),
        "reloaded" or "restarted"."""
        # what the running daemons read, whatever attributes a caller changed since
        before = self.conf_path.read_text() if self.conf_path.is_file() else ""
        if hooks is not None:
            checked = _checked_hooks(hooks)
            for key, path in checked.items():
                if not is_glob(path) and not os.access(path, os.X_OK):
                    raise SlurmClusterError(f"hooks[{key!r}] = {path}: not an executable file")
            self.hooks = checked
        if health_check_interval is not None:
            self.health_check_interval = health_check_interval
        if extra_conf is not None:
            self.extra_conf = extra_conf
        after = self.slurm_conf_text()
        if after == before:
            return ""
        self.write_config()
        if not self._running("slurmctld"):
            return "written"
        if _restart_lines(after) == _restart_lines(before):
            self.run(["scontrol", "reconfigure"], timeout=30, check=True)
            return "reloaded"
        self._stop([f"slurmd-{n}" for n in self.nodes])
        self._stop(["slurmctld"])
        self._start_ctld_process()
        for node in self.nodes:
            self._start_slurmd_process(node)
        self.wait_registered(timeout_s)
        return "restarted"

    def clean(self, timeout_s: float = 60) -> None:
        """Put the cluster back as a fresh one is: every daemon running (a stopped slurmctld continued),
        no job, no reservation, no reboot pending, every node resumed, undrained, weight 1 and idle.
        Keeps the configuration (see reconfigure)."""
        self._continue_ctld()
        self.up(timeout_s, idle=False)  # starts whatever is not running, on the saved state
        jobs = self.run(["squeue", "-h", "-o", "%i"], timeout=15, check=True).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], timeout=15)
            self.wait_for(lambda: not self.run(["squeue", "-h", "-o", "%i"], timeout=10).stdout.split(), timeout_s,
                          what="every job to end")
        for line in self.run(["scontrol", "show", "reservation", "-o"], timeout=10).stdout.splitlines():
            if line.startswith("ReservationName="):
                name = line.split()[0].split("=", 1)[1]
                self.run(["scontrol", "delete", f"ReservationName={name}"], timeout=10)
        for node in self.nodes:
            info = self.node_state(node)
            state = info.get("State", "")
            if "REBOOT_REQUESTED" in state:
                self.run(["scontrol", "cancel_reboot", node], timeout=10)
                info = self.node_state(node)
                state = info.get("State", "")
            if any(flag in state for flag in ("DRAIN", "DOWN", "FAIL", "REBOOT")) or info.get("Reason"):
                self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=10)
            if info.get("Weight", "1") != "1":
                self.run(["scontrol", "update", f"NodeName={node}", "Weight=1"], timeout=10)
        self.wait_idle(timeout_s)

    def _continue_ctld(self) -> None:
        """SIGCONT slurmctld (a test may have left it stopped with SIGSTOP)."""
        rec = self._recorded("slurmctld")
        if rec is not None and self._running("slurmctld"):
            try:
                os.kill(rec[0], signal.SIGCONT)
            except ProcessLookupError:
                pass

    # --------------------------------------------------------------- helpers for tests
    def stop_ctld(self) -> None:
        """Stop slurmctld (its state is saved under spool/ctld); the slurmd keep running."""
        self._stop(["slurmctld"])

    def start_ctld(self, timeout_s: float = 30) -> None:
        """Start slurmctld again with its saved state; return when it answers and every node whose slurmd
        runs has registered again (about 4 s: until then such a node shows 'unknown')."""
        if not self._running("slurmctld"):
            self._start_ctld_process()
        self.wait_registered(timeout_s, [n for n in self.nodes if self._running(f"slurmd-{n}")])

    def kill_slurmd(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Kill `node`'s slurmd (default SIGKILL, a crash) and wait until it is gone."""
        name = f"slurmd-{node}"
        rec = self._recorded(name)
        if rec is None or not self._running(name):
            raise SlurmClusterError(f"slurmd of {node} is not running")
        os.kill(rec[0], sig)
        self.wait_for(lambda: not self._running(name), STOP_GRACE_S, what=f"slurmd of {node} to exit")
        proc = self._popen.pop(rec[0], None)
        if proc is not None:
            proc.wait(timeout=1)

    def start_slurmd(self, node: str, timeout_s: float = 30) -> None:
        """Start `node`'s slurmd again; return when slurmctld sees the node registered."""
        if not self._running(f"slurmd-{node}"):
            self._start_slurmd_process(node)
        self.wait_registered(timeout_s, [node])

    def node_state(self, node: str) -> dict[str, str]:
        """`scontrol show node -o NODE` as a dict; Reason is split into Reason, ReasonUser and ReasonTime."""
        result = self.run(["scontrol", "show", "node", "-o", node], timeout=10, check=True)
        line = result.stdout.strip()
        if not line:
            raise SlurmClusterError(f"scontrol show node {node}: empty answer")
        return parse_node_line(line)

    def wait_for(
        self, predicate: Callable[[], T], timeout: float = 30, interval: float = 0.2, what: str = "condition"
    ) -> T:
        """Poll `predicate` until it returns something truthy (and return that), or raise after `timeout` s."""
        return poll(predicate, timeout, what, interval=interval, error=SlurmClusterError)

    def status(self) -> str:
        """One line per daemon (pid, running or not) and, when slurmctld runs, `sinfo -N`."""
        lines = [f"root {self.root}  slurm.conf {self.conf_path}  ctld port {self.ctld_port}"]
        for name in self._names():
            rec = self._recorded(name)
            state = "running" if self._running(name) else "stopped"
            lines.append(f"{name:16} {rec[0] if rec else '-':>8}  {state}")
        if self._running("slurmctld"):
            try:
                lines.append(self.run(["sinfo", "-N", "-o", "%N %T %G %E"], timeout=5).stdout.rstrip())
            except SlurmClusterError as exc:
                lines.append(f"sinfo: {exc}")
        return "\n".join(lines)


_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.]*)=")
_REASON_BY = re.compile(r"\s*\[([^\[\]@\s]+)@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\]")


def held_view(state: dict[str, str]) -> dict[str, str]:
    """A node_state dict as healthd reads a node: without Reason, ReasonUser and ReasonTime unless the
    State holds DRAIN, DOWN or FAIL (healthd.slurmtext.reason_holds). Slurm 24.11 keeps the last reason
    after RESUME on a node that is IDLE again, until it runs a job; 22.05 and 26.05 clear it. A test that
    asks whether a node is held compares this view, the same on every release."""
    base, flags = parse_state_string(state.get("State", "") or "UNKNOWN")
    if reason_holds(base, flags):
        return dict(state)
    return {k: v for k, v in state.items() if k not in ("Reason", "ReasonUser", "ReasonTime")}


def parse_node_line(line: str) -> dict[str, str]:
    """Parse one `scontrol show node -o` line. Values may contain spaces (OS=, Reason=), so a key starts
    only at `Word=` after whitespace; the free-text Reason runs up to its ` [user@time]` suffix."""
    reason: dict[str, str] = {}
    rest = ""
    at = line.find(" Reason=")
    if at >= 0:
        text = line[at + len(" Reason=") :]
        line = line[:at]
        by = _REASON_BY.search(text)
        if by:
            reason = {"Reason": text[: by.start()].strip(), "ReasonUser": by.group(1), "ReasonTime": by.group(2)}
            rest = text[by.end() :]
        else:
            reason = {"Reason": text.strip()}
    out: dict[str, str] = {}
    for chunk in (line, rest):
        keys = list(_KEY.finditer(chunk))
        for i, match in enumerate(keys):
            end = keys[i + 1].start() if i + 1 < len(keys) else len(chunk)
            out[match.group(1)] = chunk[match.end() : end].strip()
    out.update(reason)
    return out


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.slurm_cluster", description="A local Slurm test cluster on 127.0.0.1."
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"state directory (default {DEFAULT_ROOT})")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            ensure_installed()
            cluster = SlurmCluster(
                args.root, nodes=args.nodes, gpus_per_node=args.gpus_per_node, port_base=args.port_base
            )
            if cluster.is_up():
                print(f"already up\n{cluster.status()}")
                return 0
            cluster.up(args.timeout)
            print(f"up in {cluster.up_seconds:.1f} s\n{cluster.status()}")
            print(f"export SLURM_CONF={cluster.conf_path}")
        elif args.command == "down":
            cluster = SlurmCluster.from_root(args.root)
            cluster.down()
            print(f"down: {cluster.root}")
        else:
            cluster = SlurmCluster.from_root(args.root)
            print(cluster.status())
            return 0 if cluster.is_up() else 3
    except SlurmClusterError as exc:
        print(f"slurm_cluster {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
