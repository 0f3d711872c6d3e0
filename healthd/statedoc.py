"""The agent's state document, read the one way every reader on a node reads it: the hooks' gate, the
dry-run renderer and the reporter go through these functions. The controller receives the same
document over HTTP, checks it field by field (healthd.report_schema) and turns its findings back
into values with healthd.model.Finding.from_json.

`judge` says whether a document is usable right now (fresh, this node's, from a live agent): the
Slurm hooks' gate and `healthd state` ask it the same question.

The document is JSON written atomically by the agent (healthd.persist; healthd.agent.daemon writes
it, a finding's part is healthd.model.Finding.to_json). The field names every reader on a node uses
are the constants below, and tests/test_contracts.py checks that the agent's real document has each
of them. The accessors take the document as parsed JSON and never trust a field's type: a finding
whose tier is not an integer has no tier. Standard library only.
"""

from __future__ import annotations

import os

from healthd import trusted
from healthd.record import Record
from healthd.text import clean, parse_time

# The exit code of a one-shot check and of `healthd state` per verdict (the Nagios plugin codes).
EXIT_CODES = {"healthy": 0, "degraded": 1, "failed": 2, "unknown": 3}

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

STATE_MAX_BYTES = 8 << 20
"""A state document larger than this is refused (a real one is tens of KiB)."""

# the document
NODE = "node"
VERDICT = "verdict"
GENERATED_AT = "generated_at"
"""When the agent wrote it, RFC 3339."""
DRY_RUN = "dry_run"
AGENT = "agent"
AGENT_PID = "pid"
"""In `agent`: the pid of the agent that wrote it."""
FINDINGS = "findings"
WOULD_DO = "would_do"
INBAND = "inband"
DOCUMENT_FIELDS = (NODE, VERDICT, GENERATED_AT, DRY_RUN, AGENT, FINDINGS, WOULD_DO, INBAND)

# a finding
ID = "id"
TIER = "tier"
ATTRIBUTION = "attribution"
ACTION = "action"
SUMMARY = "summary"
COMPONENT = "component"
FINDING_FIELDS = (ID, TIER, ATTRIBUTION, ACTION, SUMMARY, COMPONENT)

# a finding's component
KIND = "kind"
"""gpu, port, node or filesystem."""
INDEX = "index"
"""A GPU's index (NVML numbering)."""
BUS_ID = "bus_id"
DEVICE = "device"
PORT = "port"


def load_state(path: str, trusted_uid: int = trusted.TRUSTED_UID) -> tuple[dict[str, Any] | None, str]:
    """(document, '') or (None, why it could not be read). Only a trusted file is read: owned by
    `trusted_uid` (root) and writable by neither group nor others, in a directory that is the same,
    neither the file nor its directory a link; anything else is 'agent unknown' with a line that
    names the path, the owner and the mode."""
    try:
        return trusted.read_json(path, STATE_MAX_BYTES, trusted_uid=trusted_uid), ""
    except FileNotFoundError:
        return None, f"state file {path} is missing (is healthd running?)"
    except trusted.TooLarge as e:
        return None, f"state file refused: {e}"
    except trusted.Untrusted as e:
        return None, f"state file refused: {e}"
    except OSError as e:
        return None, f"cannot read state file {path}: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"state file {path} is unparsable (truncated?): {clean(e, 120)}"


def f_id(f: dict[str, Any]) -> str:
    return str(f.get(ID))


def f_action(f: dict[str, Any]) -> Any:
    return f.get(ACTION)


def f_tier(f: dict[str, Any]) -> int | None:
    t = f.get(TIER)
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def f_gpu(f: dict[str, Any]) -> int | None:
    """The GPU index a finding is about (NVML numbering = Slurm/CUDA numbering on a node whose
    gres.conf lists the devices in order), or None for anything that is not an indexed GPU."""
    c = f.get(COMPONENT)
    if not isinstance(c, dict) or c.get(KIND) != "gpu":
        return None
    i = c.get(INDEX)
    return i if isinstance(i, int) and not isinstance(i, bool) and i >= 0 else None


def is_node_level(f: dict[str, Any]) -> bool:
    """A finding about the node's GPUs as a whole rather than one indexed GPU: component kind 'node'
    (fewer GPUs than expected, a failed quick check, an Xid line naming no bus id), or a GPU that
    carries no index (lost at enumeration; an Xid on a bus id NVML no longer lists). Ports,
    filesystems and findings without a component are not."""
    c = f.get(COMPONENT)
    if not isinstance(c, dict):
        return False
    return c.get(KIND) == "node" or (c.get(KIND) == "gpu" and f_gpu(f) is None)


