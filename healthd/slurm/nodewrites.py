"""The scontrol backend's node state writes: drain, resume, reboot ASAP and its cancellation.

RESUME and cancel_reboot are refused by slurmctld on a node that needs neither, so they read the
nodes first and write only to those that need it (guarded_state_write)."""

from __future__ import annotations

from collections.abc import Sequence

from healthd.slurm.backend import guarded_state_write, slurm_hostlist, validate_next_state, validate_reason
from healthd.slurm.nodereads import NodeReads


class NodeWrites(NodeReads):
    """Node state writes, each from the argv its `_argv_<action>` builds (what describe() shows);
    over the reads, which the guarded writes need."""

    # -- argv ---------------------------------------------------------------------------

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

    # -- writes ---------------------------------------------------------------------------

    def drain(self, nodes: str | Sequence[str], reason: str) -> None:
        self._write(self._argv_drain(nodes, reason))

    def resume(self, nodes: str | Sequence[str]) -> None:
        """RESUME the nodes that need it. RESUME is not idempotent in Slurm (an idle node answers
        'Invalid node state specified'), so nodes that are not drained/down/failed/awaiting a
        reboot are skipped, and a refusal that a fresh read shows was a race is tolerated."""
        self._argv_resume(nodes)  # validate before reading
        guarded_state_write(
            self.named_nodes, nodes, lambda n: n.resumable, lambda todo: self._write(self._argv_resume(todo)), "resume", self._log
        )

    def reboot_asap(self, nodes: str | Sequence[str], reason: str, next_state: str = "RESUME") -> None:
        self._write(self._argv_reboot_asap(nodes, reason, next_state))

    def cancel_reboot(self, nodes: str | Sequence[str]) -> None:
        """Cancel a requested (not yet issued) reboot; nodes without one are skipped. Slurm also
        drops the drain and reason that `reboot ASAP` set (seen on 22.05)."""
        self._argv_cancel_reboot(nodes)
        guarded_state_write(
            self.named_nodes,
            nodes,
            lambda n: "REBOOT_REQUESTED" in n.flags,
            lambda todo: self._write(self._argv_cancel_reboot(todo)),
            "cancel_reboot",
            self._log,
        )
