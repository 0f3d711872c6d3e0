"""healthd.agent.collectors.kernel_parse: every NVRM line variant the driver prints, with exact fields; no input crashes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.agent.collectors.kernel_parse import is_nvrm, looks_like_xid, nvlink5_subcode, parse_line
from healthd.model import KernelLine, normalize_bus_id

UUID = "GPU-509665ad-1c2d-3e4f-5a6b-7c8d9e0f1a2b"


def whole_line(message: str, kind: str, bus_id: str | None, **fields: Any) -> tuple[str, KernelLine]:
    """A case for a line that is not an Xid: its KernelLine's text is the whole message."""
    return message, KernelLine(kind=kind, bus_id=bus_id, text=message, **fields)  # type: ignore[arg-type]


# message -> the exact KernelLine expected (fields not named are the dataclass defaults)
CASES: list[tuple[str, KernelLine]] = [
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        KernelLine(kind="xid", bus_id="00000000:3B:00.0", xid=79, pid=1234, process="python",
                   text="GPU has fallen off the bus."),
    ),
    (
        "NVRM: Xid (0000:03:00): 14, Channel 00000001",
        KernelLine(kind="xid", bus_id="00000000:03:00.0", xid=14, text="Channel 00000001"),
    ),
    (
        "NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        KernelLine(kind="xid", bus_id="00000000:05:00.0", xid=79, text="GPU has fallen off the bus."),
    ),
    (
        "NVRM: Xid (PCI:0000:b9:00): 71, pid=<unknown>, name=<unknown>, NVLink: fatal error detected on link 6(0x0)",
        KernelLine(kind="xid", bus_id="00000000:B9:00.0", xid=71, text="NVLink: fatal error detected on link 6(0x0)",
                   nvlink_severity="Fatal"),
    ),
    (
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        KernelLine(kind="xid", bus_id="00000000:01:00.0", xid=79, text="GPU has fallen off the bus."),
    ),
    (
        "NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of waiting for RPC "
        "response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).",
        KernelLine(kind="xid", bus_id="00000000:9B:00.0", xid=119, pid=2024380, process="nvidia-smi",
                   text="Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 "
                   "(GSP_RM_ALLOC) (0x2081 0x4)."),
    ),
    (
        # Xid 63 prints a pid but no name.
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
        KernelLine(kind="xid", bus_id="00000000:10:1C.0", xid=63, pid=1896,
                   text="Row Remapper: New row marked for remapping, reset gpu to activate."),
    ),
    (
        "NVRM: Xid (PCI:0000:b5:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
        "(GPC 1, TPC 3, SM 0): Out Of Range Address",
        KernelLine(kind="xid", bus_id="00000000:B5:00.0", xid=13,
                   text="Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): Out Of Range Address",
                   gpc=1, tpc=3, sm=0),
    ),
    (
        "NVRM: Xid (PCI:0002:00:00): 13, pid=2519562, name=python3, Graphics Exception: ChID 000c, Class 0000c7c0",
        KernelLine(kind="xid", bus_id="00000002:00:00.0", xid=13, pid=2519562, process="python3",
                   text="Graphics Exception: ChID 000c, Class 0000c7c0"),
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
        "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        KernelLine(kind="xid", bus_id="00000018:01:00.0", xid=149,
                   text="NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 0x00000000 0x00000000 "
                   "0x00000000 0x00000000)",
                   subcode=4, nvlink_unit="NETIR_LINK_EVT", nvlink_severity="Fatal"),
    ),
    (
        # gpud's test vectors: 0x025001c6 -> 37, 0x026001c6 -> 38; Nonfatal spelled as the driver does.
        "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Nonfatal XC0 i0 Link 00 (0x025001c6 0x00000000)",
        KernelLine(kind="xid", bus_id="00000000:00:00.0", xid=149,
                   text="NETIR_LINK_EVT Nonfatal XC0 i0 Link 00 (0x025001c6 0x00000000)",
                   subcode=37, nvlink_unit="NETIR_LINK_EVT", nvlink_severity="Non-fatal"),
    ),
    (
        "NVRM: Xid (PCI:0008:01:00): 145, pid=77, name=nccl, RLW_SRC_TRACK Non-fatal XC1 i0 Link -1 (0x026001c6 0x00000010)",
        KernelLine(kind="xid", bus_id="00000008:01:00.0", xid=145, pid=77, process="nccl",
                   text="RLW_SRC_TRACK Non-fatal XC1 i0 Link -1 (0x026001c6 0x00000010)",
                   subcode=38, nvlink_unit="RLW_SRC_TRACK", nvlink_severity="Non-fatal"),
    ),
    (
        # An NVLink5 Xid whose detail is not in the unit/severity form: still an Xid, no subcode.
        "NVRM: Xid (PCI:0008:01:00): 144, something new",
        KernelLine(kind="xid", bus_id="00000008:01:00.0", xid=144, text="something new"),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
        KernelLine(kind="xid", bus_id="00000000:3B:00.0", xid=154,
                   text="GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 95, pid=1234, name=pt_main_thread, Uncontained: FBHUB. RST: Yes, D-RST: No",
        KernelLine(kind="xid", bus_id="00000000:3B:00.0", xid=95, pid=1234, process="pt_main_thread",
                   text="Uncontained: FBHUB. RST: Yes, D-RST: No"),
    ),
    whole_line("NVRM: GPU 0000:05:00.0: GPU has fallen off the bus.", "fallen_off_bus", "00000000:05:00.0", xid=79),
    whole_line("NVRM: The NVIDIA GPU 0000:18:00.0\nNVRM: (PCI ID: 10de:2330) installed in this system has\n"
               "NVRM: fallen off the bus and is not responding to commands.",
               "fallen_off_bus", "00000000:18:00.0", xid=79),
    # Some drivers leave out the PCI domain (gpud's normalisation test).
    whole_line("NVRM: GPU 18:00.0: GPU has fallen off the bus.", "fallen_off_bus", "00000000:18:00.0", xid=79),
    # A fail-stop line whose address cannot be read still counts, on an unknown GPU.
    whole_line("NVRM: fallen off the bus and is not responding to commands.", "fallen_off_bus", None, xid=79),
    whole_line(f"NVRM: GPU at PCI:0000:9b:00: {UUID}", "gpu_identity", "00000000:9B:00.0", uuid=UUID),
    whole_line("NVRM: GPU Board Serial Number: 1652823054928", "serial", None, serial="1652823054928"),
    (
        # A dmesg-style prefix before NVRM is tolerated.
        "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error (DBE) has been detected",
        KernelLine(kind="xid", bus_id="00000000:3B:00.0", xid=48,
                   text="An uncorrectable double bit error (DBE) has been detected"),
    ),
    (
        # NVLink 1-4: the severity is in the text ("fatal error detected on link N").
        "NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link "
        "14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        KernelLine(kind="xid", bus_id="00000003:00:00.0", xid=74,
                   text="NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
                   nvlink_severity="Fatal"),
    ),
    (
        "NVRM: Xid (PCI:0000:07:00): 74, NVLink: nonfatal error detected on link 2(0x0, 0x0, 0x0)",
        KernelLine(kind="xid", bus_id="00000000:07:00.0", xid=74,
                   text="NVLink: nonfatal error detected on link 2(0x0, 0x0, 0x0)", nvlink_severity="Non-fatal"),
    ),
    # A GPU that failed to initialise: no Xid number, read as 143 on the bus the line names.
    whole_line("NVRM: GPU 0000:39:00.0: RmInitAdapter failed! (0x62:0x40:2393)", "init_failed", "00000000:39:00.0",
               xid=143),
    whole_line("NVRM: GPU 0000:0a:00.0: rm_init_adapter failed, device minor number 5", "init_failed",
               "00000000:0A:00.0", xid=143),
    whole_line("NVRM: GPU 0000:3b:00.0: GPU does not have the necessary power cables connected.", "init_failed",
               "00000000:3B:00.0", xid=143),
    # Older drivers name no bus: still a failed GPU, on an unknown bus.
    whole_line("NVRM: RmInitAdapter failed! (0x27:0x38:1193)", "init_failed", None, xid=143),
    whole_line("NVRM: rm_init_adapter failed for device bearing minor number 0", "init_failed", None, xid=143),
    whole_line("NVRM: rm_init_adapter(0) failed", "init_failed", None, xid=143),
]


