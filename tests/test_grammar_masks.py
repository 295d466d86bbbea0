"""Grammar masks off the engine thread (grammar.py, masks.py): a constrained request's next mask is computed on the
grammar's worker pool while the engine launches steps, the masks of a step's constrained rows are applied together,
and the output is what a step-by-step masked decode gives, beside any neighbours; a grammar that fails, fails its
request alone."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import queue
import threading
import time

import jsonschema
import pytest
import torch

from service.api.tools import SPEECH_OPENING
from service.backends.decoder import DecodeOutput
from service.backends.reference import ReferenceDecoder
from service.engine.engine import Engine
from service.engine.grammar import GrammarConstraint, Grammars, json_rule
from service.engine.masks import StepMasks
from service.engine.request import SamplingParams
from service.model.loader import load_model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"]}
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}
GREEDY = SamplingParams(max_tokens=60, temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


@pytest.fixture(scope="module")
def eos(tiny) -> int:
    return tiny.tokenizer.hf.token_to_id("<|im_end|>")


@pytest.fixture(scope="module")
def grammars(tiny, eos) -> Grammars:
    return Grammars(tiny.tokenizer, frozenset({eos}))


class Watched:
    """An llguidance matcher that records the threads its masks are computed on, and can be made to fail (from its
    Nth mask on), to allow nothing, or to be slow."""

    def __init__(self, inner, fail_at: int = 0, empty: bool = False, delay_s: float = 0.0) -> None:
        self.inner, self.fail_at, self.empty, self.delay_s = inner, fail_at, empty, delay_s
        self.threads: list[str] = []

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        self.inner.unsafe_compute_mask_ptr(ptr, size)
        if self.empty:
            ctypes.memset(ptr, 0, size)

    def is_error(self) -> bool:
        return self.fail_at > 0 and len(self.threads) >= self.fail_at or self.inner.is_error()

    def get_error(self) -> str:
        return "the grammar broke here" if self.fail_at else self.inner.get_error()

    def consume_token(self, token: int) -> bool:
        return self.inner.consume_token(token)

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()


def with_constraint(params: SamplingParams, c: GrammarConstraint) -> SamplingParams:
    return dataclasses.replace(params, constraint=c)


def constraint(grammars: Grammars, schema: dict, **watch) -> tuple[GrammarConstraint, Watched]:
    matcher = Watched(grammars.matcher(f"start: {json_rule(schema)}"), **watch)
    return GrammarConstraint(matcher, grammars.vocab_size, grammars.pool), matcher


class InStepReference(ReferenceDecoder):
    """The reference decoder as one that draws its tokens inside its step and takes the grammar masks there (as the
    megakernel does): the engine's in-step path, on the CPU. Its draw: a seeded softmax sample per row."""

    draws_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masked_steps = 0  # steps that carried grammar masks

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None) -> DecodeOutput:
        self.masked_steps += bool(masks)
        out = super().decode(slots, token_ids, positions, draws, sampled_rows, masks)
        if draws is None:
            return out
        return DecodeOutput(out.logits, out.argmax, self.draw(out.logits, draws[:len(out.logits)], positions))

    def draw(self, logits, draws, positions) -> torch.Tensor:
        out = []
        for row, d, pos in zip(logits, draws, positions):
            if d.temperature <= 0:
                out.append(int(row.argmax()))
            else:
                g = torch.Generator().manual_seed((d.seed + pos) % 2**63)
                out.append(int(torch.multinomial((row.float() / d.temperature).softmax(-1), 1, generator=g)))
        return torch.tensor(out)


def engine(tiny, eos, overlap: bool, in_step: bool = False) -> Engine:
    kind = InStepReference if in_step else ReferenceDecoder
    dec = kind(tiny.config, tiny.weights, max_slots=4, max_context=256)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(eos,), sla_tokens=8)
    eng.overlap = overlap  # run a step ahead as on a GPU
    return eng


def run(eng: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str, str | None]]:
    """Submit every job before the engine starts (so that they share steps); each one's (tokens, finish, error)."""
    qs = []
    for prompt, params in jobs:
        q: queue.SimpleQueue = queue.SimpleQueue()
        eng.submit(prompt, params, q.put)
        qs.append(q)
    eng.start()
    try:
        out = []
        for q in qs:
            deltas = []
            while not deltas or deltas[-1].finish_reason is None:
                deltas.append(q.get(timeout=60))
            out.append(([t for d in deltas for t in d.token_ids], deltas[-1].finish_reason, deltas[-1].error))
        return out
    finally:
        eng.stop()


