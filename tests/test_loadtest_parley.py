"""parley-loadtest against the REAL Parley server on loopback (the embedded default model, on the CPU):
every request completes with the right token count over completions, chat and realtime, and the report's
figures agree with its records."""

import json
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.cli import main
from tests.server_fixture import start_server, stop_server

sys.path.insert(0, str(Path(__file__).parent))
from loadtest_checks import check_consistent  # noqa: E402

STARTUP_S = 180  # ~25 s on an idle 2-core machine (model load + calibration); far more on a busy one
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parley(tmp_path_factory):
    # --max-waiting 4: a burst of 16 finds the queue full (the short loads, 2 in flight, never do).
    server = start_server(tmp_path_factory.mktemp("parley") / "server.log", "--max-batch", "4", "--max-waiting", "4",
                          timeout_s=STARTUP_S)
    yield server.base
    stop_server(server)


def run(tmp_path, url: str, *args: str) -> dict:
    out = tmp_path / "parley.json"
    assert main(["--url", url, "--quiet", "--warmup", "1", "--json", str(out), "--input-len", "16",
                 "--output-len", "8", "--timeout", "60", *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat", "realtime"])
def test_short_load(tmp_path, parley, endpoint):
    doc = run(tmp_path, parley, "--endpoint", endpoint, "--num-requests", "6", "--concurrency", "2")
    [r] = doc["runs"]
    s, recs = r["summary"], r["requests"]
    listed = httpx.get(f"{parley}/v1/models").json()["data"][0]["id"]
    assert doc["config"]["model"] == listed
    assert len(recs) == 6 and s["ok"] == 6 and s["rejected"] == s["errors"] == 0, [x["error"] for x in recs]
    for x in recs:
        assert x["outcome"] == "ok" and x["output_tokens"] == 8
        assert 1 <= len(x["token_times_s"]) <= 8 and x["ttft_ms"] > 0 and x["ttfn_ms"] >= x["ttft_ms"]
        if endpoint != "realtime":
            assert x["prompt_tokens"] >= 16
    assert s["output_tokens"] == 48 and s["mean_output_tokens"] == 8
    check_consistent(doc)


def test_realtime_session_and_barge_in(tmp_path, parley):
    doc = run(tmp_path, parley, "--endpoint", "realtime", "--turns", "3", "--num-requests", "2", "--concurrency", "2")
    recs = doc["runs"][0]["requests"]
    assert [x["outcome"] for x in recs] == ["ok"] * 6 and all(x["output_tokens"] == 8 for x in recs)
    doc = run(tmp_path, parley, "--endpoint", "realtime", "--num-requests", "2", "--output-len", "64",
              "--cancel-after-tokens", "2")
    for x in doc["runs"][0]["requests"]:
        assert x["outcome"] == "cancelled" and 2 <= x["output_tokens"] < 64 and x["cancel_ms"] is not None
    check_consistent(doc)


def test_burst_is_shed_with_429(tmp_path, parley):
    doc = run(tmp_path, parley, "--warmup", "0", "--num-requests", "16", "--concurrency", "16", "--output-len", "2")
    s, recs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert s["ok"] + s["rejected"] == 16 and s["errors"] == 0, [x["error"] for x in recs]
    assert s["rejected"] >= 1 and s["reject_ms"]["n"] == s["rejected"]
    for x in recs:
        if x["outcome"] == "rejected":
            assert x["status"] == 429 and x["retry_after_s"] >= 1 and x["output_tokens"] == 0
        else:
            assert x["output_tokens"] == 2
    assert s["rejection_rate"] == s["rejected"] / 16
    check_consistent(doc)
