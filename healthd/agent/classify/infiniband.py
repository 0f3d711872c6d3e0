"""InfiniBand / RoCE rules: port count, short downs and drops (sticky after recovery), flaps, link
rate, counter thresholds, saturated and unreadable counters.

Counter deltas are the collector's (CounterDelta, against the collector's own baseline); the rules
only add them to trailing windows. A sample classified a second time (the kernel follower ticks
between collections) carries the same read time, and its deltas are not added again.
"""

from __future__ import annotations

import dataclasses

from healthd.agent.classify.context import HOUR_S, MINUTE_S, TickContext, dur, fmt, iso
from healthd.agent.history import PortRecord
from healthd.model import NODE, Component, CounterDelta, Evidence, InfinibandSample, PortSample

INFINIBAND = "infiniband"

# InfiniBand counter rules (NVSentinel NIC monitor thresholds). Per-second rates are the
# collector's tick rate (a burst); per-minute and per-hour are counts over a trailing window,
# never extrapolated from one short tick.
IB_RATE_RULES: tuple[tuple[str, str, str], ...] = (
    ("symbol_error", "per_hour", "symbol_error_per_hour"),
    ("symbol_error", "per_s", "symbol_error_per_s"),
    ("link_error_recovery", "per_min", "link_error_recovery_per_min"),
    ("port_rcv_errors", "per_s", "port_rcv_errors_per_s"),
    ("port_xmit_discards", "per_s", "port_xmit_discards_per_s"),
    ("local_ack_timeout_err", "per_s", "local_ack_timeout_err_per_s"),
    ("roce_slow_restart", "per_s", "roce_slow_restart_per_s"),
)
IB_ANY_RULES = ("link_downed", "excessive_buffer_overrun_errors", "local_link_integrity_errors", "rnr_nak_retry_err")
"""Any increase is a finding (NVSentinel's 'fatal' set)."""
IB_ERROR_COUNTERS = frozenset(
    {r[0] for r in IB_RATE_RULES}
    | set(IB_ANY_RULES)
    | {
        "port_rcv_remote_physical_errors",
        "port_rcv_switch_relay_errors",
        "port_rcv_constraint_errors",
        "port_xmit_constraint_errors",
        "VL15_dropped",
    }
)
"""Counters whose saturation hides errors. port_xmit_wait (congestion) and the data/packet counters
are not errors and are never reported."""


def expected_ports(ctx: TickContext) -> int | None:
    cfg = ctx.settings.infiniband
    return cfg.expected_ports if isinstance(cfg.expected_ports, int) and not isinstance(cfg.expected_ports, bool) else None


def absent(ctx: TickContext, ib: InfinibandSample) -> None:
    """No HCA on this node: a fault only where the config expects ports."""
    expected = expected_ports(ctx)
    if ctx.settings.infiniband.enabled and expected:
        ctx.emit("ib.port_count", "node", NODE, INFINIBAND,
                 f"0 of {expected} InfiniBand ports present ({ib.detail or 'no HCA found'})",
                 [Evidence("state", f"infiniband status {ib.status}: {ib.detail}", {"status": ib.status, "detail": ib.detail}),
                  Evidence("config", f"infiniband.expected_ports = {expected}", {"expected_ports": expected})])


def evaluate(ctx: TickContext, ib: InfinibandSample) -> None:
    expected = expected_ports(ctx)
    fresh = ib.time is None or ib.time != ctx.ib_read
    ctx.ib_read = ib.time
    # A down port matters if it was up this boot (something broke) or if the node has fewer
    # ports up than it must (it is needed). A port never up on a node with enough ports up is
    # an unused one (not cabled) and stays quiet.
    up_count = sum(1 for p in ib.ports if p.up)
    needed = expected is not None and up_count < expected
    present = set()
    for p in ib.ports:
        key = f"{p.device}/{p.port}"
        present.add(key)
        port(ctx, p, key, needed, fresh)
    # A port seen up this boot that vanished from sysfs is down (its HCA is gone).
    for key, rec in list(ctx.ports.items()):
        if key not in present and rec.seen_up:
            device, _, num = key.rpartition("/")
            ghost = PortSample(device=device, port=int(num) if num.isdigit() else 0, state="ABSENT",
                               phys_state="missing from sysfs", rate_gbps=None, link_layer=None)
            port(ctx, ghost, key, True, fresh)
    if expected and len(ib.ports) < expected:
        states = [f"{p.device}/{p.port} {p.state}/{p.phys_state}" for p in ib.ports]
        ctx.emit("ib.port_count", "node", NODE, INFINIBAND,
                 f"{len(ib.ports)} of {expected} InfiniBand ports present ({up_count} up)",
                 [Evidence("state", f"ports: {', '.join(states) or 'none'}", {"present": len(ib.ports), "up": up_count, "expected": expected}),
                  Evidence("config", f"infiniband.expected_ports = {expected}", {"expected_ports": expected})])