@pytest.mark.parametrize("message,expected", CASES, ids=[c[1].kind + str(c[1].xid) + f"-{i}" for i, c in enumerate(CASES)])
def test_variant_parses_exactly(message: str, expected: KernelLine) -> None:
    assert parse_line(message) == expected


# lines parse_line reads as no KernelLine: not the driver's Xid lines, or Xid lines too broken to read
NOT_OURS = [
    "",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",  # no NVRM: not the driver
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.08",
    "NVRM: GPU4 GSP RPC buffer contains function 103 (GSP_RM_ALLOC) and data 0x2081 0x4.",
    "NVRM: GPU Board Serial Number: ",
    # why an init failed: the summary line that follows is the one counted
    "NVRM: RmInitAdapter: Cannot initialize GSP firmware RM",
    "NVRM: RmInitAdapter: osInitNvMapping failed, bailing out of RmInitAdapter",
]
MALFORMED = [
    "NVRM: Xid (PCI:zz): abc",
    "NVRM: Xid (PCI:0000:3b:00): abc, text",
    "NVRM: Xid (PCI:0000:3g:00): 79, text",
    "NVRM: Xid (PCI:0000:3b:20): 79, device 0x20 is not a PCI device number",
    "NVRM: Xid (PCI:0000:3b:00): 1234567, too many digits",
    "NVRM: Xid (",
    "NVRM: Xid",
]


