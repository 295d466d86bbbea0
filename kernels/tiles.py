"""How each matvec streams its weights (MatvecTile, a constexpr of the kernel), and the tiles a launch uses unless
its KernelConfig names others: a function of its rows and weight format (default_tiles).
"""

from __future__ import annotations

from typing import NamedTuple

from kernels.instructions import Op, split_rows
from kernels.kernel_args import INT8_BLOCK


class MatvecTile(NamedTuple):
    """How one matvec streams its weights (a constexpr of the kernel): rows per tile, k chunk per pipeline stage,
    independent k slices of the dot, pipeline stages, row tiles kept on their way into L2 ahead of the stream
    (0: none), whether the tensor-memory accelerator loads the weights (descriptors) instead of pointers, whether
    K's two halves stream side by side (matvecs of one run of rows: OPROJ, DOWN, LM head), and how many tasks
    share each tile's K (split K: wide tiles while every program still streams)."""

    rows: int = 16
    k_chunk: int = 256
    k_slices: int = 4
    stages: int = 4
    prefetch_tiles: int = 0
    tma: bool = False
    k_halves: bool = False
    k_splits: int = 1  # parts of K, each a task of one tile (the last to arrive adds them up: instructions.py); the
    # model's K settles the count (parts_of_k)
    swap: bool = False  # the weights as the dot's wide side (M), the step's rows (padded to 16) as N; one k slice
    # W8A8 (FP8 or int8-row weights, swapped tiles): each k chunk's activations quantized to the weights' type with a
    # scale per row (its absmax over the chunk to 448 or 127), so the dot runs e4m3 x e4m3 or int8 x int8 on the
    # tensor cores (wgmma, from 64-row tiles)
    w8a8: bool = False
    # int8 weights converted to float16 by byte permutes in inline PTX (matvec._int8_f16), else by Triton's integer
    # ops (what the interpreter runs)
    int8_prmt: bool = True
    # K split: the part's merge (_k_merge: its sums stored, a barrier, the acq_rel arrival) after the stream's loop
    # instead of inside it at the tile's last chunk. Inside, Triton does not pipeline the loop: sm90-compile finds no
    # cp.async in the split tasks' streams. After the loop they are pipelined, and on the H100 every split variant
    # got faster (Llama bf16 64 rows, down in 64-row tiles over 4 parts of K: 3.362 -> 3.118 ms at context 2,048), the
    # unsplit tiles unchanged (bench/NOTES.md "Split tasks pipelined"). False: the merge inside the loop, as before
    merge_after: bool = True


MATVECS = (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD)
TileTable = dict[Op, MatvecTile]


