"""The report envelope agents push to the controller: its wire format and canonical digest.

Wire format (the HTTP body, UTF-8 JSON):

    {"credential":"MUNGE:...:","healthd_report":1,"node":"node02","report":{...}}

The credential is a MUNGE credential made by the node's munged whose payload IS the SHA-256 digest
(32 raw bytes) of the canonical payload: `canonical({"healthd_report": 1, "node": ..., "report": ...})`
(sorted keys, no whitespace, ASCII escapes, no NaN/Infinity). So the credential binds the claimed node
name and every byte of meaning in the report; nothing outside the digest is accepted (an envelope with
extra fields is refused). The agent signs with `sign_report`; the controller checks with
healthd.controller.auth.verify_report.

`sign_report` lays the body out as the canonical payload with the credential member spliced in first
("credential" sorts first, so the whole body is canonical JSON too): the bytes after the credential
member, behind an opening brace, are exactly the bytes the digest was taken over. The controller hashes
those bytes as they arrived (`sent_payload_digest`) instead of serialising the parsed report again. Any
other layout of the same JSON (other key order, whitespace) still verifies, through the canonical
re-serialisation (`payload_digest`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from healthd import munge

ENVELOPE_VERSION = 1
VERSION_KEY = "healthd_report"
ENVELOPE_KEYS = frozenset({VERSION_KEY, "node", "report", "credential"})
DEFAULT_MAX_BYTES = 1_048_576
DEFAULT_MAX_AGE_S = 300.0
MAX_CREDENTIAL_CHARS = 8192
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SPLICED_PREFIX = b'{"credential":"'
"""How a body laid out by sign_report starts: the credential member, then the canonical payload's members."""


def canonical(obj: Any) -> bytes:
    """The one byte string a JSON value hashes as: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def payload_digest(node: str, doc: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical payload the credential binds (the node's claim and the report)."""
    return hashlib.sha256(canonical({VERSION_KEY: ENVELOPE_VERSION, "node": node, "report": doc})).digest()


def sent_payload_digest(body: bytes | bytearray | memoryview) -> bytes | None:
    """SHA-256 of the payload bytes as sent, for a body laid out as sign_report lays it out
    (`{"credential":"...",` then the payload's members and its closing brace): the digest of `{` followed
    by every byte after the credential member. None for any other layout: the credential string holds a
    backslash, something other than `",` follows it, or the body does not end in `}`. Never raises;
    says nothing about whether the body is valid JSON."""
    data = body if isinstance(body, bytes) else bytes(body)
    start = len(SPLICED_PREFIX)
    if not data.startswith(SPLICED_PREFIX) or not data.endswith(b"}"):
        return None
    end = data.find(b'"', start)
    # a backslash could escape the quote that seems to end the credential, so the members after it would
    # not be where they seem: such a body is left to the canonical path
    if end < 0 or data.find(b"\\", start, end) >= 0 or data[end + 1 : end + 2] != b"," or end + 2 >= len(data):
        return None
    digest = hashlib.sha256(b"{")
    digest.update(memoryview(data)[end + 2 :])
    return digest.digest()


def sign_report(
    doc: Mapping[str, Any],
    node: str,
    socket: str | None = None,
    *,
    ttl: int | None = None,
    encode: Callable[..., str] = munge.encode,
) -> bytes:
    """Agent side: the HTTP body for `doc` from `node`, with a credential from the munged on `socket`
    binding its digest. The body is the canonical payload with the credential member spliced in first
    (the module docstring). Raises ValueError or TypeError for a doc that is not canonical JSON (NaN,
    infinities, keys that are not strings, objects json cannot encode),
    munge.MungeError when the node's munged refuses."""
    if not NODE_NAME.fullmatch(node):
        raise ValueError(f"node name {node!r} is not a hostname")
    canon = canonical({VERSION_KEY: ENVELOPE_VERSION, "node": node, "report": dict(doc)})
    cred = encode(hashlib.sha256(canon).digest(), socket, ttl=ttl)
    return b'{"credential":' + json.dumps(cred, ensure_ascii=True).encode("ascii") + b"," + canon[1:]
