"""What follows the LM head's stream: each LM-head task's (max, argmax) partials, greedy and drawn, and the Argmax
task that reduces them into each row's token.

Sampling happens in the same launch: where a row samples, each LM-head task reduces the Gumbel-perturbed logits
of its columns (kernels/sampling.py) after its stream, and Argmax reduces those partials next to the greedy ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.sampling import gumbel_best
from kernels.sync import ld_act


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
        lg = ld_act(logits_ptr + rb[:, None] * N + rc[None, :], m, CG, float("-inf"))
        mx, idx = gumbel_best(lg, rc, temperature, seed_lo, seed_hi, position, N)
        take = mx > best_v  # blocks come in increasing order: ties keep the earlier index
        best_v = tl.where(take, mx, best_v)
        best_i = tl.where(take, idx, best_i)
    return best_v, best_i


@triton.jit
def lm_partials(row0, rows_end, part, best_v, best_i, B, lm, logits_ptr, draw_ptr, pos_ptr, N: tl.constexpr,
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
        vals = ld_act(lmax_ptr + rt[:, None] * R + rb[None, :], m, CG, float("-inf"))
        idxs = ld_act(lidx_ptr + rt[:, None] * R + rb[None, :], m, CG, V)
        cm = tl.max(vals, axis=0)
        ci = tl.min(tl.where(vals == cm[None, :], idxs, V), axis=0)
        take = (cm > best) | ((cm == best) & (ci < bidx))
        best = tl.where(take, cm, best)
        bidx = tl.where(take, ci, bidx)
    return bidx


@triton.jit
def argmax(B, n_parts, n_counters, lm, outs, draw_ptr, pos_ptr, cnt_ptr, V: tl.constexpr, R: tl.constexpr,
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
