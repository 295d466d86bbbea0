"""load_model on Hugging Face checkpoint directories (tiny random Llama with llama3 RoPE, tiny Qwen2 with QKV
bias, an untied head), checked against transformers' own forward; the errors a bad spec raises; the
synthetic models' shapes."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from service.backends.reference import ReferenceDecoder
from service.model.config import ModelError
from service.model.hf_checkpoint import config_from_hf
from service.model.loader import load_model
from service.model.synthetic import SHAPES, byte_level_alphabet, byte_tokenizer, load_synthetic

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _randomize(model, seed):
    """HF initialises norms to 1 and biases to 0: make them random too, so that loading them is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _write_checkpoint(path, hf_model, hf_tok, template_in_config=True):
    hf_model.save_pretrained(path, safe_serialization=True)
    hf_tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}}
    if template_in_config:
        cfg["chat_template"] = CHAT_TEMPLATE
    else:  # transformers 5 writes the template to its own file
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """name → (directory, transformers model): tiny random Llama (llama3 RoPE, GQA, tied; vocabulary = our
    GGUF tokenizer), the same untied, and a tiny Qwen2 (QKV bias; byte-level tokenizer, vocab padded)."""
    out = {}
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, initializer_range=0.1, rms_norm_eps=1e-5, max_position_embeddings=256)
    for name, tied in [("llama", True), ("llama_untied", False)]:
        torch.manual_seed(1 if tied else 2)
        cfg = transformers.LlamaConfig(**common, vocab_size=tokenizer.vocab_size, rope_parameters=dict(LLAMA3_ROPE),
                                       tie_word_embeddings=tied, bos_token_id=1, eos_token_id=[2, 0])
        m = _randomize(transformers.LlamaForCausalLM(cfg), seed=3)
        out[name] = (_write_checkpoint(tmp_path_factory.mktemp(name), m, tokenizer.hf, template_in_config=tied), m)
    torch.manual_seed(4)
    byte_tok = byte_tokenizer(258)
    cfg = transformers.Qwen2Config(**common, vocab_size=300, rope_parameters={"rope_type": "default",
                                   "rope_theta": 1e6}, tie_word_embeddings=True, eos_token_id=257)
    m = _randomize(transformers.Qwen2ForCausalLM(cfg), seed=5)
    out["qwen2"] = (_write_checkpoint(tmp_path_factory.mktemp("qwen2"), m, byte_tok.hf), m)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: load_model(str(path)) for name, (path, _) in checkpoints.items()}


@pytest.mark.parametrize("name", ["llama", "llama_untied", "qwen2"])
def test_config_read(name, loaded, checkpoints):
    c, h = loaded[name].config, checkpoints[name][1].config
    assert c.architecture == ("qwen2" if name == "qwen2" else "llama")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        64, 2, 4, 2, 16, 128)
    assert c.vocab_size == h.vocab_size and c.rms_norm_eps == 1e-5
    assert c.qkv_bias == (name == "qwen2")
    assert c.tie_word_embeddings == (name != "llama_untied")
    if name == "qwen2":
        assert c.rope_scaling is None and c.rope_theta == 1e6 and c.eos_token_ids == (257,)
    else:
        assert c.rope_theta == 500000.0 and c.eos_token_ids == (2, 0) and c.bos_token_id == 1
        s = c.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (8, 1, 4, 64)
    # the RoPE frequencies (llama3 scaling: high, medium and low bands at head_dim 16) are transformers' own
    torch.testing.assert_close(c.rope_inv_freq(), checkpoints[name][1].model.rotary_emb.inv_freq, rtol=0, atol=0)
    n_hf = sum(p.numel() for p in checkpoints[name][1].parameters())
    assert c.num_params() == n_hf


