"""The megakernel's instruction set and its schedule, built in plain Python.

A decode step is a list of tasks. Each task is one instruction on one piece of work, serialised into an int64
record: a header every task has (opcode, layer, the counter it waits on and the count it waits for, the counter it
adds one to when done, two weight regions to prefetch into L2), then the instruction's own named fields. Every
program of the persistent kernel (one per SM) walks its own slice of the list in order. The list is ordered by
phase, so the waits only ever look backwards; with all programs resident, nothing deadlocks. With a single program
(the CPU interpreter), every wait is already met when it is reached.

The instructions (one layer = QKV → ATTN → OPROJ → GATEUP → DOWN):

  Embed    columns [col0, col0 + tiles*64) of x[b] = embed[token[b]] for every row of the bucket, and of the first
           norm's operand x * norm_weight
  Matvec   rows [row0, row0 + tiles*bn) of one of
           QKV     RMSNorm(x) @ [Wq; Wk; Wv]^T (+ bias), then RoPE on q and k, q to the attention's input, k and v
                   appended to the KV cache at the row's position. A QKV tile is two runs of bn rows streamed side
                   by side: rows d.. of a head and the rows d + head_dim/2.. they rotate with, so a tile applies
                   RoPE on its own (v tiles: two consecutive runs)
           OPROJ   x += attn @ Wo^T
           GATEUP  ffn = silu(RMSNorm(x) @ Wgate^T) * (RMSNorm(x) @ Wup^T)
           DOWN    x += ffn @ Wdown^T
           LMHEAD  logits = RMSNorm(x) @ lm_head^T, and the task's (max, argmax) per row as partial `part`
           A matvec whose K is split (Tiling.k_splits) runs each tile as that many tasks, one per part of K
           (`k_split`); each leaves its float32 sums in the tile's scratch `slot` and arrives on the tile's counter
           `arrive`; the last to arrive adds the parts up in split order (the same sums whoever comes last) and
           finishes the tile. So a matrix with fewer tiles than the GPU has programs still keeps every program
           streaming, with tiles wide enough that each activation chunk feeds many weight rows.
  Attention one split of flash-decoding for (batch row, KV head) over the cached positions, the new one included;
           the last split to arrive (counted on counter `arrive`) merges the partials. How many splits take part is
           decided at run time from the position (short contexts: one split, which writes attn directly). Where
           query blocks are on, the tasks of a block's rows (a prompt's chunk) share its work instead, arriving on
           its first row's counter (`arrive_row_stride` says where that is: kernels/attention.py)
  Argmax   reduce the `parts` (max, argmax) partials into the greedy token (and the drawn one), then zero the
           counters for the next replay

The tasks that write x (Embed, OPROJ, DOWN) also write x * (the next norm's weight) and their columns' sums of
squares (one partial per 16 columns and row, in a scratch slot of their own: no atomics, so the sums are the same
every step), so a norm costs its consumers one read of the partials and a scale by rstd in their epilogue.

`Layout` says where every dependency counter and every scratch slot lives; the schedule writes the indices into
the records, so the kernel never derives one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch


class Op(enum.IntEnum):
    EMBED = 0
    QKV = 1
    ATTN = 2
    OPROJ = 3
    GATEUP = 4
    DOWN = 5
    LMHEAD = 6
    ARGMAX = 7


# the opcodes as plain module constants: what the kernel compares against
EMBED, QKV, ATTN, OPROJ, GATEUP, DOWN, LMHEAD, ARGMAX = (int(o) for o in Op)
OP_NAMES = tuple(o.name for o in Op)
LAYER_OPS = (Op.QKV, Op.ATTN, Op.OPROJ, Op.GATEUP, Op.DOWN)  # one layer's phases, in order
EMBED_COLS = 64  # columns per Embed tile


@dataclass(frozen=True)
class Region:
    """A span of weights to prefetch into L2: an address and a byte count (0: nothing)."""

    addr: int = 0
    nbytes: int = 0


NO_REGION = Region()


@dataclass(frozen=True)
class Task:
    """The header every record starts with. Subclasses add their own fields, which follow it in declaration order."""

    op: Op = Op.EMBED
    layer: int = 0
    wait: int = -1  # counter to wait on (-1: none)
    target: int = 0  # ... until it reaches this
    done: int = -1  # counter to add one to when done (-1: none)
    prefetch: tuple[Region, Region] = (NO_REGION, NO_REGION)

    HEADER_LEN: ClassVar[int] = 9  # op, layer, wait, target, done, and (addr, bytes) of two regions

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        base = {f.name for f in fields(Task)}
        return tuple(f.name for f in fields(cls) if f.name not in base)

    @classmethod
    def offset(cls, name: str) -> int:
        """Where field `name` of this instruction sits in its record."""
        return cls.HEADER_LEN + cls.own_fields().index(name)

    def encode(self) -> list[int]:
        a, b = self.prefetch
        rec = [int(self.op), self.layer, self.wait, self.target, self.done, a.addr, a.nbytes, b.addr, b.nbytes]
        rec += [int(getattr(self, name)) for name in self.own_fields()]
        return rec + [0] * (RECORD_LEN - len(rec))


@dataclass(frozen=True)
class Embed(Task):
    op: Op = Op.EMBED
    col0: int = 0
    tiles: int = 0
    ssq: int = 0  # the scratch slot its sums of squares go to (the first layer's attention norm)


@dataclass(frozen=True)
class Matvec(Task):
    op: Op = Op.QKV
    row0: int = 0
    tiles: int = 0
    part: int = 0  # LMHEAD: which (max, argmax) partial this task leaves
    ssq: int = 0  # after a norm (QKV, GATEUP, LMHEAD): the slot of the sums it reads; OPROJ, DOWN: the one it writes
    k_split: int = 0  # which part of K this task streams (K split: one tile a task)
    arrive: int = -1  # K split: the tile's arrival counter
    slot: int = 0  # K split: the tile's scratch slot of partial sums


@dataclass(frozen=True)
class Attention(Task):
    op: Op = Op.ATTN
    row: int = 0  # batch row
    kv_head: int = 0
    split: int = 0
    arrive: int = 0  # the counter the splits of (layer, row, kv_head) arrive on
    arrive_row_stride: int = 0  # how far apart two consecutive rows' `arrive` counters are (a query block's: its first)


@dataclass(frozen=True)
class Argmax(Task):
    op: Op = Op.ARGMAX
    parts: int = 0  # LM-head partials to reduce
    counters: int = 0  # counters to zero for the next replay


INSTRUCTIONS = (Embed, Matvec, Attention, Argmax)
RECORD_LEN = Task.HEADER_LEN + max(len(cls.own_fields()) for cls in INSTRUCTIONS)

# record offsets, as plain module constants for the kernel
F_OP, F_LAYER, F_WAIT, F_TARGET, F_DONE, F_PF0, F_PF0_BYTES, F_PF1, F_PF1_BYTES = range(Task.HEADER_LEN)
EMBED_COL0, EMBED_TILES, EMBED_SSQ = Embed.offset("col0"), Embed.offset("tiles"), Embed.offset("ssq")
MV_ROW0, MV_TILES, MV_PART, MV_SSQ = (Matvec.offset(f) for f in ("row0", "tiles", "part", "ssq"))
MV_K_SPLIT, MV_ARRIVE, MV_SLOT = (Matvec.offset(f) for f in ("k_split", "arrive", "slot"))
SSQ_COLS = 16  # columns per partial sum of squares
ATTN_ROW, ATTN_KV_HEAD = Attention.offset("row"), Attention.offset("kv_head")
ATTN_SPLIT, ATTN_ARRIVE = Attention.offset("split"), Attention.offset("arrive")
ATTN_ARRIVE_ROW_STRIDE = Attention.offset("arrive_row_stride")
ARGMAX_PARTS, ARGMAX_COUNTERS = Argmax.offset("parts"), Argmax.offset("counters")


@dataclass(frozen=True)
class ModelDims:
    """What the kernel needs to know of the model: shapes only, no framework types."""

    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float
    qkv_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Layout:
    """Where each dependency counter (one int32 each) and each scratch slot of sums of squares lives, for one model
    and batch bucket. Counters: one per (layer, phase), Embed's and the LM head's, the attention splits' arrivals per
    (layer, row, KV head), the QKV tasks done per (layer, KV head), then the arrivals of each split-K tile per layer
    (tile_arrivals a layer). Sums of squares: one slot per norm (each layer's attention and MLP norms, the final
    norm), each holding hidden/16 partials per row."""

    num_layers: int
    batch: int
    kv_heads: int
    tile_arrivals: int = 0  # tiles per layer whose K is split (their parts arrive on a counter each)

    def phase(self, layer: int, op: Op) -> int:
        return layer * len(LAYER_OPS) + LAYER_OPS.index(op)

    @property
    def embed(self) -> int:
        return self.num_layers * len(LAYER_OPS)

    @property
    def lm_head(self) -> int:
        return self.embed + 1

    def arrive(self, layer: int, row: int, kv_head: int) -> int:
        return self.lm_head + 1 + (layer * self.batch + row) * self.kv_heads + kv_head

    def qkv_head(self, layer: int, kv_head: int) -> int:
        """The QKV tasks of one KV head's group (its query heads, its key and value rows) done in this layer."""
        return self.arrive(self.num_layers - 1, self.batch - 1, self.kv_heads - 1) + 1 + \
            layer * self.kv_heads + kv_head

    def tile_arrive(self, layer: int, tile: int) -> int:
        """The counter the K parts of a split tile arrive on (tile: numbered across the layer's split matvecs)."""
        return self.qkv_head(self.num_layers - 1, self.kv_heads - 1) + 1 + layer * self.tile_arrivals + tile

    @property
    def counters(self) -> int:
        return self.qkv_head(self.num_layers - 1, self.kv_heads - 1) + 1 + self.num_layers * self.tile_arrivals

    def attn_norm(self, layer: int) -> int:
        """The sums-of-squares slot of layer's attention norm (layer == num_layers: the final norm)."""
        return 2 * layer

    def mlp_norm(self, layer: int) -> int:
        return 2 * layer + 1

    @property
    def ssq_slots(self) -> int:
        return 2 * self.num_layers + 1


