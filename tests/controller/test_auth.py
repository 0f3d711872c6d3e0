"""Report authentication against real munged daemons: one per fake node (origin 127.0.0.N) and one for
the controller, sharing one key (tests/controller/munge_support.py)."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd import munge
from healthd.controller import auth
from healthd.controller.auth import ReportRejected, verify_report
from healthd.envelope import (
    DEFAULT_MAX_BYTES,
    SPLICED_PREFIX,
    canonical,
    payload_digest,
    sent_payload_digest,
    sign_report,
)
from tests.controller.munge_support import MungeFleet, _alive, encode_as_user, munged_path

NOBODY = 65534
DOC = {"verdict": "degraded", "findings": [{"code": "xid.79", "gpu": 0, "evidence": "Xid 79 fell off the bus"}], "seq": 7}

pytestmark = pytest.mark.skipif(munged_path() is None, reason="munged not installed (apt-get install munge)")


@pytest.fixture(scope="module")
def fleet():
    with MungeFleet(["node02", "node03"]) as f:
        yield f


def verify(fleet: MungeFleet, body: bytes, **kw) -> auth.VerifiedReport:
    kw.setdefault("now", time.time())
    return verify_report(body, socket=fleet.controller_socket, node_addrs=fleet.node_addrs, **kw)


def rejected(fleet: MungeFleet, body: bytes, **kw) -> ReportRejected:
    with pytest.raises(ReportRejected) as info:
        verify(fleet, body, **kw)
    assert "\n" not in str(info.value)
    return info.value


def envelope(body: bytes, **changes) -> bytes:
    env = json.loads(body)
    env.update(changes)
    return json.dumps(env).encode()


# ---------------------------------------------------------------------------------- the binding


def test_binding_round_trip_reports_origin_uid_and_ttl(fleet):
    cred = munge.encode(b"\x00binary\xffpayload", fleet.socket("node03"), ttl=60)
    dec = munge.decode(cred, fleet.controller_socket)
    assert dec.payload == b"\x00binary\xffpayload"
    assert (dec.uid, dec.gid) == (os.getuid(), os.getgid())
    assert dec.encode_addr == "127.0.0.3"
    assert dec.ttl == 60
    assert abs(dec.encode_time - time.time()) < 5


def test_binding_errors_carry_munge_codes(fleet):
    cred = munge.encode(b"", fleet.socket("node02"))
    munge.decode(cred, fleet.controller_socket)
    with pytest.raises(munge.MungeError) as info:
        munge.decode(cred, fleet.controller_socket)
    assert (info.value.code, info.value.name) == (17, "EMUNGE_CRED_REPLAYED")
    with pytest.raises(munge.MungeError) as info:
        munge.decode("MUNGE:not-a-credential:", fleet.controller_socket)
    assert info.value.code == munge.EMUNGE_BAD_CRED
    assert munge.strerror(munge.EMUNGE_CRED_EXPIRED) == "Expired credential"


# ---------------------------------------------------------------------------------- accepted


def test_valid_report_from_node02_verifies_as_node02(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    got = verify(fleet, body)
    assert got.node == "node02"
    assert got.report == DOC
    assert got.uid == 0 and got.encode_addr == "127.0.0.2"
    assert got.digest == payload_digest("node02", DOC).hex()


def test_signing_is_independent_of_key_order_and_whitespace(fleet):
    body = sign_report({"b": 1, "a": [1.5, "é"]}, "node03", fleet.socket("node03"))
    env = json.loads(body)
    pretty = json.dumps({"credential": env["credential"], "report": {"a": [1.5, "é"], "b": 1}, "node": "node03", "healthd_report": 1}, indent=2, ensure_ascii=False)
    assert verify(fleet, pretty.encode()).report == {"a": [1.5, "é"], "b": 1}


# ---------------------------------------------------------------------------------- the digest as sent


def old_layout(body: bytes) -> bytes:
    """The same envelope as json.dumps writes it in insertion order, the credential last."""
    env = json.loads(body)
    env = {"healthd_report": env["healthd_report"], "node": env["node"], "report": env["report"], "credential": env["credential"]}
    return json.dumps(env, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def spliced(cred: str, payload: bytes) -> bytes:
    """A body laid out as sign_report lays it out, around payload bytes of the caller's choosing."""
    return SPLICED_PREFIX + cred.encode("ascii") + b'",' + payload[1:]


