"""The steps of building a turn (turn.py): text and chat messages encoded, max_tokens, the sampling parameters and the
grammar."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from service.api.errors import APIError
from service.api.protocol import SamplingFields
from service.engine.constraint import TokenConstraint
from service.engine.grammar import GrammarError, grammars
from service.engine.request import SamplingParams
from service.model.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # chat: up to the context, at most this many
_OFFLOAD_CHARS = 8192  # tokenize longer texts off the event loop
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (dividing logits by it would overflow: inf, NaN)


def check_unicode(text: str, param: str) -> None:
    """JSON can carry lone surrogates (\\ud800) that are no text at all; the tokenizer would raise on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: a lone surrogate at character {e.start}", param=param,
                       code="invalid_encoding") from e


async def encode_text(tokenizer: Tokenizer, text: str, param: str = "prompt") -> list[int]:
    check_unicode(text, param)
    if len(text) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text)
    return tokenizer.encode(text)


async def encode_messages(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], param: str = "messages",
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template over the conversation (and the `tools` it renders), ending with the assistant's generation
    prompt."""
    msgs = list(messages)
    for i, m in enumerate(msgs):
        check_unicode(m.get("content") or "", f"{param}.{i}.content" if param == "messages" else param)
    try:
        if sum(len(m.get("content") or "") for m in msgs) > _OFFLOAD_CHARS:
            return await asyncio.to_thread(tokenizer.encode_chat, msgs, True, tools)
        return tokenizer.encode_chat(msgs, tools=tools)
    except ValueError as e:  # the template refuses this conversation (e.g. roles out of order)
        raise APIError(400, str(e), param=param, code="invalid_messages") from e
    except Exception as e:  # jinja errors on odd input are the input's fault, not ours
        raise APIError(400, f"the chat template cannot render these messages: {e}", param=param,
                       code="invalid_messages") from e


def chat_max_tokens(prompt_len: int, max_context: int) -> int:
    """max_tokens where a chat or realtime client gives none: up to the context, at most DEFAULT_CHAT_MAX_TOKENS
    (at least 1: a prompt that fills the context is the engine's to refuse)."""
    return max(1, min(DEFAULT_CHAT_MAX_TOKENS, max_context - prompt_len))


def sampling_params(fields: SamplingFields, max_tokens: int, constraint: TokenConstraint | None = None
                    ) -> SamplingParams:
    """The engine's parameters from what a request (or a realtime turn) asked for, and the grammar it follows."""
    temperature = 0.0 if fields.temperature < GREEDY_BELOW else fields.temperature
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=fields.top_p,
                          top_k=max(0, fields.top_k), seed=fields.seed, stop=fields.stop_sequences,
                          ignore_eos=fields.ignore_eos, constraint=constraint)


async def grammar_constraint(tokenizer: Tokenizer, eos_ids: frozenset[int], grammar: str, param: str,
                             opening: bool = False) -> TokenConstraint:
    """One request's grammar (Lark), compiled off the event loop: a few ms, and the first one also builds the
    grammar engine's vocabulary (~0.3 s). A grammar that does not compile is the request's fault (`param`).
    `opening`: it holds the reply's opening only (lifted once it accepts)."""
    try:
        return await asyncio.to_thread(grammars(tokenizer, eos_ids).constraint, grammar, opening)
    except GrammarError as e:
        raise grammar_refusal(param, e) from e


def grammar_refusal(param: str, e: GrammarError) -> APIError:
    """The 400 for a grammar that does not compile (here, or in the engine process)."""
    return APIError(400, f"{param}: no grammar can be built from it: {e}", param=param, code="invalid_schema")