@dataclass(frozen=True)
class Tiling:
    """Rows per tile of each matvec and attention splits, for one batch bucket. A matvec phase is cut into at most
    one task per program, each a contiguous run of row tiles that the kernel streams through one pipeline."""

    rows: dict[Op, int] = field(default_factory=lambda: {Op.QKV: 16, Op.OPROJ: 16, Op.GATEUP: 16, Op.DOWN: 16,
                                                         Op.LMHEAD: 64})
    attn_splits: int = 1  # splits of the cached positions per (row, kv head), at most
    head_counters: bool = True  # attention for a KV head waits only for its own group's QKV tasks
    attn_heads: int = 1  # KV heads an attention task takes (of one row; > 1 only with one task per pair: attn_splits 1)
    k_splits: dict[Op, int] = field(default_factory=dict)  # parts of K per matvec (absent: 1); never the LM head's

    def k_split(self, op: Op) -> int:
        return self.k_splits.get(op, 1)


def attention_splits(dims: ModelDims, batch: int, num_programs: int, max_splits: int = 16) -> int:
    """Enough attention splits to give every program one (at long contexts; short ones use fewer)."""
    return max(1, min(max_splits, round(num_programs / (batch * dims.num_kv_heads))))


@dataclass
class Schedule:
    tasks: torch.Tensor  # int64 [num_tasks, RECORD_LEN], grouped by program
    starts: torch.Tensor  # int32 [num_programs + 1]: program p runs tasks[starts[p]:starts[p+1]]
    num_programs: int
    layout: Layout
    num_lm_parts: int  # LM-head tasks, each leaving one (max, argmax) partial per row
    tiling: Tiling
    batch: int

    def describe(self) -> str:
        ops = self.tasks[:, F_OP].tolist()
        counts = {o.name: ops.count(int(o)) for o in Op}
        per_prog = (self.starts[1:] - self.starts[:-1]).tolist()
        return f"batch {self.batch}, {self.num_programs} programs, {len(ops)} tasks {counts}, " \
               f"tasks per program {min(per_prog)}..{max(per_prog)}"


