"""The controller's HTTP endpoint (stdlib ThreadingHTTPServer).

    POST /v1/report   a signed report envelope (healthd.controller.auth); 200 {"accepted": true,
                      "instructions": []} or the refusal's HTTP status with {"accepted": false, "error"}
    POST /v1/request  a signed envelope whose report is {"kind": "drain-request", "node", "finding",
                      "job"} from a prolog in `controller` gating mode; 200 {"granted": bool, "reason"}
    GET  /healthz     200 {"ok": true}

Bodies over 1 MiB are refused with 413 before they are read. The handlers call into a Controller
(healthd.controller.daemon) which bounds every wait on Slurm.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from healthd.controller.auth import DEFAULT_MAX_BYTES

_log = logging.getLogger("healthd.controller.server")


class Handler(Protocol):
    def receive_report(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]: ...

    def receive_request(self, body: bytes, peer: str = "") -> tuple[int, dict[str, Any]]: ...


class _RequestHandler(BaseHTTPRequestHandler):
    server: ControllerHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "healthd-controller"
    timeout = 30  # seconds a client may take to send its request (no slow-loris thread pinning)
    # TCP_NODELAY: headers and body leave as two small writes; with Nagle on, a keep-alive client's
    # delayed ACK held every body back ~40 ms (bench/controller_path.py: 90 reports/s -> 1,600/s)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        _log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/healthz":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": f"no such endpoint {self.path[:80]!r}"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        route = {"/v1/report": self.server.controller.receive_report,
                 "/v1/request": self.server.controller.receive_request}.get(self.path)
        if route is None:
            self.close_connection = True
            self._send(404, {"error": f"no such endpoint {self.path[:80]!r}"})
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            _log.warning("%s %s refused: 411 no Content-Length", self.client_address[0], self.path)
            self._send(411, {"accepted": False, "error": "Content-Length required"})
            return
        length = int(length_text)
        if length > self.server.max_bytes:
            self.close_connection = True  # never read the body
            reason = f"body is {length} bytes, over the {self.server.max_bytes}-byte limit"
            _log.warning("%s %s refused: 413 %s", self.client_address[0], self.path, reason)
            self._send(413, {"accepted": False, "error": reason})
            return
        body = self.rfile.read(length)
        try:
            status, payload = route(body, self.client_address[0])
        except Exception as exc:  # a bug must not kill the server thread silently
            _log.exception("%s %s failed", self.client_address[0], self.path)
            status, payload = 500, {"error": f"internal error: {type(exc).__name__}"}
        self._send(status, payload)


class ControllerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: str, controller: Handler, max_bytes: int = DEFAULT_MAX_BYTES):
        host, _, port = listen.rpartition(":")
        self.controller = controller
        self.max_bytes = max_bytes
        super().__init__((host.strip("[]"), int(port)), _RequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                  name="healthd-controller-http", daemon=True)
        thread.start()
        return thread
