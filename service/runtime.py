"""build_engine: from a ServeConfig to a loaded, warm, calibrated engine. What `parley serve` runs at start-up."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from service import guard_memory
from service.admission import AdmissionController
from service.admission_log import AdmissionLog
from service.backends import make_decoder, resolve_backend
from service.backends.decoder import Decoder
from service.backends.faults import FaultInjectingDecoder
from service.calibration import cache_dir_of, cache_key, calibrated, default_budget, run_every_step_shape
from service.config import ServeConfig, engine_cpu_threads, step_prefill_rows
from service.engine.admission import AdmitAll
from service.engine.collector import Collector
from service.engine.commit import Event, StepDone
from service.engine.engine import DEFAULT_MAX_ROWS, Engine
from service.engine.grammar import grammars, json_rule
from service.engine.kv_slots import COPY_MIN_TOKENS
from service.engine.request import SamplingParams
from service.engine.sampler import TokenConstraint
from service.latency_model import LatencyModel
from service.metrics import Metrics
from service.model.config import ModelConfig
from service.model.loader import Model, load_model
from service.model.tokenizer import Tokenizer

log = logging.getLogger("parley")


@dataclass
class Runtime:
    config: ServeConfig
    model: Model
    engine: Engine
    backend: str
    device: str
    model_id: str
    latency: LatencyModel
    admission: AdmissionController

    def latency_model(self) -> dict[str, object]:
        """What admission predicts with (GET /v1/latency_model): the latency model, the SLA, the guard."""
        adm = self.admission
        return {**self.latency.snapshot(), "sla_ms": adm.sla_s * 1e3, "sla_tokens": adm.sla_tokens,
                "admission": adm.forecasts, "best_effort": adm.best_effort, "strict": adm.strict,
                "guard": adm.snapshot(),
                "idle_time_to_sla_token_ms": round(adm.idle_prediction_s() * 1e3, 3),
                "backend": self.backend, "device": self.device}

    @property
    def max_context(self) -> int:
        return min(self.config.max_context, self.model.config.max_position_embeddings)


def build_engine(cfg: ServeConfig) -> Runtime:
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(cfg.backend)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if device == "cpu":  # before the warm-up and the calibration: they time the steps as the engine will run them
        torch.set_num_threads(engine_cpu_threads(cfg))
        log.info("the engine computes with %d torch threads on the CPU (--cpu-threads)", torch.get_num_threads())
    t0 = time.perf_counter()
    model = load_model(cfg.model, device=device, dtype=dtype)
    log.info("loaded %s (%s) in %.1f s", cfg.model, model.config.name, time.perf_counter() - t0)
    max_context = min(cfg.max_context, model.config.max_position_embeddings)
    kv_slots = cfg.kv_slots or default_kv_slots(model.config, max_context, cfg.max_batch, device, dtype)
    max_rows = max(cfg.max_rows or DEFAULT_MAX_ROWS, cfg.max_batch)
    prefill_rows = step_prefill_rows(cfg, backend, device, max_rows)
    decoder = make_decoder(backend, model.config, model.weights, kv_slots, max_context, device,
                           weight_format=cfg.weights, max_batch=cfg.max_batch, batch_invariant=cfg.batch_invariant,
                           max_rows=prefill_rows, query_blocks=cfg.query_blocks)
    carries = getattr(decoder, "max_rows", None)  # the most rows the backend's step takes (the megakernel's tiles)
    if carries is not None and prefill_rows > carries:
        flag, asked = ("--max-rows", max_rows) if max_rows > carries else ("--prefill-rows", prefill_rows)
        log.warning("%s %d: the %s backend carries at most %d rows a step", flag, asked, backend, carries)
        max_rows, prefill_rows = min(max_rows, carries), carries
    log.info("%d KV slots of %d tokens (cached conversations), decoding up to %d requests together, %d rows a step "
             "(%d without a decode row)", kv_slots, max_context, cfg.max_batch, max_rows, prefill_rows)
    faults = None
    if cfg.step_delay_ms or cfg.fail_step or cfg.hang_step:
        # The delay applies from the start (calibration must see it); --fail-step/--hang-step count the steps of
        # users' requests only, from when the server is warm.
        decoder = faults = FaultInjectingDecoder(decoder, cfg.step_delay_ms / 1e3, cfg.fail_step, cfg.hang_step)
        faults.armed = False
    t0 = time.perf_counter()
    # warm first: the calibration then times shapes that have already run once (allocations, kernel loads)
    seen = warm_up(decoder, model.tokenizer, cfg.sla_ms, cfg.sla_tokens, frozenset(model.config.eos_token_ids),
                   max_batch=cfg.max_batch, max_rows=max_rows, prefill_rows=prefill_rows)
    log.info("warmed up in %.1f s", time.perf_counter() - t0)
    # every step width the planner may choose is timed: up to the prompt-only step's
    key = calibration_key(cfg, decoder, model.config, backend, prefill_rows)
    latency = calibrated_latency(cfg, decoder, key, prefill_rows, seen)
    trace = AdmissionLog(cfg.admission_log) if cfg.admission_log else None
    if trace is not None:
        atexit.register(trace.close)  # the last lines written at a clean exit (SIGTERM's drain)
    admission = AdmissionController(latency, cfg.sla_ms / 1e3, cfg.sla_tokens, cfg.max_batch,
                                    strict=cfg.strict_sla, target=cfg.sla_target, trace=trace,
                                    forecasts=cfg.admission)
    remember_guard(cfg, key, admission)
    metrics = Metrics(cfg.sla_tokens)
    metrics.export_guard(admission.guard)
    metrics.info.labels(model=cfg.model, backend=backend, device=device, weights=cfg.weights).set(1)
    metrics.gpu_hourly_usd.set(cfg.gpu_hourly_usd)
    engine = Engine(decoder, model.tokenizer, model.config.eos_token_ids, metrics=metrics,
                    admission=admission, sla_ms=cfg.sla_ms, sla_tokens=cfg.sla_tokens,
                    max_waiting=cfg.max_waiting, wedge_timeout_s=cfg.wedge_timeout_s, max_batch=cfg.max_batch,
                    max_rows=max_rows, prefill_rows=prefill_rows, handoff_budget_s=cfg.handoff_budget_ms / 1e3)
    engine.start()
    if faults is not None:
        faults.steps, faults.armed = 0, True
    return Runtime(cfg, model, engine, backend, device, model_id=cfg.model, latency=latency, admission=admission)


def calibration_key(cfg: ServeConfig, decoder: Decoder, config: ModelConfig, backend: str,
                    max_rows: int) -> dict[str, object]:
    """What this server's step times depend on: its calibration's cache key, and its guard memory's."""
    return cache_key(decoder.device, cfg.model, config, cfg.weights, backend, max_rows, cfg.max_batch,
                     decoder.max_context, batch_invariant=cfg.batch_invariant, step_delay_ms=cfg.step_delay_ms)


