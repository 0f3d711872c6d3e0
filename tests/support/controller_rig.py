"""healthd-controller in-process for end-to-end tests over HTTP: the real Controller behind the real
ControllerHTTPServer on 127.0.0.1 (an ephemeral port), its ledger in a directory of the test's, real
MUNGE on both sides (a MungeFleet: one munged per node plus the controller's) and a fake Slurm
(FakeBackend over the fleet's nodes). Rounds run when the test calls `rig.controller.evaluate(now)`.
With `report_processes`, reports are checked in that many worker processes (the daemon's default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from healthd.controller.config import ControllerSettings
from healthd.controller.daemon import Controller
from healthd.controller.ledger import Ledger
from healthd.controller.policy import ControllerPolicySettings
from healthd.controller.server import ControllerHTTPServer
from healthd.envelope import sign_report
from tests.support.fake_slurm import FakeBackend
from tests.support.wire import post_json


class ControllerRig:
    def __init__(self, fleet: Any, directory: Path, mode: str = "auto", *, backend: FakeBackend | None = None,
                 report_processes: int = 0, **policy: Any):
        self.fleet = fleet
        self.backend = backend if backend is not None else FakeBackend(fleet.nodes)
        self.ledger = Ledger(directory / "ledger.sqlite")
        settings = ControllerSettings(listen="127.0.0.1:0", ledger=str(directory / "ledger.sqlite"),
                                      munge_socket=fleet.controller_socket, node_addrs=fleet.node_addrs,
                                      policy=ControllerPolicySettings(mode=mode, **policy))  # type: ignore[arg-type]
        self.controller = Controller(settings, self.ledger, self.backend)
        if report_processes:  # reports checked in worker processes, as the daemon does by default
            self.controller.start_report_processes(report_processes)
        self.server = ControllerHTTPServer(settings.listen, self.controller)
        self.server.start_background()

    def post(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """POST `body` as it is: (HTTP status, JSON answer)."""
        return post_json(self.server.url + path, body)

    def send(self, path: str, doc: dict[str, Any], node: str, *, signer: str | None = None) -> tuple[int, dict[str, Any]]:
        """POST `doc` in the envelope the agent on `signer` (default `node`) makes, claiming to be `node`."""
        return self.post(path, sign_report(doc, node, self.fleet.socket(signer or node)))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.controller.close()
        self.ledger.close()
