"""InfiniBand rules: down/drop/sticky, flaps, rate, port count, counter thresholds, saturation."""

from __future__ import annotations

from tests.support.builders import (
    NOW,
    cd,
    get,
    ib,
    ids,
    port,
    restart,
    run,
    settings,
    snap,
    texts,
)

P = "mlx5_0/1"


def ticks_of(states, start=NOW, step=10.0, **port_kw):
    """One snapshot per port state (True up / False down), `step` seconds apart."""
    return [snap(start + k * step, i=ib(port(up=s, **port_kw))) for k, s in enumerate(states)]


def test_healthy_port_no_findings():
    res = run(*ticks_of([True, True]))
    assert res[-1].findings == () and res[-1].verdict == "healthy"


def test_port_never_up_this_boot_is_not_tracked_without_expected_ports():
    res = run(*ticks_of([False] * 40))
    assert res[-1].findings == ()


def test_short_down_is_t2_then_a_drop_past_the_window_is_t1_fabric_drain():
    cfg = settings(infiniband={"drop_after_s": 240.0})
    res = run(*ticks_of([True] + [False] * 30), cfg=cfg)
    short = get(res[1], f"ib.down:{P}")
    assert (short.tier, short.attribution, short.action) == (2, "fabric", "none") and "DOWN/Polling" in short.summary
    assert f"ib.drop:{P}" not in ids(res[24])  # 240 s down: not yet
    drop = get(res[26], f"ib.drop:{P}")
    assert (drop.tier, drop.attribution, drop.action) == (1, "fabric", "drain")
    assert drop.first_seen == NOW + 10 and "down since" in texts(drop) and res[26].verdict == "failed"
    assert res[26].would_do[0]["reason"].startswith(f"healthd: {P}: port down for 4m")


def test_drop_is_sticky_after_recovery_then_clears():
    cfg = settings(infiniband={"drop_after_s": 60.0, "sticky_s": 120.0})
    res = run(*ticks_of([True] + [False] * 10 + [True] * 20), cfg=cfg)
    recovered = res[11]
    f = get(recovered, f"ib.drop:{P}")
    assert f.tier == 1 and "up again since" in f.summary and "sticky for 2m00s" in texts(f)
    assert f"ib.drop:{P}" in ids(res[23])  # 120 s after recovery
    assert f"ib.drop:{P}" not in ids(res[24]) and res[24].verdict == "healthy"


def test_drop_sticky_survives_restart():
    cfg = settings(infiniband={"drop_after_s": 60.0, "sticky_s": 600.0})
    first = run(*ticks_of([True] + [False] * 10 + [True]), cfg=cfg)
    again = run(snap(NOW + 200, i=ib(port())), history=restart(first[-1].history), cfg=cfg)
    assert get(again[0], f"ib.drop:{P}").tier == 1


def test_flap_detected_over_ticks_and_sticky():
    cfg = settings(infiniband={"flap_cycles": 3, "flap_window_s": 600.0, "sticky_s": 300.0})
    states = [True, False, True, False, True, False, True] + [True] * 100
    res = run(*ticks_of(states, step=20.0), cfg=cfg)
    assert f"ib.flap:{P}" not in ids(res[4])  # two cycles
    f = get(res[6], f"ib.flap:{P}")
    assert (f.tier, f.attribution, f.action, f.count) == (2, "fabric", "drain", 3)
    assert "3 down->up transitions observed" in texts(f)
    # the cycles leave the 600 s window at ~t=640 s; the flap stays for sticky 300 s more
    assert f"ib.flap:{P}" in ids(res[40])
    assert f"ib.flap:{P}" not in ids(res[-1])


def test_flap_shorter_than_a_tick_is_seen_through_link_downed():
    cfg = settings(infiniband={"flap_cycles": 3})
    res = run(
        snap(NOW, i=ib(port(counters={"counters/link_downed": cd(5, None)}))),
        snap(NOW + 10, i=ib(port(counters={"counters/link_downed": cd(6, 1)}))),
        snap(NOW + 20, i=ib(port(counters={"counters/link_downed": cd(8, 2)}))),
        cfg=cfg,
    )
    assert "link_downed +3" in texts(get(res[-1], f"ib.flap:{P}"))
    c = get(res[1], f"ib.counter:{P}:link_downed")
    assert (c.tier, c.attribution) == (2, "fabric") and "counters/link_downed +1" in texts(c)


