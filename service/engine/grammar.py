"""Constrained decoding with llguidance: a grammar (llguidance's Lark, JSON schemas embedded as `%json {...}`)
compiled against the served model's tokenizer into a TokenConstraint, which masks the logits before each choice to
the tokens the grammar allows next (~25 µs a token for a 50k vocabulary) and advances with the token chosen.

The API asks for a grammar (a JSON schema for response_format, a model family's tool-call syntax: service/api/
tools.py); the sampler applies it (Request.constraint). Once the grammar is complete, the mask allows only the
end-of-sequence tokens, so the request ends there.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import llguidance
import torch

from service.model.tokenizer import Tokenizer

# How the grammar lets a model write JSON: no free whitespace (a weak model fills it forever) and the separators
# json.dumps writes, which chat templates use (`tojson`) when they render a call back into the history, so that
# the history repeats the model's own text (and the cached K/V of it).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Where a JSON schema holds further schemas (closed() walks them): maps of them, lists of them, single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it does not allow."""


def closed(schema: Any) -> Any:
    """The schema with every object that lists `properties` and says nothing of other keys closed to them
    (`additionalProperties: false`, as OpenAI's strict mode requires): an open object lets a weak model add keys
    forever. (allOf is left alone: closing its parts would make their union unsatisfiable.)"""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed(v) for k, v in value.items()}
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            out[key] = [closed(v) for v in value]
        elif key in _SCHEMA_ONE:
            out[key] = closed(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark expression for JSON valid for `schema`, closed (see closed()) and written in JSON_STYLE."""
    body = closed(schema)
    body = {**body, "x-guidance": {**JSON_STYLE, **body.get("x-guidance", {})}}
    return f"%json {json.dumps(body, ensure_ascii=False)}"


def literal(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text, ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def _schema_error(schema_json: str) -> str | None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(closed(json.loads(schema_json)))
    return llguidance.LLMatcher.validate_grammar(grammar) or None


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why `schema` (closed, as the grammar takes it) is not a JSON schema a grammar can be built from; None if it
    is. Cached by the schema's text: agents send the same tools with every turn."""
    try:
        return _schema_error(json.dumps(schema, sort_keys=True))
    except (TypeError, ValueError) as e:
        return str(e)


class GrammarConstraint:
    """One request's grammar state: a TokenConstraint (service/engine/sampler.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int) -> None:
        self._matcher = matcher
        # one bit per token, on the host (pinned where the logits are on a GPU, so that the copy need not wait).
        # (llguidance.torch does the same, but importing it costs seconds of torch._dynamo.)
        self._bits = torch.zeros((tokenizer_vocab + 31) // 32, dtype=torch.int32,
                                 pin_memory=torch.cuda.is_available())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with what the grammar does not allow next at -inf, on the logits' device, without waiting
        for it."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        # Not waiting for the copy is safe: the bits are rewritten only at the next mask, after the token chosen
        # from these logits has been read back (and accepted), by when the copy has long run.
        words = self._bits.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((words[:, None] >> shifts) & 1).flatten().bool()
        vocab = logits.shape[-1]
        if allowed.numel() < vocab:  # ids past the tokenizer's vocabulary (a padded embedding) are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
        return logits.masked_fill(~allowed[:vocab], float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error() or f"token {token} is not allowed here")


class Grammars:
    """Compiles grammars for one model. The llguidance tokenizer (from the tokenizer's JSON, ~0.3 s for a 50k
    vocabulary) is built on the first constrained request, then kept."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.vocab_size
        eos = sorted(i for i in eos_ids if 0 <= i < vocab)
        if not eos and tokenizer.eos_token is not None:  # a model that never stops on EOS (synthetic): the mask
            eos = [i for i in (tokenizer.hf.token_to_id(tokenizer.eos_token),) if i is not None]  # needs one
        self._eos = eos or None
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._tokenizer.vocab_size,
                                                      eos_token=self._eos)
                except TypeError:  # an llguidance before 1.7 takes one EOS token (the GPU image's wheel: 1.6)
                    self._ll = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._tokenizer.vocab_size,
                                                      eos_token=self._eos[0] if self._eos else None)
            return self._ll

    def constraint(self, lark: str) -> GrammarConstraint:
        """A fresh constraint for a Lark grammar (its `start` rule); GrammarError if it does not compile."""
        ll = self._lltokenizer()
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarConstraint(matcher, ll.vocab_size)


@functools.lru_cache(maxsize=4)
def grammars(tokenizer: Tokenizer, eos_ids: frozenset[int]) -> Grammars:
    """The served model's grammar compiler (one per model; the tokenizer object is the model's)."""
    return Grammars(tokenizer, eos_ids)
