"""deploy/: the Prometheus alerting rules (checked and unit-tested by promtool) and the Grafana
dashboard (its structure, and every expression parsed by Prometheus's own parser).

That the metric names both use are names jobtier exports is checked against a real /metrics
in tests/e2e/test_deploy_metrics.py.
"""

from __future__ import annotations

import copy
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_files import (
    DASHBOARD_VARIABLES,
    RULES,
    RULES_TESTS,
    check_exprs,
    dashboard_exprs,
    dashboard_metric_names,
    load_dashboard,
    load_rules,
    metric_names,
    rule_metric_names,
    run_promtool,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "alerts.md"
GRID_WIDTH = 24  # Grafana's grid is 24 columns wide


# --- the rules -----------------------------------------------------------------------------
def test_promtool_checks_the_rules() -> None:
    done = run_promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in done.stdout


def test_the_rules_pass_their_promtool_tests() -> None:
    done = run_promtool("test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def rules_tests() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    return [case for test in doc["tests"] for case in test["alert_rule_test"]]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    alerts = {rule["alert"] for rule in load_rules()}
    cases = rules_tests()
    # promtool passes a case naming an alert that does not exist, if it expects none
    assert {case["alertname"] for case in cases} <= alerts
    for alert in sorted(alerts):
        mine = [case for case in cases if case["alertname"] == alert]
        assert any(case["exp_alerts"] for case in mine), f"{alert}: no case where it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{alert}: no case where it is quiet"


@pytest.mark.parametrize(
    ("alert", "before", "after"),
    [
        ("JobtierNoWorkers", "(jobtier_workers) < 1", "(jobtier_workers) < 0"),
        ("JobtierHighFailureRate", "or\n", "and\n"),
        ("JobtierQueueBacklog", "unless on (job, queue)", "or on (job, queue)"),
        ("JobtierPersisterDown", 'role=~"persister|run"', 'role="persister"'),
        # a scale-down with nothing waiting, and a paused queue's pool, would fire
        ("JobtierWorkersDropped", "> 120", ">= 0"),
        ("JobtierWorkersDropped", "unless on (job, queue)", "or on (job, queue)"),
        ("JobtierOutboxRefused", "[10m]))) > 0", "[10m]))) >= 0"),
    ],
)
def test_a_broken_rule_fails_its_promtool_tests(
    tmp_path: Path, alert: str, before: str, after: str
) -> None:
    text = RULES.read_text()
    start = text.index(f"alert: {alert}\n")
    end = text.find("- alert:", start)
    rule = text[start:end]
    assert before in rule
    (tmp_path / RULES.name).write_text(text[:start] + rule.replace(before, after) + text[end:])
    shutil.copy(RULES_TESTS, tmp_path / RULES_TESTS.name)
    done = run_promtool("test", "rules", RULES_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0 and f"alertname: {alert}" in done.stdout + done.stderr


def test_alerts_carry_severity_summary_description_and_runbook() -> None:
    docs = DOCS.read_text()
    for rule in load_rules():
        alert = rule["alert"]
        assert alert.startswith("Jobtier") and rule.get("for"), alert
        assert rule["labels"]["severity"] in ("warning", "critical"), alert
        notes = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(notes), alert
        assert "\n" not in notes["runbook"], f"{alert}: a runbook is one line"
        assert re.search(rf"^### {alert}$", docs, re.M), f"docs/alerts.md has no {alert}"
        # the page says the same (and test_docs checks the commands and settings it names)
        assert f"Runbook: {notes['runbook']}" in docs, f"docs/alerts.md: {alert}'s runbook"


def test_metric_names_are_read_out_of_an_expression() -> None:
    expr = """
        sum by (job, queue) (rate(jobtier_a_total{queue=~"x{1,2}", role!="run"}[5m] offset 1h))
        / on (job) group_left (queue) max without (instance) (jobtier_b:ratio)
        > 1e3 and ignoring (le) histogram_quantile(0.95, jobtier_c_bucket[$__rate_interval])
        unless absent(jobtier_d) or bool 2
    """
    assert metric_names(expr) == {"jobtier_a_total", "jobtier_b:ratio", "jobtier_c_bucket"} | {
        "jobtier_d"
    }


def test_the_rules_and_the_dashboard_use_jobtier_metrics_only() -> None:
    used = rule_metric_names(load_rules()) | dashboard_metric_names(load_dashboard())
    assert used and all(name.startswith("jobtier_") for name in used), sorted(used)


# --- the dashboard -------------------------------------------------------------------------
def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """What is wrong with a dashboard's structure (nothing: an empty list)."""
    problems: list[str] = []
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        problems.append("schemaVersion missing or older than Grafana 9's")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource":
        problems.append("no datasource variable")
    panels = dashboard.get("panels", [])
    if not panels:
        problems.append("no panels")
    ids = [panel.get("id") for panel in panels]
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        problems.append(f"panel ids not unique integers: {ids}")
    boxes: list[tuple[str, dict[str, int]]] = []
    for panel in panels:
        where = f"panel {panel.get('id')} ({panel.get('title')})"
        pos = panel.get("gridPos", {})
        if not all(isinstance(pos.get(k), int) for k in "xywh"):
            problems.append(f"{where}: no gridPos")
            continue
        if pos["x"] < 0 or pos["y"] < 0 or pos["w"] < 1 or pos["h"] < 1:
            problems.append(f"{where}: gridPos out of the grid")
        if pos["x"] + pos["w"] > GRID_WIDTH:
            problems.append(f"{where}: wider than the grid")
        for other, box in boxes:
            if (
                pos["x"] < box["x"] + box["w"]
                and box["x"] < pos["x"] + pos["w"]
                and pos["y"] < box["y"] + box["h"]
                and box["y"] < pos["y"] + pos["h"]
            ):
                problems.append(f"{where} overlaps {other}")
        boxes.append((where, pos))
        targets = panel.get("targets", [])
        sources = [panel.get("datasource")] + [t.get("datasource") for t in targets]
        if any(source != {"type": "prometheus", "uid": "${datasource}"} for source in sources):
            problems.append(f"{where}: a data source other than the datasource variable")
        if not targets or not all(t.get("expr") for t in targets):
            problems.append(f"{where}: a panel without a query")
        for target in targets:
            for name in re.findall(r"\$\{?(\w+)", target.get("expr", "")):
                if name not in variables and f"${name}" not in DASHBOARD_VARIABLES:
                    problems.append(f"{where}: ${name} is no variable of the dashboard")
    return problems


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()  # valid JSON, or this raises
    assert dashboard_problems(dashboard) == []
    assert {"job", "queue"} <= {v["name"] for v in dashboard["templating"]["list"]}


def _drop_datasource_variable(d: dict[str, Any]) -> None:
    d["templating"]["list"] = [v for v in d["templating"]["list"] if v["type"] != "datasource"]


BREAKAGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "not unique": lambda d: d["panels"][1].update(id=d["panels"][0]["id"]),
    "overlaps": lambda d: d["panels"][1].update(gridPos=dict(d["panels"][0]["gridPos"])),
    "no gridPos": lambda d: d["panels"][2].pop("gridPos"),
    "wider than the grid": lambda d: d["panels"][3]["gridPos"].update(x=20, w=8),
    "no datasource variable": _drop_datasource_variable,
    "a data source other": lambda d: d["panels"][4].update(datasource={"uid": "prod"}),
    "is no variable": lambda d: d["panels"][5]["targets"][0].update(expr="jobtier_workers{a='$x'}"),
    "schemaVersion": lambda d: d.pop("schemaVersion"),
}


@pytest.mark.parametrize("problem", sorted(BREAKAGES))
def test_each_dashboard_check_catches_its_breakage(problem: str) -> None:
    broken = copy.deepcopy(load_dashboard())
    BREAKAGES[problem](broken)
    assert any(problem in found for found in dashboard_problems(broken))


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    exprs = dashboard_exprs(load_dashboard())
    assert exprs and not [e for _, e in exprs if "$" in e]  # every variable stood in for
    done = check_exprs(exprs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # and the same check refuses one that does not parse
    done = check_exprs([*exprs, ("broken", "sum(rate(jobtier_workers[5m])")], tmp_path)
    assert done.returncode != 0
