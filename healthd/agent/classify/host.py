"""Host rules: the configured filesystems (mounted, writable, answering, fast enough), available
memory, pressure stall information and processes stuck in uninterruptible sleep."""

from __future__ import annotations

from healthd.agent.classify.context import TickContext, fmt
from healthd.model import NODE, Component, Evidence, FilesystemProbe, HostSample
from healthd.settings import FilesystemSpec

HOST = "host"


def evaluate(ctx: TickContext, h: HostSample) -> None:
    cfg = ctx.settings.host
    specs = {fs.path: fs for fs in cfg.filesystems}
    for probe in h.filesystems:
        filesystem(ctx, probe, specs.get(probe.path) or FilesystemSpec(path=probe.path))

    avail, total = h.mem_available_bytes, h.mem_total_bytes
    if avail is not None and total and total > 0:
        pct = avail / total * 100
        if pct < cfg.mem_available_min_pct:
            ctx.emit(
                "host.memory", "node", NODE, HOST,
                f"available memory {pct:.1f}% of {total / 2**30:.0f} GiB (minimum {fmt(cfg.mem_available_min_pct)}%)",
                [Evidence("state", f"/proc/meminfo MemAvailable {avail:.0f} of MemTotal {total:.0f} bytes = {pct:.2f}%",
                          {"mem_available_bytes": h.mem_available_bytes, "mem_total_bytes": h.mem_total_bytes, "pct": pct,
                           "min_pct": cfg.mem_available_min_pct})],
            )
    for resource, limit in (("memory", cfg.psi_memory_full_avg10_max), ("io", cfg.psi_io_full_avg10_max)):
        reading = h.psi.get(resource, {}).get("full_avg10")
        full = float(reading) if reading is not None else None
        if full is not None and full > limit:
            ctx.emit(
                f"host.psi_{resource}", "node", NODE, HOST,
                f"{resource} pressure: full avg10 {full:.1f}% (max {fmt(limit)}%)",
                [Evidence("state", f"/proc/pressure/{resource} full avg10={full:.2f}", {"resource": resource, "full_avg10": full, "max": limit})],
            )
    dstate = h.dstate_pids
    if len(dstate) >= cfg.dstate_min_count:
        shown = ", ".join(f"{pid} ({comm})" for pid, comm in dstate[:10])
        ctx.emit(
            "host.dstate", "node", NODE, HOST,
            f"{len(dstate)} processes in uninterruptible sleep (D state)",
            [Evidence("state", f"D-state processes: {shown}{' ...' if len(dstate) > 10 else ''}",
                      {"count": len(dstate), "pids": [[pid, comm] for pid, comm in dstate[:50]], "min_count": cfg.dstate_min_count})],
        )


def filesystem(ctx: TickContext, probe: FilesystemProbe, spec: FilesystemSpec) -> None:
    """The first that applies: not mounted, hung, not writable, slow, a probe error."""
    comp = Component(kind="filesystem", device=probe.path)
    key = comp.key()
    what = f"{probe.role} filesystem {probe.path}"
    data = {"path": probe.path, "role": probe.role, "mounted": probe.mounted, "writable": probe.writable,
            "latency_s": probe.latency_s, "timed_out": probe.timed_out, "error": probe.error, "fstype": probe.fstype,
            "mount_point": probe.mount_point}
    probe_ev = Evidence("probe", f"{probe.path}: mounted {probe.mounted} (mount {probe.mount_point}, {probe.fstype}), "
                        f"writable {probe.writable}, write+fsync {probe.latency_s if probe.latency_s is None else f'{probe.latency_s:.3f}s'}"
                        f"{', timed out' if probe.timed_out else ''}{f', error: {probe.error}' if probe.error else ''}", data)

    def emit(kind: str, summary: str, *extra: Evidence) -> None:
        ctx.emit(kind, key, comp, HOST, summary, [probe_ev, *extra])

    latency = probe.latency_s
    if not probe.mounted:
        emit("fs.unmounted", f"{what} is not mounted (jobs cannot checkpoint)")
    elif probe.timed_out:
        emit("fs.hung", f"{what} hung: write+fsync did not finish in {fmt(spec.timeout_s)}s",
             Evidence("config", f"timeout_s = {spec.timeout_s}", {"timeout_s": spec.timeout_s}))
    elif probe.writable is False:
        emit("fs.readonly", f"{what} is not writable{f': {probe.error}' if probe.error else ''}")
    elif latency is not None and latency > spec.max_latency_s:
        emit("fs.slow", f"{what} slow: write+fsync {latency:.2f}s (max {fmt(spec.max_latency_s)}s)",
             Evidence("config", f"max_latency_s = {spec.max_latency_s}", {"max_latency_s": spec.max_latency_s}))
    elif probe.error:
        emit("fs.probe_error", f"could not probe {what}: {probe.error}")
