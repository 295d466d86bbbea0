"""The decode bench's library peer (bench/library_peer.py): its chain of matrices, run eagerly on the CPU at a tiny
shape, against a straightforward float32 reference; its FP8 arithmetic against the same chain on the dequantized
weights; the bench's table naming it; and, on a GPU, the CUDA-graph timing itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.library_peer import BACKEND, Fp8Weight, library_peer, make_weights, quantize_rows, rel_err, step
from service.model.synthetic import SHAPES

TINY = SHAPES["tiny"]
ROOT = Path(__file__).resolve().parents[1]


def reference_logits(w, x: torch.Tensor, head_rows: int) -> torch.Tensor:  # noqa: ANN001
    """The chain written out in float32, matrix by matrix: Q's rows of QKV into O, gate and up apart, residuals."""
    c = TINY
    q, f = c.q_size, c.intermediate_size
    xf = x.float()
    for wqkv, wo, wgu, wdown in w.layers:
        wq = wqkv.float()[:q]  # QKV's first q output features are Q's
        xf = xf + (xf @ wq.t()) @ wo.float().t()
        gate, up = xf @ wgu.float()[:f].t(), xf @ wgu.float()[f:].t()
        xf = xf + (gate * torch.sigmoid(gate) * up) @ wdown.float().t()
    return xf[:head_rows] @ w.lm_head.float().t()