def split_rows(rows: int, bn: int, parts: int) -> list[tuple[int, int]]:
    """Cut ceil(rows/bn) row tiles into at most `parts` contiguous runs of near-equal length: (first row, tiles)."""
    tiles = -(-rows // bn)
    parts = min(parts, tiles)
    out, t0 = [], 0
    for p in range(parts):
        n = tiles // parts + (1 if p < tiles % parts else 0)
        out.append((t0 * bn, n))
        t0 += n
    return out


def k_split_runs(runs: list[tuple[int, int]], bn: int, splits: int) -> list[tuple[int, int, int]]:
    """(first row, tiles, part of K) of each task: the runs as they are where K is whole, else every tile of every
    run as `splits` tasks of one tile, one per part of K."""
    if splits == 1:
        return [(r0, n, 0) for r0, n in runs]
    return [(r0 + i * bn, 1, s) for r0, n in runs for i in range(n) for s in range(splits)]


def qkv_head_runs(dims: ModelDims, tile: int, parts: int) -> list[list[tuple[int, int]]] | None:
    """QKV's runs of tiles grouped by KV head: for head g, runs over its query heads' rows, its key rows and its
    value rows, each segment cut into about its share of `parts` runs. None where a tile would straddle two heads."""
    D, G, Q, KV = dims.head_dim, dims.group, dims.q_size, dims.kv_size
    if D % tile:
        return None
    total = dims.qkv_rows // tile
    groups = []
    for g in range(dims.num_kv_heads):
        segments = ((g * G * D, G * D), (Q + g * D, D), (Q + KV + g * D, D))
        groups.append([(start + r0, n) for start, rows in segments
                       for r0, n in split_rows(rows, tile, max(1, round(parts * rows / tile / total)))])
    return groups


# weight matrices of each matvec: (region names, rows of the matrix, its row length) for the prefetch hints
def _matrices(dims: ModelDims) -> dict[Op, tuple[tuple[str, ...], int, int]]:
    return {Op.QKV: (("qkv",), dims.qkv_rows, dims.hidden), Op.OPROJ: (("o",), dims.hidden, dims.q_size),
            Op.GATEUP: (("gate", "up"), dims.ffn, dims.hidden), Op.DOWN: (("down",), dims.hidden, dims.ffn),
            Op.LMHEAD: (("lm_head",), dims.vocab, dims.hidden)}


def build_schedule(dims: ModelDims, batch: int, num_programs: int, tiling: Tiling,
                   weight_regions: dict[str, tuple[int, int, int]] | None = None,
                   prefetch_bytes: int = 64 << 10) -> Schedule:
    """The task lists of one decode step for a batch bucket.

    weight_regions: name → (address, bytes per layer, bytes per element) of the packed weights "qkv", "o", "gate",
    "up", "down", "lm_head"; used only for the L2 prefetch hints (the first `prefetch_bytes` of each task's rows),
    never for correctness (None: no hints).
    """
    L, P = dims.num_layers, num_programs
    mats = _matrices(dims)
    if tiling.k_split(Op.LMHEAD) != 1:
        raise ValueError("the LM head's K is never split (its tiles are many, and its partials are (max, argmax))")

    def tile_rows(op: Op) -> int:  # QKV's tiles are two runs of tiling.rows each (rotation pairs: see Matvec)
        return 2 * tiling.rows[op] if op is Op.QKV else tiling.rows[op]

    def parts(op: Op) -> int:  # runs to cut a matvec into: one per program, or one per tile where K is split
        return P if tiling.k_split(op) == 1 else -(-mats[op][1] // tile_rows(op))

    plain = {op: split_rows(mats[op][1], tile_rows(op), parts(op)) for op in mats}
    embed_runs = split_rows(dims.hidden, EMBED_COLS, P)
    # QKV's runs per KV head, where its tiles fall within heads: attention for a head then waits for its group only
    if tiling.attn_heads > 1 and (tiling.attn_splits != 1 or dims.num_kv_heads % tiling.attn_heads):
        raise ValueError("several KV heads an attention task need one task per (row, KV head) and divide the heads")
    # (a task of several KV heads waits for the whole QKV phase)
    qkv_groups = qkv_head_runs(dims, tile_rows(Op.QKV), parts(Op.QKV)) \
        if tiling.head_counters and tiling.attn_heads == 1 else None
    if qkv_groups is not None:
        plain[Op.QKV] = [r for group in qkv_groups for r in group]
    runs = {op: k_split_runs(r, tile_rows(op), tiling.k_split(op)) for op, r in plain.items()}
    # each split matvec's first arrival counter among the layer's
    arrive_base, n_arrive = {}, 0
    for op in (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN):
        if tiling.k_split(op) > 1:
            arrive_base[op] = n_arrive
            n_arrive += -(-mats[op][1] // tile_rows(op))
    cnt = Layout(L, batch, dims.num_kv_heads, n_arrive)

    def regions(op: Op, layer: int, row0: int, rows: int, k_split: int) -> tuple[Region, Region]:
        names, total, row_len = mats[op]
        if weight_regions is None:
            return NO_REGION, NO_REGION
        out = []
        for name in names:
            addr, per_layer, elem = weight_regions[name]
            n = max(0, min(rows, total - row0))
            k0 = k_split * row_len // tiling.k_split(op)  # a split task's first column
            nbytes = min(n * row_len * elem, prefetch_bytes) // 16 * 16
            out.append(Region(addr + layer * per_layer + (row0 * row_len + k0) * elem, nbytes))
        return (out[0], out[1] if len(out) > 1 else NO_REGION)

    def matvec(op: Op, layer: int, wait: int, target: int, done: int, ssq: int, i: int, r0: int, n: int,
               k_split: int) -> Matvec:
        bn = tile_rows(op)
        split = tiling.k_split(op) > 1
        return Matvec(op=op, layer=layer, wait=wait, target=target, done=done, row0=r0, tiles=n, part=i, ssq=ssq,
                      prefetch=regions(op, layer, r0, n * bn, k_split), k_split=k_split, slot=r0 // bn,
                      arrive=cnt.tile_arrive(layer, arrive_base[op] + r0 // bn) if split else -1)

    def matvecs(op: Op, layer: int, wait: int, target: int, done: int, ssq: int) -> list[Task]:
        return [matvec(op, layer, wait, target, done, ssq, i, r0, n, ks) for i, (r0, n, ks) in enumerate(runs[op])]

    def qkv_tasks(layer: int, wait: int, target: int, ssq: int) -> list[Task]:
        if qkv_groups is None:
            return matvecs(Op.QKV, layer, wait, target, cnt.phase(layer, Op.QKV), ssq)
        split = tiling.k_split(Op.QKV)
        return [matvec(Op.QKV, layer, wait, target, cnt.qkv_head(layer, g), ssq, 0, r0, n, ks)
                for g, group in enumerate(qkv_groups) for r0, n, ks in k_split_runs(group, tile_rows(Op.QKV), split)]

    def attention_wait(layer: int, g: int) -> tuple[int, int]:
        if qkv_groups is None:
            return cnt.phase(layer, Op.QKV), len(runs[Op.QKV])
        return cnt.qkv_head(layer, g), len(k_split_runs(qkv_groups[g], tile_rows(Op.QKV), tiling.k_split(Op.QKV)))

    phases: list[list[Task]] = [[Embed(col0=c0, tiles=n, done=cnt.embed, ssq=cnt.attn_norm(0))
                                 for c0, n in embed_runs]]
    for layer in range(L):
        def c(op: Op) -> int:
            return cnt.phase(layer, op)  # noqa: B023

        wait, target = (cnt.embed, len(embed_runs)) if layer == 0 else \
            (cnt.phase(layer - 1, Op.DOWN), len(runs[Op.DOWN]))
        phases.append(qkv_tasks(layer, wait, target, cnt.attn_norm(layer)))
        phases.append([
            Attention(layer=layer, wait=attention_wait(layer, g)[0], target=attention_wait(layer, g)[1],
                      done=c(Op.ATTN), row=b, kv_head=g, split=s, arrive=cnt.arrive(layer, b, g),
                      arrive_row_stride=cnt.arrive(layer, 1, g) - cnt.arrive(layer, 0, g))
            for g in range(0, dims.num_kv_heads, tiling.attn_heads) for b in range(batch)
            for s in range(tiling.attn_splits)
        ])
        phases.append(matvecs(Op.OPROJ, layer, c(Op.ATTN), batch * dims.num_kv_heads, c(Op.OPROJ),
                              cnt.mlp_norm(layer)))
        phases.append(matvecs(Op.GATEUP, layer, c(Op.OPROJ), len(runs[Op.OPROJ]), c(Op.GATEUP), cnt.mlp_norm(layer)))
        phases.append(matvecs(Op.DOWN, layer, c(Op.GATEUP), len(runs[Op.GATEUP]), c(Op.DOWN),
                              cnt.attn_norm(layer + 1)))
    phases.append(matvecs(Op.LMHEAD, 0, cnt.phase(L - 1, Op.DOWN), len(runs[Op.DOWN]), cnt.lm_head,
                          cnt.attn_norm(L)))
    phases.append([Argmax(wait=cnt.lm_head, target=len(runs[Op.LMHEAD]), parts=len(runs[Op.LMHEAD]),
                          counters=cnt.counters)])

    # Deal each phase's tasks round-robin, starting where the last phase stopped, so the counts even out.
    per_prog: list[list[Task]] = [[] for _ in range(P)]
    nxt = 0
    for ph in phases:
        for tk in ph:
            per_prog[nxt].append(tk)
            nxt = (nxt + 1) % P
    starts = [0]
    for prog in per_prog:
        starts.append(starts[-1] + len(prog))
    return Schedule(
        tasks=torch.tensor([tk.encode() for prog in per_prog for tk in prog], dtype=torch.int64),
        starts=torch.tensor(starts, dtype=torch.int32),
        num_programs=P,
        layout=cnt,
        num_lm_parts=len(runs[Op.LMHEAD]),
        tiling=tiling,
        batch=batch,
    )
