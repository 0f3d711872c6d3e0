"""The Xid catalog: what each NVIDIA Xid means and what healthd does about it, loaded from data.

The rows live in `healthd/data/xid_catalog.yaml` (NVIDIA's buckets plus healthd's attribution, tier
and action, a source URL on every row). `load_catalog` validates every row before anything uses it
and applies the site's `catalog.overrides`; a bad row or override is a `CatalogError` that names the
file, the row, the field, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from healthd.model import ACTIONS, ATTRIBUTIONS, TIERS
from healthd.settings import XidOverride

NVIDIA_CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
PACKAGED = "healthd/data/xid_catalog.yaml"
"""How the packaged catalog is named in errors (the file ships inside the package)."""

NVIDIA_IMMEDIATE = frozenset(
    {
        "RESTART_APP",
        "RESET_GPU",
        "RESTART_BM",
        "RESTART_VM",
        "CONTACT_SUPPORT",
        "IGNORE",
        "CHECK_MECHANICALS",
        "UPDATE_SWFW",
        "XID_154",
    }
)
"""NVIDIA's immediate-resolution buckets; `WORKFLOW_<NAME>` values are accepted as well."""

NVIDIA_EQUIVALENT: dict[str, str | None] = {
    "RESTART_APP": "none",
    "IGNORE": "none",
    "RESET_GPU": "reset-gpu-when-idle",
    "RESTART_BM": "reboot-when-idle",
    "RESTART_VM": "reboot-when-idle",
    "UPDATE_SWFW": "reboot-when-idle",
    "CONTACT_SUPPORT": "inspect-hardware",
    "CHECK_MECHANICALS": "inspect-hardware",
    "XID_154": "none",
}
"""healthd's action that does what NVIDIA's immediate bucket says (restarting the application needs
nothing of the node; an update is applied by a reboot). A `WORKFLOW_<NAME>` bucket is a procedure, not
one action: None. Xid 154's own row records the change and its `recovery_action` rules follow the
announcement, so its row's equivalent is none."""

_WORKFLOW = re.compile(r"^WORKFLOW_[A-Z0-9_]+$")
_ROW_FIELDS = {
    "xid": True,
    "mnemonic": True,
    "description": True,
    "nvidia_immediate": True,
    "nvidia_investigatory": True,
    "attribution": True,
    "tier": True,
    "action": True,
    "summary": False,
    "source": True,
    "note": False,
    "differs": False,
    "repeat": False,
    "sympathetic": False,
    "severity": False,
    "recovery_action": False,
}
"""Row keys and whether each is required; any other key is a typo and rejected."""
_TOP_FIELDS = {"version", "catalog_source", "xids"}


class CatalogError(ValueError):
    """A catalog file or override that cannot be used; the message says where and what to do."""


@dataclass(frozen=True)
class XidOutcome:
    """The tier, attribution and action of an Xid row, or of one of the row's rules (repeat,
    severity, recovery action) that applies instead of the row's own."""

    tier: int
    attribution: str
    action: str


@dataclass(frozen=True)
class XidEntry:
    """One catalog row after validation and site overrides."""

    xid: int
    mnemonic: str
    description: str
    nvidia_immediate: str
    nvidia_investigatory: str
    attribution: str
    tier: int
    action: str
    summary: str
    source: tuple[str, ...]
    note: str = ""
    differs: str = ""
    """Why healthd's action is not the one NVIDIA's immediate bucket names (see `differs_from_nvidia`)."""
    repeat: XidOutcome | None = None
    """The outcome when the Xid repeats on one GPU (and on no other GPU of the node)."""
    sympathetic: bool = False
    """Cleanup after another Xid on the same GPU when it follows one within the sympathetic window."""
    severity: Mapping[str, XidOutcome] = field(default_factory=dict)
    """NVLink5: printed severity ('Fatal', 'Non-fatal') -> outcome."""
    recovery_action: tuple[tuple[str, XidOutcome], ...] = ()
    """Xid 154: (word in the announced recovery action, outcome), first match wins."""
    in_catalog: bool = True
    """False for the default entry given to an Xid the catalog does not list."""
    ignore: bool = False
    """A site override drops findings for this Xid."""
    overridden: tuple[str, ...] = ()
    """Fields a site override changed."""

    @property
    def outcome(self) -> XidOutcome:
        return XidOutcome(self.tier, self.attribution, self.action)

    @property
    def differs_from_nvidia(self) -> bool:
        """The row's action is not what NVIDIA's immediate bucket says (a workflow bucket names no
        single action, so any action differs from it)."""
        return NVIDIA_EQUIVALENT.get(self.nvidia_immediate) != self.action


