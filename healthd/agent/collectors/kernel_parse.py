"""Parse NVIDIA driver (NVRM) kernel log lines into KernelLine values. Pure: no I/O, never raises.

Line variants (as the NVIDIA driver prints them; gpud's Xid reader knows the same set):

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    NVRM: Xid (0000:03:00): 14, Channel 00000001                      older drivers: no PCI:, no pid/name
    NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, ...
    NVRM: Xid (PCI:0000:b5:00): 13, pid=..., name=..., Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): ...
    NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 ...)
    NVRM: GPU 0000:05:00.0: GPU has fallen off the bus.              no Xid text: reported as Xid 79
    NVRM: The NVIDIA GPU 0000:18:00.0 ... fallen off the bus and is not responding to commands.
    NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 14(0x0, ...)
    NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-...                    bus id -> UUID
    NVRM: GPU Board Serial Number: 1652823054928                     serial of the GPU named just before
    NVRM: GPU 0000:39:00.0: RmInitAdapter failed! (0x62:0x40:2393)   a GPU that failed to initialise:
    NVRM: GPU 0000:0a:00.0: rm_init_adapter failed, device minor number 5      no Xid text, reported
    NVRM: GPU 0000:01:00.0: GPU does not have the necessary power cables connected.   as Xid 143
    NVRM: RmInitAdapter failed! (0x27:0x38:1193)                     older drivers: no bus id
    NVRM: rm_init_adapter failed for device bearing minor number 0

Anything before `NVRM:` (a dmesg `[  123.456]` or `[Fri Aug 30 11:43:09 2024]` time, a syslog
`Aug 12 06:54:37 host kernel:` prefix) is ignored: journal and kmsg messages carry none, and lines
copied from dmesg or syslog read the same.

The caller counts a message as malformed when `parse_line` returns None and `looks_like_xid` is True.
"""

from __future__ import annotations

import re

from healthd.model import KernelLine, normalize_bus_id

__all__ = ["parse_line", "is_nvrm", "looks_like_xid", "nvlink5_subcode", "XID_MARKER", "INIT_FAILED_XID"]

XID_MARKER = "NVRM: Xid"
INIT_FAILED_XID = 143
"""NVIDIA's GPU_INIT_ERROR: the Xid a failed GPU initialisation is reported as (the driver prints none)."""

# A PCI address as the driver prints it: `0000:3b:00`, `3b:00`, `0000:05:00.0`, optional `PCI:`.
_ADDR = r"(?:PCI:)?(?P<bus>[0-9A-Fa-f]{1,8}(?::[0-9A-Fa-f]{1,2}){1,2}(?:\.[0-7])?)"

