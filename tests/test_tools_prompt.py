"""How tools, calls and results reach the model (service/api/tools.py): through a chat template that renders tools
itself, or Hermes-style for one that does not (the embedded SmolLM2's); and a tool round trip's prompt repeats the
previous turn's prompt and reply (prefix reuse)."""

from __future__ import annotations

import json

import pytest

from service.api.protocol import ChatCompletionRequest
from service.api.tool_formats import HERMES, LLAMA3_JSON
from service.api.tools import ChatTools, ToolDialect
from service.model.synthetic import smollm2_tokenizer
from service.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# Small templates in the manner of Qwen2.5's (ChatML, tools in the system turn, calls as <tool_call> blocks) and of
# Llama-3.x's (header tokens, calls as bare JSON with "parameters"): each renders `tools` itself.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_LIKE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if 'tool_calls' in m %}{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": "
    "{{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# ChatML that refuses any role but system, user and assistant (as some templates do, with raise_exception)
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return smollm2_tokenizer(49152)


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.hf, chat_template=template, bos_token=tok.bos_token, eos_token=tok.eos_token)


def request(messages: list[dict], **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages, tools=[WEATHER], **fields)


def rendered(tok: Tokenizer, body: ChatCompletionRequest, add_generation_prompt: bool = True) -> str:
    messages, tools = ChatTools.of(tok, body).template_input([m.for_template() for m in body.messages])
    return tok.apply_chat_template(messages, add_generation_prompt, tools)


def test_the_dialect_comes_from_the_template(smollm2: Tokenizer) -> None:
    assert not smollm2.takes_tools and ToolDialect.of(smollm2) == ToolDialect(HERMES, native=False, tool_role=True)
    assert ToolDialect.of(with_template(smollm2, NO_TOOL_ROLE)) == ToolDialect(HERMES, native=False, tool_role=False)
    assert ToolDialect.of(with_template(smollm2, QWEN_LIKE)) == ToolDialect(HERMES, native=True)
    assert ToolDialect.of(with_template(smollm2, LLAMA_LIKE)) == ToolDialect(LLAMA3_JSON, native=True)
    caps = ToolDialect.of(smollm2).capabilities()
    assert (caps.tool_template, caps.tool_call_format, caps.parallel_tool_calls) == ("hermes", "hermes", True)


def test_hermes_for_a_template_that_ignores_tools(smollm2: Tokenizer) -> None:
    """The tools as a system block (after the client's system message), calls as <tool_call> blocks of the
    assistant's message, results as the template's own `tool` turns (SmolLM2's ChatML renders any role); where the
    template renders no `tool` role, as one user turn of <tool_response> blocks."""
    body = request([{"role": "system", "content": "You are a weather bot."},
                    {"role": "user", "content": "Weather in Paris and Rome?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        CALL, {**CALL, "id": "call_2", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Rome"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"}])
    text = rendered(smollm2, body)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system and "<tool_call>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>') in text
    assert ("</tool_call><|im_end|>\n<|im_start|>tool\n21 C<|im_end|>\n<|im_start|>tool\n25 C<|im_end|>\n"
            "<|im_start|>assistant\n") in text and "<tool_response>" not in text.split("</tools>")[1]
    assert ("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in rendered(with_template(smollm2, NO_TOOL_ROLE), body)
    # without a system message of the client's, the tools are the system message
    assert rendered(smollm2, request([{"role": "user", "content": "hi"}])).startswith("<|im_start|>system\n# Tools")


def test_native_templates_get_tools_and_arguments_as_objects(smollm2: Tokenizer) -> None:
    body = request([{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])
    qwen = rendered(with_template(smollm2, QWEN_LIKE), body)
    assert json.dumps(WEATHER) in qwen  # the tool object, whole
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in qwen
    llama = rendered(with_template(smollm2, LLAMA_LIKE), body)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in llama


def test_tool_choice_none_keeps_the_prompt(smollm2: Tokenizer) -> None:
    """The model is told of the tools whatever tool_choice says: a conversation's prompt does not change when
    only the choice does (its K/V stay reusable)."""
    messages = [{"role": "user", "content": "hi"}]
    assert rendered(smollm2, request(messages, tool_choice="none")) == rendered(smollm2, request(messages))
    parser = ChatTools.of(smollm2, request(messages, tool_choice="none")).parser()
    assert parser is not None  # it reads calls of no tool: a call the model writes all the same is no call
    parser.feed(HERMES.write("get_weather", {"city": "Paris"}))
    parser.finish()
    assert parser.calls == []


@pytest.mark.parametrize("template", [None, QWEN_LIKE], ids=["hermes", "native"])
def test_a_tool_round_trip_extends_the_previous_prompt(smollm2: Tokenizer, template: str | None) -> None:
    """Turn 2's prompt begins with turn 1's prompt and the call exactly as the grammar made the model write it."""
    tok = smollm2 if template is None else with_template(smollm2, template)
    first = [{"role": "user", "content": "Weather in Paris?"}]
    generated = HERMES.write("get_weather", {"city": "Paris"})  # what tool_choice "required" forces
    second = first + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    turn1, turn2 = rendered(tok, request(first)), rendered(tok, request(second))
    assert turn2.startswith(turn1 + generated + "<|im_end|>")
    ids1 = tok.encode(turn1, add_special_tokens=False)
    assert tok.encode(turn2, add_special_tokens=False)[:len(ids1)] == ids1  # as tokens too
