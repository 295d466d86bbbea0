"""The megakernel: one persistent Triton launch runs a whole decode step by executing the schedule that
kernels/instructions.py builds. The kernel only interprets task records; every decision of who does what is on
the host, once per model and batch bucket.

Numerics follow the PyTorch reference (service/backends/reference.py) step for step: activations are rounded to
the weights' dtype where the reference rounds them (after each norm, linear, RoPE, SiLU and residual add), and
every sum is accumulated in float32.

Synchronisation: a task spins on a volatile load of its counter, then takes an acquire atomic; a finished task
passes a CTA barrier and adds one to its counter with release semantics. Activations are read with `.cg` (L2,
never a stale L1 line). The last task (ARGMAX) zeroes every counter, so a CUDA graph can replay the launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import instructions as I

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_numpy2_shim() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array, which numpy ≥ 2.4
    refuses (a loop bound loaded from memory then fails). Patch that one conversion, for the interpreter only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_parley_shim", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._parley_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _interpreter_numpy2_shim()


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
def _prefetch(rec, NPF: tl.constexpr):
    """Bulk-prefetch a task's two weight regions into L2, spread over NPF lanes."""
    HALF: tl.constexpr = NPF // 2
    i = tl.arange(0, NPF)
    second = i >= HALF
    j = tl.where(second, i - HALF, i).to(tl.int64)
    a0 = tl.load(rec + I.F_PF0)
    n0 = tl.load(rec + I.F_PF0_BYTES)
    a1 = tl.load(rec + I.F_PF1)
    n1 = tl.load(rec + I.F_PF1_BYTES)
    addr = tl.where(second, a1, a0)
    nbytes = tl.where(second, n1, n0)
    chunk = ((nbytes // HALF + 15) // 16) * 16
    off = j * chunk
    size = tl.minimum(chunk, tl.maximum(nbytes - off, 0)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rstd(x_ptr, B, eps, H: tl.constexpr, BPAD: tl.constexpr, BK: tl.constexpr, CG: tl.constexpr):
    rb = tl.arange(0, BPAD)
    ss = tl.zeros([BPAD], tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        m = (rb[:, None] < B) & (rk[None, :] < H)
        x = _ld_act(x_ptr + rb[:, None] * H + rk[None, :], m, CG).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return tl.rsqrt(ss / H + eps)


@triton.jit
def _matvec(w_ptr, N, a_ptr, B, rstd, nw_ptr, K: tl.constexpr, NORM: tl.constexpr, BPAD: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, CG: tl.constexpr):
    """acc[b, n] = sum_k a'[b, k] * w[n, k] for the N (≤ BN) rows at w_ptr; a' = RMSNorm(a) when NORM."""
    rb = tl.arange(0, BPAD)
    rn = tl.arange(0, BN)
    acc = tl.zeros([BPAD, BN], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        a = _ld_act(a_ptr + rb[:, None] * K + rk[None, :], (rb[:, None] < B) & (rk[None, :] < K), CG)
        if NORM:
            nw = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            a = (nw[None, :] * (a.to(tl.float32) * rstd[:, None]).to(w.dtype).to(tl.float32)).to(w.dtype)
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _residual_store(x_ptr, acc, n0, B, H: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr, CG: tl.constexpr):
    rb = tl.arange(0, BPAD)
    rn = n0 + tl.arange(0, BN)
    m = (rb[:, None] < B) & (rn[None, :] < H)
    ptrs = x_ptr + rb[:, None] * H + rn[None, :]
    x = _ld_act(ptrs, m, CG)
    y = x.to(tl.float32) + acc.to(x.dtype).to(tl.float32)
    tl.store(ptrs, y.to(x.dtype), mask=m)


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
def _op_embed(tok_ptr, embed_ptr, x_ptr, B, H: tl.constexpr, BPAD: tl.constexpr, BK: tl.constexpr):
    rb = tl.arange(0, BPAD)
    tok = tl.load(tok_ptr + rb, mask=rb < B, other=0).to(tl.int64)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        m = (rb[:, None] < B) & (rk[None, :] < H)
        e = tl.load(embed_ptr + tok[:, None] * H + rk[None, :], mask=m, other=0.0)
        tl.store(x_ptr + rb[:, None] * H + rk[None, :], e, mask=m)


@triton.jit
def _op_attn(layer, b, g, s, S, batch, cnt_ptr, arrive0, tok_ptr, slot_ptr, pos_ptr, qkv_ptr, cos_ptr, sin_ptr,
             kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, attn_ptr, sm_scale,
             NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, CTX: tl.constexpr,
             GPAD: tl.constexpr, CH: tl.constexpr, CG: tl.constexpr):
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
    # the cached positions [0, pos), split S ways in whole chunks
    span = tl.cdiv(tl.cdiv(pos, S), CH) * CH
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
    part = (b * KVH + g) * S + s
    tl.store(pm_ptr + part * GPAD + rg, m_i)
    tl.store(pl_ptr + part * GPAD + rg, l_i)
    tl.store(pacc_ptr + (part * GPAD + rg[:, None]) * D + rd[None, :], acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + arrive0 + (layer * batch + b) * KVH + g, 1, sem="acq_rel", scope="gpu")
    last = arrived == S - 1
    if last:
        # the last split in merges all S partials into attn[b, heads of g]
        p0 = (b * KVH + g) * S
        m_all = tl.full([GPAD], float("-inf"), tl.float32)
        for i in range(0, S):
            m_all = tl.maximum(m_all, _ld_act(pm_ptr + (p0 + i) * GPAD + rg, rg < GPAD, CG))
        l_all = tl.zeros([GPAD], tl.float32)
        o = tl.zeros([GPAD, D], tl.float32)
        for i in range(0, S):
            w = tl.exp2(_ld_act(pm_ptr + (p0 + i) * GPAD + rg, rg < GPAD, CG) - m_all)
            l_all += w * _ld_act(pl_ptr + (p0 + i) * GPAD + rg, rg < GPAD, CG)
            o += w[:, None] * _ld_act(pacc_ptr + ((p0 + i) * GPAD + rg[:, None]) * D + rd[None, :],
                                      rg[:, None] < GPAD, CG)
        o = o / l_all[:, None]
        tl.store(attn_ptr + b * Q + (g * G + rg[:, None]) * D + rd[None, :], o.to(dt), mask=rg[:, None] < G)
    return last.to(tl.int32)


@triton.jit
def _op_lmhead(n0, tile, B, x_ptr, fnorm_ptr, lm_ptr, logits_ptr, lmax_ptr, lidx_ptr, eps,
               H: tl.constexpr, V: tl.constexpr, BPAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               CG: tl.constexpr):
    rstd = _rstd(x_ptr, B, eps, H, BPAD, BK, CG)
    acc = _matvec(lm_ptr + n0 * H, V - n0, x_ptr, B, rstd, fnorm_ptr, H, True, BPAD, BN, BK, CG)
    dt = lm_ptr.dtype.element_ty
    lg = acc.to(dt).to(tl.float32)
    rb = tl.arange(0, BPAD)
    rn = n0 + tl.arange(0, BN)
    tl.store(logits_ptr + rb[:, None] * V + rn[None, :], lg, mask=(rb[:, None] < B) & (rn[None, :] < V))
    lg = tl.where(rn[None, :] < V, lg, float("-inf"))
    mx = tl.max(lg, axis=1)
    idx = tl.min(tl.where(lg == mx[:, None], rn[None, :], V), axis=1)  # the first index of the maximum
    tl.store(lmax_ptr + tile * BPAD + rb, mx)
    tl.store(lidx_ptr + tile * BPAD + rb, idx)


@triton.jit
def _op_argmax(B, n_tiles, lmax_ptr, lidx_ptr, out_ptr, cnt_ptr, n_counters, V: tl.constexpr,
               BPAD: tl.constexpr, CG: tl.constexpr):
    TC: tl.constexpr = 64
    rb = tl.arange(0, BPAD)
    best = tl.full([BPAD], float("-inf"), tl.float32)
    bidx = tl.full([BPAD], V, tl.int32)
    for t0 in range(0, n_tiles, TC):
        rt = t0 + tl.arange(0, TC)
        m = (rt[:, None] < n_tiles) & (rb[None, :] < BPAD)
        vals = _ld_act(lmax_ptr + rt[:, None] * BPAD + rb[None, :], m, CG, float("-inf"))
        idxs = _ld_act(lidx_ptr + rt[:, None] * BPAD + rb[None, :], m, CG, V)
        cm = tl.max(vals, axis=0)
        ci = tl.min(tl.where(vals == cm[None, :], idxs, V), axis=0)
        take = (cm > best) | ((cm == best) & (ci < bidx))
        best = tl.where(take, cm, best)
        bidx = tl.where(take, ci, bidx)
    tl.store(out_ptr + rb, bidx.to(tl.int64), mask=rb < B)
    # every other task is done (they all lead here): reset the counters for the next replay
    for c0 in range(0, n_counters, 256):
        rc = c0 + tl.arange(0, 256)
        tl.store(cnt_ptr + rc, tl.zeros([256], tl.int32), mask=rc < n_counters)


# ---------------------------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def megakernel(
    tasks_ptr, starts_ptr, cnt_ptr, err_ptr,
    tok_ptr, slot_ptr, pos_ptr, batch, attn_splits, n_counters, n_lm_tiles,
    embed_ptr, wqkv_ptr, bqkv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, norm1_ptr, norm2_ptr, fnorm_ptr, lm_ptr,
    cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    x_ptr, qkv_ptr, attn_ptr, ffn_ptr, logits_ptr, pm_ptr, pl_ptr, pacc_ptr, lmax_ptr, lidx_ptr, out_ptr,
    eps, sm_scale,
    H: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, F: tl.constexpr, V: tl.constexpr,
    NLAYERS: tl.constexpr, SLOTS: tl.constexpr, CTX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr, BN_LM: tl.constexpr,
    BPAD: tl.constexpr, BK: tl.constexpr, GPAD: tl.constexpr, CH: tl.constexpr,
    NPF: tl.constexpr, PF_AHEAD: tl.constexpr, CG: tl.constexpr, MAX_SPIN: tl.constexpr,
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
                _prefetch(tasks_ptr + (t_begin + i) * NF, NPF)
    for t in range(t_begin, t_end):
        rec = tasks_ptr + t * NF
        if PF_AHEAD > 0:
            if t + PF_AHEAD < t_end:
                _prefetch(tasks_ptr + (t + PF_AHEAD) * NF, NPF)
        op = tl.load(rec + I.F_OP)
        layer = tl.load(rec + I.F_LAYER)
        a0 = tl.load(rec + I.F_A0)
        _wait(cnt_ptr, tl.load(rec + I.F_WAIT), tl.load(rec + I.F_TARGET), err_ptr, MAX_SPIN)
        inc = tl.full([], 1, tl.int32)
        if op == I.QKV:
            rstd = _rstd(x_ptr, batch, eps, H, BPAD, BK, CG)
            acc = _matvec(wqkv_ptr + (layer * QKVR + a0) * H, QKVR - a0, x_ptr, batch, rstd, norm1_ptr + layer * H,
                          H, True, BPAD, BN_QKV, BK, CG)
            rn = a0 + tl.arange(0, BN_QKV)
            if HAS_BIAS:
                acc += tl.load(bqkv_ptr + layer * QKVR + rn, mask=rn < QKVR, other=0.0).to(tl.float32)[None, :]
            rb = tl.arange(0, BPAD)
            tl.store(qkv_ptr + rb[:, None] * QKVR + rn[None, :], acc.to(qkv_ptr.dtype.element_ty),
                     mask=(rb[:, None] < batch) & (rn[None, :] < QKVR))
        elif op == I.ATTN:
            inc = _op_attn(layer, a0, tl.load(rec + I.F_A1), tl.load(rec + I.F_A2), attn_splits, batch, cnt_ptr,
                           arrive0, tok_ptr, slot_ptr, pos_ptr, qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                           pm_ptr, pl_ptr, pacc_ptr, attn_ptr, sm_scale, NH, KVH, D, SLOTS, CTX, GPAD, CH, CG)
        elif op == I.OPROJ:
            acc = _matvec(wo_ptr + (layer * H + a0) * Q, H - a0, attn_ptr, batch, eps, norm1_ptr, Q, False,
                          BPAD, BN_O, BK, CG)
            _residual_store(x_ptr, acc, a0, batch, H, BPAD, BN_O, CG)
        elif op == I.GATEUP:
            rstd = _rstd(x_ptr, batch, eps, H, BPAD, BK, CG)
            gate = _matvec(wg_ptr + (layer * F + a0) * H, F - a0, x_ptr, batch, rstd, norm2_ptr + layer * H,
                           H, True, BPAD, BN_GU, BK, CG)
            up = _matvec(wu_ptr + (layer * F + a0) * H, F - a0, x_ptr, batch, rstd, norm2_ptr + layer * H,
                         H, True, BPAD, BN_GU, BK, CG)
            dt = ffn_ptr.dtype.element_ty
            gate = gate.to(dt).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
            y = (act * up.to(dt).to(tl.float32)).to(dt)
            rb = tl.arange(0, BPAD)
            rn = a0 + tl.arange(0, BN_GU)
            tl.store(ffn_ptr + rb[:, None] * F + rn[None, :], y, mask=(rb[:, None] < batch) & (rn[None, :] < F))
        elif op == I.DOWN:
            acc = _matvec(wd_ptr + (layer * H + a0) * F, H - a0, ffn_ptr, batch, eps, norm1_ptr, F, False,
                          BPAD, BN_DOWN, BK, CG)
            _residual_store(x_ptr, acc, a0, batch, H, BPAD, BN_DOWN, CG)
        elif op == I.LMHEAD:
            _op_lmhead(a0, tl.load(rec + I.F_A1), batch, x_ptr, fnorm_ptr, lm_ptr, logits_ptr, lmax_ptr, lidx_ptr,
                       eps, H, V, BPAD, BN_LM, BK, CG)
        elif op == I.EMBED:
            _op_embed(tok_ptr, embed_ptr, x_ptr, batch, H, BPAD, BK)
        elif op == I.ARGMAX:
            _op_argmax(batch, n_lm_tiles, lmax_ptr, lidx_ptr, out_ptr, cnt_ptr, n_counters, V, BPAD, CG)
            inc = tl.full([], 0, tl.int32)
        tl.debug_barrier()
        done = tl.load(rec + I.F_DONE)
        if (done >= 0) & (inc > 0):
            tl.atomic_add(cnt_ptr + done, 1, sem="release", scope="gpu")


# ---------------------------------------------------------------------------------------------------------------
# host side


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int = 8
    num_stages: int = 3
    bk: int = 128
    chunk: int = 64  # attention positions per inner step
    prefetch_ahead: int = 1  # tasks ahead whose weights are prefetched into L2 (0: none)
    cooperative: bool = True
    max_spin: int = 1 << 22


class Megakernel:
    """Buffers, schedules (one per batch bucket) and the launch of the decode-step kernel.

    k_cache/v_cache: [layers, slots, kv_heads, max_context, head_dim]; cos/sin: float32 [max_context, head_dim/2].
    Inputs are the int32 tensors `tokens`, `slots`, `positions` ([max_batch]); outputs `logits` (float32
    [max_batch, vocab]) and `argmax` (int64 [max_batch]). `step(batch)` reads and writes only those.
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
                torch.cuda.get_device_properties(dev).multi_processor_count
        self.num_programs = num_programs
        self.max_batch = max_batch
        self.bpad = max(16, _pow2(max_batch))
        self.tilings = tilings or {}
        d, dt = dims, weights.embed.dtype
        self.slots_total, self.max_context = k_cache.shape[1], k_cache.shape[3]
        self.gpad = max(16, _pow2(d.group))
        max_splits = 16
        bp = self.bpad

        def z(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, device=dev, dtype=dtype)

        self.tokens = z(bp, dtype=torch.int32)
        self.slots = z(bp, dtype=torch.int32)
        self.positions = z(bp, dtype=torch.int32)
        self.x, self.qkv = z(bp, d.hidden), z(bp, d.qkv_rows)
        self.attn, self.ffn = z(bp, d.q_size), z(bp, d.ffn)
        self.logits = z(bp, d.vocab, dtype=torch.float32)
        self.argmax = z(bp, dtype=torch.int64)
        nparts = bp * d.num_kv_heads * max_splits
        self.pm, self.pl = z(nparts, self.gpad, dtype=torch.float32), z(nparts, self.gpad, dtype=torch.float32)
        self.pacc = z(nparts, self.gpad, d.head_dim, dtype=torch.float32)
        self.err = z(1, dtype=torch.int32)
        self.schedules: dict[int, I.Schedule] = {}
        self.sched_dev: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.max_splits = max_splits

    def schedule(self, batch: int) -> I.Schedule:
        if batch not in self.schedules:
            til = self.tilings.get(batch) or I.default_tiling(self.dims, batch, self.num_programs, self.max_splits)
            regions = self.w.regions() if self.cfg.prefetch_ahead > 0 else None
            s = I.build_schedule(self.dims, batch, self.num_programs, regions, self.w.embed.element_size(), til)
            n_lm = s.num_lm_tiles
            self.schedules[batch] = s
            self.sched_dev[batch] = (
                s.tasks.to(self.device), s.starts.to(self.device),
                torch.zeros(s.num_counters, device=self.device, dtype=torch.int32),
                torch.zeros(n_lm, self.bpad, device=self.device, dtype=torch.float32),
                torch.zeros(n_lm, self.bpad, device=self.device, dtype=torch.int32),
            )
        return self.schedules[batch]

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
            self.tokens, self.slots, self.positions, batch, t.attn_splits, s.num_counters, s.num_lm_tiles,
            w.embed, w.wqkv, w.bqkv if w.bqkv is not None else w.wqkv, w.wo, w.w_gate, w.w_up, w.w_down,
            w.attn_norm, w.mlp_norm, w.final_norm, w.lm_head,
            self.cos, self.sin, self.k_cache, self.v_cache,
            self.x, self.qkv, self.attn, self.ffn, self.logits, self.pm, self.pl, self.pacc, lmax, lidx,
            self.argmax, d.rms_eps, d.head_dim ** -0.5,
            H=d.hidden, NH=d.num_heads, KVH=d.num_kv_heads, D=d.head_dim, F=d.ffn, V=d.vocab,
            NLAYERS=d.num_layers, SLOTS=self.slots_total, CTX=self.max_context, HAS_BIAS=w.bqkv is not None,
            BN_QKV=t.bn_qkv, BN_O=t.bn_o, BN_GU=t.bn_gu, BN_DOWN=t.bn_down, BN_LM=t.bn_lm,
            BPAD=self.bpad, BK=c.bk, GPAD=self.gpad, CH=c.chunk,
            NPF=32 * c.num_warps, PF_AHEAD=0 if INTERPRET else c.prefetch_ahead, CG=not INTERPRET,
            MAX_SPIN=c.max_spin, num_warps=c.num_warps, num_stages=c.num_stages, **extra,
        )
