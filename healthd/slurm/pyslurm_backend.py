"""SlurmBackend over pyslurm, for sites whose Slurm matches the installed pyslurm (24.11 or 25.11).

Run against a real slurmctld: pyslurm 24.11.0 (built from its source against Slurm 24.11.5) passes the
backend contract suite (tests/slurm/contract.py) and reads every node as the scontrol backend does.
The calls, by pyslurm's own API generation:
- nodes (both): `Nodes.load()` (a MultiClusterMap: .values()), `Node.load(name)` (RPCError "Node 'x'
  does not exist"), `Node(name).modify(Node(state=..., reason=...))` (slurm_update_node with
  node_names=self.name, so a hostlist expression works); read-only `state` ("IDLE+DRAIN"),
  `reason_user`, `reason_time` (epoch or None), `partitions`, `configured_gres` ({"gpu": 4}),
  `next_state`, `boot_time`.
- jobs (both): `Job(job_id).requeue()` (slurm_requeue).
- reservations: 25.11 `Reservation(name=..., nodes=..., users=[...], duration=..., flags=ReservationFlags)`
  `.create()`/`.delete()`/`Reservation.load(name)`; 24.11 has no Reservation class, so its dict API:
  `slurm_create_reservation({...})` with the RESERVE_FLAG_* constants, `slurm_delete_reservation(name)`,
  `reservation().get()` (failures there are ValueError(text, errno), turned into RPCError).
- slurmctld: 25.11 `slurmctld.Config.load().version`; 24.11's Config has neither the version nor the
  start time, so `config().get()` ("version", "boot_time").
- errors: `RPCError(errno, msg)` with `.errno` and `.msg`.
- import: pyslurm 25.11 skips its auto-init under PYSLURM_DISABLE_AUTO_INIT; 24.11 always runs
  slurm_init() on import, reading SLURM_CONF (healthd.slurm._import_pyslurm sets both).
pyslurm has no call for `scontrol reboot` (no slurm_reboot_nodes wrapper; no REBOOT state), nor for
requeueing one array task, and pyslurm 24.11.0's Node(state="CANCEL_REBOOT") raises NameError (its
node.pyx names an undeclared `slurm` there): those go through the `fallback` ScontrolBackend. So do
the reads of jobs and node addresses and the validation steps: an `srun` step is a process whatever
the backend, and the job and address reads (once per requeue, every few minutes) stay on the client
calls the contract suite proves.

Each pyslurm call runs in a daemon thread and the caller waits at most timeout_s; while a timed-out
call is still stuck, further calls fail fast with SlurmUnavailable instead of piling up threads. But
pyslurm 24.11's RPCs hold the interpreter (the GIL) until libslurm returns, so no thread of the
process runs meanwhile and timeout_s cannot cut a call short: a stopped slurmctld costs each call
libslurm's own retries, about slurm.conf's MessageTimeout (9 s of the default 10 seen on 24.11;
`unavailable_within_s`). The scontrol backend's clients are processes, killed at timeout_s.
"""

from __future__ import annotations

import logging
import threading
import time
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


# healthd reservation flag (scontrol spelling) -> pyslurm 24.11 constant (slurm.h's RESERVE_FLAG_*)
RESERVATION_FLAG_CONSTANTS = {
    "MAINT": "RESERVE_FLAG_MAINT",
    "IGNORE_JOBS": "RESERVE_FLAG_IGN_JOBS",
    "FLEX": "RESERVE_FLAG_FLEX",
    "OVERLAP": "RESERVE_FLAG_OVERLAP",
    "MAGNETIC": "RESERVE_FLAG_MAGNETIC",
    "ANY_NODES": "RESERVE_FLAG_ANY_NODES",
    "STATIC": "RESERVE_FLAG_STATIC",
    "PART_NODES": "RESERVE_FLAG_PART_NODES",
    "PURGE_COMP": "RESERVE_FLAG_PURGE_COMP",
}


