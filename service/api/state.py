"""ServerState: what the handlers share — the engine client once the engine process is ready, whether the server
drains, and the streams still being written (a drain waits for them, not only for the engine). `server_state(app)`
finds it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette

from service.api.engine_client import EngineClient, RemoteSession
from service.api.errors import APIError
from service.api.streaming import EngineStream
from service.engine.request import SamplingParams
from service.model.tokenizer import Tokenizer

RETRY_AFTER = {"Retry-After": "5"}


@dataclass
class ServerState:
    client: EngineClient | None = None
    draining: bool = False
    failed: str | None = None  # why the engine could not be started
    created: int = field(default_factory=lambda: int(time.time()))
    _streams: int = 0
    _streams_changed: threading.Condition = field(default_factory=threading.Condition)

    # -- readiness ----------------------------------------------------------------------------------------
    def _unavailable(self) -> tuple[str, str, str] | None:
        """Why no request can be served now, as (error code, error message, /health status); None when ready."""
        client = self.client
        if client is None:
            return "not_ready", self.failed or "the model is still loading", self.failed or "loading"
        why = client.unavailable()
        if why is None and self.draining:
            return "draining", "the server is shutting down", "draining"
        return why

    def ready(self) -> EngineClient:
        """The engine's client, or a 503 in OpenAI's shape while loading, draining, wedged or gone."""
        why = self._unavailable()
        if why is not None:
            raise APIError(503, why[1], code=why[0], headers=dict(RETRY_AFTER))
        return self.engine

    def loaded(self) -> EngineClient:
        """The engine's client, also while draining (what it describes stays true); a 503 while loading."""
        return self.ready() if self.client is None else self.client

    def health(self) -> tuple[bool, str]:
        why = self._unavailable()
        return (True, "ok") if why is None else (False, why[2])

    def check_model(self, model: str | None, param: str = "model") -> None:
        """A request may name the served model, or none."""
        if model and model != self.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param=param, code="model_not_found")

    # -- the served model -----------------------------------------------------------------------------------
    @property
    def engine(self) -> EngineClient:
        assert self.client is not None
        return self.client

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_id(self) -> str:
        return self.engine.info.model_id

    @property
    def max_context(self) -> int:
        return self.engine.info.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def sla_tokens(self) -> int:
        """N of the SLA's "token N within --sla-ms"."""
        return self.engine.info.sla_tokens

    # -- streams in flight ----------------------------------------------------------------------------------
    async def open_stream(self, prompt_ids: list[int], params: SamplingParams, arrival: float,
                          grammar: str | None = None, session: RemoteSession | None = None) -> EngineStream:
        """The engine's submit, counted as a stream in flight until the stream is closed. What the engine answers
        propagates: Rejected (429, 503), ValueError for a prompt it cannot take, GrammarError (Turn.submit answers
        both)."""
        stream = await self.engine.submit(prompt_ids, params, grammar, session=session, arrival=arrival,
                                          on_close=self._stream_closed)
        with self._streams_changed:
            self._streams += 1
        return stream

    def _stream_closed(self) -> None:
        with self._streams_changed:
            self._streams -= 1
            self._streams_changed.notify_all()

    def wait_streams(self, timeout_s: float) -> bool:
        """Block (off the event loop) until every stream is written to its end, at most timeout_s; whether so."""
        with self._streams_changed:
            return self._streams_changed.wait_for(lambda: self._streams == 0, timeout_s)


def server_state(app: Starlette) -> ServerState:
    return app.state.parley
