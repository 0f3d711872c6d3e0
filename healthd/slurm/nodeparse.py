"""What the Slurm clients print about nodes, parsed (pure): the lines of `scontrol show node -o`
(`parse_scontrol_node_line`, and the NodeAddr of each in `parse_node_addresses`), the JSON documents
of `sinfo --json` and `scontrol show nodes --json` (`parse_sinfo_json`), and `scontrol --version`.
Output this module does not understand raises SlurmOutputError.

Sources for the JSON shapes: SchedMD/slurm src/plugins/data_parser/v0.0.42/parsers.c
(PARSER_ARRAY(NODE), PARSER_ARRAY(SINFO_DATA), PARSER_FLAG_ARRAY(NODE_STATES)) and the 22.05
sinfo output captured on a real cluster (tests/slurm/captured/).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

from healthd.slurm.backend import NodeInfo, SlurmOutputError, node_info, parse_state_string
from healthd.slurmtext import shared

_VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")

_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z_][A-Za-z0-9_]*)=")
# the ` [user@time]` Slurm appends to the first line of a reason (SLURM_TIME_FORMAT=standard)
_REASON_SUFFIX_RE = re.compile(r" \[([^\s\[\]@]+)@(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})\]")
# optional fields Slurm prints after Reason= (src/api/node_info.c, slurm_sprint_node_table)
_AFTER_REASON_KEYS = ("Comment", "Extra", "InstanceId", "InstanceType", "ReservationName")
_AFTER_REASON_RE = re.compile(r" (?:" + "|".join(_AFTER_REASON_KEYS) + r")=")


def local_epoch(stamp: str) -> float | None:
    """A time as the clients print it (SLURM_TIME_FORMAT=standard, local time) in epoch seconds; None
    when it is not one."""
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
        return tail[: chosen.start()], chosen.group(1), local_epoch(chosen.group(2))
    after = _AFTER_REASON_RE.search(tail)
    text = tail[: after.start()] if after else tail
    return text.rstrip(), None, None


def _head_fields(head: str) -> dict[str, str]:
    """The `Key=value` fields of a line of `scontrol show node -o` before its Reason=, in order.
    Values may contain spaces (OS=), so each runs to the next ` Key=`; a repeated key keeps its first."""
    fields: dict[str, str] = {}
    keys = list(_KEY_RE.finditer(head))
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(head)
        fields.setdefault(m.group(1), head[m.end():end].strip())
    return fields


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
    fields = _head_fields(head)
    name = fields.get("NodeName", "")
    if not name or next(iter(fields)) != "NodeName":
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
    return node_info(
        name, state, flags, reason, user, when,
        partitions=partitions,
        gres=gres,
        next_state=next_state.upper() if next_state else None,
        boot_time=local_epoch(boot) if boot and boot not in ("None", "Unknown") else None,
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
    gres = _get(obj, "gres", path, (str,)) or None
    return node_info(
        name, base, flags, reason, user, when,
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
        part = _get(entry, "partition", p, (dict,), default={})
        part_name = _get(part, "name", f"{p}.partition", (str,), default="")
        gres = _get(_get(entry, "gres", p, (dict,), default={}), "total", f"{p}.gres", (str,)) or None
        for name in names:
            if name in merged:
                prev = merged[name]
                if part_name and part_name not in prev.partitions:
                    merged[name] = dataclasses.replace(prev, partitions=(*prev.partitions, part_name))
                continue
            merged[name] = node_info(
                name, base, flags, reason, user, when,
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


def parse_node_addresses(text: str) -> dict[str, str]:
    """node -> NodeAddr from the lines of `scontrol show node -o` (pure). The fields are read from
    the part of the line before Reason=, whose free text could hold a `NodeAddr=` of its own."""
    out = {}
    for line in text.splitlines():
        fields = _head_fields(line.split(" Reason=", 1)[0])
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
