"""The OpenAI-compatible HTTP API against a real `parley serve` on loopback: the `openai` SDK (streaming and not),
the raw SSE framing, a dropped stream freeing its slot, and the documented errors."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server_support import Server, assert_openai_error, scrape_metrics, sse_data, sse_events, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(shared_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_health_metrics(shared_server: Server, model_id: str) -> None:
    assert model_id == "smollm2-135m-instruct"  # the --model value (the default)
    r = httpx.get(f"{shared_server.base}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(f"{shared_server.base}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "parley_kv_slots_total" in r.text


def test_sdk_streaming_completion(client: openai.OpenAI, model_id: str) -> None:
    stream = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip()
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens > 0
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_how_late_tokens_reach_the_front_end_is_measured(shared_server: Server, client: openai.OpenAI,
                                                           model_id: str) -> None:
    """parley_token_delivery_seconds: every delta of tokens the engine publishes is timed from then until the front
    end's event loop reads it for the reply; an idle server's stream adds a few, each well under a step."""
    name = "parley_token_delivery_seconds"
    wait_idle(shared_server.base)
    before = scrape_metrics(shared_server.base)
    stream = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert sum(len(c.choices[0].text) > 0 for c in stream if c.choices) >= 1
    after = wait_idle(shared_server.base)
    deltas = after[f"{name}_count"] - before[f"{name}_count"]
    waited = after[f"{name}_sum"] - before[f"{name}_sum"]
    assert 1 <= deltas <= 8, deltas  # each delta carries one token or more
    assert 0 <= waited / deltas < 0.1, waited / deltas


def test_the_front_end_event_loop_is_watched(shared_server: Server) -> None:
    """parley_front_end_loop_lag_seconds: the front end's event loop is sampled every 5 ms from start-up on, how late
    each wake-up came; a second of an idle server adds about 200 samples (a loaded CI box: at least 20), never more
    than one each 5 ms."""
    name = "parley_front_end_loop_lag_seconds"
    t0 = time.monotonic()
    before = scrape_metrics(shared_server.base)
    time.sleep(1.0)
    after = scrape_metrics(shared_server.base)
    samples = after[f"{name}_count"] - before[f"{name}_count"]
    assert 20 <= samples <= (time.monotonic() - t0) / 0.005 + 1, samples


def test_sdk_streaming_chat(client: openai.OpenAI, model_id: str) -> None:
    stream = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert 0 < usage.completion_tokens <= 12
    # other tests may have left this prompt's prefix in the cache: some tokens may come from it, never all
    assert usage.prompt_tokens_details is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_sdk_non_streaming_matches_streaming(client: openai.OpenAI, model_id: str) -> None:
    """Greedy: the same text whether streamed or not, for both endpoints."""
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert full.object == "text_completion"
    assert full.choices[0].text == streamed and streamed
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens <= 10

    chat = client.chat.completions.create(model=model_id, messages=MESSAGES, max_completion_tokens=10,
                                          temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == streamed and streamed
    assert chat.usage is not None and chat.usage.prompt_tokens > 0


def test_stop_sequence_and_token_prompt(client: openai.OpenAI, model_id: str, shared_server: Server) -> None:
    ids = httpx.post(f"{shared_server.base}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()
    text = ids["choices"][0]["text"]
    cut = text.strip()[:3]  # a stop string that the greedy output contains
    stopped = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert cut not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    # token ids as the prompt: [1, 2, 3] are valid ids for any vocabulary
    r = client.completions.create(model=model_id, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_raw_sse_framing(shared_server: Server, endpoint: str) -> None:
    body: dict = {"max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", MESSAGES
    else:
        path, body["prompt"] = "/v1/completions", PROMPT
    with httpx.stream("POST", shared_server.base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n"), "every SSE event ends with a blank line"
    for e in raw[:-2].split("\n\n"):
        assert e.startswith("data: ") and "\n" not in e, f"not one `data:` line: {e!r}"
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    for c in chunks:
        assert set(c) >= {"id", "object", "created", "model", "choices"}
        assert c["object"] == obj and c["id"] == chunks[0]["id"] and isinstance(c["created"], int)
    *content, usage = chunks
    assert usage["choices"] == []
    u = usage["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert list(u["prompt_tokens_details"]) == ["cached_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
    for c in content:
        (choice,) = c["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None and "finish_reason" in choice
        assert ("delta" in choice) if endpoint == "chat" else isinstance(choice["text"], str)
    assert [c["choices"][0]["finish_reason"] for c in content][-1] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    if endpoint == "chat":
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"


def test_dropped_stream_frees_its_slot(shared_server: Server) -> None:
    wait_idle(shared_server.base)
    before = scrape_metrics(shared_server.base).requests("cancelled")
    body = {"prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{shared_server.base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if (first := sse_data(line)) is not None:
                break  # one chunk, then hang up (a barge-in)
    assert json.loads(first)["choices"][0]["text"], first  # a token, not an error event
    t0 = time.monotonic()
    after = wait_idle(shared_server.base, timeout_s=15)
    assert after.requests("cancelled") == before + 1, (
        {o: after.requests(o) for o in ("completed", "cancelled", "failed")}, shared_server.log_tail())
    assert time.monotonic() - t0 < 15


BAD = [
    # name, path, request kwargs, status, code, param
    ("bad json", "/v1/completions", {"content": b'{"prompt": ', "headers": {"content-type": "application/json"}},
     400, "invalid_json", None),
    ("missing prompt", "/v1/completions", {"json": {"max_tokens": 2}}, 400, "missing_required_parameter",
     "prompt"),
    ("wrong type", "/v1/completions", {"json": {"prompt": "x", "max_tokens": "many"}}, 400, "invalid_value",
     "max_tokens"),
    ("prompt type", "/v1/completions", {"json": {"prompt": {"text": "x"}}}, 400, "invalid_value", "prompt"),
    ("n=2", "/v1/completions", {"json": {"prompt": "x", "n": 2}}, 400, "invalid_value", "n"),
    ("temperature=5", "/v1/completions", {"json": {"prompt": "x", "temperature": 5}}, 400, "invalid_value",
     "temperature"),
    ("top_p=0", "/v1/completions", {"json": {"prompt": "x", "top_p": 0}}, 400, "invalid_value", "top_p"),
    ("unknown model", "/v1/completions", {"json": {"prompt": "x", "model": "gpt-9"}}, 404, "model_not_found",
     "model"),
    ("prompt too long", "/v1/completions", {"json": {"prompt": "hello " * 1100}}, 400, "context_length_exceeded",
     "prompt"),
    ("max_tokens too many", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 5000}}, 400,
     "context_length_exceeded", "max_tokens"),
    ("empty prompt", "/v1/completions", {"json": {"prompt": ""}}, 400, "empty_prompt", "prompt"),
    ("token out of vocabulary", "/v1/completions", {"json": {"prompt": [1, 2, 10_000_000]}}, 400,
     "invalid_token_id", "prompt"),
    ("oversize body", "/v1/completions", {"json": {"prompt": "a" * (2 << 20)}}, 413, "request_too_large", None),
    ("echo", "/v1/completions", {"json": {"prompt": "x", "echo": True}}, 400, "invalid_value", "echo"),
    ("5 stops", "/v1/completions", {"json": {"prompt": "x", "stop": list("abcde")}}, 400, "invalid_value", "stop"),
    ("not an object", "/v1/completions", {"json": ["x"]}, 400, "invalid_body", None),
    ("no messages", "/v1/chat/completions", {"json": {"messages": []}}, 400, "invalid_value", "messages"),
    ("image part", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}}, 400, "invalid_value", "messages.0.content"),
    ("bad role", "/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}}, 400,
     "invalid_value", "messages.0.role"),
    ("chat n=3", "/v1/chat/completions", {"json": {"messages": MESSAGES, "n": 3}}, 400, "invalid_value", "n"),
    ("chat unknown model", "/v1/chat/completions", {"json": {"messages": MESSAGES, "model": "x"}}, 404,
     "model_not_found", "model"),
    ("unknown route", "/v1/embeddings", {"json": {"input": "x"}}, 404, "not_found", None),
]


@pytest.mark.parametrize("name,path,kwargs,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_documented_errors(shared_server: Server, name: str, path: str, kwargs: dict, status: int, code: str,
                           param: str | None) -> None:
    r = httpx.post(shared_server.base + path, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert_openai_error(r.json(), code, param, type="invalid_request_error")


def test_healthy_after_errors_and_unknown_fields_ignored(shared_server: Server, client: openai.OpenAI,
                                                         model_id: str) -> None:
    assert httpx.get(f"{shared_server.base}/health", timeout=30).status_code == 200
    # what OpenAI clients send along: zero penalties, a user, fields Parley has never heard of
    r = httpx.post(f"{shared_server.base}/v1/chat/completions", timeout=120, json={
        "model": model_id, "messages": MESSAGES, "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0,
        "user": "u1", "parallel_tool_calls": False, "metadata": {"a": "b"}, "some_future_field": 1})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="x", max_tokens=1, presence_penalty=1.5)
