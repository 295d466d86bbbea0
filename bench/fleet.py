"""N Parley replicas behind vllm-router on one host, as processes: what `docker compose up` runs, without Docker.

Replica i runs on GPU i (CUDA_VISIBLE_DEVICES=i), or on the CPU, on a loopback port; the router gets exactly the flags
docker-compose.yml gives it (deploy/render_compose.py's ROUTER_FLAGS, and a balance threshold of half a replica's
batch, as compose sets it), so that what `python -m bench router` measures is what deploys. tests/test_router.py
starts its router with router_command too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.runs import with_flags
from bench.server import ROOT, ServerFailed, Started, free_port, launch, log_tail, stop, wait_healthy

ROUTER_START_TIMEOUT_S = 120.0
COMPOSE_BALANCE_ABS_THRESHOLD = 4  # compose's default (PARLEY_ROUTER_BALANCE_ABS_THRESHOLD), for its default batch


@cache
def render_compose() -> ModuleType:
    """deploy/render_compose.py as a module (deploy/ is no package): the router's flags live there."""
    spec = importlib.util.spec_from_file_location("render_compose", ROOT / "deploy" / "render_compose.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def router_launcher() -> list[str] | None:
    """How to run vllm-router: its module with this interpreter where it is importable (pip --target puts no
    console script on PATH), else its console script in PATH or beside this Python; None if it is not installed."""
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    beside = Path(sys.executable).parent / "vllm-router"
    exe = shutil.which("vllm-router") or (str(beside) if beside.exists() else None)
    return [exe] if exe else None


def balance_abs_threshold(serve_flags: Sequence[str]) -> int:
    """Half of the replicas' --max-batch, as deploy/README.md says to set PARLEY_ROUTER_BALANCE_ABS_THRESHOLD."""
    if "--max-batch" in serve_flags:
        return max(1, int(serve_flags[list(serve_flags).index("--max-batch") + 1]) // 2)
    return COMPOSE_BALANCE_ABS_THRESHOLD


def router_command(worker_urls: Sequence[str], port: int, metrics_port: int, balance_abs_threshold: int,
                   host: str = "127.0.0.1") -> list[str]:
    """vllm-router in front of `worker_urls` with compose's arguments (render_compose.router_command) but this
    host's addresses."""
    launcher = router_launcher()
    if launcher is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
    return [*launcher, "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--balance-abs-threshold", str(balance_abs_threshold), *render_compose().ROUTER_FLAGS]


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text page."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def metric_total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (0 where there is none yet)."""
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def scrape(url: str, timeout_s: float = 10.0) -> list[tuple[str, dict[str, str], float]] | None:
    """The samples of url's /metrics; None if it does not answer (a replica that is down)."""
    try:
        r = httpx.get(url, timeout=timeout_s)
        r.raise_for_status()
        return metric_samples(r.text)
    except httpx.HTTPError:
        return None


@dataclass
class Replica:
    index: int
    flags: tuple[str, ...]
    gpu: str | None  # its CUDA_VISIBLE_DEVICES; None: the CPU
    port: int
    raw: Path
    name: str = "replica"  # its logs: <raw>/<name>-<index>.log, then .start-2.log, ... after restarts
    server: Started | None = None
    starts: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        stem = f"{self.name}-{self.index}"
        return self.raw / (f"{stem}.log" if self.starts <= 1 else f"{stem}.start-{self.starts}.log")

    def launch(self) -> None:
        """Start it on its own port (the router knows it by that address), not waiting for it."""
        self.starts += 1
        env = {"CUDA_VISIBLE_DEVICES": self.gpu if self.gpu is not None else ""}
        self.server = launch(self.flags, self.log, self.port, env)

    def wait_healthy(self, timeout_s: float) -> None:
        assert self.server is not None
        wait_healthy(self.server, timeout_s)

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to its whole process group (a crash: no drain; any child process it started goes too)."""
        assert self.server is not None
        try:
            os.killpg(self.server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM (it drains), SIGKILL after a minute; its exit status."""
        return stop(self.server.proc) if self.server is not None else None


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path
    command: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def healthy_workers(self) -> int | None:
        """/readiness's count of healthy workers; None while it does not answer."""
        if self.proc.poll() is not None:
            raise ServerFailed(f"vllm-router exited with {self.proc.returncode}:\n{log_tail(self.log)}")
        try:
            r = httpx.get(f"{self.base}/readiness", timeout=5)
            return int(r.json().get("healthy_workers", 0))
        except (httpx.HTTPError, ValueError, AttributeError):
            return None


def start_router(worker_urls: Sequence[str], log: Path, balance_abs_threshold: int,
                 timeout_s: float = ROUTER_START_TIMEOUT_S, router_args: str = "") -> Router:
    """vllm-router on loopback in front of `worker_urls` with compose's flags (each flag of `router_args` replacing
    its value, or added); returns once it sees every worker healthy. Raises ServerFailed (having stopped it)
    otherwise."""
    port, metrics_port = free_port(), free_port()
    cmd = list(with_flags(router_command(worker_urls, port, metrics_port, balance_abs_threshold), router_args))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, port, metrics_port, log, cmd)
    end = time.monotonic() + timeout_s
    try:
        while router.healthy_workers() != len(worker_urls):
            if time.monotonic() > end:
                raise ServerFailed(f"vllm-router did not see {len(worker_urls)} healthy workers in {timeout_s:.0f} "
                                   f"s:\n{log_tail(log)}")
            time.sleep(0.2)
    except ServerFailed:
        stop(proc, timeout_s=10)
        raise
    return router


@dataclass
class Fleet:
    replicas: list[Replica]
    router: Router


def gpu_ids(replicas: int, cpu: bool) -> list[str | None]:
    return [None if cpu else str(i) for i in range(replicas)]


@contextmanager
def fleet(flags: Sequence[str], gpus: Sequence[str | None], raw: Path, timeout_s: float = 300.0,
          name: str = "fleet", router_args: str = "") -> Iterator[Fleet]:
    """One replica per entry of `gpus` (a CUDA_VISIBLE_DEVICES value, None for the CPU), all started at once, and
    the router in front of them once they are healthy (`router_args`: flags replacing or added to compose's);
    everything stopped after the block. Logs: <raw>/<name>-
    replica-<i>.log and <raw>/<name>-router.log."""
    replicas = [Replica(i, tuple(flags), gpu, free_port(), raw, f"{name}-replica") for i, gpu in enumerate(gpus)]
    router = None
    try:
        for r in replicas:
            r.launch()
        for r in replicas:  # they load in parallel; each wait is what is left of the slowest
            r.wait_healthy(timeout_s)
        router = start_router([r.base for r in replicas], raw / f"{name}-router.log",
                              balance_abs_threshold(flags), router_args=router_args)
        yield Fleet(replicas, router)
    finally:
        if router is not None:
            stop(router.proc, timeout_s=10)
        for r in replicas:
            if r.alive():
                r.stop()
