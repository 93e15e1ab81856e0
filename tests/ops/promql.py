"""Pull metric selectors out of PromQL, and check them against the series of kvpush_prod.metrics.

A small scanner, not a PromQL parser: enough for the expressions we ship (alerts, dashboard,
doc examples). promtool checks their syntax separately.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvpush_prod.metrics import SCRAPE_LABELS, VLLM_LABELS, Series, sample_names
from kvpush_prod.metrics_docs import all_series

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SELECTOR = re.compile(rf"({_NAME})?\s*\{{([^{{}}]*)\}}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_DURATION = re.compile(r"\b\d+(?:ms|[smhdwy])\b")
_NUMBER = re.compile(r"(?<![a-zA-Z_:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(rf"({_NAME})(\s*\()?")
_KEYWORDS = {
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
    "inf",
    "nan",
    "Inf",
    "NaN",
}


@dataclass
class Selector:
    """One metric named in an expression, with its label matchers (label, op, value)."""

    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)


def selectors(expr: str) -> list[Selector]:
    """Every metric selector in ``expr``."""
    found: list[Selector] = []

    def take(m: re.Match[str]) -> str:
        matchers = _MATCHER.findall(m.group(2))
        name = m.group(1)
        if name is None:
            name = next((v for lb, op, v in matchers if lb == "__name__" and op == "="), "")
        # A name directly followed by {...} is a selector, unless it is a function call.
        found.append(Selector(name, [x for x in matchers if x[0] != "__name__"]))
        return " "

    rest = _SELECTOR.sub(take, expr)
    rest = _RANGE.sub(" ", rest)
    rest = _GROUPING.sub(" ", rest)
    rest = _STRING.sub(" ", rest)
    rest = _DURATION.sub(" ", rest)
    rest = _NUMBER.sub(" ", rest)
    for m in _IDENT.finditer(rest):
        name, call = m.group(1), m.group(2)
        if call or name in _KEYWORDS:
            continue
        found.append(Selector(name))
    return [s for s in found if s.name]


def grafana_template_selectors(query: str) -> list[Selector]:
    """Selectors in a Grafana variable query such as ``label_values(metric{...}, label)``."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", query)
    return selectors(m.group(1)) if m else selectors(query)


def _index() -> dict[str, tuple[Series, str]]:
    out: dict[str, tuple[Series, str]] = {}
    for s in all_series():
        for sample in sample_names(s):
            out[sample] = (s, sample[len(s.name) :])
    return out


INDEX = _index()


def problems(expr: str, where: str) -> list[str]:
    """What is wrong with the series and labels ``expr`` names (empty when all is well)."""
    out = []
    sels = selectors(expr)
    if not sels:
        out.append(f"{where}: names no series: {expr!r}")
    for sel in sels:
        if sel.name.startswith("vllm:"):
            continue  # vLLM's own series; the e2e test checks they exist on a real engine
        hit = INDEX.get(sel.name)
        if hit is None:
            out.append(
                f"{where}: {sel.name!r} is not a series of kvpush_prod.metrics "
                "(counters end in _total, histograms in _bucket/_sum/_count)"
            )
            continue
        series, suffix = hit
        allowed = set(series.labels) | set(SCRAPE_LABELS)
        if series.source == "connector":
            allowed |= set(VLLM_LABELS)
        if suffix == "_bucket":
            allowed.add("le")
        for label, op, value in sel.matchers:
            if label not in allowed:
                out.append(
                    f"{where}: {sel.name} has no label {label!r} "
                    f"(labels: {', '.join(sorted(allowed))})"
                )
                continue
            closed = series.allowed(label)
            if closed is None or value.startswith("$"):
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            for v in values:
                if re.fullmatch(r"[a-zA-Z0-9_/.:-]+", v) and v not in closed:
                    out.append(
                        f"{where}: {sel.name}{{{label}}} has no value {v!r} "
                        f"(values: {', '.join(closed)})"
                    )
    return out
