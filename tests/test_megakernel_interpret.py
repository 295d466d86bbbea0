"""The megakernel on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), at tiny shapes, against the reference.

Triton reads TRITON_INTERPRET when a kernel is defined, so each check runs in a fresh Python process with the
variable set: the result does not depend on what else the test session imported. With one program, the schedule
meets every dependency in order and no spin-wait ever blocks; the kernel source is the one the GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # name: (qkv_bias, llama3 rope scaling, vocab, attention splits, lm tile, positions per split at least)
    "llama": (False, True, 256, 3, 64, 1),  # the split-and-merge attention path
    "qwen": (True, False, 200, 2, 32, 4),  # the single-split path (contexts < 4 chunks)
}


def _run(case: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, case], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_megakernel_matches_reference_in_interpreter(case: str) -> None:
    result = _run(case)
    for r in result["steps"]:
        assert r["rel_err"] < 1e-4, (result["seed"], r)
        assert r["argmax"] == r["ref_argmax"], (result["seed"], r)
        assert r["kv_err"] < 1e-4, (result["seed"], r)
    assert {r["batch"] for r in result["steps"]} == {1, 3}


# ------------------------------------------------------------------------------------------------------------
# what runs inside the interpreter process


def _check(case: str) -> dict:
    import torch

    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.config import ModelConfig, RopeScaling
    from service.model.weights import LayerWeights, ModelWeights

    bias, scaling, vocab, splits, bn_lm, split_min = CASES[case]
    c = ModelConfig(
        name=f"tiny-{case}", architecture="qwen2" if bias else "llama", hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=vocab, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=4096, qkv_bias=bias,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64) if scaling else None,
    )
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; the seed is in the report
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, f, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    layers = [
        LayerWeights(attn_norm=1 + r(h), wq=r(q, h), wk=r(kv, h), wv=r(kv, h), wo=r(h, q), mlp_norm=1 + r(h),
                     w_gate=r(f, h), w_up=r(f, h), w_down=r(h, f), bq=r(q) if bias else None,
                     bk=r(kv) if bias else None, bv=r(kv) if bias else None)
        for _ in range(c.num_layers)
    ]
    embed = r(vocab, h, std=1.0)
    w = ModelWeights(embed=embed, layers=layers, final_norm=1 + r(h), lm_head=embed)
    max_slots, max_context = 4, 256
    ref = ReferenceDecoder(c, w, max_slots, max_context, device="cpu", dtype=torch.float32)
    mk = MegakernelDecoder(c, w, max_slots, max_context, device="cpu", dtype=torch.float32,
                           kernel_config=KernelConfig(split_min_chunks=split_min))
    from kernels.instructions import Tiling

    # bucket 4 (batch 3) splits the cached positions; bucket 1 keeps one split; LM tiles leave a ragged tail
    mk.kernel.tilings = {4: Tiling(attn_splits=splits, bn_lm=bn_lm), 1: Tiling(attn_splits=1, bn_lm=bn_lm)}
    steps = []
    for slots in ([1], [2, 0, 3]):
        pos = []
        for s in slots:
            n = int(torch.randint(20, 150, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            ref.prefill(s, ids)
            mk.prefill(s, ids)
            pos.append(n)
        toks = torch.randint(0, vocab, (len(slots),), generator=g).tolist()
        for _ in range(3):
            a = ref.decode(slots, toks, pos)
            b = mk.decode(slots, toks, pos)
            rel = ((a.logits - b.logits).norm() / a.logits.norm()).item()
            kv_err = max(
                ((ref.cache.k[:, s, :, p] - mk.reference.cache.k[:, s, :, p]).abs().max().item()
                 + (ref.cache.v[:, s, :, p] - mk.reference.cache.v[:, s, :, p]).abs().max().item())
                for s, p in zip(slots, pos)
            )
            steps.append({"batch": len(slots), "rel_err": rel, "kv_err": kv_err, "argmax": b.argmax.tolist(),
                          "ref_argmax": a.argmax.tolist()})
            # teacher forcing with fresh random tokens: every step sees new inputs
            toks = torch.randint(0, vocab, (len(slots),), generator=g).tolist()
            pos = [p + 1 for p in pos]
    return {"case": case, "seed": seed, "steps": steps}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_check(sys.argv[1])))
