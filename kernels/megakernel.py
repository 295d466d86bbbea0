"""The megakernel: one persistent Triton launch runs a whole decode step by executing the schedule that
kernels/instructions.py builds. The kernel only interprets task records; every decision of who does what is on
the host, once per model and batch bucket.

Numerics follow the PyTorch reference (service/backends/reference.py): activations are rounded to the weights'
dtype where the reference rounds them (after each linear, RoPE, SiLU and residual add), and every sum is
accumulated in float32. One reordering: RMSNorm(x) @ W^T is computed as rstd * ((x * norm_weight) @ W^T). The
tasks that write the residual stream also write x * norm_weight of the next norm (bf16) and add their rows' sum of
squares to a per-norm accumulator, so a consumer's matvec streams a ready operand and scales by rstd at the end.

Synchronisation: a task spins on a volatile load of its counter, then takes an acquire atomic; a finished task
passes a CTA barrier and adds one to its counter with release semantics. Activations are read with `.cg` (L2,
never a stale L1 line). The last task (ARGMAX) zeroes the counters and the sums of squares, so a CUDA graph can
replay the launch. A wait that spins too long sets an error flag (Megakernel.err) and the step finishes instead of
hanging; the host checks the flag.

Matvecs use tensor cores (`tl.dot`) with the batch rows as M, padded only to the bucket; each 16-row weight tile is
accumulated as KS independent k-slices (a batched dot, one slice per warp) and summed in the epilogue.

Sampling happens in the same launch: where a row samples, each LM-head task reduces the Gumbel-perturbed logits
of its columns (kernels/sampling.py) after its stream, and ARGMAX reduces those partials next to the greedy ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import instructions as I
from kernels.sampling import gumbel_best

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class PackedWeights:
    """The model's tensors in the layout the kernel reads (layer-stacked, out × in)."""

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

    def regions(self) -> dict[str, tuple[int, int]]:
        """Addresses and per-layer bytes, for the schedule's prefetch hints."""
        def r(t: torch.Tensor) -> tuple[int, int]:
            return t.data_ptr(), t[0].numel() * t.element_size()

        return {"qkv": r(self.wqkv), "o": r(self.wo), "gate": r(self.w_gate), "up": r(self.w_up),
                "down": r(self.w_down), "lm_head": (self.lm_head.data_ptr(), 0)}


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
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, $3; setp.gt.s32 q, $2, 0; "
        "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, lane], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rstd(ssq_ptr, B, eps, H: tl.constexpr, BPAD: tl.constexpr, CG: tl.constexpr):
    rb = tl.arange(0, BPAD)
    ss = _ld_act(ssq_ptr + rb, rb < B, CG)
    return tl.rsqrt(ss / H + eps)


