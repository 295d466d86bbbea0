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
    # name: (qkv_bias, llama3 rope scaling, vocab, attention splits, lm tile, positions per split at least, weights)
    "llama": (False, True, 256, 3, 64, 1, "bf16"),  # the split-and-merge attention path
    "qwen": (True, False, 200, 2, 32, 4, "bf16"),  # the single-split path (contexts < 4 chunks)
    "llama-fp8": (False, True, 256, 3, 64, 1, "fp8"),  # FP8 matrices against the reference on their dequantized values
    "qwen-fp8": (True, False, 200, 2, 32, 4, "fp8"),
    "llama-tma": (False, True, 256, 3, 64, 1, "bf16"),  # weights through tensor descriptors (TMA on the GPU)
    "qwen-fp8-tma": (True, False, 200, 2, 32, 4, "fp8"),
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
    # float32 everywhere, but with FP8 weights the dot runs in float16 (as on the GPU): the activations round to
    # its 11 significant bits on the way in
    tol = 3e-3 if "fp8" in case else 1e-4
    for r in result["steps"]:
        assert r["rel_err"] < tol, (result["seed"], r)
        assert r["argmax"] == r["ref_argmax"], (result["seed"], r)
        assert r["kv_err"] < tol, (result["seed"], r)
    assert {r["batch"] for r in result["steps"]} == {1, 3}


def test_in_kernel_sampling_draws_from_the_softmax() -> None:
    """The Gumbel-max draw (kernels/sampling.py) over fresh random logits: the tokens drawn with independent seeds
    follow softmax(logits / T) (a chi-square test), greedy rows keep the argmax, and a (seed, position) pair draws
    the same token again."""
    r = _run("sampling")
    assert r["greedy_rows_keep_argmax"], r
    assert r["same_key_same_draw"] and r["new_position_new_draw"], r
    # chi-square over bins with >= 5 expected draws: the 1e-6 quantile for the degrees of freedom at hand
    assert r["chi2"] < r["chi2_limit"], r


def test_megakernel_draws_match_the_drawing_function_in_interpreter() -> None:
    """The megakernel's sampled token equals the Gumbel-max draw of its own logits with the row's temperature,
    seed and position (computed over the whole row, while the kernel reduces tile by tile); greedy rows return
    the argmax; the same seed draws the same token, other seeds other tokens."""
    r = _run("megakernel-draws")
    assert r["sampled"] == r["expected"], r
    assert r["greedy_equal"], r
    assert r["repeat_equal"], r
    assert r["distinct_over_seeds"] >= 3, r


# ------------------------------------------------------------------------------------------------------------
# what runs inside the interpreter process


def _check_sampling() -> dict:
    import math

    import torch

    from kernels.sampling import draw

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    c, n = 16, 16384
    logits = torch.randn(c, generator=g) * 1.5
    temp = 0.5 + torch.rand(1, generator=g).item()
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    pos = torch.randint(0, 4096, (n,), generator=g)
    tokens = draw(logits.expand(n, c), torch.full((n,), temp), seeds, pos)
    counts = torch.bincount(tokens, minlength=c).double()
    expected = (logits / temp).softmax(-1).double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts[big]
    exp = torch.cat([expected[big], expected[~big].sum()[None]]) if (~big).any() else expected[big]
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2) / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 1e-6 (z = 4.753)
    limit = dof * (1 - 2 / (9 * dof) + 4.753 * math.sqrt(2 / (9 * dof))) ** 3
    rows = torch.randn(64, c, generator=g)
    greedy = draw(rows, torch.zeros(64), seeds[:64], pos[:64])
    again = draw(logits.expand(64, c), torch.full((64,), 4.0), seeds[:64], pos[:64])
    first = draw(logits.expand(64, c), torch.full((64,), 4.0), seeds[:64], pos[:64])
    moved = draw(logits.expand(64, c), torch.full((64,), 4.0), seeds[:64], pos[:64] + 1)
    return {"seed": seed, "temperature": temp, "chi2": chi2, "chi2_limit": limit, "dof": dof,
            "greedy_rows_keep_argmax": bool((greedy == rows.argmax(-1)).all()),
            "same_key_same_draw": bool((again == first).all()), "new_position_new_draw": bool((moved != first).any())}


