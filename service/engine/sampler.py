"""Sampler: how each request's tokens are chosen from its sampled rows of a step (its first token from its prompt's
last row, then one per decode row).

A request's Choice is decided once (choice_of):
- STEP: the step's own output: greedy (its argmax), or drawn inside the step where the decoder can
  (Decoder.draws_tokens: temperature sampling keyed by the request's seed and the position, so a seed reproduces
  whatever the batch);
- DEVICE: from its row's logits on the device: unseeded top-k/top-p requests together, in a few batched kernels;
  seeded ones that the decoder cannot draw with their own generator;
- HOST: constrained requests: a grammar masks the logits first, and advances with each token on the host, so the
  request's next row can be planned only once its last token has been read back (it lags: planner.py). The masks of
  a step's constrained rows are computed off the engine thread beforehand (masks.py). Where the decoder draws tokens,
  it applies them inside its step (its LM head puts disallowed logits at -inf), and the rows are chosen there as
  STEP rows are (top-k/top-p ones as DEVICE rows, from the masked logits); elsewhere they mask the logits together
  after the step, and the rows are chosen with the DEVICE ones (a seeded one with its own generator).
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
from service.engine.masks import Masked, StepMasks
from service.engine.request import Choice, Request, SamplingParams
from service.engine.token_ring import TokenRing

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
    return Choice.HOST if req.constraint is not None else unconstrained_choice(req.params, draws_tokens)


def unconstrained_choice(p: SamplingParams, draws_tokens: bool) -> Choice:
    """How tokens are chosen for these parameters without a constraint (also once a constraint is lifted)."""
    if p.greedy or (draws_tokens and untruncated(p)):
        return Choice.STEP
    return Choice.DEVICE


def in_step(req: Request, masked_in_step: bool) -> bool:
    """Whether the step itself chooses the request's token (its argmax, or its draw inside the step)."""
    return req.choice is Choice.STEP or (masked_in_step and req.choice is Choice.HOST and untruncated(req.params))


def draws(requests: list[Request], masked_in_step: bool = False) -> list[Draw] | None:
    """What the decoder should draw inside its step for these sampled rows (temperature 0: its argmax); None: nothing
    to draw. masked_in_step: the decoder masks the constrained rows' logits inside the step (they draw there too)."""
    drawn = [in_step(r, masked_in_step) and not r.params.greedy for r in requests]
    if not any(drawn):
        return None
    return [Draw(r.params.temperature if d else 0.0, r.draw_seed) for r, d in zip(requests, drawn)]


def choose(out: DecodeOutput, requests: list[Request], collected: Masked | None = None,
           masks: StepMasks | None = None, masked_in_step: bool = False, ring: TokenRing | None = None) -> StepTokens:
    """The tokens of a step's sampled rows (row i is requests[i]'s), chosen on the device now: the step need not have
    run. `collected`: the constrained rows' masks (masks.py; computed off this thread beforehand). Where the decoder
    applied them inside the step (masked_in_step), its logits and choices are masked already; otherwise they mask the
    logits all together here. Then the rows the step did not choose are sampled together; only rows with a seed of
    their own are sampled one at a time, with their generator. Their trip to the host starts at once (through `ring`'s
    pinned buffers where given: token_ring.py); read() waits for it."""
    chosen = out.sampled if out.sampled is not None else out.argmax
    logits = out.logits
    constrained = {i: r.constraint for i, r in enumerate(requests) if r.constraint is not None}
    errors: dict[int, Exception] = {}
    waits, wait_s = 0, 0.0
    if constrained:
        if collected is None:
            collected = (masks or StepMasks()).collect(constrained)
        errors, waits, wait_s = dict(collected.errors), collected.waits, collected.wait_s
        if not masked_in_step:
            masked = (masks or StepMasks()).apply(logits, collected).logits
            assert masked is not None
            logits = masked
    stepped = [in_step(r, masked_in_step) for r in requests]
    own = [not st and r.params.seed is not None and not r.params.greedy for r, st in zip(requests, stepped)]
    pooled = [not st and not o for st, o in zip(stepped, own)]
    chosen = _sample_on_device(logits, chosen, requests, keep=[not p for p in pooled])
    rows: dict[int, torch.Tensor] = {}
    for i, req in enumerate(requests):
        if own[i] and i not in errors:
            try:
                rows[i] = _sample_one(logits[i], req)
            except Exception as e:  # this row alone: it fails when read
                errors[i] = e
    if rows:
        at = to_device(list(rows), torch.int64, chosen.device)
        chosen = chosen.index_copy(0, at, torch.stack(list(rows.values())).to(chosen.dtype))
    tokens = StepTokens(requests, chosen, set(rows) | set(constrained), errors, mask_waits=waits, mask_wait_s=wait_s)
    if chosen.is_cuda and ring is not None:  # start the tokens' trip to the host now; read() waits for it
        tokens.host, tokens.ready = ring.send(chosen)
    elif chosen.is_cuda:
        tokens.host, tokens.ready = chosen.to("cpu", non_blocking=True), torch.cuda.Event()
        tokens.ready.record()
    return tokens


