"""What the controller accepts from a node: the state document (`POST /v1/report`) and the drain
request (`POST /v1/request`), checked field by field before anything reaches the report table.

The signed envelope is verified first (healthd.controller.auth: size, JSON, MUNGE); the functions
here check the document inside it. `validate_report` and `validate_request` are pure: they read the
parsed JSON value, change nothing, and either return or raise `ReportInvalid`, whose one-line
message names the path of the first bad field (`findings[3].tier: expected an integer 1-3, found
"1x"`). Nothing else ever escapes them, whatever the input (tests/controller/test_report_schema.py
fuzzes them with arbitrary JSON).

Why so strict: one node's report is read by every control round. A value of the wrong type (a tier
"1x", an action that is a list, a string Python cannot write to SQLite) that passed intake would
fail or slow every round until the report expired, so that no node anywhere would be drained. A
refusal at intake costs only that node's report, with a reason its agent logs.

The allowed values come from the code that writes them: healthd.model (Finding, Component and
Evidence `to_json`, the ATTRIBUTIONS / ACTIONS vocabularies, the sources and component kinds),
healthd.agent.daemon.Agent.document (the top-level sections), healthd.model.would_do, and the Slurm
hooks (job ids are SLURM_JOB_ID digits). Times are RFC 3339 with an offset, as `healthd.model.iso`
writes them, or epoch seconds (accepted before this module existed); both must lie in 1970-2100.

Limits (the README's "What the controller accepts" lists them too), each chosen above what an honest
node produces:

* `MAX_FINDINGS` (256) findings per report. A node with 8 GPUs and 8 HCAs that trips every NVML, IB,
  host and filesystem rule at once has under 200; only a flood of distinct Xid codes on every GPU
  goes past it. The agent keeps the strongest 256 (tier, then action severity) and says how many it
  left out in `findings_dropped` (`fit_report` below).
* `MAX_EVIDENCE` (128) evidence items per finding: the largest honest finding is a GPU with all 18
  NVLinks' four counters rising, 72 items.
* strings: ids and component device names 1,024 characters (a filesystem finding's id carries its
  mount point), summaries 2,048 (the NVLink summary lists every rising counter, ~1,200), evidence
  text and details 4,096 (kernel lines are kept to 2,000), names (uuid, serial, bus id, GPU name)
  256. Every string must be encodable as UTF-8 (a lone surrogate cannot be written to the ledger).
* evidence data (the fields beside `kind` and `text`) and unknown extra fields: JSON values at most
  4 levels deep and 1,024 values per item, object keys up to 128 characters.
* the in-band section (`inband`, training progress per job: healthd.progress's values as the agent
  reads them from the jobs' step records): `MAX_INBAND_JOBS` (64) jobs, `MAX_INBAND_RANKS` (1,024) ranks
  per job entry (and as many stragglers, behind ranks and phases), `MAX_INBAND_WINDOWS` (16) windows
  per rank (the agent keeps `history_windows`, 8 by default), `MAX_INBAND_WAITS` (256) per-step waits
  per window (sent only for jobs under 16 ranks; one per step of a window, 50 by default),
  `MAX_INBAND_CORROBORATION` (8) corroborating lines per rank (summary length) and
  `MAX_INBAND_ERRORS` (32) error lines per job (text length). Ranks are below `MAX_WORLD_SIZE`
  (2^24), a world size -1 (unknown) or up to it, a GPU index -1 (unknown) to `MAX_GPU_INDEX`;
  durations and ages are non-negative and at most `MAX_INBAND_SECONDS`; a wait is such a duration or
  -1 (not recorded); a rank, a window of a rank and a job appear once. Much of it is what a job
  writes in its own step records, so the agent's fit leaves out a job entry that does not pass on
  its own rather than the whole section. An honest node (8 GPUs, a few
  jobs of at most 64 ranks each) sends well under 100 KB of it; when a report would not fit
  `MAX_DOCUMENT_BYTES`, the agent leaves the in-band section out before any finding (`fit_report`).
* the document's size: `MAX_DOCUMENT_BYTES`, the envelope's byte cap (envelope.DEFAULT_MAX_BYTES) less
  room for the envelope itself, so that a document the agent fits to it always travels. The check
  here adds up a lower bound of the canonical JSON length while it walks; the envelope's cap (413,
  before parsing) is the exact one.

Unknown keys: accepted and ignored, but bounded. Each object (the document, a finding, a component,
an evidence item's data, a GPU, a port, ...) may carry at most `MAX_EXTRA_KEYS` keys this controller
does not know, each a bounded JSON value as above. A newer agent may then add a field without every
one of its reports being refused by an older controller, while a document can never smuggle in an
unbounded amount of data. Unknown VALUES of the enumerated fields (tier, action, attribution,
source, component kind, verdict, source status) are refused: the controller decides on them and
cannot guess what a new one means, so a new value needs the controller upgraded before the agents.
Evidence kinds are the one open vocabulary (a short lowercase word): they are shown to operators and
recorded, never decided on.

Cross-field consistency (a `healthy` verdict with a T1 finding) is not checked: policy decides on the
findings, never on the verdict. Duplicate finding ids in one report are refused.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Mapping
from typing import Any, get_args

from healthd.envelope import DEFAULT_MAX_BYTES, MAX_CREDENTIAL_CHARS, NODE_NAME
from healthd.model import ACTION_SEVERITY, ACTIONS, ATTRIBUTIONS, TIERS, TS_MAX, VERDICTS, ComponentKind, Source, Status
from healthd.progress import Phase
from healthd.reason import MAX_REASON_BYTES

# --------------------------------------------------------------------------- the vocabularies
# the agent's own types (healthd.model), so that the two sides cannot drift apart

SOURCES: tuple[str, ...] = get_args(Source)
COMPONENT_KINDS: tuple[str, ...] = get_args(ComponentKind)
SOURCE_STATUSES: tuple[str, ...] = get_args(Status)
GPU_STATES: tuple[str, ...] = ("ok", "lost")
"""healthd.agent.daemon's `gpus[].state`."""
EVIDENCE_KINDS: tuple[str, ...] = ("log_line", "counter", "nvml_value", "probe", "state", "history", "config", "inband")
"""The kinds the agent writes today; any short lowercase word is accepted (see the module doc)."""
REQUEST_KIND = "drain-request"
PHASES: tuple[str, ...] = get_args(Phase)
"""healthd.progress's phases of a rank (`inband.jobs[].ranks[].phase`, a hang's `phases`)."""
STRAGGLER_TESTS: tuple[str, ...] = ("magnitude", "rank-order")
GPU_SOURCES: tuple[str, ...] = ("nvml", "header", "unknown")
"""Where an in-band rank's GPU index comes from (the agent's RankView.gpu_from)."""

