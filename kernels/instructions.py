"""The megakernel's instruction set and its schedule, built in plain Python.

A decode step is a list of tasks. Each task is one instruction on one tile of work; every program of the
persistent kernel (one per SM) walks its own slice of the list in order. A task waits until a global counter
reaches a target (its inputs are ready), runs, and adds one to its own counter. The list is ordered by phase, so
the waits only ever look backwards; with all programs resident, nothing deadlocks. With a single program (the
CPU interpreter), every wait is already met when it is reached.

The instructions (one layer = QKV → ATTN → OPROJ → GATEUP → DOWN):

  EMBED   columns [c0, c1) of x[b] = embed[token[b]] for every row of the bucket
  QKV     rows [n0, n1) of qkv = RMSNorm(x) @ [Wq; Wk; Wv]^T (+ bias)
  ATTN    one split of flash-decoding for (row b, KV head g): RoPE on q and the new k, partial softmax over the
          cached positions of the split (split 0 also takes the new token and appends k, v to the cache); the last
          split to arrive merges the partials into attn[b, heads of g]. How many of the splits take part is decided
          at run time from the position (short contexts: one split, which writes attn directly)
  OPROJ   rows [n0, n1) of x += attn @ Wo^T
  GATEUP  rows [n0, n1) of ffn = silu(RMSNorm(x) @ Wgate^T) * (RMSNorm(x) @ Wup^T)
  DOWN    rows [n0, n1) of x += ffn @ Wdown^T
  LMHEAD  rows [n0, n1) of logits = RMSNorm(x) @ lm_head^T, and the task's (max, argmax) per row
  ARGMAX  reduce the tasks' (max, argmax) into the greedy token; reset the counters and sums of squares

A matvec phase has at most one task per program: a run of 16-row tiles that the kernel streams through one
software pipeline. The tasks that write x (EMBED, OPROJ, DOWN) also write x * (the next norm's weight) and add
their rows' sums of squares, so a norm costs its consumers nothing but a scale by rstd in their epilogue.

Each task also names up to two weight regions (address, bytes) that the kernel prefetches into L2 a task ahead:
weights never depend on activations, so their loads need not wait for anything (measured: a few % on SmolLM2,
nothing on Llama-1B; see bench/NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# opcodes
EMBED, QKV, ATTN, OPROJ, GATEUP, DOWN, LMHEAD, ARGMAX = range(8)
OP_NAMES = ("EMBED", "QKV", "ATTN", "OPROJ", "GATEUP", "DOWN", "LMHEAD", "ARGMAX")

# fields of one task record (int64)
F_OP, F_LAYER, F_A0, F_A1, F_A2, F_WAIT, F_TARGET, F_DONE, F_PF0, F_PF0_BYTES, F_PF1, F_PF1_BYTES = range(12)
NUM_FIELDS = 12

# counters: one per (layer, phase), then EMBED and LMHEAD, then the ATTN arrival counters per (layer, row, kv head)
PHASES_PER_LAYER = 5  # QKV, ATTN, OPROJ, GATEUP, DOWN
EMBED_COLS = 64  # columns per EMBED tile


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
class Tiling:
    """Rows per matvec tile and attention splits. A matvec phase is cut into at most one task per program, each
    a contiguous run of row tiles that the kernel streams through one software pipeline."""

    bn_mv: int = 16  # rows per tile of QKV, O, gate/up, down (16: the smallest tensor-core dot)
    bn_lm: int = 64  # rows per tile of the LM head (one partial argmax per tile)
    attn_splits: int = 1  # splits of the cached positions per (row, kv head)


def default_tiling(dims: ModelDims, batch: int, num_programs: int, max_splits: int = 16, bn_mv: int = 16,
                   bn_lm: int = 64) -> Tiling:
    """Enough attention splits to give every program one (at long contexts; short ones use fewer)."""
    splits = max(1, min(max_splits, round(num_programs / (batch * dims.num_kv_heads))))
    return Tiling(bn_mv=bn_mv, bn_lm=bn_lm, attn_splits=splits)


@dataclass
class Schedule:
    tasks: torch.Tensor  # int64 [num_tasks, NUM_FIELDS], grouped by program
    starts: torch.Tensor  # int32 [num_programs + 1]: program p runs tasks[starts[p]:starts[p+1]]
    num_programs: int
    num_counters: int
    num_lm_parts: int  # LM-head tasks, each leaving one (max, argmax) partial per row
    tiling: Tiling
    batch: int

    def describe(self) -> str:
        ops = self.tasks[:, F_OP].tolist()
        counts = {OP_NAMES[o]: ops.count(o) for o in range(len(OP_NAMES))}
        per_prog = (self.starts[1:] - self.starts[:-1]).tolist()
        return f"batch {self.batch}, {self.num_programs} programs, {len(ops)} tasks {counts}, " \
               f"tasks per program {min(per_prog)}..{max(per_prog)}"


def counter_index(dims: ModelDims, layer: int, phase: int) -> int:
    return layer * PHASES_PER_LAYER + phase


def num_counters(dims: ModelDims, batch: int) -> int:
    return dims.num_layers * PHASES_PER_LAYER + 2 + dims.num_layers * batch * dims.num_kv_heads


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


def build_schedule(dims: ModelDims, batch: int, num_programs: int,
                   weight_regions: dict[str, tuple[int, int]] | None = None, elem_bytes: int = 2,
                   tiling: Tiling | None = None, prefetch_bytes: int = 64 << 10) -> Schedule:
    """The task lists of one decode step for a batch bucket.

    weight_regions: name → (address, bytes per layer) of the packed weights "qkv", "o", "gate", "up", "down",
    and (address, 0) of "lm_head"; used only for the L2 prefetch hints (the first `prefetch_bytes` of each task's
    rows), never for correctness (None: no hints).
    """
    t = tiling or default_tiling(dims, batch, num_programs)
    L, H, V, P = dims.num_layers, dims.hidden, dims.vocab, num_programs
    c_embed = L * PHASES_PER_LAYER
    c_lm = c_embed + 1
    c_arrive0 = c_embed + 2

    def region(name: str, layer: int, row0: int, rows: int, row_len: int, total_rows: int) -> tuple[int, int]:
        if weight_regions is None:
            return 0, 0
        addr, per_layer = weight_regions[name]
        rows = max(0, min(rows, total_rows - row0))
        nbytes = min(rows * row_len * elem_bytes, prefetch_bytes) // 16 * 16
        return addr + layer * per_layer + row0 * row_len * elem_bytes, nbytes

    def task(op: int, layer: int, a0: int = 0, a1: int = 0, a2: int = 0, wait: int = -1, target: int = 0,
             done: int = -1, pf0: tuple[int, int] = (0, 0), pf1: tuple[int, int] = (0, 0)) -> list[int]:
        return [op, layer, a0, a1, a2, wait, target, done, pf0[0], pf0[1], pf1[0], pf1[1]]

    bn = t.bn_mv
    qkv_runs, o_runs = split_rows(dims.qkv_rows, bn, P), split_rows(H, bn, P)
    gu_runs, down_runs = split_rows(dims.ffn, bn, P), split_rows(H, bn, P)
    lm_runs = split_rows(V, t.bn_lm, P)
    embed_runs = split_rows(H, EMBED_COLS, P)
    phases: list[list[list[int]]] = [[task(EMBED, 0, c0, n, done=c_embed) for c0, n in embed_runs]]
    for layer in range(L):
        c = [counter_index(dims, layer, p) for p in range(PHASES_PER_LAYER)]
        wait, target = (c_embed, len(embed_runs)) if layer == 0 else \
            (counter_index(dims, layer - 1, 4), len(down_runs))
        phases.append([
            task(QKV, layer, r0, n, wait=wait, target=target, done=c[0],
                 pf0=region("qkv", layer, r0, n * bn, H, dims.qkv_rows))
            for r0, n in qkv_runs
        ])
        phases.append([
            task(ATTN, layer, b, g, s, wait=c[0], target=len(qkv_runs), done=c[1])
            for b in range(batch) for g in range(dims.num_kv_heads) for s in range(t.attn_splits)
        ])
        phases.append([
            task(OPROJ, layer, r0, n, wait=c[1], target=batch * dims.num_kv_heads, done=c[2],
                 pf0=region("o", layer, r0, n * bn, dims.q_size, H))
            for r0, n in o_runs
        ])
        phases.append([
            task(GATEUP, layer, r0, n, wait=c[2], target=len(o_runs), done=c[3],
                 pf0=region("gate", layer, r0, n * bn, H, dims.ffn), pf1=region("up", layer, r0, n * bn, H, dims.ffn))
            for r0, n in gu_runs
        ])
        phases.append([
            task(DOWN, layer, r0, n, wait=c[3], target=len(gu_runs), done=c[4],
                 pf0=region("down", layer, r0, n * bn, dims.ffn, H))
            for r0, n in down_runs
        ])
    phases.append([
        task(LMHEAD, 0, r0, n, i, wait=counter_index(dims, L - 1, 4), target=len(down_runs), done=c_lm,
             pf0=region("lm_head", 0, r0, n * t.bn_lm, H, V))
        for i, (r0, n) in enumerate(lm_runs)
    ])
    phases.append([task(ARGMAX, 0, a0=c_arrive0, wait=c_lm, target=len(lm_runs))])

    # Deal each phase's tasks round-robin, starting where the last phase stopped, so the counts even out.
    per_prog: list[list[list[int]]] = [[] for _ in range(P)]
    nxt = 0
    for ph in phases:
        for tk in ph:
            per_prog[nxt].append(tk)
            nxt = (nxt + 1) % P
    rows = [tk for prog in per_prog for tk in prog]
    starts = [0]
    for prog in per_prog:
        starts.append(starts[-1] + len(prog))
    return Schedule(
        tasks=torch.tensor(rows, dtype=torch.int64),
        starts=torch.tensor(starts, dtype=torch.int32),
        num_programs=P,
        num_counters=num_counters(dims, batch),
        num_lm_parts=len(lm_runs),
        tiling=t,
        batch=batch,
    )