def default_tiles(fp8: bool = False, rows: int = 1, int8: bool = False, e4m3: bool = False, a8_int8: bool = False
                  ) -> TileTable:
    """The tiles of a launch whose matvecs have `rows` rows (its bucket; the LM head's own rows for the LM head).
    fp8: 8-bit weights (e4m3, or int8 with row scales, which stream alike); int8: int8 with block scales; e4m3: the
    weights are e4m3 (W8A8 possible); a8_int8: int8 with row scales, W8A8 with int8 activations (the same tiles as
    e4m3's from 16 rows: gate/up, and the LM head where it has 16 rows; the dot int8 x int8 on wgmma). On the H100
    that took int8-row's 16-row step from 1.147 to 0.958 ms and 64 rows from 2.297 to 2.131 (gate/up alone: 1.069,
    2.237), for +0.77% perplexity over its weight-only form on SmolLM2 (bench/NOTES.md "int8 W8A8").

    Up to 16 rows, what the H100 measured best (bench/NOTES.md, K1-K4): 16-row tiles (the smallest tensor-core dot) of
    256 columns; QKV and gate/up stream two runs of rows side by side, down its K's two halves; the LM head's 64-row
    tiles of 256 columns through the tensor-memory accelerator (its long stream ran at 72% of the bandwidth with pointer
    loads, 99% with TMA). With FP8 weights each k chunk doubles, so a pipeline stage holds as many weight bytes (the LM
    head's TMA box stays at 256 columns, its limit), over 3 stages instead of 4 (0.5-2.5% faster at 1, 8 and 16 rows in
    four runs; bf16 slower with 3). bf16's LM head keeps those 64-row boxes at every bucket under 32 rows: the 128-row
    tiles of 128 columns over two k slices that it took from 8 sampled rows (2-3% faster at 8 rows on the H100 of then)
    were 0.8-1.1% slower at 8 rows and 1.3-2.0% at 16 on the H200, at contexts 128 and 2,048, in two calls
    (bench/NOTES.md "Host time a step, cut again"). FP8 with 16 sampled rows: the LM head in 128-row tiles of 128
    columns and one k slice (the same bytes a stage, half as many tile ends, each an epilogue over 16 rows' logits and
    their (max, argmax), and no sum over slices): 6.5% faster a step at 16 rows (8.4% with the 3 stages, against main's
    kernel in the same call), even at 8, 4-13% slower at 1 (bench/NOTES.md "The step at the floor, second session").
    8-bit weights at 1 and 2 rows: the LM head's 64-row tiles over 5 stages (its one long stream is limited by the bytes
    in flight): FP8 1.7-2.1% faster a step at 1 row, 2.1% at 2 (int8-row 1.2% at 1 row); 7 stages or the next row tile
    prefetched into L2 are slower (bench/NOTES.md "The LM head's stream, deeper"). Then boxes twice as deep (128 rows of
    256 columns, 32 KB a stage) over 4 stages, at every 8-bit bucket under 16 sampled rows, on the H200 against those
    64-row boxes: FP8 2.5 / 3.8 / 4.1 / 3.1% faster a step at 1 / 2 / 4 / 8 rows, int8-row 2.7 / 3.7% at 1 / 2 (its LM
    head 127 -> 102 us at 1 row); 3 or 5 stages within 0.5% of 4 (bench/NOTES.md "Deeper TMA boxes for the 8-bit LM
    head"). 8-bit gate/up under 16 rows streamed at half the bandwidth (FP8 15.2 us a layer at one row, 8.1 of bytes):
    its 16-row tiles held 8 KB a run a stage. In 32-row tiles (16 KB) the H200 took FP8 2.2-3.4% off a step at 1-8 rows
    (int8-row 0.8-2.4%, even at 4 rows); at one row, 64-row tiles through TMA (one tile a program, 4 stages of 2 x 16
    KB) 4.3% (int8-row 3.0%), slower from 4 rows, where their accumulators spill (bench/NOTES.md "8-bit gate/up in wider
    tiles").

    Pipeline stages, in two calls on two H200s in turns against the tiles above (bench/NOTES.md "A verdict in two
    halves", s65 and s66c): bf16's 16-row bucket over 6 stages instead of 4 (the LM head's too), 1.0-1.2% faster a step
    at contexts 128 and 2,048 (slower at 1 and 4 rows); e4m3 at one row, gate/up's and the LM head's TMA streams over 3
    stages instead of 4, 0.8-1.0% faster (slower at 4 rows). int8 with row scales keeps 4: not measured.

    From 32 rows the operands are swapped (MatvecTile.swap): the weight tile is the dot's M and the step's rows its
    N, one k slice of 256 columns, 3 stages (bf16; FP8: 4 stages, gate/up in 64-row tiles). On the H100 this took
    the 32- and 64-row bf16 steps from 2.07 / 3.16 ms to 1.75 / 2.18 (FP8 2.43 / 4.57 to 2.05 / 3.78); at 16 rows
    and fewer it is slower (1.58 vs 1.43 ms at 16), so those keep the tiles above. Wider weight tiles with K split
    over several tasks (MatvecTile.k_splits) measured slower at every row count (bench/NOTES.md "Flat steps").

    int8 weights: a k slice per block of 32 columns (int8_slices: the dot's slices are scaled one by one), over
    bf16's chunk widths (256 columns, 8 slices; at FP8's 512 the 16 slices' accumulators spilled at 1 row), and at
    32+ rows over one-block chunks (4 slices of 128 columns spilled 3 KB a thread at 64 rows, one block
    0.8 KB, FP8's tiles 1 KB: bench/sm90_compile.py). Not yet measured on the H100.

    e4m3 weights from 16 rows: gate/up runs W8A8 (MatvecTile.w8a8: its activations in e4m3, a scale per row and 256
    columns; wgmma e4m3 x e4m3 in swapped 64-row tiles, 3 stages): 2.1-2.6% faster a step at 16 rows (four runs) and
    3.4-3.9% at 64 (three) (bench/NOTES.md "W8A8"), +0.5% perplexity over weight-only FP8 on the real SmolLM2 weights
    (bench/fp8_quality.py). From 16 sampled rows the LM head runs W8A8 too, over 64-column chunks (a scale per row and
    64 columns: +0.88% perplexity over weight-only FP8 with gate/up's, where 128 columns cost +1.06% and 256 +1.13%) in
    256-row tiles through TMA, 6 stages: in its launch of its own (KernelConfig.lm_launch) the 16-row step 1.100 ->
    1.042 ms against the LM head weight-only, as fast as 128-column chunks in 128-row tiles (64-column chunks in
    128-row tiles: 1.088). In the layers' launch a W8A8 LM head slowed their phases more than it gained (bench/NOTES.md
    "The LM head in a launch of its own"). In the 64-row bucket down runs W8A8 too, in gate/up's 64-row
    swapped tiles with K over 4 tasks (W8A8_DOWN: its N = 2,048 alone makes 32 tiles): on the H100 the 64-row FP8 step
    1.765 -> 1.728 ms (-2.1%; mixed with a prompt's chunk 1.746 -> 1.703, -2.5%; context 2,048 -0.5 / -1.8%) for
    +0.02% perplexity over gate/up's and the LM head's W8A8 on SmolLM2. At 16 rows it was 10.6% slower on the H200
    (bench/NOTES.md "Down W8A8 in the 64-row bucket"). At 32 rows too since its split is pipelined (s95, bench variant
    w-dn-a8-ks4-fit against the default in one H100 call, ms a step, decode / mixed rows): Llama-3.2-1B 1.292 / 1.259
    -> 1.189 / 1.163 at context 128 (-8%), 2.021 / 1.888 -> 1.939 / 1.788 at 2,048 (-4 / -5%); Qwen2.5-1.5B -2.8 /
    -2.5% at 128, +2.1 / +2.9% at 2,048; SmolLM2-135M +9% (fit_to_programs keeps its short K weight-only there; before
    the pipelining, 3.4% slower on Llama: 1.262 -> 1.305 ms).

    Split K, pipelined (MatvecTile.merge_after; bench/NOTES.md "Split tasks pipelined"), on the H100 against the
    unsplit tiles in the same calls: e4m3's 16-row down in 32-row tiles, K over 2 tasks (bench variant dn-r32-ks2)
    took Llama-3.2-1B's step 0.929 -> 0.880 ms at context 128 (1.349 -> 1.316 at 2,048) and Qwen2.5-1.5B's 1.600 ->
    1.530 (2.138 -> 2.069); Llama even at 8 rows, 0.4% slower at 4, 1.3% faster at 1 (not taken: Qwen's and SmolLM2's
    one-row steps read slower, against their unfitted tiles). bf16's down from 32 rows in 64-row swapped tiles, K
    over 4 tasks (w-d-r64-ks4): Llama 32 / 64 rows 1.458 / 1.859 -> 1.387 / 1.727 ms at context 128, 2.230 / 3.245
    -> 2.172 / 3.118 at 2,048; the same tiles with the merge inside the loop were slower than the default (3.362 ms).
    Against the unsplit tiles on every model (s91a, bench variant down-unsplit): Qwen2.5-1.5B's and SmolLM2-135M's
    16-row FP8 down 6% and 2% faster split, Qwen's wide bf16 one 5-8%; SmolLM2's wide bf16 one (K of 1,536) 2-3%
    slower, so fit_to_programs leaves it unsplit."""
    lm_wide = MatvecTile(rows=64, k_chunk=128, k_slices=1, tma=True)
    if int8:
        if rows <= 16:
            narrow = {op: MatvecTile(k_chunk=256, k_halves=op is Op.DOWN) for op in (Op.QKV, Op.OPROJ, Op.GATEUP,
                                                                                       Op.DOWN)}
            return {op: int8_slices(t) for op, t in (narrow | {Op.LMHEAD: MatvecTile(rows=64, tma=True)}).items()}
        wide = {op: MatvecTile(k_chunk=INT8_BLOCK, k_slices=1) for op in (Op.QKV, Op.OPROJ)}
        wide[Op.GATEUP] = MatvecTile(rows=32, k_chunk=INT8_BLOCK, k_slices=1)
        wide[Op.DOWN] = MatvecTile(k_chunk=INT8_BLOCK, k_slices=1, k_halves=True)
        return wide | {Op.LMHEAD: int8_slices(lm_wide._replace(k_chunk=INT8_BLOCK))}
    k = 2 if fp8 else 1
    if rows <= 16:
        stages = 3 if fp8 else 6 if rows == 16 else 4  # bf16's 16 rows: 6 stages (1% faster; docstring)
        tiles = {op: MatvecTile(k_chunk=256 * k, stages=stages) for op in (Op.QKV, Op.OPROJ, Op.GATEUP)}
        tiles[Op.DOWN] = MatvecTile(k_chunk=256 * k, k_halves=True, stages=stages)
        if rows >= 16 and fp8:
            tiles[Op.LMHEAD] = MatvecTile(rows=128, k_chunk=128, k_slices=1, tma=True, stages=stages)
            if e4m3 or a8_int8:
                tiles[Op.GATEUP] = W8A8_GATEUP
                tiles[Op.LMHEAD] = W8A8_LMHEAD
        elif fp8:  # 8-bit: the one long stream's TMA boxes 128 rows deep, 4 of them in flight (more bytes in flight)
            tiles[Op.LMHEAD] = MatvecTile(rows=128, k_chunk=256, tma=True, stages=4)
        else:
            tiles[Op.LMHEAD] = MatvecTile(rows=64, k_chunk=256, tma=True, stages=stages)
        if fp8 and rows < 16:  # 8-bit gate/up: twice the bytes a stage; at one row, one TMA-fed 64-row tile a program
            tiles[Op.GATEUP] = GATEUP_8BIT_ONE_ROW if rows == 1 else GATEUP_8BIT_NARROW
        if e4m3 and rows == 16:  # e4m3 at 16 rows: down in 32-row tiles, K over 2 tasks (docstring)
            tiles[Op.DOWN] = DOWN_E4M3_16_SPLIT
        if e4m3 and rows == 1:  # e4m3 at one row: gate/up's and the LM head's TMA streams over 3 stages, not 4
            tiles = tiles | {op: tiles[op]._replace(stages=3) for op in (Op.GATEUP, Op.LMHEAD)}
        return tiles
    # swapped operands: the weight tile is the dot's M, the rows its N (measured, bench/NOTES.md "Flat steps")
    wide = {op: MatvecTile(k_chunk=256, k_slices=1, stages=4 if fp8 else 3, swap=True)
            for op in (Op.QKV, Op.OPROJ, Op.DOWN)}
    wide[Op.GATEUP] = W8A8_GATEUP if e4m3 or a8_int8 else \
        MatvecTile(rows=64 if fp8 else 32, k_chunk=256, k_slices=1, stages=4 if fp8 else 3, swap=True)
    if e4m3:
        wide[Op.DOWN] = W8A8_DOWN
    elif not fp8:  # bf16: down's K over 4 tasks of 64-row tiles (docstring)
        wide[Op.DOWN] = DOWN_WIDE_SPLIT
    return wide | {Op.LMHEAD: lm_wide}


