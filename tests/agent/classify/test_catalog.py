"""The Xid catalog: packaged data is complete and valid; bad files and overrides fail clearly."""

from __future__ import annotations

import re

import pytest

from healthd.agent.classify.catalog import CatalogError, load_catalog, parse_catalog
from healthd.settings import XidOverride

GOOD_ROW = """\
  - xid: 79
    mnemonic: ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS
    description: GPU has fallen off the bus
    nvidia_immediate: RESTART_BM
    nvidia_investigatory: CONTACT_SUPPORT
    attribution: hardware
    tier: 1
    action: drain
    source: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
"""


def write(tmp_path, body: str) -> str:
    path = tmp_path / "site-catalog.yaml"
    path.write_text("version: 1\nxids:\n" + body)
    return str(path)


def test_packaged_catalog_covers_the_required_xids_and_every_row_has_a_source():
    cat = load_catalog()
    required = {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 121, 140, 143,
                *range(144, 151), 154, 155, 156, 157, 158, 8, 14, 32, 38, 56, 57, 58, 65, 73, 80, 81}
    assert required <= set(cat.xids())
    for x in cat.xids():
        e = cat.lookup(x)
        assert e.source and all(re.match(r"^https?://", u) for u in e.source), x
        assert "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html" in e.source
        assert e.tier in (1, 2, 3) and (e.tier != 3 or e.action == "none")


@pytest.mark.parametrize(
    "code, tier, attribution, action",
    [
        (79, 1, "hardware", "drain-and-requeue"),
        (95, 1, "hardware", "drain-and-requeue"),
        (48, 1, "hardware", "drain"),
        (64, 1, "hardware", "inspect-hardware"),
        (140, 1, "hardware", "drain"),
        (143, 1, "hardware", "reboot-when-idle"),
        (63, 2, "hardware", "reset-gpu-when-idle"),
        (92, 2, "hardware", "reset-gpu-when-idle"),
        (119, 2, "software", "reboot-when-idle"),
        (120, 2, "software", "reboot-when-idle"),
        (74, 2, "fabric", "reboot-when-idle"),
        (13, 3, "user", "none"),
        (31, 3, "user", "none"),
        (43, 3, "user", "none"),
        (45, 3, "user", "none"),
        (94, 3, "user", "none"),
    ],
)
def test_decided_rows(code, tier, attribution, action):
    e = load_catalog().lookup(code)
    assert (e.tier, e.attribution, e.action) == (tier, attribution, action)


def test_rules_are_data():
    cat = load_catalog()
    assert cat.lookup(13).repeat is not None and cat.lookup(13).repeat.tier == 2
    assert cat.lookup(45).sympathetic
    assert cat.lookup(149).severity["Fatal"].tier == 1 and cat.lookup(149).severity["Non-fatal"].tier == 3
    assert dict(cat.lookup(154).recovery_action)["reboot"].action == "reboot-when-idle"


def test_unknown_xid_gets_an_explicit_default():
    e = load_catalog().lookup(999)
    assert (e.attribution, e.tier, e.action, e.summary, e.in_catalog) == ("unknown", 3, "none", "Xid 999 not in catalog", False)


def test_a_good_site_file_loads(tmp_path):
    cat = load_catalog(write(tmp_path, GOOD_ROW))
    assert cat.xids() == (79,) and cat.path.endswith("site-catalog.yaml")


@pytest.mark.parametrize(
    "edit, fragments",
    [
        # missing source URL
        (lambda r: r.replace("    source: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html\n", ""),
         ["row 0 (xid 79)", "field 'source'", "required but missing"]),
        # source that is not a URL
        (lambda r: r.replace("source: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html", "source: NVIDIA docs"),
         ["row 0 (xid 79)", "field 'source'", "expected an http(s) URL", "found 'NVIDIA docs'"]),
        # bad tier
        (lambda r: r.replace("tier: 1", "tier: 4"), ["row 0 (xid 79)", "field 'tier'", "expected 1, 2 or 3", "found 4"]),
        # unknown action
        (lambda r: r.replace("action: drain", "action: reboot"), ["row 0 (xid 79)", "field 'action'", "expected one of none", "found 'reboot'"]),
        # unknown attribution
        (lambda r: r.replace("attribution: hardware", "attribution: gpu"), ["field 'attribution'", "found 'gpu'"]),
        # a tier 3 row may not act
        (lambda r: r.replace("tier: 1", "tier: 3"), ["field 'action'", "expected none for a tier 3 row", "found 'drain'"]),
        # unknown NVIDIA bucket
        (lambda r: r.replace("RESTART_BM", "REBOOT_PLEASE"), ["field 'nvidia_immediate'", "found 'REBOOT_PLEASE'"]),
        # a typo in a field name
        (lambda r: r.replace("    tier: 1\n", "    tier: 1\n    teir: 1\n"), ["row 0 (xid 79)", "unknown field(s) teir"]),
        # bad xid
        (lambda r: r.replace("xid: 79", "xid: seventy-nine"), ["row 0", "field 'xid'", "found 'seventy-nine'"]),
    ],
)
def test_row_validation_errors_name_file_row_field_expected_and_found(tmp_path, edit, fragments):
    path = write(tmp_path, edit(GOOD_ROW))
    with pytest.raises(CatalogError) as err:
        load_catalog(path)
    msg = str(err.value)
    assert msg.startswith(path + ":"), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_duplicate_xid_names_both_rows(tmp_path):
    path = write(tmp_path, GOOD_ROW + GOOD_ROW)
    with pytest.raises(CatalogError, match=r"site-catalog.yaml: row 1 \(xid 79\): field 'xid': expected each Xid once, found a duplicate of row 0"):
        load_catalog(path)


