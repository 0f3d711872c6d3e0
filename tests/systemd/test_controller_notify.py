"""The real `healthd-controller` under the sd_notify protocol, on the real local Slurm cluster and
munged fleet (tests/controller). READY=1 only once the ledger exists and the HTTP server answers;
STATUS= follows mode, breaker and reports; WATCHDOG=1 after rounds, and none while a round is hung
(a stand-in `sinfo`/`scontrol` on PATH that blocks, as a wedged slurmctld does, until the backend's
10 s timeout), while the process stays alive and keeps serving HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from tests.controller.reliability_support import CONTROLLER_BIN, REPO, ControllerProc, signed
from tests.support.slurm_cluster import SAFE_PATH
from tests.support.sdnotify import watchdog_silence

PERIOD_S = 2.0


def hanging_clients(bindir: Path, knob: Path) -> None:
    bindir.mkdir()
    for tool in ("sinfo", "scontrol"):
        real = subprocess.run(["sh", "-c", f"PATH={SAFE_PATH} command -v {tool}"], capture_output=True,
                              text=True, check=True).stdout.strip()
        (bindir / tool).write_text(f"#!/bin/sh\n[ -e {knob} ] && exec sleep 30\nexec {real} \"$@\"\n")
        (bindir / tool).chmod(0o755)


def test_controller_ready_status_and_watchdog_stop_during_a_hung_round(cluster, fleet, listener, tmp_path):
    ctl = ControllerProc(tmp_path, cluster, fleet, mode="observe")
    ctl.write_config()

    def bound() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", ctl.port)) == 0

    listener.on_message = lambda text: (ctl.ledger.exists(), bound()) if text == "READY=1" else None
    knob = tmp_path / "hang"
    hanging_clients(tmp_path / "bin", knob)
    env = {**cluster.env, "PATH": f"{tmp_path / 'bin'}:{SAFE_PATH}", "NOTIFY_SOCKET": listener.address,
           "WATCHDOG_USEC": str(int(PERIOD_S * 1e6))}
    with open(ctl.log, "ab") as log:
        ctl.proc = subprocess.Popen([str(CONTROLLER_BIN), "--config", str(ctl.config), "--interval", "0.5"],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(REPO), start_new_session=True)
    try:
        ready_i, ready = listener.wait_for(lambda m: m.text == "READY=1", 60, "READY=1")
        assert ready.seen == (True, True), "READY=1 before the ledger was open or the HTTP port bound"
        texts = listener.texts()
        assert texts[:ready_i] == ["STATUS=mode observe, breaker closed, 0 report(s)"], texts

        status, _ = ctl.post(signed(fleet, "node01"))
        assert status == 200
        listener.wait_for(lambda m: m.text == "STATUS=mode observe, breaker closed, 1 report(s)", 30,
                          "STATUS with the report")
        listener.wait_for(lambda m: len(listener.watchdogs()) >= 4, 60, "4 WATCHDOG=1")
        feeds = listener.watchdogs()
        assert max(b - a for a, b in zip(feeds, feeds[1:], strict=False)) < PERIOD_S, feeds

        knob.touch()  # the next round blocks in sinfo/scontrol for the backend's 10 s timeout
        last = watchdog_silence(listener, lambda: ctl.alive(), silence_s=1.5 * PERIOD_S, timeout=60)
        assert ctl.alive() and bound(), "the controller stopped serving while its round was hung"
        knob.unlink()
        # the hung call times out, the round returns (Slurm unreachable), feeding resumes
        listener.wait_for(lambda m: m.text == "WATCHDOG=1" and m.at > last, 60, "WATCHDOG=1 after the hang")
        assert any("Slurm unreachable" in t for t in listener.texts() if t.startswith("STATUS=")), listener.texts()
    finally:
        rc = ctl.stop()
    assert rc == 0, ctl.log_text()[-3000:]
    assert listener.texts()[-1] == "STOPPING=1"
    assert os.path.exists(ctl.ledger)
