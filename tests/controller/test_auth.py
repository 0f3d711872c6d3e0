"""Report authentication against real munged daemons: one per fake node (origin 127.0.0.N) and one for
the controller, sharing one key (tests/controller/munge_support.py)."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthd import munge
from healthd.controller import auth
from healthd.controller.auth import ReportRejected, verify_report
from healthd.envelope import DEFAULT_MAX_BYTES, payload_digest, sign_report
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
