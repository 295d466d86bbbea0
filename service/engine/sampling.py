"""Sampling: greedy, temperature, top-k, top-p, per-request seeds. One call per step for the whole batch."""

from __future__ import annotations

import torch

from service.engine.request import Request, SamplingParams


def untruncated(params: SamplingParams) -> bool:
    """Sampling from the whole softmax: what a decoder can draw inside its step (Decoder.draws_tokens)."""
    return params.top_k <= 0 and params.top_p >= 1.0


def sample(logits: torch.Tensor, chosen: torch.Tensor, requests: list[Request],
           decided: list[bool] | None = None) -> list[int | Exception]:
    """The next token of each request; logits [batch, vocab] float32 and chosen [batch] from the decoder: the
    greedy token, or the token the decoder drew, for the rows that `decided` marks (default: the greedy ones).
    Sampling is per request, and so are its failures: a request whose sampling raises gets the exception in its
    place (the engine fails that request only), the others get their tokens."""
    if decided is None:
        decided = [r.params.greedy for r in requests]
    tokens: list[int | Exception] = chosen.tolist()  # the one host sync of a step
    for i, req in enumerate(requests):
        if not decided[i]:
            try:
                tokens[i] = sample_one(logits[i], req)
            except Exception as e:
                tokens[i] = e
    return tokens


def sample_one(logits: torch.Tensor, req: Request) -> int:
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


def sample_on_device(logits: torch.Tensor, chosen: torch.Tensor, requests: list[Request],
                     generator: torch.Generator | None = None, decided: list[bool] | None = None) -> torch.Tensor:
    """The same choice as `sample`, for a whole batch at once and without waiting for the device: the result
    stays on the GPU, where the next decode step can read it before the host does. Rows draw by the Gumbel-max
    trick over the temperature-scaled, top-k and top-p truncated scores. Seeded requests are left to `sample`."""
    dev = logits.device
    if decided is None:
        decided = [r.params.greedy for r in requests]
    if all(decided):
        return chosen

    def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:  # pinned, so the copy does not sync
        return torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)[:, None]

    vocab = logits.shape[-1]
    temp = column([r.params.temperature if not r.params.greedy else 1.0 for r in requests], torch.float32)
    keep = column(decided, torch.bool)[:, 0]
    if all(untruncated(r.params) for r in requests):
        # no truncation (what most clients send): no sort over the vocabulary, a handful of small kernels
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_(generator=generator)
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
    noise = torch.empty_like(scores).exponential_(generator=generator)
    choice = (scores.softmax(-1) / noise).argmax(-1, keepdim=True)  # Gumbel-max, as an exponential race
    sampled = order.gather(-1, choice)[:, 0]
    return torch.where(keep, chosen, sampled)
