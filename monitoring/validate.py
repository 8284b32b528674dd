#!/usr/bin/env python3
"""Checks the shipped monitoring assets beyond what promtool sees.

  - every generated YAML file parses (with PyYAML, a real parser, unlike the
    writer in generate.py) to exactly what generate.py meant to write
  - the Grafana alert rules are wired: query, reduce and threshold steps, the
    datasource placeholder, one rule per alert
  - the dashboard is valid JSON with the datasource, namespace and queue
    variables, every panel and query uses ${datasource}, every query is
    narrowed by $namespace and never groups queues without their namespace
  - every metric a query names is in metric-names.txt
  - every runbook_url anchor is a heading of docs/runbook.md
  - every alert has promtool tests that fire, stay quiet, and raise one alert
    from several pods; every alert on a counter has a case with a pod scraped
    twice

Run by scripts/test-monitoring with a Python that has PyYAML. Prints one line
per failed check and exits 1 if there was any.
"""

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# The modules imported from here are small; a __pycache__ beside them would only be litter.
sys.dont_write_bytecode = True

import alerts  # noqa: E402  (found through the path set just above)
import generate  # noqa: E402

DASHBOARD = HERE / "grafana" / "courier-dashboard.json"
RUNBOOK = ROOT / "docs" / "runbook.md"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
DASHBOARD_MUST_SHOW = [
    "courier_deliveries_total",
    "courier_delivery_duration_seconds_bucket",
    "courier_dlq_depth",
    "courier_dlq_oldest_age_seconds",
    "courier_retry_backlog",
    "courier_queue_depth",
    "courier_queue_oldest_age_seconds",
    "courier_in_flight",
    "courier_app_up",
    "courier_policy_generation",
]

failures = []


def fail(message):
    failures.append(message)


# === generated files ===

def check_generated():
    for relative, build in generate.OUTPUTS.items():
        path = HERE / relative
        try:
            parsed = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as err:
            fail(f"monitoring/{relative}: does not parse: {err}")
            continue
        if parsed != build(alerts.ALERTS):
            fail(f"monitoring/{relative}: parses to something other than generate.py built")


def grafana_rules():
    document = yaml.safe_load((HERE / "grafana" / "alert-rules.yaml").read_text())
    if document.get("apiVersion") != 1:
        fail("grafana/alert-rules.yaml: apiVersion must be 1")
    return [rule for group in document.get("groups", []) for rule in group.get("rules", [])]


def check_grafana_rules(rules):
    titles = [rule.get("title") for rule in rules]
    expected = [alert["name"] for alert in alerts.ALERTS]
    if titles != expected:
        fail(f"grafana/alert-rules.yaml: rules {titles} differ from alerts {expected}")
    for rule in rules:
        title = rule.get("title")
        steps = {step["refId"]: step for step in rule.get("data", [])}
        if rule.get("condition") not in steps:
            fail(f"grafana {title}: condition {rule.get('condition')!r} names no step")
            continue
        queries = [s for s in steps.values() if s.get("datasourceUid") != "__expr__"]
        if len(queries) != 1 or queries[0].get("datasourceUid") != alerts.GRAFANA_DATASOURCE_UID:
            fail(f"grafana {title}: needs one query on {alerts.GRAFANA_DATASOURCE_UID}")
        kinds = sorted(s["model"].get("type", "query") for s in steps.values())
        if kinds != ["query", "reduce", "threshold"]:
            fail(f"grafana {title}: steps are {kinds}, expected query, reduce, threshold")
        if steps[rule["condition"]]["model"].get("type") != "threshold":
            fail(f"grafana {title}: the condition must be the threshold step")
        for key in ("summary", "description", "runbook_url"):
            if not rule.get("annotations", {}).get(key):
                fail(f"grafana {title}: annotation {key} is missing")
        if "severity" not in rule.get("labels", {}):
            fail(f"grafana {title}: label severity is missing")


# === dashboard ===

