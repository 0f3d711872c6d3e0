"""The config loader: every key documented, every error names file, key, expected and found."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings as hsettings, strategies as st

from healthd import config
from healthd.config import ConfigError
from healthd.settings import FilesystemSpec, Settings, XidOverride

FULL = """
node_name: gpu-node-01
state_file: /run/healthd/state.json
state_dir: /var/lib/healthd
interval_s: 10
log_level: info
nvml: {enabled: true, expected_gpus: 8, call_timeout_s: 5, margin_warn_c: 5}
kernel_log: {enabled: true, journal_dir: null, kmsg_path: /dev/kmsg, start_at: boot}
infiniband:
  sysfs_root: /sys/class/infiniband
  expected_ports: 8
  expected_rate_gbps: 400
  thresholds: {symbol_error_per_hour: 120}
host:
  filesystems:
    - {path: /checkpoint, role: checkpoint, timeout_s: 5, max_latency_s: 1}
    - {path: /datasets, role: dataset}
nvme:
  enabled: true
  sysfs_root: /sys/class/nvme
  smart_log_command: [nvme, smart-log, -o, json]
  command_timeout_s: 5
  wear_warn_pct: 85
  media_errors_window_s: 86400
catalog:
  overrides:
    94: {tier: 2, action: reset-gpu-when-idle}
    13: {ignore: true}