def remember_guard(cfg: ServeConfig, key: dict[str, object], admission: AdmissionController) -> None:
    """Where the calibration is cached (and --guard-memory is on), the guard starts from what the last run of this
    server learned and leaves what it learns at a clean exit (service/guard_memory.py)."""
    directory = cache_dir_of(cfg.calibration_cache)
    if directory is None or not cfg.guard_memory or not cfg.admission:  # --no-admission: no forecast to score
        return
    key = guard_memory.memory_key(key, cfg.sla_ms, cfg.sla_tokens)
    path = guard_memory.memory_path(directory, key)
    guard_memory.load(path, key, admission.guard)
    atexit.register(guard_memory.save, path, key, admission.guard)


def calibrated_latency(cfg: ServeConfig, decoder: Decoder, key: dict[str, object], max_rows: int,
                       seen: dict[int, float] | None = None) -> LatencyModel:
    """The latency model admission starts from: the cached calibration of this device, model, weight format and
    step limits (`key`) where --calibration-cache has one (a restart times one step), else measured within
    --calibration-budget-s (no step slower than the warm-up saw one of as many rows or more: `seen`) and cached."""
    t0 = time.perf_counter()
    budget = cfg.calibration_budget_s or default_budget(decoder.device, process_age_s())
    cal = calibrated(decoder, key, cache_dir_of(cfg.calibration_cache), max_rows, cfg.max_batch, budget, seen=seen)
    latency = cal.latency_model()
    log.info("latency model ready in %.1f s (%d points timed at start-up, the rest predicted and learned while "
             "serving): %s", time.perf_counter() - t0, len(cal.measured), latency.snapshot())
    return latency


