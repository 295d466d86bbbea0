"""Function calling over /v1/chat/completions against a live `parley serve` of the embedded SmolLM2-135M, through the
`openai` SDK as voice agents use it: a required or named call streams as delta.tool_calls and its arguments validate
against the function's schema (the grammar forces it, whatever the model); a conversation goes on after the tool's
result; malformed tools get a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from bench.tool_speech import ROUND_TRIPS, SYSTEM, RoundTrip, judge
from tests.server_support import Server, assert_openai_error

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "description": "The city, e.g. Paris"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
                                                "parameters": WEATHER_PARAMETERS}}
WEATHER_CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HANG_UP = {"type": "function", "function": {"name": "hang_up", "description": "End the call"}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(shared_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_calls(chunks: list[Any]) -> dict[int, dict[str, str]]:
    """delta.tool_calls joined as a client joins them: by index, the id, name and arguments' pieces."""
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or "" if tc.function else ""
            call["arguments"] += tc.function.arguments or "" if tc.function else ""
    return calls


def test_required_call_streams_and_validates(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[GET_WEATHER], stream=True,
                                                 tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                                 temperature=0.8))
    calls = streamed_calls(chunks)
    assert list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].type == "function" and pieces[0].function.arguments == ""  # the name comes first
    assert len(pieces) > 3  # then the arguments, in pieces as they are generated
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[HANG_UP, GET_WEATHER], max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0.8)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_function_without_parameters_gets_empty_arguments(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Bye!"}], max_tokens=32,
                                       tools=[HANG_UP], tool_choice="required", temperature=0)
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []][:1] == [
        ("hang_up", "{}")]


def test_auto_answers_and_a_conversation_goes_on_after_a_tool_result(client: openai.OpenAI) -> None:
    """tool_choice auto (the default with tools): whatever the model writes is an answer, never an error; a history
    holding the assistant's call and the tool's result (tool_call_id) is rendered and answered."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[GET_WEATHER], max_tokens=24,
                                           temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "sunny"}'}]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=history, tools=[GET_WEATHER],
                                                         tool_choice="none", max_tokens=24, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(model=MODEL, messages=history, tools=[GET_WEATHER],
                                               tool_choice="none", max_tokens=24, temperature=0)
            text, usage = r.choices[0].message.content or "", r.usage
            assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
        # an answer in words (test_a_tool_round_trip_ends_in_speech)
        assert text.strip() and "<tool" not in text and usage is not None and usage.completion_tokens > 0
        assert usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_the_same_call_twice_is_one_call(client: openai.OpenAI) -> None:
    """tool_choice "required" with parallel calls allowed: greedy SmolLM2 writes the same call twice (a stutter); an
    agent would run the tool twice. Identical calls (same function, same arguments) are one, streamed or not."""
    kwargs: Any = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
                   "tools": [WEATHER_CITY], "tool_choice": "required", "max_tokens": 64, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = streamed_calls(chunks)
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == calls and list(streamed) == [0]
    # the reply ends at the stutter (greedy, it would stutter on to max_tokens): its calls made, no more
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage.completion_tokens < 64


@pytest.mark.parametrize("max_tokens", [14, 15, 16, 17])
def test_a_call_cut_by_max_tokens_has_what_the_model_wrote(client: openai.OpenAI, max_tokens: int) -> None:
    """max_tokens ends the reply inside a call: the call's arguments are what the model wrote of them (a partial JSON
    text, as OpenAI returns it; "" where it wrote none), never arguments it did not write ("{}", which the schema
    refuses: `city` is required), streamed or not; finish_reason "length"."""
    kwargs: Any = {"model": MODEL, "messages": ASK, "tools": [WEATHER_CITY], "tool_choice": "required",
                   "parallel_tool_calls": False, "temperature": 0}
    full = client.chat.completions.create(**kwargs, max_tokens=64).choices[0].message.tool_calls or []
    cut = client.chat.completions.create(**kwargs, max_tokens=max_tokens).choices[0]
    streamed = streamed_calls(list(client.chat.completions.create(**kwargs, max_tokens=max_tokens, stream=True)))
    assert cut.finish_reason == "length"
    calls = [c.function.arguments for c in cut.message.tool_calls or []]
    assert calls == [c["arguments"] for c in streamed.values()]
    for arguments in calls:
        assert arguments != "{}" and full[0].function.arguments.startswith(arguments), (arguments, full)


@pytest.mark.parametrize("trip", ROUND_TRIPS[:3], ids=lambda t: t.tool)
def test_a_tool_round_trip_ends_in_speech(client: openai.OpenAI, trip: RoundTrip) -> None:
    """What a voice agent does: the model's call, the tool's result, then the reply a listener hears. It is words —
    not empty, not the result echoed in markup, not raw JSON, not the call again — streamed or not (SmolLM2 echoed
    the <tool_response> block or called again in 19 of 20 round trips of `python -m bench tool-speech`)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": trip.question}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=trip.tools(),
                                           tool_choice="required", max_tokens=48, temperature=0)
    calls = first.choices[0].message.tool_calls or []
    assert calls
    messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps(trip.result)} for c in calls]
    kwargs: Any = {"model": MODEL, "messages": messages, "tools": trip.tools(), "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.content
    heard = judge(whole.content, whole.tool_calls, trip)
    assert heard["spoken"], heard


MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>",
          "<|python_tag|>")


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_tool_markup_is_never_spoken(client: openai.OpenAI, tool_choice: str) -> None:
    """As a voice agent asks (Pipecat: the tools on every turn, after a tool's result): whatever the model writes,
    the content holds no tool-protocol markup — SmolLM2 echoes the <tool_response> block its prompt showed it. A
    call is a call (under "auto"), never text."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "sunny"}'}]
    for temperature, seed in ((0.0, None), (0.9, 4), (0.9, 0)):  # greedy and seed 4 echo the block; seed 0 speaks
        kwargs: Any = {"model": MODEL, "messages": history, "tools": [GET_WEATHER], "tool_choice": tool_choice,
                       "max_tokens": 64, "temperature": temperature, "seed": seed}
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == (whole.choices[0].message.content or "")  # seeded: the same reply either way
        assert not [m for m in MARKUP if m in streamed], streamed
        if tool_choice == "none":
            assert not whole.choices[0].message.tool_calls and not streamed_calls(chunks)


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has spaces"}}]}, "tools.0.function.name"),
    ({"tools": [GET_WEATHER, GET_WEATHER]}, "tools"),
    ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice"),
    ({"tools": [GET_WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages.0"),
])
def test_malformed_tools_are_a_400_that_names_the_field(shared_server: Server, fields: dict, param: str) -> None:
    r = httpx.post(f"{shared_server.base}/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert_openai_error(r.json(), param=param, type="invalid_request_error")


def test_models_say_what_the_model_supports(shared_server: Server) -> None:
    card = httpx.get(f"{shared_server.base}/v1/models", timeout=30).json()["data"][0]
    assert card["capabilities"] == {
        "tools": True, "tool_template": "hermes", "tool_call_format": "hermes", "parallel_tool_calls": True,
        "tool_choice": ["none", "auto", "required", "function"],
        "response_format": ["text", "json_object", "json_schema"]}
