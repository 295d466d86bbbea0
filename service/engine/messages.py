"""What the engine process and its front ends say to each other: msgspec structs, encoded as MessagePack (ipc.py
carries them over ZeroMQ). The engine sends token ids and events, never text: front ends detokenize and apply stop
strings. Each way, one message per engine iteration (StepOutput) or per request event (Submit, Verdict), never one
per token.

front end → engine: Submit, Cancel, CloseSession, Truncate, Query, Drain
engine → front end: Ready (once), Verdict (per Submit), StepOutput (per iteration with output), Status (a heartbeat
                    every STATUS_EVERY_S), Answer (per Query)
"""

from __future__ import annotations

import msgspec

STATUS_EVERY_S = 0.05  # the engine's heartbeat: what /health and the drain read


class Params(msgspec.Struct, array_like=True, frozen=True):
    """SamplingParams less what stays in the front end (stop strings); a grammar travels as its Lark text and is
    compiled in the engine process."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    grammar: str | None = None


# -- front end → engine -----------------------------------------------------------------------------------------------
class Submit(msgspec.Struct, tag=True, array_like=True):
    fe: int  # the front end: where the request's output goes
    rid: int  # its id, unique within the front end
    prompt_ids: list[int]
    params: Params
    arrival: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process of the host)
    session: str | None = None  # a realtime session's id: its turns share a pinned KV slot


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """End a request before its next step: "cancelled" (a client gone, a barge-in), or "stop" (the front end read a
    stop string: it ends as completed)."""

    fe: int
    rid: int
    reason: str = "cancelled"


class CloseSession(msgspec.Struct, tag=True, array_like=True):
    fe: int
    session: str


class Truncate(msgspec.Struct, tag=True, array_like=True):
    fe: int
    session: str
    keep_tokens: int


class Query(msgspec.Struct, tag=True, array_like=True):
    """A question the engine answers with an Answer: "metrics" (its Prometheus exposition), "latency_model" (JSON)."""

    fe: int
    qid: int
    what: str


class Drain(msgspec.Struct, tag=True, array_like=True):
    """Stop admitting (SIGTERM): what is admitted runs to its end."""


ToEngine = Submit | Cancel | CloseSession | Truncate | Query | Drain


# -- engine → front end -----------------------------------------------------------------------------------------------
class EngineInfo(msgspec.Struct, frozen=True):
    """What a front end needs of the served model, sent once: the tokenizer (Hugging Face's tokenizer.json and the
    chat template) and the limits requests are checked against."""

    model_id: str
    backend: str
    device: str
    pid: int
    max_context: int
    vocab_size: int
    sla_tokens: int
    max_batch: int
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    extra_tokens: list[str]


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Verdict(msgspec.Struct, tag=True, array_like=True):
    """Admission's answer to a Submit. `status` 0: admitted; else the HTTP status of the refusal (429, 503) or 400
    (`reason` "invalid": a prompt the engine cannot take; "grammar": a grammar that does not compile)."""

    rid: int
    status: int = 0
    reason: str = ""
    message: str = ""
    retry_after_s: float = 0.0


class Finish(msgspec.Struct, array_like=True):
    """A request ended: stop | length (with its last token) | cancelled | error; its usage and timings."""

    rid: int
    reason: str
    token: int | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_ms: float | None
    prefill_ms: float | None
    ttft_ms: float | None
    ttfn_ms: float | None
    e2e_ms: float | None
    n: int


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    """One engine iteration's output for one front end: token `tokens[i]` for request `rids[i]`, in order, then the
    requests that ended."""

    rids: list[int]
    tokens: list[int]
    finished: list[Finish]


class Status(msgspec.Struct, tag=True, array_like=True):
    running: int
    waiting: int
    free_slots: int
    total_slots: int
    cached_slots: int
    accepting: bool
    healthy: bool


class Answer(msgspec.Struct, tag=True, array_like=True):
    qid: int
    body: bytes


ToFrontEnd = Ready | Verdict | StepOutput | Status | Answer
