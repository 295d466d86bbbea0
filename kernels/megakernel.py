"""The megakernel: one persistent Triton launch runs a whole decode step by executing the schedule that
kernels/instructions.py builds. The kernel only interprets task records; every decision of who does what is on
the host, once per model and row bucket.

A step is a list of rows (slot, token, position). Rows are independent: several rows of one sequence at consecutive
positions (a prompt's chunk) ride beside decode rows. Every QKV task (which appends each row's K/V at its position)
finishes before any attention task starts, so a row at position p attends over [0, p] of its slot including the
K/V of the same step's earlier rows: causal attention within a chunk. Only the first `lm_rows` rows (the rows that
need a token: the caller puts them first) go through the LM head, the sampling and the argmax; their number is fixed
per row bucket (min(bucket, the Megakernel's max_sampled)), so each bucket's launch has a fixed shape.

Numerics follow the PyTorch reference (service/backends/reference.py): activations are rounded to the activations'
dtype where the reference rounds them (after each linear, RoPE, SiLU and residual add), and every sum is
accumulated in float32. One reordering: RMSNorm(x) @ W^T is computed as rstd * ((x * norm_weight) @ W^T). The
tasks that write the residual stream also write x * norm_weight of the next norm, so a consumer's matvec streams a
ready operand, and computes rstd from x itself (no atomics anywhere in the arithmetic: a step is deterministic).

Weights are bf16; or FP8 (e4m3) with one float32 scale per output row, converted in registers after the load and
scaled in the epilogue; or int8, converted by bit manipulation, with one float32 scale per output row (scaled in the
epilogue) or one float16 scale per block of 32 columns (GGUF's Q8_0; scaled per k slice of the dot: _weight_dot):
the same tensor-core dot streams half the bytes.

Synchronisation: a task spins on a volatile load of its counter, then takes an acquire atomic; a finished task
passes a CTA barrier and adds one to its counter with release semantics. Activations are read with `.cg` (L2,
never a stale L1 line). The last task (Argmax) zeroes the counters, so a CUDA graph can replay the launch. A wait
that spins too long sets an error flag (Megakernel.err) and the step finishes instead of hanging.

Matvecs use tensor cores (`tl.dot`) with the rows as M, padded only to the bucket; each weight tile is accumulated
as k_slices independent k-slices (a batched dot, one slice per warp) and summed in the epilogue. The tiles are a
function of the bucket (default_tiles): wide buckets reread their activations per weight tile, so they stream
wider tiles over shorter k chunks.

Sampling happens in the same launch: where a row samples, each LM-head task reduces the Gumbel-perturbed logits
of its columns (kernels/sampling.py) after its stream, and Argmax reduces those partials next to the greedy ones.

The kernel's arguments are NamedTuples (Triton passes their fields by name: `MODEL.head_dim`, `ws.scale`); an
operand a model or a weight format lacks is None (no QKV bias, no FP8 scales, no descriptor where a matvec loads
through pointers), and the code that would read it is not compiled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels import instructions as I
from kernels.instructions import Op
from kernels.sampling import gumbel_best

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INT8_BLOCK = 32  # columns per scale of int8 weights (GGUF's Q8_0)
I8_BLOCK = tl.constexpr(INT8_BLOCK)  # the same, as the kernel reads a global


@dataclass
class PackedWeights:
    """The model's tensors in the layout the kernel reads (layer-stacked, out × in). With FP8, the matrices are
    float8_e4m3fn and `scales` holds each one's float32 scale per output row ([L, rows], [V] for the LM head). With
    int8, `scales` holds a float32 scale per output row as FP8's, or a float16 scale per block of INT8_BLOCK
    columns, block-major ([K / 32, L, rows], [K / 32, V] for the LM head): a layer's first scale is at layer × rows as
    with FP8's, and a k slice's scales of a tile's consecutive rows are contiguous. The embedding table stays in the
    activations' dtype (it is looked up, not streamed)."""

    embed: torch.Tensor  # [V, H]
    wqkv: torch.Tensor  # [L, q + 2 kv, H]
    bqkv: torch.Tensor | None  # [L, q + 2 kv]
    wo: torch.Tensor  # [L, H, q]
    w_gate: torch.Tensor  # [L, F, H]
    w_up: torch.Tensor  # [L, F, H]
    w_down: torch.Tensor  # [L, H, F]
    attn_norm: torch.Tensor  # [L, H]
    mlp_norm: torch.Tensor  # [L, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    scales: dict[str, torch.Tensor] | None = None  # "qkv", "o", "gate", "up", "down", "lm_head"

    MATRICES = ("qkv", "o", "gate", "up", "down", "lm_head")

    def matrix(self, name: str) -> torch.Tensor:
        return {"qkv": self.wqkv, "o": self.wo, "gate": self.w_gate, "up": self.w_up, "down": self.w_down,
                "lm_head": self.lm_head}[name]

    @property
    def fp8(self) -> bool:
        return self.wqkv.dtype == torch.float8_e4m3fn

    @property
    def int8(self) -> bool:
        return self.wqkv.dtype == torch.int8

    @property
    def int8_blocks(self) -> bool:
        """int8 with a scale per block of INT8_BLOCK columns (not per row)."""
        return self.int8 and self.scales is not None and self.scales["qkv"].dtype == torch.float16

    def nbytes(self) -> int:
        """What one decode step streams: every matrix (and scale) once, the norms."""
        mats = sum(self.matrix(n).numel() * self.matrix(n).element_size() for n in self.MATRICES)
        scales = sum(s.numel() * s.element_size() for s in (self.scales or {}).values())
        norms = sum(t.numel() * t.element_size() for t in (self.attn_norm, self.mlp_norm, self.final_norm))
        return mats + scales + norms

    def regions(self) -> dict[str, tuple[int, int, int]]:
        """Address, bytes per layer and bytes per element of each matrix, for the schedule's prefetch hints."""
        def r(t: torch.Tensor, layered: bool = True) -> tuple[int, int, int]:
            return t.data_ptr(), t[0].numel() * t.element_size() if layered else 0, t.element_size()

        return {n: r(self.matrix(n), n != "lm_head") for n in self.MATRICES}


# ---------------------------------------------------------------------------------------------------------------
# the kernel's named arguments


class MatvecTile(NamedTuple):
    """How one matvec streams its weights (a constexpr of the kernel): rows per tile, k chunk per pipeline stage,
    independent k slices of the dot, pipeline stages, row tiles kept on their way into L2 ahead of the stream
    (0: none), whether the tensor-memory accelerator loads the weights (descriptors) instead of pointers, whether
    K's two halves stream side by side (matvecs of one run of rows: OPROJ, DOWN, LM head), and how many tasks
    share each tile's K (split K: wide tiles while every program still streams)."""

    rows: int = 16
    k_chunk: int = 256
    k_slices: int = 4
    stages: int = 4
    prefetch_tiles: int = 0
    tma: bool = False
    k_halves: bool = False
    k_splits: int = 1  # parts of K, each a task of one tile (the last to arrive adds them up: instructions.py)
    swap: bool = False  # the weights as the dot's wide side (M), the step's rows (padded to 16) as N; one k slice


class ModelShape(NamedTuple):
    """The model's shapes (constexpr)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int


class AttnShape(NamedTuple):
    """Attention's constexprs: the query heads of a KV head padded to a power of two, positions per inner step,
    splits per (row, KV head) at most, chunks a split reads at least."""

    group_pad: int
    chunk: int
    max_splits: int
    split_min_chunks: int


class Sched(NamedTuple):
    tasks: torch.Tensor  # int64 [tasks, RECORD_LEN]
    starts: torch.Tensor  # int32 [programs + 1]
    counters: torch.Tensor  # int32 dependency counters (Layout)
    err: torch.Tensor  # int32 [1]: a wait timed out
    prof: torch.Tensor | None  # int64 [tasks, 4] (start, ready, end, SM) where profiling
    k_sums: torch.Tensor  # float32 partial sums of split-K tiles (KSplit.sums)


class StepInputs(NamedTuple):
    tokens: torch.Tensor  # int32 [rows]
    slots: torch.Tensor  # int32 [rows]
    positions: torch.Tensor  # int32 [rows]
    draw: torch.Tensor  # int32 [4, rows]: temperature's float32 bits (0: greedy), seed's low and high words, and
    # whether the row's logits go through its grammar mask (1) or not (0)
    masks: torch.Tensor  # int32 [lm rows, ceil(vocab / 32)]: the tokens a grammar allows, a bit each (masked rows)


class Weights(NamedTuple):
    embed: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor


class Scales(NamedTuple):
    """8-bit weights' scales: FP8's float32 per output row, int8's float16 per block (PackedWeights)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    lm_head: torch.Tensor


class Cache(NamedTuple):
    k: torch.Tensor  # [layers, slots, kv heads, context, head_dim]
    v: torch.Tensor
    slots: int
    context: int


class Activations(NamedTuple):
    x: torch.Tensor  # [rows, H] the residual stream
    xn: torch.Tensor  # [rows, H] x * the next norm's weight
    q: torch.Tensor  # [rows, q] RoPE'd queries
    attn: torch.Tensor  # [rows, q]
    ffn: torch.Tensor  # [rows, F]
    logits: torch.Tensor  # float32 [lm rows, V]


class AttnScratch(NamedTuple):
    """Partials of the attention splits: running max, sum and output per (row, KV head, split, query head)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


class LmPartials(NamedTuple):
    """Each LM-head task's (max, argmax) per row: greedy, then drawn."""

    gmax: torch.Tensor
    gidx: torch.Tensor
    smax: torch.Tensor
    sidx: torch.Tensor


class KSplit(NamedTuple):
    """What a split-K matvec task needs beyond its rows: its part of K, its tile's arrival counter and scratch slot,
    the counters and the scratch of float32 partial sums ([slots, parts, runs, BPAD, rows per run])."""

    part: Any
    arrive: Any
    slot: Any
    counters: Any
    sums: Any


class StepOutputs(NamedTuple):
    argmax: torch.Tensor  # int64 [lm rows]
    sampled: torch.Tensor  # int64 [lm rows]


