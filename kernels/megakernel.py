"""The megakernel: one persistent Triton launch runs a whole decode step by executing the schedule that
kernels/instructions.py builds. The kernel only interprets task records; every decision of who does what is on
the host, once per model and batch bucket.

Numerics follow the PyTorch reference (service/backends/reference.py): activations are rounded to the activations'
dtype where the reference rounds them (after each linear, RoPE, SiLU and residual add), and every sum is
accumulated in float32. One reordering: RMSNorm(x) @ W^T is computed as rstd * ((x * norm_weight) @ W^T). The
tasks that write the residual stream also write x * norm_weight of the next norm, so a consumer's matvec streams a
ready operand, and computes rstd from x itself (no atomics anywhere in the arithmetic: a step is deterministic).

Weights are bf16, or FP8 (e4m3) with one float32 scale per output row, converted to bf16 in registers after the
load and scaled in the epilogue: the same tensor-core dot streams half the bytes.

Synchronisation: a task spins on a volatile load of its counter, then takes an acquire atomic; a finished task
passes a CTA barrier and adds one to its counter with release semantics. Activations are read with `.cg` (L2,
never a stale L1 line). The last task (Argmax) zeroes the counters, so a CUDA graph can replay the launch. A wait
that spins too long sets an error flag (Megakernel.err) and the step finishes instead of hanging.

Matvecs use tensor cores (`tl.dot`) with the batch rows as M, padded only to `BPAD`; each weight tile is
accumulated as KS independent k-slices (a batched dot, one slice per warp) and summed in the epilogue.

Sampling happens in the same launch: where a row samples, each LM-head task reduces the Gumbel-perturbed logits
of its columns (kernels/sampling.py) after its stream, and Argmax reduces those partials next to the greedy ones.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import instructions as I
from kernels.instructions import Op
from kernels.sampling import gumbel_best

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class PackedWeights:
    """The model's tensors in the layout the kernel reads (layer-stacked, out × in). With FP8, the matrices are
    float8_e4m3fn and `scales` holds each one's float32 scale per output row ([L, rows], [V] for the LM head); the
    embedding table stays in the activations' dtype (it is looked up, not streamed)."""

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

    def nbytes(self) -> int:
        """What one decode step streams: every matrix (and scale) once, the norms."""
        mats = sum(self.matrix(n).numel() * self.matrix(n).element_size() for n in self.MATRICES)
        scales = sum(s.numel() * 4 for s in (self.scales or {}).values())
        norms = sum(t.numel() * t.element_size() for t in (self.attn_norm, self.mlp_norm, self.final_norm))
        return mats + scales + norms

    def regions(self) -> dict[str, tuple[int, int, int]]:
        """Address, bytes per layer and bytes per element of each matrix, for the schedule's prefetch hints."""
        def r(t: torch.Tensor, layered: bool = True) -> tuple[int, int, int]:
            return t.data_ptr(), t[0].numel() * t.element_size() if layered else 0, t.element_size()

        return {n: r(self.matrix(n), n != "lm_head") for n in self.MATRICES}


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
def _rstd(ssq_ptr, B, eps, H: tl.constexpr, BPAD: tl.constexpr, CG: tl.constexpr):
    """1 / RMS of each row of x, from the H/16 partial sums of squares per row that x's writers left at ssq_ptr
    (summed in a fixed order, whatever wrote them when)."""
    NP: tl.constexpr = H // I.SSQ_COLS
    NPP: tl.constexpr = triton.next_power_of_2(NP)
    rp = tl.arange(0, NPP)
    rb = tl.arange(0, BPAD)
    parts = _ld_act(ssq_ptr + rp[:, None] * BPAD + rb[None, :], (rp[:, None] < NP) & (rb[None, :] < B), CG)
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
        D: tl.constexpr = MODEL[3]
        ROT: tl.constexpr = (MODEL[1] + MODEL[2]) * MODEL[3]  # q and k rows are rotated, v rows are not
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
def _qkv_out(lo, hi, rows, rows2, rb, B, layer, epi, dt: tl.constexpr, MODEL: tl.constexpr, BPAD: tl.constexpr,
             BN: tl.constexpr):
    """QKV's epilogue on the tile's two runs [BPAD, BN] (float32, bias added): RoPE on q and k rows at each batch
    row's position (run one holds x[d], run two x[d + head_dim/2]), q to the attention's input, k and v into the
    KV cache."""
    q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr = epi
    NH: tl.constexpr = MODEL[1]
    KVH: tl.constexpr = MODEL[2]
    D: tl.constexpr = MODEL[3]
    SLOTS: tl.constexpr = MODEL[7]
    CTX: tl.constexpr = MODEL[8]
    Q: tl.constexpr = NH * D
    KV: tl.constexpr = KVH * D
    HALF: tl.constexpr = D // 2
    live = rb < B
    pos = tl.load(pos_ptr + rb, mask=live, other=0)
    lo = lo.to(dt).to(tl.float32)  # the linear's output, rounded where the reference rounds it
    hi = hi.to(dt).to(tl.float32)
    first = tl.min(rows, axis=0)
    if first < Q + KV:
        fi = rows % HALF
        c = tl.load(cos_ptr + pos[:, None] * HALF + fi[None, :]).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF + fi[None, :]).to(dt).to(tl.float32)
        lo, hi = lo * c - hi * s, hi * c + lo * s
    m = live[:, None] & (rows[None, :] < Q + 2 * KV)
    if first < Q:
        tl.store(q_ptr + rb[:, None] * Q + rows[None, :], lo.to(dt), mask=m)
        tl.store(q_ptr + rb[:, None] * Q + rows2[None, :], hi.to(dt), mask=m)
    else:
        slot = tl.load(slot_ptr + rb, mask=live, other=0).to(tl.int64)
        base = (layer * SLOTS + slot[:, None]) * KVH * CTX * D + pos[:, None].to(tl.int64) * D
        r1, r2 = (rows - Q) % KV, (rows2 - Q) % KV
        o1 = base + ((r1 // D) * CTX * D + r1 % D)[None, :]
        o2 = base + ((r2 // D) * CTX * D + r2 % D)[None, :]
        if first < Q + KV:
            tl.store(kc_ptr + o1, lo.to(dt), mask=m)
            tl.store(kc_ptr + o2, hi.to(dt), mask=m)
        else:
            tl.store(vc_ptr + o1, lo.to(dt), mask=m)
            tl.store(vc_ptr + o2, hi.to(dt), mask=m)


@triton.jit
def _lm_out(lg, rows, rb, B, best_v, best_i, logits_ptr, N: tl.constexpr):
    """LMHEAD's epilogue: the logits (float32, rounded to the activations' dtype first as the reference's are), and
    the running (max, first argmax) of the task's tiles."""
    m = (rb[:, None] < B) & (rows[None, :] < N)
    tl.store(logits_ptr + rb[:, None] * N + rows[None, :], lg, mask=m)
    lg = tl.where(rows[None, :] < N, lg, float("-inf"))
    mx = tl.max(lg, axis=1)
    idx = tl.min(tl.where(lg == mx[:, None], rows[None, :], N), axis=1).to(tl.int32)  # first index of the max
    take = mx > best_v  # tiles come in increasing order: ties keep the earlier index
    return tl.where(take, mx, best_v), tl.where(take, idx, best_i)


@triton.jit
def _epilogue(OP: tl.constexpr, rows, rows2, acc, acc2, rstd, best_v, best_i, B, layer, ws, epi, ssq_ptr,
              dt: tl.constexpr, MODEL: tl.constexpr, N: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr,
              W_FP8: tl.constexpr, CG: tl.constexpr):
    """What a matvec does with a finished tile: float32 sums [BPAD, BN] of its rows (and acc2: QKV's second run,
    gate/up's up)."""
    rb = tl.arange(0, BPAD)
    if W_FP8:  # one scale per output row
        acc = acc * tl.load(ws[2] + rows, mask=rows < N, other=0.0)[None, :]
        if (OP == I.GATEUP) or (OP == I.QKV):
            acc2 = acc2 * tl.load(ws[3] + rows2, mask=rows2 < N, other=0.0)[None, :]
    m = (rb[:, None] < B) & (rows[None, :] < N)
    if OP == I.QKV:
        lo = acc * rstd[:, None]
        hi = acc2 * rstd[:, None]
        if MODEL[9]:  # QKV bias
            lo += tl.load(ws[4] + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
            hi += tl.load(ws[4] + rows2, mask=rows2 < N, other=0.0).to(tl.float32)[None, :]
        _qkv_out(lo, hi, rows, rows2, rb, B, layer, epi, dt, MODEL, BPAD, BN)
    elif OP == I.GATEUP:
        ffn_ptr = epi
        gate = (acc * rstd[:, None]).to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        tl.store(ffn_ptr + rb[:, None] * N + rows[None, :], (act * (acc2 * rstd[:, None]).to(dt).to(tl.float32))
                 .to(dt), mask=m)
    elif OP == I.LMHEAD:
        best_v, best_i = _lm_out((acc * rstd[:, None]).to(dt).to(tl.float32), rows, rb, B, best_v, best_i, epi,
                                 N)
    else:  # OPROJ, DOWN: the residual stream x += acc, and the next norm's operand and sums of squares
        x_ptr, xn_ptr, nw_ptr = epi
        ptrs = x_ptr + rb[:, None] * N + rows[None, :]
        y = (_ld_act(ptrs, m, CG).to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
        tl.store(ptrs, y, mask=m)
        _norm_operand(y, m, rb, tl.min(rows, axis=0), xn_ptr, nw_ptr, ssq_ptr, dt, N, BPAD, BN)
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
def _matvec(OP: tl.constexpr, row0, tiles, B, layer, ws, a_ptr, ssq_ptr, epi, eps, dt: tl.constexpr,
            MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr, BPAD: tl.constexpr,
            W_FP8: tl.constexpr, CG: tl.constexpr):
    """Tiles [row0, row0 + tiles*rows-per-tile) of out = a @ W^T, as one software-pipelined stream over (row tile,
    k chunk): a task of many row tiles fills the pipeline once. Two streams run side by side where they can (more
    bytes in flight per SM): QKV's and gate/up's second run of rows (see _tile_rows), or with K_HALVES the second
    half of K. Ops that follow a norm stream a = x * norm_weight and scale by rstd (from the partial sums of squares
    at ssq_ptr); OPROJ and DOWN leave theirs at ssq_ptr. With FP8 weights the dot runs in float16 (e4m3 converts
    to it in one instruction per pair; the activations, scaled by rstd first, fit its range). ws = (W, W2, scale,
    scale2, bias, and for TMA the descriptors of W and W2 and this layer's first row in them). TILE = (rows per run,
    k chunk, k slices, pipeline stages, row tiles prefetched into L2 ahead of the stream, whether the tensor-memory
    accelerator loads the weights, whether K's halves stream side by side). Returns the LM head's running
    (max, argmax) per row."""
    BN: tl.constexpr = TILE[0]
    BK: tl.constexpr = TILE[1]
    KS: tl.constexpr = TILE[2]
    STAGES: tl.constexpr = TILE[3]
    PF_TILES: tl.constexpr = TILE[4]
    TMA: tl.constexpr = TILE[5]
    K_HALVES: tl.constexpr = TILE[6] and not ((OP == I.GATEUP) or (OP == I.QKV))
    ROWS2: tl.constexpr = (OP == I.GATEUP) or (OP == I.QKV)
    TR: tl.constexpr = 2 * BN if OP == I.QKV else BN  # rows per tile
    NORM: tl.constexpr = (OP == I.QKV) or (OP == I.GATEUP) or (OP == I.LMHEAD)
    PRE_NORM: tl.constexpr = NORM and W_FP8
    DOT_T: tl.constexpr = tl.float16 if W_FP8 else dt
    KB: tl.constexpr = (K + BK - 1) // BK
    KB1: tl.constexpr = (KB + 1) // 2 if K_HALVES else KB  # chunks per stream
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0) and (KB1 * (2 if K_HALVES else 1) == KB)
    w_ptr, w2_ptr = ws[0], ws[1]
    rb = tl.arange(0, BPAD)
    if NORM:
        rstd = _rstd(ssq_ptr, B, eps, K, BPAD, CG)
    else:
        rstd = tl.full([BPAD], 1.0, tl.float32)
    rstd_out = tl.full([BPAD], 1.0, tl.float32) if PRE_NORM else rstd  # what the epilogue still scales by
    best_v = tl.full([BPAD], float("-inf"), tl.float32)
    best_i = tl.full([BPAD], N, tl.int32)
    # KS independent accumulators (a batched dot over KS slices of each k chunk): no serial chain of
    # tensor-core ops through one accumulator, and every warp has its own slice
    BKS: tl.constexpr = BK // KS
    koff = tl.arange(0, KS)[:, None] * BKS + tl.arange(0, BKS)[None, :]  # [KS, BKS]
    acc = tl.zeros([KS, BPAD, BN], tl.float32)
    acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    end_row = tl.minimum(row0 + tiles * TR, N)
    for it in tl.range(0, tiles * KB1, num_stages=STAGES):
        sub = it // KB1
        kb = it - sub * KB1
        n0 = row0 + sub * TR
        if PF_TILES > 0:  # keep the stream's next rows on their way into L2, beyond what the pipeline holds
            if kb == 0:
                ahead = n0 + PF_TILES * TR
                nbytes = (tl.minimum(ahead + TR, end_row) - ahead) * K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
                lane = tl.arange(0, 2)
                _prefetch_l2((w_ptr + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0, lane)
                if OP == I.GATEUP:
                    _prefetch_l2((w2_ptr + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0,
                                 lane + 1)
        rows, rows2 = _tile_rows(OP, n0, MODEL, BN)
        rk = kb * BK + koff  # [KS, BKS]
        a = _operand(a_ptr, rb, rk, B, rstd, K, EVEN, DOT_T, PRE_NORM, CG)
        w = _load_tile(w_ptr, ws[5], ws[7], rows, kb * BK, N, K, BN, BK, KS, EVEN, TMA)
        acc = tl.dot(a, tl.permute(w.to(DOT_T), (0, 2, 1)), acc)
        if ROWS2:
            w2 = _load_tile(w2_ptr, ws[6], ws[7], rows2, kb * BK, N, K, BN, BK, KS, EVEN, TMA)
            acc2 = tl.dot(a, tl.permute(w2.to(DOT_T), (0, 2, 1)), acc2)
        if K_HALVES:  # the same rows' second half of K
            a2 = _operand(a_ptr, rb, rk + KB1 * BK, B, rstd, K, EVEN, DOT_T, PRE_NORM, CG)
            w2 = _load_tile(w_ptr, ws[5], ws[7], rows, (kb + KB1) * BK, N, K, BN, BK, KS, EVEN, TMA)
            acc2 = tl.dot(a2, tl.permute(w2.to(DOT_T), (0, 2, 1)), acc2)
        if kb == KB1 - 1:
            if K_HALVES:
                sums, sums2 = tl.sum(acc, axis=0) + tl.sum(acc2, axis=0), tl.zeros([BPAD, BN], tl.float32)
            else:
                sums, sums2 = tl.sum(acc, axis=0), tl.sum(acc2, axis=0)
            best_v, best_i = _epilogue(OP, rows, rows2, sums, sums2, rstd_out, best_v, best_i, B, layer, ws, epi,
                                       ssq_ptr, dt, MODEL, N, BPAD, BN, W_FP8, CG)
            acc = tl.zeros([KS, BPAD, BN], tl.float32)
            acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    return best_v, best_i


@triton.jit
def _load_draw(draw_ptr, pos_ptr, B, BPAD: tl.constexpr, DSTRIDE: tl.constexpr):
    """How each row picks its token: temperature (0: greedy), seed words, position; and whether any row samples.
    draw_ptr holds three int32 rows of DSTRIDE: the temperature's float32 bits, the seed's low and high words."""
    rb = tl.arange(0, BPAD)
    m = rb < B
    temperature = tl.load(draw_ptr + rb, mask=m, other=0).to(tl.float32, bitcast=True)
    seed_lo = tl.load(draw_ptr + DSTRIDE + rb, mask=m, other=0)
    seed_hi = tl.load(draw_ptr + 2 * DSTRIDE + rb, mask=m, other=0)
    position = tl.load(pos_ptr + rb, mask=m, other=0)
    return temperature, seed_lo, seed_hi, position, tl.max(temperature, axis=0) > 0


@triton.jit
def _sample_partial(c0, c1, B, logits_ptr, draw_ptr, pos_ptr, N: tl.constexpr, BPAD: tl.constexpr,
                    DSTRIDE: tl.constexpr, CG: tl.constexpr):
    """The drawn token's (max, argmax) over columns [c0, c1) of logits this program has just written: one pass
    after the LM head's stream, in blocks of 8 elements per thread, so the noise of many columns is computed side
    by side (per 64-column tile, inside the stream's epilogue, its latency stalled the stream: ~38 us a step)."""
    SC: tl.constexpr = 1024 // BPAD
    rb = tl.arange(0, BPAD)
    temperature, seed_lo, seed_hi, position, _ = _load_draw(draw_ptr, pos_ptr, B, BPAD, DSTRIDE)
    best_v = tl.full([BPAD], float("-inf"), tl.float32)
    best_i = tl.full([BPAD], N, tl.int32)
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
                 BPAD: tl.constexpr, DSTRIDE: tl.constexpr, CG: tl.constexpr):
    """Leave an LM-head task's greedy (max, argmax) as partial `part`, and where a row samples, its drawn one."""
    gmax_ptr, gidx_ptr, smax_ptr, sidx_ptr = lm
    rb = tl.arange(0, BPAD)
    tl.store(gmax_ptr + part * BPAD + rb, best_v)
    tl.store(gidx_ptr + part * BPAD + rb, best_i)
    if tl.max(tl.load(draw_ptr + rb, mask=rb < B, other=0).to(tl.float32, bitcast=True), axis=0) > 0:
        tl.debug_barrier()  # the logits this program wrote, visible to all its threads
        sv, si = _sample_partial(row0, rows_end, B, logits_ptr, draw_ptr, pos_ptr, N, BPAD, DSTRIDE, CG)
        tl.store(smax_ptr + part * BPAD + rb, sv)
        tl.store(sidx_ptr + part * BPAD + rb, si)


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
def _attention(layer, b, g, s, S, arrive, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr, sm_scale,
               MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """Flash-decoding for (batch row b, KV head g) over positions [0, pos] of its slot (the new token's k and v are
    in the cache already: QKV put them there). The positions are cut into splits by the position alone (whatever
    the bucket: a row's sums never depend on the batch it runs in); this task, one of S for (b, g), takes splits
    s, s + S, ...; the last task to arrive merges the splits' partials in split order. Returns 1 if this task
    finished (b, g)."""
    slot_ptr, pos_ptr = inputs[1], inputs[2]
    kc_ptr, vc_ptr = cache
    pm_ptr, pl_ptr, pacc_ptr = scratch
    NH: tl.constexpr = MODEL[1]
    KVH: tl.constexpr = MODEL[2]
    D: tl.constexpr = MODEL[3]
    SLOTS: tl.constexpr = MODEL[7]
    CTX: tl.constexpr = MODEL[8]
    GPAD: tl.constexpr = ATT[0]
    CH: tl.constexpr = ATT[1]
    SMAX: tl.constexpr = ATT[2]
    SPLIT_MIN: tl.constexpr = ATT[3]
    G: tl.constexpr = NH // KVH
    Q: tl.constexpr = NH * D
    dt = kc_ptr.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E
    n_pos = tl.load(pos_ptr + b) + 1
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rg = tl.arange(0, GPAD)
    rd = tl.arange(0, D)
    out_ptrs = attn_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :]
    base = ((layer * SLOTS + slot) * KVH + g) * CTX * D
    # splits of at least SPLIT_MIN chunks, at most SMAX of them
    n_split = tl.maximum(1, tl.minimum(SMAX, tl.cdiv(n_pos, CH * SPLIT_MIN)))
    span = tl.cdiv(tl.cdiv(n_pos, n_split), CH) * CH
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
                k = _ld_act(kc_ptr + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
                v = _ld_act(vc_ptr + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
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
                tl.store(pm_ptr + part * GPAD + rg, m_i, mask=rg < G)
                tl.store(pl_ptr + part * GPAD + rg, l_i, mask=rg < G)
                tl.store(pacc_ptr + (part * GPAD + rg[:, None]) * D + rd[None, :], acc, mask=rg[:, None] < G)
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
                m_all = tl.max(_ld_act(pm_ptr + (p0 + ri)[:, None] * GPAD + rg[None, :], (ri[:, None] < n_split) & mg,
                                       CG, float("-inf")), axis=0)
                l_all = tl.zeros([GPAD], tl.float32)
                o = tl.zeros([GPAD, D], tl.float32)
                for i0 in range(0, n_split, 4):
                    r4 = i0 + tl.arange(0, 4)
                    m4 = (r4[:, None] < n_split) & mg
                    w = tl.exp2(_ld_act(pm_ptr + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG, float("-inf"))
                                - m_all[None, :])
                    w = tl.where(m4, w, 0.0)
                    l_all += tl.sum(w * _ld_act(pl_ptr + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG), axis=0)
                    offs = (((p0 + r4)[:, None] * GPAD + rg[None, :]) * D)[:, :, None] + rd[None, None, :]
                    acc4 = _ld_act(pacc_ptr + offs, m4[:, :, None], CG)
                    o += tl.sum(w[:, :, None] * acc4, axis=0)
                tl.store(out_ptrs, (o / tl.where(rg < G, l_all, 1.0)[:, None]).to(dt), mask=rg[:, None] < G)
    return last.to(tl.int32)


@triton.jit
def _reduce_partials(lmax_ptr, lidx_ptr, n_parts, B, V: tl.constexpr, BPAD: tl.constexpr, CG: tl.constexpr):
    """The token of each row from n_parts (max, argmax) partials: the largest value, and of equal values the
    smallest index."""
    TC: tl.constexpr = 128
    rb = tl.arange(0, BPAD)
    best = tl.full([BPAD], float("-inf"), tl.float32)
    bidx = tl.full([BPAD], V, tl.int32)
    for t0 in range(0, n_parts, TC):
        rt = t0 + tl.arange(0, TC)
        m = (rt[:, None] < n_parts) & (rb[None, :] < B)
        vals = _ld_act(lmax_ptr + rt[:, None] * BPAD + rb[None, :], m, CG, float("-inf"))
        idxs = _ld_act(lidx_ptr + rt[:, None] * BPAD + rb[None, :], m, CG, V)
        cm = tl.max(vals, axis=0)
        ci = tl.min(tl.where(vals == cm[None, :], idxs, V), axis=0)
        take = (cm > best) | ((cm == best) & (ci < bidx))
        best = tl.where(take, cm, best)
        bidx = tl.where(take, ci, bidx)
    return bidx


@triton.jit
def _argmax(B, n_parts, n_counters, lm, outs, draw_ptr, pos_ptr, cnt_ptr, V: tl.constexpr, BPAD: tl.constexpr,
            CG: tl.constexpr, DSTRIDE: tl.constexpr):
    """Reduce the LM-head tasks' (max, argmax) partials into the greedy token, and the sampled ones into the drawn
    token (the greedy one where no row samples); then, every other task being done (they all lead here), zero the
    counters for the next replay."""
    gmax_ptr, gidx_ptr, smax_ptr, sidx_ptr = lm
    out_ptr, sample_out_ptr = outs
    rb = tl.arange(0, BPAD)
    greedy = _reduce_partials(gmax_ptr, gidx_ptr, n_parts, B, V, BPAD, CG)
    tl.store(out_ptr + rb, greedy.to(tl.int64), mask=rb < B)
    draw = _load_draw(draw_ptr, pos_ptr, B, BPAD, DSTRIDE)
    if draw[4]:
        tl.store(sample_out_ptr + rb, _reduce_partials(smax_ptr, sidx_ptr, n_parts, B, V, BPAD, CG).to(tl.int64),
                 mask=rb < B)
    else:
        tl.store(sample_out_ptr + rb, greedy.to(tl.int64), mask=rb < B)
    for c0 in range(0, n_counters, 1024):
        rc = c0 + tl.arange(0, 1024)
        tl.store(cnt_ptr + rc, tl.zeros([1024], tl.int32), mask=rc < n_counters)


# ---------------------------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def _prefetch_kv(rec, inputs, cache, S, MODEL: tl.constexpr, ATT: tl.constexpr):
    """An attention task's cached keys and values (the positions before this step's) into L2 while it waits for
    QKV: they do not depend on this step. The task's first split only; one bulk prefetch each, from threads 0, 1."""
    SLOTS: tl.constexpr = MODEL[7]
    CTX: tl.constexpr = MODEL[8]
    KVH: tl.constexpr = MODEL[2]
    D: tl.constexpr = MODEL[3]
    CH: tl.constexpr = ATT[1]
    SMAX: tl.constexpr = ATT[2]
    SPLIT_MIN: tl.constexpr = ATT[3]
    b = tl.load(rec + I.ATTN_ROW)
    s = tl.load(rec + I.ATTN_SPLIT)
    pos = tl.load(inputs[2] + b)
    n_split = tl.maximum(1, tl.minimum(SMAX, tl.cdiv(pos + 1, CH * SPLIT_MIN)))
    span = tl.cdiv(tl.cdiv(pos + 1, n_split), CH) * CH
    start = s * span
    n = tl.minimum(start + span, pos) - start
    if (s < n_split) & (n > 0):
        slot = tl.load(inputs[1] + b).to(tl.int64)
        off = (((tl.load(rec + I.F_LAYER) * SLOTS + slot) * KVH + tl.load(rec + I.ATTN_KV_HEAD)) * CTX + start) * D
        lane = tl.arange(0, 2)
        base = tl.where(lane == 0, cache[0] + off, cache[1] + off).to(tl.int64, bitcast=True)
        _prefetch_l2(base, (n * D * cache[0].dtype.element_ty.primitive_bitwidth // 8).to(tl.int32) + lane * 0, lane)


@triton.jit
def megakernel(
    sched,  # (tasks, starts, counters, err, prof)
    inputs,  # (tokens, slots, positions, draw): the step's rows
    batch, attn_splits,
    weights,  # (embed, wqkv, bqkv, wo, w_gate, w_up, w_down, attn_norm, mlp_norm, final_norm, lm_head)
    scales,  # (qkv, o, gate, up, down, lm_head): float32 per output row (FP8), else placeholders
    # tensor descriptors where a matvec loads through TMA, else its weights (not a tuple: the launcher wants them
    # at the top level)
    d_qkv, d_o, d_g, d_u, d_d, d_lm,
    rope,  # (cos, sin)
    cache,  # (k, v): [layers, slots, kv heads, context, head_dim]
    acts,  # (x, xn, q, attn, ffn, logits)
    ssq_ptr,  # [norms, hidden/16, BPAD] partial sums of squares (Layout's slots)
    attn_scratch,  # (m, l, acc) partials of the attention splits
    lm,  # (max, argmax) partials of the LM-head tasks: greedy, then drawn
    outs,  # (argmax, sampled)
    eps, sm_scale,
    MODEL: tl.constexpr,  # (H, NH, KVH, D, F, V, NLAYERS, SLOTS, CTX, HAS_BIAS)
    # per matvec: (BN, BK, KS, STAGES, PF_TILES, TMA, K_HALVES)
    T_QKV: tl.constexpr, T_OPROJ: tl.constexpr, T_GATEUP: tl.constexpr, T_DOWN: tl.constexpr, T_LMHEAD: tl.constexpr,
    ATT: tl.constexpr,  # (GPAD, CH, SMAX, SPLIT_MIN)
    BPAD: tl.constexpr, W_FP8: tl.constexpr, PF_AHEAD: tl.constexpr, PF_OWN: tl.constexpr, PF_KV: tl.constexpr,
    DSTRIDE: tl.constexpr, CG: tl.constexpr, MAX_SPIN: tl.constexpr, PROFILE: tl.constexpr,
):
    NF: tl.constexpr = I.RECORD_LEN
    H: tl.constexpr = MODEL[0]
    NH: tl.constexpr = MODEL[1]
    KVH: tl.constexpr = MODEL[2]
    D: tl.constexpr = MODEL[3]
    F: tl.constexpr = MODEL[4]
    V: tl.constexpr = MODEL[5]
    NLAYERS: tl.constexpr = MODEL[6]
    Q: tl.constexpr = NH * D
    QKVR: tl.constexpr = Q + 2 * KVH * D
    SSQ: tl.constexpr = H // I.SSQ_COLS * BPAD  # one norm's slot of partial sums of squares
    tasks_ptr, starts_ptr, cnt_ptr, err_ptr, prof_ptr = sched
    tok_ptr, slot_ptr, pos_ptr, draw_ptr = inputs
    embed_ptr, wqkv_ptr, bqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, norm1_ptr, norm2_ptr, fnorm_ptr, lm_ptr = weights
    s_qkv, s_o, s_g, s_u, s_d, s_lm = scales
    cos_ptr, sin_ptr = rope
    kc_ptr, vc_ptr = cache
    x_ptr, xn_ptr, q_ptr, attn_ptr, ffn_ptr, logits_ptr = acts
    dt = embed_ptr.dtype.element_ty  # activations
    pid = tl.program_id(0)
    t_begin = tl.load(starts_ptr + pid)
    t_end = tl.load(starts_ptr + pid + 1)
    if PF_AHEAD > 0:
        for i in tl.static_range(PF_AHEAD):
            if t_begin + i < t_end:
                _prefetch(tasks_ptr + (t_begin + i) * NF)
    for t in range(t_begin, t_end):
        rec = tasks_ptr + t * NF
        if PF_AHEAD > 0:
            if t + PF_AHEAD < t_end:
                _prefetch(tasks_ptr + (t + PF_AHEAD) * NF)
        if PF_OWN:  # this task's first weights travel into L2 while it waits for its inputs
            _prefetch(rec)
        if PROFILE:
            tl.store(prof_ptr + t * 4, tl.extra.cuda.globaltimer())
        op = tl.load(rec + I.F_OP)
        layer = tl.load(rec + I.F_LAYER)
        if PF_KV:
            if op == I.ATTN:
                _prefetch_kv(rec, inputs, cache, attn_splits, MODEL, ATT)
        _wait(cnt_ptr, tl.load(rec + I.F_WAIT), tl.load(rec + I.F_TARGET), err_ptr, MAX_SPIN)
        if PROFILE:
            tl.store(prof_ptr + t * 4 + 1, tl.extra.cuda.globaltimer())
        inc = tl.full([], 1, tl.int32)
        if op == I.QKV:
            rope_out = (q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr)
            w = wqkv_ptr + layer * QKVR * H
            sc = s_qkv + layer * QKVR
            _matvec(I.QKV, tl.load(rec + I.MV_ROW0), tl.load(rec + I.MV_TILES), batch, layer,
                    (w, w, sc, sc, bqkv_ptr + layer * QKVR, d_qkv, d_qkv, layer * QKVR),
                    xn_ptr, ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ, rope_out, eps, dt, MODEL, H, QKVR, T_QKV, BPAD,
                    W_FP8, CG)
        elif op == I.ATTN:
            inc = _attention(layer, tl.load(rec + I.ATTN_ROW), tl.load(rec + I.ATTN_KV_HEAD),
                             tl.load(rec + I.ATTN_SPLIT), attn_splits, tl.load(rec + I.ATTN_ARRIVE), cnt_ptr, inputs,
                             q_ptr, cache, attn_scratch, attn_ptr, sm_scale, MODEL, ATT, CG)
        elif op == I.OPROJ:
            _matvec(I.OPROJ, tl.load(rec + I.MV_ROW0), tl.load(rec + I.MV_TILES), batch, layer,
                    (wo_ptr + layer * H * Q, wo_ptr, s_o + layer * H, s_o, bqkv_ptr, d_o, d_o, layer * H),
                    attn_ptr, ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ, (x_ptr, xn_ptr, norm2_ptr + layer * H), eps,
                    dt, MODEL, Q, H, T_OPROJ, BPAD, W_FP8, CG)
        elif op == I.GATEUP:
            _matvec(I.GATEUP, tl.load(rec + I.MV_ROW0), tl.load(rec + I.MV_TILES), batch, layer,
                    (wg_ptr + layer * F * H, wu_ptr + layer * F * H, s_g + layer * F, s_u + layer * F, bqkv_ptr,
                     d_g, d_u, layer * F),
                    xn_ptr, ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ, ffn_ptr, eps, dt, MODEL, H, F, T_GATEUP, BPAD,
                    W_FP8, CG)
        elif op == I.DOWN:
            # x += ffn @ Wdown^T, and the next layer's attention-norm operand (the final norm's after the last)
            nw = tl.where(layer == NLAYERS - 1, fnorm_ptr, norm1_ptr + (layer + 1) * H)
            _matvec(I.DOWN, tl.load(rec + I.MV_ROW0), tl.load(rec + I.MV_TILES), batch, layer,
                    (wd_ptr + layer * H * F, wd_ptr, s_d + layer * H, s_d, bqkv_ptr, d_d, d_d, layer * H),
                    ffn_ptr, ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ, (x_ptr, xn_ptr, nw), eps, dt, MODEL, F, H,
                    T_DOWN, BPAD, W_FP8, CG)
        elif op == I.LMHEAD:
            row0 = tl.load(rec + I.MV_ROW0)
            tiles = tl.load(rec + I.MV_TILES)
            best_v, best_i = _matvec(I.LMHEAD, row0, tiles, batch, layer,
                                     (lm_ptr, lm_ptr, s_lm, s_lm, bqkv_ptr, d_lm, d_lm, 0), xn_ptr,
                                     ssq_ptr + tl.load(rec + I.MV_SSQ) * SSQ, logits_ptr, eps, dt, MODEL, H, V,
                                     T_LMHEAD, BPAD, W_FP8, CG)
            _lm_partials(row0, tl.minimum(row0 + tiles * T_LMHEAD[0], V), tl.load(rec + I.MV_PART), best_v, best_i,
                         batch, lm, logits_ptr, draw_ptr, pos_ptr, V, BPAD, DSTRIDE, CG)
        elif op == I.EMBED:
            _embed(tl.load(rec + I.EMBED_COL0), tl.load(rec + I.EMBED_TILES), batch, tok_ptr, embed_ptr, x_ptr,
                   xn_ptr, norm1_ptr, ssq_ptr + tl.load(rec + I.EMBED_SSQ) * SSQ, H, BPAD, I.EMBED_COLS)
        elif op == I.ARGMAX:
            _argmax(batch, tl.load(rec + I.ARGMAX_PARTS), tl.load(rec + I.ARGMAX_COUNTERS), lm, outs, draw_ptr,
                    pos_ptr, cnt_ptr, V, BPAD, CG, DSTRIDE)
            inc = tl.full([], 0, tl.int32)
        tl.debug_barrier()
        done = tl.load(rec + I.F_DONE)
        if (done >= 0) & (inc > 0):
            tl.atomic_add(cnt_ptr + done, 1, sem="release", scope="gpu")
        if PROFILE:
            tl.store(prof_ptr + t * 4 + 2, tl.extra.cuda.globaltimer())
            tl.store(prof_ptr + t * 4 + 3, tl.extra.cuda.smid().to(tl.int64))


# ---------------------------------------------------------------------------------------------------------------
# host side


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class MatvecTile:
    """How one matvec streams its weights: rows per tile, k chunk per pipeline stage, independent k slices of the
    dot, pipeline stages, and row tiles kept on their way into L2 ahead of the stream (0: none)."""

    rows: int = 16
    k_chunk: int = 256
    k_slices: int = 4
    stages: int = 4
    prefetch_tiles: int = 0
    tma: bool = False  # load the weights through the tensor-memory accelerator (descriptors) instead of pointers
    k_halves: bool = False  # stream K's two halves side by side (matvecs of one run of rows: OPROJ, DOWN, LM head)


MATVECS = (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD)


def default_tiles(fp8: bool = False) -> dict[Op, MatvecTile]:
    """What the H100 measured best (bench/NOTES.md, K1-K3): 16-row tiles (the smallest tensor-core dot) of 256
    columns; QKV and gate/up stream two runs of rows side by side, down its K's two halves; the LM head's 64-row
    tiles of 256 columns through the tensor-memory accelerator (its long stream ran at 72% of the bandwidth with
    pointer loads, 99% with TMA). With FP8 weights each k chunk doubles, so a pipeline stage holds as many bytes
    (the LM head's TMA box stays at 256 columns, its limit)."""
    k = 2 if fp8 else 1
    tiles = {op: MatvecTile(k_chunk=256 * k) for op in (Op.QKV, Op.OPROJ, Op.GATEUP)}
    tiles[Op.DOWN] = MatvecTile(k_chunk=256 * k, k_halves=True)
    tiles[Op.LMHEAD] = MatvecTile(rows=64, k_chunk=256, tma=True)
    return tiles


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 4
    num_stages: int = 4  # the launch's default, for loops that set none of their own
    programs_per_sm: int = 1
    tiles: dict[Op, MatvecTile] | None = None  # None: default_tiles() for the weights' dtype
    chunk: int = 64  # attention positions per inner step
    max_splits: int = 16  # attention splits per (row, kv head) at most
    split_min_chunks: int = 4  # a split reads at least this many chunks (shorter contexts use fewer splits)
    min_rows: int = 1  # a launch pads its batch rows to max(bucket, min_rows)
    batch_invariant: bool = False  # every bucket pads its rows to the largest one: the same sums in the same order
    prefetch_ahead: int = 1  # tasks ahead whose first weights are prefetched into L2 (0: none)
    prefetch_own: bool = True  # each task's own first weights, prefetched into L2 before it waits
    prefetch_bytes: int = 64 << 10  # at most this much of each of a task's weight regions
    prefetch_kv: bool = True  # attention tasks prefetch their cached keys and values into L2 before they wait
    cooperative: bool = True
    max_spin: int = 1 << 22
    profile: bool = False  # record (start, ready, end, SM) per task in Megakernel.prof


class Megakernel:
    """Buffers, schedules (one per batch bucket) and the launch of the decode-step kernel.

    k_cache/v_cache: [layers, slots, kv_heads, max_context, head_dim]; cos/sin: float32 [max_context, head_dim/2].
    Inputs are the int32 tensors `tokens`, `slots`, `positions` ([max_batch]) and `draw` ([3, max_batch]: each
    row's temperature as float32 bits, 0 for greedy, and its seed's two words); outputs `logits` (float32
    [max_batch, vocab]), `argmax` and `sampled` (int64 [max_batch]). `step(batch)` reads and writes only those.
    """

    BUCKETS = (1, 2, 4, 8, 16)

    def __init__(self, dims: I.ModelDims, weights: PackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, max_batch: int = 16, num_programs: int | None = None,
                 config: KernelConfig | None = None, attn_splits: dict[int, int] | None = None) -> None:
        self.dims, self.w, self.k_cache, self.v_cache = dims, weights, k_cache, v_cache
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.cfg = config or KernelConfig()
        tiles = self.cfg.tiles or default_tiles(weights.fp8)
        # a QKV tile pairs runs of rows half a head apart: a run is at most half a head
        qkv = tiles[Op.QKV]
        self.tiles = tiles | {Op.QKV: dataclasses.replace(qkv, rows=min(qkv.rows, dims.head_dim // 2))}
        dev = weights.embed.device
        self.device = dev
        if num_programs is None:
            num_programs = 1 if INTERPRET or dev.type != "cuda" else \
                torch.cuda.get_device_properties(dev).multi_processor_count * self.cfg.programs_per_sm
        self.num_programs = num_programs
        self.max_batch = max_batch
        self.bpad = max(_pow2(max_batch), self.cfg.min_rows)  # buffer rows
        self.attn_splits = attn_splits or {}  # per bucket, where a test wants other than attention_splits()
        d, dt = dims, weights.embed.dtype
        self.slots_total, self.max_context = k_cache.shape[1], k_cache.shape[3]
        self.gpad = _pow2(d.group)
        bp = self.bpad

        def z(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, device=dev, dtype=dtype)

        self.tokens = z(bp, dtype=torch.int32)
        self.slots = z(bp, dtype=torch.int32)
        self.positions = z(bp, dtype=torch.int32)
        # how each row picks its token (kernels/sampling.py): temperature as float32 bits (0: greedy), seed words
        self.draw = z(3, bp, dtype=torch.int32)
        self.x, self.xn, self.q = z(bp, d.hidden), z(bp, d.hidden), z(bp, d.q_size)
        self.attn, self.ffn = z(bp, d.q_size), z(bp, d.ffn)
        self.logits = z(bp, d.vocab, dtype=torch.float32)
        self.argmax = z(bp, dtype=torch.int64)
        self.sampled = z(bp, dtype=torch.int64)  # the drawn token (the greedy one for rows that do not sample)
        self.max_splits = _pow2(self.cfg.max_splits)
        nparts = bp * d.num_kv_heads * self.max_splits
        self.pm, self.pl = z(nparts, self.gpad, dtype=torch.float32), z(nparts, self.gpad, dtype=torch.float32)
        self.pacc = z(nparts, self.gpad, d.head_dim, dtype=torch.float32)
        self.err = z(1, dtype=torch.int32)
        self.prof: torch.Tensor | None = None
        self.schedules: dict[int, I.Schedule] = {}
        self._sched_dev: dict[int, tuple[Any, ...]] = {}  # tasks, starts, counters, (LM-head partials), ssq
        # FP8 scales, or one placeholder float for every scale pointer
        placeholder = z(1, dtype=torch.float32)
        s = weights.scales or {}
        self._scales = tuple(s.get(n, placeholder) for n in PackedWeights.MATRICES)
        self._descs = self._descriptors()

    def _descriptors(self) -> tuple[object, ...]:
        """Each matrix as a [L*rows, cols] tensor descriptor with its tile's box where its matvec loads through TMA
        (QKV's box is one of a tile's two runs); the matrix itself elsewhere."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        ops = {"qkv": Op.QKV, "o": Op.OPROJ, "gate": Op.GATEUP, "up": Op.GATEUP, "down": Op.DOWN,
               "lm_head": Op.LMHEAD}
        out: list[object] = []
        for name in PackedWeights.MATRICES:
            w, t = self.w.matrix(name), self.tiles[ops[name]]
            if not t.tma:
                out.append(w)
                continue
            out.append(TensorDescriptor.from_tensor(w.reshape(-1, w.shape[-1]), [t.rows, t.k_chunk]))
        return tuple(out)

    def rows_of(self, batch: int) -> int:
        """Rows a launch for this bucket computes: the bucket, or the largest one where batch-invariant."""
        return self.bpad if self.cfg.batch_invariant else max(batch, self.cfg.min_rows)

    def tiling(self, batch: int) -> I.Tiling:
        splits = self.attn_splits.get(batch) or \
            I.attention_splits(self.dims, batch, self.num_programs, self.cfg.max_splits)
        return I.Tiling(rows={op: t.rows for op, t in self.tiles.items()}, attn_splits=splits)

    def schedule(self, batch: int) -> I.Schedule:
        if batch not in self.schedules:
            regions = self.w.regions() if (self.cfg.prefetch_ahead > 0 or self.cfg.prefetch_own) else None
            s = I.build_schedule(self.dims, batch, self.num_programs, self.tiling(batch), regions,
                                 self.cfg.prefetch_bytes)
            rows = self.rows_of(batch)
            self.schedules[batch] = s

            def partials(dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(s.num_lm_parts, rows, device=self.device, dtype=dtype)

            self._sched_dev[batch] = (
                s.tasks.to(self.device), s.starts.to(self.device),
                torch.zeros(s.layout.counters, device=self.device, dtype=torch.int32),
                # (max, argmax) partials of the LM-head tasks: greedy, then drawn
                (partials(torch.float32), partials(torch.int32), partials(torch.float32), partials(torch.int32)),
                torch.zeros(s.layout.ssq_slots, self.dims.hidden // I.SSQ_COLS, rows, device=self.device,
                            dtype=torch.float32),
            )
        return self.schedules[batch]

    def prof_buffer(self, s: I.Schedule) -> torch.Tensor:
        n = len(s.tasks)
        if not self.cfg.profile:
            return self.err
        if self.prof is None or self.prof.shape[0] < n:
            self.prof = torch.zeros(n, 4, device=self.device, dtype=torch.int64)
        return self.prof

    def step(self, batch: int) -> None:
        """One decode step for rows [0, batch) of tokens/slots/positions (batch must be a bucket size)."""
        d, c, w = self.dims, self.cfg, self.w
        s = self.schedule(batch)
        tasks, starts, counters, lm, ssq = self._sched_dev[batch]
        extra = {}
        if not INTERPRET and self.device.type == "cuda" and c.cooperative:
            extra["launch_cooperative_grid"] = True
        pf = not INTERPRET  # the interpreter runs no inline PTX

        def tile(op: Op) -> tuple[int, int, int, int, int, bool, bool]:
            t = self.tiles[op]
            return t.rows, t.k_chunk, t.k_slices, t.stages, t.prefetch_tiles if pf else 0, t.tma, t.k_halves

        megakernel[(self.num_programs,)](
            (tasks, starts, counters, self.err, self.prof_buffer(s)),
            (self.tokens, self.slots, self.positions, self.draw),
            batch, s.tiling.attn_splits,
            (w.embed, w.wqkv, w.bqkv if w.bqkv is not None else w.attn_norm, w.wo, w.w_gate, w.w_up, w.w_down,
             w.attn_norm, w.mlp_norm, w.final_norm, w.lm_head),
            self._scales, *self._descs, (self.cos, self.sin), (self.k_cache, self.v_cache),
            (self.x, self.xn, self.q, self.attn, self.ffn, self.logits), ssq, (self.pm, self.pl, self.pacc), lm,
            (self.argmax, self.sampled), d.rms_eps, d.head_dim ** -0.5,
            MODEL=(d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.ffn, d.vocab, d.num_layers, self.slots_total,
                   self.max_context, w.bqkv is not None),
            T_QKV=tile(Op.QKV), T_OPROJ=tile(Op.OPROJ), T_GATEUP=tile(Op.GATEUP), T_DOWN=tile(Op.DOWN),
            T_LMHEAD=tile(Op.LMHEAD),
            ATT=(self.gpad, c.chunk, self.max_splits, c.split_min_chunks),
            BPAD=self.rows_of(batch), W_FP8=w.fp8,
            PF_AHEAD=c.prefetch_ahead if pf else 0, PF_OWN=c.prefetch_own and pf, PF_KV=c.prefetch_kv and pf,
            DSTRIDE=self.draw.stride(0), CG=not INTERPRET, MAX_SPIN=c.max_spin, PROFILE=c.profile and not INTERPRET,
            num_warps=c.num_warps, num_stages=c.num_stages, **extra,
        )
