"""SlurmBackend over the Slurm command-line clients (scontrol, sinfo), for every Slurm version.

Every client runs with SLURM_CONF in its environment (without it a client falls back to
"configless" mode and sends a DNS SRV query off the machine), from an argv list (never a shell),
with a hard timeout after which the whole process group is killed. Failures are typed:
SlurmUnavailable (timeout, slurmctld unreachable), SlurmRefused (slurmctld said no),
SlurmOutputError (output we do not understand).

Validation steps (`run_step`, an `srun` the controller starts) run with a minimal environment instead:
srun hands the caller's environment to the job on the node, so the step gets a fixed system PATH,
LANG=C and SLURM_CONF, nothing of the daemon's own.

Reads, by Slurm version (`scontrol --version`, which does not contact slurmctld):
- 23.02 and later: `scontrol show nodes --json`, the data_parser NODE schema (one object per
  node; `state` is a list such as ["IDLE", "DRAIN"]; times are {"set","infinite","number"}).
  `sinfo --json` there emits the grouped SINFO_DATA schema instead, which parse_sinfo_json also
  reads, but scontrol's per-node document is the exact one.
- 21.08 to 22.05: `sinfo --json` (openapi v0.0.38: `state` is a lowercase string, the rest of
  the state in `state_flags`). It ignores -n, so nodes are filtered here.
- anything else, or a JSON answer this module does not understand: `scontrol show node -o`,
  parsed by parse_scontrol_node_line.
Sources for the JSON shapes: SchedMD/slurm src/plugins/data_parser/v0.0.42/parsers.c
(PARSER_ARRAY(NODE), PARSER_ARRAY(SINFO_DATA), PARSER_FLAG_ARRAY(NODE_STATES)) and the 22.05
sinfo output captured on a real cluster (tests/slurm/captured/).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from healthd.slurm.backend import (
    JobInfo,
    JobRun,
    NodeInfo,
    SlurmError,
    SlurmOutputError,
    SlurmRefused,
    SlurmUnavailable,
    StepResult,
    filter_nodes,
    guarded_state_write,
    parse_state_string,
    slurm_hostlist,
    validate_admin_comment,
    validate_argv,
    validate_duration,
    validate_job_id,
    validate_next_state,
    validate_node_name,
    validate_nodes,
    validate_reason,
    validate_reservation_flags,
    validate_reservation_name,
    validate_users,
)
from healthd.slurmtext import SCRUB_ENV, SCRUB_ENV_PREFIXES, UNAVAILABLE_MARKERS, shared

log = logging.getLogger(__name__)


_VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")
# slurmctld's answer to a reservation name it does not hold (ESLURM_RESERVATION_INVALID), and
# `scontrol show reservation NAME`'s for one that does not exist
RESERVATION_GONE_MARKERS = ("Requested reservation is invalid", "not found")
_BOOT_TIME_RE = re.compile(r"^BOOT_TIME\s*=\s*(\S+)", re.MULTILINE)
# squeue's answer to a job id slurmctld no longer holds (ESLURM_INVALID_JOB_ID)
JOB_GONE_MARKER = "Invalid job id"
SQUEUE_FORMAT = "--Format=JobID:40|,BatchFlag:4|,RestartCnt:10|,State:24|,Partition:64|,Account:64|,Comment:1000"
"""The batch flag (sbatch, not salloc/srun) is only in --Format; fields padded, '|' ends all but the
free-text comment, which comes last (Slurm refuses '|' in partition and account names)."""
SACCT_FORMAT = "--format=JobIDRaw,State,Start,End,Partition,Account,AllocTRES,NodeList,AdminComment"
"""With --parsable2: '|' between fields; the free-text AdminComment comes last."""
ACCOUNTING_DISABLED_MARKER = "accounting storage is disabled"
DBD_UNAVAILABLE_MARKERS = ("Problem talking to the database", "persistent connection", "Connection refused",
                           "Unable to contact")
"""sacct's words when slurmdbd (or its database) does not answer."""
_GPU_TRES_RE = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")
STEP_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"
"""PATH of a validation step (with bin_dir first when one is given): the system's, not the daemon's."""

# ---------------------------------------------------------------------------------------------
# running a client


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class CommandTimeout(Exception):
    pass


Runner = Callable[[list[str], dict[str, str], float], CommandResult]