def port(ctx: TickContext, p: PortSample, key: str, needed: bool, fresh: bool) -> None:
    """Every rule of one port."""
    cfg = ctx.settings.infiniband
    comp = Component(kind="port", device=p.device, port=p.port)
    port_counters(ctx, p, key, comp, fresh)  # first: this tick's link_downed delta feeds the flap count
    rec = ctx.ports.get(key) or PortRecord()
    if p.state is not None and p.phys_state is not None:
        rec = port_state(ctx, p, key, comp, rec, needed)
    ctx.ports[key] = dataclasses.replace(rec, updated=ctx.now)

    if p.up and cfg.expected_rate_gbps and p.rate_gbps is not None and p.rate_gbps < cfg.expected_rate_gbps:
        ctx.emit("ib.rate", key, comp, INFINIBAND,
                 f"{key}: link at {fmt(p.rate_gbps)} Gb/s, expected {fmt(cfg.expected_rate_gbps)}",
                 [Evidence("state", f"ports/{p.port}/rate = {fmt(p.rate_gbps)} Gb/s ({p.link_layer}); infiniband.expected_rate_gbps = "
                           f"{fmt(cfg.expected_rate_gbps)}", {"rate_gbps": p.rate_gbps, "expected_rate_gbps": cfg.expected_rate_gbps})])
    if p.unreadable:
        unreadable = dict(p.unreadable)
        ctx.emit("ib.unreadable", key, comp, INFINIBAND,
                 f"{key}: {len(unreadable)} counter file(s) unreadable; errors on them are unknown",
                 [Evidence("state", "; ".join(f"{f}: {err}" for f, err in sorted(unreadable.items())), {"unreadable": unreadable})])


def port_state(ctx: TickContext, p: PortSample, key: str, comp: Component, rec: PortRecord, needed: bool) -> PortRecord:
    """Track down_since and transitions; report drops (T1), short downs (T2) and flaps (T2)."""
    cfg = ctx.settings.infiniband
    now = ctx.now
    state = f"{p.state}/{p.phys_state}"
    transitions = rec.transitions
    if p.up:
        if rec.up is False:
            transitions += ((now, "up"),)
        recovered = rec.recovered_at
        if rec.drop_since is not None and recovered is None:
            recovered = now
        rec = dataclasses.replace(rec, up=True, state=state, down_since=None, seen_up=True, recovered_at=recovered, transitions=transitions)
    else:
        if rec.up is True:
            transitions += ((now, "down"),)
        down_since = rec.down_since if rec.down_since is not None and rec.up is False else now
        rec = dataclasses.replace(rec, up=False, state=state, down_since=down_since, transitions=transitions)
        if (rec.seen_up or needed) and now - down_since > cfg.drop_after_s:
            rec = dataclasses.replace(rec, drop_since=down_since, recovered_at=None)
    lo = now - cfg.flap_window_s
    rec = dataclasses.replace(rec, transitions=tuple(t for t in rec.transitions if t[0] > lo))

    state_ev = Evidence("state", f"ports/{p.port}/state {p.state}, phys_state {p.phys_state}",
                        {"state": p.state, "phys_state": p.phys_state})
    if not p.up and (rec.seen_up or needed) and rec.down_since is not None:
        down_for = now - rec.down_since
        if down_for > cfg.drop_after_s:
            ctx.emit("ib.drop", key, comp, INFINIBAND,
                     f"{key}: port down for {dur(down_for)} ({state})",
                     [state_ev, Evidence("history", f"down since {iso(rec.down_since)} ({dur(down_for)}, drop after {dur(cfg.drop_after_s)})",
                                         {"down_since": iso(rec.down_since), "down_s": down_for, "drop_after_s": cfg.drop_after_s})],
                     first_seen=rec.down_since)
        else:
            ctx.emit("ib.down", key, comp, INFINIBAND,
                     f"{key}: port down for {dur(down_for)} ({state}); a drop after {dur(cfg.drop_after_s)}",
                     [state_ev, Evidence("history", f"down since {iso(rec.down_since)}", {"down_since": iso(rec.down_since), "down_s": down_for})],
                     first_seen=rec.down_since)
    elif p.up and rec.drop_since is not None and rec.recovered_at is not None:
        if now - rec.recovered_at <= cfg.sticky_s:
            down_for = rec.recovered_at - rec.drop_since
            ctx.emit("ib.drop", key, comp, INFINIBAND,
                     f"{key}: port dropped for {dur(down_for)}, up again since {iso(rec.recovered_at)} (reported until {iso(rec.recovered_at + cfg.sticky_s)})",
                     [state_ev, Evidence("history", f"down from {iso(rec.drop_since)} to {iso(rec.recovered_at)} ({dur(down_for)}); "
                                         f"sticky for {dur(cfg.sticky_s)} after recovery",
                                         {"down_since": iso(rec.drop_since), "recovered_at": iso(rec.recovered_at), "sticky_s": cfg.sticky_s})],
                     first_seen=rec.drop_since)
        else:
            rec = dataclasses.replace(rec, drop_since=None, recovered_at=None)

    # Flaps: down-then-up cycles seen between ticks, or counted by link_downed (a flap shorter
    # than a tick is invisible to the state but not to the counter).
    ups = sum(1 for _, s in rec.transitions if s == "up")
    downed, _ = ctx.window(f"port/{key}/link_downed", cfg.flap_window_s)
    cycles = max(ups, int(downed))
    if cycles >= cfg.flap_cycles:
        ctx.latch(ctx.finding(
            "ib.flap", key, comp, INFINIBAND,
            f"{key}: link flapping ({cycles} down/up cycles in {dur(cfg.flap_window_s)})",
            [Evidence("history", f"{ups} down->up transitions observed and link_downed +{downed:.0f} within {dur(cfg.flap_window_s)} "
                      f"(flap at {cfg.flap_cycles}); transitions: {', '.join(f'{s}@{iso(t)}' for t, s in rec.transitions) or 'none'}",
                      {"cycles": cycles, "observed_up_transitions": ups, "link_downed_delta": downed,
                       "window_s": cfg.flap_window_s, "flap_cycles": cfg.flap_cycles})],
        ), cfg.sticky_s, 0, total=cycles)
    return rec


