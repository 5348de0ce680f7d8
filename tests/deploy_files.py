"""deploy/: the Prometheus rules and the Grafana dashboard as the tests read them, and the
metric names their PromQL expressions use (tests/unit/test_deploy_alerts.py,
tests/e2e/test_deploy_metrics.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "jobtier-alerts.yml"
RULES_TESTS = ROOT / "deploy" / "prometheus" / "jobtier-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "jobtier-dashboard.json"

# what the dashboard's variables stand for when its expressions are checked outside Grafana
DASHBOARD_VARIABLES = {
    "$__rate_interval": "5m",
    "$job": "jobtier",
    "$queue": ".*",
}
# names Prometheus itself makes (not jobtier's), which a rule may use
PROMETHEUS_OWN = {"up"}

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_KEYWORDS |= {"by", "without", "on", "ignoring", "group_left", "group_right"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBERS = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)")
_OFFSETS = re.compile(r"\boffset\s+-?\w+")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers once strings, label
    matchers, ranges, label lists, numbers and offsets are taken out, less the functions and
    aggregations (an identifier before ``(``) and the operators spelt as words."""
    text = _STRING.sub('""', expr)
    for pattern in (_MATCHERS, _RANGES, _LABEL_LISTS, _OFFSETS, _NUMBERS):
        text = pattern.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        if text[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def load_rules(path: Path = RULES) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def rules_test_series_labels() -> dict[str, set[frozenset[str]]]:
    """The label names of each metric the rules' tests feed promtool (less the scrape's own
    ``job`` and ``instance``): metric -> the label-name sets its input series have."""
    doc = yaml.safe_load(RULES_TESTS.read_text())
    out: dict[str, set[frozenset[str]]] = {}
    for test in doc["tests"]:
        for series in test["input_series"]:
            m = re.fullmatch(r"([\w:]+)(?:\{(.*)\})?", series["series"])
            assert m is not None, series["series"]
            names = frozenset(re.findall(r'(\w+)="', m.group(2) or "")) - {"job", "instance"}
            out.setdefault(m.group(1), set()).add(names)
    return out


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) of every panel target, the variables replaced."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in sorted(DASHBOARD_VARIABLES.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(name, value)
            out.append((f"panel {panel['id']} ({panel['title']}) {target['refId']}", expr))
    return out


def rule_metric_names(rules: list[dict[str, Any]]) -> set[str]:
    return {name for rule in rules for name in metric_names(rule["expr"])} - PROMETHEUS_OWN


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    return {name for _, expr in dashboard_exprs(dashboard) for name in metric_names(expr)}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH: scripts/system-deps.sh installs it (Debian's prometheus)"
        )
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def check_exprs(exprs: list[tuple[str, str]], folder: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on a rules file holding each expression as a recording rule:
    Prometheus's own parser says whether each one parses."""
    rules = [{"record": f"dashboard:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(exprs)]
    path = folder / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return run_promtool("check", "rules", str(path))
