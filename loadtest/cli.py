"""`parley-loadtest`: what one GPU holds under the SLA, and what a token costs. Runs against any OpenAI-compatible
server (Parley, vLLM, ...) from a client box: it needs aiohttp, websockets and rich (matplotlib for --plot)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loadtest.clients import ClientPool, Target, first_model, server_text
from loadtest.record import RequestRecord
from loadtest.report import plot, print_run, sweep_table, write_json
from loadtest.runner import Load, run_load
from loadtest.stats import by_turn, summarize
from loadtest.sweep import find_max_rate
from loadtest.workers import run_workers
from loadtest.workload import Session, dataset_sessions, load_dataset, synthetic_sessions

# An assumption, not a quote: on-demand H100 80GB prices at GPU clouds ranged about $2-4 per GPU-hour in 2025-26
# (hyperscalers higher). Pass your own with --gpu-hourly-usd.
DEFAULT_GPU_HOURLY_USD = 2.50

# What a scenario changes: the defaults of the work. `voice` is a voice agent's conversation as Pipecat and LiveKit
# send it: a long system prompt, 8 turns of ~40-token messages, barge-in on 30% of the turns and preemptive starts
# on 30%. Any of these can still be given explicitly.
SCENARIOS: dict[str, dict[str, Any]] = {
    "requests": {"turns": 1, "input_len": 32, "cancel_after_tokens": None, "cancel_share": 1.0, "system_len": 0,
                 "preemptive_share": 0.0},
    "voice": {"turns": 8, "input_len": 40, "cancel_after_tokens": 8, "cancel_share": 0.3, "system_len": 1500,
              "preemptive_share": 0.3},
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none or the scenario sets it (the help says so)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _by_scenario(name: str) -> str:
    return ", ".join(f"{s}: {'off' if d[name] is None else d[name]}" for s, d in SCENARIOS.items())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parley-loadtest", formatter_class=_HelpFormatter,
        description="Load-test an OpenAI-compatible server: per-request latencies measured at the client, "
                    "SLA attainment (first N tokens within M ms), goodput, and USD per 1M output tokens.")
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat", "realtime"), default="completions",
                   help="/v1/completions, /v1/chat/completions (SSE), or Parley's /v1/realtime WebSocket")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as an error")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into each request body")
    g.add_argument("--session-header", action="store_true",
                   help="send each conversation's id in an x-session-id header, as a voice agent can (its call id): "
                        "what a session-sticky router policy keys on")
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, help="sessions per second, open loop (default: unlimited, so the "
                                              "concurrency cap makes it a closed loop)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--concurrency", type=int,
                   help="sessions in flight at most (default: one per worker when no --rate)")
    g.add_argument("--num-requests", type=int, help="measured sessions (default 100 unless --duration)")
    g.add_argument("--duration", type=float, help="seconds during which sessions arrive")
    g.add_argument("--warmup", type=int, default=2, help="sessions sent first and left out of every figure")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, arrivals and barge-ins")
    g.add_argument("--workers", type=int, default=1,
                   help="client processes sharing the load (one handles ~10-20k tokens/s before its own lag shows)")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", action="store_true",
                   help="find the highest rate at which >= --sla-target of ALL requests meet the SLA")
    g.add_argument("--sweep-rates", type=lambda s: [float(x) for x in s.split(",")],
                   help="comma-separated rates to measure instead of searching (e.g. 1,2,4,8)")
    g.add_argument("--sweep-start", type=float, default=1.0, help="first rate of the search (doubled until "
                                                                  "the SLA breaks, then bisected)")
    g.add_argument("--sweep-max-rate", type=float, default=1024.0, help="stop doubling here")
    g.add_argument("--sweep-bisect", type=int, default=3, help="bisection steps after the doubling")
    g.add_argument("--sla-target", type=float, default=0.99, help="share of requests that must meet the SLA")
    g = p.add_argument_group("work")
    g.add_argument("--scenario", choices=tuple(SCENARIOS), default="requests",
                   help="the defaults of the work: `requests` (independent prompts) or `voice` (voice-agent "
                        "conversations: system prompt, turns, barge-in, preemptive starts)")
    g.add_argument("--input-len", type=int,
                   help=f"synthetic prompt (user message) tokens, one-token words ({_by_scenario('input_len')})")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens, sent with ignore_eos=true")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="leave ignore_eos out (for servers that refuse the field; lengths are then not exact)")
    g.add_argument("--len-spread", type=float, default=0.0,
                   help="lengths drawn uniformly from len×[1-s, 1+s]")
    g.add_argument("--dataset", help="JSONL: one {\"prompt\": str} | {\"messages\": [...]} | {\"turns\": [...]} "
                                     "a line, optional \"max_tokens\"")
    g.add_argument("--shuffle", action="store_true", help="shuffle the dataset's rows")
    g.add_argument("--turns", type=int,
                   help=f"synthetic sessions of K turns, each extending the conversation ({_by_scenario('turns')})")
    g.add_argument("--cancel-after-tokens", type=int,
                   help="barge in after K tokens (close the stream / response.cancel, then "
                        f"conversation.item.truncate) ({_by_scenario('cancel_after_tokens')})")
    g.add_argument("--cancel-share", type=float,
                   help=f"share of turns barged in on ({_by_scenario('cancel_share')})")
    g.add_argument("--system-len", type=int,
                   help=f"tokens of a synthetic system prompt, 0 for none ({_by_scenario('system_len')})")
    g.add_argument("--system-per-session", action="store_true",
                   help="a system prompt of its own for each session, instead of one for all (one agent's)")
    g.add_argument("--preemptive-share", type=float,
                   help="share of turns whose reply is first started on partial transcripts, as LiveKit's "
                        "preemptive_generation and Pipecat's eager end-of-turn do "
                        f"({_by_scenario('preemptive_share')})")
    g.add_argument("--preemptive-max", type=int, default=2, help="preemptive starts on such a turn: 1 to this many")
    g.add_argument("--preemptive-after-tokens", type=int, default=4, help="cancel a preemptive start after K tokens")
    g.add_argument("--think-s", type=float, default=0.0,
                   help="seconds between a reply's end and the session's next turn (the caller listens, speaks)")
    g.add_argument("--after-refusal", choices=("hang-up", "fall-back"), default="hang-up",
                   help="when a reply is refused (429): end the session (hang-up), or go on as a voice agent with a "
                        "fallback LLM does (fall-back: that turn answered elsewhere, the next asked here again)")
    g = p.add_argument_group("SLA and cost")
    g.add_argument("--sla-tokens", type=int, default=64, help="N: the SLA is on the time to the Nth token")
    g.add_argument("--sla-ms", type=float, default=100.0, help="deadline for the Nth token, ms")
    g.add_argument("--gpu-hourly-usd", type=float, default=DEFAULT_GPU_HOURLY_USD,
                   help="USD per GPU-hour. The default is an ASSUMPTION (a typical on-demand H100 hour at GPU "
                        "clouds, 2025-26: about $2-4), not a quote: pass your own")
    g.add_argument("--gpus", type=int, default=1, help="GPUs serving the measured server")
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write every figure and one record per request to this file")
    g.add_argument("--plot", help="write latency CDFs (and latency against rate for a sweep) to this PNG")
    g.add_argument("--metrics-snapshots", metavar="DIR",
                   help="GET the server's /metrics (Prometheus text) before and after each rate into "
                        "DIR/<i>-<rate>-{before,after}.txt, their names in --json's runs: what the server's own "
                        "histograms saw at each rate of a sweep (bench e2e reads its engine loop's per rate)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def sessions_from(args: argparse.Namespace) -> tuple[Iterator[Session], int]:
    """The sessions, and the most turns one has (for the progress bar)."""
    if args.dataset:
        rows = load_dataset(args.dataset, args.output_len)
        return dataset_sessions(rows, args.shuffle, args.seed), max(len(r) for r in rows)
    return synthetic_sessions(args.input_len, args.output_len, args.len_spread, args.turns, args.seed,
                              args.system_len, args.system_per_session, args.preemptive_share,
                              args.preemptive_max), args.turns


def load_from(args: argparse.Namespace) -> Load:
    num = args.num_requests if args.num_requests is not None else (None if args.duration else 100)
    conc = args.concurrency if args.concurrency or args.rate or args.sweep else args.workers
    return Load(rate=args.rate, burstiness=args.burstiness, concurrency=conc, num_sessions=num,
                duration_s=args.duration, cancel_after=args.cancel_after_tokens, cancel_share=args.cancel_share,
                preemptive_after=args.preemptive_after_tokens, think_s=args.think_s, sla_tokens=args.sla_tokens,
                sla_ms=args.sla_ms, seed=args.seed, after_refusal=args.after_refusal)


async def amain(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    target = Target(url=args.url.rstrip("/"), endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                    timeout_s=args.timeout, extra_body=args.extra_body, ignore_eos=args.ignore_eos,
                    session_prefix=f"call-{args.seed}-{os.getpid()}" if args.session_header else None)
    load, (sessions, turns) = load_from(args), sessions_from(args)
    runs: list[dict[str, Any]] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    snapshots = Path(args.metrics_snapshots) if args.metrics_snapshots else None
    if snapshots is not None:
        snapshots.mkdir(parents=True, exist_ok=True)
    async with ClientPool(target) as pool:
        async def snapshot(name: str) -> str | None:
            """The server's /metrics now, into DIR/name: the name (None where the server did not answer)."""
            client = pool.take()
            try:
                text = await server_text(client, target, "/metrics")
            finally:
                pool.give(client)
            if text is None or snapshots is None:
                return None
            (snapshots / name).write_text(text)
            return name

        if target.model is None:
            client = pool.take()
            try:
                target.model = await first_model(client, target)
            except Exception as e:
                if isinstance(e, aiohttp.ClientResponseError) and e.status == 401:
                    raise SystemExit(f"{args.url} refused the API key ({'a wrong one' if args.api_key else 'none'} "
                                     "was sent): pass --api-key or set OPENAI_API_KEY") from None
                if target.endpoint != "realtime":
                    raise SystemExit(f"no --model given and GET {args.url}/v1/models failed: {e}") from e
            finally:
                pool.give(client)
        with Progress(*columns, console=console, disable=args.quiet, transient=True) as progress:
            async def measure(rate: float | None) -> dict[str, Any]:
                total = load.num_sessions * turns if load.num_sessions is not None else None
                task = progress.add_task(f"rate {rate if rate is not None else '∞'}", total=total)
                counts = dict.fromkeys(("ok", "rejected", "error", "cancelled"), 0)

                def on_record(r: RequestRecord) -> None:  # the bar counts replies; preemptive starts come on top
                    counts[r.outcome] += 1
                    progress.update(task, advance=r.kind != "preemptive",
                                    description=f"rate {rate if rate is not None else '∞'} ok {counts['ok']} "
                                    f"rej {counts['rejected']} err {counts['error']} cancel {counts['cancelled']}")

                lag: list[float] = []
                warmup = args.warmup if not runs else 0
                stem = f"{len(runs):02d}-{'max' if rate is None else f'{rate:g}'}"
                metrics = {"before": await snapshot(f"{stem}-before.txt")} if snapshots is not None else None
                if args.workers > 1:  # fresh prompts for each sweep point: another seed
                    make = partial(sessions_from, argparse.Namespace(**vars(args) | {"seed": args.seed + len(runs)}))
                    recs, lag = await run_workers(args.workers, target, make, replace(load, rate=rate), warmup,
                                                  lambda outcome, kind: on_record(RequestRecord(
                                                      0, 0, kind=kind, outcome=outcome)))
                else:
                    recs = await run_load(pool, target, sessions, replace(load, rate=rate), warmup=warmup,
                                          on_record=on_record, loop_lag_ms=lag)
                progress.update(task, completed=progress.tasks[task].total or len(recs), visible=False)
                if metrics is not None:  # the server's histograms over this rate alone (the first: its warm-up too)
                    metrics["after"] = await snapshot(f"{stem}-after.txt")
                summary = summarize(recs, args.gpu_hourly_usd, args.gpus, lag) | {
                    "by_turn": by_turn(recs, args.sla_tokens)}
                runs.append({"rate": rate, "concurrency": load.concurrency, "model": target.model,
                             "endpoint": target.endpoint, "summary": summary, "requests": recs}
                            | ({"metrics": metrics} if metrics is not None else {}))
                return summary

            sweep = None
            if args.sweep:
                points, best = await find_max_rate(measure, args.sla_target, args.sweep_rates, args.sweep_start,
                                                   args.sweep_max_rate, args.sweep_bisect)
                best_summary = next((s for r, s in points if r == best), None)
                sweep = {"target": args.sla_target, "best_rate": best, "best": best_summary}
            else:
                await measure(args.rate)
    if sweep is not None:
        console.print(sweep_table([(r["rate"], r["summary"]) for r in runs], sweep["best_rate"], args.sla_target))
        if sweep["best"] is not None:
            console.print(f"At the highest rate holding the SLA ({sweep['best_rate']:g} sessions/s):")
            print_run(console, sweep["best"], args.sla_tokens, args.sla_ms)
    else:
        print_run(console, runs[0]["summary"], args.sla_tokens, args.sla_ms)
    config = {k: v for k, v in vars(args).items() if k != "api_key"} | {"model": target.model}
    if args.json:
        write_json(args.json, config, runs, sweep)
    if args.plot:
        try:
            plot(args.plot, runs, args.sla_tokens, args.sla_ms)
        except ImportError:
            console.print("[yellow]--plot needs matplotlib: pip install matplotlib[/yellow]")
    return {"config": config, "runs": runs, "sweep": sweep}


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for name, default in SCENARIOS[args.scenario].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("rate", "burstiness", "concurrency", "num_requests", "duration", "timeout", "turns", "gpus", "workers",
                 "cancel_after_tokens", "sla_tokens", "sla_ms", "input_len", "output_len", "preemptive_max",
                 "preemptive_after_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.system_len < 0 or args.think_s < 0:
        p.error("--system-len and --think-s must be >= 0")
    if not (0 <= args.cancel_share <= 1 and 0 <= args.preemptive_share <= 1 and 0 <= args.len_spread < 1
            and 0 < args.sla_target <= 1):
        p.error("--cancel-share, --preemptive-share and --sla-target are in [0, 1], --len-spread in [0, 1)")
    if args.concurrency and args.workers > args.concurrency:
        p.error("--workers must not exceed --concurrency")
    console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=140)  # logs: wide
    asyncio.run(amain(args, console))
    return 0


if __name__ == "__main__":
    sys.exit(main())