class MatvecWeights(NamedTuple):
    """One matvec's weights, built in the kernel for this layer: the matrix (and the second run's: QKV's same
    matrix, gate/up's up; None where one run streams), FP8 scales (None: bf16), QKV's bias (None: none), the
    tensor descriptors where TMA loads (None: pointers) and this layer's first row in them."""

    w: Any
    w2: Any
    scale: Any
    scale2: Any
    bias: Any
    desc: Any
    desc2: Any
    drow: Any


class QkvOut(NamedTuple):
    """Where QKV's epilogue puts q, k and v, and what RoPE reads."""

    q: Any
    cache: Any
    cos: Any
    sin: Any
    slots: Any
    positions: Any


class LmOut(NamedTuple):
    """Where the LM head's epilogue puts the logits, and the grammar masks it applies first (per row, where flagged)."""

    logits: Any
    masks: Any
    masked: Any


class ResidualOut(NamedTuple):
    """Where OPROJ's and DOWN's epilogue adds to the residual stream, and the next norm's weight."""

    x: Any
    xn: Any
    norm_weight: Any


# ---------------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _ld_act(ptr, mask, CG: tl.constexpr, other=0.0):
    """Activations written by other programs in this launch: read through L2."""
    if CG:
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _wait(cnt_ptr, idx, target, err_ptr, MAX_SPIN: tl.constexpr):
    if idx >= 0:
        spins = 0
        while (tl.load(cnt_ptr + idx, volatile=True) < target) & (spins < MAX_SPIN):
            spins += 1
            if spins % 1024 == 0:  # once any wait has failed, stop waiting: finish fast and report
                if tl.load(err_ptr, volatile=True) != 0:
                    spins = MAX_SPIN
        seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire", scope="gpu")
        if seen < target:
            tl.atomic_add(err_ptr, 1)  # a dependency never came: report instead of hanging
    tl.debug_barrier()


@triton.jit
def _prefetch(rec):
    """Bulk-prefetch a task's two weight regions into L2: one instruction each, from threads 0 and 1."""
    lane = tl.arange(0, 2)
    second = lane == 1
    addr = tl.where(second, tl.load(rec + I.F_PF1), tl.load(rec + I.F_PF0))
    size = tl.where(second, tl.load(rec + I.F_PF1_BYTES), tl.load(rec + I.F_PF0_BYTES)).to(tl.int32)
    _prefetch_l2(addr, size, lane)


@triton.jit
def _prefetch_l2(addr, size, lane):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `addr` (int64) from the thread whose id is `lane` (size > 0)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, $3; setp.gt.s32 q, $2, 0; "
        "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, lane], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rstd(ssq_ptr, B, eps, H: tl.constexpr, R: tl.constexpr, STRIDE: tl.constexpr, CG: tl.constexpr):
    """1 / RMS of each of the first R rows of x, from the H/16 partial sums of squares per row that x's writers left
    at ssq_ptr (STRIDE rows apart; summed in a fixed order, whatever wrote them when)."""
    NP: tl.constexpr = H // I.SSQ_COLS
    NPP: tl.constexpr = triton.next_power_of_2(NP)
    rp = tl.arange(0, NPP)
    rb = tl.arange(0, R)
    parts = _ld_act(ssq_ptr + rp[:, None] * STRIDE + rb[None, :], (rp[:, None] < NP) & (rb[None, :] < B), CG)
    return tl.rsqrt(tl.sum(parts, axis=0) / H + eps)