# 8-bit weights at one row: gate/up's weights through TMA, 64-row boxes of 256 columns over 4 stages (default_tiles)
GATEUP_8BIT_ONE_ROW = MatvecTile(rows=64, k_chunk=256, tma=True, stages=4)
# 8-bit weights under 16 rows: gate/up's pointer-loaded tiles (32 rows from 2 rows; fit_to_programs may take 16)
GATEUP_8BIT_NARROW = MatvecTile(rows=32, k_chunk=512, stages=3)
# 8-bit weights at 16 rows where W8A8's 64-row gate/up tiles leave most programs idle: 16-row weight-only ones
# (fit_to_programs)
GATEUP_8BIT_16_ROWS = MatvecTile(rows=16, k_chunk=512, stages=3)
# e4m3 weights from 16 rows: gate/up W8A8, and from 16 sampled rows the LM head (default_tiles)
W8A8_GATEUP = MatvecTile(rows=64, k_chunk=256, k_slices=1, stages=3, swap=True, w8a8=True)
# e4m3 weights at 64 rows: down W8A8 in gate/up's tiles, K over 4 tasks (its N = 2,048 makes 32 tiles alone)
W8A8_DOWN = W8A8_GATEUP._replace(k_splits=4)
W8A8_LMHEAD = MatvecTile(rows=256, k_chunk=64, k_slices=1, stages=6, tma=True, swap=True, w8a8=True)
# e4m3 weights at 16 rows: down in 32-row tiles of 512 columns, K over 2 tasks, pipelined (merge_after): each task
# rereads half the rows' activations of the default's 16-row tiles over K's two halves, for the same task count
DOWN_E4M3_16_SPLIT = MatvecTile(rows=32, k_chunk=512, stages=3, k_splits=2)
# bf16 from 32 rows: down's swapped tiles 64 rows wide, K over 4 tasks of 128-column chunks, pipelined (merge_after)
DOWN_WIDE_SPLIT = MatvecTile(rows=64, k_chunk=128, k_slices=1, stages=3, swap=True, k_splits=4)
# bf16 from 32 rows where K is short: down unsplit in the other matrices' swapped tiles (fit_to_programs)
DOWN_WIDE = MatvecTile(k_chunk=256, k_slices=1, stages=3, swap=True)
# e4m3 from 32 rows where K is short: down weight-only, unsplit, in the other matrices' swapped tiles (fit_to_programs)
DOWN_WIDE_8BIT = DOWN_WIDE._replace(stages=4)
# the fewest columns of K a part of DOWN_WIDE_SPLIT streams for the split to pay: on the H100 (s91a) parts of 1,792
# (Qwen2.5-1.5B) and 2,048 (Llama-3.2-1B) columns made the step 4-8% faster, parts of 384 (SmolLM2-135M) 2-3% slower
DOWN_SPLIT_MIN_COLUMNS = 1024
# each wide split down and the unsplit tile fit_to_programs takes instead where K is short
UNSPLIT_DOWN = {DOWN_WIDE_SPLIT: DOWN_WIDE, W8A8_DOWN: DOWN_WIDE_8BIT}


