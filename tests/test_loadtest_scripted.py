"""parley-loadtest end to end against a scripted server whose token timings are known
(tests/loadtest_scripted_server.py, in a subprocess on 127.0.0.1): latencies, outcomes, SLA attainment, goodput,
cost, barge-in, multi-turn sessions, arrivals, sweep, JSON and plot."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.cli import main
from loadtest.workload import arrival_gaps, should_cancel
from tests.loadtest_checks import check_consistent
from tests.server_support import poll

SERVER = Path(__file__).with_name("loadtest_scripted_server.py")
FAST = "ttft=4 itl=0.4"  # token 64 at 29.2 ms
SLOW = "ttft=5 itl=4"  # token 64 at 257 ms
SLACK_MS = 40.0  # client + server overhead allowed (on the median) on a busy 2-core CI machine


@pytest.fixture(scope="module")
def scripted_server():
    """tests/loadtest_scripted_server.py in a subprocess; its URL once it answers."""
    proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        poll(answers, bool, 30, "the scripted server answers", every_s=0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def url(scripted_server):
    """The scripted server's URL, its counters reset."""
    httpx.post(f"{scripted_server}/stats").raise_for_status()
    return scripted_server


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


def run_cli(tmp_path, url, *args: str) -> dict:
    out = tmp_path / "run.json"
    assert main(["--url", url, "--quiet", "--warmup", "0", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def dataset(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "realtime"])
def test_known_timings(tmp_path, url, endpoint):
    doc = run_cli(tmp_path, url, "--endpoint", endpoint, "--dataset", dataset(tmp_path, [{"prompt": FAST}]),
                  "--num-requests", "6", "--concurrency", "2", "--output-len", "64", "--warmup", "1")
    [run] = doc["runs"]
    assert run["model"] == "scripted-model"  # the first of GET /v1/models
    s, recs = run["summary"], run["requests"]
    assert len(recs) == 6 and s["ok"] == 6 and s["sla_attainment"] == 1.0
    assert s["client_loop_lag_ms"]["n"] > 0  # the client watched its own event loop
    for r in recs:
        assert r["outcome"] == "ok" and r["output_tokens"] == 64 and len(r["token_times_s"]) == 64
        assert r["ttft_ms"] >= 4.0 and r["ttfn_ms"] >= 29.2  # never before the server sent them
        assert r["prompt_tokens"] == 2
    assert s["ttft_ms"]["p50"] <= 4.0 + SLACK_MS and s["ttfn_ms"]["p50"] <= 29.2 + SLACK_MS
    assert s["tpot_ms"]["p50"] == pytest.approx(0.4, abs=0.3)
    check_consistent(doc)


def test_outcomes_sla_and_cost(tmp_path, url):
    rows = [{"prompt": FAST}] * 4 + [{"prompt": SLOW}] * 2 + [{"prompt": "status=429"}] * 2 + [{"prompt": "status=500"}]
    doc = run_cli(tmp_path, url, "--dataset", dataset(tmp_path, rows), "--num-requests", "9", "--concurrency", "3",
                  "--gpu-hourly-usd", "4.0", "--gpus", "2")
    s, recs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert (s["requests"], s["ok"], s["rejected"], s["errors"], s["cancelled"]) == (9, 6, 2, 1, 0)
    assert s["admitted"] == 7 and s["sla_met"] == 4
    assert s["sla_attainment"] == pytest.approx(4 / 7)
    assert s["sla_attainment_all"] == pytest.approx(4 / 9)
    assert s["rejection_rate"] == pytest.approx(2 / 9)
    slow = [r for r in recs if r["outcome"] == "ok" and not r["sla_met"]]
    assert len(slow) == 2
    for r in slow:
        assert 257.0 <= r["ttfn_ms"] <= 257.0 + 2 * SLACK_MS and r["tpot_ms"] == pytest.approx(4.0, abs=1.0)
    for r in recs:
        if r["outcome"] == "rejected":
            assert r["status"] == 429 and r["retry_after_s"] == 0.5 and r["output_tokens"] == 0
        if r["outcome"] == "error":
            assert r["status"] == 500 and "scripted failure" in r["error"]
    assert s["output_tokens"] == 6 * 64 and s["good_output_tokens"] == 4 * 64
    assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    tokens_per_hour = s["output_throughput"] * 3600
    assert s["usd_per_1m_output_tokens"] == pytest.approx(4.0 * 2 / tokens_per_hour * 1e6)
    assert s["goodput"] == pytest.approx(4 / s["duration_s"])
    check_consistent(doc)


def test_usage_overrides_chunk_count(tmp_path, url):
    doc = run_cli(tmp_path, url, "--endpoint", "chat", "--dataset", dataset(tmp_path, [{"prompt": "usage=70"}]),
                  "--num-requests", "2", "--output-len", "8")
    for r in doc["runs"][0]["requests"]:
        assert len(r["token_times_s"]) == 8 and r["output_tokens"] == 70  # the role-only chunk is no token
    assert [b["max_tokens"] for b in stats(url)["bodies"]] == [8, 8]
    body = stats(url)["bodies"][0]
    assert body["ignore_eos"] is True and body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("endpoint", ["completions", "realtime"])
def test_barge_in(tmp_path, url, endpoint):
    rows = [{"prompt": "ttft=5 itl=3"}]
    doc = run_cli(tmp_path, url, "--endpoint", endpoint, "--dataset", dataset(tmp_path, rows), "--num-requests", "4",
                  "--concurrency", "2", "--output-len", "64", "--cancel-after-tokens", "5", "--cancel-share", "1")
    s, recs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert s["cancelled"] == 4 and s["ok"] == 0 and s["sla_met"] == 4
    for r in recs:
        assert r["outcome"] == "cancelled" and 5 <= r["output_tokens"] < 64
    check_consistent(doc)  # the SLA judged on the tokens it got
    if endpoint == "realtime":
        assert stats(url)["ws_cancels"] == 4 and all(r["cancel_ms"] is not None for r in recs)
        assert s["cancel_ms"]["n"] == 4
    else:
        assert all(r["output_tokens"] == 5 for r in recs)
        # the server notices the closed streams
        poll(lambda: stats(url)["disconnects"], lambda n: n == 4, 5, "4 disconnects seen", every_s=0.02)


def test_realtime_cancel_race(tmp_path, url):
    # The cancel (after 7 of 8 tokens sent at once) reaches the server after the response ended: the server's
    # error about it must not fail the next turn of the session.
    doc = run_cli(tmp_path, url, "--endpoint", "realtime", "--dataset", dataset(tmp_path, [{"turns": [
        "ttft=1 itl=0"] * 3, "max_tokens": 8}]), "--num-requests", "2", "--cancel-after-tokens", "7")
    recs = doc["runs"][0]["requests"]
    assert len(recs) == 6 and all(r["outcome"] in ("ok", "cancelled") for r in recs), [r["error"] for r in recs]
    assert stats(url)["ws_cancels"] == 6


def test_cancel_share(tmp_path, url):
    doc = run_cli(tmp_path, url, "--input-len", "4", "--output-len", "16", "--num-requests", "40",
                  "--concurrency", "4", "--cancel-after-tokens", "2", "--cancel-share", "0.25", "--seed", "3")
    expected = sum(should_cancel(3, i, 0, 0.25) for i in range(40))
    assert 0 < expected < 40 and doc["runs"][0]["summary"]["cancelled"] == expected


def test_multi_turn_chat_sends_the_growing_conversation(tmp_path, url):
    doc = run_cli(tmp_path, url, "--endpoint", "chat", "--turns", "3", "--num-requests", "2", "--concurrency", "2",
                  "--input-len", "4", "--output-len", "8")
    recs = doc["runs"][0]["requests"]
    assert len(recs) == 6 and {(r["session"], r["turn"]) for r in recs} == {(s, t) for s in (0, 1) for t in (0, 1, 2)}
    assert sorted(stats(url)["message_counts"]) == [1, 1, 3, 3, 5, 5]
    third = next(b for b in stats(url)["bodies"] if len(b["messages"]) == 5)["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == " t" * 8  # the reply the client got
    by_turn = {r["turn"]: r["prompt_tokens"] for r in recs if r["session"] == 0}
    assert by_turn == {0: 4, 1: 4 + 8 + 4, 2: 4 + 8 + 4 + 8 + 4}


def test_a_session_header_names_each_conversation_in_every_turn(tmp_path, url):
    """--session-header: every request of a conversation carries the same x-session-id, and no two conversations
    share one (what a session-sticky router keys on); without it, no header."""
    run_cli(tmp_path, url, "--endpoint", "chat", "--turns", "3", "--num-requests", "2", "--concurrency", "2",
            "--input-len", "4", "--output-len", "8", "--session-header")
    s = stats(url)
    by_id: dict[str, set[str]] = {}
    for sid, body in zip(s["session_ids"], s["bodies"]):
        by_id.setdefault(sid, set()).add(body["messages"][0]["content"])  # the conversation's first message
    assert len(by_id) == 2 and None not in by_id and all(len(firsts) == 1 for firsts in by_id.values()), by_id
    assert len(set().union(*by_id.values())) == 2  # two conversations, one id each
    httpx.post(f"{url}/stats").raise_for_status()
    run_cli(tmp_path, url, "--num-requests", "2", "--input-len", "4", "--output-len", "8")
    assert stats(url)["session_ids"] == [None, None]


def test_multi_turn_realtime_is_one_socket(tmp_path, url):
    doc = run_cli(tmp_path, url, "--endpoint", "realtime", "--turns", "3", "--num-requests", "2",
                  "--concurrency", "2", "--input-len", "4", "--output-len", "8")
    assert [r["outcome"] for r in doc["runs"][0]["requests"]] == ["ok"] * 6
    st = stats(url)
    assert st["ws_sessions"] == 2 and len(st["ws_inputs"]) == 6
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in st["ws_inputs"])  # only the new turn is sent


def test_realtime_rejection(tmp_path, url):
    doc = run_cli(tmp_path, url, "--endpoint", "realtime", "--dataset",
                  dataset(tmp_path, [{"prompt": "status=429"}, {"prompt": FAST}]), "--num-requests", "4")
    s, recs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert s["rejected"] == 2 and s["ok"] == 2 and s["sla_attainment"] == 1.0 and s["sla_attainment_all"] == 0.5
    assert all(r["retry_after_s"] == 0.5 for r in recs if r["outcome"] == "rejected")


def test_open_loop_arrivals_follow_the_schedule(tmp_path, url):
    doc = run_cli(tmp_path, url, "--rate", "50", "--burstiness", "0.5", "--num-requests", "15", "--seed", "5",
                  "--input-len", "4", "--output-len", "4")
    starts = sorted(r["start_s"] for r in doc["runs"][0]["requests"])
    gaps = arrival_gaps(50, 0.5, seed=5)
    due, expected = 0.0, []
    for _ in range(15):
        due += next(gaps)
        expected.append(due)
    for got, want in zip(starts, expected):
        assert want <= got + 0.001 and got - want < 0.03


def test_duration_bounds_arrivals(tmp_path, url):
    doc = run_cli(tmp_path, url, "--rate", "40", "--duration", "0.5", "--input-len", "4", "--output-len", "4")
    recs = doc["runs"][0]["requests"]
    assert 3 <= len(recs) <= 60 and all(r["start_s"] < 0.5 for r in recs)


def test_warmup_is_excluded(tmp_path, url):
    out = tmp_path / "w.json"
    main(["--url", url, "--quiet", "--warmup", "3", "--num-requests", "5", "--concurrency", "2", "--input-len", "4",
          "--output-len", "4", "--json", str(out)])
    assert len(json.loads(out.read_text())["runs"][0]["requests"]) == 5 and stats(url)["requests"] == 8


def test_workers_share_the_load(tmp_path, url):
    doc = run_cli(tmp_path, url, "--workers", "2", "--warmup", "3", "--num-requests", "9", "--concurrency", "4",
                  "--dataset", dataset(tmp_path, [{"prompt": FAST}, {"prompt": "status=429"}]), "--output-len", "16")
    recs = doc["runs"][0]["requests"]
    assert sorted(r["session"] for r in recs) == list(range(3, 12))  # the sessions one process would have sent
    assert sum(r["outcome"] == "rejected" for r in recs) == sum(s % 2 == 1 for s in range(3, 12))
    assert stats(url)["requests"] == 12 and doc["runs"][0]["summary"]["client_loop_lag_ms"]["n"] > 0
    assert max(r["start_s"] for r in recs) < 1.0 and min(r["start_s"] for r in recs) >= 0  # one clock
    check_consistent(doc)


def test_every_sweep_point_warms_its_worker_processes(tmp_path, url):
    """A sweep's every point runs in fresh worker processes, and a point with no warm-up of its own still sends one
    request a process before its clock starts: a fresh process's first request pays its imports and connection (on
    the H100 host the first two arrivals of every later point came 100-150 ms late, and a server judging from the
    client's clock refused them). The warm-ups are not among the point's records."""
    doc = run_cli(tmp_path, url, "--workers", "2", "--sweep", "--sweep-rates", "20,40", "--num-requests", "6",
                  "--dataset", dataset(tmp_path, [{"prompt": FAST}]), "--output-len", "16")
    assert [r["rate"] for r in doc["runs"]] == [20, 40]
    for run in doc["runs"]:
        assert sorted(r["session"] for r in run["requests"]) == list(range(2, 8))
    assert stats(url)["requests"] == 2 * (2 + 6)
    check_consistent(doc)


def test_sweep_json_plot_and_tables(tmp_path, url, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["--url", url, "--warmup", "1", "--sweep", "--sweep-rates", "20,40", "--num-requests", "8",
                 "--input-len", "4", "--output-len", "64", "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert [r["rate"] for r in doc["runs"]] == [20, 40]
    assert doc["sweep"]["best_rate"] == 40 and doc["sweep"]["best"] == doc["runs"][1]["summary"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "Sweep" in text and "SLA attainment, admitted requests" in text and "USD per 1M output tokens" in text
    check_consistent(doc)


def served(metrics_text: str) -> float:
    """The scripted server's streams served so far, from its /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    return next(s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
                if s.name == "parley_engine_host_seconds_count")


def test_metrics_snapshots_bracket_each_rate(tmp_path, url):
    """--metrics-snapshots: the server's /metrics before and after each rate of a sweep, named in the JSON's runs, so
    that its own histograms can be read rate by rate (the scripted server counts one observation a stream). With
    worker processes too: the snapshots are the parent's, around the point's whole load."""
    snaps = tmp_path / "points"
    for workers in ("1", "2"):
        doc = run_cli(tmp_path, url, "--workers", workers, "--sweep", "--sweep-rates", "20,40", "--num-requests", "5",
                      "--dataset", dataset(tmp_path, [{"prompt": FAST}]), "--output-len", "8",
                      "--metrics-snapshots", str(snaps))
        for i, run in enumerate(doc["runs"]):
            names, stem = run["metrics"], f"{i:02d}-{run['rate']:g}"
            assert names == {"before": f"{stem}-before.txt", "after": f"{stem}-after.txt"}
            streams = served((snaps / names["after"]).read_text()) - served((snaps / names["before"]).read_text())
            # the point's requests, and a warm-up request a worker process where there are several
            assert streams == len(run["requests"]) + (int(workers) if workers != "1" else 0)


def test_single_run_plot(tmp_path, url):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cdf.png"
    assert main(["--url", url, "--quiet", "--num-requests", "4", "--output-len", "8", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


def test_no_torch_no_service():
    code = "import loadtest.cli, sys; assert 'torch' not in sys.modules and 'service' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
