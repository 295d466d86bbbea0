"""The megakernel's matrix path: the Matvec instructions (QKV, OPROJ, GATEUP, DOWN, LMHEAD), from the weight stream
to each one's epilogue.

Matvecs use tensor cores (`tl.dot`) with the rows as M, padded only to the bucket; each weight tile is accumulated
as k_slices independent k-slices (a batched dot, one slice per warp) and summed in the epilogue. The tiles are a
function of the bucket (tiles.py): wide buckets reread their activations per weight tile, so they stream wider
tiles over shorter k chunks.

Norms: RMSNorm(x) @ W^T is computed as rstd * ((x * norm_weight) @ W^T), the one reordering against the reference
(numerics: megakernel.py). The tasks that write the residual stream also write x * norm_weight of the next norm, so
a consumer's matvec streams a ready operand, and computes rstd from x itself (no atomics: a step is deterministic).

Weights are bf16; or FP8 (e4m3) with one float32 scale per output row, converted in registers after the load and
scaled in the epilogue; or int8, converted by bit manipulation, with one float32 scale per output row (scaled in the
epilogue) or one float16 scale per block of 32 columns (GGUF's Q8_0; scaled per k slice of the dot: _weight_dot):
the same tensor-core dot streams half the bytes. FP8 and int8-row weights in swapped tiles may also run W8A8
(MatvecTile.w8a8): each k chunk's activations quantized per row to e4m3 or int8, the dot e4m3 x e4m3 or int8 x int8
(summed in int32) with no weight conversion at all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import INTERPRET
from kernels import instructions as I
from kernels.kernel_args import INT8_BLOCK
from kernels.sync import ld_act, prefetch_l2

I8_BLOCK = tl.constexpr(INT8_BLOCK)  # the same, as the kernel reads a global
E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value
# Triton's interpreter (3.6) rounds float32 to e4m3 without the carry where a mantissa rounds up into the next power
# of two (124.7 -> 64, not 128; 31.05 -> 16): there the kernel rounds in float32 first (_e4m3_rtne), so the CPU tests
# check W8A8's quantization as the GPU (cvt.rn.satfinite) and the oracle (torch) do it
INTERPRETED = tl.constexpr(INTERPRET)
# A norm's operand (x * norm weight, before rstd) times this on its way into a float16 dot (8-bit weights), rstd and
# its inverse waiting for the epilogue: float16 overflows at 65,504, the residual stream's outliers stay far below
# 2^20. A constant (not rstd itself) so the multiply stays in the dot operand's layout, read straight from shared
# memory; a row-wise rstd there sent every activation chunk of a swapped tile through registers and shared memory
# again (QKV at 64 rows: 56 us a layer against bf16's 19).
F16_SCALE = tl.constexpr(1.0 / 16)


@triton.jit
def _rstd(ssq_ptr, B, eps, H: tl.constexpr, R: tl.constexpr, STRIDE: tl.constexpr, CG: tl.constexpr):
    """1 / RMS of each of the first R rows of x, from the H/16 partial sums of squares per row that x's writers left
    at ssq_ptr (STRIDE rows apart; summed in a fixed order, whatever wrote them when)."""
    NP: tl.constexpr = H // I.SSQ_COLS
    NPP: tl.constexpr = triton.next_power_of_2(NP)
    rp = tl.arange(0, NPP)
    rb = tl.arange(0, R)
    parts = ld_act(ssq_ptr + rp[:, None] * STRIDE + rb[None, :], (rp[:, None] < NP) & (rb[None, :] < B), CG)
    return tl.rsqrt(tl.sum(parts, axis=0) / H + eps)


@triton.jit
def norm_operand(y, m, rb, n0, xn_ptr, nw_ptr, ssq_ptr, dt: tl.constexpr, N: tl.constexpr, BPAD: tl.constexpr,
                  BN: tl.constexpr):
    """For the columns [n0, n0 + BN) of x this task wrote (y): the next norm's operand x * norm_weight (rounded to
    dt), and their sums of squares, one partial per 16 columns and row, at ssq_ptr. An operand buffer of another type
    than dt is the float16 operand of 8-bit weights' dots (KernelConfig.f16_norm_operand): the operand times
    F16_SCALE, as those dots take it."""
    rn = n0 + tl.arange(0, BN)
    yf = y.to(tl.float32)
    nw = tl.load(nw_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    xn = (yf * nw[None, :]).to(dt)
    if xn_ptr.dtype.element_ty != dt:
        xn = xn.to(tl.float32) * F16_SCALE
    tl.store(xn_ptr + rb[:, None] * N + rn[None, :], xn.to(xn_ptr.dtype.element_ty), mask=m)
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
def _int8_f16(w, PRMT: tl.constexpr):
    """int8 → float16 exactly, by bits instead of a conversion instruction per element: the float16 with bits
    0x6400 + (b + 128) is 1024 + (b + 128), so a float16 subtraction of 1152 leaves b. PRMT (inline PTX; the
    interpreter runs none): four bytes at a time, one xor makes each b + 128 and two byte permutes put 0x64 above
    each, five instructions for four weights; else in Triton's integer ops, which sign-extend and pack each pair
    (about 5.6 SASS instructions a pair: a one-row int8 step paid ~20% over FP8's one conversion a pair)."""
    if PRMT:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, h, c; xor.b32 t, $2, 0x80808080; mov.b32 h, 0x64646464; mov.b32 c, 0x64806480; "
            "prmt.b32 $0, t, h, 0x4140; prmt.b32 $1, t, h, 0x4342; "
            "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }",
            "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return (w.to(tl.int16) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _weight_dot(a, w, acc, scale, rows, k0, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                SB_STRIDE: tl.constexpr, EVEN: tl.constexpr, DOT_T: tl.constexpr, W_INT8: tl.constexpr,
                PRMT: tl.constexpr):
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
        part = tl.dot(a, tl.permute(_int8_f16(w, PRMT), (0, 2, 1)))
        blk = (k0 + tl.arange(0, KS) * BKS) // I8_BLOCK  # [KS]
        s_ptrs = scale + blk[:, None] * SB_STRIDE + rows[None, :]  # [KS, BN]
        if EVEN:
            s = tl.load(s_ptrs)
        else:
            s = tl.load(s_ptrs, mask=(blk[:, None] < K // I8_BLOCK) & (rows[None, :] < N), other=0.0)
        return acc + part * s.to(tl.float32)[:, None, :]
    elif W_INT8:
        return tl.dot(a, tl.permute(_int8_f16(w, PRMT), (0, 2, 1)), acc)
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
        y = (ld_act(ptrs, m, CG).to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
        tl.store(ptrs, y, mask=m)
        n0 = tl.min(rows, axis=0)
        if out.xn_final is None:
            norm_operand(y, m, rb, n0, out.xn, out.norm_weight, ssq_ptr, dt, N, BPAD, BN)
        elif layer == MODEL.layers - 1:  # the final norm's operand: the LM head's
            norm_operand(y, m, rb, n0, out.xn_final, out.norm_weight, ssq_ptr, dt, N, BPAD, BN)
        else:
            norm_operand(y, m, rb, n0, out.xn, out.norm_weight, ssq_ptr, dt, N, BPAD, BN)
    return best_v, best_i


@triton.jit
def _operand(a_ptr, rb, rk, B, K: tl.constexpr, EVEN: tl.constexpr, DOT_T: tl.constexpr, SCALE_IN: tl.constexpr,
             CG: tl.constexpr):
    """The activation tile [KS, BPAD, BK/KS] at columns rk, as the dot takes it (scaled by F16_SCALE first where
    the dot runs in float16: 8-bit weights)."""
    a_ptrs = a_ptr + rb[None, :, None] * K + rk[:, None, :]
    if EVEN:
        a = ld_act(a_ptrs, rb[None, :, None] < B, CG)
    else:
        a = ld_act(a_ptrs, (rb[None, :, None] < B) & (rk[:, None, :] < K), CG)
    if SCALE_IN:
        a = a.to(tl.float32) * F16_SCALE
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
            tot += ld_act(base + p * PER + off, every, CG)
            if TWO:
                tot2 += ld_act(base + p * PER + RUN + off, every, CG)
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
                  W_INT8: tl.constexpr, PRMT: tl.constexpr):
    """The weight tile [BN, BK] of `rows` and columns [k0, k0 + BK), in the dot's type (8-bit converted; e4m3 and
    int8 stay as they are where the dot's type is theirs: W8A8)."""
    if TMA:
        w = desc.load([(drow + tl.min(rows, axis=0)).to(tl.int32), k0.to(tl.int32)])
    else:
        rk = k0 + tl.arange(0, BK)
        if EVEN:
            w = tl.load(w_ptr + rows[:, None] * K + rk[None, :])
        else:
            w = tl.load(w_ptr + rows[:, None] * K + rk[None, :], mask=(rows[:, None] < N) & (rk[None, :] < K),
                        other=0.0)
    if W_INT8 and DOT_T != tl.int8:
        return _int8_f16(w, PRMT)
    return w.to(DOT_T)


@triton.jit
def _act_int8(a):
    """W8A8's activations for int8 weights: a [BK, BPAD] (float32, a k chunk of each row) as int8 and each row's scale
    (the chunk's absmax maps to 127, rounded half up; a row of zeros, the padding, keeps zeros and scale 0)."""
    amax = tl.max(tl.abs(a), axis=0)
    live = amax > 0
    q = tl.floor(a * tl.where(live, 127.0 / amax, 1.0)[None, :] + 0.5).to(tl.int8)
    return q, tl.where(live, amax / 127.0, 0.0)


@triton.jit
def _e4m3_rtne(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 (exact: the steps are
    powers of two): what the interpreter's conversion then keeps as it is (INTERPRETED)."""
    ax = tl.abs(x)
    step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(ax, 1e-30))), -6.0) - 3.0)  # 3 mantissa bits; subnormals
    y = ax / step
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r % 2 == 1), r - 1.0, r)  # a tie goes to the even neighbour
    return tl.where(x < 0, -r * step, r * step)


