"""The megakernel's arguments: the model's tensors in the layout the kernel reads (PackedWeights), and the
NamedTuples the kernel takes and its helpers pass around.

Triton passes a NamedTuple's fields by name (`MODEL.head_dim`, `ws.scale`); an operand a model or a weight format
lacks is None (no QKV bias, no FP8 scales, no descriptor where a matvec loads through pointers), and the code that
would read it is not compiled. A matvec's tile (MatvecTile) is in tiles.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

INT8_BLOCK = 32  # columns per scale of int8 weights (GGUF's Q8_0)


@dataclass
class PackedWeights:
    """The model's tensors in the layout the kernel reads (layer-stacked, out × in). With FP8, the matrices are
    float8_e4m3fn and `scales` holds each one's float32 scale per output row ([L, rows], [V] for the LM head). With
    int8, `scales` holds a float32 scale per output row as FP8's, or a float16 scale per block of INT8_BLOCK
    columns, block-major ([K / 32, L, rows], [K / 32, V] for the LM head): a layer's first scale is at layer × rows as
    with FP8's, and a k slice's scales of a tile's consecutive rows are contiguous. The embedding table stays in the
    activations' dtype (it is looked up, not streamed)."""

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
    scales: dict[str, torch.Tensor] | None = None  # "qkv", "o", "gate", "up", "down", "lm_head"

    MATRICES = ("qkv", "o", "gate", "up", "down", "lm_head")

    def matrix(self, name: str) -> torch.Tensor:
        return {"qkv": self.wqkv, "o": self.wo, "gate": self.w_gate, "up": self.w_up, "down": self.w_down,
                "lm_head": self.lm_head}[name]

    @property
    def fp8(self) -> bool:
        return self.wqkv.dtype == torch.float8_e4m3fn

    @property
    def int8(self) -> bool:
        return self.wqkv.dtype == torch.int8

    @property
    def int8_blocks(self) -> bool:
        """int8 with a scale per block of INT8_BLOCK columns (not per row)."""
        return self.int8 and self.scales is not None and self.scales["qkv"].dtype == torch.float16

    @property
    def int8_rows(self) -> bool:
        """int8 with a scale per output row (`int8-row`), which streams and runs W8A8 as FP8 does."""
        return self.int8 and not self.int8_blocks

    def nbytes(self) -> int:
        """What one decode step streams: every matrix (and scale) once, the norms."""
        mats = sum(self.matrix(n).numel() * self.matrix(n).element_size() for n in self.MATRICES)
        scales = sum(s.numel() * s.element_size() for s in (self.scales or {}).values())
        norms = sum(t.numel() * t.element_size() for t in (self.attn_norm, self.mlp_norm, self.final_norm))
        return mats + scales + norms

    def regions(self) -> dict[str, tuple[int, int, int]]:
        """Address, bytes per layer and bytes per element of each matrix, for the schedule's prefetch hints."""
        def r(t: torch.Tensor, layered: bool = True) -> tuple[int, int, int]:
            return t.data_ptr(), t[0].numel() * t.element_size() if layered else 0, t.element_size()

        return {n: r(self.matrix(n), n != "lm_head") for n in self.MATRICES}


# ---------------------------------------------------------------------------------------------------------------
# the kernel's named arguments


