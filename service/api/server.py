"""ParleyServer: uvicorn, one worker, with a graceful drain on SIGTERM (and on the first Ctrl-C).

uvicorn on its own closes at once on SIGTERM. Parley instead stops admitting (new requests get 503 in OpenAI's
shape, /health turns 503 so that the load balancer looks elsewhere), lets every admitted request finish and every
stream be written to its end, and only then tells uvicorn to exit; the process exits 0. A second signal forces
the exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from types import FrameType

import uvicorn

from service.api.app import MAX_BODY_BYTES, create_app
from service.api.auth import ApiKeyError, ApiKeys, announce, redact_keys_in_logs, reload_on_sighup
from service.api.state import ServerState, server_state
from service.config import ServeConfig
from service.runtime import build_engine, settle_process

log = logging.getLogger("parley")

# Realtime frames up to this size reach the app, which answers one over 1 MiB with an `error` event (the socket stays
# open); only a larger one is refused by the WebSocket layer itself (close 1009, message too big).
WS_MAX_BYTES = 4 * MAX_BODY_BYTES
STREAMS_GRACE_S = 10.0  # after the engine drained: time for the last bytes of each stream to go out


class ParleyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._drain_thread: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread, between two bytecodes of the event loop: only flip flags and start a thread.
        if self._drain_thread is not None:  # a second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        self._drain_thread = threading.Thread(target=self._drain, name="parley-drain", daemon=True)
        self._drain_thread.start()

    def _drain(self) -> None:
        rt = self.state.runtime
        if rt is not None:
            engine = rt.engine
            engine.accepting = False
            s = engine.stats
            log.info("draining: no new requests; waiting for %d running and %d waiting (at most %.0f s)",
                     s.running, s.waiting, self.drain_timeout_s)
            t0 = time.monotonic()
            done = engine.drain(self.drain_timeout_s)
            self.state.wait_streams(STREAMS_GRACE_S)
            if done:
                log.info("drained in %.1f s", time.monotonic() - t0)
            else:
                log.warning("drain timed out after %.0f s; exiting with requests in flight", self.drain_timeout_s)
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        rt = self.state.runtime
        if self.started and rt is not None:
            c = self.config
            log.info("Parley listening on http://%s:%d — model %s, backend %s, device %s, %d slots, context %d",
                     c.host, c.port, rt.model_id, rt.backend, rt.device, rt.config.max_batch,
                     self.state.max_context)
            # uvicorn's "auto" takes uvloop and httptools where installed: 0.3 ms off an idle CPU server's first
            # token, none on the H100 (6.7 ms against 6.5), where its single streams ran a worse tail; not a
            # dependency (bench/NOTES.md). The log says which ran.
            log.info("event loop %s, HTTP parser %s", type(asyncio.get_running_loop()).__module__.split(".")[0],
                     getattr(c.http_protocol_class, "__name__", c.http))


def serve(cfg: ServeConfig) -> int:
    """Run `parley serve` until SIGTERM/SIGINT; the exit status."""
    check_port(cfg.host, cfg.port)  # before minutes of loading, not after
    try:
        keys = ApiKeys.from_config(cfg)
    except ApiKeyError as e:
        raise SystemExit(f"parley: {e}") from None
    redact_keys_in_logs()
    announce(keys, cfg.host, cfg.port)
    reload_on_sighup(keys)
    log.info("loading %s (backend %s) for http://%s:%d ...", cfg.model, cfg.backend, cfg.host, cfg.port)
    app = create_app(lambda: settle_process(build_engine(cfg)), api_keys=keys)
    state = server_state(app)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, workers=1, lifespan="on", log_config=None,
                            log_level=cfg.log_level, access_log=cfg.access_log, ws_max_size=WS_MAX_BYTES,
                            timeout_graceful_shutdown=None)
    server = ParleyServer(config, state, cfg.drain_timeout_s)
    server.run()
    if state.runtime is not None:  # the lifespan stops it; a forced exit skips the lifespan
        state.runtime.engine.stop()
    return 0 if server.started else 1


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"parley: cannot listen on {host}:{port}: {e.strerror or e}") from e