def parts_of_k(chunks: int, wanted: int) -> int:
    """Parts of a K of `chunks` k chunks for a tile that asks for `wanted`: the divisor of chunks nearest to it (the
    larger of two as near; each part is a task of equal chunks). Llama-3.2-1B's down (32 chunks of 256) takes 4,
    SmolLM2's (6) 3, Qwen2.5-1.5B's (35) 5."""
    return min((d for d in range(1, chunks + 1) if chunks % d == 0), key=lambda d: (abs(d - wanted), -d))


def int8_slices(t: MatvecTile) -> MatvecTile:
    """The tile with one k slice per int8 block of its k chunk (a slice must lie within one block)."""
    return t._replace(k_slices=max(1, t.k_chunk // INT8_BLOCK))


# A tile's fixed cost (its epilogue, its turn of the pipeline) in weight rows streamed, fitted to the H100's sweeps of
# 8-bit gate/up in 64-, 32- and 16-row tiles on three models (bench/NOTES.md "Tiles that fit the programs"): any value
# from 9 to 31 picks what was fastest in each of them
TILE_COST_ROWS = 16


def busiest_cost(n: int, rows: int, programs: int) -> int:
    """The busiest program's share of a matvec of n weight rows in tiles of `rows`, dealt to `programs` as the schedule
    deals them (instructions.split_rows): its tiles' rows plus TILE_COST_ROWS a tile."""
    return max(tiles for _, tiles in split_rows(n, rows, programs)) * (rows + TILE_COST_ROWS)


def fit_to_programs(tiles: TileTable, rows: int, eight_bit: bool, qkv_rows: int, ffn: int, programs: int) -> TileTable:
    """default_tiles, where a model's matrices cut into them fit the GPU's programs badly (a launch of `rows` rows).

    8-bit gate/up under 16 rows: of its default tile and the narrow 32- and 16-row ones, the one whose busiest
    program costs least (busiest_cost; the default where even). A matrix a few tiles wider than the programs leaves
    those few to stream a second tile while the rest wait (Qwen2.5-1.5B's 8,960 rows are 140 64-row tiles for 132
    programs), and one of a few wide tiles leaves most programs idle while each streams at what one SM can (SmolLM2's
    1,536 rows: 24). Timed alone on the H100: Qwen2.5-1.5B FP8 at one row 1.272 -> 1.219 ms in 32-row tiles (16-row:
    1.265), SmolLM2-135M 0.702 -> 0.637 in 16-row tiles at one row, 0.698 -> 0.673 at 4 rows and 0.886 -> 0.821 at 8;
    Llama-3.2-1B keeps its tiles (16-row ones: 2-5% slower at 4 and 8 rows).

    The same at 16 rows where gate/up runs W8A8 in 64-row tiles: those or 16-row weight-only pointer tiles
    (GATEUP_8BIT_16_ROWS, bench variant gu16-r16). On the H100 (s90b) SmolLM2 FP8 0.952 -> 0.933 ms at context 128,
    1.688 -> 1.615 at 2,048 (and its logits nearer the weight-only reference: no activations quantized); Qwen2.5-1.5B
    +2.4% (its busiest costs tie: kept), Llama-3.2-1B +8% (kept). int8-row not timed.

    bf16's wide down (DOWN_WIDE_SPLIT, from 32 rows) unsplit (DOWN_WIDE) where its parts of K would stream under
    DOWN_SPLIT_MIN_COLUMNS: a part of a few chunks is all its pipeline's prologue and drain, and its merge a round
    trip more. On the H100 (s91a, against the unsplit tile in the same call) SmolLM2-135M's K of 1,536 in parts of 384
    columns read 0.892 / 1.260 ms at 32 / 64 rows against 0.871 / 1.220 unsplit; Qwen2.5-1.5B's parts of 1,792 2.178 /
    2.616 against 2.372 / 2.740, Llama-3.2-1B's of 2,048 1.392 / 1.731 against 1.466 / 1.866.

    e4m3's down from 32 rows (W8A8_DOWN) weight-only and unsplit (DOWN_WIDE_8BIT) by the same rule: SmolLM2's K of
    1,536 in parts of 512 read 0.997 / 0.991 ms unsplit against 1.093 / 1.080 split at 32 rows (s95, H100, context 128;
    +8-9% at 2,048 too), and at 64 rows 1.416 / 1.398 against 1.483 / 1.464 (context 128), 2.690 / 2.311 against
    2.736 / 2.384 (2,048; s96, decode / mixed steps); Llama's parts of 2,048 and Qwen's of 1,792 keep it (Qwen
    weight-only at 64 rows: +5 to +8%).

    QKV's runs of 8 rows (tiles of 16) where its tiles of 32 would fill under a third of the programs: SmolLM2's 960
    rows are 30 of them. Timed alone on the H100 2.0-4.4% faster a step at 1, 4, 8 and 16 rows (bf16 and FP8);
    Qwen2.5-1.5B's 64 tiles measured within 1.3% either way (kept), Llama-3.2-1B's 96 become 192, two a program: 17%
    slower.

    Both, against the unfitted tiles in one H100 call (bench variant `unfitted`; ms a step at 1 / 4 / 16 rows):
    SmolLM2 FP8 0.700 / 0.696 / 0.983 -> 0.613 / 0.652 / 0.950, bf16 0.618 / 0.637 / 0.878 -> 0.604 / 0.622 / 0.851;
    Qwen2.5-1.5B FP8 at one row 1.262 -> 1.208, the rest even (bench/NOTES.md "Tiles that fit the programs")."""
    out = dict(tiles)
    gate_up = tiles[Op.GATEUP]
    if eight_bit and rows < 16 and not gate_up.swap:
        options = [gate_up] + [GATEUP_8BIT_NARROW._replace(rows=r) for r in (32, 16)]
        out[Op.GATEUP] = min(options, key=lambda t: busiest_cost(ffn, t.rows, programs))
    if rows == 16 and gate_up.w8a8:
        out[Op.GATEUP] = min((gate_up, GATEUP_8BIT_16_ROWS), key=lambda t: busiest_cost(ffn, t.rows, programs))
    down = tiles[Op.DOWN]
    unsplit = UNSPLIT_DOWN.get(down)
    if unsplit is not None and ffn // parts_of_k(-(-ffn // down.k_chunk), down.k_splits) < DOWN_SPLIT_MIN_COLUMNS:
        out[Op.DOWN] = unsplit
    qkv = tiles[Op.QKV]
    if not qkv.swap and qkv.rows >= 16 and 3 * -(-qkv_rows // (2 * qkv.rows)) < programs:
        out[Op.QKV] = qkv._replace(rows=qkv.rows // 2)
    return out
