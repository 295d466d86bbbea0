"""Int8 weights (service/model/int8.py, GGUF's Q8_0 layout): the quantize/dequantize round trip and its error
bound, agreement with the `gguf` package's own Q8_0 quantizer, the kernel's packed layout, and the reference backend
on int8. The megakernel on int8 weights is checked in tests/test_megakernel_interpret.py (CPU) and
test_megakernel_gpu.py; a Q8_0 GGUF file's own values in tests/test_loaders.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.backends import make_decoder
from service.model.int8 import BLOCK, quantize, quantize_model
from service.model.synthetic import load_synthetic


def _fresh(*shape: int) -> torch.Tensor:
    """Random rows of very different magnitudes and blocks of different magnitudes within a row, one zero block."""
    g = torch.Generator().manual_seed(int.from_bytes(bytes(torch.randint(0, 255, (4,)).tolist()), "little"))
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[0])[:, None]
    w *= torch.rand(shape[1] // BLOCK, generator=g).repeat_interleave(BLOCK)[None, :] * 4
    w[0, :BLOCK] = 0.0
    return w


def test_round_trip_error_is_half_a_step_of_each_block() -> None:
    w = _fresh(48, 8 * BLOCK)
    q = quantize(w)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float16
    assert q.data.shape == w.shape and q.scale.shape == (48, 8) and q.block == BLOCK
    back = q.dequantize(torch.float32)
    # half a step of the block, and the float16 rounding of its scale over up to 127 steps: 2^-11 of it, or half
    # float16's smallest subnormal (2^-25) where the scale is that small (blocks whose values are below ~0.008)
    step = q.scale.float().repeat_interleave(BLOCK, dim=1)
    bound = step * (0.5 + 127 * 2.0**-11) + 127 * 2.0**-25
    assert ((back - w).abs() <= bound * (1 + 1e-3)).all()
    # each block's largest value reaches ±127 (the scale is the block's, not the row's), but the zero block
    top = q.data.abs().reshape(48, 8, BLOCK).amax(dim=2)
    assert (top[1:] == 127).all() and top[0, 0] == 0 and (top[0, 1:] == 127).all()
    assert torch.equal(back[0, :BLOCK], torch.zeros(BLOCK)) and q.scale[0, 0] == 0
    assert q.data.min() >= -127


def test_the_same_blocks_as_ggufs_q8_0() -> None:
    """What llama.cpp writes for Q8_0 (the `gguf` package's quantizer), bit for bit: a Q8_0 file and this format
    are one format."""
    gguf = pytest.importorskip("gguf")
    w = _fresh(16, 4 * BLOCK)
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(16, 4, 34)
    q = quantize(w)
    assert np.array_equal(q.scale.numpy(), blocks[:, :, :2].copy().view(np.float16)[:, :, 0])
    assert np.array_equal(q.data.numpy().reshape(16, 4, BLOCK), blocks[:, :, 2:].copy().view(np.int8))


def test_per_row_scales() -> None:
    """block=None ("int8-row"): one float32 scale per row, each row's largest value at ±127, half a step of error."""
    w = _fresh(24, 4 * BLOCK)[:, :3 * BLOCK + 7]  # rows need not split into blocks
    q = quantize(w, None)
    assert q.scale.shape == (24, 1) and q.scale.dtype == torch.float32 and q.block == w.shape[1]
    assert (q.data.abs().amax(dim=1) == 127).all()
    assert ((q.dequantize(torch.float32) - w).abs() <= q.scale / 2 * (1 + 1e-5) + 1e-12).all()


def test_a_row_that_does_not_split_into_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.randn(4, 40))


def test_packed_for_the_kernel_block_major() -> None:
    """pack_int8: the matrices stacked as bf16's are, the scales [K / 32, L, rows] (the LM head's [K / 32, V]), each
    scale where the kernel looks for block j of row r of layer l: j × L × rows + l × rows + r."""
    from service.backends.packing import pack_int8

    config, weights, _ = load_synthetic("tiny", seed=int(torch.randint(0, 2**31, (1,))))
    q = quantize_model(weights, torch.float32)
    p = pack_int8(config, q, torch.device("cpu"), torch.float32)
    assert p.int8 and p.int8_blocks and not p.fp8 and p.scales is not None
    L, h = config.num_layers, config.hidden_size
    gate = p.scales["gate"]
    assert gate.shape == (h // BLOCK, L, config.intermediate_size)
    flat = gate.reshape(-1)
    layer, row, blk = L - 1, 5, 1
    assert flat[blk * L * config.intermediate_size + layer * config.intermediate_size + row] == \
        q.layers[layer]["w_gate"].scale[row, blk]
    assert torch.equal(p.w_down[layer], q.layers[layer]["w_down"].data)
    assert torch.equal(p.scales["lm_head"], q.lm_head.scale.T)
    qkv = torch.cat([q.layers[0][n].data for n in ("wq", "wk", "wv")])
    assert torch.equal(p.wqkv[0], qkv)
    mats = sum(m.numel() for m in (p.wqkv, p.wo, p.w_gate, p.w_up, p.w_down, p.lm_head))
    assert p.nbytes() == mats + 2 * sum(s.numel() for s in p.scales.values()) + \
        4 * (p.attn_norm.numel() + p.mlp_norm.numel() + p.final_norm.numel())


def test_packed_for_the_kernel_per_row() -> None:
    """pack_int8 of row scales: float32 [L, rows] as FP8's (the LM head's [V]); a model mixing rows and blocks is
    refused."""
    from service.backends.packing import pack_int8

    config, weights, _ = load_synthetic("tiny", seed=int(torch.randint(0, 2**31, (1,))))
    q = quantize_model(weights, torch.float32, None)
    p = pack_int8(config, q, torch.device("cpu"), torch.float32)
    assert p.int8 and not p.int8_blocks and p.scales is not None
    assert p.scales["down"].shape == (config.num_layers, config.hidden_size)
    assert torch.equal(p.scales["down"][1], q.layers[1]["w_down"].scale[:, 0])
    assert torch.equal(p.scales["lm_head"], q.lm_head.scale[:, 0])
    q.layers[0]["wo"] = quantize(weights.layers[0].wo)
    with pytest.raises(ValueError, match="every matrix alike"):
        pack_int8(config, q, torch.device("cpu"), torch.float32)


def test_reference_backend_runs_the_quantized_model() -> None:
    """--weights int8 / int8-row on the reference backend: the same logits as a reference decoder built on the
    dequantized int8 weights, and not those of the original (the weights really changed)."""
    config, weights, _ = load_synthetic("tiny", seed=int(torch.randint(0, 2**31, (1,))))
    plain = make_decoder("reference", config, weights, 2, 64, "cpu")
    ids = torch.randint(0, config.vocab_size, (20,)).tolist()
    c = plain.prefill(0, ids)
    for fmt, block in (("int8", BLOCK), ("int8-row", None)):
        int8 = make_decoder("reference", config, weights, 2, 64, "cpu", weight_format=fmt)
        deq = quantize_model(weights, torch.float32, block).dequantized
        a, b = int8.prefill(0, ids), make_decoder("reference", config, deq, 2, 64, "cpu").prefill(0, ids)
        assert torch.equal(a, b), fmt
        assert not torch.equal(a, c), fmt
