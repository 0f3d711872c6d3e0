"""healthd.fastjson is the json package's loads and compact dumps, without importing it: the same
values, the same output bytes, the same errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from healthd import fastjson

DOCS = [
    {}, [], 0, -1, 1.5, 1e300, -0.0, True, False, None, "", "é ☃ \u2028 \x00 \U0001f600", "\ud800",
    {"a": [1, 2, {"b": None}], "c": "d", "n": 12345678901234567890, "f": 0.1},
    {"nested": [[[[[]]]]], "k\u00e9y": {"x": [True, False]}},
    {"evidence": [{"kind": "log_line", "text": "NVRM: Xid 13 " + "x" * 5000}] * 20},
    [float("inf"), float("-inf")],
]


@pytest.mark.parametrize("doc", DOCS)
def test_dumps_compact_is_json_dumps_and_loads_reads_it_back(doc: object) -> None:
    text = fastjson.dumps_compact(doc)
    assert text == json.dumps(doc, separators=(",", ":"))
    assert repr(fastjson.loads(text)) == repr(json.loads(text))
    assert repr(fastjson.loads(text.encode("utf-8", "surrogatepass"))) == repr(json.loads(text.encode("utf-8", "surrogatepass")))


@pytest.mark.parametrize("data", [
    "  {\"a\": 1}\n\t", b"[1, 2]\r\n", "NaN", "[NaN, -Infinity]", b'"\\ud800"', b"\xef\xbb\xbf{}",
    "{\"a\": 1, \"a\": 2}", '{"x": 1.0e-5}', "[" * 50 + "]" * 50,
    '{"a": 1} x', "", "   ", "{", "[1,]", "{'a': 1}", b"\xff\xfe{\x00}\x00", b"\x80abc", "\ufeff{}",
    b'{"a": "\xc3"}', '{"a": "\x01"}', "tru", "1 2",
])
def test_loads_is_json_loads_values_and_errors(data: str | bytes) -> None:
    try:
        want = json.loads(data)
    except ValueError as e:
        with pytest.raises(type(e)) as got:
            fastjson.loads(data)
        assert str(got.value) == str(e)
        return
    got = fastjson.loads(data)
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert repr(got) == repr(want)


def test_what_json_cannot_write_fails_alike() -> None:
    for bad in ({"s": {1, 2}}, {"b": b"x"}, {(1, 2): 3}):
        with pytest.raises(TypeError) as want:
            json.dumps(bad, separators=(",", ":"))
        with pytest.raises(TypeError) as got:
            fastjson.dumps_compact(bad)
        assert str(got.value) == str(want.value)
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        fastjson.dumps_compact(loop)
    assert fastjson.dumps_compact([1]) == "[1]"  # and the next call is not confused by the last one


def test_bad_documents_fail_like_json_in_a_process_that_never_imported_json() -> None:
    code = ("import sys\nfrom healthd import fastjson\nassert 'json' not in sys.modules\n"
            "for bad in (b'{\"a\": [1, 2', b'', b'[1,]', b'{} x', '\\ufeff{}'):\n"
            "    try:\n        fastjson.loads(bad)\n    except ValueError as e:\n        print(type(e).__name__, e)\n"
            "    else:\n        print('parsed', bad)\n")
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert p.returncode == 0, p.stderr
    want = []
    for bad in (b'{"a": [1, 2', b"", b"[1,]", b"{} x", "\ufeff{}"):
        try:
            json.loads(bad)
        except ValueError as e:
            want.append(f"{type(e).__name__} {e}")
    assert p.stdout.splitlines() == want
