"""The library peer of the decode bench (issue 29): a step's matrices as vendor-library calls in one CUDA graph.

    python -m bench.library_peer [--models llama-3.2-1b] [--weights bf16 fp8] [--rows 1 8 16 32 64] [--sampled 16]

Per layer the step's four matrices, QKV [q + 2 kv, hidden], O [hidden, q], gate/up [2 ffn, hidden] and down
[hidden, ffn], then the LM head [vocab, hidden] over the sampled rows only (the first min(rows, sampled)), as
cuBLAS bf16 (`F.linear`) or FP8 W8A8 (`torch._scaled_mm`, e4m3 x e4m3 into bf16: weights quantized beforehand
with a scale per output channel, activations quantized per row inside the graph with a dynamic scale, amax / 448,
by one Triton kernel per matrix input as vLLM's per-token quantization does (`quantize_rows_kernel`: a row's
amax, its scale and the e4m3 cast in one launch; their rows padded to a multiple of 16), captured in one CUDA
graph per row count and timed as bench/decode.py times its graphs (bench/cuda_timing.py). Where the installed
torch cannot scale row-wise, both scales are per tensor, quantized by torch's own kernels; each record says which
(`library_scaling`). Every layer has weights of its own (16 layers of
Llama-3.2-1B are 2.47 GB in bf16: nothing stays in L2) and the calls form one dependent chain, as a step does:
QKV's first q columns are O's input (attention's stand-in), silu(gate) * up is down's input, O and down add to
the residual, the LM head reads the last residual. Attention, norms, biases, RoPE and sampling are left out, so
the time is a lower bound for a step built from library calls; it does not depend on the context.
Weights are random (decode cost does not depend on their values), N(0, 1/fan-in), O and down further scaled by
1/sqrt(2 layers), so that the residual stays near unit size through the chain without norms.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench import cuda_timing
from service.model.config import ModelConfig

BACKEND = "library-matrices-cudagraph"
FORMATS = ("bf16", "fp8")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12


@dataclasses.dataclass
class Fp8Weight:
    """W ≈ data.float() * scale: data e4m3 [out, in]; scale float32 [1, out] (row-wise) or [] (per tensor)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def rowwise(self) -> bool:
        return self.scale.dim() == 2

    def dequantized(self) -> torch.Tensor:
        s = self.scale.reshape(-1, 1) if self.rowwise else self.scale
        return (self.data.float() * s).to(torch.bfloat16)


Matrix = torch.Tensor | Fp8Weight


@dataclasses.dataclass
class PeerWeights:
    """One step's matrices: per layer (QKV, O, gate/up, down), then the LM head; bf16 tensors or Fp8Weight."""

    layers: list[tuple[Matrix, Matrix, Matrix, Matrix]]
    lm_head: Matrix
    q_size: int
    ffn: int

    @property
    def fp8(self) -> bool:
        return isinstance(self.lm_head, Fp8Weight)

    def nbytes(self) -> int:
        def size(m: Matrix) -> int:
            return m.nbytes if isinstance(m, torch.Tensor) else m.data.nbytes + m.scale.nbytes

        return sum(size(m) for mats in self.layers for m in mats) + size(self.lm_head)

    def dequantized(self) -> PeerWeights:
        """The same weights in bf16 (FP8 ones dequantized): the reference for the FP8 arithmetic."""
        def deq(m: Matrix) -> torch.Tensor:
            return m.dequantized() if isinstance(m, Fp8Weight) else m

        return PeerWeights([tuple(deq(m) for m in mats) for mats in self.layers],  # type: ignore[misc]
                           deq(self.lm_head), self.q_size, self.ffn)


def quantize_weight(w: torch.Tensor, rowwise: bool) -> Fp8Weight:
    """e4m3 with a scale per output channel (row of w), or one for the whole matrix."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True) if rowwise else wf.abs().amax()
    scale = amax.clamp_min(EPS) / E4M3_MAX
    return Fp8Weight((wf / scale).to(E4M3), scale.reshape(1, -1) if rowwise else scale.reshape(()))


def quantize_rows(a: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: scale = amax / 448 per row ([rows, 1]) or per tensor ([]), data = a / scale
    in e4m3 (|a / scale| <= 448 by construction, nothing to clamp)."""
    if rowwise:
        amax = torch.linalg.vector_norm(a, math.inf, dim=1, keepdim=True, dtype=torch.float32)
    else:
        amax = torch.linalg.vector_norm(a, math.inf, dtype=torch.float32)
    scale = amax.clamp_min(EPS) / E4M3_MAX
    return (a / scale).to(E4M3), scale