def panels_of(dashboard):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def check_dashboard():
    try:
        dashboard = json.loads(DASHBOARD.read_text())
    except (OSError, ValueError) as err:
        fail(f"grafana/courier-dashboard.json: does not parse: {err}")
        return []
    if dashboard.get("schemaVersion", 0) < 36:
        fail("dashboard: schemaVersion is older than 36")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource", {})
    if source.get("type") != "datasource" or source.get("query") != "prometheus":
        fail("dashboard: needs a datasource variable of type datasource, query prometheus")
    queue = variables.get("queue", {})
    queue_query = queue.get("query", {})
    if isinstance(queue_query, dict):
        queue_query = queue_query.get("query")
    if (queue_query != 'label_values(courier_deliveries_total{namespace=~"$namespace"}, queue)'
            or not queue.get("multi") or not queue.get("includeAll")):
        fail("dashboard: needs a multi, include-all queue variable from courier_deliveries_total "
             "in the chosen namespaces")
    namespace = variables.get("namespace", {})
    namespace_query = namespace.get("query", {})
    if isinstance(namespace_query, dict):
        namespace_query = namespace_query.get("query")
    if (namespace_query != "label_values(courier_build_info, namespace)"
            or not namespace.get("multi") or not namespace.get("includeAll")):
        fail("dashboard: needs a multi, include-all namespace variable from courier_build_info")
    if queue.get("datasource", {}).get("uid") != "${datasource}":
        fail("dashboard: the queue variable's datasource is not ${datasource}")
    ids = [panel.get("id") for panel in panels_of(dashboard)]
    if len(ids) != len(set(ids)):
        fail("dashboard: panel ids are not unique")
    exprs = [queue_query or ""]
    for panel in panels_of(dashboard):
        if panel.get("type") == "row":
            continue
        title = panel.get("title")
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            fail(f"dashboard panel {title!r}: datasource is not ${{datasource}}")
        if not panel.get("targets"):
            fail(f"dashboard panel {title!r}: has no queries")
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("uid") != "${datasource}":
                fail(f"dashboard panel {title!r}: query {target.get('refId')} "
                     "datasource is not ${datasource}")
            expr = target.get("expr", "")
            exprs.append(expr)
            # Same-named queues of two namespaces must not merge, and the
            # namespace variable must narrow every panel.
            if 'namespace=~"$namespace"' not in expr:
                fail(f"dashboard panel {title!r}: query {target.get('refId')} ignores $namespace")
            if "queue" in expr and re.search(r"\bby \((?![^)]*namespace)[^)]*queue", expr):
                fail(f"dashboard panel {title!r}: query {target.get('refId')} groups queues "
                     "without namespace")
    shown = {name for expr in exprs for name in metric_names(expr)}
    for name in DASHBOARD_MUST_SHOW:
        if name not in shown:
            fail(f"dashboard: no panel shows {name}")
    return exprs


# === metric names ===

def metric_names(expr):
    return re.findall(r"\bcourier_[a-z0-9_]+", expr)


def check_metric_names(exprs):
    listed = {
        line.strip()
        for line in (HERE / "metric-names.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for expr in exprs:
        for name in metric_names(expr):
            base = name
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name[: -len(suffix)] in listed:
                    base = name[: -len(suffix)]
            if base not in listed:
                fail(f"{name} is queried but not in monitoring/metric-names.txt: {expr}")


# === runbook ===

def github_anchor(heading):
    """The id GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def check_runbook():
    try:
        text = RUNBOOK.read_text()
    except OSError as err:
        fail(f"docs/runbook.md: {err}")
        return
    anchors = {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}
    for alert in alerts.ALERTS:
        if alert["runbook"] not in anchors:
            fail(f"docs/runbook.md has no heading for #{alert['runbook']} ({alert['name']})")


# === promtool test coverage ===

def check_test_coverage():
    """Each alert needs a case that fires, one that stays quiet, and one where
    several pods' series give exactly one alert."""
    fires, quiet, replicas, doubled = set(), set(), set(), set()
    for path in sorted((HERE / "tests").glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        if "../prometheus/courier-rules.yaml" not in document.get("rule_files", []):
            fail(f"{path.name}: does not test ../prometheus/courier-rules.yaml")
        for group in document.get("tests", []):
            pods = {
                m.group(1)
                for series in group.get("input_series", [])
                for m in [re.search(r'pod="([^"]+)"', series["series"])]
                if m
            }
            # The same series from two scrape jobs: labels equal but for job
            # and instance.
            scraped = [
                re.sub(r',?(job|instance)="[^"]*"', "", series["series"])
                for series in group.get("input_series", [])
            ]
            twice = len(scraped) != len(set(scraped))
            for case in group.get("alert_rule_test", []):
                expected = case.get("exp_alerts") or []
                name = case["alertname"]
                (fires if expected else quiet).add(name)
                if len(pods) > 1 and len(expected) == 1:
                    replicas.add(name)
                if twice:
                    doubled.add(name)
    for alert in alerts.ALERTS:
        name = alert["name"]
        for kind, seen in (("firing", fires), ("quiet", quiet), ("replica", replicas)):
            if name not in seen:
                fail(f"monitoring/tests: no {kind} case for {name}")
        # A counter's rate summed over a pod scraped twice would double.
        if re.search(r"\b(rate|increase)\(", alert["query"]) and name not in doubled:
            fail(f"monitoring/tests: no double-scrape case for {name} (same series from two jobs)")


def main():
    check_generated()
    rules = grafana_rules()
    check_grafana_rules(rules)
    exprs = check_dashboard()
    plain = yaml.safe_load((HERE / "prometheus" / "courier-rules.yaml").read_text())
    exprs += [rule["expr"] for group in plain["groups"] for rule in group["rules"]]
    exprs += [step["model"]["expr"] for rule in rules for step in rule.get("data", [])
              if "expr" in step.get("model", {})]
    check_metric_names(exprs)
    check_runbook()
    check_test_coverage()
    for message in failures:
        print(f"  {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