@triton.jit
def _act_e4m3(a):
    """W8A8's activations: a [BK, BPAD] (float32, a k chunk of each row) as e4m3 and each row's scale (the chunk's
    absmax maps to 448, e4m3's largest; a row of zeros, the padding, keeps zeros and scale 0)."""
    amax = tl.max(tl.abs(a), axis=0)
    live = amax > 0
    x = a * tl.where(live, E4M3_MAX / amax, 1.0)[None, :]
    if INTERPRETED:
        x = _e4m3_rtne(x)
    q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return q, tl.where(live, amax / E4M3_MAX, 0.0)


@triton.jit
def _a8_dot(w, a, W_INT8: tl.constexpr):
    """A W8A8 chunk's dot w [BN, BK] @ a [BK, BPAD], in float32: e4m3 x e4m3, or int8 x int8 summed exactly in int32."""
    if W_INT8:
        return tl.dot(w, a, out_dtype=tl.int32).to(tl.float32)
    else:
        return tl.dot(w, a)


@triton.jit
def _matvec_swapped(OP: tl.constexpr, row0, tiles, kc0, B, layer, ws, a_ptr, ssq_ptr, out, rstd, best_v, best_i,
                    ks, dt: tl.constexpr, MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                    TILE: tl.constexpr, BPAD: tl.constexpr, KB: tl.constexpr, DOT_T: tl.constexpr,
                    SCALE_IN: tl.constexpr, W_INT8: tl.constexpr, CG: tl.constexpr):
    """matvec's stream with the operands swapped (as Marlin and vLLM's small-batch kernels do): acc [BN, BPAD] =
    W [BN, BK] @ a^T [BK, BPAD], so the weight tile is the dot's wide side and each activation chunk feeds all BN
    weight rows; one k slice, the rows padded to a tensor-core side (BPAD >= 16). With TILE.w8a8 (FP8 weights) each
    chunk's activations are quantized per row (_act_e4m3) and the e4m3 x e4m3 dot's chunk is scaled by them as it is
    added up; the weights' row scales wait for the epilogue as ever."""
    BN: tl.constexpr = TILE.rows
    A8: tl.constexpr = TILE.w8a8
    W_T: tl.constexpr = (tl.int8 if W_INT8 else tl.float8e4nv) if A8 else DOT_T
    PRMT: tl.constexpr = TILE.int8_prmt
    BK: tl.constexpr = TILE.k_chunk
    ROWS2: tl.constexpr = (OP == I.GATEUP) or (OP == I.QKV)
    TR: tl.constexpr = 2 * BN if OP == I.QKV else BN
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    MERGE_AFTER: tl.constexpr = TILE.k_splits > 1 and TILE.merge_after
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
            a = ld_act(a_ptrs, rb[None, :] < B, CG)
        else:
            a = ld_act(a_ptrs, (rb[None, :] < B) & (rk[:, None] < K), CG)
        if A8 and W_INT8:  # int8 x int8 on the tensor cores, int32 sums
            a, a_scale = _act_int8(a.to(tl.float32))
        elif A8:  # scale-invariant: an operand not yet times F16_SCALE enters as it is (matvec leaves rstd alone)
            a, a_scale = _act_e4m3(a.to(tl.float32))
        elif SCALE_IN:
            a = a.to(tl.float32) * F16_SCALE
        if not A8:
            a = a.to(DOT_T)
        w = _swapped_tile(ws.w, ws.desc, ws.drow, rows, k0, N, K, BN, BK, EVEN, TILE.tma, W_T, W_INT8, PRMT)
        if A8:
            acc += _a8_dot(w, a, W_INT8) * a_scale[None, :]
        else:
            acc = tl.dot(w, a, acc)
        if ROWS2:
            w2 = _swapped_tile(ws.w2, ws.desc2, ws.drow, rows2, k0, N, K, BN, BK, EVEN, TILE.tma, W_T, W_INT8, PRMT)
            if A8:
                acc2 += _a8_dot(w2, a, W_INT8) * a_scale[None, :]
            else:
                acc2 = tl.dot(w2, a, acc2)
        if not MERGE_AFTER:
            if kb == KB - 1:
                best_v, best_i = _finish_tile(OP, rows, rows2, tl.trans(acc), tl.trans(acc2), rstd, best_v, best_i,
                                              B, layer, ws, out, ssq_ptr, ks, TILE.k_splits, dt, MODEL, N, BPAD, BN,
                                              CG)
                acc = tl.zeros([BN, BPAD], tl.float32)
                acc2 = tl.zeros([BN, BPAD], tl.float32)
    if MERGE_AFTER:  # one tile a task: its merge after the loop (MatvecTile.merge_after)
        rows, rows2 = _tile_rows(OP, row0, MODEL, BN)
        best_v, best_i = _finish_tile(OP, rows, rows2, tl.trans(acc), tl.trans(acc2), rstd, best_v, best_i, B,
                                      layer, ws, out, ssq_ptr, ks, TILE.k_splits, dt, MODEL, N, BPAD, BN, CG)
    return best_v, best_i


