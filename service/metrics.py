"""Prometheus metrics, prefix `parley_`, named after vLLM's habits. Every latency histogram has a bucket edge at
exactly 0.1 s, the SLA line, so that "share of requests under 100 ms" is one bucket read, not an interpolation.

Each Metrics object owns its registry, so that several engines (tests) never collide on names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# here, not in consume(): imported there, they cost ~2 µs an event (~40 µs an iteration of 16 streams)
from service.engine.commit import Event, Finished, Started, StepDone, Token
from service.engine.request import outcome_of

if TYPE_CHECKING:
    from service.admission_guard import AdmissionGuard

# 0.1 is an edge on purpose; dense around it.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                 0.2, 0.5, 1.0)
STEP_BUCKETS = (0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.0025,
                0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5)  # quarter milliseconds about a GPU step's ~1 ms
# A GPU step's own time: 50 us apart from 0.5 to 1.5 ms (an 8-bit or bf16 step of 1-16 rows), where a step's time is
# read against the inter-token time (#37: inter-token p99 <= 1.1 x the step); quarter milliseconds would put FP8's
# 0.76 ms and bf16's 1.09 ms steps inside one bucket each
STEP_GPU_BUCKETS = tuple(sorted({*STEP_BUCKETS, *(round(0.0005 + 0.00005 * i, 5) for i in range(21))}))
# The engine loop (service/engine/loop_clock.py): tens of microseconds matter beside a ~1 ms step; 50 us is issue 37's
# target for the GPU's idle time between steps, 0.15 ms the host's per iteration.
LOOP_BUCKETS = (0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005,
                0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1)

OUTCOMES = ("completed", "cancelled", "rejected", "failed")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, sla_tokens: int = 64, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.info = Gauge("parley_info", "The model, backend, device and weight format this server runs (value 1)",
                          ["model", "backend", "device", "weights"], registry=r)
        self.time_to_first_token = Histogram(
            "parley_time_to_first_token_seconds", "Arrival to first generated token", buckets=LATENCY_BUCKETS,
            registry=r)
        self.time_to_nth_token = Histogram(
            "parley_time_to_nth_token_seconds", f"Arrival to the SLA's token (the {sla_tokens}th)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "parley_inter_token_latency_seconds", "Time between two tokens of one request", buckets=TOKEN_BUCKETS,
            registry=r)
        self.e2e_latency = Histogram(
            "parley_e2e_request_latency_seconds", "Arrival to the last token", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "parley_request_queue_time_seconds", "Arrival to the start of prefill", buckets=LATENCY_BUCKETS,
            registry=r)
        self.prefill_time = Histogram(
            "parley_request_prefill_time_seconds", "Prefill of one request", buckets=LATENCY_BUCKETS, registry=r)
        self.decode_step = Histogram(
            "parley_decode_step_seconds", "One decode step of the whole running batch", ["batch_size"],
            buckets=STEP_BUCKETS, registry=r)
        self._decode_step_by: dict[int, Histogram] = {}  # sampled rows → decode_step's series of that batch_size
        self.engine_host = Histogram(
            "parley_engine_host_seconds", "One engine iteration's time not blocked on the device (plan, launch, "
            "commit, publish, gauges): what the host adds between two steps", buckets=LOOP_BUCKETS, registry=r)
        self.verdict_after = Histogram(
            "parley_admission_verdict_seconds", "From a request's arrival (the SLA clock's start) to admission's "
            "verdict: the budget the front end (body, template, tokenizer) and the forecast spent before it was "
            "admitted or refused", buckets=LOOP_BUCKETS, registry=r)
        self.received_after = Histogram(
            "parley_engine_received_seconds", "From a request's arrival to the engine's receiving it (the client's "
            "send where it stamped the arrival, the front end's body, template and tokenizer, the hop to the engine "
            "process): the first part of parley_admission_verdict_seconds", buckets=LOOP_BUCKETS, registry=r)
        self.forecast_time = Histogram(
            "parley_admission_forecast_seconds", "Admission's own time for one verdict (the forecast); the rest of "
            "parley_admission_verdict_seconds after parley_engine_received_seconds is the wait for the engine "
            "thread to take the request", buckets=LOOP_BUCKETS, registry=r)
        self.gpu_idle: Histogram | None = None  # only where a GPU is measured (track_gpu_idle): absent, not zeros
        self.idle_gaps: Counter | None = None  # with gpu_idle
        self.idle_gap_seconds: Counter | None = None
        self.step_gpu: Histogram | None = None  # the same
        self.gc_pause = Histogram(
            "parley_gc_pause_seconds", "Python garbage-collector pauses: every stream stalls during one",
            ["generation"], buckets=STEP_BUCKETS, registry=r)
        self.requests = Counter(
            "parley_requests", "Requests by outcome (completed, cancelled, rejected, failed) and reason",
            ["outcome", "reason"], registry=r)
        self.sla_violations = Counter(
            "parley_sla_violations", "Admitted requests whose SLA token came after the deadline", registry=r)
        self.sla_checked = Counter(
            "parley_sla_checked", "Admitted requests that reached the SLA token or finished before it", registry=r)
        self.prompt_tokens = Counter("parley_prompt_tokens", "Prompt tokens received", registry=r)
        self.prefilled_tokens = Counter(
            "parley_prefilled_tokens", "Prompt tokens actually prefilled (the rest came from the prefix cache)",
            registry=r)
        self.prefix_cache_queries = Counter(
            "parley_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (each request's, as it starts)",
            registry=r)
        self.prefix_cache_hits = Counter(
            "parley_prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache (not prefilled)",
            registry=r)
        self.generation_tokens = Counter("parley_generation_tokens", "Tokens generated", registry=r)
        self.prefill_slow_path = Counter(
            "parley_prefill_slow_path", "Prefills on a GPU that could not replay a captured graph (eager: slow)",
            registry=r)
        self.query_block_steps = Counter(
            "parley_query_block_steps", "Decode steps run in the megakernel's query-blocks launch: every row a "
            "prompt's, over a long conversation, each block of rows reading its K/V once (--query-blocks)",
            registry=r)
        self.grammar_mask_waits = Counter(
            "parley_grammar_mask_waits", "Constrained tokens whose grammar mask (computed off the engine thread) was "
            "not ready when their step was launched: the engine thread waited for it", registry=r)
        self.running = Gauge("parley_requests_running", "Requests holding a KV slot and decoding", registry=r)
        self.waiting = Gauge("parley_requests_waiting", "Admitted requests waiting for a slot", registry=r)
        self.kv_slots_free = Gauge(
            "parley_kv_slots_free", "KV-cache slots no running request holds (empty, or caching an idle "
            "conversation that a new request may evict)", registry=r)
        self.kv_slots_cached = Gauge(
            "parley_kv_slots_cached", "KV-cache slots caching an idle conversation's K/V (a later request that "
            "extends it prefills only what follows)", registry=r)
        self.kv_slots_total = Gauge("parley_kv_slots_total", "KV-cache slots in all (--kv-slots)", registry=r)
        # What a router or the Gateway API endpoint picker reads as KV-cache use (vLLM's kv_cache_usage_perc). KV
        # memory is reserved a slot at a time (--max-context positions each), so the share of slots is the share of
        # KV memory that running requests hold; slots caching an idle conversation count as free, as vLLM counts
        # cached blocks no request holds. Derived from the slot gauges: whoever sets those keeps this right.
        self.kv_cache_usage = Gauge(
            "parley_kv_cache_usage_perc", "Share (0-1) of KV-cache slots held by running requests",
            registry=r)
        self.kv_cache_usage.set_function(self._kv_cache_usage)
        self.sla_headroom = Gauge(
            "parley_sla_headroom_seconds",
            "Smallest predicted slack to its deadline among running requests (the SLA itself when idle)",
            registry=r)
        self.sla_seconds = Gauge("parley_sla_seconds", "The SLA deadline for the SLA token", registry=r)
        self.sla_tokens = Gauge("parley_sla_tokens", "Which token the SLA is about", registry=r)
        self.gpu_hourly_usd = Gauge("parley_gpu_hourly_usd", "Configured price of this replica's GPU per hour",
                                    registry=r)
        self.sla_tokens.set(sla_tokens)
        for outcome in OUTCOMES:  # so that rate() has a series from the start
            self.requests.labels(outcome=outcome, reason="")

    def track_gpu_idle(self) -> Histogram:
        """parley_gpu_idle_seconds (and parley_step_gpu_seconds beside it), created on first call: only an engine on a
        CUDA device measures them."""
        if self.gpu_idle is None:
            self.gpu_idle = Histogram(
                "parley_gpu_idle_seconds", "The GPU's idle time between two consecutive steps (the next launched "
                "before the last was read), timed by CUDA events on the step's stream", buckets=LOOP_BUCKETS,
                registry=self.registry)
            self.step_gpu = Histogram(
                "parley_step_gpu_seconds", "One engine step's time on the GPU (its prefix copies, prefills and decode, "
                "from its first launch to its last as CUDA events on the step's stream timed them)",
                buckets=STEP_GPU_BUCKETS, registry=self.registry)
            self.idle_gaps = Counter(
                "parley_gpu_idle_gaps", "Gaps over 100 us the GPU waited through before a step, by the phase of the "
                "engine thread's path to that step the gap overlapped most (service/engine/host_path.py)", ["after"],
                registry=self.registry)
            self.idle_gap_seconds = Counter(
                "parley_gpu_idle_gap_seconds", "The seconds of those gaps, split among the phases they overlapped",
                ["after"], registry=self.registry)
        return self.gpu_idle

    def export_guard(self, guard: AdmissionGuard) -> None:
        """The admission guard's state, read at every scrape: its stretch per load level and how often it erred."""
        self.registry.register(_GuardCollector(guard))

    def consume(self, event: Event) -> None:
        """What a step committed (service/engine/commit.py), into the series above."""
        if isinstance(event, Token):  # most events, one a token: tested first
            self._token(event)
            return
        if isinstance(event, StepDone):
            if event.seconds > 0:
                # by the requests it served a token (its rows, prompt tokens included, are in the latency model);
                # each size's series kept, not looked up by its label every step
                series = self._decode_step_by.get(event.sampled)
                if series is None:
                    series = self._decode_step_by[event.sampled] = self.decode_step.labels(
                        batch_size=str(event.sampled))
                series.observe(event.seconds)
            return
        req = event.req
        if isinstance(event, Started):
            self.queue_time.observe(max(0.0, (req.prefill_start or event.at) - req.arrival))
            self.prefix_cache_queries.inc(len(req.prompt_ids))
            self.prefix_cache_hits.inc(event.cached)
            self.prefilled_tokens.inc(len(req.prompt_ids) - event.cached)
            return
        if event.token is not None:  # the last token, with its Finished
            self._token(event)
        if isinstance(event, Finished):
            outcome = outcome_of(event.reason)
            self.requests.labels(outcome=outcome, reason="" if outcome != "failed" else "engine_error").inc()
            self.e2e_latency.observe(event.at - req.arrival)
            if event.reason in ("stop", "length") and event.n < req.sla_token_index:
                self._check_sla(req.deadline, event.at)  # ended before the SLA token: the SLA was about its last

    def _token(self, event: Token | Finished) -> None:
        """A token: counted, its time since arrival (the first, the SLA token's) or since the last one."""
        req = event.req
        self.generation_tokens.inc()
        if event.n == 1:
            self.time_to_first_token.observe(event.at - req.arrival)
            if req.prefill_start is not None:
                self.prefill_time.observe(event.at - req.prefill_start)
        elif event.gap is not None:
            self.inter_token_latency.observe(event.gap)
        if event.n == req.sla_token_index:
            self.time_to_nth_token.observe(event.at - req.arrival)
            self._check_sla(req.deadline, event.at)

    def _check_sla(self, deadline: float | None, at: float) -> None:
        if deadline is not None:
            self.sla_checked.inc()
            if at > deadline:
                self.sla_violations.inc()

    def _kv_cache_usage(self) -> float:
        total = _value(self.kv_slots_total)
        return 0.0 if total <= 0 else min(1.0, max(0.0, 1.0 - _value(self.kv_slots_free) / total))

    def render(self) -> bytes:
        return generate_latest(self.registry)


