"""The reference decoder against Hugging Face transformers on the embedded GGUF (SmolLM2-135M-Instruct Q4_1):
same weights, same config, greedy output token for token, alone and batched, and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from service.backends.reference import ReferenceDecoder

NEW_TOKENS = 32
MAX_CONTEXT = 512

_LONG = " ".join(
    f"Paragraph {i}: the committee reviewed the quarterly report on river water quality, noting that "
    f"sediment levels near station {i} rose after the spring floods, while nitrate readings stayed flat."
    for i in range(8)
)


def _prompts(tok):
    chat = tok.encode_chat([{"role": "user", "content": "What is the tallest mountain in the world?"}])
    multi_turn = tok.encode_chat([
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "And a larger one?"},
    ])
    one = tok.encode("Hello")
    assert len(one) == 1
    prompts = {
        "plain": tok.encode("The capital of France is"),
        "chat": chat,
        "chat_multi_turn": multi_turn,
        "code": tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n\tif n < 2:\n'),
        "digits": tok.encode("Compute step by step: 12345 + 67890 = 80235, and 3.14159 * 2 ="),
        "multibyte": tok.encode("Le café est très chaud. Über den Wolken. 東京は日本の首都です。Привет, мир! 🎉"),
        "long": tok.encode(_LONG),
        "one_token": one,
    }
    assert 200 <= len(prompts["long"]) <= 480, len(prompts["long"])
    return prompts


PROMPT_NAMES = ["plain", "chat", "chat_multi_turn", "code", "digits", "multibyte", "long", "one_token"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    p = _prompts(tokenizer)
    assert sorted(p) == sorted(PROMPT_NAMES)
    return p


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    """transformers' greedy continuation of each prompt, alone. eos_token_id=None: generation runs past EOS
    like the reference does here (min_new_tokens would mask EOS's logit instead and change the argmax)."""
    out = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            x = torch.tensor([ids])
            g = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  eos_token_id=None)
            out[name] = g[0, len(ids):].tolist()
            assert len(out[name]) == NEW_TOKENS, (name, out[name])
    return out


def _greedy_alone(dec, ids, slot=0):
    logits = dec.prefill(slot, ids)
    out = [int(logits.argmax())]
    for i in range(NEW_TOKENS - 1):
        out.append(int(dec.decode([slot], [out[-1]], [len(ids) + i]).argmax[0]))
    return out


@pytest.fixture(scope="module")
def ref_alone(model, prompts):
    # One single-slot decoder for all prompts: each prefill overwrites the slot, so a longer earlier prompt
    # leaves stale K/V behind the current one (masked by position), which must not matter.
    dec = ReferenceDecoder(model.config, model.weights, max_slots=1, max_context=MAX_CONTEXT, device="cpu",
                           dtype=torch.float32)
    order = sorted(prompts, key=lambda n: -len(prompts[n]))  # longest first: the most stale K/V
    return {name: _greedy_alone(dec, prompts[name]) for name in order}


@pytest.fixture(scope="module")
def ref_batched(model, prompts):
    """Every prompt in its own slot of one decoder (slots in a scrambled order, one left unused), then one
    decode call per step for all of them at once, each at its own position."""
    names = list(prompts)
    slots = list(range(len(names), 0, -1))  # n..1: the k-th sequence not in slot k, slot 0 unused
    assert sorted(slots) == list(range(1, len(names) + 1))
    dec = ReferenceDecoder(model.config, model.weights, max_slots=len(names) + 1, max_context=MAX_CONTEXT,
                           device="cpu", dtype=torch.float32)
    out = {n: [int(dec.prefill(s, prompts[n]).argmax())] for n, s in zip(names, slots)}
    for step in range(NEW_TOKENS - 1):
        res = dec.decode(slots, [out[n][-1] for n in names], [len(prompts[n]) + step for n in names])
        assert res.logits.shape == (len(names), model.config.vocab_size) and res.logits.dtype == torch.float32
        assert torch.equal(res.argmax, res.logits.argmax(-1))
        for n, t in zip(names, res.argmax.tolist()):
            out[n].append(t)
    return out


def test_config_matches_transformers(model, hf_model):
    c, h = model.config, hf_model.config
    assert c.architecture == "llama" and h.model_type == "llama"
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size) == (h.hidden_size, h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads,
                              h.head_dim, h.intermediate_size, h.vocab_size)
    # DESIGN.md's SmolLM2-135M shapes
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size) == (576, 30, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == h.rope_parameters["rope_theta"] == 100000.0
    assert h.rope_parameters.get("rope_type", "default") == "default" and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps)
    assert c.tie_word_embeddings and h.tie_word_embeddings and not c.qkv_bias
    assert c.bos_token_id == h.bos_token_id == 1
    assert h.eos_token_id in c.eos_token_ids
    assert model.tokenizer.hf.id_to_token(2) == "<|im_end|>" and 2 in c.eos_token_ids
    n_hf = sum(p.numel() for p in hf_model.parameters())  # parameters() counts the tied head once
    assert c.num_params() == n_hf == 134_515_008


def test_weights_match_transformers(model, hf_model):
    """Our dequantization (gguf's numpy) and Q/K un-permutation land on transformers' tensors."""
    sd = hf_model.state_dict()
    w = model.weights
    assert w.lm_head is w.embed
    torch.testing.assert_close(w.embed, sd["model.embed_tokens.weight"], rtol=0, atol=1e-6)
    torch.testing.assert_close(w.final_norm, sd["model.norm.weight"], rtol=0, atol=1e-6)
    for i in (0, 17, 29):
        lw, p = w.layers[i], f"model.layers.{i}."
        for ours, theirs in [("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"), ("wv", "self_attn.v_proj"),
                             ("wo", "self_attn.o_proj"), ("w_gate", "mlp.gate_proj"), ("w_up", "mlp.up_proj"),
                             ("w_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                             ("mlp_norm", "post_attention_layernorm")]:
            torch.testing.assert_close(getattr(lw, ours), sd[p + theirs + ".weight"], rtol=0, atol=1e-6,
                                       msg=lambda m, n=ours, i=i: f"layer {i} {n}: {m}")
        assert lw.bq is None and lw.bk is None and lw.bv is None


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_greedy_alone_matches_transformers(name, ref_alone, hf_greedy, prompts):
    assert ref_alone[name] == hf_greedy[name], f"{name}: prompt of {len(prompts[name])} tokens"


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_greedy_batched_matches_alone(name, ref_batched, ref_alone, hf_greedy):
    assert ref_batched[name] == ref_alone[name]
    assert ref_batched[name] == hf_greedy[name]


def test_greedy_runs_past_eos(hf_greedy, model):
    """The comparison is meaningful past an end-of-turn: at least one continuation crosses an EOS id."""
    eos = set(model.config.eos_token_ids)
    assert any(eos & set(toks[:-1]) for toks in hf_greedy.values())


@pytest.mark.parametrize("name", ["chat", "multibyte"])
def test_logits_match_transformers(name, model, hf_model, prompts):
    """Prefill and decode logits against one full transformers forward over prompt + continuation."""
    ids = prompts[name]
    dec = ReferenceDecoder(model.config, model.weights, max_slots=2, max_context=MAX_CONTEXT, device="cpu",
                           dtype=torch.float32)
    seq, ours = list(ids), [dec.prefill(1, ids)]
    for _ in range(4):
        seq.append(int(ours[-1].argmax()))
        ours.append(dec.decode([1], [seq[-1]], [len(seq) - 1]).logits[0])
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([seq])).logits[0, len(ids) - 1:].float()
    torch.testing.assert_close(torch.stack(ours), theirs, rtol=0, atol=2e-4)


def test_chunked_prefill_matches_full(model, prompts):
    """prefill(prefix) then prefill(rest, start_pos=len(prefix)) gives the logits of one full prefill, and the
    K/V cache written both ways agrees (the next decode step gives the same logits)."""
    ids = prompts["chat_multi_turn"]
    dec = ReferenceDecoder(model.config, model.weights, max_slots=3, max_context=MAX_CONTEXT, device="cpu",
                           dtype=torch.float32)
    full = dec.prefill(0, ids)
    cut = len(ids) // 3
    dec.prefill(1, ids[:cut])
    two = dec.prefill(1, ids[cut:], start_pos=cut)
    # three chunks, the middle one a single token
    dec.prefill(2, ids[:cut])
    dec.prefill(2, ids[cut:cut + 1], start_pos=cut)
    three = dec.prefill(2, ids[cut + 1:], start_pos=cut + 1)
    torch.testing.assert_close(two, full, rtol=0, atol=1e-4)
    torch.testing.assert_close(three, full, rtol=0, atol=1e-4)
    nxt = int(full.argmax())
    step = dec.decode([0, 1, 2], [nxt] * 3, [len(ids)] * 3).logits
    torch.testing.assert_close(step[1], step[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(step[2], step[0], rtol=0, atol=1e-4)


def test_prefill_rejects_overflow(model):
    dec = ReferenceDecoder(model.config, model.weights, max_slots=1, max_context=16, device="cpu",
                           dtype=torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        dec.prefill(0, list(range(10)), start_pos=8)
    with pytest.raises(ValueError, match="does not fit"):
        dec.prefill(0, [])
    with pytest.raises(ValueError, match="does not fit"):
        dec.decode([0], [5], [16])
    with pytest.raises(ValueError, match="decode of"):
        dec.decode([0], [5, 6], [3])


# -- the `kernels` name clash ---------------------------------------------------------------------------------
# Parley's top-level package `kernels` shares its import name with Hugging Face's `kernels` (hub kernels), which
# transformers probes with is_kernels_available() and, when it says yes, imports from (`from kernels import
# get_kernel, ...`). The probe finds our package by find_spec, then asks the installed metadata for its version:
# `kernels` maps to the distribution `parley` (0.1.0), below transformers' window (>= 0.18.2, < 0.19), so it is
# not viable and transformers never imports it. Without metadata (a source tree on PYTHONPATH) it imports our
# package to read `__version__`; ours has none, so again not viable, as long as `import kernels` stays harmless.

_PROBE = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.find_spec("kernels")
from transformers.utils.import_utils import is_kernels_available
ok = is_kernels_available()
imported = "kernels" in sys.modules
loaded = None
if sys.argv[1] == "load":
    import torch
    from transformers import AutoModelForCausalLM
    from service.model.loader import default_model_path
    p = default_model_path()
    m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    with torch.inference_mode():
        loaded = int(m(torch.tensor([[504, 3575, 282, 4649, 314]])).logits[0, -1].argmax())
print(json.dumps({"origin": spec and spec.origin, "available": ok, "imported": imported,
                  "imported_after": "kernels" in sys.modules, "loaded": loaded}))
"""

_NO_METADATA = """
import importlib.metadata, json, sys
real_version = importlib.metadata.version
def version(name):  # as if Parley were a source tree on PYTHONPATH, not an installed distribution
    if name.lower() in ("parley", "kernels"):
        raise importlib.metadata.PackageNotFoundError(name)
    return real_version(name)
importlib.metadata.version = version
from transformers.utils import import_utils
import_utils._package_distribution_mapping = lambda: {}
print(json.dumps({"available": import_utils.is_kernels_available(), "imported": "kernels" in sys.modules,
                  "origin": getattr(sys.modules.get("kernels"), "__file__", None)}))
"""


def _run_probe(code, cwd, *args):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if cwd == _REPO:
        env["PYTHONPATH"] = str(_REPO)  # the source tree first, as `python -c` from the repo root has it
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_kernels_name_clash_outside_repo(tmp_path):
    r = _run_probe(_PROBE, tmp_path, "probe")
    assert r["origin"] == str(_REPO / "kernels" / "__init__.py")  # the clash is real: `kernels` is ours
    assert r["available"] is False and r["imported"] is False


def test_kernels_name_clash_from_repo_root_oracle_loads(hf_model, prompts):
    """From the repo root (cwd first on sys.path), transformers still leaves our `kernels` alone and loads
    the GGUF oracle; its greedy token for the plain prompt is the one the in-process oracle gives."""
    assert prompts["plain"] == [504, 3575, 282, 4649, 314]
    with torch.inference_mode():
        expected = int(hf_model(torch.tensor([prompts["plain"]])).logits[0, -1].argmax())
    r = _run_probe(_PROBE, _REPO, "load")
    assert r["origin"] == str(_REPO / "kernels" / "__init__.py")
    assert r["available"] is False and r["imported"] is False and r["imported_after"] is False
    assert r["loaded"] == expected


def test_kernels_name_clash_without_metadata(tmp_path):
    """No distribution metadata: transformers imports our `kernels` to read a version; it must import cleanly
    and read as no version."""
    r = _run_probe(_NO_METADATA, _REPO)
    assert r["available"] is False
    assert r["imported"] is True and r["origin"] == str(_REPO / "kernels" / "__init__.py")


def test_kernels_not_available_in_process(hf_model):
    import sys

    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available() is False
    mod = sys.modules.get("kernels")
    assert mod is None or not hasattr(mod, "get_kernel")
