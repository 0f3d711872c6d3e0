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


def test_every_controller_config_key_is_documented():
    from healthd.controller.config import ControllerSettings
    from healthd.controller.policy import ControllerPolicySettings
    from healthd.controller.reintegrate import ReintegrationSettings

    wanted = ([k for k in keys(ControllerSettings) if k not in ("policy", "reintegration")]
              + keys(ControllerPolicySettings, "policy.") + keys(ReintegrationSettings, "reintegration."))
    missing = [k for k in wanted if f"`{k}`" not in README]
    assert not missing, f"README.md lacks these controller config keys: {missing}"


def test_the_readme_controller_example_loads():
    from healthd.controller.config import parse_controller_settings

    example = README.split("A minimal site config for acting on T1 faults:")[1].split("```yaml")[1].split("```")[0]
    s = parse_controller_settings(example, "README.md")
    assert s.policy.mode == "auto" and len(s.reintegration.validation) == 2
