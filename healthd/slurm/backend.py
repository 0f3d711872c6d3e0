"""The Slurm seam: what healthd reads from and writes to Slurm, as values and one Protocol.

`NodeInfo` is one node as Slurm reports it, normalised across the three ways we read it
(`sinfo --json` of 22.05, the data_parser JSON of 23.02+, `scontrol show node -o`, pyslurm).
`SlurmBackend` is the Protocol the controller talks to; `ScontrolBackend` (healthd.slurm.scontrol)
and `PyslurmBackend` (healthd.slurm.pyslurm_backend) implement it, and the contract suite in
tests/slurm/contract.py holds both to the same behaviour.

Everything a caller hands to a write is validated here, before any client runs: node names are
Slurm hostnames or hostlists, reasons are one line of printable text. A reason travels as ONE argv
element (`Reason=<text>`), never through a shell, so spaces, `=`, quotes and `;|&$()` in it are
data, not syntax; what is refused is only what Slurm cannot keep: more than one line, or more than
healthd.reason.MAX_REASON_BYTES.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ClusterShell.NodeSet import NodeSet, NodeSetException
from ClusterShell.RangeSet import RangeSetException

from healthd.reason import MAX_REASON_BYTES, reason_bytes
from healthd.slurmtext import parse_state_string, reason_holds  # noqa: F401 - parse_state_string re-exported: the backends parse states with it

MAX_NODES_CHARS = 256
# A hostlist such as n[0-999999999] is 256 characters but a billion names: refuse it before
# ClusterShell expands it.
MAX_NODES_EXPANDED = 65536
# one argv element may hold at most 128 KiB on Linux (MAX_ARG_STRLEN)
MAX_HOSTLIST_CHARS = 100_000

_NODES_RE = re.compile(r"[A-Za-z0-9._\-\[\],]+")
_RANGE_RE = re.compile(r"(\d+)-(\d+)")
_DIGIT_BRACKET_RE = re.compile(r"\d\[([^\]]*)\]")
_JOB_ID_RE = re.compile(r"[1-9][0-9]{0,9}(_[0-9]{1,10})?")
_RESV_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,31}\$?")

# Node states a RESUME can act on. RESUME on anything else is refused by slurmctld
# ("Invalid node state specified"), so resume() skips nodes that are none of these.
RESUMABLE_FLAGS = frozenset({"DRAIN", "FAIL", "REBOOT_REQUESTED", "REBOOT_ISSUED"})
RESUMABLE_STATES = frozenset({"down"})
# slurmctld's answer to a state change the node's current state does not allow (slurm_strerror of
# ESLURM_INVALID_NODE_STATE): RESUME of an idle node, cancel_reboot with no reboot pending.
INVALID_STATE_MARKER = "Invalid node state specified"
NEXT_STATES = ("RESUME", "DOWN")
RESERVATION_FLAGS = frozenset(
    {"MAINT", "IGNORE_JOBS", "FLEX", "OVERLAP", "MAGNETIC", "ANY_NODES", "STATIC", "PART_NODES", "PURGE_COMP"}
)
# create_reservation's defaults: a maintenance reservation only root may use, made even while jobs
# still run on its nodes
MAINT_USERS = ("root",)
MAINT_FLAGS = ("MAINT", "IGNORE_JOBS")


@dataclass(frozen=True, slots=True)  # slots: the controller holds one per node, 100,000 at the largest sites
class NodeInfo:
    """One Slurm node. `state` is the base state in lowercase (idle, mixed, allocated, down,
    future, unknown, error); every other bit is an uppercase flag (DRAIN, NOT_RESPONDING,
    COMPLETING, REBOOT_REQUESTED, ...). `reason` is '' when the node has none; `reason_user` and
    `reason_time` (epoch seconds) are None when Slurm does not say or the reason is empty.
    `next_state` is the state after a requested reboot (e.g. 'RESUME', 'DOWN'), else None.
    `boot_time` is when the node's operating system last booted (epoch seconds), None when unknown:
    a requested reboot is done once it is later than the request."""

    name: str
    state: str
    flags: frozenset[str] = field(default_factory=frozenset)
    reason: str = ""
    reason_user: str | None = None
    reason_time: float | None = None
    partitions: tuple[str, ...] = ()
    gres: str | None = None
    next_state: str | None = None
    boot_time: float | None = None

    @property
    def drain_requested(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def draining(self) -> bool:
        """DRAIN is set and jobs still run (sinfo's `draining`)."""
        return self.drain_requested and (self.state in ("allocated", "mixed") or "COMPLETING" in self.flags)

    @property
    def drained(self) -> bool:
        """DRAIN is set and no job runs any more (sinfo's `drained`)."""
        return self.drain_requested and not self.draining

    @property
    def reboot_requested(self) -> bool:
        return bool(self.flags & {"REBOOT_REQUESTED", "REBOOT_ISSUED"})

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags

    @property
    def resumable(self) -> bool:
        """A RESUME would be accepted (the node is drained, down, failed or awaiting a reboot)."""
        return self.state in RESUMABLE_STATES or bool(self.flags & RESUMABLE_FLAGS)


def node_info(name: str, state: str, flags: frozenset[str], reason: str, user: str | None, when: float | None,
              **rest: Any) -> NodeInfo:
    """A NodeInfo as every reader builds it: the reason only while the state holds DRAIN, DOWN or FAIL
    (healthd.slurmtext.reason_holds: Slurm 24.11 keeps the old reason after RESUME), and its user and
    time only with a reason, since Slurm can keep them after a resume cleared it (22.05's
    reason_set_by_user, tests/slurm/captured/)."""
    if reason and not reason_holds(state, flags):
        reason = ""
    return NodeInfo(name=name, state=state, flags=flags, reason=reason, reason_user=(user or None) if reason else None,
                    reason_time=when if reason else None, **rest)


@dataclass(frozen=True)
class JobInfo:
    """A job as far as requeue opt-in and its reconciliation need it."""

    job_id: str
    batch: bool
    """Submitted with sbatch (only a batch job can be requeued)."""
    comment: str
    restarts: int = 0
    """Slurm's restart count: a requeue Slurm kept leaves the job with a higher count, elsewhere."""
    state: str = ""
    """Slurm's job state (RUNNING, PENDING, COMPLETED, ...); empty when the backend did not say."""
    partition: str = ""
    account: str = ""


@dataclass(frozen=True)
class JobRun:
    """One run of a job as Slurm's accounting has it (`sacct --duplicates`): a requeued job has one
    per start."""

    job_id: str
    state: str
    """How the run ended (COMPLETED, FAILED, REQUEUED, NODE_FAIL, ...), or RUNNING / PENDING."""
    start: float | None
    """None: the run has not started (a requeued job waiting)."""
    end: float | None
    """None: the run has not ended."""
    partition: str = ""
    account: str = ""
    gpus: int | None = None
    """GPUs allocated (AllocTRES gres/gpu); None when accounting does not track them."""
    nodes: str = ""
    admin_comment: str = ""


@dataclass(frozen=True)
class StepResult:
    """How one command run by `SlurmBackend.run_step` ended: its exit status (124: killed at its
    timeout; 127: it could not be started) and what it printed, stdout then stderr."""

    returncode: int
    output: str


class SlurmError(RuntimeError):
    """A Slurm call failed. `argv` is the command (or pyslurm call) that was attempted,
    `returncode` its exit status (None when it never finished), `stderr` what Slurm said."""

    def __init__(self, message: str, argv: Sequence[str] = (), returncode: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


class SlurmUnavailable(SlurmError):
    """slurmctld could not be reached in time (down, overloaded, network), or no Slurm client
    can be run safely here. Retry later; nothing was changed."""


class SlurmRefused(SlurmError):
    """slurmctld answered and said no (invalid node state transition, unknown node, permission)."""


class SlurmOutputError(SlurmError):
    """Slurm answered with output this module does not understand (a new JSON shape, a truncated
    line). The message names the Slurm version and the path inside the document."""


@runtime_checkable
class SlurmBackend(Protocol):
    """What healthd needs from Slurm. Every write validates its arguments (ValueError) before any
    call; `describe()` returns the exact call a write would make; with `dry_run=True` a backend
    records writes in `planned` instead of making them (reads still happen).

    Writes whose effect is already there are done, not errors: `delete_reservation` of a
    reservation that does not exist returns quietly (a restart after a delete repeats it), as do
    RESUME and cancel_reboot on a node that needs neither. `ctld_started_at` is when the running
    slurmctld started (epoch seconds; None when it does not say): a controller that restarted
    after a write may have come back from a state save older than the write.

    Jobs: `jobs_on(node)` lists the jobs running on one node; `job(job_id)` reads one job in any
    state, None once Slurm no longer knows it. `node_addresses()` maps node names to their NodeAddr
    as Slurm has it (not resolved). `run_step(argv, timeout_s)` runs one command that starts work
    through Slurm (an `srun` validation step) with SLURM_CONF and a minimal environment, and never
    raises for how the command ended (see StepResult); with `dry_run=True` it is planned, not run,
    like a write."""

    dry_run: bool
    planned: list[list[str]]

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]: ...

    def node(self, name: str) -> NodeInfo: ...

    def drain(self, nodes: str | Sequence[str], reason: str) -> None: ...

    def resume(self, nodes: str | Sequence[str]) -> None: ...

    def reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> None: ...

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None: ...

    def requeue(self, job_id: int | str) -> None: ...

    def create_reservation(self, name: str, nodes: str | Sequence[str], duration_min: int,
                           users: Sequence[str] = MAINT_USERS, flags: Sequence[str] = MAINT_FLAGS) -> None: ...

    def delete_reservation(self, name: str) -> None: ...

    def reservation_exists(self, name: str) -> bool: ...

    def ctld_started_at(self) -> float | None: ...

    def jobs_on(self, node: str) -> list[JobInfo]: ...

    def job(self, job_id: int | str) -> JobInfo | None: ...

    def job_runs(self, job_id: int | str) -> list[JobRun] | None:
        """The job's runs from Slurm's accounting (slurmdbd), oldest first; None where the site keeps
        none; [] when accounting has no record of the job."""
        ...

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        """Set the AdminComment of a job in Slurm's accounting (after it ended: `sacctmgr modify job`)."""
        ...

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]: ...

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult: ...

    def version(self) -> str: ...

    def describe(self, action: str, **kw) -> list[str]: ...


