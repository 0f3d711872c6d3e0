"""Slurm accounting for the local test cluster: a real MariaDB (mariadbd, from Debian's mariadb-server)
and a real slurmdbd, both on 127.0.0.1 under one directory, started and stopped by PID.

    db = AccountingDB(root)
    cluster = SlurmCluster(root, ..., extra_conf=db.slurm_conf_lines(root / "munge" / "munge.sock"))
    db.start(cluster)                       # before the cluster: slurmctld needs slurmdbd at start
    cluster.up()
    db.wait_registered(cluster)
    ...
    cluster.down(); db.stop()

slurmdbd gets a munged of its own with the cluster's key (written here first; SlurmCluster keeps a key
it finds), since the cluster's munged starts with the cluster, after slurmdbd.
mariadbd runs as root (`--user=root`) with its data under `root/mysql`, listening on a free loopback
port; slurmdbd connects to it over TCP as a user with a password (the socket's root login is
`unix_socket` only). slurmdbd runs as the cluster's SlurmUser from the slurmdbd.conf beside the cluster's slurm.conf (0600,
owned by that user, as slurmdbd requires).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.support.polling import free_port

STOP_GRACE_S = 10.0
DB_USER = "slurm"
DB_NAME = "slurm_acct_db"


class AccountingError(RuntimeError):
    pass


def installed() -> str | None:
    """The first of mariadbd, mariadb-install-db, slurmdbd, sacct that is missing; None when all are there."""
    for exe in ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacct", "sacctmgr"):
        if shutil.which(exe, path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            return exe
    return None


def _exe(name: str) -> str:
    found = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise AccountingError(f"{name} is not installed (make deps installs mariadb-server and slurmdbd)")
    return found


class AccountingDB:
    def __init__(self, root: Path, slurm_user: str = "slurm"):
        self.root = Path(root).absolute()
        self.slurm_user = slurm_user
        self.db_port = free_port()
        self.dbd_port = free_port()
        self.password = os.urandom(12).hex()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def socket(self) -> Path:
        return self.root / "mysql" / "mysqld.sock"

    conf: Path | None = None
    """slurmdbd.conf: beside the cluster's slurm.conf, where slurmdbd looks for it (SLURM_CONF's directory)."""

    def slurm_conf_lines(self, munge_socket: Path) -> str:
        """The cluster's slurm.conf lines for accounting; `munge_socket`: the cluster's munged, which
        slurmctld signs its connection to slurmdbd with (AccountingStoragePass names it)."""
        return "\n".join([
            "AccountingStorageType=accounting_storage/slurmdbd",
            f"AccountingStoragePass={munge_socket}",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}",
            "JobAcctGatherType=jobacct_gather/none",
        ])

    def log(self, name: str) -> str:
        try:
            return (self.root / "log" / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ MariaDB

    def start_mariadb(self, timeout_s: float = 60) -> None:
        data = self.root / "mysql" / "data"
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        if not data.exists():
            data.mkdir(parents=True)
            done = subprocess.run([_exe("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
                                   "--auth-root-authentication-method=socket", "--skip-test-db"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise AccountingError(f"mariadb-install-db failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        self._spawn("mariadbd", [_exe("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=root",
                                 f"--socket={self.socket}", f"--port={self.db_port}", "--bind-address=127.0.0.1",
                                 f"--pid-file={self.root / 'mysql' / 'mariadbd.pid'}",
                                 f"--log-error={self.root / 'log' / 'mariadbd.log'}", "--skip-name-resolve",
                                 "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=48M"])
        self._wait(lambda: self._sql("SELECT 1", check=False).returncode == 0, timeout_s, "mariadbd",
                   "to answer on its socket")
        # the database exists before slurmdbd's first start: slurmdbd 24.11.5 creating it itself with
        # libmariadb3 1:11.8.9 (Debian 13) exits at its first query on the new connection (error 5027,
        # "Number of columns in result (=1) ... maximum allowed ... (=0)"); started on an existing
        # database it runs (docs/slurm.md)
        self._sql(f"CREATE DATABASE IF NOT EXISTS {DB_NAME}; "
                  f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.password}'; "
                  f"ALTER USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.password}'; "
                  f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;")

    def _sql(self, statements: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([_exe("mariadb"), "--no-defaults", f"--socket={self.socket}", "-u", "root", "-e",
                               statements], capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise AccountingError(f"mariadb: {statements[:80]}: {done.stderr[-1000:]}")
        return done

    # ------------------------------------------------------------------ slurmdbd

    def start(self, cluster, timeout_s: float = 60) -> None:
        """munged (the cluster's key), mariadbd, then slurmdbd; returns once slurmdbd listens."""
        key = cluster.root / "munge" / "munge.key"
        key.parent.mkdir(parents=True, exist_ok=True)
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(os.urandom(1024))
        self._start_munged(key, timeout_s)
        self.start_mariadb(timeout_s)
        self.start_slurmdbd(cluster, timeout_s)

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    def _start_munged(self, key: Path, timeout_s: float) -> None:
        m = self.root / "munge"
        m.mkdir(parents=True, exist_ok=True)
        os.chmod(m, 0o755)
        self._spawn("munged", [_exe("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
                               f"--seed-file={m / 'munged.seed'}"])
        self._wait(self.munge_socket.exists, timeout_s, "munged", f"to create {self.munge_socket}")

    def start_slurmdbd(self, cluster, timeout_s: float = 60) -> None:
        """slurmdbd (with this munged); returns once it listens."""
        user = pwd.getpwnam(self.slurm_user)
        self.conf = cluster.conf_path.parent / "slurmdbd.conf"
        self.conf.parent.mkdir(parents=True, exist_ok=True)
        (self.root / "run").mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "DbdHost=localhost",
            "DbdAddr=127.0.0.1",
            f"DbdPort={self.dbd_port}",
            f"SlurmUser={self.slurm_user}",
            "DebugLevel=info",
            f"LogFile={self.root / 'log' / 'slurmdbd.log'}",
            f"PidFile={self.root / 'run' / 'slurmdbd.pid'}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={self.db_port}",
            f"StorageUser={DB_USER}",
            f"StoragePass={self.password}",
            f"StorageLoc={DB_NAME}",
            "",
        ]))
        os.chown(self.conf, user.pw_uid, user.pw_gid)
        os.chmod(self.conf, 0o600)
        for d in (self.root / "log", self.root / "run"):
            os.chown(d, user.pw_uid, user.pw_gid)
        self._spawn("slurmdbd", [_exe("slurmdbd"), "-D"], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C",
                                                              "SLURM_CONF": str(cluster.conf_path)})
        self._wait(lambda: self._listening(), timeout_s, "slurmdbd", f"to listen on 127.0.0.1:{self.dbd_port}")

    def wait_registered(self, cluster, timeout_s: float = 60) -> None:
        """Until sacctmgr lists the cluster with slurmctld's port (slurmctld registered with slurmdbd)."""

        def registered() -> bool:
            out = cluster.run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster,controlport"], timeout=10,
                              check=False)
            return any(line.split("|")[:1] == ["healthd"] and line.split("|")[1] not in ("", "0")
                       for line in out.stdout.splitlines())

        self._wait(registered, timeout_s, "slurmctld", "to register with slurmdbd", cluster=cluster)

    def _listening(self) -> bool:
        import socket

        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.dbd_port)) == 0

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        with open(self.root / "log" / f"{name}.stdout", "ab") as out:
            self._procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True, cwd=self.root,
                                                 env=env or {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"})

    def _wait(self, ready, timeout_s: float, name: str, what: str, cluster=None) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise AccountingError(f"{name} exited ({proc.returncode}):\n{self.log(name)}\n{self._stdout(name)}")
            if time.monotonic() > deadline:
                extra = cluster.logs("slurmctld")[-2000:] if cluster is not None else ""
                raise AccountingError(f"{name}: waited {timeout_s:.0f} s {what}:\n{self.log(name)}\n"
                                      f"{self._stdout(name)}\n{extra}")
            time.sleep(0.2)

    def _stdout(self, name: str) -> str:
        try:
            return (self.root / "log" / f"{name}.stdout").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self._procs.items() if p.poll() is None}

    def stop(self) -> None:
        """TERM slurmdbd, mariadbd, then munged by PID, KILL what is left after STOP_GRACE_S."""
        for name in ("slurmdbd", "mariadbd", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_GRACE_S)
