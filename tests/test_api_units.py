"""The API's pieces without a server process: sentence chunking, request parsing (the table of unsupported fields,
the realtime settings), and the app built in-process (create_app with a runtime factory) on the tiny synthetic
model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.api.app import create_app
from service.api.chunking import SentenceChunker
from service.api.prompts import sampling_params
from service.api.protocol import (
    SESSION_SETTINGS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    RealtimeResponseConfig,
    RealtimeSessionConfig,
)
from service.api.state import server_state
from service.config import ServeConfig
from service.runtime import build_engine


def chunks_of(pieces: list[str]) -> list[str]:
    c = SentenceChunker()
    out = [chunk for p in pieces for chunk in c.add(p)]
    return out + c.flush()


def test_sentence_chunks_end_at_clause_boundaries() -> None:
    pieces = ["Hello", ",", " world", ".", " How", " are", " you", "?", " Pi", " is", " 3", ".", "14", "!"]
    assert chunks_of(pieces) == ["Hello,", " world.", " How are you?", " Pi is 3.14!"]
    assert chunks_of(["one\n", "two"]) == ["one\n", "two"]
    assert chunks_of(["no boundary at all"]) == ["no boundary at all"]
    assert chunks_of([]) == []


def test_a_long_clause_goes_out_at_a_space() -> None:
    c = SentenceChunker(max_chars=20)
    out = c.add("word " * 10)
    assert out and out[0].endswith(" ") and len(out[0]) <= 50
    assert "".join(out + c.flush()) == "word " * 10


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").prompt_input() == "hi"
    assert CompletionRequest(prompt=["hi"]).prompt_input() == "hi"
    assert CompletionRequest(prompt=[1, 2]).prompt_input() == [1, 2]
    assert CompletionRequest(prompt=[[1, 2]]).prompt_input() == [1, 2]
    with pytest.raises(ValueError):
        CompletionRequest(prompt=["a", "b"])
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[1.5])


def test_chat_fields() -> None:
    r = ChatCompletionRequest(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
                              max_tokens=5, max_completion_tokens=7, top_k=-1, stop="x")
    assert r.messages[0].for_template() == {"role": "system", "content": "ab"}
    assert r.requested_max_tokens == 7 and r.stop_sequences == ("x",)
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], presence_penalty=0.5)


REQUESTS = [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [{"role": "user",
                                                                                         "content": "x"}]})]


@pytest.mark.parametrize("model,base", REQUESTS, ids=["completions", "chat"])
def test_unsupported_fields_take_only_the_value_that_asks_for_nothing(model: type[OpenAIRequest], base: dict
                                                                       ) -> None:
    refused = {"n": 2, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"42": 5}, "logprobs": 1,
               "echo": True, "best_of": 3, "suffix": "!", "top_logprobs": 2, "tools": [{"type": "function"}],
               "response_format": {"type": "json_object"}}
    assert set(model.unsupported) <= set(model.model_fields)
    schema = model.model_json_schema()["properties"]
    for field, rule in model.unsupported.items():
        model(**base, **{field: None})
        accepted = rule.accepted.model_dump() if hasattr(rule.accepted, "model_dump") else rule.accepted
        model(**base, **{field: accepted})
        with pytest.raises(ValidationError) as refusal:
            model(**base, **{field: refused[field]})
        error = refusal.value.errors()[0]
        assert error["loc"] == (field,) and rule.message in error["msg"]
        # the published schema says the same (the fuzzer generates from it)
        said = {k: v for k, v in schema[field].items() if k in ("type", "anyOf")}
        assert said == ({"type": "null"} if accepted is None else {"anyOf": [{"const": accepted}, {"type": "null"}]})


def test_realtime_settings_are_the_sampling_fields() -> None:
    settings = RealtimeSessionConfig()
    assert settings.model_dump(include=SESSION_SETTINGS) == {
        "instructions": None, "max_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop": [],
        "seed": None, "ignore_eos": False, "chunking": "none", "tools": None, "tool_choice": None,
        "parallel_tool_calls": None}
    settings = settings.updated(RealtimeSessionConfig(instructions="be brief", temperature=0.2, seed=7, stop="."))
    # null leaves what has no null of its own as it is, and clears what has one
    settings = settings.updated(RealtimeSessionConfig.model_validate({"temperature": None, "seed": None}))
    assert (settings.instructions, settings.temperature, settings.seed, settings.stop_sequences) == (
        "be brief", 0.2, None, (".",))
    turn = settings.updated(RealtimeResponseConfig(input="hi", max_tokens=5, top_k=-1, id="r"))
    params = sampling_params(turn, 5)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (5, 0.2, 0, (".",))
    assert settings.max_tokens is None  # a response's overrides are its own
    with pytest.raises(ValidationError):
        RealtimeResponseConfig.model_validate({"input": None})


SLA_TOKENS = 8  # not 64: the realtime timing key is named for the server's N


@pytest.fixture(scope="module")
def app_client():
    cfg = ServeConfig(model="synthetic:tiny", max_batch=2, max_context=256, device="cpu", backend="reference",
                      sla_tokens=SLA_TOKENS)
    app = create_app(lambda: build_engine(cfg))
    with TestClient(app) as client:  # the lifespan builds the runtime before the first request
        yield client, app


def test_app_from_a_factory(app_client) -> None:
    client, app = app_client
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "synthetic:tiny"
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as s:
        assert s.read().decode().endswith("data: [DONE]\n\n")
    with client.websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "response.create", "response": {"input": "hi", "max_tokens": 2, "ignore_eos": True}})
        events = [ws.receive_json() for _ in range(2)]
        while events[-1]["type"] != "response.done":
            events.append(ws.receive_json())
        assert events[0]["type"] == "response.created" and events[-1]["response"]["status"] == "completed"
        assert set(events[-1]["response"]["timings"]) == {"queue_ms", "prefill_ms", "ttft_ms", f"ttf{SLA_TOKENS}_ms",
                                                          "e2e_ms"}


def test_draining_answers_503(app_client) -> None:
    client, app = app_client
    st = server_state(app)
    st.draining = True
    try:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        st.draining = False
    assert client.get("/health").status_code == 200
