"""A `parley serve` for a benchmark: started on a free port of this host, ready once /health answers 200, stopped
with SIGTERM (the way an orchestrator stops it). Only httpx and the standard library: it runs from a client box."""

from __future__ import annotations

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


class ServerFailed(RuntimeError):
    """The server exited, or was not healthy in time; the message ends with its log's tail."""


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:<port>
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def launch(flags: Sequence[str], log: Path, port: int | None = None, env: Mapping[str, str] | None = None) -> Started:
    """`parley serve FLAGS` on `port` (a free one if None), its output in `log`, with `env` added to this process's
    environment; returns at once (wait_healthy waits for it)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:  # its own session: a Ctrl-C meant for the benchmark reaches it as our SIGTERM
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
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
def serving(flags: Sequence[str], log: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """A started server's base URL for the block; stopped after it, whatever happens in it."""
    started = start(flags, log, timeout_s)
    try:
        yield started.base
    finally:
        stop(started.proc)


def get_text(base: str, path: str, timeout_s: float = 10.0) -> str | None:
    """GET base+path's body, or None if it fails (what a benchmark keeps beside its figures, not a figure)."""
    try:
        r = httpx.get(f"{base}{path}", timeout=timeout_s)
        r.raise_for_status()
        return r.text
    except httpx.HTTPError:
        return None