@pytest.mark.parametrize(("message", "malformed"), [*((m, False) for m in NOT_OURS), *((m, True) for m in MALFORMED)])
def test_unparsed_lines_are_none_and_only_broken_xid_lines_are_flagged(message: str, malformed: bool) -> None:
    assert parse_line(message) is None
    assert looks_like_xid(message) is malformed
    assert is_nvrm(message) or not malformed


def test_nvlink5_subcode_is_bits_20_to_25() -> None:
    assert nvlink5_subcode(0x004505C6) == 4
    assert nvlink5_subcode(0x025001C6) == 37
    assert nvlink5_subcode(0x000FE406) == 0
    assert nvlink5_subcode(0xFFFFFFFF) == 63


# --------------------------------------------------------------------------- properties


@settings(max_examples=2000, deadline=None)
@given(st.text())
def test_no_text_crashes_parse_line(message: str) -> None:
    line = parse_line(message)
    assert line is None or isinstance(line, KernelLine)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(["NVRM: Xid (", "NVRM: Xid (PCI:", "NVRM: GPU ", "NVRM: GPU at PCI:", "NVRM: GPU Board Serial Number: "]),
    st.text(alphabet="0123456789abcdefABCDEF:.,()= '<>-xPCI", max_size=60),
)
def test_no_near_miss_crashes_parse_line(prefix: str, tail: str) -> None:
    line = parse_line(prefix + tail)
    assert line is None or isinstance(line, KernelLine)


_NAME = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=",'<>"), min_size=1,
                max_size=15)
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=80).filter(
    lambda t: not t.lstrip().startswith(("pid=", "name="))
)


