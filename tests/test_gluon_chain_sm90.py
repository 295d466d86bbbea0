"""The loader's prototype (kernels/gluon_chain.py) on the CPU: its schedule gives every program the same steps and
covers every phase's weights exactly once, with the flags the kernel walks by; and it compiles for the H100
(sm_90a) to TMA copies and wgmma without spills, inside shared memory, in every mode. Its run on a GPU is
tests/test_gluon_chain_gpu.py."""

from __future__ import annotations

import pytest

from kernels import gluon_chain as gc

H100_SMEM = 227 * 1024
F = {name: int(getattr(gc, name)) for name in dir(gc) if name.startswith("F_")}


def _flag(rec: list[int], name: str) -> bool:
    return bool(rec[F["F_FLAGS"]] & int(getattr(gc, name)))


@pytest.mark.parametrize("rows", [1, 16])
def test_schedule_covers_every_weight_tile_once_in_equal_shares(rows: int) -> None:
    layers, programs, bm, bk = 2, 128, 128, 128
    sched = gc.build_schedule(layers, rows, programs, bm, bk)
    table = sched.table.tolist()
    assert len({len(p) for p in table}) == 1  # every program the same number of steps
    seen: dict[tuple[int, int, int], int] = {}
    for steps in table:
        phases = [s[F["F_PH"]] for s in steps]
        assert phases == sorted(phases)  # a program walks the phases in order
        for i, rec in enumerate(steps):
            key = (rec[F["F_KIND"]], rec[F["F_WROW"]], rec[F["F_K"]])
            seen[key] = seen.get(key, 0) + 1
            assert _flag(rec, "FIRST_OF_PHASE") == (i == 0 or steps[i - 1][F["F_PH"]] != rec[F["F_PH"]])
            assert _flag(rec, "LAST_OF_PHASE") == (i + 1 == len(steps) or steps[i + 1][F["F_PH"]] != rec[F["F_PH"]])
            assert rec[F["F_PHASE_END"]] > i and steps[rec[F["F_PHASE_END"]] - 1][F["F_PH"]] == rec[F["F_PH"]]
            assert rec[F["F_KK"]] < rec[F["F_CHUNKS"]] <= sched.max_chunks
    for ki, (n, k) in enumerate(gc.LLAMA_1B.values()):
        tiles = {(kind, row, kk) for (kind, row, kk) in seen if kind == ki}
        assert len(tiles) == layers * (n // bm) * (k // bk)  # each [bm, bk] tile of every layer once
    assert set(seen.values()) == {1}
    # each phase reads its producer's output: O the first 2048 of QKV's 3072 columns, down the first 8192 of 16384;
    # a tile of it is whole after as many arrivals as its producer has K splits (QKV 16, O 8, gate/up 2, down 8)
    o = next(s for s in table[0] if s[F["F_KIND"]] == 1)
    assert o[F["F_IN"]] == sched.out_base[0] and o[F["F_IN_STRIDE"]] == 3072
    deps = {(s[F["F_PH"]], s[F["F_DEP"]]) for s in table[0]}
    assert deps == {(0, 0), (1, 16), (2, 8), (3, 2), (4, 8), (5, 16), (6, 8), (7, 2)}


def test_a_split_that_cannot_share_evenly_is_refused() -> None:
    with pytest.raises(ValueError):
        gc.splits_for(2048, 256, 128, 128, 128)  # 16 tiles, at most 2 K chunks: never 128 equal tasks


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_compiles_to_tma_and_wgmma_without_spills(weights: str, rows: int) -> None:
    from bench.gluon_chain import compile_launches
    from bench.gluon_proto import code_report, compile_sm90

    names = []
    for name, kernel, args, kwargs in compile_launches(weights, rows):
        rep = code_report(compile_sm90(kernel, args, kwargs))
        assert rep["ptx_target"] == "sm_90a"
        assert rep["stack"] == 0 and rep["local"] == 0, (name, rep)
        assert rep["shared_bytes"] <= H100_SMEM, (name, rep)
        assert rep["cp.async.bulk.tensor (TMA)"] > 0 and rep["wgmma.mma_async"] > 0, (name, rep)
        k = 32 if weights == "fp8" else 16
        assert rep["wgmma shapes"] == [f"m64n{gc.padded_rows(rows)}k{k}"]
        names.append(name.rsplit("-", 1)[0])
    assert {"ring", "drain", "nowait", "tiles", "steal-1"} <= set(names)


def test_claimed_tasks_cover_every_weight_tile_once() -> None:
    layers, bm, bk = 2, 128, 128
    chunks = {"qkv": 1, "o": 2, "gate_up": 4, "down": 2}
    tk = gc.build_tasks(layers, 16, chunks, bm, bk)
    table = tk.table.tolist()
    tiles = set()
    for ph in range(tk.phases):
        kind = gc.KINDS[ph % 4]
        for rec in table[tk.first[ph]:tk.first[ph] + tk.count[ph]]:
            assert rec[F["F_PH"]] == ph and rec[F["F_CHUNKS"]] == chunks[kind]
            for c in range(rec[F["F_CHUNKS"]]):
                tiles.add((rec[F["F_KIND"]], rec[F["F_WROW"]], rec[F["F_K"]] + c * bk))
    assert len(tiles) == layers * sum((n // bm) * (k // bk) for n, k in gc.LLAMA_1B.values())
    assert int(tk.count.sum()) == len(table)
    with pytest.raises(ValueError):
        gc.build_tasks(1, 1, chunks | {"qkv": 3})  # 2048 is not a whole number of 3 chunks of 128
