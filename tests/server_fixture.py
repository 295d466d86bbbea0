"""A real `parley serve` on loopback for the API tests: started as a subprocess, once per test session, shared by
every module that imports the `parley` fixture. Also the helpers the tests share (free ports, /metrics parsing)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0  # loading + calibrating the embedded model takes ~10-90 s on two busy cores
MAX_BATCH = 4
MAX_CONTEXT = 1024


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, *args: str, timeout_s: float = START_TIMEOUT_S) -> Server:
    """`python -m service.cli serve --port <free> <args>`; returns once /health answers 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, whatever the machine
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, port, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"parley exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"parley not healthy after {timeout_s:.0f} s:\n{server.log_tail()}")
        time.sleep(0.5)


def stop_server(server: Server, timeout_s: float = 60.0) -> int | None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=10)
    return server.proc.returncode


_shared: Server | None = None


@pytest.fixture(scope="session")
def parley(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Server:
    """The shared server: the embedded SmolLM2-135M on the CPU, 4 slots, 1024 tokens of context."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        log = tmp_path_factory.mktemp("parley") / "parley.log"
        try:
            _shared = start_server(log, "--max-batch", str(MAX_BATCH), "--max-context", str(MAX_CONTEXT))
        except RuntimeError as e:
            pytest.fail(str(e))
        server = _shared
        request.addfinalizer(lambda: stop_server(server))
    return _shared


# -- /metrics ---------------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{labels}': value} (labels as Prometheus prints them)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def requests_total(sample: dict[str, float], outcome: str) -> float:
    return sum(v for k, v in sample.items()
               if k.startswith("parley_requests_total{") and f'outcome="{outcome}"' in k)


def wait_idle(base: str, slots: int = MAX_BATCH, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV slot is free; the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        if (m.get("parley_requests_running") == 0 and m.get("parley_requests_waiting") == 0
                and m.get("parley_kv_slots_free") == slots):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: running={m.get('parley_requests_running')} "
                                 f"waiting={m.get('parley_requests_waiting')} free={m.get('parley_kv_slots_free')}")
        time.sleep(0.1)
