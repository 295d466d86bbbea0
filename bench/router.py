"""`python -m bench router`: N Parley replicas, one per GPU, behind vllm-router with the flags docker-compose.yml
gives it (bench/fleet.py), measured by parley-loadtest through the router, in three phases:

- goodput: `bench e2e`'s goodput sweep (Poisson arrivals, 32-token prompts, 64-token replies; the highest rate at
  which >= 99% of ALL requests meet the SLA) against one replica directly, then through the router from N times the
  first rate, in the same run: `goodput_ratio` = the router's goodput / the replica's (target >= 1.9 for two);
- failover: Poisson load through the router, the last replica SIGKILLed mid-way and restarted (bench/failover.py);
- voice: `--scenario voice` over HTTP chat through the router at 2, 8 and 16 sessions/s: admitted turns on time, and
  the share of prompt tokens served from the replicas' caches (their /metrics, and the replies' usage).

    python -m bench router --phase goodput,failover   # one GPU call: ~5-6 min on two H100s
    python -m bench router --phase voice              # a second call: ~3-4 min
    python -m bench router --dry-run                  # the plan and its estimate

Each run merges its phases into <out>/router-<device>-x<N>.{json,md} (a phase measured again replaces its own; the
others stay), so phases run in separate calls make one report. Raw files (each loadtest's JSON, the servers' and
the router's logs, /metrics) go to <raw>, git-ignored. `--cpu` runs the replicas on the CPU (tests/test_bench_router.py
runs the whole script that way at tiny sizes, with `--serve-args "--model synthetic:tiny --backend reference"`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import failover, router_report
from bench.device import describe, file_stem
from bench.e2e_report import record
from bench.fleet import Fleet, fleet, gpu_ids, metric_total, render_compose, scrape
from bench.publish import RAW, RESULTS
from bench.runner import pack, run_loadtest, say
from bench.runs import START_S, Benchmark, Loadtest, e2e, voice, with_flags
from bench.server import ROOT, ServerFailed, add_api_key_argument, use_api_key
from loadtest.record import RequestRecord
from loadtest.stats import conversation_figures

PHASES = ("goodput", "failover", "voice")
E2E_RUN = "megakernel.bf16"  # the run of bench e2e whose serve flags and sweep the goodput and failover phases use
VOICE_THINK_S = 0.5  # as bench voice: between a reply's end and the next turn
FAILOVER_SHARE_OF_ONE = 0.8  # the failover load, as a share of one replica's goodput: the survivor can carry it
FAILOVER_DEFAULT_RATE = 12.0  # where no goodput was measured (one H100 holds ~15 req/s bf16)
FAILOVER_ESTIMATE_S = 70.0


@dataclass(frozen=True)
class Plan:
    replicas: int
    cpu: bool
    phases: tuple[str, ...]
    serve_args: str
    sla_ms: float
    timeout_s: float
    sweep_start: float
    sweep_bisect: int
    sweep_s: float
    sweep_rates: str  # fixed rates for the replica (the router gets N times each) instead of the search
    sweep_workers: int
    voice_rates: tuple[float, ...]
    voice_s: float
    voice_workers: int
    voice_args: str
    failover_rate: float | None
    kill_at_s: float
    restart_after_s: float
    back_requests: int
    tail_s: float
    back_timeout_s: float
    start_timeout_s: float
    router_args: str = ""  # flags replacing or added to the router's (compose's)

    @property
    def loadtest_args(self) -> tuple[str, ...]:
        return ("--sla-tokens", "64", "--sla-ms", f"{self.sla_ms:g}", "--timeout", f"{self.timeout_s:g}")

    def serve(self, phase: str) -> tuple[str, ...]:
        """The replicas' flags: bench e2e's megakernel bf16 run (goodput, failover) or bench voice's server (8k
        context: a conversation outgrows 2k), with --sla-ms and `serve_args` on top."""
        extra = f"--sla-ms {self.sla_ms:g}{' --device cpu' if self.cpu else ''} {self.serve_args}"
        if phase == "voice":
            return voice(serve_args=extra).servers[0].serve
        return e2e(only=E2E_RUN, serve_args=extra).servers[0].serve

    def sweep(self, name: str, start: float, rates: list[float], gpus: int) -> Loadtest:
        """bench e2e's goodput sweep (its loadtest of E2E_RUN), from `start` (or at `rates`), costed for `gpus`."""
        [test] = [t for t in e2e(only=E2E_RUN, sweep_start=start, sweep_bisect=self.sweep_bisect,
                                 sweep_s=self.sweep_s, sweep_workers=self.sweep_workers).servers[0].loadtests
                  if "--sweep" in t.args]
        args = with_flags(test.args, f"--gpus {gpus}")
        estimate = test.estimate_s
        if rates:
            args = with_flags(args, "--sweep-rates " + ",".join(f"{r:g}" for r in rates))
            estimate = len(rates) * (self.sweep_s + 2)
        return Loadtest(name, args, estimate)

    def voice_test(self, k: int, rate: float) -> Loadtest:
        # Each rate its own seed: its own agent (system prompt) and callers, nothing cached from the rate before.
        args = ("--scenario", "voice", "--endpoint", "chat", "--rate", f"{rate:g}", "--duration", f"{self.voice_s:g}",
                "--warmup", "1" if k == 0 else "0", "--think-s", f"{VOICE_THINK_S:g}", "--seed", str(1 + k),
                "--workers", str(self.voice_workers), "--gpus", str(self.replicas), *shlex.split(self.voice_args))
        return Loadtest(f"voice-{rate:g}", args, self.voice_s + 12)

    def estimate_s(self) -> float:
        """About how long the phases take on two H100s (a fleet's start counted as START_S)."""
        total = 0.0
        groups = {"voice" if p == "voice" else "e2e" for p in self.phases}
        total += START_S * len(groups)
        if "goodput" in self.phases:
            rates = [float(r) for r in self.sweep_rates.split(",") if r.strip()]
            total += 2 * self.sweep("single", self.sweep_start, rates, 1).estimate_s
        if "failover" in self.phases:
            total += FAILOVER_ESTIMATE_S
        if "voice" in self.phases:
            total += sum(self.voice_test(k, r).estimate_s for k, r in enumerate(self.voice_rates))
        return total


