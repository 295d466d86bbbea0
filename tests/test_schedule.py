"""The megakernel's schedule (kernels/instructions.py), checked on the host: what each task waits for is exactly what
the tasks before it provide, so that the persistent kernel neither deadlocks nor reads a buffer early."""

from __future__ import annotations

from collections import Counter

import pytest

from kernels import instructions as I
from kernels.instructions import Op

MODELS = {
    "llama-3.2-1b": I.ModelDims(2048, 16, 32, 8, 64, 8192, 128256, 1e-5, False),
    "qwen2.5-1.5b": I.ModelDims(1536, 28, 12, 2, 128, 8960, 151936, 1e-6, True),
    "smollm2-135m": I.ModelDims(576, 30, 9, 3, 64, 1536, 49152, 1e-5, False),
}


def tasks_of(s: I.Schedule) -> list[dict[str, int]]:
    names = ["op", "layer", "wait", "target", "done"]
    return [dict(zip(names, rec[:5])) | {"row0": rec[I.MV_ROW0], "tiles": rec[I.MV_TILES],
                                         "kv_head": rec[I.ATTN_KV_HEAD]} for rec in s.tasks.tolist()]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("programs", [1, 7, 132])
def test_attention_waits_for_its_own_heads_qkv_rows(model: str, programs: int) -> None:
    dims = MODELS[model]
    tile = 32  # QKV's two runs of 16 rows
    s = I.build_schedule(dims, 2, programs, I.Tiling(attn_splits=3))
    tasks = tasks_of(s)
    qkv = [t for t in tasks if t["op"] == Op.QKV and t["layer"] == 1]
    # the runs cover every row of Wq, Wk, Wv exactly once
    rows = Counter(r for t in qkv for r in range(t["row0"], t["row0"] + t["tiles"] * tile))
    assert sorted(rows) == list(range(dims.qkv_rows)) and set(rows.values()) == {1}
    signals = Counter(t["done"] for t in qkv)
    d, g = dims.head_dim, dims.group
    for t in qkv:  # a task signals the counter of the KV head whose rows it computes
        head = (t["row0"] // (g * d) if t["row0"] < dims.q_size
                else (t["row0"] - dims.q_size) % dims.kv_size // d)
        assert t["done"] == s.layout.qkv_head(1, head)
    for t in (t for t in tasks if t["op"] == Op.ATTN and t["layer"] == 1):
        assert t["wait"] == s.layout.qkv_head(1, t["kv_head"])
        assert t["target"] == signals[t["wait"]]  # every QKV task of that head, no more
    assert max(max(t["wait"], t["done"]) for t in tasks) < s.layout.counters


@pytest.mark.parametrize(("head_counters", "attn_heads"), [(True, 1), (False, 1), (True, 3)])
def test_every_wait_is_met_by_earlier_tasks(head_counters: bool, attn_heads: int) -> None:
    """Run the schedule as the GPU would with every program resident: each program takes its next task once the
    counter it waits for has reached its target. Attention's `done` counts (row, KV head) pairs finished (one split
    each here; a task of several KV heads adds them all); everything else counts tasks. The step must finish, with no
    counter overshooting a wait."""
    dims = MODELS["smollm2-135m"]
    s = I.build_schedule(dims, 3, 16, I.Tiling(head_counters=head_counters, attn_heads=attn_heads))
    attention = [t for t in s.tasks.tolist() if t[I.F_OP] == Op.ATTN and t[I.F_LAYER] == 0]
    assert len(attention) == 3 * dims.num_kv_heads // attn_heads
    assert sorted({t[I.ATTN_KV_HEAD] for t in attention}) == list(range(0, dims.num_kv_heads, attn_heads))
    tasks = tasks_of(s)
    starts = s.starts.tolist()
    queues = [list(range(starts[p], starts[p + 1])) for p in range(s.num_programs)]
    counters = Counter[int]()
    progress = True
    while progress:
        progress = False
        for q in queues:
            while q and (tasks[q[0]]["wait"] < 0 or counters[tasks[q[0]]["wait"]] >= tasks[q[0]]["target"]):
                t = tasks[q.pop(0)]
                if t["done"] >= 0 and t["op"] != Op.ARGMAX:
                    counters[t["done"]] += attn_heads if t["op"] == Op.ATTN else 1
                progress = True
    assert not any(queues), "a program waits forever"
    waits = Counter((t["wait"], t["target"]) for t in tasks if t["wait"] >= 0)
    for (counter, target), _ in waits.items():
        assert counters[counter] == target, f"counter {counter} ends at {counters[counter]}, awaited at {target}"


@pytest.mark.parametrize("parts", [2, 4])
def test_split_k_tiles_arrive_once_per_part_and_cover_every_row(parts: int) -> None:
    """Split K (Tiling.k_splits): each tile of O and down is `parts` tasks, one per part of K, each arriving on the
    tile's own counter (a counter no other tile uses, inside the layout), and together the tasks cover every row
    once per part; the schedule still finishes when run as the GPU would."""
    dims = MODELS["llama-3.2-1b"]
    tiling = I.Tiling(rows={Op.QKV: 32, Op.OPROJ: 64, Op.GATEUP: 64, Op.DOWN: 64, Op.LMHEAD: 64},
                      k_splits={Op.OPROJ: parts, Op.DOWN: parts})
    s = I.build_schedule(dims, 4, 132, tiling)
    recs = s.tasks.tolist()
    for op in (Op.OPROJ, Op.DOWN):
        mine = [r for r in recs if r[I.F_OP] == op and r[I.F_LAYER] == 3]
        assert Counter(r[I.MV_TILES] for r in mine) == {1: len(mine)}
        by_tile = Counter((r[I.MV_ROW0], r[I.MV_ARRIVE]) for r in mine)
        assert set(by_tile.values()) == {parts} and len(by_tile) == dims.hidden // 64
        assert sorted({r[I.MV_K_SPLIT] for r in mine}) == list(range(parts))
        arrivals = {a for _, a in by_tile}
        assert len(arrivals) == len(by_tile) and max(arrivals) < s.layout.counters
    # the arrival counters are nobody's done or wait counter
    arrive = {r[I.MV_ARRIVE] for r in recs if r[I.F_OP] in (Op.OPROJ, Op.DOWN)}
    assert not arrive & {r[I.F_DONE] for r in recs} and not arrive & {r[I.F_WAIT] for r in recs}
    # consumers wait for every part of every tile
    gateup = next(r for r in recs if r[I.F_OP] == Op.GATEUP and r[I.F_LAYER] == 3)
    assert gateup[I.F_TARGET] == parts * dims.hidden // 64


def test_attention_tasks_of_several_heads_need_one_task_per_pair() -> None:
    """Several KV heads a task (Tiling.attn_heads) only where each (row, KV head) has one attention task (its task then
    merges its own splits) and the heads divide evenly."""
    dims = MODELS["llama-3.2-1b"]
    with pytest.raises(ValueError, match="one task per"):
        I.build_schedule(dims, 4, 132, I.Tiling(attn_splits=2, attn_heads=2))
    with pytest.raises(ValueError, match="divide"):
        I.build_schedule(dims, 4, 132, I.Tiling(attn_heads=3))



def tiny_decoder(**config: object):  # noqa: ANN201
    """A megakernel decoder of the tiny synthetic model on the CPU, up to 16 rows a step (its buckets' schedules and
    attention shapes are built on the host; nothing runs)."""
    import torch

    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    config_, weights, _ = load_synthetic("tiny", device="cpu", dtype=torch.float32, seed=0)
    return MegakernelDecoder(config_, weights, max_slots=4, max_context=256, device="cpu", dtype=torch.float32,
                             max_rows=16, kernel_config=KernelConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize("invariant", [False, True])
def test_attention_steps_through_more_positions_in_wide_launches_only(invariant: bool) -> None:
    """Launches of 8 rows or more take 128 positions an attention step (splits of 512 at least), narrower ones 64
    (256); a batch-invariant kernel computes every bucket as its widest launch, so each bucket sums its attention in
    the same steps (a row's bits then do not depend on the rows beside it)."""
    mk = tiny_decoder(batch_invariant=invariant)
    shapes = {b: mk.kernel.attn_shape(mk.kernel.schedule(b)) for b in mk.buckets}
    chunks = {b: (a.chunk, a.chunk * a.split_min_chunks) for b, a in shapes.items()}
    narrow = (128, 512) if invariant else (64, 256)
    assert chunks == {1: narrow, 2: narrow, 4: narrow, 8: (128, 512), 16: (128, 512)}


@pytest.mark.parametrize("invariant", [False, True])
def test_a_pair_streams_as_one_split_only_where_it_has_one_task(invariant: bool) -> None:
    """KernelConfig.single_split: launches that give each (row, KV head) one attention task stream its positions as one
    split; launches that spread a pair over several tasks keep their splits (else those tasks would idle). A
    batch-invariant kernel decides by its widest launch, for every bucket alike."""
    from kernels.megakernel import KernelConfig

    mk = tiny_decoder(batch_invariant=invariant, single_split=True)
    mk.kernel.attn_splits = {1: 4, 2: 2}  # tasks a pair in the narrow launches (the rest: one, on the CPU's program)
    splits = {b: mk.kernel.attn_shape(mk.kernel.schedule(b)).max_splits for b in mk.buckets}
    most = KernelConfig().max_splits
    assert splits == ({b: 1 for b in mk.buckets} if invariant else {1: most, 2: most, 4: 1, 8: 1, 16: 1})


@pytest.mark.parametrize(("asked", "parts"), [(2, 2), (3, 4), (4, 4), (5, 4), (8, 8), (16, 8)])
def test_a_split_tile_takes_the_parts_its_models_k_divides_into(asked: int, parts: int) -> None:
    """A tile asks for parts of K (MatvecTile.k_splits); the model's K settles them: the divisor of its k chunks
    nearest to the ask, the larger of two as near (kernels.tiles.parts_of_k). The tiny model's down (K = 128 in chunks
    of 16: 8 chunks) asked for 3 takes 4, for 16 takes 8; the schedule then has that many tasks a tile, each part
    once. Llama-3.2-1B's down in chunks of 256 (32) takes 4 of 4, SmolLM2's (6) 3, Qwen2.5-1.5B's (35) 5."""
    from kernels.tiles import MATVECS, MatvecTile, parts_of_k

    assert [parts_of_k(c, 4) for c in (32, 6, 35, 1)] == [4, 3, 5, 1]
    tiles = {op: MatvecTile(rows=64 if op is Op.LMHEAD else 16, k_chunk=16) for op in MATVECS}
    mk = tiny_decoder(tiles=tiles | {Op.DOWN: tiles[Op.DOWN]._replace(k_splits=asked)})
    for b in mk.buckets:
        assert mk.kernel.tiling(b).k_splits.get(Op.DOWN, 1) == parts
        t = mk.kernel.schedule(b).tasks
        down = t[t[:, I.F_OP] == int(Op.DOWN)]
        per_tile = Counter((int(r[I.F_LAYER]), int(r[I.MV_ROW0])) for r in down)
        assert set(per_tile.values()) == {parts}
        first = down[(down[:, I.F_LAYER] == 0) & (down[:, I.MV_ROW0] == 0)]
        assert sorted(first[:, I.MV_K_SPLIT].tolist()) == list(range(parts))


def test_a_launch_of_one_lm_row_where_the_lm_head_takes_many() -> None:
    """Buckets whose LM head takes KernelConfig.one_lm_row_min rows or more (16 on a GPU: the server's seats) have a
    second launch whose LM head takes one row, for the steps where one row samples at most (a prompt alone): its
    schedule's LM-head tiles are one row's, its layers' tiles the bucket's. Not in buckets over one_lm_max_rows (64 on
    a GPU: every bucket), not where batch-invariant (a row's logits would depend on the launch), nor
    where the LM head shares the layers' launch."""
    from kernels.megakernel import KernelConfig

    mk = tiny_decoder(one_lm_row_min=4)  # 16 rows, 4 slots: every bucket from 4 samples 4 rows
    k = mk.kernel
    assert {b: k.has_one_lm_row(b) for b in mk.buckets} == {1: False, 2: False, 4: True, 8: True, 16: True}
    assert (k.lm_rows_of(16), k.lm_rows_of(16, one_lm=True)) == (4, 1)
    plain, one = k.schedule(16), k.schedule(16, one_lm=True)
    assert one is not plain and k.schedule(2, one_lm=True) is k.schedule(2)  # (bucket 2 has none)
    assert one.tiling.rows[Op.LMHEAD] == k.tiles(1)[Op.LMHEAD].rows
    assert {op: r for op, r in one.tiling.rows.items() if op is not Op.LMHEAD} == \
        {op: r for op, r in plain.tiling.rows.items() if op is not Op.LMHEAD}
    assert not any(tiny_decoder(one_lm_row_min=4, batch_invariant=True).kernel.has_one_lm_row(b) for b in mk.buckets)
    assert not any(tiny_decoder(one_lm_row_min=4, lm_launch=False).kernel.has_one_lm_row(b) for b in mk.buckets)
    assert not any(tiny_decoder(one_lm_row_min=0).kernel.has_one_lm_row(b) for b in mk.buckets)
    assert not tiny_decoder(one_lm_row_min=4, one_lm_max_rows=8).kernel.has_one_lm_row(16)
    assert (KernelConfig().one_lm_row_min, KernelConfig().one_lm_max_rows) == (16, 64)


def _busiest(model: str, weights: str, rows: int, op: Op, programs: int, fitted: bool) -> tuple[int, int]:
    """(tasks, weight rows of the busiest task) of one layer's `op` in a launch of `rows` rows of the real shapes."""
    from kernels.tiles import default_tiles, fit_to_programs

    dims = MODELS[model]
    eight_bit = weights == "fp8"
    tiles = default_tiles(eight_bit, rows, e4m3=eight_bit)
    if fitted:
        tiles = fit_to_programs(tiles, rows, eight_bit, dims.qkv_rows, dims.ffn, programs)
    tiling = I.Tiling(rows={o: t.rows for o, t in tiles.items()})
    height = 2 * tiles[op].rows if op is Op.QKV else tiles[op].rows
    mine = [t for t in tasks_of(I.build_schedule(dims, rows, programs, tiling))
            if t["op"] == op and t["layer"] == 0]
    return len(mine), max(t["tiles"] for t in mine) * height


@pytest.mark.parametrize(("model", "weights", "rows", "op", "before", "after"), [
    # Qwen's 8,960 gate/up rows: 140 64-row tiles on 132 programs, 8 of them streaming 128 rows; 32-row tiles: 96
    ("qwen2.5-1.5b", "fp8", 1, Op.GATEUP, (132, 128), (132, 96)),
    # SmolLM2's 1,536: 24 64-row tiles (108 programs idle), 48 32-row ones at 4 rows; 96 16-row tiles
    ("smollm2-135m", "fp8", 1, Op.GATEUP, (24, 64), (96, 16)),
    ("smollm2-135m", "fp8", 4, Op.GATEUP, (48, 32), (96, 16)),
    # ... and at 16 rows, where W8A8's 64-row tiles are 24: 16-row weight-only ones
    ("smollm2-135m", "fp8", 16, Op.GATEUP, (24, 64), (96, 16)),
    # SmolLM2's 960 QKV rows: 30 tiles of two runs of 16, 60 of two runs of 8
    ("smollm2-135m", "bf16", 1, Op.QKV, (30, 32), (60, 16)),
    ("smollm2-135m", "fp8", 16, Op.QKV, (30, 32), (60, 16)),
    # what already fits stays: Llama's 128 64-row gate/up tiles, its 96 QKV tiles (halved: 192, two a program),
    # Qwen's 64 QKV tiles, bf16's 16-row gate/up, the W8A8 tiles from 16 rows
    ("llama-3.2-1b", "fp8", 1, Op.GATEUP, (128, 64), (128, 64)),
    ("llama-3.2-1b", "fp8", 4, Op.GATEUP, (132, 64), (132, 64)),
    ("llama-3.2-1b", "bf16", 1, Op.QKV, (96, 32), (96, 32)),
    ("qwen2.5-1.5b", "bf16", 1, Op.QKV, (64, 32), (64, 32)),
    ("qwen2.5-1.5b", "bf16", 1, Op.GATEUP, (132, 80), (132, 80)),
    ("qwen2.5-1.5b", "fp8", 16, Op.GATEUP, (132, 128), (132, 128)),
    ("llama-3.2-1b", "fp8", 16, Op.GATEUP, (128, 64), (128, 64)),
])
def test_tiles_fit_the_programs_where_a_models_matrices_cut_badly(model: str, weights: str, rows: int, op: Op,
                                                                  before: tuple[int, int],
                                                                  after: tuple[int, int]) -> None:
    """kernels.tiles.fit_to_programs on the H100's 132 programs: the busiest task of a phase streams fewer weight rows
    (or more programs share the phase) where the default tiles cut a model's matrix badly, and nothing changes where
    they fit. With one program (the interpreter) every tile stays as default_tiles made it."""
    assert _busiest(model, weights, rows, op, 132, fitted=False) == before
    assert _busiest(model, weights, rows, op, 132, fitted=True) == after
    assert _busiest(model, weights, rows, op, 1, fitted=True) == _busiest(model, weights, rows, op, 1, fitted=False)


def test_the_gpu_default_is_the_fitted_table() -> None:
    """A Megakernel with no tiles of its own config runs default_tiles fitted to its model and programs; a table
    given in its config runs as given (bench variant `unfitted`: the default before the fit)."""
    from kernels.tiles import default_tiles, fit_to_programs

    mk = tiny_decoder()
    k = mk.kernel
    k.num_programs = 132
    dims = k.dims
    want = fit_to_programs(default_tiles(False, 1), 1, False, dims.qkv_rows, dims.ffn, 132)
    assert want[Op.QKV].rows == 8 and k._table(1) == want  # (the tiny model's 128 QKV rows: 4 tiles of 32)
    assert tiny_decoder(tiles=default_tiles(False, 1)).kernel._table(1) == default_tiles(False, 1)


@pytest.mark.parametrize(("model", "weights", "rows", "tasks", "parts"), [
    # e4m3 at 16 rows: 32-row tiles, K over 2 tasks (SmolLM2's 3 chunks of 512 columns: 3 parts), as many tasks as the
    # 16-row tiles made
    ("llama-3.2-1b", "fp8", 16, 128, 2),
    ("qwen2.5-1.5b", "fp8", 16, 96, 2),
    ("smollm2-135m", "fp8", 16, 54, 3),
    # bf16 from 32 rows: 64-row swapped tiles, K over 4 (Qwen's 70 chunks of 128 columns: 5), where each part streams
    # 1,024 columns at least; SmolLM2's 12 chunks would make parts of 384: unsplit, in 16-row tiles (measured faster)
    ("llama-3.2-1b", "bf16", 32, 128, 4),
    ("qwen2.5-1.5b", "bf16", 64, 120, 5),
    ("smollm2-135m", "bf16", 32, 36, 1),
    ("smollm2-135m", "bf16", 64, 36, 1),
    # e4m3 from 32 rows: down W8A8, K over 4 tasks (Qwen's 35 chunks of 256 columns: 5), where each part streams
    # 1,024 columns at least; SmolLM2's 6 chunks would make parts of 512: weight-only and unsplit (32 and 64 rows)
    ("llama-3.2-1b", "fp8", 64, 128, 4),
    ("llama-3.2-1b", "fp8", 32, 128, 4),
    ("qwen2.5-1.5b", "fp8", 32, 120, 5),
    ("qwen2.5-1.5b", "fp8", 64, 120, 5),
    ("smollm2-135m", "fp8", 32, 36, 1),
    ("smollm2-135m", "fp8", 64, 36, 1),
    # unsplit elsewhere: bf16's 16 rows, e4m3's 8
    ("llama-3.2-1b", "bf16", 16, 128, 1),
    ("llama-3.2-1b", "fp8", 8, 128, 1),
])
def test_downs_k_is_split_where_the_h100_measured_it_faster(model: str, weights: str, rows: int, tasks: int,
                                                            parts: int) -> None:
    """The default down of a launch of `rows` rows on the real shapes and 132 programs, fitted to the model as the
    Megakernel fits it: its tasks and the parts of K that the model's K settles (kernels/tiles.py: each split measured
    2-8% faster a step where taken, and SmolLM2's short K unsplit 2-3% faster), every split with its merge after the
    stream's loop (pipelined)."""
    from kernels.tiles import default_tiles, fit_to_programs, parts_of_k

    dims = MODELS[model]
    eight_bit = weights == "fp8"
    tiles = default_tiles(eight_bit, rows, e4m3=eight_bit)
    tile = fit_to_programs(tiles, rows, eight_bit, dims.qkv_rows, dims.ffn, 132)[Op.DOWN]
    got = parts_of_k(-(-dims.ffn // tile.k_chunk), tile.k_splits) if tile.k_splits > 1 else 1
    assert got == parts
    assert tile.merge_after
    tiling = I.Tiling(rows={**I.Tiling().rows, Op.DOWN: tile.rows}, k_splits={Op.DOWN: got})
    mine = [t for t in tasks_of(I.build_schedule(dims, rows, 132, tiling)) if t["op"] == Op.DOWN and t["layer"] == 0]
    assert len(mine) == tasks