API_KEY_REFUSAL_REASONS = ("missing", "invalid")
TRANSPORTS = ("http", "websocket")


class FrontEndMetrics:
    """What the HTTP front end counts itself: callers refused for their API key (service/api/auth.py), before a
    request reaches the engine; and how late the engine's tokens reach its event loop. A registry of its own,
    rendered after the engine's on /metrics, so that these stay the front end's wherever the engine runs."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.api_key_refusals = Counter(
            "parley_api_key_refusals", "Requests and WebSocket handshakes refused with 401 before any work, by "
            "reason (missing: no key sent; invalid: a key that is not one of the server's) and transport (http, "
            "websocket)", ["reason", "transport"], registry=r)
        for reason in API_KEY_REFUSAL_REASONS:  # so that rate() has a series from the start
            for transport in TRANSPORTS:
                self.api_key_refusals.labels(reason=reason, transport=transport)
        self.token_delivery = Histogram(
            "parley_token_delivery_seconds", "From the engine publishing a request's tokens (its step committed) to "
            "the front end's event loop reading them for the SSE or WebSocket reply: a busy event loop, a GIL held "
            "elsewhere or the hop between processes, seen per delta", buckets=LOOP_BUCKETS, registry=r)
        self.token_hop = Histogram(
            "parley_token_hop_seconds", "From the engine publishing a step's tokens to this front end's reader taking "
            "them off the engine's socket (the hop between processes, once a message): the first part of "
            "parley_token_delivery_seconds; the rest is this event loop's turns to the reply", buckets=LOOP_BUCKETS,
            registry=r)
        self.request_transit = Histogram(
            "parley_request_transit_seconds", "From the send time a request's x-request-start header gives to this "
            "server's first sight of it (the client's own send, a proxy, a router's retries): the first part of "
            "parley_engine_received_seconds; requests without the header are not counted", buckets=LOOP_BUCKETS,
            registry=r)
        self.loop_lag = Histogram(
            "parley_front_end_loop_lag_seconds", "How late the front end's event loop woke a task that asked to sleep "
            "5 ms: time in which no request was read and no token written, for every stream at once",
            buckets=(*LOOP_BUCKETS, 0.25, 0.5, 1.0), registry=r)

    def render(self) -> bytes:
        """This front end's series; with several front ends (`--api-workers`, which set PROMETHEUS_MULTIPROC_DIR for
        them), every front end's, summed (prometheus_client's multiprocess mode)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class _GuardCollector(Collector):
    """service/admission_guard.py's state as gauges, computed when scraped (a level appears once it has scores)."""

    def __init__(self, guard: AdmissionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        target = GaugeMetricFamily(
            "parley_admission_guard_target", "The share of admitted requests that must reach the SLA token in time "
            "(--sla-target)")
        target.add_metric([], self.guard.target)
        quantile = GaugeMetricFamily(
            "parley_admission_guard_quantile", "The factor admission stretches forecasts by at this load level: the "
            "target quantile of actual / forecast time to the SLA token of admitted requests",
            labels=["in_flight", "prompt"])
        scores = GaugeMetricFamily(
            "parley_admission_guard_scores", "Admitted requests of this load level whose actual / forecast time the "
            "quantile is taken over (fewer than the target needs: it borrows from other levels and a prior)",
            labels=["in_flight", "prompt"])
        median = GaugeMetricFamily(
            "parley_admission_guard_median", "The median actual / forecast time to the SLA token of this load level's "
            "admitted requests: under 1, forecasts that run pessimistic (requests refused that would have been on "
            "time), over 1 optimistic; the quantile is its tail", labels=["in_flight", "prompt"])
        for state in self.guard.levels():
            labels = [state.level.labels["in_flight"], state.level.labels["prompt"]]
            quantile.add_metric(labels, state.stretch)
            scores.add_metric(labels, state.scores)
            if state.median is not None:
                median.add_metric(labels, state.median)
        late, exceeded = self.guard.miss_rate()
        miss = GaugeMetricFamily("parley_admission_guard_miss_rate",
                                 "Share of admitted requests late to their SLA token over the last minute")
        miss.add_metric([], late)
        over = GaugeMetricFamily(
            "parley_admission_guard_exceeded_rate", "Share of admitted requests over the last minute whose actual / "
            "forecast time exceeded the stretch they were admitted with (what the target bounds)")
        over.add_metric([], exceeded)
        yield from (target, quantile, scores, median, miss, over)


def _value(gauge: Gauge) -> float:
    """An unlabelled gauge's current value, through the public collect()."""
    (family,) = gauge.collect()
    return family.samples[0].value
