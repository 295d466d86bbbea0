"""The engine thread's own Python for one step's tokens (issue 37), on this CPU: what grows with the rows of a step.

On a GPU host the engine thread's time per iteration (0.33-0.40 ms p50 in the H200's FP8 sweeps, against a 0.75-0.85
ms step) is the slack a verdict must fit beside (bench/NOTES.md, s72), and much of it is per token: planning a row,
committing its token (the stop rule, the event), publishing it (the delta into the engine process's outbox,
Prometheus, admission's clocks) and the iteration's message to the front end. This times those parts alone, without
threads, a decoder or a socket: an Engine whose planner holds N requests decoding (32-token prompts, replies that never
end, token ids drawn from the real Llama-sized vocabulary), taken as the engine process takes a request without stop
strings (token ids out: its front end writes the text), its admission and metrics as `parley serve` builds them, and
an engine-process outbox encoded with msgspec as the engine process sends it. Each part is timed over many steps (the
minimum of several rounds, per step and per token).

    python -m bench step-host [--decoding 1 4 8 16] [--steps 2000] [--tag NAME]

Writes bench/results/step-host-<cpu>[-<tag>].{json,md}. Compare builds on one machine, in one run of each.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.device import cpu_name, describe, file_stem
from bench.publish import publish
from bench.verdict import latency_model
from service.admission import AdmissionController
from service.engine import ipc
from service.engine.commit import commit
from service.engine.engine import Engine
from service.engine.messages import Out, StepOutput
from service.engine.request import Delta, SamplingParams
from service.metrics import Metrics
from service.model.config import ModelConfig
from service.model.synthetic import SHAPES, smollm2_tokenizer

PROMPT_TOKENS, SLA_TOKENS = 32, 64
CONTEXT = 1 << 24  # replies that never end, however many steps are timed
MODEL = SHAPES["llama-3.2-1b"]


class NoDecoder:
    """What the engine reads of a decoder, and nothing it runs: this bench never launches a step."""

    def __init__(self, config: ModelConfig, slots: int) -> None:
        import torch

        self.config, self.max_slots, self.max_context = config, slots, CONTEXT
        self.device = torch.device("cpu")
        self.draws_tokens = True
        self.slow_prefills = self.query_block_steps = 0


class Outbox:
    """The engine process's sink and its iteration's message (EngineService._sink and _flush), with no socket."""

    def __init__(self) -> None:
        self.box: list[Out] = []
        self.bytes = 0

    def sink(self, rid: int, d: Delta) -> None:
        self.box.append(Out(rid, d.text, d.token_ids))

    def flush(self) -> None:
        box, self.box = self.box, []
        self.bytes = len(ipc.ENCODER.encode(StepOutput(box, time.perf_counter())))


def engine_with(decoding: int, seed: int) -> tuple[Engine, Outbox]:
    """An engine whose planner holds `decoding` requests past their prompts, each admitted by its admission."""
    tok = smollm2_tokenizer(MODEL.vocab_size)
    metrics = Metrics(SLA_TOKENS)
    lat = latency_model()
    admission = AdmissionController(lat, 1.0, SLA_TOKENS, 16, strict=False)  # all 16 admitted at once
    engine = Engine(NoDecoder(MODEL, 64), tok, MODEL.eos_token_ids, metrics=metrics,  # type: ignore[arg-type]
                     admission=admission, sla_ms=1000.0, sla_tokens=SLA_TOKENS, max_batch=16,
                    max_rows=16, prefill_rows=64)
    outbox = Outbox()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=CONTEXT // 2, ignore_eos=True)
    # as the engine process takes a request without stop strings: token ids out, its front end detokenizes (a build
    # from before that detokenized every request in the engine; this bench runs on it too, for a comparison)
    own_text = {} if "detokenize" not in inspect.signature(engine.prepare).parameters else {"detokenize": False}
    for i in range(decoding):
        prompt = [rng.randrange(1000, MODEL.vocab_size - 1000) for _ in range(PROMPT_TOKENS)]
        engine.admit(engine.prepare(prompt, params, functools.partial(outbox.sink, i), **own_text))
    engine._take_inbox()
    token = token_source(seed)
    planner = engine.planner
    while any(not r.output_ids for r in (*planner.waiting, *planner.prefilling, *planner.running)):
        engine._publish(commit(engine.planner.plan(), token, engine.eos, CONTEXT, time.perf_counter()))
    outbox.flush()
    return engine, outbox


def token_source(seed: int) -> Any:
    """Each row's token: ids of ordinary words and pieces (the vocabulary's first 30,000 past its bytes)."""
    rng = random.Random(seed)
    return lambda row: rng.randrange(300, 30_000)


def best(fn: Any, steps: int, rounds: int = 5) -> float:
    """The minimum over rounds of fn's seconds per call."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        out.append((time.perf_counter() - t0) / steps)
    return min(out)


def point(decoding: int, steps: int, seed: int) -> dict[str, Any]:
    engine, outbox = engine_with(decoding, seed)
    token = token_source(seed + 1)
    planner = engine.planner
    plan = planner.plan()
    assert len(plan.sampled) == decoding and not plan.chunks, "every request decodes"
    plan_s = best(lambda: planner.plan(), steps)
    state: dict[str, Any] = {}

    def committed() -> None:
        state["events"] = commit(planner.plan(), token, engine.eos, CONTEXT, time.perf_counter(), 0.0009)

    commit_s = best(committed, steps) - plan_s

    def published() -> None:
        committed()
        engine._publish(state["events"])
        outbox.flush()

    whole_s = best(published, steps)
    publish_s = whole_s - plan_s - commit_s

    def us(seconds: float) -> float:
        return round(seconds * 1e6, 1)

    return {"decoding": decoding, "plan_us": us(plan_s), "commit_us": us(commit_s), "publish_us": us(publish_s),
            "step_us": us(whole_s), "per_token_us": us(whole_s / decoding), "message_bytes": outbox.bytes}


COLUMNS = (("decoding", "requests decoding"), ("plan_us", "plan µs"), ("commit_us", "commit µs"),
           ("publish_us", "publish + message µs"), ("step_us", "a step's host µs"), ("per_token_us", "µs a token"),
           ("message_bytes", "message bytes"))


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# The engine thread's Python for a step's tokens on {result['cpu']}", "",
             f"Python {result['python']}, Parley {result['parley']}. N requests decoding (32-token prompts, Llama-3.2 "
             "vocabulary), one token each a step: the plan, the commit (tokens applied, detokenized, the stop rule, "
             "the events), the publish (each delta into the engine process's outbox, Prometheus, admission) and the "
             "iteration's message encoded; no decoder, no threads, no socket. Minimum of 5 rounds of "
             f"{result['steps']} steps.", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in result["points"]:
        lines.append("| " + " | ".join(str(p[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench step-host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoding", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    points = []
    for n in a.decoding:
        points.append(point(n, a.steps, a.seed))
        print(json.dumps(points[-1]), flush=True)
    result = {**describe("cpu"), "cpu": cpu_name(), "steps": a.steps, "points": points}
    publish(Path(a.out), file_stem("step-host" + (f"-{a.tag}" if a.tag else ""), cpu_name(short=True)), result,
            markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