_XID_RE = re.compile(r"NVRM: Xid \(" + _ADDR + r"\): (?P<xid>\d{1,5})(?![0-9])(?:,\s*|\s+|$)(?P<rest>.*)", re.S)
_PID_RE = re.compile(r"pid=(?:'?<unknown>'?|(?P<pid>\d{1,10}))(?:,\s*|\s*$)")
_NAME_RE = re.compile(r"name=(?P<name>[^,]*?)(?:,\s*|\s*$)")
# NVLink5 (Xid 144-150): `<UNIT> <Fatal|Nonfatal|Non-fatal> XC0 i0 Link 08 (0x<intrinfo> 0x<status> ...)`.
_NVL5_RE = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*(?:/[A-Z0-9_]+)*)\s+(?P<sev>[Ff]atal|[Nn]on-?[Ff]atal)\b[^(]*\(\s*(?P<word>0x[0-9A-Fa-f]{1,8})(?![0-9A-Fa-f])"
)
# NVLink 1-4 (Xid 74): `NVLink: fatal error detected on link 6(0x10000, ...)`; `nonfatal`/`non-fatal` too.
_NVL_SEV_RE = re.compile(r"NVLink:\s*(?P<sev>fatal|non-?fatal)\s+error", re.I)
_GPC_RE = re.compile(r"\(GPC (?P<gpc>\d+), TPC (?P<tpc>\d+)(?:, SM (?P<sm>\d+))?\)")
_ANY_ADDR_RE = re.compile(r"(?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)(?![0-9A-Fa-f])")
_IDENTITY_RE = re.compile(r"NVRM: GPU at " + _ADDR + r":\s*(?P<uuid>GPU-[0-9A-Fa-f-]{8,64})")
_SERIAL_RE = re.compile(r"NVRM: GPU Board Serial Number:\s*(?P<serial>[0-9A-Za-z_-]{1,64})")
# A GPU that did not initialise. The summary lines only: detail lines before them (`RmInitAdapter: Cannot
# initialize GSP firmware RM`, `... bailing out of RmInitAdapter`) say why and are left to the evidence of
# the line that follows.
_INIT_RE = re.compile(
    r"RmInitAdapter failed|rm_init_adapter(?:\(\d+\))? failed|does not have the necessary power cables connected"
)
_GPU_BUS_RE = re.compile(r"NVRM: GPU (?:PCI:)?(?P<bus>(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*:")
"""`NVRM: GPU <bus>:` as the driver starts a per-GPU line; the domain is left out by some drivers
(`NVRM: GPU 18:00.0: GPU has fallen off the bus.`). Anchored on the prefix, so no time can match."""

_UNKNOWN = ("<unknown>", "'<unknown>'", "")


def is_nvrm(message: str) -> bool:
    """True for any NVIDIA driver line (the cheap pre-filter)."""
    return "NVRM" in message


def looks_like_xid(message: str) -> bool:
    """True for a line that claims to be an Xid report; one `parse_line` rejects is malformed."""
    return XID_MARKER in message


def nvlink5_subcode(intrinfo: int) -> int:
    """NVLink5 subcode: bits 20-25 of the first hex word (gpud `calculateSubCode`)."""
    return (intrinfo >> 20) & 0x3F


def parse_line(message: str) -> KernelLine | None:
    """One kernel message -> KernelLine, or None when it is not a (well-formed) NVRM line of interest."""
    try:
        if "NVRM" not in message:
            return None
        if XID_MARKER in message:
            return _parse_xid(message)
        if "fallen off the bus" in message:
            return _parse_fallen(message)
        if _INIT_RE.search(message):
            return _parse_init_failed(message)
        if "GPU at " in message:
            return _parse_identity(message)
        if "Serial Number" in message:
            m = _SERIAL_RE.search(message)
            if m is None:
                return None
            return KernelLine(kind="serial", bus_id=None, text=message, serial=m.group("serial"))
        return None
    except Exception:  # noqa: BLE001 - the contract is "never raises"; a parser bug must not stop the follower
        return None


def _on_gpu(pattern: re.Pattern[str], message: str) -> tuple[re.Match[str], str] | None:
    """The match of a line that must name its GPU, and the GPU's bus id; None when the line does
    not match or its address is not a PCI address (then it is not that line)."""
    m = pattern.search(message)
    bus_id = normalize_bus_id(m.group("bus")) if m is not None else None
    return (m, bus_id) if m is not None and bus_id is not None else None


def _parse_xid(message: str) -> KernelLine | None:
    found = _on_gpu(_XID_RE, message)
    if found is None:
        return None
    m, bus_id = found
    xid = int(m.group("xid"))
    rest = m.group("rest")
    pos = 0
    pid: int | None = None
    process: str | None = None
    pm = _PID_RE.match(rest)
    if pm is not None:
        if pm.group("pid") is not None:
            pid = int(pm.group("pid"))
        pos = pm.end()
    nm = _NAME_RE.match(rest, pos)
    if nm is not None:
        name = nm.group("name").strip()
        process = None if name in _UNKNOWN else name
        pos = nm.end()
    text = rest[pos:].strip()

    subcode = unit = severity = None
    if 144 <= xid <= 150:
        vm = _NVL5_RE.match(text)
        if vm is not None:
            unit = vm.group("unit")
            severity = "Fatal" if vm.group("sev").lower() == "fatal" else "Non-fatal"
            subcode = nvlink5_subcode(int(vm.group("word"), 16))
    elif "NVLink" in text:
        sv = _NVL_SEV_RE.search(text)
        if sv is not None:
            severity = "Fatal" if sv.group("sev").lower() == "fatal" else "Non-fatal"
    gpc = tpc = sm = None
    if "GPC" in text:
        gm = _GPC_RE.search(text)
        if gm is not None:
            gpc, tpc = int(gm.group("gpc")), int(gm.group("tpc"))
            sm = int(gm.group("sm")) if gm.group("sm") is not None else None
    return KernelLine(
        kind="xid",
        bus_id=bus_id,
        xid=xid,
        pid=pid,
        process=process,
        text=text,
        subcode=subcode,
        nvlink_unit=unit,
        nvlink_severity=severity,
        gpc=gpc,
        tpc=tpc,
        sm=sm,
    )


def _parse_fallen(message: str) -> KernelLine:
    """`NVRM: GPU 0000:05:00.0: GPU has fallen off the bus.` and the multi-line `The NVIDIA GPU ...` form.

    A fail-stop signal is never dropped: without a readable address the line still counts, bus_id None.
    """
    m = _GPU_BUS_RE.search(message) or _ANY_ADDR_RE.search(message)
    bus_id = normalize_bus_id(m.group("bus")) if m is not None else None
    return KernelLine(kind="fallen_off_bus", bus_id=bus_id, xid=79, text=message)


def _parse_init_failed(message: str) -> KernelLine:
    """A GPU the driver could not initialise: reported as Xid 143, named by its bus id when the line
    has one (`NVRM: GPU 0000:39:00.0: ...`); older drivers name only a device minor number, and the
    line still counts, bus_id None."""
    m = _GPU_BUS_RE.search(message)
    bus_id = normalize_bus_id(m.group("bus")) if m is not None else None
    return KernelLine(kind="init_failed", bus_id=bus_id, xid=INIT_FAILED_XID, text=message)


def _parse_identity(message: str) -> KernelLine | None:
    found = _on_gpu(_IDENTITY_RE, message)
    if found is None:
        return None
    m, bus_id = found
    return KernelLine(kind="gpu_identity", bus_id=bus_id, text=message, uuid=m.group("uuid"))
