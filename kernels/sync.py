"""How the megakernel's tasks wait for each other and read each other's writes, and the L2 prefetches they issue.

A task spins on a volatile load of its counter, then takes an acquire atomic; a finished task passes a CTA barrier
and adds one to its counter with release semantics (the kernel's loop, megakernel.py). Activations are read with
`.cg` (L2, never a stale L1 line). The last task (Argmax, lm_head.py) zeroes the counters, so a CUDA graph can
replay the launch. A wait that spins too long sets an error flag (Megakernel.err) and the step finishes instead of
hanging.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import instructions as I


@triton.jit
def ld_act(ptr, mask, CG: tl.constexpr, other=0.0):
    """Activations written by other programs in this launch: read through L2."""
    if CG:
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def wait_counter(cnt_ptr, idx, target, err_ptr, MAX_SPIN: tl.constexpr):
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
def prefetch(rec):
    """Bulk-prefetch a task's two weight regions into L2: one instruction each, from threads 0 and 1."""
    lane = tl.arange(0, 2)
    second = lane == 1
    addr = tl.where(second, tl.load(rec + I.F_PF1), tl.load(rec + I.F_PF0))
    size = tl.where(second, tl.load(rec + I.F_PF1_BYTES), tl.load(rec + I.F_PF0_BYTES)).to(tl.int32)
    prefetch_l2(addr, size, lane)


@triton.jit
def prefetch_l2(addr, size, lane):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `addr` (int64) from the thread whose id is `lane` (size > 0)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, $3; setp.gt.s32 q, $2, 0; "
        "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, lane], dtype=tl.int32, is_pure=False, pack=1)
