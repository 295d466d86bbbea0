"""Does a constrained request slow its neighbours? Inter-token latency of N unconstrained streams decoded together,
without and then with one constrained request (response_format json_schema, masked by its grammar on every token)
in the same batch, and of the constrained request itself, as clients see them (parley-loadtest's HTTP client).

    python -m bench constrained                        # the GPU: synthetic Llama-3.2-1B shapes, the megakernel
    python -m bench constrained --model synthetic:tiny --backend reference --device cpu --neighbours 2 \\
        --tokens 24 --repeats 1 --serve-args "--sla-ms 60000" --out /tmp/constrained   # a quick check on a CPU

It starts `parley serve` (its log in bench/results/raw/; or measures --url), runs the two scenarios in turn
`--repeats` times, and writes <out>/constrained-<device>.json and .md: the device, the versions, and ITL p50/p99 of
the neighbours without a constrained request (the baseline), of the neighbours beside one, and of the constrained
request; and how often the engine thread waited for a grammar mask (computed off it: parley_grammar_mask_waits).
The synthetic models tokenize as SmolLM2 does, so the grammar works over a real 49k vocabulary; their random weights
never stop on their own, and the schema (an array of at least --tokens items) keeps the grammar at work for every
token.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
from pathlib import Path
from typing import Any

from bench.device import describe, file_stem
from bench.publish import RAW, RESULTS, publish
from bench.server import add_api_key_argument, api_key, get_text, serving, use_api_key
from bench.soak import metric, parse_metrics
from loadtest.clients import ClientPool, Target, http_turn
from loadtest.record import RequestRecord, finish
from loadtest.stats import describe as spread

PROMPT = [{"role": "user", "content": "List words with a number for each, as JSON."}]


def long_schema(items: int) -> dict[str, Any]:
    """JSON that takes more than `items` tokens to complete: the grammar masks every token of the run."""
    return {"type": "array", "minItems": items, "items": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["word", "n"]}}


async def scenario(url: str, neighbours: int, tokens: int, constrained: bool,
                   stagger_s: float) -> list[tuple[bool, RequestRecord]]:
    """`neighbours` unconstrained streams of `tokens` tokens, and with `constrained` one more under a json_schema
    grammar (the first to start), started `stagger_s` apart: all at once, the later ones would be refused by
    admission control (each prefill delays the streams already within their first 64 tokens). (constrained?, its
    record) each."""
    fmt = {"type": "json_schema", "json_schema": {"name": "words", "schema": long_schema(tokens)}}
    targets = [Target(url, "chat", api_key=api_key(), extra_body={"temperature": 1.0}) for _ in range(neighbours)]
    if constrained:
        targets.insert(0, Target(url, "chat", api_key=api_key(),
                                 extra_body={"temperature": 1.0, "response_format": fmt}))

    async def start(i: int, target: Target, pool: ClientPool) -> RequestRecord:
        await asyncio.sleep(i * stagger_s)
        return await http_turn(pool.take(), target, PROMPT, tokens, RequestRecord(i, 0))

    async with ClientPool(targets[0]) as pool:
        records = await asyncio.gather(*(start(i, t, pool) for i, t in enumerate(targets)))
    return [(constrained and i == 0, finish(r, sla_tokens=64, sla_ms=100.0)) for i, r in enumerate(records)]


def figures(itl_ms: list[float]) -> dict[str, Any]:
    d = spread(itl_ms)
    rounded = {k: round(v, 3) if (v := d[k]) is not None else None for k in ("p50", "p99", "mean")}
    return {"n": d["n"], **rounded}


def mask_waits(url: str) -> float | None:
    """The server's count of grammar masks the engine thread waited for (None: not served)."""
    text = get_text(url, "/metrics")
    return None if text is None else metric(parse_metrics(text), "parley_grammar_mask_waits_total")


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    # warm-up: the grammar engine's vocabulary is built once
    await scenario(url, 1, 8, constrained=True, stagger_s=0.0)
    waits_before = await asyncio.to_thread(mask_waits, url)
    itl: dict[str, list[float]] = {"baseline": [], "beside": [], "constrained": []}
    refused: list[str] = []
    constrained_tokens = 0
    for _ in range(args.repeats):
        for mixed in (False, True):
            for constrained, r in await scenario(url, args.neighbours, args.tokens, mixed,
                                                           args.stagger_ms / 1e3):
                if r.outcome != "ok":
                    refused.append(f"{r.status} {r.error or ''}".strip())
                itl["constrained" if constrained else "beside" if mixed else "baseline"] += r.itl_ms
                constrained_tokens += r.output_tokens if constrained else 0
    waits_after = await asyncio.to_thread(mask_waits, url)
    base, beside = figures(itl["baseline"]), figures(itl["beside"])
    slowdown = beside["p50"] / base["p50"] - 1 if base["p50"] and beside["p50"] is not None else None
    waits = None if waits_before is None or waits_after is None else int(waits_after - waits_before)
    return {"itl_ms": {"baseline_neighbours": base, "neighbours_beside_constrained": beside,
                       "constrained": figures(itl["constrained"])},
            "neighbour_p50_slowdown": slowdown, "refused": refused,
            "grammar_mask_waits": waits, "constrained_tokens": constrained_tokens}