def quantize_rows_kernel(a: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(a, rowwise=True) as one Triton launch (a program per row): what a library-built FP8 step pays
    to quantize each matrix input. a may be a column slice (rows a.stride(0) apart). (dtype: float32 leaves a / scale
    unrounded, for tests.)"""
    assert a.stride(1) == 1, "the columns of a row must be contiguous"
    rows, k = a.shape
    q = torch.empty(rows, k, device=a.device, dtype=dtype)
    scale = torch.empty(rows, 1, device=a.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    _quantize_rows[(rows,)](a, q, scale, a.stride(0), k, block, num_warps=8 if block >= 4096 else 4)
    return q, scale


_EPS, _E4M3_MAX = tl.constexpr(EPS), tl.constexpr(E4M3_MAX)  # as the kernel reads globals


@triton.jit
def _quantize_rows(a_ptr, q_ptr, scale_ptr, a_row_stride, K: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + row * a_row_stride + rk, mask=rk < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(a), axis=0), _EPS) / _E4M3_MAX
    tl.store(q_ptr + row * K + rk, (a / scale).to(q_ptr.dtype.element_ty), mask=rk < K)
    tl.store(scale_ptr + row, scale)


def matmul(a: torch.Tensor, w: Matrix) -> torch.Tensor:
    """a [rows, in] bf16 times w [out, in] transposed: cuBLAS bf16, or W8A8 `torch._scaled_mm` into bf16 (the
    activations quantized per row by one Triton kernel on a GPU)."""
    if isinstance(w, torch.Tensor):
        return F.linear(a, w)
    if w.rowwise and a.is_cuda:
        aq, sa = quantize_rows_kernel(a)
    else:
        aq, sa = quantize_rows(a, w.rowwise)
    out = torch._scaled_mm(aq, w.data.t(), sa, w.scale, out_dtype=torch.bfloat16)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 also returned the amax


def step(w: PeerWeights, x: torch.Tensor, head_rows: int) -> torch.Tensor:
    """The chain of one step's matrices from the residual x [rows, hidden] (bf16); the LM head over its first
    head_rows rows. Returns bf16 logits [head_rows, vocab]."""
    q, f = w.q_size, w.ffn
    for wqkv, wo, wgu, wdown in w.layers:
        qkv = matmul(x, wqkv)
        x = x + matmul(qkv[:, :q], wo)  # attention's stand-in: O reads q-size columns of QKV's output
        gu = matmul(x, wgu)
        x = x + matmul(F.silu(gu[:, :f]) * gu[:, f:], wdown)
    return matmul(x[:head_rows], w.lm_head)


def make_weights(config: ModelConfig, fmt: str, device: torch.device | str = "cuda", seed: int = 0,
                 rowwise: bool = True) -> PeerWeights:
    """Random matrices of the config's shapes, a distinct set per layer; FP8 quantized (row-wise or per tensor)."""
    if fmt not in FORMATS:
        raise ValueError(f"the library peer runs {FORMATS}, not {fmt!r}")
    c = config
    h, q, kv, f = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    gen = torch.Generator(device=device).manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * c.num_layers)

    def rand(n: int, k: int, scale: float = 1.0) -> Matrix:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16).mul_(scale / math.sqrt(k))
        return w if fmt == "bf16" else quantize_weight(w, rowwise)

    layers = [(rand(q + 2 * kv, h), rand(h, q, out_scale), rand(2 * f, h), rand(h, f, out_scale))
              for _ in range(c.num_layers)]
    return PeerWeights(layers, rand(c.vocab_size, h), q, f)


