"""The committed sysfs trees under tests/fixtures/ib, read as the collector reads /sys/class/infiniband.

They are written by tests/support/ib_tree.py (`python -m tests.support.ib_tree DIR SCENARIO`); the
last test proves the builder still writes exactly these files, so the two cannot drift apart.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from healthd.agent.collectors.infiniband import InfinibandCollector
from tests.support import ib_tree

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "ib"
BOOT = "0b7f8a4e-9c1d-4f2a-8e3b-5d6c7a8b9c0d"


@pytest.fixture
def boot(tmp_path: Path) -> Path:
    p = tmp_path / "boot_id"
    p.write_text(BOOT + "\n")
    return p


def read(scenario: str, boot: Path):
    c = InfinibandCollector(sysfs_root=str(FIXTURES / scenario), boot_id_path=str(boot))
    first = c.collect(1000.0)
    second = c.collect(1010.0)
    return first, second


def test_healthy_8_port_ndr_node(boot):
    first, second = read("healthy", boot)
    assert first.status == "ok" and len(first.ports) == 8
    assert {(p.device, p.port) for p in first.ports} == {(f"mlx5_{i}", 1) for i in range(8)}
    for p in second.ports:
        assert (p.state, p.phys_state, p.rate_gbps, p.link_layer, p.up) == ("ACTIVE", "LinkUp", 400.0, "InfiniBand", True)
        assert p.unreadable == {}
        errors = {k: d for k, d in p.counters.items() if "error" in k or k.endswith("link_downed")}
        assert errors and all(d.delta == 0 and d.window_s == 10.0 and not d.saturated for d in errors.values())


def test_port_down(boot):
    _, s = read("port_down", boot)
    down = [p for p in s.ports if not p.up]
    assert [(p.device, p.state, p.phys_state) for p in down] == [("mlx5_3", "DOWN", "Disabled")]
    assert sum(p.up for p in s.ports) == 7


def test_saturated_counters_are_unknown_not_zero(boot):
    _, s = read("saturated", boot)
    p = next(p for p in s.ports if p.device == "mlx5_0")
    for name, top in (("symbol_error", 65535), ("link_downed", 255), ("local_link_integrity_errors", 15)):
        d = p.counters[f"counters/{name}"]
        assert (d.value, d.saturated, d.delta) == (top, True, None), name


def test_no_hca_is_no_data(boot, tmp_path):
    c = InfinibandCollector(sysfs_root=str(tmp_path / "absent"), boot_id_path=str(boot))
    assert c.collect(0.0).status == "no_data"


@pytest.mark.parametrize("scenario", ["healthy", "port_down", "saturated"])
def test_builder_writes_exactly_the_committed_tree(scenario, tmp_path):
    out = tmp_path / scenario
    ib_tree.SCENARIOS[scenario](out)

    def diff(a: Path, b: Path) -> list[str]:
        c = filecmp.dircmp(a, b)
        bad = [str(a / n) for n in c.left_only + c.right_only + c.diff_files + c.funny_files]
        _, mismatch, errors = filecmp.cmpfiles(a, b, c.common_files, shallow=False)
        bad += [str(a / n) for n in mismatch + errors]
        for sub in c.common_dirs:
            bad += diff(a / sub, b / sub)
        return bad

    assert diff(FIXTURES / scenario, out) == []
