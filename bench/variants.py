"""The megakernel's configurations the decode bench can time beside its default (`python -m bench decode --variants
NAME ...`), and that `python -m bench sm90-compile` compiles: each a function of the weights' format ("bf16", "fp8",
"int8": their default tiles differ). bench/NOTES.md says what each measured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kernels.instructions import Op
from kernels.megakernel import KernelConfig
from kernels.tiles import (
    DOWN_E4M3_16_SPLIT,
    DOWN_WIDE,
    DOWN_WIDE_SPLIT,
    MATVECS,
    W8A8_DOWN,
    MatvecTile,
    default_tiles,
    int8_slices,
)


def _tiles(weights: str, ops: tuple[Op, ...] = MATVECS, min_rows: int = 1, **change: Any
           ) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles of each launch's rows, with `change` applied to `ops` in launches of at least min_rows
    (with int8 weights, then cut into one k slice per block: int8_slices)."""
    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = default_tiles(weights != "bf16", rows, weights == "int8", weights == "fp8", weights == "int8-row")
        if rows < min_rows:
            return tiles
        changed = {op: t._replace(**change) if op in ops else t for op, t in tiles.items()}
        return {op: int8_slices(t) for op, t in changed.items()} if weights == "int8" else changed

    return table


WIDE = 32  # the buckets whose default tiles differ (default_tiles)
_CALL_NONE = {"call_min_rows": 1 << 20, "call_min_rows_8bit": 1 << 20}  # KernelConfig: every op inlined
_CALL_ALL = {"call_min_rows": 1, "call_min_rows_8bit": 1}  # the matvecs called at every row count
K_CHUNK = {"bf16": 256, "fp8": 512, "int8-row": 512, "int8": 256}  # the narrow buckets' default k chunk


