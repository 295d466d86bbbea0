"""ServeConfig: every setting of `parley serve`, declared once. Each field is a flag (`--max-batch`), an
environment variable (`PARLEY_MAX_BATCH`; a flag wins over it), a default, a type, choices where there are some,
and the help `parley serve --help` prints: pydantic-settings builds the command line and reads the environment from
these fields, so a new setting is one field here."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from service.backend_names import BACKENDS, WEIGHT_FORMATS
from service.engine.handoff import HANDOFF_BUDGET_S

Backend = Literal[BACKENDS]  # type: ignore[valid-type]  # the tuple, stated once in service.backend_names
WeightFormat = Literal[WEIGHT_FORMATS]  # type: ignore[valid-type]


class ServeConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PARLEY_", extra="ignore", cli_kebab_case=True, cli_implicit_flags=True,
        cli_show_env_vars=True, cli_hide_none_type=True, cli_avoid_json=True, cli_exit_on_error=True)

    model: str = Field("smollm2-135m-instruct", description="the embedded model (the default), a .gguf file, a "
                       "Hugging Face checkpoint directory, or synthetic:<shape> (random weights, real shapes)")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8000, description="port to listen on")
    # Secrets: the config's repr shows no key; service/api/auth.py reads and checks them (its errors quote none)
    api_key: SecretStr | None = Field(None, description="the key callers must send (Authorization: Bearer <key>, or "
                                      "the WebSocket subprotocol openai-insecure-api-key.<key>), or several, "
                                      "comma-separated; every route but /health and /metrics refuses a call "
                                      "without one with 401. Unset (and no --api-key-file): no key is asked")
    api_key_file: str | None = Field(None, description="a file of keys, one a line (# comments), re-read on "
                                     "SIGHUP: a key is rotated without a restart; with --api-key, both are valid")
    backend: Backend = Field("auto", description="auto: the megakernel where a GPU can run it, else the PyTorch "
                             "reference")
    device: str | None = Field(None, description="cuda or cpu; unset: cuda where present")
    cpu_threads: int | None = Field(None, ge=1, description="on the CPU, the threads the engine's torch computes "
                                    "with; unset: every core this process may run on but one, which the HTTP front "
                                    "end and the clients keep (at least one thread)")
    weights: WeightFormat = Field("bf16", description="the matrices' format in memory: fp8 is e4m3 with a scale per "
                                  "output row, half the bytes a decode step streams (a checkpoint already in FP8 "
                                  "keeps its own values); int8 is GGUF's Q8_0 (int8 with a scale per 32 columns: "
                                  "bf16's quality at 53 percent of its bytes; a Q8_0 GGUF keeps its own values); "
                                  "int8-row is int8 with a scale per output row")
    batch_invariant: bool = Field(False, description="megakernel: a request's greedy tokens never depend on the "
                                  "batch it runs in (every step pads to the largest batch: +8 percent bf16, "
                                  "+23 percent fp8 per step at batch 1 on the H100)")
    query_blocks: bool = Field(True, description="megakernel: a step of prompts' rows over a long conversation (a "
                               "voice turn's new tokens; every row a prompt's, 32K positions read in all) runs in a "
                               "launch whose attention reads a prompt's cached K/V once for 4 of its rows, not once a "
                               "row (64 rows over 2,048 positions: 2.87 -> 2.13 ms on the H200)")
    max_batch: int = Field(8, ge=1, description="requests seated together (prefilling or decoding): a step's "
                           "sampled rows never exceed it (more wait)")
    kv_slots: int | None = Field(None, description="KV slots: conversations whose K/V stay cached (a request whose "
                                 "prompt begins with cached tokens prefills only the rest; idle ones are evicted "
                                 "least recently used); at least --max-batch. Unset: on a GPU, as many as half the "
                                 "memory left after the weights holds (at most 64); on the CPU, --max-batch")
    max_rows: int | None = Field(None, ge=1, description="the token budget of a step: rows it carries, decode "
                                 "rows and prompt tokens riding beside them (a longer prompt is chunked over steps); "
                                 "at least --max-batch. Unset: 16 (the megakernel carries up to 64, but past 16 rows a "
                                 "step's cost grows ~3x faster per row on the H100: README)")
    prefill_rows: int | None = Field(None, ge=1, description="the rows of a step that carries no decode row "
                                     "(nobody is waiting for a token): a short prompt on an idle server is prefilled "
                                     "in one such step instead of chunks of --max-rows, and a longer one is launched "
                                     "on its own; at least --max-rows. Unset: 64 with the megakernel on a GPU (its "
                                     "widest step, 1.67 ms against 1.04 for 16 rows, bf16 on the H200), unless "
                                     "--batch-invariant (every step would pad to it); --max-rows elsewhere")
    max_context: int = Field(2048, description="tokens per slot, prompt + output")
    calibration_budget_s: float | None = Field(None, gt=0, description="at most this long (roughly) timing steps and "
                                               "prefills at start-up, the points that matter first; the rest is "
                                               "predicted, then learned from the steps served. Unset: 3 s on the "
                                               "CPU, 10 s on a GPU, less what start-up took past 14 s (CPU) or 29 s "
                                               "(GPU) so far; at least 1 s")
    calibration_cache: str | None = Field(None, description="directory of the start-up calibration's cache (one "
                                          "file per device, model, weight format and step limits: a restart times "
                                          "one step instead of the sweep); off: no cache. Unset: "
                                          "$XDG_CACHE_HOME/parley/calibration or ~/.cache/parley/calibration")
    guard_memory: bool = Field(True, description="keep what the admission guard learned (how far forecasts ran "
                               "off, per load level) beside the calibration's cache, and start from it after a "
                               "restart: a fresh guard stretches forecasts beside others by a prior and refuses more "
                               "until it has learned. Needs the calibration cache")
    sla_ms: float = Field(100.0, description="the deadline of the SLA token, in ms from arrival")
    sla_tokens: int = Field(64, description="which token the SLA is about (the Nth)")
    admission: bool = Field(True, description="forecast each request beside those in flight and refuse at once "
                            "what would miss the SLA (off: every request admitted unjudged, best-effort, its SLA "
                            "token still timed against the deadline on /metrics: what `bench e2e` measures the "
                            "server's capacity with; --sla-ms 100000 instead forecast every newcomer behind the whole "
                            "queue, up to 5 ms a verdict beside the GPU's steps past capacity)")
    strict_sla: bool = Field(False, description="refuse what cannot meet the SLA even where no request could "
                             "(a CPU) instead of serving best-effort")
    sla_target: float = Field(0.995, ge=0.5, lt=1.0, description="the share of admitted requests that reach the SLA "
                              "token in time: admission stretches its forecasts by this quantile of how much longer "
                              "than forecast admitted requests took, as measured at each load level (0.995: a "
                              "minute of a hundred requests then shows at least 99% of them on time, not half the "
                              "minutes below it as a true 1% would)")
    admission_log: str | None = Field(None, description="a file that gets a JSON line for every admission verdict "
                                      "(its forecast, stretch, time left, and the rule that refused it) and every "
                                      "admitted request's SLA token (how far its forecast was off): why a request "
                                      "was refused, request by request. Unset: none")
    handoff_budget_ms: float = Field(HANDOFF_BUDGET_S * 1e3, gt=0,
                                     description="how much of the host's time beside a launched step the engine "
                                     "spends on admission's verdicts (and the other work handed to it) before the "
                                     "rest waits for the next step (a verdict's first part always runs): the host's "
                                     "slack beside a step. Past it the GPU waits: on the H200 a step's cadence took "
                                     "on nearly all handed-over work beyond ~0.4 ms (FP8); on the H100 (FP8) 0.3 "
                                     "against 0.5 took the steps beside verdicts from 1.29x to 1.01x their prediction")
    max_waiting: int = Field(64, description="admitted requests that may wait for a slot")
    gpu_hourly_usd: float = Field(0.0, description="this replica's GPU price per hour, exported as "
                                  "parley_gpu_hourly_usd for the cost panels")
    drain_timeout_s: float = Field(30.0, description="on SIGTERM, how long in-flight requests may take")
    wedge_timeout_s: float = Field(30.0, description="a decode step or prefill hung this long turns /health "
                                   "503 (and new requests get 503) so that an orchestrator restarts the server")
    engine_process: bool | None = Field(None, description="run the engine (warm-up, admission, the step loop) in a "
                                        "process of its own beside the HTTP front end, so that the front end's "
                                        "Python never holds the GIL the engine loop needs (off: the engine is a "
                                        "thread of this process); unset: on where the device is a GPU, off on the "
                                        "CPU")
    api_workers: int | None = Field(None, ge=1, description="HTTP front-end processes (each with its own event "
                                    "loop: HTTP parsing, templates, tokenization, SSE and WebSocket framing) sharing "
                                    "the port, all served by one engine process (so more than 1 runs the engine in a "
                                    "process of its own); unset: 2 on a GPU (unless --no-engine-process), 1 on the "
                                    "CPU; more when one front end's event loop is busy enough to delay tokens "
                                    "(/metrics: parley_front_end_loop_lag_seconds)")
    step_delay_ms: float = Field(0.0, description="testing: slow every decode step down by this much")
    fail_step: int = Field(0, description="testing: the decode step (1-based, of users' requests) that "
                           "raises, once; 0: never")
    hang_step: int = Field(0, description="testing: the decode step (1-based, of users' requests) that hangs "
                           "(wedges the engine); 0: never")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="logging threshold")
    access_log: bool = Field(False, description="log every HTTP request")

    @field_validator("api_workers")
    @classmethod
    def _one_engine_for_many(cls, api_workers: int | None, info: ValidationInfo) -> int | None:
        if api_workers is not None and api_workers > 1 and info.data.get("engine_process") is False:
            raise ValueError("more than one front end needs the engine in a process of its own: drop "
                             "--no-engine-process")
        return api_workers

    @field_validator("kv_slots")
    @classmethod
    def _holds_a_batch(cls, kv_slots: int | None, info: ValidationInfo) -> int | None:
        max_batch = info.data.get("max_batch")
        if kv_slots is not None and max_batch is not None and kv_slots < max_batch:
            raise ValueError(f"must be at least --max-batch ({max_batch}): every request decoding holds a slot")
        return kv_slots

    @field_validator("max_rows")
    @classmethod
    def _carries_a_batch(cls, max_rows: int | None, info: ValidationInfo) -> int | None:
        max_batch = info.data.get("max_batch")
        if max_rows is not None and max_batch is not None and max_rows < max_batch:
            raise ValueError(f"must be at least --max-batch ({max_batch}): every request decoding has a row a step")
        return max_rows

    @field_validator("prefill_rows")
    @classmethod
    def _no_narrower_than_a_step(cls, prefill_rows: int | None, info: ValidationInfo) -> int | None:
        floor = max(info.data.get("max_rows") or 0, info.data.get("max_batch") or 0)
        if prefill_rows is not None and prefill_rows < floor:
            raise ValueError(f"must be at least --max-rows and --max-batch ({floor}): a step with no decode row "
                             "carries at least what one beside them does")
        return prefill_rows


def engine_in_own_process(cfg: ServeConfig) -> bool:
    """--engine-process, or where unset: on a GPU, where the H100 measured the thread engine's goodput at 2.5-3.8
    req/s against 12.5 (bf16) and 35 (FP8) with the engine in its own process, in the same call (bench/NOTES.md);
    off on the CPU, where one process is all `parley serve` needs."""
    if cfg.api_workers is not None and cfg.api_workers > 1:
        return True
    if cfg.engine_process is not None:
        return cfg.engine_process
    return _on_gpu(cfg)


def front_end_count(cfg: ServeConfig) -> int:
    """--api-workers, or where unset: 2 on a GPU whose engine runs in a process of its own, where two H200 calls
    measured a token's hop to the front end's event loop at p99 1.3-1.7 ms in FP8's sweeps against 2.3-3.6 with one, and
    realtime barge-in cancel → response.done at p99 1.65-1.84 ms against 2.2-2.5 (bench/NOTES.md, "The guard scored
    against the steps that ran"); 1 on the CPU, whose few cores the engine needs."""
    if cfg.api_workers is not None:
        return cfg.api_workers
    return 2 if cfg.engine_process is not False and _on_gpu(cfg) else 1


def engine_cpu_threads(cfg: ServeConfig, cores: int | None = None) -> int:
    """--cpu-threads, or where unset: one fewer than the cores this process may run on, at least one. The reference
    decoder's torch threads meet at a barrier every op, so a core the front end or a client takes stalls them all: a
    two-core VM streaming four replies over HTTP brought them to their SLA token 1.4-2.2x their two-thread forecast
    (a fresh strict server's first burst late past its 2x prior) and 1.03-1.11x with one thread, which also finished
    them sooner: 10-13 s against 16-19 (bench/NOTES.md, "The CPU engine leaves a core to the front end")."""
    if cfg.cpu_threads is not None:
        return cfg.cpu_threads
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


MEGAKERNEL_PREFILL_ROWS = 64  # the megakernel's widest step (its largest bucket)


def step_prefill_rows(cfg: ServeConfig, backend: str, device: str, max_rows: int) -> int:
    """--prefill-rows, or where unset: the megakernel's widest step on a GPU, whose rows cost less the more a step
    carries (bf16 on the H200, as its calibration timed them: 16 rows 1.04 ms, 32 rows 1.31, 64 rows 1.67), so that a
    32-token prompt on an idle server is one step, not two chunks of 16: its first token 0.7-0.8 ms sooner
    (bench/NOTES.md, "Prompts alone in one step"); not with --batch-invariant, where every step pads to the widest.
    Elsewhere (the reference decoder, whose step costs about the same per row at any width) --max-rows. Never below
    max_rows."""
    if cfg.prefill_rows is not None:
        return max(cfg.prefill_rows, max_rows)
    if backend == "megakernel" and device.startswith("cuda") and not cfg.batch_invariant:
        return max(MEGAKERNEL_PREFILL_ROWS, max_rows)
    return max_rows


def _on_gpu(cfg: ServeConfig) -> bool:
    import torch

    return (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def add_serve_arguments(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], ServeConfig]:
    """Every field of ServeConfig as a flag of `parser`. Returns what turns the parsed flags into the ServeConfig
    (defaults, then PARLEY_* variables, then the flags given); a bad value, from a flag or a variable, exits as
    argparse does (status 2), naming the flag and its variable."""
    source: CliSettingsSource[ServeConfig] = CliSettingsSource(ServeConfig, root_parser=parser)

    def config(args: argparse.Namespace) -> ServeConfig:
        try:
            return ServeConfig(_cli_settings_source=source(parsed_args=args))  # type: ignore[call-arg]
        except ValidationError as e:
            parser.error("; ".join(_problem(err) for err in e.errors()))

    return config


def _problem(err: ErrorDetails) -> str:
    name = str(err["loc"][0]) if err["loc"] else ""
    where = f"--{name.replace('_', '-')} (PARLEY_{name.upper()})" if name else "the settings"
    return f"{where}: {err['msg']}, got {err['input']!r}"
