"""Grafana: provisioning files point at the dashboards, every dashboard is well-formed JSON, every panel (rows aside)
has a target with an expression, and the panels the issue promised are there."""

from __future__ import annotations

import json

import yaml

from tests.deploy_support import DASHBOARDS_DIR, GRAFANA_DIR, dashboards, iter_panels

DS_UID = "prometheus"


def test_datasource_provisioning():
    files = sorted((GRAFANA_DIR / "provisioning" / "datasources").glob("*.yml"))
    assert files
    ds = [d for f in files for d in yaml.safe_load(f.read_text())["datasources"]]
    prom = [d for d in ds if d["type"] == "prometheus"]
    assert len(prom) == 1 and prom[0]["uid"] == DS_UID and prom[0]["url"] == "http://prometheus:9090"


def test_dashboard_provisioning_points_at_the_mounted_dashboards():
    files = sorted((GRAFANA_DIR / "provisioning" / "dashboards").glob("*.yml"))
    assert files
    providers = [p for f in files for p in yaml.safe_load(f.read_text())["providers"]]
    # docker-compose.yml mounts deploy/grafana/dashboards there.
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]


def test_dashboards_are_well_formed_json():
    paths = sorted(DASHBOARDS_DIR.glob("*.json"))
    assert paths
    for p in paths:
        dash = json.loads(p.read_text())
        assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
        assert isinstance(dash["panels"], list) and dash["panels"]


def test_every_panel_has_a_target():
    for name, dash in dashboards().items():
        ids = set()
        for p in iter_panels(dash["panels"]):
            assert p["id"] not in ids, f"{name}: duplicate panel id {p['id']}"
            ids.add(p["id"])
            assert {"x", "y", "w", "h"} <= set(p["gridPos"]), f"{name}: {p.get('title')}"
            if p["type"] == "row":
                continue
            assert p.get("title"), f"{name}: panel {p['id']} has no title"
            targets = p.get("targets") or []
            assert targets, f"{name}: panel {p['title']!r} has no target"
            for t in targets:
                assert t.get("expr", "").strip(), f"{name}: panel {p['title']!r} target {t.get('refId')} is empty"
                assert t["datasource"]["uid"] == DS_UID
            assert len({t["refId"] for t in targets}) == len(targets), f"{name}: {p['title']!r} refIds"
            assert p["datasource"]["uid"] == DS_UID


def test_the_promised_panels_are_there():
    dash = dashboards()["parley.json"]
    panels = [p for p in iter_panels(dash["panels"]) if p["type"] != "row"]
    exprs = "\n".join(t["expr"] for p in panels for t in p["targets"])
    titles = "\n".join(p["title"] for p in panels).lower()
    for needle in ("sla attainment", "64th token", "first token", "inter-token", "admitted against rejected",
                   "running and waiting", "decode-step time by batch size", "tokens/s", "cost per 1m"):
        assert needle in titles, needle
    for metric in ("parley_sla_violations_total", "parley_sla_checked_total", "parley_time_to_nth_token_seconds_bucket",
                   "parley_time_to_first_token_seconds_bucket", "parley_inter_token_latency_seconds_bucket",
                   "parley_requests_total", "parley_requests_running", "parley_requests_waiting",
                   "parley_decode_step_seconds_bucket", "parley_generation_tokens_total", "parley_gpu_hourly_usd"):
        assert metric in exprs, metric
    # The 64th-token panel shows p50 and p99 against the 100 ms line.
    nth = next(p for p in panels if "64th token: p50 / p99" in p["title"])
    nth_exprs = [t["expr"] for t in nth["targets"]]
    assert any("histogram_quantile(0.5," in e for e in nth_exprs)
    assert any("histogram_quantile(0.99," in e for e in nth_exprs)
    steps = nth["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert 0.1 in [s["value"] for s in steps]
    assert nth["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    # Decode-step time is split by batch size.
    step = next(p for p in panels if p["title"].startswith("Decode-step time by batch size"))
    assert all("batch_size" in t["expr"] for t in step["targets"])


def test_the_replicas_dashboard_shows_replicas_side_by_side_and_the_routers_view():
    dash = dashboards()["replicas.json"]
    panels = [p for p in iter_panels(dash["panels"]) if p["type"] != "row"]
    replica_panels = [p for p in panels if any("parley_" in t["expr"] for t in p["targets"])]
    router_panels = [p for p in panels if any("vllm_router_" in t["expr"] for t in p["targets"])]
    assert len(replica_panels) >= 8 and len(router_panels) >= 6
    for p in replica_panels:  # one line per replica, filtered by the Replica variable
        for t in p["targets"]:
            assert "by (instance" in t["expr"] and 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
            assert "{{instance}}" in t["legendFormat"], p["title"]
    exprs = "\n".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("parley_kv_cache_usage_perc", "parley_prefix_cache_hits_total", "parley_requests_running",
                   "parley_requests_waiting", "vllm_router_processed_requests_total", "vllm_router_worker_health",
                   "vllm_router_retries_total", "vllm_router_running_requests"):
        assert metric in exprs, metric
