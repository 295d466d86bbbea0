"""The megakernel's attention: flash-decoding of (row, KV head) over its slot's cached positions, cut into splits by
the position alone, and the prefetch of those keys and values into L2 while the task waits for QKV.

Where a bucket has a task per (row, KV head) pair already (many rows), a task may take AttnShape.heads KV heads of its
row, one after another: fewer tasks (each a wait, a record and a release), each head's chunks through Triton's
software pipeline. A split's running max, sum and output restart where it starts and are stored where it ends, as
a task of one head does them, so the sums are the same. (All the heads' chunks in one pipelined loop was tried: the
pipeliner then copies q ahead too, in 4-byte `cp.async.ca` copies that go through L1, where an earlier layer's q may
still sit: wrong logits on the H100, right in the interpreter.)

Query blocks (AttnShape.block_queries > 0): rows of one slot at consecutive positions (a prompt's chunk) attend over
the same keys and values, so they share them. From a run's first row on, every block_queries // group rows form one
block (kernels/query_blocks.py says which, on the host) whose query heads fill one tile (the rows a single row's tile
leaves as padding), streamed once over the slot's positions with a causal mask per row. The block's tasks (one per
row, as the schedule deals them) share its work (KV heads x splits of the positions); where a head has several
splits the last task to arrive merges them. A decode row is a block of one and takes the path above, except in a
launch that runs blocks only (AttnShape.block_only: the decoder takes it only where every real row is in a block of
several), where a row alone is a padding row: its tasks count their pairs done and compute nothing, and the row path's
code and registers stay out of the launch. A row's sums then depend on its neighbours, so batch-invariant kernels
leave blocks off.
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
def _chunk(q, k, v, mask, m_i, l_i, acc, qk_scale, dt, CAUSAL: tl.constexpr = False):
    """One chunk of keys and values folded into a split's running max, sum and output (online softmax). mask: the
    positions each query sees ([1, chunk] or [queries, chunk]). CAUSAL: a query may see none of a split's positions
    (a block's earlier rows), so its max may still be -inf: it then counts as 0, leaving its sum and output 0."""
    sc = tl.dot(q, tl.trans(k)) * qk_scale
    sc = tl.where(mask, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if CAUSAL else m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
    return m_new, l_i, acc


@triton.jit
def _queries(b, g, rows, QP: tl.constexpr, MODEL: tl.constexpr, tail=None):
    """A query tile of QP query heads: `rows` rows from row b on, each with the group of KV head g's query heads
    (query i: row b + i // group, head g * group + i % group; the last row is row `tail` where given): its rows, its
    columns of q and attn, and which are real. One row (rows 1) is a single row's tile, padded past its group."""
    G: tl.constexpr = MODEL.heads // MODEL.kv_heads
    qi = tl.arange(0, QP)
    qrow = b + qi // G
    if tail is not None:
        qrow = tl.where(qi // G == rows - 1, tail, qrow)
    return qrow, (g * G + qi % G) * MODEL.head_dim, qi < rows * G


@triton.jit
def _store_out(qrow, qcol, valid, o, l_i, attn_ptr, dt, MODEL: tl.constexpr):
    """attn[query's row, query's head] = o / l_i, rounded to the activations' type dt (then stored as attn's type)."""
    D: tl.constexpr = MODEL.head_dim
    out = attn_ptr + qrow[:, None] * (MODEL.heads * D) + qcol[:, None] + tl.arange(0, D)[None, :]
    tl.store(out, (o / tl.where(valid, l_i, 1.0)[:, None]).to(dt), mask=valid[:, None])


@triton.jit
def _kv_chunk(cache, base, rc, mask, D: tl.constexpr, CG: tl.constexpr):
    """The cached keys and values at positions rc of one (slot, KV head) (base: its first element)."""
    rd = tl.arange(0, D)
    return (ld_act(cache.k + base + rc[:, None] * D + rd[None, :], mask[:, None], CG),
            ld_act(cache.v + base + rc[:, None] * D + rd[None, :], mask[:, None], CG))


@triton.jit
def _stream_split(q, cache, base, start, end, qk_scale, dt, QP: tl.constexpr, D: tl.constexpr, ATT: tl.constexpr,
                  CG: tl.constexpr, qpos=None):
    """Positions [start, end) of one (slot, KV head) (base: its first element) for a tile of QP queries, pipelined:
    the split's running max, sum and output. qpos: each query's last position (a query block's causal mask); without
    it every query sees every position."""
    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    for c0 in tl.range(start, end, ATT.chunk, num_stages=ATT.stages):
        rc = c0 + tl.arange(0, ATT.chunk)
        mc = rc < end
        k, v = _kv_chunk(cache, base, rc, mc, D, CG)
        if qpos is None:
            m_i, l_i, acc = _chunk(q, k, v, mc[None, :], m_i, l_i, acc, qk_scale, dt)
        else:
            m_i, l_i, acc = _chunk(q, k, v, mc[None, :] & (rc[None, :] <= qpos[:, None]), m_i, l_i, acc, qk_scale,
                                   dt, CAUSAL=True)
    return m_i, l_i, acc


@triton.jit
def _split_done(b, g, i, n_split, m_i, l_i, acc, scratch, attn_ptr, dt, MODEL: tl.constexpr, ATT: tl.constexpr):
    """A finished split: the output itself where it is the row's only one, else its partials for the merge."""
    qrow, qcol, valid = _queries(b, g, 1, ATT.group_pad, MODEL)
    if n_split == 1:
        _store_out(qrow, qcol, valid, acc, l_i, attn_ptr, dt, MODEL)
    else:
        _store_parts((b * MODEL.kv_heads + g) * ATT.max_splits + i, valid, m_i, l_i, acc, scratch, ATT.group_pad,
                     MODEL.head_dim)


@triton.jit
def _store_parts(part, valid, m_i, l_i, acc, scratch, QP: tl.constexpr, D: tl.constexpr):
    """A split's running max, sum and output of its QP queries, into scratch part `part`."""
    qi = tl.arange(0, QP)
    tl.store(scratch.m + part * QP + qi, m_i, mask=valid)
    tl.store(scratch.l + part * QP + qi, l_i, mask=valid)
    tl.store(scratch.acc + (part * QP + qi[:, None]) * D + tl.arange(0, D)[None, :], acc, mask=valid[:, None])


@triton.jit
def _merge(b, g, n_split, scratch, attn_ptr, dt, MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """attn[b, heads of g] from the splits' partials."""
    qrow, qcol, valid = _queries(b, g, 1, ATT.group_pad, MODEL)
    _merge_parts((b * MODEL.kv_heads + g) * ATT.max_splits, n_split, qrow, qcol, valid, scratch, attn_ptr, dt, MODEL,
                 ATT.group_pad, ATT.max_splits, CG)


@triton.jit
def _merge_parts(p0, n_split, qrow, qcol, valid, scratch, attn_ptr, dt, MODEL: tl.constexpr, QP: tl.constexpr,
                 SPLITS: tl.constexpr, CG: tl.constexpr, STEP: tl.constexpr = 4):
    """A query tile's output from its n_split splits' partials (scratch parts p0, p0 + 1, ...), in split order, STEP
    at a time."""
    D: tl.constexpr = MODEL.head_dim
    qi = tl.arange(0, QP)
    rd = tl.arange(0, D)
    ri = tl.arange(0, SPLITS)
    mg = valid[None, :]
    m_all = tl.max(ld_act(scratch.m + (p0 + ri)[:, None] * QP + qi[None, :], (ri[:, None] < n_split) & mg, CG,
                          float("-inf")), axis=0)
    l_all = tl.zeros([QP], tl.float32)
    o = tl.zeros([QP, D], tl.float32)
    for i0 in range(0, n_split, STEP):
        r4 = i0 + tl.arange(0, STEP)
        m4 = (r4[:, None] < n_split) & mg
        w = tl.exp2(ld_act(scratch.m + (p0 + r4)[:, None] * QP + qi[None, :], m4, CG, float("-inf"))
                    - m_all[None, :])
        w = tl.where(m4, w, 0.0)
        l_all += tl.sum(w * ld_act(scratch.l + (p0 + r4)[:, None] * QP + qi[None, :], m4, CG), axis=0)
        offs = (((p0 + r4)[:, None] * QP + qi[None, :]) * D)[:, :, None] + rd[None, None, :]
        acc4 = ld_act(scratch.acc + offs, m4[:, :, None], CG)
        o += tl.sum(w[:, :, None] * acc4, axis=0)
    _store_out(qrow, qcol, valid, o, l_all, attn_ptr, dt, MODEL)


@triton.jit
def _stream_chunk(q, b, g, c0, n_pos, n_split, span, slot, layer, cache, scratch, attn_ptr, m_i, l_i, acc, qk_scale,
                  dt, MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """Chunk c0 of (row b, KV head g) in a task that streams every split of its heads: the split's running max, sum
    and output restart where it starts and are stored (_split_done) where it ends."""
    KVH: tl.constexpr = MODEL.kv_heads
    D: tl.constexpr = MODEL.head_dim
    i = c0 // span  # the split this chunk belongs to
    fresh = c0 == i * span
    m_i = tl.where(fresh, float("-inf"), m_i)
    l_i = tl.where(fresh, 0.0, l_i)
    acc = tl.where(fresh, 0.0, acc)
    base = ((layer * cache.slots + slot) * KVH + g) * cache.context * D
    rc = c0 + tl.arange(0, ATT.chunk)
    mc = rc < n_pos
    k, v = _kv_chunk(cache, base, rc, mc, D, CG)
    m_i, l_i, acc = _chunk(q, k, v, mc[None, :], m_i, l_i, acc, qk_scale, dt)
    if (c0 + ATT.chunk >= (i + 1) * span) | (c0 + ATT.chunk >= n_pos):
        _split_done(b, g, i, n_split, m_i, l_i, acc, scratch, attn_ptr, dt, MODEL, ATT)
    return m_i, l_i, acc


@triton.jit
def _block(b, inputs):
    """Row b's query block (kernels/query_blocks.py, on the host): its first row, its rows, the positions its last row
    attends over, row b's index in it, its tail row and its slot; one round trip of independent loads."""
    st = inputs.blocks_stride
    lead = tl.load(inputs.blocks + b)
    rows = tl.load(inputs.blocks + st + b)
    n_pos = tl.load(inputs.blocks + 2 * st + b) + 1
    index = tl.load(inputs.blocks + 3 * st + b)
    tail = tl.load(inputs.blocks + 4 * st + b)
    slot = tl.load(inputs.slots + b)
    return lead, rows, n_pos, index, tail, slot.to(tl.int64)


@triton.jit
def _attention_block(layer, index, g0, s, S, lead, rows, n_pos, tail, slot, arrive, cnt_ptr, q_ptr, cache, scratch,
                     attn_ptr, qk_scale, dt, MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """A query block of `rows` rows from row `lead` on, its last row `tail` (at positions n_pos - rows .. n_pos - 1 of
    its slot), KV heads [g0, g0 + ATT.heads): its work is those heads x splits of [0, n_pos), as many splits as its
    rows' tasks (rows x S) leave to each head; this task (the s-th of S of the block's row `index`) takes every
    (rows x S)-th unit from its own index on. A head of one split is stored at once; else each task adds its units to
    the block's arrival counter (its first row's, `arrive`) and the last one merges every head. Returns the (row, KV
    head) pairs this task finished."""
    KVH: tl.constexpr = MODEL.kv_heads
    D: tl.constexpr = MODEL.head_dim
    Q: tl.constexpr = MODEL.heads * D
    QB: tl.constexpr = ATT.block_queries
    CH: tl.constexpr = ATT.chunk
    HEADS: tl.constexpr = ATT.heads
    tasks = rows * S
    me = index * S + s
    n_split = tl.maximum(1, tl.minimum(tl.minimum(ATT.block_splits, tasks // HEADS), tl.cdiv(n_pos, CH)))
    span = tl.cdiv(tl.cdiv(n_pos, n_split), CH) * CH
    n_split = tl.cdiv(n_pos, span)  # (no empty split)
    units = HEADS * n_split
    qi = tl.arange(0, QB)
    rd = tl.arange(0, D)
    qpos = n_pos - rows + qi // (MODEL.heads // KVH)  # each query's position: the last it sees
    done = tl.zeros([], tl.int32)
    mine = tl.zeros([], tl.int32)
    for u in range(me, units, tasks):
        g = g0 + u // n_split
        i = u % n_split
        qrow, qcol, valid = _queries(lead, g, rows, QB, MODEL, tail)
        q = ld_act(q_ptr + qrow[:, None] * Q + qcol[:, None] + rd[None, :], valid[:, None], CG)  # RoPE'd
        base = ((layer * cache.slots + slot) * KVH + g) * cache.context * D
        start = i * span
        m_i, l_i, acc = _stream_split(q, cache, base, start, tl.minimum(start + span, n_pos), qk_scale, dt, QB, D,
                                      ATT, CG, qpos)
        if n_split == 1:
            _store_out(qrow, qcol, valid, acc, l_i, attn_ptr, dt, MODEL)
            done += rows
        else:
            _store_parts((lead * KVH + g) * ATT.block_splits + i, valid, m_i, l_i, acc, scratch, QB, D)
        mine += 1
    if (n_split > 1) & (mine > 0):
        tl.debug_barrier()  # (the partials, written by all its threads, are read by another task's)
        arrived = tl.atomic_add(cnt_ptr + arrive, mine, sem="acq_rel", scope="gpu")
        if arrived + mine == units:
            for h in range(0, HEADS):
                qrow, qcol, valid = _queries(lead, g0 + h, rows, QB, MODEL, tail)
                _merge_parts((lead * KVH + g0 + h) * ATT.block_splits, n_split, qrow, qcol, valid, scratch, attn_ptr,
                             dt, MODEL, QB, ATT.block_splits, CG, ATT.block_merge)
            done = rows * HEADS
    return done


@triton.jit
def attention(layer, b, g0, s, S, arrive, arrive_row_stride, cnt_ptr, inputs, q_ptr, cache, scratch, attn_ptr, sm_scale,
              MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """Attention of row b's task: its query block's share where the row is in one of several rows
    (ATT.block_queries > 0), else the row's own (_attention_row). arrive: the (row, KV head) pair's arrival counter;
    arrive_row_stride: how far apart consecutive rows' counters are."""
    dt = cache.k.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E
    if ATT.block_queries > 0:
        lead, rows, n_pos, index, tail, slot = _block(b, inputs)
        if rows > 1:
            done = _attention_block(layer, index, g0, s, S, lead, rows, n_pos, tail, slot,
                                    arrive + (lead - b) * arrive_row_stride, cnt_ptr, q_ptr, cache, scratch, attn_ptr,
                                    qk_scale, dt, MODEL, ATT, CG)
        elif ATT.block_only:  # a padding row: its pairs counted once (by the first of a pair's S tasks)
            done = tl.where(s == 0, ATT.heads, 0).to(tl.int32)
        else:
            done = _attention_row(layer, b, g0, s, S, n_pos, slot, arrive, cnt_ptr, q_ptr, cache, scratch, attn_ptr,
                                  qk_scale, dt, MODEL, ATT, CG)
    else:
        n_pos = tl.load(inputs.positions + b) + 1
        slot = tl.load(inputs.slots + b).to(tl.int64)
        done = _attention_row(layer, b, g0, s, S, n_pos, slot, arrive, cnt_ptr, q_ptr, cache, scratch, attn_ptr,
                              qk_scale, dt, MODEL, ATT, CG)
    return done


@triton.jit
def _attention_row(layer, b, g0, s, S, n_pos, slot, arrive, cnt_ptr, q_ptr, cache, scratch, attn_ptr, qk_scale, dt,
                   MODEL: tl.constexpr, ATT: tl.constexpr, CG: tl.constexpr):
    """Flash-decoding for row b, KV heads [g0, g0 + ATT.heads), over positions [0, n_pos) of its slot (this step's k
    and v of every row are in the cache already: QKV put them there). The positions are cut into splits (_splits);
    this task, one of S for (b, g0) (S = 1 where ATT.heads > 1), takes splits s, s + S, ...; the last task to arrive
    merges the splits' partials in split order. Returns the (row, KV head) pairs this task finished."""
    KVH: tl.constexpr = MODEL.kv_heads
    D: tl.constexpr = MODEL.head_dim
    G: tl.constexpr = MODEL.heads // KVH
    Q: tl.constexpr = MODEL.heads * D
    GPAD: tl.constexpr = ATT.group_pad
    CH: tl.constexpr = ATT.chunk
    HEADS: tl.constexpr = ATT.heads
    rg = tl.arange(0, GPAD)
    rd = tl.arange(0, D)
    n_split, span = _splits(n_pos, ATT)
    done = tl.zeros([], tl.int32)
    if HEADS > 1:  # the only task of its pairs: every split of each head
        m_i = tl.full([GPAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GPAD], tl.float32)
        acc = tl.zeros([GPAD, D], tl.float32)
        for h in range(0, HEADS):  # (a pipeline per head: q reloaded in one stream went through L1, see above)
            q = ld_act(q_ptr + b * Q + ((g0 + h) * G + rg[:, None]) * D + rd[None, :], rg[:, None] < G, CG)
            for c0 in tl.range(0, n_pos, CH, num_stages=ATT.stages):
                m_i, l_i, acc = _stream_chunk(q, b, g0 + h, c0, n_pos, n_split, span, slot, layer, cache, scratch,
                                              attn_ptr, m_i, l_i, acc, qk_scale, dt, MODEL, ATT, CG)
        if n_split > 1:  # it merges its own partials
            tl.debug_barrier()  # (written by all its threads, read back by others)
            for h in range(0, HEADS):
                _merge(b, g0 + h, n_split, scratch, attn_ptr, dt, MODEL, ATT, CG)
        done = tl.full([], HEADS, tl.int32)
    elif s < n_split:
        q = ld_act(q_ptr + b * Q + (g0 * G + rg[:, None]) * D + rd[None, :], rg[:, None] < G, CG)  # RoPE'd
        base = ((layer * cache.slots + slot) * KVH + g0) * cache.context * D
        for i in range(s, n_split, S):
            start = i * span
            m_i, l_i, acc = _stream_split(q, cache, base, start, tl.minimum(start + span, n_pos), qk_scale, dt, GPAD,
                                          D, ATT, CG)
            _split_done(b, g0, i, n_split, m_i, l_i, acc, scratch, attn_ptr, dt, MODEL, ATT)
        if n_split == 1:
            done = tl.full([], 1, tl.int32)
        else:
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + arrive, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.minimum(S, n_split) - 1:
                _merge(b, g0, n_split, scratch, attn_ptr, dt, MODEL, ATT, CG)
                done = tl.full([], 1, tl.int32)
    return done


@triton.jit
def prefetch_kv(r, inputs, cache, MODEL: tl.constexpr, ATT: tl.constexpr):
    """An attention task's cached keys and values (the positions before this step's) into L2 while it waits for
    QKV: they do not depend on this step. The task's first split of its first KV head only; one bulk prefetch each,
    from threads 0, 1. r: the task's record (megakernel._record)."""
    D: tl.constexpr = MODEL.head_dim
    b = r[I.ATTN_ROW]
    pos = tl.load(inputs.positions + b)
    n_split, span = _splits(pos + 1, ATT)
    s = r[I.ATTN_SPLIT]
    start = s * span
    n = tl.minimum(start + span, pos) - start
    if (s < n_split) & (n > 0):
        slot = tl.load(inputs.slots + b).to(tl.int64)
        head = (r[I.F_LAYER] * cache.slots + slot) * MODEL.kv_heads + r[I.ATTN_KV_HEAD]
        off = (head * cache.context + start) * D
        lane = tl.arange(0, 2)
        base = tl.where(lane == 0, cache.k + off, cache.v + off).to(tl.int64, bitcast=True)
        prefetch_l2(base, (n * D * cache.k.dtype.element_ty.primitive_bitwidth // 8).to(tl.int32) + lane * 0, lane)
