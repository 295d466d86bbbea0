"""The Gluon swap-AB matvec (kernels/gluon_matvec.py) on an sm_90 GPU: gate/up's shape at 1, 16 and 64 rows
against the float32 product, fresh random inputs every run; and a ragged program split (a grid that does not divide
the tiles), x streamed instead of resident, and one row of a 16-row bucket (rows past R zero-filled by the TMA)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs an sm_90 CUDA GPU", allow_module_level=True)

N, K = 16384, 2048


def _inputs(rows: int, n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
    return x, w, seed


def _close(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, seed: int) -> None:
    ref = x.float() @ w.float().t()
    lib = (x @ w.t()).float()
    err = (out.float() - ref).abs().max().item()
    lib_err = (lib - ref).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= max(2 * lib_err, 1e-2 * ref.abs().max().item()), (seed, err, lib_err)


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("cfg", ["128x128x4", "128x64x8", "64x128x4"])
def test_gateup_matches_float32(rows: int, cfg: str) -> None:
    from kernels import gluon_matvec as gm

    bm, bk, stages = map(int, cfg.split("x"))
    x, w, seed = _inputs(rows)
    out = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    gm.swapab_matvec(x, w, out, gm.SwapABConfig(bm=bm, bk=bk, stages=stages))
    _close(x, w, out, seed)


@pytest.mark.parametrize("rows", [3, 16])
def test_ragged_grid_and_streamed_x(rows: int) -> None:
    """7 programs over 40 tiles (5 or 6 each), x streamed per step: every column written once, right."""
    from kernels import gluon_matvec as gm

    x, w, seed = _inputs(rows, n=40 * 64, k=1024)
    for resident in (True, False):
        out = torch.full((rows, w.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        gm.swapab_matvec(x, w, out, gm.SwapABConfig(bm=64, bk=128, stages=3, x_resident=resident), grid=7)
        _close(x, w, out, seed)


def test_baseline_matches_float32() -> None:
    from bench.gluon_proto import _baseline_fn, megakernel_tile

    for rows in (1, 16, 64):
        x, w, seed = _inputs(rows)
        _close(x, w, _baseline_fn(megakernel_tile(rows), 132)(x, w), seed)