def accept(req: Request, token: int) -> int:
    """A token chosen for `req`, on the host: checked, and told to its constraint."""
    try:
        if token < 0:
            raise ValueError("its logits allow no choice (NaN, or nothing the constraint allows)")
        if req.constraint is not None:
            req.constraint.accept(token)
            if req.constraint.lifted():
                req.constraint, req.choice = None, req.lifted_choice
    except Exception as e:
        raise SamplingError(req, e) from e
    return token


@dataclass
class StepTokens:
    """One step's tokens, one per sampled row, on the device in `chosen`. read() brings them to the host, the one wait
    of a step; token(i) gives row i's."""

    requests: list[Request]
    chosen: torch.Tensor
    checked: set[int]  # rows checked, and told to their constraint, when read (constrained or sampled alone)
    errors: dict[int, Exception]  # rows whose choice failed
    mask_waits: int = 0  # constrained rows whose mask was not ready when the step was launched
    mask_wait_s: float = 0.0  # how long choose() waited for those
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
        if i in self.checked:
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
    trick over the temperature-scaled, top-k and top-p truncated scores, greedy ones (constrained: their logits are
    masked) take their argmax; `keep` rows keep `chosen`. The rows' parameters go to the device in one copy."""
    dev = logits.device
    if all(keep):
        return chosen
    vocab = logits.shape[-1]
    drawn = [r for r, k in zip(requests, keep) if not k]
    greedy = [r.params.greedy and not k for r, k in zip(requests, keep)]
    params = to_device([[r.params.temperature if not r.params.greedy else 1.0, k, g,
                         min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab, r.params.top_p]
                        for r, k, g in zip(requests, keep, greedy)], torch.float32, dev)
    temp, keep_rows = params[:, 0:1], params[:, 1] != 0
    scaled = logits.float() / temp
    if all(untruncated(r.params) for r in drawn):
        # no truncation (what most clients send): no sort over the vocabulary, a handful of small kernels
        noise = torch.empty_like(scaled).exponential_()
        sampled = (scaled.softmax(-1) / noise).argmax(-1)
    else:
        top_k, top_p = params[:, 3:4], params[:, 4:5]
        scores, order = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        scores = scores.masked_fill(rank >= top_k, float("-inf"))
        probs = scores.softmax(-1)
        drop = (probs.cumsum(-1) - probs >= top_p) & (rank > 0)  # the smallest prefix reaching top_p; never the top
        scores = scores.masked_fill(drop, float("-inf"))
        noise = torch.empty_like(scores).exponential_()
        choice = (scores.softmax(-1) / noise).argmax(-1, keepdim=True)  # Gumbel-max, as an exponential race
        sampled = order.gather(-1, choice)[:, 0]
    if any(greedy):
        sampled = torch.where(params[:, 2] != 0, logits.argmax(-1), sampled)
    return torch.where(keep_rows, chosen, sampled)
