"""The Gluon swap-AB matvec compiled for the H100 (sm_90a) on the CPU (no GPU needed: Triton's bundled ptxas): it
becomes TMA bulk-tensor copies and wgmma, spills nothing and fits in shared memory; the schedule's split of tiles
over programs. Its run on a GPU is tests/test_gluon_matvec_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kernels import gluon_matvec as gm

H100_SMEM = 227 * 1024


def test_programs_own_every_tile_once() -> None:
    for tiles, grid in ((128, 132), (256, 132), (40, 7), (5, 5)):
        owned = [t for p in range(grid) for t in gm.program_tiles(p, grid, tiles)]
        assert owned == list(range(tiles))
        sizes = {len(gm.program_tiles(p, grid, tiles)) for p in range(grid)}
        assert max(sizes) - min(sizes) <= 1
    assert [gm.padded_rows(r) for r in (1, 8, 9, 16, 33, 64)] == [8, 8, 16, 16, 64, 64]


def test_launch_rejects_shapes_it_cannot_tile() -> None:
    x = torch.empty(4, 2048, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        gm.launch_args(x, torch.empty(100, 2048, dtype=torch.bfloat16), torch.empty(4, 100), gm.SwapABConfig(), 132)
    with pytest.raises(ValueError):
        gm.launch_args(x.float(), torch.empty(128, 2048), torch.empty(4, 128), gm.SwapABConfig(), 132)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_compiles_to_tma_and_wgmma_without_spills(rows: int) -> None:
    from bench.gluon_proto import code_report, compile_sm90

    x = torch.empty(rows, 2048, dtype=torch.bfloat16)
    w = torch.empty(16384, 2048, dtype=torch.bfloat16)
    out = torch.empty(rows, 16384, dtype=torch.bfloat16)
    cfg = gm.SwapABConfig()
    (grid, ), args, kwargs = gm.launch_args(x, w, out, cfg, 132)
    assert grid == 128 and kwargs["X_RESIDENT"] == (rows <= 16)
    rep = code_report(compile_sm90(gm.swapab_matvec_kernel, args, kwargs))
    assert rep["ptx_target"] == "sm_90a"
    assert rep["stack"] == 0 and rep["local"] == 0, rep
    assert rep["shared_bytes"] <= H100_SMEM, rep
    assert rep["cp.async.bulk.tensor (TMA)"] > 0 and rep["wgmma.mma_async"] > 0, rep
    assert rep["wgmma shapes"] == [f"m64n{gm.padded_rows(rows)}k16"]
    assert rep["ld.global"] == 0 and rep["mma.sync"] == 0  # every operand through TMA, every product on wgmma
