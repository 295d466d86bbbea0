"""Our GGUF-built tokenizer against transformers' load of the same GGUF; the chat template; the incremental
detokenizer over multi-byte text."""

from __future__ import annotations

import json
import os
import random

import pytest

import service.model.synthetic
from service.model.synthetic import byte_level_alphabet
from service.model.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

TEXTS = [
    "Hello world",
    "Hello, world! How are you doing today?",
    " leading space and trailing space ",
    "It's what we've done; they'll see, I'd say, you're right.",
    "def f(x):\n\treturn x ** 2  # square\n\n",
    "x  y   z\n\n\n    indented\r\nwindows line",
    "naïve café, résumé, Ångström, straße",
    "東京は日本の首都です。",
    "Привет, мир! Γειά σου Κόσμε.",
    "emoji: 🎉🚀👍🏽 and 👨‍👩‍👧",
    "e\u0301 combining acute, n\u0303",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "UPPER lower MiXeD __dunder__ snake_case camelCase",
    "https://example.com/path?q=1&r=two#frag",
    "",
]

DIGIT_TEXTS = [
    "0123456789",
    "The year 2024 had 366 days.",
    "3.14159265358979",
    " 42",
    "a1b22c333d4444",
    "Call 555-0199 or +44 20 7946 0958",
    "١٢٣ and ４２",  # Arabic-Indic and full-width digits (\p{N})
]

MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in French: «vert»? 🎨"},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(text, tokenizer, hf_tokenizer):
    ours = tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS
    assert tokenizer.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)


