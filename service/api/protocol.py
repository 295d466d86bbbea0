"""What clients send, as pydantic models: the OpenAI-compatible HTTP bodies and the realtime WebSocket's settings
(session.update) and turns (response.create). What Parley answers is answers.py (HTTP) and realtime_events.py.

Requests ignore fields they do not know (OpenAI clients send many); fields Parley knows but does not support are
accepted at the value that asks for nothing and refused otherwise (each endpoint's `unsupported` table), so that
nothing a client asks for is silently dropped. The sampling fields are declared once (SamplingFields) for the HTTP
bodies and the realtime session alike. Validators check shapes only: whether a schema can become a grammar, and
whether a tool_choice fits the tools, are checked where a turn is built (turn.py), so that these models do not
import the grammar engine.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

MAX_STOP = 4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class SamplingFields(BaseModel):
    """The sampling fields, declared once for every endpoint: the HTTP bodies, the realtime session's settings and
    each response.create's overrides."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension (vLLM): -1 or 0 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    @field_serializer("stop")
    def _stop_list(self, v: str | list[str] | None) -> list[str]:
        return list(self.stop_sequences)

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


@dataclass(frozen=True)
class Unsupported:
    """A field Parley knows but does not support: the one value it accepts besides null (the value that asks for
    nothing), and what a client sending another one is told."""

    accepted: Any
    message: str


def _unsupported_in_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The schema of each unsupported field says what the table accepts: that one value, or null."""
    for name, rule in getattr(model, "unsupported", {}).items():
        prop = schema.get("properties", {}).get(name)
        if prop is None:
            continue
        for key in ("anyOf", "type", "$ref", "items", "additionalProperties"):
            prop.pop(key, None)
        if rule.accepted is None:
            prop["type"] = "null"
        else:
            prop["anyOf"] = [{"const": to_jsonable_python(rule.accepted)}, {"type": "null"}]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class OpenAIRequest(SamplingFields):
    """What both HTTP endpoints take. Fields Parley knows but does not support are listed in `unsupported` (one
    table per endpoint, checked by one validator): accepted at the value that asks for nothing, refused otherwise,
    so that nothing a client asks for is silently dropped. Supporting one is removing its row."""

    model_config = ConfigDict(json_schema_extra=_unsupported_in_schema)
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "n": Unsupported(1, "only n=1 is supported (one choice per request)"),
        "presence_penalty": Unsupported(0, "penalties are not supported; send 0 or leave it out"),
        "frequency_penalty": Unsupported(0, "penalties are not supported; send 0 or leave it out"),
        "logit_bias": Unsupported({}, "logit_bias is not supported"),
    }

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("*")
    @classmethod
    def _supported(cls, v: Any, info: ValidationInfo) -> Any:
        rule = cls.unsupported.get(info.field_name or "")
        if rule is not None and v is not None and v != rule.accepted:
            raise ValueError(rule.message)
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(OpenAIRequest):
    unsupported: ClassVar[dict[str, Unsupported]] = {
        **OpenAIRequest.unsupported,
        "logprobs": Unsupported(None, "logprobs are not supported"),
        "echo": Unsupported(False, "echo is not supported"),
        "best_of": Unsupported(1, "best_of is not supported (only 1)"),
        "suffix": Unsupported("", "suffix is not supported"),
    }

    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or (len(v) == 1 and isinstance(v[0], str))
            or (len(v) == 1 and isinstance(v[0], list)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v[0]))))
        if not ok:
            if isinstance(v, list) and len(v) > 1 and all(isinstance(x, str | list) for x in v):
                raise ValueError("batched prompts are not supported: send one prompt per request")
            raise ValueError("prompt must be a string, a list of one string, or a list of token ids")
        return v

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str):
            return p[0]
        if p and isinstance(p[0], list):
            return p[0]
        return p  # type: ignore[return-value]


TEXT_PARTS = ("text", "input_text", "output_text")  # chat's name, and the Realtime and Responses APIs' (OpenAI)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type not in TEXT_PARTS or self.text is None:
            raise ValueError(f"only text content parts are supported (got type {self.type!r})")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it (an object is taken too, and written as JSON)

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v


class ToolCall(BaseModel):
    """A call the assistant made: in a reply (message.tool_calls) and in the history a client sends back."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(
                isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str) for p in v):
            raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts "
                             "(\"input_text\" and \"output_text\" too, as OpenAI's Realtime API names them; only "
                             "text is supported)")
        return v

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (tool calls and ids only where there are some: templates test
        `'tool_calls' in message`)."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# -- tools and structured output ------------------------------------------------------------------------------
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (turn.check_schemas); none: it takes no arguments
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


def _function_beside_type(data: Any, key: str) -> Any:
    """The realtime API writes a function's fields beside `type` ({"type": "function", "name": ...}); chat nests
    them ({"type": "function", "function": {"name": ...}}). Both are taken."""
    if isinstance(data, dict) and key not in data and "name" in data:
        return {"type": data.get("type"), key: {k: v for k, v in data.items() if k != "type"}}
    return data


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition

    _flat = model_validator(mode="before")(lambda data: _function_beside_type(data, "function"))


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the one function the model must call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName

    _flat = model_validator(mode="before")(lambda data: _function_beside_type(data, "function"))


ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = ToolChoiceMode | NamedToolChoice


