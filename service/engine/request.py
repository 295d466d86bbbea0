"""A request's life in the engine: its parameters, its state, and what it streams back (Delta)."""

from __future__ import annotations

import enum
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.constraint import TokenConstraint
from service.engine.output import TextOutput


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # A grammar for this request alone (it keeps the grammar's state): the Request takes it as its `constraint`.
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (not prefilled)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    queue_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    ttfn_ms: float | None = None  # time to token n (the last one, for requests of fewer tokens)
    e2e_ms: float | None = None
    n: int = 64  # the N of ttfn_ms: --sla-tokens


@dataclass
class Delta:
    """What one step produced for one request. The last one has `finish_reason` and `usage`."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


def outcome_of(finish_reason: str | None) -> str:
    """How a request ended, as metrics and the realtime API's `status` name it: completed, cancelled or failed."""
    return {"stop": "completed", "length": "completed", "cancelled": "cancelled"}.get(finish_reason or "", "failed")


class Choice(enum.Enum):
    """How a request's tokens are chosen from its sampled rows (sampler.choice_of decides, once)."""

    STEP = "step"  # the step's own output: its argmax, or drawn inside the step (Decoder.draws_tokens)
    DEVICE = "device"  # sampled from its row's logits on the device (top-k, top-p, a seed the decoder cannot draw)
    HOST = "host"  # needs its last token on the host first (a grammar advances with each): never fed from the device


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Delta], None]  # called on the engine thread; must not block
    output: TextOutput | None  # ids → text and stop strings; None where the front end detokenizes (token ids only)
    session: object | None = None  # a kv_slots.Session
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # when the SLA token must be out (set by admission)
    delivery_s: float = 0.0  # how long its tokens take from the engine to the front end lately (measured there)
    sla_tokens: int = 64
    state: State = State.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    prompt_blocks: list[int] = field(default_factory=list)  # prefix_cache.block_hashes of the prompt
    cached_tokens: int = 0  # prompt tokens whose K/V come from the prefix cache: expected at submit, exact once placed
    kv_len: int = 0  # positions of this request's slot holding valid K/V (committed: read back)
    prefilled: int = 0  # prompt positions planned into steps (or a launch) so far
    visible: int = 0  # of those, the ones its slot says it holds, for later requests to copy
    cancelled: bool = False
    withdrawn: bool = False  # seated before its verdict, then refused (engine/launch_first.py): nothing of it goes out
    generator: torch.Generator | None = None
    constraint: TokenConstraint | None = None  # masks the logits before each choice (a grammar)
    choice: Choice = Choice.STEP
    lifted_choice: Choice = Choice.STEP  # its choice once its constraint is lifted (TokenConstraint.lifted)
    draw_seed: int = field(default_factory=lambda: random.getrandbits(63))  # keys draws made inside a step
    prefill_start: float | None = None
    prefill_end: float | None = None
    first_token_at: float | None = None
    nth_token_at: float | None = None
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        if self.constraint is None:
            self.constraint = self.params.constraint
        if self.params.seed is not None:  # a seeded request draws the same tokens every time
            self.draw_seed = self.params.seed & (2**63 - 1)

    @property
    def sla_token_index(self) -> int:
        """The token the SLA speaks of: the Nth, or the last one for shorter requests."""
        return min(self.sla_tokens, self.params.max_tokens)

    def timings(self, now: float) -> Timings:
        def ms(t: float | None, since: float | None = None) -> float | None:
            return None if t is None else round((t - (self.arrival if since is None else since)) * 1e3, 3)

        return Timings(
            queue_ms=ms(self.prefill_start),
            prefill_ms=ms(self.prefill_end, self.prefill_start) if self.prefill_start else None,
            ttft_ms=ms(self.first_token_at),
            ttfn_ms=ms(self.nth_token_at),
            e2e_ms=ms(now),
            n=self.sla_tokens,
        )

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids), self.cached_tokens)
