"""The loader's prototype (kernels/gluon_chain.py) on an sm_90 GPU: the chained layer matrices, with the ring run
across phase boundaries, drained at each, with each task waiting only for its input tiles, or fed by tasks claimed
at run time, give every phase's output of the same
chain in torch (on the kernel's own input of the phase), on fresh random inputs, at 1 and 16 rows, bf16 and W8A8
FP8; no wait fails."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs an sm_90 CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("mode", ["ring", "drain", "tiles", "steal-1", "steal-mix"])
def test_chain_matches_torch(weights: str, rows: int, mode: str) -> None:
    from bench.gluon_chain import STAGES, Chain

    seed = int.from_bytes(os.urandom(4), "little")
    chain = Chain(weights, rows, 3, seed)
    rec = chain.check(chain.launcher(mode, STAGES[weights][0]))
    assert rec["wait_errors"] == 0, (seed, rec)
    assert rec["ok"], (seed, rec)
    assert rec["ref_max_abs"] > 0.1  # the chain carries signal, not zeros
