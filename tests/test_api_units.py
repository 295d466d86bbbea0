"""The API's pieces without a server process: sentence chunking, request parsing, and the app built in-process
(create_app with a runtime factory) on the tiny synthetic model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app, server_state
from service.api.chunking import SentenceChunker
from service.api.protocol import ChatCompletionRequest, CompletionRequest
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


@pytest.fixture(scope="module")
def app_client():
    cfg = ServeConfig(model="synthetic:tiny", max_batch=2, max_context=256, device="cpu", backend="reference")
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
