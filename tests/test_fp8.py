"""FP8 weights (service/model/fp8.py): the quantize/dequantize round trip and its error bound, the reference backend
on FP8, and a checkpoint shipped in FP8 (a tiny one the test writes) loaded with its own values and scales.
The megakernel on FP8 weights is checked in tests/test_megakernel_interpret.py (CPU) and test_megakernel_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.backends import make_decoder
from service.model.fp8 import E4M3_MAX, activations_e4m3, from_checkpoint, quantize, quantize_model
from service.model.loader import load_model
from service.model.synthetic import load_synthetic


def _fresh(*shape: int) -> torch.Tensor:
    """Random rows of very different magnitudes (weights are never all alike), some exact zeros."""
    g = torch.Generator().manual_seed(int.from_bytes(bytes(torch.randint(0, 255, (4,)).tolist()), "little"))
    w = torch.randn(*shape, generator=g) * torch.logspace(-4, 2, shape[0])[:, None]
    w[0, :3] = 0.0
    return w


def test_round_trip_error_is_within_e4m3_rounding() -> None:
    w = _fresh(64, 300)
    q = quantize(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    back = q.dequantize(torch.float32)
    # scales are powers of two, and each row's largest value lands in the top binade of e4m3
    assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))
    top = q.data.float().abs().amax(dim=1)
    assert ((top >= E4M3_MAX / 2) & (top <= E4M3_MAX)).all()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below the normal range, half a subnormal step
    bound = w.abs() * 2.0**-4 + q.scale[:, None] * 2.0**-10
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(back[0, :3], torch.zeros(3))
    # every dequantized weight is exactly a bf16 number: the reference runs the very values the kernel reads
    assert torch.equal(q.dequantize(torch.bfloat16).float(), back)


def test_a_zero_row_quantizes_to_zeros() -> None:
    q = quantize(torch.zeros(3, 8))
    assert torch.equal(q.dequantize(torch.float32), torch.zeros(3, 8))
    assert torch.equal(q.scale, torch.ones(3))


def test_w8a8_activations_round_each_run_of_columns_on_its_own_scale() -> None:
    """W8A8's activations (what the kernel's W8A8 tiles compute, dequantized): each run of columns on its own scale,
    its largest value kept, every value within its normal range at most half an e4m3 step off (3 mantissa
    bits: 1/16 of the value), zero runs zero, and a run's values independent of the other runs' (a huge value in
    one run costs its neighbours nothing)."""
    x = _fresh(8, 300)
    x[3, 256:] = 0.0  # the ragged last run of row 3: zeros
    x[5, :10] *= 1e6  # one huge run
    q = activations_e4m3(x, 128)
    assert q.shape == x.shape and q.dtype == x.dtype
    for r in range(x.shape[0]):
        for c0 in range(0, 300, 128):
            run, qrun = x[r, c0:c0 + 128], q[r, c0:c0 + 128]
            # the run's absmax maps to 448 exactly (scaled back to within float32's rounding)
            torch.testing.assert_close(qrun.abs().max(), run.abs().max(), rtol=1e-6, atol=0)
            normal = run.abs() >= run.abs().max() * 2.0 ** -6  # e4m3's normal range below its largest
            assert ((qrun - run).abs()[normal] <= run.abs()[normal] / 16).all(), (r, c0)
    assert (q[3, 256:] == 0).all()
    assert torch.equal(q[5, 128:], activations_e4m3(x[5:6, 128:], 128)[0])


def test_each_bucket_keeps_its_own_lm_head_and_gate_up_tiles() -> None:
    """The tile table's cases do not leak into each other (kernels/tiles.py): bf16's LM head in 64-row boxes at every
    bucket under 32 rows; 8-bit gate/up through TMA in 64-row tiles at one row, 32-row tiles at
    2-8, and from 16 rows its W8A8 (e4m3) or 16-row tiles (int8 with row scales), with the LM head of 16 rows W8A8
    for e4m3 whatever gate/up took; int8 blocks keep their own tiles. Stages where measured: bf16's 16-row bucket 6,
    e4m3's one-row gate/up and LM head 3."""
    from kernels.instructions import Op
    from kernels.tiles import GATEUP_8BIT_ONE_ROW, W8A8_LMHEAD, default_tiles

    for rows in (1, 2, 4, 8, 16):
        bf16 = default_tiles(False, rows)
        assert bf16[Op.LMHEAD]._replace(stages=4) == default_tiles(False, 1)[Op.LMHEAD]
        assert bf16[Op.LMHEAD].rows == 64 and bf16[Op.LMHEAD].tma
        assert bf16[Op.GATEUP].rows == 16
        assert {t.stages for t in bf16.values()} == {6 if rows == 16 else 4}  # measured per bucket (kernels/tiles.py)
        for e4m3 in (True, False):
            t = default_tiles(True, rows, e4m3=e4m3)
            want = GATEUP_8BIT_ONE_ROW._replace(stages=3 if e4m3 else 4) if rows == 1 else None
            if want is not None:
                assert t[Op.GATEUP] == want and t[Op.GATEUP].tma
            elif rows < 16:
                assert t[Op.GATEUP].rows == 32 and not t[Op.GATEUP].tma
            else:
                assert t[Op.GATEUP].w8a8 == e4m3 and t[Op.GATEUP].rows == (64 if e4m3 else 16)
            assert (t[Op.LMHEAD] == W8A8_LMHEAD) == (rows == 16 and e4m3)
            assert t[Op.LMHEAD].rows == 128 and t[Op.LMHEAD].tma or rows == 16 and e4m3
            assert t[Op.LMHEAD].stages == (3 if rows == 1 and e4m3 else 6 if rows == 16 and e4m3 else
                                           3 if rows == 16 else 4)
        assert default_tiles(True, rows, int8=True)[Op.GATEUP].rows == 16


