"""One turn, built once for every endpoint: from what a client asked (a chat or completion request over HTTP, a
realtime response.create) to a generation submitted to the engine. HTTP and the WebSocket differ only in how they
answer; everything a turn asks is checked here, each rule once:

- the schemas (a tool's parameters, response_format's schema) can become grammars;
- tool_choice fits the tools (a conversation's turn: the template renders them);
- the prompt is templated (a conversation, with the tools) or taken as it is (text, token ids), and encoded;
- max_tokens: the client's, or up to the context (at most DEFAULT_CHAT_MAX_TOKENS);
- the grammar: a forced call, a JSON reply (response_format), or either (tool_choice "auto");
- the prompt fits the model: the engine checks that (Engine.submit knows the decoder's context and vocabulary), and
  a turn it refuses is answered with the OpenAI error that names the field at fault (Turn.refusal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.api import prompts
from service.api.engine_client import RemoteGrammar, RemoteSession, RemoteStream
from service.api.errors import APIError
from service.api.protocol import NamedToolChoice, ResponseFormat, SamplingFields, ToolFields
from service.api.reply import ReplyReader
from service.api.state import ServerState
from service.api.streaming import EngineStream
from service.api.tools import SPEECH_OPENING, ChatTools
from service.engine.grammar import GrammarError, schema_error
from service.engine.kv_slots import Session
from service.engine.request import SamplingParams

Message = dict[str, Any]  # a chat message as templates take it (ChatMessage.for_template)


@dataclass(frozen=True)
class Fields:
    """The names a refusal gives the fields at fault: HTTP bodies and realtime events nest them differently."""

    prompt: str  # "prompt", "messages", "response.input"
    prefix: str = ""  # before tools, tool_choice, response_format ("response." in a realtime event)
    max_tokens: str = "max_tokens"

    def of(self, name: str) -> str:
        return self.prefix + name


COMPLETION_FIELDS = Fields("prompt")
CHAT_FIELDS = Fields("messages")


@dataclass(frozen=True)
class Conversation:
    """A prompt of chat messages: the chat template renders them (and the tools)."""

    messages: list[Message]


@dataclass(frozen=True)
class TurnRequest:
    """What a client asks of one turn."""

    prompt: str | list[int] | Conversation  # text and token ids are the prompt as they are
    sampling: SamplingFields
    fields: Fields
    spoken: bool  # the reply is content for a listener (chat, realtime): calls read, markup withheld (reply.py)
    max_tokens: int | None = None  # None: up to the context, at most DEFAULT_CHAT_MAX_TOKENS
    tools: ToolFields | None = None  # a conversation's; checked whatever the prompt
    response_format: ResponseFormat | None = None


@dataclass(frozen=True)
class Turn:
    """A turn ready to submit: its prompt's ids, the engine's parameters, and what reads its reply."""

    ids: list[int]
    params: SamplingParams
    tools: ChatTools
    spoken: bool
    fields: Fields
    # --engine-process: the grammar as it travels (compiled in the engine process), and the field it came from
    grammar: RemoteGrammar | None = None
    grammar_param: str = ""

    def reader(self) -> ReplyReader | None:
        """What reads a spoken reply (calls, content without markup); None for raw text (/v1/completions)."""
        return ReplyReader(self.tools.parser()) if self.spoken else None

    async def submit(self, st: ServerState, arrival: float, session: Session | RemoteSession | None = None
                     ) -> EngineStream | RemoteStream:
        """The engine's submit. Rejected (429, 503) propagates; a prompt the engine refuses is a 400 naming the
        field, as is a grammar the engine process cannot compile."""
        try:
            return await st.open_stream(self.ids, self.params, arrival, session=session, grammar=self.grammar)
        except GrammarError as e:
            raise prompts.grammar_refusal(self.grammar_param, e) from e
        except ValueError as e:
            raise self.refusal(str(e), st.max_context, st.vocab_size) from e

    def refusal(self, why: str, max_context: int, vocab_size: int) -> APIError:
        """The engine refused this turn's prompt (`why`): the OpenAI error that names the field at fault. Only a
        refused turn comes here: the engine decides, this says which field and code."""
        ids, f, max_tokens = self.ids, self.fields, self.params.max_tokens
        if not ids:
            return APIError(400, "the prompt is empty", param=f.prompt, code="empty_prompt")
        # min/max run in C; only a prompt that holds a bad id is searched (in Python) for the first one
        if not (0 <= min(ids) and max(ids) < vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            return APIError(400, f"token id {bad} is out of the vocabulary [0, {vocab_size})", param=f.prompt,
                            code="invalid_token_id")
        if len(ids) >= max_context:
            return APIError(400, f"this model's context is {max_context} tokens and the prompt has {len(ids)}",
                            param=f.prompt, code="context_length_exceeded")
        if len(ids) + max_tokens > max_context:
            return APIError(400, f"this model's context is {max_context} tokens; the prompt has {len(ids)} and "
                                 f"max_tokens asks for {max_tokens} more", param=f.max_tokens,
                            code="context_length_exceeded")
        return APIError(400, why, param=f.prompt, code="invalid_prompt")


async def build_turn(st: ServerState, asked: TurnRequest) -> Turn:
    """The turn `asked` describes, every rule checked (APIError names the field at fault)."""
    f, tok = asked.fields, st.tokenizer
    tool_fields = asked.tools or ToolFields()
    check_schemas(tool_fields, asked.response_format, f.prefix)
    if isinstance(asked.prompt, Conversation):
        check_tool_choice(tool_fields, f.of("tool_choice"))
        tools = ChatTools.of(tok, tool_fields)
        messages, template_tools = tools.template_input(asked.prompt.messages)
        ids = await prompts.encode_messages(tok, messages, param=f.prompt, tools=template_tools)
    else:  # no template: the model is told of no tools
        tools = ChatTools.of(tok, ToolFields())
        prompt = asked.prompt
        ids = await prompts.encode_text(tok, prompt, param=f.prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = asked.max_tokens if asked.max_tokens is not None else \
        prompts.chat_max_tokens(len(ids), st.max_context)
    after_tool = isinstance(asked.prompt, Conversation) and bool(asked.prompt.messages) \
        and asked.prompt.messages[-1]["role"] == "tool"
    grammar = tools.grammar(asked.response_format.output_schema if asked.response_format else None, after_tool)
    param = f.of("tools" if tools.required else "response_format")
    if grammar is not None and st.client is not None:  # compiled where it is used: in the engine process
        return Turn(ids, prompts.sampling_params(asked.sampling, max_tokens), tools, asked.spoken, f,
                    RemoteGrammar(grammar, grammar == SPEECH_OPENING), param)
    constraint = None if grammar is None else await prompts.grammar_constraint(
        tok, st.engine.eos, grammar, param=param, opening=grammar == SPEECH_OPENING)
    return Turn(ids, prompts.sampling_params(asked.sampling, max_tokens, constraint), tools, asked.spoken, f)


def check_schemas(tools: ToolFields, response_format: ResponseFormat | None, prefix: str = "") -> None:
    """Every schema a turn may constrain output to (each tool's parameters, response_format's) can become a
    grammar: checked when the request comes, whatever tool_choice says (a cached check: agents send the same tools
    every turn)."""
    named = [(f"tools.{i}.function.parameters", t.function.parameters) for i, t in enumerate(tools.tools or [])]
    if response_format is not None and response_format.json_schema is not None:
        named.append(("response_format.json_schema.schema", response_format.json_schema.schema_))
    for name, schema in named:
        if schema is not None and (why := schema_error(schema)) is not None:
            param = prefix + name
            raise APIError(400, f"{param}: not a JSON schema Parley can constrain output to: {why}", param=param,
                           code="invalid_value")


def check_tool_choice(tools: ToolFields, param: str) -> None:
    """A tool_choice that asks for a call needs tools, and a named one a tool of that name."""
    names = [t.function.name for t in tools.tools or []]
    choice = tools.tool_choice
    why = None
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        why = f"there is no tool named {choice.function.name!r} (tools: {', '.join(names) or 'none'})"
    elif choice == "required" and not names:
        why = 'tool_choice "required" needs tools'
    if why is not None:
        raise APIError(400, f"{param}: {why}", param=param, code="invalid_value")
