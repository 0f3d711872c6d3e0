"""Stand-ins for healthd-controller's request handling.

`StubController`: the object ControllerHTTPServer calls, for tests of the HTTP server itself (MUNGE
and the ledger play no part): it records what reached it and answers fixed documents.

`VerifyingController`: a small HTTP server on 127.0.0.1 for the agent's and the prolog's side of the
transport: every POST is checked with auth.verify_report against real munged daemons, as the
controller checks it, recorded, and answered."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from healthd.controller import auth


class StubController:
    def __init__(self) -> None:
        self.reports: list[tuple[bytes, str]] = []
        self.requests: list[bytes] = []
        self.request_delay_s = 0.0

    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict]:
        if body == b"boom":
            raise RuntimeError("bug")
        self.reports.append((body, peer))
        return 200, {"accepted": True, "instructions": []}

    def receive_request(self, body: bytes, peer: str = "") -> tuple[int, dict]:
        time.sleep(self.request_delay_s)  # Slurm may take its time: must not stall the loop
        self.requests.append(body)
        return 200, {"granted": True, "reason": "ok"}


class VerifyingController:
    """POST anything: verified against the controller's munged of `fleet` (a MungeFleet) with
    `node_addrs` (default the fleet's own), then answered `answer(path)` on success or the rejection's
    status and reason. `hang=True`: never answers (until close()).

    Recorded: `paths` (every POST), `credentials` (each body's credential field, as sent),
    `verified` (auth.VerifiedReport of each accepted body), `rejections` (each refusal's reason)."""

    def __init__(self, fleet: Any, answer: dict[str, Any] | None = None, *, status: int = 200,
                 node_addrs: Mapping[str, str] | None = None, hang: bool = False, port: int = 0):
        self.fleet = fleet
        self.answer = answer if answer is not None else {"accepted": True, "instructions": []}
        self.status = status
        self.node_addrs = dict(fleet.node_addrs if node_addrs is None else node_addrs)
        self.hang = hang
        self.paths: list[str] = []
        self.credentials: list[Any] = []
        self.verified: list[auth.VerifiedReport] = []
        self.rejections: list[str] = []
        self.got = threading.Condition()
        self.release = threading.Event()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with stub.got:
                    stub.paths.append(self.path)
                    stub.credentials.append(_credential(body))
                if stub.hang:
                    stub.release.wait(30)
                    return
                try:
                    rep = auth.verify_report(body, socket=stub.fleet.controller_socket, node_addrs=stub.node_addrs,
                                             now=time.time())
                except auth.ReportRejected as e:
                    with stub.got:
                        stub.rejections.append(e.reason)
                        stub.got.notify_all()
                    self._answer(e.http_status, {"error": e.reason})
                    return
                with stub.got:
                    stub.verified.append(rep)
                    stub.got.notify_all()
                self._answer(stub.status, stub.answer)

            def _answer(self, status, doc):
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def wait(self, n: int, timeout: float = 10.0) -> list[auth.VerifiedReport]:
        """The verified reports once there are `n` of them (or whatever came within `timeout`)."""
        end = time.monotonic() + timeout
        with self.got:
            while len(self.verified) < n and time.monotonic() < end:
                self.got.wait(0.05)
            return list(self.verified)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _credential(body: bytes) -> Any:
    try:
        return json.loads(body).get("credential")
    except (ValueError, AttributeError):
        return None
