"""A conversation encoded stretch by stretch (earlier stretches from the cache) gives exactly the ids of encoding
its whole rendered text, for every tokenizer Parley ships; and a growing conversation encodes only its new turn."""

import random

import pytest
from tokenizers import AddedToken

from service.model.synthetic import byte_tokenizer, smollm2_tokenizer
from service.model.tokenizer import Tokenizer

WORDS = ["the", "weather", "Paris", "  spaced", "\n\n", "tab\there", "naïve café", "日本語", "😀👍", "1234567",
         "don't", "<|im_end|>", "<|im_start|>user", "end.", " ", "ĠĠ", "\r\n", "x" * 70]


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    def text(n: int) -> str:
        return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n))

    msgs = [{"role": "system", "content": "You are a voice assistant. " + text(60)}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": text(rng.randint(0, 12))})
        msgs.append({"role": "assistant", "content": text(rng.randint(1, 20))})
    msgs.append({"role": "user", "content": text(5)})
    return msgs


def whole(tok: Tokenizer, msgs: list[dict[str, str]]) -> list[int]:
    return tok.hf.encode(tok.apply_chat_template(msgs), add_special_tokens=False).ids


@pytest.fixture(params=["smollm2", "bytes", "gguf"])
def tok(request) -> Tokenizer:
    if request.param == "smollm2":
        return smollm2_tokenizer(49152)
    if request.param == "bytes":
        return byte_tokenizer(512)
    return request.getfixturevalue("tokenizer")  # the embedded SmolLM2 GGUF's own


def test_pieces_give_the_whole_texts_ids(tok: Tokenizer) -> None:
    assert tok.pieces.usable
    rng = random.Random(7)
    for trial in range(30):
        msgs = conversation(rng, trial % 6)
        assert tok.encode_chat(msgs) == whole(tok, msgs)
        assert tok.encode_chat(msgs) == whole(tok, msgs)  # again, now from the cache


def test_a_growing_conversation_encodes_only_its_new_turn() -> None:
    tok = smollm2_tokenizer(49152)
    rng = random.Random(1)
    msgs = conversation(rng, 0)
    tok.encode_chat(msgs)
    for _ in range(5):
        msgs += [{"role": "assistant", "content": "Sure, here is what I found about that. " * 3},
                 {"role": "user", "content": "And what about tomorrow, in the evening, near the river? " * 2}]
        misses = tok.pieces.misses
        assert tok.encode_chat(msgs) == whole(tok, msgs)
        assert tok.pieces.misses - misses <= 2  # the new reply and message; the system prompt and earlier turns hit


def test_a_tokenizer_that_strips_around_its_added_tokens_encodes_whole_texts() -> None:
    tok = smollm2_tokenizer(49152)
    tok.hf.add_special_tokens([AddedToken("<|tool|>", special=True, lstrip=True)])
    fresh = Tokenizer(tok.hf, chat_template=tok.chat_template, bos_token=None, eos_token="<|im_end|>")
    assert not fresh.pieces.usable
    msgs = [{"role": "user", "content": "call it  <|tool|> now " * 20}]
    assert fresh.encode_chat(msgs) == whole(fresh, msgs)