def is_t1_hardware(f: dict[str, Any]) -> bool:
    return f_tier(f) == 1 and f.get(ATTRIBUTION) == "hardware"


def summary(f: dict[str, Any], limit: int = 150) -> str:
    return clean(f.get(SUMMARY) or f.get(ID) or "unnamed finding", limit)


def generated_at(doc: dict[str, Any]) -> float | None:
    """When the agent wrote the document (epoch seconds); None when the field is not a time."""
    return parse_time(doc.get(GENERATED_AT))


def agent_pid(doc: dict[str, Any]) -> int | None:
    """The pid of the agent that wrote the document; None when it names none."""
    agent = doc.get(AGENT)
    pid = agent.get(AGENT_PID) if isinstance(agent, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def findings(doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The document's findings; None when it has no findings list."""
    found = doc.get(FINDINGS)
    return found if isinstance(found, list) else None


def finding_ids(doc: dict[str, Any]) -> frozenset[str]:
    """The ids of the document's findings (what makes a report news, with the verdict)."""
    return frozenset(f_id(f) for f in findings(doc) or () if isinstance(f, dict))


def component_label(c: dict[str, Any]) -> str:
    """How a person names a finding's component: gpu3 (or gpu@<bus id>), mlx5_0/1, fs <mount>, node."""
    kind = c.get(KIND)
    if kind == "gpu":
        return f"gpu{c[INDEX]}" if c.get(INDEX) is not None else f"gpu@{c.get(BUS_ID)}"
    if kind == "port":
        return f"{c.get(DEVICE)}/{c.get(PORT)}"
    if kind == "filesystem":
        return f"fs {c.get(DEVICE)}"
    return "node"


# --------------------------------------------------------------------------- is it usable now


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Judgement(Record):
    """known: True only for a fresh document from a live agent on this node. reason: why the agent
    is unknown, or a one-line summary of what it says. doc: the document; age_s: its age."""

    _fields = ("known", "reason", "doc", "age_s")
    _defaults = {"doc": None, "age_s": None}
    known: bool
    reason: str
    doc: dict[str, Any] | None
    age_s: float | None

    @property
    def findings(self) -> list[dict[str, Any]]:
        if not self.known or self.doc is None:
            return []
        return [f for f in findings(self.doc) or [] if isinstance(f, dict)]


def judge(
    doc: dict[str, Any] | None,
    now: float,
    settings: Any,
    *,
    node: str | None = None,
    error: str = "",
    pid_alive: Callable[[int], bool] = pid_alive,
) -> Judgement:
    """Is the agent's state document usable right now? Pure given `pid_alive`. `node` (default
    settings.node_name) is the node the hook runs for; `error` says why `doc` is None."""
    stale_after_s = settings.hooks.stale_after_s
    node = node or settings.node_name

    def unknown(why: str) -> Judgement:
        return Judgement(False, f"agent unknown: {why}", doc)

    if doc is None:
        return unknown(error or "no state document")
    t = generated_at(doc)
    if t is None:
        return unknown(f"{GENERATED_AT} {clean(repr(doc.get(GENERATED_AT)), 60)} is not an RFC 3339 time")
    if doc.get(NODE) != node:
        return unknown(f"state file is for node {clean(repr(doc.get(NODE)), 80)}, not {node}")
    pid = agent_pid(doc)
    if pid is None:
        return unknown("state has no agent pid")
    # A dead agent's document is also stale soon after: the more exact reason is said first.
    if not pid_alive(pid):
        return unknown(f"agent pid {pid} is not running")
    age = now - t
    if age > stale_after_s:
        return unknown(f"state is {age:.0f}s old (hooks.stale_after_s {stale_after_s:g}): the agent is stopped or stuck")
    if age < -stale_after_s:
        return unknown(f"state is dated {-age:.0f}s in the future: the clock moved")
    listed = findings(doc)
    if listed is None:
        return unknown("state has no findings list")
    verdict = doc.get(VERDICT)
    return Judgement(True, f"agent alive (pid {pid}, verdict {clean(verdict, 20)}, {len(listed)} finding(s), "
                           f"state {max(age, 0.0):.1f}s old)", doc, age)