# ---------------------------------------------------------------------------------------------
# validation (pure)


def _has_forbidden_char(text: str) -> str | None:
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs", "Zl", "Zp"):  # controls (incl. NUL, CR, LF, TAB), surrogates, line breaks
            return ch
    return None


def validate_nodes(nodes: str | Sequence[str]) -> NodeSet:
    """Return the nodes as a ClusterShell NodeSet, or raise ValueError saying what is wrong.

    Accepts one hostname, one hostlist expression (`gpu[001-128]`) or a sequence of either.
    Allowed characters are letters, digits and `-_.[],`; anything else (spaces, `=`, quotes,
    newlines, shell metacharacters) is refused, as is an expression over 256 characters or one
    that expands to more than 65536 names."""
    items = [nodes] if isinstance(nodes, str) else list(nodes)
    if not items:
        raise ValueError("no node given: expected a node name or hostlist such as gpu[001-004]")
    out = NodeSet()
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"node name must be a string, got {type(item).__name__}: {item!r}")
        if not item:
            raise ValueError("empty node name")
        if len(item) > MAX_NODES_CHARS:
            raise ValueError(f"node list is {len(item)} characters, more than {MAX_NODES_CHARS}: {item[:40]!r}...")
        if not _NODES_RE.fullmatch(item):
            bad = next((c for c in item if not _NODES_RE.fullmatch(c)), "?")
            raise ValueError(
                f"invalid node name {item!r}: character {bad!r} is not allowed "
                "(a Slurm node name or hostlist has only letters, digits and -_.[],)"
            )
        # ClusterShell 1.9 merges digits before a bracket into the range: n1[9,10] becomes
        # n[19-110] (92 names) where Slurm means n19,n110. Equal-width numbers are read the same
        # by both (n1[01-16] = n101..n116); anything else is refused as ambiguous.
        for inside in _DIGIT_BRACKET_RE.findall(item):
            if len({len(num) for num in re.findall(r"\d+", inside)}) > 1:
                raise ValueError(
                    f"ambiguous hostlist {item!r}: digits right before [ with numbers of different widths "
                    "are expanded differently by ClusterShell and Slurm; move the digits into the brackets "
                    "(write n1[9,10] as n[19,110])"
                )
        expanded = 0
        for lo, hi in _RANGE_RE.findall(item):
            expanded += max(int(hi) - int(lo) + 1, 1)
            if expanded > MAX_NODES_EXPANDED:
                raise ValueError(f"hostlist {item!r} expands to more than {MAX_NODES_EXPANDED} nodes")
        try:
            parsed = NodeSet(item)
        except (NodeSetException, RangeSetException, ValueError, IndexError, TypeError) as exc:
            raise ValueError(f"invalid hostlist {item!r}: {exc}") from None
        if len(parsed) == 0:
            raise ValueError(f"hostlist {item!r} names no node")
        for name in parsed:
            if name.startswith(("-", ".")):
                raise ValueError(f"invalid node name {name!r} in {item!r}: may not start with {name[0]!r}")
        out.update(parsed)
    if len(out) > MAX_NODES_EXPANDED:
        raise ValueError(f"{len(out)} nodes given, more than {MAX_NODES_EXPANDED}")
    return out


