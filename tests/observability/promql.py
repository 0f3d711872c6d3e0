"""Metric names a PromQL expression selects: enough of PromQL's lexer for names, not a parser."""

from __future__ import annotations

import re

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?")
_NUMBER_UNIT = re.compile(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+)?[smhdwy]?\b", re.IGNORECASE)


def metric_names(expr: str) -> set[str]:
    s = _STRING.sub('""', expr)
    s = _VARIABLE.sub("1m", s)
    s = _MATCHERS.sub("", s)
    s = _RANGE.sub("", s)
    s = _GROUPING.sub("", s)
    s = _NUMBER_UNIT.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in KEYWORDS:
            continue  # a function, or an operator keyword
        names.add(word)
    return names