def _narrow(weights: str, ops: tuple[Op, ...], below: int = WIDE, at_least: int = 1, **change: Any
            ) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles, with `change` applied to `ops` in launches of at least `at_least` and fewer than `below`
    rows (16: under FP8's W8A8 gate/up)."""
    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(rows)
        if not at_least <= rows < below:
            return tiles
        return {op: t._replace(**change) if op in ops else t for op, t in tiles.items()}

    return table


def _flat(weights: str, qkv: tuple[int, int], o: tuple[int, int], gateup: tuple[int, int], down: tuple[int, int],
          k_chunk: int = 128, k_slices: int = 1, stages: int = 4, min_rows: int = 1, swap: bool = False
          ) -> Callable[[int], dict[Op, MatvecTile]]:
    """Wide weight tiles with K split (issue 29): (rows per tile, parts of K) for each matvec; QKV's rows are per run
    (a tile is two runs). The LM head keeps its default."""
    shape = {Op.QKV: qkv, Op.OPROJ: o, Op.GATEUP: gateup, Op.DOWN: down}

    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = default_tiles(weights != "bf16", rows, weights == "int8", weights == "fp8", weights == "int8-row")
        if rows < min_rows:
            return tiles
        k = k_chunk * (2 if weights == "fp8" and k_chunk < 256 else 1)
        out = tiles | {op: MatvecTile(rows=r, k_chunk=k, k_slices=k_slices, stages=stages, k_splits=n, swap=swap)
                       for op, (r, n) in shape.items()}
        return {op: int8_slices(t) for op, t in out.items()} if weights == "int8" else out

    return table
def _w8a8(weights: str, ops: tuple[Op, ...] = (Op.GATEUP, Op.LMHEAD), min_rows: int = 16, stages: int = 3,
          gateup_rows: int = 64, k_chunk: int = 256, lm_stages: int | None = None, lm_rows: int = 128
          ) -> Callable[[int], dict[Op, MatvecTile]]:
    """FP8 W8A8 (issue 35): `ops` in swapped tiles whose activations are quantized to e4m3 per row and k chunk, so the
    dot runs e4m3 x e4m3 on wgmma, in launches of at least min_rows rows (the others, and other formats, keep the
    default tiles). wgmma wants 64-row weight tiles: gate/up (N = 8,192, 128 tiles) and the LM head (128-row tiles
    through TMA) have rows to spare; QKV (runs of half a head), O and down (N = 2,048: 32 tiles for 132 programs) keep
    their tiles unless named."""
    shape = {Op.QKV: MatvecTile(rows=32), Op.OPROJ: MatvecTile(rows=64), Op.DOWN: MatvecTile(rows=64),
             Op.GATEUP: MatvecTile(rows=gateup_rows), Op.LMHEAD: MatvecTile(rows=lm_rows, tma=True)}

    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = default_tiles(weights != "bf16", rows, weights == "int8", weights == "fp8", weights == "int8-row")
        if weights != "fp8" or rows < min_rows:
            return tiles
        return tiles | {op: shape[op]._replace(k_chunk=k_chunk, k_slices=1, swap=True, w8a8=True,
                                               stages=lm_stages if op is Op.LMHEAD and lm_stages else stages)
                        for op in ops}

    return table


def _lm_boxes_64(weights: str) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles, with the 8-bit LM head under 16 sampled rows in the 64-row TMA boxes it had before the
    128-row ones: 5 stages at 1-2 rows, 3 at 4-8."""
    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(rows)
        if weights != "bf16" and rows < 16:
            tiles[Op.LMHEAD] = tiles[Op.LMHEAD]._replace(rows=64, stages=5 if rows <= 2 else 3)
        return tiles

    return table


def _lm_weight_only(weights: str) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles, with FP8's W8A8 LM head (16+ sampled rows) weight-only, as before it ran W8A8."""
    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(rows)
        if tiles[Op.LMHEAD].w8a8:
            tiles[Op.LMHEAD] = MatvecTile(rows=128, k_chunk=128, k_slices=1, tma=True, stages=3)
        return tiles

    return table


def _k_split(weights: str, ops: tuple[Op, ...], rows: int, parts: int, wide: bool = False
             ) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles, with `ops` in tiles of `rows` weight rows whose K is split over `parts` tasks (the last to
    arrive adds the parts up and runs the epilogue: instructions.py), in the narrow buckets (under WIDE rows) or, with
    `wide`, the wide ones. A matvec of N = 2,048 (O, down) in 16-row tiles is 128 tasks, each rereading the step's
    activations over all of K: at 16 rows their bytes are twice FP8's weight bytes (down: 32 MB of L2 reads a layer
    against 16 MB of weights). In 64-row tiles over 4 parts of K it is still 128 tasks of the same weight bytes, which
    read a quarter of the activations."""
    def table(b: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(b)
        if (b >= WIDE) != wide:
            return tiles
        # as many weight bytes a pipeline stage as the default's two runs of 16 rows (fewer registers a thread)
        return tiles | {op: tiles[op]._replace(rows=rows, k_chunk=tiles[op].k_chunk * 32 // rows, k_splits=parts,
                                               k_halves=False) for op in ops}

    return table


def _down_weight_only(weights: str) -> Callable[[int], dict[Op, MatvecTile]]:
    """FP8 from 32 rows: down weight-only in the tiles it had before W8A8_DOWN became its default there (those of
    8-bit weights without W8A8: the 64-row bucket's until s82, the 32-row one's until s95); other formats and buckets
    keep the default."""
    def table(b: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(b)
        if weights != "fp8" or b < WIDE:
            return tiles
        return tiles | {Op.DOWN: default_tiles(True, b)[Op.DOWN]}

    return table


def _down_unsplit(weights: str) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles with down unsplit where s90 split it: e4m3 at 16 rows in 16-row tiles over K's two halves,
    bf16 from 32 rows in 16-row swapped tiles (DOWN_WIDE, as fit_to_programs leaves it where K is short)."""
    unsplit = {DOWN_E4M3_16_SPLIT: MatvecTile(k_chunk=512, k_halves=True, stages=3),
               DOWN_WIDE_SPLIT: DOWN_WIDE}

    def table(b: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(b)
        return tiles | {Op.DOWN: unsplit.get(tiles[Op.DOWN], tiles[Op.DOWN])}

    return table


def _wide_w8a8(weights: str, ops: tuple[Op, ...]) -> Callable[[int], dict[Op, MatvecTile]]:
    """FP8 from 32 rows: `ops` W8A8 in W8A8_DOWN's tiles (gate/up's 64-row swapped tiles, K over 4 tasks); other
    formats and buckets keep the default."""
    def table(b: int) -> dict[Op, MatvecTile]:
        tiles = _tiles(weights)(b)
        if weights != "fp8" or b < WIDE:
            return tiles
        return tiles | dict.fromkeys(ops, W8A8_DOWN)

    return table


BK2X = {"bf16": 512, "fp8": 1024, "int8-row": 1024, "int8": 512}  # twice the default k chunk of the 16-row buckets

# Kernel variants the bench can time beside the default (--variants NAME ...): each a function of the weights' format
# (their default tiles differ). bench/NOTES.md says what each measured. The "w-" variants change
# only the wide buckets' tiles (32 and 64 rows).
_ATT_CH128 = {"wide_chunk_rows": 1, "wide_split_min_chunks": 2}  # one-row attention in 128-position chunks


def _no_wait(*ops: Op) -> Callable[[str], KernelConfig]:
    """Timing only: `ops`' tasks start without waiting for their inputs (KernelConfig.skip_waits)."""
    return lambda w: KernelConfig(skip_waits=ops)


VARIANTS: dict[str, Callable[[str], KernelConfig]] = {
    "default": lambda w: KernelConfig(),
    # default_tiles as they are, not fitted to the model's matrices and the programs (tiles.fit_to_programs): the
    # default before s89
    "unfitted": lambda w: KernelConfig(tiles=_tiles(w)),
    # e4m3's 16-row down and bf16's wide down unsplit, in the tiles they had before s90 (fitted, as the default)
    "down-unsplit": lambda w: KernelConfig(tiles=_down_unsplit(w), fit_tiles=True),
    # the 16-row bucket's 8-bit gate/up weight-only in 16-row pointer tiles (SmolLM2's 1,536 rows: 96 tiles, where
    # the W8A8 ones of 64 rows are 24)
    "gu16-r16": lambda w: KernelConfig(tiles=_narrow(w, (Op.GATEUP,) if w in ("fp8", "int8-row") else (), 17,
                                                     at_least=16, rows=16, k_chunk=512, k_slices=4, stages=3,
                                                     tma=False, swap=False, w8a8=False)),
    # weights through the tensor-memory accelerator in every matvec (boxes of at most 256 columns)
    "tma": lambda w: KernelConfig(tiles=_tiles(w, tma=True, k_chunk=256, stages=6 if w != "bf16" else 4)),
    "lm-pointers": lambda w: KernelConfig(tiles=_tiles(w, (Op.LMHEAD,), tma=False)),
    # int8 weights converted by Triton's integer ops (sign-extended pairs), as before the byte permutes
    "int8-add16": lambda w: KernelConfig(tiles=_tiles(w, int8_prmt=False)),
    "one-stream": lambda w: KernelConfig(tiles=_tiles(w, (Op.OPROJ, Op.DOWN), k_halves=False)),
    # weights prefetched into L2 a task ahead instead of before each task's own wait
    "pf-ahead": lambda w: KernelConfig(prefetch_own=False, prefetch_ahead=1),
    # the next task's record loaded as this one releases (KernelConfig.record_ahead)
    "rec-ahead": lambda w: KernelConfig(record_ahead=True),
    "no-kv-prefetch": lambda w: KernelConfig(prefetch_kv=False),
    "pft2": lambda w: KernelConfig(tiles=_tiles(w, (Op.GATEUP,), prefetch_tiles=2)),
    "st6": lambda w: KernelConfig(tiles=_tiles(w, stages=6)),
    "qkv8": lambda w: KernelConfig(tiles=_tiles(w, (Op.QKV,), rows=8)),
    "bk2x": lambda w: KernelConfig(tiles=_tiles(w, (Op.QKV, Op.OPROJ, Op.DOWN), k_chunk=BK2X[w])),
    "invariant": lambda w: KernelConfig(batch_invariant=True),
    # attention splits of one 64-position chunk at least (default: 4): short contexts spread over several programs
    "split1": lambda w: KernelConfig(split_min_chunks=1),
    "split2": lambda w: KernelConfig(split_min_chunks=2),
    "split1-ch32": lambda w: KernelConfig(split_min_chunks=1, chunk=32),
    # buckets of 8 rows or more: 64 positions an attention step (as one row), splits of 256 at least (default 128, 512)
    "wide-ch64": lambda w: KernelConfig(wide_chunk=64),
    # ... 256 positions a step, two chunks copied ahead (shared memory), splits of 512 (1024) at least
    "wide-ch256": lambda w: KernelConfig(wide_chunk=256, wide_split_min_chunks=2, attn_stages=3),
    "wide-ch256-s4": lambda w: KernelConfig(wide_chunk=256, attn_stages=3),
    # ... 128 positions a step, splits of 1024 at least (fewer splits: fewer partials to merge)
    "wide-s8": lambda w: KernelConfig(wide_split_min_chunks=8),
    # every bucket 128 positions a step
    "ch128-all": lambda w: KernelConfig(chunk=128),
    # five chunks of K/V copied ahead instead of two (wide launches: 160 KB of shared memory)
    "attn-st6": lambda w: KernelConfig(attn_stages=6),
    # ... three instead of two: the default before s46 (two: never slower in s45's calls, 8 rows at 2048 -1.3/-1.7%)
    "attn-st4": lambda w: KernelConfig(attn_stages=4),
    # splits (partials and a merge) also where each (row, KV head) has one task: the default before s44 (default: one
    # split there, one pipeline fill, no merge)
    "multi-split": lambda w: KernelConfig(single_split=False),
    # one (up to 2) KV heads of a row an attention task (default: up to 4, where the bucket has a task per pair)
    "attn-h1": lambda w: KernelConfig(attn_heads=1),
    "attn-h2": lambda w: KernelConfig(attn_heads=2),
    # a prompt chunk's rows attend in query blocks: 16 query heads a tile (4 rows of Llama), or 32 (8 rows)
    "qblocks": lambda w: KernelConfig(query_blocks=True),
    "qblocks32": lambda w: KernelConfig(query_blocks=True, block_queries=32),
    # ... a block's merge folding 4 or 1 splits at a time (default 2)
    "qblocks-m4": lambda w: KernelConfig(query_blocks=True, block_merge=4),
    "qblocks-m1": lambda w: KernelConfig(query_blocks=True, block_merge=1),
    # the blocks' launch with the rows' own path compiled in too (as before s62), taken for every layout
    "qblocks-mixed": lambda w: KernelConfig(query_blocks=True, block_min_positions=0),
    # attention waits for the whole QKV phase (one counter a phase), as before the per-KV-head counters
    "phase-counters": lambda w: KernelConfig(head_counters=False),
    # wide buckets: the 16-row buckets' tiles (16-row tiles, 4 k slices) over 128-column k chunks
    "w-narrow": lambda w: KernelConfig(tiles=_tiles(w, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, rows=16,
                                                      k_slices=4)),
    # wide buckets: gate/up in 64-row tiles (one tile a program: the activation read once per task)
    "w-gateup64": lambda w: KernelConfig(tiles=_tiles(w, (Op.GATEUP,), WIDE, rows=64, k_chunk=64)),
    # wide buckets: O and down in 32-row tiles (half as many tasks, each activation read feeds twice the rows)
    "w-od32": lambda w: KernelConfig(tiles=_tiles(w, (Op.OPROJ, Op.DOWN), WIDE, rows=32)),
    # wide buckets: one k slice (the dot's M spreads over the warps already)
    "w-ks1": lambda w: KernelConfig(tiles=_tiles(w, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, k_slices=1)),
    # flat steps (issue 29): wide weight tiles, K split so that every program streams (rows per tile, parts of K)
    "flat-a": lambda w: KernelConfig(tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4))),
    "flat-b": lambda w: KernelConfig(tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4), k_slices=2)),
    "flat-c": lambda w: KernelConfig(tiles=_flat(w, (32, 4), (128, 8), (64, 1), (128, 8))),
    "flat-d": lambda w: KernelConfig(tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4), stages=3, k_chunk=256)),
    "flat-e": lambda w: KernelConfig(tiles=_flat(w, (16, 2), (32, 2), (32, 1), (32, 2))),
    "flat-w": lambda w: KernelConfig(tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4), min_rows=WIDE)),
    # the same with the operands swapped (weights as the dot's wide side, rows padded to 16)
    "swap-a": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4), swap=True)),
    "swap-b": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (64, 4), (64, 1), (64, 4), swap=True,
                                                              k_chunk=256, stages=3)),
    "swap-c": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (32, 2), (64, 4), (64, 1), (64, 4), swap=True,
                                                              k_chunk=256, stages=3)),
    "swap-d": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (16, 1), (32, 1), (16, 1), swap=True,
                                                              k_chunk=256)),
    "swap-e": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (32, 1), (64, 2), (64, 1), (64, 2), swap=True,
                                                              k_chunk=64, stages=6)),
    "swap-f": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (16, 1), (64, 1), (16, 1), swap=True)),
    "swap-g": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (16, 1), (32, 1), (16, 1), swap=True)),
    "swap-h": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (16, 1), (32, 1), (16, 1), swap=True,
                                                              k_chunk=256, stages=3)),
    "swap-j": lambda w: KernelConfig(min_rows=16, tiles=_flat(w, (16, 1), (16, 1), (32, 1), (16, 2), swap=True,
                                                              k_chunk=256)),
    # issue 35: waits that poll with relaxed loads and then acquire (as before); wider k chunks, fewer stages, two
    # k slices, down's K in two parts of 32-row tiles (half the activation read a task), up to 16 rows
    "no-acq": lambda w: KernelConfig(poll_acquire=False),
    "k512": lambda w: KernelConfig(tiles=_narrow(w, (Op.QKV, Op.OPROJ, Op.DOWN), k_chunk=2 * K_CHUNK[w])),
    "st3": lambda w: KernelConfig(tiles=_narrow(w, MATVECS, stages=3)),
    "ks2": lambda w: KernelConfig(tiles=_narrow(w, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), k_slices=2)),
    "down2": lambda w: KernelConfig(tiles=_narrow(w, (Op.DOWN,), rows=32, k_splits=2, k_halves=False), fit_tiles=True),
    # timing only, its logits WRONG by design: no task waits for its inputs, so the step costs what its tasks cost
    # streamed back to back; against the default, what the dependency waits and phase boundaries cost
    "no-wait": lambda w: KernelConfig(skip_waits=True),
    # ... only one op's tasks (the others wait as usual): what that one boundary costs the step, which says where finer
    # dependencies (a consumer streaming the part of its K whose producers are done) would pay
    **{f"no-wait-{op.name.lower()}": _no_wait(op) for op in (Op.QKV, Op.ATTN, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD)},
    # ... groups of them: no single boundary saved over 1% on the H100 where all of them together saved 14% (s91b), so
    # which phases' overlap makes the difference: the attention chain's (QKV, attention, O), the FFN's (gate/up, down),
    # every layer op's (the LM head still waits), every op's but attention's
    "no-wait-small": _no_wait(Op.QKV, Op.ATTN, Op.OPROJ),
    "no-wait-ffn": _no_wait(Op.GATEUP, Op.DOWN),
    "no-wait-layers": _no_wait(Op.QKV, Op.ATTN, Op.OPROJ, Op.GATEUP, Op.DOWN),
    "no-wait-but-attn": _no_wait(Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD),
    # no launch of one LM row (KernelConfig.one_lm_row_min 0): a step of prompt rows alone (the prompt layout) runs its
    # bucket's LM head over every seat's row, as before s85
    "lm-all": lambda w: KernelConfig(one_lm_row_min=0),
    # the one-LM-row launch up to 32 rows (s85's first default), and its tail at the 8-bit 64-row bucket's 8 warps
    "one-lm-32": lambda w: KernelConfig(one_lm_max_rows=32),
    "one-lm-64-w8": lambda w: KernelConfig(one_lm_warps=8),
    # each layer's matvec and attention inlined into the task loop at every row count (the default before s64);
    # attention inlined where the matvecs are called (from 1 row, both formats); both called at every row count
    "inline": lambda w: KernelConfig(**_CALL_NONE),
    "inline-attn": lambda w: KernelConfig(**_CALL_ALL, call_attention_max_rows=0),
    "call-all": lambda w: KernelConfig(**_CALL_ALL, call_attention_max_rows=1 << 20),
    "qblocks-inline": lambda w: KernelConfig(query_blocks=True, **_CALL_NONE),
    "qblocks-inline-attn": lambda w: KernelConfig(query_blocks=True, **_CALL_ALL, call_attention_max_rows=0),
    "qblocks-call-all": lambda w: KernelConfig(query_blocks=True, **_CALL_ALL, call_attention_max_rows=1 << 20),
    # up to 16 rows: QKV's 96 tiles (Llama-3.2-1B) cut into 2 or 4 parts of K, so its tasks cover every program
    # (96 of 132 streamed, at ~20 GB/s each); the last part to arrive finishes the tile
    "qkv-k2": lambda w: KernelConfig(tiles=_narrow(w, (Op.QKV,), k_splits=2)),
    "qkv-k4": lambda w: KernelConfig(tiles=_narrow(w, (Op.QKV,), k_splits=4)),
    # up to 16 rows: the LM head in 128-row tiles of 128 columns, two k slices (half the tile ends, each epilogue's
    # logits and (max, argmax) over twice the columns; the same bytes a pipeline stage)
    "lm128": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=128, k_chunk=128, k_slices=2)),
    "lm128-ks1": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=128, k_chunk=128, k_slices=1)),
    "lm256": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=256, k_chunk=64, k_slices=1)),
    # 8-bit weight-only everywhere: FP8's default before gate/up ran W8A8 from 16 rows (int8-row's before s76)
    "weight-only": lambda w: KernelConfig(tiles=lambda rows: default_tiles(w != "bf16", rows, w == "int8")),
    # FP8 W8A8 from 16 rows (_w8a8): gate/up (the default now) and the LM head; each alone; four stages; 128-row
    # gate/up tiles; at every row count (rows padded to 16); O and down too (64-row tiles: 32 tasks each)
    "a8": lambda w: KernelConfig(tiles=_w8a8(w)),
    "a8-gu": lambda w: KernelConfig(tiles=_w8a8(w, (Op.GATEUP,))),
    "a8-lm": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,))),
    "a8-st4": lambda w: KernelConfig(tiles=_w8a8(w, stages=4)),
    "a8-gu128": lambda w: KernelConfig(tiles=_w8a8(w, gateup_rows=128)),
    "a8-all": lambda w: KernelConfig(min_rows=16 if w == "fp8" else 1, tiles=_w8a8(w, min_rows=1)),
    "a8-od": lambda w: KernelConfig(tiles=_w8a8(w, (Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD))),
    # the same over k chunks of 128 columns (a scale per 128: within 1% of weight-only FP8's perplexity with the LM
    # head too, bench/fp8_quality.py), four stages; gate/up in 128-row tiles over two stages
    "a8-gu-k128": lambda w: KernelConfig(tiles=_w8a8(w, (Op.GATEUP,), k_chunk=128, stages=4)),
    "a8-lm-k128": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=128, stages=4)),
    "a8-k128": lambda w: KernelConfig(tiles=_w8a8(w, k_chunk=128, stages=4)),
    "a8-gu-k128-lm6": lambda w: KernelConfig(tiles=_w8a8(w, k_chunk=128, stages=4, lm_stages=6)),
    "a8-gu128-st2": lambda w: KernelConfig(tiles=_w8a8(w, (Op.GATEUP,), gateup_rows=128, stages=2)),
    # 8-bit weights: the norms' operand stored as float16, the LM head's apart (KernelConfig.f16_norm_operand)
    "xn16": lambda w: KernelConfig(f16_norm_operand=True),
    "a8-xn16": lambda w: KernelConfig(f16_norm_operand=True, tiles=_w8a8(w)),
    # the whole step in one launch, the LM head's tail included (the default before KernelConfig.lm_launch)
    "one-launch": lambda w: KernelConfig(lm_launch=False),
    # 8-bit W8A8 from 16 sampled rows: the LM head weight-only (FP8's before it ran W8A8 over 128-column chunks)
    "lm-weight-only": lambda w: KernelConfig(tiles=_lm_weight_only(w)),
    # the LM head's W8A8 over 64-column chunks (a scale per 64: within 1% of weight-only FP8's perplexity, 128 is
    # not), in tiles of 128 or 256 rows, over 4 to 12 stages
    "lm-a8-k64": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=64, stages=8)),
    "lm-a8-k64-s4": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=64, stages=4)),
    "lm-a8-k64-s12": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=64, stages=12)),
    "lm-a8-k64-r256": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=64, stages=4, lm_rows=256)),
    "lm-a8-k64-r256-s6": lambda w: KernelConfig(tiles=_w8a8(w, (Op.LMHEAD,), k_chunk=64, stages=6, lm_rows=256)),
    # up to 16 rows: the LM head's one long stream with more bytes in flight (its TMA ring deeper; or its next row
    # tiles on their way into L2 beyond the ring: nothing else runs beside the last phase)
    "lm-st5": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), stages=5)),
    "lm-st3": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), stages=3)),
    "lm-st7": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), stages=7)),
    "lm-pf1": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), prefetch_tiles=1)),
    "lm-pf2": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), prefetch_tiles=2)),
    # 8-bit under 16 sampled rows: the LM head's TMA boxes 128 rows deep (the default) over 3 / 5 stages, or two k
    # slices; and the boxes of 64 rows before them (5 stages at 1-2 rows, 3 at 4-8)
    "lm-r128-s3": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=128, stages=3)),
    "lm-r128-s5": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=128, stages=5)),
    "lm-r128-s4-ks2": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,), rows=128, stages=4, k_slices=2)),
    "lm-r64": lambda w: KernelConfig(tiles=_lm_boxes_64(w)),
    # up to 16 rows: down (one tile of K = ffn a task: its pipeline never reaches a steady state) deeper
    "down-st6": lambda w: KernelConfig(tiles=_narrow(w, (Op.DOWN,), stages=6)),
    "down-st8": lambda w: KernelConfig(tiles=_narrow(w, (Op.DOWN,), stages=8)),
    # under 16 rows, 8-bit gate/up: the 16-row tiles before the wider default (32 rows; at one row 64 through TMA),
    # and 32-row tiles at one row too (bench/NOTES.md "8-bit gate/up in wider tiles")
    "gu-r16": lambda w: KernelConfig(tiles=_narrow(w, (Op.GATEUP,) if w in ("fp8", "int8-row") else (), 16, rows=16,
                                                      k_chunk=512, stages=3, tma=False)),
    "gu-r32-1": lambda w: KernelConfig(tiles=_narrow(w, (Op.GATEUP,) if w in ("fp8", "int8-row") else (), 16, rows=32,
                                                        k_chunk=512, stages=3, tma=False)),
    # bf16 with 8-16 sampled rows: the LM head's 128-row tiles of 128 columns over two k slices, its default before
    # the 64-row boxes of every bucket under 32 rows (bench/NOTES.md "Host time a step, cut again")
    "lm-r128-ks2": lambda w: KernelConfig(tiles=_narrow(w, (Op.LMHEAD,) if w == "bf16" else (), at_least=8, rows=128,
                                                         k_chunk=128, k_slices=2)),
    # wide buckets: 3 pipeline stages (shared memory for wider tiles)
    "w-st3": lambda w: KernelConfig(tiles=_tiles(w, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, stages=3)),
    # 8 warps a program (the default 4): at 16 rows gate/up grows 3.4 us a layer from one row where the same tiles
    # alone grow 0.9 (the Gluon prototype's `triton-mk`), about the dot's own time unhidden at one program of 4 warps
    # per SM; twice the warps hide more of it if the 255 registers they may each keep are enough (8 warps were slower
    # than 4 on the kernel of V1-V3, bench/NOTES.md)
    "warps8": lambda w: KernelConfig(num_warps=8),
    # 8-bit weights' 64-row buckets in 4 warps a program, as before KernelConfig.wide_warps_8bit (default 8)
    "warps4": lambda w: KernelConfig(wide_warps_8bit=4),
    # O and down in wide tiles with K split, so that fewer tasks reread each activation (_k_split): each slower than
    # the default at every row count on the H200 while the merge sat inside the loop (bench/NOTES.md "A verdict in two
    # halves; O and down with K split"); pipelined, dn-r32-ks2 at 16 rows (e4m3) and w-d-r64-ks4 (bf16) became the
    # default (s90). The O and down variants are fitted to the programs as the default is (KernelConfig.fit_tiles)
    "dn-r64-ks4": lambda w: KernelConfig(tiles=_k_split(w, (Op.DOWN,), 64, 4), fit_tiles=True),
    "dn-r32-ks2": lambda w: KernelConfig(tiles=_k_split(w, (Op.DOWN,), 32, 2), fit_tiles=True),
    "od-r64-ks4": lambda w: KernelConfig(tiles=_k_split(w, (Op.OPROJ, Op.DOWN), 64, 4), fit_tiles=True),
    "w-od-r64-ks4": lambda w: KernelConfig(tiles=_k_split(w, (Op.OPROJ, Op.DOWN), 64, 4, wide=True), fit_tiles=True),
    # ... QKV too: in the 64-row bucket (8 warps with 8-bit weights) each task rereads a quarter of the rows'
    # activations from L2 and each warp converts only its own 16 weight rows (16-row tiles: every warp converts the
    # whole tile; bench/NOTES.md "Eight warps")
    "w-qkvod-r64-ks4": lambda w: KernelConfig(tiles=_k_split(w, (Op.QKV, Op.OPROJ, Op.DOWN), 64, 4, wide=True)),
    # ... down alone, K over 4 or 8 tasks: s79's FP8 64-row timeline had down 3.7 us a layer faster in those tiles and
    # QKV twice as slow (48 tiles of its 3,072 rows leave most SMs without one), O 1.7 slower
    "w-d-r64-ks4": lambda w: KernelConfig(tiles=_k_split(w, (Op.DOWN,), 64, 4, wide=True), fit_tiles=True),
    "w-d-r64-ks8": lambda w: KernelConfig(tiles=_k_split(w, (Op.DOWN,), 64, 8, wide=True), fit_tiles=True),
    # FP8 from 32 rows: down W8A8 in gate/up's 64-row swapped tiles over 4 parts of K, as the default does at 64
    # (s82 on the H100: 3.4% slower at 32 rows)
    "w-dn-a8-ks4": lambda w: KernelConfig(tiles=_wide_w8a8(w, (Op.DOWN,))),
    # ... fitted to the programs as the default is (s95: unfitted, SmolLM2's and Qwen's steps read the fit's loss)
    "w-dn-a8-ks4-fit": lambda w: KernelConfig(tiles=_wide_w8a8(w, (Op.DOWN,)), fit_tiles=True),
    # ... and O W8A8 in the same tiles (K over 4 tasks; s82: within 0.2% of the default at 64 rows)
    "w-o-a8-ks4": lambda w: KernelConfig(tiles=_wide_w8a8(w, (Op.OPROJ, Op.DOWN))),
    # FP8's down weight-only from 32 rows, as before s82 (64 rows) and s95 (32 rows), fitted as the default is
    "dn-weight-only": lambda w: KernelConfig(tiles=_down_weight_only(w), fit_tiles=True),
    # attention at one row in chunks of 128 positions, splits of two chunks at least (256 positions: as many splits
    # as the default's 4 x 64): at context 128 the (row, KV head) task that does all the work streams one chunk, not
    # two in a chain (s67's timeline: those 8 tasks ran ~4 us past their wait, O waited for the last). s71 (H200): +1.0%
    # bf16, +1.3% FP8 at one row and context 128, even at 2,048: the 4 us is not the chunks' chain
    "att-ch128": lambda w: KernelConfig(**_ATT_CH128),
    # O's K in two halves streamed side by side, as down's (under 32 rows): half as many chunks in series a task. At
    # one row FP8's O task took 3.29 us for 32 KB already in L2 (s67): four chunks each waited on in turn. K3 measured
    # O +0.8 us with two streams on the H100's bf16 kernel of then (bench/NOTES.md K4). s71 (H200): one row within
    # noise, 16 rows +1.2-1.3% bf16: K3's verdict stands
    "o-halves": lambda w: KernelConfig(tiles=_narrow(w, (Op.OPROJ,), k_halves=True), fit_tiles=True),
}