@pytest.fixture
def canonical_calls(monkeypatch) -> list[str]:
    """Counts verify_report's canonical re-serialisations (the fallback digest)."""
    calls: list[str] = []

    def counted(node, doc):
        calls.append(node)
        return payload_digest(node, doc)

    monkeypatch.setattr(auth, "payload_digest", counted)
    return calls


def test_signed_body_is_the_canonical_payload_with_the_credential_spliced_in_first():
    body = sign_report(DOC, "node02", None, encode=lambda payload, socket, ttl=None: "MUNGE:fake:")
    env = json.loads(body)
    assert env == {"healthd_report": 1, "node": "node02", "report": DOC, "credential": "MUNGE:fake:"}
    assert canonical(env) == body  # "credential" sorts first: the whole body is canonical JSON
    assert body == b'{"credential":"MUNGE:fake:",' + canonical({"healthd_report": 1, "node": "node02", "report": DOC})[1:]
    assert sent_payload_digest(body) == payload_digest("node02", DOC)


def test_signed_body_verifies_on_the_digest_as_sent_without_re_serialising(fleet, canonical_calls):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    sent = sent_payload_digest(body)
    assert sent == payload_digest("node02", DOC)
    assert munge.decode(json.loads(body)["credential"], fleet.controller_socket).payload == sent
    body = sign_report(DOC, "node02", fleet.socket("node02"))  # a fresh credential: the one above is used
    got = verify(fleet, body)
    assert (got.node, got.report, got.digest) == ("node02", DOC, sent.hex())
    assert canonical_calls == []


def test_the_same_envelope_in_another_layout_verifies_on_the_canonical_digest(fleet, canonical_calls):
    body = old_layout(sign_report(DOC, "node02", fleet.socket("node02")))
    assert sent_payload_digest(body) is None
    got = verify(fleet, body)
    assert got.report == DOC and got.digest == payload_digest("node02", DOC).hex()
    assert canonical_calls == ["node02"]
    # credential first but the other members out of order: the digest as sent differs, the canonical one matches
    env = json.loads(sign_report(DOC, "node03", fleet.socket("node03")))
    body = spliced(env["credential"], json.dumps({"report": DOC, "node": "node03", "healthd_report": 1}).encode())
    assert sent_payload_digest(body) not in (None, payload_digest("node03", DOC))
    assert verify(fleet, body).report == DOC
    assert canonical_calls == ["node02", "node03"]


@pytest.mark.parametrize("layout", ["spliced", "old"])
def test_one_byte_changed_in_the_report_is_refused_by_both_digests(fleet, canonical_calls, layout):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    body = body if layout == "spliced" else old_layout(body)
    tampered = body.replace(b'"seq":7', b'"seq":8')
    assert tampered != body and json.loads(tampered)["report"]["seq"] == 8
    if layout == "spliced":
        assert sent_payload_digest(tampered) is not None
    exc = rejected(fleet, tampered)
    assert exc.http_status == 401 and "does not match its credential" in exc.reason
    assert canonical_calls == ["node02"]  # the fallback ran, and did not match either


def test_whitespace_around_the_members_falls_back_to_the_canonical_digest(fleet, canonical_calls):
    for k, where in enumerate(("before the comma", "after the comma")):
        body = sign_report({**DOC, "seq": k}, "node02", fleet.socket("node02"))
        end = body.index(b'"', len(SPLICED_PREFIX)) + 1
        spaced = body[:end] + b" " + body[end:] if k == 0 else body[: end + 1] + b" " + body[end + 1 :]
        assert json.loads(spaced) == json.loads(body), where
        # not sign_report's layout: no digest as sent, or one over bytes the credential does not bind
        assert sent_payload_digest(spaced) in (None, hashlib.sha256(b"{ " + body[end + 1 :]).digest()), where
        assert sent_payload_digest(spaced) != payload_digest("node02", {**DOC, "seq": k}), where
        assert verify(fleet, spaced).report == {**DOC, "seq": k}, where
    assert canonical_calls == ["node02", "node02"]


