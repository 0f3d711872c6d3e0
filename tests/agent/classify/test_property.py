"""classify never raises, whatever the samples hold, and its history always survives a restart."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from healthd.agent.classify import classify
from healthd.agent.history import History
from healthd.model import (
    ACTIONS,
    CounterDelta,
    FilesystemProbe,
    GpuSample,
    HostSample,
    InfinibandSample,
    KernelSample,
    NvmlSample,
    PortSample,
    Snapshot,
    XidEvent,
)
from tests.support.builders import BUS, CATALOG, NOW, settings

small_int = st.one_of(st.none(), st.integers(-5, 5), st.integers(0, 2**40))
maybe_bool = st.one_of(st.none(), st.booleans())
times = st.floats(NOW - 100_000, NOW + 100_000, allow_nan=False)
any_float = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.floats(-10, 1000))
text = st.text(max_size=30)
bus = st.one_of(st.none(), st.sampled_from(BUS[:3]), st.sampled_from(["PCI:0000:18:00", "0000:2a:00", "garbage", ""]))
statuses = st.sampled_from(["ok", "no_data", "error"])

gpus = st.builds(
    GpuSample,
    index=st.integers(0, 3),
    uuid=st.one_of(st.none(), st.sampled_from(["GPU-a", "GPU-b"])),
    bus_id=bus,
    lost=st.booleans(),
    margin_c=small_int,
    clock_event_reasons=small_int,
    ecc_corrected_volatile=small_int,
    ecc_uncorrected_volatile=small_int,
    remap_pending=maybe_bool,
    remap_failure=maybe_bool,
    retired_pending=maybe_bool,
    pcie_replay=small_int,
    pcie_gen=small_int,
    pcie_gen_max=small_int,
    pcie_width=small_int,
    pcie_width_max=small_int,
    nvlink_errors=st.dictionaries(st.sampled_from(["link0.replay", "link1.crc_flit", "bogus", "link9.x"]), st.integers(-3, 10**9), max_size=3),
    errors=st.dictionaries(text, text, max_size=2),
)
nvml = st.builds(NvmlSample, status=statuses, detail=text,
                 error_kind=st.one_of(st.none(), st.sampled_from(["driver_not_loaded", "init_failed", "timeout", "other", "library_not_found"])),
                 count=small_int, gpus=st.lists(gpus, max_size=4).map(tuple))
events = st.builds(
    XidEvent,
    xid=st.one_of(st.sampled_from([13, 31, 45, 48, 63, 79, 94, 119, 149, 154]), st.integers(-2, 400)),
    bus_id=bus,
    text=st.one_of(text, st.just("NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")),
    count=st.integers(-2, 10**6),
    first_ts=st.one_of(times, st.floats(allow_nan=True, allow_infinity=True)),
    last_ts=st.one_of(times, st.floats(allow_nan=True, allow_infinity=True)),
    first_cursor=st.one_of(st.none(), text),
    last_cursor=st.one_of(st.none(), text),
    subcode=small_int,
    nvlink_severity=st.one_of(st.none(), st.sampled_from(["Fatal", "Non-fatal", "weird"])),
    gpc=small_int,
    tpc=small_int,
    synthesized=st.booleans(),
)
kernel = st.builds(KernelSample, status=statuses, detail=text, events=st.lists(events, max_size=5).map(tuple), gap=st.booleans(),
                   identities=st.dictionaries(st.sampled_from(BUS[:3]), st.tuples(st.one_of(st.none(), text), st.one_of(st.none(), text)), max_size=2))
counter = st.builds(CounterDelta, value=st.integers(0, 2**64), delta=st.one_of(st.none(), st.integers(-5, 10**6)), window_s=any_float,
                    saturated=st.booleans(), reset=st.booleans())
counter_names = st.sampled_from(["counters/symbol_error", "counters/link_downed", "counters/port_xmit_wait", "hw_counters/rnr_nak_retry_err",
                                 "counters/link_error_recovery", "counters/port_rcv_errors", "hw_counters/local_ack_timeout_err", "x/y"])
ports = st.builds(
    PortSample,
    device=st.sampled_from(["mlx5_0", "mlx5_1"]),
    port=st.integers(1, 2),
    state=st.one_of(st.none(), st.sampled_from(["ACTIVE", "DOWN", "INIT"])),
    phys_state=st.one_of(st.none(), st.sampled_from(["LinkUp", "Polling", "Disabled"])),
    rate_gbps=any_float,
    link_layer=st.one_of(st.none(), st.just("InfiniBand")),
    counters=st.dictionaries(counter_names, counter, max_size=4),
    unreadable=st.dictionaries(text, text, max_size=1),
)
infiniband = st.builds(InfinibandSample, status=statuses, detail=text, ports=st.lists(ports, max_size=3).map(tuple))
probes = st.builds(FilesystemProbe, path=st.sampled_from(["/ckpt", "/data"]), role=text, mounted=st.booleans(), writable=maybe_bool,
                   latency_s=any_float, timed_out=st.booleans(), error=st.one_of(st.none(), text))
host = st.builds(
    HostSample,
    status=statuses,
    detail=text,
    mem_available_bytes=small_int,
    mem_total_bytes=small_int,
    psi=st.dictionaries(st.sampled_from(["memory", "io", "cpu"]), st.dictionaries(st.sampled_from(["full_avg10", "some_avg10"]), any_float.filter(lambda x: x is not None), max_size=2), max_size=3),
    dstate_pids=st.lists(st.tuples(st.integers(1, 10**6), text), max_size=8).map(tuple),
    filesystems=st.lists(probes, max_size=2).map(tuple),
)
snapshots = st.builds(Snapshot, node=st.just("gpu001"), time=times, boot_id=st.one_of(st.none(), st.sampled_from(["b1", "b2"])),
                      nvml=nvml, kernel=kernel, infiniband=infiniband, host=host)
configs = st.builds(
    lambda g, p, r, i: settings(interval_s=i, nvml={"expected_gpus": g},
                                infiniband={"expected_ports": p, "expected_rate_gbps": r}),
    st.one_of(st.none(), st.integers(0, 8)),
    st.one_of(st.none(), st.integers(0, 8)),
    st.one_of(st.none(), st.floats(0, 800)),
    st.sampled_from([1.0, 10.0, 60.0]),
)


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seq=st.lists(snapshots, min_size=1, max_size=3), cfg=configs)
def test_classify_never_raises_and_history_round_trips(seq, cfg):
    hist = History()
    for snap in seq:
        before = json.dumps(hist.to_json(), allow_nan=False, sort_keys=True)
        res = classify(snap, hist, CATALOG, cfg)
        assert json.dumps(hist.to_json(), allow_nan=False, sort_keys=True) == before  # input untouched
        assert not [f for f in res.findings if f.id.startswith("classify.error")], [f.summary for f in res.findings]
        assert res.verdict in ("healthy", "degraded", "failed", "unknown")
        assert len({f.id for f in res.findings}) == len(res.findings)
        for f in res.findings:
            assert f.tier in (1, 2, 3) and f.action in ACTIONS and (f.tier != 3 or f.action == "none")
            json.dumps(f.to_json(), allow_nan=False)
        for w in res.would_do:
            assert w["reason"].startswith("healthd: ") and w["action"] != "none"
        text = json.dumps(res.history.to_json(), allow_nan=False)
        assert History.from_json(json.loads(text)) == res.history
        hist = res.history