@functools.lru_cache(maxsize=1024)
def default_entry(xid: int) -> XidEntry:
    """The explicit entry for an Xid the catalog does not list: recorded, never acted on."""
    return XidEntry(
        xid=xid,
        mnemonic="UNKNOWN",
        description=f"Xid {xid} not in catalog",
        nvidia_immediate="",
        nvidia_investigatory="",
        attribution="unknown",
        tier=3,
        action="none",
        summary=f"Xid {xid} not in catalog",
        source=(NVIDIA_CATALOG_URL,),
        in_catalog=False,
    )


class Catalog:
    """Validated Xid rows by code. `lookup` never fails: unknown Xids get `default_entry`."""

    def __init__(self, entries: Mapping[int, XidEntry], path: str = PACKAGED) -> None:
        self._entries = dict(entries)
        self.path = path

    def lookup(self, xid: int) -> XidEntry:
        entry = self._entries.get(xid)
        return entry if entry is not None else default_entry(xid)

    def __contains__(self, xid: object) -> bool:
        return xid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def xids(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))

    def __repr__(self) -> str:
        return f"Catalog({self.path!r}, {len(self._entries)} rows)"


# --------------------------------------------------------------------------- loading


def load_catalog(path: str | None = None, overrides: Mapping[int, XidOverride] = {}) -> Catalog:
    """Read, validate and override the catalog. `path` None reads the packaged file."""
    if path is None:
        name = PACKAGED
        try:
            text = importlib.resources.files("healthd").joinpath("data/xid_catalog.yaml").read_text("utf-8")
        except OSError as exc:  # a broken install
            raise CatalogError(f"{name}: cannot read the packaged Xid catalog: {exc}; reinstall healthd") from exc
    else:
        name = path
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise CatalogError(
                f"{name}: cannot read the Xid catalog: {exc.strerror or exc}; "
                "fix catalog.path in the config or remove it to use the packaged catalog"
            ) from exc
    entries = parse_catalog(text, name)
    return Catalog(apply_overrides(entries, overrides, name), name)


