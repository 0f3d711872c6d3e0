"""A driver older than the NVML functions healthd calls: the C stand-in built without them (pynvml
then raises NVMLError_FunctionNotFound on its real ctypes path, exactly as with an old
libnvidia-ml.so.1), and the real `healthd` executable on top.

What an older driver lacks, as far as NVIDIA's own NVML references show it: the R525 reference has
only the nvmlClocksThrottleReasons names (nvmlDeviceGetCurrentClocksEventReasons is in R550's);
nvmlFieldValue_t is in R384's reference with an `unused` member where R470's has `scopeId` (the
per-link NVLink state field needs it). OLD_DRIVER leaves out those and the other functions healthd
reads that are younger than the Ampere generation's first drivers."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd.agent.collectors.nvml import REQUIRED_FUNCTIONS, gpu_identity
from healthd.model import GpuSample
from healthd.report_schema import validate_report
from tests.agent.collectors.nvml.conftest import run_collector_subprocess
from tests.support.agent_node import HEALTHD, Node
from tests.support.fake_nvml import build_fake_nvml, fake_nvml_env, healthy_node, write_nvml_config
from tests.support.polling import read_text, wait_for

OLD_DRIVER = (
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetMarginTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetNvLinkState",
)
OLD_DRIVER_LACKS = {
    "nvmlDeviceGetMarginTemperature": ["margin_c"],
    "nvmlDeviceGetNvLinkState": ["nvlink_errors"],
    "nvmlDeviceGetRemappedRows": ["remap_corrected", "remap_failure", "remap_pending", "remap_uncorrected"],
}
"""What that driver cannot give: the clock reasons and the process list come through the older
symbols, the counters the field call would batch through their own functions."""

LACKS_LINE = "its NVML lacks"


def exported(lib_dir: Path) -> set[str]:
    """The NVML symbols a built stand-in exports."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("reading the stand-in's symbols needs nm (binutils, installed with gcc)")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib_dir / "libnvidia-ml.so.1")],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("nvml")}


@pytest.fixture(scope="module")
def all_functions(fake_nvml_dir: Path) -> tuple[str, ...]:
    return tuple(sorted(exported(fake_nvml_dir)))


@pytest.fixture(scope="module")
def old_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("old-nvml"), omit=OLD_DRIVER)


@pytest.fixture
def old_node(tmp_path: Path, old_driver: Path):
    n = Node(tmp_path, old_driver)
    yield n
    n.close()


def test_the_build_really_lacks_what_it_leaves_out(fake_nvml_dir: Path, old_driver: Path, all_functions):
    assert set(OLD_DRIVER) | set(REQUIRED_FUNCTIONS) <= set(all_functions)
    assert exported(old_driver) == set(all_functions) - set(OLD_DRIVER)


def test_a_node_on_an_old_driver_is_healthy_and_says_once_what_it_cannot_read(old_node: Node):
    rc, doc, err = old_node.dry_run()
    assert rc == 0, err
    validate_report(doc)
    assert (doc["verdict"], doc["findings"], doc["would_do"]) == ("healthy", [], [])
    nvml = doc["sources"]["nvml"]
    assert (nvml["status"], nvml["detail"]) == ("ok", "")
    assert nvml["driver_lacks"] == OLD_DRIVER_LACKS
    for gpu in doc["gpus"]:
        assert gpu["state"] == "ok" and gpu["remap_pending"] is None and gpu["margin_c"] is None
        assert {r for readings in OLD_DRIVER_LACKS.values() for r in readings} <= set(gpu["no_data"])
    said = [line for line in err.splitlines() if LACKS_LINE in line]
    assert said == [
        "healthd: WARNING NVIDIA driver 550.54.15: its NVML lacks nvmlDeviceGetMarginTemperature (no margin_c); "
        "nvmlDeviceGetNvLinkState (no nvlink_errors); nvmlDeviceGetRemappedRows (no remap_corrected, "
        "remap_failure, remap_pending, remap_uncorrected); not a fault of the node, these readings are not "
        "taken until a driver that has the functions is loaded"
    ]

    text = subprocess.run([HEALTHD, "--dry-run", "--once", "--config", str(old_node.config)], capture_output=True,
                          text=True, env=old_node.env(), timeout=60)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    head = lines.index("Not read: this NVIDIA driver's NVML lacks the function (no fault of the node, "
                       "and no sign of health)")
    assert lines[head + 1:head + 5] == [
        "  nvmlDeviceGetMarginTemperature: margin_c",
        "  nvmlDeviceGetNvLinkState: nvlink_errors",
        "  nvmlDeviceGetRemappedRows: remap_corrected, remap_failure, remap_pending, remap_uncorrected",
        "",
    ]
    assert lines[0].startswith("healthd on node01: HEALTHY")


