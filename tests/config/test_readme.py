"""The README's configuration reference names every key the loader accepts, so it cannot drift."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from healthd.settings import FilesystemSpec, Settings, XidOverride

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


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
    missing = [k for k in wanted if f"`{k}`" not in README]
    assert not missing, f"README.md lacks these config keys: {missing}"
