"""What the HTTP endpoints answer, as pydantic models: whole completions, the chunks of a stream, model cards and
errors. (The realtime WebSocket's events are realtime_events.py.)

Parley's own models, not the `openai` SDK's types: the SDK is a client (a test dependency here, released weekly) and
its types describe what OpenAI sends, not what Parley sends — Parley's extensions (`max_model_len`, `capabilities`)
would be undeclared extras, and its optional fields are absent where Parley writes null. tests/test_api_answers.py
checks that each model parses as the SDK's type, which is what a client needs. A field that is None and that OpenAI
leaves out (a delta's unset keys, a message's tool_calls) is left out here too (`exclude_if`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from service.api.protocol import ToolCall
from service.engine.request import Usage

ToolCallFormat = Literal["hermes", "llama3_json"]  # the tool-call syntaxes Parley parses and forces


def _none(value: object) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, u: Usage) -> UsageInfo:
        return cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))


# -- whole answers -----------------------------------------------------------------------------------------------
class Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    logprobs: None = None


class CompletionChoice(Choice):
    text: str


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply is calls only
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_none)


class ChatChoice(Choice):
    message: ChatMessageOut


class Envelope(BaseModel):
    """What every answer and every streamed chunk of both HTTP endpoints carries around its choices."""

    id: str
    created: int
    model: str
    usage: UsageInfo | None = None


class Completion(Envelope):
    """What both HTTP endpoints answer without `stream`; each names its object and the shape of its choices."""


class CompletionResponse(Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


# -- streamed chunks ----------------------------------------------------------------------------------------------
class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_none)  # in a call's first chunk only
    arguments: str


class ToolCallDelta(BaseModel):
    """A piece of a call, as OpenAI streams calls: its index, id, type and name first (arguments ""), then its
    arguments in pieces (index and arguments only)."""

    index: int
    id: str | None = Field(default=None, exclude_if=_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_none)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_none)
    content: str | None = Field(default=None, exclude_if=_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_none)


class ChunkChoice(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    logprobs: None = None


class CompletionChunkChoice(ChunkChoice):
    text: str


class ChatChunkChoice(ChunkChoice):
    delta: ChatDelta


class Chunk(Envelope):
    """One streamed chunk: one choice, or (the last chunk of a stream that asked for usage) none and the usage. With
    `stream_options.include_usage`, every chunk has `usage` (null but on the last); without, none has the key: the
    writer leaves it out (Answer.sse)."""


class CompletionChunk(Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]


class ChatCompletionChunk(Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


# -- models ----------------------------------------------------------------------------------------------------------
class ModelCapabilities(BaseModel):
    """What the served model supports beyond text, and how (/v1/models)."""

    tools: bool = True
    tool_template: Literal["native", "hermes"]  # its chat template renders the tools, or Parley does (Hermes)
    tool_call_format: ToolCallFormat  # how it writes a call (and Parley parses and forces one)
    parallel_tool_calls: bool  # whether it may make several calls in one turn
    tool_choice: list[str] = ["none", "auto", "required", "function"]
    response_format: list[str] = ["text", "json_object", "json_schema"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parley"
    max_model_len: int | None = None
    capabilities: ModelCapabilities | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors ----------------------------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail
