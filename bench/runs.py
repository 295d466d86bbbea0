"""The benchmarks that start servers, declared as data: which `parley serve` each one starts, with which flags, and
which parley-loadtest runs it measures against each. `python -m bench <name> --dry-run` prints a plan as commands;
`--set key=value` changes one keyword argument of its builder below (`--set sweep_s=4`).

Sized for one 10-minute GPU call each on an H100 (`python -m bench e2e --dry-run` adds up the estimate)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

LLAMA = ("--model", "synthetic:llama-3.2-1b")
QWEN = ("--model", "synthetic:qwen2.5-1.5b")
# Mixed steps (issue 21): up to 16 requests decode together and a step carries up to 64 rows, so a new prompt's
# tokens ride in the decode step beside them.
MEGAKERNEL = ("--backend", "megakernel", "--max-batch", "16", "--max-rows", "16")
REFERENCE = ("--backend", "reference", "--max-batch", "16")
PRICE = ("--gpu-hourly-usd", "2.5")  # the same price the load tester assumes: its cost figures and the server's agree
SLA = ("--sla-tokens", "64", "--sla-ms", "100")
START_S = 60.0  # a server's start on the H100 with a cold Triton cache, at most (the plan's estimate)
WARM_START_S = 30.0  # ...and of the same model again (Triton's and the calibration's caches warm)
# Admission off: every request admitted unjudged, no forecast beside the steps (--sla-ms 100000 forecast each
# newcomer behind the whole queue: up to 5 ms a verdict past capacity, the GPU idle beside it); the client judges by
# 100 ms.
ADMISSION_OFF = "--no-admission"


@dataclass(frozen=True)
class Loadtest:
    name: str  # its files in the raw folder: <name>.json (every request), <name>.txt (the tables it printed)
    args: tuple[str, ...]  # parley-loadtest flags (the URL, the SLA and --json come from the runner)
    estimate_s: float  # about how long it takes on an H100, for the plan
    profile: bool = False  # py-spy records the server's processes while it runs (bench/host_profile.py)


@dataclass(frozen=True)
class Server:
    label: str  # names its files (server-<label>.log, <label>-metrics.txt); no "-": reports split names there
    serve: tuple[str, ...]  # `parley serve` flags (host and port come from the runner)
    loadtests: tuple[Loadtest, ...]
    targets: Mapping[str, float] = field(default_factory=dict)  # figure -> the target (the report checks)
    start_s: float = START_S  # its start, for the plan's estimate
    # It measures what only a server started with its own flags can (admission off): skipped at --url
    needs_own_server: bool = False

    def __post_init__(self) -> None:
        if "-" in self.label:
            raise ValueError(f"a server's label has no '-': {self.label!r}")


@dataclass(frozen=True)
class Benchmark:
    name: str  # the report's file stem: <name>-<device>.{json,md,png}
    report: Literal["e2e", "voice"]  # which report folds the raw folder
    servers: tuple[Server, ...]
    loadtest_args: tuple[str, ...] = (*SLA, "--timeout", "30")  # every loadtest's
    start_timeout_s: float = 300.0

    def estimate_s(self) -> float:
        return sum(s.start_s + sum(t.estimate_s for t in s.loadtests) for s in self.servers)


def with_flags(flags: Sequence[str], more: str) -> tuple[str, ...]:
    """`flags` with each `--flag value` (or bare `--flag`) of `more` replacing the same flag's, or added."""
    out, extra = list(flags), shlex.split(more)
    i = 0
    while i < len(extra):
        flag = extra[i]
        value = [extra[i + 1]] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else []
        i += 1 + len(value)
        if flag in out:
            at = out.index(flag)
            had = 1 if at + 1 < len(out) and not out[at + 1].startswith("--") else 0
            out[at:at + 1 + had] = [flag, *value]
        else:
            out += [flag, *value]
    return tuple(out)


def _floats(csv: str) -> list[float]:
    return [float(x) for x in csv.split(",") if x.strip()]


