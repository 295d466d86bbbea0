"""Sampler: how each request's tokens are chosen from its sampled rows of a step (its first token from its prompt's
last row, then one per decode row).

A request's Choice is decided once (choice_of):
- STEP: the step's own output: greedy (its argmax), or drawn inside the step where the decoder can
  (Decoder.draws_tokens: temperature sampling keyed by the request's seed and the position, so a seed reproduces
  whatever the batch);
- DEVICE: from its row's logits on the device: unseeded top-k/top-p requests together, in a few batched kernels;
  seeded ones that the decoder cannot draw with their own generator;
- HOST: constrained requests: a grammar masks the logits first, and advances with each token on the host, so the
  request's next row can be planned only once its last token has been read back (it lags: planner.py).
Every choice is made on the logits' device as soon as the step is launched, without waiting for it: the tokens come to
the host together, in the one wait of a step (StepTokens.read), and the next step can be fed them before that.

A request whose sampling fails (its logits hold NaN, its grammar breaks or allows nothing) raises SamplingError for
that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service.backends.decoder import DecodeOutput, Draw
from service.engine.constraint import TokenConstraint
from service.engine.request import Choice, Request, SamplingParams

__all__ = ["Choice", "SamplingError", "StepTokens", "TokenConstraint", "choice_of", "choose", "draws"]


class SamplingError(Exception):
    """Choosing one request's token failed; the engine fails that request, and only it."""

    def __init__(self, request: Request, cause: Exception) -> None:
        super().__init__(str(cause))
        self.request = request


def untruncated(params: SamplingParams) -> bool:
    """Sampling from the whole softmax: what a decoder can draw inside its step."""
    return params.top_k <= 0 and params.top_p >= 1.0


def choice_of(req: Request, draws_tokens: bool) -> Choice:
    """How the request's tokens are chosen, given whether the decoder draws tokens inside its step."""
    p = req.params
    if req.constraint is not None:
        return Choice.HOST
    if p.greedy or (draws_tokens and untruncated(p)):
        return Choice.STEP
    return Choice.DEVICE


def draws(requests: list[Request]) -> list[Draw] | None:
    """What the decoder should draw inside its step for these sampled rows (temperature 0: its argmax); None: nothing
    to draw."""
    drawn = [r.choice is Choice.STEP and not r.params.greedy for r in requests]
    if not any(drawn):
        return None
    return [Draw(r.params.temperature if d else 0.0, r.draw_seed) for r, d in zip(requests, drawn)]


def choose(out: DecodeOutput, requests: list[Request]) -> StepTokens:
    """The tokens of a step's sampled rows (row i is requests[i]'s), chosen on the device now: the step need not have
    run. Their trip to the host starts at once; read() waits for it."""
    chosen = out.sampled if out.sampled is not None else out.argmax
    pooled = [r.choice is Choice.DEVICE and r.params.seed is None for r in requests]
    chosen = _sample_on_device(out.logits, chosen, requests, keep=[not p for p in pooled])
    own: dict[int, torch.Tensor] = {}
    errors: dict[int, Exception] = {}
    for i, req in enumerate(requests):
        if req.choice is Choice.HOST or (req.choice is Choice.DEVICE and not pooled[i]):
            try:
                own[i] = _choose(out.logits[i], req)
            except Exception as e:  # this row alone: it fails when read
                errors[i] = e
    if own:
        at = to_device(list(own), torch.int64, chosen.device)
        chosen = chosen.index_copy(0, at, torch.stack(list(own.values())).to(chosen.dtype))
    tokens = StepTokens(requests, chosen, set(own), errors)
    if chosen.is_cuda:  # start the tokens' trip to the host now; read() waits for it
        tokens.host, tokens.ready = chosen.to("cpu", non_blocking=True), torch.cuda.Event()
        tokens.ready.record()
    return tokens


def _choose(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The request's token from its logits [vocab], on their device, without waiting for them: -1 where they allow no
    choice."""
    return _sample_one(logits if req.constraint is None else req.constraint.mask(logits.float()), req)


def accept(req: Request, token: int) -> int:
    """A token chosen for `req`, on the host: checked, and told to its constraint."""
    try:
        if token < 0:
            raise ValueError("its logits allow no choice (NaN, or nothing the constraint allows)")
        if req.constraint is not None:
            req.constraint.accept(token)
    except Exception as e:
        raise SamplingError(req, e) from e
    return token


@dataclass
class StepTokens:
    """One step's tokens, one per sampled row, on the device in `chosen`. read() brings them to the host, the one wait
    of a step; token(i) gives row i's."""

    requests: list[Request]
    chosen: torch.Tensor
    own: set[int]  # rows chosen one request at a time: checked, and told to their constraint, when read
    errors: dict[int, Exception]  # rows whose choice failed
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
            raise SamplingError(self.requests[i], self.errors[i])
        if i in self.own:
            return accept(self.requests[i], self._read[i])
        return self._read[i]


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


def to_device(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
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
        return to_device(values, dtype, dev)[:, None]

    vocab = logits.shape[-1]
    temp = column([r.params.temperature if not r.params.greedy else 1.0 for r in requests], torch.float32)
    keep_rows = column(keep, torch.bool)[:, 0]
    if all(untruncated(r.params) for r in requests):
        # no truncation (what most clients send): no sort over the vocabulary, a handful of small kernels
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_()
        sampled = ((logits.float() / temp).softmax(-1) / noise).argmax(-1)
        return torch.where(keep_rows, chosen, sampled)
    top_k = column([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in requests], torch.int64)
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