def markdown(result: dict[str, Any]) -> str:
    names = {"baseline_neighbours": "neighbours, no constrained request (the baseline)",
             "neighbours_beside_constrained": "neighbours beside one constrained request",
             "constrained": "the constrained request (json_schema)"}
    cfg = result["config"]
    lines = [f"# Inter-token latency beside a constrained request — {result['device']}", "",
             f"`{cfg['model']}`, backend `{cfg['backend']}`, {cfg['neighbours']} unconstrained streams of "
             f"{cfg['tokens']} tokens (+ one json_schema stream, the first), "
             f"started {cfg.get('stagger_ms', 0):g} ms apart, {cfg['repeats']} repeats; "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), "",
             "| streams | ITL p50 (ms) | ITL p99 (ms) | mean (ms) | gaps |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {names[k]} | {s['p50']} | {s['p99']} | {s['mean']} | {s['n']} |" for k, s in result["itl_ms"].items()]
    if result["neighbour_p50_slowdown"] is not None:
        lines += ["", f"Neighbours' ITL p50 beside a constrained request: {result['neighbour_p50_slowdown']:+.1%} "
                      "against the baseline."]
    if result.get("grammar_mask_waits") is not None:
        lines += ["", f"The engine thread waited for {result['grammar_mask_waits']} of the "
                      f"{result['constrained_tokens']} constrained tokens' grammar masks (computed off it)."]
    if result["refused"]:
        lines += ["", f"{len(result['refused'])} requests were refused or failed, and are not measured: "
                      f"{result['refused'][0]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench constrained", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:llama-3.2-1b")
    p.add_argument("--backend", default="megakernel")
    p.add_argument("--device", default=None, help="cuda or cpu (default: the server's choice)")
    p.add_argument("--neighbours", type=int, default=7, help="unconstrained streams decoded with it")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stagger-ms", type=float, default=25.0, help="between the streams' starts")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--serve-args", default="", help="more `parley serve` flags")
    p.add_argument("--url", default=None, help="measure a running server instead of starting one")
    p.add_argument("--out", default=str(RESULTS))
    add_api_key_argument(p)
    args = p.parse_args(argv)
    use_api_key(args.api_key)
    info = describe(args.device)
    device = str(info["device"])
    stem = file_stem("constrained", device)
    if args.url is None:
        flags = ["--model", args.model, "--backend", args.backend, "--max-batch", str(args.neighbours + 1),
                 "--max-context", str(args.max_context), *(["--device", args.device] if args.device else []),
                 *shlex.split(args.serve_args)]
        with serving(flags, RAW / f"{stem}.log", timeout_s=900) as url:  # logs are no result
            measured = asyncio.run(measure(args, url))
    else:
        measured = asyncio.run(measure(args, args.url))
    result = {"device": device, "versions": {k: v for k, v in info.items() if k != "device"},
              "config": {k: getattr(args, k) for k in ("model", "backend", "neighbours", "tokens", "repeats",
                                                                  "stagger_ms")},
              **measured}
    publish(Path(args.out), stem, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
