"""create_app: the FastAPI application — OpenAI-compatible HTTP (completions, chat, models), the realtime WebSocket,
/health and /metrics. Give it a Runtime (tests) or a factory that builds one (`parley serve`), or with
`--engine-process` a coroutine function that connects to the engine process (engine_client.py): either runs in the
lifespan, before the server answers anything, so /health is 200 only once the model is loaded and warm. /metrics is
the engine's registry (rendered in the engine process where it runs apart) followed by the front end's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

# anyio imports its asyncio backend on the first request: a first voice turn would pay those imports on the event
# loop (seen in the H100 profile) and look late to admission. Import it now.
import anyio._backends._asyncio  # noqa: F401
from fastapi import FastAPI, HTTPException
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import completions, errors, realtime
from service.api.answers import ModelCard, ModelList
from service.api.auth import ApiKeys, RequireApiKey
from service.api.engine_client import EngineClient
from service.api.errors import APIError
from service.api.request_start import RequestStart
from service.api.state import ServerState, server_state
from service.api.tools import ToolDialect
from service.metrics import CONTENT_TYPE
from service.runtime import Runtime

log = logging.getLogger("parley.api")

MAX_BODY_BYTES = 1 << 20  # 1 MiB


def create_app(runtime: Runtime | Callable[[], Runtime] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               api_keys: ApiKeys | None = None,
               connect: Callable[[], Awaitable[EngineClient]] | None = None) -> FastAPI:
    """`api_keys`: the keys every route but /health and /metrics asks for (service/api/auth.py); None or none: open.
    `connect` instead of `runtime`: the engine runs in a process of its own."""
    state = ServerState()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        built = False
        if connect is not None:
            try:
                state.client = await connect()
                state.client.on_hop = state.metrics.token_hop.observe
            except Exception as e:
                state.failed = f"the engine process could not start: {e}"
                log.exception("start-up failed")
                raise
            try:
                yield
            finally:
                await state.client.close()
            return
        assert runtime is not None
        if isinstance(runtime, Runtime):
            state.runtime = runtime
        else:
            try:
                state.runtime = await asyncio.to_thread(runtime)
                built = True
            except Exception as e:
                state.failed = f"the model could not be loaded: {e}"
                log.exception("start-up failed")
                raise
        try:
            yield
        finally:
            if built and state.runtime is not None:
                await asyncio.to_thread(state.runtime.engine.stop)

    app = FastAPI(title="Parley", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.parley = state
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestStart)  # a request's SLA clock starts before its body is read
    if api_keys is not None and api_keys.required:  # added last: outermost, so a refused caller's body is never read
        app.add_middleware(RequireApiKey, keys=api_keys,
                           count_refusal=lambda reason, transport: state.metrics.api_key_refusals.labels(
                               reason=reason, transport=transport).inc())
    app.include_router(completions.router)
    app.include_router(realtime.router)

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        ok, why = state.health()
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": why}, status_code=503, headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.loaded()
        engine = await engine_answer(state.client, "metrics") if state.client is not None else \
            state._runtime.engine.metrics.render()
        return Response(engine + state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/latency_model", response_model=None)
    async def latency_model() -> JSONResponse:
        """What admission predicts with: decode-step time per batch size and prefill time per prompt length,
        measured at start-up and corrected from every step since; and the SLA it enforces."""
        state.loaded()
        if state.client is not None:
            return JSONResponse(json.loads(await engine_answer(state.client, "latency_model")))
        return JSONResponse(state._runtime.latency_model())

    def model_card() -> ModelCard:
        state.loaded()
        return ModelCard(id=state.model_id, created=state.created, max_model_len=state.max_context,
                         capabilities=ToolDialect.of(state.tokenizer).capabilities())

    @app.get("/v1/models", response_model=None)
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> JSONResponse:
        card = model_card()
        state.check_model(model_id)
        return JSONResponse(card.model_dump())

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


async def engine_answer(client: EngineClient, what: str) -> bytes:
    """The engine process's answer to a question, or a 503 once it is gone or silent."""
    try:
        return await client.query(what)
    except (RuntimeError, TimeoutError) as e:
        raise APIError(503, f"the engine did not answer: {e}", code="engine_gone", headers={"Retry-After": "5"}) from e


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema (the request bodies are the pydantic models), less the 422 it documents for every body:
    Parley answers a bad body with 400 in OpenAI's shape (documented per route). Once the model is loaded, the
    limits it sets are in the schema too: max_tokens below the context, token ids within the vocabulary."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    models = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        models.pop(name, None)
    st = server_state(app)
    if st.runtime is None and st.client is None:
        return schema  # not cached: the limits come with the model
    ctx, vocab = st.max_context, st.vocab_size
    for model, fields in (("CompletionRequest", ("max_tokens",)),
                          ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
        for f in fields:
            for alt in _alternatives(models.get(model, {}).get("properties", {}).get(f, {})):
                if alt.get("type") == "integer":
                    alt["maximum"] = ctx - 1
    for alt in _alternatives(models.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})):
        items = alt.get("items", {})
        for arr in (alt, items):
            if arr.get("type") == "array" and arr.get("items", {}).get("type") == "integer":
                arr["maxItems"] = ctx - 1
                arr["items"].update(minimum=0, maximum=vocab - 1)
    app.openapi_schema = schema
    return schema


def _alternatives(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return list(prop.get("anyOf", [])) or [prop]


class BodyLimit:
    """413 for request bodies over the limit: at once from Content-Length, or while a chunked body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(scope, receive, send)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())  # FastAPI lets an HTTPException through
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = APIError(413, self._message(), code="request_too_large").response()
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
