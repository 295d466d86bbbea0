"""The megakernel's attention: flash-decoding of one (row, KV head) over its slot's cached positions, cut into
splits by the position alone, and the prefetch of those keys and values into L2 while the task waits for QKV.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import instructions as I
from kernels.sync import ld_act, prefetch_l2


@triton.jit
def _splits(n_pos, ATT: tl.constexpr):
    """How a row's positions [0, n_pos) are cut for attention: (splits, positions per split). By the position
    alone, whatever the bucket, so a row's sums never depend on the rows it runs with: splits of at least
    ATT.split_min_chunks chunks, at most ATT.max_splits of them."""
    n_split = tl.maximum(1, tl.minimum(ATT.max_splits, tl.cdiv(n_pos, ATT.chunk * ATT.split_min_chunks)))
    span = tl.cdiv(tl.cdiv(n_pos, n_split), ATT.chunk) * ATT.chunk
    return n_split, span


@triton.jit
def attention(layer, b, g, s, S, arrive, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr, sm_scale,
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
        q = ld_act(q_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :], rg[:, None] < G, CG)  # RoPE'd
        for i in range(s, n_split, S):
            start = i * span
            end = tl.minimum(start + span, n_pos)
            m_i = tl.full([GPAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GPAD], tl.float32)
            acc = tl.zeros([GPAD, D], tl.float32)
            for c0 in range(start, end, CH):
                rc = c0 + tl.arange(0, CH)
                mc = rc < end
                k = ld_act(cache.k + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
                v = ld_act(cache.v + base + rc[:, None] * D + rd[None, :], mc[:, None], CG)
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
                m_all = tl.max(ld_act(scratch.m + (p0 + ri)[:, None] * GPAD + rg[None, :],
                                       (ri[:, None] < n_split) & mg, CG, float("-inf")), axis=0)
                l_all = tl.zeros([GPAD], tl.float32)
                o = tl.zeros([GPAD, D], tl.float32)
                for i0 in range(0, n_split, 4):
                    r4 = i0 + tl.arange(0, 4)
                    m4 = (r4[:, None] < n_split) & mg
                    w = tl.exp2(ld_act(scratch.m + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG, float("-inf"))
                                - m_all[None, :])
                    w = tl.where(m4, w, 0.0)
                    l_all += tl.sum(w * ld_act(scratch.l + (p0 + r4)[:, None] * GPAD + rg[None, :], m4, CG), axis=0)
                    offs = (((p0 + r4)[:, None] * GPAD + rg[None, :]) * D)[:, :, None] + rd[None, None, :]
                    acc4 = ld_act(scratch.acc + offs, m4[:, :, None], CG)
                    o += tl.sum(w[:, :, None] * acc4, axis=0)
                tl.store(out_ptrs, (o / tl.where(rg < G, l_all, 1.0)[:, None]).to(dt), mask=rg[:, None] < G)
    return last.to(tl.int32)


@triton.jit
def prefetch_kv(r, inputs, cache, MODEL: tl.constexpr, ATT: tl.constexpr):
    """An attention task's cached keys and values (the positions before this step's) into L2 while it waits for
    QKV: they do not depend on this step. The task's first split only; one bulk prefetch each, from threads 0, 1.
    r: the task's record (megakernel._record)."""
    D: tl.constexpr = MODEL.head_dim
    b = r[I.ATTN_ROW]
    s = r[I.ATTN_SPLIT]
    pos = tl.load(inputs.positions + b)
    n_split, span = _splits(pos + 1, ATT)
    start = s * span
    n = tl.minimum(start + span, pos) - start
    if (s < n_split) & (n > 0):
        slot = tl.load(inputs.slots + b).to(tl.int64)
        head = (r[I.F_LAYER] * cache.slots + slot) * MODEL.kv_heads + r[I.ATTN_KV_HEAD]
        off = (head * cache.context + start) * D
        lane = tl.arange(0, 2)
        base = tl.where(lane == 0, cache.k + off, cache.v + off).to(tl.int64, bitcast=True)
        prefetch_l2(base, (n * D * cache.k.dtype.element_ty.primitive_bitwidth // 8).to(tl.int32) + lane * 0, lane)
