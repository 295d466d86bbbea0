"""Start-up concerns of service/runtime.py that no request shows: the garbage collector kept out of the way, the
warm-up, and the latency calibration read from its cache on a restart."""

import gc
import logging
import math
import time
from pathlib import Path

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
    latency = LatencyModel({1: 1.0}, {16: 1.0}, max_rows=2)  # nothing meets 100 ms
    users = Engine(decoder, model.tokenizer, admission=AdmissionController(latency, 0.1, 64, 2, strict=True))
    with pytest.raises(Rejected):
        users.submit([1, 2, 3], SamplingParams(max_tokens=4), lambda d: None)
    eos = frozenset(model.config.eos_token_ids)
    warm_up(decoder, model.tokenizer, sla_ms=100.0, sla_tokens=64, eos_ids=eos)
    # four requests of four tokens (four steps each: the prompt rides in the step that samples the first; a step or
    # two more where a prompt is longer than a step's token budget), then one under a grammar, which may end early
    assert 16 + 2 <= decoder.steps <= 16 + 2 + 4
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


def test_a_restart_reads_the_calibration_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture):
    """The first build measures the latency model and caches it under --calibration-cache; a second build of the same
    configuration reads it, timing two one-row steps instead of the sweep, and admits with the same model; a build
    whose key changed (--max-batch) measures again; a corrupt cache is ignored with a warning and measured over."""
    import service.calibration
    import service.runtime
    from service.calibration import calibrated, plan
    from service.config import ServeConfig
    from service.runtime import build_engine

    launches: list[int] = []  # the decoder's steps and prefills during each build's calibration

    class Counted:
        def __init__(self, inner) -> None:
            self.inner, self.launches = inner, 0

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def decode(self, *args, **kwargs):
            self.launches += 1
            return self.inner.decode(*args, **kwargs)

        def prefill(self, *args, **kwargs):
            self.launches += 1
            return self.inner.prefill(*args, **kwargs)

    def counted(decoder, *args, **kwargs):
        counter = Counted(decoder)
        try:
            return calibrated(counter, *args, **kwargs)
        finally:
            launches.append(counter.launches)

    monkeypatch.setattr(service.runtime, "calibrated", counted)
    # however busy the host while the test runs, the one-row step it checks the cache with agrees with the cache
    monkeypatch.setattr(service.calibration, "SANITY", math.inf)

    def build(**settings) -> dict:
        # a budget that a busy host cannot cut short: every point gets its three tries
        cfg = ServeConfig(**{"model": "synthetic:tiny", "device": "cpu", "max_batch": 4, "max_rows": 16,
                             "max_context": 256, "calibration_budget_s": 600, "calibration_cache": str(tmp_path),
                             **settings})
        rt = build_engine(cfg)
        rt.engine.stop()
        return rt.latency.snapshot()

    with caplog.at_level(logging.INFO, logger="parley"):
        first = build()
        assert "calibration read from" not in caplog.text and len(list(tmp_path.glob("*.json"))) == 1
        caplog.clear()
        assert build() == first
        assert "calibration read from" in caplog.text
        sweep = len(plan(256, 16, 4, None))  # every point's three tries
        assert launches[1] == 2 and launches[0] == sweep  # two one-row steps against the sweep
        caplog.clear()
        build(max_batch=2)
        assert "calibration read from" not in caplog.text and len(list(tmp_path.glob("*.json"))) == 2
        assert launches[2] == len(plan(256, 16, 2, None))
        caplog.clear()
        cache = sorted(tmp_path.glob("*.json"), key=lambda p: p.stat().st_mtime)[0]
        cache.write_text("{not json")
        build()
        assert "ignoring the calibration cache" in caplog.text and launches[3] == sweep


def test_no_calibration_cache_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from service.config import ServeConfig
    from service.runtime import build_engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PARLEY_CALIBRATION_CACHE", raising=False)  # tests/conftest.py turns it off for servers
    rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_context=128,
                                  calibration_cache="off"))
    rt.engine.stop()
    assert not list(tmp_path.rglob("*.json"))
    rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_context=128))
    rt.engine.stop()
    assert len(list((tmp_path / "parley" / "calibration").glob("*.json"))) == 1  # the default: under XDG_CACHE_HOME


