"""NVMe fixtures written as the kernel and the tools write them: a /sys/class/nvme tree (attribute
files padded the way the Identify Controller strings are), and SMART / Health logs in the JSON of
nvme-cli 1.x, nvme-cli 2.x (128-bit counters as decimal strings, verbose critical_warning object) and
smartctl -j."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def controller(root: Path, name: str, *, model: str = "SAMSUNG MZQL23T8HCLS-00A07", serial: str | None = None,
               firmware: str = "GDC5602Q", state: str = "live") -> Path:
    """One /sys/class/nvme/<name> entry (a directory here; a link to the PCI device on a real node)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    serial = serial if serial is not None else f"S64HNE0T{int(name[4:]):06d}"
    (d / "model").write_text(f"{model:<40}\n")
    (d / "serial").write_text(f"{serial:<20}\n")
    (d / "firmware_rev").write_text(f"{firmware:<8}\n")
    (d / "state").write_text(f"{state}\n")
    (d / "transport").write_text("pcie\n")
    (d / "address").write_text("0000:c1:00.0\n")
    return d


def nvme_cli_2(*, critical_warning: int = 0, percent_used: int = 3, media_errors: int = 0, avail_spare: int = 100,
               verbose: bool = False) -> dict[str, Any]:
    """`nvme smart-log -o json /dev/nvmeX` of nvme-cli 2.x."""
    warning: Any = critical_warning
    if verbose:
        warning = {"value": critical_warning, "available_spare": critical_warning & 1,
                   "temp_threshold": (critical_warning & 2) >> 1, "reliability_degraded": (critical_warning & 4) >> 2,
                   "ro": (critical_warning & 8) >> 3, "vmbu_failed": (critical_warning & 0x10) >> 4,
                   "pmr_ro": (critical_warning & 0x20) >> 5}
    return {
        "critical_warning": warning, "temperature": 310, "avail_spare": avail_spare, "spare_thresh": 10,
        "percent_used": percent_used, "endurance_grp_critical_warning_summary": 0,
        "data_units_read": "1364822930", "data_units_written": "2296427474", "host_read_commands": "15387460938",
        "host_write_commands": "24411566370", "controller_busy_time": "20397", "power_cycles": "46",
        "power_on_hours": "17532", "unsafe_shutdowns": "31", "media_errors": str(media_errors),
        "num_err_log_entries": "0", "warning_temp_time": 0, "critical_comp_time": 0, "temperature_sensor_1": 310,
        "temperature_sensor_2": 318, "thm_temp1_trans_count": 0, "thm_temp2_trans_count": 0,
        "thm_temp1_total_time": 0, "thm_temp2_total_time": 0,
    }


def nvme_cli_1(*, critical_warning: int = 0, percent_used: int = 3, media_errors: int = 0) -> dict[str, Any]:
    """The same log as nvme-cli 1.x prints it: every counter a number."""
    return {
        "critical_warning": critical_warning, "temperature": 310, "avail_spare": 100, "spare_thresh": 10,
        "percent_used": percent_used, "endurance_grp_critical_warning_summary": 0, "data_units_read": 1364822930,
        "data_units_written": 2296427474, "host_read_commands": 15387460938, "host_write_commands": 24411566370,
        "controller_busy_time": 20397, "power_cycles": 46, "power_on_hours": 17532, "unsafe_shutdowns": 31,
        "media_errors": media_errors, "num_err_log_entries": 0, "warning_temp_time": 0, "critical_comp_time": 0,
        "temperature_sensor_1": 310,
    }


def smartctl(*, critical_warning: int = 0, percentage_used: int = 3, media_errors: int = 0) -> dict[str, Any]:
    """`smartctl -j -A /dev/nvmeX`: the log under nvme_smart_health_information_log."""
    return {
        "json_format_version": [1, 0],
        "smartctl": {"version": [7, 3], "exit_status": 0},
        "device": {"name": "/dev/nvme0", "type": "nvme", "protocol": "NVMe"},
        "nvme_smart_health_information_log": {
            "critical_warning": critical_warning, "temperature": 37, "available_spare": 100,
            "available_spare_threshold": 10, "percentage_used": percentage_used, "data_units_read": 1364822930,
            "data_units_written": 2296427474, "power_cycles": 46, "power_on_hours": 17532, "unsafe_shutdowns": 31,
            "media_errors": media_errors, "num_err_log_info_entries": 0,
        },
    }


def smart_file(directory: Path, name: str, doc: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / f"{name}.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
    return p