def _merge_inside(variant: Callable[[str], KernelConfig]) -> Callable[[str], KernelConfig]:
    """The variant with every split tile's merge inside its stream's loop (MatvecTile.merge_after=False), as before
    s90: Triton then leaves a split task's loads unpipelined. Fitted to the programs where the variant is (the default
    is)."""
    def config(w: str) -> KernelConfig:
        base = variant(w)
        table = base.tiles if base.tiles is not None else _tiles(w)

        def tiles(rows: int) -> dict[Op, MatvecTile]:
            t = table(rows) if callable(table) else table
            return {op: tile._replace(merge_after=False) for op, tile in t.items()}

        return replace(base, tiles=tiles, fit_tiles=base.fit_tiles or base.tiles is None)

    return config


# every variant whose tiles split K (and the default: e4m3's 16- and 64-row down, bf16's wide down), with the merge
# inside the loop
SPLIT_VARIANTS = ("default", "dn-r64-ks4", "dn-r32-ks2", "od-r64-ks4", "w-od-r64-ks4", "w-qkvod-r64-ks4",
                  "w-d-r64-ks4", "w-d-r64-ks8", "w-dn-a8-ks4", "w-o-a8-ks4", "qkv-k2", "qkv-k4", "down2")
VARIANTS |= {f"{name}-inside": _merge_inside(VARIANTS[name]) for name in SPLIT_VARIANTS}
