"""Constrained decoding with llguidance: a grammar (llguidance's Lark, JSON schemas embedded as `%json {...}`)
compiled against the served model's tokenizer into a TokenConstraint: a bitmask of the tokens the grammar allows
next (~50 µs a token for a 50k vocabulary, up to ~0.5 ms; computed on a worker thread, not the engine's), and the token
chosen, to advance with.

The API asks for a grammar (a JSON schema for response_format, a model family's tool-call syntax: service/api/
tools.py); the sampler applies the masks of a step's constrained rows together (masks.py, Request.constraint).
Once the grammar is complete, the mask allows only the end-of-sequence tokens, so the request ends there.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
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


MASK_WORKERS = 4  # threads computing masks, at most (one per CPU core)


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
    """One request's grammar state: a TokenConstraint (service/engine/constraint.py). Its next mask is computed on the
    grammar's worker pool as soon as it can be (when the constraint is made, and after each token accepted), while
    the engine thread launches steps; llguidance releases the GIL while it computes one."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int, pool: Executor | None = None,
                 opening: bool = False) -> None:
        self._matcher = matcher
        self._opening = opening  # the grammar is of the reply's opening alone: lifted once it accepts
        # one bit per token, on the host: the sampler copies it into a step's pinned staging buffer
        self._bits = torch.zeros((tokenizer_vocab + 31) // 32, dtype=torch.int32)
        self._pool = pool
        self._next: Future[torch.Tensor] | None = None
        self._start()

    def _compute(self) -> torch.Tensor:
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        return self._bits

    def _start(self) -> None:
        """The next position's mask, on the pool (inline, when allowed() asks, without one)."""
        self._next = self._pool.submit(self._compute) if self._pool is not None else None

    def ready(self) -> bool:
        return self._next is not None and self._next.done()

    def allowed(self) -> torch.Tensor:
        if self._next is None:
            return self._compute()
        return self._next.result()

    def accept(self, token: int) -> None:
        if self._next is not None and not self._next.done():  # never two threads in the matcher at once
            wait([self._next])
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error() or f"token {token} is not allowed here")
        if not self.lifted():
            self._start()  # (a complete grammar's mask allows its end-of-sequence tokens)

    @property
    def opening(self) -> bool:
        return self._opening

    def lifted(self) -> bool:
        return self._opening and self._matcher.is_accepting()


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
        # where masks are computed: a few threads, each mask of one request at a time (a request's masks in order)
        self.pool = ThreadPoolExecutor(max_workers=min(MASK_WORKERS, os.cpu_count() or 1),
                                       thread_name_prefix="parley-grammar")

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

    def matcher(self, lark: str) -> llguidance.LLMatcher:
        """A fresh matcher for a Lark grammar (its `start` rule); GrammarError if it does not compile."""
        matcher = llguidance.LLMatcher(self._lltokenizer(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    @property
    def vocab_size(self) -> int:
        """The vocabulary the masks cover: the tokenizer's (a padded embedding's extra ids are never allowed)."""
        return self._lltokenizer().vocab_size

    def constraint(self, lark: str, opening: bool = False) -> GrammarConstraint:
        """A fresh constraint for a Lark grammar, its first mask under way; GrammarError if it does not compile.
        `opening`: the grammar constrains the reply's opening only, and is lifted as soon as it accepts."""
        return GrammarConstraint(self.matcher(lark), self.vocab_size, self.pool, opening)


@functools.lru_cache(maxsize=4)
def grammars(tokenizer: Tokenizer, eos_ids: frozenset[int]) -> Grammars:
    """The served model's grammar compiler (one per model; the tokenizer object is the model's)."""
    return Grammars(tokenizer, eos_ids)
