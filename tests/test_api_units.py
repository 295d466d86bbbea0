"""The API's pieces without a server process: sentence chunking, request parsing (the table of unsupported fields,
the realtime settings), and the app built in-process (create_app with a runtime factory) on the tiny synthetic
model."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_text_parts_by_the_realtime_apis_names_are_text_too() -> None:
    """OpenAI's Realtime API sends a user's text as `input_text` parts and gives the assistant's back as `output_text`
    (as Parley's response.done does): a voice client that sends them gets the same turn as with `text`; anything else
    is still refused, naming the field."""
    from service.api.protocol import ChatMessage

    for kind in ("text", "input_text", "output_text"):
        m = ChatMessage(role="user", content=[{"type": kind, "text": "hi "}, {"type": "text", "text": "there"}])
        assert m.for_template() == {"role": "user", "content": "hi there"}
    with pytest.raises(ValueError, match="input_text"):
        ChatMessage(role="user", content=[{"type": "input_audio", "audio": "..."}])


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
        "parallel_tool_calls": None, "response_format": None}
    settings = settings.updated(RealtimeSessionConfig(instructions="be brief", temperature=0.2, seed=7, stop="."))
    # null leaves what has no null of its own as it is, and clears what has one
    settings = settings.updated(RealtimeSessionConfig.model_validate({"temperature": None, "seed": None}))
    assert (settings.instructions, settings.temperature, settings.seed, settings.stop_sequences) == (
        "be brief", 0.2, None, (".",))
    turn = settings.updated(RealtimeResponseConfig(input="hi", max_tokens=5, top_k=-1, id="r"))
    params = sampling_params(turn, 5)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (5, 0.2, 0, (".",))
    assert settings.max_tokens is None  # a response's overrides are its own
    # no input, or a null one, replies to the conversation as it stands (the items conversation.item.create added)
    assert RealtimeResponseConfig.model_validate({"input": None}).input == []
    assert RealtimeResponseConfig.model_validate({}).input == []
    with pytest.raises(ValidationError):
        RealtimeResponseConfig.model_validate({"input": 42})


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
        assert events[0]["type"] == "response.created" and events[-1]["response"]["status"] == "incomplete"
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


CTX, VOCAB = 256, 512  # app_client's model


@pytest.mark.parametrize("body,code,param", [
    ({"prompt": [1] * 250, "max_tokens": 7}, "context_length_exceeded", "max_tokens"),
    ({"prompt": [1] * CTX}, "context_length_exceeded", "prompt"),
    ({"prompt": []}, "empty_prompt", "prompt"),
    ({"prompt": [1, VOCAB]}, "invalid_token_id", "prompt"),
    ({"prompt": "hi", "max_tokens": 10**30}, "context_length_exceeded", "max_tokens"),
], ids=["max_tokens past the context", "prompt fills the context", "empty", "id past the vocabulary", "10**30"])
def test_a_prompt_the_engine_refuses_is_a_400_naming_the_field(app_client, body: dict, code: str, param: str
                                                                ) -> None:
    client, _ = app_client
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)


def test_the_context_is_the_engines_up_to_its_last_token(app_client) -> None:
    client, _ = app_client
    r = client.post("/v1/completions", json={"prompt": [1] * 250, "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == CTX
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * CTX}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_render_gives_the_ids_a_request_would_submit(app_client) -> None:
    """vLLM's /render (what vllm-router's cache-aware policy asks each replica): the prompt's token ids, as many as
    the same request's usage counts, and the ids themselves for a prompt given as ids; nothing is generated."""
    client, _ = app_client
    messages = [{"role": "system", "content": "You route."}, {"role": "user", "content": "Where to?"}]
    ids = client.post("/v1/chat/completions/render", json={"messages": messages}).json()["token_ids"]
    used = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()["usage"]
    assert len(ids) == used["prompt_tokens"] and all(isinstance(t, int) for t in ids)
    r = client.post("/v1/completions/render", json={"prompt": [5, 6, 7]})
    assert r.status_code == 200 and r.json() == [{"token_ids": [5, 6, 7]}]
    assert client.post("/v1/completions/render", json={"prompt": [5], "n": 3}).status_code == 400


def realtime_events(ws, until: str) -> list[dict]:
    events = [ws.receive_json()]
    while events[-1]["type"] not in (until, "error"):
        events.append(ws.receive_json())
    return events


PERSON = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}}, "required": ["ok", "n"]}


def test_a_realtime_turn_follows_response_format(app_client) -> None:
    """The same turn as chat's: response_format on the session (or one response) makes the reply JSON valid for the
    schema, whatever the (random) model would say, for a conversation and for a text prompt."""
    jsonschema = pytest.importorskip("jsonschema")
    client, _ = app_client
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with client.websocket_connect("/v1/realtime") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "session.update", "session": {"response_format": fmt, "max_tokens": 40}})
        [updated] = realtime_events(ws, "session.updated")
        assert updated["session"]["response_format"]["json_schema"]["schema"] == PERSON
        for prompt in ([{"role": "user", "content": "hi"}], "Once upon a time"):
            ws.send_json({"type": "response.create", "response": {"input": prompt}})
            done = realtime_events(ws, "response.done")[-1]
            assert done["type"] == "response.done", done
            jsonschema.validate(json.loads(done["response"]["output_text"]), PERSON)
        ws.send_json({"type": "response.create", "response": {"input": "hi", "response_format": None,
                                                               "max_tokens": 3, "ignore_eos": True}})
        done = realtime_events(ws, "response.done")[-1]
        assert not done["response"]["output_text"].startswith('{"')  # a response's override: free text


@pytest.mark.parametrize("event,param", [
    ({"type": "session.update", "session": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}},
     "session.response_format.json_schema.schema"),
    ({"type": "response.create", "response": {"input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": 5}}]}},
     "response.tools.0.function.parameters"),
    ({"type": "response.create", "response": {"input": [{"role": "user", "content": "hi"}],
                                              "tool_choice": "required"}}, "response.tool_choice"),
])
def test_realtime_turns_are_checked_as_chat_requests_are(app_client, event: dict, param: str) -> None:
    client, _ = app_client
    with client.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
        ws.send_json(event)
        e = ws.receive_json()
        assert e["type"] == "error" and e["error"]["param"] == param, e
        assert e["error"]["code"] == "invalid_value" and e["error"]["type"] == "invalid_request_error"


def test_the_request_models_do_not_import_the_grammar_engine() -> None:
    """protocol.py's validators check shapes; schemas are checked where a turn is built (turn.py)."""
    code = "import sys, service.api.protocol, service.api.answers; print('llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
