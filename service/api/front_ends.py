"""Several HTTP front ends behind one port (`parley serve --api-workers N`), one engine process behind them.

One front end's event loop does every request's HTTP parsing, template and tokenizer, and frames every stream's
tokens: past a hundred streamed replies a second it runs late (the H200's FP8 sweeps: a token's trip from the engine
to its event loop p99 2-3.5 ms, the loop waking up to 20-50 ms late), and every stream of it waits together. So:

    parley serve (this process: the supervisor; no HTTP)
     ├─ the engine process (service/engine_process.py): one per server, as with --engine-process
     ├─ front end 0 ┐  each a process of its own: uvicorn on the one listening socket this process bound (the kernel
     ├─ front end 1 │  hands each new connection to whichever accepts first), its own ZeroMQ socket to the engine,
     └─ ...         ┘  its own ids (messages.front_end_of), the answers routed back to it

- /metrics is one endpoint on every front end: the engine's series (from the engine process), then the front ends'
  own (refusals for a key, token delivery, transit, loop lag) summed over all of them by prometheus_client's
  multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set for the front ends only).
- SIGTERM (or Ctrl-C) here is passed to every front end, each drains as `parley serve` does (the engine stops
  admitting; it waits for the engine's work and its own streams), then the engine is stopped; a second signal kills.
  SIGHUP is passed on (each re-reads --api-key-file).
- A front end that dies is started again under its number: its Hello has the engine cancel what its predecessor left
  running (those streams were cut with it); the others keep serving.
- The engine dying: every front end sees it gone (its pid), ends its streams in errors, answers 503 and exits 1; then
  this process exits 1, so that an orchestrator restarts the server. Every child dies with this process
  (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from pydantic import SecretStr

from service.api.server import bound_socket, run_front_end
from service.config import ServeConfig, front_end_count

log = logging.getLogger("parley")

POLL_S = 0.1  # how often the supervisor looks at its children
RESTART_EVERY_S = 1.0  # a front end that keeps dying is started again at most this often
STOP_TIMEOUT_S = 15.0  # a front end's drain has this long past --drain-timeout-s before it is killed
KEY_VARIABLE = "PARLEY_API_KEY"  # --api-key reaches a front end here, not on its command line


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening, and inherited by the front ends."""
    sock = bound_socket(host, port)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def engine_gone(pid: int) -> str | None:
    """Why the engine process (not this process's child) is gone, or None while it runs: its /proc entry vanished or
    it is a zombie that the supervisor has not reaped yet (Linux); elsewhere None (the heartbeat still notices)."""
    stat = Path(f"/proc/{pid}/stat")
    if not Path("/proc/self/stat").exists():
        return None
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "it exited"
    return "it exited" if state in ("Z", "X") else None


class FrontEnds:
    """The supervisor: the engine process and `cfg.api_workers` front ends on `sock`."""

    def __init__(self, cfg: ServeConfig, sock: socket.socket) -> None:
        from service import engine_process
        from service.engine import ipc

        self.cfg, self.sock = cfg, sock
        self.addresses = ipc.Addresses.fresh()
        self.metrics_dir = tempfile.mkdtemp(prefix="parley-metrics-")
        self.engine = engine_process.spawn(cfg, self.addresses)  # its environment has no PROMETHEUS_MULTIPROC_DIR
        self.children: list[subprocess.Popen[bytes]] = []
        self.started_at: list[float] = []
        self.stopping = False
        self.engine_died = False

    def spawn(self, front_end: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        if self.cfg.api_key is not None:
            env[KEY_VARIABLE] = self.cfg.api_key.get_secret_value()
        cmd = [sys.executable, "-m", "service.api.front_ends", self.cfg.model_dump_json(), self.addresses.root,
               str(front_end), str(self.sock.fileno()), str(self.engine.pid), str(os.getpid())]
        return subprocess.Popen(cmd, pass_fds=(self.sock.fileno(),), env=env)

    def run(self) -> int:
        self.children = [self.spawn(i) for i in range(front_end_count(self.cfg))]
        self.started_at = [time.monotonic()] * len(self.children)
        log.info("%d front ends on http://%s:%d (pids %s), engine process %d", len(self.children), self.cfg.host,
                 self.cfg.port, ", ".join(str(c.pid) for c in self.children), self.engine.pid)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, lambda *_: self._signal_all(signal.SIGHUP))
        while any(c.poll() is None for c in self.children) or not (self.stopping or self.engine_died):
            time.sleep(POLL_S)
            if not self.engine_died and self.engine.poll() is not None:
                self.engine_died = True  # the front ends see it too, fail their streams and exit
                log.error("the engine process exited with %s: the front ends end their streams and exit",
                          self.engine.returncode)
            for i, child in enumerate(self.children):
                if child.poll() is None or self.stopping or self.engine_died:
                    continue
                if time.monotonic() - self.started_at[i] < RESTART_EVERY_S:
                    continue
                log.error("front end %d (pid %d) exited with %s: starting it again", i, child.pid, child.returncode)
                self.children[i], self.started_at[i] = self.spawn(i), time.monotonic()
        if self.engine_died:
            return 1
        return 0 if all(c.returncode == 0 for c in self.children) else 1

    def _on_stop(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping:  # a second signal: now
            self._signal_all(signal.SIGKILL)
            return
        self.stopping = True
        log.info("%s: every front end drains", signal.Signals(sig).name)
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(sig)

    def close(self) -> None:
        """The front ends (killed where a drain overran), then the engine, then what they shared."""
        from service import engine_process

        deadline = time.monotonic() + self.cfg.drain_timeout_s + STOP_TIMEOUT_S
        for child in self.children:
            if child.poll() is None:
                child.terminate()
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        engine_process.stop(self.engine)
        self.addresses.remove()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def serve_with_front_ends(cfg: ServeConfig) -> int:
    """`parley serve --api-workers N` (N > 1): this process supervises; the exit status."""
    sock = listening_socket(cfg.host, cfg.port)
    front_ends = FrontEnds(cfg, sock)
    try:
        return front_ends.run()
    finally:
        front_ends.close()
        sock.close()


def main(argv: list[str]) -> int:
    """`python -m service.api.front_ends CONFIG_JSON IPC_ROOT FRONT_END SOCKET_FD ENGINE_PID PARENT_PID`"""
    from service.api.auth import ApiKeyError, ApiKeys, install_log_filters, reload_on_sighup
    from service.engine import ipc
    from service.engine_process import die_with_parent

    config_json, root, front_end, fd, engine, parent = argv[0], argv[1], *map(int, argv[2:6])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the supervisor passes it on
    cfg = ServeConfig.model_validate_json(config_json)
    if KEY_VARIABLE in os.environ:  # a secret dumps as stars: it travels apart
        cfg = cfg.model_copy(update={"api_key": SecretStr(os.environ.pop(KEY_VARIABLE))})
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s %(name)s[front end {front_end}]: %(message)s")
    install_log_filters()
    try:
        keys = ApiKeys.from_config(cfg)
    except ApiKeyError as e:
        log.error("%s", e)
        return 2
    reload_on_sighup(keys)
    sock = socket.socket(fileno=fd)
    return run_front_end(cfg, keys, ipc.Addresses(root), lambda: engine_gone(engine), front_end, [sock], engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
