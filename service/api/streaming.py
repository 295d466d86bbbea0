"""From the engine process to asyncio, and from asyncio to Server-Sent Events.

`EngineStream` is one submitted request as a front end sees it: the engine process sends its token ids (a StepOutput
per iteration, engine_client.py) and the stream turns them into text deltas here, with the request's stop strings:
text that may start one is held back, and the one that completes one ends the request (the engine is told to stop it,
as completed). `SSEResponse` streams `data: ...` events and cancels the generation the moment the client goes away (a
barge-in closes the stream): it listens for the disconnect itself, whatever ASGI version the server speaks, and
cancels the request in a `finally`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.engine.messages import Finish, Verdict
from service.engine.output import TextOutput
from service.engine.request import Delta, Timings, Usage

if TYPE_CHECKING:
    from service.api.engine_client import EngineClient


class EngineStream:
    """One submitted request, its deltas readable with `async for` (the last one carries finish_reason)."""

    def __init__(self, client: EngineClient, rid: int, prompt_tokens: int, output: TextOutput,
                 on_close: Callable[[], None] | None = None) -> None:
        self.client, self.rid = client, rid
        self.verdict: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._output = output
        self._prompt_tokens = prompt_tokens
        self._tokens = 0  # received
        self._stopped_at: int | None = None  # the token that completed a stop string: the engine was told to stop
        self._ended = False  # the last delta is queued
        self.finished = False  # ...and read
        self._on_close = on_close

    # -- from the engine (the client's reader, on the event loop) ----------------------------------------------------
    def token(self, token: int) -> None:
        if self._stopped_at is not None or self._ended:
            return  # generated before the engine heard of the stop: not the client's
        self._tokens += 1
        text = self._output.add(token)
        if self._output.stopped:
            self._stopped_at = self._tokens
            self.client.cancel(self.rid, "stop")
        self._queue.put_nowait(Delta(text, [token]))

    def finish(self, f: Finish) -> None:
        if self._ended:
            return
        reason, text, ids = f.reason, "", [] if f.token is None else [f.token]
        completion = f.completion_tokens
        if self._stopped_at is not None:  # a stop string ended it, whatever the engine did meanwhile
            reason, ids, completion = "stop", [], self._stopped_at
        elif reason == "length" and f.token is not None:
            text = self._output.add(f.token)
            if self._output.stopped:
                reason = "stop"
        if reason in ("stop", "length"):
            text += self._output.finish()
        timings = Timings(f.queue_ms, f.prefill_ms, f.ttft_ms, f.ttfn_ms, f.e2e_ms, f.n)
        self._end(Delta(text, ids, reason, f.error, Usage(f.prompt_tokens or self._prompt_tokens, completion,
                                                          f.cached_tokens), timings))

    def fail(self, why: str) -> None:
        """The engine is gone: an error, now."""
        if not self.verdict.done():
            self.verdict.set_result(Verdict(self.rid, 503, "engine_gone", why, 5.0))
        if not self._ended:
            self._end(Delta("", [], "error", why, Usage(self._prompt_tokens, self._tokens, 0)))

    def _end(self, delta: Delta) -> None:
        self._ended = True
        if not self.verdict.done():  # it ended before its verdict came (a cancel): it was admitted
            self.verdict.set_result(Verdict(self.rid))
        self._queue.put_nowait(delta)

    # -- the API's side -------------------------------------------------------------------------------------------
    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.finished:
            delta = await self._queue.get()
            if delta.finish_reason is not None:
                self.finished = True
            yield delta

    def cancel(self) -> None:
        """Free the slot before the next step (idempotent; a finished request is left alone)."""
        if not self._ended:
            self.client.cancel(self.rid)

    def close(self) -> None:
        """Done with it: cancelled if it still runs, and `on_close` called (once; idempotent)."""
        self.cancel()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


async def until_disconnect(receive: Receive) -> None:
    """Returns once the HTTP client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


def sse_event(data: str) -> bytes:
    """One `data:` event; `data` is one line (JSON as pydantic writes it, or [DONE])."""
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


class SSEResponse(Response):
    """text/event-stream from an async iterator of bytes. The stream stops (and `on_close` runs) when the
    iterator ends, when the client disconnects, or when the handler is cancelled."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.body_iterator = content
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.body_iterator:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:
                        pass  # the client went away mid-write
                    finally:
                        tg.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    await until_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch_disconnect)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()
