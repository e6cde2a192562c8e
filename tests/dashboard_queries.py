"""Reading the Grafana dashboard's PromQL: which metrics each panel selects, and from which Prometheus jobs.

Shared by tests/unit/test_dashboard.py (the JSON is sound) and tests/integration/test_dashboard.py (every
metric it selects is served by the running system).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "distserve.json"
PROMETHEUS_CONFIGS = (DEPLOY / "prometheus" / "prometheus.yml", DEPLOY / "prometheus" / "local.yml")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# A name not inside a number (1e9) or a Grafana variable ($__range); a function's is followed by "(", a
# selector's by its matchers block, {#i} (see _split_matchers).
_NAME = re.compile(r"(?<![\w.$:#])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?(?:\{#(\d+)\})?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan"}
_JOB = re.compile(r'\bjob\s*(=~|=)\s*"([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Selector:
    """One vector selector of a query: the metric name and the jobs it is restricted to (None: any job)."""

    name: str
    jobs: frozenset[str] | None


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data (rows are layout, not panels), also those nested in collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel.get("targets", [])]


def _jobs(matchers: str) -> frozenset[str] | None:
    """The jobs a matcher list allows: job="x" or a plain alternation job=~"x|y"; None when it names none."""
    match = _JOB.search(matchers)
    if match is None:
        return None
    op, value = match.groups()
    jobs = value.split("|") if op == "=~" else [value]
    assert all(re.fullmatch(r"[a-z_]+", job) for job in jobs), f"job matcher is not a list of names: {value!r}"
    return frozenset(jobs)


def _split_matchers(expr: str) -> tuple[str, list[str]]:
    """The expression with each {matchers} block replaced by {#i} and strings by "", and the blocks' text.
    Strings are skipped while looking for a block's end: they may hold braces (le=~"${slo}")."""
    out, blocks, i = [], [], 0
    while i < len(expr):
        char = expr[i]
        if char == '"':
            i = _STRING.match(expr, i).end()
            out.append('""')
        elif char == "{":
            start = i = i + 1
            while expr[i] != "}":
                i = _STRING.match(expr, i).end() if expr[i] == '"' else i + 1
            blocks.append(expr[start:i])
            out.append(f"{{#{len(blocks) - 1}}}")
            i += 1
        else:
            out.append(char)
            i += 1
    return "".join(out), blocks


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression, e.g. `sum by (le) (rate(x_bucket{job="router"}[5m]))`
    gives [Selector("x_bucket", {"router"})]. Function names, keywords, label names in by(...), ranges,
    numbers (1e9) and Grafana variables are not metrics."""
    text, blocks = _split_matchers(expr)
    text = _GROUPING.sub(" ", _RANGE.sub(" ", text))
    found = []
    for match in _NAME.finditer(text):
        name, call, index = match.groups()
        if call or name.lower() in _KEYWORDS:
            continue
        found.append(Selector(name, _jobs(blocks[int(index)]) if index is not None else None))
    return found


def prometheus_jobs(config: Path) -> set[str]:
    return {job["job_name"] for job in yaml.safe_load(config.read_text())["scrape_configs"]}


def exposed_names(exposition: str) -> set[str]:
    """Series names a /metrics text defines, from its # TYPE lines, so that a metric with no samples yet (a
    histogram never observed, a labelled counter never incremented) still counts: a histogram x defines
    x_bucket, x_count and x_sum; a counter is typed under its x_total name."""
    names = set()
    for line in exposition.splitlines():
        if not line.startswith("# TYPE "):
            continue
        _, _, name, kind = line.split(maxsplit=3)
        if kind == "histogram":
            names |= {name + "_bucket", name + "_count", name + "_sum"}
        elif kind == "summary":
            names |= {name, name + "_count", name + "_sum"}
        else:
            names.add(name)
    return names
