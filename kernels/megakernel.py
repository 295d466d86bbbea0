"""The megakernel: one persistent Triton kernel runs a whole decode step by executing the schedule that
kernels/instructions.py builds, in two launches back to back (the layers, then the LM head's tail:
KernelConfig.lm_launch). The kernel only interprets task records; every decision of who does what is on the host,
once per model and row bucket. This file holds the kernel's entry, which dispatches each task (Embed's
body is here; the other instructions' are in matvec.py, attention.py and lm_head.py, the waits and prefetches in
sync.py), and the host side that launches it (Megakernel; its arguments are in kernel_args.py, its tiles in tiles.py).

A step is a list of rows (slot, token, position). Rows are independent: several rows of one sequence at consecutive
positions (a prompt's chunk) ride beside decode rows. Every QKV task (which appends each row's K/V at its position)
finishes before any attention task starts, so a row at position p attends over [0, p] of its slot including the
K/V of the same step's earlier rows: causal attention within a chunk. Only the first `lm_rows` rows (the rows that
need a token: the caller puts them first) go through the LM head, the sampling and the argmax; their number is fixed
per row bucket (min(bucket, the Megakernel's max_sampled)), so each bucket's launch has a fixed shape.

Numerics follow the PyTorch reference (service/backends/reference.py): activations are rounded to the activations'
dtype where the reference rounds them (after each linear, RoPE, SiLU and residual add), and every sum is
accumulated in float32 (one reordering, the norms: matvec.py). No atomics anywhere in the arithmetic: a step is
deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import INTERPRET
from kernels import instructions as I
from kernels.attention import attention, prefetch_kv
from kernels.instructions import Op
from kernels.kernel_args import (
    INT8_BLOCK,
    Activations,
    AttnScratch,
    AttnShape,
    Cache,
    KSplit,
    LmOut,
    LmPartials,
    MatvecWeights,
    ModelShape,
    PackedWeights,
    QkvOut,
    ResidualOut,
    Scales,
    Sched,
    StepInputs,
    StepOutputs,
    Weights,
)
from kernels.lm_head import argmax, lm_partials
from kernels.matvec import matvec, norm_operand
from kernels.query_blocks import BLOCK_FIELDS, query_blocks
from kernels.sync import prefetch, prefetch_record, prefetch_regions, wait_counter
from kernels.tiles import MatvecTile, TileTable, default_tiles, fit_to_programs, parts_of_k

# ---------------------------------------------------------------------------------------------------------------
# the kernel


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
        norm_operand(e, m, rb, n0, xn_ptr, nw_ptr, ssq_ptr, embed_ptr.dtype.element_ty, H, BPAD, BN)


@triton.jit
def _field(rec, k: tl.constexpr, valid):
    """Field k of a record; with `valid` (not None) a masked load, 0 where it is False."""
    if valid is None:
        return tl.load(rec + k)
    else:
        return tl.load(rec + k, mask=valid, other=0)


@triton.jit
def _record(rec, valid=None):
    """A task's whole record (instructions.RECORD_LEN int64 fields) as a tuple, its loads issued together: one round
    trip, before anything waits on any field (fields loaded where each is first used cost a round trip each on the
    task's critical path: ncu's stall samples at 1 and 16 rows, bench/NOTES.md). `valid` False: zeros (record_ahead's
    load after a program's last task reads nothing)."""
    tl.static_assert(I.RECORD_LEN == 16, "_record loads 16 fields")
    return (_field(rec, 0, valid), _field(rec, 1, valid), _field(rec, 2, valid), _field(rec, 3, valid),
            _field(rec, 4, valid), _field(rec, 5, valid), _field(rec, 6, valid), _field(rec, 7, valid),
            _field(rec, 8, valid), _field(rec, 9, valid), _field(rec, 10, valid), _field(rec, 11, valid),
            _field(rec, 12, valid), _field(rec, 13, valid), _field(rec, 14, valid), _field(rec, 15, valid))


@triton.jit
def _matvec_task(r, ssq_ptr, SSQ: tl.constexpr):
    """A Matvec record's first row, row tiles, and its slot of sums of squares."""
    return r[I.MV_ROW0], r[I.MV_TILES], ssq_ptr + r[I.MV_SSQ] * SSQ


@triton.jit
def _k_split(r, sched):
    """A Matvec record's part of K, its tile's arrival counter and scratch slot (used where its K is split)."""
    return KSplit(r[I.MV_K_SPLIT], r[I.MV_ARRIVE], r[I.MV_SLOT], sched.counters, sched.k_sums)


@triton.jit(noinline=True)
def matvec_call(OP: tl.constexpr, row0, tiles, B, layer, ws, a_ptr, ssq_ptr, out, eps, dt: tl.constexpr,
                MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr, BPAD: tl.constexpr,
                SSQ_STRIDE: tl.constexpr, CG: tl.constexpr, ks=None):
    """A layer's matvec as a function of its own (KernelConfig.call_min_rows): no result (a call's tensors cannot
    cross it), and none of its loop-invariant values hoisted into the task loop."""
    matvec(OP, row0, tiles, B, layer, ws, a_ptr, ssq_ptr, out, eps, dt, MODEL, K, N, TILE, BPAD, SSQ_STRIDE, CG, ks)


@triton.jit(noinline=True)
def attention_call(layer, b, g0, s, S, arrive, arrive_row_stride, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr,
                   sm_scale, MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """attention as a function of its own (KernelConfig.call_attention_max_rows); its result is a scalar."""
    return attention(layer, b, g0, s, S, arrive, arrive_row_stride, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr,
                     sm_scale, MODEL, ATT, CG)


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
    REC_AHEAD: tl.constexpr,  # KernelConfig.record_ahead: the next task's record loaded as this one releases
    DSTRIDE: tl.constexpr, CG: tl.constexpr, MAX_SPIN: tl.constexpr, POLL_ACQUIRE: tl.constexpr,
    PROFILE: tl.constexpr,
    SKIP_WAITS: tl.constexpr,  # timing only (KernelConfig.skip_waits): a mask of the ops whose tasks never wait
    MATVEC: tl.constexpr,  # a layer's matvec: matvec inlined, or matvec_call (KernelConfig.call_min_rows)
    ATTENTION: tl.constexpr,  # attention inlined, or attention_call
    PART: tl.constexpr = 0,  # which tasks this launch runs: 0 the whole step, 1 the layers, 2 the LM head's tail
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
    t_all = tl.load(sched.starts + pid + 1)  # where the program's tasks end in the whole step
    t_begin = tl.load(sched.lm_starts + pid) if PART == 2 else tl.load(sched.starts + pid)
    t_end = tl.load(sched.lm_starts + pid) if PART == 1 else t_all
    LAYERS: tl.constexpr = PART != 2  # the instructions compiled into this launch
    TAIL: tl.constexpr = PART != 1
    if PF_AHEAD > 0:
        for i in tl.static_range(PF_AHEAD):
            if t_begin + i < t_end:
                prefetch(sched.tasks + (t_begin + i) * NF)
    # the records' cache lines travel two tasks ahead of their use (records are reread once a step: by then the
    # weight stream has pushed them out of L2)
    if CG:  # (the interpreter runs no inline PTX)
        for i in tl.static_range(2):
            if t_begin + i < t_end:
                prefetch_record(sched.tasks + (t_begin + i) * NF)
    if REC_AHEAD:
        r_next = _record(sched.tasks + t_begin * NF, t_begin < t_end)
    for t in range(t_begin, t_end):
        rec = sched.tasks + t * NF
        if PROFILE:
            tl.store(sched.prof + t * 4, tl.extra.cuda.globaltimer())
        if REC_AHEAD:
            r = r_next
        else:
            r = _record(rec)
        if CG:
            if t + 2 < t_end:
                prefetch_record(rec + 2 * NF)
        if PF_AHEAD > 0:  # (the layers' launch prefetches the LM head's first weights too)
            if t + PF_AHEAD < t_all:
                prefetch(sched.tasks + (t + PF_AHEAD) * NF)
        if PF_OWN:  # this task's first weights travel into L2 while it waits for its inputs
            prefetch_regions(r[I.F_PF0], r[I.F_PF0_BYTES], r[I.F_PF1], r[I.F_PF1_BYTES])
        op = r[I.F_OP]
        layer = r[I.F_LAYER]
        if PF_KV and LAYERS:
            if op == I.ATTN:
                prefetch_kv(r, inputs, cache, MODEL, ATT)
        if SKIP_WAITS == 0:  # (the default's code as it was: no per-op test)
            wait_counter(sched.counters, r[I.F_WAIT], r[I.F_TARGET], sched.err, MAX_SPIN, POLL_ACQUIRE)
        elif ((SKIP_WAITS >> op) & 1) == 0:
            wait_counter(sched.counters, r[I.F_WAIT], r[I.F_TARGET], sched.err, MAX_SPIN, POLL_ACQUIRE)
        if PROFILE:
            tl.store(sched.prof + t * 4 + 1, tl.extra.cuda.globaltimer())
        inc = tl.full([], 1, tl.int32)
        if (op == I.QKV) and LAYERS:
            row0, tiles, ssq = _matvec_task(r, ssq_ptr, SSQ)
            wl = w.wqkv + layer * QKVR * H
            sc = scales.qkv + layer * QKVR if FP8 else None
            bias = w.bqkv + layer * QKVR if w.bqkv is not None else None
            MATVEC(I.QKV, row0, tiles, batch, layer, MatvecWeights(wl, wl, sc, sc, bias, d_qkv, d_qkv, layer * QKVR),
                    xn_ptr, ssq, QkvOut(acts.q, cache, cos, sin, inputs.slots, inputs.positions), eps, dt,
                    MODEL, H, QKVR, T_QKV, BPAD, BPAD, CG, _k_split(r, sched))
        elif (op == I.ATTN) and LAYERS:
            inc = ATTENTION(layer, r[I.ATTN_ROW], r[I.ATTN_KV_HEAD], r[I.ATTN_SPLIT], attn_splits, r[I.ATTN_ARRIVE],
                             r[I.ATTN_ARRIVE_ROW_STRIDE], sched.counters, inputs, acts.q, cache, attn_scratch,
                             acts.attn, sm_scale, MODEL, ATT, CG)
        elif (op == I.OPROJ) and LAYERS:
            row0, tiles, ssq = _matvec_task(r, ssq_ptr, SSQ)
            sc = scales.o + layer * H if FP8 else None
            MATVEC(I.OPROJ, row0, tiles, batch, layer,
                    MatvecWeights(w.wo + layer * H * Q, None, sc, None, None, d_o, None, layer * H),
                    acts.attn, ssq, ResidualOut(x_ptr, xn_ptr, w.mlp_norm + layer * H), eps, dt, MODEL, Q, H,
                    T_OPROJ, BPAD, BPAD, CG, _k_split(r, sched))
        elif (op == I.GATEUP) and LAYERS:
            row0, tiles, ssq = _matvec_task(r, ssq_ptr, SSQ)
            sg = scales.gate + layer * F if FP8 else None
            su = scales.up + layer * F if FP8 else None
            MATVEC(I.GATEUP, row0, tiles, batch, layer,
                    MatvecWeights(w.w_gate + layer * F * H, w.w_up + layer * F * H, sg, su, None, d_g, d_u,
                                  layer * F),
                    xn_ptr, ssq, acts.ffn, eps, dt, MODEL, H, F, T_GATEUP, BPAD, BPAD, CG, _k_split(r, sched))
        elif (op == I.DOWN) and LAYERS:
            row0, tiles, ssq = _matvec_task(r, ssq_ptr, SSQ)
            # x += ffn @ Wdown^T, and the next layer's attention-norm operand (the final norm's after the last)
            nw = tl.where(layer == MODEL.layers - 1, w.final_norm, w.attn_norm + (layer + 1) * H)
            sc = scales.down + layer * H if FP8 else None
            MATVEC(I.DOWN, row0, tiles, batch, layer,
                    MatvecWeights(w.w_down + layer * H * F, None, sc, None, None, d_d, None, layer * H),
                    acts.ffn, ssq, ResidualOut(x_ptr, xn_ptr, nw, acts.xn_final), eps, dt, MODEL, F, H, T_DOWN,
                    BPAD, BPAD, CG, _k_split(r, sched))
        elif (op == I.LMHEAD) and TAIL:
            row0, tiles, ssq = _matvec_task(r, ssq_ptr, SSQ)
            # the first lm_rows rows only (BS of them in the tiles), reading the final norm's sums BPAD rows apart
            sc = scales.lm_head if FP8 else None
            best_v, best_i = matvec(I.LMHEAD, row0, tiles, lm_rows, layer,
                                     MatvecWeights(w.lm_head, None, sc, None, None, d_lm, None, 0),
                                     xn_ptr if acts.xn_final is None else acts.xn_final, ssq,
                                     LmOut(acts.logits, inputs.masks, inputs.draw + 3 * DSTRIDE), eps, dt,
                                     MODEL, H, V, T_LMHEAD, BS, BPAD, CG)
            lm_partials(row0, tl.minimum(row0 + tiles * T_LMHEAD.rows, V), r[I.MV_PART], best_v,
                         best_i, lm_rows, lm, acts.logits, inputs.draw, inputs.positions, V, BS, DSTRIDE, CG)
        elif (op == I.EMBED) and LAYERS:
            _embed(r[I.EMBED_COL0], r[I.EMBED_TILES], batch, inputs.tokens, w.embed, x_ptr, xn_ptr, w.attn_norm,
                   ssq_ptr + r[I.EMBED_SSQ] * SSQ, H, BPAD, I.EMBED_COLS)
        elif (op == I.ARGMAX) and TAIL:
            argmax(lm_rows, r[I.ARGMAX_PARTS], r[I.ARGMAX_COUNTERS], lm, outs, inputs.draw, inputs.positions,
                    sched.counters, V, BS, CG, DSTRIDE)
            inc = tl.full([], 0, tl.int32)
        if REC_AHEAD:  # its round trip beside this task's barrier and release, off the next task's critical path
            r_next = _record(rec + NF, t + 1 < t_end)
        tl.debug_barrier()
        done = r[I.F_DONE]
        if (done >= 0) & (inc > 0):
            tl.atomic_add(sched.counters + done, inc, sem="release", scope="gpu")
        if PROFILE:
            tl.store(sched.prof + t * 4 + 2, tl.extra.cuda.globaltimer())
            tl.store(sched.prof + t * 4 + 3, tl.extra.cuda.smid().to(tl.int64))


# ---------------------------------------------------------------------------------------------------------------
# host side


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# what KernelConfig.tiles may be: one table for every launch, or a function of the launch's rows
TileChoice = TileTable | Callable[[int], TileTable]


def skip_mask(skip_waits: bool | tuple[Op, ...]) -> int:
    """KernelConfig.skip_waits as the kernel's mask: bit `op` set where that op's tasks never wait (True: all)."""
    if skip_waits is True:
        return (1 << len(Op)) - 1
    return sum(1 << int(op) for op in skip_waits or ())


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 4
    # 8-bit weights with row scales (FP8, int8-row) in buckets of wide_warps_rows rows or more: warps a program. Their
    # swapped tiles' dots and conversions are issued by one warp per scheduler at 4 warps, which hides little, and
    # their 64-row launch kept 328 B of stack a thread (8 warps: 80). On the H100, in turns against 4 (bench/NOTES.md
    # "Eight warps for 8-bit 64-row steps"): 64 rows FP8 1.864 -> 1.758 ms, int8-row 2.136 -> 1.921; but 32 rows FP8
    # 1.293 -> 1.380 and bf16 slower at both (1.465 -> 1.683, 1.862 -> 1.988), so bf16 and 32 rows keep num_warps
    wide_warps_8bit: int = 8
    wide_warps_rows: int = 64
    num_stages: int = 4  # the launch's default, for loops that set none of their own
    programs_per_sm: int = 1
    tiles: TileChoice | None = None  # None: default_tiles for each launch's rows and the weights' format
    # a given table fitted to the programs as the default is (tiles.fit_to_programs): bench variants that change one
    # matvec of the default, timed on a model whose default is fitted (SmolLM2, Qwen2.5), change only that matvec
    fit_tiles: bool = False
    chunk: int = 64  # attention positions per inner step (buckets under wide_chunk_rows)
    max_splits: int = 16  # attention splits per (row, kv head) at most
    split_min_chunks: int = 4  # a split reads at least this many chunks (shorter contexts use fewer splits)
    # Buckets of wide_chunk_rows rows or more: wide_chunk positions per inner step, splits of wide_split_min_chunks of
    # them at least. A task's inner steps run one after another (each waits on the last one's max and sum), so at long
    # contexts attention pays per step, not per byte: on the H200, 128 positions a step in splits of 512 or more took
    # the 16-row step at context 2048 1.64 -> 1.51 ms (bf16), 1.53 -> 1.36 (FP8), 8 rows -4%; one row keeps 64 (its
    # splits spread a short context over more programs) (bench/NOTES.md, s43)
    wide_chunk_rows: int = 8
    wide_chunk: int = 128
    wide_split_min_chunks: int = 4
    # Attention's K/V pipeline: stages - 1 chunks copied ahead. Two, not three: on the H200 8 rows at context 2048
    # took 1.219 -> 1.203 ms (bf16), 1.095 -> 1.076 (FP8), never slower in two calls (bench/NOTES.md, s45; variant
    # `attn-st4` is the old way)
    attn_stages: int = 3
    # Where a launch gives each (row, KV head) one attention task (its tiling's attn_splits 1: Llama's 16 rows), that
    # task streams all the pair's positions as one split: one pipeline fill, no partials, no merge. On the H200 16
    # rows took 1.509 -> 1.443 ms at context 2048 (bf16), FP8 1.365 -> 1.255, 0.918 -> 0.883 at 128; 1 and 8 rows
    # unchanged (bench/NOTES.md, s44; variant `multi-split` is the old way)
    single_split: bool = True
    min_rows: int = 1  # a launch pads its rows to max(bucket, min_rows)
    batch_invariant: bool = False  # every bucket pads its rows to the largest one: the same sums in the same order
    prefetch_ahead: int = 1  # tasks ahead whose first weights are prefetched into L2 (0: none)
    prefetch_own: bool = True  # each task's own first weights, prefetched into L2 before it waits
    prefetch_bytes: int = 64 << 10  # at most this much of each of a task's weight regions
    prefetch_kv: bool = True  # attention tasks prefetch their cached keys and values into L2 before they wait
    # The next task's record (16 fields, its line already in L2) loaded at the end of this task, before its barrier
    # and release, instead of at the next task's start: under ncu a one-row step's warps spent 8% of their samples
    # waiting on a task's record (bench/NOTES.md, s71), on the critical path wherever a task's inputs are ready
    record_ahead: bool = False
    head_counters: bool = True  # attention for a KV head waits for its own group's QKV tasks, not the whole phase
    # KV heads (of one row) an attention task streams one after another, at most: in buckets whose attention has a
    # task per (row, KV head) pair and whose tasks would still number about one a program (32 and 64 rows of Llama).
    # 4 took the H100's FP8 64-row step 1.96 -> 1.87 ms, 32 rows -2.4%, at context 2048 -11 to -15%, the logits the
    # same (bench variant `attn-h1`: one head a task; bench/NOTES.md, s42)
    attn_heads: int = 4
    # Rows of one slot at consecutive positions (a prompt's chunk) attend in query blocks of block_queries query heads
    # (4 rows of Llama, whose 4 query heads a KV head leave 12 of a 16-query tile empty): each block reads its keys
    # and values once for its rows, and its rows' tasks share its heads and splits (kernels/attention.py). Off where
    # batch-invariant (a row's sums would depend on its neighbours)
    query_blocks: bool = False
    block_queries: int = 16
    # ... in a launch of its own (the same kernel compiled with the blocks' path: compiled into every launch it cost the
    # other phases 3-15%, its registers spilling the task loop's), which the decoder runs for a step whose every row is
    # in a block of several and which attend over this many positions together at least (kernels/query_blocks.py:
    # uses_blocks). On the H200 a 64-row prompt over 2,048 positions took 2.86 -> 2.11 ms (bf16), 3.00 -> 2.16 (FP8);
    # 32 rows 1.89 -> 1.55; 16 rows 1.30 -> 1.22; about even at 32K positions, slower under (bench/NOTES.md, s60).
    # Where it is over 0 that launch only ever runs steps whose rows are all in blocks, so a row's own path is not
    # compiled into it (AttnShape.block_only: a padding row's tasks count their pairs done): on the H200 the 64-row
    # prompt step at 2,048 took 2.095 -> 1.996 ms, 16 rows 1.232 -> 1.199 (bf16; bench variant `qblocks-mixed`, 0,
    # is the launch with both paths, which the tests use to run blocks beside decode rows)
    block_min_positions: int = 1 << 15
    # splits a block's merge folds at a time (a row's merge: 4): 16 queries x 4 splits of partials held at once had
    # the block launch spill (64 rows' stack 312 B bf16, 1,592 FP8; two at a time 232 and 792). On the H200, prompt
    # rows at 2,048 positions: bf16 32 / 64 rows 1.582 -> 1.518, 2.118 -> 2.086 ms, FP8 16 rows 1.133 -> 1.088, its
    # 64-row step 2.159 -> 2.032 by the kernel's clock; bf16 16 rows 1.217 -> 1.250 (bench variants qblocks-m4 / -m1)
    block_merge: int = 2
    cooperative: bool = True
    max_spin: int = 1 << 22
    poll_acquire: bool = True  # waits poll with acquire loads (one L2 round trip less a task; sync.py)
    profile: bool = False  # record (start, ready, end, SM) per task in Megakernel.prof
    # Timing only: every task starts without waiting for its inputs (the results are wrong). The step's cost less its
    # dependency latency: what the same tasks cost streamed back to back (bench variant `no-wait`). Ops named: only
    # their tasks skip their waits (bench variants `no-wait-<op>`): what each boundary costs the step on its own
    skip_waits: bool | tuple[Op, ...] = False
    # 8-bit weights: the norms' operand stored as float16 (times F16_SCALE: matvec.norm_operand), so QKV and gate/up
    # convert nothing either, and the final norm's operand, the LM head's input, in the activations' type apart (stored
    # as float16 the LM head of 16 sampled rows ran 35 us slower). Timed (bench variant `xn16`): 64 rows -3.3%, 1 row
    # -0.9%, 16 rows +1.8% (the server's bucket), so off
    f16_norm_operand: bool = False
    # The LM head, the sampling and the argmax in a launch of their own right after the layers' (the same kernel with
    # only those instructions compiled in; both in the step's CUDA graph): each launch's registers and shared memory
    # are then what its own phases need, not the most any phase of the step needs. On the H100 the 16-row step 4.7%
    # (FP8) and 5.7% (bf16) faster, 64 rows 6%, one row even (bench/NOTES.md "The LM head in a launch of its own")
    lm_launch: bool = True
    # Each layer's matvec, and attention in launches of up to call_attention_max_rows rows, called as a function of
    # its own rather than inlined into the task loop, in launches of call_min_rows rows or more (8-bit weights:
    # call_min_rows_8bit): the compiler then cannot hoist their loop-invariant values (offsets, masks) out of the
    # loop, where they stayed live across every task (sm90-compile, 16 rows: 255 -> 168 registers; 64 rows' stack
    # 184 -> 48 B bf16, 744 -> 224 FP8). On the H200, in turns against both inlined (bench/NOTES.md s64; variants
    # inline, inline-attn, call-all): FP8 faster at every row count (1 row -1.3 to -1.9%, 8 rows -3 to
    # -4%, 16 rows -3.3% at context 128 and -5.9% at 2,048); bf16 16 rows -1% / -3%, but 1 row +0.4 to +0.9% and 8
    # rows +1.4% at context 128, so bf16 calls from 16 rows. From 32 rows attention inlined beside called matvecs was
    # the fastest (64 rows at 2,048 -7% bf16, -9% FP8; called, it lost FP8's 64-row blocks' launch 8%).
    call_min_rows: int = 16
    call_min_rows_8bit: int = 1
    call_attention_max_rows: int = 16
    # Launches whose LM head has one_lm_row_min rows or more (0: none), in buckets of one_lm_max_rows rows at most,
    # have a second LM-head launch of one row, for the steps where one row samples at most: a prompt alone (its last
    # row), a voice turn's new tokens; the first token a user waits on. The layers' launch is the same
    # (Megakernel.step). On the H100, prompt rows alone against the LM head of 16 rows (bench variant `lm-all`,
    # decode-...-s85.md): 16 / 32 rows FP8 0.929 -> 0.903, 1.257 -> 1.227 ms at context 128 (its LM head 118 -> 100 us),
    # bf16 1.182 -> 1.170, 1.407 -> 1.389 (196 -> 180 us), as much at 2,048. Its tail runs one_lm_warps warps a program
    # whatever the bucket's (one row's LM tiles were tuned at 4): 64 rows (decode-...-s85b.md, against the plain launch)
    # FP8 1.654 -> 1.631 and 2.556 -> 2.534 ms at 128 / 2,048 rows, bf16 1.810 -> 1.792, 2.757 -> 2.728; the tail at the
    # 8-bit bucket's 8 warps (variant `one-lm-64-w8`) was 25-28 us slower than the plain launch
    one_lm_row_min: int = 16
    one_lm_max_rows: int = 64
    one_lm_warps: int = 4


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
        # each row's query block (kernels/query_blocks.py)
        self.blocks = z(BLOCK_FIELDS, bp, dtype=torch.int32)
        self.x, self.xn, self.q = z(bp, d.hidden), z(bp, d.hidden), z(bp, d.q_size)
        self.xn_final: torch.Tensor | None = None  # the LM head reads xn
        if weights.scales is not None and self.cfg.f16_norm_operand:
            self.xn, self.xn_final = z(bp, d.hidden, dtype=torch.float16), self.xn
        # O's and down's inputs: with 8-bit weights their dots run in float16, so attention and gate/up's epilogue
        # store them as float16 (the same values the dots read before: each rounded to the activations' type first),
        # and O and down stream them into the dot unconverted (at 64 rows four times the weights' elements a tile:
        # 2.26 -> 2.17 ms a step). The norms' operand stays in the activations' type: stored as float16 (times
        # F16_SCALE) it made the 64-row step 6% faster still but the LM head of 16 sampled rows 35 us slower
        # (bench/NOTES.md, "FP8 at 64 rows")
        mid = torch.float16 if weights.scales is not None else dt
        self.attn, self.ffn = z(bp, d.q_size, dtype=mid), z(bp, d.ffn, dtype=mid)
        self.logits = z(sp, d.vocab, dtype=torch.float32)
        self.argmax = z(sp, dtype=torch.int64)
        self.sampled = z(sp, dtype=torch.int64)  # the drawn token (the greedy one for rows that do not sample)
        self.max_splits = _pow2(self.cfg.max_splits)
        nparts = bp * d.num_kv_heads * self.max_splits
        # a query block's tile of queries (0: none)
        self.block_queries = max(self.cfg.block_queries, self.gpad) \
            if self.cfg.query_blocks and not self.cfg.batch_invariant else 0
        qp = max(self.gpad, self.block_queries)  # queries a part holds
        self.pm, self.pl = z(nparts, qp, dtype=torch.float32), z(nparts, qp, dtype=torch.float32)
        self.pacc = z(nparts, qp, d.head_dim, dtype=torch.float32)
        self.err = z(1, dtype=torch.int32)
        self.prof: torch.Tensor | None = None
        # per (bucket, one LM row): the default launch's, and where has_one_lm_row, the one-LM-row launch's
        self.schedules: dict[tuple[int, bool], I.Schedule] = {}
        self._launches: dict[tuple[int, bool], _Launch] = {}
        self.compiled: dict[int, object] = {}  # each part's kernel as its last launch compiled it (its cubin: ncu-step)
        s = weights.scales
        self._scales = Scales(*(s[n] for n in PackedWeights.MATRICES)) if s is not None else None

    # -- per bucket ----------------------------------------------------------------------------------------------
    @property
    def block_rows(self) -> int:
        """Rows of a query block at most (0: no blocks)."""
        return self.block_queries // self.dims.group

    def fill_blocks(self, batch: int) -> None:
        """blocks for rows [0, batch) from what slots and positions hold (for benchmarks, which write those on the
        device; the decoder writes all three from its host lists)."""
        if self.block_queries:
            blocks = query_blocks(self.slots[:batch].tolist(), self.positions[:batch].tolist(), self.block_rows)
            self.blocks[:, :batch] = torch.tensor(blocks, dtype=torch.int32)

    def rows_of(self, batch: int) -> int:
        """Rows a launch for this bucket computes: the bucket, or the largest one where batch-invariant."""
        return self.bpad if self.cfg.batch_invariant else max(batch, self.cfg.min_rows)

    def lm_rows_of(self, batch: int, one_lm: bool = False) -> int:
        """Rows of the LM head's tiles in a launch for this bucket (one_lm: its one-LM-row launch's: 1)."""
        return 1 if one_lm else min(self.rows_of(batch), self.spad)

    def has_one_lm_row(self, batch: int) -> bool:
        """Whether this bucket has a launch whose LM head takes one row (KernelConfig.one_lm_row_min), for steps
        where one row samples at most. Not where batch-invariant: a row's logits would depend on the launch."""
        m = self.cfg.one_lm_row_min
        return m > 0 and not self.cfg.batch_invariant and self.cfg.lm_launch and \
            self.lm_rows_of(batch) >= max(m, 2) and self.rows_of(batch) <= self.cfg.one_lm_max_rows

    def _table(self, rows: int) -> TileTable:
        t = self.cfg.tiles
        eight_bit = self.w.fp8 or self.w.int8
        if t is None:
            tiles = default_tiles(eight_bit, rows, self.w.int8_blocks, e4m3=self.w.fp8, a8_int8=self.w.int8_rows)
        else:
            tiles = t(rows) if callable(t) else t
            if not self.cfg.fit_tiles:
                return tiles
        if self.w.int8_blocks:  # (its k slices follow int8's blocks: not measured)
            return tiles
        return fit_to_programs(tiles, rows, eight_bit, self.dims.qkv_rows, self.dims.ffn, self.num_programs)

    def tiles(self, batch: int, one_lm: bool = False) -> TileTable:
        """Each matvec's tile in a launch for this bucket (the LM head's chosen for its own rows; one_lm: one row).
        A QKV tile pairs runs of rows half a head apart: a run is at most half a head."""
        lm_rows = self.lm_rows_of(batch, one_lm)
        tiles = self._table(self.rows_of(batch)) | {Op.LMHEAD: self._table(lm_rows)[Op.LMHEAD]}
        ks = {Op.QKV: self.dims.hidden, Op.OPROJ: self.dims.q_size, Op.GATEUP: self.dims.hidden,
              Op.DOWN: self.dims.ffn, Op.LMHEAD: self.dims.hidden}
        for op, t in list(tiles.items()):
            if t.k_splits > 1:
                if op is Op.LMHEAD:
                    raise ValueError("the LM head's K is never split")
                # parts of K must divide its chunks: the tile asks for a count, the model's K settles it
                t = tiles[op] = t._replace(k_splits=parts_of_k(-(-ks[op] // t.k_chunk), t.k_splits))
            rows = lm_rows if op is Op.LMHEAD else self.rows_of(batch)
            if t.swap and (self.w.int8_blocks or rows < 16 and not INTERPRET):
                raise ValueError(f"{op.name}: swapped tiles need rows padded to 16 (KernelConfig.min_rows; the LM "
                                 "head's: max_sampled) and no int8 block scales")
            if t.w8a8 and not (t.swap and (self.w.fp8 or self.w.int8_rows)):
                raise ValueError(f"{op.name}: W8A8 tiles need FP8 or int8-row weights and swapped operands")
            if self.w.int8_blocks and INT8_BLOCK % (t.k_chunk // t.k_slices):
                raise ValueError(f"int8 weights: {op.name}'s k slices of {t.k_chunk // t.k_slices} columns cross "
                                 f"blocks of {INT8_BLOCK} (int8_slices makes a tile's slices fit)")
        qkv = tiles[Op.QKV]
        return tiles | {Op.QKV: qkv._replace(rows=min(qkv.rows, self.dims.head_dim // 2))}

    def tiling(self, batch: int, one_lm: bool = False) -> I.Tiling:
        splits = self.attn_splits.get(batch) or \
            I.attention_splits(self.dims, batch, self.num_programs, self.cfg.max_splits)
        tiles = self.tiles(batch, one_lm)
        pairs, heads = batch * self.dims.num_kv_heads, 1
        while (splits == 1 and heads * 2 <= self.cfg.attn_heads
               and self.dims.num_kv_heads % (heads * 2) == 0 and pairs / (heads * 2) >= 0.9 * self.num_programs):
            heads *= 2
        return I.Tiling(rows={op: t.rows for op, t in tiles.items()}, attn_splits=splits,
                        head_counters=self.cfg.head_counters, attn_heads=heads,
                        k_splits={op: t.k_splits for op, t in tiles.items() if t.k_splits > 1})

    def schedule(self, batch: int, one_lm: bool = False) -> I.Schedule:
        """The bucket's schedule (one_lm: its one-LM-row launch's, where has_one_lm_row)."""
        key = (batch, one_lm and self.has_one_lm_row(batch))
        one_lm = key[1]
        if key not in self.schedules:
            regions = self.w.regions() if (self.cfg.prefetch_ahead > 0 or self.cfg.prefetch_own) else None
            s = I.build_schedule(self.dims, batch, self.num_programs, self.tiling(batch, one_lm), regions,
                                 self.cfg.prefetch_bytes)
            self.schedules[key] = s
            rows, lm_rows = self.rows_of(batch), self.lm_rows_of(batch, one_lm)

            def partials(dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(s.num_lm_parts, lm_rows, device=self.device, dtype=dtype)

            tiles = self.tiles(batch, one_lm)
            self._launches[key] = _Launch(
                rows=rows, lm_rows=lm_rows,
                tiles={op: self._runnable(t) for op, t in tiles.items()},
                descriptors=self._descriptors(tiles),
                sched=Sched(s.tasks.to(self.device), s.starts.to(self.device),
                            torch.zeros(s.layout.counters, device=self.device, dtype=torch.int32), self.err, None,
                            torch.zeros(max(1, self._k_sums(tiles, rows)), device=self.device,
                                        dtype=torch.float32), _lm_starts(s).to(self.device)),
                lm=LmPartials(partials(torch.float32), partials(torch.int32), partials(torch.float32),
                              partials(torch.int32)),
                ssq=torch.zeros(s.layout.ssq_slots, self.dims.hidden // I.SSQ_COLS, rows, device=self.device,
                                dtype=torch.float32),
            )
        return self.schedules[key]

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
        return t if not INTERPRET else t._replace(prefetch_tiles=0, int8_prmt=False)  # the interpreter: no PTX

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

    def step(self, batch: int, blocks: bool = False, one_lm: bool = False) -> None:
        """One step for rows [0, batch) of tokens/slots/positions (batch must be a bucket size); the LM head, the
        sampling and the argmax for the first min(batch, max_sampled) of them (one_lm, where has_one_lm_row: the
        first row only). blocks: the launch whose attention takes rows in query blocks (block_queries; `blocks`
        then holds each row's)."""
        c = self.cfg
        one_lm = one_lm and self.has_one_lm_row(batch)
        s = self.schedule(batch, one_lm)
        launch = self._launches[batch, one_lm]
        extra: dict[str, object] = {}
        if not INTERPRET and self.device.type == "cuda" and c.cooperative:
            extra["launch_cooperative_grid"] = True
        pf = not INTERPRET  # the interpreter runs no inline PTX
        if not c.lm_launch:
            self._launch(0, batch, s, launch, pf, extra, blocks)
            return
        # The layers' launch runs none of the LM head's instructions: with one LM row it takes the default launch's LM
        # constexprs, row counts and descriptors (the compiled kernel's specialization), so that a bucket's two launches
        # share the layers' compiled kernel; its schedule, counters and sums are its own launch's, which the LM head's
        # tail then reads
        sampled = min(batch, self.max_sampled)
        layers = launch
        if one_lm:
            self.schedule(batch)
            plain = self._launches[batch, False]
            layers = dataclasses.replace(launch, rows=plain.rows, lm_rows=plain.lm_rows, tiles=plain.tiles,
                                         descriptors=plain.descriptors)
        self._launch(1, batch, s, layers, pf, extra, blocks, lm_rows=sampled)
        self._launch(2, batch, s, launch, pf, extra, blocks, lm_rows=1 if one_lm else sampled,
                     warps=c.one_lm_warps if one_lm else None)

    def attn_shape(self, s: I.Schedule, blocks: bool = False) -> AttnShape:
        """Attention's constexprs for a bucket's schedule: wide launches step through more positions at a time (by the
        rows the launch computes, so a batch-invariant kernel sums every bucket's attention alike); with `blocks`,
        query blocks."""
        c = self.cfg
        rows = self.rows_of(s.batch)
        wide = rows >= c.wide_chunk_rows
        one = c.single_split and self.tiling(rows).attn_splits == 1
        return AttnShape(self.gpad, c.wide_chunk if wide else c.chunk, 1 if one else self.max_splits,
                         c.wide_split_min_chunks if wide else c.split_min_chunks, s.tiling.attn_heads, c.attn_stages,
                         self.block_queries if blocks else 0, self.max_splits, c.block_merge,
                         blocks and self.block_queries > 0 and c.block_min_positions > 0)

    def _launch(self, part: int, batch: int, s: I.Schedule, launch: _Launch, pf: bool, extra: dict[str, object],
                blocks: bool = False, lm_rows: int | None = None, warps: int | None = None) -> None:
        """One launch of the step's kernel: its tasks (part 0), its layers' (1) or the LM head's tail (2); lm_rows:
        the rows its LM head takes (default min(batch, max_sampled)); warps: a program's (default: warps(rows))."""
        d, c, w = self.dims, self.cfg, self.w
        called = launch.rows >= (c.call_min_rows if self._scales is None else c.call_min_rows_8bit)
        self.compiled[part] = megakernel[(self.num_programs,)](
            launch.sched._replace(prof=self.prof_buffer(s)),
            StepInputs(self.tokens, self.slots, self.positions, self.draw, self.masks, self.blocks,
                       self.blocks.stride(0)),
            batch, min(batch, self.max_sampled) if lm_rows is None else lm_rows, s.tiling.attn_splits,
            Weights(w.embed, w.wqkv, w.bqkv, w.wo, w.w_gate, w.w_up, w.w_down, w.attn_norm, w.mlp_norm,
                    w.final_norm, w.lm_head),
            self._scales, *launch.descriptors, self.cos, self.sin,
            Cache(self.k_cache, self.v_cache, self.slots_total, self.max_context),
            Activations(self.x, self.xn, self.q, self.attn, self.ffn, self.logits, self.xn_final), launch.ssq,
            AttnScratch(self.pm, self.pl, self.pacc), launch.lm, StepOutputs(self.argmax, self.sampled),
            d.rms_eps, d.head_dim ** -0.5,
            MODEL=ModelShape(d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.ffn, d.vocab, d.num_layers),
            T_QKV=launch.tiles[Op.QKV], T_OPROJ=launch.tiles[Op.OPROJ], T_GATEUP=launch.tiles[Op.GATEUP],
            T_DOWN=launch.tiles[Op.DOWN], T_LMHEAD=launch.tiles[Op.LMHEAD],
            ATT=self.attn_shape(s, blocks),
            BPAD=launch.rows, BS=launch.lm_rows,
            PF_AHEAD=c.prefetch_ahead if pf else 0, PF_OWN=c.prefetch_own and pf, PF_KV=c.prefetch_kv and pf,
            REC_AHEAD=c.record_ahead, DSTRIDE=self.draw.stride(0), CG=not INTERPRET, MAX_SPIN=c.max_spin,
            POLL_ACQUIRE=c.poll_acquire and not INTERPRET, PROFILE=c.profile and not INTERPRET,
            SKIP_WAITS=skip_mask(c.skip_waits), PART=part,
            MATVEC=matvec_call if called else matvec,
            ATTENTION=attention_call if called and launch.rows <= c.call_attention_max_rows else attention,
            num_warps=self.warps(launch.rows) if warps is None else warps, num_stages=c.num_stages, **extra,
        )

    def warps(self, rows: int) -> int:
        """Warps a program in a launch of `rows` rows (KernelConfig.wide_warps_8bit)."""
        wide = (self.w.fp8 or self.w.int8_rows) and rows >= self.cfg.wide_warps_rows
        return self.cfg.wide_warps_8bit if wide else self.cfg.num_warps


def _lm_starts(s: I.Schedule) -> torch.Tensor:
    """Each program's first LM-head or Argmax task (its list's end where it has none): the last phases, so every
    task from there on is one of theirs."""
    ops = s.tasks[:, I.F_OP].tolist()
    starts = s.starts.tolist()
    out = []
    for p in range(s.num_programs):
        t = next((t for t in range(starts[p], starts[p + 1]) if ops[t] in (I.LMHEAD, I.ARGMAX)), starts[p + 1])
        assert all(ops[u] in (I.LMHEAD, I.ARGMAX) for u in range(t, starts[p + 1]))
        out.append(t)
    return torch.tensor(out, dtype=torch.int32)
