"""POST /v1/completions and POST /v1/chat/completions: parse → engine.submit → stream (SSE) or collect (JSON)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api import prompts
from service.api.errors import APIError, error_body
from service.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Sampling,
    usage_info,
)
from service.api.state import ServerState
from service.api.streaming import SSE_DONE, EngineStream, SSEResponse, sse_event
from service.engine.request import Delta, SamplingParams

log = logging.getLogger("parley.api")
router = APIRouter()


def documented(response: type) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI description of an endpoint's answers: JSON or, with `"stream": true`, SSE; and its errors."""
    err = {"model": ErrorResponse}
    return {
        200: {"model": response, "content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "the completion (JSON), or with `stream: true` Server-Sent Events ending in "
                             "`data: [DONE]`"},
        400: {**err, "description": "a bad field (`param` names it)"},
        404: {**err, "description": "an unknown model"},
        413: {**err, "description": "a body over 1 MiB"},
        429: {**err, "description": "refused by admission control (Retry-After, x-should-retry: false)"},
        500: {**err, "description": "the engine failed the generation"},
        503: {**err, "description": "loading, draining, or the engine is not responding"},
    }


def state_of(request: Request) -> ServerState:
    return request.app.state.parley


@router.post("/v1/completions", response_model=None, responses=documented(CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    st = state_of(request)
    rt = st.ready()
    check_model(body, st)
    prompt = body.prompt_input()
    ids = await prompts.encode_text(st.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = body.max_tokens or prompts.DEFAULT_COMPLETION_MAX_TOKENS
    prompts.check_prompt(ids, st.vocab_size, st.max_context, max_tokens, param="prompt")
    params = params_of(body, max_tokens)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": rt.model_id,
                             "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        if body.include_usage:
            c["usage"] = None
        return c

    if body.stream:
        return start_stream(st, ids, params, arrival, rid, created, body.include_usage, chunk, prologue=None,
                            object_name="text_completion")
    text, last = await collect(st, ids, params, arrival, request)
    assert last.usage is not None
    return JSONResponse(CompletionResponse(
        id=rid, created=created, model=rt.model_id,
        choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)],
        usage=usage_info(last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens),
    ).model_dump())


@router.post("/v1/chat/completions", response_model=None, responses=documented(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    st = state_of(request)
    rt = st.ready()
    check_model(body, st)
    ids = await prompts.encode_messages(st.tokenizer, [m.for_template() for m in body.messages])
    max_tokens = prompts.chat_max_tokens(body.requested_max_tokens, len(ids), st.max_context)
    prompts.check_prompt(ids, st.vocab_size, st.max_context, max_tokens, param="messages")
    params = params_of(body, max_tokens)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text: str, finish: str | None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        if delta is None:
            delta = {"content": text} if text or finish is None else {}
        c: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": rt.model_id,
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if body.include_usage:
            c["usage"] = None
        return c

    if body.stream:
        role = chunk("", None, {"role": "assistant", "content": ""})
        return start_stream(st, ids, params, arrival, rid, created, body.include_usage, chunk, prologue=role,
                            object_name="chat.completion.chunk")
    text, last = await collect(st, ids, params, arrival, request)
    assert last.usage is not None
    return JSONResponse(ChatCompletionResponse(
        id=rid, created=created, model=rt.model_id,
        choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=last.finish_reason)],
        usage=usage_info(last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens),
    ).model_dump())


# -- shared ----------------------------------------------------------------------------------------------------
def check_model(body: Sampling, st: ServerState) -> None:
    if body.model and body.model != st.model_id:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {st.model_id!r}",
                       param="model", code="model_not_found")


def params_of(body: Sampling, max_tokens: int) -> SamplingParams:
    return prompts.sampling_params(max_tokens, body.temperature, body.top_p, body.top_k, body.stop_sequences,
                                   body.seed, body.ignore_eos)


def submit(st: ServerState, ids: list[int], params: SamplingParams, arrival: float) -> EngineStream:
    """engine.submit; Rejected propagates (429/503 by the error handlers), bad input becomes a 400."""
    try:
        return EngineStream(st.engine, ids, params, arrival=arrival)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt", code="invalid_prompt") from e


async def collect(st: ServerState, ids: list[int], params: SamplingParams, arrival: float, request: Request
                  ) -> tuple[str, Delta]:
    """Non-streaming: the whole text and the last delta. A client that hangs up cancels the generation."""
    st.stream_started()
    try:
        stream = submit(st, ids, params, arrival)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
        parts: list[str] = []
        last: Delta | None = None
        try:
            async for d in stream:
                parts.append(d.text)
                last = d
        finally:
            watcher.cancel()
            stream.cancel()
    finally:
        st.stream_ended()
    assert last is not None
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {last.error or 'engine error'}", code="engine_error")
    if last.finish_reason == "cancelled":
        raise APIError(503, "the request was cancelled", code="cancelled")
    return "".join(parts), last


async def _cancel_on_disconnect(request: Request, stream: EngineStream) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return


def start_stream(st: ServerState, ids: list[int], params: SamplingParams, arrival: float, rid: str, created: int,
                 include_usage: bool, chunk: Callable[..., dict[str, Any]], prologue: dict[str, Any] | None,
                 object_name: str) -> SSEResponse:
    """Submit now (so that a refusal is a plain 429/400), then stream the deltas as OpenAI's SSE chunks."""
    stream = submit(st, ids, params, arrival)
    st.stream_started()

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in _events():
                yield event
        except Exception as e:  # after the first byte an error can only be a last event
            log.exception("stream %s failed", rid)
            yield sse_event(error_body(f"internal error: {type(e).__name__}", "server_error", None, "internal"))
            yield SSE_DONE

    async def _events() -> AsyncIterator[bytes]:
        if prologue is not None:
            yield sse_event(prologue)
        async for d in stream:
            if d.finish_reason is None:
                if d.text:
                    yield sse_event(chunk(d.text, None))
                continue
            if d.finish_reason in ("error", "cancelled"):
                message = f"generation failed: {d.error or 'engine error'}" if d.finish_reason == "error" \
                    else "the request was cancelled"
                code = "engine_error" if d.finish_reason == "error" else "cancelled"
                yield sse_event(error_body(message, "server_error", None, code))
                break
            yield sse_event(chunk(d.text, d.finish_reason))
            if include_usage and d.usage is not None:
                u = d.usage
                yield sse_event({"id": rid, "object": object_name, "created": created, "model": st.model_id,
                                 "choices": [],
                                 "usage": usage_info(u.prompt_tokens, u.completion_tokens,
                                                     u.cached_tokens).model_dump()})
        yield SSE_DONE

    def on_close() -> None:
        stream.cancel()  # a no-op once finished; a dropped stream frees its slot before the next step
        st.stream_ended()

    return SSEResponse(events(), on_close=on_close)
