"""StepPlan: who runs in one step and how, as data. The planner (planner.py) returns it, the engine executes it, and
commit.py turns it and the tokens it produced into events.

A step is one launch of the decoder over a list of rows; a row is (KV slot, position, token). Rows come in two kinds:
- sampled rows, first: [0, len(sampled)). Each gives one request its next token: a running request's decode row (its
  last token at its next position), or the last row of a prompt (its first token);
- prompt rows after them: the rest of the prompt chunks, whose logits nobody reads.
Every row writes its K/V at its position before any row's attention reads the cache, so the rows of one prompt chunk
attend causally among themselves and over what the slot holds: a prompt may be cut into chunks across steps, and one
sequence may have several rows in a step (the same machinery verifies speculative tokens).

A row's token comes from the host, or from the device (`feed`): the token that row `src` of the step before chose,
which the host has not seen yet when this step is launched (the engine runs a step ahead on a GPU).

A prompt too long to ride in steps without delaying everyone goes as a separate prefill launch (`launches`) of all its
tokens but the last, run before the step, whose last token then rides in the step as a sampled row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.request import Request


@dataclass(frozen=True)
class PromptChunk:
    """Prompt positions [start, end) of `req` in this step; `last` if end is the prompt's end (its last row samples)."""

    req: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.req.prompt_ids)


@dataclass(frozen=True)
class Launch:
    """A separate prefill of prompt positions [start, end) of `req` in its slot, before the step."""

    req: Request
    start: int
    end: int


@dataclass(frozen=True)
class Copy:
    """The K/V of positions [0, tokens) of slot `src` into slot `dst`, before anything else in the step."""

    src: int
    dst: int
    tokens: int


@dataclass
class StepPlan:
    sampled: list[Request] = field(default_factory=list)  # row i < len(sampled) gives sampled[i] a token
    chunks: list[PromptChunk] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # per row
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per row, from the host (a placeholder where fed)
    feed: dict[int, int] = field(default_factory=dict)  # row → the sampled row of the step before whose token it takes
    copies: list[Copy] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # requests whose prompt starts in this step (placed now)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def prompt_rows(self) -> int:
        """Rows that carry prompt tokens (a prompt's last row, which samples, included)."""
        return sum(c.end - c.start for c in self.chunks)

    @property
    def kv_positions(self) -> int:
        """Cached positions the rows attend over, summed: what attention reads (the latency model's second term)."""
        return sum(self.positions)

    def add_row(self, slot: int, position: int, token: int) -> int:
        self.slots.append(slot)
        self.positions.append(position)
        self.tokens.append(token)
        return len(self.slots) - 1

    def __bool__(self) -> bool:
        return bool(self.slots)