def test_long_texts_encode_the_same(tokenizer, hf_tokenizer):
    """Texts past LONG_TEXT_CHARS take the encode_batch path (the GIL released): the ids are transformers' all the
    same, with and without special tokens, for plain text and for a chat."""
    from service.model.tokenizer import LONG_TEXT_CHARS

    text = " ".join(TEXTS) * (LONG_TEXT_CHARS // len(" ".join(TEXTS)) + 2)
    assert len(text) >= LONG_TEXT_CHARS
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": text}]
    chat = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode_chat(messages) == hf_tokenizer.encode(chat, add_special_tokens=False)


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_individually(text, tokenizer, hf_tokenizer):
    """llama.cpp's `smollm` pre-tokenizer and SmolLM2's tokenizer.json split \\p{N} one digit at a time.
    (transformers' GGUF converter uses plain GPT-2 splitting for `smollm`; SmolLM2's vocabulary has no
    multi-digit pieces, so both agree here; the single-digit property is what we hold to.)"""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    for piece in pieces:
        digits = [c for c in piece if c in "0123456789"]
        assert len(digits) <= 1, (text, pieces)
        if digits:
            assert piece == digits[0], (text, pieces)  # a digit is its own token: no space or letter glued on
    assert tokenizer.decode(ids) == text
    # every \p{N} (Arabic-Indic, full-width too) is its own pre-token, before byte-level BPE
    alphabet = byte_level_alphabet()
    words = [bytes(alphabet[c] for c in w).decode() for w, _ in tokenizer.hf.pre_tokenizer.pre_tokenize_str(text)]
    assert "".join(words) == text
    for w in words:
        if any(c.isdigit() for c in w):
            assert len(w) == 1, (text, words)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def real_tokenizer():
    """SmolLM2's real tokenizer.json and tokenizer_config.json (the copy Parley ships for synthetic models)."""
    from pathlib import Path

    data = Path(service.model.synthetic.__file__).parent / "data"
    if not (data / "smollm2-tokenizer.json").exists():
        pytest.skip("no shipped SmolLM2 tokenizer.json")
    cfg = json.loads((data / "smollm2-tokenizer_config.json").read_text())
    return Tokenizer.from_file(data / "smollm2-tokenizer.json", chat_template=cfg["chat_template"],
                               bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_encode_matches_real_smollm2_tokenizer(text, tokenizer, real_tokenizer):
    """The GGUF-built tokenizer (llama.cpp's `smollm` pre-tokenizer) is SmolLM2's real one, digits included."""
    assert tokenizer.encode(text) == real_tokenizer.encode(text)


def test_chat_template_matches_real_smollm2(tokenizer, real_tokenizer):
    for messages in MESSAGES:
        assert tokenizer.apply_chat_template(messages) == real_tokenizer.apply_chat_template(messages)


def test_digit_tokens_are_single_digits(tokenizer):
    ids = tokenizer.encode("9876543210")
    assert len(ids) == 10
    assert [tokenizer.hf.id_to_token(i) for i in ids] == list("9876543210")


def test_special_tokens(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("<|endoftext|>") == [0]
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.vocab_size == 49152
    # special tokens are never shown: they decode to nothing
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(messages, add_generation_prompt, tokenizer, hf_tokenizer):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys"):
        hf_ids = hf_ids["input_ids"]
    assert ids == list(hf_ids)


# A template that leans on what transformers' template environment offers: loop controls, its `tojson` (no
# HTML escaping, keys in order, non-ASCII kept), `strftime_now`, `raise_exception`, namespaces.
FEATURE_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "Today {{ strftime_now('%Y-%m-%d') }}\n"
    "{%- for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if m.get('meta') %} {{ m['meta'] | tojson }}{% endif %}"
    "<|im_end|>\n{% endfor %}[{{ ns.n }}]"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_environment_matches_transformers(tokenizer, hf_tokenizer):
    messages = [
        {"role": "user", "content": "a", "meta": {"z": 1, "a": "<b>&é"}},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "b"},
        {"role": "stop", "content": ""},
        {"role": "user", "content": "never shown"},
    ]
    tok = Tokenizer(tokenizer.hf, chat_template=FEATURE_TEMPLATE, bos_token=None, eos_token=None)
    ours = tok.apply_chat_template(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == theirs
    assert '{"z": 1, "a": "<b>&é"}' in ours and "hidden" not in ours and "never" not in ours and "[2]" in ours


def test_chat_template_raise_exception(tokenizer):
    tok = Tokenizer(tokenizer.hf, chat_template="{{ raise_exception('no system role') }}", bos_token=None,
                    eos_token=None)
    with pytest.raises(ValueError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_default_chat_template_is_chatml():
    tok = Tokenizer(_gpt2_like_tokenizer(), chat_template=None, bos_token=None, eos_token=None)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _gpt2_like_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    hf = HFTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    return hf


# -- the incremental detokenizer ---------------------------------------------------------------------------

def _byte_ids(tokenizer, data: bytes) -> list[int]:
    """One token per byte, through the byte-level alphabet: every multi-byte character split across tokens."""
    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    ids = [tokenizer.hf.token_to_id(alphabet[b]) for b in data]
    assert None not in ids
    return ids


def _stream(tokenizer, ids):
    det = tokenizer.detokenizer()
    deltas = [det.add(i) for i in ids]
    return deltas, det.flush()


STREAM_TEXTS = [
    "東京は日本の首都です。",
    "emoji 🎉🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "e\u0301 n\u0303 a\u0308 combining",
    "Привет, мир! naïve café",
    "<|im_start|>assistant\nBonjour 👋<|im_end|>",
    "mixed: abc 123 αβγ 中文 🙂 end",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_detokenizer_streams_whole_characters(text, tokenizer):
    ids = tokenizer.encode(text)
    deltas, tail = _stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert tail == ""
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "".join(deltas) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


@pytest.mark.parametrize("text", ["🎉", "a🎉b", "東京", "é", "👨‍👩‍👧!"])
def test_detokenizer_byte_tokens(text, tokenizer):
    """A 4-byte emoji fed as four single-byte tokens: nothing until its last byte, then the whole character."""
    data = text.encode()
    ids = _byte_ids(tokenizer, data)
    deltas, tail = _stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == text == tokenizer.decode(ids)
    if text == "🎉":
        assert deltas == ["", "", "", "🎉"]


def test_detokenizer_flush_hands_over_incomplete_bytes(tokenizer):
    data = "ok 🎉".encode()[:-2]  # the emoji cut after 2 of its 4 bytes
    ids = _byte_ids(tokenizer, data)
    deltas, tail = _stream(tokenizer, ids)
    assert "".join(deltas) == "ok "
    assert tail == "\ufffd"  # held back, then handed over, never dropped
    assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_detokenizer_invalid_bytes_are_replaced_not_dropped(tokenizer):
    ids = _byte_ids(tokenizer, b"a\x80b\xc3")  # a stray continuation byte, then a truncated 2-byte lead
    deltas, tail = _stream(tokenizer, ids)
    assert "".join(deltas) + tail == "a\ufffdb\ufffd" == tokenizer.decode(ids)


def test_detokenizer_ignores_special_and_out_of_range_ids(tokenizer):
    det = tokenizer.detokenizer()
    assert det.add(1) == "" and det.add(2) == ""
    assert det.add(10**9) == "" and det.add(-1) == ""
    assert det.flush() == ""


def test_detokenizer_streams_what_the_library_decodes(tokenizer):
    """Random id sequences, mixing special tokens, single-byte tokens that form invalid or unfinished UTF-8 and whole
    words: the streamed text, flushed, is the library's decode of the same ids, special tokens left out."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    specials = [i for i, t in tokenizer.hf.get_added_tokens_decoder().items() if t.special]
    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    bytes_ = [i for i in (tokenizer.hf.token_to_id(alphabet[b]) for b in range(256)) if i is not None]
    for _ in range(300):
        ids = [rng.choice([rng.randrange(tokenizer.vocab_size), rng.choice(specials), rng.choice(bytes_)])
               for _ in range(rng.randint(1, 24))]
        deltas, tail = _stream(tokenizer, ids)
        assert "".join(deltas) + tail == tokenizer.decode(ids), ids


def test_ids_past_the_vocabulary_read_as_extra_tokens():
    """A model whose embedding is larger than its tokenizer's vocabulary (a synthetic one here: 258 tokens, 300
    ids) may emit the ids past it: they stream as the tokenizer's extra_tokens, in order with the rest."""
    tok = service.model.synthetic.byte_tokenizer(300)
    assert tok.vocab_size == 258 and len(tok.extra_tokens) == 42
    ids = [*tok.encode("h"), 258, *tok.encode("é"), 299, *tok.encode("i")]
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == f"h{tok.extra_tokens[0]}é{tok.extra_tokens[41]}i"
