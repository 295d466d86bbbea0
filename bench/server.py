"""A `parley serve` for a benchmark: started on a free port of this host, ready once /health answers 200, stopped
with SIGTERM (the way an orchestrator stops it). Only httpx and the standard library: it runs from a client box.

The API key: a benchmark sends $OPENAI_API_KEY (what the openai SDK and parley-loadtest read; each script's
`--api-key` sets it for the benchmark and every process it starts) as `Authorization: Bearer`, and a server it starts
requires that key (PARLEY_API_KEY), so that what it measures includes the check."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
API_KEY_VARIABLE = "OPENAI_API_KEY"


class ServerFailed(RuntimeError):
    """The server exited, or was not healthy in time; the message ends with its log's tail."""


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:<port>
    log: Path


def api_key() -> str | None:
    """The key benchmarks send, and the servers they start require; None: none."""
    return os.environ.get(API_KEY_VARIABLE) or None


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help=f"the key to send as Authorization: Bearer (default ${API_KEY_VARIABLE}); "
                                          "a server the benchmark starts requires it")


def use_api_key(key: str | None) -> None:
    """--api-key's value, for this process and every one it starts (loadtests read $OPENAI_API_KEY: a key in a
    child's command line would show in the process list)."""
    if key:
        os.environ[API_KEY_VARIABLE] = key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def launch(flags: Sequence[str], log: Path, port: int | None = None, env: Mapping[str, str] | None = None) -> Started:
    """`parley serve FLAGS` on `port` (a free one if None), its output in `log`, with `env` added to this process's
    environment (and PARLEY_API_KEY, where the benchmark has a key); returns at once (wait_healthy waits for it)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    log.parent.mkdir(parents=True, exist_ok=True)
    key = api_key()
    with open(log, "wb") as out:  # its own session: a Ctrl-C meant for the benchmark reaches it as our SIGTERM
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **({"PARLEY_API_KEY": key} if key else {}), **(env or {})})
    return Started(proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(server: Started, timeout_s: float = 300.0) -> Started:
    """The server once /health answers 200. Raises ServerFailed (having killed it) if it exits or is not healthy
    within `timeout_s`."""
    proc, log = server.proc, server.log
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    proc.wait(timeout=10)
    raise ServerFailed(f"the server was not healthy after {timeout_s:.0f} s:\n{log_tail(log)}")


def start(flags: Sequence[str], log: Path, timeout_s: float = 300.0, port: int | None = None,
          env: Mapping[str, str] | None = None) -> Started:
    """launch, then wait_healthy: the started server, healthy."""
    return wait_healthy(launch(flags, log, port, env), timeout_s)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int | None:
    """SIGTERM (the server drains), then SIGKILL after `timeout_s`; its exit status (None if killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            return None
    return proc.returncode


@contextmanager
def running(flags: Sequence[str], log: Path, timeout_s: float = 300.0) -> Iterator[Started]:
    """A started, healthy server for the block; stopped after it, whatever happens in it."""
    started = start(flags, log, timeout_s)
    try:
        yield started
    finally:
        stop(started.proc)


@contextmanager
def serving(flags: Sequence[str], log: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """A started server's base URL for the block; stopped after it, whatever happens in it."""
    with running(flags, log, timeout_s) as started:
        yield started.base


def get_text(base: str, path: str, timeout_s: float = 10.0) -> str | None:
    """GET base+path's body (with the key), or None if it fails (what a benchmark keeps beside its figures, not a
    figure)."""
    try:
        r = httpx.get(f"{base}{path}", timeout=timeout_s, headers=auth_headers())
        r.raise_for_status()
        return r.text
    except httpx.HTTPError:
        return None