@pytest.mark.parametrize("name", ["llama", "llama_untied", "qwen2"])
def test_weights_read(name, loaded, checkpoints):
    w, sd = loaded[name].weights, checkpoints[name][1].state_dict()
    torch.testing.assert_close(w.embed, sd["model.embed_tokens.weight"], rtol=0, atol=0)
    if name == "llama_untied":
        assert w.lm_head is not w.embed
        torch.testing.assert_close(w.lm_head, sd["lm_head.weight"], rtol=0, atol=0)
        assert not torch.equal(w.lm_head, w.embed)
    else:
        assert w.lm_head is w.embed
    lw = w.layers[1]
    torch.testing.assert_close(lw.wq, sd["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(lw.mlp_norm, sd["model.layers.1.post_attention_layernorm.weight"], rtol=0, atol=0)
    if name == "qwen2":
        torch.testing.assert_close(lw.bk, sd["model.layers.1.self_attn.k_proj.bias"], rtol=0, atol=0)
    else:
        assert lw.bq is None


@pytest.mark.parametrize("name", ["llama", "llama_untied", "qwen2"])
def test_logits_and_greedy_match_transformers(name, loaded, checkpoints):
    """Two sequences in one decoder (prompts of 70 and 45 tokens: positions past the llama3 `original` 64),
    prefill each, then 8 decode steps for both in one call each; every step's logits against transformers'
    forward over the whole sequence, and the greedy tokens against transformers' generate."""
    model, hf = loaded[name], checkpoints[name][1]
    gen = torch.Generator().manual_seed(7)
    vocab = min(model.tokenizer.vocab_size, model.config.vocab_size)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (70, 45)]
    dec = ReferenceDecoder(model.config, model.weights, max_slots=3, max_context=128, device="cpu",
                           dtype=torch.float32)
    slots, steps = [2, 0], 8
    logits = [[dec.prefill(s, p)] for s, p in zip(slots, prompts)]
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        for seq, lg in zip(seqs, logits):
            seq.append(int(lg[-1].argmax()))
        out = dec.decode(slots, [s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for i, lg in enumerate(logits):
            lg.append(out.logits[i])
    with torch.inference_mode():
        for p, seq, lg in zip(prompts, seqs, logits):
            ref = hf(torch.tensor([seq])).logits[0, len(p) - 1:].float()
            torch.testing.assert_close(torch.stack(lg[: steps + 1]), ref, rtol=1e-4, atol=1e-4)
            x = torch.tensor([p])
            greedy = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=steps,
                                 eos_token_id=None)[0, len(p):].tolist()
            assert seq[len(p):] == greedy


def test_tokenizer_read(loaded, tokenizer):
    llama, qwen = loaded["llama"].tokenizer, loaded["qwen2"].tokenizer
    text = "Hello, world! 12 東京 🎉"
    assert llama.encode(text) == tokenizer.encode(text)
    assert llama.decode(llama.encode(text)) == text
    assert qwen.encode("hi") == [ord("h"), ord("i")] and qwen.decode(qwen.encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert llama.apply_chat_template(msgs) == expected  # from tokenizer_config.json
    assert loaded["llama_untied"].tokenizer.apply_chat_template(msgs) == expected  # from chat_template.jinja
    assert llama.eos_token == "<|im_end|>" and llama.bos_token is None


# -- GGUF files written the way llama.cpp's converter writes them (F32), for architectures and RoPE the embedded
# SmolLM2 file does not exercise: Llama-3.x's `llama3` scaling (a rope_freqs tensor), Qwen2 (QKV bias, no Q/K
# row interleaving) --------------------------------------------------------------------------------------------

def _llamacpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows → interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_rope_factors(cfg):
    """convert_hf_to_gguf.py's `llama3` rope_freqs (per-frequency divisors), computed as it does."""
    rp = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _q8_0_bytes(a):
    """A matrix as Q8_0 blocks (float16 scale, 32 int8) with scales twice what a quantizer picks (values within
    ±64): blocks only a loader that keeps the file's own values, instead of requantizing, returns as written."""
    import gguf
    import numpy as np

    blocks = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape[0], -1, 34).copy()
    scale = blocks[:, :, :2].view(np.float16)
    scale *= 2
    q = blocks[:, :, 2:].view(np.int8)
    q //= 2
    return blocks.reshape(a.shape[0], -1)


def _write_gguf(path, hf, arch, rope_factors=None, q8_0=False):
    """A GGUF file as llama.cpp's converter writes one (F32; with q8_0, every matrix and the embedding in Q8_0)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    if q8_0:
        add = w.add_tensor

        def add_q8_0(name, a):
            if a.ndim == 2:
                return add(name, _q8_0_bytes(a), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            return add(name, a)

        w.add_tensor = add_q8_0
    w.add_name("tiny-" + arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    tokens = [alphabet[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if arch == "llama":
        factors = _llamacpp_rope_factors(cfg) if rope_factors is None else rope_factors
        w.add_tensor("rope_freqs.weight", factors.numpy())
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _llamacpp_permute(q, nh), _llamacpp_permute(k, nkv)
        w.add_tensor(f"blk.{i}.attn_q.weight", q)
        w.add_tensor(f"blk.{i}.attn_k.weight", k)
        for hf_name, gguf_name in names.items():
            if p + hf_name in sd:
                w.add_tensor(f"blk.{i}.{gguf_name}", sd[p + hf_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_llama3_rope_and_qwen2(arch, tmp_path):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, initializer_range=0.1, rms_norm_eps=1e-5, max_position_embeddings=256,
                  vocab_size=272)
    torch.manual_seed(11)
    if arch == "llama":
        rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 32}  # head_dim 16: all three bands
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope,
                                                                    tie_word_embeddings=False))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True))
    hf = _randomize(hf, seed=12)
    model = load_model(str(_write_gguf(tmp_path / f"tiny-{arch}.gguf", hf, arch)))
    c = model.config
    assert c.architecture == arch and c.qkv_bias == (arch == "qwen2") and c.eos_token_ids == (257,)
    assert c.tie_word_embeddings == (arch == "qwen2")
    if arch == "llama":
        s = c.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (8, 1, 4, 32)
        torch.testing.assert_close(c.rope_inv_freq(), hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    else:
        assert c.rope_scaling is None
    assert model.tokenizer.encode("hi") == [104, 105] and model.tokenizer.decode([104, 105, 257]) == "hi"
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(13)).tolist()
    dec = ReferenceDecoder(c, model.weights, max_slots=1, max_context=128, device="cpu", dtype=torch.float32)
    ours = [dec.prefill(0, ids[:90])] + [dec.decode([0], [t], [90 + i]).logits[0] for i, t in enumerate(ids[90:])]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, 89:].float()
    torch.testing.assert_close(torch.stack(ours), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_q8_0_matrices_keep_their_own_values(arch, tmp_path):
    """A GGUF whose matrices and embedding are Q8_0: the loader keeps every layer matrix and the LM head as the
    file's int8 values and float16 scales (ModelWeights.int8, Llama's Q/K rows un-interleaved like the floats),
    the float tensors are exactly their dequantized values, and the int8 weight format uses them bit for bit."""
    import numpy as np

    from service.model.int8 import quantize_model

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, initializer_range=0.1, rms_norm_eps=1e-5, max_position_embeddings=256,
                  vocab_size=272)
    torch.manual_seed(int.from_bytes(np.random.bytes(4), "little"))
    if arch == "llama":
        rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 32}
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope,
                                                                    tie_word_embeddings=False))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True))
    hf = _randomize(hf, seed=int(torch.randint(0, 2**31, (1,))))
    weights = load_model(str(_write_gguf(tmp_path / f"q8-{arch}.gguf", hf, arch, q8_0=True))).weights
    assert weights.int8 is not None and len(weights.int8) == 2 * 7 + 1
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    head = sd["lm_head.weight"] if arch == "llama" else sd["model.embed_tokens.weight"]
    written = _q8_0_bytes(head).reshape(head.shape[0], -1, 34)
    m = weights.int8["lm_head"]
    assert np.array_equal(m.data.numpy().reshape(written.shape[0], -1, 32), written[:, :, 2:].view(np.int8))
    assert np.array_equal(m.scale.numpy(), written[:, :, :2].view(np.float16)[:, :, 0])
    assert m.data.abs().max() <= 64  # the file's values, not requantized (a quantizer's reach ±127)
    q = quantize_model(weights, torch.float32)
    assert q.lm_head is m
    for i, lw in enumerate(weights.layers):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            own = weights.int8[f"layers.{i}.{name}"]
            assert q.layers[i][name] is own
            assert torch.equal(own.dequantize(torch.float32), getattr(lw, name)), (i, name)
    assert torch.equal(m.dequantize(torch.float32), weights.lm_head)
    # Llama's Q rows un-interleaved: they match the HF checkpoint's (to Q8_0's rounding)
    wq = torch.from_numpy(sd["model.layers.0.self_attn.q_proj.weight"])
    assert (weights.layers[0].wq - wq).abs().max() <= wq.abs().max() / 60


def test_gguf_rope_freqs_not_llama3_is_refused(tmp_path):
    """rope_freqs that no `llama3` scaling reproduces: refused, rather than silently ignored."""
    torch.manual_seed(14)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=272, rope_parameters=dict(LLAMA3_ROPE))
    factors = _llamacpp_rope_factors(cfg).flip(0)
    path = _write_gguf(tmp_path / "odd.gguf", transformers.LlamaForCausalLM(cfg), "llama", rope_factors=factors)
    _raises(path, "rope_freqs", "not supported")


# -- configs of the real checkpoints (their config.json, transformers 4 style) and the synthetic shapes ------------

REAL_CONFIGS = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12, "num_hidden_layers": 28,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "vocab_size": 49152,
    },
}
# DESIGN.md: hidden, layers, heads, kv heads, head_dim, ffn, vocab, theta, qkv bias, tied
DESIGN_SHAPES = {
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, 500000.0, False, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 128, 8960, 151936, 1e6, True, True),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, 100000.0, False, True),
}
PARAMS = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-1.5b": 1_543_714_304, "smollm2-135m": 134_515_008}


def _shape(c):
    return (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.rope_theta, c.qkv_bias, c.tie_word_embeddings)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_synthetic_shapes_are_the_real_ones(name):
    real = config_from_hf(REAL_CONFIGS[name], name)
    syn = SHAPES[name]
    assert _shape(syn) == _shape(real) == DESIGN_SHAPES[name]
    assert syn.rope_scaling == real.rope_scaling
    assert syn.rms_norm_eps == real.rms_norm_eps and syn.max_position_embeddings == real.max_position_embeddings
    assert syn.num_params() == real.num_params() == PARAMS[name]
    assert syn.name == f"synthetic:{name}"


def test_llama_3_2_rope_scaling():
    s = SHAPES["llama-3.2-1b"].rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (32, 1, 4, 8192)
    cfg = transformers.LlamaConfig(**{k: v for k, v in REAL_CONFIGS["llama-3.2-1b"].items() if k != "architectures"})
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(SHAPES["llama-3.2-1b"].rope_inv_freq(), rope.inv_freq, rtol=0, atol=0)
    assert SHAPES["llama-3.2-1b"].num_params() * 2 / 1e9 == pytest.approx(2.47, abs=0.01)  # bf16 GB


def test_synthetic_smollm2_model(tokenizer):
    m = load_model("synthetic:smollm2-135m")
    c, w = m.config, m.weights
    assert m.spec == "synthetic:smollm2-135m" and c is SHAPES["smollm2-135m"]
    assert w.embed.shape == (49152, 576) and w.lm_head is w.embed and len(w.layers) == 30
    lw = w.layers[0]
    assert (lw.wq.shape, lw.wk.shape, lw.wv.shape, lw.wo.shape) == ((576, 576), (192, 576), (192, 576), (576, 576))
    assert (lw.w_gate.shape, lw.w_up.shape, lw.w_down.shape) == ((1536, 576), (1536, 576), (576, 1536))
    assert lw.bq is None and w.embed.dtype == torch.float32
    n = w.embed.numel() + w.final_norm.numel() + sum(t.numel() for x in w.layers for t in vars(x).values()
                                                     if t is not None)
    assert n == c.num_params() == 134_515_008
    # SmolLM2's own tokenizer (shipped): synthetic prompts tokenize like the real model's
    text = "Hello, world! 2024 東京 🎉"
    assert m.tokenizer.encode(text) == tokenizer.encode(text)
    assert m.tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == tokenizer.encode_chat(
        [{"role": "user", "content": "hi"}])
    assert m.tokenizer.decode(m.tokenizer.encode(text)) == text


def test_synthetic_is_deterministic():
    a = load_synthetic("smollm2-135m", num_layers=2)[1]
    b = load_synthetic("smollm2-135m", num_layers=2)[1]
    c = load_synthetic("smollm2-135m", num_layers=2, seed=1)[1]
    for x, y in [(a.embed, b.embed), (a.layers[1].wq, b.layers[1].wq), (a.final_norm, b.final_norm)]:
        assert torch.equal(x, y)
    assert not torch.equal(a.layers[0].wq, c.layers[0].wq)
    bf = load_synthetic("smollm2-135m", num_layers=2, dtype=torch.bfloat16)[1]
    assert bf.embed.dtype == torch.bfloat16 and torch.equal(bf.embed, a.embed.to(torch.bfloat16))


def test_synthetic_byte_tokenizer():
    tok = byte_tokenizer(300)
    assert tok.encode("hello") == list(b"hello")
    assert tok.decode([299, 104]) == "eh"  # ids past the bytes read as letters


def test_synthetic_decodes():
    config, weights, _ = load_synthetic("smollm2-135m", num_layers=2)
    dec = ReferenceDecoder(config, weights, max_slots=2, max_context=32, device="cpu", dtype=torch.float32)
    first = dec.prefill(0, [1, 2, 3])
    out = dec.decode([0], [int(first.argmax())], [3])
    assert out.logits.shape == (1, 49152) and torch.isfinite(out.logits).all()


# -- errors --------------------------------------------------------------------------------------------------------

@pytest.fixture
def broken(tmp_path, checkpoints):
    """A copy of the tiny Llama checkpoint to break."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"][0], path)
    return path


