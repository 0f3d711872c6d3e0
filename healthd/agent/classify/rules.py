"""The rules table: what each kind of finding means for the node, as data.

A finding's kind is the rule name that prefixes its id (`nvml.lost` in `nvml.lost:gpu3`,
`ib.drop` in `ib.drop:mlx5_0/1`). Each row gives the tier, attribution and action the rule's
findings carry; a rule whose outcome depends on what it saw has one row per case (`case` names
it). The rule modules read their outcomes here and nowhere else, and docs/agent.md ("Tiers,
attribution and actions") lists the same rows, and a test keeps the two in step.

Xid findings (kind `xid`) take theirs from the Xid catalog (healthd/data/xid_catalog.yaml).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from healthd.model import ACTIONS, ATTRIBUTIONS, TIERS


@dataclass(frozen=True)
class Rule:
    """One row: the outcome of a kind of finding (in one case of it)."""

    kind: str
    tier: int
    attribution: str
    action: str
    case: str = ""
    """Empty for a rule with one outcome; else the condition this row is for."""


RULES: tuple[Rule, ...] = (
    # NVML
    Rule("nvml.driver", 2, "software", "reboot-when-idle"),
    Rule("nvml.hung", 2, "unknown", "reboot-when-idle"),
    Rule("nvml.gpu_count", 1, "hardware", "drain"),
    Rule("nvml.lost", 1, "hardware", "drain-and-requeue"),
    Rule("nvml.remap_failure", 1, "hardware", "inspect-hardware"),
    Rule("nvml.remap_pending", 2, "hardware", "reset-gpu-when-idle"),
    Rule("nvml.retired_pending", 2, "hardware", "reset-gpu-when-idle"),
    Rule("nvml.ecc_uncorrected", 1, "hardware", "drain", case="no remap pending"),
    Rule("nvml.ecc_uncorrected", 2, "hardware", "reset-gpu-when-idle", case="remap pending"),
    Rule("nvml.ecc_sbe_rate", 2, "hardware", "none"),
    Rule("nvml.pcie_replay", 2, "hardware", "drain"),
    Rule("nvml.pcie_width", 2, "hardware", "drain"),
    Rule("nvml.pcie_gen", 3, "hardware", "none"),
    Rule("nvml.hw_slowdown", 2, "hardware", "drain"),
    Rule("nvml.thermal", 3, "hardware", "none"),
    Rule("nvml.nvlink", 2, "fabric", "reboot-when-idle"),
    Rule("nvml.read_error", 3, "unknown", "none"),
    # kernel log (the Xids themselves are catalog rows)
    Rule("kernel.gap", 3, "unknown", "none"),
    # InfiniBand
    Rule("ib.port_count", 1, "fabric", "drain"),
    Rule("ib.down", 2, "fabric", "none"),
    Rule("ib.drop", 1, "fabric", "drain"),
    Rule("ib.flap", 2, "fabric", "drain"),
    Rule("ib.rate", 2, "fabric", "drain"),
    Rule("ib.counter", 2, "fabric", "drain"),
    Rule("ib.saturated", 3, "unknown", "none"),
    Rule("ib.unreadable", 3, "unknown", "none"),
    # host
    Rule("fs.unmounted", 1, "storage", "drain"),
    Rule("fs.hung", 1, "storage", "drain"),
    Rule("fs.readonly", 1, "storage", "drain"),
    Rule("fs.slow", 2, "storage", "drain"),
    Rule("fs.probe_error", 3, "unknown", "none"),
    Rule("host.memory", 2, "software", "none"),
    Rule("host.psi_memory", 3, "software", "none"),
    Rule("host.psi_io", 3, "storage", "none"),
    Rule("host.dstate", 3, "storage", "none"),
    # NVMe drives
    Rule("nvme.critical_warning", 2, "storage", "drain"),
    Rule("nvme.media_errors", 2, "storage", "none"),
    Rule("nvme.wear", 3, "storage", "none"),
    Rule("nvme.unreadable", 3, "unknown", "none"),
    # the hooks' quick checks (healthd.agent.hookfiles); hooks.check is any other check's failure
    Rule("hooks.gpu_count", 1, "hardware", "drain"),
    Rule("hooks.dcgmi_diag", 2, "hardware", "drain"),
    Rule("hooks.check", 3, "unknown", "none"),
    # the agent itself
    Rule("collector.nvml", 3, "unknown", "none"),
    Rule("collector.kernel_log", 3, "unknown", "none"),
    Rule("collector.infiniband", 3, "unknown", "none"),
    Rule("collector.host", 3, "unknown", "none"),
    Rule("collector.nvme", 3, "unknown", "none"),
    Rule("classify.error", 3, "unknown", "none"),
)

QUICK_CHECK_PREFIX = "hooks."
OTHER_CHECK = "hooks.check"


class RulesTableError(ValueError):
    """A row of the rules table that no finding may carry."""


def _index(rows: tuple[Rule, ...]) -> dict[tuple[str, str], Rule]:
    table: dict[tuple[str, str], Rule] = {}
    for r in rows:
        where = f"rules table row {r.kind}{f' ({r.case})' if r.case else ''}"
        if (r.kind, r.case) in table:
            raise RulesTableError(f"{where}: listed twice")
        if r.tier not in TIERS or r.attribution not in ATTRIBUTIONS or r.action not in ACTIONS:
            raise RulesTableError(f"{where}: tier {r.tier}, attribution {r.attribution}, action {r.action} is not a valid outcome")
        if r.tier == 3 and r.action != "none":
            raise RulesTableError(f"{where}: tier 3 is recorded, never acted on; found action {r.action}")
        if r.tier == 1 and r.action == "none":
            raise RulesTableError(f"{where}: tier 1 is a certain fault and needs an action")
        table[(r.kind, r.case)] = r
    return table


TABLE: Mapping[tuple[str, str], Rule] = _index(RULES)
"""(kind, case) -> row."""


def rule(kind: str, case: str = "") -> Rule:
    """The row for `kind` (in `case`); a KeyError names a kind the table lacks."""
    return TABLE[(kind, case)]


def quick_check(name: str) -> tuple[str, Rule]:
    """(finding id, row) for a failed quick check `name`: a known check is `hooks.<name>:node`,
    any other `hooks.check:<name>`."""
    kind = QUICK_CHECK_PREFIX + name
    if kind != OTHER_CHECK and (kind, "") in TABLE:
        return f"{kind}:node", TABLE[(kind, "")]
    return f"{OTHER_CHECK}:{name}", TABLE[(OTHER_CHECK, "")]
