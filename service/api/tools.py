"""Tools in a chat turn (HTTP or realtime): which functions the model is offered and whether it must call one, how
tools and the calls and results of earlier turns reach it through its chat template, and the grammar that forces a
call or a JSON reply.

A template that renders `tools` itself in a format Parley reads (Llama-3.x, Qwen2.5) gets them as OpenAI's objects
(`native`). Any other (the embedded SmolLM2's ignores them) gets them Hermes-style, as Qwen2.5 writes them: a
system block listing the functions inside `<tools>` … `</tools>` and the `<tool_call>` format; an assistant's calls
become `<tool_call>` blocks of its message. A tool result goes to the template as the `tool` message it is where the
template renders any role (ChatML's `<|im_start|>tool`, SmolLM2's own): shown a user turn of `<tool_response>`
blocks, a model never taught them echoes the block instead of speaking; a template that renders no `tool` role gets
that user turn (as Qwen2.5 renders results). Either way the
history writes a call as the grammar makes the model write it, so that a turn's prompt repeats the previous reply
token for token (prefix reuse across a tool round trip).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, cast

from service.api.answers import ModelCapabilities, ToolCallFormat
from service.api.protocol import FunctionDefinition, NamedToolChoice, ToolFields
from service.api.tool_formats import HERMES, LLAMA3_JSON, CallFormat
from service.api.tool_parsers import ToolCallParser
from service.engine.grammar import json_rule
from service.model.tokenizer import Tokenizer

Message = dict[str, Any]

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>\n\n'
    "When a function's result comes back, answer the user's question with it in one short sentence.")


# A reply to a tool's result opens with a word: not with the result echoed back in the markup the prompt showed
# (`<tool_response>`), a call again, or raw JSON, and never empty. A model shown a result may do any of these
# (SmolLM2 echoes or calls again nine times in ten); the listener would hear nothing. The grammar holds the opening
# only (an optional space, then a letter, digit or opening quote) and is lifted once it has it, so the rest of the
# reply is chosen as free text is, at full speed; a call may still follow what it says.
SPEECH_OPENING = "start: /[ ]?[\\p{L}\\p{N}\"'¿¡(](?s:.*)/"


@dataclass(frozen=True)
class ToolDialect:
    """How the served model takes tools: the format it writes calls in, and whether its template renders tools."""

    format: CallFormat
    native: bool
    tool_role: bool = False  # (not native) the template renders a `tool` message itself

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ToolDialect:
        template = tokenizer.chat_template
        if tokenizer.takes_tools and "<|start_header_id|>" in template and '"parameters"' in template:
            return cls(LLAMA3_JSON, native=True)
        if tokenizer.takes_tools and "<tool_call>" in template:
            return cls(HERMES, native=True)
        return cls(HERMES, native=False, tool_role=_renders_tool_role(tokenizer))

    def capabilities(self) -> ModelCapabilities:
        """What /v1/models says of the served model's tools."""
        name = cast(ToolCallFormat, self.format.name)  # tool_formats.py names its formats so
        return ModelCapabilities(tool_template="native" if self.native else "hermes",
                                 tool_call_format=name, parallel_tool_calls=self.format.several)