def fp8_rowwise_works(device: torch.device | str = "cuda") -> bool:
    """Whether this torch scales `_scaled_mm` row-wise here (SM90 CUTLASS on CUDA), checked against bf16."""
    try:
        gen = torch.Generator(device=device).manual_seed(1)
        a = torch.randn(16, 64, generator=gen, device=device, dtype=torch.bfloat16)
        w = torch.randn(32, 64, generator=gen, device=device, dtype=torch.bfloat16)
        got = matmul(a, quantize_weight(w, True)).float()
        want = a.float() @ w.float().t()
        return bool(((got - want).norm() / want.norm()).item() < 0.1)
    except Exception as e:  # noqa: BLE001
        print(f"library peer: row-wise torch._scaled_mm unavailable ({repr(e)[:200]}); scaling per tensor", flush=True)
        return False


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """The worst row's relative L2 distance of x from y."""
    x, y = x.float(), y.float()
    return ((x - y).norm(dim=-1) / y.norm(dim=-1)).max().item()


def library_peer(config: ModelConfig, fmt: str, rows: Sequence[int], sampled: int = 16, reps: int = 200,
                 seed: int = 0, device: str = "cuda") -> dict[int, dict]:
    """Per row count: the step's matrices as library calls in one CUDA graph, timed (`time_graph`'s step_ms,
    step_ms_min, step_ms_back_to_back) with `library_rows` (rows the matrices ran: padded to 16 with FP8),
    `library_head_rows`, `library_scaling` (bf16, fp8-rowwise or fp8-tensorwise), `library_weight_bytes` and, with
    FP8, `library_rel_err_vs_bf16` (its logits against the same chain in bf16 on the dequantized weights).
    Weights other than bf16 and fp8 get {}. A failure prints and yields what was measured (never raises)."""
    if fmt not in FORMATS:
        return {}
    out: dict[int, dict] = {}
    try:
        _measure(config, fmt, rows, sampled, reps, seed, device, out)
    except Exception as e:  # noqa: BLE001
        print(f"library peer {config.name} {fmt} failed: {repr(e)[:500]}", flush=True)
    torch.cuda.empty_cache()  # its weights (gone with _measure's frame) and graphs
    return out


def _measure(config: ModelConfig, fmt: str, rows: Sequence[int], sampled: int, reps: int, seed: int, device: str,
             out: dict[int, dict]) -> None:
    rowwise = fp8_rowwise_works(device) if fmt == "fp8" else True
    scaling = "bf16" if fmt == "bf16" else "fp8-rowwise" if rowwise else "fp8-tensorwise"
    w = make_weights(config, fmt, device, seed, rowwise)
    ref = w.dequantized() if w.fp8 else None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for n in rows:
        try:
            pad = -(-n // 16) * 16 if w.fp8 else n
            head = min(n, sampled)
            head_pad = -(-head // 16) * 16 if w.fp8 else head
            x = torch.zeros(pad, config.hidden_size, device=device, dtype=torch.bfloat16)
            x[:n] = torch.randn(n, config.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
            extra: dict[str, object] = {}
            with torch.inference_mode():
                if ref is not None:
                    extra["library_rel_err_vs_bf16"] = rel_err(step(w, x, head_pad)[:head],
                                                                step(ref, x, head_pad)[:head])
                g = cuda_timing.graph_of(lambda: step(w, x, head_pad))  # noqa: B023
            res = cuda_timing.time_graph(g, reps)
            del g
            out[n] = {**res, "library_rows": pad, "library_head_rows": head_pad, "library_scaling": scaling,
                      "library_weight_bytes": w.nbytes(), **extra}
            print(f"library peer {config.name} {fmt} rows={n:3d} ({scaling}, {pad} rows, head {head_pad}): "
                  f"{res['step_ms']:.4f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"library peer {config.name} {fmt} rows={n} failed: {repr(e)[:500]}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Only this peer, quickly (no megakernel, no file): its times per model, weights and row count."""
    from service.model.synthetic import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b"], choices=sorted(SHAPES))
    ap.add_argument("--weights", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    ap.add_argument("--sampled", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for model in args.models:
        for fmt in args.weights:
            res = library_peer(SHAPES[model], fmt, args.rows, args.sampled, args.reps)
            print(f"{model} {fmt}: " + ", ".join(f"{n} rows {r['step_ms']:.3f} ms" for n, r in res.items()),
                  flush=True)


if __name__ == "__main__":
    main()
