"""Sampling: greedy, temperature, top-k, top-p, per-request seeds. One call per step for the whole batch."""

from __future__ import annotations

import torch

from service.engine.request import Request


def sample(logits: torch.Tensor, argmax: torch.Tensor, requests: list[Request]) -> list[int | Exception]:
    """The next token of each request; logits [batch, vocab] float32 and argmax [batch] from the decoder.
    Sampling is per request, and so are its failures: a request whose sampling raises gets the exception in its
    place (the engine fails that request only), the others get their tokens."""
    tokens: list[int | Exception] = argmax.tolist()  # the one host sync of a step
    for i, req in enumerate(requests):
        if not req.params.greedy:
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
