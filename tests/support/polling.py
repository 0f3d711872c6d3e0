"""Small helpers the end-to-end tests (and the demo's harness) share: wait for a condition, read a file
that may not exist yet, scrape a loopback HTTP endpoint, pick a free loopback port."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout: float, what: str = "condition", *, interval: float = 0.2,
         error: type[Exception] = AssertionError, diagnostics: Callable[[], str] | None = None) -> T:
    """Call `predicate` until it returns something truthy and return that; after `timeout` s raise
    `error` naming `what`, with `diagnostics()` appended (the logs that say why)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = ""
            if diagnostics is not None:
                try:
                    extra = "\n" + diagnostics()
                except Exception as exc:  # noqa: BLE001 - diagnostics must not hide the timeout
                    extra = f"\n(diagnostics failed: {exc})"
            raise error(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)


def wait_for(read, ok, timeout: float = 20.0):
    """Poll `read()` until `ok(value)`; the assertion shows the last value read."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = read()
        if value is not None and ok(value):
            return value
        time.sleep(0.1)
    shown = value if isinstance(value, str) else json.dumps(value, default=str)
    raise AssertionError(f"condition not met within {timeout}s; last value: {shown[:2000]}")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def scrape(url: str) -> str | None:
    """GET a loopback URL (never through a proxy from the environment); None when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
