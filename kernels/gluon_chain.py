"""The loader's question (issue 35), asked of a prototype: do a phase's weights in shared memory before its dependency
wait hide the phase boundary? A persistent Gluon kernel runs Llama-3.2-1B's four layer matrices chained, layer after
layer, every phase waiting for the whole previous one as the megakernel's do (bench/NOTES.md "which waits the
overlap needs": the boundaries cost FP8 a quarter of its one-row step, and no group of waits holds it alone):

    QKV [3072, 2048] -> O [2048, 2048] (reads QKV's first 2048 columns: attention left out)
      -> gate/up [16384, 2048] -> down [2048, 8192] (reads gate/up's first 8192 columns) -> next layer's QKV

Each phase is (weight tile of BM rows) x (K split) tasks, split so that every program gets the same number of steps
(a step: one [BM, BK] weight tile through TMA into a ring slot, one wgmma with the weights as the wide operand and
the activation chunk as the narrow one: swap-AB, as kernels/gluon_matvec.py). A task's partial sums are added to
the phase's float32 output with atomics; its consumer reads them after the phase's counter says every program has
finished (a CTA barrier, then a release add; acquire polls), converts them and stores them into shared memory.

The schedule is built here in plain Python (`build_schedule`): one record a step, per program; the kernel only walks
it. What the modes change is only when a step's weights are issued:
- `ring` (the loader): the ring runs across phase boundaries, so a phase's first STAGES-1 weight tiles are in flight
  into shared memory while its program waits for the previous phase;
- `drain` (the megakernel's order today): nothing of a phase is issued before its wait has passed;
- `nowait`: no waits at all (a timing bound; its sums are wrong by design);
- `tiles` (finer dependencies): `ring`, but a task waits only for the producer tasks of the columns it reads (a
  counter per output tile of 128 columns, one arrival per K split), not for the whole phase before.
`chain_steal_kernel` runs the same chain with tasks claimed at run time (`build_tasks`; bench variants `steal-*`).

Measured on the H100 (bench/NOTES.md "The loader's prototype", `python -m bench gluon-chain`): the ring takes 2.7 of
the 16.6 µs a layer that the waits cost bf16 at one row, 1.2 of 13.4 FP8; neither `tiles` nor claimed tasks did
better. A prototype beside the megakernel, not part of it.

Importing this module needs no GPU; launching chain_kernel does (sm_90). kernels/ never imports service/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.gluon_matvec import _store_layout, padded_rows

MODES = {"ring": 0, "drain": 1, "nowait": 2, "tiles": 3}
TILE_SLOTS = gl.constexpr(128)  # `tiles`: counters a phase (gate/up: 16384 columns, 128 tiles of 128)
KINDS = ("qkv", "o", "gate_up", "down")
# kind -> (N, K) of Llama-3.2-1B; a phase reads its producer's output columns [0, K)
LLAMA_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}

# a step's record: NF int32 fields (constexprs, so the kernel reads them too)
F_KIND, F_WROW, F_K, F_KK, F_IN, F_IN_STRIDE, F_OUT, F_OUT_STRIDE, F_N0, F_FLAGS, F_PH, F_PHASE_END, F_CHUNKS, \
    F_DEP = (gl.constexpr(i) for i in range(14))  # F_DEP: the producer phase's K splits (arrivals an input tile)
NF = gl.constexpr(16)
FIRST_OF_TASK, LAST_OF_TASK, FIRST_OF_PHASE, LAST_OF_PHASE = (gl.constexpr(1 << i) for i in range(4))
MAX_SPIN = gl.constexpr(1 << 20)  # ~1 s of polls


@dataclass
class Schedule:
    """Every program's steps (`table` [programs, steps, NF] int32), the float32 activation buffer's size and where
    each phase writes (`out_base[ph]`, width `out_width[ph]`; phase -1, the input x, at 0), the phases' count."""

    table: torch.Tensor
    act_elems: int
    out_base: list[int]
    out_width: list[int]
    phases: int
    max_chunks: int