def test_a_current_driver_shows_no_such_section(tmp_path: Path, fake_nvml_dir: Path):
    node = Node(tmp_path, fake_nvml_dir)
    try:
        rc, doc, err = node.dry_run()
        assert rc == 0 and "driver_lacks" not in doc["sources"]["nvml"] and LACKS_LINE not in err
        text = subprocess.run([HEALTHD, "--dry-run", "--once", "--config", str(node.config)], capture_output=True,
                              text=True, env=node.env(), timeout=60).stdout
        assert "Not read:" not in text
    finally:
        node.close()


def test_a_fault_only_the_missing_function_shows_is_said_absent_not_healthy(tmp_path: Path, fake_nvml_dir: Path,
                                                                          old_driver: Path):
    """The same pending and failed row remap on GPU 2: the current library finds it; the old one
    cannot see it, and says the reading is absent, never that the rows are fine."""
    docs = {}
    for name, lib in (("current", fake_nvml_dir), ("old", old_driver)):
        (tmp_path / name).mkdir()
        node = Node(tmp_path / name, lib)
        node.gpus[2].update({"remapped_rows.pending": 1, "remapped_rows.failure": 1, "remapped_rows.uncorrected": 3})
        write_nvml_config(node.nvml_values, node.gpus)
        try:
            rc, docs[name], err = node.dry_run()
        finally:
            node.close()
    current, old = docs["current"], docs["old"]
    assert {f["id"].split(":")[0] for f in current["findings"]} == {"nvml.remap_pending", "nvml.remap_failure"}
    assert current["gpus"][2]["remap_pending"] is True
    assert old["findings"] == [] and old["verdict"] == "healthy"
    assert old["gpus"][2]["remap_pending"] is None and "remap_pending" in old["gpus"][2]["no_data"]
    assert "remap_pending" in old["sources"]["nvml"]["driver_lacks"]["nvmlDeviceGetRemappedRows"]


def test_the_daemon_says_it_once_over_many_ticks_and_publishes_it(old_node: Node):
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(old_node.config)], env=old_node.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen: list[str] = []

        def five_ticks(state: dict) -> bool:
            if not seen or state["generated_at"] != seen[-1]:
                seen.append(state["generated_at"])
            return len(seen) >= 5 or proc.poll() is not None

        state = wait_for(old_node.state, five_ticks, timeout=60)
        assert proc.poll() is None and len(seen) >= 5
        assert state["verdict"] == "healthy" and state["sources"]["nvml"]["driver_lacks"] == OLD_DRIVER_LACKS
        prom = wait_for(lambda: read_text(old_node.root / "healthd.prom"),
                        lambda t: "healthd_nvml_reading_unavailable" in t)
        assert ('healthd_nvml_reading_unavailable{function="nvmlDeviceGetRemappedRows",reading="remap_pending"} 1.0'
                in prom)
        assert prom.count("healthd_nvml_reading_unavailable{") == 6
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert sum(LACKS_LINE in line for line in err.splitlines()) == 1, err


# --------------------------------------------------------------------------- any subset


# GpuSample fields that are readings (not bookkeeping): None in a sample means "no data".
_READINGS = tuple(f.name for f in dataclasses.fields(GpuSample)
                  if f.name not in ("index", "lost", "lost_detail", "nvlink_errors", "counters", "no_data", "errors"))


def _absent(full: dict, old: dict) -> set[str]:
    """The readings the full library gives and the old one leaves without data, on one GPU."""
    gone = {f for f in _READINGS if old[f] is None and full[f] is not None}
    if full["nvlink_errors"] and "nvlink_errors" in old["no_data"]:
        gone.add("nvlink_errors")  # no link state at all, so no counter was asked for
    else:
        counters = {k.split(".")[1] for k in full["nvlink_errors"]} - {k.split(".")[1] for k in old["nvlink_errors"]}
        gone |= {f"nvlink_errors.{name}" for name in counters}
    return gone