def _floats(csv: str) -> list[float]:
    return [float(x) for x in csv.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench router", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__)
    p.add_argument("--replicas", type=int, default=2, help="replicas, one on each of GPUs 0..N-1 (default 2)")
    p.add_argument("--cpu", action="store_true", help="run the replicas on the CPU (a check of the script)")
    p.add_argument("--phase", default="all", help=f"comma-separated, of {', '.join(PHASES)} (default all)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the report goes (default bench/results)")
    p.add_argument("--raw", type=Path, default=RAW / "router", help="raw files (default bench/results/raw/router)")
    p.add_argument("--archive", type=Path, help="also pack the raw folder into this .tar.gz after each phase")
    p.add_argument("--serve-args", default="", help="flags replacing or added to every replica's")
    p.add_argument("--sla-ms", type=float, default=100.0, help="the SLA, for the replicas and the loadtests")
    p.add_argument("--timeout", type=float, default=30.0, help="a request's timeout, seconds (parley-loadtest's)")
    g = p.add_argument_group("goodput")
    g.add_argument("--sweep-start", type=float, default=10.0, help="the replica's first rate; the router's is N×")
    g.add_argument("--sweep-bisect", type=int, default=4)
    g.add_argument("--sweep-s", type=float, default=10.0, help="seconds of arrivals per rate")
    g.add_argument("--sweep-rates", default="", help="fixed rates for the replica instead of the search (the "
                                                     "router gets N times each)")
    g.add_argument("--sweep-workers", type=int, default=2, help="client processes (as bench e2e's sweep)")
    g = p.add_argument_group("voice")
    g.add_argument("--voice-rates", default="2,8,16", help="session arrivals per second")
    g.add_argument("--voice-s", type=float, default=30.0, help="seconds of arrivals per rate")
    g.add_argument("--voice-workers", type=int, default=2, help="client processes")
    g.add_argument("--voice-args", default="", help="more parley-loadtest flags (e.g. --system-per-session)")
    g = p.add_argument_group("failover")
    g.add_argument("--failover-rate", type=float, help="requests/s through the router (default: "
                   f"{FAILOVER_SHARE_OF_ONE:g}× one replica's goodput where measured, else "
                   f"{FAILOVER_DEFAULT_RATE:g})")
    g.add_argument("--kill-at-s", type=float, default=10.0, help="the last replica is killed this far into the load")
    g.add_argument("--restart-after-s", type=float, default=10.0, help="and restarted this long after")
    g.add_argument("--back-requests", type=int, default=20, help="the drill ends once the restarted replica has "
                                                                 "served this many...")
    g.add_argument("--tail-s", type=float, default=5.0, help="...and at least this long after its health")
    g.add_argument("--back-timeout-s", type=float, default=120.0, help="or this long after the restart")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="a replica's start, at most")
    p.add_argument("--router-args", default="", help="flags replacing or added to the router's (compose's), e.g. "
                   "'--balance-abs-threshold 2' or '--policy sticky_least_loaded'")
    add_api_key_argument(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimate, run nothing")
    p.add_argument("--report-only", action="store_true", help="rewrite the Markdown from the JSON in --out")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="fold reports of separate calls (each router-<device>-x<N>.json) into one in --out, the "
                        "phases of later files replacing those of earlier ones; measure nothing")
    return p