def test_bad_rule_outcome_is_named(tmp_path):
    path = write(tmp_path, GOOD_ROW + "    repeat: {tier: 2, attribution: hardware, action: explode}\n")
    with pytest.raises(CatalogError, match=r"row 0 \(xid 79\): field 'repeat.action': expected one of .* found 'explode'"):
        load_catalog(path)


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, GOOD_ROW + "    description: broken: here\n")
    with pytest.raises(CatalogError, match=r"site-catalog.yaml: line \d+ column \d+: not valid YAML"):
        load_catalog(path)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(CatalogError, match=r"nope.yaml: cannot read the Xid catalog: .*catalog.path"):
        load_catalog(str(tmp_path / "nope.yaml"))
    with pytest.raises(CatalogError, match=r"field 'xids': expected a non-empty list"):
        parse_catalog("version: 1\nxids: []\n", "empty.yaml")
    with pytest.raises(CatalogError, match=r"empty.yaml: expected a mapping"):
        parse_catalog("", "empty.yaml")


# --------------------------------------------------------------------------- overrides


def test_override_changes_fields_and_is_recorded():
    cat = load_catalog(overrides={63: XidOverride(action="reboot-when-idle"), 109: XidOverride(tier=2, action="reset-gpu-when-idle", attribution="hardware")})
    e63, e109 = cat.lookup(63), cat.lookup(109)
    assert (e63.tier, e63.action, e63.overridden) == (2, "reboot-when-idle", ("action",))
    assert (e109.tier, e109.attribution, e109.action) == (2, "hardware", "reset-gpu-when-idle")
    assert e63.source == load_catalog().lookup(63).source


def test_override_ignore_and_unknown_xid():
    cat = load_catalog(overrides={43: XidOverride(ignore=True), 500: XidOverride(tier=2, action="drain", attribution="hardware")})
    assert cat.lookup(43).ignore and cat.lookup(43).overridden == ("ignore",)
    e = cat.lookup(500)
    assert (e.tier, e.action, e.in_catalog) == (2, "drain", False)


@pytest.mark.parametrize(
    "ov, fragment",
    [
        (XidOverride(action="reboot"), "field 'action': expected one of none, reset-gpu-when-idle"),
        (XidOverride(tier=0), "field 'tier': expected 1, 2 or 3, found 0"),
        (XidOverride(attribution="cosmic-rays"), "field 'attribution': expected one of hardware"),
        (XidOverride(tier=3), "expected none for a tier 3 row"),  # 79 drains: tier 3 alone contradicts it
    ],
)
def test_bad_override_is_rejected_naming_the_config_key(ov, fragment):
    with pytest.raises(CatalogError) as err:
        load_catalog(overrides={79: ov})
    msg = str(err.value)
    assert msg.startswith("config catalog.overrides.79 (catalog healthd/data/xid_catalog.yaml)"), msg
    assert fragment in msg, msg


def test_override_of_a_tier_with_its_action_is_accepted():
    e = load_catalog(overrides={79: XidOverride(tier=3, action="none")}).lookup(79)
    assert (e.tier, e.action) == (3, "none")


def test_site_can_treat_xid_13_as_hardware_on_sight():
    e = load_catalog(overrides={13: XidOverride(tier=2, attribution="hardware", action="drain")}).lookup(13)
    assert (e.tier, e.attribution, e.action) == (2, "hardware", "drain")
