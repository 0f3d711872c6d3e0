"""Signed posts to healthd-controller: the HTTP client both the agent's reporter and the prolog's
drain request use. No proxy from the environment ever applies; every failure is one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from healthd.settings import ControllerClientSettings

REPORT_PATH = "/v1/report"
REQUEST_PATH = "/v1/request"
MAX_RESPONSE_BYTES = 1 << 20

Poster = Callable[[str, bytes, float], tuple[int, bytes]]
"""post(url, body, timeout_s) -> (http status, response body); raises OSError when there is no answer."""


class ControllerUnreachable(OSError):
    """No HTTP answer at all: refused connection, timeout, DNS, reset."""


def urllib_post(url: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
    """POST `body` as JSON with urllib; no proxy from the environment ever applies (ProxyHandler({}))."""
    import urllib.error  # lazy: spared from the hooks' start (only the prolog's drain request posts)
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(MAX_RESPONSE_BYTES)
    except urllib.error.HTTPError as e:
        try:
            data = e.read(MAX_RESPONSE_BYTES)
        except OSError:
            data = b""
        finally:
            e.close()
        return e.code, data
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ControllerUnreachable(f"no answer within {timeout_s:.1f}s") from None
        raise ControllerUnreachable(str(e.reason)) from None
    except TimeoutError:
        raise ControllerUnreachable(f"no answer within {timeout_s:.1f}s") from None
    except (OSError, ValueError) as e:  # resets, a garbled status line
        raise ControllerUnreachable(f"{type(e).__name__}: {e}") from None


def one_line(value: Any, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refusal_reason(status: int, data: bytes) -> str:
    """One line from a refusal body: its JSON 'reason'/'error' when there is one, else the text."""
    text = data.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        for key in ("reason", "error"):
            if isinstance(doc.get(key), str):
                return one_line(doc[key])
    return one_line(text) or f"HTTP {status}"


def request_drain(
    settings: ControllerClientSettings,
    node: str,
    finding: Mapping[str, Any],
    job: str,
    timeout_s: float,
    *,
    post: Poster = urllib_post,
    sign: Callable[..., bytes] | None = None,
) -> tuple[bool, str]:
    """Ask the controller to drain `node` for `finding` before job `job` starts (`hooks.gating:
    controller`). Returns (granted, why): granted only on HTTP 200 with {"granted": true}; every
    other answer, and no answer within timeout_s, is (False, the reason in one line)."""
    if not settings.url:
        return False, "controller.url is not set"
    try:
        from healthd.report_schema import fit_request_finding  # lazy: spared from the hooks' start

        report = {"kind": "drain-request", "node": node, "finding": fit_request_finding(finding), "job": job}
        if sign is not None:
            body = sign(report, node, settings.munge_socket)
        else:
            from healthd import envelope  # lazy: spared from the hooks' start

            body = envelope.sign_report(report, node, settings.munge_socket)
    except Exception as e:  # munged down or refusing, a finding json cannot encode
        return False, f"cannot sign the drain request: {type(e).__name__}: {one_line(e)}"
    url = settings.url.rstrip("/") + REQUEST_PATH
    try:
        status, data = post(url, body, timeout_s)
    except OSError as e:
        return False, f"controller {settings.url} unreachable: {one_line(e)}"
    if status != 200:
        return False, f"controller refused the request: HTTP {status}: {refusal_reason(status, data)}"
    try:
        answer = json.loads(data.decode("utf-8"))
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("granted"), bool):
        return False, f"controller gave no usable answer: {one_line(data[:200].decode('utf-8', 'replace'))}"
    why = one_line(answer.get("reason") or "", 300) or "no reason given"
    return answer["granted"], why