def process_age_s() -> float:
    """Seconds since this process started (Linux; 0 elsewhere): what start-up has taken so far, imports included."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks after boot
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def settle_process(rt: Runtime) -> Runtime:
    """What a serving process sets once its runtime is warm (process-wide, so `parley serve` does it, not every
    build_engine): the start-up heap frozen out of the garbage collector, every collection timed (and on a GPU run by
    the engine thread beside its steps), and a short GIL switch interval. The engine thread waits on the GPU with the
    GIL released, and every torch call it makes releases it too; each time it needs the GIL back from the event loop's
    thread, which hands it over only every switch interval while it runs Python (admission's forecasts, SSE framing).
    Single-stream runs on the H100 showed 4-7 ms gaps between tokens at the default 5 ms, gone at 0.5 ms; under load
    the engine's `feed` and `decode` phases still took up to 6-7 ms, a dozen or so GIL hand-overs each. On the CPU
    beside a busy Python thread, the `feed` phase's p99 was 3.5 ms at 0.5 ms and 1.5 ms at 0.1 ms (20 us alone)."""
    GC_WATCH.install(rt.engine.metrics, rt.admission.trace)
    # on a GPU the engine thread collects beside its launched steps (service/engine/collector.py); Python 3.14's
    # incremental collector counts and triggers otherwise, so there it keeps its own pace
    if rt.engine.overlap and sys.version_info < (3, 14):
        rt.engine.collector = Collector().install()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return rt


SWITCH_INTERVAL_S = 0.0001

KV_MEMORY_SHARE = 0.5  # of the GPU memory left after the weights: the rest is for prefill graphs and activations
MAX_DEFAULT_KV_SLOTS = 64


def default_kv_slots(config: ModelConfig, max_context: int, max_batch: int, device: str, dtype: torch.dtype) -> int:
    """How many conversations to keep cached when --kv-slots is unset: on a GPU, as many slots as a share of the
    memory left after the weights holds (each 2 × layers × kv_heads × context × head_dim values: 268 MB for
    Llama-3.2-1B at 8k in bf16, so 64 fit on an 80 GB H100), at most MAX_DEFAULT_KV_SLOTS; on the CPU, --max-batch.
    Never fewer than --max-batch."""
    if not device.startswith("cuda"):
        return max_batch
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    per_slot = 2 * config.num_layers * config.num_kv_heads * max_context * config.head_dim * dtype.itemsize
    fits = int(free * KV_MEMORY_SHARE) // per_slot - 1  # the megakernel keeps one scratch slot more
    return max(max_batch, min(MAX_DEFAULT_KV_SLOTS, fits))


def warm_up(decoder: Decoder, tokenizer: Tokenizer, sla_ms: float, sla_tokens: int,
            eos_ids: frozenset[int] = frozenset(), max_batch: int | None = None,
            max_rows: int | None = None, prefill_rows: int | None = None) -> dict[int, float]:
    """Short requests through the whole path (an engine of their own on the same decoder, run before the users'),
    so the first user pays no compilation or allocation: not even the grammar engine's view of the vocabulary,
    which took the first request with `tools` 0.4 s on the H100 (and so past its SLA: refused). They are admitted
    whatever the SLA (a strict SLA that no request can meet, on a CPU, must refuse users, not stop the server
    starting) and counted in no user's metrics and no latency model. Returns the median step it saw of each size
    (rows → seconds): what a calibrated step of as many rows or fewer far over is a stall (no_slower_than_seen)."""
    steps = _SeenSteps(sla_ms / 1e3)
    engine = Engine(decoder, tokenizer, admission=steps, metrics=Metrics(sla_tokens),
                    sla_ms=sla_ms, sla_tokens=sla_tokens, max_batch=max_batch, max_rows=max_rows,
                    prefill_rows=prefill_rows)
    engine.start()
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # a prefix long enough to be copied rather than prefilled
    shared = list(range(1, min(2 * COPY_MIN_TOKENS, decoder.max_context // 2) + 1))
    try:
        # a prompt, then one that branches off its cached tokens (their K/V copied into another slot, the rest
        # prefilled on top of them); then sampled requests with and without truncation: each path has kernels of
        # its own to load
        for prompt, params in ((shared, greedy), ([*shared[:-1], 0], greedy),
                               ([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)),
                               ([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=40,
                                                             ignore_eos=True))):
            for _ in engine.generate(prompt, params):
                pass
        constrained = _warm_constraint(tokenizer, eos_ids)
        if constrained is not None:
            for _ in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True,
                                                                  constraint=constrained)):
                pass
    finally:
        engine.stop()
    if decoder.device.type == "cuda" and max_rows is not None:
        # every step shape compiled and its graph captured now, though a calibration read from its cache times one
        run_every_step_shape(decoder, max(max_rows, prefill_rows or 0), max_batch or decoder.max_slots)
    return steps.medians()


class _SeenSteps(AdmitAll):
    """Admits everything (the warm-up's requests), and keeps the times of each step size it runs."""

    def __init__(self, sla_s: float) -> None:
        super().__init__(sla_s)
        self.seconds: dict[int, list[float]] = {}

    def consume(self, event: Event) -> None:
        if isinstance(event, StepDone) and event.seconds > 0 and not event.launched:
            self.seconds.setdefault(event.rows, []).append(event.seconds)

    def medians(self) -> dict[int, float]:
        return {rows: statistics.median(times) for rows, times in self.seconds.items()}


def _warm_constraint(tokenizer: Tokenizer, eos_ids: frozenset[int]) -> TokenConstraint | None:
    """A grammar compiled by the served model's grammar compiler (the one the API uses, built here), or None where
    this tokenizer cannot be constrained (such requests then get a 400, and the server still serves the rest)."""
    try:
        integers = json_rule({"type": "array", "items": {"type": "integer"}})
        return grammars(tokenizer, eos_ids).constraint(f"start: {integers}")
    except Exception as e:  # noqa: BLE001 - any failure here is a feature missing, not a server that cannot start
        log.warning("constrained decoding is unavailable for this model's tokenizer: %s", e)
        return None


class GcWatch:
    """The garbage collector, kept out of the way. What start-up allocated (torch, transformers, FastAPI, the
    model's Python objects: about a million objects) is frozen out of the collector's reach, so a full collection
    under load scans only what serving allocated; and every collection is timed (parley_gc_pause_seconds), since
    a pause holds the GIL and stalls every stream at once; one of 1 ms or more is a line in the admission log, where
    there is one, so that a step held up by it can be told from one held up by a handed-over task
    (bench.admission_trace). One per process: gc.callbacks is global."""

    SLOW_S = 0.02
    TRACE_S = 0.001

    def __init__(self) -> None:
        self.metrics: Metrics | None = None
        self.trace: AdmissionLog | None = None
        self._start = 0.0

    def install(self, metrics: Metrics, trace: AdmissionLog | None = None) -> None:
        gc.collect()
        gc.freeze()
        self.metrics, self.trace = metrics, trace
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
            atexit.register(self._uninstall)  # the collections of the exit itself stall nobody

    def _uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        if self.metrics is not None:
            self.metrics.gc_pause.labels(generation=str(info["generation"])).observe(pause)
        if self.trace is not None and pause >= self.TRACE_S:
            self.trace.record("gc", t=time.perf_counter(), generation=info["generation"], ms=pause * 1e3,
                              collected=info.get("collected", 0))
        if pause > self.SLOW_S:
            log.warning("garbage collection of generation %d took %.0f ms (%d objects freed)", info["generation"],
                        pause * 1e3, info.get("collected", 0))


GC_WATCH = GcWatch()
