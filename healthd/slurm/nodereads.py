"""The scontrol backend's reads: nodes, node addresses, the client's version and slurmctld's start.

Nodes are read by Slurm version (`scontrol --version`, which does not contact slurmctld):
- 23.02 and later: `scontrol show nodes --json`, the data_parser NODE schema (one object per
  node; `state` is a list such as ["IDLE", "DRAIN"]; times are {"set","infinite","number"}).
  `sinfo --json` there emits the grouped SINFO_DATA schema instead, which parse_sinfo_json also
  reads, but scontrol's per-node document is the exact one.
- 21.08 to 22.05: `sinfo --json` (openapi v0.0.38: `state` is a lowercase string, the rest of
  the state in `state_flags`). It ignores -n, so nodes are filtered here.
- anything else, or a JSON answer the parsers (healthd.slurm.nodeparse) do not understand:
  `scontrol show node -o`, parsed by parse_scontrol_node_line.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable

from healthd.slurm.backend import (
    NodeInfo,
    SlurmOutputError,
    SlurmRefused,
    SlurmUnavailable,
    filter_nodes,
    requested_nodes,
    validate_nodes,
)
from healthd.slurm.nodeparse import (
    json_errors,
    local_epoch,
    parse_node_addresses,
    parse_scontrol_node_line,
    parse_scontrol_show_node,
    parse_sinfo_json,
    parse_version,
)
from healthd.slurm.runner import ClientRunner

FEW_NODES = 8
"""Up to this many nodes asked for by name are read one `scontrol show node` each; more, the whole fleet
in one read."""
_BOOT_TIME_RE = re.compile(r"^BOOT_TIME\s*=\s*(\S+)", re.MULTILINE)


class NodeReads(ClientRunner):
    """Reads of nodes and of slurmctld. `read_mode` is how nodes are read ("auto": by version); the
    attributes are set by ScontrolBackend."""

    read_mode: str
    _version: str | None
    _effective_read_mode: str | None

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
        names = requested_nodes(names)
        if names == []:
            return []
        return filter_nodes(self._read_all(), names)

    def named_nodes(self, names: Iterable[str]) -> list[NodeInfo]:
        """The nodes named (missing ones left out), read one `scontrol show node` each when they are
        few: a write's guard (resume, cancel_reboot) asks for one or a few nodes, and reading the whole
        fleet for them cost 1.5 s at 10,000 nodes on 24.11."""
        wanted = list(dict.fromkeys(validate_nodes(list(names))))
        if len(wanted) > FEW_NODES:
            return self.nodes(wanted)
        return [n for n in map(self._one, wanted) if n is not None]

    def node(self, name: str) -> NodeInfo:
        ns = validate_nodes(name)
        if len(ns) != 1:
            raise ValueError(f"node() takes one node name, got {name!r} ({len(ns)} nodes)")
        found = self._one(ns[0])
        if found is None:
            raise SlurmRefused(f"Slurm has no node named {name!r}", argv=[self._bin("scontrol"), "show", "node", "-o", name])
        return found

    def _one(self, name: str) -> NodeInfo | None:
        """One node by its name, None when Slurm has none of that name."""
        # One node, one RPC, one process: the hooks call this on every node at every health check,
        # so it must not list the whole cluster (sinfo --json) nor ask for the client version first.
        argv = [self._bin("scontrol"), "show", "node", "-o", name]
        try:
            found = filter_nodes(parse_scontrol_show_node(self._run(argv)), [name])
        except SlurmRefused as exc:
            if "invalid node name" in (exc.stderr or str(exc)).lower():
                return None
            raise
        return found[0] if found else None

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """node -> its NodeAddr as Slurm has it (`scontrol show node -o`), all nodes or those named."""
        names = requested_nodes(names)
        if names == []:
            return {}
        addrs = parse_node_addresses(self._run([self._bin("scontrol"), "show", "node", "-o"]))
        if names is None:
            return addrs
        wanted = set(validate_nodes(names))
        return {n: a for n, a in addrs.items() if n in wanted}

    def ctld_started_at(self) -> float | None:
        """BOOT_TIME of `scontrol show config`: when the running slurmctld started."""
        out = self._run([self._bin("scontrol"), "show", "config"])
        m = _BOOT_TIME_RE.search(out)
        return local_epoch(m.group(1)) if m else None
