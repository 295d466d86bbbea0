"""Helpers for the deploy tests (tests/test_deploy_*.py): where the deploy files are, every PromQL expression they
hold (Grafana dashboards, Prometheus rules, KEDA triggers), Grafana's variables replaced by values a plain
Prometheus understands, and the metric names service/metrics.py defines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
K8S_DIR = DEPLOY / "k8s"

# What Grafana puts in place of its variables when it sends a query; the windows are long enough to span a test's
# whole traffic, and short enough that the traffic of the last seconds counts.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$instance": ".*",
}


@dataclass(frozen=True)
class Expr:
    where: str  # "parley.json: panel 'Tokens/s' target B", "alerts.yml: alert ParleyTargetDown", ...
    promql: str  # as written in the file
    kind: str  # "dashboard", "variable", "record", "alert", "keda"

    @property
    def query(self) -> str:
        """The expression as Prometheus is asked it: Grafana variables filled in, alerts made to always answer."""
        q = substitute_grafana_variables(self.promql)
        if self.kind == "alert":
            q = alert_as_always_answering(q)
        if self.kind == "variable":
            q = label_values_as_query(q)
        return q


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def iter_panels(panels: list[dict]):
    for p in panels:
        yield p
        yield from iter_panels(p.get("panels", []))  # a collapsed row holds its panels


def dashboard_exprs() -> list[Expr]:
    out = []
    for name, dash in dashboards().items():
        for p in iter_panels(dash.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append(Expr(f"{name}: panel {p.get('title')!r} target {t.get('refId')}", t["expr"],
                                    "dashboard"))
        for v in dash.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                out.append(Expr(f"{name}: variable ${v['name']}", query, "variable"))
    return out


def rule_exprs() -> list[Expr]:
    out = []
    for path in sorted(PROMETHEUS_DIR.glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, dict) or "groups" not in doc:
            continue
        for group in doc["groups"]:
            for rule in group["rules"]:
                kind = "record" if "record" in rule else "alert"
                out.append(Expr(f"{path.name}: {kind} {rule.get('record') or rule.get('alert')}",
                                rule["expr"].strip(), kind))
    return out


def recording_rule_names() -> list[str]:
    return [e.where.split("record ", 1)[1] for e in rule_exprs() if e.kind == "record"]


def k8s_documents() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


def keda_exprs() -> list[Expr]:
    out = []
    for path, doc in k8s_documents():
        if doc.get("kind") != "ScaledObject":
            continue
        for trig in doc["spec"]["triggers"]:
            if trig["type"] == "prometheus":
                out.append(Expr(f"{path.name}: trigger {trig.get('name')}", trig["metadata"]["query"], "keda"))
    return out


def all_exprs() -> list[Expr]:
    return dashboard_exprs() + rule_exprs() + keda_exprs()


def substitute_grafana_variables(expr: str) -> str:
    # Longest names first: $__range must not eat the start of a longer name.
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def label_values_as_query(expr: str) -> str:
    """Grafana's label_values(metric, label) is not PromQL: ask for the metric, which must have the label."""
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", expr)
    assert m, f"unexpected variable query: {expr}"
    return f"count by ({m.group(2)}) ({m.group(1)})"


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!=)")


def alert_as_always_answering(expr: str) -> str:
    """An alert's expression is empty while all is well, which tells nothing about whether it can see its series.
    Ask the same question with every comparison turned into a `bool` one (0 or 1 instead of a filter), and
    absent(X) into X: the answer is then non-empty exactly when the series the alert watches exist."""
    m = re.fullmatch(r"\s*absent\((.*)\)\s*", expr, flags=re.S)
    if m:
        return m.group(1)
    out, i, depth, quote = [], 0, 0, ""
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(expr[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
            out.append(c)
        elif c in "{[":
            depth += 1
            out.append(c)
        elif c in "}]":
            depth -= 1
            out.append(c)
        elif depth == 0 and (m := _COMPARISON.match(expr, i)):
            op = m.group(1)
            rest = expr[m.end():]
            out.append(op if rest.lstrip().startswith("bool") else op + " bool")
            i = m.end()
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


_METRIC = re.compile(r"(?<![\w:])(parley_[A-Za-z0-9_]+)")


def metric_names_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def defined_series_names() -> set[str]:
    """Every series name service/metrics.py's Metrics can expose, with prometheus_client's suffixes."""
    from service.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names

