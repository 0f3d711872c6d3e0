"""The controller's check of a report envelope (its wire format: healthd.envelope).

The controller decodes through its own munged (`socket`); munged checks the MAC, the TTL and replay
(its replay cache) and tells us who encoded it (uid/gid) and where (the encoding munged's origin
address). verify_report then checks, in this order, refusing with ReportRejected(http_status, reason):

    413  body larger than max_bytes (checked before parsing)
    400  not UTF-8 JSON, not an object, wrong version, missing/ill-typed node or report, extra fields,
         a number canonical JSON cannot carry (NaN, an infinity such as 1e400)
    403  the claimed node is not one the controller knows (no address to check it against)
    401  no credential, or not a MUNGE credential string
    401  munged says the credential is invalid (bad MAC, wrong key, garbled), expired or rewound
    409  munged says the credential was already decoded (replayed). 409, not 401: the credential is
         authentic but used; it tells an agent that retried a request whose response it lost to sign
         again (a fresh credential), and lets metrics and logs tell a duplicate from a forgery.
    401  the credential's payload is not the digest of this envelope (tampered or mismatched): neither
         of the bytes after the credential member as sent (a body laid out as sign_report lays it out)
         nor of the canonical payload
    403  the credential was made by a uid not in allowed_uids (default root only: a non-root user on a
         compute node can reach that node's munged, but cannot make the controller act)
    403  the credential's encode address is not the claimed node's address (cross-node forgery)
    401  the credential is older than max_age_s by the controller's clock (defence in depth: munged's
         replay cache is in memory, so after a restart of the controller's munged only this bounds
         how long a captured credential stays usable)
    503  the controller's own munged is unreachable or failed (not the client's fault)

Every reason is one line, safe to log as is (claimed values are quoted with repr and truncated).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from healthd import munge
from healthd.envelope import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    ENVELOPE_KEYS,
    ENVELOPE_VERSION,
    MAX_CREDENTIAL_CHARS,
    NODE_NAME,
    SPLICED_PREFIX,
    VERSION_KEY,
    payload_digest,
    sent_payload_digest,
)

# munge errors that mean "the controller's own munged could not do its job", not "bad credential"
_SERVER_SIDE = {munge.EMUNGE_SNAFU, munge.EMUNGE_NO_MEMORY, munge.EMUNGE_SOCKET, munge.EMUNGE_TIMEOUT}


class ReportRejected(Exception):
    """A report the controller refuses: `http_status` to answer with, `reason` one line for the log
    and the response body."""

    def __init__(self, http_status: int, reason: str):
        self.http_status = http_status
        self.reason = " ".join(reason.split())  # one line, whatever went in
        super().__init__(f"{http_status} {self.reason}")


@dataclass(frozen=True)
class VerifiedReport:
    node: str
    report: dict[str, Any]
    uid: int
    gid: int
    encode_addr: str
    encode_time: int
    ttl: int
    digest: str  # hex SHA-256 the credential binds: of the canonical payload, for every body sign_report makes


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed in a report")


def _finite_float(text: str) -> float:
    # a literal like 1e400 reads as infinity, which canonical JSON cannot carry: refused here, so a report
    # whose digest is taken over the bytes as sent holds nothing the canonical digest would refuse
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:24]} is out of range (not a finite number)")
    return value


def _quote(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _node_of(addr: str, node_addrs: Mapping[str, str]) -> str:
    names = [n for n, a in node_addrs.items() if a == addr]
    return f" ({', '.join(sorted(names)[:3])})" if names else " (no known node)"


def parse_envelope(body: bytes, max_bytes: int) -> tuple[str, dict[str, Any], str]:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise ReportRejected(400, f"report body must be bytes, got {type(body).__name__}")
    if len(body) > max_bytes:
        raise ReportRejected(413, f"report body is {len(body)} bytes, over the {max_bytes}-byte limit")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportRejected(400, f"report body is not UTF-8 (byte {exc.start})") from None
    try:
        env = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise ReportRejected(400, f"report body is not valid JSON: {str(exc)[:80]}") from None
    if not isinstance(env, dict):
        raise ReportRejected(400, f"report body must be a JSON object, got {type(env).__name__}")
    version = env.get(VERSION_KEY)
    if version != ENVELOPE_VERSION or type(version) is not int:
        raise ReportRejected(400, f"report field {VERSION_KEY!r} must be {ENVELOPE_VERSION}, got {_quote(version)}")
    extra = set(env) - ENVELOPE_KEYS
    if extra:
        raise ReportRejected(400, f"report has fields the credential does not cover: {_quote(sorted(extra))}")
    node = env.get("node")
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise ReportRejected(400, f"report field 'node' must be a hostname, got {_quote(node)}")
    doc = env.get("report")
    if not isinstance(doc, dict):
        raise ReportRejected(400, f"report field 'report' must be a JSON object, got {type(doc).__name__}")
    cred = env.get("credential")
    return node, doc, cred


def _canonical_digest(node: str, doc: dict[str, Any]) -> bytes:
    try:
        return payload_digest(node, doc)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ReportRejected(400, f"report from {node!r} is not canonical JSON: {str(exc)[:80]}") from None


def verify_report(
    body: bytes,
    *,
    socket: str | None,
    node_addrs: Mapping[str, str],
    now: float,
    allowed_uids: Collection[int] = (0,),
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    decode: Callable[[str, str | None], munge.Decoded] = munge.decode,
) -> VerifiedReport:
    """Controller side: the checked report in `body`, or ReportRejected (see the module docstring for
    every status). `socket` is the controller's munged; `node_addrs` maps each node name to the address
    its munged encodes as (its --origin / NodeAddr); `now` is the controller's clock (epoch seconds)."""
    node, doc, cred = parse_envelope(body, max_bytes)
    expected_addr = node_addrs.get(node)
    if expected_addr is None:
        raise ReportRejected(403, f"report claims node {node!r}, which the controller does not know")
    if cred is None:
        raise ReportRejected(401, f"report from {node!r} carries no credential")
    if not isinstance(cred, str) or not cred.startswith("MUNGE:") or len(cred) > MAX_CREDENTIAL_CHARS or not cred.isascii():
        raise ReportRejected(401, f"report from {node!r} carries no MUNGE credential (got {_quote(cred, 24)})")

    # The credential binds the bytes its signer hashed. In a body laid out as sign_report lays it out, those
    # are the bytes after the credential member, and json.loads reads exactly them into the node and report
    # used here: hashing them as sent proves what serialising the parsed report again would, for a fraction
    # of the cost, and a signer vouches only for bytes it signed. Any other layout pays for the canonical
    # digest, and before the decode, so a body that cannot be canonicalised is refused without using up its
    # credential in munged's replay cache.
    sent_digest = sent_payload_digest(body)
    start = len(SPLICED_PREFIX)
    if sent_digest is not None and body[start : start + len(cred) + 2] != cred.encode("ascii") + b'",':
        sent_digest = None  # a later "credential" member is the one json.loads kept: not sign_report's layout
    digest = _canonical_digest(node, doc) if sent_digest is None else None

    try:
        dec = decode(cred, socket)
    except munge.MungeError as exc:
        if exc.code == munge.EMUNGE_CRED_REPLAYED:
            raise ReportRejected(409, f"report from {node!r} replays a credential already used (munged: {exc.message})") from None
        if exc.code == munge.EMUNGE_CRED_EXPIRED:
            raise ReportRejected(401, f"report from {node!r} has an expired credential (munged: {exc.message})") from None
        if exc.code == munge.EMUNGE_CRED_REWOUND:
            raise ReportRejected(401, f"report from {node!r} has a credential encoded in the future; check clock sync (munged: {exc.message})") from None
        if exc.code in _SERVER_SIDE:
            raise ReportRejected(503, f"controller cannot verify the report from {node!r}: its munged failed ({exc.name}: {exc.message})") from None
        raise ReportRejected(401, f"report from {node!r} has an invalid credential ({exc.name}: {exc.message})") from None

    if sent_digest is not None and dec.payload == sent_digest:
        digest = sent_digest
    else:
        if digest is None:
            digest = _canonical_digest(node, doc)
        if dec.payload != digest:
            raise ReportRejected(401, f"report from {node!r} does not match its credential: payload digest differs (tampered or re-used credential)")
    if dec.uid not in allowed_uids:
        allowed = ", ".join(str(u) for u in sorted(allowed_uids)) or "none"
        raise ReportRejected(403, f"report from {node!r} was signed by uid {dec.uid}, not an allowed uid ({allowed}): only root on a node may report")
    if dec.encode_addr != expected_addr:
        raise ReportRejected(
            403,
            f"report claims node {node!r} ({expected_addr}) but its credential was encoded on "
            f"{dec.encode_addr}{_node_of(dec.encode_addr, node_addrs)}: cross-node report refused",
        )
    age = now - dec.encode_time
    if age > max_age_s:
        raise ReportRejected(401, f"report from {node!r} has a credential {age:.0f} s old, over the controller's {max_age_s:.0f} s limit")
    return VerifiedReport(
        node=node,
        report=doc,
        uid=dec.uid,
        gid=dec.gid,
        encode_addr=dec.encode_addr,
        encode_time=dec.encode_time,
        ttl=dec.ttl,
        digest=digest.hex(),
    )