def slurm_hostlist(nodes: str | Sequence[str] | NodeSet) -> str:
    """The nodes as a hostlist string Slurm reads back as exactly these nodes.

    ClusterShell's default n-D folding can write text after a bracket (`rack[1-3]-node01`,
    `gpu[1-2]-ib`), which Slurm 22.05 rejects ("Invalid hostlist"; checked with `scontrol show
    hostnames`). So names that end in a digit are folded on their last numeric axis only
    (`rack1-node[01-02],rack2-node01`), and names that end in anything else are listed as they
    are. tests/slurm/test_parsers.py checks the result against Slurm's own expansion."""
    ns = nodes if isinstance(nodes, NodeSet) else validate_nodes(nodes)
    ends_in_digit = [n for n in ns if n[-1:].isdigit()]
    others = [n for n in ns if not n[-1:].isdigit()]
    parts = []
    if ends_in_digit:
        parts.append(str(NodeSet(",".join(ends_in_digit), fold_axis=[-1])))
    parts.extend(others)
    text = ",".join(parts)
    if len(text) > MAX_HOSTLIST_CHARS:
        raise ValueError(f"{len(ns)} nodes make a {len(text)}-character hostlist; split them into smaller calls")
    return text


def validate_reason(reason: str) -> str:
    """Return the reason unchanged, or raise ValueError. A reason is one line of at most
    MAX_REASON_BYTES bytes of UTF-8 (healthd.reason says why) with no control characters; it must
    not be empty or only spaces."""
    if not isinstance(reason, str):
        raise ValueError(f"reason must be a string, got {type(reason).__name__}")
    if not reason.strip():
        raise ValueError("reason is empty: Slurm requires a reason to drain or reboot a node")
    size = reason_bytes(reason)
    if size > MAX_REASON_BYTES:
        raise ValueError(f"reason is {size} bytes of UTF-8, more than the {MAX_REASON_BYTES} Slurm's accounting "
                         "keeps (healthd.reason)")
    bad = _has_forbidden_char(reason)
    if bad is not None:
        raise ValueError(
            f"reason contains control character {bad!r} (U+{ord(bad):04X}); a Slurm reason is one line "
            "of printable text"
        )
    return reason


