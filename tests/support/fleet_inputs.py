"""What the pure policy and gate tests feed decide(): findings as agents report them, node reports,
and nodes as Slurm shows them."""

from __future__ import annotations

from healthd.controller.policy import NodeReport
from healthd.model import Component, Evidence, Finding
from healthd.slurm.backend import NodeInfo

NOW = 1_800_000_000.0


def finding(fid="xid:gpu0:79", tier=1, action="drain-and-requeue", attribution="hardware", xid=79,
            first_seen=NOW - 5, summary=None) -> Finding:
    return Finding(
        id=fid,
        component=Component(kind="gpu", index=0, serial="1650123456789"),
        source="kernel_log",
        attribution=attribution,
        tier=tier,
        action=action,
        summary=summary or f"{fid}: test finding",
        evidence=(Evidence(kind="log_line", text=f"NVRM: Xid (PCI:0000:3b:00): {xid}, test"),),
        xid=xid,
        first_seen=first_seen,
        last_seen=first_seen,
    )


def report(node, *findings, received_at=NOW - 1, verdict=None) -> NodeReport:
    """`node`'s report: failed when it holds findings, healthy when not, unless `verdict` says otherwise."""
    return NodeReport(node=node, verdict=verdict or ("failed" if findings else "healthy"), findings=tuple(findings),
                      received_at=received_at)


def info(node, state="idle", flags=(), reason="", partitions=("gpu",), user=None) -> NodeInfo:
    return NodeInfo(name=node, state=state, flags=frozenset(flags), reason=reason, reason_user=user,
                    partitions=tuple(partitions))
