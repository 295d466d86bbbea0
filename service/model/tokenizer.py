"""Tokenizer: Hugging Face `tokenizers` for text ↔ ids, the model's chat template, and an incremental
detokenizer (the library's DecodeStream, through the tokenizer's own decoders) that turns a stream of ids into text
without ever splitting a UTF-8 sequence or losing a byte. Special tokens are left out of the text, except those that
open a tool call (TOOL_CALL_TOKENS): the API reads the call that follows, and never speaks the token itself
(service/api/reply.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from itertools import groupby
from pathlib import Path
from typing import Any

from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from service.model.piece_cache import PieceCache

LONG_TEXT_CHARS = 1024
# Special tokens that open a tool call: Llama-3.x's <|python_tag|> (a call, or code for its interpreter, up to
# <|eom_id|>). Decoded as their text, not skipped: the tool-call parser must see where a call begins.
TOOL_CALL_TOKENS = ("<|python_tag|>",)

# A plain ChatML template, for checkpoints that ship none.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self.hf = tokenizer
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tool_call_tokens = {i: t for t in TOOL_CALL_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
        # What ids past the tokenizer's vocabulary read as (id vocab_size + i), where a model's embedding is larger
        # than its tokenizer's vocabulary; decoding skips those ids otherwise.
        self.extra_tokens: list[str] = []
        # The environment transformers renders chat templates in: {% break %}/{% continue %}, a `tojson` that
        # neither escapes HTML nor sorts keys, and `strftime_now` (Llama-3.x templates print today's date).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(self.chat_template)
        # Whether the template renders `tools` itself (Llama-3.x, Qwen2.5); others get them from the API as text.
        self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(self.chat_template))
        # A rendered conversation is encoded stretch by stretch between its special tokens, the stretches seen
        # before (the system prompt, earlier turns) from a cache: only the new message costs an encoding.
        self.pieces = PieceCache(tokenizer, lambda text: self._encode(text, add_special_tokens=False))

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)), **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text; the tokenizer's post-processor adds a BOS where the model wants one."""
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # A long text through encode_batch: the same ids, with the GIL released while the Rust side works, so the
        # engine thread keeps streaming tokens meanwhile (a 1,000-token prompt takes ~1.5 ms to encode).
        if len(text) >= LONG_TEXT_CHARS:
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` as the detokenizer gives it: special tokens left out (but TOOL_CALL_TOKENS), ids past
        the vocabulary as extra_tokens."""
        return "".join(self._decode_run(kind, list(run)) for kind, run in groupby(ids, key=self._kind))

    def _kind(self, token_id: int) -> int:
        """0: in the vocabulary; 1: a tool-call token, shown; 2: past the vocabulary."""
        if not 0 <= token_id < self.vocab_size:
            return 2
        return 1 if token_id in self.tool_call_tokens else 0

    def _decode_run(self, kind: int, run: list[int]) -> str:
        if kind == 0:
            return self.hf.decode(run, skip_special_tokens=True)
        return "".join(self.tool_call_tokens[i] if kind == 1 else self.extra(i) for i in run)

    def extra(self, token_id: int) -> str:
        """What an id outside the vocabulary reads as: its extra token, or nothing."""
        i = token_id - self.vocab_size
        return self.extra_tokens[i] if 0 <= i < len(self.extra_tokens) else ""

    def to_json(self) -> str:
        """The tokenizer as Hugging Face's tokenizer.json (what a grammar engine builds its vocabulary from)."""
        return self.hf.to_str()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """`tools` (OpenAI's tool objects) reach templates that take them (takes_tools); without tools, the template
        sees none defined, as transformers renders it."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **({"tools": tools} if tools is not None else {}),
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        # The template writes the BOS itself where the model wants one.
        if self.pieces.usable:
            return self.pieces.encode(text)
        return self._encode(text, add_special_tokens=False)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class IncrementalDetokenizer:
    """Ids in, text out, one token at a time, through the library's DecodeStream: a multi-byte character split
    across tokens is held back until its last byte arrives; `flush` hands over whatever is left (invalid bytes as
    U+FFFD), so nothing is lost. Ids past the vocabulary read as the tokenizer's extra_tokens (or as nothing); a
    tool-call token (TOOL_CALL_TOKENS) as its text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []  # ids the stream has not turned into text yet

    def add(self, token_id: int) -> str:
        tok = self._tokenizer
        if not 0 <= token_id < tok.vocab_size:
            return tok.extra(token_id)
        shown = tok.tool_call_tokens.get(token_id)
        if shown is not None:  # what came before is whole; the text after it decodes as a new stream
            before = self.flush()
            self._stream = DecodeStream(skip_special_tokens=True)
            return before + shown
        text = self._stream.step(tok.hf, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        # The stream holds ids back until they end in a whole character; what it still holds decodes on its own.
        held, self._held = self._held, []
        return self._tokenizer.decode(held) if held else ""


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """tokenizer.json plus tokenizer_config.json (chat template, BOS/EOS) of a Hugging Face checkpoint."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

    def token_text(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    return Tokenizer(
        HFTokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=template,
        bos_token=token_text(cfg.get("bos_token")),
        eos_token=token_text(cfg.get("eos_token")),
    )
