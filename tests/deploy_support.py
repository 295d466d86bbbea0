"""Helpers for the deploy tests (tests/test_deploy_*.py, tests/test_router.py): where the deploy files are, every
PromQL expression they hold (Grafana dashboards, Prometheus rules, KEDA triggers), Grafana's variables replaced by
values a plain Prometheus understands, the metric names service/metrics.py defines and those vllm-router exports,
and a vllm-router (installed from PyPI) started on loopback in front of given replicas, with the flags compose uses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench import fleet
from bench.fleet import render_compose as render_compose  # the tests of deploy/ read its flags from here
from bench.fleet import router_command
from bench.runs import with_flags
from tests.server_support import Scrape, free_port, poll, stop_process

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
K8S_DIR = DEPLOY / "k8s"
SCHEMAS_DIR = K8S_DIR / "schemas"
ROUTER_START_TIMEOUT_S = 60.0

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
_ROUTER_METRIC = re.compile(r"(?<![\w:])(vllm_router_[A-Za-z0-9_]+)")


def metric_names_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def router_metric_names_in(expr: str) -> set[str]:
    return set(_ROUTER_METRIC.findall(expr))


def defined_series_names() -> set[str]:
    """Every series name service/metrics.py's Metrics (the engine's, with the admission guard's gauges) and
    FrontEndMetrics can expose, with prometheus_client's suffixes."""
    from service.admission_guard import AdmissionGuard
    from service.metrics import FrontEndMetrics, Metrics

    engine = Metrics()
    engine.export_guard(AdmissionGuard())
    names = set()
    for family in [*engine.registry.collect(), *FrontEndMetrics().registry.collect()]:
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names



# -- the router ---------------------------------------------------------------------------------------------------
def router_executable() -> str | None:
    """vllm-router's console script, installed from PyPI (requirements-ci.txt), in PATH or beside this Python."""
    beside = Path(sys.executable).parent / "vllm-router"
    return shutil.which("vllm-router") or (str(beside) if beside.exists() else None)


def router_binary() -> bytes | None:
    """The installed router's Rust library, whose strings hold every vllm_router_* metric name it can export (its
    families appear on /metrics only once first counted); None where vllm-router is not installed."""
    try:
        import vllm_router_rs  # type: ignore[import-not-found]  # the Rust extension module
    except ImportError:
        return None
    return Path(vllm_router_rs.__file__).read_bytes()


class Router(fleet.Router):
    """The benchmark's router handle (bench/fleet.py), with what the tests read of it."""

    def metrics(self) -> Scrape:
        """The router's own metrics (its --prometheus-port)."""
        return Scrape.parse(httpx.get(self.metrics_url, timeout=10).text)

    def readiness(self) -> dict | None:
        """/readiness ({"status", "healthy_workers", "total_workers"}), or None while it does not answer."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            r = httpx.get(f"{self.base}/readiness", timeout=5)
            return r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        except (httpx.HTTPError, ValueError):
            return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def start_router(worker_urls: list[str], log: Path, balance_abs_threshold: int, router_args: str = "") -> Router:
    """vllm-router on loopback in front of `worker_urls`, with the flags docker-compose.yml gives it
    (deploy/render_compose.py's ROUTER_FLAGS; each of `router_args` replacing its value, or added); returns once every
    worker is healthy in its eyes."""
    assert router_executable() is not None, "vllm-router is not installed (pip install vllm-router)"
    port, metrics_port = free_port(), free_port()
    cmd = list(with_flags(router_command(worker_urls, port, metrics_port, balance_abs_threshold), router_args))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, port, metrics_port, log)
    try:
        poll(router.readiness, lambda r: bool(r) and r.get("healthy_workers") == len(worker_urls),
             ROUTER_START_TIMEOUT_S, "vllm-router sees every worker healthy", every_s=0.2)
    except (AssertionError, RuntimeError) as e:
        stop_process(proc, timeout_s=10)
        raise RuntimeError(f"{e}\n{router.log_tail()}") from None
    return router


def worker_health(router: Router) -> dict[str, float]:
    """vllm_router_worker_health by worker URL: 1 while the router sends it work, 0 once it took it out."""
    return {s.labels["worker"]: s.value for s in router.metrics().samples if s.name == "vllm_router_worker_health"}
