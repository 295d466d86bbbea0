"""Helpers the reliability tests share: servers of their own on the tiny synthetic model (it starts in seconds),
the OpenAI error shape, the server's RSS, and waiting for the engine to be idle (nothing running, every slot free)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.server_fixture import Server, metrics, start_server

TINY = ("--model", "synthetic:tiny")


def tiny_server(log: Path, *args: str) -> Server:
    return start_server(log, *TINY, *args, timeout_s=120)


def assert_openai_error(body: Any, code: str | None = None, param: str | None = "<any>",
                        type: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} (exactly those keys), with the given code/param/type."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if param != "<any>":
        assert err["param"] == param, err
    if type is not None:
        assert err["type"] == type, err
    return err


def health_status(base: str, timeout_s: float = 30.0) -> int:
    return httpx.get(f"{base}/health", timeout=timeout_s).status_code


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS of /proc/<pid>/status), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_idle(base: str, slots: int, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and all `slots` KV slots are free; the last sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        if (m.get("parley_requests_running") == 0 and m.get("parley_requests_waiting") == 0
                and m.get("parley_kv_slots_free") == slots == m.get("parley_kv_slots_total")):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: running={m.get('parley_requests_running')} "
                                 f"waiting={m.get('parley_requests_waiting')} free={m.get('parley_kv_slots_free')}"
                                 f"/{m.get('parley_kv_slots_total')}")
        time.sleep(0.1)