@dataclass(frozen=True)
class ChatTools:
    """What one chat turn does with tools. The model is told of every tool whatever tool_choice says (as vLLM
    does), so that a conversation's prompt stays the same from turn to turn (prefix reuse) when only the choice
    changes; under "none" it makes no call (what it writes as one is withheld: reply.py)."""

    dialect: ToolDialect
    functions: tuple[FunctionDefinition, ...]
    choice: str  # none | auto | required | function (named: `forced`)
    forced: FunctionDefinition | None
    parallel: bool  # it may call several at once

    @classmethod
    def of(cls, tokenizer: Tokenizer, fields: ToolFields) -> ChatTools:
        functions = tuple(t.function for t in fields.tools or [])
        choice = fields.tool_choice or ("auto" if functions else "none")
        if isinstance(choice, NamedToolChoice):
            forced = next(f for f in functions if f.name == choice.function.name)
            return cls(ToolDialect.of(tokenizer), functions, "function", forced, parallel=False)
        return cls(ToolDialect.of(tokenizer), functions, choice, None, parallel=fields.parallel_tool_calls is not False)

    @property
    def required(self) -> bool:
        """The model must call a tool (tool_choice "required" or a named function): the grammar forces it."""
        return self.choice in ("required", "function")

    # -- the prompt -----------------------------------------------------------------------------------------
    def template_input(self, messages: list[Message]) -> tuple[list[Message], list[Message] | None]:
        """The messages (as ChatMessage.for_template gives them) and the `tools` the chat template renders."""
        fmt = self.dialect.format
        if self.dialect.native:
            tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]
            return [_with_argument_objects(m) for m in messages], tools or None
        history = _hermes_history(messages, fmt, self.dialect.tool_role)
        if not self.functions:
            return history, None
        listed = "\n".join(json.dumps({"type": "function", "function": f.model_dump(exclude_none=True)},
                                      ensure_ascii=False) for f in self.functions)
        block = HERMES_TOOLS_PROMPT.format(tools=listed)
        if history and history[0]["role"] == "system":
            return [{**history[0], "content": f"{history[0]['content']}\n\n{block}"}, *history[1:]], None
        return [{"role": "system", "content": block}, *history], None

    # -- the reply ------------------------------------------------------------------------------------------
    def parser(self) -> ToolCallParser | None:
        """What reads calls out of the reply; None where the model was told of no tools. Under tool_choice "none" it
        reads calls of no tool: what looks like a call is withheld (tool_parsers.py), never spoken."""
        if not self.functions:
            return None
        if self.choice == "none":
            names = []
        else:
            names = [self.forced.name] if self.forced else [f.name for f in self.functions]
        several = self.parallel and self.dialect.format.several
        return ToolCallParser(self.dialect.format, names, max_calls=None if several else 1)

    def grammar(self, reply_schema: dict[str, Any] | None, after_tool: bool = False) -> str | None:
        """The Lark grammar the reply must follow: calls (a required or named call), or a JSON reply valid for
        `reply_schema` (response_format; under tool_choice "auto", or calls); after a tool's result (`after_tool`),
        a reply that opens with speech (SPEECH_OPENING: the grammar is lifted once it has); None: free text."""
        fmt = self.dialect.format
        if self.required:
            return f"start: calls\n{fmt.grammar((self.forced,) if self.forced else self.functions, self.parallel)}"
        if reply_schema is None:
            return SPEECH_OPENING if after_tool else None
        reply = f"reply: {json_rule(reply_schema)}"
        if self.choice == "none" or not self.functions:
            return f"start: reply\n{reply}"
        return f"start: reply | calls\n{reply}\n{fmt.grammar(self.functions, self.parallel)}"


def _arguments_object(arguments: str) -> Any:
    """A call's arguments (JSON text) as templates write them (`tojson` of an object); text that is no JSON stays
    text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _with_argument_objects(message: Message) -> Message:
    if "tool_calls" not in message:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
        for c in message["tool_calls"]]}


_PROBE = "\x00parley-tool-result\x00"


@functools.lru_cache(maxsize=8)
def _renders_tool_role(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a `tool` message as it renders any role: its text, under the role's name."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "tool", "content": _PROBE}],
                                             add_generation_prompt=True)
    except Exception:  # a template that refuses the role (raise_exception), or any other
        return False
    return _PROBE in text and "tool" in text.split(_PROBE)[0][-16:]


def _hermes_history(messages: list[Message], fmt: CallFormat, tool_role: bool) -> list[Message]:
    """Calls and tool results as text, for a template that knows neither: an assistant's calls as blocks of its
    content; tool results as the template's own `tool` messages (`tool_role`), else consecutive ones as one user turn
    of `<tool_response>` blocks (as Qwen2.5 renders them)."""
    out: list[Message] = []
    for m in messages:
        if m["role"] == "tool" and tool_role:
            out.append({"role": "tool", "content": m["content"]})
            continue
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += f"\n{block}"
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        if "tool_calls" in m:
            calls = fmt.separator.join(fmt.write(c["function"]["name"], _arguments_object(c["function"]["arguments"]))
                                       for c in m["tool_calls"])
            out.append({"role": m["role"], "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]