def test_rate_below_expected_is_t2():
    cfg = settings(infiniband={"expected_rate_gbps": 400.0})
    f = get(run(snap(NOW, i=ib(port(rate=200.0))), cfg=cfg)[0], f"ib.rate:{P}")
    assert (f.tier, f.attribution, f.action) == (2, "fabric", "drain") and "200 Gb/s, expected 400" in f.summary


def test_fewer_ports_than_expected_is_t1():
    cfg = settings(infiniband={"expected_ports": 2})
    res = run(snap(NOW, i=ib(port("mlx5_0"))), cfg=cfg)[0]
    f = get(res, "ib.port_count:node")
    assert (f.tier, f.attribution, f.action) == (1, "fabric", "drain") and f.summary == "1 of 2 InfiniBand ports present (1 up)"
    none = run(snap(NOW, i=ib(status="no_data", detail="no /sys/class/infiniband")), cfg=cfg)[0]
    assert "0 of 2" in get(none, "ib.port_count:node").summary


def test_a_needed_port_down_is_reported_from_the_first_tick_and_drops_after_the_window():
    cfg = settings(infiniband={"expected_ports": 2, "drop_after_s": 60.0})
    res = run(*[snap(NOW + k * 10, i=ib(port("mlx5_0"), port("mlx5_1", up=False, phys_state="Disabled"))) for k in range(9)], cfg=cfg)
    first = get(res[0], "ib.down:mlx5_1/1")
    assert (first.tier, first.attribution) == (2, "fabric") and "DOWN/Disabled" in first.summary
    assert "ib.drop:mlx5_1/1" not in ids(res[6])
    assert get(res[7], "ib.drop:mlx5_1/1").tier == 1 and "ib.port_count:node" not in ids(res[7])


def test_an_unused_port_on_a_node_with_enough_ports_up_stays_quiet():
    cfg = settings(infiniband={"expected_ports": 1, "drop_after_s": 60.0})
    res = run(*[snap(NOW + k * 10, i=ib(port("mlx5_0"), port("mlx5_1", up=False))) for k in range(9)], cfg=cfg)
    assert all(r.findings == () for r in res)


def test_port_that_vanishes_from_sysfs_is_down():
    cfg = settings(infiniband={"drop_after_s": 30.0})
    res = run(snap(NOW, i=ib(port("mlx5_0"), port("mlx5_1"))), *[snap(NOW + 10 * k, i=ib(port("mlx5_0"))) for k in range(1, 6)], cfg=cfg)
    assert "ABSENT/missing from sysfs" in get(res[-1], "ib.drop:mlx5_1/1").summary


def counters(**kw):
    return {f"{'hw_counters' if name in ('local_ack_timeout_err', 'roce_slow_restart', 'rnr_nak_retry_err') else 'counters'}/{name}": v
            for name, v in kw.items()}


def two(first: dict, second: dict, cfg=None):
    return run(snap(NOW, i=ib(port(counters=first))), snap(NOW + 10, i=ib(port(counters=second))), cfg=cfg)[-1]


def test_counter_rate_thresholds():
    # per-second rules use the tick's rate
    res = two(counters(port_rcv_errors=cd(0, None), port_xmit_discards=cd(0, None), local_ack_timeout_err=cd(0, None), roce_slow_restart=cd(0, None)),
              counters(port_rcv_errors=cd(200, 200), port_xmit_discards=cd(500, 500), local_ack_timeout_err=cd(20, 20), roce_slow_restart=cd(50, 50)))
    for name, rate in (("port_rcv_errors", "20/s"), ("local_ack_timeout_err", "2/s")):
        f = get(res, f"ib.counter:{P}:{name}")
        assert (f.tier, f.attribution, f.action) == (2, "fabric", "drain") and rate in texts(f)
    assert f"ib.counter:{P}:port_xmit_discards" not in ids(res)  # 50/s < 100/s
    assert f"ib.counter:{P}:roce_slow_restart" not in ids(res)  # 5/s < 10/s


def test_any_increase_counters():
    names = ("excessive_buffer_overrun_errors", "local_link_integrity_errors", "rnr_nak_retry_err")
    res = two(counters(**{n: cd(7, None) for n in names}), counters(**{n: cd(8, 1) for n in names}))
    for n in names:
        assert "+1" in texts(get(res, f"ib.counter:{P}:{n}"))