def run_command(argv: list[str], env: dict[str, str], timeout_s: float) -> CommandResult:
    """Run argv (no shell) with env, stdin closed, in its own process group. After timeout_s the
    whole group is killed and CommandTimeout raised; the call never waits much past timeout_s.
    argv[0] is looked up on env's PATH; FileNotFoundError when it is not there."""
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} not found on PATH={env.get('PATH', os.defpath)}")
    proc = subprocess.Popen(
        [exe, *argv[1:]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        raise CommandTimeout(f"{argv[0]} did not finish within {timeout_s:g} s") from None
    return CommandResult(
        proc.returncode,
        out.decode("utf-8", errors="replace"),
        err.decode("utf-8", errors="replace"),
    )


def step_result(argv: list[str], env: dict[str, str], timeout_s: float, runner: Runner = run_command) -> StepResult:
    """Run one command through `runner` and say how it ended, whatever happened: its exit status and
    stdout then stderr; 124 and the timeout when it was killed at `timeout_s`; 127 and the error when
    it could not be started (not found, not executable, a NUL in an argument)."""
    try:
        done = runner(argv, env, timeout_s)
    except CommandTimeout as exc:
        return StepResult(124, str(exc))
    except (OSError, ValueError) as exc:
        return StepResult(127, f"{type(exc).__name__}: {exc}")
    return StepResult(done.returncode, done.stdout + done.stderr)


# ---------------------------------------------------------------------------------------------
# parsers (pure)

_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z_][A-Za-z0-9_]*)=")
# the ` [user@time]` Slurm appends to the first line of a reason (SLURM_TIME_FORMAT=standard)
_REASON_SUFFIX_RE = re.compile(r" \[([^\s\[\]@]+)@(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})\]")
# optional fields Slurm prints after Reason= (src/api/node_info.c, slurm_sprint_node_table)
_AFTER_REASON_KEYS = ("Comment", "Extra", "InstanceId", "InstanceType", "ReservationName")
_AFTER_REASON_RE = re.compile(r" (?:" + "|".join(_AFTER_REASON_KEYS) + r")=")


