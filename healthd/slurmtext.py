"""Slurm's own words, for every part that reads its clients: the node state strings of scontrol and
sinfo, what a client prints when slurmctld cannot be reached, and the environment a client must not see. One home for both the Slurm
backends (healthd.slurm) and the hooks' small client (healthd.hooks.slurmnode), which must not pay
for importing the backends. Imports nothing."""

from __future__ import annotations

UNAVAILABLE_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out on send/recv operation",
    "Communication connection failure",
    "Communication send failure",
    "Communication receive failure",
    "Communication shutdown failure",
    "Zero Bytes were transmitted or received",
    "Connection refused",
    "Unable to establish controller machine",
    "Could not establish a configuration source",
    "Insane message length",
    "Protocol authentication error",
    "Munge encode failed",
    "Slurmctld is unavailable",
    "Slurm backup controller in standby mode",
)
"""What a client prints when slurmctld cannot be reached (src/common/slurm_errno.c texts), or when
the client cannot even find its controller: unavailable, not refused."""

SCRUB_ENV_PREFIXES = ("SINFO_", "SQUEUE_", "SCONTROL_")
SCRUB_ENV = ("SLURM_CLUSTERS", "SLURM_FEDERATION", "SLURM_LOCAL")
"""Environment variables that change what a client prints or which nodes it reports: never passed on."""


REASON_STATES = frozenset({"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING"})
"""The states in which a node's reason is Slurm's word on why the node is out of service (a base state
or a flag)."""


def reason_holds(state: str, flags: frozenset[str]) -> bool:
    """Whether a node's reason means something now: only while its state holds DRAIN, DOWN or FAIL.
    Slurm 24.11 keeps the last reason, its user and time after RESUME on a node that is plain IDLE
    again (until the node runs a job; 22.05 and 26.05 clear them): read then, the old reason would
    look like a hold or someone else's drain. `state` as parse_state_string gives it (lowercase base
    state, uppercase flags)."""
    return state.upper() in REASON_STATES or not REASON_STATES.isdisjoint(flags)


def parse_state_string(text: str) -> tuple[str, frozenset[str]]:
    """`IDLE+DRAIN+NOT_RESPONDING` (scontrol State=, pyslurm Node.state) -> ('idle', {...}).
    A trailing `*` (sinfo's short form for not responding) becomes NOT_RESPONDING. The first
    element is the base state; an unknown base state is kept as-is in lowercase."""
    text = text.strip()
    if not text:
        raise ValueError("empty node state")
    parts = [p for p in text.split("+") if p]
    if not parts:
        raise ValueError(f"node state {text!r} has no base state")
    flags: set[str] = set()
    base = parts[0]
    if base.endswith("*"):
        base = base.rstrip("*")
        flags.add("NOT_RESPONDING")
    for p in parts[1:]:
        p = p.rstrip("*")
        if p:
            flags.add(p.upper())
    base = base.lower()
    if not base:
        raise ValueError(f"node state {text!r} has no base state")
    # slurmctld reports "COMPLETING" as a flag on 22.05+, but older sinfo forms use it as the base
    if base == "completing":
        flags.add("COMPLETING")
        base = "allocated"
    return shared(base), shared(frozenset(flags))


_SHARED: dict = {}
_SHARED_MAX = 4096


def shared(value):
    """One instance of each equal value (states, flag sets, partition lists): a fleet of 100,000 nodes
    has a handful of each, and a copy per node cost the controller's fleet view ~40 MiB."""
    got = _SHARED.get(value)
    if got is None:
        if len(_SHARED) >= _SHARED_MAX:  # hostile or endless variety: stop sharing, never grow
            return value
        got = _SHARED[value] = value
    return got