@triton.jit
def matvec(OP: tl.constexpr, row0, tiles, B, layer, ws, a_ptr, ssq_ptr, out, eps, dt: tl.constexpr,
            MODEL: tl.constexpr, K: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr, BPAD: tl.constexpr,
            SSQ_STRIDE: tl.constexpr, CG: tl.constexpr, ks=None):
    """Tiles [row0, row0 + tiles*rows-per-tile) of out = a @ W^T for the first B of BPAD rows, as one
    software-pipelined stream over (row tile, k chunk): a task of many row tiles fills the pipeline once. Two
    streams run side by side where they can (more bytes in flight per SM): QKV's and gate/up's second run of rows
    (see _tile_rows), or with TILE.k_halves the second half of K. Ops that follow a norm stream a = x * norm_weight
    and scale by rstd (from the partial sums of squares at ssq_ptr, SSQ_STRIDE rows apart); OPROJ and DOWN leave
    theirs at ssq_ptr. With 8-bit weights (ws.scale set) the dot runs in float16 (e4m3 converts to it in one
    instruction per pair, int8 by bits: _int8_f16; a norm's operand scaled by F16_SCALE fits its range).
    With TILE.k_splits > 1 the task streams one tile over its part of K (ks: KSplit) and the last part to arrive
    finishes the tile (_k_merge). ws: MatvecWeights. Returns the LM head's running (max, argmax) per row."""
    BN: tl.constexpr = TILE.rows
    BK: tl.constexpr = TILE.k_chunk
    KS: tl.constexpr = TILE.k_slices
    ROWS2: tl.constexpr = (OP == I.GATEUP) or (OP == I.QKV)
    PARTS: tl.constexpr = TILE.k_splits
    MERGE_AFTER: tl.constexpr = PARTS > 1 and TILE.merge_after
    K_HALVES: tl.constexpr = TILE.k_halves and not ROWS2 and PARTS == 1
    TR: tl.constexpr = 2 * BN if OP == I.QKV else BN  # rows per tile
    NORM: tl.constexpr = (OP == I.QKV) or (OP == I.GATEUP) or (OP == I.LMHEAD)
    W8: tl.constexpr = ws.scale is not None  # FP8 or int8
    W_INT8: tl.constexpr = ws.w.dtype.element_ty == tl.int8
    PRMT: tl.constexpr = TILE.int8_prmt
    SB: tl.constexpr = N if OP == I.LMHEAD else MODEL.layers * N  # int8: one block's scales, layer-stacked
    PRE_NORM: tl.constexpr = NORM and W8  # the operand enters the float16 dot times F16_SCALE: rstd undoes it...
    SCALE_IN: tl.constexpr = PRE_NORM and a_ptr.dtype.element_ty == dt  # ...scaled here, unless its writer did
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
    if PRE_NORM and not (SCALE_IN and TILE.swap and TILE.w8a8):  # the epilogue's scale: the operand streamed
        rstd = rstd * (1.0 / F16_SCALE)  # times F16_SCALE (W8A8 quantizes an unscaled operand as it is)
    best_v = tl.full([BPAD], float("-inf"), tl.float32)
    best_i = tl.full([BPAD], N, tl.int32)
    if TILE.swap:
        return _matvec_swapped(OP, row0, tiles, kc0, B, layer, ws, a_ptr, ssq_ptr, out, rstd, best_v, best_i,
                               ks, dt, MODEL, K, N, TILE, BPAD, KB, DOT_T, SCALE_IN, W_INT8, CG)
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
                prefetch_l2((ws.w + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0, lane)
                if OP == I.GATEUP:
                    prefetch_l2((ws.w2 + ahead * K).to(tl.int64, bitcast=True) + lane * 0, nbytes + lane * 0,
                                 lane + 1)
        rows, rows2 = _tile_rows(OP, n0, MODEL, BN)
        k0 = (kc0 + kb) * BK
        rk = k0 + koff  # [KS, BKS]
        a = _operand(a_ptr, rb, rk, B, K, EVEN, DOT_T, SCALE_IN, CG)
        w = _load_tile(ws.w, ws.desc, ws.drow, rows, k0, N, K, BN, BK, KS, EVEN, TILE.tma)
        acc = _weight_dot(a, w, acc, ws.scale, rows, k0, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8, PRMT)
        if ROWS2:
            w2 = _load_tile(ws.w2, ws.desc2, ws.drow, rows2, k0, N, K, BN, BK, KS, EVEN, TILE.tma)
            acc2 = _weight_dot(a, w2, acc2, ws.scale2, rows2, k0, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8, PRMT)
        if K_HALVES:  # the same rows' second half of K
            a2 = _operand(a_ptr, rb, rk + KB1 * BK, B, K, EVEN, DOT_T, SCALE_IN, CG)
            w2 = _load_tile(ws.w, ws.desc, ws.drow, rows, (kb + KB1) * BK, N, K, BN, BK, KS, EVEN, TILE.tma)
            acc2 = _weight_dot(a2, w2, acc2, ws.scale, rows, (kb + KB1) * BK, N, K, BK, KS, SB, EVEN, DOT_T, W_INT8,
                               PRMT)
        if not MERGE_AFTER:
            if kb == KB1 - 1:
                if K_HALVES:
                    sums, sums2 = tl.sum(acc, axis=0) + tl.sum(acc2, axis=0), tl.zeros([BPAD, BN], tl.float32)
                else:
                    sums, sums2 = tl.sum(acc, axis=0), tl.sum(acc2, axis=0)
                best_v, best_i = _finish_tile(OP, rows, rows2, sums, sums2, rstd, best_v, best_i, B, layer, ws, out,
                                              ssq_ptr, ks, PARTS, dt, MODEL, N, BPAD, BN, CG)
                acc = tl.zeros([KS, BPAD, BN], tl.float32)
                acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    if MERGE_AFTER:  # one tile a task: its merge after the loop (MatvecTile.merge_after)
        rows, rows2 = _tile_rows(OP, row0, MODEL, BN)
        best_v, best_i = _finish_tile(OP, rows, rows2, tl.sum(acc, axis=0), tl.sum(acc2, axis=0), rstd, best_v,
                                      best_i, B, layer, ws, out, ssq_ptr, ks, PARTS, dt, MODEL, N, BPAD, BN, CG)
    return best_v, best_i