def test_w8a8_where_the_default_tiles_say() -> None:
    """e4m3 weights run gate/up W8A8 in launches of 16 rows and more, down in the 32- and 64-row buckets (its K over
    4 tasks; fit_to_programs keeps a short K weight-only), and the LM head W8A8 where it has 16 rows (the LM
    head's table is its own rows', at most the 16 sampled of any bucket: kernels/tiles.py), and int8 with row scales
    gate/up and the LM head (int8 activations); fewer rows, bf16 and int8 blocks never; W8A8 tiles over bf16 weights
    are refused."""
    from kernels.instructions import Op
    from kernels.megakernel import KernelConfig
    from kernels.tiles import MATVECS, MatvecTile, default_tiles
    from service.backends.megakernel import MegakernelDecoder

    for rows in (1, 8, 16, 32, 64):
        tiles = default_tiles(True, rows, e4m3=True)
        assert tiles[Op.GATEUP].w8a8 == (rows >= 16) and (tiles[Op.GATEUP].swap or rows < 16)
        assert tiles[Op.LMHEAD].w8a8 == (rows == 16) and (tiles[Op.LMHEAD].swap or rows != 16)
        assert tiles[Op.DOWN].w8a8 == (rows >= 32) and (tiles[Op.DOWN].k_splits == 4) == (rows >= 32)
        assert not any(t.w8a8 for op, t in tiles.items() if op not in (Op.GATEUP, Op.LMHEAD, Op.DOWN))
        assert not any(t.w8a8 for t in default_tiles(True, rows).values())  # int8 with row scales
        assert not any(t.w8a8 for t in default_tiles(False, rows).values())
    config, w, _ = load_synthetic("tiny")

    def decoder(fmt: str, cfg: KernelConfig | None = None) -> MegakernelDecoder:
        return MegakernelDecoder(config, w, max_slots=16, max_context=64, device="cpu", dtype=torch.float32,
                                 weight_format=fmt, kernel_config=cfg, use_cuda_graphs=False)

    fp8 = decoder("fp8").kernel
    assert fp8.tiles(16)[Op.GATEUP].w8a8 and fp8.tiles(64)[Op.GATEUP].w8a8 and not fp8.tiles(8)[Op.GATEUP].w8a8
    # a 64-row step samples 16 rows: its LM head runs the 16-row W8A8 tiles
    assert fp8.tiles(16)[Op.LMHEAD].w8a8 and fp8.tiles(64)[Op.LMHEAD].w8a8 and not fp8.tiles(8)[Op.LMHEAD].w8a8
    # int8 with row scales: the same W8A8 tiles, int8 activations; Q8_0's block scales never
    int8_row = decoder("int8-row").kernel
    for rows in (16, 64):
        assert int8_row.tiles(rows)[Op.GATEUP].w8a8 and int8_row.tiles(rows)[Op.LMHEAD].w8a8
        # (the tiny model's K of down is short: weight-only and unsplit in every bucket, fit_to_programs)
        assert not fp8.tiles(rows)[Op.DOWN].w8a8 and not int8_row.tiles(rows)[Op.DOWN].w8a8
    assert not any(t.w8a8 for t in int8_row.tiles(8).values())
    assert not any(t.w8a8 for rows in (1, 16, 64) for t in decoder("int8").kernel.tiles(rows).values())
    a8 = MatvecTile(rows=16, k_chunk=16, k_slices=1, swap=True, w8a8=True)
    bf16 = decoder("bf16", KernelConfig(tiles={op: a8 for op in MATVECS})).kernel
    with pytest.raises(ValueError, match="W8A8 tiles need FP8 or int8-row weights"):
        bf16.tiles(16)


