"""Kubernetes manifests under deploy/k8s: the built-in kinds validate (strictly: no unknown field) against the
Kubernetes OpenAPI schemas bundled in the `kubernetes-validate` package, for the oldest and newest versions we
support; the KEDA ScaledObject validates against the models generated from KEDA's CRD (`cloudcoil-models-keda`);
and the deployment keeps the promises of deploy/README.md (GPU, probes, drain, affinity, autoscaling)."""

from __future__ import annotations

import pytest

from tests.deploy_support import K8S_DIR, defined_series_names, k8s_documents, metric_names_in

KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
BUILTIN = {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def _docs(kind: str) -> list[dict]:
    return [d for _, d in k8s_documents() if d["kind"] == kind]


def test_manifests_are_there():
    kinds = sorted(d["kind"] for _, d in k8s_documents())
    assert kinds == ["Deployment", "Ingress", "PodDisruptionBudget", "ScaledObject", "Service"], kinds
    assert {p.name for p in K8S_DIR.glob("*.yaml")} == {"deployment.yaml", "service.yaml", "ingress.yaml",
                                                         "scaledobject.yaml"}


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
    assert checked == 4


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
    (dep,) = _docs("Deployment")
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
    (dep,) = _docs("Deployment")
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
    (svc,) = _docs("Service")
    (dep,) = _docs("Deployment")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["sessionAffinity"] == "ClientIP"
    (ing,) = _docs("Ingress")
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert ann["nginx.ingress.kubernetes.io/affinity-mode"] == "persistent"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600  # WebSocket sessions live long
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
