"""Start-up concerns of service/runtime.py that no request shows: the garbage collector kept out of the way, and the
warm-up."""

import gc

import pytest

from service.admission import AdmissionController
from service.backends.faults import FaultInjectingDecoder
from service.backends.reference import ReferenceDecoder
from service.engine.admission import Rejected
from service.engine.engine import Engine
from service.engine.request import SamplingParams
from service.latency_model import LatencyModel
from service.metrics import Metrics
from service.model.loader import load_model
from service.runtime import GcWatch, warm_up


def test_startup_heap_is_frozen_and_collections_are_timed():
    """After install, what start-up allocated is out of the collector's reach (a full collection then scans only
    what serving allocates: ~0.2 ms instead of ~100 ms with torch and transformers loaded), and each collection
    lands in parley_gc_pause_seconds."""
    import torch  # noqa: F401  # the heap a server has
    watch, metrics = GcWatch(), Metrics()
    try:
        watch.install(metrics)
        assert gc.get_freeze_count() > 10_000
        garbage = [[i] for i in range(1000)]
        garbage.append(garbage)  # a cycle: only the collector frees it
        del garbage
        gc.collect()
        count = metrics.registry.get_sample_value("parley_gc_pause_seconds_count", {"generation": "2"})
        assert count is not None and count >= 1
    finally:
        gc.callbacks.remove(watch._callback)
        gc.unfreeze()


def test_warm_up_runs_its_own_requests_whatever_the_sla():
    """Warm-up runs greedy and sampled requests through a whole engine on the server's decoder before users come,
    admitted whatever the SLA: a server whose strict SLA refuses every user still starts. Nothing of it reaches
    the users' engine."""
    model = load_model("synthetic:tiny")
    decoder = FaultInjectingDecoder(ReferenceDecoder(model.config, model.weights, max_slots=2, max_context=64))
    latency = LatencyModel({1: 1.0}, {16: 1.0}, max_batch=2)  # nothing meets 100 ms
    users = Engine(decoder, model.tokenizer, admission=AdmissionController(latency, 0.1, 64, 2, strict=True))
    with pytest.raises(Rejected):
        users.submit([1, 2, 3], SamplingParams(max_tokens=4), lambda d: None)
    warm_up(decoder, model.tokenizer, sla_ms=100.0, sla_tokens=64)
    assert decoder.steps == 9  # three requests of four tokens: a prefill and three steps each
    assert latency.observed_steps == latency.observed_prefills == 0
    assert users.metrics.registry.get_sample_value("parley_generation_tokens_total") == 0