def plan_of(args: argparse.Namespace) -> Plan:
    phases = PHASES if args.phase == "all" else tuple(p.strip() for p in args.phase.split(",") if p.strip())
    if not phases or not set(phases) <= set(PHASES):
        raise SystemExit(f"--phase: a comma-separated list of {', '.join(PHASES)}, or all; got {args.phase!r}")
    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    return Plan(args.replicas, args.cpu, tuple(p for p in PHASES if p in phases), args.serve_args, args.sla_ms,
                args.timeout, args.sweep_start, args.sweep_bisect, args.sweep_s, args.sweep_rates,
                args.sweep_workers, tuple(_floats(args.voice_rates)), args.voice_s, args.voice_workers,
                args.voice_args, args.failover_rate, args.kill_at_s, args.restart_after_s, args.back_requests,
                args.tail_s, args.back_timeout_s, args.start_timeout_s, args.router_args)


def plan_text(plan: Plan, stem: str, out: Path, raw: Path) -> str:
    router = shlex.join(with_flags(["vllm-router", "--worker-urls", "<replica URLs>", "--balance-abs-threshold",
                                    "<half of --max-batch>", *render_compose().ROUTER_FLAGS], plan.router_args))
    lines = [f"router: {plan.replicas} replica(s) {'on the CPU' if plan.cpu else 'one per GPU'}, phases "
             f"{', '.join(plan.phases)}; about {plan.estimate_s():.0f} s on two H100s (a fleet's start counted as "
             f"{START_S:.0f} s)", f"  report → {out}/{stem}.{{json,md}}   raw → {raw}/", f"  {router}"]
    for phase in plan.phases:
        lines += ["", f"{phase}: parley serve {shlex.join(plan.serve(phase))}"]
        if phase == "goodput":
            rates = _floats(plan.sweep_rates)
            for name, start, rs, gpus in (("one replica", plan.sweep_start, rates, 1),
                                          ("the router", plan.sweep_start * plan.replicas,
                                           [r * plan.replicas for r in rates], plan.replicas)):
                test = plan.sweep(name, start, rs, gpus)
                lines.append(f"  ~{test.estimate_s:4.0f} s  {name}: parley-loadtest {shlex.join(test.args)}")
        elif phase == "voice":
            for k, rate in enumerate(plan.voice_rates):
                test = plan.voice_test(k, rate)
                lines.append(f"  ~{test.estimate_s:4.0f} s  parley-loadtest {shlex.join(test.args)}")
        else:
            lines.append(f"  ~{FAILOVER_ESTIMATE_S:4.0f} s  Poisson at {plan.failover_rate or 'the failover rate'}/s "
                         f"through the router; the last replica killed at {plan.kill_at_s:g} s, restarted "
                         f"{plan.restart_after_s:g} s later")
    return "\n".join(lines)


