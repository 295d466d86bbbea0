"""parley-loadtest against the REAL Parley server on loopback (conftest.py's shared server: the embedded default
model on the CPU, 4 slots, 4 waiting at most): every request completes with the right token count over completions,
chat and realtime, a burst finds the queue full, and the report's figures agree with its records."""

import json

import httpx
import pytest

from loadtest.cli import main
from tests.loadtest_checks import check_consistent
from tests.server_support import Server, wait_idle

pytestmark = pytest.mark.slow


def run(tmp_path, server: Server, *args: str) -> dict:
    out = tmp_path / "parley.json"
    assert main(["--url", server.base, "--quiet", "--warmup", "1", "--json", str(out), "--input-len", "16",
                 "--output-len", "8", "--timeout", "60", *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat", "realtime"])
def test_short_load(tmp_path, shared_server: Server, endpoint):
    doc = run(tmp_path, shared_server, "--endpoint", endpoint, "--num-requests", "6", "--concurrency", "2")
    [r] = doc["runs"]
    s, recs = r["summary"], r["requests"]
    listed = httpx.get(f"{shared_server.base}/v1/models").json()["data"][0]["id"]
    assert doc["config"]["model"] == listed
    assert len(recs) == 6 and s["ok"] == 6 and s["rejected"] == s["errors"] == 0, [x["error"] for x in recs]
    for x in recs:
        assert x["outcome"] == "ok" and x["output_tokens"] == 8
        assert 1 <= len(x["token_times_s"]) <= 8 and x["ttft_ms"] > 0 and x["ttfn_ms"] >= x["ttft_ms"]
        if endpoint != "realtime":
            assert x["prompt_tokens"] >= 16
    assert s["output_tokens"] == 48 and s["mean_output_tokens"] == 8
    check_consistent(doc)


def test_realtime_session_and_barge_in(tmp_path, shared_server: Server):
    doc = run(tmp_path, shared_server, "--endpoint", "realtime", "--turns", "3", "--num-requests", "2",
              "--concurrency", "2")
    recs = doc["runs"][0]["requests"]
    assert [x["outcome"] for x in recs] == ["ok"] * 6 and all(x["output_tokens"] == 8 for x in recs)
    doc = run(tmp_path, shared_server, "--endpoint", "realtime", "--num-requests", "2", "--output-len", "64",
              "--cancel-after-tokens", "2")
    for x in doc["runs"][0]["requests"]:
        assert x["outcome"] == "cancelled" and 2 <= x["output_tokens"] < 64 and x["cancel_ms"] is not None
    check_consistent(doc)


def test_an_http_barge_in_closes_its_stream_and_the_server_frees_the_slot(tmp_path, shared_server: Server):
    """A barge-in over HTTP (--cancel-after-tokens) stops reading and closes the connection: each reply is recorded
    as cancelled with the tokens heard, and the server sees the client go: it counts both requests cancelled (a reply
    read to its end, or left open, would count as completed) and every slot is free again."""
    before = wait_idle(shared_server.base).requests("cancelled")  # an earlier test's cancels all counted
    doc = run(tmp_path, shared_server, "--endpoint", "completions", "--num-requests", "2", "--concurrency", "2",
              "--output-len", "64", "--cancel-after-tokens", "2", "--warmup", "0")
    for x in doc["runs"][0]["requests"]:
        assert x["outcome"] == "cancelled" and 2 <= x["output_tokens"] < 64, x
    assert wait_idle(shared_server.base).requests("cancelled") - before == 2
    check_consistent(doc)


def test_burst_is_shed_with_429(tmp_path, shared_server: Server):
    doc = run(tmp_path, shared_server, "--warmup", "0", "--num-requests", "16", "--concurrency", "16",
              "--output-len", "2")
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
