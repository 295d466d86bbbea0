"""Start-up concerns of service/runtime.py that no request shows: the garbage collector kept out of the way, and the
warm-up."""

import gc

import pytest

from service.admission import AdmissionController
from service.backends.faults import FaultInjectingDecoder
from service.backends.reference import ReferenceDecoder
from service.engine.admission import Rejected
from service.engine.engine import Engine
from service.engine.grammar import grammars
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
    """Warm-up runs greedy, sampled and grammar-constrained requests through a whole engine on the server's decoder
    before users come, admitted whatever the SLA: a server whose strict SLA refuses every user still starts.
    Nothing of it reaches the users' engine."""
    model = load_model("synthetic:tiny")
    decoder = FaultInjectingDecoder(ReferenceDecoder(model.config, model.weights, max_slots=2, max_context=64))
    latency = LatencyModel({1: 1.0}, {16: 1.0}, max_batch=2)  # nothing meets 100 ms
    users = Engine(decoder, model.tokenizer, admission=AdmissionController(latency, 0.1, 64, 2, strict=True))
    with pytest.raises(Rejected):
        users.submit([1, 2, 3], SamplingParams(max_tokens=4), lambda d: None)
    eos = frozenset(model.config.eos_token_ids)
    warm_up(decoder, model.tokenizer, sla_ms=100.0, sla_tokens=64, eos_ids=eos)
    # four requests of four tokens (a prefill and three steps each), then one under a grammar, which may end early
    assert 12 + 2 <= decoder.steps <= 12 + 4
    # the grammar compiler the API uses has its view of the vocabulary already (0.4 s on the first request else)
    assert grammars(model.tokenizer, eos)._ll is not None
    assert latency.observed_steps == latency.observed_prefills == 0
    assert users.metrics.registry.get_sample_value("parley_generation_tokens_total") == 0


def test_kv_slots_default_to_what_the_memory_left_after_the_weights_holds(monkeypatch):
    """Unset --kv-slots: on a GPU, as many slots as half the free memory holds (each 2 x layers x kv_heads x context
    x head_dim values), at most 64 and never fewer than --max-batch; on the CPU, --max-batch."""
    import torch

    from service.model.synthetic import SHAPES
    from service.runtime import default_kv_slots

    llama = SHAPES["llama-3.2-1b"]
    per_slot = 2 * 16 * 8 * 8192 * 64 * 2  # 256 MiB in bf16
    assert default_kv_slots(llama, 8192, 8, "cpu", torch.float32) == 8
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (77 * 2**30, 80 * 2**30))
    assert default_kv_slots(llama, 8192, 8, "cuda", torch.bfloat16) == 64  # an H100 after the weights: the cap
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * 2**30, 80 * 2**30))
    assert default_kv_slots(llama, 8192, 4, "cuda", torch.bfloat16) == 2 * 2**30 // per_slot - 1  # one scratch slot
    assert default_kv_slots(llama, 8192, 16, "cuda", torch.bfloat16) == 16