def test_escapes_in_the_credential_fall_back_to_the_canonical_digest(fleet, canonical_calls):
    cred = ""
    while "/" not in cred:  # base64: most credentials have a "/", written \/ below
        body = sign_report(DOC, "node02", fleet.socket("node02"))
        cred = json.loads(body)["credential"]
    for escaped in (body.replace(b"M", b"\\u004d", 1), body.replace(b"/", b"\\/", 1)):  # JSON allows both
        assert escaped != body and json.loads(escaped) == json.loads(body)
        assert sent_payload_digest(escaped) is None
    assert verify(fleet, body.replace(b"/", b"\\/", 1)).report == DOC
    assert canonical_calls == ["node02"]


def test_an_escaped_quote_cannot_move_where_the_credential_member_seems_to_end(fleet):
    # what follows the quote that seems to end the credential parses as part of the credential string
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    forged = SPLICED_PREFIX + b'MUNGE:x\\",\\"healthd_report\\":1}",' + body[body.index(b'",') + 2 :]
    assert json.loads(forged)["credential"].startswith('MUNGE:x",')
    assert sent_payload_digest(forged) is None
    assert rejected(fleet, forged).http_status == 401
    cred_with_quote = sign_report(DOC, "node02", None, encode=lambda payload, socket, ttl=None: 'MUNGE:a"b\\c:')
    assert json.loads(cred_with_quote)["credential"] == 'MUNGE:a"b\\c:'
    assert sent_payload_digest(cred_with_quote) is None


def test_a_later_credential_member_is_not_the_spliced_one(fleet, canonical_calls):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    other = json.loads(sign_report(DOC, "node02", fleet.socket("node02")))["credential"]
    doubled = body[:-1] + b',"credential":"' + other.encode() + b'"}'
    assert json.loads(doubled)["credential"] == other  # json.loads keeps the last
    assert verify(fleet, doubled).report == DOC  # on the canonical digest, as for any other layout
    assert canonical_calls == ["node02"]


def test_a_signer_vouches_for_the_bytes_it_signed(fleet):
    """A spliced body whose payload bytes are not canonical is accepted when its credential binds those
    bytes (only a signer that hashed them can make one), and reads as those bytes say."""
    payload = b'{ "report": {"seq": 7, "verdict": "degraded", "findings": []}, "node": "node02", "healthd_report": 1 }'
    cred = munge.encode(hashlib.sha256(payload).digest(), fleet.socket("node02"))
    got = verify(fleet, spliced(cred, payload))
    assert got.report == {"seq": 7, "verdict": "degraded", "findings": []}
    assert got.digest == hashlib.sha256(payload).hexdigest()


def test_a_number_canonical_json_cannot_carry_is_refused_before_the_credential_is_used(fleet):
    payload = b'{"healthd_report":1,"node":"node02","report":{"t":1e400}}'
    cred = munge.encode(hashlib.sha256(payload).digest(), fleet.socket("node02"))
    old = b'{"healthd_report":1,"node":"node02","report":{"t":-1e400},"credential":"' + cred.encode() + b'"}'
    for body in (spliced(cred, payload), old):
        exc = rejected(fleet, body)
        assert exc.http_status == 400 and "out of range" in exc.reason
    assert munge.decode(cred, fleet.controller_socket).payload == hashlib.sha256(payload).digest()  # not used up


def test_a_body_that_cannot_be_canonicalised_is_refused_before_the_credential_is_used(fleet, monkeypatch):
    body = old_layout(sign_report(DOC, "node02", fleet.socket("node02")))

    def cannot(node, doc):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")

    monkeypatch.setattr(auth, "payload_digest", cannot)
    exc = rejected(fleet, body)
    assert exc.http_status == 400 and "not canonical JSON" in exc.reason
    monkeypatch.undo()
    assert verify(fleet, body).report == DOC  # its credential was not decoded


# ---------------------------------------------------------------------------------- rejected


