"""HTTP as the tests speak it to healthd's servers: raw bytes over a socket (so that malformed and
half-sent requests can be sent at all, and the server's exact answer read back), and a plain
urllib POST that returns the status and the JSON answer whatever the status."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


def connect(address: tuple[str, int], *, source: str | None = None, timeout: float = 5.0) -> socket.socket:
    """A TCP connection to `address`, from the loopback address `source` when given (all of
    127.0.0.0/8 is local on Linux: one test can be many peers)."""
    return socket.create_connection(address, timeout=timeout, source_address=(source, 0) if source else None)


def raw_post(path: str, body: bytes, extra: str = "") -> bytes:
    """The bytes of an HTTP/1.1 POST with its Content-Length; `extra` is more header lines, each
    ending in CRLF."""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes] | None:
    """One response off the socket: (status, headers with lower-case names, body); None on EOF
    before any byte. Bytes after the body are an error: no test here pipelines past one answer."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            if not buf:
                return None
            raise AssertionError(f"EOF inside a response head: {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "EOF inside a response body"
        rest += chunk
    assert len(rest) == length, "bytes after the body: pipelining not requested"
    return status, headers, rest


def exchange(address: tuple[str, int], raw: bytes, *, source: str | None = None) -> tuple[int, dict[str, Any]]:
    """Send `raw` on a fresh connection; (status, JSON body) of the one answer."""
    with connect(address, source=source) as sock:
        sock.sendall(raw)
        got = read_response(sock)
        assert got is not None, f"the server closed without answering {raw[:80]!r}"
        status, _, body = got
        return status, json.loads(body)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed the connection (EOF or a reset); False if it sent data instead.
    A server that does neither within the socket's timeout raises TimeoutError."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post_json(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """POST `body` as an agent does (urllib, the whole body sent, no proxy from the environment):
    (HTTP status, JSON answer), for an error status too."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
