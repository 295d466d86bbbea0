"""Kubernetes manifests under deploy/k8s: the built-in kinds validate (strictly: no unknown field) against the
Kubernetes OpenAPI schemas bundled in the `kubernetes-validate` package, for the oldest and newest versions we
support; the KEDA ScaledObject validates against the models generated from KEDA's CRD (`cloudcoil-models-keda`);
the Gateway API Inference Extension's InferencePool and HTTPRoute validate against their CRDs' schemas
(deploy/k8s/schemas, from the upstream releases); and the manifests keep the promises of deploy/README.md (GPU,
probes, drain, affinity, autoscaling, the endpoint picker reading Parley's gauges)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.deploy_support import K8S_DIR, SCHEMAS_DIR, defined_series_names, k8s_documents, metric_names_in

KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
BUILTIN = {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceAccount",
           "Role", "RoleBinding", "ConfigMap", "NetworkPolicy"}
CRD_SCHEMAS = {"InferencePool": "inferencepool-v1.json", "HTTPRoute": "httproute-v1.json"}
INFERENCE_DIR = K8S_DIR / "inference-gateway"
NETWORK_POLICY_DIR = K8S_DIR / "network-policy"


def _docs(kind: str) -> list[dict]:
    return [d for _, d in k8s_documents() if d["kind"] == kind]


def _named(kind: str, name: str) -> dict:
    (doc,) = [d for d in _docs(kind) if d["metadata"]["name"] == name]
    return doc


def test_manifests_are_there():
    kinds = sorted(d["kind"] for _, d in k8s_documents())
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "HTTPRoute", "InferencePool", "Ingress",
                     "NetworkPolicy", "PodDisruptionBudget", "Role", "RoleBinding", "ScaledObject", "Service",
                     "Service", "ServiceAccount"], kinds
    # `kubectl apply -f deploy/k8s/` needs no CRD but KEDA's; the Inference Extension's pieces are a folder apart
    assert {p.name for p in K8S_DIR.glob("*.yaml")} == {"deployment.yaml", "service.yaml", "ingress.yaml",
                                                         "scaledobject.yaml"}
    assert {p.name for p in INFERENCE_DIR.glob("*.yaml")} == {"inferencepool.yaml", "httproute.yaml",
                                                               "endpoint-picker.yaml"}
    assert {p.name for p in NETWORK_POLICY_DIR.glob("*.yaml")} == {"networkpolicy.yaml"}  # opt-in, a folder apart


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_kinds_validate_strictly(version):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    checked = 0
    for path, doc in k8s_documents():
        if doc["kind"] not in BUILTIN:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']}: {'.'.join(map(str, e.path))}: {e.message}")
        checked += 1
    assert checked == 11


def _unknown_fields(given, model_dump, path="spec"):
    """Fields present in the manifest and dropped by the model: pydantic ignores extra fields, Kubernetes rejects
    them (strict field validation), so a typo would pass silently without this."""
    out = []
    if isinstance(given, dict) and isinstance(model_dump, dict):
        for k, v in given.items():
            if k not in model_dump:
                out.append(f"{path}.{k}")
            else:
                out += _unknown_fields(v, model_dump[k], f"{path}.{k}")
    elif isinstance(given, list) and isinstance(model_dump, list):
        for i, (a, b) in enumerate(zip(given, model_dump)):
            out += _unknown_fields(a, b, f"{path}[{i}]")
    return out


def test_keda_scaledobject_validates_against_the_keda_crd_models():
    keda = pytest.importorskip("cloudcoil.models.keda.v1alpha1", reason="pip install cloudcoil-models-keda")
    (doc,) = _docs("ScaledObject")
    obj = keda.ScaledObject.model_validate(doc)  # raises on a wrong type or a missing required field
    dumped = obj.model_dump(by_alias=True, exclude_none=True)
    assert not _unknown_fields(doc["spec"], dumped["spec"])
    assert dumped["spec"]["scaleTargetRef"]["name"] == "parley"


def test_scaledobject_scales_the_deployment_on_parley_metrics():
    (so,) = _docs("ScaledObject")
    dep = _named("Deployment", "parley")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
    defined = defined_series_names()
    for trig in so["spec"]["triggers"]:
        assert trig["type"] == "prometheus"
        meta = trig["metadata"]
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values must be strings"
        float(meta["threshold"])
        names = metric_names_in(meta["query"])
        assert names and names <= defined, names
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_deployment_gpu_probes_and_drain():
    dep = _named("Deployment", "parley")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    live = c["livenessProbe"]
    assert live["httpGet"]["path"] in ("/health", "/health/live")
    # generous: a minute of failures before a restart
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) >= 5
    env = {e["name"]: e.get("value") for e in c["env"]}
    # the preStop sleep and the server's own drain fit in the grace period, with margin
    drain = float(env["PARLEY_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain + 10
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert env["PARLEY_PORT"] == "8000" and "PARLEY_GPU_HOURLY_USD" in env
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


def test_session_affinity_for_websocket_sessions():
    svc = _named("Service", "parley")
    dep = _named("Deployment", "parley")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["sessionAffinity"] == "ClientIP"
    (ing,) = _docs("Ingress")
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert ann["nginx.ingress.kubernetes.io/affinity-mode"] == "persistent"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600  # WebSocket sessions live long
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]


def test_the_api_key_comes_from_a_secret_the_server_can_read_again():
    """PARLEY_API_KEY_FILE names a file of the Secret's volume, mounted whole (a subPath mount is never updated when
    the Secret changes, and SIGHUP would read the old keys), read-only, readable by the server's group."""
    dep = _named("Deployment", "parley")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "PARLEY_API_KEY" not in env  # a key in the manifest would be a key in git
    path = env["PARLEY_API_KEY_FILE"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True and "subPath" not in mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "parley-api-keys" and not volume["secret"].get("optional")
    assert path.rsplit("/", 1)[1] == "api-keys"  # the Secret's key: kubectl create secret ... --from-file=api-keys=
    assert volume["secret"]["defaultMode"] & 0o047 == 0o040 and pod["securityContext"]["fsGroup"] == 10001


def test_the_ingress_publishes_the_api_alone():
    """/v1/ goes out (behind its key); /health and /metrics, which ask for none, stay in the cluster."""
    (ing,) = _docs("Ingress")
    paths = [(p["path"], p["pathType"]) for rule in ing["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == [("/v1", "Prefix")]


def test_the_network_policy_keeps_the_pods_port_to_the_ingress_prometheus_and_the_namespace():
    (policy,) = _docs("NetworkPolicy")
    dep = _named("Deployment", "parley")
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert [p["port"] for p in rule["ports"]] == [port["name"] for port in c["ports"]] == ["http"]
    namespaces = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"]
                  if "namespaceSelector" in p}
    assert namespaces == {"ingress-nginx", "monitoring"}
    assert {"podSelector": {}} in rule["from"]


# -- the Gateway API Inference Extension ----------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation: an object that declares its
    properties takes no other field (unless it keeps unknown fields)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_inference_extension_kinds_validate_against_their_crds(kind):
    jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema")
    crd = json.loads((SCHEMAS_DIR / CRD_SCHEMAS[kind]).read_text())
    schema = _strict(crd["openAPIV3Schema"])
    (doc,) = _docs(kind)
    assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}"
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_crd_schemas_catch_a_typo():
    """The validation above can fail: a misspelt field and a missing required one are caught."""
    jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema")
    schema = _strict(json.loads((SCHEMAS_DIR / CRD_SCHEMAS["InferencePool"]).read_text())["openAPIV3Schema"])
    good = _named("InferencePool", "parley")
    bad = {**good, "spec": {**good["spec"], "targetPort": good["spec"]["targetPorts"]}}
    del bad["spec"]["targetPorts"]
    messages = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(bad)]
    assert any("targetPort" in m for m in messages) and any("targetPorts" in m for m in messages), messages


