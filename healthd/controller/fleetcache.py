"""Slurm's node list as the controller last read it, refreshed off the report path and incrementally.

Reading the whole fleet costs what the fleet costs: with 10,000 nodes in slurmctld, `sinfo --json`
takes about half a second and parsing it a quarter more, all while holding the interpreter. A control
round that re-read the fleet before acting put that on every Xid's way to its drain, and stalled
report intake behind the parse. So the fleet view lives here instead:

- one thread re-reads it every refresh period with `scontrol show node -o` (one line per node, a
  sixth of the JSON's time on 22.05), keeps the lines it saw, and parses only the lines that changed
  since (a set difference in C: a few milliseconds for 10,000 nodes, nothing to parse in a quiet fleet);
- what the gates need from the whole fleet (members per partition, nodes out of service) is kept up
  to date from the changed nodes, never recomputed per round;
- the round reads the latest snapshot (an immutable value) and never waits for Slurm; the one node
  about to be written is re-read by the executor first, as the ownership rule requires, and that
  read (and the one after the write) refreshes its entry here;
- the read keeps out of the rounds' way (`next_refresh_at`): never started while a round runs, and
  the one that would run into the next round is started early enough to end before it. On a small
  head node that also runs slurmctld, the read (`scontrol` printing 10,000 nodes, slurmctld packing
  them) takes both cores for a tenth of a second, and a round sharing them took 3-10 times as long.

A backend that cannot list lines (pyslurm, the in-memory one of tests) is read whole with `nodes()`
and compared node by node: the same snapshots, without the line shortcut.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from healthd.slurm.backend import NodeInfo, SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller.fleetcache")


MIN_LEAD_S = 0.25
"""A read due this close to the next round (or closer than three times the latest read of Slurm)
is started that much before the round instead, or after it."""


def next_refresh_at(now: float, last_end: float, period_s: float, lead_s: float, *, poked: bool,
                    in_round: bool, round_due: float | None) -> float | None:
    """When the refresh thread starts its next read (time.monotonic()), or None: after the round
    running now, or the one due within `lead_s`, has ended (pure).

    A read is due a period after the last one ended (at once when poked: a write or a failed
    read), so a slow or hung one is not followed by another at once. It never starts while a round
    runs, nor within `lead_s / 2` of the next one; one that would start within `lead_s` of the next
    round starts `lead_s` before it instead, so that the round acts on a view just read, unless
    that is within half a period of the last one (then it waits for the round to end). However
    busy the rounds, a read is never put off past two periods after the last."""
    overdue = last_end + 2 * period_s
    if now >= overdue:
        return now
    if in_round:
        return None
    target = now if poked else last_end + period_s
    if round_due is None:
        return target
    keep_out = round_due - lead_s
    if now > round_due - lead_s / 2:  # a read started now might not end before the round
        return None
    if target < keep_out:
        return target
    return keep_out if keep_out >= last_end + period_s / 2 else None


def out_of_service(info: NodeInfo | None) -> bool:
    """Drained or draining, down, not responding or rebooting: not healthy capacity."""
    if info is None:
        return True
    return info.drain_requested or info.state == "down" or not info.responding or info.reboot_requested


@dataclass(frozen=True)
class SlurmSnapshot:
    """The fleet as Slurm showed it at one read, with what the gates derive from it."""

    nodes: Mapping[str, NodeInfo] = field(default_factory=lambda: MappingProxyType({}))
    """node -> what Slurm said about it (read-only)."""
    partitions: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))
    """partition -> its nodes."""
    out_of_service: frozenset[str] = frozenset()
    """Nodes drained, down, not responding or rebooting (the capacity floor's 'gone')."""
    read_at: float = 0.0
    """Wall-clock time the read behind this snapshot started (entries noted since may be newer)."""
    version: int = 0
    """Grows by one with every snapshot that differs from the one before."""


@dataclass(frozen=True)
class RefreshResult:
    """What one refresh found."""

    changed: int
    """Nodes whose entry is new or changed (removed ones included)."""
    parsed: int
    """Lines parsed (a full read parses none: it compares values)."""
    seconds: float
    """Wall time of the read and the update."""
    read_s: float = 0.0
    """Wall time of the read of Slurm alone (what every read costs again; parsing only what changed
    costs most the first time)."""


class FleetCache:
    """The controller's fleet view: refreshed by one thread (or inline by `refresh()`), read by the round."""

    def __init__(self, backend: SlurmBackend, *, clock: Callable[[], float] = time.time):
        self.backend = backend
        self.clock = clock
        self._read_lines: Callable[[], list[str]] | None = getattr(backend, "node_lines", None)
        self._parse_line: Callable[[str], NodeInfo] | None = getattr(backend, "parse_node_line", None)
        self._parse_addrs: Callable[[str], dict[str, str]] | None = getattr(backend, "parse_node_addresses", None)
        self._addrs: dict[str, str] = {}
        """node -> NodeAddr from the lines read (with the backend's lines and address parser)."""
        self._lines: set[str] = set()
        """The lines of the last read whose nodes' entries they made (a noted node's is forgotten)."""
        self._line_of: dict[str, str] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._members: dict[str, set[str]] = {}
        self._oos: set[str] = set()
        self._noted: dict[str, tuple[float, str]] = {}
        """node -> (when a single-node read newer than the last full read was noted, the line of it
        seen before): until a full read that started later, the node's line is parsed at every read."""
        self._lock = threading.Lock()
        self._snapshot: SlurmSnapshot | None = None
        self._dirty_partitions: set[str] = set()
        self._partitions: dict[str, frozenset[str]] = {}
        self.error: str | None = None
        """Why the latest refresh failed; None after one that succeeded."""
        self.failed_at: float | None = None
        """When the latest refresh failed (None after one that succeeded)."""
        self.refreshes = 0
        self.busy_since: float | None = None
        """time.monotonic() when the read in progress began; None between reads."""
        self.last: RefreshResult | None = None
        """What the latest successful refresh found (the benchmark reads it)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set after any of the flags below changes: the thread works out its next read again."""
        self._poked = False
        self._in_round = False
        self._round_due: float | None = None
        """time.monotonic() the round loop expects its next round (None: not said since the last)."""

    # -- reading -----------------------------------------------------------------------------------

    def snapshot(self) -> SlurmSnapshot | None:
        """The latest snapshot; None before the first successful read."""
        return self._snapshot

    @property
    def healthy(self) -> bool:
        """The latest refresh succeeded (the round acts only on a view Slurm could give)."""
        return self._snapshot is not None and self.error is None

    # -- updating ----------------------------------------------------------------------------------

    def refresh(self) -> RefreshResult:
        """Read the fleet once and fold what changed into a new snapshot. Raises SlurmError (the
        snapshot stays as it was, and `error` says why)."""
        started = time.monotonic()
        read_at = self.clock()
        self.busy_since = started
        try:
            if self._read_lines is not None and self._parse_line is not None:
                lines = self._read_lines()
                read_s = time.monotonic() - started
                changed, parsed = self._from_lines(lines, read_at)
            else:
                nodes = self.backend.nodes()
                read_s = time.monotonic() - started
                changed, parsed = self._from_nodes(nodes, read_at), 0
        except SlurmError as exc:
            self.error = str(exc)[:500]
            self.failed_at = read_at
            raise
        finally:
            self.busy_since = None
        self.error = None
        self.failed_at = None
        self.refreshes += 1
        self.last = RefreshResult(changed, parsed, time.monotonic() - started, read_s)
        return self.last

    def _from_lines(self, lines: list[str], read_at: float) -> tuple[int, int]:
        # set(lines) and the differences run in C; only the few new lines are looked at in Python
        # (a loop over every line held the interpreter ~3 ms at 10,000 nodes, every refresh)
        current = set(lines)
        assert self._parse_line is not None
        with self._lock:
            fresh = current - self._lines
            stray = {line for line in fresh if not line.startswith("NodeName=")}
            fresh -= stray
            current -= stray
            gone = self._lines - current
        parsed = [self._parse_line(line) for line in fresh]  # SlurmOutputError before anything changes
        # NodeAddr of the changed lines only: the controller's MUNGE origin check needs every node's,
        # and reading and parsing the whole fleet again for it held the interpreter ~0.4 s at 10,000 nodes
        addrs = self._parse_addrs("\n".join(fresh)) if self._parse_addrs is not None and fresh else {}
        with self._lock:
            updates: dict[str, NodeInfo | None] = {}
            for line in gone:
                name = line[len("NodeName="):].split(" ", 1)[0]
                if self._line_of.get(name) == line:
                    updates[name] = None
            for info in parsed:
                updates[info.name] = info
            changed = self._apply(updates, read_at)[0]
            for name, info in updates.items():
                if info is None:
                    self._line_of.pop(name, None)
                    self._addrs.pop(name, None)
            self._addrs.update(addrs)
            for line, info in zip(fresh, parsed, strict=True):
                self._line_of[info.name] = line
            for name, (_at, seen) in self._noted.items():  # newer than this read: the next parses it again
                current.discard(seen)
                current.discard(self._line_of.pop(name, ""))
            self._lines = current
        return changed, len(parsed)

    def node_addresses(self) -> dict[str, str] | None:
        """node -> NodeAddr as of the latest read; None when this backend's reads do not carry them
        (ask the backend), or before a read."""
        if self._parse_addrs is None or self._read_lines is None or self._snapshot is None:
            return None
        with self._lock:
            return dict(self._addrs)

    def _from_nodes(self, nodes: Iterable[NodeInfo], read_at: float) -> int:
        seen = {n.name: n for n in nodes}
        with self._lock:
            # `is` first: a backend that hands back the entry it handed before (nothing changed) costs
            # no field-by-field comparison
            updates: dict[str, NodeInfo | None] = {name: info for name, info in seen.items()
                                                   if (cur := self._nodes.get(name)) is not info and cur != info}
            updates.update({name: None for name in self._nodes if name not in seen})
            return self._apply(updates, read_at)[0]

    def note(self, info: NodeInfo) -> None:
        """A single-node read (the executor's, before or after a write): newer than the last full
        read, so it replaces that node's entry until a full read that started after it."""
        with self._lock:
            line = self._line_of.pop(info.name, None)
            if line is not None:
                self._lines.discard(line)  # the next full read parses this node again
            self._noted[info.name] = (self.clock(), line or self._noted.get(info.name, (0.0, ""))[1])
            self._apply({info.name: info}, None)

    def _apply(self, updates: Mapping[str, NodeInfo | None], read_at: float | None) -> tuple[int, set[str]]:
        """Fold `updates` (None: the node is gone) into the entries and publish a snapshot; returns
        (entries changed, nodes skipped). A full read (`read_at` set) does not overwrite a node noted
        after it started."""
        changed = 0
        skipped: set[str] = set()
        for name, info in updates.items():
            if read_at is not None:
                noted = self._noted.get(name)
                if noted is not None:
                    if noted[0] > read_at:
                        skipped.add(name)
                        continue
                    del self._noted[name]
            old = self._nodes.get(name)
            if old == info:
                continue
            changed += 1
            for p in old.partitions if old is not None else ():
                self._members.get(p, set()).discard(name)
                self._dirty_partitions.add(p)
            if info is None:
                self._nodes.pop(name, None)
                self._oos.discard(name)
                continue
            self._nodes[name] = info
            for p in info.partitions:
                self._members.setdefault(p, set()).add(name)
                self._dirty_partitions.add(p)
            if out_of_service(info):
                self._oos.add(name)
            else:
                self._oos.discard(name)
        previous = self._snapshot
        if previous is not None and not changed:
            if read_at is not None:
                self._snapshot = SlurmSnapshot(previous.nodes, previous.partitions, previous.out_of_service,
                                               read_at, previous.version)
            return 0, skipped
        for p in self._dirty_partitions:
            members = self._members.get(p)
            if members:
                self._partitions[p] = frozenset(members)
            else:
                self._partitions.pop(p, None)
                self._members.pop(p, None)
        self._dirty_partitions.clear()
        self._snapshot = SlurmSnapshot(
            nodes=MappingProxyType(dict(self._nodes)),
            partitions=MappingProxyType(dict(self._partitions)),
            out_of_service=frozenset(self._oos),
            read_at=read_at if read_at is not None else (previous.read_at if previous else self.clock()),
            version=(previous.version if previous else 0) + 1,
        )
        return changed, skipped

    # -- the refresh thread ------------------------------------------------------------------------

    def start(self, period_s: float, after: Callable[[], None] | None = None) -> None:
        """Refresh every `period_s` in a thread of its own (daemon), out of the rounds' way
        (next_refresh_at); `after` runs after each attempt (the controller's NodeAddr refresh, say).
        A failing read is logged once per kind of failure."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            said = None
            # read just before the start: the first refresh is a period away
            last_end = time.monotonic() if self.healthy else float("-inf")
            while not self._stop.is_set():
                now = time.monotonic()
                at = next_refresh_at(now, last_end, period_s, self.lead_s(), poked=self._poked,
                                     in_round=self._in_round, round_due=self._round_due)
                if at is None or at > now:
                    # flags are read before the wait and the event cleared after it: a change in
                    # between leaves the event set or is seen when the next read is worked out again
                    self._wake.wait(max(0.0, (at if at is not None else last_end + 2 * period_s) - now))
                    self._wake.clear()
                    continue
                self._poked = False
                try:
                    self.refresh()
                    if said is not None:
                        _log.info("Slurm's node list is readable again")
                    said = None
                except SlurmError as exc:
                    if said != type(exc).__name__:
                        _log.warning("cannot read Slurm's node list (the round waits for it): %s", exc)
                        said = type(exc).__name__
                except Exception:  # the view must keep refreshing whatever one read brings
                    _log.exception("fleet refresh failed")
                    self.error = "fleet refresh failed"
                if after is not None:
                    try:
                        after()
                    except Exception:
                        _log.exception("after the fleet refresh")
                last_end = time.monotonic()

        self._thread = threading.Thread(target=loop, name="healthd-fleet", daemon=True)
        self._thread.start()

    def lead_s(self) -> float:
        """How long before a round a read due near it starts: three times the latest read of Slurm,
        at least MIN_LEAD_S. The read, not the whole refresh: the first one parses every line (half
        a second at 10,000 nodes), the next only the few that changed."""
        last = self.last
        return max(MIN_LEAD_S, 3 * last.read_s) if last is not None else MIN_LEAD_S

    def round_started(self) -> None:
        """A control round began: no read starts until it ends."""
        self._in_round = True
        self._wake.set()

    def round_ended(self) -> None:
        """The round ended; when the next one is due is for the round loop to say (expect_round)."""
        self._in_round = False
        self._round_due = None
        self._wake.set()

    def expect_round(self, monotonic_at: float) -> None:
        """The round loop's next round is due at `monotonic_at` (time.monotonic()): a read that would
        run into it is started early enough to end before it."""
        self._round_due = monotonic_at
        self._wake.set()

    def stuck_for(self, monotonic_now: float) -> float:
        """How long the read in progress has been running (0 between reads): every Slurm call has a
        hard timeout, so a read stuck longer than that means the refresh itself is wedged."""
        since = self.busy_since
        return 0.0 if since is None else max(0.0, monotonic_now - since)

    def failed(self, why: str) -> None:
        """Another read of Slurm failed (the executor's, before a write): the view is not acted on
        until a refresh succeeds, and that refresh is tried at once."""
        self.error = why[:500]
        self.failed_at = self.clock()
        self.poke()

    def poke(self) -> None:
        """Refresh now rather than at the end of the period (a write just changed a node), or as soon
        as the round running now has ended."""
        self._poked = True
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