def splits_for(n: int, k: int, bm: int, bk: int, programs: int, max_chunks: int = 8) -> int:
    """The smallest K split (a power of two) that gives every program the same whole number of tasks, each of at
    most max_chunks K chunks (its activations fit the shared-memory buffer)."""
    tiles = n // bm
    s = 1
    while (tiles * s) % programs or tiles * s < programs or k // s // bk > max_chunks:
        s *= 2
        if k // s < bk:
            raise ValueError(f"no K split of [{n}, {k}] in [{bm}, {bk}] tiles gives {programs} programs equal work")
    return s


def act_layout(layers: int, rows: int, dims: dict[str, tuple[int, int]]) -> tuple[list[int], list[int], int]:
    """Where each phase writes its float32 output [rows, N] in the activation buffer (the input x [rows, K of QKV]
    first), its width, and the buffer's size."""
    out_base, out_width = [], []
    base = rows * dims["qkv"][1]
    for _layer in range(layers):
        for kind in KINDS:
            out_base.append(base)
            out_width.append(dims[kind][0])
            base += rows * dims[kind][0]
    return out_base, out_width, base


def build_schedule(layers: int, rows: int, programs: int, bm: int = 128, bk: int = 128,
                   dims: dict[str, tuple[int, int]] | None = None) -> Schedule:
    """Program p's steps: for each layer and kind, its run of the phase's tasks [p T / G, (p+1) T / G), task t =
    (tile t // S, K split t % S), each task's steps its K chunks of BK."""
    dims = dims or LLAMA_1B
    out_base, out_width, base = act_layout(layers, rows, dims)
    progs: list[list[list[int]]] = [[] for _ in range(programs)]
    max_chunks = 1
    prev_splits = 0
    for layer in range(layers):
        for ki, kind in enumerate(KINDS):
            ph = layer * len(KINDS) + ki
            n, k = dims[kind]
            s = splits_for(n, k, bm, bk, programs)
            tasks = (n // bm) * s
            chunks = k // s // bk
            max_chunks = max(max_chunks, chunks)
            in_base, in_stride = (0, k) if ph == 0 else (out_base[ph - 1], out_width[ph - 1])
            for p in range(programs):
                steps = progs[p]
                start = len(steps)
                mine = range(p * tasks // programs, (p + 1) * tasks // programs)
                for t in mine:
                    tile, split = divmod(t, s)
                    for c in range(chunks):
                        flags = (int(FIRST_OF_TASK) if c == 0 else 0) | (int(LAST_OF_TASK) if c == chunks - 1 else 0)
                        rec = [0] * int(NF)
                        rec[F_KIND], rec[F_WROW], rec[F_KK] = ki, layer * n + tile * bm, c
                        rec[F_K] = (split * chunks + c) * bk
                        rec[F_IN], rec[F_IN_STRIDE] = in_base, in_stride
                        rec[F_OUT], rec[F_OUT_STRIDE], rec[F_N0] = out_base[ph], n, tile * bm
                        rec[F_FLAGS], rec[F_PH], rec[F_CHUNKS], rec[F_DEP] = flags, ph, chunks, prev_splits
                        steps.append(rec)
                steps[start][F_FLAGS] |= int(FIRST_OF_PHASE)
                steps[-1][F_FLAGS] |= int(LAST_OF_PHASE)
                for rec in steps[start:]:
                    rec[F_PHASE_END] = len(steps)
            prev_splits = s
    lengths = {len(s) for s in progs}
    if len(lengths) != 1:
        raise ValueError(f"programs got unequal step counts {sorted(lengths)}")
    table = torch.tensor([[[int(v) for v in rec] for rec in steps] for steps in progs], dtype=torch.int32)
    return Schedule(table, base, out_base, out_width, layers * len(KINDS), max_chunks)


@gluon.jit
def _issue(tab, j, w0, w1, w2, w3, ring, ready, STAGES: gl.constexpr):
    """Step j's weight tile into ring slot j % STAGES."""
    rec = tab + j * NF
    _issue_tile(gl.load(rec + F_KIND), gl.load(rec + F_WROW), gl.load(rec + F_K), j, w0, w1, w2, w3, ring, ready,
                STAGES)


@gluon.jit
def _issue_tile(kind, row, k, j, w0, w1, w2, w3, ring, ready, STAGES: gl.constexpr):
    """The weight tile [row:, k:] of matrix `kind` into ring slot j % STAGES (its descriptor chosen by kind)."""
    s = j % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, w0.block_type.nbytes)
    if kind == 0:
        tma.async_copy_global_to_shared(w0, [row, k], bar, ring.index(s))
    elif kind == 1:
        tma.async_copy_global_to_shared(w1, [row, k], bar, ring.index(s))
    elif kind == 2:
        tma.async_copy_global_to_shared(w2, [row, k], bar, ring.index(s))
    else:
        tma.async_copy_global_to_shared(w3, [row, k], bar, ring.index(s))


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _wait(cnt_ptr, target, err_ptr):
    """Spin (acquire reads) until the counter reaches target; a wait that never ends sets the error flag."""
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
        if spins % 1024 == 0:  # once any wait has failed, stop waiting: the launch ends fast and reports
            if gl.load(err_ptr, volatile=True) != 0:
                spins = MAX_SPIN
    if seen < target:
        gl.atomic_add(err_ptr, 1)
    gl.thread_barrier()


@gluon.jit
def _wait_tiles(cnt_ptr, t0, nt, target, err_ptr, num_warps: gl.constexpr):
    """Spin until counters [t0, t0 + nt) all reach target (one acquire read a counter a thread, all at once)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs = gl.arange(0, 32 * num_warps, layout=layout)
    live = offs < nt
    ptrs = cnt_ptr + t0 + offs
    zero = gl.zeros_like(offs)
    seen = gl.min(gl.where(live, gl.atomic_add(ptrs, zero, mask=live, sem="acquire", scope="gpu"), target), axis=0)
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = gl.min(gl.where(live, gl.atomic_add(ptrs, zero, mask=live, sem="acquire", scope="gpu"), target),
                      axis=0)
        spins += 1
        if spins % 1024 == 0:
            if gl.load(err_ptr, volatile=True) != 0:
                spins = MAX_SPIN
    if seen < target:
        gl.atomic_add(err_ptr, 1)
    gl.thread_barrier()


@gluon.jit
def _load_x(act, rec, R, x_smem, RP: gl.constexpr, BK: gl.constexpr, MAX_CHUNKS: gl.constexpr,
            num_warps: gl.constexpr):
    """A task's activation chunks (float32 from L2, rows past R as zeros) into shared memory in the weights' type."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    in_base = gl.load(rec + F_IN)
    stride = gl.load(rec + F_IN_STRIDE)
    k0 = gl.load(rec + F_K)
    chunks = gl.load(rec + F_CHUNKS)
    rr = gl.arange(0, RP, layout=gl.SliceLayout(1, layout))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    base = act + in_base + rr[:, None] * stride + k0 + rk[None, :]
    live = (rr[:, None] < R) & (rk[None, :] < BK)
    for c in gl.static_range(MAX_CHUNKS):
        if c < chunks:
            v = gl.load(base + c * BK, mask=live, other=0.0, cache_modifier=".cg")
            x_smem.index(c).store(v.to(x_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _add_tile(acc, act, rec, R, BM: gl.constexpr, RP: gl.constexpr, num_warps: gl.constexpr):
    """out[r, n0 + i] += acc[i, r] (float32 atomics) for the live rows r < R."""
    layout: gl.constexpr = _store_layout(BM, num_warps)
    o = gl.convert_layout(acc, layout)
    out = act + gl.load(rec + F_OUT)
    stride = gl.load(rec + F_OUT_STRIDE)
    rn = gl.load(rec + F_N0) + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rr = gl.arange(0, RP, layout=gl.SliceLayout(0, layout))
    gl.atomic_add(out + rr[None, :] * stride + rn[:, None], o, mask=(rr[None, :] < R) & (rn[:, None] >= 0),
                  sem="relaxed", scope="gpu")


@gluon.jit
def _buffers(w0, X_LAYOUT: gl.constexpr, RP: gl.constexpr, KI: gl.constexpr, STAGES: gl.constexpr,
             MAX_CHUNKS: gl.constexpr, num_warps: gl.constexpr):
    """A program's shared memory (the weight ring, a task's activation chunks, the ring's mbarriers, initialised) and
    its zeroed wgmma accumulator [BM, RP]."""
    BM: gl.constexpr = w0.block_type.shape[0]
    BK: gl.constexpr = w0.block_type.shape[1]
    ring = gl.allocate_shared_memory(w0.dtype, [STAGES, BM, BK], w0.layout)
    x_smem = gl.allocate_shared_memory(w0.dtype, [MAX_CHUNKS, RP, BK], X_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(ready.index(b), count=1)
    fence_async_shared()
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, RP, KI])
    return ring, x_smem, ready, gl.zeros([BM, RP], gl.float32, mma_layout)


@gluon.jit
def chain_kernel(tab_ptr, n_steps, w0, w1, w2, w3, act, cnt, err, prof, R, target, X_LAYOUT: gl.constexpr,
                 RP: gl.constexpr, KI: gl.constexpr, STAGES: gl.constexpr, MAX_CHUNKS: gl.constexpr,
                 MODE: gl.constexpr, TIMELINE: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = w0.block_type.shape[0]
    BK: gl.constexpr = w0.block_type.shape[1]
    tab = tab_ptr + gl.program_id(0) * n_steps * NF
    if TIMELINE:  # per phase: the wait begun, the wait ended, the phase's sums added and released (ns); the SM
        prof = prof + gl.program_id(0) * (gl.load(tab + (n_steps - 1) * NF + F_PH) + 1) * 4

    ring, x_smem, ready, acc = _buffers(w0, X_LAYOUT, RP, KI, STAGES, MAX_CHUNKS, num_warps)
    issued = 0
    first = gl.minimum(n_steps, STAGES - 1)
    if MODE == 1:
        first = gl.minimum(first, gl.load(tab + F_PHASE_END))
    while issued < first:
        _issue(tab, issued, w0, w1, w2, w3, ring, ready, STAGES)
        issued += 1
    for i in range(n_steps):
        rec = tab + i * NF
        flags = gl.load(rec + F_FLAGS)
        ph = gl.load(rec + F_PH)
        first_of_task = (flags & FIRST_OF_TASK) != 0
        if (flags & FIRST_OF_PHASE) != 0:
            if TIMELINE:
                gl.store(prof + ph * 4, _now())
            if MODE < 2:
                if ph > 0:
                    _wait(cnt + ph - 1, target, err)
            if MODE == 3:
                if ph > 0:
                    _wait_tiles(cnt + (ph - 1) * TILE_SLOTS, gl.load(rec + F_K) // BM, gl.load(rec + F_CHUNKS),
                                gl.load(rec + F_DEP), err, num_warps)
            if TIMELINE:
                gl.store(prof + ph * 4 + 1, _now())
        elif MODE == 3:
            if first_of_task & (ph > 0):  # the phase's later tasks: their own input tiles
                _wait_tiles(cnt + (ph - 1) * TILE_SLOTS, gl.load(rec + F_K) // BM, gl.load(rec + F_CHUNKS),
                            gl.load(rec + F_DEP), err, num_warps)
        while issued <= i:  # drain: a phase's first step goes out only now
            _issue(tab, issued, w0, w1, w2, w3, ring, ready, STAGES)
            issued += 1
        if first_of_task:
            _load_x(act, rec, R, x_smem, RP, BK, MAX_CHUNKS, num_warps)
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        xk = x_smem.index(gl.load(rec + F_KK))
        acc = warpgroup_mma(ring.index(s), xk.permute((1, 0)), acc, use_acc=(flags & FIRST_OF_TASK) == 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step i-1's wgmma done: its slot is free
        limit = gl.minimum(n_steps, i + STAGES)
        if MODE == 1:
            limit = gl.minimum(limit, gl.load(rec + F_PHASE_END))
        while issued < limit:
            _issue(tab, issued, w0, w1, w2, w3, ring, ready, STAGES)
            issued += 1
        if (flags & LAST_OF_TASK) != 0:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _add_tile(acc, act, rec, R, BM, RP, num_warps)
            if MODE == 3:  # this task's output tile: one more of its K splits added
                gl.thread_barrier()
                gl.atomic_add(cnt + ph * TILE_SLOTS + gl.load(rec + F_N0) // BM, 1, sem="release", scope="gpu")
            if (flags & LAST_OF_PHASE) != 0:
                if MODE != 3:
                    gl.thread_barrier()  # every thread's sums issued before the release
                    gl.atomic_add(cnt + ph, 1, sem="release", scope="gpu")
                if TIMELINE:
                    gl.store(prof + ph * 4 + 2, _now())
                    gl.store(prof + ph * 4 + 3, _smid().to(gl.int64))

    for b in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(b))


@dataclass
class Tasks:
    """Every phase's tasks for programs that claim them (`steal`): `table` [tasks, NF] int32 (a task's record: its
    first K chunk in F_K, its chunks in F_CHUNKS), phase ph's tasks are [first[ph], first[ph] + count[ph])."""

    table: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    act_elems: int
    out_base: list[int]
    out_width: list[int]
    phases: int
    max_chunks: int


def build_tasks(layers: int, rows: int, chunks: dict[str, int], bm: int = 128, bk: int = 128,
                dims: dict[str, tuple[int, int]] | None = None) -> Tasks:
    """Phase by phase, its (weight tile, K split) tasks of chunks[kind] K chunks each, tile-major."""
    dims = dims or LLAMA_1B
    out_base, out_width, act_elems = act_layout(layers, rows, dims)
    recs: list[list[int]] = []
    first: list[int] = []
    count: list[int] = []
    for layer in range(layers):
        for ki, kind in enumerate(KINDS):
            ph = layer * len(KINDS) + ki
            n, k = dims[kind]
            c = chunks[kind]
            if k % (c * bk):
                raise ValueError(f"{kind}: K {k} is not a whole number of {c} chunks of {bk}")
            in_base, in_stride = (0, k) if ph == 0 else (out_base[ph - 1], out_width[ph - 1])
            first.append(len(recs))
            for tile in range(n // bm):
                for split in range(k // (c * bk)):
                    rec = [0] * int(NF)
                    rec[F_KIND], rec[F_WROW], rec[F_K], rec[F_CHUNKS] = ki, layer * n + tile * bm, split * c * bk, c
                    rec[F_IN], rec[F_IN_STRIDE] = in_base, in_stride
                    rec[F_OUT], rec[F_OUT_STRIDE], rec[F_N0], rec[F_PH] = out_base[ph], n, tile * bm, ph
                    recs.append(rec)
            count.append(len(recs) - first[-1])
    return Tasks(torch.tensor(recs, dtype=torch.int32), torch.tensor(first, dtype=torch.int32),
                 torch.tensor(count, dtype=torch.int32), act_elems, out_base, out_width, len(first),
                 max(chunks.values()))


@gluon.jit
def _claim(claim, first, count, tasks, mine, n_mine, i_ph, n_phases):
    """The next task of the earliest phase with one left (claim counters, relaxed atomics), written to this program's
    list; (its record or the list's base when none is left, whether one was got, the phase claimed from, n_mine)."""
    got = 0
    task = 0
    while (got == 0) & (i_ph < n_phases):
        t = gl.atomic_add(claim + i_ph, 1, sem="relaxed", scope="gpu")
        if t < gl.load(count + i_ph):
            task = gl.load(first + i_ph) + t
            got = 1
        else:
            i_ph += 1
    if got != 0:
        gl.store(mine + n_mine, task)
        n_mine += 1
    return tasks + task * NF, got, i_ph, n_mine


@gluon.jit
def _fill(limit, issued, more, i_rec, i_chunk, i_n, i_ph, n_mine, claim, first, count, tasks, mine, n_phases, w0, w1,
          w2, w3, ring, ready, STAGES: gl.constexpr):
    """Issue tiles of the claimed tasks (claiming more as each is used up) until `limit` steps are issued or no task
    is left; the issuer's state back."""
    BK: gl.constexpr = w0.block_type.shape[1]
    while (issued < limit) & (more != 0):
        if i_chunk == i_n:
            i_rec, more, i_ph, n_mine = _claim(claim, first, count, tasks, mine, n_mine, i_ph, n_phases)
            i_chunk = 0
            i_n = gl.load(i_rec + F_CHUNKS)
        if more != 0:
            _issue_tile(gl.load(i_rec + F_KIND), gl.load(i_rec + F_WROW), gl.load(i_rec + F_K) + i_chunk * BK, issued,
                        w0, w1, w2, w3, ring, ready, STAGES)
            i_chunk += 1
            issued += 1
    return issued, more, i_rec, i_chunk, i_n, i_ph, n_mine


@gluon.jit
def chain_steal_kernel(tasks, first, count, n_phases, n_tasks, w0, w1, w2, w3, act, claim, done, err, claims, prof, R,
                       X_LAYOUT: gl.constexpr, RP: gl.constexpr, KI: gl.constexpr, STAGES: gl.constexpr,
                       MAX_CHUNKS: gl.constexpr, TIMELINE: gl.constexpr, num_warps: gl.constexpr):
    """chain_kernel's work with tasks claimed at run time: a program issues the weights of the tasks it claims up to
    STAGES-1 tiles ahead of its wgmma (across phase boundaries, as `ring`), so a program that streams faster takes
    more tasks and every program ends a phase within about one task of the others. A phase's consumers wait for
    its tasks' count (each task adds one, with release semantics, once its sums are added)."""
    BM: gl.constexpr = w0.block_type.shape[0]
    BK: gl.constexpr = w0.block_type.shape[1]
    pid = gl.program_id(0)
    mine = claims + pid * n_tasks  # the tasks this program claimed, in order
    if TIMELINE:
        prof = prof + pid * n_phases * 4

    ring, x_smem, ready, acc = _buffers(w0, X_LAYOUT, RP, KI, STAGES, MAX_CHUNKS, num_warps)

    # the issuer: the task whose tiles go out next (i_rec, chunk i_chunk of i_n), the phase it claims from
    i_rec = tasks
    i_chunk = 0
    i_n = 0
    i_ph = 0
    n_mine = 0
    more = 1
    issued = 0
    # the consumer: the task its wgmma works on (c_rec, chunk c_chunk of c_n), the phase it last waited for
    c_rec = tasks
    c_idx = 0
    c_chunk = 0
    c_n = 0
    c_ph = -1
    i = 0
    going = True
    while going:
        # step i and up to STAGES-2 more (slot i-1 may still be read)
        issued, more, i_rec, i_chunk, i_n, i_ph, n_mine = _fill(
            i + STAGES - 1, issued, more, i_rec, i_chunk, i_n, i_ph, n_mine, claim, first, count, tasks, mine,
            n_phases, w0, w1, w2, w3, ring, ready, STAGES)
        gl.thread_barrier()  # the claims' list written before any thread reads it
        if issued <= i:
            going = False
        else:
            if c_chunk == c_n:
                c_rec = tasks + gl.load(mine + c_idx) * NF
                c_idx += 1
                c_chunk = 0
                c_n = gl.load(c_rec + F_CHUNKS)
                ph = gl.load(c_rec + F_PH)
                if ph != c_ph:
                    if TIMELINE:
                        gl.store(prof + ph * 4, _now())
                    if ph > 0:
                        _wait(done + ph - 1, gl.load(count + ph - 1), err)
                    if TIMELINE:
                        gl.store(prof + ph * 4 + 1, _now())
                    c_ph = ph
                _load_x(act, c_rec, R, x_smem, RP, BK, MAX_CHUNKS, num_warps)
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(ring.index(s), x_smem.index(c_chunk).permute((1, 0)), acc, use_acc=c_chunk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            c_chunk += 1
            if c_chunk == c_n:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _add_tile(acc, act, c_rec, R, BM, RP, num_warps)
                gl.thread_barrier()
                gl.atomic_add(done + c_ph, 1, sem="release", scope="gpu")
                if TIMELINE:
                    gl.store(prof + c_ph * 4 + 2, _now())
                    gl.store(prof + c_ph * 4 + 3, _smid().to(gl.int64))
            i += 1
            # the wgmma before this one is done, its slot free: up to step i + STAGES - 1 (i now counts it)
            issued, more, i_rec, i_chunk, i_n, i_ph, n_mine = _fill(
                i + STAGES - 1, issued, more, i_rec, i_chunk, i_n, i_ph, n_mine, claim, first, count, tasks, mine,
                n_phases, w0, w1, w2, w3, ring, ready, STAGES)

    for b in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(b))


def steal_launch_args(tk: Tasks, weights: list[torch.Tensor], act: torch.Tensor, claim: torch.Tensor,
                      done: torch.Tensor, err: torch.Tensor, claims: torch.Tensor, rows: int, programs: int,
                      stages: int, prof: torch.Tensor | None = None, bm: int = 128, bk: int = 128,
                      num_warps: int = 4) -> tuple[tuple[int], tuple, dict]:
    """(grid, args, kwargs) of chain_steal_kernel; claim and done: int32 [phases], zeroed before each launch; claims:
    int32 [programs, tasks] (each program's list of the tasks it claimed)."""
    dtype, rp, descs, x_layout = _operands(weights, rows, bm, bk)
    args = (tk.table, tk.first, tk.count, tk.phases, tk.table.shape[0], *descs, act, claim, done, err, claims,
            err if prof is None else prof, rows)
    kwargs = {"X_LAYOUT": x_layout, "RP": rp, "KI": 32 if dtype.itemsize == 1 else 16, "STAGES": stages,
              "MAX_CHUNKS": tk.max_chunks, "TIMELINE": prof is not None, "num_warps": num_warps}
    return (programs, ), args, kwargs


def _operands(weights: list[torch.Tensor], rows: int, bm: int, bk: int):  # noqa: ANN202
    """The weights' type, the padded rows, the weights' TMA descriptors and the activation chunks' layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = weights[0].dtype
    if any(w.dtype != dtype for w in weights) or dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError("chain: weights all bf16 or all float8_e4m3fn")
    rp = padded_rows(rows)
    w_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], _gl_dtype(dtype))
    x_layout = gl.NVMMASharedLayout.get_default_for([rp, bk], _gl_dtype(dtype))
    descs = [TensorDescriptor(w, list(w.shape), list(w.stride()), [bm, bk], w_layout) for w in weights]
    return dtype, rp, descs, x_layout


def _gl_dtype(dtype: torch.dtype):  # noqa: ANN202
    return {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]


def launch_args(sched: Schedule, weights: list[torch.Tensor], act: torch.Tensor, cnt: torch.Tensor,
                err: torch.Tensor, rows: int, mode: str, stages: int, prof: torch.Tensor | None = None,
                bm: int = 128, bk: int = 128, num_warps: int = 4) -> tuple[tuple[int], tuple, dict]:
    """(grid, args, kwargs) of chain_kernel: weights [QKV, O, gate/up, down], each its layers stacked [L N, K];
    prof (int64 [programs, phases, 4]): the per-phase timeline written, else none."""
    dtype, rp, descs, x_layout = _operands(weights, rows, bm, bk)
    programs, n_steps, _ = sched.table.shape
    args = (sched.table, n_steps, *descs, act, cnt, err, err if prof is None else prof, rows, programs)
    kwargs = {"X_LAYOUT": x_layout, "RP": rp, "KI": 32 if dtype.itemsize == 1 else 16,  # wgmma's k: 32 bytes
              "STAGES": stages, "MAX_CHUNKS": sched.max_chunks,
              "MODE": MODES[mode], "TIMELINE": prof is not None, "num_warps": num_warps}
    return (programs, ), args, kwargs


def reference_phase(inp: torch.Tensor, weights: list[torch.Tensor], ph: int,
                    dims: dict[str, tuple[int, int]] | None = None) -> torch.Tensor:
    """Phase ph's output from its input (the previous phase's float32 output) the kernel's way in torch: the input
    rounded to the weights' type, float32 sums. Checked phase by phase: with FP8's 3-bit mantissa, a chain's
    roundings drift apart from any summation-order difference, so only each phase on its own input is exact."""
    dims = dims or LLAMA_1B
    ki = ph % len(KINDS)
    n, k = dims[KINDS[ki]]
    layer = ph // len(KINDS)
    w = weights[ki][layer * n:(layer + 1) * n].float()
    return inp[:, :k].to(weights[ki].dtype).float() @ w.t()
