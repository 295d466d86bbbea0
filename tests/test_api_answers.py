"""What Parley answers, as its models write it (answers.py, realtime_events.py), read back by the `openai` SDK's own
types, as a client reads it: every chunk of a chat or completion stream (text, a tool call's start and arguments,
the finish, the usage), and the whole answers; `usage` on every chunk only when the client asked for it; the realtime
events' own shapes (timings named for the server's N, the settings as a client wrote them)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion as SDKCompletion
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatChunk

from service.api.answers import UsageInfo
from service.api.completions import CHAT, COMPLETIONS, Answer, Reply, tool_call_delta
from service.api.protocol import RealtimeSessionConfig, ToolCall
from service.api.realtime_events import ResponseTimings, session_info
from service.api.tool_parsers import CallArguments, CallStart, Content
from service.engine.request import Timings, Usage

USAGE = Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8)


def sse_json(event: bytes) -> dict[str, Any]:
    text = event.decode()
    assert text.startswith("data: ") and text.endswith("\n\n") and "\n" not in text[:-2]
    return json.loads(text[len("data: "):-2])


def test_a_chat_stream_reads_as_the_sdk_reads_it() -> None:
    answer = Answer(CHAT, "chatcmpl-1", 1700000000, "m", include_usage=True)
    chunks = [answer.chunk(CHAT.prologue), answer.chunk(tool_call_delta(Content("Let me check."))),
              answer.chunk(tool_call_delta(CallStart(0, "call_1", "get_weather"))),
              answer.chunk(tool_call_delta(CallArguments(0, '{"city": '))),
              answer.chunk(tool_call_delta(CallArguments(0, '"Paris"}'))),
              answer.chunk(CHAT.text("", "tool_calls")), answer.chunk(None, UsageInfo.of(USAGE))]
    raw = [sse_json(c) for c in chunks]
    assert all(r["usage"] is None for r in raw[:-1])  # asked for: on every chunk, null but on the last
    assert raw[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert raw[-2]["choices"][0]["delta"] == {}
    sdk = [SDKChatChunk.model_validate(r) for r in raw]
    assert all(c.id == "chatcmpl-1" and c.object == "chat.completion.chunk" for c in sdk)
    assert sdk[0].choices[0].delta.role == "assistant"
    assert sdk[1].choices[0].delta.content == "Let me check." and sdk[1].choices[0].finish_reason is None
    start = (sdk[2].choices[0].delta.tool_calls or [])[0]
    assert (start.index, start.id, start.type, start.function and start.function.name) == (0, "call_1", "function",
                                                                                          "get_weather")
    assert "".join((c.choices[0].delta.tool_calls or [])[0].function.arguments or "" for c in sdk[2:5]) == \
        '{"city": "Paris"}'
    assert "id" not in raw[3]["choices"][0]["delta"]["tool_calls"][0]  # a piece: index and arguments only
    assert sdk[5].choices[0].finish_reason == "tool_calls"
    assert sdk[6].choices == [] and sdk[6].usage is not None
    assert (sdk[6].usage.prompt_tokens, sdk[6].usage.completion_tokens, sdk[6].usage.total_tokens) == (12, 3, 15)
    assert sdk[6].usage.prompt_tokens_details and sdk[6].usage.prompt_tokens_details.cached_tokens == 8


def test_usage_is_no_key_of_a_stream_that_did_not_ask() -> None:
    answer = Answer(COMPLETIONS, "cmpl-1", 1700000000, "m", include_usage=False)
    raw = sse_json(answer.chunk(COMPLETIONS.text(" Paris", "length")))
    assert "usage" not in raw
    assert raw["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None, "text": " Paris"}]
    sdk = SDKCompletion.model_validate(raw)  # the SDK reads completion chunks as Completion
    assert sdk.object == "text_completion" and sdk.choices[0].text == " Paris"


@pytest.mark.parametrize("reply,content", [
    (Reply("It is sunny."), "It is sunny."),
    (Reply("", [ToolCall(id="call_1", function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})]), None),
])
def test_whole_answers_read_as_the_sdk_reads_them(reply: Reply, content: str | None) -> None:
    body = CHAT.response(id="chatcmpl-2", created=1700000000, model="m", usage=UsageInfo.of(USAGE),
                         choices=[CHAT.choice(reply, "tool_calls" if reply.tool_calls else "stop")]).model_dump()
    assert ("tool_calls" in body["choices"][0]["message"]) == bool(reply.tool_calls)  # absent, not null
    sdk = SDKChatCompletion.model_validate(body)
    message = sdk.choices[0].message
    assert message.role == "assistant" and message.content == content
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c.id, c.function.name, c.function.arguments) for c in reply.tool_calls]
    completion = COMPLETIONS.response(id="cmpl-2", created=1, model="m", usage=UsageInfo.of(USAGE),
                                      choices=[COMPLETIONS.choice(Reply(" Paris."), "stop")]).model_dump()
    assert SDKCompletion.model_validate(completion).choices[0].text == " Paris."


def test_realtime_timings_are_named_for_the_servers_n() -> None:
    t = Timings(queue_ms=1.0, prefill_ms=2.0, ttft_ms=3.0, ttfn_ms=40.0, e2e_ms=50.0)
    assert json.loads(ResponseTimings.of(t, n=8).model_dump_json()) == {
        "queue_ms": 1.0, "prefill_ms": 2.0, "ttft_ms": 3.0, "ttf8_ms": 40.0, "e2e_ms": 50.0}


def test_the_realtime_session_shows_the_settings_as_a_client_writes_them() -> None:
    settings = RealtimeSessionConfig.model_validate({
        "instructions": "Be brief.", "tools": [{"type": "function", "name": "hang_up"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}})
    shown = json.loads(session_info(settings, id="s1", model="m", max_context=256).model_dump_json())
    assert (shown["id"], shown["object"], shown["model"], shown["max_context"]) == ("s1", "realtime.session", "m", 256)
    assert shown["instructions"] == "Be brief." and shown["tools"][0]["function"]["name"] == "hang_up"
    assert shown["response_format"]["json_schema"]["schema"] == {"type": "object"}  # "schema", not "schema_"
    assert RealtimeSessionConfig.model_validate(shown).response_format == settings.response_format


def test_a_failed_generation_leaves_no_reference_cycle_behind() -> None:
    """A whole answer whose generation failed raises the OpenAI-shaped 500; the error, its traceback and the frames it
    passed through are freed as soon as it is answered, not left in a cycle for the garbage collector (the engine's
    refusals did that, and collections held GPU steps up: bench/NOTES.md)."""
    import asyncio
    import gc
    import types

    from service.api.errors import APIError
    from service.engine.request import Delta

    class FailedStream:
        finished = False

        async def __aiter__(self):
            yield Delta("", [], finish_reason="error", error="boom")

        def cancel(self) -> None: ...

        def close(self) -> None: ...

    class Connected:  # a client that stays: collect()'s disconnect watcher waits until cancelled
        async def receive(self) -> dict[str, str]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

    async def collect() -> APIError:
        try:
            await Answer(COMPLETIONS, "cmpl-1", 1700000000, "m", include_usage=False).collect(FailedStream(),
                                                                                             Connected())
        except APIError as e:
            return APIError(e.status, e.message, code=e.code)  # a copy: the raised one goes with this frame
        raise AssertionError("a failed generation answered")

    gc.collect()
    gc.disable()
    try:
        failures = [asyncio.run(collect()) for _ in range(3)]
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, (APIError, types.FrameType, types.TracebackType))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert [(f.status, f.code) for f in failures] == [(500, "engine_error")] * 3
    assert cyclic == []