@triton.jit
def _norm_operand(y, m, rb, n0, xn_ptr, nw_ptr, ssq_ptr, dt: tl.constexpr, N: tl.constexpr, BPAD: tl.constexpr,
                  BN: tl.constexpr):
    """For the columns [n0, n0 + BN) of x this task wrote (y): the next norm's operand x * norm_weight (rounded to
    dt), and their sums of squares, one partial per 16 columns and row, at ssq_ptr."""
    rn = n0 + tl.arange(0, BN)
    yf = y.to(tl.float32)
    nw = tl.load(nw_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(xn_ptr + rb[:, None] * N + rn[None, :], (yf * nw[None, :]).to(dt), mask=m)
    NPT: tl.constexpr = BN // I.SSQ_COLS
    sq = tl.reshape(tl.where(m, yf * yf, 0.0), [BPAD, NPT, I.SSQ_COLS])
    rp = n0 // I.SSQ_COLS + tl.arange(0, NPT)
    tl.store(ssq_ptr + rp[None, :] * BPAD + rb[:, None], tl.sum(sq, axis=2), mask=rp[None, :] < N // I.SSQ_COLS)


@triton.jit
def _tile_rows(OP: tl.constexpr, n0, MODEL: tl.constexpr, BN: tl.constexpr):
    """The weight rows of the tile at n0: (first run, second run), BN rows each. A QKV tile streams two runs side by
    side: in a q or k head, rows d.. and the rows d + head_dim/2.. they rotate with under RoPE; in v, two consecutive
    runs. Gate/up's second run is the same rows of the up matrix; other matvecs stream one."""
    rn = tl.arange(0, BN)
    if OP == I.QKV:
        D: tl.constexpr = MODEL.head_dim
        ROT: tl.constexpr = (MODEL.heads + MODEL.kv_heads) * D  # q and k rows are rotated, v rows are not
        lo = tl.where(n0 < ROT, n0 - n0 % D + (n0 % D) // 2, n0)
        hi = lo + tl.where(n0 < ROT, D // 2, BN)
        return lo + rn, hi + rn
    else:
        return n0 + rn, n0 + rn


@triton.jit
def _load_tile(w_ptr, desc, drow, rows, k0, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               KS: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr):
    """The weight tile [KS, BN, BK/KS] of `rows` (consecutive) and columns [k0, k0 + BK): through the tensor-memory
    accelerator (desc: the layer-stacked matrix as [L*N, K], this layer's rows from drow), or as pointer loads."""
    BKS: tl.constexpr = BK // KS
    if TMA:  # descriptor coordinates are int32
        w = desc.load([(drow + tl.min(rows, axis=0)).to(tl.int32), k0.to(tl.int32)])
        return tl.permute(tl.reshape(w, [BN, KS, BKS]), (1, 0, 2))
    else:
        rk = k0 + tl.arange(0, KS)[:, None] * BKS + tl.arange(0, BKS)[None, :]  # [KS, BKS]
        w_off = rows[None, :, None] * K + rk[:, None, :]  # [KS, BN, BKS]
        if EVEN:  # no masks in the hot loop: fewer instructions per byte streamed
            return tl.load(w_ptr + w_off)
        else:
            return tl.load(w_ptr + w_off, mask=(rows[None, :, None] < N) & (rk[:, None, :] < K), other=0.0)


@triton.jit
def _int8_f16(w):
    """int8 → float16 exactly, by bits instead of a conversion instruction per element: the float16 with bits
    0x6400 + (b + 128) is 1024 + (b + 128), so one integer add and one float16 subtraction of 1152 leave b."""
    return (w.to(tl.int16) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _weight_dot(a, w, acc, scale, rows, k0, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                SB_STRIDE: tl.constexpr, EVEN: tl.constexpr, DOT_T: tl.constexpr, W_INT8: tl.constexpr):
    """acc + the dot of the activation tile a [KS, BPAD, BK/KS] with the weight tile w [KS, BN, BK/KS], per k slice.
    int8 weights with block scales (float16 at `scale`, block j of row r at j × SB_STRIDE + r): the dot runs on the
    integers (exact in float16) and each slice's float32 result is scaled by its block's scale: the weights stay
    exact (scaling the tile before the dot would round each weight to float16), for one multiply per (row, output)
    a slice, as many as that would cost per pair of weights while the dot's M is padded to 16, and fewer at 32+
    rows (one-block chunks). So a slice is at most one block: BK/KS divides INT8_BLOCK. Row scales (float32) wait
    for the epilogue, as FP8's."""
    if W_INT8 and scale.dtype.element_ty == tl.float16:
        BKS: tl.constexpr = BK // KS
        tl.static_assert(I8_BLOCK % BKS == 0, "int8 weights: a k slice (k_chunk / k_slices) within one block")
        part = tl.dot(a, tl.permute(_int8_f16(w), (0, 2, 1)))
        blk = (k0 + tl.arange(0, KS) * BKS) // I8_BLOCK  # [KS]
        s_ptrs = scale + blk[:, None] * SB_STRIDE + rows[None, :]  # [KS, BN]
        if EVEN:
            s = tl.load(s_ptrs)
        else:
            s = tl.load(s_ptrs, mask=(blk[:, None] < K // I8_BLOCK) & (rows[None, :] < N), other=0.0)
        return acc + part * s.to(tl.float32)[:, None, :]
    elif W_INT8:
        return tl.dot(a, tl.permute(_int8_f16(w), (0, 2, 1)), acc)
    else:
        return tl.dot(a, tl.permute(w.to(DOT_T), (0, 2, 1)), acc)


@triton.jit
def _qkv_out(lo, hi, rows, rows2, rb, B, layer, out, dt: tl.constexpr, MODEL: tl.constexpr):
    """QKV's epilogue on the tile's two runs [rows, BN] (float32, bias added): RoPE on q and k rows at each row's
    position (run one holds x[d], run two x[d + head_dim/2]), q to the attention's input, k and v into the KV cache
    at the row's (slot, position)."""
    KVH: tl.constexpr = MODEL.kv_heads
    D: tl.constexpr = MODEL.head_dim
    Q: tl.constexpr = MODEL.heads * D
    KV: tl.constexpr = KVH * D
    HALF: tl.constexpr = D // 2
    live = rb < B
    pos = tl.load(out.positions + rb, mask=live, other=0)
    lo = lo.to(dt).to(tl.float32)  # the linear's output, rounded where the reference rounds it
    hi = hi.to(dt).to(tl.float32)
    first = tl.min(rows, axis=0)
    if first < Q + KV:
        fi = rows % HALF
        c = tl.load(out.cos + pos[:, None] * HALF + fi[None, :]).to(dt).to(tl.float32)
        s = tl.load(out.sin + pos[:, None] * HALF + fi[None, :]).to(dt).to(tl.float32)
        lo, hi = lo * c - hi * s, hi * c + lo * s
    m = live[:, None] & (rows[None, :] < Q + 2 * KV)
    if first < Q:
        tl.store(out.q + rb[:, None] * Q + rows[None, :], lo.to(dt), mask=m)
        tl.store(out.q + rb[:, None] * Q + rows2[None, :], hi.to(dt), mask=m)
    else:
        cache = out.cache
        ctx = cache.context
        slot = tl.load(out.slots + rb, mask=live, other=0).to(tl.int64)
        base = (layer * cache.slots + slot[:, None]) * KVH * ctx * D + pos[:, None].to(tl.int64) * D
        r1, r2 = (rows - Q) % KV, (rows2 - Q) % KV
        o1 = base + ((r1 // D) * ctx * D + r1 % D)[None, :]
        o2 = base + ((r2 // D) * ctx * D + r2 % D)[None, :]
        if first < Q + KV:
            tl.store(cache.k + o1, lo.to(dt), mask=m)
            tl.store(cache.k + o2, hi.to(dt), mask=m)
        else:
            tl.store(cache.v + o1, lo.to(dt), mask=m)
            tl.store(cache.v + o2, hi.to(dt), mask=m)


@triton.jit
def _lm_out(lg, rows, rb, B, best_v, best_i, out, N: tl.constexpr):
    """LMHEAD's epilogue: the logits (float32, rounded to the activations' dtype first as the reference's are), with
    the tokens a flagged row's grammar does not allow at -inf (so the greedy choice, the draw and whoever reads the
    logits see only allowed tokens), and the running (max, first argmax) of the task's tiles."""
    m = (rb[:, None] < B) & (rows[None, :] < N)
    flags = tl.load(out.masked + rb, mask=rb < B, other=0)
    if tl.max(flags, axis=0) > 0:
        W: tl.constexpr = (N + 31) // 32
        words = tl.load(out.masks + rb[:, None] * W + rows[None, :] // 32, mask=m & (flags[:, None] > 0), other=-1)
        lg = tl.where(((words >> (rows[None, :] % 32)) & 1) != 0, lg, float("-inf"))
    tl.store(out.logits + rb[:, None] * N + rows[None, :], lg, mask=m)
    lg = tl.where(rows[None, :] < N, lg, float("-inf"))
    mx = tl.max(lg, axis=1)
    idx = tl.min(tl.where(lg == mx[:, None], rows[None, :], N), axis=1).to(tl.int32)  # first index of the max
    take = mx > best_v  # tiles come in increasing order: ties keep the earlier index
    return tl.where(take, mx, best_v), tl.where(take, idx, best_i)


@triton.jit
def _epilogue(OP: tl.constexpr, rows, rows2, acc, acc2, rstd, best_v, best_i, B, layer, ws, out, ssq_ptr,
              dt: tl.constexpr, MODEL: tl.constexpr, N: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr,
              CG: tl.constexpr):
    """What a matvec does with a finished tile: float32 sums [BPAD, BN] of its rows (and acc2: QKV's second run,
    gate/up's up). out: QkvOut (QKV), ResidualOut (OPROJ, DOWN), the ffn buffer (GATEUP), LmOut (LMHEAD)."""
    rb = tl.arange(0, BPAD)
    if ws.scale is not None:
        if ws.scale.dtype.element_ty == tl.float32:  # one scale per output row (int8 blocks: per k slice, float16)
            acc = acc * tl.load(ws.scale + rows, mask=rows < N, other=0.0)[None, :]
            if ws.scale2 is not None:
                acc2 = acc2 * tl.load(ws.scale2 + rows2, mask=rows2 < N, other=0.0)[None, :]
    m = (rb[:, None] < B) & (rows[None, :] < N)
    if OP == I.QKV:
        lo = acc * rstd[:, None]
        hi = acc2 * rstd[:, None]
        if ws.bias is not None:
            lo += tl.load(ws.bias + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
            hi += tl.load(ws.bias + rows2, mask=rows2 < N, other=0.0).to(tl.float32)[None, :]
        _qkv_out(lo, hi, rows, rows2, rb, B, layer, out, dt, MODEL)
    elif OP == I.GATEUP:
        gate = (acc * rstd[:, None]).to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        tl.store(out + rb[:, None] * N + rows[None, :], (act * (acc2 * rstd[:, None]).to(dt).to(tl.float32))
                 .to(dt), mask=m)
    elif OP == I.LMHEAD:
        best_v, best_i = _lm_out((acc * rstd[:, None]).to(dt).to(tl.float32), rows, rb, B, best_v, best_i, out, N)
    else:  # OPROJ, DOWN: the residual stream x += acc, and the next norm's operand and sums of squares
        ptrs = out.x + rb[:, None] * N + rows[None, :]
        y = (_ld_act(ptrs, m, CG).to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
        tl.store(ptrs, y, mask=m)
        _norm_operand(y, m, rb, tl.min(rows, axis=0), out.xn, out.norm_weight, ssq_ptr, dt, N, BPAD, BN)
    return best_v, best_i


@triton.jit
def _operand(a_ptr, rb, rk, B, rstd, K: tl.constexpr, EVEN: tl.constexpr, DOT_T: tl.constexpr, PRE_NORM: tl.constexpr,
             CG: tl.constexpr):
    """The activation tile [KS, BPAD, BK/KS] at columns rk, as the dot takes it (scaled by rstd first where the
    dot runs in float16: FP8 weights)."""
    a_ptrs = a_ptr + rb[None, :, None] * K + rk[:, None, :]
    if EVEN:
        a = _ld_act(a_ptrs, rb[None, :, None] < B, CG)
    else:
        a = _ld_act(a_ptrs, (rb[None, :, None] < B) & (rk[:, None, :] < K), CG)
    if PRE_NORM:
        a = a.to(tl.float32) * rstd[None, :, None]
    return a.to(DOT_T)


@triton.jit
def _k_merge(sums, sums2, ks, PARTS: tl.constexpr, TWO: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr,
             CG: tl.constexpr):
    """Split K: leave this task's float32 sums of the tile (and its second run's) in the tile's scratch slot and
    arrive on the tile's counter. The last task to arrive gets the whole sums back, added in part order (the same
    bits whichever task comes last), and 1; the others zeros and 0."""
    rb = tl.arange(0, BPAD)
    rn = tl.arange(0, BN)
    RUN: tl.constexpr = BPAD * BN
    PER: tl.constexpr = (2 if TWO else 1) * RUN
    base = ks.sums + ks.slot * (PARTS * PER)
    off = rb[:, None] * BN + rn[None, :]
    tl.store(base + ks.part * PER + off, sums)
    if TWO:
        tl.store(base + ks.part * PER + RUN + off, sums2)
    tl.debug_barrier()  # every thread's sums stored before the arrival is released
    arrived = tl.atomic_add(ks.counters + ks.arrive, 1, sem="acq_rel", scope="gpu")
    last = arrived == PARTS - 1
    tot = tl.zeros([BPAD, BN], tl.float32)
    tot2 = tl.zeros([BPAD, BN], tl.float32)
    if last:
        every = rb[:, None] < BPAD
        for p in tl.static_range(PARTS):
            tot += _ld_act(base + p * PER + off, every, CG)
            if TWO:
                tot2 += _ld_act(base + p * PER + RUN + off, every, CG)
    return tot, tot2, last


@triton.jit
def _finish_tile(OP: tl.constexpr, rows, rows2, sums, sums2, rstd, best_v, best_i, B, layer, ws, out, ssq_ptr, ks,
                 PARTS: tl.constexpr, dt: tl.constexpr, MODEL: tl.constexpr, N: tl.constexpr, BPAD: tl.constexpr,
                 BN: tl.constexpr, CG: tl.constexpr):
    """A tile's float32 sums [BPAD, BN] are complete (or, with K split, this task's part is): the epilogue, by the
    last part to arrive where K is split."""
    if PARTS > 1:
        sums, sums2, mine = _k_merge(sums, sums2, ks, PARTS, (OP == I.GATEUP) or (OP == I.QKV), BPAD, BN, CG)
        if mine:
            best_v, best_i = _epilogue(OP, rows, rows2, sums, sums2, rstd, best_v, best_i, B, layer, ws, out, ssq_ptr,
                                       dt, MODEL, N, BPAD, BN, CG)
    else:
        best_v, best_i = _epilogue(OP, rows, rows2, sums, sums2, rstd, best_v, best_i, B, layer, ws, out, ssq_ptr,
                                   dt, MODEL, N, BPAD, BN, CG)
    return best_v, best_i


@triton.jit
def _swapped_tile(w_ptr, desc, drow, rows, k0, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, DOT_T: tl.constexpr,
                  W_INT8: tl.constexpr):
    """The weight tile [BN, BK] of `rows` and columns [k0, k0 + BK), in the dot's type (8-bit converted)."""
    if TMA:
        w = desc.load([(drow + tl.min(rows, axis=0)).to(tl.int32), k0.to(tl.int32)])
    else:
        rk = k0 + tl.arange(0, BK)
        if EVEN:
            w = tl.load(w_ptr + rows[:, None] * K + rk[None, :])
        else:
            w = tl.load(w_ptr + rows[:, None] * K + rk[None, :], mask=(rows[:, None] < N) & (rk[None, :] < K),
                        other=0.0)
    if W_INT8:
        return _int8_f16(w)
    return w.to(DOT_T)


@triton.jit
def _matvec_swapped(OP: tl.constexpr, row0, tiles, kc0, B, layer, ws, a_ptr, ssq_ptr, out, rstd, rstd_out, best_v,
                    best_i, ks, dt: tl.constexpr, MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                    TILE: tl.constexpr, BPAD: tl.constexpr, KB: tl.constexpr, DOT_T: tl.constexpr,
                    PRE_NORM: tl.constexpr, W_INT8: tl.constexpr, CG: tl.constexpr):
    """_matvec's stream with the operands swapped (as Marlin and vLLM's small-batch kernels do): acc [BN, BPAD] =
    W [BN, BK] @ a^T [BK, BPAD], so the weight tile is the dot's wide side and each activation chunk feeds all BN
    weight rows; one k slice, the rows padded to a tensor-core side (BPAD >= 16)."""
    BN: tl.constexpr = TILE.rows
    BK: tl.constexpr = TILE.k_chunk
    ROWS2: tl.constexpr = (OP == I.GATEUP) or (OP == I.QKV)
    TR: tl.constexpr = 2 * BN if OP == I.QKV else BN
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    rb = tl.arange(0, BPAD)
    acc = tl.zeros([BN, BPAD], tl.float32)
    acc2 = tl.zeros([BN, BPAD], tl.float32)
    for it in tl.range(0, tiles * KB, num_stages=TILE.stages):
        sub = it // KB
        kb = it - sub * KB
        n0 = row0 + sub * TR
        rows, rows2 = _tile_rows(OP, n0, MODEL, BN)
        k0 = (kc0 + kb) * BK
        rk = k0 + tl.arange(0, BK)
        a_ptrs = a_ptr + rb[None, :] * K + rk[:, None]  # a^T [BK, BPAD]
        if EVEN:
            a = _ld_act(a_ptrs, rb[None, :] < B, CG)
        else:
            a = _ld_act(a_ptrs, (rb[None, :] < B) & (rk[:, None] < K), CG)
        if PRE_NORM:
            a = a.to(tl.float32) * rstd[None, :]
        a = a.to(DOT_T)
        w = _swapped_tile(ws.w, ws.desc, ws.drow, rows, k0, N, K, BN, BK, EVEN, TILE.tma, DOT_T, W_INT8)
        acc = tl.dot(w, a, acc)
        if ROWS2:
            w2 = _swapped_tile(ws.w2, ws.desc2, ws.drow, rows2, k0, N, K, BN, BK, EVEN, TILE.tma, DOT_T, W_INT8)
            acc2 = tl.dot(w2, a, acc2)
        if kb == KB - 1:
            best_v, best_i = _finish_tile(OP, rows, rows2, tl.trans(acc), tl.trans(acc2), rstd_out, best_v, best_i,
                                          B, layer, ws, out, ssq_ptr, ks, TILE.k_splits, dt, MODEL, N, BPAD, BN, CG)
            acc = tl.zeros([BN, BPAD], tl.float32)
            acc2 = tl.zeros([BN, BPAD], tl.float32)
    return best_v, best_i


@triton.jit
def _matvec(OP: tl.constexpr, row0, tiles, B, layer, ws, a_ptr, ssq_ptr, out, eps, dt: tl.constexpr,
            MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr, BPAD: tl.constexpr,
            SSQ_STRIDE: tl.constexpr, CG: tl.constexpr, ks=None):
    """Tiles [row0, row0 + tiles*rows-per-tile) of out = a @ W^T for the first B of BPAD rows, as one
    software-pipelined stream over (row tile, k chunk): a task of many row tiles fills the pipeline once. Two
    streams run side by side where they can (more bytes in flight per SM): QKV's and gate/up's second run of rows
    (see _tile_rows), or with TILE.k_halves the second half of K. Ops that follow a norm stream a = x * norm_weight
    and scale by rstd (from the partial sums of squares at ssq_ptr, SSQ_STRIDE rows apart); OPROJ and DOWN leave
    theirs at ssq_ptr. With 8-bit weights (ws.scale set) the dot runs in float16 (e4m3 converts to it in one
    instruction per pair, int8 by bits: _int8_f16; the activations, scaled by rstd first, fit its range).
    With TILE.k_splits > 1 the task streams one tile over its part of K (ks: KSplit) and the last part to arrive
    finishes the tile (_k_merge). ws: MatvecWeights. Returns the LM head's running (max, argmax) per row."""
    BN: tl.constexpr = TILE.rows
    BK: tl.constexpr = TILE.k_chunk
    KS: tl.constexpr = TILE.k_slices
    ROWS2: tl.constexpr = (OP == I.GATEUP) or (OP == I.QKV)
    PARTS: tl.constexpr = TILE.k_splits
    K_HALVES: tl.constexpr = TILE.k_halves and not ROWS2 and PARTS == 1
    TR: tl.constexpr = 2 * BN if OP == I.QKV else BN  # rows per tile
    NORM: tl.constexpr = (OP == I.QKV) or (OP == I.GATEUP) or (OP == I.LMHEAD)
    W8: tl.constexpr = ws.scale is not None  # FP8 or int8
    W_INT8: tl.constexpr = ws.w.dtype.element_ty == tl.int8
    SB: tl.constexpr = N if OP == I.LMHEAD else MODEL.layers * N  # int8: one block's scales, layer-stacked
    PRE_NORM: tl.constexpr = NORM and W8
    DOT_T: tl.constexpr = tl.float16 if W8 else dt
    KB: tl.constexpr = (K + BK - 1) // BK // PARTS  # chunks per task (the host checks that parts divide them)
    KB1: tl.constexpr = (KB + 1) // 2 if K_HALVES else KB  # chunks per stream
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0) and (KB1 * (2 if K_HALVES else 1) == KB)
    if PARTS > 1:
        kc0 = ks.part * KB  # this task's first chunk
    else:
        kc0 = 0
    rb = tl.arange(0, BPAD)
    if NORM:
        rstd = _rstd(ssq_ptr, B, eps, K, BPAD, SSQ_STRIDE, CG)
    else:
        rstd = tl.full([BPAD], 1.0, tl.float32)
    rstd_out = tl.full([BPAD], 1.0, tl.float32) if PRE_NORM else rstd  # what the epilogue still scales by
    best_v = tl.full([BPAD], float("-inf"), tl.float32)
    best_i = tl.full([BPAD], N, tl.int32)
    if TILE.swap:
        return _matvec_swapped(OP, row0, tiles, kc0, B, layer, ws, a_ptr, ssq_ptr, out, rstd, rstd_out, best_v,
                               best_i, ks, dt, MODEL, K, N, TILE, BPAD, KB, DOT_T, PRE_NORM, W_INT8, CG)
    # KS independent accumulators (a batched dot over KS slices of each k chunk): no serial chain of
    # tensor-core ops through one accumulator, and every warp has its own slice
    BKS: tl.constexpr = BK // KS
    koff = tl.arange(0, KS)[:, None] * BKS + tl.arange(0, BKS)[None, :]  # [KS, BKS]
    acc = tl.zeros([KS, BPAD, BN], tl.float32)
    acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    end_row = tl.minimum(row0 + tiles * TR, N)
    for it in tl.range(0, tiles * KB1, num_stages=TILE.stages):
        sub = it // KB1
        kb = it - sub * KB1
        n0 = row0 + sub * TR
        if TILE.prefetch_tiles > 0:  # keep the stream's next rows on their way into L2, beyond what the pipeline holds
            if kb == 0:
                ahead = n0 + TILE.prefetch_tiles * TR
                nbytes = (tl.minimum(ahead + TR, end_row) - ahead) * K * ws.w.dtype.element_ty.primitive_bitwidth // 8
                lane = tl.arange(0, 2)
                _prefetch_l2((ws.w + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0, lane)
                if OP == I.GATEUP:
                    _prefetch_l2((ws.w2 + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0,
                                 lane + 1)
        rows, rows2 = _tile_rows(OP, n0, MODEL, BN)
        k0 = (kc0 + kb) * BK
        rk = k0 + koff  # [KS, BKS]
        a = _operand(a_ptr, rb, rk, B, rstd, K, EVEN, DOT_T, PRE_NORM, CG)
        w = _load_tile(ws.w, ws.desc, ws.drow, rows, k0, N, K, BN, BK, KS, EVEN, TILE.tma)
        acc = _weight_dot(a, w, acc, ws.scale, rows, k0, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8)
        if ROWS2:
            w2 = _load_tile(ws.w2, ws.desc2, ws.drow, rows2, k0, N, K, BN, BK, KS, EVEN, TILE.tma)
            acc2 = _weight_dot(a, w2, acc2, ws.scale2, rows2, k0, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8)
        if K_HALVES:  # the same rows' second half of K
            a2 = _operand(a_ptr, rb, rk + KB1 * BK, B, rstd, K, EVEN, DOT_T, PRE_NORM, CG)
            w2 = _load_tile(ws.w, ws.desc, ws.drow, rows, (kb + KB1) * BK, N, K, BN, BK, KS, EVEN, TILE.tma)
            acc2 = _weight_dot(a2, w2, acc2, ws.scale, rows, (kb + KB1) * BK, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8)
        if kb == KB1 - 1:
            if K_HALVES:
                sums, sums2 = tl.sum(acc, axis=0) + tl.sum(acc2, axis=0), tl.zeros([BPAD, BN], tl.float32)
            else:
                sums, sums2 = tl.sum(acc, axis=0), tl.sum(acc2, axis=0)
            best_v, best_i = _finish_tile(OP, rows, rows2, sums, sums2, rstd_out, best_v, best_i, B, layer, ws, out,
                                          ssq_ptr, ks, PARTS, dt, MODEL, N, BPAD, BN, CG)
            acc = tl.zeros([KS, BPAD, BN], tl.float32)
            acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    return best_v, best_i


@triton.jit
def _load_draw(draw_ptr, pos_ptr, B, R: tl.constexpr, DSTRIDE: tl.constexpr):
    """How each of the first R rows picks its token: temperature (0: greedy), seed words, position; and whether any
    row samples. draw_ptr holds int32 rows of DSTRIDE: the temperature's float32 bits, the seed's words."""
    rb = tl.arange(0, R)
    m = rb < B
    temperature = tl.load(draw_ptr + rb, mask=m, other=0).to(tl.float32, bitcast=True)
    seed_lo = tl.load(draw_ptr + DSTRIDE + rb, mask=m, other=0)
    seed_hi = tl.load(draw_ptr + 2 * DSTRIDE + rb, mask=m, other=0)
    position = tl.load(pos_ptr + rb, mask=m, other=0)
    return temperature, seed_lo, seed_hi, position, tl.max(temperature, axis=0) > 0


@triton.jit
def _sample_partial(c0, c1, B, logits_ptr, draw_ptr, pos_ptr, N: tl.constexpr, R: tl.constexpr,
                    DSTRIDE: tl.constexpr, CG: tl.constexpr):
    """The drawn token's (max, argmax) over columns [c0, c1) of logits this program has just written: one pass
    after the LM head's stream, in blocks of 8 elements per thread, so the noise of many columns is computed side
    by side (per 64-column tile, inside the stream's epilogue, its latency stalled the stream: ~38 us a step)."""
    SC: tl.constexpr = 1024 // R
    rb = tl.arange(0, R)
    temperature, seed_lo, seed_hi, position, _ = _load_draw(draw_ptr, pos_ptr, B, R, DSTRIDE)
    best_v = tl.full([R], float("-inf"), tl.float32)
    best_i = tl.full([R], N, tl.int32)
    for s0 in range(c0, c1, SC):
        rc = s0 + tl.arange(0, SC)
        m = (rb[:, None] < B) & (rc[None, :] < c1)
        lg = _ld_act(logits_ptr + rb[:, None] * N + rc[None, :], m, CG, float("-inf"))
        mx, idx = gumbel_best(lg, rc, temperature, seed_lo, seed_hi, position, N)
        take = mx > best_v  # blocks come in increasing order: ties keep the earlier index
        best_v = tl.where(take, mx, best_v)
        best_i = tl.where(take, idx, best_i)
    return best_v, best_i


@triton.jit
def _lm_partials(row0, rows_end, part, best_v, best_i, B, lm, logits_ptr, draw_ptr, pos_ptr, N: tl.constexpr,
                 R: tl.constexpr, DSTRIDE: tl.constexpr, CG: tl.constexpr):
    """Leave an LM-head task's greedy (max, argmax) as partial `part`, and where a row samples, its drawn one."""
    rb = tl.arange(0, R)
    tl.store(lm.gmax + part * R + rb, best_v)
    tl.store(lm.gidx + part * R + rb, best_i)
    if tl.max(tl.load(draw_ptr + rb, mask=rb < B, other=0).to(tl.float32, bitcast=True), axis=0) > 0:
        tl.debug_barrier()  # the logits this program wrote, visible to all its threads
        sv, si = _sample_partial(row0, rows_end, B, logits_ptr, draw_ptr, pos_ptr, N, R, DSTRIDE, CG)
        tl.store(lm.smax + part * R + rb, sv)
        tl.store(lm.sidx + part * R + rb, si)


@triton.jit
def _embed(c0, tiles, B, tok_ptr, embed_ptr, x_ptr, xn_ptr, nw_ptr, ssq_ptr, H: tl.constexpr, BPAD: tl.constexpr,
           BN: tl.constexpr):
    """Columns [c0, c0 + tiles*BN) of x = embed[tokens], and of the first norm's operand and sums of squares."""
    rb = tl.arange(0, BPAD)
    tok = tl.load(tok_ptr + rb, mask=rb < B, other=0).to(tl.int64)
    for i in range(0, tiles):
        n0 = c0 + i * BN
        rn = n0 + tl.arange(0, BN)
        m = (rb[:, None] < B) & (rn[None, :] < H)
        e = tl.load(embed_ptr + tok[:, None] * H + rn[None, :], mask=m, other=0.0)
        tl.store(x_ptr + rb[:, None] * H + rn[None, :], e, mask=m)
        _norm_operand(e, m, rb, n0, xn_ptr, nw_ptr, ssq_ptr, embed_ptr.dtype.element_ty, H, BPAD, BN)


@triton.jit
def _splits(n_pos, ATT: tl.constexpr):
    """How a row's positions [0, n_pos) are cut for attention: (splits, positions per split). By the position
    alone, whatever the bucket, so a row's sums never depend on the rows it runs with: splits of at least
    ATT.split_min_chunks chunks, at most ATT.max_splits of them."""
    n_split = tl.maximum(1, tl.minimum(ATT.max_splits, tl.cdiv(n_pos, ATT.chunk * ATT.split_min_chunks)))
    span = tl.cdiv(tl.cdiv(n_pos, n_split), ATT.chunk) * ATT.chunk
    return n_split, span


@triton.jit
def _attention(layer, b, g, s, S, arrive, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr, sm_scale,
               MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """Flash-decoding for (row b, KV head g) over positions [0, pos] of its slot (this step's k and v of every row
    are in the cache already: QKV put them there). The positions are cut into splits (_splits); this task, one of
    S for (b, g), takes splits s, s + S, ...; the last task to arrive merges the splits' partials in split order.
    Returns 1 if this task finished (b, g)."""
    KVH: tl.constexpr = MODEL.kv_heads
    D: tl.constexpr = MODEL.head_dim
    G: tl.constexpr = MODEL.heads // KVH
    Q: tl.constexpr = MODEL.heads * D
    GPAD: tl.constexpr = ATT.group_pad
    CH: tl.constexpr = ATT.chunk
    SMAX: tl.constexpr = ATT.max_splits
    dt = cache.k.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E
    n_pos = tl.load(inputs.positions + b) + 1
    slot = tl.load(inputs.slots + b).to(tl.int64)
    rg = tl.arange(0, GPAD)
    rd = tl.arange(0, D)
    out_ptrs = attn_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :]
    base = ((layer * cache.slots + slot) * KVH + g) * cache.context * D
    n_split, span = _splits(n_pos, ATT)
    last = n_pos < 0
    if s < n_split:
        q = _ld_act(q_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :], rg[:, None] < G, CG)  # RoPE'd
        for i in range(s, n_split, S):
            start = i * span
            end = tl.minimum(start + span, n_pos)
            m_i = tl.full([GPAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GPAD], tl.float32)
            acc = tl.zeros([GPAD, D], tl.float32)
            for c0 in range(start, end, CH):
                rc = c0 + tl.arange(0, CH)
                mc = rc < end
                k = _ld_act(cache.k + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
                v = _ld_act(cache.v + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
                sc = tl.dot(q, tl.trans(k)) * qk_scale
                sc = tl.where(mc[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
                m_i = m_new
            if n_split == 1:  # one split: the output directly, no partials to merge
                tl.store(out_ptrs, (acc / tl.where(rg < G, l_i, 1.0)[:, None]).to(dt), mask=rg[:, None] < G)
            else:
                part = (b * KVH + g) * SMAX + i
                tl.store(scratch.m + part * GPAD + rg, m_i, mask=rg < G)
                tl.store(scratch.l + part * GPAD + rg, l_i, mask=rg < G)
                tl.store(scratch.acc + (part * GPAD + rg[:, None]) * D + rd[None, :], acc, mask=rg[:, None] < G)
        if n_split == 1:
            last = n_pos >= 0
        else:
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + arrive, 1, sem="acq_rel", scope="gpu")
            last = arrived == tl.minimum(S, n_split) - 1
            if last:
                # the last task in merges the splits' partials into attn[b, heads of g], in split order, four at a time
                p0 = (b * KVH + g) * SMAX
                ri = tl.arange(0, SMAX)
                mg = rg[None, :] < G
                m_all = tl.max(_ld_act(scratch.m + (p0 + ri)[:, None] * GPAD + rg[None, :],
                                       (ri[:, None] < n_split) & mg, CG, float("-inf")), axis=0)
                l_all = tl.zeros([GPAD], tl.float32)
                o = tl.zeros([GPAD, D], tl.float32)
                for i0 in range(0, n_split, 4):
                    r4 = i0 + tl.arange(0, 4)
                    m4 = (r4[:, None] < n_split) & mg
                    w = tl.exp2(_ld_act(scratch.m + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG, float("-inf"))
                                - m_all[None, :])
                    w = tl.where(m4, w, 0.0)
                    l_all += tl.sum(w * _ld_act(scratch.l + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG), axis=0)
                    offs = (((p0 + r4)[:, None] * GPAD + rg[None, :]) * D)[:, :, None] + rd[None, None, :]
                    acc4 = _ld_act(scratch.acc + offs, m4[:, :, None], CG)
                    o += tl.sum(w[:, :, None] * acc4, axis=0)
                tl.store(out_ptrs, (o / tl.where(rg < G, l_all, 1.0)[:, None]).to(dt), mask=rg[:, None] < G)
    return last.to(tl.int32)


@triton.jit
def _reduce_partials(lmax_ptr, lidx_ptr, n_parts, B, V: tl.constexpr, R: tl.constexpr, CG: tl.constexpr):
    """The token of each row from n_parts (max, argmax) partials: the largest value, and of equal values the
    smallest index."""
    TC: tl.constexpr = 128
    rb = tl.arange(0, R)
    best = tl.full([R], float("-inf"), tl.float32)
    bidx = tl.full([R], V, tl.int32)
    for t0 in range(0, n_parts, TC):
        rt = t0 + tl.arange(0, TC)
        m = (rt[:, None] < n_parts) & (rb[None, :] < B)
        vals = _ld_act(lmax_ptr + rt[:, None] * R + rb[None, :], m, CG, float("-inf"))
        idxs = _ld_act(lidx_ptr + rt[:, None] * R + rb[None, :], m, CG, V)
        cm = tl.max(vals, axis=0)
        ci = tl.min(tl.where(vals == cm[None, :], idxs, V), axis=0)
        take = (cm > best) | ((cm == best) & (ci < bidx))
        best = tl.where(take, cm, best)
        bidx = tl.where(take, ci, bidx)
    return bidx


@triton.jit
def _argmax(B, n_parts, n_counters, lm, outs, draw_ptr, pos_ptr, cnt_ptr, V: tl.constexpr, R: tl.constexpr,
            CG: tl.constexpr, DSTRIDE: tl.constexpr):
    """Reduce the LM-head tasks' (max, argmax) partials into the greedy token of each of the first B rows, and the
    sampled ones into the drawn token (the greedy one where no row samples); then, every other task being done
    (they all lead here), zero the counters for the next replay."""
    rb = tl.arange(0, R)
    greedy = _reduce_partials(lm.gmax, lm.gidx, n_parts, B, V, R, CG)
    tl.store(outs.argmax + rb, greedy.to(tl.int64), mask=rb < B)
    _, _, _, _, any_samples = _load_draw(draw_ptr, pos_ptr, B, R, DSTRIDE)
    if any_samples:
        tl.store(outs.sampled + rb, _reduce_partials(lm.smax, lm.sidx, n_parts, B, V, R, CG).to(tl.int64),
                 mask=rb < B)
    else:
        tl.store(outs.sampled + rb, greedy.to(tl.int64), mask=rb < B)
    for c0 in range(0, n_counters, 1024):
        rc = c0 + tl.arange(0, 1024)
        tl.store(cnt_ptr + rc, tl.zeros([1024], tl.int32), mask=rc < n_counters)


# ---------------------------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def _prefetch_kv(rec, inputs, cache, MODEL: tl.constexpr, ATT: tl.constexpr):
    """An attention task's cached keys and values (the positions before this step's) into L2 while it waits for
    QKV: they do not depend on this step. The task's first split only; one bulk prefetch each, from threads 0, 1."""
    D: tl.constexpr = MODEL.head_dim
    b = tl.load(rec + I.ATTN_ROW)
    s = tl.load(rec + I.ATTN_SPLIT)
    pos = tl.load(inputs.positions + b)
    n_split, span = _splits(pos + 1, ATT)
    start = s * span
    n = tl.minimum(start + span, pos) - start
    if (s < n_split) & (n > 0):
        slot = tl.load(inputs.slots + b).to(tl.int64)
        head = (tl.load(rec + I.F_LAYER) * cache.slots + slot) * MODEL.kv_heads + tl.load(rec + I.ATTN_KV_HEAD)
        off = (head * cache.context + start) * D
        lane = tl.arange(0, 2)
        base = tl.where(lane == 0, cache.k + off, cache.v + off).to(tl.int64, bitcast=True)
        _prefetch_l2(base, (n * D * cache.k.dtype.element_ty.primitive_bitwidth // 8).to(tl.int32) + lane * 0, lane)


@triton.jit
def _matvec_task(rec, ssq_ptr, SSQ: tl.constexpr):
    """A Matvec record's first row, row tiles, and its slot of sums of squares."""
    return tl.load(rec + I.MV_ROW0), tl.load(rec + I.MV_TILES), ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ


@triton.jit
def _k_split(rec, sched):
    """A Matvec record's part of K, its tile's arrival counter and scratch slot (used where its K is split)."""
    return KSplit(tl.load(rec + I.MV_K_SPLIT), tl.load(rec + I.MV_ARRIVE), tl.load(rec + I.MV_SLOT), sched.counters,
                  sched.k_sums)


@triton.jit
def megakernel(
    sched,  # Sched
    inputs,  # StepInputs: the step's rows
    batch,  # rows computed (the bucket)
    lm_rows,  # of those, the first rows that go through the LM head and pick a token
    attn_splits,  # attention tasks per (row, KV head)
    weights,  # Weights
    scales,  # Scales (FP8), or None
    # tensor descriptors where a matvec loads through TMA, else None (not in a tuple: the launcher wants them at
    # the top level)
    d_qkv, d_o, d_g, d_u, d_d, d_lm,
    cos, sin,  # float32 [context, head_dim/2]
    cache,  # Cache
    acts,  # Activations
    ssq_ptr,  # [norms, hidden/16, BPAD] partial sums of squares (Layout's slots)
    attn_scratch,  # AttnScratch
    lm,  # LmPartials
    outs,  # StepOutputs
    eps, sm_scale,
    MODEL: tl.constexpr,  # ModelShape
    # each matvec's MatvecTile (one constexpr each: a constexpr tuple's tuple field reaches a call as a plain tuple)
    T_QKV: tl.constexpr, T_OPROJ: tl.constexpr, T_GATEUP: tl.constexpr, T_DOWN: tl.constexpr, T_LMHEAD: tl.constexpr,
    ATT: tl.constexpr,  # AttnShape
    BPAD: tl.constexpr,  # rows of the launch's tiles (the bucket; the largest one where batch-invariant)
    BS: tl.constexpr,  # rows of the LM head's tiles (lm_rows padded)
    PF_AHEAD: tl.constexpr, PF_OWN: tl.constexpr, PF_KV: tl.constexpr,
    DSTRIDE: tl.constexpr, CG: tl.constexpr, MAX_SPIN: tl.constexpr, PROFILE: tl.constexpr,
):
    NF: tl.constexpr = I.RECORD_LEN
    H: tl.constexpr = MODEL.hidden
    F: tl.constexpr = MODEL.ffn
    V: tl.constexpr = MODEL.vocab
    Q: tl.constexpr = MODEL.heads * MODEL.head_dim
    QKVR: tl.constexpr = Q + 2 * MODEL.kv_heads * MODEL.head_dim
    SSQ: tl.constexpr = H // I.SSQ_COLS * BPAD  # one norm's slot of partial sums of squares
    FP8: tl.constexpr = scales is not None
    w = weights
    x_ptr, xn_ptr = acts.x, acts.xn
    dt = w.embed.dtype.element_ty  # activations
    pid = tl.program_id(0)
    t_begin = tl.load(sched.starts + pid)
    t_end = tl.load(sched.starts + pid + 1)
    if PF_AHEAD > 0:
        for i in tl.static_range(PF_AHEAD):
            if t_begin + i < t_end:
                _prefetch(sched.tasks + (t_begin + i) * NF)
    for t in range(t_begin, t_end):
        rec = sched.tasks + t * NF
        if PF_AHEAD > 0:
            if t + PF_AHEAD < t_end:
                _prefetch(sched.tasks + (t + PF_AHEAD) * NF)
        if PF_OWN:  # this task's first weights travel into L2 while it waits for its inputs
            _prefetch(rec)
        if PROFILE:
            tl.store(sched.prof + t * 4, tl.extra.cuda.globaltimer())
        op = tl.load(rec + I.F_OP)
        layer = tl.load(rec + I.F_LAYER)
        if PF_KV:
            if op == I.ATTN:
                _prefetch_kv(rec, inputs, cache, MODEL, ATT)
        _wait(sched.counters, tl.load(rec + I.F_WAIT), tl.load(rec + I.F_TARGET), sched.err, MAX_SPIN)
        if PROFILE:
            tl.store(sched.prof + t * 4 + 1, tl.extra.cuda.globaltimer())
        inc = tl.full([], 1, tl.int32)
        if op == I.QKV:
            row0, tiles, ssq = _matvec_task(rec, ssq_ptr, SSQ)
            wl = w.wqkv + layer * QKVR * H
            sc = scales.qkv + layer * QKVR if FP8 else None
            bias = w.bqkv + layer * QKVR if w.bqkv is not None else None
            _matvec(I.QKV, row0, tiles, batch, layer, MatvecWeights(wl, wl, sc, sc, bias, d_qkv, d_qkv, layer * QKVR),
                    xn_ptr, ssq, QkvOut(acts.q, cache, cos, sin, inputs.slots, inputs.positions), eps, dt,
                    MODEL, H, QKVR, T_QKV, BPAD, BPAD, CG, _k_split(rec, sched))
        elif op == I.ATTN:
            inc = _attention(layer, tl.load(rec + I.ATTN_ROW), tl.load(rec + I.ATTN_KV_HEAD),
                             tl.load(rec + I.ATTN_SPLIT), attn_splits, tl.load(rec + I.ATTN_ARRIVE), sched.counters,
                             inputs, acts.q, cache, attn_scratch, acts.attn, sm_scale, MODEL, ATT, CG)
        elif op == I.OPROJ:
            row0, tiles, ssq = _matvec_task(rec, ssq_ptr, SSQ)
            sc = scales.o + layer * H if FP8 else None
            _matvec(I.OPROJ, row0, tiles, batch, layer,
                    MatvecWeights(w.wo + layer * H * Q, None, sc, None, None, d_o, None, layer * H),
                    acts.attn, ssq, ResidualOut(x_ptr, xn_ptr, w.mlp_norm + layer * H), eps, dt, MODEL, Q, H,
                    T_OPROJ, BPAD, BPAD, CG, _k_split(rec, sched))
        elif op == I.GATEUP:
            row0, tiles, ssq = _matvec_task(rec, ssq_ptr, SSQ)
            sg = scales.gate + layer * F if FP8 else None
            su = scales.up + layer * F if FP8 else None
            _matvec(I.GATEUP, row0, tiles, batch, layer,
                    MatvecWeights(w.w_gate + layer * F * H, w.w_up + layer * F * H, sg, su, None, d_g, d_u,
                                  layer * F),
                    xn_ptr, ssq, acts.ffn, eps, dt, MODEL, H, F, T_GATEUP, BPAD, BPAD, CG, _k_split(rec, sched))
        elif op == I.DOWN:
            row0, tiles, ssq = _matvec_task(rec, ssq_ptr, SSQ)
            # x += ffn @ Wdown^T, and the next layer's attention-norm operand (the final norm's after the last)
            nw = tl.where(layer == MODEL.layers - 1, w.final_norm, w.attn_norm + (layer + 1) * H)
            sc = scales.down + layer * H if FP8 else None
            _matvec(I.DOWN, row0, tiles, batch, layer,
                    MatvecWeights(w.w_down + layer * H * F, None, sc, None, None, d_d, None, layer * H),
                    acts.ffn, ssq, ResidualOut(x_ptr, xn_ptr, nw), eps, dt, MODEL, F, H, T_DOWN, BPAD, BPAD, CG,
                    _k_split(rec, sched))
        elif op == I.LMHEAD:
            row0, tiles, ssq = _matvec_task(rec, ssq_ptr, SSQ)
            # the first lm_rows rows only (BS of them in the tiles), reading the final norm's sums BPAD rows apart
            sc = scales.lm_head if FP8 else None
            best_v, best_i = _matvec(I.LMHEAD, row0, tiles, lm_rows, layer,
                                     MatvecWeights(w.lm_head, None, sc, None, None, d_lm, None, 0), xn_ptr, ssq,
                                     LmOut(acts.logits, inputs.masks, inputs.draw + 3 * DSTRIDE), eps, dt,
                                     MODEL, H, V, T_LMHEAD, BS, BPAD, CG)
            _lm_partials(row0, tl.minimum(row0 + tiles * T_LMHEAD.rows, V), tl.load(rec + I.MV_PART), best_v,
                         best_i, lm_rows, lm, acts.logits, inputs.draw, inputs.positions, V, BS, DSTRIDE, CG)
        elif op == I.EMBED:
            _embed(tl.load(rec + I.EMBED_COL0), tl.load(rec + I.EMBED_TILES), batch, inputs.tokens, w.embed, x_ptr,
                   xn_ptr, w.attn_norm, ssq_ptr + tl.load(rec + I.EMBED_SSQ) * SSQ, H, BPAD, I.EMBED_COLS)
        elif op == I.ARGMAX:
            _argmax(lm_rows, tl.load(rec + I.ARGMAX_PARTS), tl.load(rec + I.ARGMAX_COUNTERS), lm, outs, inputs.draw,
                    inputs.positions, sched.counters, V, BS, CG, DSTRIDE)
            inc = tl.full([], 0, tl.int32)
        tl.debug_barrier()
        done = tl.load(rec + I.F_DONE)
        if (done >= 0) & (inc > 0):
            tl.atomic_add(sched.counters + done, 1, sem="release", scope="gpu")
        if PROFILE:
            tl.store(sched.prof + t * 4 + 2, tl.extra.cuda.globaltimer())
            tl.store(sched.prof + t * 4 + 3, tl.extra.cuda.smid().to(tl.int64))


# ---------------------------------------------------------------------------------------------------------------
# host side


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


MATVECS = (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD)
TileTable = dict[Op, MatvecTile]


def default_tiles(fp8: bool = False, rows: int = 1, int8: bool = False) -> TileTable:
    """The tiles of a launch whose matvecs have `rows` rows (its bucket; the LM head's own rows for the LM head).

    Up to 16 rows, what the H100 measured best (bench/NOTES.md, K1-K4): 16-row tiles (the smallest tensor-core
    dot) of 256 columns; QKV and gate/up stream two runs of rows side by side, down its K's two halves; the LM head's
    64-row tiles of 256 columns through the tensor-memory accelerator (its long stream ran at 72% of the bandwidth
    with pointer loads, 99% with TMA). With FP8 weights each k chunk doubles, so a pipeline stage holds as many
    weight bytes (the LM head's TMA box stays at 256 columns, its limit).

    From 32 rows the operands are swapped (MatvecTile.swap): the weight tile is the dot's M and the step's rows its
    N, one k slice of 256 columns, 3 stages (bf16; FP8: 4 stages, gate/up in 64-row tiles). On the H100 this took
    the 32- and 64-row bf16 steps from 2.07 / 3.16 ms to 1.75 / 2.18 (FP8 2.43 / 4.57 to 2.05 / 3.78); at 16 rows
    and fewer it is slower (1.58 vs 1.43 ms at 16), so those keep the tiles above. Wider weight tiles with K split
    over several tasks (MatvecTile.k_splits) measured slower at every row count (bench/NOTES.md "Flat steps").

    int8 weights: a k slice per block of 32 columns (int8_slices: the dot's slices are scaled one by one), over
    bf16's chunk widths (256 columns, 8 slices; at FP8's 512 the 16 slices' accumulators spilled at 1 row), and at
    32+ rows over one-block chunks (4 slices of 128 columns spilled 3 KB a thread at 64 rows, one block
    0.8 KB, FP8's tiles 1 KB: bench/sm90_compile.py). Not yet measured on the H100."""
    lm_wide = MatvecTile(rows=64, k_chunk=128, k_slices=1, tma=True)
    if int8:
        if rows <= 16:
            return {op: int8_slices(t._replace(k_chunk=256)) for op, t in default_tiles(True, rows).items()}
        wide = {op: MatvecTile(k_chunk=INT8_BLOCK, k_slices=1) for op in (Op.QKV, Op.OPROJ)}
        wide[Op.GATEUP] = MatvecTile(rows=32, k_chunk=INT8_BLOCK, k_slices=1)
        wide[Op.DOWN] = MatvecTile(k_chunk=INT8_BLOCK, k_slices=1, k_halves=True)
        return wide | {Op.LMHEAD: int8_slices(lm_wide._replace(k_chunk=INT8_BLOCK))}
    k = 2 if fp8 else 1
    if rows <= 16:
        tiles = {op: MatvecTile(k_chunk=256 * k) for op in (Op.QKV, Op.OPROJ, Op.GATEUP)}
        tiles[Op.DOWN] = MatvecTile(k_chunk=256 * k, k_halves=True)
        tiles[Op.LMHEAD] = MatvecTile(rows=64, k_chunk=256, tma=True)
        return tiles
    # swapped operands: the weight tile is the dot's M, the rows its N (measured, bench/NOTES.md "Flat steps")
    wide = {op: MatvecTile(k_chunk=256, k_slices=1, stages=4 if fp8 else 3, swap=True)
            for op in (Op.QKV, Op.OPROJ, Op.DOWN)}
    wide[Op.GATEUP] = MatvecTile(rows=64 if fp8 else 32, k_chunk=256, k_slices=1, stages=4 if fp8 else 3, swap=True)
    return wide | {Op.LMHEAD: lm_wide}


def int8_slices(t: MatvecTile) -> MatvecTile:
    """The tile with one k slice per int8 block of its k chunk (a slice must lie within one block)."""
    return t._replace(k_slices=max(1, t.k_chunk // INT8_BLOCK))


# what KernelConfig.tiles may be: one table for every launch, or a function of the launch's rows
TileChoice = TileTable | Callable[[int], TileTable]


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 4
    num_stages: int = 4  # the launch's default, for loops that set none of their own
    programs_per_sm: int = 1
    tiles: TileChoice | None = None  # None: default_tiles(fp8, rows) for each launch's rows
    chunk: int = 64  # attention positions per inner step
    max_splits: int = 16  # attention splits per (row, kv head) at most
    split_min_chunks: int = 4  # a split reads at least this many chunks (shorter contexts use fewer splits)
    min_rows: int = 1  # a launch pads its rows to max(bucket, min_rows)
    batch_invariant: bool = False  # every bucket pads its rows to the largest one: the same sums in the same order
    prefetch_ahead: int = 1  # tasks ahead whose first weights are prefetched into L2 (0: none)
    prefetch_own: bool = True  # each task's own first weights, prefetched into L2 before it waits
    prefetch_bytes: int = 64 << 10  # at most this much of each of a task's weight regions
    prefetch_kv: bool = True  # attention tasks prefetch their cached keys and values into L2 before they wait
    head_counters: bool = True  # attention for a KV head waits for its own group's QKV tasks, not the whole phase
    cooperative: bool = True
    max_spin: int = 1 << 22
    profile: bool = False  # record (start, ready, end, SM) per task in Megakernel.prof


@dataclass
class _Launch:
    """What one bucket's launch needs beyond the schedule: its rows, tiles, descriptors and scratch."""

    rows: int  # BPAD
    lm_rows: int  # BS
    tiles: dict[Op, MatvecTile]
    descriptors: tuple[object, ...]
    sched: Sched
    lm: LmPartials
    ssq: torch.Tensor


class Megakernel:
    """Buffers, schedules (one per row bucket) and the launch of the decode-step kernel.

    k_cache/v_cache: [layers, slots, kv_heads, max_context, head_dim]; cos/sin: float32 [max_context, head_dim/2].
    Inputs are the int32 tensors `tokens`, `slots`, `positions` ([max_rows]), `draw` ([4, max_rows]: each
    row's temperature as float32 bits, 0 for greedy, its seed's two words, and 1 where its logits go through its
    grammar mask) and `masks` ([max_sampled, ceil(vocab/32)]: a bit per token, 1 where allowed); outputs, for the first
    min(rows, max_sampled) rows, `logits` (float32 [max_sampled, vocab]), `argmax` and `sampled` (int64).
    `step(bucket)` reads and writes only those.
    """

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, dims: I.ModelDims, weights: PackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, max_rows: int = 16, max_sampled: int = 16,
                 num_programs: int | None = None, config: KernelConfig | None = None,
                 attn_splits: dict[int, int] | None = None) -> None:
        if not 1 <= max_rows <= self.BUCKETS[-1]:
            raise ValueError(f"a step has 1 to {self.BUCKETS[-1]} rows, not {max_rows}")
        self.dims, self.w, self.k_cache, self.v_cache = dims, weights, k_cache, v_cache
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.cfg = config or KernelConfig()
        dev = weights.embed.device
        self.device = dev
        if num_programs is None:
            num_programs = 1 if INTERPRET or dev.type != "cuda" else \
                torch.cuda.get_device_properties(dev).multi_processor_count * self.cfg.programs_per_sm
        self.num_programs = num_programs
        self.max_rows = max_rows
        self.max_sampled = max(1, min(max_sampled, max_rows))
        self.bpad = max(_pow2(max_rows), self.cfg.min_rows)  # buffer rows
        self.spad = min(_pow2(self.max_sampled), self.bpad)  # LM-head buffer rows
        self.attn_splits = attn_splits or {}  # per bucket, where a test wants other than attention_splits()
        d, dt = dims, weights.embed.dtype
        self.slots_total, self.max_context = k_cache.shape[1], k_cache.shape[3]
        self.gpad = _pow2(d.group)
        bp, sp = self.bpad, self.spad

        def z(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, device=dev, dtype=dtype)

        self.tokens = z(bp, dtype=torch.int32)
        self.slots = z(bp, dtype=torch.int32)
        self.positions = z(bp, dtype=torch.int32)
        # how each row picks its token (kernels/sampling.py): temperature as float32 bits (0: greedy), seed words
        self.draw = z(4, bp, dtype=torch.int32)
        self.masks = z(sp, (d.vocab + 31) // 32, dtype=torch.int32)  # rows flagged in draw[3]: grammar masks
        self.x, self.xn, self.q = z(bp, d.hidden), z(bp, d.hidden), z(bp, d.q_size)
        self.attn, self.ffn = z(bp, d.q_size), z(bp, d.ffn)
        self.logits = z(sp, d.vocab, dtype=torch.float32)
        self.argmax = z(sp, dtype=torch.int64)
        self.sampled = z(sp, dtype=torch.int64)  # the drawn token (the greedy one for rows that do not sample)
        self.max_splits = _pow2(self.cfg.max_splits)
        nparts = bp * d.num_kv_heads * self.max_splits
        self.pm, self.pl = z(nparts, self.gpad, dtype=torch.float32), z(nparts, self.gpad, dtype=torch.float32)
        self.pacc = z(nparts, self.gpad, d.head_dim, dtype=torch.float32)
        self.err = z(1, dtype=torch.int32)
        self.prof: torch.Tensor | None = None
        self.schedules: dict[int, I.Schedule] = {}
        self._launches: dict[int, _Launch] = {}
        s = weights.scales
        self._scales = Scales(*(s[n] for n in PackedWeights.MATRICES)) if s is not None else None

    # -- per bucket ----------------------------------------------------------------------------------------------
    def rows_of(self, batch: int) -> int:
        """Rows a launch for this bucket computes: the bucket, or the largest one where batch-invariant."""
        return self.bpad if self.cfg.batch_invariant else max(batch, self.cfg.min_rows)

    def lm_rows_of(self, batch: int) -> int:
        """Rows of the LM head's tiles in a launch for this bucket."""
        return min(self.rows_of(batch), self.spad)

    def _table(self, rows: int) -> TileTable:
        t = self.cfg.tiles
        if t is None:
            return default_tiles(self.w.fp8 or self.w.int8, rows, self.w.int8_blocks)
        return t(rows) if callable(t) else t

    def tiles(self, batch: int) -> TileTable:
        """Each matvec's tile in a launch for this bucket (the LM head's chosen for its own rows). A QKV tile pairs
        runs of rows half a head apart: a run is at most half a head."""
        tiles = self._table(self.rows_of(batch)) | {Op.LMHEAD: self._table(self.lm_rows_of(batch))[Op.LMHEAD]}
        ks = {Op.QKV: self.dims.hidden, Op.OPROJ: self.dims.q_size, Op.GATEUP: self.dims.hidden,
              Op.DOWN: self.dims.ffn, Op.LMHEAD: self.dims.hidden}
        for op, t in tiles.items():
            chunks = -(-ks[op] // t.k_chunk)
            if t.k_splits > 1 and (chunks % t.k_splits or op is Op.LMHEAD):
                raise ValueError(f"{op.name}: {t.k_splits} parts of K do not divide its {chunks} k chunks "
                                 f"(or the LM head, whose K is never split)")
            if t.swap and (self.w.int8_blocks or self.rows_of(batch) < 16 and not INTERPRET):
                raise ValueError(f"{op.name}: swapped tiles need rows padded to 16 (KernelConfig.min_rows) and no "
                                 "int8 block scales")
            if self.w.int8_blocks and INT8_BLOCK % (t.k_chunk // t.k_slices):
                raise ValueError(f"int8 weights: {op.name}'s k slices of {t.k_chunk // t.k_slices} columns cross "
                                 f"blocks of {INT8_BLOCK} (int8_slices makes a tile's slices fit)")
        qkv = tiles[Op.QKV]
        return tiles | {Op.QKV: qkv._replace(rows=min(qkv.rows, self.dims.head_dim // 2))}

    def tiling(self, batch: int) -> I.Tiling:
        splits = self.attn_splits.get(batch) or \
            I.attention_splits(self.dims, batch, self.num_programs, self.cfg.max_splits)
        tiles = self.tiles(batch)
        return I.Tiling(rows={op: t.rows for op, t in tiles.items()}, attn_splits=splits,
                        head_counters=self.cfg.head_counters,
                        k_splits={op: t.k_splits for op, t in tiles.items() if t.k_splits > 1})

    def schedule(self, batch: int) -> I.Schedule:
        if batch not in self.schedules:
            regions = self.w.regions() if (self.cfg.prefetch_ahead > 0 or self.cfg.prefetch_own) else None
            s = I.build_schedule(self.dims, batch, self.num_programs, self.tiling(batch), regions,
                                 self.cfg.prefetch_bytes)
            self.schedules[batch] = s
            rows, lm_rows = self.rows_of(batch), self.lm_rows_of(batch)

            def partials(dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(s.num_lm_parts, lm_rows, device=self.device, dtype=dtype)

            tiles = self.tiles(batch)
            self._launches[batch] = _Launch(
                rows=rows, lm_rows=lm_rows,
                tiles={op: self._runnable(t) for op, t in tiles.items()},
                descriptors=self._descriptors(tiles),
                sched=Sched(s.tasks.to(self.device), s.starts.to(self.device),
                            torch.zeros(s.layout.counters, device=self.device, dtype=torch.int32), self.err, None,
                            torch.zeros(max(1, self._k_sums(tiles, rows)), device=self.device,
                                        dtype=torch.float32)),
                lm=LmPartials(partials(torch.float32), partials(torch.int32), partials(torch.float32),
                              partials(torch.int32)),
                ssq=torch.zeros(s.layout.ssq_slots, self.dims.hidden // I.SSQ_COLS, rows, device=self.device,
                                dtype=torch.float32),
            )
        return self.schedules[batch]

    def _k_sums(self, tiles: TileTable, rows: int) -> int:
        """Floats of scratch the split-K matvecs need: per tile, per part, its runs' float32 [rows, tile rows]
        (the matvecs run one after another, so they share it)."""
        d = self.dims
        out_rows = {Op.QKV: d.qkv_rows, Op.OPROJ: d.hidden, Op.GATEUP: d.ffn, Op.DOWN: d.hidden}
        need = 0
        for op, n in out_rows.items():
            t = tiles[op]
            if t.k_splits > 1:
                runs = 2 if op in (Op.QKV, Op.GATEUP) else 1
                tile_rows = runs * t.rows if op is Op.QKV else t.rows  # rows a tile index covers
                need = max(need, -(-n // tile_rows) * t.k_splits * runs * rows * t.rows)
        return need

    @staticmethod
    def _runnable(t: MatvecTile) -> MatvecTile:
        return t if not INTERPRET else t._replace(prefetch_tiles=0)  # the interpreter runs no inline PTX

    def _descriptors(self, tiles: TileTable) -> tuple[object, ...]:
        """Each matrix as a [L*rows, cols] tensor descriptor with its tile's box where its matvec loads through TMA
        (QKV's box is one of a tile's two runs); None elsewhere."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        ops = {"qkv": Op.QKV, "o": Op.OPROJ, "gate": Op.GATEUP, "up": Op.GATEUP, "down": Op.DOWN,
               "lm_head": Op.LMHEAD}
        out: list[object] = []
        for name in PackedWeights.MATRICES:
            w, t = self.w.matrix(name), tiles[ops[name]]
            out.append(TensorDescriptor.from_tensor(w.reshape(-1, w.shape[-1]), [t.rows, t.k_chunk]) if t.tma
                       else None)
        return tuple(out)

    def prof_buffer(self, s: I.Schedule) -> torch.Tensor | None:
        if not self.cfg.profile or INTERPRET:
            return None
        n = len(s.tasks)
        if self.prof is None or self.prof.shape[0] < n:
            self.prof = torch.zeros(n, 4, device=self.device, dtype=torch.int64)
        return self.prof

    def step(self, batch: int) -> None:
        """One step for rows [0, batch) of tokens/slots/positions (batch must be a bucket size); the LM head, the
        sampling and the argmax for the first min(batch, max_sampled) of them."""
        d, c, w = self.dims, self.cfg, self.w
        s = self.schedule(batch)
        launch = self._launches[batch]
        extra = {}
        if not INTERPRET and self.device.type == "cuda" and c.cooperative:
            extra["launch_cooperative_grid"] = True
        pf = not INTERPRET  # the interpreter runs no inline PTX
        megakernel[(self.num_programs,)](
            launch.sched._replace(prof=self.prof_buffer(s)),
            StepInputs(self.tokens, self.slots, self.positions, self.draw, self.masks),
            batch, min(batch, self.max_sampled), s.tiling.attn_splits,
            Weights(w.embed, w.wqkv, w.bqkv, w.wo, w.w_gate, w.w_up, w.w_down, w.attn_norm, w.mlp_norm,
                    w.final_norm, w.lm_head),
            self._scales, *launch.descriptors, self.cos, self.sin,
            Cache(self.k_cache, self.v_cache, self.slots_total, self.max_context),
            Activations(self.x, self.xn, self.q, self.attn, self.ffn, self.logits), launch.ssq,
            AttnScratch(self.pm, self.pl, self.pacc), launch.lm, StepOutputs(self.argmax, self.sampled),
            d.rms_eps, d.head_dim ** -0.5,
            MODEL=ModelShape(d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.ffn, d.vocab, d.num_layers),
            T_QKV=launch.tiles[Op.QKV], T_OPROJ=launch.tiles[Op.OPROJ], T_GATEUP=launch.tiles[Op.GATEUP],
            T_DOWN=launch.tiles[Op.DOWN], T_LMHEAD=launch.tiles[Op.LMHEAD],
            ATT=AttnShape(self.gpad, c.chunk, self.max_splits, c.split_min_chunks),
            BPAD=launch.rows, BS=launch.lm_rows,
            PF_AHEAD=c.prefetch_ahead if pf else 0, PF_OWN=c.prefetch_own and pf, PF_KV=c.prefetch_kv and pf,
            DSTRIDE=self.draw.stride(0), CG=not INTERPRET, MAX_SPIN=c.max_spin, PROFILE=c.profile and not INTERPRET,
            num_warps=c.num_warps, num_stages=c.num_stages, **extra,
        )