@pytest.fixture(scope="module")
def full_sample(fake_nvml_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    config = write_nvml_config(tmp_path_factory.mktemp("full") / "nvml.conf", _gpus())
    return run_collector_subprocess(fake_nvml_env(fake_nvml_dir, config))


def _gpus() -> list[dict]:
    gpus = healthy_node(2)
    gpus[1]["processes"] = "4242:1048576"
    return gpus


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_functions_missing_never_a_finding_never_a_crash_and_the_core_is_a_clear_error(
        data, tmp_path_factory: pytest.TempPathFactory, all_functions, full_sample):
    """Any subset of the functions the stand-in exports left out: without one of the required core
    the collection is an error that names it (a finding, never a healthy node); otherwise the node is
    healthy, and the readings said to be lacking are exactly those the full library gives and this
    one does not, each named in the GPU's no_data."""
    omit = data.draw(st.sets(st.sampled_from(all_functions)), label="omit")
    root = tmp_path_factory.mktemp("subset")
    lib = build_fake_nvml(root / "lib", omit=sorted(omit))
    config = write_nvml_config(root / "nvml.conf", _gpus())
    sample = run_collector_subprocess(fake_nvml_env(lib, config))
    (root / "node").mkdir()
    node = Node(root / "node", lib)
    node.gpus = _gpus()
    write_nvml_config(node.nvml_values, node.gpus)
    node.write_config(nvml={"expected_gpus": 2})
    try:
        rc, doc, err = node.dry_run()
    finally:
        node.close()
    assert "Traceback" not in err, err
    validate_report(doc)
    core = [f for f in REQUIRED_FUNCTIONS if f in omit]
    assert rc == (1 if core else 0), err  # --once exits with the verdict's Nagios code: degraded is 1
    if core:
        assert (sample["status"], sample["error_kind"]) == ("error", "driver_too_old")
        assert f"lacks {core[0]}," in sample["detail"]
        assert doc["verdict"] != "healthy"
        assert [f["id"] for f in doc["findings"]] == ["collector.nvml:node"]
        assert core[0] in doc["findings"][0]["summary"]
        return
    assert sample["status"] == "ok" and sample["error_kind"] is None
    assert (doc["verdict"], doc["findings"]) == ("healthy", []), doc["findings"]
    lacks = sample["driver_lacks"]
    assert set(lacks) <= omit
    said = {r for readings in lacks.values() for r in readings}
    for full, old in zip(full_sample["gpus"], sample["gpus"], strict=True):
        assert old["errors"] == {}
        assert _absent(full, old) == said
        assert said <= set(old["no_data"])
    assert doc["sources"]["nvml"].get("driver_lacks", {}) == {fn: list(r) for fn, r in lacks.items()}
    assert sum(LACKS_LINE in line for line in err.splitlines()) == (1 if lacks else 0)


def test_the_slurm_hooks_pass_a_node_on_an_old_driver(tmp_path: Path, old_driver: Path):
    """The agent on the old driver publishes its state where the hooks read it: the health check
    judges the agent alive, and the prolog with gating `local` runs a GPU job and asks Slurm nothing."""
    from tests.hooks.support import Node as HookNode

    hooks = HookNode(tmp_path / "hooks")
    hooks.write_config(gating="local")
    (tmp_path / "agent").mkdir()
    agent = Node(tmp_path / "agent", old_driver)
    agent.state_file = hooks.state_file
    agent.write_config(state_file=str(hooks.state_file), nvml={"expected_gpus": 8})
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(agent.config)], env=agent.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        state = wait_for(agent.state, lambda d: proc.poll() is not None or "driver_lacks" in d["sources"]["nvml"])
        assert proc.poll() is None and state["verdict"] == "healthy"
        rc, err, _ = hooks.run("healthd-healthcheck", {"SLURMD_NODENAME": hooks.name})
        assert rc == 0, err
        checks = json.loads((hooks.run_dir / "checks.json").read_text())
        assert checks["agent"]["known"] is True, checks["agent"]
        assert "verdict healthy, 0 finding(s)" in checks["agent"]["reason"]
        rc, err, _ = hooks.run("healthd-prolog", hooks.prolog_env(job="7", gpus="0,1"))
        assert rc == 0, err
        assert "refuse" not in err and hooks.writes() == []
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        agent.close()
    assert proc.returncode == 0, err


def test_a_gpu_without_its_uuid_and_bus_id_is_known_by_its_index():
    """A driver without nvmlDeviceGetUUID and nvmlDeviceGetPciInfo_v3 leaves both unread (None): the
    baseline's key is then the index (found by the property above, once, as a crash)."""
    assert gpu_identity(GpuSample(index=3, uuid=None, bus_id=None)) == "index3"
    assert gpu_identity(GpuSample(index=3, uuid=None, bus_id="0000:3b:00.0")) == "00000000:3B:00.0"