# --------------------------------------------------------------------------- the limits

MAX_FINDINGS = 256
MAX_EVIDENCE = 128
MAX_WOULD_DO = MAX_FINDINGS
MAX_GPUS = 64
MAX_PORTS = 256
MAX_SOURCE_ENTRIES = 16
MAX_NO_DATA = 64
MAX_ID_CHARS = 1024
MAX_NAME_CHARS = 256
MAX_SUMMARY_CHARS = 2048
MAX_TEXT_CHARS = 4096
MAX_REASON_CHARS = MAX_REASON_BYTES
"""A would_do reason is the Slurm reason the agent would write (healthd.model.would_do): printable
ASCII, so Slurm's limit in bytes is its limit in characters."""
MAX_SHORT_CHARS = 64
MAX_TIME_CHARS = 64
MAX_KEY_CHARS = 128
MAX_EXTRA_KEYS = 16
MAX_DATA_KEYS = 64
MAX_VALUE_DEPTH = 4
MAX_VALUE_CELLS = 1024
MAX_GPU_INDEX = 1023
MAX_PORT_NUMBER = 255
MAX_XID = 99_999
MAX_COUNT = 2**63 - 1
MAX_PID = 2**31 - 1
MAX_DROPPED = 2**31 - 1
"""2100-01-01: later (or before 1970) is garbage, as the agent's classifier treats it."""
ENVELOPE_RESERVE_BYTES = 16 * 1024
"""Room in the envelope's byte cap for everything but the document: the credential (at most
envelope.MAX_CREDENTIAL_CHARS), the node name and the envelope's own keys."""
MAX_DOCUMENT_BYTES = DEFAULT_MAX_BYTES - ENVELOPE_RESERVE_BYTES
"""The canonical JSON of a document may be at most this long (the agent fits its reports to it)."""
MAX_ERROR_CHARS = 300
MAX_INBAND_JOBS = 64
MAX_INBAND_RANKS = 1024
MAX_INBAND_WINDOWS = 16
MAX_INBAND_WAITS = 256
MAX_INBAND_CORROBORATION = 8
MAX_INBAND_ERRORS = 32
MAX_WORLD_SIZE = 2**24
MAX_INBAND_SECONDS = 1e9
"""Any in-band duration or age (about 31 years): more is a broken clock or garbage."""
MAX_EFFECT = 1e6

assert ENVELOPE_RESERVE_BYTES > MAX_CREDENTIAL_CHARS + 64 + 128

