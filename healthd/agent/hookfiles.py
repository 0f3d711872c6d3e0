"""The agent's side of the hooks' files, applied to each classification before it is published:

- quick-check results (`<run_dir>/checks.json`, re-read only when its mtime or size changed) become
  findings (healthd.checks) merged into the classification, verdict and would_do recomputed;
- job bindings (`<run_dir>/jobs/*.json`, `jobs/done/*.json`) set `Finding.job` on GPU findings.

Only reads: the agent never writes the hooks' files (and in dry-run writes nothing at all). Only
trusted files are read -- owned by root and writable by neither group nor others, in a directory that
is the same, no link followed below the run directory (healthd.trusted) -- since anyone who could
plant a checks file could fail the node, and a binding charge another user's job; anything else is
ignored with one log line naming the path, the owner and the mode.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Iterable

from healthd.agent.classify.rules import quick_check
from healthd.bindings import BindingReader, attach_jobs
from healthd.checks import CHECKS_FILE, MAX_RESULTS
from healthd.model import NODE, Evidence, Finding, verdict, would_do
from healthd.lograte import WarnOnce
from healthd.text import clean, iso, parse_time
from healthd.trusted import SMALL_MAX_BYTES, TRUSTED_UID, TrustedDir, json_object, read_fd

log = logging.getLogger("healthd")


class HookFiles:
    def __init__(self, trusted_uid: int = TRUSTED_UID) -> None:
        self.trusted_uid = trusted_uid
        self.bindings = BindingReader(trusted_uid)
        self._checks_key: tuple[str, int, int, int, int, int] | None = None
        self._checks_doc: Any = None
        self._warn_once = WarnOnce(log)

    def checks_doc(self, run_dir: str) -> Any:
        """The checks document, re-read only when the file changed; None when absent, unusable or
        not trusted."""
        path = os.path.join(run_dir, CHECKS_FILE)
        try:
            with TrustedDir(run_dir, trusted_uid=self.trusted_uid) as d:
                fd, st = d.open_file(CHECKS_FILE)
                try:
                    key = (path, st.st_mtime_ns, st.st_size, st.st_ino, st.st_uid, st.st_mode)
                    if key == self._checks_key:
                        return self._checks_doc
                    self._checks_key, self._checks_doc = key, None
                    self._checks_doc = json_object(read_fd(fd, st, SMALL_MAX_BYTES, path))
                finally:
                    os.close(fd)
        except FileNotFoundError:
            self._checks_key, self._checks_doc = None, None
        except OSError as e:  # not trusted, a link, not a regular file, too large: looked at again next tick
            self._warn_once(f"quick-check results {path} unreadable ({clean(e, 300)}); ignored")
            self._checks_key, self._checks_doc = None, None
        except (ValueError, UnicodeDecodeError) as e:  # unparsable: re-read once it changes
            self._warn_once(f"quick-check results {path} unreadable ({clean(e, 300)}); ignored")
            self._checks_doc = None
        return self._checks_doc

    def apply(self, classification: Any, now: float, settings: Any) -> Any:
        try:
            return self._apply(classification, now, settings)
        except Exception:  # noqa: BLE001 - the hooks' files must never stop the agent publishing
            log.exception("applying the hooks' files failed; publishing the classification without them")
            return classification

    def _apply(self, classification: Any, now: float, settings: Any) -> Any:
        run_dir = settings.hooks.run_dir
        doc = self.checks_doc(run_dir)
        if doc is not None:
            extra, problem = findings_from_checks(doc, settings.node_name, now, settings.classify.finding_ttl_s)
            if problem:
                self._warn_once(f"quick-check results ignored: {problem}")
            classification = merge(classification, extra)
        bindings = self.bindings.read(run_dir, settings.node_name, self._warn_once)
        if bindings:
            classification = replace(classification, findings=attach_jobs(classification.findings, bindings))
        return classification


def findings_from_checks(doc: Any, node: str, now: float, ttl_s: float) -> tuple[tuple[Any, ...], str]:
    """(findings, problem): failed, current results of a checks document for `node` as Findings.
    `problem` is '' or why the document was ignored as a whole."""
    if not isinstance(doc, dict):
        return (), "checks document is not an object"
    if doc.get("node") != node:
        return (), f"checks file is for node {clean(repr(doc.get('node')), 80)}, not {node}"
    results = doc.get("results")
    if not isinstance(results, list):
        return (), "checks document has no results list"
    out: dict[str, Any] = {}
    for r in results[:MAX_RESULTS]:
        if not isinstance(r, dict) or r.get("ok") is not False or not isinstance(r.get("name"), str):
            continue
        t = parse_time(r.get("time"))
        if t is None or now - t > ttl_s or t - now > ttl_s:
            continue
        name = clean(r["name"], 40)
        fid, rule = quick_check(name)
        detail = clean(r.get("detail") or "failed", 200)
        source = clean(r.get("source") or "hook", 40)
        out[fid] = Finding(
            id=fid,
            component=NODE,
            source="host",
            attribution=rule.attribution,  # type: ignore[arg-type]
            tier=rule.tier,  # type: ignore[arg-type]
            action=rule.action,  # type: ignore[arg-type]
            summary=f"quick check {name} failed: {detail}",
            evidence=(Evidence("probe", f"{source} at {iso(t)}: {name} failed: {detail}",
                               {"check": name, "ok": False, "detail": detail, "by": source, "time": iso(t)}),),
            first_seen=t,
            last_seen=t,
        )
    return tuple(out.values()), ""


def merge(classification: Any, extra: Iterable[Any]) -> Any:
    """A Classification with `extra` findings added (a classifier finding with the same id wins),
    its verdict and would_do recomputed."""
    ids = {f.id for f in classification.findings}
    extra = [f for f in extra if f.id not in ids]
    if not extra:
        return classification
    findings = tuple(sorted((*classification.findings, *extra), key=lambda f: (f.tier, f.id)))
    return replace(classification, findings=findings, verdict=verdict(findings, unreadable=classification.verdict == "unknown"),
                   would_do=would_do(findings))
