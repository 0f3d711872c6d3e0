"""Text and time in the one form every healthd document and log line uses. Standard library only and
cheap to import: the hooks load it on every job start."""

from __future__ import annotations

try:  # the C module behind datetime: importing datetime itself costs the hooks ~2 ms a run
    from _datetime import datetime, timezone
except ImportError:  # an interpreter without it
    from datetime import datetime, timezone

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Sequence



def clean(value: Any, limit: int = 200) -> str:
    """One printable line of at most `limit` characters: safe in a log line and a Slurm reason."""
    text = printable_ascii(str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable_ascii(text: str) -> str:
    """`text` with every character outside printable ASCII (0x20-0x7e) replaced by `?`. Without re:
    the hooks import this module on every job start, and re costs them ~3 ms."""
    if text.isascii() and text.isprintable():  # printable ASCII is exactly 0x20-0x7e
        return text
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def iso(ts: float) -> str:
    """Epoch seconds -> RFC 3339 UTC with milliseconds, the one time format of healthd's documents."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds")


def stamp(ts: float | None) -> str:
    """Epoch seconds -> `2026-12-01T12:43:08Z`: a time a person reads in a reason, a refusal or a
    log line (UTC, to the second); `-` when unknown."""
    if ts is None:
        return "-"
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"<time {ts!r} out of range>"


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key for names with numbers in them: node2 < node10 < node10a, mlx5_2 < mlx5_10; equal
    numbers with different padding (node1, node01) by their text."""
    import re  # lazy: see printable_ascii

    parts = re.split(r"(\d+)", name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def parse_time(value: Any) -> float | None:
    """RFC 3339 text -> epoch seconds; None for anything else (no time zone is not a time)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    if t.tzinfo is None:
        return None
    return t.timestamp()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned columns, two spaces apart; None shows as "-"."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), *(fmt.format(*r).rstrip() for r in cells)]