def stepwise(tiny, grammars: Grammars, eos: int, prompt: list[int], schema: dict) -> list[int]:
    """The oracle: the reference decoder alone, one token at a time, its logits masked to what the grammar allows
    (computed here, on this thread), greedy, until EOS."""
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=1, max_context=256)
    matcher = grammars.matcher(f"start: {json_rule(schema)}")
    bits = torch.zeros((grammars.vocab_size + 31) // 32, dtype=torch.int32)
    logits = dec.prefill(0, prompt)
    out: list[int] = []
    while True:
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        allowed = [t for t in range(grammars.vocab_size) if int(bits[t // 32]) >> (t % 32) & 1]
        token = allowed[int(logits[allowed].argmax())]
        out.append(token)
        if token == eos:
            return out
        assert matcher.consume_token(token)
        logits = dec.decode([0], [token], [len(prompt) + len(out) - 1]).logits[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "ahead"])
@pytest.mark.parametrize("in_step", [False, True], ids=["masked-after", "masked-in-step"])
def test_constrained_output_is_the_masked_greedy_decode_and_valid_json(tiny, grammars, eos, overlap, in_step):
    c, _ = constraint(grammars, PERSON)
    eng = engine(tiny, eos, overlap, in_step)
    [(tokens, finish, _)] = run(eng, [([5, 6, 7], with_constraint(GREEDY, c))])
    assert tokens == stepwise(tiny, grammars, eos, [5, 6, 7], PERSON)
    if in_step:  # the masks went into the steps (every step after the first token's, which the prefill chose)
        assert eng.decoder.masked_steps >= len(tokens) - 1
    assert finish == "stop" and tokens[-1] == eos  # the grammar ended it, at its EOS
    jsonschema.validate(json.loads(tiny.tokenizer.decode(tokens[:-1])), PERSON)


def test_masks_are_computed_on_the_grammar_workers_never_on_the_engine_thread(tiny, grammars, eos):
    c, watched = constraint(grammars, PERSON)
    [(tokens, finish, _)] = run(engine(tiny, eos, True), [([5, 6, 7], with_constraint(GREEDY, c))])
    assert finish == "stop"
    # one mask a token (the first computed when the constraint was made), the last one after EOS's predecessor
    assert len(watched.threads) >= len(tokens)
    assert all(name.startswith("parley-grammar") for name in watched.threads), set(watched.threads)


@pytest.mark.parametrize("overlap,in_step", [(False, False), (True, False), (True, True)],
                         ids=["step-by-step", "ahead", "ahead-masked-in-step"])
def test_constrained_and_plain_requests_together_get_what_each_gets_alone(tiny, grammars, eos, overlap, in_step):
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def jobs():
        return [([5, 6, 7], with_constraint(GREEDY, constraint(grammars, PERSON)[0])),
                ([9, 9, 9], plain),
                ([100, 3], with_constraint(GREEDY, constraint(grammars, WORDS)[0])),
                ([1, 2, 3, 4], plain)]

    alone = [run(engine(tiny, eos, overlap, in_step), [job])[0] for job in jobs()]
    together = run(engine(tiny, eos, overlap, in_step), jobs())
    assert together == alone
    assert [finish for _, finish, _ in together] == ["stop", "length", "stop", "length"]
    jsonschema.validate(json.loads(tiny.tokenizer.decode(together[2][0][:-1])), WORDS)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "ahead"])
def test_an_opening_grammar_holds_the_first_token_then_is_lifted(tiny, grammars, eos, overlap):
    """A reply to a tool's result must open with a word (tools.SPEECH_OPENING): the first token is one, whatever the
    model prefers, and then the grammar is lifted: no further mask is computed, and the rest of the reply is the
    unconstrained greedy decode after that token."""
    watched = Watched(grammars.matcher(SPEECH_OPENING))
    c = GrammarConstraint(watched, grammars.vocab_size, grammars.pool, opening=True)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [(tokens, finish, _)] = run(engine(tiny, eos, overlap), [(prompt, with_constraint(params, c))])
    first = tiny.tokenizer.decode(tokens[:1]).removeprefix(" ")
    assert first[:1].isalnum() or first[:1] in "\"'¿¡(", first
    assert len(watched.threads) == 1 and c.lifted()  # the first token's mask alone
    plain = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    [(rest, _, _)] = run(engine(tiny, eos, overlap), [(prompt + tokens[:1], plain)])
    assert (tokens[1:], finish) == (rest, "length")


@pytest.mark.parametrize("how,message", [({"fail_at": 4}, "the grammar broke here"),
                                         ({"empty": True}, "the grammar allows no token here")])
def test_a_grammar_that_fails_fails_its_request_alone(tiny, grammars, eos, how, message):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=60, temperature=0.8)
    broken, _ = constraint(grammars, PERSON, **how)
    eng = engine(tiny, eos, True)
    got = run(eng, [([5, 6], with_constraint(sampled, broken)), ([9, 9, 9], plain),
                    ([1, 2], with_constraint(sampled, constraint(grammars, WORDS)[0]))])
    tokens, finish, error = got[0]
    assert finish == "error" and error == f"sampling failed: {message}"
    assert len(tokens) == (3 if "fail_at" in how else 0)  # masks 1-3 served tokens; the 4th failed
    assert got[1][1] == "length" and len(got[1][0]) == 12
    assert got[2][1] == "stop"
    jsonschema.validate(json.loads(tiny.tokenizer.decode(got[2][0][:-1])), WORDS)


