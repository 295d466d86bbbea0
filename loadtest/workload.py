"""What the load is made of: sessions of turns (synthetic or from a JSONL file) and their arrival times.

A session is one voice conversation: an optional system prompt, then K turns, each adding messages to the
conversation and asking for a reply; a turn may first start replies on partial transcripts of its message
(preemptive starts). A single request is a session of one turn. Arrivals, `--num-requests` and `--warmup` count
sessions.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Common English words that are ONE token each, with or without a leading space, in the BPE vocabularies of
# Llama-3, SmolLM2, Qwen2.5 and GPT-2/4 (checked on SmolLM2: n words joined by spaces = n tokens). A client has
# no tokenizer, so this is how a prompt gets a known length; the server's `usage.prompt_tokens` is reported too.
WORDS = (
    "the of and to in is that for it with as was on be at by this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know"
).split()

Message = dict[str, str]


@dataclass
class Turn:
    messages: list[Message]  # appended to the conversation before this turn's reply
    max_tokens: int
    # Replies started early, each on the messages as a partial transcript had them then (growing), and cancelled
    # once the transcript moved on: what LiveKit's preemptive_generation and Pipecat's eager end-of-turn send.
    preemptive: list[list[Message]] = field(default_factory=list)


@dataclass
class Session:
    index: int
    turns: list[Turn]
    system: str | None = None  # the system prompt (realtime: the session's instructions)


def synthetic_text(n_tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


def spread_len(n: int, spread: float, rng: random.Random) -> int:
    """A length drawn uniformly from [n(1-spread), n(1+spread)], at least 1 (vLLM's --random-range-ratio)."""
    if spread <= 0:
        return n
    return max(1, round(rng.uniform(n * (1 - spread), n * (1 + spread))))


def synthetic_sessions(input_len: int, output_len: int, spread: float = 0.0, turns: int = 1, seed: int = 0,
                       system_len: int = 0, system_per_session: bool = False, preemptive_share: float = 0.0,
                       preemptive_max: int = 2) -> Iterator[Session]:
    """Endless sessions of `turns` turns; each turn a user message of about `input_len` tokens. With `system_len`,
    a system prompt of that many tokens: one for every session (one voice agent's callers share it), or one per
    session. On a `preemptive_share` of turns (a seeded draw), 1 to `preemptive_max` preemptive starts."""
    rng = random.Random(seed)
    early = random.Random(f"{seed}:preemptive")  # its own draws: the same seed gives the same messages either way

    def system(i: int) -> str | None:
        if not system_len:
            return None
        return synthetic_text(system_len, random.Random(f"{seed}:system:{i if system_per_session else 'all'}"))

    for i in itertools.count():
        session_turns = []
        for _ in range(turns):
            text = synthetic_text(spread_len(input_len, spread, rng), rng)
            starts = early.randint(1, preemptive_max) if early.random() < preemptive_share else 0
            partial = [[{"role": "user", "content": t}] for t in partial_transcripts(text, starts, early)]
            session_turns.append(Turn([{"role": "user", "content": text}], spread_len(output_len, spread, rng),
                                      partial))
        yield Session(i, session_turns, system(i))


def partial_transcripts(text: str, count: int, rng: random.Random) -> list[str]:
    """`count` growing cuts of `text` (whole words, from half of it to all but its last word), as a speech
    recognizer's interim transcripts show the message before the user has finished it."""
    words = text.split(" ")
    cuts = range(max(1, len(words) // 2), len(words))
    return [" ".join(words[:n]) for n in sorted(rng.sample(cuts, min(count, len(cuts))))]


def parse_dataset_line(row: dict, output_len: int) -> list[Turn]:
    """One JSONL row: {"prompt": str} | {"messages": [...]} | {"turns": [str | [messages], ...]},
    with an optional "max_tokens" (or "output_len") that overrides --output-len."""
    max_tokens = int(row.get("max_tokens", row.get("output_len", output_len)))
    if "turns" in row:
        turns = row["turns"]
    elif "messages" in row:
        turns = [row["messages"]]
    elif "prompt" in row:
        turns = [row["prompt"]]
    else:
        raise ValueError(f"a dataset row needs 'prompt', 'messages' or 'turns': {row!r}")
    return [Turn([{"role": "user", "content": t}] if isinstance(t, str) else list(t), max_tokens) for t in turns]


def load_dataset(path: str | Path, output_len: int) -> list[list[Turn]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [parse_dataset_line(json.loads(line), output_len) for line in lines if line.strip()]


def dataset_sessions(rows: list[list[Turn]], shuffle: bool = False, seed: int = 0) -> Iterator[Session]:
    """The file's sessions in order (or shuffled), cycled endlessly."""
    order = list(range(len(rows)))
    if shuffle:
        random.Random(seed).shuffle(order)
    for i, j in enumerate(itertools.cycle(order)):
        yield Session(i, rows[j])


def prompt_text(conversation: list[Message]) -> str:
    """The conversation as one plain prompt (for /v1/completions): the contents joined by newlines."""
    return "\n".join(m["content"] for m in conversation)


def arrival_gaps(rate: float | None, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Seconds between arrivals: gamma-distributed with shape=burstiness and mean 1/rate (vLLM's bench;
    burstiness 1 = Poisson, < 1 burstier, > 1 more regular). rate None or inf: all at once."""
    rng = random.Random(seed)
    while True:
        if rate is None or math.isinf(rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def should_cancel(seed: int, session: int, turn: int, share: float) -> bool:
    """Whether this turn is barged in on: a fixed draw per (seed, session, turn), whatever the timing."""
    return share > 0 and random.Random(f"{seed}:{session}:{turn}").random() < share