def test_bf16_chain_has_the_steps_shapes_and_matches_the_reference() -> None:
    c = TINY
    w = make_weights(c, "bf16", "cpu")
    h, q, kv, f = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    assert len(w.layers) == c.num_layers
    for wqkv, wo, wgu, wdown in w.layers:
        assert [tuple(m.shape) for m in (wqkv, wo, wgu, wdown)] == [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)]
        assert all(m.dtype == torch.bfloat16 for m in (wqkv, wo, wgu, wdown))
    assert tuple(w.lm_head.shape) == (c.vocab_size, h)
    assert not torch.equal(w.layers[0][2], w.layers[1][2])  # a distinct matrix per layer
    assert w.nbytes() == 2 * (c.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + c.vocab_size * h)
    x = torch.randn(5, h, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = step(w, x, 3)
    assert got.shape == (3, c.vocab_size) and got.dtype == torch.bfloat16
    want = reference_logits(w, x, 3)
    assert rel_err(got, want) < 0.03
    # the reference tells a wrong chain apart: O fed from K/V's columns instead of Q's
    wrong = [(torch.cat([m[q:], m[:q]]), *rest) for m, *rest in w.layers]
    assert rel_err(step(type(w)(wrong, w.lm_head, q, f), x, 3), want) > 0.1
    # the residual stays near unit size through the chain (no norms): realistic activations for every matrix
    assert 0.3 < want.std().item() < 3 and torch.isfinite(got).all()


def test_quantize_rows_scales_each_row_to_e4m3s_range() -> None:
    a = torch.randn(16, 64).to(torch.bfloat16) * torch.logspace(-3, 3, 16)[:, None].to(torch.bfloat16)
    a[5] = 0  # a padding row
    aq, scale = quantize_rows(a, rowwise=True)
    assert aq.dtype == torch.float8_e4m3fn and scale.shape == (16, 1) and scale.dtype == torch.float32
    back = aq.float() * scale
    assert torch.all(back[5] == 0) and torch.isfinite(back).all()
    assert torch.all((back - a.float()).abs() <= 0.07 * a.float().abs() + scale * 2**-9)
    assert torch.allclose(aq.float().abs().amax(dim=1)[a.float().abs().amax(dim=1) > 0], torch.tensor(448.0))
    aq, scale = quantize_rows(a, rowwise=False)
    assert scale.shape == () and aq.float().abs().max().item() == 448.0


def test_the_quantization_kernel_matches_quantize_rows_in_the_interpreter() -> None:
    """The peer's one-launch activation quantization (a Triton kernel, run by the interpreter here) against the torch
    reference on fresh random rows of very different sizes (and a zero row): the same scale per row, and a / scale
    the same before the e4m3 cast (float32 output: the interpreter's own e4m3 cast rounds some values a binade
    off, which the GPU's does not: the GPU test checks the whole FP8 chain); e4m3 output with each row's largest
    value at 448."""
    code = textwrap.dedent("""
        import json, os, torch
        from bench.library_peer import quantize_rows, quantize_rows_kernel
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        wide = (torch.randn(6, 420, generator=g) * torch.logspace(-2, 2, 6)[:, None]).to(torch.bfloat16)
        wide[3, :300] = 0
        a = wide[:, :300]  # a column slice, as the step's O reads QKV's output: rows 420 apart
        q32, s = quantize_rows_kernel(a, torch.float32)
        q8, s8 = quantize_rows_kernel(a)
        rq, rs = quantize_rows(a, rowwise=True)
        print(json.dumps({"dtype": str(q8.dtype), "scale_err": max((s - rs).abs().max().item(),
                                                                   (s8 - rs).abs().max().item()),
                          "scaled_err": (q32 - a.float() / rs).abs().max().item(),
                          "row_max": q32.abs().amax(dim=1).tolist(),
                          "row_max8": q8.float().abs().amax(dim=1).tolist()}))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["dtype"] == "torch.float8_e4m3fn" and r["scale_err"] == 0.0, r
    assert r["scaled_err"] < 1e-4, r
    assert r["row_max"] == pytest.approx([448.0, 448.0, 448.0, 0.0, 448.0, 448.0]), r
    assert r["row_max8"] == [448.0, 448.0, 448.0, 0.0, 448.0, 448.0], r


@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_chain_matches_the_same_chain_on_its_dequantized_weights(rowwise: bool) -> None:
    if not has_cpu_scaled_mm():
        pytest.skip("this torch has no CPU _scaled_mm")
    c = TINY
    w = make_weights(c, "fp8", "cpu", rowwise=rowwise)
    layer = w.layers[0]
    assert all(isinstance(m, Fp8Weight) and m.data.dtype == torch.float8_e4m3fn for m in layer)
    assert layer[2].scale.shape == ((1, 2 * c.intermediate_size) if rowwise else ())
    x = torch.zeros(16, c.hidden_size, dtype=torch.bfloat16)  # 5 rows padded to 16
    x[:5] = torch.randn(5, c.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = step(w, x, 16)
    assert got.shape == (16, c.vocab_size) and torch.isfinite(got).all()
    assert torch.all(got[5:] == 0)  # padding rows stay zero
    deq = w.dequantized()
    assert rel_err(got[:5], step(deq, x, 16)[:5]) < 0.1  # only the activations' rounding apart
    assert rel_err(got[:5], reference_logits(deq, x, 5)) < 0.1


def test_the_decode_table_names_and_explains_the_peer() -> None:
    from bench.decode import markdown

    rec = {"model": "synthetic:tiny", "weights": "fp8", "batch": 64, "sampled_rows": 16, "layout": "mixed",
           "context": 128, "floor_ms": 0.5}
    doc = {"device": "GPU", "torch": "2.11", "triton": "3.6", "bandwidth": {"read_GBps": 3000, "copy_GBps": 2500},
           "records": [{**rec, "backend": "megakernel", "step_ms": 2.0, "floor_over_step": 0.25},
                       {**rec, "backend": BACKEND, "step_ms": 0.7, "floor_over_step": 0.7}]}
    md = markdown(doc)
    assert f"| megakernel | {BACKEND} |" in md and "| 2.000 (25%) | 0.700 (70%) |" in md
    assert "lower bound for a library-built step" in md
    doc["records"] = doc["records"][:1]
    assert "lower bound" not in markdown(doc)


def test_other_weight_formats_have_no_library_peer() -> None:
    assert library_peer(TINY, "int8", [1]) == {}


def has_cpu_scaled_mm() -> bool:
    probe = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(probe, probe.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_library_peer_records_per_row_count(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's bookkeeping on the CPU, its graph run eagerly: rows padded with FP8, the LM head's rows, the scaling
    and the FP8 logits' distance from bf16; a row count that fails is left out, the others still measured."""
    if fmt == "fp8" and not has_cpu_scaled_mm():
        pytest.skip("this torch has no CPU _scaled_mm")
    from bench import cuda_timing
    from bench import library_peer as lp

    ran: list[tuple[int, int]] = []

    class Eager:
        def __init__(self, fn) -> None:  # noqa: ANN001
            self.out = fn()
            ran.append(tuple(self.out.shape))

    def step_or_fail(w, x, head_rows):  # noqa: ANN001, ANN202
        if x.shape[0] == 48:
            raise RuntimeError("no 48")
        return step(w, x, head_rows)

    monkeypatch.setattr(cuda_timing, "graph_of", Eager)
    monkeypatch.setattr(cuda_timing, "time_graph", lambda g, reps: {"step_ms": 1.0, "step_ms_min": 0.9})
    monkeypatch.setattr(lp, "step", step_or_fail)
    res = library_peer(TINY, fmt, [1, 20, 48, 64], sampled=16, reps=3, device="cpu")
    assert sorted(res) == [1, 20, 64]  # 48 failed
    pad = {1: 1, 20: 20, 64: 64} if fmt == "bf16" else {1: 16, 20: 32, 64: 64}
    head = {1: 1, 20: 16, 64: 16} if fmt == "bf16" else {1: 16, 20: 16, 64: 16}
    assert ran == [(head[n], TINY.vocab_size) for n in res]
    for n, r in res.items():
        assert r["step_ms"] == 1.0 and r["library_rows"] == pad[n] and r["library_head_rows"] == head[n]
        assert r["library_weight_bytes"] == make_weights(TINY, fmt, "cpu").nbytes()
        if fmt == "fp8":
            assert r["library_scaling"] == "fp8-rowwise" and r["library_rel_err_vs_bf16"] < 0.1
        else:
            assert r["library_scaling"] == "bf16" and "library_rel_err_vs_bf16" not in r


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_library_peer_times_a_graph_per_row_count(fmt: str) -> None:
    res = library_peer(TINY, fmt, [1, 20], sampled=16, reps=5)
    assert sorted(res) == [1, 20]
    for n, r in res.items():
        assert r["step_ms"] > 0 and r["step_ms_min"] <= r["step_ms"]
        assert r["library_rows"] == (n if fmt == "bf16" else -(-n // 16) * 16)
        assert r["library_head_rows"] == (min(n, 16) if fmt == "bf16" else 16)
    if fmt == "fp8":
        assert res[1]["library_scaling"] in ("fp8-rowwise", "fp8-tensorwise")
        assert res[20]["library_rel_err_vs_bf16"] < 0.1
        if torch.cuda.get_device_capability() >= (9, 0):
            assert res[1]["library_scaling"] == "fp8-rowwise"
