"""Megakernel diagnostics on a GPU (bench/NOTES.md quotes them):

    python bench/_diag.py acc    # per-step logits error of the megakernel and of the bf16 reference vs float32
    python bench/_diag.py prof   # per-phase timeline from globaltimer stamps (KernelConfig(profile=True))
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import instructions as I  # noqa: E402
from kernels.megakernel import KernelConfig  # noqa: E402
from service.backends.megakernel import MegakernelDecoder  # noqa: E402
from service.backends.reference import ReferenceDecoder  # noqa: E402
from service.model.synthetic import load_synthetic  # noqa: E402
from service.model.weights import ModelWeights  # noqa: E402


def accuracy(shape: str, batch: int, steps: int, ctx: int) -> None:
    config, weights, _ = load_synthetic(shape, device="cuda", dtype=torch.bfloat16, seed=1234)
    mk = MegakernelDecoder(config, weights, max_slots=8, max_context=4096)
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
    print(f"ACC {shape} B={batch} ctx={ctx}: max over {steps} steps | mk-vs-ref {t[:, 0].max():.4f} "
          f"(mean {t[:, 0].mean():.4f}) | mk-vs-fp32 {t[:, 1].max():.4f} (mean {t[:, 1].mean():.4f}) | "
          f"ref-vs-fp32 {t[:, 2].max():.4f} (mean {t[:, 2].mean():.4f})", flush=True)
    del mk, ref, f32, w32
    torch.cuda.empty_cache()


def profile(shape: str, batch: int, ctx: int, cfg: KernelConfig) -> None:
    config, weights, _ = load_synthetic(shape, device="cuda", dtype=torch.bfloat16)
    mk = MegakernelDecoder(config, weights, max_slots=8, max_context=4096,
                           kernel_config=dataclasses.replace(cfg, profile=True), use_cuda_graphs=False)
    del weights
    k = mk.kernel
    k.tokens[:batch] = 1
    k.slots[:batch] = torch.arange(batch, device="cuda", dtype=torch.int32)
    k.positions[:batch] = ctx
    for _ in range(3):
        k.step(batch)
    torch.cuda.synchronize()
    s = k.schedule(batch)
    prof = k.prof[: len(s.tasks)].cpu().double()
    tasks = s.tasks
    t0 = prof[:, 0].min()
    ready, end = prof[:, 1] - t0, prof[:, 2] - t0
    total = end.max().item() / 1e3
    keys = [(int(r[I.F_LAYER]), int(r[I.F_OP])) for r in tasks]
    order = [(0, I.EMBED)] + [(layer, op) for layer in range(config.num_layers)
                              for op in (I.QKV, I.ATTN, I.OPROJ, I.GATEUP, I.DOWN)] + [(0, I.LMHEAD), (0, I.ARGMAX)]
    stats: dict[int, list[tuple[float, float, float]]] = {}
    prev_end = 0.0
    for key in order:
        idx = [i for i, kk in enumerate(keys) if kk == key]
        ph_ready = ready[idx].min().item()
        ph_end = end[idx].max().item()
        work = (end[idx] - ready[idx]).mean().item()
        stats.setdefault(key[1], []).append(((ph_end - prev_end) / 1e3, (ph_ready - prev_end) / 1e3, work / 1e3))
        prev_end = ph_end
    print(f"PROF {shape} B={batch} ctx={ctx} {cfg}: step {total:.1f} us (kernel-internal), {len(tasks)} tasks")
    for op, v in stats.items():
        t = torch.tensor(v)
        print(f"   {I.OP_NAMES[op]:7s} x{len(v):3d}: phase {t[:, 0].mean():6.2f} us (sum {t[:, 0].sum():7.1f}) | "
              f"first ready after prev phase end {t[:, 1].mean():5.2f} us | mean task work {t[:, 2].mean():6.2f} us",
              flush=True)
    del mk
    torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "acc":
        accuracy("llama-3.2-1b", 1, 32, 3900)
        accuracy("llama-3.2-1b", 1, 32, 100)
        accuracy("llama-3.2-1b", 8, 16, 3900)
        accuracy("smollm2-135m", 1, 32, 3900)
        accuracy("qwen2.5-1.5b", 1, 32, 3900)
    else:
        cfg = KernelConfig()
        profile("llama-3.2-1b", 1, 128, cfg)
        profile("smollm2-135m", 1, 128, cfg)
        profile("llama-3.2-1b", 8, 2048, cfg)
