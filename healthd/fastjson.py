"""json.loads and compact json.dumps for the modules on the Slurm hooks' start, through the C
accelerator `_json` that the json package itself uses, without importing the json package: that
imports re (and with it enum, functools, collections), about 5 ms of every hook run on a 2-core VM.

The results are the json package's own: `loads` is json.loads for a UTF-8 document (anything else --
another encoding, a BOM, bad JSON -- is handed to json.loads, so its value or JSONDecodeError is
exactly json's), and `dumps_compact(doc)` is `json.dumps(doc, separators=(",", ":"))` built from the
same C encoder with the same arguments. tests/test_fastjson.py compares them on many documents.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

try:
    import _json
except ImportError:  # an interpreter without the accelerator: the json package it is
    _json = None  # type: ignore[assignment]

_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}
_WHITESPACE = " \t\n\r"


class _Context:
    """What _json.make_scanner reads from a json.JSONDecoder() with default arguments."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _default(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")  # json.JSONEncoder.default


_scan = _json.make_scanner(_Context()) if _json is not None else None


def _slow_loads(data: str | bytes) -> Any:
    import json  # lazy: only for what the accelerator does not decide

    return json.loads(data)


def loads(data: str | bytes | bytearray) -> Any:
    """json.loads(data)."""
    if _scan is None:
        return _slow_loads(data)
    if isinstance(data, (bytes, bytearray)):
        if data[:3] == b"\xef\xbb\xbf" or b"\x00" in data[:4]:
            return _slow_loads(data)  # a BOM or UTF-16/32: json's detect_encoding decides
        try:
            text = bytes(data).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return _slow_loads(data)
    elif isinstance(data, str):
        text = data
    else:
        return _slow_loads(data)
    if text[:1] == "\ufeff":
        return _slow_loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
    except (StopIteration, ValueError, SystemError):
        # json raises the JSONDecodeError with its message. (_json raises it only when json.decoder is
        # already imported; before that, a bad document is a SystemError "returned NULL".)
        return _slow_loads(text)
    if end + len(text[end:]) - len(text[end:].lstrip(_WHITESPACE)) != len(text):
        return _slow_loads(text)  # extra data after the document
    return value


def dumps_compact(doc: Any) -> str:
    """json.dumps(doc, separators=(",", ":"))."""
    if _json is None:
        import json  # lazy: an interpreter without _json

        return json.dumps(doc, separators=(",", ":"))
    if isinstance(doc, str):
        return _json.encode_basestring_ascii(doc)
    # a new encoder each time, as json.dumps makes: its circular-reference markers start empty
    encode = _json.make_encoder({}, _default, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
    return "".join(encode(doc, 0))
