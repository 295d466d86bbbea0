"""build_engine: from a ServeConfig to a loaded, warm, calibrated engine. What `parley serve` runs at start-up."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from service.admission import AdmissionController
from service.backends import make_decoder, resolve_backend
from service.backends.faults import FaultInjectingDecoder
from service.config import ServeConfig
from service.engine.engine import Admission, Engine
from service.engine.request import SamplingParams
from service.latency_model import LatencyModel, calibrate
from service.metrics import Metrics
from service.model.loader import Model, load_model

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


def build_engine(cfg: ServeConfig) -> Runtime:
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(cfg.backend)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = load_model(cfg.model, device=device, dtype=dtype)
    log.info("loaded %s (%s) in %.1f s", cfg.model, model.config.name, time.perf_counter() - t0)
    max_context = min(cfg.max_context, model.config.max_position_embeddings)
    decoder = make_decoder(backend, model.config, model.weights, cfg.max_batch, max_context, device)
    faults = None
    if cfg.step_delay_ms or cfg.fail_step or cfg.hang_step:
        # The delay applies from the start (calibration must see it); --fail-step/--hang-step count the steps of
        # users' requests only, from when the server is warm.
        decoder = faults = FaultInjectingDecoder(decoder, cfg.step_delay_ms / 1e3, cfg.fail_step, cfg.hang_step)
        faults.armed = False
    t0 = time.perf_counter()
    latency = calibrate(decoder)
    log.info("latency model measured in %.1f s: %s", time.perf_counter() - t0, latency.snapshot())
    admission = AdmissionController(latency, cfg.sla_ms / 1e3, cfg.sla_tokens, decoder.max_slots,
                                    strict=cfg.strict_sla)
    metrics = Metrics(cfg.sla_tokens)
    metrics.info.labels(model=cfg.model, backend=backend, device=device).set(1)
    metrics.gpu_hourly_usd.set(cfg.gpu_hourly_usd)
    engine = Engine(decoder, model.tokenizer, model.config.eos_token_ids, metrics=metrics,
                    admission=admission, sla_ms=cfg.sla_ms, sla_tokens=cfg.sla_tokens,
                    max_waiting=cfg.max_waiting, wedge_timeout_s=cfg.wedge_timeout_s)
    engine.start()
    warm_up(engine)
    if faults is not None:
        faults.steps, faults.armed = 0, True
    return Runtime(cfg, model, engine, backend, device, model_id=cfg.model, latency=latency, admission=admission)


def warm_up(engine: Engine) -> None:
    """One short request through the whole path, so the first user pays no compilation or allocation. It bypasses
    admission: a strict SLA that no request can meet (a CPU) must refuse users, not stop the server starting."""
    admission, engine.admission = engine.admission, Admission(engine.sla_s)
    metrics, engine.metrics = engine.metrics, Metrics(engine.sla_tokens)  # users' metrics start at zero
    try:
        for _ in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            pass
    finally:
        engine.admission, engine.metrics = admission, metrics
