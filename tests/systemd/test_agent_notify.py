"""The real `healthd run` under the sd_notify protocol: a simulated node (C stand-in NVML, IB tree,
journal files; tests/support/agent_node.py's Node), a NOTIFY_SOCKET this test owns and WATCHDOG_USEC set. READY=1 only
after the first state file; STATUS= lines; WATCHDOG=1 about every half period; then a hung NVML call
stops the feeding while the process lives on and keeps publishing."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.support.agent_node import HEALTHD, Node
from tests.support.fake_nvml import write_nvml_config
from tests.support.sdnotify import watchdog_silence

PERIOD_S = 2.0


@pytest.fixture
def node(tmp_path, fake_nvml_dir):
    n = Node(tmp_path, fake_nvml_dir)
    n.write_config(nvml={"expected_gpus": 8, "call_timeout_s": 0.5})
    yield n
    n.close()


def test_ready_status_watchdog_and_a_hung_nvml_call_stops_the_feeding(node, listener):
    listener.on_message = lambda text: node.state_file.exists()  # observed when each message arrives
    env = {**node.env(), "NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": str(int(PERIOD_S * 1e6))}
    proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready_i, ready = listener.wait_for(lambda m: m.text == "READY=1", 60, "READY=1")
        assert ready.seen is True, "READY=1 arrived before the first state file was written"
        assert node.state()["verdict"] == "healthy"
        texts = listener.texts()
        status = [t for t in texts[:ready_i] if t.startswith("STATUS=")]
        assert status == ["STATUS=verdict healthy, 0 finding(s)"], texts
        assert "WATCHDOG=1" not in texts[:ready_i], "fed the watchdog before READY=1"

        # fed repeatedly, each gap below the period (systemd's own rule), about every period/2
        listener.wait_for(lambda m: len(listener.watchdogs()) >= 5, 60, "5 WATCHDOG=1")
        feeds = listener.watchdogs()
        gaps = [b - a for a, b in zip(feeds, feeds[1:], strict=False)]
        assert max(gaps) < PERIOD_S, gaps
        assert min(gaps) >= PERIOD_S / 2 * 0.9, gaps  # never more often than twice a period

        # NVML hangs in a call (nvmlDeviceGetTemperature of GPU 0 sleeps 10 minutes)
        gpus = node.gpus
        gpus[0]["temperature.sleep_ms"] = 600_000
        write_nvml_config(node.nvml_values, gpus)
        listener.wait_for(lambda m: m.text.startswith("STATUS=") and "stuck: nvml" in m.text, 60,
                          "STATUS naming NVML stuck")
        last_feed = watchdog_silence(listener, lambda: proc.poll() is None, silence_s=3 * PERIOD_S, timeout=90)

        # the loop itself did not hang: the state file is still rewritten, saying why
        before = node.state()["generated_at"]
        deadline = time.monotonic() + 30
        while (doc := node.state()) is None or doc["generated_at"] == before:
            assert time.monotonic() < deadline, "the agent stopped publishing while NVML hung"
            time.sleep(0.1)
        assert doc["sources"]["nvml"]["status"] == "error"
        assert "stuck" in doc["sources"]["nvml"]["detail"]
        assert proc.poll() is None
        assert listener.watchdogs(since=last_feed + 0.001) == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "not feeding the systemd watchdog: nvml stuck" in err, err[-3000:]
    assert listener.texts()[-1] == "STOPPING=1"
