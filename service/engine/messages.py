"""What the engine process and its front end say to each other (`parley serve --engine-process`): msgspec structs,
encoded as MessagePack (ipc.py: over ZeroMQ to the engine, frame_socket.py back). Engine → front end is one message
per engine iteration (StepOutput: every request's delta of that iteration) or per request event (Verdict), never one
per token.

front end → engine: Hello (once, at its start), Submit, Cancel, CloseSession, Truncate, Query, Drain
engine → front end: Ready (per Hello, once warm), Verdict (per Submit), StepOutput (per iteration with output),
                    Status (a heartbeat every STATUS_EVERY_S), Answer (per Query)

With `--api-workers N` there are N front ends, numbered 0..N-1: front end i numbers its requests and queries i + 1,
i + 1 + N, i + 1 + 2N, ... (`front_end_of`), so every id names the front end its answers go back to and no message
carries it twice.

The engine detokenizes and applies stop strings, as the thread engine does (deltas carry text): the front end's work
per token is framing alone.
"""

from __future__ import annotations

import msgspec

STATUS_EVERY_S = 0.05  # the engine's heartbeat: what /health and the drain read


class Params(msgspec.Struct, array_like=True, frozen=True):
    """SamplingParams as they travel; a grammar travels as its Lark text and is compiled in the engine process."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    grammar: str | None = None
    opening: bool = False  # the grammar holds the reply's opening only (lifted once it accepts)
    detokenize: bool = True  # the engine turns ids into text (a request with stop strings: it must see them to stop);
    # else its deltas carry token ids alone and the front end detokenizes, off the engine thread (api/engine_client.py)


def first_id(front_end: int) -> int:
    """The first request (and query) id of a front end: then every `front_ends`-th."""
    return front_end + 1


def front_end_of(id_: int, front_ends: int) -> int:
    """The front end a request or query id belongs to."""
    return (id_ - 1) % front_ends


# -- front end → engine -----------------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front end has bound its socket and waits for Ready. One that restarted after a crash says so too: what the
    engine still runs for its predecessor (the same number) is cancelled, since nobody reads it."""

    front_end: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    rid: int  # unique across front ends: front_end_of(rid) is the one that sent it
    prompt_ids: list[int]
    params: Params
    arrival: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process of the host)
    session: str | None = None  # a realtime session's id: its turns share a pinned KV slot
    delivery_s: float = 0.0  # the front end's recent token delivery (api/delivery.py): admission leaves room for it


class Cancel(msgspec.Struct, tag=True, array_like=True):
    rid: int


class CloseSession(msgspec.Struct, tag=True, array_like=True):
    session: str


class Truncate(msgspec.Struct, tag=True, array_like=True):
    session: str
    keep_tokens: int


class Query(msgspec.Struct, tag=True, array_like=True):
    """A question the engine answers with an Answer: "metrics" (its Prometheus exposition), "latency_model" (JSON)."""

    qid: int
    what: str


class Drain(msgspec.Struct, tag=True, array_like=True):
    """Stop admitting (SIGTERM): what is admitted runs to its end."""


ToEngine = Hello | Submit | Cancel | CloseSession | Truncate | Query | Drain


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
    eos_token_ids: list[int]
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
    cached_tokens: int = 0  # admitted: the prompt tokens the prefix cache is expected to hold (a cancel's usage)


class Out(msgspec.Struct, array_like=True):
    """One request's delta of one iteration (engine.request.Delta); the last one has finish_reason, usage, timings."""

    rid: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    usage: tuple[int, int, int] | None = None  # prompt, completion, cached tokens
    timings: tuple[float | None, float | None, float | None, float | None, float | None, int] | None = None


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    outs: list[Out]
    sent: float | None = None  # time.perf_counter() in the engine process when sent (monotonic across the host)


class Status(msgspec.Struct, tag=True, array_like=True):
    running: int
    waiting: int
    accepting: bool
    healthy: bool


class Answer(msgspec.Struct, tag=True, array_like=True):
    qid: int
    body: bytes


ToFrontEnd = Ready | Verdict | StepOutput | Status | Answer
