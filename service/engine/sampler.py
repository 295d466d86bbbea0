"""Sampler: how each request's next token is chosen, for the first token after its prefill and for every step.

A token comes one of four ways, chosen per request:
- greedy: the decoder's argmax;
- drawn inside the decoder's step (Decoder.draws_tokens): temperature sampling keyed by the request's seed and the
  position, so a seed reproduces whatever the batch;
- pooled: on the device, for a whole batch at once, when the engine runs a step ahead (temperature, top-k, top-p
  with no seed to honour);
- one request at a time, from its logits: seeded requests that the decoder cannot draw (with the request's own
  generator), constrained ones (a grammar masks the logits first), and every non-greedy request of an engine that
  does not run ahead.
Every choice is made on the logits' device as soon as the step is launched, without waiting for it: the tokens come
to the host together, in the one wait of a step (StepTokens.read), and the next step can be fed them before that.

A constrained request is the exception: its grammar advances with each token on the host (accept), so its next
choice can be masked only once its last token has been read back. In a batch that runs ahead it lags instead of
holding everyone back (run_ahead.py): its token is fed into the step after next, its row of the step in between is
void, it gets a token every other step and its neighbours keep their cadence. A batch of such requests only runs one
step at a time, with no lag.

A request whose sampling fails (its logits hold NaN, its grammar breaks or allows nothing) raises SamplingError for
that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from service.backends.decoder import DecodeOutput, Decoder, Draw
from service.engine.request import Request, SamplingParams


class TokenConstraint(Protocol):
    """What a grammar plugs in (Request.constraint, handed in as SamplingParams.constraint): the logits it allows
    before each choice, and the token chosen, so that it can advance. Once the grammar is complete, `mask` allows
    only end-of-sequence tokens: the request ends as any does at its EOS (service/engine/grammar.py)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [vocab] → the same, with disallowed tokens at -inf."""
        ...

    def accept(self, token: int) -> None: ...


class SamplingError(Exception):
    """Choosing one request's token failed; the engine fails that request, and only it."""

    def __init__(self, request: Request, cause: Exception) -> None:
        super().__init__(str(cause))
        self.request = request


def untruncated(params: SamplingParams) -> bool:
    """Sampling from the whole softmax: what a decoder can draw inside its step."""
    return params.top_k <= 0 and params.top_p >= 1.0


class Sampler:
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    # -- which way a request's tokens come --------------------------------------------------------------
    def drawn_in_step(self, req: Request) -> bool:
        return (self.decoder.draws_tokens and not req.params.greedy and untruncated(req.params)
                and req.constraint is None)

    def decided_in_step(self, req: Request) -> bool:
        """The decode step's own output is this request's token (greedy, or drawn inside the step)."""
        return (req.params.greedy and req.constraint is None) or self.drawn_in_step(req)

    def pooled(self, req: Request) -> bool:
        """Sampled with the whole batch on the device, when running ahead: nothing of its own to honour."""
        return not self.decided_in_step(req) and req.params.seed is None and req.constraint is None

    @staticmethod
    def needs_host(req: Request) -> bool:
        """Its next choice waits for its last token on the host (a grammar advances with each): it lags in a batch
        that runs ahead."""
        return req.constraint is not None

    def draws(self, batch: list[Request]) -> list[Draw] | None:
        """What the decoder should draw inside its step (greedy rows at temperature 0); None: nothing."""
        drawn = [self.drawn_in_step(r) for r in batch]
        if not any(drawn):
            return None
        return [Draw(r.params.temperature if d else 0.0, r.draw_seed) for r, d in zip(batch, drawn)]

    # -- choosing -------------------------------------------------------------------------------------
    def first(self, logits: torch.Tensor, req: Request) -> int:
        """The token after a prefill (its logits [vocab]), the way the request's steps will choose theirs."""
        if self.drawn_in_step(req):
            draw = Draw(req.params.temperature, req.draw_seed)
            return int(self.decoder.draw(logits[None], [draw], [len(req.prompt_ids) - 1])[0])
        return self.on_host(logits, req)

    def step(self, out: DecodeOutput, batch: list[Request], ahead: bool, void: list[bool] | None = None
             ) -> StepTokens:
        """A decode step's tokens, chosen on the device now (the step need not have run). `ahead`: the engine runs a
        step ahead, so pooled rows are sampled together and the tokens start their trip to the host at once. `void`
        rows (a lagging request's row between two of its tokens) get none."""
        void = void or [False] * len(batch)
        chosen = out.sampled if out.sampled is not None else out.argmax
        decided = [self.decided_in_step(r) for r in batch]
        pooled = [ahead and not v and self.pooled(r) for r, v in zip(batch, void)]
        chosen = _sample_on_device(out.logits, chosen, batch, keep=[not p for p in pooled])
        own: dict[int, torch.Tensor] = {}
        errors: dict[int, Exception] = {}
        for i, req in enumerate(batch):
            if not (decided[i] or pooled[i] or void[i]):
                try:
                    own[i] = self._choose(out.logits[i], req)
                except Exception as e:  # this row alone: it fails when read
                    errors[i] = e
        if own:
            at = _to_device(list(own), torch.int64, chosen.device)
            chosen = chosen.index_copy(0, at, torch.stack(list(own.values())).to(chosen.dtype))
        tokens = StepTokens(self, batch, chosen, set(own), errors, ahead)
        if ahead and chosen.is_cuda:  # start the tokens' trip to the host now; read() waits for it
            tokens.host, tokens.ready = chosen.to("cpu", non_blocking=True), torch.cuda.Event()
            tokens.ready.record()
        return tokens

    def on_host(self, logits: torch.Tensor, req: Request) -> int:
        """One request's token from its logits [vocab], now: temperature, top-k, top-p, its seed, its constraint."""
        try:
            token = int(self._choose(logits, req))
        except Exception as e:
            raise SamplingError(req, e) from e
        return self.accept(req, token)

    def accept(self, req: Request, token: int) -> int:
        """A token chosen by _choose, on the host: checked, and told to the request's constraint."""
        try:
            if token < 0:
                raise ValueError("its logits allow no choice (NaN, or nothing the constraint allows)")
            if req.constraint is not None:
                req.constraint.accept(token)
        except Exception as e:
            raise SamplingError(req, e) from e
        return token

    @staticmethod
    def _choose(logits: torch.Tensor, req: Request) -> torch.Tensor:
        """The request's token from its logits [vocab], on their device, without waiting for them: -1 where they
        allow no choice."""
        return _sample_one(logits if req.constraint is None else req.constraint.mask(logits.float()), req)


