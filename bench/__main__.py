"""`python -m bench <name> [options]` (or `parley-bench`): every benchmark of Parley from one entry point.

The planned ones (bench/runs.py: servers and loadtests declared as data) take the options below; the others are
scripts of their own, run as if called directly, and take their own options (`python -m bench decode --help`)."""

from __future__ import annotations

import argparse
import inspect
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.publish import RAW, RESULTS
from bench.runs import BENCHMARKS, Benchmark
from bench.server import add_api_key_argument, use_api_key

# name -> (module run as __main__, what it measures)
SCRIPTS = {
    "constrained": ("bench.constrained_gpu", "ITL of streams beside a JSON-schema-constrained one (a GPU call)"),
    "soak": ("bench.soak", "hours of mixed, misbehaving traffic against one server, then a verdict"),
    "decode": ("bench.decode", "the decode step: megakernel against its peers and the bandwidth floor (GPU)"),
    "ncu-step": ("bench.ncu_step", "where one decode step's warps wait, line by line, under Nsight Compute (GPU)"),
    "boundary": ("bench.boundary", "one phase boundary's latency by the way programs signal readiness (GPU)"),
    "host-wake": ("bench.host_wake", "an idle server's thread and process hops after idle gaps, by wait mode (CPU)"),
    "token-hop": ("bench.token_hop", "the engine's way back to a front end: ZeroMQ against the frame socket (CPU)"),
    "idle-gap": ("bench.idle_gap", "decode steps after the GPU idles, and its clocks: light load's slow steps (GPU)"),
    "sm90-compile": ("bench.sm90_compile", "compile the megakernel for sm_90 without a GPU, report registers"),
    "gluon-proto": ("bench.gluon_proto", "gate/up alone: Gluon swap-AB (TMA, wgmma) vs Triton vs cuBLAS (GPU)"),
    "gluon-chain": ("bench.gluon_chain", "the loader's prototype: a layer's matrices chained, ring vs drain (GPU)"),
    "fp8-quality": ("bench.fp8_quality", "what FP8 weights cost in perplexity and greedy agreement"),
    "tool-speech": ("bench.tool_speech", "20 tool round trips: does each follow-up end in speech (CPU or GPU)"),
    "diag": ("bench._diag", "the megakernel's per-step logits error against the reference (GPU)"),
    "engine-loop": ("bench.engine_loop", "the engine loop alone: host time, GPU idle, token gaps at 1-16 rows"),
    "host-profile": ("bench.host_profile", "a py-spy recording of a server (e2e --set profile=...), summarized"),
    "step-host": ("bench.step_host", "the engine thread's Python for one step's tokens: plan, commit, publish (CPU)"),
    "verdict": ("bench.verdict", "admission's verdict on a newcomer beside N in flight: its host time (CPU)"),
    "router": ("bench.router", "N replicas (one per GPU) behind vllm-router: goodput ratio, voice caching, failover"),
}
ABOUT = {
    "e2e": "end to end: single streams and the goodput sweep, per server of the runs table (one GPU call)",
    "voice": "voice sessions (HTTP, WebSocket), fresh prompts, session arrivals at 1-16/s, bf16 (one GPU call)",
    "voice-fp8": "the voice benchmark with FP8 weights (one GPU call)",
}


def usage() -> str:
    width = max(map(len, [*BENCHMARKS, *SCRIPTS]))
    lines = [__doc__.split("\n\n")[0], "", "planned (--dry-run prints the plan):"]
    lines += [f"  {name:{width}}  {ABOUT.get(name, '')}" for name in BENCHMARKS]
    lines += ["", "scripts:"]
    lines += [f"  {name:{width}}  {about}" for name, (_, about) in SCRIPTS.items()]
    lines += ["", "python -m bench <name> --help: its options"]
    return "\n".join(lines)


def sizes(builder: Callable[..., Benchmark]) -> dict[str, Any]:
    """The builder's keyword arguments and their defaults: what `--set` may change."""
    return {k: p.default for k, p in inspect.signature(builder).parameters.items()}


def parse_sets(builder: Callable[..., Benchmark], pairs: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs as the builder's keyword arguments, each of its default's type."""
    known, out = sizes(builder), {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        kind = type(known[key])
        if kind is bool:
            out[key] = text.lower() in ("1", "true", "yes", "on")
        else:
            try:
                out[key] = kind(text)
            except ValueError:
                raise ValueError(f"--set {pair!r}: {key} is a {kind.__name__}") from None
    return out


def planned(name: str, argv: Sequence[str]) -> int:
    builder = BENCHMARKS[name]
    defaults = "\n".join(f"  {k}={v!r}" for k, v in sizes(builder).items())
    p = argparse.ArgumentParser(
        prog=f"python -m bench {name}", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{ABOUT.get(name, name)}.\n\n{inspect.getdoc(getattr(builder, 'func', builder))}",
        epilog=f"--set KEY=VALUE, the keys and their defaults:\n{defaults}")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the report goes (default: bench/results)")
    p.add_argument("--raw", type=Path, help="where per-request data, server logs and metrics go (default: "
                                            f"bench/results/raw/{name}, git-ignored)")
    p.add_argument("--archive", type=Path, help="also pack the raw folder into this .tar.gz (a GPU call brings "
                                                "back a few files, not a folder)")
    p.add_argument("--url", help="measure the server already running there (start none; its flags are its own)")
    add_api_key_argument(p)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="change one size of the plan (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time it should take, run nothing")
    p.add_argument("--report-only", action="store_true", help="fold the raw folder into the report, measure nothing")
    args = p.parse_args(argv)
    use_api_key(args.api_key)
    try:
        bench = builder(**parse_sets(builder, args.sets))
    except ValueError as e:
        p.error(str(e))
    raw = args.raw or RAW / bench.name
    from bench import runner  # after the arguments: --help needs none of it

    if args.dry_run:
        print(runner.plan_text(bench, raw, args.out, args.url))
        return 0
    if args.report_only:
        for path in runner.fold(bench, raw, args.out):
            print(path)
        return 0
    return runner.run(bench, raw, args.out, args.url, args.archive)


def script(name: str, argv: Sequence[str]) -> int:
    """Run the script as `python -m <module> ARGV` would; its exit status."""
    module = SCRIPTS[name][0]
    saved = sys.argv
    sys.argv = [f"python -m bench {name}", *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # SystemExit("message"), as the interpreter would print it
        return 1
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help", "list"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in BENCHMARKS:
        return planned(name, rest)
    if name in SCRIPTS:
        return script(name, rest)
    print(f"python -m bench: no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
