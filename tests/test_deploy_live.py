"""A real Prometheus (Debian's `prometheus` package) on loopback scrapes a real Parley (the embedded default model on
the CPU) and the real vllm-router in front of it (PyPI's) every second, with deploy/prometheus/alerts.yml loaded;
after a little traffic through the router, every PromQL expression of the Grafana dashboards, the rules and the KEDA
triggers is asked through Prometheus' HTTP API and must answer with data: at least one sample, and at least one
finite value.

Alert expressions are empty while all is well; they are asked with their comparisons made `bool` (see
deploy_support.alert_as_always_answering), which answers exactly when the series they watch exist.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy_support import (
    PROMETHEUS_DIR,
    Router,
    all_exprs,
    recording_rule_names,
    router_executable,
    start_router,
)
from tests.server_support import Server, free_port, poll, scrape_metrics, served, start_server, stop_process

PROMETHEUS = shutil.which("prometheus")
SERVER_START_TIMEOUT_S = 420  # model load and the calibration sweep on a 2-core CI machine
SLA_TOKENS = 8  # the SLA token is the 8th here, so that short CPU requests reach it (the histogram gets data)
MAX_TOKENS = 12

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)"),
    pytest.mark.skipif(router_executable() is None, reason="vllm-router not installed (pip install vllm-router)"),
]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@pytest.fixture(scope="module")
def scraped_server(tmp_path_factory) -> Iterator[Server]:
    """The embedded model, SLA at the 8th token and a GPU price, so that every panel has something to show; an SLA
    of a minute, so that every forecast is within admission's horizon and its requests leave the guard scores (the
    guard's median panel): at 100 ms a busy CI machine forecast past it, and the panel had no data."""
    # A short context keeps the start-up calibration sweep short (no 1,024-token prefill on the CPU).
    yield from served(start_server(tmp_path_factory.mktemp("scraped") / "parley.log", "--device", "cpu",
                                   "--max-batch", "2", "--max-context", "256", "--sla-tokens", str(SLA_TOKENS),
                                   "--sla-ms", "60000", "--gpu-hourly-usd", "2.5", timeout_s=SERVER_START_TIMEOUT_S))


@pytest.fixture(scope="module")
def router(scraped_server, tmp_path_factory) -> Iterator[Router]:
    """vllm-router in front of the server, as compose runs it: the traffic goes through it."""
    r = start_router([scraped_server.base], tmp_path_factory.mktemp("router") / "router.log", balance_abs_threshold=1)
    yield r
    stop_process(r.proc, timeout_s=10)


@pytest.fixture(scope="module")
def prometheus(scraped_server, router, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(PROMETHEUS_DIR / "alerts.yml")],
        "scrape_configs": [{"job_name": "parley",
                            "static_configs": [{"targets": [f"127.0.0.1:{scraped_server.port}"]}]},
                           {"job_name": "router",
                            "static_configs": [{"targets": [f"127.0.0.1:{router.metrics_port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    cmd = [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"

    def scraped_up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}:\n{_tail(log)}")
        try:
            r = httpx.get(f"{api}/query", params={"query": "up == 1"}, timeout=2)
            return r.status_code == 200 and len(r.json()["data"]["result"]) == 2
        except httpx.HTTPError:
            return False

    try:
        try:
            poll(scraped_up, bool, 60, "prometheus scraped parley and the router", every_s=0.5)
        except AssertionError as e:
            pytest.fail(f"{e}\n{_tail(log)}")
        yield {"api": api, "log": log}
    finally:
        stop_process(proc, timeout_s=30)


def _query(api: str, q: str) -> list[dict]:
    r = httpx.get(f"{api}/query", params={"query": q}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{q}: {body}"
    return body["data"]["result"]


def _values(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result]


def _scraped_value(api: str, query: str) -> float | None:
    """The value of a one-series query, as Prometheus has it now; None while it has no sample."""
    values = _values(_query(api, query))
    return values[0] if values else None


@pytest.fixture(scope="module")
def traffic(scraped_server, router, prometheus):
    """A few completions through the router, two of them at once (a decode batch of two), once Prometheus has a
    sample from before them (so that rate() sees them all), and until Prometheus has scraped what they counted."""
    api = prometheus["api"]
    poll(lambda: _scraped_value(api, "sum(parley_generation_tokens_total)"), lambda v: v is not None, 30,
         "a sample of parley_generation_tokens_total before the traffic", every_s=0.5)
    base = router.base
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    model = models["data"][0]["id"]
    statuses: list[int] = []

    def complete(prompt: str) -> None:  # stamped when sent, as parley-loadtest and proxies do (the transit panel)
        r = httpx.post(f"{base}/v1/completions", timeout=180, headers={"x-request-start": f"t={time.time():.6f}"},
                       json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        statuses.append(r.status_code)

    for prompt in ("Hello", "The capital of France is"):
        complete(prompt)
    for _ in range(2):
        pair = [threading.Thread(target=complete, args=(p,)) for p in ("Once upon a time", "Write a haiku about")]
        for t in pair:
            t.start()
        for t in pair:
            t.join()
    assert statuses.count(200) >= 3, f"statuses {statuses}:\n{scraped_server.log_tail()}"
    served = scrape_metrics(scraped_server.base)
    poll(lambda: _scraped_value(api, "sum(vllm_router_processed_requests_total)"),
         lambda v: v is not None and v >= len(statuses), 30, "Prometheus has scraped the router's count", every_s=0.5)
    for name in ("parley_generation_tokens_total", "parley_sla_checked_total"):
        poll(lambda name=name: _scraped_value(api, f"sum({name})"),
             lambda v, name=name: v is not None and v >= served[name], 30,
             f"Prometheus has scraped {name} after the traffic", every_s=0.5)
    return statuses


def test_parley_metrics_reach_prometheus(prometheus, traffic):
    assert sum(_values(_query(prometheus["api"], "sum(parley_generation_tokens_total)"))) > 0
    assert sum(_values(_query(prometheus["api"], "sum(parley_sla_checked_total)"))) > 0


def test_every_expression_returns_data(prometheus, traffic):
    exprs = all_exprs()
    pending = {e.where: e for e in exprs}
    answers: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 20  # recorded series appear one evaluation after their inputs
    while pending and time.monotonic() < deadline:
        for where, e in list(pending.items()):
            result = _query(prometheus["api"], e.query)
            answers[where] = result
            if result and any(math.isfinite(v) for v in _values(result)):
                del pending[where]
        if pending:
            time.sleep(1)
    report = "\n".join(f"{w}:\n    {e.query}\n    -> {answers.get(w)}" for w, e in pending.items())
    assert not pending, f"{len(pending)} of {len(exprs)} expressions answered no (finite) data:\n{report}"


def test_recording_rules_are_evaluated(prometheus, traffic):
    missing = []
    deadline = time.monotonic() + 10
    for name in recording_rule_names():
        while not _query(prometheus["api"], name) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not _query(prometheus["api"], name):
            missing.append(name)
    assert not missing, missing
    rules = httpx.get(f"{prometheus['api']}/rules", timeout=10).json()["data"]["groups"]
    unhealthy = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"] if r.get("health") == "err"]
    assert not unhealthy, unhealthy
