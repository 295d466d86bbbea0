"""parley-loadtest's voice scenario (`--scenario voice`) and the voice benchmark (`python -m bench voice`,
bench/voice_report.py): the sessions it makes, the requests it sends over HTTP chat (the whole conversation as heard,
every turn) and the realtime WebSocket (only the new turn; barge-in = response.cancel + conversation.item.truncate;
preemptive starts out of band), checked on the scripted server (tests/loadtest_scripted_server.py); the figures by
turn on fixed records; the benchmark end to end on the scripted server and on the real one."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.voice_report import capacity_rates
from loadtest.record import RequestRecord, finish
from loadtest.runner import FALLBACK_REPLY
from loadtest.stats import by_turn, conversation_figures, percentile
from loadtest.workload import synthetic_sessions
from tests.server_support import ROOT, Server, poll
from tests.test_loadtest_scripted import run_cli, scripted_server, stats, url  # noqa: F401  (fixtures)

K_BARGE, K_EARLY, OUT = 3, 2, 16  # barge in after 3 tokens, cancel a preemptive start after 2, replies of 16
VOICE = ["--scenario", "voice", "--num-requests", "2", "--concurrency", "1", "--turns", "4", "--system-len", "30",
         "--input-len", "10", "--output-len", str(OUT), "--cancel-after-tokens", str(K_BARGE), "--cancel-share", "0.5",
         "--preemptive-share", "0.5", "--preemptive-after-tokens", str(K_EARLY), "--seed", "3",
         "--extra-body", json.dumps({"script": "ttft=2 itl=3"})]  # token 3 at 8 ms, token 16 at 47 ms


def words(text: str) -> list[str]:
    return text.split()


# -- the sessions ---------------------------------------------------------------------------------------------------
def test_voice_sessions() -> None:
    sessions = list(itertools.islice(synthetic_sessions(40, 64, 0.0, 8, 5, 1500, False, 0.3, 2), 20))
    plain = list(itertools.islice(synthetic_sessions(40, 64, 0.0, 8, 5), 20))
    assert len(words(sessions[0].system)) == 1500 and {s.system for s in sessions} == {sessions[0].system}
    starts = [len(t.preemptive) for s in sessions for t in s.turns]
    assert set(starts) == {0, 1, 2} and 0.15 < sum(n > 0 for n in starts) / len(starts) < 0.45
    for s, p in zip(sessions, plain):
        assert [t.messages for t in s.turns] == [t.messages for t in p.turns]  # the same seed, the same messages
        for t in s.turns:
            full = words(t.messages[0]["content"])
            assert len(full) == 40 and t.max_tokens == 64
            cuts = [words(m[0]["content"]) for m in t.preemptive]
            assert all(20 <= len(c) < 40 and c == full[:len(c)] for c in cuts)
            assert [len(c) for c in cuts] == sorted({len(c) for c in cuts})  # growing transcripts
    own = list(itertools.islice(synthetic_sessions(4, 8, 0.0, 1, 5, 50, True), 3))
    assert len({s.system for s in own}) == 3 and all(len(words(s.system)) == 50 for s in own)
    assert next(synthetic_sessions(4, 8)).system is None


# -- the requests ----------------------------------------------------------------------------------------------------
def replies(doc: dict) -> list[dict]:
    return doc["runs"][0]["requests"]


def test_http_chat_sends_the_whole_conversation_as_heard(tmp_path, url):  # noqa: F811
    recs = replies(run_cli(tmp_path, url, "--endpoint", "chat", *VOICE))
    bodies = stats(url)["bodies"]
    assert len(bodies) == len(recs)  # one session at a time: the i-th request sent is the i-th record
    kinds = [r["kind"] for r in recs]
    assert {"turn", "barge-in", "preemptive"} <= set(kinds) and all(r["endpoint"] == "chat" for r in recs)
    system = bodies[0]["messages"][0]
    assert system["role"] == "system" and len(words(system["content"])) == 30
    history: dict[int, list[dict]] = {}
    for i, (r, body) in enumerate(zip(recs, bodies)):
        conversation = history.setdefault(r["session"], [system])
        *before, last = body["messages"]
        assert before == conversation and last["role"] == "user"  # the whole conversation, every request
        assert body["max_tokens"] == OUT and body["ignore_eos"] is True and body["stream"] is True
        if r["kind"] == "preemptive":
            kept = next(b for b, x in zip(bodies[i:], recs[i:]) if x["kind"] != "preemptive")["messages"][-1]
            assert words(kept["content"])[:len(words(last["content"]))] == words(last["content"])
            assert len(words(last["content"])) < len(words(kept["content"]))  # a partial transcript...
            assert r["outcome"] == "cancelled" and r["output_tokens"] == K_EARLY  # ...dropped after a few tokens
            assert r["prompt_tokens"] is None  # the stream was closed before its usage came
            continue
        heard = K_BARGE if r["kind"] == "barge-in" else OUT
        assert r["outcome"] == ("cancelled" if r["kind"] == "barge-in" else "ok") and r["output_tokens"] == heard
        conversation += [last, {"role": "assistant", "content": " t" * heard}]  # only what was heard
        if r["kind"] == "turn":  # the usage chunk: prompt tokens and the server's cached ones
            assert r["prompt_tokens"] == sum(len(words(m["content"])) for m in body["messages"])
            assert r["cached_tokens"] == stats(url)["cached"][i] and r["cached_tokens"] > 0
    closed = sum(k != "turn" for k in kinds)  # every barge-in and preemptive start closed its stream early
    poll(lambda: stats(url)["disconnects"], lambda n: n == closed, 5, f"{closed} disconnects seen", every_s=0.02)


def test_realtime_sends_only_the_new_turn(tmp_path, url):  # noqa: F811
    recs = replies(run_cli(tmp_path, url, "--endpoint", "realtime", *VOICE))
    events = stats(url)["ws_events"]
    assert {"turn", "barge-in", "preemptive"} <= {r["kind"] for r in recs}
    updates = [e for e in events if e["type"] == "session.update"]
    assert len(updates) == 2 and len(words(updates[0]["session"]["instructions"])) == 30  # once per session
    at = [i for i, e in enumerate(events) if e["type"] == "response.create"]
    assert len(at) == len(recs)  # one session at a time: the i-th response.create is the i-th record
    for r, start, end in zip(recs, at, [*at[1:], len(events)]):
        create, following = events[start]["response"], events[start + 1:end]
        [message] = create["input"]  # only the new turn
        assert message["role"] == "user" and create["max_tokens"] == OUT
        cancels = [e for e in following if e["type"] == "response.cancel"]
        truncates = [e for e in following if e["type"] == "conversation.item.truncate"]
        if r["kind"] == "preemptive":  # out of the conversation, cancelled early, nothing to truncate
            assert create["conversation"] == "none" and cancels == [{"type": "response.cancel",
                                                                     "response_id": create["id"]}]
            assert not truncates and r["outcome"] in ("ok", "cancelled") and r["output_tokens"] >= K_EARLY
        elif r["kind"] == "barge-in":  # cancelled, then the conversation cut to what was heard
            assert "conversation" not in create and len(cancels) == 1
            assert truncates == [{"type": "conversation.item.truncate", "item_id": f"item_{create['id']}",
                                  "content_index": 0, "text_end": len(" t" * K_BARGE)}]
            assert r["cancel_ms"] is not None
        else:
            assert "conversation" not in create and not cancels and not truncates
    kept = [r for r in recs if r["kind"] != "preemptive"]
    for a, b in zip(kept, kept[1:]):
        if a["session"] == b["session"]:  # the next turn's cache: the last prompt and the reply as heard
            heard = K_BARGE if a["kind"] == "barge-in" else OUT
            assert b["cached_tokens"] == a["prompt_tokens"] + heard


REFUSED = ["--scenario", "voice", "--num-requests", "2", "--concurrency", "1", "--turns", "3", "--system-len", "10",
           "--input-len", "5", "--output-len", "4", "--cancel-share", "0", "--preemptive-share", "0", "--seed", "3",
           "--extra-body", json.dumps({"script": "ttft=1 itl=1 refuse_turn=1"})]  # every session's 2nd turn: 429


@pytest.mark.parametrize("endpoint", ["chat", "realtime"])
def test_a_refused_turn_ends_the_session_or_falls_back(tmp_path, url, endpoint):  # noqa: F811
    """A caller hangs up at a refused turn (the default); a voice agent with a fallback LLM goes on: the refused turn
    joins the conversation as the fallback answered it, and the next turn is asked here again."""
    hung_up = replies(run_cli(tmp_path, url, "--endpoint", endpoint, *REFUSED))
    assert [(r["session"], r["turn"], r["outcome"]) for r in hung_up] == [
        (s, t, o) for s in (0, 1) for t, o in ((0, "ok"), (1, "rejected"))]
    before = len(stats(url)["bodies"]), len(stats(url)["ws_events"])
    went_on = replies(run_cli(tmp_path, url, "--endpoint", endpoint, "--after-refusal", "fall-back", *REFUSED))
    assert [(r["session"], r["turn"], r["outcome"]) for r in went_on] == [
        (s, t, o) for s in (0, 1) for t, o in ((0, "ok"), (1, "rejected"), (2, "ok"))]
    if endpoint == "chat":  # the third turn's conversation: the refused turn's message and the fallback's reply
        third = [b for b in stats(url)["bodies"][before[0]:] if sum(m["role"] == "user" for m in b["messages"]) == 3]
        assert len(third) == 2
        for body in third:
            assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
            assert body["messages"][4]["content"] == FALLBACK_REPLY
    else:  # between the refused response.create and the next: the user's message and the fallback's reply, added
        events = stats(url)["ws_events"][before[1]:]
        added = [e["item"] for e in events if e["type"] == "conversation.item.create"]
        assert [(i["role"], i["content"] == FALLBACK_REPLY) for i in added] == [("user", False),
                                                                                 ("assistant", True)] * 2
        creates = [e["response"] for e in events if e["type"] == "response.create"]
        assert [i["content"] for i in added[::2]] == [c["input"][0]["content"] for c in creates[1::3]]


# -- the figures -----------------------------------------------------------------------------------------------------
def record(turn: int, kind: str, outcome: str = "ok", tokens: int = 64, ttft: float = 0.01, itl: float = 0.001,
           prompt: int | None = 100, cached: int | None = 60, cancel_ms: float | None = None) -> RequestRecord:
    times = [ttft + i * itl for i in range(tokens)] if outcome in ("ok", "cancelled") else []
    r = RequestRecord(0, turn, "realtime", kind, 0.0, 1.0, outcome, token_times_s=times, prompt_tokens=prompt,
                      cached_tokens=cached, cancel_ms=cancel_ms, output_tokens=len(times))
    return finish(r, 64, 100.0)


def test_conversation_figures() -> None:
    recs = [record(0, "turn", ttft=0.010), record(0, "turn", ttft=0.020, itl=0.002),  # the 2nd misses the SLA
            record(0, "barge-in", "cancelled", tokens=8, ttft=0.030, cancel_ms=1.5, prompt=None, cached=None),
            record(0, "turn", "rejected", prompt=None, cached=None),
            record(0, "preemptive", "cancelled", tokens=4, ttft=0.005, cancel_ms=0.5),
            record(0, "preemptive", "rejected"),
            record(1, "turn", prompt=200, cached=150)]
    [first, second] = by_turn(recs, 64)
    assert first["turn"] == 1 and second["turn"] == 2
    assert (first["requests"], first["barge_ins"], first["rejected"], first["preemptive"]) == (4, 1, 1, 2)
    assert first["admitted_share"] == 0.75 and first["sla_attainment_admitted"] == pytest.approx(2 / 3)
    assert first["ttft_ms_p50"] == pytest.approx(20.0) and first["ttft_ms_p99"] == pytest.approx(
        percentile([10.0, 20.0, 30.0], 99))
    assert first["ttf64_ms_p50"] == pytest.approx(percentile([10.0 + 63 * 1.0, 20.0 + 63 * 2.0], 50))  # no barge-in
    assert first["prompt_tokens"] == 100 and first["cached_tokens"] == 60 and first["cached_share"] == 0.6
    assert first["preemptive_admitted_share"] == 0.5 and first["preemptive_ttft_ms_p50"] == pytest.approx(5.0)
    assert first["cancel_ms_p50"] == pytest.approx(1.0)  # barge-ins' and preemptive starts' cancels
    assert second["cached_share"] == 0.75 and second["preemptive"] == 0 and second["preemptive_admitted_share"] is None
    whole = conversation_figures(recs, 64)
    assert whole["requests"] == 5 and whole["cached_share"] == pytest.approx(270 / 400)


# -- the benchmark ---------------------------------------------------------------------------------------------------
RECORD_KEYS = {"run", "endpoint", "turn", "prompt_tokens", "cached_tokens", "ttft_ms_p50", "ttft_ms_p99",
               "ttf64_ms_p50", "ttf64_ms_p99", "admitted_share", "sla_attainment_admitted", "requests", "barge_ins",
               "preemptive", "cancel_ms_p99"}


def voice_benchmark(tmp_path: Path, url: str, **sets: str) -> tuple[Path, dict[str, Any]]:  # noqa: F811
    """`python -m bench voice` against the server at `url` (it starts none), at tiny sizes; its raw folder and
    report."""
    raw, results = tmp_path / "raw", tmp_path / "results"
    sets = {"sessions": "2", "warmup": "0", "think_s": "0", "fresh": "16,40", "fresh_requests": "2",
            "fresh_out": "8", "sweep_rates": "4,8", "sweep_s": "0.5", "sweep_workers": "1", **sets}
    cmd = [sys.executable, "-m", "bench", "voice", "--url", url, "--raw", str(raw), "--out", str(results),
           *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [report] = results.glob("voice-*.json")
    assert report.with_suffix(".md").read_text().startswith("# Voice benchmark")
    assert report.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return raw, json.loads(report.read_text())


def test_benchmark_on_the_scripted_server(tmp_path, url):  # noqa: F811
    raw, doc = voice_benchmark(tmp_path, url, fresh="16,2000", voice_args="--turns 3 --system-len 30 --input-len 10 "
                               "--output-len 16 --cancel-share 0.5 --preemptive-share 0.5 --cancel-after-tokens 3")
    assert doc["device"] and doc["model"] == "scripted-model" and doc["sla_tokens"] == 64
    sessions = [r for r in doc["records"] if r["run"] == "session"]
    assert [(r["endpoint"], r["turn"]) for r in sessions] == [(e, t) for e in ("chat", "realtime") for t in (1, 2, 3)]
    assert [r["fresh_prompt_len"] for r in doc["records"] if r["run"] == "fresh"] == [16, 2000]
    assert all(RECORD_KEYS <= set(r) for r in doc["records"])
    assert [(p["endpoint"], p["rate"]) for p in doc["sweep"]] == [(e, r) for e in ("chat", "realtime") for r in (4, 8)]
    assert len(doc["targets"]) == 8 and all(t["measured"] is not None for t in doc["targets"])
    # the many-sessions targets read the highest rate; the scripted server admits every turn, on time
    at_8 = {t["target"]: t for t in doc["targets"] if "at 8 sessions/s" in t["target"]}
    assert len(at_8) == 2 and all(t["measured"] == 1.0 and t["met"] for t in at_8.values())
    assert doc["serve"] is None  # measured at --url: the flags were not the benchmark's
    # the server's engine loop at each rate, from its /metrics around the rate (the scripted server observes its
    # host-time histogram once a finished HTTP stream): read rate by rate, none of the GPU's on this server
    for p in (p for p in doc["sweep"] if p["endpoint"] == "chat"):
        assert p["host_us_p99"] > 0 and p["gpu_idle_us_p99"] is None
    assert (raw / "sweep-chat.points").is_dir()
    # every figure is the aggregate of the raw records
    single = json.loads((raw / "session-chat.json").read_text())["runs"][0]["requests"]
    for row in (r for r in sessions if r["endpoint"] == "chat"):
        mine = [x for x in single if x["turn"] == row["turn"] - 1 and x["kind"] != "preemptive"]
        assert row["requests"] == len(mine) == 2
        assert row["ttft_ms_p99"] == pytest.approx(percentile([x["ttft_ms"] for x in mine], 99))
        usage = [x for x in mine if x["prompt_tokens"] is not None]
        assert row["prompt_tokens"] == pytest.approx(sum(x["prompt_tokens"] for x in usage) / len(usage))
    fresh = json.loads((raw / "fresh-2000.json").read_text())["runs"][0]["requests"]
    row = next(r for r in doc["records"] if r.get("fresh_prompt_len") == 2000)
    assert row["prompt_tokens"] == 2000 and row["ttf64_ms_p50"] == pytest.approx(
        percentile([x["ttfn_ms"] for x in fresh], 50))


def test_voice_report_puts_the_capacity_beside_the_sweep(tmp_path, url):  # noqa: F811
    """The capacity sweep (admission off) beside the sweep at the same rates: the replies on time both ways, and the
    capacity (the highest rate with 99% of replies on time, admission off). Here the scripted server's replies come
    later in the sweep (the 64th token at ~192 ms: late) than in the capacity run (~65 ms: on time at both rates)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "device.json").write_text(json.dumps({"device": "test-device"}))
    common = ["--scenario", "voice", "--endpoint", "chat", "--sweep", "--duration", "0.5", "--warmup", "0",
              "--think-s", "0", "--turns", "2", "--system-len", "20", "--input-len", "8", "--output-len", "64",
              "--cancel-share", "0", "--preemptive-share", "0", "--seed", "1", "--after-refusal", "fall-back"]
    for kind, rates, itl in (("sweep", "8", 3), ("capacity", "4,8", 1)):
        run_cli(tmp_path, url, *common, "--sweep-rates", rates,
                "--extra-body", json.dumps({"script": f"ttft=2 itl={itl}"}))
        (tmp_path / "run.json").rename(raw / f"{kind}-chat.json")
    out = subprocess.run([sys.executable, "-m", "bench", "voice", "--report-only", "--raw", str(raw), "--out",
                          str(tmp_path / "results")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [report] = (tmp_path / "results").glob("voice-*.json")
    doc = json.loads(report.read_text())
    [on], off = doc["sweep"], doc["capacity"]
    assert [(r["endpoint"], r["rate"]) for r in off] == [("chat", 4), ("chat", 8)] and on["rate"] == 8
    assert on["requests"] > 0 and on["on_time_share"] == 0.0
    assert all(r["requests"] > 0 and r["on_time_share"] == 1.0 for r in off)
    assert doc["capacity_rate"] == {"chat": 8}
    md = report.with_suffix(".md").read_text()
    assert "## Capacity: the same arrivals, admission off" in md and "Capacity, chat: 8 sessions/s." in md
    assert "both servers are asked for the same turns" in md  # the sessions fell back at a refusal
    # admission keeps what fits: on time with it (none at 8/s here) over on time without it, where both ran
    [kept] = [t for t in doc["targets"] if t["target"].startswith("capacity: replies on time")]
    assert kept["measured"] == 0.0 and kept["met"] is False and "chat at 8/s" in kept["target"]
    n4, n8 = (r["requests"] for r in off)
    assert f"| chat | 4.00 | {n4} | {n4} (100%) | " in md  # no sweep at 4/s: its side is empty
    assert f"| chat | 8.00 | {n8} | {n8} (100%) | " in md and f"| {on['requests']} | 100% | 0 (0%) |" in md


def test_voice_capacity_is_the_highest_rate_served_on_time_with_admission_off() -> None:
    rows = [{"endpoint": "chat", "rate": r, "on_time_share": s} for r, s in ((2, 1.0), (4, 0.995), (8, 0.45))]
    rows += [{"endpoint": "realtime", "rate": r, "on_time_share": s} for r, s in ((2, 0.98), (4, None))]
    assert capacity_rates({"capacity": rows}) == {"chat": 4, "realtime": None}
    assert capacity_rates({"sweep": []}) == {}


@pytest.mark.slow
def test_benchmark_on_parley(tmp_path, shared_server: Server):
    """The whole benchmark, tiny, against the real server: every reply of every session is served, and over the
    realtime WebSocket each turn after the first finds the conversation in the cache."""
    raw, doc = voice_benchmark(tmp_path, shared_server.base, sessions="1", sweep_rates="2",
                               voice_args="--turns 3 --system-len 40 --input-len 10 --output-len 8 --seed 3 "
                                          "--cancel-after-tokens 3 --cancel-share 0.5 --preemptive-share 0.5 "
                                          "--preemptive-after-tokens 2 --timeout 120")
    for endpoint in ("chat", "realtime"):
        recs = json.loads((raw / f"session-{endpoint}.json").read_text())["runs"][0]["requests"]
        assert {x["kind"] for x in recs} == {"turn", "barge-in", "preemptive"}
        assert all(x["outcome"] in ("ok", "cancelled") for x in recs), [x["error"] for x in recs]
    rows = {(r["endpoint"], r["turn"]): r for r in doc["records"] if r["run"] == "session"}
    assert all(r["admitted_share"] == 1.0 for r in rows.values())
    for turn in (2, 3):
        r = rows[("realtime", turn)]
        assert r["cached_tokens"] > rows[("realtime", turn - 1)]["cached_tokens"] and r["cached_tokens"] < \
            r["prompt_tokens"]
    assert [r["admitted_share"] for r in doc["records"] if r["run"] == "fresh"] == [1.0, 1.0]
