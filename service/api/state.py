"""ServerState: what the handlers share — the runtime once it is built, whether the server drains, and the streams
still being written (a drain waits for them, not only for the engine). `server_state(app)` finds it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette

from service.api.errors import APIError
from service.api.streaming import EngineStream
from service.engine.engine import Engine
from service.engine.kv_slots import Session
from service.engine.request import SamplingParams
from service.metrics import FrontEndMetrics
from service.model.tokenizer import Tokenizer
from service.runtime import Runtime

RETRY_AFTER = {"Retry-After": "5"}


@dataclass
class ServerState:
    runtime: Runtime | None = None
    draining: bool = False
    failed: str | None = None  # why the runtime could not be built
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: FrontEndMetrics = field(default_factory=FrontEndMetrics)  # what the front end counts itself
    _streams: int = 0
    _streams_changed: threading.Condition = field(default_factory=threading.Condition)

    # -- readiness ----------------------------------------------------------------------------------------
    def _unavailable(self) -> tuple[str, str, str] | None:
        """Why no request can be served now, as (error code, error message, /health status); None when ready."""
        rt = self.runtime
        if rt is None:
            return "not_ready", self.failed or "the model is still loading", self.failed or "loading"
        if self.draining or not rt.engine.accepting:
            return "draining", "the server is shutting down", "draining"
        if not rt.engine.healthy():  # wedged or dead: an answer now beats a request that would wait forever
            return "engine_unhealthy", "the engine is not responding; this server should be restarted", \
                "engine unhealthy"
        return None

    def ready(self) -> Runtime:
        """The runtime, or a 503 in OpenAI's shape while loading, draining or wedged."""
        why = self._unavailable()
        if why is not None:
            raise APIError(503, why[1], code=why[0], headers=dict(RETRY_AFTER))
        return self._runtime

    def loaded(self) -> Runtime:
        """The runtime, also while draining (what it describes stays true); a 503 while loading."""
        return self.ready() if self.runtime is None else self.runtime

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
    def _runtime(self) -> Runtime:
        assert self.runtime is not None
        return self.runtime

    @property
    def engine(self) -> Engine:
        return self._runtime.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self._runtime.model.tokenizer

    @property
    def model_id(self) -> str:
        return self._runtime.model_id

    @property
    def max_context(self) -> int:
        rt = self._runtime
        return min(rt.config.max_context, rt.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return self._runtime.model.config.vocab_size

    @property
    def sla_tokens(self) -> int:
        """N of the SLA's "token N within --sla-ms"."""
        return self._runtime.config.sla_tokens

    # -- streams in flight ----------------------------------------------------------------------------------
    def open_stream(self, prompt_ids: list[int], params: SamplingParams, arrival: float,
                    session: Session | None = None) -> EngineStream:
        """engine.submit, counted as a stream in flight until the stream is closed. What the engine raises
        propagates: Rejected (429, 503), ValueError for a prompt it cannot take (Turn.submit answers it)."""
        stream = EngineStream(self.engine, prompt_ids, params, session=session, arrival=arrival,
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
