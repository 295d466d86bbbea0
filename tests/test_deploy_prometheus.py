"""Prometheus: the compose config and the rules pass promtool, the alerts' unit tests pass, and every PromQL
expression of the dashboards, rules and KEDA triggers parses and names only metrics service/metrics.py defines.
promtool is Debian's `prometheus` package (the CI script installs it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy_support import (
    PROMETHEUS_DIR,
    all_exprs,
    defined_series_names,
    metric_names_in,
    render_compose,
    router_binary,
    router_metric_names_in,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def promtool(*args: str, cwd=PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_config():
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr


@needs_promtool
def test_promtool_check_rules():
    r = promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_alert_unit_tests():
    r = promtool("test", "rules", "alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_cover_sla_rejections_and_down_target():
    doc = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert {"ParleySLAAttainmentLow", "ParleyRejectionRateHigh", "ParleyTargetDown"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("page", "warning"), name
        assert rule["annotations"]["summary"], name


def test_compose_scrapes_every_replica_and_the_router_and_loads_the_rules():
    cfg = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    (sd,) = jobs["parley"]["file_sd_configs"]
    assert sd["files"] == ["replicas.yml"]
    groups = yaml.safe_load((PROMETHEUS_DIR / "replicas.yml").read_text())
    assert [g["targets"] for g in groups] == [["parley-0:8000"]]  # what the repository's compose file runs
    assert groups[0]["labels"] == {"replica": "parley-0", "gpu": "0"}
    rc = render_compose()
    assert jobs["router"]["static_configs"][0]["targets"] == [f"router:{rc.ROUTER_METRICS_PORT}"]
    # four GPUs: four targets, each named as its compose service
    four = yaml.safe_load(rc.render_targets(["0", "1", "2", "3"]))
    assert [g["targets"] for g in four] == [[f"parley-{i}:8000"] for i in range(4)]


@needs_promtool
def test_every_expression_parses(tmp_path):
    """promtool parses PromQL offline when it checks a rules file: make one rule per expression."""
    exprs = all_exprs()
    assert len(exprs) > 30
    rules = [{"record": f"check:expr_{i}", "expr": e.query} for i, e in enumerate(exprs)]
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "all", "rules": rules}]}))
    r = promtool("check", "rules", str(path), cwd=tmp_path)
    if r.returncode != 0:
        bad = "\n".join(f"{i}: {e.where}: {e.query}" for i, e in enumerate(exprs))
        pytest.fail(r.stdout + r.stderr + "\n" + bad)


def test_every_metric_name_is_defined_in_service_metrics():
    defined = defined_series_names()
    unknown = {(e.where, name) for e in all_exprs() for name in metric_names_in(e.promql) if name not in defined}
    assert not unknown, f"metric names not in service/metrics.py: {sorted(unknown)}"


def test_every_router_metric_name_is_one_the_installed_router_exports():
    """The dashboards and rules may name vllm-router's metrics (vllm_router_*): each must be one the installed
    router's binary can export (some appear only once first counted, so /metrics alone cannot tell)."""
    binary = router_binary()
    if binary is None:
        pytest.skip("vllm-router not installed (pip install vllm-router)")
    named = {(e.where, name) for e in all_exprs() for name in router_metric_names_in(e.promql)}
    assert named, "no expression reads the router's metrics"
    unknown = sorted((where, name) for where, name in named
                     if name.removesuffix("_bucket").encode() not in binary)
    assert not unknown, f"not vllm-router metrics: {unknown}"