@dataclass
class StepTokens:
    """One decode step's tokens, on the device in `chosen` [batch] (void rows: nothing meaningful). read() brings
    them to the host, the one wait of a step; token(i) gives row i's."""

    sampler: Sampler
    batch: list[Request]
    chosen: torch.Tensor
    own: set[int]  # rows chosen one request at a time: checked, and told to their constraint, when read
    errors: dict[int, Exception]  # rows whose choice failed
    ahead: bool = False  # chosen as for running ahead: the next step may be fed them before they are read
    host: torch.Tensor | None = None  # `chosen` on its way to the host, there once `ready` has fired
    ready: torch.cuda.Event | None = None
    _read: list[int] = field(default_factory=list)

    def read(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        self._read = (self.host if self.host is not None else self.chosen).tolist()

    def token(self, i: int) -> int:
        """Row i's token (after read()); raises SamplingError for row i's request alone."""
        if i in self.errors:
            raise SamplingError(self.batch[i], self.errors[i])
        if i in self.own:
            return self.sampler.accept(self.batch[i], self._read[i])
        return self._read[i]

    def feed(self, rows: dict[int, int]) -> torch.Tensor:
        """The next step's input, without waiting for this one: the chosen tokens, with `rows` (row → token) given
        from the host instead."""
        if not rows:
            return self.chosen
        dev = self.chosen.device
        at, values = _to_device(list(rows), torch.int64, dev), _to_device(list(rows.values()), self.chosen.dtype, dev)
        return self.chosen.index_copy(0, at, values)


def _sample_one(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """A token drawn from logits [vocab] as the request's parameters say, with its own generator (seeded: the same
    draws every time), by an exponential race (a multinomial draw that never fails on the device); -1 where the
    logits allow no choice. Nothing waits for the device."""
    p = req.params
    valid = ~torch.isnan(logits).any() & (logits > float("-inf")).any()
    if p.greedy:
        return torch.where(valid, logits.argmax(), -1)
    scores = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[0] = False  # even where top_p rounds to 0 in float32 (a top_p of 1e-300 would drop every token)
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    if req.generator is None:
        req.generator = torch.Generator(device=logits.device)
        if p.seed is not None:
            req.generator.manual_seed(p.seed)
        else:
            req.generator.seed()
    noise = torch.empty_like(scores).exponential_(generator=req.generator)
    return torch.where(valid, (scores.softmax(-1) / noise).argmax(), -1)


def _to_device(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for it (pinned, so the copy does not sync; torch.tensor(values,
    device=...) would wait for every step queued before it)."""
    return torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)


def _sample_on_device(logits: torch.Tensor, chosen: torch.Tensor, requests: list[Request],
                      keep: list[bool]) -> torch.Tensor:
    """The same choice as _sample_one, for a whole batch at once and without waiting for the device: the result
    stays on the GPU, where the next decode step can read it before the host does. Rows draw by the Gumbel-max
    trick over the temperature-scaled, top-k and top-p truncated scores; `keep` rows keep `chosen`."""
    dev = logits.device
    if all(keep):
        return chosen

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return _to_device(values, dtype, dev)[:, None]

    vocab = logits.shape[-1]
    temp = column([r.params.temperature if not r.params.greedy else 1.0 for r in requests], torch.float32)
    keep_rows = column(keep, torch.bool)[:, 0]
    if all(untruncated(r.params) for r in requests):
        # no truncation (what most clients send): no sort over the vocabulary, a handful of small kernels
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_()
        sampled = ((logits.float() / temp).softmax(-1) / noise).argmax(-1)
        return torch.where(keep_rows, chosen, sampled)
    top_k = column([r.params.top_k if r.params.top_k > 0 else vocab for r in requests], torch.int64)
    top_p = column([r.params.top_p for r in requests], torch.float32)
    scores, order = torch.sort(logits.float() / temp, dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    scores = scores.masked_fill(rank >= top_k, float("-inf"))
    probs = scores.softmax(-1)
    drop = (probs.cumsum(-1) - probs >= top_p) & (rank > 0)  # the smallest prefix reaching top_p; never the top
    scores = scores.masked_fill(drop, float("-inf"))
    noise = torch.empty_like(scores).exponential_()
    choice = (scores.softmax(-1) / noise).argmax(-1, keepdim=True)  # Gumbel-max, as an exponential race
    sampled = order.gather(-1, choice)[:, 0]
    return torch.where(keep_rows, chosen, sampled)
