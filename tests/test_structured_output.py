"""Constrained decoding (service/engine/grammar.py): whatever the logits say, the output is valid for the schema and
ends there; then response_format json_schema / json_object against a live server, through the `openai` SDK."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from service.api.protocol import ChatCompletionRequest
from service.api.tool_formats import HERMES, LLAMA3_JSON, CallFormat
from service.api.tool_parsers import Content, ToolCallParser
from service.api.tools import ChatTools
from service.engine.grammar import GrammarConstraint, GrammarError, Grammars, closed, json_rule, schema_error
from service.engine.masks import StepMasks
from service.model.synthetic import smollm2_tokenizer
from tests.server_support import Server

EOS = 2  # SmolLM2's <|im_end|>
PADDED_VOCAB = 49152 + 96  # a model whose embedding is larger than its tokenizer's vocabulary

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(smollm2_tokenizer(PADDED_VOCAB), frozenset({EOS}))


def decode_with(constraint: GrammarConstraint, seed: int, max_steps: int = 400) -> str:
    """Sample from random logits (a model that knows nothing) through the constraint until EOS; the text."""
    tok = smollm2_tokenizer(PADDED_VOCAB)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    masks = StepMasks()
    for _ in range(max_steps):
        masked = masks.apply((torch.randn(PADDED_VOCAB, generator=gen) * 4)[None], {0: constraint})
        assert not masked.errors
        logits = masked.logits[0]
        assert torch.isinf(logits[tok.vocab_size:]).all()  # ids past the tokenizer's vocabulary: never
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        if token == EOS:
            return tok.decode(ids)
        constraint.accept(token)
        ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_any_model_writes_json_valid_for_the_schema(grammars: Grammars, seed: int) -> None:
    text = decode_with(grammars.constraint(f"start: {json_rule(WEATHER)}"), seed)
    jsonschema.validate(json.loads(text), WEATHER)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # written as json.dumps writes it


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("seed", range(3))
def test_any_model_makes_a_call_the_parser_reads(grammars: Grammars, fmt: CallFormat, seed: int) -> None:
    """tool_choice "required": a call of one of the tools, in the family's format, its arguments valid."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required", tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "hang_up"}}])
    tools = ChatTools.of(smollm2_tokenizer(49152), body)
    grammar = fmt.grammar(tools.functions, several=False)
    text = decode_with(grammars.constraint(f"start: calls\n{grammar}"), seed)
    parser = ToolCallParser(fmt, ["get_weather", "hang_up"])
    assert not [e for e in parser.feed(text) + parser.finish() if isinstance(e, Content)]
    [call] = parser.calls
    assert call.complete and text == fmt.write(call.name, json.loads(call.arguments))
    jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else {"const": {}})


def test_objects_are_closed_unless_they_say_otherwise() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}},
                                               "d": {"type": "array", "items": {"properties": {}}}},
              "allOf": [{"properties": {"x": {}}}]}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True
    assert out["properties"]["d"]["items"]["additionalProperties"] is False
    assert out["allOf"] == [{"properties": {"x": {}}}]  # closing parts of a conjunction would make it unsatisfiable


@pytest.mark.parametrize("schema,why", [
    ({"type": "objekt"}, "objekt"),
    ({"type": "object", "properties": 5}, "properties"),
    ({"type": "string", "pattern": "[a-"}, "regex"),
    ({"$ref": "#/$defs/missing"}, "missing"),
])
def test_schemas_no_grammar_can_be_built_from_say_why(schema: dict, why: str) -> None:
    message = schema_error(schema)
    assert message is not None and why in message
    assert schema_error(WEATHER) is None


def test_a_grammar_that_does_not_compile_is_a_grammar_error(grammars: Grammars) -> None:
    with pytest.raises(GrammarError):
        grammars.constraint("start: undefined_rule")


# -- against a live server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(shared_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.base}/v1", api_key="unused", max_retries=0, timeout=120)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
MESSAGES = [{"role": "user", "content": "Invent a person: a name and an age."}]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_json_schema_output_validates(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    if stream:
        chunks = list(client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES,
                                                     response_format=fmt, max_tokens=64, temperature=0.7,
                                                     stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, response_format=fmt,
                                           max_tokens=64, temperature=0.7)
        text, finish = r.choices[0].message.content or "", [r.choices[0].finish_reason]
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == ["stop"]  # the grammar ended it, at its EOS


@pytest.mark.slow
def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=48,
                                       response_format={"type": "json_object"}, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


@pytest.mark.slow
def test_unicode_line_breaks_in_a_reply_keep_each_event_one_line(shared_server: Server) -> None:
    """JSON leaves U+2028, U+2029 and U+0085 raw inside strings, and httpx's iter_lines (like str.splitlines) ends a
    line there: the server escapes them, so a Python client reading its stream line by line gets whole events."""
    value = "a\u2028b\u0085c\u2029d"
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "enum": [value]}}}
    body = {"model": "smollm2-135m-instruct", "messages": MESSAGES, "response_format": fmt, "max_tokens": 24,
            "stream": True}
    with httpx.stream("POST", f"{shared_server.base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]  # each one whole JSON event
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "\u2028" in text and json.loads(text) == value  # the model wrote the breaks raw; they arrived intact