@settings(max_examples=1000, deadline=None)
@given(
    domain=st.integers(0, 0xFFFF),
    bus=st.integers(0, 0xFF),
    dev=st.integers(0, 0x1F),
    pci_prefix=st.booleans(),
    upper=st.booleans(),
    xid=st.integers(0, 99999),
    pid=st.one_of(st.none(), st.integers(0, 2**22)),
    name=st.one_of(st.none(), _NAME),
    text=_TEXT,
)
def test_generated_xid_line_round_trips(domain, bus, dev, pci_prefix, upper, xid, pid, name, text) -> None:
    addr = f"{domain:04x}:{bus:02x}:{dev:02x}"
    if upper:
        addr = addr.upper()
    parts = [f"{xid}"]
    if pid is not None:
        parts.append(f"pid={pid}")
    if name is not None:
        parts.append(f"name={name}")
    parts.append(text)
    message = f"NVRM: Xid ({'PCI:' if pci_prefix else ''}{addr}): " + ", ".join(parts)
    line = parse_line(message)
    assert line is not None, message
    assert line.kind == "xid"
    assert line.xid == xid
    assert line.bus_id == normalize_bus_id(f"{domain:x}:{bus:x}:{dev:x}") == f"{domain:08X}:{bus:02X}:{dev:02X}.0"
    assert line.pid == pid
    assert line.process == name


_PREFIXES = st.sampled_from([
    "",
    "[  885.242168] ",
    "[111111111.111] ",
    "[Fri Aug 30 11:43:09 2024] ",
    "Dec  2 11:49:53 worker4 kernel: [  885.242168] ",
    "kernel: ",
    "2026-09-08T01:00:00+0000 n1 kernel: ",
])


@settings(max_examples=300, deadline=None)
@given(prefix=_PREFIXES, case=st.sampled_from(CASES))
def test_a_dmesg_or_syslog_prefix_changes_nothing_but_the_text(prefix: str, case: tuple[str, KernelLine]) -> None:
    message, expected = case
    line = parse_line(prefix + message)
    assert line is not None
    assert (line.kind, line.xid, line.bus_id, line.pid, line.process, line.nvlink_severity, line.subcode) == (
        expected.kind, expected.xid, expected.bus_id, expected.pid, expected.process, expected.nvlink_severity,
        expected.subcode)


@settings(max_examples=500, deadline=None)
@given(
    prefix=_PREFIXES,
    domain=st.integers(0, 0xFFFF),
    bus=st.integers(0, 0xFF),
    dev=st.integers(0, 0x1F),
    fn=st.integers(0, 7),
    form=st.sampled_from([
        "RmInitAdapter failed! (0x{a:x}:0x{b:x}:{c})",
        "rm_init_adapter failed, device minor number {c}",
        "GPU does not have the necessary power cables connected.",
    ]),
    a=st.integers(0, 0xFF),
    b=st.integers(0, 0xFFFF),
    c=st.integers(0, 9999),
)
def test_generated_init_failure_names_its_bus(prefix, domain, bus, dev, fn, form, a, b, c) -> None:
    message = f"{prefix}NVRM: GPU {domain:04x}:{bus:02x}:{dev:02x}.{fn}: " + form.format(a=a, b=b, c=c)
    line = parse_line(message)
    assert line is not None and line.kind == "init_failed" and line.xid == 143, message
    assert line.bus_id == f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"
    assert not looks_like_xid(message)


@settings(max_examples=500, deadline=None)
@given(
    xid=st.sampled_from([71, 74]),
    word=st.sampled_from(["fatal", "Fatal", "nonfatal", "non-fatal", "Non-fatal"]),
    link=st.integers(0, 17),
    regs=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=7),
)
def test_generated_nvlink_severity_is_read_from_the_text(xid, word, link, regs) -> None:
    message = (f"NVRM: Xid (PCI:0000:07:00): {xid}, pid='<unknown>', name=<unknown>, NVLink: {word} error detected "
               f"on link {link}({', '.join(hex(r) for r in regs)})")
    line = parse_line(message)
    assert line is not None and line.xid == xid
    assert line.nvlink_severity == ("Fatal" if word.lower() == "fatal" else "Non-fatal")
