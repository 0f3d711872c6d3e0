"""The agent's state document, read the one way every reader on a node reads it: the hooks' gate, the
dry-run renderer and the reporter go through these functions. The controller receives the same
document over HTTP, checks it field by field (healthd.report_schema) and turns its findings back
into values with healthd.model.Finding.from_json.

`judge` says whether a document is usable right now (fresh, this node's, from a live agent): the
Slurm hooks' gate and `healthd state` ask it the same question.

The document is JSON written atomically by the agent (healthd.persist); its findings are objects
with `id`, `tier`, `attribution`, `action`, `summary` and a `component` (`kind` gpu/port/node/
filesystem, with `index` for a GPU). The accessors below take the document as parsed JSON and never
trust a field's type: a finding whose tier is not an integer has no tier. Standard library only.
"""

from __future__ import annotations

import os

from healthd import trusted
from healthd.record import Record
from healthd.text import clean, parse_time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

STATE_MAX_BYTES = 8 << 20
"""A state document larger than this is refused (a real one is tens of KiB)."""


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


def f_tier(f: dict[str, Any]) -> int | None:
    t = f.get("tier")
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def f_gpu(f: dict[str, Any]) -> int | None:
    """The GPU index a finding is about (NVML numbering = Slurm/CUDA numbering on a node whose
    gres.conf lists the devices in order), or None for anything that is not an indexed GPU."""
    c = f.get("component")
    if not isinstance(c, dict) or c.get("kind") != "gpu":
        return None
    i = c.get("index")
    return i if isinstance(i, int) and not isinstance(i, bool) and i >= 0 else None


def is_node_level(f: dict[str, Any]) -> bool:
    """A finding about the node's GPUs as a whole rather than one indexed GPU: component kind 'node'
    (fewer GPUs than expected, a failed quick check, an Xid line naming no bus id), or a GPU that
    carries no index (lost at enumeration; an Xid on a bus id NVML no longer lists). Ports,
    filesystems and findings without a component are not."""
    c = f.get("component")
    if not isinstance(c, dict):
        return False
    return c.get("kind") == "node" or (c.get("kind") == "gpu" and f_gpu(f) is None)


def is_t1_hardware(f: dict[str, Any]) -> bool:
    return f_tier(f) == 1 and f.get("attribution") == "hardware"


def summary(f: dict[str, Any], limit: int = 150) -> str:
    return clean(f.get("summary") or f.get("id") or "unnamed finding", limit)


def generated_at(doc: dict[str, Any]) -> float | None:
    """When the agent wrote the document (epoch seconds); None when the field is not a time."""
    return parse_time(doc.get("generated_at"))


def agent_pid(doc: dict[str, Any]) -> int | None:
    """The pid of the agent that wrote the document; None when it names none."""
    agent = doc.get("agent")
    pid = agent.get("pid") if isinstance(agent, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def findings(doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The document's findings; None when it has no findings list."""
    found = doc.get("findings")
    return found if isinstance(found, list) else None


def finding_ids(doc: dict[str, Any]) -> frozenset[str]:
    """The ids of the document's findings (what makes a report news, with the verdict)."""
    return frozenset(str(f.get("id")) for f in findings(doc) or () if isinstance(f, dict))


def component_label(c: dict[str, Any]) -> str:
    """How a person names a finding's component: gpu3 (or gpu@<bus id>), mlx5_0/1, fs <mount>, node."""
    kind = c.get("kind")
    if kind == "gpu":
        return f"gpu{c['index']}" if c.get("index") is not None else f"gpu@{c.get('bus_id')}"
    if kind == "port":
        return f"{c.get('device')}/{c.get('port')}"
    if kind == "filesystem":
        return f"fs {c.get('device')}"
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
        return [f for f in self.doc.get("findings", []) if isinstance(f, dict)]


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
        return unknown(f"generated_at {clean(repr(doc.get('generated_at')), 60)} is not an RFC 3339 time")
    age = now - t
    if age > stale_after_s:
        return unknown(f"state is {age:.0f}s old (hooks.stale_after_s {stale_after_s:g}): the agent is stopped or stuck")
    if age < -stale_after_s:
        return unknown(f"state is dated {-age:.0f}s in the future: the clock moved")
    if doc.get("node") != node:
        return unknown(f"state file is for node {clean(repr(doc.get('node')), 80)}, not {node}")
    pid = agent_pid(doc)
    if pid is None:
        return unknown("state has no agent pid")
    if not pid_alive(pid):
        return unknown(f"agent pid {pid} is not running")
    listed = findings(doc)
    if listed is None:
        return unknown("state has no findings list")
    verdict = doc.get("verdict")
    return Judgement(True, f"agent alive (pid {pid}, verdict {clean(verdict, 20)}, {len(listed)} finding(s), "
                           f"state {max(age, 0.0):.1f}s old)", doc, age)
