"""How the megakernel's tasks wait for each other and read each other's writes, and the L2 prefetches they issue.

A task spins on acquire loads of its counter (or relaxed loads, then one acquire); a finished task passes a CTA barrier
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
def _load_acquire(ptr):
    """The int32 at each of ptr with acquire semantics at GPU scope: loads after it see what its writer released."""
    return tl.inline_asm_elementwise("ld.global.gpu.acquire.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def wait_counter(cnt_ptr, idx, target, err_ptr, MAX_SPIN: tl.constexpr, POLL_ACQUIRE: tl.constexpr):
    """Spin until counter idx reaches target (idx < 0: no wait). POLL_ACQUIRE: every poll is an acquire load, so
    the one that sees the target ends the wait (one L2 round trip after the release lands); else relaxed polls
    and then one acquire (two round trips)."""
    if idx >= 0:
        spins = 0
        if POLL_ACQUIRE:
            ptr = cnt_ptr + idx + tl.zeros([1], tl.int32)
            seen = tl.max(_load_acquire(ptr), axis=0)
            while (seen < target) & (spins < MAX_SPIN):
                spins += 1
                if spins % 1024 == 0:  # once any wait has failed, stop waiting: finish fast and report
                    if tl.load(err_ptr, volatile=True) != 0:
                        spins = MAX_SPIN
                seen = tl.max(_load_acquire(ptr), axis=0)
        else:
            while (tl.load(cnt_ptr + idx, volatile=True) < target) & (spins < MAX_SPIN):
                spins += 1
                if spins % 1024 == 0:
                    if tl.load(err_ptr, volatile=True) != 0:
                        spins = MAX_SPIN
            seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire", scope="gpu")
        if seen < target:
            tl.atomic_add(err_ptr, 1)  # a dependency never came: report instead of hanging
    tl.debug_barrier()


@triton.jit
def prefetch(rec):
    """Bulk-prefetch a task's two weight regions into L2 (its record read from memory)."""
    prefetch_regions(tl.load(rec + I.F_PF0), tl.load(rec + I.F_PF0_BYTES), tl.load(rec + I.F_PF1),
                     tl.load(rec + I.F_PF1_BYTES))


@triton.jit
def prefetch_regions(addr0, bytes0, addr1, bytes1):
    """Bulk-prefetch two regions (address, bytes; 0 bytes: none) into L2: one instruction each, threads 0 and 1."""
    lane = tl.arange(0, 2)
    second = lane == 1
    addr = tl.where(second, addr1, addr0)
    size = tl.where(second, bytes1, bytes0).to(tl.int32)
    prefetch_l2(addr, size, lane)


@triton.jit
def prefetch_record(rec):
    """A task record's cache line (I.RECORD_LEN int64 fields, 128 bytes) into L2, from thread 0."""
    lane = tl.arange(0, 1)
    prefetch_l2(rec.to(tl.int64, bitcast=True) + lane * 0, tl.full([1], I.RECORD_LEN * 8, tl.int32), lane)


@triton.jit
def prefetch_l2(addr, size, lane):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `addr` (int64) from the thread whose id is `lane` (size > 0)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, $3; setp.gt.s32 q, $2, 0; "
        "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, lane], dtype=tl.int32, is_pure=False, pack=1)