@triton.jit
def _residual_out(ptrs, m, rb, rn, acc, B, xn_ptr, nwn_ptr, ssq_ptr, dt, N: tl.constexpr, CG: tl.constexpr):
    """x += acc on rows/cols (rb, rn); also write x * (the next norm's weight) and add the sums of squares."""
    x = _ld_act(ptrs, m, CG)
    y = (x.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
    tl.store(ptrs, y, mask=m)
    _norm_out(y, m, rb, rn, B, xn_ptr, nwn_ptr, ssq_ptr, dt, N)


@triton.jit
def _norm_out(y, m, rb, rn, B, xn_ptr, nwn_ptr, ssq_ptr, dt, N: tl.constexpr):
    yf = y.to(tl.float32)
    nw = tl.load(nwn_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(xn_ptr + rb[:, None] * N + rn[None, :], (yf * nw[None, :]).to(dt), mask=m)
    ss = tl.sum(tl.where(m, yf * yf, 0.0), axis=1)
    tl.atomic_add(ssq_ptr + rb, ss, mask=rb < B, sem="relaxed", scope="gpu")


@triton.jit
def _mv_epilogue(OP: tl.constexpr, n0, acc, acc2, rstd, best_v, best_i, B, out_ptr, bias_ptr, xn_ptr, nwn_ptr,
                 ssq_out_ptr, dt, N: tl.constexpr, HAS_BIAS: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr,
                 CG: tl.constexpr):
    rb = tl.arange(0, BPAD)
    rn = n0 + tl.arange(0, BN)
    m = (rb[:, None] < B) & (rn[None, :] < N)
    ptrs = out_ptr + rb[:, None] * N + rn[None, :]
    if OP == I.QKV:
        acc = acc * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(dt), mask=m)
    elif OP == I.GATEUP:
        gate = (acc * rstd[:, None]).to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        tl.store(ptrs, (act * (acc2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt), mask=m)
    elif OP == I.LMHEAD:
        lg = (acc * rstd[:, None]).to(dt).to(tl.float32)  # the reference's logits are bf16 before .float()
        tl.store(ptrs, lg, mask=m)
        lg = tl.where(rn[None, :] < N, lg, float("-inf"))
        mx = tl.max(lg, axis=1)
        idx = tl.min(tl.where(lg == mx[:, None], rn[None, :], N), axis=1).to(tl.int32)  # first index of the max
        take = mx > best_v  # tiles come in increasing order: ties keep the earlier index
        best_v = tl.where(take, mx, best_v)
        best_i = tl.where(take, idx, best_i)
    else:  # OPROJ, DOWN: the residual stream x += acc, and the next norm's operand
        _residual_out(ptrs, m, rb, rn, acc, B, xn_ptr, nwn_ptr, ssq_out_ptr, dt, N, CG)
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
def _sample_task(c0, c1, B, logits_ptr, draw_ptr, pos_ptr, N: tl.constexpr, BPAD: tl.constexpr,
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
def _mv_task(OP: tl.constexpr, r0, nsub, ordinal, B, w_ptr, w2_ptr, a_ptr, ssq_in_ptr, bias_ptr, out_ptr,
             xn_ptr, nwn_ptr, ssq_out_ptr, lmax_ptr, lidx_ptr, n_parts, draw_ptr, pos_ptr, eps, K: tl.constexpr,
             N: tl.constexpr, NORM: tl.constexpr, DUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BPAD: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, CG: tl.constexpr, DSTRIDE: tl.constexpr):
    """Rows [r0, r0 + nsub*BN) of out = a @ W^T (and a @ W2^T with DUAL), as one software-pipelined stream over
    (row tile, k chunk): a task of many row tiles fills the pipeline once. NORM: a is x * norm_weight, and the
    epilogue scales by rstd (from the sums of squares at ssq_in_ptr). LMHEAD also leaves the greedy token's
    (max, argmax) partial, and where a row samples, the drawn token's."""
    KB: tl.constexpr = (K + BK - 1) // BK
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    dt = w_ptr.dtype.element_ty
    rb = tl.arange(0, BPAD)
    rn = tl.arange(0, BN)
    if NORM:
        rstd = _rstd(ssq_in_ptr, B, eps, K, BPAD, CG)
    else:
        rstd = tl.full([BPAD], 1.0, tl.float32)
    best_v = tl.full([BPAD], float("-inf"), tl.float32)
    best_i = tl.full([BPAD], N, tl.int32)
    # KS independent accumulators (a batched dot over KS slices of each k chunk): no serial chain of
    # tensor-core ops through one accumulator, and every warp has its own slice
    BKS: tl.constexpr = BK // KS
    koff = tl.arange(0, KS)[:, None] * BKS + tl.arange(0, BKS)[None, :]  # [KS, BKS]
    acc = tl.zeros([KS, BPAD, BN], tl.float32)
    acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    for it in range(0, nsub * KB):
        sub = it // KB
        kb = it - sub * KB
        n0 = r0 + sub * BN
        rk = kb * BK + koff  # [KS, BKS]
        w_off = (n0 + rn)[None, :, None] * K + rk[:, None, :]  # [KS, BN, BKS]
        a_ptrs = a_ptr + rb[None, :, None] * K + rk[:, None, :]  # [KS, BPAD, BKS]
        if EVEN:  # no masks in the hot loop: fewer instructions per byte streamed
            w = tl.load(w_ptr + w_off)
            a = _ld_act(a_ptrs, rb[None, :, None] < B, CG)
        else:
            wm = ((n0 + rn)[None, :, None] < N) & (rk[:, None, :] < K)
            w = tl.load(w_ptr + w_off, mask=wm, other=0.0)
            a = _ld_act(a_ptrs, (rb[None, :, None] < B) & (rk[:, None, :] < K), CG)
        acc = tl.dot(a, tl.permute(w, (0, 2, 1)), acc)
        if DUAL:
            if EVEN:
                w2 = tl.load(w2_ptr + w_off)
            else:
                w2 = tl.load(w2_ptr + w_off, mask=wm, other=0.0)
            acc2 = tl.dot(a, tl.permute(w2, (0, 2, 1)), acc2)
        if kb == KB - 1:
            best_v, best_i = _mv_epilogue(OP, n0, tl.sum(acc, axis=0), tl.sum(acc2, axis=0), rstd, best_v, best_i,
                                          B, out_ptr, bias_ptr, xn_ptr, nwn_ptr, ssq_out_ptr, dt, N, HAS_BIAS, BPAD,
                                          BN, CG)
            acc = tl.zeros([KS, BPAD, BN], tl.float32)
            acc2 = tl.zeros([KS, BPAD, BN], tl.float32)
    if OP == I.LMHEAD:
        tl.store(lmax_ptr + ordinal * BPAD + rb, best_v)
        tl.store(lidx_ptr + ordinal * BPAD + rb, best_i)
        if tl.max(tl.load(draw_ptr + rb, mask=rb < B, other=0).to(tl.float32, bitcast=True), axis=0) > 0:
            tl.debug_barrier()  # the logits this program wrote, visible to all its threads
            sv, si = _sample_task(r0, tl.minimum(r0 + nsub * BN, N), B, out_ptr, draw_ptr, pos_ptr, N, BPAD,
                                  DSTRIDE, CG)
            # the sampled partials sit after the greedy ones
            tl.store(lmax_ptr + (n_parts + ordinal) * BPAD + rb, sv)
            tl.store(lidx_ptr + (n_parts + ordinal) * BPAD + rb, si)


@triton.jit
def _rope(ptr, cos_ptr, sin_ptr, pos, rows, n_rows, dt, D: tl.constexpr, R: tl.constexpr, CG: tl.constexpr):
    """Rotate-half RoPE of rows [R, D] at ptr (row stride D), position pos; rounded to dt like the reference."""
    HALF: tl.constexpr = D // 2
    rd = tl.arange(0, D)
    m = (rows[:, None] < n_rows) & (rd[None, :] < D)
    x = _ld_act(ptr + rows[:, None] * D + rd[None, :], m, CG).to(tl.float32)
    xs = _ld_act(ptr + rows[:, None] * D + ((rd + HALF) % D)[None, :], m, CG).to(tl.float32)
    c = tl.load(cos_ptr + pos * HALF + rd % HALF).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + rd % HALF).to(dt).to(tl.float32)
    sign = tl.where(rd < HALF, -1.0, 1.0)
    return (x * c[None, :] + sign[None, :] * xs * s[None, :]).to(dt)


# ---------------------------------------------------------------------------------------------------------------
# the instructions


@triton.jit
def _op_embed(c0, nsub, tok_ptr, embed_ptr, x_ptr, xn_ptr, nw_ptr, ssq_ptr, B, H: tl.constexpr,
              BPAD: tl.constexpr, BN: tl.constexpr):
    """Columns [c0, c0 + nsub*BN) of x = embed[tokens], and of the first norm's operand."""
    rb = tl.arange(0, BPAD)
    tok = tl.load(tok_ptr + rb, mask=rb < B, other=0).to(tl.int64)
    for i in range(0, nsub):
        rn = c0 + i * BN + tl.arange(0, BN)
        m = (rb[:, None] < B) & (rn[None, :] < H)
        e = tl.load(embed_ptr + tok[:, None] * H + rn[None, :], mask=m, other=0.0)
        tl.store(x_ptr + rb[:, None] * H + rn[None, :], e, mask=m)
        _norm_out(e, m, rb, rn, B, xn_ptr, nw_ptr, ssq_ptr, embed_ptr.dtype.element_ty, H)


@triton.jit
def _op_attn(layer, b, g, s, S, batch, cnt_ptr, arrive0, tok_ptr, slot_ptr, pos_ptr, qkv_ptr, cos_ptr, sin_ptr,
             kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, attn_ptr, sm_scale,
             NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, CTX: tl.constexpr,
             GPAD: tl.constexpr, CH: tl.constexpr, SMAX: tl.constexpr, SPLIT_MIN: tl.constexpr, CG: tl.constexpr):
    G: tl.constexpr = NH // KVH
    Q: tl.constexpr = NH * D
    KV: tl.constexpr = KVH * D
    QKVR: tl.constexpr = Q + 2 * KV
    dt = kc_ptr.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rg = tl.arange(0, GPAD)
    rd = tl.arange(0, D)
    row = qkv_ptr + b * QKVR
    q = _rope(row + g * G * D, cos_ptr, sin_ptr, pos, rg, G, dt, D, GPAD, CG)  # [GPAD, D]
    base = ((layer * SLOTS + slot) * KVH + g) * CTX * D
    # splits with no cached chunk to read stay out (short contexts merge few partials)
    n_split = tl.maximum(1, tl.minimum(S, tl.cdiv(pos, CH * SPLIT_MIN)))
    last = pos < 0
    if s < n_split:
        # the cached positions [0, pos), split n_split ways in whole chunks
        span = tl.cdiv(tl.cdiv(pos, n_split), CH) * CH
        start = s * span
        end = tl.minimum(start + span, pos)
        m_i = tl.full([GPAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GPAD], tl.float32)
        acc = tl.zeros([GPAD, D], tl.float32)
        for c0 in range(start, end, CH):
            rc = c0 + tl.arange(0, CH)
            mc = rc < end
            k = tl.load(kc_ptr + base + rc[:, None] * D + rd[None, :], mask=mc[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * qk_scale
            sc = tl.where(mc[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + base + rc[:, None] * D + rd[None, :], mask=mc[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
            m_i = m_new
        if s == 0:
            # the new token: RoPE'd k and v go to the cache, and into this split's softmax
            first = rg[:, None] < 1
            kn = _rope(row + Q + g * D, cos_ptr, sin_ptr, pos, rg, 1, dt, D, GPAD, CG)  # row 0 of [GPAD, D]
            vn = _ld_act(row + Q + KV + g * D + rg[:, None] * D + rd[None, :], first & (rd[None, :] < D), CG)
            tl.store(kc_ptr + base + pos * D + rg[:, None] * D + rd[None, :], kn, mask=first & (rd[None, :] < D))
            tl.store(vc_ptr + base + pos * D + rg[:, None] * D + rd[None, :], vn, mask=first & (rd[None, :] < D))
            kn = tl.sum(kn.to(tl.float32), axis=0)  # [D] (rows other than 0 are zero)
            vn = tl.sum(vn.to(tl.float32), axis=0)
            sn = tl.sum(q.to(tl.float32) * kn[None, :], axis=1) * qk_scale  # [GPAD]
            m_new = tl.maximum(m_i, sn)
            alpha = tl.exp2(m_i - m_new)
            pn = tl.exp2(sn - m_new)
            l_i = l_i * alpha + pn
            acc = acc * alpha[:, None] + pn.to(dt).to(tl.float32)[:, None] * vn[None, :]
            m_i = m_new
        if n_split == 1:
            # one split: the output directly, no partials to merge
            o = acc / tl.where(rg < G, l_i, 1.0)[:, None]
            tl.store(attn_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :], o.to(dt), mask=rg[:, None] < G)
            last = pos >= 0
        else:
            part = (b * KVH + g) * S + s
            tl.store(pm_ptr + part * GPAD + rg, m_i, mask=rg < G)
            tl.store(pl_ptr + part * GPAD + rg, l_i, mask=rg < G)
            tl.store(pacc_ptr + (part * GPAD + rg[:, None]) * D + rd[None, :], acc, mask=rg[:, None] < G)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + arrive0 + (layer * batch + b) * KVH + g, 1, sem="acq_rel", scope="gpu")
            last = arrived == n_split - 1
            if last:
                # the last split in merges the partials into attn[b, heads of g], four splits a step
                p0 = (b * KVH + g) * S
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
                o = o / tl.where(rg < G, l_all, 1.0)[:, None]
                tl.store(attn_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :], o.to(dt), mask=rg[:, None] < G)
    return last.to(tl.int32)


@triton.jit
def _reduce_partials(lmax_ptr, lidx_ptr, p0, n_parts, B, V: tl.constexpr, BPAD: tl.constexpr, CG: tl.constexpr):
    """The token of each row from n_parts (max, argmax) partials starting at partial p0: the largest value, and
    of equal values the smallest index."""
    TC: tl.constexpr = 128
    rb = tl.arange(0, BPAD)
    best = tl.full([BPAD], float("-inf"), tl.float32)
    bidx = tl.full([BPAD], V, tl.int32)
    for t0 in range(0, n_parts, TC):
        rt = t0 + tl.arange(0, TC)
        m = (rt[:, None] < n_parts) & (rb[None, :] < B)
        vals = _ld_act(lmax_ptr + (p0 + rt[:, None]) * BPAD + rb[None, :], m, CG, float("-inf"))
        idxs = _ld_act(lidx_ptr + (p0 + rt[:, None]) * BPAD + rb[None, :], m, CG, V)
        cm = tl.max(vals, axis=0)
        ci = tl.min(tl.where(vals == cm[None, :], idxs, V), axis=0)
        take = (cm > best) | ((cm == best) & (ci < bidx))
        best = tl.where(take, cm, best)
        bidx = tl.where(take, ci, bidx)
    return bidx


@triton.jit
def _op_argmax(B, n_parts, lmax_ptr, lidx_ptr, out_ptr, sample_out_ptr, draw_ptr, pos_ptr, cnt_ptr, n_counters,
               ssq_ptr, n_ssq, V: tl.constexpr, BPAD: tl.constexpr, CG: tl.constexpr, DSTRIDE: tl.constexpr):
    """Reduce the LM-head tasks' (max, argmax) partials into the greedy token, and the sampled ones into the drawn
    token (the greedy one where no row samples); then, every other task being done (they all lead here), zero the
    counters and the sums of squares for the next replay."""
    rb = tl.arange(0, BPAD)
    greedy = _reduce_partials(lmax_ptr, lidx_ptr, 0, n_parts, B, V, BPAD, CG)
    tl.store(out_ptr + rb, greedy.to(tl.int64), mask=rb < B)
    draw = _load_draw(draw_ptr, pos_ptr, B, BPAD, DSTRIDE)
    if draw[4]:
        tl.store(sample_out_ptr + rb, _reduce_partials(lmax_ptr, lidx_ptr, n_parts, n_parts, B, V, BPAD, CG)
                 .to(tl.int64), mask=rb < B)
    else:
        tl.store(sample_out_ptr + rb, greedy.to(tl.int64), mask=rb < B)
    for c0 in range(0, n_counters, 1024):
        rc = c0 + tl.arange(0, 1024)
        tl.store(cnt_ptr + rc, tl.zeros([1024], tl.int32), mask=rc < n_counters)
    for c0 in range(0, n_ssq, 1024):
        rc = c0 + tl.arange(0, 1024)
        tl.store(ssq_ptr + rc, tl.zeros([1024], tl.float32), mask=rc < n_ssq)


# ---------------------------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def megakernel(
    tasks_ptr, starts_ptr, cnt_ptr, err_ptr,
    tok_ptr, slot_ptr, pos_ptr, draw_ptr, batch, attn_splits, n_counters, n_lm_tiles,
    embed_ptr, wqkv_ptr, bqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, norm1_ptr, norm2_ptr, fnorm_ptr, lm_ptr,
    cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    x_ptr, xn_ptr, ssq_ptr, qkv_ptr, attn_ptr, ffn_ptr, logits_ptr, pm_ptr, pl_ptr, pacc_ptr, lmax_ptr, lidx_ptr,
    out_ptr, sample_out_ptr, eps, sm_scale, prof_ptr,
    H: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, F: tl.constexpr, V: tl.constexpr,
    NLAYERS: tl.constexpr, SLOTS: tl.constexpr, CTX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BN_MV: tl.constexpr, BN_LM: tl.constexpr, BN_E: tl.constexpr,
    BK_MV: tl.constexpr, BK_GU: tl.constexpr, BK_LM: tl.constexpr, KS: tl.constexpr, KS_LM: tl.constexpr,
    BPAD: tl.constexpr, GPAD: tl.constexpr, CH: tl.constexpr, SMAX: tl.constexpr, SPLIT_MIN: tl.constexpr,
    PF_AHEAD: tl.constexpr, DSTRIDE: tl.constexpr,
    CG: tl.constexpr,
    MAX_SPIN: tl.constexpr, PROFILE: tl.constexpr,
):
    NF: tl.constexpr = I.NUM_FIELDS
    Q: tl.constexpr = NH * D
    QKVR: tl.constexpr = Q + 2 * KVH * D
    pid = tl.program_id(0)
    t_begin = tl.load(starts_ptr + pid)
    t_end = tl.load(starts_ptr + pid + 1)
    arrive0 = NLAYERS * I.PHASES_PER_LAYER + 2
    if PF_AHEAD > 0:
        for i in tl.static_range(PF_AHEAD):
            if t_begin + i < t_end:
                _prefetch(tasks_ptr + (t_begin + i) * NF)
    for t in range(t_begin, t_end):
        rec = tasks_ptr + t * NF
        if PF_AHEAD > 0:
            if t + PF_AHEAD < t_end:
                _prefetch(tasks_ptr + (t + PF_AHEAD) * NF)
        if PROFILE:
            tl.store(prof_ptr + t * 4, tl.extra.cuda.globaltimer())
        op = tl.load(rec + I.F_OP)
        layer = tl.load(rec + I.F_LAYER)
        a0 = tl.load(rec + I.F_A0)
        a1 = tl.load(rec + I.F_A1)
        _wait(cnt_ptr, tl.load(rec + I.F_WAIT), tl.load(rec + I.F_TARGET), err_ptr, MAX_SPIN)
        if PROFILE:
            tl.store(prof_ptr + t * 4 + 1, tl.extra.cuda.globaltimer())
        inc = tl.full([], 1, tl.int32)
        # sums of squares: slot 2*layer for the attention norm, 2*layer+1 for the MLP norm, 2*L for the final
        ssq_attn = ssq_ptr + (2 * layer) * BPAD
        ssq_mlp = ssq_ptr + (2 * layer + 1) * BPAD
        if op == I.QKV:
            _mv_task(I.QKV, a0, a1, 0, batch, wqkv_ptr + layer * QKVR * H, wqkv_ptr, xn_ptr, ssq_attn,
                     bqkv_ptr + layer * QKVR, qkv_ptr, xn_ptr, norm1_ptr, ssq_ptr, lmax_ptr, lidx_ptr, n_lm_tiles,
                     draw_ptr, pos_ptr, eps, H, QKVR, True, False, HAS_BIAS, BPAD, BN_MV, BK_MV, KS, CG, DSTRIDE)
        elif op == I.ATTN:
            inc = _op_attn(layer, a0, a1, tl.load(rec + I.F_A2), attn_splits, batch, cnt_ptr,
                           arrive0, tok_ptr, slot_ptr, pos_ptr, qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                           pm_ptr, pl_ptr, pacc_ptr, attn_ptr, sm_scale, NH, KVH, D, SLOTS, CTX, GPAD, CH, SMAX,
                           SPLIT_MIN, CG)
        elif op == I.OPROJ:
            # x += attn @ Wo^T, and the MLP norm's operand
            _mv_task(I.OPROJ, a0, a1, 0, batch, wo_ptr + layer * H * Q, wo_ptr, attn_ptr, ssq_ptr, bqkv_ptr, x_ptr,
                     xn_ptr, norm2_ptr + layer * H, ssq_mlp, lmax_ptr, lidx_ptr, n_lm_tiles, draw_ptr, pos_ptr, eps,
                     Q, H, False, False, False, BPAD, BN_MV, BK_MV, KS, CG, DSTRIDE)
        elif op == I.GATEUP:
            _mv_task(I.GATEUP, a0, a1, 0, batch, wg_ptr + layer * F * H, wu_ptr + layer * F * H, xn_ptr, ssq_mlp,
                     bqkv_ptr, ffn_ptr, xn_ptr, norm2_ptr, ssq_ptr, lmax_ptr, lidx_ptr, n_lm_tiles, draw_ptr,
                     pos_ptr, eps, H, F, True, True, False, BPAD, BN_MV, BK_GU, KS, CG, DSTRIDE)
        elif op == I.DOWN:
            # x += ffn @ Wdown^T, and the next layer's attention norm operand (the final norm's after the last)
            last_layer = layer == NLAYERS - 1
            nwn = tl.where(last_layer, fnorm_ptr, norm1_ptr + (layer + 1) * H)
            _mv_task(I.DOWN, a0, a1, 0, batch, wd_ptr + layer * H * F, wd_ptr, ffn_ptr, ssq_ptr, bqkv_ptr, x_ptr,
                     xn_ptr, nwn, ssq_ptr + (2 * layer + 2) * BPAD, lmax_ptr, lidx_ptr, n_lm_tiles, draw_ptr,
                     pos_ptr, eps, F, H, False, False, False, BPAD, BN_MV, BK_MV, KS, CG, DSTRIDE)
        elif op == I.LMHEAD:
            # logits, the greedy token's partials, and (where a row samples) the drawn token's
            _mv_task(I.LMHEAD, a0, a1, tl.load(rec + I.F_A2), batch, lm_ptr, lm_ptr, xn_ptr,
                     ssq_ptr + 2 * NLAYERS * BPAD, bqkv_ptr, logits_ptr, xn_ptr, fnorm_ptr, ssq_ptr, lmax_ptr,
                     lidx_ptr, n_lm_tiles, draw_ptr, pos_ptr, eps, H, V, True, False, False, BPAD, BN_LM, BK_LM,
                     KS_LM, CG, DSTRIDE)
        elif op == I.EMBED:
            _op_embed(a0, a1, tok_ptr, embed_ptr, x_ptr, xn_ptr, norm1_ptr, ssq_ptr, batch, H, BPAD, BN_E)
        elif op == I.ARGMAX:
            _op_argmax(batch, n_lm_tiles, lmax_ptr, lidx_ptr, out_ptr, sample_out_ptr, draw_ptr, pos_ptr, cnt_ptr,
                       n_counters, ssq_ptr, (2 * NLAYERS + 1) * BPAD, V, BPAD, CG, DSTRIDE)
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
class KernelConfig:
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 1
    bk_mv: int = 256  # k chunk of the 16-row matvec tiles (QKV, O, down)
    bk_gu: int = 256  # k chunk of gate/up (two weight tiles per step)
    bk_lm: int = 128  # k chunk of the LM head's wider tiles
    chunk: int = 64  # attention positions per inner step
    bn_mv: int = 16  # rows per matvec tile (QKV, O, gate/up, down)
    bn_lm: int = 64  # rows per LM-head tile
    max_splits: int = 16  # attention splits per (row, kv head) at most
    split_min_chunks: int = 4  # a split reads at least this many chunks (shorter contexts use fewer splits)
    k_split: int = 4  # independent accumulators per matvec tile (a batched dot over k slices)
    k_split_lm: int = 4
    min_rows: int = 1  # a launch pads its batch rows to max(bucket, min_rows) (16: one tensor-core tile)
    prefetch_ahead: int = 1  # tasks ahead whose first weights are prefetched into L2 (0: none)
    prefetch_bytes: int = 64 << 10  # at most this much of each of a task's weight regions
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
                 config: KernelConfig | None = None, tilings: dict[int, I.Tiling] | None = None) -> None:
        self.dims, self.w, self.k_cache, self.v_cache = dims, weights, k_cache, v_cache
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.cfg = config or KernelConfig()
        dev = weights.embed.device
        self.device = dev
        if num_programs is None:
            num_programs = 1 if INTERPRET or dev.type != "cuda" else \
                torch.cuda.get_device_properties(dev).multi_processor_count * self.cfg.programs_per_sm
        self.num_programs = num_programs
        self.max_batch = max_batch
        self.bpad = max(_pow2(max_batch), self.cfg.min_rows)  # buffer rows
        self.tilings = tilings or {}
        d, dt = dims, weights.embed.dtype
        self.slots_total, self.max_context = k_cache.shape[1], k_cache.shape[3]
        self.gpad = _pow2(d.group)
        max_splits = self.cfg.max_splits
        bp = self.bpad

        def z(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, device=dev, dtype=dtype)

        self.tokens = z(bp, dtype=torch.int32)
        self.slots = z(bp, dtype=torch.int32)
        self.positions = z(bp, dtype=torch.int32)
        # how each row picks its token (kernels/sampling.py): temperature as float32 bits (0: greedy), seed words
        self.draw = z(3, bp, dtype=torch.int32)
        self.x, self.xn, self.qkv = z(bp, d.hidden), z(bp, d.hidden), z(bp, d.qkv_rows)
        self.ssq = z(2 * d.num_layers + 1, bp, dtype=torch.float32)
        self.attn, self.ffn = z(bp, d.q_size), z(bp, d.ffn)
        self.logits = z(bp, d.vocab, dtype=torch.float32)
        self.argmax = z(bp, dtype=torch.int64)
        self.sampled = z(bp, dtype=torch.int64)  # the drawn token (the greedy one for rows that do not sample)
        nparts = bp * d.num_kv_heads * max_splits
        self.pm, self.pl = z(nparts, self.gpad, dtype=torch.float32), z(nparts, self.gpad, dtype=torch.float32)
        self.pacc = z(nparts, self.gpad, d.head_dim, dtype=torch.float32)
        self.err = z(1, dtype=torch.int32)
        self.schedules: dict[int, I.Schedule] = {}
        self.sched_dev: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.max_splits = max_splits

    def schedule(self, batch: int) -> I.Schedule:
        if batch not in self.schedules:
            til = self.tilings.get(batch) or I.default_tiling(self.dims, batch, self.num_programs, self.max_splits,
                                                              self.cfg.bn_mv, self.cfg.bn_lm)
            regions = self.w.regions() if self.cfg.prefetch_ahead > 0 else None
            s = I.build_schedule(self.dims, batch, self.num_programs, regions, self.w.embed.element_size(), til,
                                 self.cfg.prefetch_bytes)
            n_lm = s.num_lm_parts
            self.schedules[batch] = s
            self.sched_dev[batch] = (
                s.tasks.to(self.device), s.starts.to(self.device),
                torch.zeros(s.num_counters, device=self.device, dtype=torch.int32),
                # (max, argmax) partials of the LM-head tasks: the greedy ones, then the sampled ones
                torch.zeros(2 * n_lm, max(batch, self.cfg.min_rows), device=self.device, dtype=torch.float32),
                torch.zeros(2 * n_lm, max(batch, self.cfg.min_rows), device=self.device, dtype=torch.int32),
            )
        return self.schedules[batch]

    def prof_buffer(self, s: I.Schedule) -> torch.Tensor:
        n = len(s.tasks)
        if not self.cfg.profile:
            return self.err
        if getattr(self, "prof", None) is None or self.prof.shape[0] < n:
            self.prof = torch.zeros(n, 4, device=self.device, dtype=torch.int64)
        return self.prof

    def step(self, batch: int) -> None:
        """One decode step for rows [0, batch) of tokens/slots/positions (batch must be a bucket size)."""
        d, c, w = self.dims, self.cfg, self.w
        s = self.schedule(batch)
        tasks, starts, counters, lmax, lidx = self.sched_dev[batch]
        t = s.tiling
        extra = {}
        if not INTERPRET and self.device.type == "cuda" and c.cooperative:
            extra["launch_cooperative_grid"] = True
        megakernel[(self.num_programs,)](
            tasks, starts, counters, self.err,
            self.tokens, self.slots, self.positions, self.draw, batch, t.attn_splits, s.num_counters, s.num_lm_parts,
            w.embed, w.wqkv, w.bqkv if w.bqkv is not None else w.wqkv, w.wo, w.w_gate, w.w_up, w.w_down,
            w.attn_norm, w.mlp_norm, w.final_norm, w.lm_head,
            self.cos, self.sin, self.k_cache, self.v_cache,
            self.x, self.xn, self.ssq, self.qkv, self.attn, self.ffn, self.logits, self.pm, self.pl, self.pacc,
            lmax, lidx,
            self.argmax, self.sampled, d.rms_eps, d.head_dim ** -0.5, self.prof_buffer(s),
            H=d.hidden, NH=d.num_heads, KVH=d.num_kv_heads, D=d.head_dim, F=d.ffn, V=d.vocab,
            NLAYERS=d.num_layers, SLOTS=self.slots_total, CTX=self.max_context, HAS_BIAS=w.bqkv is not None,
            BN_MV=t.bn_mv, BN_LM=t.bn_lm, BN_E=I.EMBED_COLS, BK_MV=c.bk_mv, BK_GU=c.bk_gu, BK_LM=c.bk_lm,
            KS=c.k_split, KS_LM=c.k_split_lm,
            BPAD=max(batch, c.min_rows), GPAD=self.gpad, CH=c.chunk, SMAX=_pow2(self.max_splits),
            SPLIT_MIN=c.split_min_chunks,
            PF_AHEAD=0 if INTERPRET else c.prefetch_ahead, DSTRIDE=self.draw.stride(0),
            CG=not INTERPRET, MAX_SPIN=c.max_spin, PROFILE=c.profile and not INTERPRET,
            num_warps=c.num_warps, num_stages=c.num_stages, **extra,
        )