def _dict_api(ps: Any, fn: Callable[[], Any]) -> Any:
    """fn() of pyslurm's dict API (config, reservations), whose failures are
    ValueError(slurm_strerror text, errno), turned into the RPCError the object API raises, so that
    one translation serves both."""
    try:
        return fn()
    except ValueError as exc:
        if len(exc.args) == 2 and isinstance(exc.args[1], int):
            raise ps.RPCError(errno=exc.args[1], msg=str(exc.args[0]) or None) from exc
        raise


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
    requeue, jobs, node addresses, validation steps; see the module docstring); it takes timeout_s.
    message_timeout_s: slurm.conf's MessageTimeout, libslurm's own bound on a call (unavailable_within_s)."""

    def __init__(
        self,
        module: Any = None,
        *,
        fallback: ScontrolBackend | None = None,
        timeout_s: float = 10.0,
        dry_run: bool = False,
        logger: logging.Logger | None = None,
        message_timeout_s: float = 10.0,
    ):
        if module is None:
            import pyslurm as module  # noqa: PLC0415 - optional dependency
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self._ps = module
        self.fallback = fallback
        self.timeout_s = float(timeout_s)
        self._cancel_reboot_ok: bool | None = None
        self.message_timeout_s = float(message_timeout_s)
        self.dry_run = dry_run
        self.planned: list[list[str]] = []
        self._log = logger or log
        self._stuck: threading.Thread | None = None
        self._stuck_what = ""

    @property
    def timeout_s(self) -> float:
        """How long a caller waits for any call, the fallback's client calls included."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = float(value)
        if self.fallback is not None:
            self.fallback.timeout_s = self._timeout_s

    @property
    def unavailable_within_s(self) -> float:
        """How long a call to an unreachable slurmctld can take: pyslurm's RPCs hold the interpreter
        (the GIL) until libslurm returns, and libslurm retries a refused connection for about
        slurm.conf's MessageTimeout (9 s of the default 10 seen on 24.11), so timeout_s cannot cut
        them short."""
        return max(self.timeout_s, self.message_timeout_s)

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

    def _through_fallback(self, what: str, write: Callable[[ScontrolBackend], Any]) -> Any:
        """A write the fallback makes, in this backend's dry-run mode; a planned call is recorded here too."""
        fb = self._need_fallback(what)
        fb.dry_run = self.dry_run
        result = write(fb)
        if self.dry_run:
            self.planned.extend(fb.planned[-1:])
        return result

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
        if self.fallback is not None and not self._pyslurm_cancels_reboots():
            return self.fallback.describe("cancel_reboot", nodes=nodes)
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
        if not hasattr(ps, "Reservation"):
            return self._plan_create_reservation_dict(name, hl, duration_min, users, flags)
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

    def _plan_create_reservation_dict(self, name, hl, duration_min, users, flags):
        """pyslurm 24.11: no Reservation class; its dict API (pyslurm.slurm_create_reservation, the
        RESERVE_FLAG_* constants) makes the same slurm_create_reservation RPC."""
        ps = self._ps
        consts = [RESERVATION_FLAG_CONSTANTS[f] for f in flags]
        missing = [c for c in consts if not hasattr(ps, c)]
        if missing:
            raise ValueError(f"pyslurm {getattr(ps, '__version__', '?')} has no {', '.join(missing)}")
        shown = {"name": name, "node_list": hl, "users": ",".join(users), "duration": duration_min,
                 "start_time": "<now>"}

        def run():
            desc = {"name": name, "node_list": hl, "users": ",".join(users), "duration": duration_min,
                    # 0 is not "now" to slurmctld: the RPC wants the start in epoch seconds
                    "start_time": int(time.time())}
            value = 0
            for c in consts:
                value |= int(getattr(ps, c))
            if value:
                desc["flags"] = value
            return _dict_api(ps, lambda: ps.slurm_create_reservation(desc))

        flag_text = " | ".join(f"pyslurm.{c}" for c in consts)
        text = ", ".join(f"{k!r}: {v!r}" for k, v in shown.items()) + (f", 'flags': {flag_text}" if consts else "")
        return ([f"pyslurm.slurm_create_reservation({{{text}}})"], run)

    def _plan_delete_reservation(self, name):
        name = validate_reservation_name(name)
        ps = self._ps
        if not hasattr(ps, "Reservation"):
            return ([f"pyslurm.slurm_delete_reservation({name!r})"],
                    lambda: _dict_api(ps, lambda: ps.slurm_delete_reservation(name)))
        return ([f"pyslurm.Reservation({name!r}).delete()"], lambda: ps.Reservation(name).delete())

    # -- reads ----------------------------------------------------------------------------

    def _ctld_config(self, what: str) -> dict[str, Any]:
        """slurmctld's configuration through pyslurm 24.11's dict API (its slurmctld.Config has
        neither the version nor the start time)."""
        ps = self._ps
        return self._call(f"pyslurm.config().get()[{what!r}]", lambda: _dict_api(ps, lambda: ps.config().get()))

    def version(self) -> str:
        """slurmctld's version, from its configuration (pyslurm.slurmctld.Config.load() where it has
        the version, 25.11; pyslurm.config().get() before)."""
        ps = self._ps
        if hasattr(ps, "config") and not hasattr(ps.slurmctld.Config, "version"):
            return str(self._ctld_config("version")["version"])
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
        self._through_fallback("reboot_asap", lambda fb: fb.reboot_asap(nodes, reason, next_state))

    def _pyslurm_cancels_reboots(self) -> bool:
        """Whether this pyslurm can write CANCEL_REBOOT: pyslurm 24.11.0's Node(state="CANCEL_REBOOT")
        raises NameError (its node.pyx names an undeclared `slurm` there), so cancel_reboot goes through
        the fallback with it. Asked once, by building the change locally: no RPC."""
        if self._cancel_reboot_ok is None:
            try:
                self._ps.Node(state="CANCEL_REBOOT")
                self._cancel_reboot_ok = True
            except (NameError, ValueError, AttributeError) as exc:
                self._log.info("pyslurm %s cannot write CANCEL_REBOOT (%s: %s); cancel_reboot goes through scontrol",
                               getattr(self._ps, "__version__", "?"), type(exc).__name__, exc)
                self._cancel_reboot_ok = False
        return self._cancel_reboot_ok

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None:
        """Same semantics as ScontrolBackend.cancel_reboot (nodes without a pending reboot are skipped)."""
        self._plan_cancel_reboot(nodes)
        if not self._pyslurm_cancels_reboots():
            self._through_fallback("cancel_reboot", lambda fb: fb.cancel_reboot(nodes))
            return

        def write(todo: list[str]) -> None:
            call, fn = self._plan_cancel_reboot(todo)
            self._write(call[0], fn)

        guarded_state_write(self.nodes, nodes, lambda n: "REBOOT_REQUESTED" in n.flags, write, "cancel_reboot", self._log)

    def requeue(self, job_id: int | str) -> None:
        text = validate_job_id(job_id)
        if "_" in text:
            self._through_fallback("requeue of an array task", lambda fb: fb.requeue(text))
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
        if not hasattr(ps, "Reservation"):
            found = self._call("pyslurm.reservation().get()", lambda: _dict_api(ps, lambda: ps.reservation().get()))
            return name in found
        try:
            self._call(f"pyslurm.Reservation.load({name!r})", lambda: ps.Reservation.load(name))
        except SlurmRefused as exc:
            if _reservation_gone(exc):
                return False
            raise
        return True

    def ctld_started_at(self) -> float | None:
        """When slurmctld started: pyslurm 24.11's configuration dict has it (boot_time); pyslurm
        25.11's Config does not, so there the scontrol fallback reads it (None without a fallback)."""
        if hasattr(self._ps, "config"):
            boot = self._ctld_config("boot_time").get("boot_time")
            return float(boot) if isinstance(boot, (int, float)) and boot > 0 else None
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
        self._through_fallback("set_admin_comment", lambda fb: fb.set_admin_comment(job_id, text))

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        names = requested_nodes(names)
        if names == []:
            return {}
        return self._need_fallback("node_addresses").node_addresses(names)

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        validate_argv(argv)
        return self._through_fallback("run_step", lambda fb: fb.run_step(argv, timeout_s))
