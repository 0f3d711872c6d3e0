"""The Slurm node reason healthd writes: its `healthd:` prefix, the test of whether a reason says it
is healthd's, how one is built from free text, and how long one may be.

Standard library only and cheap to import: the hooks build reasons on the job-launch path, the
controller and the node model build them too, and the Slurm edge (healthd.slurm.backend) refuses any
reason over the same limit before a client runs.

The limit is MAX_REASON_BYTES, 255 bytes of UTF-8. slurmctld keeps a node reason of any length:
`update_node()` (src/slurmctld/node_mgr.c) copies it whole, and on Slurm 22.05.8 a reason of 131,064
characters set with `scontrol update` reads back whole from `scontrol show node` and `sinfo --json`
(one character more and the kernel refuses to start scontrol: one argv element holds at most 128 KiB).
The accounting record does not: slurmdbd writes every node state change, with its reason, to the
cluster's event table, whose `reason` column is a MySQL TINYTEXT of at most 255 bytes
(src/plugins/accounting_storage/mysql/accounting_storage_mysql.c, `event_table_fields`). A longer
reason is cut or refused there, and `sacctmgr show event` no longer shows the reason healthd wrote.
A reason healthd builds is printable ASCII, so its characters are its bytes.
"""

from __future__ import annotations

from healthd.text import printable_ascii

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REASON_PREFIX = "healthd:"
"""Every reason healthd writes starts with this."""
MAX_REASON_BYTES = 255
"""The longest reason, in UTF-8 bytes, that Slurm keeps whole everywhere it records one."""

def printable(text: Any) -> str:
    """`text` as one line of printable ASCII: every other character (newline, tab, control character,
    anything outside ASCII) becomes `?`."""
    return printable_ascii(str(text))


def build_reason(text: Any, suffix: str = "") -> str:
    """`healthd: <text> <suffix>` (`healthd: <text>` without a suffix): one printable line of at most
    MAX_REASON_BYTES. A text too long for the room is shortened and ends in `...`; the prefix and the
    suffix are kept."""
    body, tail = printable(text), printable(suffix)
    end = f" {tail}" if tail else ""
    room = MAX_REASON_BYTES - len(REASON_PREFIX) - 1 - len(end)
    if len(body) > room:
        body = body[: max(room - 3, 0)] + "..."
    out = f"{REASON_PREFIX} {body}{end}"
    # only a suffix longer than the limit gets here: the reason must fit all the same
    return out if len(out) <= MAX_REASON_BYTES else out[: MAX_REASON_BYTES - 3] + "..."


def is_healthd_reason(reason: Any) -> bool:
    """The reason says it is healthd's: it starts with `healthd:`. Anyone can write that text, so the
    controller decides ownership by record (healthd.controller.ownership); the hooks go by this."""
    return isinstance(reason, str) and reason.startswith(REASON_PREFIX)


def reason_bytes(reason: str) -> int:
    """The length of `reason` as Slurm stores it: UTF-8 bytes (a lone surrogate counts as three)."""
    return len(reason.encode("utf-8", "surrogatepass"))
