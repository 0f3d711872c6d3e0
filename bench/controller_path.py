"""The controller's whole report path.

Reports/s: real munged daemons (one per fake node, distinct --origin, plus the controller's), the real Controller behind the real ControllerHTTPServer on 127.0.0.1:0, reports
   signed with envelope.sign_report BEFORE the timed part (each timed report has its own credential:
   replays are 409), POSTed by a client SUBPROCESS (its own GIL; raw sockets, requests framed before
   the timed part) with --threads threads, a new connection per report (as agents do) and keep-alive,
   to the server with its report worker processes (1, 2 as shipped, 4: checks in processes of their
   own, the worker CPU counted with the server's), with 4 verifier threads (report_processes: 0) and
   with receive_report inline on the loop (the design before both), while a control-loop thread runs Controller.evaluate(now) every --round-s
   over a fleet of --nodes simulated nodes (in-memory Slurm). Client, server and munged share the
   machine's cores: CPU seconds of each are reported. Baselines in the same process: MUNGE decode
   alone (libmunge through the controller's munged, 1/2/4/8 threads, the best one counts),
   verify_report alone, and Controller.receive_report alone (verify + parse + store, no HTTP).
   Target, a new connection per report: >= 3,500 reports/s and >= 0.8 x MUNGE decode alone.

The control round at fleet scale and its memory are bench/controller_round.py's.

    .venv/bin/python bench/controller_path.py [--quick] [--reports 20000] [--nodes 10000]

Writes bench/results/controller_path.json. Slurm is an in-memory fake (never the bottleneck here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, keep_skipped, pct, save, summary

from healthd import envelope, munge
from healthd.controller import auth
from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import ROUND_INTERVAL_S, Controller
from healthd.controller.executor import Executor
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings, NodeReport
from healthd.controller.server import DEFAULT_REPORT_THREADS, ControllerHTTPServer
from healthd.model import iso
from healthd.slurm.backend import slurm_hostlist
from tests.support.fake_slurm import FakeBackend

TARGET_PER_S = 3500
"""Reports/s, a new connection per report: 100,000 nodes at a 30 s heartbeat, with headroom."""
DEFAULT_PROCESSES = ControllerSettings().report_processes
TARGET_RATIO = 0.8
"""The whole path over MUNGE decode alone (its best thread count), same run, same machine."""
SWITCH_SIZE = 32
PARTITIONS = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")
FAILING_SHARE = 0.01
T3_SHARE = 0.005

logging.getLogger("healthd").addHandler(logging.NullHandler())
logging.getLogger("healthd").propagate = False  # the breaker ALERT / apply lines are not wanted on the terminal


# --------------------------------------------------------------------------- the fleet, simulated


def node_names(n: int) -> list[str]:
    return [f"gpu{i:06d}" for i in range(n)]


def topology_conf(names: list[str]) -> str:
    """Leaf switches of 32 nodes, spines of 32 leaves, one core: what topology/tree sites write."""
    lines, leaves = [], []
    for s in range(0, len(names), SWITCH_SIZE):
        leaf = f"leaf{s // SWITCH_SIZE:05d}"
        leaves.append(leaf)
        lines.append(f"SwitchName={leaf} Nodes={slurm_hostlist(names[s:s + SWITCH_SIZE])}")
    spines = []
    for s in range(0, len(leaves), 32):
        spine = f"spine{s // 32:04d}"
        spines.append(spine)
        lines.append(f"SwitchName={spine} Switches={slurm_hostlist(leaves[s:s + 32])}")
    lines.append(f"SwitchName=core Switches={slurm_hostlist(spines)}")
    return "\n".join(lines) + "\n"


def _finding(kind: str, node_i: int, first_seen: float) -> dict:
    gpu = node_i % 8
    comp = {"kind": "gpu", "index": gpu, "uuid": f"GPU-{node_i:08x}-{gpu:04x}-4e5f-8a9b-0c1d2e3f4a5b",
            "serial": f"1652{node_i:07d}{gpu}", "bus_id": f"00000000:{0x18 + 0x10 * gpu:02X}:00.0", "device": None, "port": None}
    base = {"count": 1, "first_seen": iso(first_seen), "last_seen": iso(first_seen + 30), "job": None, "xid": None}
    if kind == "xid79":
        return {**base, "id": f"xid:gpu{gpu}:79", "component": comp, "source": "kernel_log", "xid": 79, "attribution": "hardware",
                "tier": 1, "action": "drain-and-requeue", "summary": f"xid 79 gpu{gpu}: fell off the bus",
                "evidence": [{"kind": "log_line", "text": f"NVRM: Xid (PCI:0000:{0x18 + 0x10 * gpu:02x}:00): 79, pid=4242, GPU has fallen off the bus.",
                              "cursor": f"s=8c1f;i={node_i:x}"}]}
    if kind == "xid48":
        return {**base, "id": f"xid:gpu{gpu}:48", "component": comp, "source": "kernel_log", "xid": 48, "attribution": "hardware",
                "tier": 1, "action": "drain", "summary": f"xid 48 gpu{gpu}: double-bit ECC error",
                "evidence": [{"kind": "log_line", "text": f"NVRM: Xid (PCI:0000:{0x18 + 0x10 * gpu:02x}:00): 48, An uncorrectable double bit error"}]}
    if kind == "ibdown":
        return {**base, "id": "ib-port-down:mlx5_2:1", "component": {"kind": "port", "device": "mlx5_2", "port": 1},
                "source": "infiniband", "attribution": "fabric", "tier": 1, "action": "drain",
                "summary": "mlx5_2 port 1 down for 90 s", "evidence": [{"kind": "state", "text": "state DOWN phys_state Polling since 90 s", "state": "DOWN"}]}
    if kind == "remap":
        return {**base, "id": f"remap-pending:gpu{gpu}", "component": comp, "source": "nvml", "attribution": "hardware",
                "tier": 2, "action": "reset-gpu-when-idle", "summary": f"gpu{gpu}: row remap pending",
                "evidence": [{"kind": "nvml_value", "text": "remapped rows pending: 1", "field": "remap_pending", "value": 1}]}
    return {**base, "id": f"pcie-degraded:gpu{gpu}", "component": comp, "source": "nvml", "attribution": "hardware",
            "tier": 3, "action": "none", "summary": f"gpu{gpu}: PCIe link gen4x16, expected gen5x16",
            "evidence": [{"kind": "nvml_value", "text": "pcie gen4 x16", "field": "pcie", "value": "gen4x16"}]}


def findings_for(i: int, n: int, now: float, rng: random.Random) -> list[dict]:
    """About 1 % of nodes failing (T1/T2), 0.5 % degraded (T3), the rest healthy. Failures were first
    seen over the last 24 h (a steady state: few fall inside the breaker's 10-minute window)."""
    failing = max(1, round(n * FAILING_SHARE))
    degraded = max(1, round(n * T3_SHARE))
    slot = i % 200
    if slot < failing * 200 // n:
        kind = ("xid79", "xid48", "ibdown", "remap")[(i // 200) % 4]
        return [_finding(kind, i, now - rng.uniform(0, 86400))]
    if slot < (failing + degraded) * 200 // n:
        return [_finding("t3", i, now - rng.uniform(0, 86400))]
    return []


def state_document(node: str, i: int, now: float, findings: list[dict]) -> dict:
    """The agent's JSON document (README "Output"): 8 GPUs, 8 IB ports, its findings."""
    verdict = "healthy"
    if findings:
        verdict = "failed" if any(f["tier"] == 1 for f in findings) else "degraded"
    return {
        "node": node, "verdict": verdict, "generated_at": iso(now), "dry_run": False,
        "agent": {"version": "0.1.0", "pid": 4242, "started_at": iso(now - 86400), "interval_s": 10.0,
                  "boot_id": f"{i:08x}-1f2e-4d3c-8b7a-69584736251a"},
        "sources": {s: {"status": "ok", "detail": "", "seconds": 0.0123} for s in ("nvml", "kernel_log", "infiniband", "host")},
        "gpus": [{"index": g, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08x}-{g:04x}-4e5f-8a9b-0c1d2e3f4a5b",
                  "serial": f"1652{i:07d}{g}", "bus_id": f"00000000:{0x18 + 0x10 * g:02X}:00.0", "state": "ok",
                  "temperature_c": 34 + g, "margin_c": 51 - g, "ecc_uncorrected_volatile": 0, "remap_pending": False,
                  "remap_failure": False, "pcie": "gen5x16", "no_data": []} for g in range(8)],
        "ports": [{"device": f"mlx5_{p}", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 400.0,
                   "link_layer": "InfiniBand"} for p in range(8)],
        "findings": findings,
        "would_do": [],
    }


def fleet_reports(names: list[str], now: float, seed: int = 7) -> dict[str, NodeReport]:
    """node -> NodeReport exactly as receive_report stores it (NodeReport.from_document)."""
    rng = random.Random(seed)
    return {n: NodeReport.from_document(state_document(n, i, now, findings_for(i, len(names), now, rng)), now)
            for i, n in enumerate(names)}


def make_controller(tmp: Path, names: list[str], mode: str, *, munge_socket: str | None = None,
                    node_addrs: dict[str, str] | None = None) -> tuple[Controller, Ledger, FakeBackend]:
    tmp.mkdir(parents=True, exist_ok=True)
    backend = FakeBackend(names, partition=PARTITIONS)
    ledger = Ledger(tmp / "ledger.sqlite")
    settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(tmp / "ledger.sqlite"), munge_socket=munge_socket,
                                  node_addrs=node_addrs or {},
                                  # a site sets floors; with them the capacity gate sizes every partition each round
                                  policy=ControllerPolicySettings(mode=mode,  # type: ignore[arg-type]
                                                                  capacity_floors={p: len(names) // 8 for p in PARTITIONS}))
    # list_jobs: no squeue subprocess for drain-and-requeue (no job runs on a simulated node)
    executor = Executor(backend, ledger, list_jobs=lambda node: [], out=lambda line: None)
    ctl = Controller(settings, ledger, backend, executor=executor, topology_text=topology_conf(names),
                     node_addrs=(lambda: node_addrs or {}))
    return ctl, ledger, backend


# --------------------------------------------------------------------------- 1. the whole path


def _proc_cpu_s(pid: int) -> float:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = raw[raw.rfind(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def client_main(url: str, bodies_file: str, threads: int, mode: str, max_s: float) -> None:
    """The load generator (a subprocess, its own GIL): `threads` threads posting the pre-signed bodies
    back to back over raw sockets, the HTTP/1.1 request framed before the timed part (so the client
    spends as little of the shared CPU as it can): one keep-alive connection each (`keepalive`), or a
    new connection per report with `Connection: close` (`close`: what the agent's urllib_post does).
    Stops sending after max_s seconds. Prints one JSON line."""
    import socket

    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    addr = (host, int(port))
    bodies = Path(bodies_file).read_bytes().split(b"\n")
    close = mode == "close"
    head = (f"POST /v1/report HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: healthd-bench\r\n"
            f"Content-Type: application/json\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}").encode()
    shares = [[head + b"Content-Length: %d\r\n\r\n" % len(b) + b for b in bodies[k::threads]] for k in range(threads)]
    lat: list[list[float]] = [[] for _ in range(threads)]
    status: list[Counter] = [Counter() for _ in range(threads)]
    connects = [0] * threads
    errors: list[str] = []
    ready = threading.Barrier(threads + 1)
    deadline = [0.0]

    def answer(sock: socket.socket, buf: bytearray) -> int:
        """Read one response (to EOF when closing, else by its Content-Length); its status."""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head_text = bytes(buf[:end]).decode("latin-1")
                length = 0
                for line in head_text.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                if len(buf) >= end + 4 + length:
                    del buf[:end + 4 + length]
                    return int(head_text.split(" ", 2)[1])
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the answer")
            buf += chunk

    def worker(k: int) -> None:
        sock = None
        buf = bytearray()
        ready.wait()
        try:
            for req in shares[k]:
                t = time.perf_counter()
                if t > deadline[0]:
                    break
                if sock is None:
                    sock = socket.create_connection(addr)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    connects[k] += 1
                    buf.clear()
                sock.sendall(req)
                code = answer(sock, buf)
                if close:
                    while sock.recv(65536):  # to the server's FIN, as urllib reads to EOF
                        pass
                    sock.close()
                    sock = None
                lat[k].append(time.perf_counter() - t)
                status[k][code] += 1
        except OSError as exc:
            errors.append(repr(exc))
        finally:
            if sock is not None:
                sock.close()

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    cpu0 = os.times()
    deadline[0] = time.perf_counter() + max_s
    ready.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    all_lat = sorted(x for part in lat for x in part)
    total: Counter = Counter()
    for c in status:
        total.update(c)
    print(json.dumps({"wall_s": wall, "statuses": {str(k): v for k, v in total.items()}, "sent": len(all_lat),
                      "errors": errors[:5], "p50_ms": pct(all_lat, 50) * 1e3, "p99_ms": pct(all_lat, 99) * 1e3,
                      "max_ms": all_lat[-1] * 1e3, "mean_ms": statistics.fmean(all_lat) * 1e3, "connections": sum(connects),
                      "client_cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)}))


def sign_pool(fleet, n: int, now: float, start: int = 0) -> list[bytes]:
    """n distinct signed reports, round robin over the fleet's nodes (each through its own munged);
    one report in 200 carries a T1/T2 finding."""
    nodes = fleet.nodes
    rng = random.Random(start)

    def one(k: int) -> bytes:
        i = k % len(nodes)
        node = nodes[i]
        doc = state_document(node, i, now + k * 1e-3, findings_for(k, 10_000, now, rng) if k % 100 == 0 else [])
        return envelope.sign_report(doc, node, fleet.socket(node))

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, range(start, start + n)))


VARIANTS = (
    # (name, client mode, server report_threads, report check processes, what)
    ("close-inline", "close", 0, 0, "a new connection per report, receive_report inline on the event loop"),
    ("close-threads", "close", DEFAULT_REPORT_THREADS, 0, f"a new connection per report, {DEFAULT_REPORT_THREADS} "
                                                          f"verifier threads (report_processes: 0)"),
    ("close-processes-1", "close", DEFAULT_REPORT_THREADS, 1, "a new connection per report, 1 worker process"),
    ("close", "close", DEFAULT_REPORT_THREADS, DEFAULT_PROCESSES,
     f"a new connection per report (Connection: close, as the agent's urllib_post), {DEFAULT_PROCESSES} worker "
     f"processes (as shipped)"),
    ("close-processes-4", "close", DEFAULT_REPORT_THREADS, 4, "a new connection per report, 4 worker processes"),
    ("keepalive-inline", "keepalive", 0, 0, "keep-alive connections, receive_report inline on the event loop"),
    ("keepalive", "keepalive", DEFAULT_REPORT_THREADS, DEFAULT_PROCESSES,
     f"keep-alive connections, {DEFAULT_PROCESSES} worker processes (as shipped)"),
)
MUNGE_THREADS = (1, 2, 4, 8)


def munge_decode_rate(creds: list[str], socket: str, threads: int) -> float:
    """libmunge decode alone (healthd.munge.decode, through the controller's munged with its replay
    cache) of distinct credentials: no JSON, no digest, no checks, no HTTP."""
    from healthd import munge

    t0 = time.perf_counter()
    if threads <= 1:
        for c in creds:
            munge.decode(c, socket)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda c: munge.decode(c, socket), creds))
    return len(creds) / (time.perf_counter() - t0)


def bench_path(args, tmp: Path) -> dict:
    from tests.controller.munge_support import MungeFleet

    real = [f"rnode{k:03d}" for k in range(args.munge_nodes)]
    sim = node_names(args.nodes - len(real))
    out: dict = {"munge_nodes": len(real), "simulated_nodes": len(sim), "client_threads": args.threads,
                 "client": "one subprocess (its own GIL), raw-socket HTTP/1.1, requests framed before the timed part",
                 "cores": os.cpu_count(), "round_s": args.round_s, "mode": "auto", "max_s_per_variant": args.max_s,
                 "variants": {}}
    with MungeFleet(real) as fleet:
        now = time.time()
        base_n = max(2000, args.reports // 5)
        n_base = (2 + len(MUNGE_THREADS)) * base_n
        t0 = time.perf_counter()
        variants = [v for v in VARIANTS if not args.variants or v[0] in args.variants]
        runs = len(variants) * args.repeat
        bodies = sign_pool(fleet, runs * args.reports + n_base, now)
        sign_s = time.perf_counter() - t0
        out["sign_per_s"] = round(len(bodies) / sign_s, 1)
        out["body_bytes_median"] = statistics.median(len(b) for b in bodies)
        verify_bodies, receive_bodies = bodies[:base_n], bodies[base_n:2 * base_n]
        munge_creds = [json.loads(b)["credential"] for b in bodies[2 * base_n:n_base]]
        pools = [bodies[n_base + v * args.reports: n_base + (v + 1) * args.reports] for v in range(runs)]
        print(f"  signed {len(bodies):,} reports ({out['body_bytes_median']:.0f} B each) at {out['sign_per_s']:,.0f}/s (not timed)")

        ctl, ledger, backend = make_controller(tmp / "path", sim + real, "auto", munge_socket=fleet.controller_socket,
                                               node_addrs=dict(fleet.node_addrs))
        ctl.reports.update(fleet_reports(sim, time.time()))  # the other nodes' latest reports, as already received
        ctl.evaluate(time.time())  # first round (incidents into the ledger) outside the timed part

        # baseline 0, the one the target is set against: MUNGE verification alone (libmunge decode of
        # the same kind of credentials through the same munged), at its best thread count
        munge.decode(munge_creds[0], fleet.controller_socket)  # warm: library loaded, munged's threads up
        munge_rates = {}
        for k, threads in enumerate(MUNGE_THREADS):
            munge_rates[threads] = munge_decode_rate(munge_creds[1 + k * base_n: (k + 1) * base_n], fleet.controller_socket, threads)
        munge_best = max(munge_rates.values())
        out["munge_decode_only_per_s"] = {str(k): round(v, 1) for k, v in munge_rates.items()}
        out["munge_decode_only_best_per_s"] = round(munge_best, 1)
        # baseline 1: verify_report alone, one thread, same process, same kind of bodies
        addrs = dict(fleet.node_addrs)
        t0 = time.perf_counter()
        for body in verify_bodies:
            auth.verify_report(body, socket=fleet.controller_socket, node_addrs=addrs, now=time.time())
        verify_rate = base_n / (time.perf_counter() - t0)
        # baseline 2: Controller.receive_report alone (verify + NodeReport + store + metrics), no HTTP
        t0 = time.perf_counter()
        codes = Counter(ctl.receive_report(body, "127.0.0.1")[0] for body in receive_bodies)
        receive_rate = base_n / (time.perf_counter() - t0)
        assert codes == {200: base_n}, codes
        out["verify_only_per_s"] = round(verify_rate, 1)
        out["receive_report_only_per_s"] = round(receive_rate, 1)
        t0 = time.perf_counter()
        for body in verify_bodies:  # the pure-Python share of verify: parse + the digest of the bytes as sent
            auth.parse_envelope(body, envelope.DEFAULT_MAX_BYTES)
            envelope.sent_payload_digest(body)
        out["envelope_parse_digest_only_per_s"] = round(base_n / (time.perf_counter() - t0), 1)
        print(f"  baseline, same process, no HTTP: MUNGE decode alone {', '.join(f'{k} thr {v:,.0f}/s' for k, v in munge_rates.items())} "
              f"(best {munge_best:,.0f}/s); verify_report alone {verify_rate:,.0f}/s "
              f"(its parse + digest alone {out['envelope_parse_digest_only_per_s']:,.0f}/s); receive_report alone {receive_rate:,.0f}/s")

        stop = threading.Event()
        rounds: list[float] = []

        def control_loop() -> None:  # as daemon.main: a round, then wait the interval
            while not stop.is_set():
                with ctl.reports_lock:  # the simulated agents keep reporting: their reports stay fresh
                    for node in sim:
                        r = ctl.reports[node]
                        if time.time() - r.received_at > 60:
                            ctl.reports[node] = dataclasses.replace(r, received_at=time.time())
                t = time.perf_counter()
                ctl.evaluate(time.time())
                rounds.append(time.perf_counter() - t)
                stop.wait(args.round_s)

        loop = threading.Thread(target=control_loop, daemon=True)
        loop.start()
        reg = ctl.metrics.registry
        lat_name = "healthd_controller_report_latency_seconds"
        munged = fleet.pids()
        # the variants interleaved, --repeat times: a noisy neighbour slows all of them alike, and the
        # median of each variant's runs is what counts
        for (rep, (name, mode, report_threads, processes, what)), pool in zip(
                ((r, x) for r in range(args.repeat) for x in variants), pools, strict=True):
            if processes:
                ctl.start_report_processes(processes)
                time.sleep(1.5)  # each worker started and its imports done before the timed part
            workers = ctl.checkers.pids if ctl.checkers is not None else []
            w0 = sum(_proc_cpu_s(pid) for pid in workers)
            server = ControllerHTTPServer("127.0.0.1:0", ctl, report_threads=report_threads)
            server.start_background()
            bodies_file = tmp / f"bodies-{name}.txt"
            bodies_file.write_bytes(b"\n".join(pool))
            r0 = len(rounds)
            stored0 = len(ctl.reports)
            m0 = {k: _proc_cpu_s(pid) for k, pid in munged.items()}
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            lat0 = (reg.get_sample_value(lat_name + "_sum") or 0.0, reg.get_sample_value(lat_name + "_count") or 0.0)
            proc = subprocess.run([sys.executable, __file__, "--client", server.url, str(bodies_file), str(args.threads),
                                   mode, str(args.max_s)],
                                  capture_output=True, text=True, check=False, cwd=ROOT)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            m1 = {k: _proc_cpu_s(pid) for k, pid in munged.items()}
            w1 = sum(_proc_cpu_s(pid) for pid in workers)
            server.shutdown()
            server.server_close()
            if ctl.checkers is not None:
                ctl.checkers.close()
                ctl.checkers = None
            if proc.returncode != 0:
                raise SystemExit(f"client failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            accepted = res["statuses"].get("200", 0)
            rate = accepted / res["wall_s"]
            lat_s = (reg.get_sample_value(lat_name + "_sum") or 0.0) - lat0[0]
            lat_c = (reg.get_sample_value(lat_name + "_count") or 0.0) - lat0[1]
            during = rounds[r0:]
            cpu = {"server_process": round((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime) + (w1 - w0), 2),
                   "of_which_check_processes": round(w1 - w0, 2),
                   "client_process": round(res["client_cpu_s"], 2),
                   "controller_munged": round(m1["controller"] - m0["controller"], 2)}
            cpu_total = cpu["server_process"] + cpu["client_process"] + cpu["controller_munged"]
            v = {
                "what": what, "client_mode": mode, "report_threads": report_threads, "report_processes": processes,
                "posted": res["sent"], "statuses": res["statuses"], "client_errors": res["errors"], "accepted": accepted,
                "timed_wall_s": round(res["wall_s"], 3), "accepted_per_s": round(rate, 1),
                "latency_ms": {"p50": round(res["p50_ms"], 3), "p99": round(res["p99_ms"], 3), "max": round(res["max_ms"], 2),
                               "mean": round(res["mean_ms"], 3)},
                "server_verify_store_mean_ms": round(lat_s / lat_c * 1e3, 4) if lat_c else None,
                "tcp_connections": res["connections"],
                "control_rounds_during": len(during),
                "round_ms_during": {k: round(x * 1e3, 1) for k, x in summary(during).items() if k != "n"} if during else None,
                "cpu_s": cpu,
                # the 2 cores are shared: how busy they were, and the client's part of that
                "cores_busy": round(cpu_total / res["wall_s"], 2),
                "client_cpu_share": round(cpu["client_process"] / cpu_total, 3) if cpu_total else None,
                "server_cpu_ms_per_report": round(cpu["server_process"] / accepted * 1e3, 3) if accepted else None,
                "ratio_over_munge_decode_only": round(rate / munge_best, 3),
                "ratio_over_verify_only": round(rate / verify_rate, 3),
                "ratio_over_receive_report_only": round(rate / receive_rate, 3),
            }
            out["variants"].setdefault(name, {"runs": []})["runs"].append(v)
            print(f"  {rep + 1} {name:17} {accepted:6,}/{res['sent']:,} at {rate:6,.0f}/s  p50 {res['p50_ms']:5.2f} ms  "
                  f"p99 {res['p99_ms']:6.2f} ms  /munge {v['ratio_over_munge_decode_only']:.2f}  rounds {len(during)}  "
                  f"cores busy {v['cores_busy']:.2f} (client {v['client_cpu_share']:.0%})  cpu {cpu}")
            assert len(ctl.reports) == stored0, "a report stored under a node name the fleet does not have"
        stop.set()
        loop.join(timeout=30)
        for name, x in out["variants"].items():
            middle = sorted(x["runs"], key=lambda r: r["accepted_per_s"])[len(x["runs"]) // 2]
            x.update({k: middle[k] for k in ("what", "client_mode", "report_threads", "report_processes")})
            x["accepted_per_s_runs"] = [r["accepted_per_s"] for r in x["runs"]]
            for k in ("accepted_per_s", "ratio_over_munge_decode_only", "ratio_over_verify_only",
                      "ratio_over_receive_report_only", "server_cpu_ms_per_report", "cores_busy", "client_cpu_share"):
                x[k] = round(statistics.median(r[k] for r in x["runs"]), 3)
            x["statuses"] = dict(sum((Counter(r["statuses"]) for r in x["runs"]), Counter()))
            print(f"  median {name:17} {x['accepted_per_s']:7,.0f}/s  /munge {x['ratio_over_munge_decode_only']:.2f}  "
                  f"server cpu {x['server_cpu_ms_per_report']:.3f} ms/report  cores busy {x['cores_busy']:.2f} "
                  f"(client {x['client_cpu_share']:.0%})  runs {x['accepted_per_s_runs']}")
        if args.variants:  # a partial run: no figures to set against the targets
            ctl.close()
            ledger.close()
            out["partial"] = True
            return out
        for name in ("close-inline", "keepalive-inline"):
            out["variants"][name.replace("-inline", "")]["ratio_over_inline"] = round(
                out["variants"][name.replace("-inline", "")]["accepted_per_s"] / out["variants"][name]["accepted_per_s"], 3)
        shipped = out["variants"]["close"]  # what agents do: the target is set on this one
        out["best_shipped_per_s"] = shipped["accepted_per_s"]
        out["ratio_shipped_over_munge_decode_only"] = shipped["ratio_over_munge_decode_only"]
        out["pass"] = (shipped["accepted_per_s"] >= TARGET_PER_S and shipped["ratio_over_munge_decode_only"] >= TARGET_RATIO
                       and all(set(x["statuses"]) == {"200"} for x in out["variants"].values()))
        ctl.close()
        ledger.close()
    return out



# --------------------------------------------------------------------------- 2. the decision round


# --------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts (about a minute)")
    ap.add_argument("--reports", type=int, default=None, help="signed reports per client variant (default 12000; quick 4000)")
    ap.add_argument("--nodes", type=int, default=10_000, help="simulated fleet the control loop rounds over")
    ap.add_argument("--munge-nodes", type=int, default=8, help="real munged daemons signing reports")
    ap.add_argument("--threads", type=int, default=8, help="client connections (threads) posting in parallel")
    ap.add_argument("--max-s", type=float, default=None, help="stop each client variant after this long (default 20; quick 8)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each part-1 variant, interleaved (the median counts)")
    ap.add_argument("--round-s", type=float, default=ROUND_INTERVAL_S, help="control-loop interval during part 1")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: path")
    ap.add_argument("--variants", default="", help="comma list of the part-1 variants to run (default: all; "
                                                  "a partial run prints but does not save)")
    args = ap.parse_args()
    args.reports = args.reports or (4000 if args.quick else 12000)
    args.max_s = args.max_s or (8.0 if args.quick else 20.0)
    skip = set(filter(None, args.skip.split(",")))
    args.variants = set(filter(None, args.variants.split(",")))
    doc: dict = {"what": "controller: whole signed-report path over HTTP",
                 "target_per_s": TARGET_PER_S, "target_ratio_over_munge_decode_only": TARGET_RATIO, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="healthd-bench-ctl-") as tmpdir:
        tmp = Path(tmpdir)
        if "path" not in skip:
            print(f"1. whole path: {args.reports:,} signed reports over HTTP, {args.threads} client connections, "
                  f"control round every {args.round_s:g} s over {args.nodes:,} nodes")
            p = bench_path(args, tmp)
            if p.get("partial"):
                print("  a partial run (--variants): not saved")
                return
            doc["path"] = p
            print(f"  {'PASS' if p['pass'] else 'FAIL'}: {p['best_shipped_per_s']:,.0f} reports/s as shipped, a new connection per report, "
                  f"{p['ratio_shipped_over_munge_decode_only']:.2f} x MUNGE decode alone "
                  f"(targets >= {TARGET_PER_S:,}/s and >= {TARGET_RATIO:g} x)")
    save("controller_path", keep_skipped("controller_path", doc, [p for p in ("path",) if p in skip]))


if __name__ == "__main__":
    main()