def _check_megakernel_draws() -> dict:
    import torch

    from kernels.sampling import draw
    from service.backends.decoder import Draw
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    config, weights, _ = load_synthetic("tiny", seed=seed, num_layers=1)
    v = config.vocab_size
    mk = MegakernelDecoder(config, weights, 4, 128, device="cpu", dtype=torch.float32)
    slots, pos = [0, 1, 2, 3], []
    for s in slots:
        n = int(torch.randint(3, 40, (1,), generator=g))
        mk.prefill(s, torch.randint(0, v, (n,), generator=g).tolist())
        pos.append(n)
    toks = torch.randint(0, v, (4,), generator=g).tolist()
    seeds = torch.randint(0, 2**62, (4,), generator=g).tolist()
    draws = [Draw(0.0, seeds[0]), Draw(0.7, seeds[1]), Draw(1.3, seeds[2]), Draw(2.0, seeds[3])]
    out = mk.decode(slots, toks, pos, draws)
    again = mk.decode(slots, toks, pos, draws)  # the same step again: it rewrites the same K/V
    expected = draw(out.logits, torch.tensor([d.temperature for d in draws]), torch.tensor(seeds), torch.tensor(pos))
    hot = [int(mk.decode([3], [toks[3]], [pos[3]], [Draw(2.0, seeds[3] + 1 + i)]).sampled[0]) for i in range(8)]
    return {"seed": seed, "sampled": out.sampled.tolist(), "expected": expected.tolist(),
            "greedy_equal": int(out.sampled[0]) == int(out.argmax[0]),
            "repeat_equal": again.sampled.tolist() == out.sampled.tolist(), "distinct_over_seeds": len(set(hot))}


def _check(case: str) -> dict:
    import torch

    from kernels.instructions import Op
    from kernels.megakernel import MATVECS, KernelConfig, MatvecTile
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.config import ModelConfig, RopeScaling
    from service.model.fp8 import quantize_model
    from service.model.weights import LayerWeights, ModelWeights

    bias, scaling, vocab, splits, bn_lm, split_min, weight_format = CASES[case]
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
    # the oracle runs the weights the kernel reads: with FP8, their dequantized values
    ref_w = quantize_model(w, torch.float32).dequantized if weight_format == "fp8" else w
    ref = ReferenceDecoder(c, ref_w, max_slots, max_context, device="cpu", dtype=torch.float32)
    # LM tiles that leave a ragged tail; O and down stream K's halves side by side; llama's k chunks of a quarter
    # of the hidden size make several chunks per stream (qwen's one); with "-tma", weights through tensor descriptors
    tma = case.endswith("-tma")
    k_chunk = 16 if case.startswith("llama") else 256
    tiles = {op: MatvecTile(rows=bn_lm if op is Op.LMHEAD else 16, k_chunk=k_chunk, k_slices=2 if tma else 4, tma=tma,
                            k_halves=op in (Op.OPROJ, Op.DOWN)) for op in MATVECS}
    mk = MegakernelDecoder(c, w, max_slots, max_context, device="cpu", dtype=torch.float32,
                           kernel_config=KernelConfig(split_min_chunks=split_min, tiles=tiles),
                           weight_format=weight_format)
    # bucket 4 (batch 3) splits the cached positions; bucket 1 keeps one split
    mk.kernel.attn_splits = {4: splits, 1: 1}
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
    what = sys.argv[1]
    check = {"sampling": _check_sampling, "megakernel-draws": _check_megakernel_draws}.get(what)
    print(json.dumps(check() if check else _check(what)))
