"""The soak's short variant: `python -m bench soak` spawns its own server on the tiny synthetic model and runs mixed,
misbehaving traffic (completions, chat, realtime; hang-ups, cancels, bad input, missing and wrong API keys) for ~36 s,
then checks that every request was answered without a 5xx, nothing is left running, every KV slot is free and the RSS
stayed bounded.
Users run the same script for 30 minutes (its default) or more against any server (--url)."""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from tests.server_support import ROOT

pytestmark = pytest.mark.slow


def test_soak_short_variant() -> None:
    """With an API key (`--api-key`: the spawned server asks for it, every request sends it, some bad ones come
    without it or with a wrong one and must get the 401)."""
    cmd = [sys.executable, "-m", "bench", "soak", "--spawn",
           "--model synthetic:tiny --max-batch 4 --max-context 512", "--minutes", "0.6", "--concurrency", "12",
           "--warmup-s", "12", "--max-rss-growth-mb", "30", "--start-timeout-s", "120",
           "--api-key", "sk-soak-" + secrets.token_urlsafe(12)]
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"python -m bench soak did not finish in 240 s:\n{e.stdout!r}")
    print(run.stdout[-4000:])
    assert run.returncode == 0, f"{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert "OK: every request answered" in run.stdout
    assert "completed" in run.stdout and "hung up (sse)" in run.stdout
    assert "refused for its key (http)" in run.stdout and "refused for its key (ws)" in run.stdout