def _names(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


# -- end to end ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class E2ERun:
    label: str
    serve: tuple[str, ...]
    sweep: bool  # also the goodput sweep (Poisson arrivals, 32-token prompts)
    # one stream at a time: 32-token prompts (and half as many of 1,000 tokens). 100: on one H100 host 40 streams'
    # TTFT p50 read 3.29 ms where two runs of 200 read 3.03 and 3.07 (bench/NOTES.md, s86), and the target is 3 ms;
    # more would not leave bf16 and FP8 with their capacity runs in one GPU call
    single_requests: int = 100
    targets: Mapping[str, float] = field(default_factory=dict)
    by_default: bool = True  # in the plan when `only` names no run (else only when named)


E2E_COMMON = ("--max-context", "2048", *PRICE)
E2E_RUNS = (
    E2ERun("megakernel.bf16", (*LLAMA, *MEGAKERNEL, "--weights", "bf16"), sweep=True,
           targets={"goodput_rps": 40, "ttft_ms_p50": 3, "goodput_over_capacity": 0.9,
                    "admitted_on_time_min": 0.99, "gpu_idle_us_p99_at_goodput": 50, "itl_over_step_p99": 1.1}),
    E2ERun("megakernel.fp8", (*LLAMA, *MEGAKERNEL, "--weights", "fp8"), sweep=True,
           targets={"goodput_rps": 50, "ttft_ms_p50": 3, "goodput_over_capacity": 0.9,
                    "admitted_on_time_min": 0.99, "gpu_idle_us_p99_at_goodput": 50, "itl_over_step_p99": 1.1}),
    # int8 with a scale per row: FP8's bytes at +0.25% perplexity on SmolLM2 (FP8: +6.5%; README "Int8 weights")
    E2ERun("megakernel.int8row", (*LLAMA, *MEGAKERNEL, "--weights", "int8-row"), sweep=True,
           targets={"goodput_rps": 50, "ttft_ms_p50": 3, "goodput_over_capacity": 0.9,
                    "admitted_on_time_min": 0.99, "gpu_idle_us_p99_at_goodput": 50, "itl_over_step_p99": 1.1},
           by_default=False),
    # The in-run peer: the PyTorch decoder on the same GPU (~0.75 s a request, hence fewer).
    E2ERun("reference.bf16", (*LLAMA, *REFERENCE), sweep=False, single_requests=20),
    E2ERun("qwen.megakernel.bf16", (*QWEN, *MEGAKERNEL, "--weights", "bf16"), sweep=False),
)


# `engine=`: how each run's server runs its engine (`default`: as `parley serve` does, in a process of its own on a
# GPU and a thread on the CPU), and what its label gets
ENGINES = {"default": (), "thread": ("--no-engine-process",), "process": ("--engine-process",)}
ENGINE_SUFFIX = {"default": "", "thread": ".thread", "process": ".proc"}


def e2e(name: str = "e2e", only: str = "", serve_args: str = "", single_requests: int = 0,
        sweep_start: float = 10.0, sweep_max_rate: float = 1024.0, sweep_bisect: int = 3, sweep_s: float = 8.0,
        sweep_workers: int = 2, extra_body: str = "", capacity: bool = True, sweep_warmup: int = 80,
        engine: str = "default", profile: str = "") -> Benchmark:
    """End to end: one server per run of E2E_RUNS (`only`: some of their labels, comma-separated), each measured
    one stream at a time (32- and 1,000-token prompts, 64-token replies) and, where the run says, by the goodput
    sweep: Poisson arrivals from `sweep_start` requests/s, doubled until fewer than 99% of all requests meet the
    SLA (or past `sweep_max_rate`), then `sweep_bisect` bisections, `sweep_s` seconds of arrivals each, from
    `sweep_workers` client processes (one client's own event-loop lag reached p99 2.0-3.0 ms at 45-80 req/s on the
    H100 host, `e2e-fp8-s37-…`, above the 2 ms the figures allow: two share the load). `capacity`: each swept run's
    server again with admission off (`--no-admission`), swept the same way and judged by the client against the
    same 100 ms: its capacity, and the report's goodput / capacity (what admission keeps of what the server can
    serve on time). `sweep_warmup`: requests sent at the first rate before anything is measured: a fresh server's
    admission guard judges requests beside others by a conservative prior until it has seen some of its own
    (service/admission_guard.py), and the goodput sought is a
    serving replica's, not a cold one's first seconds (a rate whose first second refuses 2 of 80 fails the sweep).
    `serve_args`: flags replacing or added to every run's (`--model synthetic:tiny` for a CPU check);
    `single_requests`: instead of each run's own; `extra_body`: JSON merged into every request
    (`{"temperature": 0}`; none: the server's defaults, as the openai SDK sends). `engine`: `default` (as `parley
    serve` runs it: in a process of its own on a GPU, a thread on the CPU), `process` (`--engine-process`, labels
    ending `.proc`), `thread` (`--no-engine-process`, `.thread`), or `both` (thread and process), comma-separated:
    each run measured with each engine in the same call, one server after the other on the same GPU. `profile`:
    loadtests (the ends of their names, comma-separated: `sweep-32`, `single-32`, `capacity-32`) during which py-spy
    records the server's processes, into the raw folder (bench/host_profile.py: where the engine's host time goes)."""
    runs = [r for r in E2E_RUNS if r.label in _names(only)] if only else [r for r in E2E_RUNS if r.by_default]
    if only and len(runs) != len(_names(only)):
        raise ValueError(f"only: not a run of {[r.label for r in E2E_RUNS]}: {only}")
    engines = ["thread", "process"] if engine == "both" else _names(engine)
    if not engines or any(e not in ENGINES for e in engines):
        raise ValueError(f"engine: default, thread, process or both, not {engine!r}")
    runs = [replace(r, label=r.label + ENGINE_SUFFIX[e], serve=(*r.serve, *ENGINES[e])) for r in runs
            for e in engines]
    body = ("--extra-body", extra_body) if extra_body else ()

    def profiled(test: Loadtest) -> Loadtest:
        return _profiled(test, profile)

    servers = []
    for run in runs:
        n = single_requests or run.single_requests
        per_request_s = 0.8 if "reference" in run.serve else 0.1
        tests = [
            Loadtest(f"{run.label}-single-32", ("--concurrency", "1", "--num-requests", str(n), "--warmup", "5",
                                                "--input-len", "32", "--output-len", "64", *body),
                     3 + (n + 5) * per_request_s),
            Loadtest(f"{run.label}-single-1000", ("--concurrency", "1", "--num-requests", str(max(1, n // 2)),
                                                  "--warmup", "3", "--input-len", "1000", "--output-len", "64",
                                                  *body),
                     3 + (n // 2 + 3) * per_request_s),
        ]
        sweep = ("--sweep", "--sweep-start", f"{sweep_start:g}", "--sweep-max-rate", f"{sweep_max_rate:g}",
                 "--sweep-bisect", str(sweep_bisect), "--duration", f"{sweep_s:g}", "--workers", str(sweep_workers),
                 "--warmup", str(sweep_warmup), "--input-len", "32", "--output-len", "64", *body)
        # ~7 rates: doubling past the goodput, bisections; the warm-up at the first rate
        sweep_estimate_s = (4 + sweep_bisect) * (sweep_s + 2) + sweep_warmup / sweep_start
        if run.sweep:
            tests.append(Loadtest(f"{run.label}-sweep-32", sweep, sweep_estimate_s))
        serve = with_flags((*run.serve, *E2E_COMMON), serve_args)
        servers.append(Server(run.label, serve, tuple(map(profiled, tests)), run.targets))
        if run.sweep and capacity:  # its loadtest is named for the run: the report pairs it with the sweep
            servers.append(Server(f"{run.label}.admissionoff", with_flags(serve, ADMISSION_OFF),
                                  (profiled(Loadtest(f"{run.label}-capacity-32", sweep, sweep_estimate_s)),),
                                  start_s=WARM_START_S, needs_own_server=True))
    return Benchmark(name, "e2e", tuple(servers))


def _profiled(test: Loadtest, profile: str) -> Loadtest:
    """The loadtest, py-spy recording the server beside it where its name is, or ends with `-` and, one of `profile`'s
    (comma-separated)."""
    return replace(test, profile=any(test.name == p or test.name.endswith(f"-{p}") for p in _names(profile)))


# -- voice -----------------------------------------------------------------------------------------------------------
VOICE_TURNS = 8  # the voice scenario's (parley-loadtest --scenario voice): for the estimate only


def voice(name: str = "voice", weights: str = "bf16", serve_args: str = "", sessions: int = 4, warmup: int = 1,
          think_s: float = 0.5, fresh: str = "32,1000,2000,4000", fresh_requests: int = 10, fresh_out: int = 64,
          sweep_rates: str = "1,2,4,8,16", sweep_s: float = 10.0, sweep_workers: int = 1,
          endpoints: str = "chat,realtime", voice_args: str = "", capacity_rates: str = "2,4,8,16",
          after_refusal: str = "fall-back", profile: str = "") -> Benchmark:
    """Voice: one server (synthetic Llama-3.2-1B, the megakernel, `weights`, 8k context; `serve_args` replace or add
    flags) measured by `parley-loadtest --scenario voice` (8 turns, a 1,500-token system prompt, 40-token messages,
    64-token replies, barge-in and preemptive starts on 30% of turns; `voice_args` changes them): `sessions` voice
    sessions one at a time per endpoint (HTTP chat resends the conversation, the realtime WebSocket sends the new
    message), `think_s` between a reply and the next turn; `fresh_requests` fresh prompts of each length in
    `fresh`, one at a time, `fresh_out` tokens each; then sessions arriving as a Poisson process at each of
    `sweep_rates` per second for `sweep_s` seconds per endpoint. `warmup`: sessions (or requests) sent first,
    left out of the figures. `capacity_rates` (empty: none): the same server again with admission off, the sessions of
    the sweep arriving at those rates, judged by the client against the same SLA: how many turns the GPU can serve
    on time, beside how many admission let in and served on time; the report's capacity is the highest of those rates
    at which it served 99% of them on time. `after_refusal`: what a session does at a refused turn (parley-loadtest
    --after-refusal): by default it goes on as a voice agent with a fallback LLM does, so admission on and off are
    asked for the same turns (before 2026-12-03 the sweeps hung up: fewer turns asked, higher admitted shares).
    `profile`: loadtests (their names, comma-separated: `sweep-chat`, `session-realtime`, `fresh-32`, ...) during
    which py-spy records the server's processes into the raw folder (bench/host_profile.py), as e2e's does: the
    voice sweeps' turns that come in ~40 ms over their forecast with nothing handed over (bench/NOTES.md, s96)."""
    extra = ("--after-refusal", after_refusal, *shlex.split(voice_args))
    turn_s = think_s + 0.15
    session_tests = [
        Loadtest(f"session-{ep}", ("--scenario", "voice", "--endpoint", ep, "--concurrency", "1",
                                   "--num-requests", str(sessions), "--warmup", str(warmup),
                                   "--think-s", f"{think_s:g}", *extra),
                 3 + (sessions + warmup) * VOICE_TURNS * turn_s)
        for ep in _names(endpoints)]
    # Each length its own seed: no prefix in common with the others.
    fresh_tests = [
        Loadtest(f"fresh-{n}", ("--endpoint", "completions", "--concurrency", "1", "--num-requests",
                                str(fresh_requests), "--warmup", str(warmup), "--input-len", str(n),
                                "--output-len", str(fresh_out), "--seed", str(n)),
                 3 + (fresh_requests + warmup) * 0.15)
        for n in (int(x) for x in _names(fresh))]
    rates = _floats(sweep_rates)
    # Other sessions than the single ones (another seed); a rate lasts its arrivals and the last session's turns.

    def swept(kind: str, ep: str, at: list[float]) -> Loadtest:
        return Loadtest(f"{kind}-{ep}", ("--scenario", "voice", "--endpoint", ep, "--sweep", "--sweep-rates",
                                         ",".join(f"{r:g}" for r in at), "--duration", f"{sweep_s:g}",
                                         "--workers", str(sweep_workers), "--warmup", str(warmup),
                                         "--think-s", f"{think_s:g}", "--seed", "1", *extra),
                        3 + len(at) * (sweep_s + 2 + VOICE_TURNS * turn_s))

    sweep_tests = [swept("sweep", ep, rates) for ep in _names(endpoints)]
    serve = with_flags((*LLAMA, *MEGAKERNEL, "--weights", weights, "--max-context", "8192", *PRICE), serve_args)
    tests = tuple(_profiled(t, profile) for t in (*session_tests, *fresh_tests, *sweep_tests))
    servers = [Server(f"megakernel.{weights}", serve, tests)]
    if _floats(capacity_rates):  # the same arrivals (the same seed) with admission off
        servers.append(Server(f"megakernel.{weights}.admissionoff", with_flags(serve, ADMISSION_OFF),
                              tuple(_profiled(swept("capacity", ep, _floats(capacity_rates)), profile)
                                    for ep in _names(endpoints)),
                              start_s=WARM_START_S, needs_own_server=True))
    return Benchmark(name, "voice", tuple(servers))


BENCHMARKS: dict[str, Callable[..., Benchmark]] = {
    "e2e": e2e,
    "voice": voice,
    "voice-fp8": partial(voice, name="voice-fp8", weights="fp8"),
}