def test_the_cpu_engine_computes_with_the_threads_it_was_given_and_calibrates_with_them(tmp_path: Path):
    """--cpu-threads sets the threads the warm-up, the calibration and the steps run with, and the calibration's
    cache keeps the timings of each count apart: a restart with another count measures its own."""
    import torch

    from service.config import ServeConfig
    from service.runtime import build_engine

    for threads in (1, 2):
        rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_context=128,
                                      cpu_threads=threads, calibration_cache=str(tmp_path)))
        rt.engine.stop()
        assert torch.get_num_threads() == threads
    cached = sorted(p.read_text() for p in tmp_path.rglob("*.json"))
    assert len(cached) == 2
    assert any("(1 threads)" in text for text in cached) and any("(2 threads)" in text for text in cached)


def test_a_prompt_only_step_is_as_wide_as_prefill_rows_and_calibrated_up_to_it(tmp_path: Path):
    """--prefill-rows reaches the engine's planner (its budget where a step has no decode row; --max-rows beside
    them) and the calibration, which times steps up to that width, so admission forecasts what the planner does."""
    from service.config import ServeConfig
    from service.runtime import build_engine

    rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_rows=4, prefill_rows=16,
                                  max_context=128, calibration_cache=str(tmp_path), handoff_budget_ms=0.7))
    try:
        assert rt.engine.handoff_budget_s == pytest.approx(0.0007)  # --handoff-budget-ms reaches the engine too
        planner = rt.engine.planner
        assert (planner.max_rows, planner.prefill_rows) == (4, 16)
        assert planner.budget(decoding=True) == 4 and planner.budget(decoding=False) == 16
        assert rt.latency.max_rows == 16 and rt.latency.step(16) >= rt.latency.step(4)
        steps = rt.latency.snapshot()["step_ms"]
        assert max(int(rows) for rows in steps) == 16, steps
        out = list(rt.engine.generate(list(range(1, 13)), SamplingParams(max_tokens=3, ignore_eos=True)))
        assert sum(len(d.token_ids) for d in out) == 3
    finally:
        rt.engine.stop()


def test_process_age_is_what_start_up_has_taken_so_far():
    from service.runtime import process_age_s

    age = process_age_s()
    time.sleep(0.05)
    assert 0.0 < age < process_age_s() < 24 * 3600


def test_a_restart_starts_admission_from_what_the_guard_learned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Beside the calibration's cache the guard's scores outlive the process: a build registers their writing at exit
    and reads what the last run of the same server left, so a restarted server stretches forecasts as it had learned
    to, not by the prior; --no-guard-memory (or no calibration cache) leaves every start fresh."""
    import service.runtime
    from service.admission_guard import PRIOR_LOADED, Level
    from service.config import ServeConfig
    from service.runtime import build_engine

    at_exit: list = []
    monkeypatch.setattr(service.runtime.atexit, "register", lambda fn, *args: at_exit.append((fn, args)))
    busy = Level(2, 1)

    def build(**settings):
        cfg = ServeConfig(**{"model": "synthetic:tiny", "device": "cpu", "max_batch": 4, "max_rows": 16,
                             "max_context": 256, "calibration_budget_s": 1, "calibration_cache": str(tmp_path),
                             **settings})
        rt = build_engine(cfg)
        rt.engine.stop()
        return rt

    first = build()
    assert first.admission.guard.stretch(busy) == PRIOR_LOADED
    for _ in range(first.admission.guard.enough):
        first.admission.guard.observe(busy, 1.02, 1.0)
    [(save, args)] = at_exit
    save(*args)  # the clean exit
    assert len(list(tmp_path.glob("*.guard.json"))) == 1
    second = build()
    assert second.admission.guard.stretch(busy) == pytest.approx(1.02)
    assert second.admission.guard.scores() == first.admission.guard.scores()
    at_exit.clear()
    fresh = build(guard_memory=False)
    assert fresh.admission.guard.stretch(busy) == PRIOR_LOADED and not at_exit
    # a server judged against another SLA (the benchmarks' admission off) neither reads nor overwrites that memory
    other_sla = build(sla_ms=100000)
    assert other_sla.admission.guard.stretch(busy) == PRIOR_LOADED
    for _ in range(other_sla.admission.guard.enough):
        other_sla.admission.guard.observe(busy, 1.5, 1.0)
    [(save, args)] = at_exit
    save(*args)
    assert len(list(tmp_path.glob("*.guard.json"))) == 2
    assert build().admission.guard.stretch(busy) == pytest.approx(1.02)
    at_exit.clear()
    # --no-admission: no forecast, so nothing scored to keep; and it leaves the admitting server's memory alone
    off = build(admission=False)
    assert not off.admission.forecasts and not at_exit
    assert off.latency_model()["admission"] is False and build().latency_model()["admission"] is True
