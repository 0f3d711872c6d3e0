"""A stand-in for pyslurm 25.11, for the backend contract suite (tests/slurm/contract.py).

Its public names and signatures are pyslurm 25.11.2's for the calls healthd.slurm.pyslurm_backend
makes (read from the pyslurm-25.11.2 sdist: pyslurm/__init__.py, core/node.pyx, core/job/job.pyx,
core/reservation.pyx, core/error.pyx, core/slurmctld/config.pyx, utils/enums.pyx):
`Nodes.load()`, `Node(name, **kwargs)`, `Node.load(name)`, `Node.modify(changes)`, `Job(job_id)`,
`Job.requeue(hold=False)`, `Reservation(name=None, **kwargs)`, `.create()`, `.delete()`,
`ReservationFlags`, `slurmctld.Config.load().version`, `RPCError(errno, msg)`, `slurm_init`,
`__version__`. Behind them is an in-memory cluster whose answers copy what a real slurmctld 22.05
answered for the same requests (drain, RESUME not idempotent, reboot ASAP, cancel_reboot, requeue,
reservations, controller down).

Everything starting with `_standin` is test control, not pyslurm API: tests reset and inspect the
fake cluster through it. Import this package only by putting its parent directory first on
sys.path inside a test (tests/slurm/test_backend_contract.py); nothing else may see it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ClusterShell.NodeSet import NodeSet

from . import slurmctld  # noqa: F401 - pyslurm.slurmctld, as in the real package

__version__ = "25.11.2"

SLURM_ERROR = -1
# slurm/slurm_errno.h
SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR = 1800
ESLURM_INVALID_JOB_ID = 2017
ESLURM_INVALID_NODE_NAME = 2018
ESLURM_INVALID_NODE_STATE = 2028
ESLURM_RESERVATION_INVALID = 2043
ESLURM_RESERVATION_NAME_DUP = 2049

_MESSAGES = {
    SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR: "Unable to contact slurm controller (connect failure)",
    ESLURM_INVALID_JOB_ID: "Invalid job id specified",
    ESLURM_INVALID_NODE_NAME: "Invalid node name specified",
    ESLURM_INVALID_NODE_STATE: "Invalid node state specified",
    ESLURM_RESERVATION_INVALID: "Requested reservation is invalid",
    ESLURM_RESERVATION_NAME_DUP: "Duplicate reservation name",
}


class PyslurmError(Exception):
    """The base Exception for all Pyslurm errors."""


class RPCError(PyslurmError):
    def __init__(self, errno=SLURM_ERROR, msg=None):
        self.msg = msg
        self.errno = errno
        if not msg:
            self.msg = _MESSAGES.get(errno, "Unspecified error")
        super().__init__(self.msg)


def slurm_init(config_path=None):
    _standin.init_path = config_path


def slurm_fini():
    pass


# --------------------------------------------------------------------------------- the fake cluster


@dataclass
class _NodeRec:
    name: str
    base: str = "IDLE"
    flags: set[str] = field(default_factory=set)
    reason: str | None = None
    reason_user: str | None = None
    reason_time: int | None = None
    next_state: str | None = None
    partitions: list[str] = field(default_factory=lambda: ["debug"])
    gres: dict = field(default_factory=lambda: {"gpu": 4})
    boot_time: int | None = None


@dataclass
class _Standin:
    nodes: dict[str, _NodeRec] = field(default_factory=dict)
    jobs: dict[int, dict] = field(default_factory=dict)
    reservations: dict[str, dict] = field(default_factory=dict)
    ctld_up: bool = True
    hang_s: float = 0.0  # every RPC sleeps this long first (a slow slurmctld)
    user: str = "root"
    version: str = "25.11.2"
    init_path: str | None = None
    calls: list[str] = field(default_factory=list)
    next_job_id: int = 1

    def rpc(self, what: str) -> None:
        self.calls.append(what)
        if self.hang_s:
            time.sleep(self.hang_s)
        if not self.ctld_up:
            raise RPCError(SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR)

    def expand(self, names: str) -> list[str]:
        out = list(NodeSet(names))
        for n in out:
            if n not in self.nodes:
                raise RPCError(ESLURM_INVALID_NODE_NAME)
        return out


_standin = _Standin()


def _standin_reset(nodes=("node01", "node02", "node03", "node04")) -> _Standin:
    """Test control: a fresh fake cluster with idle nodes; returns it for inspection."""
    global _standin
    _standin = _Standin(nodes={n: _NodeRec(n) for n in nodes})
    return _standin


def _standin_cluster() -> _Standin:
    return _standin


def _standin_submit(node: str, comment: str = "") -> int:
    """Test control: a running batch job on `node` (the node becomes MIXED)."""
    jid = _standin.next_job_id
    _standin.next_job_id += 1
    _standin.jobs[jid] = {"state": "RUNNING", "node": node, "batch": True, "comment": comment, "restarts": 0}
    _standin.nodes[node].base = "MIXED"
    return jid


def _standin_reboot(names: str, reason: str, next_state: str = "RESUME") -> None:
    """Test control: what `scontrol reboot ASAP nextstate=X reason=Y NODES` does to busy and
    idle nodes (the stand-in has no RebootProgram, so an idle node's reboot is never issued)."""
    _standin.rpc("scontrol reboot")
    for n in _standin.expand(names):
        rec = _standin.nodes[n]
        rec.flags |= {"DRAIN", "REBOOT_REQUESTED"}
        rec.next_state = next_state
        rec.reason, rec.reason_user, rec.reason_time = reason, _standin.user, int(time.time())


# --------------------------------------------------------------------------------- pyslurm.Node

_WRITABLE_NODE_STATES = ("CANCEL_REBOOT", "DOWN", "DRAIN", "FAIL", "FUTURE", "NORESP", "NO_RESP",
                         "POWER_DOWN", "POWER_DOWN_ASAP", "POWER_DOWN_FORCE", "POWER_UP", "RESUME", "UNDRAIN")


class Node:
    def __init__(self, name=None, **kwargs):
        self._rec: _NodeRec | None = None
        self._name = name
        self._state_change: str | None = None
        self._reason_change: str | None = None
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __repr__(self):
        return f"pyslurm.{self.__class__.__name__}({self.name})"

    @staticmethod
    def load(name):
        _standin.rpc(f"Node.load({name})")
        rec = _standin.nodes.get(name)
        if rec is None:
            raise RPCError(msg=f"Node '{name}' does not exist")
        return Node._from_rec(rec)

    @staticmethod
    def _from_rec(rec: _NodeRec) -> "Node":
        n = Node(rec.name)
        n._rec = _NodeRec(rec.name, rec.base, set(rec.flags), rec.reason, rec.reason_user, rec.reason_time,
                          rec.next_state, list(rec.partitions), dict(rec.gres), rec.boot_time)
        return n

    def modify(self, changes):
        _standin.rpc(f"Node({self.name}).modify")
        names = _standin.expand(self.name)
        new_state = changes._state_change
        reason = changes._reason_change
        recs = [_standin.nodes[n] for n in names]
        # no refusal of a DRAIN without a reason: slurmctld takes one over the RPC (pyslurm 24.11 on
        # Slurm 24.11.5); only the scontrol client insists on a reason
        if new_state == "RESUME":
            if not all(r.base == "DOWN" or r.flags & {"DRAIN", "FAIL", "REBOOT_REQUESTED", "REBOOT_ISSUED"} for r in recs):
                raise RPCError(ESLURM_INVALID_NODE_STATE)
        if new_state == "CANCEL_REBOOT":
            if not all("REBOOT_REQUESTED" in r.flags for r in recs):
                raise RPCError(ESLURM_INVALID_NODE_STATE)
        for r in recs:
            if new_state == "DRAIN":
                r.flags.add("DRAIN")
            elif new_state == "DOWN":
                r.base = "DOWN"
            elif new_state == "UNDRAIN":
                r.flags.discard("DRAIN")
            elif new_state in ("RESUME", "CANCEL_REBOOT"):
                r.flags -= {"DRAIN", "FAIL", "REBOOT_REQUESTED", "REBOOT_ISSUED"}
                r.next_state = None
                if r.base == "DOWN":
                    r.base = "IDLE"
                r.reason = r.reason_user = r.reason_time = None
                continue
            if reason is not None:
                r.reason, r.reason_user, r.reason_time = reason, _standin.user, int(time.time())

    # -- attributes (the ones healthd reads or writes) -----------------------------------
    @property
    def name(self):
        return self._name

    @name.setter
    def name(self, val):
        self._name = val

    @property
    def state(self):
        if self._rec is None:
            return self._state_change
        return "+".join([self._rec.base, *sorted(self._rec.flags)])

    @state.setter
    def state(self, val):
        if not val or val.upper() not in _WRITABLE_NODE_STATES:
            raise ValueError(f"Invalid Node state: {val}")
        self._state_change = val.upper()

    @property
    def reason(self):
        return self._rec.reason if self._rec else self._reason_change

    @reason.setter
    def reason(self, val):
        self._reason_change = val

    @property
    def reason_user(self):
        return self._rec.reason_user if self._rec else None

    @property
    def reason_time(self):
        return self._rec.reason_time if self._rec else None

    @property
    def partitions(self):
        return list(self._rec.partitions) if self._rec else []

    @property
    def configured_gres(self):
        return dict(self._rec.gres) if self._rec else {}

    @property
    def next_state(self):
        if self._rec and self._rec.next_state and self._rec.flags & {"REBOOT_REQUESTED", "REBOOT_ISSUED"}:
            return self._rec.next_state
        return None

    @property
    def boot_time(self):
        return self._rec.boot_time if self._rec else None


class Nodes(dict):
    """pyslurm.Nodes is a MultiClusterMap; healthd only uses load() and values()."""

    @staticmethod
    def load(preload_passwd_info=False):
        _standin.rpc("Nodes.load()")
        out = Nodes()
        for name, rec in _standin.nodes.items():
            out[name] = Node._from_rec(rec)
        return out


# --------------------------------------------------------------------------------- pyslurm.Job


class Job:
    def __init__(self, job_id):
        if not isinstance(job_id, int):
            raise TypeError(f"an integer is required, got {type(job_id).__name__}")
        self.id = job_id

    def __repr__(self):
        return f"pyslurm.{self.__class__.__name__}({self.id})"

    @staticmethod
    def load(job_id):
        _standin.rpc(f"Job.load({job_id})")
        if job_id not in _standin.jobs:
            raise RPCError(ESLURM_INVALID_JOB_ID)
        job = Job(job_id)
        job.state = _standin.jobs[job_id]["state"]
        return job

    def requeue(self, hold=False):
        _standin.rpc(f"Job({self.id}).requeue")
        job = _standin.jobs.get(self.id)
        if job is None or job["state"] != "RUNNING" or not job["batch"]:
            raise RPCError(ESLURM_INVALID_JOB_ID)
        job["state"] = "PENDING"
        job["hold"] = hold
        job["restarts"] = job.get("restarts", 0) + 1  # slurmctld counts every requeue
        node = _standin.nodes.get(job["node"])
        if node is not None and not any(j["state"] == "RUNNING" and j["node"] == node.name for j in _standin.jobs.values()):
            node.base = "IDLE"


# --------------------------------------------------------------------------------- pyslurm.Reservation


class ReservationFlags(enum.Flag):
    """Member names as in pyslurm/core/reservation.pyx (values are the stand-in's own)."""

    MAINTENANCE = enum.auto()
    MAGNETIC = enum.auto()
    FLEX = enum.auto()
    IGNORE_RUNNING_JOBS = enum.auto()
    ANY_NODES = enum.auto()
    STATIC_NODES = enum.auto()
    PARTITION_NODES_ONLY = enum.auto()
    USER_DELETION = enum.auto()
    PURGE = enum.auto()
    SPECIFIC_NODES = enum.auto()
    NO_JOB_HOLD_AFTER_END = enum.auto()
    OVERLAP = enum.auto()
    ALL_NODES = enum.auto()
    SKIP = enum.auto()
    SCHED_FAILED = enum.auto()


class Reservation:
    _FIELDS = ("name", "nodes", "users", "duration", "flags", "start_time", "end_time", "accounts", "partition")

    def __init__(self, name=None, **kwargs):
        self.name = name
        self.nodes = None
        self.users = []
        self.duration = 0
        self.flags = ReservationFlags(0)
        self.start_time = None
        for k, v in kwargs.items():
            if k not in self._FIELDS:
                raise AttributeError(f"'Reservation' has no writable attribute {k!r}")
            setattr(self, k, v)
        if self.duration and not self.start_time:
            self.start_time = int(time.time())

    def __repr__(self):
        return f"pyslurm.{self.__class__.__name__}({self.name})"

    @staticmethod
    def load(name):
        _standin.rpc(f"Reservation.load({name})")
        data = _standin.reservations.get(name)
        if data is None:
            raise RPCError(msg=f"Reservation '{name}' doesn't exist")
        return Reservation(**data)

    def create(self):
        if not self.start_time or not self.duration:
            raise RPCError(msg="You must at least specify a start_time,  combined with an end_time or a duration.")
        _standin.rpc(f"Reservation({self.name}).create")
        if self.name in _standin.reservations:
            raise RPCError(ESLURM_RESERVATION_NAME_DUP)
        _standin.expand(self.nodes)
        _standin.reservations[self.name] = {
            "name": self.name, "nodes": self.nodes, "users": list(self.users),
            "duration": self.duration, "flags": self.flags, "start_time": self.start_time,
        }
        return self

    def delete(self):
        _standin.rpc(f"Reservation({self.name}).delete")
        if _standin.reservations.pop(self.name, None) is None:
            raise RPCError(ESLURM_RESERVATION_INVALID)
