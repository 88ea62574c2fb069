"""The metric names a PromQL expression reads: for checking dashboards/*.json and
dashboards/alerts.yml against the names an endpoint exports."""

from __future__ import annotations

import re

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not its functions, label names,
    label values or ranges)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if m.group() not in _PROMQL_WORDS and not expr[m.end() :].lstrip().startswith("("):
            names.add(m.group())
    return names