def _local_epoch(stamp: str) -> float | None:
    try:
        return float(time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")))
    except (ValueError, OverflowError):
        return None


def _split_reason(tail: str) -> tuple[str, str | None, float | None]:
    """`text [user@2026-11-29T09:22:22] Comment=...` -> (text, user, epoch).

    The reason is free text and may itself contain `[x@time]` or ` Comment=`, so the suffix taken
    is the LAST ` [user@time]` that ends the line or is followed by one of the optional fields
    Slurm prints after Reason= (Comment=, Extra=, InstanceId=, InstanceType=, ReservationName=).
    Only a Comment/Extra that itself ends in a fake suffix can still fool this; the JSON readers
    have no such ambiguity. Without a suffix the reason runs to the first optional field."""
    chosen = None
    for m in _REASON_SUFFIX_RE.finditer(tail):
        rest = tail[m.end():]
        if not rest.strip() or _AFTER_REASON_RE.match(rest):
            chosen = m
    if chosen is not None:
        return tail[: chosen.start()], chosen.group(1), _local_epoch(chosen.group(2))
    after = _AFTER_REASON_RE.search(tail)
    text = tail[: after.start()] if after else tail
    return text.rstrip(), None, None


def parse_scontrol_node_line(line: str) -> NodeInfo:
    """Parse one line of `scontrol show node -o` into a NodeInfo.

    Values may contain spaces (OS=, Reason=), so fields are cut at the next ` Key=`. Reason= is
    cut differently: it is free text, so it runs to the ` [user@time]` Slurm appends (or to the
    optional Comment=/Extra=/ReservationName= fields printed after it). Raises SlurmOutputError
    when the line has no NodeName= or State=."""
    if not isinstance(line, str):
        raise SlurmOutputError(f"scontrol show node -o: expected a line of text, got {type(line).__name__}")
    line = line.rstrip("\r\n")
    reason_tail: str | None = None
    idx = line.find(" Reason=")
    head = line
    if idx >= 0:
        head, reason_tail = line[:idx], line[idx + len(" Reason="):]
    fields: dict[str, str] = {}
    keys = list(_KEY_RE.finditer(head))
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(head)
        fields.setdefault(m.group(1), head[m.end():end].strip())
    name = fields.get("NodeName", "")
    if not name or not keys or keys[0].group(1) != "NodeName":
        raise SlurmOutputError(f"scontrol show node -o: line does not start with NodeName=: {line[:120]!r}")
    state_text = fields.get("State", "")
    try:
        state, flags = parse_state_string(state_text)
    except ValueError as exc:
        raise SlurmOutputError(f"scontrol show node -o: node {name}: bad State= {state_text!r}: {exc}") from None
    reason, user, when = "", None, None
    if reason_tail is not None:
        reason, user, when = _split_reason(reason_tail)
    partitions = shared(tuple(shared(p) for p in fields.get("Partitions", "").split(",") if p))
    gres = shared(fields.get("Gres")) or None
    if gres in ("(null)", "N/A"):
        gres = None
    next_state = shared(fields.get("NextState")) or None
    boot = fields.get("BootTime", "")
    return NodeInfo(
        name=name,
        state=state,
        flags=flags,
        reason=reason,
        reason_user=user if reason else None,
        reason_time=when if reason else None,
        partitions=partitions,
        gres=gres,
        next_state=next_state.upper() if next_state else None,
        boot_time=_local_epoch(boot) if boot and boot not in ("None", "Unknown") else None,
    )


def parse_scontrol_show_node(text: str) -> list[NodeInfo]:
    """All nodes in the output of `scontrol show node -o` (one per non-empty line)."""
    out = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("No nodes in the system"):
            out.append(parse_scontrol_node_line(line))
    return out


class _Shape(Exception):
    """Internal: a JSON value is not where or what we expect; carries the path."""


def _get(obj: dict, key: str, path: str, types: tuple[type, ...], required: bool = False, default: Any = None):
    if key not in obj or obj[key] is None:
        if required:
            raise _Shape(f"{path}.{key} is missing")
        return default
    val = obj[key]
    if isinstance(val, bool) and bool not in types:
        raise _Shape(f"{path}.{key} is a boolean, expected {'/'.join(t.__name__ for t in types)}")
    if not isinstance(val, types):
        raise _Shape(f"{path}.{key} is {type(val).__name__}, expected {'/'.join(t.__name__ for t in types)}")
    return val


def _number(val: Any, path: str) -> float | None:
    """A plain number, or data_parser's {"set": bool, "infinite": bool, "number": N}. Unset,
    infinite and 0 (Slurm's "never") become None."""
    if val is None:
        return None
    if isinstance(val, dict):
        if val.get("set") is False or val.get("infinite") is True:
            return None
        val = val.get("number")
        path += ".number"
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise _Shape(f"{path} is {type(val).__name__}, expected a number")
    if isinstance(val, int) and not -(2**63) <= val < 2**64:
        raise _Shape(f"{path} = {val} is out of range")
    if val != val or val in (float("inf"), float("-inf")):
        raise _Shape(f"{path} is not a finite number")
    return float(val) if val > 0 else None


def _str_list(val: Any, path: str) -> list[str]:
    if val is None:
        return []
    if isinstance(val, str):
        return [p for p in val.split(",") if p]
    if not isinstance(val, list):
        raise _Shape(f"{path} is {type(val).__name__}, expected a list of strings")
    for i, item in enumerate(val):
        if not isinstance(item, str):
            raise _Shape(f"{path}[{i}] is {type(item).__name__}, expected a string")
    return [v for v in val if v]


def _state_from_list(items: list[str], path: str) -> tuple[str, frozenset[str]]:
    """data_parser NODE_STATES: exactly one base state (IDLE, MIXED, ...) plus flag names."""
    if not items:
        raise _Shape(f"{path} is an empty list")
    base = None
    flags = set()
    for item in items:
        low = item.lower()
        if low in ("idle", "mixed", "allocated", "down", "future", "unknown", "error") and base is None:
            base = low
        else:
            flags.add(item.upper())
    if base is None:
        raise _Shape(f"{path} {items!r} has no base state (IDLE, MIXED, ALLOCATED, DOWN, ...)")
    return base, frozenset(flags)


def _next_state(val: Any, flags_val: Any, path: str) -> str | None:
    """The state after a requested reboot. 22.05 says next_state_after_reboot "unknown" with
    next_state_after_reboot_flags ["RESUME", "?"] for `nextstate=RESUME` (seen on a real cluster);
    data_parser dumps a NODE_STATES list (["INVALID"] when there is none). RESUME wins; otherwise
    the first real state; INVALID/UNKNOWN alone mean none."""
    items = [val] if isinstance(val, str) else _str_list(val, path)
    items += _str_list(flags_val, path + "_flags") if flags_val is not None else []
    upper = [i.upper() for i in items if i]
    if "RESUME" in upper:
        return "RESUME"
    for item in upper:
        if item not in ("INVALID", "UNKNOWN", "NONE", "?"):
            return item
    return None


def _node_from_object(obj: Any, path: str) -> NodeInfo:
    if not isinstance(obj, dict):
        raise _Shape(f"{path} is {type(obj).__name__}, expected an object")
    name = _get(obj, "name", path, (str,), required=True)
    if not name:
        raise _Shape(f"{path}.name is empty")
    raw_state = _get(obj, "state", path, (str, list), required=True)
    if isinstance(raw_state, str):  # openapi v0.0.38 (21.08, 22.05)
        base, flags = parse_state_string(raw_state) if raw_state else ("", frozenset())
        if not base:
            raise _Shape(f"{path}.state is empty")
        flags = flags | frozenset(f.upper() for f in _str_list(obj.get("state_flags"), f"{path}.state_flags"))
    else:  # data_parser v0.0.39+ (23.02 and later)
        base, flags = _state_from_list(_str_list(raw_state, f"{path}.state"), f"{path}.state")
    next_state = _next_state(
        obj.get("next_state_after_reboot"),
        obj.get("next_state_after_reboot_flags"),
        f"{path}.next_state_after_reboot",
    )
    # like scontrol (src/api/node_info.c), a next state only means something while a reboot is pending
    if not flags & {"REBOOT_REQUESTED", "REBOOT_ISSUED"}:
        next_state = None
    reason = _get(obj, "reason", path, (str,), default="")
    user = _get(obj, "reason_set_by_user", path, (str,))
    when = _number(obj.get("reason_changed_at"), f"{path}.reason_changed_at")
    # 22.05 sometimes keeps reason_set_by_user after a resume cleared the reason (tests/slurm/captured/)
    if not reason:
        user, when = None, None
    gres = _get(obj, "gres", path, (str,)) or None
    return NodeInfo(
        name=name,
        state=base,
        flags=flags,
        reason=reason,
        reason_user=user or None,
        reason_time=when,
        partitions=tuple(_str_list(obj.get("partitions"), f"{path}.partitions")),
        gres=gres,
        next_state=next_state,
        boot_time=_number(obj.get("boot_time"), f"{path}.boot_time"),
    )


def _nodes_from_sinfo_entries(entries: list, path: str) -> list[NodeInfo]:
    """data_parser SINFO_DATA: one entry per group of alike nodes in one partition."""
    merged: dict[str, NodeInfo] = {}
    for i, entry in enumerate(entries):
        p = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise _Shape(f"{p} is {type(entry).__name__}, expected an object")
        node = _get(entry, "node", p, (dict,), required=True)
        base, flags = _state_from_list(_str_list(node.get("state"), f"{p}.node.state"), f"{p}.node.state")
        nodes = _get(entry, "nodes", p, (dict,), required=True)
        names = _str_list(nodes.get("nodes"), f"{p}.nodes.nodes")
        reason_obj = _get(entry, "reason", p, (dict,), default={})
        reason = _get(reason_obj, "description", f"{p}.reason", (str,), default="")
        user = _get(reason_obj, "user", f"{p}.reason", (str,))
        when = _number(reason_obj.get("time"), f"{p}.reason.time")
        if not reason:
            user, when = None, None
        part = _get(entry, "partition", p, (dict,), default={})
        part_name = _get(part, "name", f"{p}.partition", (str,), default="")
        gres = _get(_get(entry, "gres", p, (dict,), default={}), "total", f"{p}.gres", (str,)) or None
        for name in names:
            if name in merged:
                prev = merged[name]
                if part_name and part_name not in prev.partitions:
                    merged[name] = dataclasses.replace(prev, partitions=(*prev.partitions, part_name))
                continue
            merged[name] = NodeInfo(
                name=name,
                state=base,
                flags=flags,
                reason=reason,
                reason_user=user or None,
                reason_time=when,
                partitions=(part_name,) if part_name else (),
                gres=gres,
            )
    return list(merged.values())


def json_errors(doc: Any) -> list[str]:
    """The texts of a Slurm JSON document's "errors" list (at most 5). 22.05's `sinfo --json`
    exits 0 with errors [{"error": "Unspecified error", "errno": -1}] and no nodes when slurmctld
    is down (seen on a real cluster)."""
    if not isinstance(doc, dict):
        return []
    errors = doc.get("errors")
    if not isinstance(errors, list):
        return []
    texts = []
    for e in errors[:5]:
        if isinstance(e, dict):
            text = e.get("description") or e.get("error") or json.dumps(e, default=str)
            if e.get("errno") is not None:
                text = f"{text} (errno {e.get('errno')})"
            texts.append(str(text)[:200])
        else:
            texts.append(str(e)[:200])
    return texts


def _doc_release(doc: dict) -> str:
    meta = doc.get("meta")
    if isinstance(meta, dict):
        for key in ("Slurm", "slurm"):
            sl = meta.get(key)
            if isinstance(sl, dict) and isinstance(sl.get("release"), str):
                return sl["release"]
    return "(unknown version)"


def parse_sinfo_json(doc: Any) -> list[NodeInfo]:
    """Nodes from a decoded Slurm JSON document: `sinfo --json` of 21.08/22.05 (openapi v0.0.38),
    `scontrol show nodes --json` / slurmrestd /nodes of 23.02+ (data_parser NODE), or
    `sinfo --json` of 23.02+ (data_parser SINFO_DATA, grouped; expanded here).

    Anything else raises SlurmOutputError("unexpected sinfo --json shape from Slurm X: ...")."""
    release = _doc_release(doc) if isinstance(doc, dict) else "(unknown version)"
    try:
        if not isinstance(doc, dict):
            raise _Shape(f"document is {type(doc).__name__}, expected an object")
        errors = json_errors(doc)
        if errors:
            raise _Shape("Slurm reported errors: " + "; ".join(errors))
        if isinstance(doc.get("nodes"), list):
            return [_node_from_object(n, f"nodes[{i}]") for i, n in enumerate(doc["nodes"])]
        if isinstance(doc.get("sinfo"), list):
            return _nodes_from_sinfo_entries(doc["sinfo"], "sinfo")
        raise _Shape(f"no 'nodes' or 'sinfo' list at the top level (keys: {sorted(map(str, doc))[:10]})")
    except _Shape as exc:
        raise SlurmOutputError(f"unexpected sinfo --json shape from Slurm {release}: {exc}") from None
    except ValueError as exc:  # parse_state_string
        raise SlurmOutputError(f"unexpected sinfo --json shape from Slurm {release}: {exc}") from None


def parse_sinfo_json_text(text: str) -> list[NodeInfo]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SlurmOutputError(f"Slurm's JSON output does not parse: {exc}: {text[:120]!r}") from None
    return parse_sinfo_json(doc)


def parse_squeue_jobs(text: str) -> list[JobInfo]:
    """The lines of `squeue --noheader` with SQUEUE_FORMAT (pure); lines without a job id are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split("|", 6)
        if len(parts) != 7 or not parts[0].strip():
            continue
        job, batch, restarts, state, partition, account, comment = (p.strip() for p in parts)
        out.append(JobInfo(job, batch == "1", comment, int(restarts) if restarts.isdigit() else 0,
                           state, partition, account))
    return out


def _sacct_time(text: str) -> float | None:
    return None if text in ("", "Unknown", "None") else _local_epoch(text)


def parse_sacct_runs(text: str) -> list[JobRun]:
    """The lines of `sacct --duplicates --allocations --parsable2 --noheader` with SACCT_FORMAT
    (pure): one run per line, in sacct's order (oldest first); lines that are not a run are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split("|", 8)
        if len(parts) != 9 or not parts[0].strip():
            continue
        job, state, start, end, partition, account, tres, nodes, comment = parts
        words = state.split()
        m = _GPU_TRES_RE.search(tres)
        out.append(JobRun(job.strip(), words[0].rstrip("+") if words else "", _sacct_time(start.strip()),
                          _sacct_time(end.strip()), partition.strip(), account.strip(),
                          int(m.group(1)) if m else None, nodes.strip(), comment.strip()))
    return out


def parse_node_addresses(text: str) -> dict[str, str]:
    """node -> NodeAddr from the lines of `scontrol show node -o` (pure). The fields are read from
    the part of the line before Reason=, whose free text could hold a `NodeAddr=` of its own."""
    out = {}
    for line in text.splitlines():
        head = line.split(" Reason=", 1)[0]
        fields: dict[str, str] = {}
        keys = list(_KEY_RE.finditer(head))
        for i, m in enumerate(keys):
            end = keys[i + 1].start() if i + 1 < len(keys) else len(head)
            fields.setdefault(m.group(1), head[m.end():end].strip())
        name, addr = fields.get("NodeName"), fields.get("NodeAddr")
        if name and addr:
            out[name] = addr
    return out


def parse_version(text: str) -> tuple[int, int]:
    """'slurm 22.05.8' / 'slurm-wlm 22.05.8' / '24.11.1' -> (22, 5)."""
    m = _VERSION_RE.search(text or "")
    if not m:
        raise SlurmOutputError(f"cannot read a Slurm version from {text[:80]!r}")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------------


class ScontrolBackend:
    """SlurmBackend over scontrol/sinfo. See the module docstring for the read strategy.

    slurm_conf: path to slurm.conf; None takes SLURM_CONF from the environment. If neither is
    set, or the file does not exist, construction fails: no client is ever run without it.
    read_mode: "auto" (by version), "scontrol-json", "sinfo-json" or "oneliner".
    runner: how commands are run (tests pass a fake; the default is run_command)."""

    READ_MODES = ("auto", "scontrol-json", "sinfo-json", "oneliner")

    def __init__(
        self,
        slurm_conf: str | None = None,
        timeout_s: float = 10.0,
        bin_dir: str | None = None,
        *,
        dry_run: bool = False,
        read_mode: str = "auto",
        runner: Runner | None = None,
        logger: logging.Logger | None = None,
    ):
        conf = slurm_conf if slurm_conf is not None else os.environ.get("SLURM_CONF")
        if not conf:
            raise SlurmUnavailable(
                "no slurm.conf: pass slurm_conf= or set SLURM_CONF. healthd never runs a Slurm client "
                "without one (the client would fall back to a DNS SRV lookup for _slurmctld._tcp)"
            )
        if runner is None and not os.path.isfile(conf):
            raise SlurmUnavailable(f"slurm.conf {conf!r} does not exist (from {'slurm_conf=' if slurm_conf else 'SLURM_CONF'})")
        if read_mode not in self.READ_MODES:
            raise ValueError(f"read_mode {read_mode!r}: one of {', '.join(self.READ_MODES)}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.slurm_conf = os.path.abspath(conf)
        self.timeout_s = float(timeout_s)
        self.bin_dir = bin_dir
        self.dry_run = dry_run
        self.planned: list[list[str]] = []
        self.read_mode = read_mode
        self._runner = runner or run_command
        self._log = logger or log
        self._version: str | None = None
        self._effective_read_mode: str | None = None if read_mode == "auto" else read_mode

    # -- plumbing -------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        if self.bin_dir:
            return os.path.join(self.bin_dir, name)
        return name

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(SCRUB_ENV_PREFIXES) and k not in SCRUB_ENV
        }
        env["SLURM_CONF"] = self.slurm_conf
        env["SLURM_TIME_FORMAT"] = "standard"  # the [user@2026-11-29T09:22:22] the parser expects
        env.setdefault("PATH", os.defpath)
        return env

    def _run(self, argv: list[str]) -> str:
        """Run one client call; return stdout or raise SlurmUnavailable / SlurmRefused."""
        env = self._env()
        started = time.monotonic()
        try:
            res = self._runner(argv, env, self.timeout_s)
        except CommandTimeout:
            raise SlurmUnavailable(
                f"{shlex.join(argv)} timed out after {self.timeout_s:g} s: slurmctld is down or overloaded "
                f"(check `scontrol ping` with SLURM_CONF={self.slurm_conf})",
                argv=argv,
            ) from None
        except FileNotFoundError as exc:
            raise SlurmUnavailable(f"{exc}; install the Slurm client or pass bin_dir=", argv=argv) from None
        except OSError as exc:  # permission denied, argument list too long, ...
            raise SlurmUnavailable(f"cannot run {argv[0]}: {exc}", argv=argv) from None
        elapsed = time.monotonic() - started
        if res.returncode != 0:
            msg = (res.stderr.strip() or res.stdout.strip() or f"exit status {res.returncode}")
            short = msg.splitlines()[-1] if msg else msg
            if any(m in msg for m in UNAVAILABLE_MARKERS):
                raise SlurmUnavailable(
                    f"{shlex.join(argv)}: slurmctld unreachable after {elapsed:.1f} s: {short}",
                    argv=argv,
                    returncode=res.returncode,
                    stderr=res.stderr,
                )
            raise SlurmRefused(
                f"{shlex.join(argv)} failed (exit {res.returncode}): {short}",
                argv=argv,
                returncode=res.returncode,
                stderr=res.stderr,
            )
        return res.stdout

    def _write(self, argv: list[str]) -> None:
        if self.dry_run:
            self.planned.append(list(argv))
            self._log.info("dry run, not running: %s", shlex.join(argv))
            return
        self._log.info("running: %s", shlex.join(argv))
        self._run(argv)

    # -- describe: the exact argv of every write ------------------------------------------

    def describe(self, action: str, **kw) -> list[str]:
        """The argv `action` would run, after validation (ValueError on bad arguments).
        Actions: drain, resume, reboot_asap, cancel_reboot, requeue, create_reservation,
        delete_reservation."""
        builder = getattr(self, f"_argv_{action}", None)
        if builder is None:
            raise ValueError(f"unknown action {action!r}")
        return builder(**kw)

    def _argv_drain(self, nodes: str | Sequence[str], reason: str) -> list[str]:
        hl = slurm_hostlist(nodes)
        reason = validate_reason(reason)
        return [self._bin("scontrol"), "update", f"NodeName={hl}", "State=DRAIN", f"Reason={reason}"]

    def _argv_resume(self, nodes: str | Sequence[str]) -> list[str]:
        hl = slurm_hostlist(nodes)
        return [self._bin("scontrol"), "update", f"NodeName={hl}", "State=RESUME"]

    def _argv_reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> list[str]:
        hl = slurm_hostlist(nodes)
        reason = validate_reason(reason)
        next_state = validate_next_state(next_state)
        return [self._bin("scontrol"), "reboot", "ASAP", f"nextstate={next_state}", f"reason={reason}", hl]

    def _argv_cancel_reboot(self, nodes: str | Sequence[str]) -> list[str]:
        hl = slurm_hostlist(nodes)
        return [self._bin("scontrol"), "cancel_reboot", hl]

    def _argv_requeue(self, job_id: int | str) -> list[str]:
        return [self._bin("scontrol"), "requeue", validate_job_id(job_id)]

    def _argv_set_admin_comment(self, job_id: int | str, text: str) -> list[str]:
        return [self._bin("sacctmgr"), "--immediate", "modify", "job", "where", f"jobid={validate_job_id(job_id)}",
                "set", f"AdminComment={validate_admin_comment(text)}"]

    def _argv_create_reservation(
        self,
        name: str,
        nodes: str | Sequence[str],
        duration_min: int,
        users: Sequence[str] = ("root",),
        flags: Sequence[str] = ("MAINT", "IGNORE_JOBS"),
    ) -> list[str]:
        name = validate_reservation_name(name)
        hl = slurm_hostlist(nodes)
        duration_min = validate_duration(duration_min)
        users = validate_users(users)
        flags = validate_reservation_flags(flags)
        argv = [
            self._bin("scontrol"),
            "create",
            "reservation",
            f"ReservationName={name}",
            f"Nodes={hl}",
            "StartTime=now",
            f"Duration={duration_min}",
            f"Users={','.join(users)}",
        ]
        if flags:
            argv.append(f"Flags={','.join(flags)}")
        return argv

    def _argv_delete_reservation(self, name: str) -> list[str]:
        return [self._bin("scontrol"), "delete", f"ReservationName={validate_reservation_name(name)}"]

    # -- reads ----------------------------------------------------------------------------

    def version(self) -> str:
        """The Slurm version of the installed client (e.g. '22.05.8'); it does not contact
        slurmctld. Cached."""
        if self._version is None:
            out = self._run([self._bin("scontrol"), "--version"])
            parse_version(out)  # raises SlurmOutputError on nonsense
            m = re.search(r"(\d+\.\d+(?:\.\d+)?\S*)", out)
            self._version = m.group(1) if m else out.strip()
        return self._version

    def _mode(self) -> str:
        if self._effective_read_mode is None:
            major_minor = parse_version(self.version())
            if major_minor >= (23, 2):
                mode = "scontrol-json"
            elif major_minor >= (21, 8):
                mode = "sinfo-json"
            else:
                mode = "oneliner"
            self._log.debug("Slurm %s: reading nodes with %s", self._version, mode)
            self._effective_read_mode = mode
        return self._effective_read_mode

    def _read_all(self) -> list[NodeInfo]:
        mode = self._mode()
        if mode == "oneliner":
            return parse_scontrol_show_node(self._run([self._bin("scontrol"), "show", "node", "-o"]))
        argv = (
            [self._bin("scontrol"), "show", "nodes", "--json"]
            if mode == "scontrol-json"
            else [self._bin("sinfo"), "--json"]
        )
        try:
            out = self._run(argv)
            try:
                doc = json.loads(out)
            except (ValueError, RecursionError) as exc:
                raise SlurmOutputError(f"{shlex.join(argv)}: output is not JSON: {exc}: {out[:120]!r}") from None
            errors = json_errors(doc)
            if errors:
                raise SlurmUnavailable(
                    f"{shlex.join(argv)}: Slurm answered with errors instead of nodes: {'; '.join(errors)} "
                    "(slurmctld is probably down or unreachable)",
                    argv=argv,
                    returncode=0,
                    stderr="; ".join(errors),
                )
            return parse_sinfo_json(doc)
        except (SlurmOutputError, SlurmRefused) as exc:
            if self.read_mode != "auto":
                raise
            self._log.warning(
                "%s unusable (%s); reading nodes with `scontrol show node -o` from now on", shlex.join(argv), exc
            )
            self._effective_read_mode = "oneliner"
            return self._read_all()

    def node_lines(self) -> list[str]:
        """Every node as one line of `scontrol show node -o`, unparsed: the fleet view keeps the lines
        it saw and parses only those that changed (healthd.controller.fleetcache). At 10,000 nodes
        this read takes about a sixth of `sinfo --json`'s time on 22.05."""
        return self._run([self._bin("scontrol"), "show", "node", "-o"]).splitlines()

    parse_node_line = staticmethod(parse_scontrol_node_line)
    """How a line of node_lines() becomes a NodeInfo."""

    parse_node_addresses = staticmethod(parse_node_addresses)
    """node -> NodeAddr from lines of node_lines() (joined by newlines)."""

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            if not names:
                return []
            validate_nodes(names)
        return filter_nodes(self._read_all(), names)

    def node(self, name: str) -> NodeInfo:
        ns = validate_nodes(name)
        if len(ns) != 1:
            raise ValueError(f"node() takes one node name, got {name!r} ({len(ns)} nodes)")
        # One node, one RPC, one process: the hooks call this on every node at every health check,
        # so it must not list the whole cluster (sinfo --json) nor ask for the client version first.
        argv = [self._bin("scontrol"), "show", "node", "-o", name]
        try:
            found = filter_nodes(parse_scontrol_show_node(self._run(argv)), [name])
        except SlurmRefused as exc:
            if "invalid node name" in (exc.stderr or str(exc)).lower():
                raise SlurmRefused(f"Slurm has no node named {name!r}", argv=argv) from None
            raise
        if not found:
            raise SlurmRefused(f"Slurm has no node named {name!r}", argv=argv)
        return found[0]

    # -- writes ---------------------------------------------------------------------------

    def drain(self, nodes: str | Sequence[str], reason: str) -> None:
        self._write(self._argv_drain(nodes, reason))

    def resume(self, nodes: str | Sequence[str]) -> None:
        """RESUME the nodes that need it. RESUME is not idempotent in Slurm (an idle node answers
        'Invalid node state specified'), so nodes that are not drained/down/failed/awaiting a
        reboot are skipped, and a refusal that a fresh read shows was a race is tolerated."""
        self._argv_resume(nodes)  # validate before reading
        guarded_state_write(
            self.nodes, nodes, lambda n: n.resumable, lambda todo: self._write(self._argv_resume(todo)), "resume", self._log
        )

    def reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> None:
        self._write(self._argv_reboot_asap(nodes, reason, next_state))

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None:
        """Cancel a requested (not yet issued) reboot; nodes without one are skipped. Slurm also
        drops the drain and reason that `reboot ASAP` set (seen on 22.05)."""
        self._argv_cancel_reboot(nodes)
        guarded_state_write(
            self.nodes,
            nodes,
            lambda n: "REBOOT_REQUESTED" in n.flags,
            lambda todo: self._write(self._argv_cancel_reboot(todo)),
            "cancel_reboot",
            self._log,
        )

    def requeue(self, job_id: int | str) -> None:
        self._write(self._argv_requeue(job_id))

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        """`sacctmgr --immediate modify job where jobid=J set AdminComment=TEXT` (slurmdbd)."""
        self._write(self._argv_set_admin_comment(job_id, text))

    def job_runs(self, job_id: int | str) -> list[JobRun] | None:
        """Every run of the job from `sacct --duplicates` (a requeued job's earlier runs included);
        None when the site keeps no accounting; SlurmUnavailable when slurmdbd does not answer."""
        argv = [self._bin("sacct"), f"--jobs={validate_job_id(job_id)}", "--duplicates", "--allocations",
                "--parsable2", "--noheader", SACCT_FORMAT]
        try:
            out = self._run(argv)
        except SlurmRefused as exc:
            said = exc.stderr + str(exc)
            if ACCOUNTING_DISABLED_MARKER in said:
                return None
            if any(m in said for m in DBD_UNAVAILABLE_MARKERS):
                raise SlurmUnavailable(f"sacct: slurmdbd unreachable: {said.strip().splitlines()[-1][:200]}",
                                       argv=argv, returncode=exc.returncode, stderr=exc.stderr) from None
            raise
        return parse_sacct_runs(out)

    def create_reservation(
        self,
        name: str,
        nodes: str | Sequence[str],
        duration_min: int,
        users: Sequence[str] = ("root",),
        flags: Sequence[str] = ("MAINT", "IGNORE_JOBS"),
    ) -> None:
        self._write(self._argv_create_reservation(name, nodes, duration_min, users, flags))

    def delete_reservation(self, name: str) -> None:
        """Delete the reservation; one that is already gone is done, not an error."""
        try:
            self._write(self._argv_delete_reservation(name))
        except SlurmRefused as exc:
            if not any(m in (exc.stderr + str(exc)) for m in RESERVATION_GONE_MARKERS):
                raise
            self._log.info("delete reservation %s: already gone", name)

    def reservation_exists(self, name: str) -> bool:
        argv = [self._bin("scontrol"), "show", "reservation", "-o", validate_reservation_name(name)]
        try:
            out = self._run(argv)
        except SlurmRefused as exc:
            if any(m in (exc.stderr + str(exc)) for m in RESERVATION_GONE_MARKERS):
                return False
            raise
        return f"ReservationName={name} " in out + " "

    def ctld_started_at(self) -> float | None:
        """BOOT_TIME of `scontrol show config`: when the running slurmctld started."""
        out = self._run([self._bin("scontrol"), "show", "config"])
        m = _BOOT_TIME_RE.search(out)
        return _local_epoch(m.group(1)) if m else None

    # -- jobs, addresses, validation steps ------------------------------------------------

    def _squeue(self, select: list[str]) -> list[JobInfo]:
        return parse_squeue_jobs(self._run([self._bin("squeue"), "--noheader", *select, SQUEUE_FORMAT]))

    def jobs_on(self, node: str) -> list[JobInfo]:
        """The jobs running on `node` (squeue): id, batch flag, restart count, comment."""
        return self._squeue([f"--nodelist={validate_node_name(node)}", "--states=RUNNING"])

    def job(self, job_id: int | str) -> JobInfo | None:
        """One job in any state, None once slurmctld no longer holds it: its restart count tells
        whether a requeue whose client died with the controller reached slurmctld."""
        text = validate_job_id(job_id)
        try:
            found = self._squeue([f"--jobs={text}", "--states=all"])
        except SlurmRefused as exc:
            if JOB_GONE_MARKER in (exc.stderr + str(exc)):
                return None
            raise
        return next((j for j in found if j.job_id == text), None)

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """node -> its NodeAddr as Slurm has it (`scontrol show node -o`), all nodes or those named."""
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            if not names:
                return {}
            wanted = set(validate_nodes(names))
        addrs = parse_node_addresses(self._run([self._bin("scontrol"), "show", "node", "-o"]))
        return addrs if names is None else {n: a for n, a in addrs.items() if n in wanted}

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        """Run one command that starts work through Slurm (`srun ... healthd validate`), as it is (no
        shell), with STEP_PATH, LANG=C and SLURM_CONF only, its process group killed at timeout_s.
        Never raises for how it ended (StepResult); with dry_run it is planned, not run."""
        command = validate_argv(argv)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if self.dry_run:
            self.planned.append(command)
            self._log.info("dry run, not running: %s", shlex.join(command))
            return StepResult(0, f"dry run, not run: {shlex.join(command)}")
        path = f"{self.bin_dir}:{STEP_PATH}" if self.bin_dir else STEP_PATH
        env = {"PATH": path, "LANG": "C", "SLURM_CONF": self.slurm_conf}
        self._log.info("running: %s", shlex.join(command))
        return step_result(command, env, float(timeout_s), self._runner)


__all__ = [
    "CommandResult",
    "CommandTimeout",
    "ScontrolBackend",
    "SlurmError",
    "parse_node_addresses",
    "parse_scontrol_node_line",
    "parse_scontrol_show_node",
    "parse_sinfo_json",
    "parse_sinfo_json_text",
    "parse_squeue_jobs",
    "parse_version",
    "run_command",
    "step_result",
]