def test_a_mask_not_ready_in_time_is_waited_for_and_counted(tiny, grammars, eos):
    c, _ = constraint(grammars, PERSON, delay_s=0.05)
    eng = engine(tiny, eos, True)
    [(tokens, finish, _)] = run(eng, [([5, 6, 7], with_constraint(GREEDY, c))])
    assert finish == "stop"
    assert tokens == stepwise(tiny, grammars, eos, [5, 6, 7], PERSON)
    waits = eng.metrics.grammar_mask_waits._value.get()
    assert len(tokens) // 2 <= waits <= len(tokens)  # a mask 50 ms late: most steps wait for it


def test_step_masks_mask_only_the_constrained_rows(tiny, grammars):
    """StepMasks.apply: the constrained rows' disallowed tokens at -inf (ids past the tokenizer's vocabulary too),
    every other row untouched; a staging buffer reused later allows everything again where its row is not masked."""
    vocab = grammars.vocab_size + 40  # a padded embedding
    masks = StepMasks(buffers=1)
    logits = torch.randn(3, vocab)
    c, _ = constraint(grammars, WORDS)
    out = masks.apply(logits, {1: c})
    assert not out.errors
    assert torch.equal(out.logits[0], logits[0]) and torch.equal(out.logits[2], logits[2])
    allowed = torch.isfinite(out.logits[1]).nonzero().flatten().tolist()
    assert len(allowed) == 1 and tiny.tokenizer.decode(allowed) == "["  # a JSON array opens, byte by byte
    assert torch.equal(out.logits[1, allowed], logits[1, allowed])
    assert torch.equal(masks.apply(logits, {}).logits, logits)  # the same buffer: row 1 allows everything again


@pytest.mark.gpu
def test_on_the_gpu_masks_and_choices_are_the_cpus(tiny, grammars):
    """On CUDA (pinned staging buffers in turn, copies that nobody waits for), step after step: the masked logits and
    the greedy constrained choices are the CPU's, for constrained rows that change from step to step."""
    from service.engine import sampler
    from service.engine.output import TextOutput
    from service.engine.request import Request

    gen = torch.Generator().manual_seed(0)
    cpu, gpu = StepMasks(), StepMasks()
    for step in range(12):  # past the buffers' turn
        logits = torch.randn(6, grammars.vocab_size + 40, generator=gen)
        rows = {i: constraint(grammars, PERSON if i % 2 else WORDS)[0] for i in range(6) if (i + step) % 3 == 0}
        on_cpu = cpu.apply(logits, rows).logits
        on_gpu = gpu.apply(logits.cuda(), rows).logits
        assert torch.equal(on_gpu.cpu(), on_cpu)
        reqs = [Request([1], with_constraint(GREEDY, rows[i]) if i in rows else GREEDY, lambda d: None,
                        TextOutput(tiny.tokenizer.detokenizer())) for i in range(6)]
        for r in reqs:
            r.choice = sampler.choice_of(r, draws_tokens=False)
        dev = logits.cuda()
        tokens = sampler.choose(DecodeOutput(dev, dev.argmax(-1)), reqs, masks=gpu)
        tokens.read()
        assert [tokens.token(i) for i in range(6)] == on_cpu.argmax(-1).tolist()