def _raises(spec, *fragments):
    with pytest.raises(ModelError) as e:
        load_model(str(spec))
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_error_wrong_path(tmp_path):
    _raises(tmp_path / "nowhere", "model not found", "nowhere")
    _raises(tmp_path / "nowhere.gguf", "GGUF file not found", "nowhere.gguf")


def test_error_not_a_model_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _raises(tmp_path / "notes.txt", "notes.txt", "not a .gguf file")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 10)
    _raises(tmp_path / "bad.gguf", "bad.gguf", "not a readable GGUF file")


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json"])
def test_error_missing_file(missing, broken):
    (broken / missing).unlink()
    _raises(broken, missing, "missing")


def test_error_no_weights(broken):
    for f in broken.glob("*.safetensors"):
        f.unlink()
    _raises(broken, "safetensors")


def test_error_missing_tensor(broken):
    from safetensors.torch import load_file, save_file

    [shard] = list(broken.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard)
    _raises(broken, "layers.1.mlp.down_proj.weight", "missing")


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_error_llama_biases(field, broken):
    """Llama's attention_bias also biases o_proj (and mlp_bias the MLP): weights the decoder has no place for."""
    cfg = json.loads((broken / "config.json").read_text())
    cfg[field] = True
    (broken / "config.json").write_text(json.dumps(cfg))
    _raises(broken, field, "not supported")


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_error_unknown_architecture(arch, broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = [arch]
    (broken / "config.json").write_text(json.dumps(cfg))
    _raises(broken, arch, "not supported", "LlamaForCausalLM")


def test_error_unsupported_rope_scaling(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (broken / "config.json").write_text(json.dumps(cfg))
    _raises(broken, "yarn", "not supported")


def test_error_unknown_synthetic():
    _raises("synthetic:gpt-5", "unknown synthetic model", "gpt-5", "synthetic:llama-3.2-1b")