class ToolFields(BaseModel):
    """The tool fields, declared once for chat requests and the realtime session. Whether tool_choice fits the tools
    is checked per turn (turn.py): a realtime turn's choice may name a tool an earlier session.update gave."""

    model_config = ConfigDict(extra="ignore")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # none: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # none: true, as OpenAI

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("tool names must be unique")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: Any) -> Any:
        """One message for any shape that is neither a mode nor a named function (not one per alternative)."""
        if v is None or v in get_args(ToolChoiceMode):
            return v
        if isinstance(v, dict):
            with contextlib.suppress(ValidationError):
                return NamedToolChoice.model_validate(v)
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, serialize_by_alias=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # a JSON schema (turn.check_schemas)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """text (no constraint), json_object (any JSON object), or json_schema (JSON valid for its schema)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _needed(cls, v: JSONSchemaFormat | None, info: ValidationInfo) -> JSONSchemaFormat | None:
        if v is None and info.data.get("type") == "json_schema":
            raise ValueError('response_format {"type": "json_schema"} needs a json_schema {"name", "schema"}')
        return v

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The schema the output must be valid for; None for text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None and self.type == "json_schema" else None


class ChatCompletionRequest(ToolFields, OpenAIRequest):
    unsupported: ClassVar[dict[str, Unsupported]] = {
        **OpenAIRequest.unsupported,
        "logprobs": Unsupported(False, "logprobs are not supported"),
        "top_logprobs": Unsupported(0, "top_logprobs are not supported"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- the realtime WebSocket ------------------------------------------------------------------------------------
class RealtimeSessionConfig(ToolFields, SamplingFields):
    """session.update's `session`: the settings every later response.create starts from (and, as its subclass
    RealtimeResponseConfig, one response's overrides), tools and tool_choice among them. A null leaves a setting
    that has no null of its own (temperature, top_p, top_k, ignore_eos, chunking) as it is; where null means
    something (no instructions, no seed, max_tokens up to the context, no stop, no tools, a text reply), it sets
    that."""

    model: str | None = None  # if given, the served model's id
    instructions: str | None = None
    chunking: Literal["none", "sentence"] = "none"
    response_format: ResponseFormat | None = None  # as chat's: a JSON reply (with tools: a reply or calls)

    @model_validator(mode="before")
    @classmethod
    def _null_leaves_as_is(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _openai_token_limit(data)
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}

    def updated(self, changes: RealtimeSessionConfig) -> RealtimeSessionConfig:
        """These settings, with what `changes` sets."""
        return self.model_copy(update={k: getattr(changes, k) for k in changes.model_fields_set & SESSION_SETTINGS})


SESSION_SETTINGS = set(RealtimeSessionConfig.model_fields) - {"model"}
# OpenAI's Realtime API names the reply's token limit max_output_tokens (max_response_output_tokens before GA), an
# integer or "inf"; the openai SDK and the voice frameworks send those, and an unknown field is ignored: a limit they
# set was dropped and the reply ran to the context
OPENAI_TOKEN_LIMITS = ("max_output_tokens", "max_response_output_tokens")


def _openai_token_limit(data: dict[str, Any]) -> dict[str, Any]:
    """A realtime config with OpenAI's token limit as max_tokens ("inf": none, up to the context); max_tokens wins."""
    named = [k for k in OPENAI_TOKEN_LIMITS if k in data]
    if not named:
        return data
    limit = data[named[0]]
    out = {k: v for k, v in data.items() if k not in OPENAI_TOKEN_LIMITS}
    out.setdefault("max_tokens", None if limit == "inf" else limit)
    return out


class RealtimeResponseConfig(RealtimeSessionConfig):
    """response.create's `response` (none at all: every default): the turn's input and its per-response overrides.
    No input: a reply to the conversation as it stands (the items conversation.item.create added)."""

    id: str | None = Field(default=None, min_length=1, max_length=128)
    input: str | list[ChatMessage] = Field(default_factory=list)
    # "none": an out-of-band response (OpenAI's name), e.g. a preemptive start on a partial transcript: it sees the
    # conversation, and neither its input nor its reply joins it
    conversation: Literal["auto", "none"] = "auto"


class RealtimeItem(BaseModel):
    """conversation.item.create's `item`, in OpenAI's Realtime shape: a message of text parts, or a tool's output
    answering a call the assistant made (`function_call_output`, its `call_id`)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(default=None, min_length=1, max_length=128)
    type: Literal["message", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = Field(default=None, min_length=1)
    output: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> RealtimeItem:
        if self.type == "message" and (self.role is None or self.content is None):
            raise ValueError("a message item needs a role and content")
        if self.type == "function_call_output" and (self.call_id is None or self.output is None):
            raise ValueError("a function_call_output item needs the call_id it answers and its output")
        return self

    def message(self) -> ChatMessage:
        """The item as the conversation keeps it: a chat message."""
        if self.type == "function_call_output":
            return ChatMessage(role="tool", content=self.output, tool_call_id=self.call_id)
        assert self.role is not None  # _complete: a message has one
        text = self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or [])
        return ChatMessage(role=self.role, content=text)