def test_the_same_credential_twice_is_a_replay(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    verify(fleet, body)
    exc = rejected(fleet, body)
    assert exc.http_status == 409
    assert "replay" in exc.reason


def test_report_claiming_node03_made_on_node02_is_a_cross_node_forgery(fleet):
    body = sign_report(DOC, "node03", fleet.socket("node02"))
    exc = rejected(fleet, body)
    assert exc.http_status == 403
    assert "node03" in exc.reason and "127.0.0.2 (node02)" in exc.reason


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to setuid to nobody")
def test_credential_made_by_a_non_root_user_is_refused(fleet):
    def as_nobody(payload, socket, ttl=None):
        return encode_as_user(payload, socket, NOBODY, NOBODY, ttl=ttl)

    body = sign_report(DOC, "node02", fleet.socket("node02"), encode=as_nobody)
    exc = rejected(fleet, body)
    assert exc.http_status == 403
    assert f"uid {NOBODY}" in exc.reason
    # the same kind of credential is accepted where that uid is allowed (the check is the uid, nothing else)
    body = sign_report(DOC, "node02", fleet.socket("node02"), encode=as_nobody)
    assert verify(fleet, body, allowed_uids=(0, NOBODY)).uid == NOBODY


def test_tampered_report_does_not_match_its_credential(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    exc = rejected(fleet, envelope(body, report={**DOC, "verdict": "healthy"}))
    assert exc.http_status == 401
    assert "digest" in exc.reason


def test_credential_from_another_key_claiming_node02s_origin_is_invalid(fleet):
    with MungeFleet(["node02"]) as rogue:  # its own key, same origin address 127.0.0.2
        body = sign_report(DOC, "node02", rogue.socket("node02"))
    exc = rejected(fleet, body)
    assert exc.http_status == 401
    assert "invalid credential" in exc.reason


def test_expired_credential_is_refused(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"), ttl=1)
    time.sleep(2.2)  # munged: expired once decode time > encode time + ttl (whole seconds)
    exc = rejected(fleet, body)
    assert exc.http_status == 401
    assert "expired" in exc.reason


def test_credential_older_than_the_controllers_limit_is_refused(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    exc = rejected(fleet, body, now=time.time() + 1000)
    assert exc.http_status == 401
    assert "old" in exc.reason


def test_oversized_body_is_413_before_anything_else(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    assert rejected(fleet, body, max_bytes=len(body) - 1).http_status == 413
    assert verify(fleet, body, max_bytes=len(body)).node == "node02"  # the credential was not consumed
    assert rejected(fleet, b" " * (DEFAULT_MAX_BYTES + 1)).http_status == 413


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"\xff\xfe{}",
        b'{"healthd_report": 2, "node": "node02", "report": {}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": true, "node": "node02", "report": {}, "credential": "MUNGE:x:"}',
        b'{"node": "node02", "report": {}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "report": {}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": 2, "report": {}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "../etc\\npasswd", "report": {}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "node02", "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "node02", "report": [], "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "node02", "report": {"t": NaN}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "node02", "report": {"t": 1e400}, "credential": "MUNGE:x:"}',
        b'{"healthd_report": 1, "node": "node02", "report": {}, "credential": "MUNGE:x:", "act": "drain"}',
        b"[" * 100_000,
    ],
)
def test_malformed_body_is_400(fleet, body):
    assert rejected(fleet, body).http_status == 400


@pytest.mark.parametrize("cred", [None, 42, "", "hello", "MUNGE:garbage:", "MUNGE:" + "A" * 200 + ":"])
def test_missing_or_invalid_credential_is_401(fleet, cred):
    env = {"healthd_report": 1, "node": "node02", "report": DOC}
    if cred is not None:
        env["credential"] = cred
    exc = rejected(fleet, json.dumps(env).encode())
    assert exc.http_status == 401


def test_unknown_node_is_403(fleet):
    body = sign_report(DOC, "node09", fleet.socket("node02"))
    exc = rejected(fleet, body)
    assert exc.http_status == 403 and "does not know" in exc.reason


def test_controllers_munged_unreachable_is_503_not_a_client_error(fleet):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    with pytest.raises(ReportRejected) as info:
        verify_report(body, socket=f"{fleet.root}/missing.sock", node_addrs=fleet.node_addrs, now=time.time())
    assert info.value.http_status == 503


@pytest.mark.parametrize(
    ("code", "status"),
    [(munge.EMUNGE_CRED_REWOUND, 401), (munge.EMUNGE_CRED_UNAUTHORIZED, 401), (munge.EMUNGE_SNAFU, 503)],
)
def test_munge_error_codes_map_to_statuses(code, status):
    def decode(cred, socket):
        raise munge.MungeError(code, munge.ERROR_NAMES[code])

    body = sign_report(DOC, "node02", None, encode=lambda payload, socket, ttl=None: "MUNGE:fake:")
    with pytest.raises(ReportRejected) as info:
        verify_report(body, socket=None, node_addrs={"node02": "127.0.0.2"}, now=0, decode=decode)
    assert info.value.http_status == status


# ---------------------------------------------------------------------------------- never a crash

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_only_ever_raise_report_rejected(fleet, body):
    with pytest.raises(ReportRejected) as info:
        verify(fleet, body, max_bytes=2048)
    assert 400 <= info.value.http_status < 500 and "\n" not in str(info.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@SETTINGS
@given(
    node=st.one_of(st.sampled_from(["node02", "node03", "node09"]), st.text(max_size=12)),
    report=json_values,
    cred=st.one_of(json_values, st.text(max_size=300).map(lambda s: "MUNGE:" + s)),
    version=st.sampled_from([1, 1, 1, 0, "1", None]),
)
def test_arbitrary_envelopes_only_ever_raise_report_rejected(fleet, node, report, cred, version):
    body = json.dumps({"healthd_report": version, "node": node, "report": report, "credential": cred}).encode()
    with pytest.raises(ReportRejected) as info:
        verify(fleet, body)
    assert 400 <= info.value.http_status < 500 and "\n" not in str(info.value)


@SETTINGS
@given(st.one_of(
    st.binary(max_size=512),
    st.tuples(st.binary(max_size=64), st.sampled_from([b'"', b'",', b'\\",', b'" ,']), st.binary(max_size=64),
              st.sampled_from([b"", b"}"])).map(lambda t: SPLICED_PREFIX + b"".join(t)),
))
def test_the_digest_as_sent_never_raises(body):
    got = sent_payload_digest(body)
    assert got is None or (type(got) is bytes and len(got) == 32)
    assert sent_payload_digest(bytearray(body)) == got == sent_payload_digest(memoryview(body))
    if got is not None:
        end = body.index(b'"', len(SPLICED_PREFIX))
        assert b"\\" not in body[len(SPLICED_PREFIX) : end] and body.endswith(b"}")
        assert got == hashlib.sha256(b"{" + body[end + 2 :]).digest()


# ---------------------------------------------------------------------------------- the daemons


def test_fleet_stops_its_daemons_by_pid():
    f = MungeFleet(["node02"]).start()
    pids = f.pids()
    root = f.root
    assert all(_alive(p) for p in pids.values())
    f.stop()
    assert not any(_alive(p) for p in pids.values())
    assert not root.exists()


@SETTINGS
@given(data=st.data())
def test_mutated_real_credentials_are_refused_not_crashes(fleet, data):
    body = sign_report(DOC, "node02", fleet.socket("node02"))
    env = json.loads(body)
    cred = env["credential"]
    i = data.draw(st.integers(min_value=len("MUNGE:"), max_value=len(cred) - 1), label="position")
    ch = data.draw(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=:"), label="char")
    mutated = cred[:i] + ch + cred[i + 1 :]
    env["credential"] = mutated
    try:
        got = verify(fleet, json.dumps(env).encode())
    except ReportRejected as exc:
        assert exc.http_status in (400, 401, 403, 409) and "\n" not in str(exc)
    else:  # only a no-op substitution (or one base64 ignores) may still verify, and then as the original
        assert got.node == "node02" and got.report == DOC and got.encode_addr == "127.0.0.2"


def test_binding_refuses_a_non_ascii_or_nul_credential_without_calling_munged():
    for cred in ("MUNGE:é:", "MUNGE:\x00:", b"MUNGE:\x00:"):
        with pytest.raises(munge.MungeError) as info:
            munge.decode(cred, "/nonexistent/socket")
        assert info.value.code == munge.EMUNGE_BAD_CRED