class ModelShape(NamedTuple):
    """The model's shapes (constexpr)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int


class AttnShape(NamedTuple):
    """Attention's constexprs: the query heads of a KV head padded to a power of two, positions per inner step,
    splits per (row, KV head) at most, chunks a split reads at least, KV heads a task (of one row), the K/V
    pipeline's stages; the query heads of a query block's tile (0: no blocks, every row attends on its own), the
    splits a block's head may have at most (the scratch's parts per (row, KV head)) and those its merge folds at a
    time; whether a launch with blocks runs blocks only (a row alone is padding: no row path compiled in)."""

    group_pad: int
    chunk: int
    max_splits: int
    split_min_chunks: int
    heads: int = 1
    stages: int = 4
    block_queries: int = 0
    block_splits: int = 16
    block_merge: int = 2
    block_only: bool = False


class Sched(NamedTuple):
    tasks: torch.Tensor  # int64 [tasks, RECORD_LEN]
    starts: torch.Tensor  # int32 [programs + 1]
    counters: torch.Tensor  # int32 dependency counters (Layout)
    err: torch.Tensor  # int32 [1]: a wait timed out
    prof: torch.Tensor | None  # int64 [tasks, 4] (start, ready, end, SM) where profiling
    k_sums: torch.Tensor  # float32 partial sums of split-K tiles (KSplit.sums)
    lm_starts: torch.Tensor  # int32 [programs]: each program's first LM-head (or Argmax) task, where its tail begins


class StepInputs(NamedTuple):
    tokens: torch.Tensor  # int32 [rows]
    slots: torch.Tensor  # int32 [rows]
    positions: torch.Tensor  # int32 [rows]
    draw: torch.Tensor  # int32 [4, rows]: temperature's float32 bits (0: greedy), seed's low and high words, and
    # whether the row's logits go through its grammar mask (1) or not (0)
    masks: torch.Tensor  # int32 [lm rows, ceil(vocab / 32)]: the tokens a grammar allows, a bit each (masked rows)
    blocks: torch.Tensor  # int32 [5, rows]: each row's query block (kernels/query_blocks.py)
    blocks_stride: int


class Weights(NamedTuple):
    embed: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor


class Scales(NamedTuple):
    """8-bit weights' scales: FP8's float32 per output row, int8's float16 per block (PackedWeights)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    lm_head: torch.Tensor


class Cache(NamedTuple):
    k: torch.Tensor  # [layers, slots, kv heads, context, head_dim]
    v: torch.Tensor
    slots: int
    context: int


class Activations(NamedTuple):
    x: torch.Tensor  # [rows, H] the residual stream
    xn: torch.Tensor  # [rows, H] x * the next norm's weight
    q: torch.Tensor  # [rows, q] RoPE'd queries
    attn: torch.Tensor  # [rows, q]
    ffn: torch.Tensor  # [rows, F]
    logits: torch.Tensor  # float32 [lm rows, V]
    xn_final: torch.Tensor | None  # [rows, H] the final norm's operand, the LM head's input, where not xn


class AttnScratch(NamedTuple):
    """Partials of the attention splits: running max, sum and output per (row, KV head, split, query head)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741
    acc: torch.Tensor


class LmPartials(NamedTuple):
    """Each LM-head task's (max, argmax) per row: greedy, then drawn."""

    gmax: torch.Tensor
    gidx: torch.Tensor
    smax: torch.Tensor
    sidx: torch.Tensor


class StepOutputs(NamedTuple):
    argmax: torch.Tensor  # int64 [lm rows]
    sampled: torch.Tensor  # int64 [lm rows]


# ---------------------------------------------------------------------------------------------------------------
# what the kernel's helpers pass each other


class KSplit(NamedTuple):
    """What a split-K matvec task needs beyond its rows: its part of K, its tile's arrival counter and scratch slot,
    the counters and the scratch of float32 partial sums ([slots, parts, runs, BPAD, rows per run])."""

    part: Any
    arrive: Any
    slot: Any
    counters: Any
    sums: Any


class MatvecWeights(NamedTuple):
    """One matvec's weights, built in the kernel for this layer: the matrix (and the second run's: QKV's same
    matrix, gate/up's up; None where one run streams), FP8 scales (None: bf16), QKV's bias (None: none), the
    tensor descriptors where TMA loads (None: pointers) and this layer's first row in them."""

    w: Any
    w2: Any
    scale: Any
    scale2: Any
    bias: Any
    desc: Any
    desc2: Any
    drow: Any


class QkvOut(NamedTuple):
    """Where QKV's epilogue puts q, k and v, and what RoPE reads."""

    q: Any
    cache: Any
    cos: Any
    sin: Any
    slots: Any
    positions: Any


class LmOut(NamedTuple):
    """Where the LM head's epilogue puts the logits, and the grammar masks it applies first (per row, where flagged)."""

    logits: Any
    masks: Any
    masked: Any


class ResidualOut(NamedTuple):
    """Where OPROJ's and DOWN's epilogue adds to the residual stream, and the next norm's weight; DOWN's of the last
    layer writes the final norm's operand to xn_final (None: OPROJ)."""

    x: Any
    xn: Any
    norm_weight: Any
    xn_final: Any = None
