"""Carrying out a benchmark's plan (bench/runs.py): for each server, start `parley serve` with its flags, wait for
/health, run its loadtests one after another (each a `parley-loadtest` process writing <name>.json and .txt into
the raw folder), keep the server's latency model and /metrics beside them, stop it; then fold the raw folder into
the report (<out>/<name>-<device>.{json,md,png}). The report is rewritten after every server, so a run cut short
still leaves one for what it measured; with `archive`, the raw folder is packed into that one file as well (a GPU
call brings back a few files, not a folder of them)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench import host_profile, loop_metrics
from bench.runs import Benchmark, Loadtest, Server
from bench.server import ROOT, ServerFailed, get_text, running

REPORTS = {"e2e": "bench.e2e_report", "voice": "bench.voice_report"}  # each: write(raw, out, name) -> paths
TAIL_LINES = 14


def loadtest_command(bench: Benchmark, test: Loadtest, url: str, raw: Path) -> list[str]:
    return [sys.executable, "-m", "loadtest.cli", "--url", url, "--quiet", *bench.loadtest_args,
            "--json", str(raw / f"{test.name}.json"),
            "--metrics-snapshots", str(raw / f"{test.name}{loop_metrics.POINTS}"), *test.args]


def plan_text(bench: Benchmark, raw: Path, out: Path, url: str | None = None) -> str:
    """The plan as the commands it runs, with an estimate of the time each takes on an H100."""
    lines = [f"{bench.name}: {len(bench.servers)} server(s), about {bench.estimate_s():.0f} s on an H100 "
             "(a server's start counted as 60 s, 30 s for the same model again)",
             f"  raw data → {raw}/   report → {out}/{bench.name}-<device>.{{json,md,png}}"]
    for server in bench.servers:
        lines.append("")
        if url and server.needs_own_server:
            lines.append(f"{server.label}: skipped (it needs a server started with its own flags, not {url})")
            continue
        serve = f"the server at {url}" if url else f"parley serve {shlex.join(server.serve)}"
        lines.append(f"{server.label}: {serve}")
        if server.targets:
            lines.append("  targets: " + ", ".join(f"{k} {v:g}" for k, v in server.targets.items()))
        for test in server.loadtests:
            cmd = loadtest_command(bench, test, url or "URL", raw)[3:]
            profiled = f"   (py-spy → {test.name}{host_profile.SUFFIX})" if test.profile and not url else ""
            lines.append(f"  ~{test.estimate_s:4.0f} s  parley-loadtest {shlex.join(cmd)}{profiled}")
    return "\n".join(lines)


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:5.0f} s] {text}", flush=True)


def run_loadtest(bench: Benchmark, test: Loadtest, url: str, raw: Path, t0: float) -> bool:
    """Run one loadtest against `url` (its JSON and printed tables into `raw`); whether it finished and wrote them."""
    out, txt = raw / f"{test.name}.json", raw / f"{test.name}.txt"
    out.unlink(missing_ok=True)  # a stale file from an earlier run must not stand in for a failed one
    say(t0, f"-- {test.name}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    timeout_s = max(120.0, 4 * test.estimate_s)
    with open(txt, "w") as log:
        try:
            rc = subprocess.run(loadtest_command(bench, test, url, raw), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    print("\n".join(txt.read_text(errors="replace").splitlines()[-TAIL_LINES:]), flush=True)
    if rc != 0:
        say(t0, f"{test.name} failed ({'timed out' if rc is None else f'exit {rc}'}); see {txt}")
    return rc == 0 and out.exists()


def scrape(base: str, path: Path) -> None:
    """base's /metrics into `path` (a stale one removed where it does not answer)."""
    text = get_text(base, "/metrics")
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(text)


@contextmanager
def _server(server: Server, raw: Path, url: str | None, timeout_s: float) -> Iterator[tuple[str, int | None]]:
    """The server's base URL, and its process id where this runner started it."""
    if url:
        yield url, None
    else:
        # every verdict and SLA token, request by request (service/admission_log.py): why a rate's requests were
        # refused, read beside the loadtests by the report
        serve = (*server.serve, "--admission-log", str(raw / f"admission-{server.label}.jsonl"))
        with running(serve, raw / f"server-{server.label}.log", timeout_s) as started:
            yield started.base, started.proc.pid


def fold(bench: Benchmark, raw: Path, out: Path) -> list[Path]:
    """Write the report of what the raw folder holds so far."""
    report = importlib.import_module(REPORTS[bench.report])
    paths: list[Path] = report.write(raw, out, bench.name)
    return paths


def pack(raw: Path, archive: Path) -> None:
    """The raw folder as one .tar.gz (written aside, then renamed: a kill mid-way leaves the last one whole)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        tar.add(raw, arcname=raw.name)
    part.replace(archive)


def run(bench: Benchmark, raw: Path, out: Path, url: str | None = None, archive: Path | None = None) -> int:
    """Measure every server of the plan; 0 if every server started and every loadtest finished, else 1."""
    t0 = time.monotonic()
    raw.mkdir(parents=True, exist_ok=True)
    plan = dataclasses.asdict(bench) | {"url": url}  # with a URL, the servers' flags were not ours to choose
    (raw / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    # In a child: this process holds no CUDA context beside the server's.
    subprocess.run([sys.executable, "-m", "bench.device", str(raw / "device.json")], cwd=ROOT, check=True)
    failed: list[str] = []
    paths: list[Path] = []
    startup: dict[str, float] = {}  # seconds from the start to /health 200, per server (issue 21: ≤ 30 s on a GPU)
    for server in bench.servers:
        if url and server.needs_own_server:
            say(t0, f"== {server.label}: skipped (it needs a server started with its own flags)")
            continue
        say(t0, f"== {server.label}: " + (f"the server at {url}" if url else f"parley serve "
                                                                                f"{shlex.join(server.serve)}"))
        started = time.monotonic()
        try:
            with _server(server, raw, url, bench.start_timeout_s) as (base, pid):
                say(t0, f"{server.label} ready at {base}")
                if not url:
                    startup[server.label] = round(time.monotonic() - started, 1)
                    (raw / "startup.json").write_text(json.dumps(startup, indent=1) + "\n")
                for test in server.loadtests:
                    # /metrics around each loadtest: the report reads the engine loop's histograms over it
                    scrape(base, raw / f"{test.name}{loop_metrics.BEFORE}")
                    with ExitStack() as profiling:
                        if test.profile and pid is not None:
                            profiling.enter_context(host_profile.recording(pid, raw / f"{test.name}"
                                                                                     f"{host_profile.SUFFIX}"))
                        if not run_loadtest(bench, test, base, raw, t0):
                            failed.append(test.name)
                    scrape(base, raw / f"{test.name}{loop_metrics.AFTER}")
                for path, name in (("/v1/latency_model", f"{server.label}-latency-model.json"),
                                   ("/metrics", f"{server.label}-metrics.txt")):
                    text = get_text(base, path)
                    if text is not None:
                        (raw / name).write_text(text)
        except ServerFailed as e:
            say(t0, f"{server.label}: {e}")
            failed.append(f"server {server.label}")
        try:
            paths = fold(bench, raw, out)
            say(t0, "report: " + ", ".join(str(p) for p in paths))
        except Exception:  # keep measuring: the raw folder can be folded again (--report-only)
            traceback.print_exc()
            failed.append("report")
        if archive is not None:
            pack(raw, archive)
    if paths:
        print(paths[1].read_text())  # the Markdown
    failed = list(dict.fromkeys(failed))
    say(t0, f"{bench.name} measured" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