def test_symbol_error_per_hour_accumulates_over_ticks_not_from_one_tick():
    # 5 symbol errors per minute: never 10/s, but 300/h > 120/h once the hour fills up
    snaps = [snap(NOW + k * 60, i=ib(port(counters=counters(symbol_error=cd(5 * k, 5 if k else None, 60.0))))) for k in range(40)]
    res = run(*snaps)
    assert f"ib.counter:{P}:symbol_error" not in ids(res[20])  # 100 in the first 20 min
    f = get(res[30], f"ib.counter:{P}:symbol_error")
    assert "per" not in f.id and "/h (threshold 120/h)" in texts(f)
    # a burst above 10/s trips the per-second rule at once
    burst = two(counters(symbol_error=cd(0, None)), counters(symbol_error=cd(150, 150)))
    assert "15/s (threshold 10/s)" in texts(get(burst, f"ib.counter:{P}:symbol_error"))


def test_link_error_recovery_per_minute():
    res = two(counters(link_error_recovery=cd(0, None)), counters(link_error_recovery=cd(6, 6)))
    assert "/min (threshold 5/min)" in texts(get(res, f"ib.counter:{P}:link_error_recovery"))


def test_counter_finding_is_sticky_and_classifying_one_sample_twice_counts_once():
    cfg = settings(infiniband={"sticky_s": 100.0})
    s1 = snap(NOW, i=ib(port(counters=counters(local_link_integrity_errors=cd(0, None)))))
    s2 = snap(NOW + 10, i=ib(port(counters=counters(local_link_integrity_errors=cd(4, 4)))))
    s2_again = snap(NOW + 12, i=s2.infiniband)  # the kernel follower ticked; same IB sample
    later = [snap(NOW + 10 + k * 10, i=ib(port(counters=counters(local_link_integrity_errors=cd(4, 0))))) for k in range(1, 12)]
    res = run(s1, s2, s2_again, *later, cfg=cfg)
    assert get(res[2], f"ib.counter:{P}:local_link_integrity_errors").count == 4
    assert f"ib.counter:{P}:local_link_integrity_errors" in ids(res[10])  # held for sticky_s
    assert "reported until" in texts(get(res[10], f"ib.counter:{P}:local_link_integrity_errors"))
    assert f"ib.counter:{P}:local_link_integrity_errors" not in ids(res[-1])


def test_saturated_counter_is_t3_unknown():
    res = run(snap(NOW, i=ib(port(counters=counters(symbol_error=cd(65535, None, saturated=True))))))[0]
    f = get(res, f"ib.saturated:{P}:symbol_error")
    assert (f.tier, f.attribution, f.action) == (3, "unknown", "none")
    assert f.summary == f"{P}: symbol_error counter saturated at max: errors since are unknown; clear with perfquery -x -R"
    assert "65535" in texts(f)


def test_unreadable_counter_file_is_t3_unknown():
    res = run(snap(NOW, i=ib(port(unreadable={"counters/symbol_error": "[Errno 5] Input/output error"}))))[0]
    f = get(res, f"ib.unreadable:{P}")
    assert (f.tier, f.attribution) == (3, "unknown") and "Input/output error" in texts(f)


def test_port_xmit_wait_is_congestion_never_an_error():
    res = two(counters(port_xmit_wait=cd(2_500_000_000, None)), counters(port_xmit_wait=cd(4_294_967_295, 1_794_967_295, saturated=True)))
    assert res.findings == ()


def test_ib_collector_error_is_t3_unknown():
    res = run(snap(NOW, i=ib(status="error", detail="EIO reading /sys/class/infiniband")))[0]
    f = get(res, "collector.infiniband:node")
    assert (f.tier, f.attribution) == (3, "unknown") and f.summary == "could not check infiniband: EIO reading /sys/class/infiniband"


def test_counter_increases_and_their_windows_are_the_collectors():
    # the collector's window (30 s since its previous reading), not the 10 s between two ticks
    res = two(counters(link_downed=cd(5, None)), counters(link_downed=cd(6, 1, 30.0)))
    assert "counters/link_downed +1 in 30s" in texts(get(res, f"ib.counter:{P}:link_downed"))
    # a value that went up with no delta (the collector saw a reset or a first reading) is no increase
    assert two(counters(link_downed=cd(5, None)), counters(link_downed=cd(9, None, reset=True))).findings == ()
