"""How each model family writes a tool call, stated once for the three things that need it: the grammar that forces a
call (tool_choice "required" or a named function), the parser that reads calls out of the reply
(tool_parsers.py), and the history, where a call the assistant made is written back as the model wrote it.

- Hermes (Qwen2.5, Hermes, SmolLM2, and every template that does not render tools itself):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- Llama-3.x JSON: a bare `{"name": ..., "parameters": {...}}` as the whole reply (`<|python_tag|>` may open it);
  its templates take one call per turn.

Each family's tool-protocol markup (`markup`) is also what reply.py's MarkupFilter keeps out of spoken content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.api.protocol import FunctionDefinition
from service.engine.grammar import json_rule, literal


@dataclass(frozen=True)
class CallFormat:
    name: str  # as /v1/models reports it
    arguments_key: str  # the key of the arguments in a call's JSON
    prefix: str  # what comes before a call's JSON
    suffix: str  # and after it
    separator: str  # between two calls
    several: bool  # whether the family's templates take several calls in one assistant turn
    leading_json: bool  # a JSON object that opens the reply is a call (the family writes calls bare)
    markers: tuple[str, ...]  # text that opens a call anywhere in the reply
    # the family's tool-protocol blocks, as (what opens one, what closes it; None: the end of the reply)
    markup: tuple[tuple[str, str | None], ...]

    def write(self, name: str, arguments: Any) -> str:
        """A call as the grammar makes the model write it (JSON as json.dumps writes it: grammar.JSON_STYLE)."""
        return self.prefix + json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False) \
            + self.suffix

    def grammar(self, functions: Sequence[FunctionDefinition], several: bool) -> str:
        """Lark rules whose `calls` is one call of one of `functions` (or, with `several`, one or more), each
        function's arguments valid for its parameters' schema."""
        choice = " | ".join(f"function_{i}" for i in range(len(functions)))
        call = " ".join(part for part in (literal(self.prefix) if self.prefix else "", f"({choice})",
                                          literal(self.suffix) if self.suffix else "") if part)
        rules = [f"calls: call ({literal(self.separator)} call)*" if several and self.several else "calls: call",
                 f"call: {call}"]
        for i, f in enumerate(functions):
            schema = {"type": "object", "properties": {"name": {"const": f.name},
                                                       self.arguments_key: f.parameters_schema},
                      "required": ["name", self.arguments_key]}
            rules.append(f"function_{i}: {json_rule(schema)}")
        return "\n".join(rules)


HERMES = CallFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", several=True,
                    leading_json=False, markers=("<tool_call>",),
                    markup=(("<tool_call>", "</tool_call>"), ("<tool_response>", "</tool_response>"),
                            ("<tools>", "</tools>")))
# <|python_tag|> opens a call (or Python for Llama's code interpreter) that runs to the end of the message
LLAMA3_JSON = CallFormat("llama3_json", "parameters", "", "", "; ", several=False, leading_json=True,
                         markers=("<|python_tag|>",), markup=(("<|python_tag|>", None),))

# Every family's markup: a model may echo whatever protocol its prompt showed it (SmolLM2 repeats Hermes's
# <tool_response> blocks), so all of it is kept out of speech whichever family is served.
MARKUP = HERMES.markup + LLAMA3_JSON.markup