def test_the_pool_holds_the_parley_pods_and_asks_the_picker():
    pool = _named("InferencePool", "parley")["spec"]
    dep = _named("Deployment", "parley")
    assert pool["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert [p["number"] for p in pool["targetPorts"]] == [p["containerPort"] for p in container["ports"]]
    picker = _named("Service", pool["endpointPickerRef"]["name"])
    grpc = next(p for p in picker["spec"]["ports"] if p["port"] == pool["endpointPickerRef"]["port"]["number"])
    picker_dep = _named("Deployment", "parley-endpoint-picker")
    assert picker["spec"]["selector"] == picker_dep["spec"]["selector"]["matchLabels"]
    (epp,) = picker_dep["spec"]["template"]["spec"]["containers"]
    assert grpc["port"] in [p["containerPort"] for p in epp["ports"]]
    assert f"--pool-name={_named('InferencePool', 'parley')['metadata']['name']}" in epp["args"]


def test_the_route_sends_the_openai_api_to_the_pool():
    (rule,) = _named("HTTPRoute", "parley")["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                                   "parley")
    assert rule["matches"][0]["path"]["value"] == "/v1/"


def test_the_endpoint_picker_reads_parleys_gauges():
    """Queued, running and KV use 0-1 mapped to Parley's metric names, in the config and in the flags alike; every
    name a gauge service/metrics.py exports; every scorer of the profile declared."""
    from service.metrics import Metrics

    config = yaml.safe_load(_named("ConfigMap", "parley-endpoint-picker")["data"]["parley-plugins.yaml"])
    plugins = {p["type"]: p for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    mapping = {"queued": engine["queuedRequestsSpec"], "running": engine["runningRequestsSpec"],
               "kv": engine["kvUsageSpec"]}
    assert mapping == {"queued": "parley_requests_waiting", "running": "parley_requests_running",
                       "kv": "parley_kv_cache_usage_perc"}
    gauges = {f.name for f in Metrics().registry.collect() if f.type == "gauge"}
    assert set(mapping.values()) <= gauges
    (epp,) = _named("Deployment", "parley-endpoint-picker")["spec"]["template"]["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp["args"] if "=" in a)
    assert (flags["total-queued-requests-metric"], flags["total-running-requests-metric"],
            flags["kv-cache-usage-percentage-metric"]) == (mapping["queued"], mapping["running"], mapping["kv"])
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    (profile,) = config["schedulingProfiles"]
    refs = {p["pluginRef"] for p in profile["plugins"]}
    assert refs <= set(plugins) and {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= refs


def test_kv_cache_usage_is_the_share_of_slots_running_requests_hold():
    """What the picker reads as KV use: 0 idle, 1 with every slot held; a slot caching an idle conversation (free to
    evict) does not count."""
    from service.metrics import Metrics

    m = Metrics()

    def usage() -> float:
        return next(s.value for f in m.registry.collect() for s in f.samples
                    if s.name == "parley_kv_cache_usage_perc")

    assert usage() == 0.0  # before the engine set the slot counts
    m.kv_slots_total.set(8)
    m.kv_slots_free.set(8)
    assert usage() == 0.0
    m.kv_slots_free.set(2)
    m.kv_slots_cached.set(3)
    assert usage() == 0.75
    m.kv_slots_free.set(0)
    assert usage() == 1.0
