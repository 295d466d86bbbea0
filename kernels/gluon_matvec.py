"""A matvec phase (gate/up of Llama-3.2-1B: out[R, N] = x[R, K] @ W[N, K]^T) in Gluon, the prototype of issue 35's
"activations read once per task, the weights as the wide operand on wgmma" (bench/NOTES.md, "Where the rest is").

Plain Triton cannot keep an operand in shared memory across loop iterations, so the megakernel rereads a task's
activation rows from L2 for every weight tile, and cannot issue a tile's weight loads before the task's dependency
wait. Gluon (triton.experimental.gluon) exposes shared memory, the tensor-memory accelerator (TMA), mbarriers and
wgmma, so the schedule is written out:

    program p of G (a persistent grid, one program per SM) owns the output columns of tiles [t0, t1),
        t0 = p * T // G, t1 = (p + 1) * T // G, T = N / BM tiles of BM weight rows;
    its work is (t1 - t0) * K / BK steps i, step i = (tile t0 + i // KT, k chunk i % KT), KT = K / BK;
    a ring of STAGES shared-memory slots, slot i % STAGES holding step i's weight tile W[BM, BK] (and, unless x is
    resident, x's chunk [RP, BK]), each slot with an mbarrier that the TMA signals when its bytes land;
    prologue: the TMA loads of steps 0 .. STAGES-2 (weights first: nothing they need waits on x); then, if x is
    resident, all of x [RP, K] into shared memory once (one mbarrier), and a wait for it;
    step i: wait for slot i % STAGES; acc[BM, RP] += W_i @ x_k^T on the tensor cores (wgmma, asynchronous; the
    weight tile is the wide M side, x^T the narrow N side: swap-AB); wait until at most this wgmma is in flight, so
    step i-1's slot is free, and issue the TMA of step i + STAGES - 1 into it; at a tile's last k chunk, wait for
    the wgmma and store acc^T (bf16) to out[:, tile's columns].

x^T for wgmma's B operand: x's chunk lands as [RP, BK] (K contiguous, 128-byte swizzle, TMA zero-fills rows
R..RP-1) and the wgmma reads it through a permuted view [BK, RP], a K-major B (wgmma transposes bf16 B itself). RP
is R rounded up to a power of two, at least 8 (wgmma's smallest N). x is resident (loaded once, K/BK boxes) when it
fits beside the ring (bf16: up to 16 rows with a 4 x 32 KB ring; 64 rows is 256 KB, more than an SM has), else its
chunk rides in each ring slot beside the weights: with one tile a program (BM = 128 over N = 16384 on 132 SMs) that
is also each chunk of x read once per program.

Importing this module needs no GPU; launching `swapab_matvec` does (sm_90). kernels/ never imports service/.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SMEM_BUDGET = 200 * 1024  # of the H100's 227 KB a block: the ring, x if resident, and the store's layout change


def program_tiles(pid: int, grid: int, num_tiles: int) -> range:
    """The weight tiles program `pid` of `grid` owns: a contiguous run, the runs' lengths differing by one at most
    (the kernel computes the same)."""
    return range(pid * num_tiles // grid, (pid + 1) * num_tiles // grid)


def padded_rows(rows: int) -> int:
    """x's rows as wgmma's N: a power of two, at least 8."""
    return max(8, triton.next_power_of_2(rows))


def x_fits(rows: int, k: int, bm: int, bk: int, stages: int) -> bool:
    """Whether all of x [padded rows, K] (bf16) fits in shared memory beside the weight ring."""
    rp = padded_rows(rows)
    return rp * k * 2 + stages * bm * bk * 2 + bm * rp * 2 <= SMEM_BUDGET


@gluon.constexpr_function
def _store_layout(bm, num_warps):
    """A layout for the output tile [BM, RP] with each thread's 8 values consecutive columns of one output row."""
    tpw0 = min(32, bm // 8)
    return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[tpw0, 32 // tpw0],
                            warps_per_cta=[1, num_warps], order=[0, 1])


@gluon.jit
def _issue(j, t0, n_iter, w_desc, x_desc, w_ring, x_ring, ready, KT: gl.constexpr, STAGES: gl.constexpr,
           X_RESIDENT: gl.constexpr):
    """The TMA loads of step j into slot j % STAGES (none past the program's last step)."""
    BM: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    s = j % STAGES
    kk = j % KT
    live = j < n_iter
    bar = ready.index(s)
    if X_RESIDENT:
        mbarrier.expect(bar, w_desc.block_type.nbytes, pred=live)
    else:
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(x_desc, [0, kk * BK], bar, x_ring.index(s), pred=live)
    tma.async_copy_global_to_shared(w_desc, [(t0 + j // KT) * BM, kk * BK], bar, w_ring.index(s), pred=live)


@gluon.jit
def _store_tile(acc, out_ptr, n0, R, N, BM: gl.constexpr, RP: gl.constexpr, num_warps: gl.constexpr):
    """out[r, n0 + i] = acc[i, r] (bf16) for the live rows r < R."""
    layout: gl.constexpr = _store_layout(BM, num_warps)
    o = gl.convert_layout(acc.to(gl.bfloat16), layout)
    rn = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rr = gl.arange(0, RP, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + rr[None, :] * N + rn[:, None], o, mask=(rr[None, :] < R) & (rn[:, None] < N))


@gluon.jit
def swapab_matvec_kernel(w_desc, x_desc, out_ptr, R, N, K: gl.constexpr, STAGES: gl.constexpr,
                         X_RESIDENT: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    RP: gl.constexpr = x_desc.block_type.shape[0]
    KT: gl.constexpr = K // BK
    gl.static_assert(BM % (16 * num_warps) == 0, "each warp owns 16-row slices of the weight tile (wgmma's m64)")
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    num_tiles = N // BM
    t0 = pid * num_tiles // grid
    n_iter = ((pid + 1) * num_tiles // grid - t0) * KT

    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BM, BK], w_desc.layout)
    if X_RESIDENT:
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [KT, RP, BK], x_desc.layout)
    else:
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, RP, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(ready.index(b), count=1)
    mbarrier.init(x_bar, count=1)
    fence_async_shared()

    # the weights of the first STAGES-1 steps: in a megakernel task, what it can issue before its dependency wait
    for j in gl.static_range(STAGES - 1):
        _issue(j, t0, n_iter, w_desc, x_desc, w_ring, x_smem, ready, KT, STAGES, X_RESIDENT)
    if X_RESIDENT:  # x once: K / BK boxes on one barrier
        mbarrier.expect(x_bar, KT * x_desc.block_type.nbytes)
        for c in gl.static_range(KT):
            tma.async_copy_global_to_shared(x_desc, [0, c * BK], x_bar, x_smem.index(c))
        mbarrier.wait(x_bar, 0)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, RP, 16])
    acc = gl.zeros([BM, RP], gl.float32, mma_layout)
    for i in range(n_iter):
        s = i % STAGES
        kk = i % KT
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if X_RESIDENT:
            xk = x_smem.index(kk)
        else:
            xk = x_smem.index(s)
        acc = warpgroup_mma(w_ring.index(s), xk.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step i-1's wgmma done: its slot is free
        _issue(i + STAGES - 1, t0, n_iter, w_desc, x_desc, w_ring, x_smem, ready, KT, STAGES, X_RESIDENT)
        if kk == KT - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _store_tile(acc, out_ptr, (t0 + i // KT) * BM, R, N, BM, RP, num_warps)

    for b in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(b))
    mbarrier.invalidate(x_bar)


class SwapABConfig:
    """The launch's sizes: weight tile [bm, bk], ring slots, warps (one warpgroup: 4), x resident (None: if it
    fits)."""

    def __init__(self, bm: int = 128, bk: int = 128, stages: int = 4, num_warps: int = 4,
                 x_resident: bool | None = None) -> None:
        self.bm, self.bk, self.stages, self.num_warps, self.x_resident = bm, bk, stages, num_warps, x_resident

    def resident(self, rows: int, k: int) -> bool:
        return x_fits(rows, k, self.bm, self.bk, self.stages) if self.x_resident is None else self.x_resident

    def __repr__(self) -> str:
        return f"SwapABConfig(bm={self.bm}, bk={self.bk}, stages={self.stages}, num_warps={self.num_warps}, " \
               f"x_resident={self.x_resident})"


def descriptors(x, w, cfg: SwapABConfig):  # noqa: ANN001, ANN201
    """The TMA descriptors of w [N, K] (boxes [bm, bk]) and x [R, K] (boxes [padded rows, bk]: rows past R read as
    zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rp = padded_rows(x.shape[0])
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.bm, cfg.bk], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([rp, cfg.bk], gl.bfloat16)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg.bm, cfg.bk], w_layout)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [rp, cfg.bk], x_layout)
    return w_desc, x_desc


def launch_args(x, w, out, cfg: SwapABConfig, grid: int):  # noqa: ANN001, ANN201
    """(grid, args, kwargs) of swapab_matvec_kernel for out = x @ w^T."""
    rows, k = x.shape
    n = w.shape[0]
    if w.dtype != x.dtype or x.dtype.itemsize != 2 or k != w.shape[1] or n % cfg.bm or k % cfg.bk:
        raise ValueError(f"swapab_matvec: bf16 x [R, K] and w [N, K] with N % {cfg.bm} == K % {cfg.bk} == 0; "
                         f"got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    if padded_rows(rows) > 256:
        raise ValueError(f"swapab_matvec: at most 256 rows (wgmma's N), got {rows}")
    w_desc, x_desc = descriptors(x, w, cfg)
    grid = max(1, min(grid, n // cfg.bm))
    kwargs = {"K": k, "STAGES": cfg.stages, "X_RESIDENT": cfg.resident(rows, k), "num_warps": cfg.num_warps}
    return (grid, ), (w_desc, x_desc, out, rows, n), kwargs


def swapab_matvec(x, w, out=None, cfg: SwapABConfig | None = None, grid: int | None = None):  # noqa: ANN001, ANN201
    """out [R, N] = x [R, K] @ w [N, K]^T on an sm_90 GPU, bf16 in and out, float32 accumulation."""
    import torch

    cfg = cfg or SwapABConfig()
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    if grid is None:
        grid = torch.cuda.get_device_properties(x.device).multi_processor_count
    g, args, kwargs = launch_args(x, w, out, cfg, grid)
    swapab_matvec_kernel[g](*args, **kwargs)
    return out
