"""SlurmBackend over pyslurm, for sites whose Slurm matches the installed pyslurm (25.11).

The calls below are the ones pyslurm 25.11.2 defines; read from its sdist (pyslurm-25.11.2.tar.gz
on PyPI, the same tree as github.com/PySlurm/pyslurm):
- pyslurm/core/node.pyx: `Nodes.load()` (staticmethod, a MultiClusterMap: .values()),
  `Node.load(name)` (RPCError "Node 'x' does not exist"), `Node(name, **changes)`,
  `Node.modify(changes: Node)` (slurm_update_node with node_names=self.name, so a hostlist
  expression works), writable `state` ("DRAIN", "RESUME", "UNDRAIN", "CANCEL_REBOOT", ... via
  _node_state_from_str) and `reason`; read-only `state` ("IDLE+DRAIN", from
  slurm_node_state_string_complete), `reason_user`, `reason_time` (epoch or None),
  `partitions` (list), `configured_gres` (dict such as {"gpu": 4}), `next_state`.
- pyslurm/core/job/job.pyx: `Job(job_id)`, `Job.requeue(hold=False)` (slurm_requeue).
- pyslurm/core/reservation.pyx: `Reservation(name=None, **kwargs)` with `nodes`, `users` (list),
  `duration` (minutes; sets start_time to now), `flags` (ReservationFlags, e.g.
  MAINTENANCE | IGNORE_RUNNING_JOBS); `.create()`, `.delete()`.
- pyslurm/core/slurmctld/config.pyx: `slurmctld.Config.load().version` (slurmctld's version).
- pyslurm/core/error.pyx: `RPCError(errno, msg)` with `.errno` and `.msg`.
- pyslurm/__init__.py: `__version__`, `slurm_init(config_path)`; auto-init on import unless
  PYSLURM_DISABLE_AUTO_INIT is set.
pyslurm 25.11 has no call for `scontrol reboot` (no slurm_reboot_nodes wrapper, and
_node_state_from_str knows no REBOOT state), nor for requeueing one array task: those two go
through the `fallback` ScontrolBackend. So do the reads of jobs and node addresses and the
validation steps: an `srun` step is a process whatever the backend, and the job and address reads
(once per requeue, every few minutes) stay on the client calls the contract suite proves on a real
Slurm rather than on pyslurm attributes nothing here has run against.

pyslurm calls are in-process C RPCs that cannot be interrupted, so each runs in a daemon thread
and the caller waits at most timeout_s; while a timed-out call is still stuck, further calls fail
fast with SlurmUnavailable instead of piling up threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from healthd.slurm.backend import (
    MAINT_FLAGS,
    MAINT_USERS,
    JobInfo,
    JobRun,
    NodeInfo,
    SlurmRefused,
    SlurmUnavailable,
    StepResult,
    filter_nodes,
    guarded_state_write,
    node_info,
    parse_state_string,
    requested_nodes,
    reservation_args,
    slurm_hostlist,
    validate_admin_comment,
    validate_argv,
    validate_job_id,
    validate_next_state,
    validate_node_name,
    validate_nodes,
    validate_reason,
    validate_reservation_name,
)
from healthd.slurm.scontrol import ScontrolBackend
from healthd.slurmtext import UNAVAILABLE_MARKERS

log = logging.getLogger(__name__)

# Slurm errno values meaning "slurmctld not reachable" (slurm/slurm_errno.h)
UNAVAILABLE_ERRNOS = frozenset({1001, 1800, 1801, 1802, 1803, 1804, 1805, 5004})
ESLURM_RESERVATION_INVALID = 2043

# healthd reservation flag (scontrol spelling) -> pyslurm.ReservationFlags member
RESERVATION_FLAG_NAMES = {
    "MAINT": "MAINTENANCE",
    "IGNORE_JOBS": "IGNORE_RUNNING_JOBS",
    "FLEX": "FLEX",
    "OVERLAP": "OVERLAP",
    "MAGNETIC": "MAGNETIC",
    "ANY_NODES": "ANY_NODES",
    "STATIC": "STATIC_NODES",
    "PART_NODES": "PARTITION_NODES_ONLY",
    "PURGE_COMP": "PURGE",
}


def _gres_text(gres: Any) -> str | None:
    if isinstance(gres, dict):
        return ",".join(f"{k}:{v}" for k, v in gres.items()) or None
    if isinstance(gres, str):
        return gres or None
    return None


def node_from_pyslurm(node: Any) -> NodeInfo:
    """A pyslurm.Node -> NodeInfo (pure; only attribute reads)."""
    base, flags = parse_state_string(node.state or "UNKNOWN")
    reason = node.reason or ""
    when = node.reason_time
    next_state = node.next_state
    return node_info(
        node.name, base, flags, reason, node.reason_user, float(when) if reason and when else None,
        partitions=tuple(node.partitions or ()),
        gres=_gres_text(node.configured_gres),
        next_state=next_state.upper() if next_state else None,
        boot_time=float(boot) if isinstance(boot := getattr(node, "boot_time", None), (int, float)) and boot > 0
        else None,
    )


def _reservation_gone(exc: SlurmRefused) -> bool:
    text = f"{exc.stderr} {exc}"
    return exc.returncode == ESLURM_RESERVATION_INVALID or "doesn't exist" in text or \
        "Requested reservation is invalid" in text


class PyslurmBackend:
    """SlurmBackend over the pyslurm module.

    module: the imported pyslurm (tests pass the stand-in); None imports pyslurm.
    fallback: a ScontrolBackend for what goes through scontrol, squeue and srun (reboot, array-task
    requeue, jobs, node addresses, validation steps; see the module docstring)."""

    def __init__(
        self,
        module: Any = None,
        *,
        fallback: ScontrolBackend | None = None,
        timeout_s: float = 10.0,
        dry_run: bool = False,
        logger: logging.Logger | None = None,
    ):
        if module is None:
            import pyslurm as module  # noqa: PLC0415 - optional dependency
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self._ps = module
        self.fallback = fallback
        self.timeout_s = float(timeout_s)
        self.dry_run = dry_run
        self.planned: list[list[str]] = []
        self._log = logger or log
        self._stuck: threading.Thread | None = None
        self._stuck_what = ""

    # -- plumbing -------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._stuck is not None:
            if self._stuck.is_alive():
                raise SlurmUnavailable(
                    f"{what}: an earlier pyslurm call ({self._stuck_what}) is still waiting for slurmctld",
                    argv=[what],
                )
            self._stuck = None
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc

        t = threading.Thread(target=target, name=f"pyslurm:{what[:40]}", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self._stuck, self._stuck_what = t, what
            raise SlurmUnavailable(
                f"{what} did not return within {self.timeout_s:g} s: slurmctld is down or overloaded",
                argv=[what],
            )
        if "error" in box:
            raise self._translate(what, box["error"])
        return box.get("value")

    def _translate(self, what: str, exc: BaseException) -> BaseException:
        rpc_error = getattr(self._ps, "RPCError", None)
        if rpc_error is not None and isinstance(exc, rpc_error):
            msg = str(getattr(exc, "msg", None) or exc)
            errno = getattr(exc, "errno", None)
            if errno in UNAVAILABLE_ERRNOS or any(m in msg for m in UNAVAILABLE_MARKERS):
                return SlurmUnavailable(f"{what}: slurmctld unreachable: {msg}", argv=[what], stderr=msg)
            return SlurmRefused(f"{what} failed: {msg}", argv=[what], returncode=errno, stderr=msg)
        return exc

    def _write(self, call: str, fn: Callable[[], Any]) -> None:
        if self.dry_run:
            self.planned.append([call])
            self._log.info("dry run, not calling: %s", call)
            return
        self._log.info("calling: %s", call)
        self._call(call, fn)

    def _need_fallback(self, what: str) -> ScontrolBackend:
        if self.fallback is None:
            raise SlurmUnavailable(
                f"{what}: this goes through the Slurm clients here and no scontrol fallback is configured "
                "(pass fallback=ScontrolBackend(...))",
                argv=[what],
            )
        return self.fallback

    # -- describe -------------------------------------------------------------------------

    def describe(self, action: str, **kw) -> list[str]:
        """The exact call `action` would make, as one Python expression (or, for what goes
        through the fallback, the scontrol argv). ValueError on bad arguments."""
        builder = getattr(self, f"_plan_{action}", None)
        if builder is None:
            raise ValueError(f"unknown action {action!r}")
        plan = builder(**kw)
        return plan[0] if isinstance(plan, tuple) else plan

    def _plan_modify(self, hl, **fields):
        """A node state write: the expression shown and the call, over one validated hostlist."""
        ps = self._ps
        shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return [f"pyslurm.Node({hl!r}).modify(pyslurm.Node({shown}))"], lambda: ps.Node(hl).modify(ps.Node(**fields))

    def _plan_drain(self, nodes, reason):
        hl = slurm_hostlist(nodes)
        return self._plan_modify(hl, state="DRAIN", reason=validate_reason(reason))

    def _plan_resume(self, nodes):
        return self._plan_modify(slurm_hostlist(nodes), state="RESUME")

    def _plan_cancel_reboot(self, nodes):
        return self._plan_modify(slurm_hostlist(nodes), state="CANCEL_REBOOT")

    def _plan_reboot_asap(self, nodes, reason, next_state="RESUME"):
        validate_nodes(nodes)
        validate_reason(reason)
        validate_next_state(next_state)
        if self.fallback is None:
            return ["(needs scontrol) scontrol reboot ASAP ..."]
        return self.fallback.describe("reboot_asap", nodes=nodes, reason=reason, next_state=next_state)

    def _plan_requeue(self, job_id):
        text = validate_job_id(job_id)
        if "_" in text:
            if self.fallback is None:
                return [f"(needs scontrol) scontrol requeue {text}"]
            return self.fallback.describe("requeue", job_id=text)
        ps = self._ps
        jid = int(text)
        return ([f"pyslurm.Job({jid}).requeue()"], lambda: ps.Job(jid).requeue())

    def _plan_create_reservation(self, name, nodes, duration_min, users=MAINT_USERS, flags=MAINT_FLAGS):
        name, hl, duration_min, users, flags = reservation_args(name, nodes, duration_min, users, flags)
        ps = self._ps
        members = [RESERVATION_FLAG_NAMES[f] for f in flags]
        flag_text = " | ".join(f"pyslurm.ReservationFlags.{m}" for m in members)
        kwargs_text = f"name={name!r}, nodes={hl!r}, users={users!r}, duration={duration_min}"
        if members:
            kwargs_text += f", flags={flag_text}"

        def run():
            kwargs: dict[str, Any] = {"name": name, "nodes": hl, "users": list(users), "duration": duration_min}
            if members:
                combined = getattr(ps.ReservationFlags, members[0])
                for m in members[1:]:
                    combined = combined | getattr(ps.ReservationFlags, m)
                kwargs["flags"] = combined
            return ps.Reservation(**kwargs).create()

        return ([f"pyslurm.Reservation({kwargs_text}).create()"], run)

    def _plan_delete_reservation(self, name):
        name = validate_reservation_name(name)
        ps = self._ps
        return ([f"pyslurm.Reservation({name!r}).delete()"], lambda: ps.Reservation(name).delete())

    # -- reads ----------------------------------------------------------------------------

    def version(self) -> str:
        """slurmctld's version, from its configuration (pyslurm.slurmctld.Config.load())."""
        ps = self._ps
        return str(self._call("pyslurm.slurmctld.Config.load().version", lambda: ps.slurmctld.Config.load().version))

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        names = requested_nodes(names)
        if names == []:
            return []
        ps = self._ps
        loaded = self._call("pyslurm.Nodes.load()", lambda: list(ps.Nodes.load().values()))
        return filter_nodes([node_from_pyslurm(n) for n in loaded], names)

    def node(self, name: str) -> NodeInfo:
        ns = validate_nodes(name)
        if len(ns) != 1:
            raise ValueError(f"node() takes one node name, got {name!r} ({len(ns)} nodes)")
        ps = self._ps
        single = str(ns)
        return node_from_pyslurm(self._call(f"pyslurm.Node.load({single!r})", lambda: ps.Node.load(single)))

    # -- writes ---------------------------------------------------------------------------

    def drain(self, nodes: str | Sequence[str], reason: str) -> None:
        call, fn = self._plan_drain(nodes, reason)
        self._write(call[0], fn)

    def resume(self, nodes: str | Sequence[str]) -> None:
        """Same semantics as ScontrolBackend.resume: nodes that are not drained, down, failed or
        awaiting a reboot are skipped; a refusal that a fresh read shows was a race is tolerated."""
        self._plan_resume(nodes)  # validate before reading

        def write(todo: list[str]) -> None:
            call, fn = self._plan_resume(todo)
            self._write(call[0], fn)

        guarded_state_write(self.nodes, nodes, lambda n: n.resumable, write, "resume", self._log)

    def reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> None:
        validate_nodes(nodes)
        validate_reason(reason)
        validate_next_state(next_state)
        fb = self._need_fallback("reboot_asap")
        fb.dry_run = self.dry_run
        fb.reboot_asap(nodes, reason, next_state)
        if self.dry_run:
            self.planned.extend(fb.planned[-1:])

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None:
        """Same semantics as ScontrolBackend.cancel_reboot (nodes without a pending reboot are skipped)."""
        self._plan_cancel_reboot(nodes)

        def write(todo: list[str]) -> None:
            call, fn = self._plan_cancel_reboot(todo)
            self._write(call[0], fn)

        guarded_state_write(self.nodes, nodes, lambda n: "REBOOT_REQUESTED" in n.flags, write, "cancel_reboot", self._log)

    def requeue(self, job_id: int | str) -> None:
        text = validate_job_id(job_id)
        if "_" in text:
            fb = self._need_fallback("requeue of an array task")
            fb.dry_run = self.dry_run
            fb.requeue(text)
            if self.dry_run:
                self.planned.extend(fb.planned[-1:])
            return
        call, fn = self._plan_requeue(text)
        self._write(call[0], fn)

    def create_reservation(self, name: str, nodes: str | Sequence[str], duration_min: int,
                           users: Sequence[str] = MAINT_USERS, flags: Sequence[str] = MAINT_FLAGS) -> None:
        call, fn = self._plan_create_reservation(name, nodes, duration_min, users, flags)
        self._write(call[0], fn)

    def delete_reservation(self, name: str) -> None:
        """Delete the reservation; one that is already gone is done, not an error."""
        call, fn = self._plan_delete_reservation(name)
        try:
            self._write(call[0], fn)
        except SlurmRefused as exc:
            if not _reservation_gone(exc):
                raise
            self._log.info("delete reservation %s: already gone", name)

    def reservation_exists(self, name: str) -> bool:
        name = validate_reservation_name(name)
        ps = self._ps
        try:
            self._call(f"pyslurm.Reservation.load({name!r})", lambda: ps.Reservation.load(name))
        except SlurmRefused as exc:
            if _reservation_gone(exc):
                return False
            raise
        return True

    def ctld_started_at(self) -> float | None:
        """When slurmctld started: pyslurm 25.11 does not expose it, so the scontrol fallback
        reads it (None without a fallback)."""
        return self.fallback.ctld_started_at() if self.fallback is not None else None

    # -- through the fallback: jobs, node addresses, validation steps -----------------------

    def jobs_on(self, node: str) -> list[JobInfo]:
        validate_node_name(node)
        return self._need_fallback("jobs_on").jobs_on(node)

    def job(self, job_id: int | str) -> JobInfo | None:
        validate_job_id(job_id)
        return self._need_fallback("job").job(job_id)

    def job_runs(self, job_id: int | str) -> list[JobRun] | None:
        validate_job_id(job_id)
        return self._need_fallback("job_runs").job_runs(job_id)

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        validate_job_id(job_id)
        validate_admin_comment(text)
        fb = self._need_fallback("set_admin_comment")
        fb.dry_run = self.dry_run
        fb.set_admin_comment(job_id, text)
        if self.dry_run:
            self.planned.extend(fb.planned[-1:])

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        names = requested_nodes(names)
        if names == []:
            return {}
        return self._need_fallback("node_addresses").node_addresses(names)

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        validate_argv(argv)
        fb = self._need_fallback("run_step")
        fb.dry_run = self.dry_run
        result = fb.run_step(argv, timeout_s)
        if self.dry_run:
            self.planned.extend(fb.planned[-1:])
        return result
