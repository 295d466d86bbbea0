"""`parley serve`: the engine process (service/engine_process.py) and a front end — uvicorn in this process, and with
`--api-workers N` N-1 more front-end processes on the same port (SO_REUSEPORT: the kernel spreads connections) —
with a graceful drain on SIGTERM (and on the first Ctrl-C).

uvicorn on its own closes at once on SIGTERM. Parley instead stops admitting (new requests get 503 in OpenAI's
shape, /health turns 503 so that the load balancer looks elsewhere), lets every admitted request finish and every
stream be written to its end, and only then tells uvicorn to exit, then stops the engine process; the process exits
0. A second signal forces the exit. When the engine process dies, every stream ends in an error, /health says why
(503) for ENGINE_GONE_GRACE_S, and the front end exits 1: an orchestrator restarts the whole server. The processes
this one starts die with it (PR_SET_PDEATHSIG); a front-end process that dies takes the server down (exit 1).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from service import engine_process
from service.api.app import MAX_BODY_BYTES, create_app
from service.api.engine_client import EngineClient
from service.api.state import ServerState, server_state
from service.config import ServeConfig
from service.engine import ipc

log = logging.getLogger("parley")

# Realtime frames up to this size reach the app, which answers one over 1 MiB with an `error` event (the socket stays
# open); only a larger one is refused by the WebSocket layer itself (close 1009, message too big).
WS_MAX_BYTES = 4 * MAX_BODY_BYTES
STREAMS_GRACE_S = 10.0  # after the engine drained: time for the last bytes of each stream to go out
ENGINE_GONE_GRACE_S = 2.0  # the engine process died: /health answers 503 (and why) this long, then the server exits


class ParleyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float,
                 workers: list[subprocess.Popen[bytes]] | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.workers = workers or []  # the other front-end processes (`--api-workers`), this one's children
        self._drain_thread: threading.Thread | None = None
        self.engine_gone = False
        self.worker_gone = False
        self.worker_of: int | None = None  # in a front-end process of its own: the pid of the one that started it

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread, between two bytecodes of the event loop: only flip flags and start a thread.
        if sig == signal.SIGINT and self.worker_of is not None:
            return  # a Ctrl-C reaches every process of the group: the first front end drains the others
        if self._drain_thread is not None:  # a second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        self._drain_thread = threading.Thread(target=self._drain, name="parley-drain", daemon=True)
        self._drain_thread.start()

    def _drain(self) -> None:
        for w in self.workers:  # they drain their own streams, as this one does
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        client = self.state.client
        if client is not None:
            client.drain()
            s = client.status
            log.info("draining: no new requests; waiting for %d running and %d waiting (at most %.0f s)",
                     s.running if s else 0, s.waiting if s else 0, self.drain_timeout_s)
            t0 = time.monotonic()
            end = t0 + self.drain_timeout_s
            while not client.drained() and time.monotonic() < end:
                time.sleep(0.01)
            done = client.drained()
            self.state.wait_streams(STREAMS_GRACE_S)
            if done:
                log.info("drained in %.1f s", time.monotonic() - t0)
            else:
                log.warning("drain timed out after %.0f s; exiting with requests in flight", self.drain_timeout_s)
        for w in self.workers:
            try:
                w.wait(STREAMS_GRACE_S)
            except subprocess.TimeoutExpired:
                w.kill()
        self.should_exit = True

    def on_engine_gone(self, why: str) -> None:
        """The engine process died (on the event loop): exit after the grace, whatever is still open."""
        self.engine_gone = True

        def leave() -> None:
            self.should_exit = True

        asyncio.get_running_loop().call_later(ENGINE_GONE_GRACE_S, leave)

    async def _watch_workers(self) -> None:
        """A front-end process that dies (not drained) takes the server down: an orchestrator restarts it whole."""
        while not self.should_exit:
            await asyncio.sleep(0.2)
            for w in self.workers:
                if w.poll() is not None and self._drain_thread is None:
                    log.error("front-end process %d exited with %s: stopping the server", w.pid, w.returncode)
                    self.worker_gone = self.should_exit = True
                    return

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.workers:
            self._watcher = asyncio.create_task(self._watch_workers())
        client = self.state.client
        if self.started and client is not None:
            c, info = self.config, client.info
            gc.collect()
            gc.freeze()  # what start-up allocated stays out of every later collection's scan
            log.info("Parley listening on http://%s:%d — model %s, backend %s, device %s, %d slots, context %d "
                     "(engine process %d)", c.host, c.port, info.model_id, info.backend, info.device, info.max_batch,
                     info.max_context, info.pid)


def serve(cfg: ServeConfig) -> int:
    """Run `parley serve` until SIGTERM/SIGINT; the exit status."""
    check_port(cfg.host, cfg.port)  # before minutes of loading, not after
    log.info("loading %s (backend %s) for http://%s:%d ...", cfg.model, cfg.backend, cfg.host, cfg.port)
    addresses = ipc.Addresses.fresh()
    engine = engine_process.spawn(cfg, addresses, front_ends=cfg.api_workers)
    workers = [spawn_front_end(cfg, addresses, fe, engine.pid) for fe in range(1, cfg.api_workers)]
    try:
        return run_front_end(cfg, addresses, 0, engine.poll, workers)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        engine_process.stop(engine)
        addresses.remove()


def run_front_end(cfg: ServeConfig, addresses: ipc.Addresses, fe: int, engine_exit: Callable[[], int | None],
                  workers: list[subprocess.Popen[bytes]] | None = None, worker_of: int | None = None) -> int:
    """Front end `fe`: uvicorn on the port (shared with the others), until SIGTERM or the engine's end."""
    server: ParleyServer | None = None

    async def connect() -> EngineClient:
        client = await EngineClient.connect(addresses, fe, exit_code=engine_exit)
        assert server is not None
        client.on_dead.append(server.on_engine_gone)
        return client

    app = create_app(connect)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, workers=1, lifespan="on", log_config=None,
                            log_level=cfg.log_level, access_log=cfg.access_log, ws_max_size=WS_MAX_BYTES,
                            timeout_graceful_shutdown=None)
    server = ParleyServer(config, server_state(app), cfg.drain_timeout_s, workers)
    server.worker_of = worker_of
    server.run(sockets=[listen(cfg.host, cfg.port, shared=cfg.api_workers > 1)])
    if server.engine_gone or server.worker_gone:
        return 1
    return 0 if server.started else 1


