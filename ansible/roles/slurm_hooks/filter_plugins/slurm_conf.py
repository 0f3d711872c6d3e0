"""slurm_conf_conflicts: the slurm.conf settings, outside healthd's managed block, that set one of
healthd's keys to another value (Slurm would take whichever line comes last)."""

from __future__ import annotations

import re

_BLOCK = re.compile(r"(?ms)^# BEGIN healthd managed block.*?^# END healthd managed block[^\n]*$")


def slurm_conf_conflicts(text: str, settings: dict) -> list[str]:
    """`Key=value` (as written in slurm.conf) for every line outside the block that sets a key of
    `settings` to a value other than healthd's. Keys compare without case, as Slurm reads them; a line
    may hold several `Key=value` words; `#` starts a comment. Files named by `Include` are not read."""
    wanted = {str(k).lower(): str(v) for k, v in settings.items()}
    found = []
    for line in _BLOCK.sub("", text).splitlines():
        for word in line.split("#", 1)[0].split():
            key, sep, value = word.partition("=")
            if sep and key.lower() in wanted and value.strip("\"'") != wanted[key.lower()]:
                found.append(f"{key}={value}")
    return found


class FilterModule:
    def filters(self):
        return {"slurm_conf_conflicts": slurm_conf_conflicts}