def device_info(plan: Plan, raw: Path) -> dict[str, Any]:
    """bench.device's description (asked in a child on a GPU host: this process holds no CUDA context) and the GPU
    count, which must cover the replicas."""
    if plan.cpu:
        info: dict[str, Any] = dict(describe("cpu")) | {"gpus": 0}
    else:
        subprocess.run([sys.executable, "-m", "bench.device", str(raw / "device.json")], cwd=ROOT, check=True)
        info = json.loads((raw / "device.json").read_text())
        count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        info["gpus"] = int(count)
        if info["gpus"] < plan.replicas:
            raise SystemExit(f"{plan.replicas} replicas need {plan.replicas} GPUs; this host has {info['gpus']}")
    info["replicas"] = plan.replicas
    (raw / "device.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _metrics(fl: Fleet) -> tuple[list[Any], Any]:
    return [scrape(f"{r.base}/metrics") for r in fl.replicas], scrape(fl.router.metrics_url)


def _replica_deltas(before: list[Any], after: list[Any]) -> list[dict[str, float | None]]:
    """Per replica, what its /metrics counted between two scrapes (None where it did not answer)."""
    out: list[dict[str, float | None]] = []
    for b, a in zip(before, after):
        if a is None or b is None:
            out.append({"completed": None})
            continue

        def d(name: str, **labels: str) -> float:
            return metric_total(a, name, **labels) - metric_total(b, name, **labels)  # noqa: B023
        out.append({"completed": d("parley_requests_total", outcome="completed"),
                    "cancelled": d("parley_requests_total", outcome="cancelled"),
                    "rejected": d("parley_requests_total", outcome="rejected"),
                    "prompt_tokens": d("parley_prefix_cache_queries_total"),
                    "cached_tokens": d("parley_prefix_cache_hits_total")})
    return out


def _router_deltas(before: Any, after: Any) -> dict[str, float]:
    """The router's counters (summed over their labels) that moved between two scrapes."""
    if before is None or after is None:
        return {}
    names = sorted({n for n, _, _ in after if n.startswith("vllm_router_") and n.endswith("_total")})
    moved = {n: metric_total(after, n) - metric_total(before, n) for n in names}
    return {n: v for n, v in moved.items() if v}


def measure_goodput(fl: Fleet, plan: Plan, bench: Benchmark, raw: Path, t0: float) -> dict[str, Any]:
    rates = _floats(plan.sweep_rates)
    n = plan.replicas
    out: dict[str, Any] = {}
    for key, url, test in (
            ("single", fl.replicas[0].base, plan.sweep("goodput-single", plan.sweep_start, rates, 1)),
            ("router", fl.router.base, plan.sweep("goodput-router", plan.sweep_start * n, [r * n for r in rates], n))):
        before = _metrics(fl)
        ok = run_loadtest(bench, test, url, raw, t0)
        after = _metrics(fl)
        if not ok:
            raise RuntimeError(f"the loadtest {test.name} failed; see {raw / test.name}.txt")
        doc = json.loads((raw / f"{test.name}.json").read_text())
        rec = record(key, doc["config"]["model"], "sweep-32", doc)
        out[key] = {"goodput_rps": rec["goodput_rps"], "ttf64_ms_p99": rec["ttf64_ms_p99"],
                    "sla_attainment": rec["sla_attainment"], "usd_per_1m_tokens": rec["usd_per_1m_tokens"],
                    "sweep": rec["sweep"], "replicas": _replica_deltas(before[0], after[0]),
                    "router": _router_deltas(before[1], after[1])}
        say(t0, f"goodput, {key}: {rec['goodput_rps']} req/s")
    single, routed = out["single"]["goodput_rps"], out["router"]["goodput_rps"]
    out["goodput_ratio"] = round(routed / single, 3) if single and routed else None
    return out


def measure_voice(fl: Fleet, plan: Plan, bench: Benchmark, raw: Path, t0: float) -> dict[str, Any]:
    rows = []
    for k, rate in enumerate(plan.voice_rates):
        test = plan.voice_test(k, rate)
        before = _metrics(fl)
        ok = run_loadtest(bench, test, fl.router.base, raw, t0)
        after = _metrics(fl)
        if not ok:
            raise RuntimeError(f"the loadtest {test.name} failed; see {raw / test.name}.txt")
        doc = json.loads((raw / f"{test.name}.json").read_text())
        recs = [RequestRecord(**r) for r in doc["runs"][0]["requests"]]
        replicas = _replica_deltas(before[0], after[0])
        prompt = sum(r.get("prompt_tokens") or 0 for r in replicas)
        cached = sum(r.get("cached_tokens") or 0 for r in replicas)
        figs = conversation_figures(recs, doc["config"]["sla_tokens"])
        rows.append({"rate": rate, "sessions": len({r.session for r in recs}), **figs,
                     "cached_share_metrics": cached / prompt if prompt else None,
                     "replicas": replicas, "router": _router_deltas(before[1], after[1])})
        say(t0, f"voice at {rate:g}/s: {figs['admitted_share']} admitted, {figs['sla_attainment_admitted']} of them "
                f"on time, cached share {rows[-1]['cached_share_metrics']} (/metrics), {figs['cached_share']} (usage)")
    return {"think_s": VOICE_THINK_S, "voice_s": plan.voice_s, "voice_args": plan.voice_args, "rates": rows}


def measure_failover(fl: Fleet, plan: Plan, rate: float, raw: Path, t0: float) -> dict[str, Any]:
    drill = failover.Drill(rate=rate, kill_at_s=plan.kill_at_s, restart_after_s=plan.restart_after_s,
                           back_requests=plan.back_requests, tail_s=plan.tail_s, back_timeout_s=plan.back_timeout_s,
                           timeout_s=plan.timeout_s, sla_ms=plan.sla_ms)
    say(t0, f"-- failover: Poisson at {rate:g} req/s through the router")
    return failover.run(fl, drill, raw, lambda text: say(t0, text))


def run(plan: Plan, out: Path, raw: Path, archive: Path | None) -> int:
    t0 = time.monotonic()
    raw.mkdir(parents=True, exist_ok=True)
    info = device_info(plan, raw)
    stem = f"{file_stem('router', info['device'])}-x{plan.replicas}"
    report = out / f"{stem}.json"
    doc: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}
    doc |= info
    doc.setdefault("phases", {})
    bench = Benchmark("router", "e2e", (), plan.loadtest_args)
    failed: list[str] = []
    say(t0, plan_text(plan, stem, out, raw))
    groups: list[tuple[str, list[str]]] = []  # phases sharing the replicas' flags share one fleet
    for phase in plan.phases:
        key = "voice" if phase == "voice" else "e2e"
        if groups and groups[-1][0] == key:
            groups[-1][1].append(phase)
        else:
            groups.append((key, [phase]))
    for group, phases in groups:
        serve = plan.serve(phases[0])
        say(t0, f"== {plan.replicas} replicas: parley serve {shlex.join(serve)}")
        started = time.monotonic()
        try:
            with fleet(serve, gpu_ids(plan.replicas, plan.cpu), raw, plan.start_timeout_s, group,
                       plan.router_args) as fl:
                ready_s = round(time.monotonic() - started, 1)  # the replicas' start (in parallel) and the router's
                say(t0, f"replicas healthy and the router ready in {ready_s:.0f} s: "
                        f"{fl.router.base} → {', '.join(r.base for r in fl.replicas)}")
                router_info = {"router_command": [Path(fl.router.command[0]).name, *fl.router.command[1:]],
                               "router_version": render_compose().ROUTER_VERSION}
                for phase in phases:
                    say(t0, f"=== phase {phase}")
                    try:
                        result = _measure(phase, fl, plan, bench, raw, t0, doc)
                    except Exception as e:  # noqa: BLE001  (the next phase still runs; the report says)
                        say(t0, f"phase {phase} FAILED: {type(e).__name__}: {e}")
                        failed.append(phase)
                        continue
                    doc["phases"][phase] = result | {"serve": list(serve), "startup_s": ready_s} | router_info
                    _publish(doc, out, stem, raw, archive, t0)
        except ServerFailed as e:
            say(t0, f"the fleet did not start: {e}")
            failed += [p for p in phases if p not in failed]
    paths = _publish(doc, out, stem, raw, archive, t0)
    print(paths[1].read_text(), flush=True)
    say(t0, "router measured" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several of the same device and replica count: the last one's description, every phase (a
    later file's replacing an earlier one's)."""
    if len({(d["device"], d["replicas"]) for d in docs}) != 1:
        raise SystemExit("--merge: the reports must be of one device and one replica count: "
                         + ", ".join(f"{d['device']} x{d['replicas']}" for d in docs))
    out: dict[str, Any] = {}
    for d in docs:
        out |= {k: v for k, v in d.items() if k != "phases"}
        out["phases"] = out.get("phases", {}) | d.get("phases", {})
    return out


def _measure(phase: str, fl: Fleet, plan: Plan, bench: Benchmark, raw: Path, t0: float,
             doc: dict[str, Any]) -> dict[str, Any]:
    if phase == "goodput":
        return measure_goodput(fl, plan, bench, raw, t0)
    if phase == "voice":
        return measure_voice(fl, plan, bench, raw, t0)
    single = doc["phases"].get("goodput", {}).get("single", {}).get("goodput_rps")
    rate = plan.failover_rate or (round(FAILOVER_SHARE_OF_ONE * single, 1) if single else FAILOVER_DEFAULT_RATE)
    return measure_failover(fl, plan, rate, raw, t0)


def _publish(doc: dict[str, Any], out: Path, stem: str, raw: Path, archive: Path | None,
             t0: float) -> list[Path]:
    paths = router_report.write(doc, out, stem)
    say(t0, "report: " + ", ".join(str(p) for p in paths))
    if archive is not None:
        pack(raw, archive)
    return paths


def main(argv: Sequence[str] | None = None, printer: Callable[[str], None] = print) -> int:
    args = parser().parse_args(argv)
    use_api_key(args.api_key)
    plan = plan_of(args)
    if args.dry_run:
        device = "cpu" if plan.cpu else "<device>"
        printer(plan_text(plan, f"router-{device}-x{plan.replicas}", args.out, args.raw))
        return 0
    if args.report_only:
        for path in sorted(args.out.glob("router-*-x*.json")):
            for written in router_report.write(json.loads(path.read_text()), args.out, path.stem):
                printer(str(written))
        return 0
    if args.merge:
        doc = merge([json.loads(path.read_text()) for path in args.merge])
        for written in router_report.write(doc, args.out, f"{file_stem('router', doc['device'])}-x{doc['replicas']}"):
            printer(str(written))
        return 0
    # `timeout 570 python -m bench router ...` (a GPU call's limit) sends SIGTERM: unwind, so that the replicas and
    # the router are stopped rather than left holding the GPUs for the next call.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run(plan, args.out, args.raw, args.archive)


if __name__ == "__main__":
    sys.exit(main())
