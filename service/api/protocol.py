"""The OpenAI-compatible request and response models (pydantic), and the realtime WebSocket's event payloads.

Requests ignore fields they do not know (OpenAI clients send many); fields Parley knows but does not support are
accepted at their default value and refused otherwise, so that nothing a client asks for is silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 4


def only(value: Any) -> dict[str, Any]:
    """A schema fragment: the one value (or null) a known but unsupported field accepts."""
    return {"anyOf": [{"const": value}, {"type": "null"}]}
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension (vLLM): -1 or 0 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens
    user: str | None = None
    # Known but unsupported: accepted at their defaults only. The schema says so (validation is the validators').
    n: int = Field(default=1, json_schema_extra=only(1))
    presence_penalty: float | None = Field(default=None, json_schema_extra=only(0))
    frequency_penalty: float | None = Field(default=None, json_schema_extra=only(0))
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={"maxProperties": 0})

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported; send 0 or leave it out")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(Sampling):
    prompt: Prompt
    logprobs: int | None = Field(default=None, json_schema_extra={"type": "null"})
    echo: bool = Field(default=False, json_schema_extra=only(False))
    best_of: int | None = Field(default=None, json_schema_extra=only(1))
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})

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

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str):
            return p[0]  # type: ignore[return-value]
        if p and isinstance(p[0], list):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported (got type {self.type!r})")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
            raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts "
                             "(only text is supported)")
        return v

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def for_template(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, json_schema_extra=only(False))
    top_logprobs: int | None = Field(default=None, json_schema_extra=only(0))
    tools: list[Any] | None = Field(default=None, json_schema_extra={"maxItems": 0})
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("top_logprobs are not supported")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type", "text") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parley"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


# -- the realtime WebSocket ------------------------------------------------------------------------------------
class RealtimeSessionConfig(BaseModel):
    """session.update's `session`: the defaults of every later response.create."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # if given, the served model's id
    instructions: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool | None = None
    chunking: Literal["none", "sentence"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v


class RealtimeResponseConfig(RealtimeSessionConfig):
    """response.create's `response`: the turn's input and its per-response overrides."""

    id: str | None = Field(default=None, min_length=1, max_length=128)
    input: str | list[ChatMessage]


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
