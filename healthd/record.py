"""`Record`: a small immutable value class for the modules on the Slurm hooks' start.

What `@dataclass(frozen=True)` gives them -- keyword or positional construction with defaults,
equality, hashing and repr by field, no assignment -- without importing dataclasses, which pulls in
inspect and typing: about 10 ms of every hook run on a 2-core VM, a sixth of the job-launch path.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Record:
    """Subclasses list their fields in order in `_fields` and the defaults of the trailing ones in
    `_defaults`."""

    _fields: tuple[str, ...] = ()
    _defaults: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if len(args) > len(cls._fields):
            raise TypeError(f"{cls.__name__}() takes at most {len(cls._fields)} positional arguments")
        values = dict(zip(cls._fields, args, strict=False))
        for name, value in kwargs.items():
            if name not in cls._fields or name in values:
                raise TypeError(f"{cls.__name__}() got an unexpected or repeated argument {name!r}")
            values[name] = value
        for name in cls._fields:
            if name not in values:
                if name not in cls._defaults:
                    raise TypeError(f"{cls.__name__}() missing argument {name!r}")
                values[name] = cls._defaults[name]
            object.__setattr__(self, name, values[name])

    def replace(self, **changes: Any) -> Record:
        """A copy with `changes` (dataclasses.replace)."""
        return type(self)(**{**{n: getattr(self, n) for n in self._fields}, **changes})

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._fields)})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable ({name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable ({name})")