ADMIN_COMMENT_MAX = 200
_ADMIN_COMMENT_RE = re.compile(r"[\x20-\x7e]{1,200}")


def validate_admin_comment(text: str) -> str:
    """A comment healthd writes: printable ASCII, one line, at most ADMIN_COMMENT_MAX characters."""
    if not isinstance(text, str) or not _ADMIN_COMMENT_RE.fullmatch(text):
        raise ValueError(f"invalid AdminComment {str(text)[:40]!r}: printable ASCII, 1-{ADMIN_COMMENT_MAX} characters")
    return text


def validate_job_id(job_id: int | str) -> str:
    if isinstance(job_id, bool):
        raise ValueError(f"invalid job id {job_id!r}")
    text = str(job_id) if isinstance(job_id, int) else job_id
    if not isinstance(text, str) or not _JOB_ID_RE.fullmatch(text):
        raise ValueError(f"invalid job id {job_id!r}: expected a positive integer or ARRAYID_TASKID")
    return text


def validate_reservation_name(name: str) -> str:
    if not isinstance(name, str) or not _RESV_NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid reservation name {name!r}: 1-64 characters, letters, digits and ._- , starting alphanumeric"
        )
    return name


def validate_node_name(name: str) -> str:
    """Return one node name unchanged, or raise ValueError (a hostlist of several is refused)."""
    ns = validate_nodes(name)
    if not isinstance(name, str) or len(ns) != 1 or str(ns) != name:
        raise ValueError(f"expected one node name, got {name!r}")
    return name


