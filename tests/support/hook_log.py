"""What the installed Slurm hooks write to stderr (slurmd's log): one line per message, each starting
with the hook's own tag, so no value from the environment can forge or break a line."""

from __future__ import annotations

HOOK_TAGS = ("healthd-prolog[", "healthd-epilog[", "healthd-healthcheck[")


def hook_lines(stderr: str) -> list[str]:
    """The hook's lines; asserts that every one is the hook's own."""
    out = stderr.splitlines()
    for line in out:
        assert line.startswith(HOOK_TAGS), line
    return out


def one_line(stderr: str, *parts: str) -> str:
    """The single line that carries every part (one clear line, not a traceback)."""
    found = [line for line in hook_lines(stderr) if all(p in line for p in parts)]
    assert len(found) == 1, (parts, stderr)
    return found[0]
