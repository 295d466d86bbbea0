"""What the tests against a live `parley serve` share, each written once: starting and stopping a server (the embedded
model, or the tiny synthetic one that starts in seconds), free ports, polling, reading /metrics (prometheus_client's
parser), reading SSE bodies and realtime events, and the OpenAI error shape. The session's shared server is
conftest.py's `shared_server` fixture."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from websockets.asyncio.client import ClientConnection

from bench.server import stop as stop_process  # SIGTERM (the server drains), SIGKILL after a timeout

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0  # loading + calibrating the embedded model takes ~10-90 s on two busy cores
TINY = ("--model", "synthetic:tiny")
EVENT_TIMEOUT_S = 120.0  # a realtime event not come by then is a hang (generous: two busy cores)

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(probe: Callable[[], T], until: Callable[[T], bool], timeout_s: float, what: str,
         every_s: float = 0.1, describe: Callable[[T], str] = repr) -> T:
    """Ask `probe` every `every_s` until `until` holds for its answer, and return that answer; after `timeout_s`,
    an AssertionError that says `what` was awaited and describes the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if until(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {describe(answer)})")
        time.sleep(every_s)


# -- a server of one's own ----------------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def health(self) -> int | None:
        """/health's status, or None while the port does not answer; RuntimeError once the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"parley exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return health_status(self.base, timeout_s=5)
        except httpx.HTTPError:
            return None


def start_server(log: Path, *args: str, timeout_s: float = START_TIMEOUT_S) -> Server:
    """`python -m service.cli serve --port <free> <args>` on the CPU; returns once /health answers 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, whatever the machine
    # ...but the calibration cache stays as conftest.py sets it (off): dropped with the rest, a test server had read a
    # calibration another run cached on a busy moment (one 16-token prefill timed at 336 ms, extrapolated to 42 s for
    # a 2,000-token conversation) and refused an 8-token turn of tests/test_router.py
    env["PARLEY_CALIBRATION_CACHE"] = os.environ.get("PARLEY_CALIBRATION_CACHE", "off")
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, port, log)
    try:
        poll(server.health, lambda status: status == 200, timeout_s, "parley healthy", every_s=0.5)
    except AssertionError as e:
        stop_server(server)
        raise RuntimeError(f"{e}\n{server.log_tail()}") from None
    return server


def tiny_server(log: Path, *args: str) -> Server:
    """A server on the tiny synthetic model (it loads and calibrates in seconds)."""
    return start_server(log, *TINY, *args, timeout_s=120)


def stop_server(server: Server, timeout_s: float = 60.0) -> int | None:
    return stop_process(server.proc, timeout_s)


def served(server: Server) -> Iterator[Server]:
    """The body of a server fixture (`yield from served(start_server(...))`): the server, then SIGTERM at teardown,
    and it must exit 0 (a clean drain)."""
    yield server
    assert stop_server(server) == 0, server.log_tail()


def health_status(base: str, timeout_s: float = 30.0) -> int:
    return httpx.get(f"{base}/health", timeout=timeout_s).status_code


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS of /proc/<pid>/status), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# -- /metrics -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scrape:
    """One read of /metrics, as prometheus_client's parser reads it."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls(tuple(s for family in text_string_to_metric_families(text) for s in family.samples))

    def get(self, name: str) -> float | None:
        """The value of the unlabelled sample `name` (a gauge, an unlabelled counter); None when it is not exposed."""
        return next((s.value for s in self.samples if s.name == name and not s.labels), None)

    def __getitem__(self, name: str) -> float:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels`; 0 where there is none (a labelled counter
        before its first count)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def requests(self, outcome: str) -> float:
        """parley_requests_total of one outcome (completed, cancelled, rejected, failed), over every reason."""
        return self.total("parley_requests_total", outcome=outcome)


def scrape_metrics(base: str) -> Scrape:
    return Scrape.parse(httpx.get(f"{base}/metrics", timeout=30).text)


def is_idle(m: Scrape) -> bool:
    """Nothing runs or waits and every KV slot is free."""
    free, total = m.get("parley_kv_slots_free"), m.get("parley_kv_slots_total")
    return (m.get("parley_requests_running") == 0 and m.get("parley_requests_waiting") == 0
            and total is not None and free == total)


def wait_idle(base: str, timeout_s: float = 30.0) -> Scrape:
    """Poll /metrics until the server is idle (is_idle); then a scrape taken wholly after that one, idle too.

    One scrape is not a snapshot: the engine renders its metrics on another thread while it steps, so a scrape can
    read a request's outcome counter before its end is counted and the gauges after its slot is freed (CI on two cores
    saw a dropped stream idle yet not cancelled). The engine counts an end before it updates the gauges, so a scrape
    begun after the gauges read idle holds every count."""
    def idle_twice() -> Scrape:
        m = scrape_metrics(base)
        return scrape_metrics(base) if is_idle(m) else m

    return poll(idle_twice, is_idle, timeout_s, "idle", describe=lambda m: (
        f"running {m.get('parley_requests_running')}, waiting {m.get('parley_requests_waiting')}, "
        f"KV slots free {m.get('parley_kv_slots_free')}/{m.get('parley_kv_slots_total')}"))


# -- answers ------------------------------------------------------------------------------------------------------
def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line (`[DONE]` included); None for the blank line between events."""
    return line[len("data: "):] if line.startswith("data: ") else None


def sse_events(body: str | Iterable[str]) -> list[str]:
    """The `data:` payloads of an SSE body (the whole text, or its lines), in order."""
    lines = body.splitlines() if isinstance(body, str) else body
    return [data for line in lines if (data := sse_data(line)) is not None]


async def recv_event(ws: ClientConnection, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
    """The next realtime event of the socket, as JSON."""
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


def assert_openai_error(body: Any, code: str | None = None, param: str | None = "<any>",
                        type: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} (exactly those keys), with the given code/param/type."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if param != "<any>":
        assert err["param"] == param, err
    if type is not None:
        assert err["type"] == type, err
    return err


def group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (a server started with start_new_session: its pid is the group's)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # field 5: the process group; field 3: its state
            pids.append(int(entry))
    return pids


def engine_pid(server: Server) -> int:
    """The engine process (`--engine-process`, `--api-workers`): the one process of the server's group that runs
    service.engine_process."""
    for pid in group_pids(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"service.engine_process" in cmdline:
            return pid
    raise AssertionError(f"no engine process in the group of {server.proc.pid}:\n{server.log_tail()}")


def stream_killing(server: Server, body: dict[str, Any], pid: int, after: int = 3) -> tuple[list[str], float]:
    """A streamed completion's SSE data, SIGKILL sent to `pid` once `after` events have come; and how long the stream
    took to end after the kill."""
    events: list[str] = []
    killed = None
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if (d := sse_data(line)) is not None:
                events.append(d)
                if len(events) == after:
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
    assert killed is not None, f"the stream ended after {len(events)} events, before the kill"
    return events, time.monotonic() - killed