def port_counters(ctx: TickContext, p: PortSample, key: str, comp: Component, fresh: bool) -> None:
    """Saturated counters, per-second rates of this reading, per-minute/per-hour counts over the
    trailing windows, and counters where any increase is an error."""
    cfg = ctx.settings.infiniband
    th = cfg.thresholds
    counters = p.counters

    def get(name: str) -> tuple[str, CounterDelta] | None:
        for prefix in ("counters/", "hw_counters/"):
            cd = counters.get(prefix + name)
            if cd is not None:
                return prefix + name, cd
        return None

    deltas: dict[str, tuple[float, float]] = {}
    counted: set[str] = set()
    for path, cd in sorted(counters.items()):
        name = path.rsplit("/", 1)[-1]
        if name not in IB_ERROR_COUNTERS:
            continue
        if cd.saturated:
            ctx.emit(
                "ib.saturated", f"{key}:{name}", comp, INFINIBAND,
                f"{key}: {name} counter saturated at max: errors since are unknown; clear with perfquery -x -R",
                [Evidence("counter", f"{path} = {cd.value} (the PMA counter's maximum)",
                          {"counter": path, "value": cd.value, "saturated": True})],
            )
            continue
        if name in counted:
            continue  # read under counters/ and hw_counters/: counted once, from counters/ as `get` reads it
        counted.add(name)
        if fresh and cd.delta:
            span = float(cd.window_s if cd.window_s is not None else ctx.interval)
            deltas[name] = (float(cd.delta), span)
            ctx.record(f"port/{key}/{name}", cd.delta, span)

    violations: dict[str, list[Evidence]] = {}
    for name, kind, attr in IB_RATE_RULES:
        found = get(name)
        if found is None:
            continue
        path, cd = found
        limit = getattr(th, attr)
        if kind == "per_s":
            rate = cd.rate_per_s
            if rate is not None and rate > limit:
                violations.setdefault(name, []).append(Evidence(
                    "counter", f"{path} +{cd.delta} in {fmt(cd.window_s)}s = {fmt(rate)}/s (threshold {fmt(limit)}/s)",  # type: ignore[arg-type]
                    {"counter": path, "delta": cd.delta, "window_s": cd.window_s, "per_s": rate, "threshold_per_s": limit, "value": cd.value}))
        else:
            win = HOUR_S if kind == "per_hour" else MINUTE_S
            total, span = ctx.window(f"port/{key}/{name}", win)
            cover = max(win, span)
            rate = total / cover * win
            if total and rate > limit:
                unit = "h" if kind == "per_hour" else "min"
                violations.setdefault(name, []).append(Evidence(
                    "counter", f"{path} +{total:.0f} in the last {dur(cover)} = {fmt(rate)}/{unit} (threshold {fmt(limit)}/{unit})",
                    {"counter": path, "delta": total, "window_s": cover, f"per_{unit}": rate, f"threshold_per_{unit}": limit, "value": cd.value}))
    for name in IB_ANY_RULES:
        if name in deltas:
            path = (get(name) or (name, None))[0]
            inc, span = deltas[name]
            violations.setdefault(name, []).append(Evidence(
                "counter", f"{path} +{inc:.0f} in {dur(span)} (any increase is an error)",
                {"counter": path, "delta": inc, "window_s": span}))
    for name, ev in sorted(violations.items()):
        ctx.latch(ctx.finding(
            "ib.counter", f"{key}:{name}", comp, INFINIBAND,
            f"{key}: {name} errors above threshold",
            ev,
        ), cfg.sticky_s, int(deltas.get(name, (0, 0))[0]))
