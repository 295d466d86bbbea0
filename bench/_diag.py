"""Megakernel accuracy diagnostic on a GPU (bench/NOTES.md quotes it): the per-step logits error of the megakernel
and of the bf16 reference decoder against float32. The per-phase timeline is `bench/decode.py --timeline`.

    python -m bench diag [bf16|fp8]
"""

from __future__ import annotations

import sys

import torch

from service.backends.megakernel import MegakernelDecoder
from service.backends.reference import ReferenceDecoder
from service.model.synthetic import load_synthetic
from service.model.weights import ModelWeights


def accuracy(shape: str, batch: int, steps: int, ctx: int, weight_format: str = "bf16") -> None:
    config, weights, _ = load_synthetic(shape, device="cuda", dtype=torch.bfloat16, seed=1234)
    mk = MegakernelDecoder(config, weights, max_slots=8, max_context=4096, weight_format=weight_format)
    del weights
    ref = ReferenceDecoder(config, mk.reference.weights, 9, 4096, "cuda", torch.bfloat16)
    w32: ModelWeights = mk.reference.weights.to("cuda", torch.float32)
    f32 = ReferenceDecoder(config, w32, 9, 4096, "cuda", torch.float32)
    g = torch.Generator().manual_seed(5)
    slots = list(range(batch))
    lens = [ctx] + torch.randint(1, ctx, (batch - 1,), generator=g).tolist()
    for s, n in zip(slots, lens):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        for d in (ref, mk, f32):
            d.prefill(s, ids)
    pos = list(lens)
    rows = []
    for _ in range(steps):
        toks = torch.randint(0, config.vocab_size, (batch,), generator=g).tolist()
        a, b, c = ref.decode(slots, toks, pos), mk.decode(slots, toks, pos), f32.decode(slots, toks, pos)

        def rel(x: torch.Tensor, y: torch.Tensor) -> float:
            return ((x - y).norm(dim=-1) / y.norm(dim=-1)).max().item()

        rows.append((rel(b.logits, a.logits), rel(b.logits, c.logits), rel(a.logits, c.logits)))
        pos = [p + 1 for p in pos]
    t = torch.tensor(rows)
    print(f"ACC {shape} {weight_format} B={batch} ctx={ctx}: max over {steps} steps | mk-vs-ref {t[:, 0].max():.4f} "
          f"(mean {t[:, 0].mean():.4f}) | mk-vs-fp32 {t[:, 1].max():.4f} (mean {t[:, 1].mean():.4f}) | "
          f"ref-vs-fp32 {t[:, 2].max():.4f} (mean {t[:, 2].mean():.4f})", flush=True)
    del mk, ref, f32, w32
    torch.cuda.empty_cache()


if __name__ == "__main__":
    fmt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    accuracy("llama-3.2-1b", 1, 32, 3900, fmt)
    accuracy("llama-3.2-1b", 1, 32, 100, fmt)
    accuracy("llama-3.2-1b", 8, 16, 3900, fmt)
    accuracy("smollm2-135m", 1, 32, 3900, fmt)
    accuracy("qwen2.5-1.5b", 1, 32, 3900, fmt)
