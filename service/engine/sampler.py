"""Sampler: how each request's next token is chosen, for the first token after its prefill and for every step.

A token comes one of four ways, chosen per request:
- greedy: the decoder's argmax;
- drawn inside the decoder's step (Decoder.draws_tokens): temperature sampling keyed by the request's seed and the
  position, so a seed reproduces whatever the batch;
- on the device, for a whole batch at once, when the engine runs a step ahead (temperature, top-k, top-p with no
  seed to honour): the next step is fed these tokens before the host has read them;
- on the host, one request at a time: seeded requests that the decoder cannot draw, and every non-greedy request
  of an engine that does not run ahead.

A request whose sampling fails raises SamplingError for that request alone. A request with a `constraint` (the
extension point for grammars) has its logits masked before every choice, which therefore happens on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from service.backends.decoder import DecodeOutput, Decoder, Draw
from service.engine.request import Request, SamplingParams


class TokenConstraint(Protocol):
    """What a grammar plugs in (Request.constraint): the logits it allows before each choice, and the token
    chosen, so that it can advance."""

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

    def on_device(self, batch: list[Request]) -> bool:
        """Whether every token of a step can be chosen on the device, with no host work: what running ahead needs."""
        return all(self.decided_in_step(r) or (r.params.seed is None and r.constraint is None) for r in batch)

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

    def step(self, out: DecodeOutput, batch: list[Request], ahead: bool) -> StepTokens:
        """A decode step's tokens. `ahead`: chosen now, on the device, for every row (see on_device), and on their
        way to the host at once; otherwise the decided rows are the step's own and the others are sampled on the
        host when read."""
        chosen = out.sampled if out.sampled is not None else out.argmax
        decided = [self.decided_in_step(r) for r in batch]
        if not ahead:
            return StepTokens(self, batch, out.logits, chosen, decided)
        chosen = _sample_on_device(out.logits, chosen, batch, decided)
        tokens = StepTokens(self, batch, out.logits, chosen, [True] * len(batch), ahead=True)
        if chosen.is_cuda:  # start the tokens' trip to the host now; read() waits for it
            tokens.host, tokens.ready = chosen.to("cpu", non_blocking=True), torch.cuda.Event()
            tokens.ready.record()
        return tokens

    def on_host(self, logits: torch.Tensor, req: Request) -> int:
        """One request's token from its logits [vocab]: temperature, top-k, top-p, its seed, its constraint."""
        try:
            token = _sample_one(logits if req.constraint is None else req.constraint.mask(logits.float()), req)
            if req.constraint is not None:
                req.constraint.accept(token)
            return token
        except Exception as e:
            raise SamplingError(req, e) from e


@dataclass
class StepTokens:
    """One decode step's tokens: `chosen` [batch] on the device holds the decided rows' (every row's when chosen
    ahead: the next step is fed them); read() brings them to the host, the one wait of a step, and token(i)
    gives row i's, sampling it on the host if it was not decided."""

    sampler: Sampler
    batch: list[Request]
    logits: torch.Tensor
    chosen: torch.Tensor
    decided: list[bool]
    ahead: bool = False
    host: torch.Tensor | None = None  # `chosen` on its way to the host, there once `ready` has fired
    ready: torch.cuda.Event | None = None
    _read: list[int] = field(default_factory=list)

    def read(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        self._read = (self.host if self.host is not None else self.chosen).tolist()

    def token(self, i: int) -> int:
        """Row i's token (after read()); raises SamplingError for row i's request alone."""
        if self.decided[i]:
            return self._read[i]
        return self.sampler.on_host(self.logits[i], self.batch[i])


def _sample_one(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if p.greedy:
        return int(logits.argmax())
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
    return int(torch.multinomial(scores.softmax(-1), 1, generator=req.generator))


def _sample_on_device(logits: torch.Tensor, chosen: torch.Tensor, requests: list[Request],
                      decided: list[bool]) -> torch.Tensor:
    """The same choice as _sample_one, for a whole batch at once and without waiting for the device: the result
    stays on the GPU, where the next decode step can read it before the host does. Rows draw by the Gumbel-max
    trick over the temperature-scaled, top-k and top-p truncated scores; decided rows keep `chosen`."""
    dev = logits.device
    if all(decided):
        return chosen

    def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:  # pinned, so the copy does not sync
        return torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)[:, None]

    vocab = logits.shape[-1]
    temp = column([r.params.temperature if not r.params.greedy else 1.0 for r in requests], torch.float32)
    keep = column(decided, torch.bool)[:, 0]
    if all(untruncated(r.params) for r in requests):
        # no truncation (what most clients send): no sort over the vocabulary, a handful of small kernels
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_()
        sampled = ((logits.float() / temp).softmax(-1) / noise).argmax(-1)
        return torch.where(keep, chosen, sampled)
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
    return torch.where(keep, chosen, sampled)