def listen(host: str, port: int, shared: bool) -> socket.socket:
    """The listening socket; `shared`: every front end binds the port (SO_REUSEPORT) and the kernel spreads
    connections among them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # what accepted connections inherit: no Nagle (uvloop sets it only on servers it binds itself; without it every
    # small response waited ~40 ms for the client's delayed ACK)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind((host, port))
    s.set_inheritable(False)
    return s


def spawn_front_end(cfg: ServeConfig, addresses: ipc.Addresses, fe: int, engine_pid: int) -> subprocess.Popen[bytes]:
    """Front-end process `fe` (`--api-workers`): `python -m service.api.server`, dying with this process."""
    cmd = [sys.executable, "-m", "service.api.server", cfg.model_dump_json(), addresses.root, str(fe), str(engine_pid),
           str(os.getpid())]
    return subprocess.Popen(cmd)


def pid_exit(pid: int) -> Callable[[], int | None]:
    """An exit status for a process that is not this one's child: None while it lives, -1 once it is gone."""

    def code() -> int | None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            pass
        return None

    return code


def front_end_main(argv: list[str]) -> int:
    """`python -m service.api.server CONFIG_JSON IPC_DIR FE ENGINE_PID PARENT_PID`: a front-end process of its own."""
    config_json, root, fe, engine_pid, parent = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    engine_process.die_with_parent(parent)
    cfg = ServeConfig.model_validate_json(config_json)
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{fe}]: %(message)s")
    return run_front_end(cfg, ipc.Addresses(root), fe, pid_exit(engine_pid), worker_of=parent)


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"parley: cannot listen on {host}:{port}: {e.strerror or e}") from e


if __name__ == "__main__":
    sys.exit(front_end_main(sys.argv[1:]))
