"""The documentation cannot drift: the configuration reference names every key the loaders accept,
its controller example loads, every page under docs/ is reachable from the README, and no relative
link points at a file that does not exist."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from healthd.settings import FilesystemSpec, Settings, XidOverride

ROOT = Path(__file__).resolve().parents[2]
README_PATH = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE_PATH = DOCS / "configuration.md"
REFERENCE = REFERENCE_PATH.read_text()


def keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_config_key_is_documented():
    wanted = keys(Settings) + keys(FilesystemSpec, "host.filesystems[].") + keys(XidOverride, "catalog.overrides.<xid>.")
    missing = [k for k in wanted if f"`{k}`" not in REFERENCE]
    assert not missing, f"docs/configuration.md lacks these config keys: {missing}"


def test_every_controller_config_key_is_documented():
    from healthd.controller.config import ControllerSettings
    from healthd.controller.policy import ControllerPolicySettings
    from healthd.controller.reintegrate import ReintegrationSettings

    wanted = ([k for k in keys(ControllerSettings) if k not in ("policy", "reintegration")]
              + keys(ControllerPolicySettings, "policy.") + keys(ReintegrationSettings, "reintegration."))
    missing = [k for k in wanted if f"`{k}`" not in REFERENCE]
    assert not missing, f"docs/configuration.md lacks these controller config keys: {missing}"


def test_the_controller_example_loads():
    from healthd.controller.config import parse_controller_settings

    example = REFERENCE.split("A minimal site config for acting on T1 faults:")[1].split("```yaml")[1].split("```")[0]
    s = parse_controller_settings(example, "docs/configuration.md")
    assert s.policy.mode == "auto" and len(s.reintegration.validation) == 2


# --- links -----------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)


def pages() -> list[Path]:
    return [README_PATH, *sorted(DOCS.glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """Every link target of a Markdown text, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text) + REFDEF.findall(text)


def is_relative(target: str) -> bool:
    return not (target.startswith("#") or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"))


def resolve(page: Path, target: str) -> Path:
    path = target.split("#", 1)[0].split("?", 1)[0]
    return (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)


def test_link_extraction_skips_code_and_external_links():
    text = "[a](docs/x.md#y) [b](https://example.org/z) [c](#top)\n`[d](nope.md)`\n```\n[e](nope.md)\n```\n[f]: ../g.md\n"
    assert [t for t in link_targets(text) if is_relative(t)] == ["docs/x.md#y", "../g.md"]


def test_there_are_doc_pages():
    assert (DOCS / "configuration.md").is_file()
    assert len(pages()) > 2


def test_every_doc_page_is_linked_from_the_readme():
    linked = {resolve(README_PATH, t).resolve() for t in link_targets(README_PATH.read_text()) if is_relative(t)}
    unlinked = [p.relative_to(ROOT).as_posix() for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link these pages: {unlinked}"


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for page in pages():
        for target in link_targets(page.read_text()):
            if is_relative(target) and not resolve(page, target).exists():
                broken.append(f"{page.relative_to(ROOT).as_posix()}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_anchor_names_a_heading():
    broken = []
    for page in pages():
        for target in link_targets(page.read_text()):
            if "#" not in target or not (is_relative(target) or target.startswith("#")):
                continue
            path, anchor = target.split("#", 1)
            dest = page if not path else resolve(page, path)
            if dest.suffix == ".md" and dest.is_file() and anchor not in slugs(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT).as_posix()}: {target}")
    assert not broken, "links to missing headings:\n" + "\n".join(broken)