def parse_catalog(text: str, name: str = "<catalog>") -> dict[int, XidEntry]:
    """Validate catalog YAML text; `name` is the file named in errors."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CatalogError(f"{name}:{where}: not valid YAML: {problem}") from exc
    if not isinstance(doc, dict):
        raise CatalogError(f"{name}: expected a mapping with an `xids:` list at the top, found {_kind(doc)}")
    unknown = sorted(str(k) for k in doc if k not in _TOP_FIELDS)
    if unknown:
        raise CatalogError(
            f"{name}: unknown top-level key(s) {', '.join(unknown)}; expected {', '.join(sorted(_TOP_FIELDS))}"
        )
    rows = doc.get("xids")
    if not isinstance(rows, list) or not rows:
        raise CatalogError(f"{name}: field 'xids': expected a non-empty list of rows, found {_kind(rows)}")
    entries: dict[int, XidEntry] = {}
    first_row: dict[int, int] = {}
    for index, row in enumerate(rows):
        entry = _parse_row(row, index, name)
        if entry.xid in entries:
            raise CatalogError(
                f"{name}: row {index} (xid {entry.xid}): field 'xid': expected each Xid once, "
                f"found a duplicate of row {first_row[entry.xid]}"
            )
        entries[entry.xid] = entry
        first_row[entry.xid] = index
    return entries


def _parse_row(row: Any, index: int, name: str) -> XidEntry:
    where = f"{name}: row {index}"
    if not isinstance(row, dict):
        raise CatalogError(f"{where}: expected a mapping of fields, found {_kind(row)}")
    xid = row.get("xid")
    if isinstance(xid, bool) or not isinstance(xid, int) or xid < 0:
        raise CatalogError(f"{where}: field 'xid': expected a non-negative integer, found {xid!r}")
    where = f"{name}: row {index} (xid {xid})"

    def fail(fld: str, expected: str, found: Any) -> CatalogError:
        return CatalogError(f"{where}: field '{fld}': expected {expected}, found {found!r}")

    unknown = sorted(str(k) for k in row if k not in _ROW_FIELDS)
    if unknown:
        raise CatalogError(
            f"{where}: unknown field(s) {', '.join(unknown)}; expected some of {', '.join(_ROW_FIELDS)}"
        )
    for fld, required in _ROW_FIELDS.items():
        if required and fld not in row:
            raise CatalogError(f"{where}: field '{fld}': required but missing")

    def text(fld: str, allow_empty: bool = False) -> str:
        value = row.get(fld, "")
        if value is None and allow_empty:
            return ""
        if not isinstance(value, str) or (not allow_empty and not value.strip()):
            raise fail(fld, "a non-empty string" if not allow_empty else "a string", value)
        return value.strip()

    immediate = text("nvidia_immediate")
    if immediate not in NVIDIA_IMMEDIATE and not _WORKFLOW.match(immediate):
        raise fail("nvidia_immediate", f"one of {', '.join(sorted(NVIDIA_IMMEDIATE))} or WORKFLOW_<NAME>", immediate)

    outcome = _outcome(row, "", fail)
    sources = row.get("source")
    source_list = [sources] if isinstance(sources, str) else sources
    if not isinstance(source_list, list) or not source_list:
        raise fail("source", "an http(s) URL or a non-empty list of them", sources)
    for url in source_list:
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+\.[^\s]+$", url.strip()):
            raise fail("source", "an http(s) URL", url)

    repeat = None
    if row.get("repeat") is not None:
        repeat = _outcome(row["repeat"], "repeat.", fail)
    sympathetic = row.get("sympathetic", False)
    if not isinstance(sympathetic, bool):
        raise fail("sympathetic", "true or false", sympathetic)
    severity: dict[str, XidOutcome] = {}
    if row.get("severity") is not None:
        sev = row["severity"]
        if not isinstance(sev, dict) or not sev:
            raise fail("severity", "a mapping of printed severity (Fatal, Non-fatal) to {tier, attribution, action}", sev)
        for word, value in sev.items():
            severity[str(word)] = _outcome(value, f"severity.{word}.", fail)
    recovery: list[tuple[str, XidOutcome]] = []
    if row.get("recovery_action") is not None:
        rec = row["recovery_action"]
        if not isinstance(rec, dict) or not rec:
            raise fail("recovery_action", "a mapping of a word in the announced action to {tier, attribution, action}", rec)
        for word, value in rec.items():
            recovery.append((str(word).lower(), _outcome(value, f"recovery_action.{word}.", fail)))
    summary = text("summary") if "summary" in row else text("description")
    return XidEntry(
        xid=xid,
        mnemonic=text("mnemonic"),
        description=text("description"),
        nvidia_immediate=immediate,
        nvidia_investigatory=text("nvidia_investigatory", allow_empty=True),
        attribution=outcome.attribution,
        tier=outcome.tier,
        action=outcome.action,
        summary=summary,
        source=tuple(u.strip() for u in source_list),
        note=text("note", allow_empty=True) if "note" in row else "",
        differs=text("differs") if "differs" in row else "",
        repeat=repeat,
        sympathetic=sympathetic,
        severity=severity,
        recovery_action=tuple(recovery),
    )


def _outcome(value: Any, prefix: str, fail: Any) -> XidOutcome:
    """Validate {tier, attribution, action} (a row or a rule's outcome)."""
    if not isinstance(value, dict):
        raise fail(prefix.rstrip(".") or "row", "a mapping with tier, attribution and action", value)
    for fld in ("tier", "attribution", "action"):
        if fld not in value:
            raise fail(prefix + fld, "a value", "nothing (missing)")
    tier, attribution, action = value["tier"], value["attribution"], value["action"]
    if isinstance(tier, bool) or tier not in TIERS:
        raise fail(prefix + "tier", "1, 2 or 3", tier)
    if attribution not in ATTRIBUTIONS:
        raise fail(prefix + "attribution", f"one of {', '.join(ATTRIBUTIONS)}", attribution)
    if action not in ACTIONS:
        raise fail(prefix + "action", f"one of {', '.join(ACTIONS)}", action)
    _check_consistent(tier, action, prefix + "action", fail)
    return XidOutcome(int(tier), attribution, action)


def _check_consistent(tier: int, action: str, fld: str, fail: Any) -> None:
    if tier == 3 and action != "none":
        raise fail(fld, "none for a tier 3 row (tier 3 is recorded, never acted on)", action)
    if tier == 1 and action == "none":
        raise fail(fld, "an action for a tier 1 row (tier 1 is a certain fault)", action)


def apply_overrides(
    entries: Mapping[int, XidEntry], overrides: Mapping[int, XidOverride], name: str = PACKAGED
) -> dict[int, XidEntry]:
    """Apply `catalog.overrides` from the config. An override for an Xid the catalog lacks starts from
    the default entry. Values are checked like catalog rows and errors name `catalog.overrides.<xid>`."""
    out = dict(entries)
    for xid, ov in overrides.items():
        where = f"config catalog.overrides.{xid} (catalog {name})"
        if isinstance(xid, bool) or not isinstance(xid, int) or xid < 0:
            raise CatalogError(f"config catalog.overrides: key: expected an Xid number, found {xid!r}")
        if not isinstance(ov, XidOverride):
            raise CatalogError(f"{where}: expected attribution/tier/action/ignore fields, found {_kind(ov)}")

        def fail(fld: str, expected: str, found: Any, where: str = where) -> CatalogError:
            return CatalogError(f"{where}: field '{fld}': expected {expected}, found {found!r}")

        base = out.get(xid) or default_entry(xid)
        changes: dict[str, Any] = {}
        if ov.attribution is not None:
            if ov.attribution not in ATTRIBUTIONS:
                raise fail("attribution", f"one of {', '.join(ATTRIBUTIONS)}", ov.attribution)
            changes["attribution"] = ov.attribution
        if ov.tier is not None:
            if isinstance(ov.tier, bool) or ov.tier not in TIERS:
                raise fail("tier", "1, 2 or 3", ov.tier)
            changes["tier"] = int(ov.tier)
        if ov.action is not None:
            if ov.action not in ACTIONS:
                raise fail("action", f"one of {', '.join(ACTIONS)}", ov.action)
            changes["action"] = ov.action
        if not isinstance(ov.ignore, bool):
            raise fail("ignore", "true or false", ov.ignore)
        tier = changes.get("tier", base.tier)
        action = changes.get("action", base.action)
        try:
            _check_consistent(tier, action, "action", fail)
        except CatalogError as exc:
            raise CatalogError(f"{exc} (tier {tier} with action {action!r}; set both tier and action)") from None
        if ov.ignore:
            changes["ignore"] = True
        changes["overridden"] = tuple(sorted(k for k in changes if k != "overridden"))
        out[xid] = dataclasses.replace(base, **changes)
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, (dict, list, str, int, float, bool)):
        return f"{type(value).__name__} {value!r}"[:120]
    return type(value).__name__
