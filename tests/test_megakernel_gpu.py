"""The megakernel on a GPU against the reference decoder: bf16, the real (synthetic) shapes, 128 teacher-forced
steps at contexts up to 4096, batch 1 and 8, fresh random weights and inputs every run (the seed is reported)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MAX_CONTEXT = 4096
STEPS = 128
TOL = 2e-2


def _check(shape: str, batch: int, steps: int = STEPS) -> dict:
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic(shape, device="cuda", dtype=torch.bfloat16, seed=seed)
    max_slots = 8
    mk = MegakernelDecoder(config, weights, max_slots=max_slots, max_context=MAX_CONTEXT)
    del weights
    # the oracle shares the (read-only) weights and keeps its own cache
    ref = ReferenceDecoder(config, mk.reference.weights, max_slots + 1, MAX_CONTEXT, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(max_slots, generator=g)[:batch].tolist()
    # prompt lengths: one row ends near the end of the context, the others anywhere
    lens = [MAX_CONTEXT - steps - 1] + torch.randint(1, MAX_CONTEXT - steps, (batch - 1,), generator=g).tolist()
    for s, n in zip(slots, lens):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        ref.prefill(s, ids)
        mk.prefill(s, ids)
    pos = list(lens)
    worst, argmax_ok, near_max = 0.0, True, True
    for _ in range(steps):
        toks = torch.randint(0, config.vocab_size, (batch,), generator=g).tolist()  # teacher forcing
        a = ref.decode(slots, toks, pos)
        b = mk.decode(slots, toks, pos)
        assert torch.isfinite(b.logits).all()
        rel = ((b.logits - a.logits).norm(dim=-1) / a.logits.norm(dim=-1)).max().item()
        worst = max(worst, rel)
        argmax_ok &= bool((b.argmax == b.logits.argmax(-1)).all())
        # the kernel's greedy token is a maximum of the reference's logits, to within the tolerance
        picked = a.logits.gather(1, b.argmax[:, None])[:, 0]
        near_max &= bool((a.logits.max(-1).values - picked <= TOL * a.logits.abs().max(-1).values).all())
        pos = [p + 1 for p in pos]
    mk.check_errors()
    return {"seed": seed, "worst_rel_err": worst, "argmax_consistent": argmax_ok, "argmax_near_max": near_max}


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen2.5-1.5b", "smollm2-135m"])
def test_megakernel_matches_reference_on_gpu(shape: str, batch: int) -> None:
    r = _check(shape, batch)
    print(shape, batch, r)
    assert r["worst_rel_err"] < TOL, r
    assert r["argmax_consistent"], r
    assert r["argmax_near_max"], r
