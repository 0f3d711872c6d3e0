"""The report envelope agents push to the controller: its wire format and canonical digest.

Wire format (the HTTP body, UTF-8 JSON):

    {"healthd_report": 1, "node": "node02", "report": {...}, "credential": "MUNGE:...:"}

The credential is a MUNGE credential made by the node's munged whose payload IS the SHA-256 digest
(32 raw bytes) of the canonical payload: `canonical({"healthd_report": 1, "node": ..., "report": ...})`
(sorted keys, no whitespace, ASCII escapes, no NaN/Infinity). So the credential binds the claimed node
name and every byte of meaning in the report; nothing outside the digest is accepted (an envelope with
extra fields is refused). The agent signs with `sign_report`; the controller checks with
healthd.controller.auth.verify_report.
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


def canonical(obj: Any) -> bytes:
    """The one byte string a JSON value hashes as: sorted keys, no whitespace, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def payload_digest(node: str, doc: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical payload the credential binds (the node's claim and the report)."""
    return hashlib.sha256(canonical({VERSION_KEY: ENVELOPE_VERSION, "node": node, "report": doc})).digest()


def sign_report(
    doc: Mapping[str, Any],
    node: str,
    socket: str | None = None,
    *,
    ttl: int | None = None,
    encode: Callable[..., str] = munge.encode,
) -> bytes:
    """Agent side: the HTTP body for `doc` from `node`, with a credential from the munged on `socket`
    binding its digest. Raises ValueError or TypeError for a doc that is not canonical JSON (NaN,
    infinities, keys that are not strings, objects json cannot encode),
    munge.MungeError when the node's munged refuses."""
    if not NODE_NAME.fullmatch(node):
        raise ValueError(f"node name {node!r} is not a hostname")
    doc = dict(doc)
    cred = encode(payload_digest(node, doc), socket, ttl=ttl)
    envelope = {VERSION_KEY: ENVELOPE_VERSION, "node": node, "report": doc, "credential": cred}
    return json.dumps(envelope, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