def validate_argv(argv: Sequence[str]) -> list[str]:
    """Return a command as a list, or raise ValueError: a non-empty sequence of strings, the first
    not empty (it is run as it is, without a shell)."""
    if isinstance(argv, str) or not isinstance(argv, Sequence):
        raise ValueError(f"a command is a list of arguments, got {type(argv).__name__}")
    items = list(argv)
    if not items or not all(isinstance(a, str) for a in items) or not items[0]:
        raise ValueError(f"a command is a non-empty list of strings, got {items!r}")
    return items


def validate_users(users: Sequence[str]) -> list[str]:
    items = [users] if isinstance(users, str) else list(users)
    if not items:
        raise ValueError("a reservation needs at least one user")
    for u in items:
        if not isinstance(u, str) or not _USER_RE.fullmatch(u):
            raise ValueError(f"invalid user name {u!r}")
    return items


def validate_reservation_flags(flags: Sequence[str]) -> list[str]:
    items = [flags] if isinstance(flags, str) else list(flags)
    for f in items:
        if f not in RESERVATION_FLAGS:
            raise ValueError(f"unsupported reservation flag {f!r}; supported: {', '.join(sorted(RESERVATION_FLAGS))}")
    return items


def validate_duration(duration_min: int) -> int:
    if isinstance(duration_min, bool) or not isinstance(duration_min, int) or not 0 < duration_min <= 525600:
        raise ValueError(f"invalid duration {duration_min!r}: minutes, an integer from 1 to 525600 (one year)")
    return duration_min


def validate_next_state(next_state: str) -> str:
    if next_state not in NEXT_STATES:
        raise ValueError(f"invalid next state {next_state!r}: one of {', '.join(NEXT_STATES)}")
    return next_state


def reservation_args(
    name: str, nodes: str | Sequence[str], duration_min: int, users: Sequence[str], flags: Sequence[str]
) -> tuple[str, str, int, list[str], list[str]]:
    """A maintenance reservation's name, hostlist, duration, users and flags, validated in that order
    (ValueError), as every backend writes them."""
    return (validate_reservation_name(name), slurm_hostlist(nodes), validate_duration(duration_min),
            validate_users(users), validate_reservation_flags(flags))


def requested_nodes(names: str | Iterable[str] | None) -> list[str] | None:
    """The nodes a read is asked for as a list of names or hostlists, validated (ValueError): None asks
    for every node, an empty list for none (the read has nothing to do)."""
    if names is None:
        return None
    items = [names] if isinstance(names, str) else list(names)
    if items:
        validate_nodes(items)
    return items


# ---------------------------------------------------------------------------------------------
# state strings shared by the scontrol and pyslurm readers

BASE_STATES = frozenset({"idle", "mixed", "allocated", "down", "future", "unknown", "error", "completing"})


def filter_nodes(infos: Iterable[NodeInfo], names: Iterable[str] | None) -> list[NodeInfo]:
    """Keep the nodes named (names may be hostlists), in Slurm's order; all when names is None."""
    infos = list(infos)
    if names is None:
        return infos
    wanted = set(validate_nodes(list(names)) if not isinstance(names, str) else validate_nodes(names))
    return [n for n in infos if n.name in wanted]


def guarded_state_write(
    read: Callable[[list[str]], list[NodeInfo]],
    nodes: str | Sequence[str],
    needs: Callable[[NodeInfo], bool],
    write: Callable[[list[str]], None],
    what: str,
    log: logging.Logger,
) -> list[str]:
    """A node state change that Slurm refuses when it is not needed (RESUME, CANCEL_REBOOT), made
    idempotent: read the nodes, write only those that `needs` it, and when slurmctld still answers
    "Invalid node state specified", re-read: if no node needs it any more someone else did it
    (tolerated), otherwise the refusal stands. Returns the nodes written to."""
    wanted = list(validate_nodes(nodes))
    current = {n.name: n for n in read(wanted)}
    missing = [n for n in wanted if n not in current]
    if missing:
        raise SlurmRefused(f"{what}: Slurm has no node named {', '.join(missing[:5])}", argv=[what])
    todo = [n for n in wanted if needs(current[n])]
    if not todo:
        log.info("%s %s: nothing to do", what, ",".join(wanted))
        return []
    try:
        write(todo)
    except SlurmRefused as exc:
        if INVALID_STATE_MARKER not in (exc.stderr + str(exc)):
            raise
        if any(needs(n) for n in read(todo)):
            raise
        log.info("%s %s: already done by someone else (%s)", what, ",".join(todo), INVALID_STATE_MARKER)
    return todo