_JOB_ID = re.compile(r"[0-9]{1,20}")
_WORD = re.compile(r"[a-z][a-z0-9_]{0,31}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ReportInvalid(ValueError):
    """A document the controller refuses (HTTP 400). `path` is where (`findings[3].tier`), `reason`
    the whole one-line message, at most MAX_ERROR_CHARS characters."""

    def __init__(self, path: str, problem: str):
        self.path = path
        text = f"{path}: {problem}" if path else problem
        text = " ".join(_CONTROL.sub(" ", text).split())
        if len(text) > MAX_ERROR_CHARS:
            text = text[: MAX_ERROR_CHARS - 3] + "..."
        self.reason = text
        super().__init__(text)


# --------------------------------------------------------------------------- messages


def _show(value: Any) -> str:
    """A short rendering of a found value for a message (never raises, never long)."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if -(10**30) < value < 10**30 else "a very large integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        shown = json.dumps(value[:40])
        return shown + "..." if len(value) > 40 else shown
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return f"an object of {len(value)} key{'' if len(value) == 1 else 's'}"
    return f"a {type(value).__name__}"


def _at(path: str, key: Any) -> str:
    if isinstance(key, str) and len(key) <= 64 and _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    shown = json.dumps(key[:40]) if isinstance(key, str) else _show(key)
    return f"{path}[{shown}]"


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def strength(finding: Mapping[str, Any]) -> tuple[int, int, str]:
    """The order the agent keeps findings in when it must leave some out, strongest first: tier,
    then action severity (as the controller's policy picks its primary finding), then id."""
    tier = finding.get("tier")
    action = finding.get("action")
    fid = finding.get("id")
    return (
        tier if type(tier) is int and tier in TIERS else 9,
        -ACTION_SEVERITY.get(action, -1) if isinstance(action, str) else 1,
        fid if isinstance(fid, str) else "",
    )


# --------------------------------------------------------------------------- the walker


class _Check:
    """One walk over a document. `size` adds up a lower bound of its canonical JSON length."""

    def __init__(self) -> None:
        self.size = 0

    def fail(self, path: str, problem: str) -> ReportInvalid:
        return ReportInvalid(path, problem)

    # -- scalars ---------------------------------------------------------------------------------

    def text(self, v: Any, path: str, limit: int, *, nullable: bool = False, empty: bool = True) -> None:
        if v is None and nullable:
            self.size += 4
            return
        if not isinstance(v, str):
            raise self.fail(path, f"expected a string{' or null' if nullable else ''}, found {_show(v)}")
        if len(v) > limit:
            raise self.fail(path, f"expected at most {limit} characters, found {len(v)}")
        if not empty and not v:
            raise self.fail(path, "expected a non-empty string")
        if not _utf8(v):
            raise self.fail(path, "string is not valid Unicode (a lone surrogate)")
        self.size += len(v) + 2

    def ident(self, v: Any, path: str, limit: int = MAX_ID_CHARS) -> None:
        self.text(v, path, limit, empty=False)
        if _CONTROL.search(v):
            raise self.fail(path, f"control character in {_show(v)}")

    def choice(self, v: Any, path: str, allowed: tuple[Any, ...]) -> None:
        if not isinstance(v, str) or v not in allowed:
            raise self.fail(path, f"expected one of {', '.join(allowed)}, found {_show(v)}")
        self.size += len(v) + 2

    def integer(self, v: Any, path: str, lo: int, hi: int, *, nullable: bool = False) -> None:
        if v is None and nullable:
            self.size += 4
            return
        if type(v) is not int or not lo <= v <= hi:
            null = " or null" if nullable else ""
            raise self.fail(path, f"expected an integer {lo}-{hi}{null}, found {_show(v)}")
        self.size += 1

    def number(self, v: Any, path: str, lo: float, hi: float, *, nullable: bool = False) -> None:
        if v is None and nullable:
            self.size += 4
            return
        if type(v) not in (int, float) or not lo <= v <= hi:  # NaN compares False: refused
            null = " or null" if nullable else ""
            raise self.fail(path, f"expected a number {lo:g}-{hi:g}{null}, found {_show(v)}")
        self.size += 1

    def boolean(self, v: Any, path: str, *, nullable: bool = False) -> None:
        if v is None and nullable:
            self.size += 4
            return
        if v is not True and v is not False:
            raise self.fail(path, f"expected true or false{' or null' if nullable else ''}, found {_show(v)}")
        self.size += 4

    def time(self, v: Any, path: str) -> None:
        """null, epoch seconds, or RFC 3339 with an offset (healthd.model.iso), within 1970-2100."""
        if v is None:
            self.size += 4
            return
        if type(v) in (int, float):
            if 0 <= v <= TS_MAX:
                self.size += 1
                return
            raise self.fail(path, f"expected a time in 1970-2100, found {_show(v)}")
        problem = f"expected an RFC 3339 time with an offset or epoch seconds, found {_show(v)}"
        if not isinstance(v, str) or len(v) > MAX_TIME_CHARS or not v.isascii():
            raise self.fail(path, problem)
        try:
            parsed = _dt.datetime.fromisoformat(v)
            ts = parsed.timestamp() if parsed.tzinfo is not None else None
        except (ValueError, OverflowError, OSError):
            ts = None
        if ts is None or not 0 <= ts <= TS_MAX:
            raise self.fail(path, problem)
        self.size += len(v) + 2

    def job(self, v: Any, path: str) -> None:
        if v is None:
            self.size += 4
            return
        if not isinstance(v, str) or not _JOB_ID.fullmatch(v):
            raise self.fail(path, f"expected a Slurm job id (digits) or null, found {_show(v)}")
        self.size += len(v) + 2

    # -- bounded free JSON (evidence data, unknown keys) ------------------------------------------

    def key(self, k: Any, path: str) -> None:
        if not isinstance(k, str):  # only a Python caller can do this; JSON keys are strings
            raise self.fail(path, f"object key {_show(k)} is not a string")
        if len(k) > MAX_KEY_CHARS:
            raise self.fail(path, f"object key of {len(k)} characters, over {MAX_KEY_CHARS}")
        if not _utf8(k):
            raise self.fail(path, "object key is not valid Unicode (a lone surrogate)")
        self.size += len(k) + 3

    def value(self, v: Any, path: str, depth: int, budget: list[int]) -> None:
        """Any JSON value within MAX_VALUE_DEPTH levels and budget[0] values (shared per item)."""
        budget[0] -= 1
        if budget[0] < 0:
            raise self.fail(path, f"more than {MAX_VALUE_CELLS} values in one item")
        if v is None or v is True or v is False:
            self.size += 4
        elif isinstance(v, str):
            self.text(v, path, MAX_TEXT_CHARS)
        elif type(v) is int:
            if not -(2**63) <= v < 2**63:
                raise self.fail(path, f"integer out of range, found {_show(v)}")
            self.size += 1
        elif type(v) is float:
            if not math.isfinite(v):
                raise self.fail(path, f"expected a finite number, found {_show(v)}")
            self.size += 1
        elif isinstance(v, (list, tuple, dict)):
            if depth >= MAX_VALUE_DEPTH:
                raise self.fail(path, f"nested more than {MAX_VALUE_DEPTH} levels deep")
            if len(v) > budget[0]:
                raise self.fail(path, f"more than {MAX_VALUE_CELLS} values in one item")
            self.size += 2
            if isinstance(v, dict):
                for k, item in v.items():
                    self.key(k, path)
                    self.value(item, _at(path, k), depth + 1, budget)
            else:
                for i, item in enumerate(v):
                    self.value(item, f"{path}[{i}]", depth + 1, budget)
        else:
            raise self.fail(path, f"not a JSON value: {_show(v)}")

    def extra(self, k: Any, v: Any, path: str, seen: int) -> int:
        """An unknown key of an object: accepted and ignored while bounded. Returns the new count."""
        seen += 1
        if seen > MAX_EXTRA_KEYS:
            raise self.fail(path or "report", f"more than {MAX_EXTRA_KEYS} unknown fields")
        self.key(k, path or "report")
        self.value(v, _at(path, k), 1, [MAX_VALUE_CELLS])
        return seen

    # -- objects ---------------------------------------------------------------------------------

    def obj(self, v: Any, path: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(path or "report", f"expected an object, found {_show(v)}")
        self.size += 2
        return v

    def items(self, v: Any, path: str, limit: int, what: str) -> list | tuple:
        if not isinstance(v, (list, tuple)):
            raise self.fail(path, f"expected a list, found {_show(v)}")
        if len(v) > limit:
            raise self.fail(path, f"{len(v)} {what}, over the limit of {limit}")
        self.size += 2 + len(v)
        return v

    def fields(self, v: Any, path: str, spec: Mapping[str, tuple], required: tuple[str, ...]) -> dict:
        """An object whose known keys are checked by `spec` (key -> a rule made by _text, _int, _num,
        _choice, _bool or _call), with `required` keys present and at most MAX_EXTRA_KEYS unknown
        ones. The common cases are decided inline; a value that fails them goes through the full
        check, which raises with its path (paths are only built for a refusal)."""
        doc = self.obj(v, path)
        extras = 0
        size = 0
        for k, item in doc.items():
            rule = spec.get(k) if isinstance(k, str) else None
            if rule is None:
                extras = self.extra(k, item, path, extras)
                continue
            size += len(k) + 3
            kind, a, b, nullable = rule
            if item is None and nullable:
                size += 4
            elif kind == "s":
                if type(item) is str and len(item) <= a and (item or b) and (item.isascii() or _utf8(item)):
                    size += len(item) + 2
                else:
                    self.text(item, f"{path}.{k}" if path else k, a, nullable=nullable, empty=b)
            elif kind == "i":
                if type(item) is int and a <= item <= b:
                    size += 1
                else:
                    self.integer(item, f"{path}.{k}" if path else k, a, b, nullable=nullable)
            elif kind == "c":
                if type(item) is str and item in b:
                    size += len(item) + 2
                else:
                    self.choice(item, f"{path}.{k}" if path else k, a)
            elif kind == "n":
                if (type(item) is float or type(item) is int) and a <= item <= b:
                    size += 1
                else:
                    self.number(item, f"{path}.{k}" if path else k, a, b, nullable=nullable)
            elif kind == "b":
                if item is True or item is False:
                    size += 4
                else:
                    self.boolean(item, f"{path}.{k}" if path else k, nullable=nullable)
            else:
                a(self, item, f"{path}.{k}" if path else k)  # spec keys are plain words
        self.size += size
        for k in required:
            if k not in doc:
                raise self.fail(_at(path, k), "missing")
        return doc

    def component(self, v: Any, path: str) -> None:
        self.fields(v, path, _COMPONENT, ("kind",))

    def evidence_item(self, v: Any, path: str) -> None:
        item = self.obj(v, path)
        if "kind" not in item:
            raise self.fail(_at(path, "kind"), "missing")
        if "text" not in item:
            raise self.fail(_at(path, "text"), "missing")
        if len(item) - 2 > MAX_DATA_KEYS:
            raise self.fail(path, f"{len(item) - 2} data fields, over the limit of {MAX_DATA_KEYS}")
        budget = [MAX_VALUE_CELLS]
        for k, item_v in item.items():
            if k == "kind":
                kind = item_v
                if not isinstance(kind, str) or not _WORD.fullmatch(kind):
                    raise self.fail(_at(path, "kind"), f"expected a short lowercase word such as "
                                    f"{', '.join(EVIDENCE_KINDS[:3])}, found {_show(kind)}")
                self.size += len(kind) + 9
            elif k == "text":
                self.text(item_v, _at(path, "text"), MAX_TEXT_CHARS)
                self.size += 7
            else:
                self.key(k, path)
                self.value(item_v, _at(path, k), 1, budget)

    def evidence(self, v: Any, path: str) -> None:
        for i, item in enumerate(self.items(v, path, MAX_EVIDENCE, "evidence items")):
            self.evidence_item(item, f"{path}[{i}]")

    def finding(self, v: Any, path: str) -> dict:
        return self.fields(v, path, _FINDING, _FINDING_REQUIRED)

    def findings(self, v: Any, path: str) -> None:
        seen: dict[str, int] = {}
        for i, f in enumerate(self.items(v, path, MAX_FINDINGS, "findings")):
            here = f"{path}[{i}]"
            fid = self.finding(f, here)["id"]
            if fid in seen:
                raise self.fail(_at(here, "id"), f"duplicates findings[{seen[fid]}].id {_show(fid)}")
            seen[fid] = i

    def sources(self, v: Any, path: str) -> None:
        doc = self.obj(v, path)
        if len(doc) > MAX_SOURCE_ENTRIES:
            raise self.fail(path, f"{len(doc)} sources, over the limit of {MAX_SOURCE_ENTRIES}")
        for k, item in doc.items():
            if not isinstance(k, str) or not _WORD.fullmatch(k):
                raise self.fail(path, f"source name {_show(k)} is not a short lowercase word")
            self.size += len(k) + 3
            self.fields(item, _at(path, k), _SOURCE, ("status",))

    def gpus(self, v: Any, path: str) -> None:
        for i, g in enumerate(self.items(v, path, MAX_GPUS, "GPUs")):
            self.fields(g, f"{path}[{i}]", _GPU, ("index",))

    def ports(self, v: Any, path: str) -> None:
        for i, p in enumerate(self.items(v, path, MAX_PORTS, "ports")):
            self.fields(p, f"{path}[{i}]", _PORT, ("device", "port"))

    def would_do(self, v: Any, path: str) -> None:
        for i, w in enumerate(self.items(v, path, MAX_WOULD_DO, "requests")):
            self.fields(w, f"{path}[{i}]", _WOULD_DO, ("action", "finding"))

    def no_data(self, v: Any, path: str) -> None:
        for i, name in enumerate(self.items(v, path, MAX_NO_DATA, "names")):
            self.text(name, f"{path}[{i}]", MAX_SHORT_CHARS)

    # -- the in-band section (healthd.progress values, per job) ----------------------------------------

    def waits(self, v: Any, path: str) -> None:
        if v is None:
            self.size += 4
            return
        for i, w in enumerate(self.items(v, path, MAX_INBAND_WAITS, "waits")):
            # -1: a step the rank did not record (healthd.progress.RankWindow.waits)
            if (type(w) is not float and type(w) is not int) or not (0 <= w <= MAX_INBAND_SECONDS or w == -1):
                raise self.fail(f"{path}[{i}]", f"expected a number 0-{MAX_INBAND_SECONDS:g} or -1, found {_show(w)}")
            self.size += 1

    def keyed(self, v: Any, path: str, limit: int, what: str, spec: Mapping[str, tuple], required: tuple[str, ...],
              key: str) -> None:
        """A list of at most `limit` objects checked by `spec`, no two with the same `key`."""
        seen: dict[Any, int] = {}
        for i, item in enumerate(self.items(v, path, limit, what)):
            here = f"{path}[{i}]"
            value = self.fields(item, here, spec, required)[key]
            if value in seen:
                raise self.fail(f"{here}.{key}", f"duplicates {path}[{seen[value]}].{key} {_show(value)}")
            seen[value] = i

    def inband_windows(self, v: Any, path: str) -> None:
        self.keyed(v, path, MAX_INBAND_WINDOWS, "windows", _INBAND_WINDOW, _INBAND_WINDOW_REQUIRED, "window")

    def window_numbers(self, v: Any, path: str) -> None:
        for i, w in enumerate(self.items(v, path, MAX_INBAND_WINDOWS, "windows")):
            self.integer(w, f"{path}[{i}]", 0, MAX_COUNT)

    def rank_numbers(self, v: Any, path: str) -> None:
        for i, r in enumerate(self.items(v, path, MAX_INBAND_RANKS, "ranks")):
            self.integer(r, f"{path}[{i}]", 0, MAX_WORLD_SIZE - 1)

    def short_texts(self, v: Any, path: str, limit: int, chars: int) -> None:
        for i, t in enumerate(self.items(v, path, limit, "strings")):
            self.text(t, f"{path}[{i}]", chars)

    def corroboration(self, v: Any, path: str) -> None:
        self.short_texts(v, path, MAX_INBAND_CORROBORATION, MAX_SUMMARY_CHARS)

    def inband_errors(self, v: Any, path: str) -> None:
        self.short_texts(v, path, MAX_INBAND_ERRORS, MAX_TEXT_CHARS)

    def phases(self, v: Any, path: str) -> None:
        doc = self.obj(v, path)
        if len(doc) > MAX_INBAND_RANKS:
            raise self.fail(path, f"{len(doc)} ranks, over the limit of {MAX_INBAND_RANKS}")
        for k, phase in doc.items():
            if not isinstance(k, str) or not k.isdigit() or not k.isascii() or len(k) > 8 \
                    or int(k) >= MAX_WORLD_SIZE:
                raise self.fail(path, f"key {_show(k)} is not a rank number")
            self.size += len(k) + 3
            self.choice(phase, _at(path, k), PHASES)

    def hang(self, v: Any, path: str) -> None:
        if v is None:
            self.size += 4
            return
        self.fields(v, path, _INBAND_HANG, _INBAND_HANG_REQUIRED)

    def inband_ranks(self, v: Any, path: str) -> None:
        self.keyed(v, path, MAX_INBAND_RANKS, "ranks", _INBAND_RANK, _INBAND_RANK_REQUIRED, "rank")

    def inband_stragglers(self, v: Any, path: str) -> None:
        for i, s in enumerate(self.items(v, path, MAX_INBAND_RANKS, "stragglers")):
            self.fields(s, f"{path}[{i}]", _INBAND_STRAGGLER, _INBAND_STRAGGLER_REQUIRED)

    def job_id(self, v: Any, path: str) -> None:
        if v is None:
            raise self.fail(path, "expected a Slurm job id (digits), found null")
        self.job(v, path)

    def inband_jobs(self, v: Any, path: str) -> None:
        self.keyed(v, path, MAX_INBAND_JOBS, "jobs", _INBAND_JOB, _INBAND_JOB_REQUIRED, "job")

    def inband(self, v: Any, path: str) -> None:
        self.fields(v, path, _INBAND, ("jobs",))

    def node(self, v: Any, path: str) -> None:
        if not isinstance(v, str) or not NODE_NAME.fullmatch(v):
            raise self.fail(path, f"expected a node name (hostname), found {_show(v)}")
        self.size += len(v) + 2


def _text(limit: int, *, nullable: bool = False, empty: bool = True) -> tuple:
    return ("s", limit, empty, nullable)


def _int(lo: int, hi: int, *, nullable: bool = False) -> tuple:
    return ("i", lo, hi, nullable)


def _num(lo: float, hi: float, *, nullable: bool = False) -> tuple:
    return ("n", lo, hi, nullable)


def _choice(allowed: tuple[str, ...]) -> tuple:
    return ("c", allowed, frozenset(allowed), False)


def _bool(*, nullable: bool = False) -> tuple:
    return ("b", None, None, nullable)


def _call(method: Any) -> tuple:
    """A rule checked by `method(check, value, path)` (which adds to the size itself)."""
    return ("f", method, None, False)


_COMPONENT: dict[str, Any] = {
    "kind": _choice(COMPONENT_KINDS),
    "index": _int(0, MAX_GPU_INDEX, nullable=True),
    "uuid": _text(MAX_NAME_CHARS, nullable=True),
    "serial": _text(MAX_NAME_CHARS, nullable=True),
    "bus_id": _text(MAX_NAME_CHARS, nullable=True),
    "device": _text(MAX_ID_CHARS, nullable=True),
    "port": _int(0, MAX_PORT_NUMBER, nullable=True),
}

_FINDING: dict[str, Any] = {
    "id": _call(_Check.ident),
    "component": _call(_Check.component),
    "source": _choice(SOURCES),
    "xid": _int(0, MAX_XID, nullable=True),
    "attribution": _choice(ATTRIBUTIONS),
    "tier": _int(min(TIERS), max(TIERS)),
    "action": _choice(ACTIONS),
    "summary": _text(MAX_SUMMARY_CHARS),
    "evidence": _call(_Check.evidence),
    "count": _int(0, MAX_COUNT),
    "first_seen": _call(_Check.time),
    "last_seen": _call(_Check.time),
    "job": _call(_Check.job),
    "evidence_dropped": _int(0, MAX_DROPPED),
}
_FINDING_REQUIRED = ("id", "component", "source", "attribution", "tier", "action", "summary", "evidence")

_SOURCE: dict[str, Any] = {
    "status": _choice(SOURCE_STATUSES),
    "detail": _text(MAX_TEXT_CHARS, nullable=True),
    "seconds": _num(0.0, 86400.0, nullable=True),
}

_GPU: dict[str, Any] = {
    "index": _int(0, MAX_GPU_INDEX),
    "name": _text(MAX_NAME_CHARS, nullable=True),
    "uuid": _text(MAX_NAME_CHARS, nullable=True),
    "serial": _text(MAX_NAME_CHARS, nullable=True),
    "bus_id": _text(MAX_NAME_CHARS, nullable=True),
    "state": _choice(GPU_STATES),
    "temperature_c": _num(-273.0, 1000.0, nullable=True),
    "margin_c": _num(-1000.0, 1000.0, nullable=True),
    "ecc_uncorrected_volatile": _int(0, MAX_COUNT, nullable=True),
    "remap_pending": _bool(nullable=True),
    "remap_failure": _bool(nullable=True),
    "pcie": _text(MAX_SHORT_CHARS, nullable=True),
    "no_data": _call(_Check.no_data),
}

_PORT: dict[str, Any] = {
    "device": _text(MAX_NAME_CHARS, empty=False),
    "port": _int(0, MAX_PORT_NUMBER),
    "state": _text(MAX_SHORT_CHARS, nullable=True),
    "phys_state": _text(MAX_SHORT_CHARS, nullable=True),
    "rate_gbps": _num(0.0, 1e6, nullable=True),
    "link_layer": _text(MAX_SHORT_CHARS, nullable=True),
}

_AGENT: dict[str, Any] = {
    "version": _text(MAX_SHORT_CHARS),
    "pid": _int(0, MAX_PID, nullable=True),
    "started_at": _call(_Check.time),
    "interval_s": _num(0.0, 86400.0, nullable=True),
    "boot_id": _text(MAX_SHORT_CHARS, nullable=True),
}

_WOULD_DO: dict[str, Any] = {
    "action": _choice(ACTIONS),
    "component": _text(MAX_ID_CHARS),
    "reason": _text(MAX_REASON_CHARS),
    "finding": _call(_Check.ident),
    "tier": _int(min(TIERS), max(TIERS)),
}

_INBAND_WINDOW: dict[str, Any] = {
    "window": _int(0, MAX_COUNT),
    "steps": _int(0, MAX_COUNT),
    "compute_s": _num(0.0, MAX_INBAND_SECONDS),
    "step_s": _num(0.0, MAX_INBAND_SECONDS),
    "wait_s": _num(0.0, MAX_INBAND_SECONDS),
    "waits": _call(_Check.waits),
}
_INBAND_WINDOW_REQUIRED = ("window", "steps", "compute_s", "step_s", "wait_s")

_INBAND_RANK: dict[str, Any] = {
    "rank": _int(0, MAX_WORLD_SIZE - 1),
    "local_rank": _int(0, MAX_WORLD_SIZE - 1, nullable=True),
    "gpu": _int(-1, MAX_GPU_INDEX, nullable=True),
    "gpu_from": _choice(GPU_SOURCES),
    "pid": _int(0, MAX_PID, nullable=True),
    "last_step": _int(-1, MAX_COUNT),
    "last_step_age_s": _num(0.0, MAX_INBAND_SECONDS),
    "phase": _choice(PHASES),
    "phase_age_s": _num(0.0, MAX_INBAND_SECONDS),
    "step_median_s": _num(0.0, MAX_INBAND_SECONDS, nullable=True),
    "longest_save_s": _num(0.0, MAX_INBAND_SECONDS),
    "restored": _int(-1, MAX_COUNT, nullable=True),
    "durable": _int(-1, MAX_COUNT, nullable=True),
    "lost": _int(0, MAX_COUNT),
    "torn": _int(0, MAX_COUNT),
    "rail": _text(MAX_NAME_CHARS, nullable=True),
    "corroboration": _call(_Check.corroboration),
    "windows": _call(_Check.inband_windows),
}
_INBAND_RANK_REQUIRED = ("rank", "last_step", "last_step_age_s", "phase")

_INBAND_STRAGGLER: dict[str, Any] = {
    "rank": _int(0, MAX_WORLD_SIZE - 1),
    "test": _choice(STRAGGLER_TESTS),
    "windows": _call(_Check.window_numbers),
    "effect": _num(-1.0, MAX_EFFECT),
    "threshold": _num(0.0, MAX_EFFECT),
    "last_in": _int(0, MAX_COUNT),
    "of_steps": _int(0, MAX_COUNT),
    "p_value": _num(0.0, 1.0, nullable=True),
}
_INBAND_STRAGGLER_REQUIRED = ("rank", "test", "windows", "effect", "threshold")

_INBAND_HANG: dict[str, Any] = {
    "step": _int(-1, MAX_COUNT),
    "stalled_s": _num(0.0, MAX_INBAND_SECONDS),
    "bound_s": _num(0.0, MAX_INBAND_SECONDS),
    "behind": _call(_Check.rank_numbers),
    "phases": _call(_Check.phases),
}
_INBAND_HANG_REQUIRED = ("step", "stalled_s", "bound_s", "behind")

_INBAND_JOB: dict[str, Any] = {
    "job": _call(_Check.job_id),
    "world_size": _int(-1, MAX_WORLD_SIZE),
    "ranks_here": _int(0, MAX_WORLD_SIZE),
    "step_median_s": _num(0.0, MAX_INBAND_SECONDS, nullable=True),
    "ranks": _call(_Check.inband_ranks),
    "stragglers": _call(_Check.inband_stragglers),
    "hang": _call(_Check.hang),
    "errors": _call(_Check.inband_errors),
}
_INBAND_JOB_REQUIRED = ("job", "ranks")

_INBAND: dict[str, Any] = {"jobs": _call(_Check.inband_jobs)}

_REPORT: dict[str, Any] = {
    "node": _call(_Check.node),
    "verdict": _choice(VERDICTS),
    "generated_at": _call(_Check.time),
    "dry_run": _bool(),
    "agent": _call(lambda c, v, p: c.fields(v, p, _AGENT, ())),
    "sources": _call(_Check.sources),
    "gpus": _call(_Check.gpus),
    "ports": _call(_Check.ports),
    "findings": _call(_Check.findings),
    "would_do": _call(_Check.would_do),
    "findings_dropped": _int(0, MAX_DROPPED),
    "inband": _call(_Check.inband),
}
REPORT_REQUIRED: tuple[str, ...] = ("node", "verdict", "findings")
OPTIONAL_SECTIONS: tuple[str, ...] = tuple(k for k in _REPORT if k not in REPORT_REQUIRED)

_REQUEST: dict[str, Any] = {
    "kind": _choice((REQUEST_KIND,)),
    "node": _call(_Check.node),
    "finding": _call(_Check.finding),
    "job": _call(_Check.job),
}
REQUEST_REQUIRED: tuple[str, ...] = ("kind", "node", "finding")


# --------------------------------------------------------------------------- the entry points


def _guard(run, *args: Any) -> Any:
    """Run a check; anything but ReportInvalid escaping it is a bug here, reported as a refusal
    rather than as an exception out of the HTTP handler."""
    try:
        return run(*args)
    except ReportInvalid:
        raise
    except RecursionError:
        raise ReportInvalid("report", "nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the validator's contract: only ReportInvalid escapes
        raise ReportInvalid("report", f"cannot be checked ({type(exc).__name__})") from None


def _report(doc: Any, node: str | None) -> None:
    if not isinstance(doc, dict):
        raise ReportInvalid("report", f"expected an object, found {_show(doc)}")
    findings = doc.get("findings")
    # the count first: a report of 24,000 findings is refused before any of them is looked at
    if isinstance(findings, (list, tuple)) and len(findings) > MAX_FINDINGS:
        raise ReportInvalid("findings", f"{len(findings)} findings, over the limit of {MAX_FINDINGS}")
    _document(doc, _REPORT, REPORT_REQUIRED, node, "report")


def validate_report(doc: Any, node: str | None = None) -> None:
    """Check a state document (the README's "Output: the JSON document"); raise ReportInvalid naming
    the first bad field. `node`: the node the envelope's credential vouches for; the document must be
    about that node."""
    _guard(_report, doc, node)


def _request(doc: Any, node: str | None) -> None:
    _document(doc, _REQUEST, REQUEST_REQUIRED, node, "request")


def _document(doc: Any, spec: Any, required: Any, node: str | None, what: str) -> None:
    """Every field of a report or request, the node its credential vouches for, its size."""
    check = _Check()
    check.fields(doc, "", spec, required)
    if node is not None and doc["node"] != node:
        raise ReportInvalid("node", f"{what} is for {_show(doc['node'])}, its credential for {_show(node)}")
    if check.size > MAX_DOCUMENT_BYTES:
        raise ReportInvalid("report", f"at least {check.size} bytes of JSON, over the limit of {MAX_DOCUMENT_BYTES}")


def validate_request(doc: Any, node: str | None = None) -> None:
    """Check a prolog's drain request {"kind": "drain-request", "node", "finding", "job"}; raise
    ReportInvalid naming the first bad field."""
    _guard(_request, doc, node)


def validate_finding(doc: Any, path: str = "finding") -> None:
    """Check one finding of the state document's shape; raise ReportInvalid naming the bad field."""
    _guard(_Check().finding, doc, path)


# --------------------------------------------------------------------------- the agent's side


def canonical_size(value: Any) -> int:
    """The length of `value` as envelope.canonical writes it (what the envelope's byte cap counts)."""
    return len(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False))


def _clip(text: str, limit: int) -> str:
    if not _utf8(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fits(run, *args: Any) -> bool:
    try:
        _guard(run, *args)
    except ReportInvalid:
        return False
    return True


def fit_finding(finding: Any) -> Any:
    """A finding trimmed to the limits where trimming keeps its meaning: summary and evidence text
    shortened, evidence beyond MAX_EVIDENCE left out (counted in `evidence_dropped`), evidence data
    that is too big left out (the text stays). Identity and enumerated fields are never changed; a
    finding still invalid after this is for the caller to leave out."""
    if not isinstance(finding, dict):
        return finding
    out = dict(finding)
    if isinstance(out.get("summary"), str):
        out["summary"] = _clip(out["summary"], MAX_SUMMARY_CHARS)
    evidence = out.get("evidence")
    if isinstance(evidence, (list, tuple)):
        kept = []
        for item in evidence:
            if not isinstance(item, dict):
                continue
            item = dict(item)
            if isinstance(item.get("text"), str):
                item["text"] = _clip(item["text"], MAX_TEXT_CHARS)
            if not _fits(_Check().evidence_item, item, "evidence"):
                item = {"kind": item.get("kind"), "text": item.get("text")}
            kept.append(item)
        dropped = len(evidence) - min(len(kept), MAX_EVIDENCE)
        out["evidence"] = kept[:MAX_EVIDENCE]
        if dropped > 0:
            before = out.get("evidence_dropped")
            before = before if type(before) is int and before >= 0 else 0
            out["evidence_dropped"] = min(MAX_DROPPED, before + dropped)
    return out


def fit_report(doc: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The agent's side of the limits: `doc` as the controller will accept it, and a note of what
    was left out ("" when nothing was). A document within the limits is returned unchanged.

    Otherwise: each finding is trimmed (fit_finding) and left out if still invalid; only the
    MAX_FINDINGS strongest are kept (`strength`: tier, then action severity), in their original
    order; then the weakest go until the canonical JSON fits MAX_DOCUMENT_BYTES. `findings_dropped`
    says how many were left out; `would_do` keeps the requests of the kept findings. An optional
    section (agent, sources, gpus, ports, ...) or unknown field that does not fit is left out (the
    controller decides on findings only). What cannot be repaired (a bad node name or verdict) is
    sent as it is, and the controller's refusal says why."""
    doc = dict(doc)
    # a document that validates holds only canonical JSON values: its size can always be taken
    if _fits(_report, doc, None) and canonical_size(doc) <= MAX_DOCUMENT_BYTES:
        return doc, ""
    try:
        return _refit(doc)
    except (TypeError, ValueError) as exc:  # a node or verdict json cannot encode: signing says so
        return doc, f"cannot be fitted: {type(exc).__name__}"


def _fit_inband(section: Any) -> tuple[dict[str, Any], int] | None:
    """The in-band jobs that pass on their own (one job's garbage costs that job only), and how many
    were left out; None when none is left."""
    jobs = section.get("jobs") if isinstance(section, dict) else None
    if not isinstance(jobs, (list, tuple)):
        return None
    kept: list[Any] = []
    seen: set[str] = set()
    for job in jobs:
        if len(kept) < MAX_INBAND_JOBS and _fits(_Check().fields, job, "job", _INBAND_JOB, _INBAND_JOB_REQUIRED) \
                and job["job"] not in seen:
            seen.add(job["job"])
            kept.append(job)
    return ({"jobs": kept}, len(jobs) - len(kept)) if kept else None


def _refit(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    notes: list[str] = []
    out: dict[str, Any] = {}
    extras = 0
    for k, v in doc.items():
        if k in ("findings", "would_do", "findings_dropped"):
            continue
        if k in REPORT_REQUIRED or (k in _REPORT and _fits(_Check().fields, {k: v}, "", {k: _REPORT[k]}, ())):
            out[k] = v
        elif k == "inband" and (kept := _fit_inband(v)) is not None:
            out[k], left_out = kept
            notes.append(f"{left_out} in-band job(s) that do not fit")
        elif k not in _REPORT and extras < MAX_EXTRA_KEYS and _fits(_Check().extra, k, v, "", 0):
            out[k] = v
            extras += 1
        else:
            notes.append(f"field {_at('', k) if isinstance(k, str) else '?'}")
    raw = doc.get("findings")
    raw = list(raw) if isinstance(raw, (list, tuple)) else []
    before = doc.get("findings_dropped")
    dropped = before if type(before) is int and 0 <= before <= MAX_DROPPED else 0
    valid: list[tuple[int, dict]] = []
    ids: set[str] = set()
    invalid = 0
    for i, f in enumerate(raw):
        g = fit_finding(f)
        if not _fits(_Check().finding, g, "finding") or g["id"] in ids:
            invalid += 1
            continue
        ids.add(g["id"])
        valid.append((i, g))
    ranked = sorted(valid, key=lambda pair: strength(pair[1]))
    over = max(0, len(ranked) - MAX_FINDINGS)
    ranked = ranked[:MAX_FINDINGS]

    def assemble(kept: list[tuple[int, dict]]) -> dict[str, Any]:
        result = dict(out)
        result["findings"] = [g for _, g in sorted(kept, key=lambda pair: pair[0])]
        kept_ids = {g["id"] for g in result["findings"]}
        wd = doc.get("would_do")
        if isinstance(wd, (list, tuple)):
            wd = [w for w in wd if isinstance(w, dict) and isinstance(w.get("finding"), str)
                  and w["finding"] in kept_ids and _fits(_Check().fields, w, "would_do", _WOULD_DO, ("action", "finding"))]
            result["would_do"] = wd[:MAX_WOULD_DO]
        left_out = dropped + (len(raw) - len(kept))
        if left_out:
            result["findings_dropped"] = min(MAX_DROPPED, left_out)
        return result

    result = assemble(ranked)
    size = canonical_size(result)
    if size > MAX_DOCUMENT_BYTES and "inband" in out:
        # the controller decides on findings: training progress goes before any finding does
        del out["inband"]
        notes.append("field inband (over the size limit)")
        result = assemble(ranked)
        size = canonical_size(result)
    too_big = 0
    if size > MAX_DOCUMENT_BYTES:
        # leave out the weakest findings until it fits: one canonical size per finding, then a prefix
        sizes = [canonical_size(g) + 1 for _, g in ranked]
        room = MAX_DOCUMENT_BYTES - (size - sum(sizes))
        keep = 0
        while keep < len(ranked) and sizes[keep] <= room:
            room -= sizes[keep]
            keep += 1
        while True:
            result = assemble(ranked[:keep])
            if canonical_size(result) <= MAX_DOCUMENT_BYTES or keep == 0:
                break
            keep = keep * 3 // 4
        too_big = len(ranked) - keep
    if invalid:
        notes.append(f"{invalid} malformed or duplicate finding(s)")
    if over:
        notes.append(f"{over} finding(s) over the limit of {MAX_FINDINGS}")
    if too_big:
        notes.append(f"{too_big} finding(s) over the size limit of {MAX_DOCUMENT_BYTES} bytes")
    return result, "; ".join(notes) or "long text or evidence lists shortened"


def fit_request_finding(finding: Mapping[str, Any]) -> Any:
    """The prolog's finding, trimmed like a report's (fit_finding) so that a drain request is never
    refused for a long evidence list or text."""
    return fit_finding(dict(finding)) if isinstance(finding, Mapping) else finding


__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_EVIDENCE",
    "MAX_FINDINGS",
    "ReportInvalid",
    "fit_finding",
    "fit_report",
    "fit_request_finding",
    "strength",
    "validate_finding",
    "validate_report",
    "validate_request",
]