def test_checkpoint_scales_per_tensor_and_per_row() -> None:
    data = (torch.randn(4, 8) * 10).to(torch.float8_e4m3fn)
    per_tensor = from_checkpoint(data, torch.tensor(0.5))
    assert torch.equal(per_tensor.dequantize(torch.float32), data.float() * 0.5)
    rows = torch.tensor([[1.0], [2.0], [0.25], [4.0]])
    per_row = from_checkpoint(data, rows)
    assert torch.equal(per_row.dequantize(torch.float32), data.float() * rows)
    with pytest.raises(ValueError, match="per-row"):
        from_checkpoint(data, torch.ones(2))


def test_reference_backend_runs_the_quantized_model() -> None:
    """--weights fp8 on the reference backend: the same logits as a reference decoder built on the dequantized
    FP8 weights, and not those of the bf16-exact original (the weights really changed)."""
    config, weights, _ = load_synthetic("tiny", seed=int(torch.randint(0, 2**31, (1,))))
    fp8 = make_decoder("reference", config, weights, 2, 64, "cpu", weight_format="fp8")
    plain = make_decoder("reference", config, weights, 2, 64, "cpu")
    oracle = make_decoder("reference", config, quantize_model(weights, torch.float32).dequantized, 2, 64, "cpu")
    ids = torch.randint(0, config.vocab_size, (20,)).tolist()
    a, b, c = fp8.prefill(0, ids), oracle.prefill(0, ids), plain.prefill(0, ids)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    with pytest.raises(ValueError, match="weight format"):
        make_decoder("reference", config, weights, 2, 64, "cpu", weight_format="int4")


def test_a_checkpoint_in_fp8_loads_with_its_own_values(tmp_path, tokenizer) -> None:
    """A Hugging Face directory whose linear layers are float8_e4m3fn with a `weight_scale` (per tensor for the
    attention, per row for the MLP, as published FP8 checkpoints store them): the loader keeps the checkpoint's own
    FP8 values and scales (quantize_model uses them bit for bit), and the tensors it hands the bf16 path are their
    dequantized values."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=tokenizer.vocab_size, tie_word_embeddings=True,
                                   max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (shard,) = tmp_path.glob("*.safetensors")
    tensors = load_file(shard)
    written = {}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name].float()
        if ".mlp." in name:  # per row
            scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        else:  # per tensor
            scale = w.abs().amax().reshape(1) / E4M3_MAX
        data = (w / scale).to(torch.float8_e4m3fn)
        tensors[name], tensors[name.replace("weight", "weight_scale")] = data, scale
        written[name] = (data, scale)
    save_file(tensors, shard)

    model = load_model(str(tmp_path))
    assert model.weights.fp8 is not None and len(model.weights.fp8) == 2 * 7
    layer = model.weights.layers[1]
    data, scale = written["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(layer.wq, data.float() * scale)
    data, scale = written["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.w_down, data.float() * scale)
    q = quantize_model(model.weights, torch.float32)
    assert torch.equal(q.layers[1]["w_down"].data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.layers[1]["w_down"].scale, scale.reshape(-1))
    # the LM head (tied, not in the checkpoint as FP8) is quantized here
    assert torch.equal(q.lm_head.dequantize(torch.float32), quantize(model.weights.embed).dequantize(torch.float32))


def test_8bit_launches_of_64_rows_run_8_warps_a_program() -> None:
    """FP8 and int8-row launches of 64 rows run 8 warps a program (KernelConfig.wide_warps_8bit: their 64-row step
    5.7% and 10% faster on the H100), every other launch num_warps: fewer rows, bf16 and Q8_0 blocks (not measured
    faster), and the variant that sets it back to 4."""
    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder

    config, w, _ = load_synthetic("tiny")

    def kernel(fmt: str, cfg: KernelConfig | None = None):  # noqa: ANN202
        return MegakernelDecoder(config, w, max_slots=16, max_context=64, device="cpu", dtype=torch.float32,
                                 weight_format=fmt, kernel_config=cfg, use_cuda_graphs=False).kernel

    for fmt in ("fp8", "int8-row"):
        k = kernel(fmt)
        assert [k.warps(rows) for rows in (1, 16, 32, 64)] == [4, 4, 4, 8], fmt
        assert kernel(fmt, KernelConfig(wide_warps_8bit=4)).warps(64) == 4
    assert kernel("bf16").warps(64) == 4 and kernel("int8").warps(64) == 4
    assert kernel("bf16", KernelConfig(num_warps=8)).warps(1) == 8