classify: {xid_repeat_count: 3}
metrics: {textfile: /var/lib/node_exporter/textfile/healthd.prom, listen: "127.0.0.1:9840"}
"""


def test_full_config_maps_onto_settings():
    s = config.parse(FULL, "healthd.yaml")
    assert s.node_name == "gpu-node-01"
    assert s.nvml.expected_gpus == 8
    assert s.kernel_log.journal_dir is None
    assert s.infiniband.expected_rate_gbps == 400.0
    assert s.infiniband.thresholds.symbol_error_per_hour == 120.0
    assert s.infiniband.thresholds.port_rcv_errors_per_s == 10.0  # untouched default
    assert s.host.filesystems == (
        FilesystemSpec("/checkpoint", "checkpoint", 5.0, 1.0),
        FilesystemSpec("/datasets", "dataset"),
    )
    assert s.catalog.overrides == {94: XidOverride(tier=2, action="reset-gpu-when-idle"), 13: XidOverride(ignore=True)}
    assert s.metrics.listen == "127.0.0.1:9840"
    assert s.nvme.enabled and s.nvme.smart_log_command == ("nvme", "smart-log", "-o", "json")
    assert (s.nvme.smart_log_dir, s.nvme.wear_warn_pct, s.nvme.smart_log_max_age_s) == (None, 85, 3600.0)


def test_empty_file_gives_defaults_with_hostname():
    s = config.parse("", "empty.yaml")
    assert isinstance(s, Settings) and s.node_name == config.default_node_name()
    assert s.state_file == "/run/healthd/state.json" and s.interval_s == 10.0
    # a source added since reads nothing until a site turns it on
    assert not s.nvme.enabled and s.nvme.smart_log_dir is None and s.nvme.smart_log_command == ()


def test_absent_default_file_is_defaults_but_named_file_must_exist(tmp_path):
    assert config.load(None, required=False).interval_s == 10.0
    with pytest.raises(ConfigError, match=r"missing\.yaml: \(top level\): expected a readable YAML file"):
        config.load(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("nvml: {expected_gpus: eight}", "f.yaml: nvml.expected_gpus: expected an integer, found 'eight'"),
        ("nvml: {expected_gpus: true}", "f.yaml: nvml.expected_gpus: expected an integer, found True"),
        ("nodename: x", "f.yaml: nodename: expected one of the known keys"),
        ("infiniband: {sysfs: /x}", "f.yaml: infiniband.sysfs: expected one of the known keys"),
        ("interval_s: 0", "f.yaml: interval_s: expected a number greater than 0, found 0.0"),
        ("log_level: loud", "f.yaml: log_level: expected one of debug, info, warning, error, found 'loud'"),
        ("state_file: relative.json", "f.yaml: state_file: expected an absolute path"),
        ("kernel_log: {start_at: yesterday}", "f.yaml: kernel_log.start_at: expected one of boot, tail, head"),
        ("host: {filesystems: [{role: x}]}", r"f.yaml: host.filesystems\[0\].path: expected a value, found <missing>"),
        ("host: {filesystems: [{path: ckpt}]}", r"f.yaml: host.filesystems\[0\].path: expected an absolute path"),
        ("catalog: {overrides: {94: {tier: 7}}}", "f.yaml: catalog.overrides.94.tier: expected 1, 2 or 3, found 7"),
        ("catalog: {overrides: {94: {action: explode}}}", "f.yaml: catalog.overrides.94.action: expected one of none"),
        ("catalog: {overrides: {xid94: {tier: 2}}}", "f.yaml: catalog.overrides.xid94: expected an integer"),
        ("metrics: {listen: '0.0.0.0'}", "f.yaml: metrics.listen: expected HOST:PORT"),
        ("node_name: 'gpu 01'", "f.yaml: node_name: expected a Slurm node name without spaces"),
        ("[1, 2]", r"f.yaml: \(top level\): expected a mapping of keys"),
        ("a: [", r"f.yaml: \(top level\): expected valid YAML, found <a syntax error at line [12]"),
        ("nvme: {sysfs_root: sys/class/nvme}", "f.yaml: nvme.sysfs_root: expected an absolute path, found 'sys/class/nvme'"),
        ("nvme: {smart_log_dir: smart}", "f.yaml: nvme.smart_log_dir: expected an absolute path, or null, found 'smart'"),
        ("nvme: {smart_log_command: nvme smart-log}", "f.yaml: nvme.smart_log_command: expected a list, found 'nvme smart-log'"),
        ("nvme: {smart_log_command: [nvme, '']}", "f.yaml: nvme.smart_log_command: expected a list of non-empty arguments"),
        ("nvme: {smart_log_command: [nvme], smart_log_dir: /run/smart}", "nvme.smart_log_command: .*and smart_log_dir null"),
        ("nvme: {command_timeout_s: 0}", "f.yaml: nvme.command_timeout_s: expected a finite number greater than 0, found 0.0"),
        ("nvme: {media_errors_window_s: .inf}", "f.yaml: nvme.media_errors_window_s: expected a finite number greater than 0"),
        ("nvme: {wear_warn_pct: 0}", "f.yaml: nvme.wear_warn_pct: expected a percentage from 1 to 255, found 0"),
        ("nvme: {wear_warn_pct: 90.5}", "f.yaml: nvme.wear_warn_pct: expected an integer, found 90.5"),
    ],
)
def test_errors_name_file_key_expected_found(text, message):
    with pytest.raises(ConfigError, match=message):
        config.parse(text, "f.yaml")


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12) | st.integers(), inner, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(["node_name", "interval_s", "nvml", "kernel_log", "infiniband", "host", "nvme", "catalog",
                        "classify", "metrics", "state_file", "bogus"])


@hsettings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, yaml_values, max_size=5))
def test_no_structured_input_crashes_the_loader(doc):
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        config.parse(text, "h.yaml")
    except ConfigError as e:
        assert str(e).startswith("h.yaml: ")


@hsettings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_no_text_crashes_the_loader(text):
    try:
        config.parse(text, "h.yaml")
    except ConfigError as e:
        assert str(e).startswith("h.yaml: ")


nvme_keys = st.sampled_from(["enabled", "sysfs_root", "smart_log_dir", "smart_log_max_age_s", "smart_log_command",
                             "command_timeout_s", "wear_warn_pct", "media_errors_window_s"])


@hsettings(max_examples=300, deadline=None)
@given(st.dictionaries(nvme_keys, yaml_values, max_size=4))
def test_no_nvme_section_crashes_the_loader(section):
    """A section that checks its own values (`problems()`) refuses what it cannot use with a ConfigError too."""
    try:
        s = config.parse(yaml.safe_dump({"nvme": section}), "h.yaml")
    except ConfigError as e:
        assert str(e).startswith("h.yaml: nvme")
    else:
        assert s.nvme.problems() == []
