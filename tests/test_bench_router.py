"""`python -m bench router` (bench/router.py, bench/fleet.py, bench/failover.py): the plan it runs on a two-GPU host,
and, slow, the whole script on the CPU at tiny sizes: two replicas of the tiny synthetic model behind the real
vllm-router, the goodput sweeps, a replica killed and restarted under load, voice sessions, in two calls whose
phases merge into one report, as the GPU run does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import router
from bench.failover import Drill, figures
from bench.fleet import balance_abs_threshold, render_compose, router_command, router_launcher
from bench.runs import e2e, voice
from loadtest.record import RequestRecord, finish
from tests.server_support import ROOT

GPU_CALL_S = 600
INSTALL_S = 30  # pip installing the carried wheels at the start of a GPU call


def plan(*argv: str) -> router.Plan:
    return router.plan_of(router.parser().parse_args(list(argv)))


def test_the_router_runs_with_composes_flags() -> None:
    if router_launcher() is None:
        pytest.skip("vllm-router not installed")
    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], 8000, 29000, 8)
    compose = render_compose().router_command(["0", "1"])
    flags = [a for a in cmd if a.startswith("--")]
    assert flags == [a for a in compose if a.startswith("--")]  # the same flags, in the same order
    assert cmd[-len(render_compose().ROUTER_FLAGS):] == list(render_compose().ROUTER_FLAGS)
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--prometheus-host")] == ["http://127.0.0.1:1",
                                                                                 "http://127.0.0.1:2"]
    assert "cache_aware" in cmd


def test_the_replicas_run_the_benchmarks_flags() -> None:
    p = plan()
    assert p.phases == ("goodput", "failover", "voice") and p.replicas == 2
    e2e_serve = e2e(only=router.E2E_RUN).servers[0].serve
    assert p.serve("goodput")[:len(e2e_serve)] == e2e_serve and "megakernel" in p.serve("goodput")
    voice_serve = voice().servers[0].serve
    assert p.serve("voice")[:len(voice_serve)] == voice_serve
    assert balance_abs_threshold(p.serve("goodput")) == 8  # half of --max-batch 16, as compose's README says
    # the sweep is bench e2e's, with the router's search starting at N times the replica's
    single, routed = p.sweep("s", 10, [], 1), p.sweep("r", 20, [], 2)
    e2e_sweep = [t for t in e2e(only=router.E2E_RUN, sweep_bisect=4, sweep_s=10).servers[0].loadtests
                 if "--sweep" in t.args][0]
    assert single.args == (*e2e_sweep.args, "--gpus", "1")
    assert routed.args[routed.args.index("--sweep-start") + 1] == "20" and routed.args[-1] == "2"
    assert [float(t.args[t.args.index("--rate") + 1]) for t in (p.voice_test(k, r) for k, r in
                                                                 enumerate(p.voice_rates))] == [2, 8, 16]


def test_each_recommended_call_fits_one_gpu_call() -> None:
    for phases in ("goodput,failover", "voice"):
        assert plan("--phase", phases).estimate_s() + INSTALL_S < GPU_CALL_S - 60, phases
    with pytest.raises(SystemExit):
        plan("--phase", "goodput,nonsense")


def test_dry_run_prints_the_plan() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "router", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--policy cache_aware" in out.stdout and "--sweep-start 20" in out.stdout
    assert "router-<device>-x2" in out.stdout


def test_reports_of_separate_calls_merge(tmp_path: Path) -> None:
    """The GPU run's two calls each bring back a report; --merge folds them, later phases replacing earlier ones."""
    head = {"device": "NVIDIA H100 80GB HBM3", "replicas": 2, "gpus": 2, "torch": "2.11.0"}
    sweep = {"goodput_rps": 15.0, "ttf64_ms_p99": 90.0, "sla_attainment": 1.0, "usd_per_1m_tokens": 0.9,
             "sweep": [], "replicas": []}
    first = {**head, "phases": {"goodput": {"single": sweep, "router": {**sweep, "goodput_rps": 29.0},
                                            "goodput_ratio": 1.933}, "voice": {"rates": [], "voice_s": 1}}}
    second = {**head, "triton": "3.6.0", "phases": {"voice": {"rates": [], "voice_s": 30}}}
    paths = []
    for i, doc in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    assert router.main(["--merge", *map(str, paths), "--out", str(tmp_path / "out")], printer=lambda _: None) == 0
    merged = json.loads((tmp_path / "out" / "router-NVIDIA-H100-80GB-HBM3-x2.json").read_text())
    assert merged["goodput_ratio"] == 1.933 and merged["phases"]["voice"]["voice_s"] == 30
    assert merged["triton"] == "3.6.0" and merged["targets"][0]["met"] is True
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**head, "replicas": 4, "phases": {}}))
    with pytest.raises(SystemExit):
        router.main(["--merge", str(paths[0]), str(other), "--out", str(tmp_path / "out")])


def _rec(start: float, outcome: str = "ok", dur: float = 0.08, error: str | None = None) -> RequestRecord:
    r = RequestRecord(0, 0, "completions", start_s=start, end_s=start + dur, outcome=outcome, error=error,
                      token_times_s=[0.005 + i * dur / 64 for i in range(64)] if outcome == "ok" else [])
    return finish(r, 64, 100.0)


def test_failover_figures() -> None:
    """A drill on paper: killed at 10 s, marked down at 12 s, last attempt at 11 s, restarted at 20 s, healthy at
    25 s, back in rotation at 26 s, serving from 27 s; one request in flight at the kill failed, one late one
    timed out."""
    drill = Drill(rate=10, kill_at_s=10, restart_after_s=10, back_requests=5, tail_s=1, back_timeout_s=60,
                  timeout_s=30)
    samples = []
    for k in range(0, 120):
        t = k * 0.25
        down = 12 <= t < 26
        samples.append({"t": t, "health": 0 if down else 1, "cb_state": 0, "sent": min(t, 11.0),
                        "cb_outcomes": min(t, 11.0),
                        "completed": [t * 10, None if 10 <= t < 25 else (0 if t < 27 else t - 26)]})
    records = [_rec(s / 10) for s in range(0, 290)]
    records += [_rec(9.95, "error", 0.2, "RemoteProtocolError: peer closed"), _rec(15, "error", 30.0,
                                                                                   "TimeoutError: ")]
    run = {"records": records, "samples": samples, "victim": 1, "victim_url": "x",
           "marks": {"kill": 10.0, "restart": 20.0, "healthy": 25.0, "stop": 29.0, "end": 30.0}}
    f = figures(run, drill)
    assert f["router_marked_down_s"] == 2.0 and f["last_sent_to_victim_s"] == 1.0
    assert f["failed"] == 2 and f["failed_in_flight_at_kill"] == 1 and f["failed_sent_after_kill"] == 1
    assert f["hung"] == 1 and f["last_client_failure_s"] == 35.0
    assert f["restart_healthy_s"] == 5.0 and f["router_back_s"] == 1.0 and f["traffic_back_s"] == 2.0
    assert f["victim_completed_after_restart"] > 0
    assert f["survivor_alone"]["requests"] == 171 and f["survivor_alone"]["sla_attainment"] == 170 / 171


@pytest.mark.slow
@pytest.mark.skipif(router_launcher() is None, reason="vllm-router not installed (pip install vllm-router)")
def test_the_whole_script_on_the_cpu(tmp_path: Path) -> None:
    """Two replicas of the tiny model on the CPU behind the real router, in the two calls the GPU run makes: goodput
    and failover, then voice, merged into one report. The SLA is loose (a shared 2-core box); the figures that do
    not depend on speed must hold: the ratio is measured, both replicas serve through the router, the killed one is
    taken out within seconds and nothing sent after the kill fails or hangs, it serves again once restarted, and
    voice turns find their prompt in the cache."""
    out, raw = tmp_path / "results", tmp_path / "raw"
    # --max-batch 2 sets the router's balance threshold to 1 (half of it, as deploy/README.md says): the tiny model
    # answers in ~0.15 s, so at these rates a replica rarely holds more than 2 requests, and below the threshold the
    # cache-aware policy keeps unrelated prompts on one replica (measured: 13 of 15 on one at the default threshold)
    # with an API key: the replicas ask for it, every request through the router (and the router's own calls to the
    # replicas' render endpoints, which the voice phase's caching needs) carries the client's
    common = ["--cpu", "--replicas", "2", "--out", str(out), "--raw", str(raw), "--serve-args",
              "--model synthetic:tiny --backend reference --max-batch 2", "--sla-ms", "30000", "--timeout", "60",
              "--api-key", "sk-router-bench"]

    def call(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "bench", "router", *common, *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
        return done.stdout

    # the restart 6 s after the kill: the router's health checks (every 2 s, 2 failures) take up to ~4 s to mark the
    # victim down where too few requests reach it to trip its circuit breaker first
    first = call("--phase", "goodput,failover", "--sweep-rates", "2,6", "--sweep-s", "2", "--failover-rate", "4",
                 "--kill-at-s", "2", "--restart-after-s", "6", "--back-requests", "3", "--tail-s", "1")
    assert "killed at" in first and "restarted at" in first
    report = out / "router-cpu-x2.json"
    goodput = json.loads(report.read_text())["phases"]["goodput"]
    call("--phase", "voice", "--voice-rates", "1,2", "--voice-s", "3", "--voice-workers", "1", "--voice-args",
         "--turns 3 --system-len 300")
    doc = json.loads(report.read_text())
    assert set(doc["phases"]) == {"goodput", "failover", "voice"} and doc["phases"]["goodput"] == goodput
    assert doc["device"] == "cpu" and doc["replicas"] == 2 and doc["torch"]

    assert doc["goodput_ratio"] == goodput["goodput_ratio"] and goodput["goodput_ratio"] > 0
    assert [p["rate"] for p in goodput["single"]["sweep"]] == [2, 6]
    assert [p["rate"] for p in goodput["router"]["sweep"]] == [4, 12]
    assert goodput["single"]["replicas"][1]["completed"] == 0  # the single sweep went to replica 0 alone
    assert all(r["completed"] > 0 for r in goodput["router"]["replicas"]), goodput["router"]["replicas"]

    f = doc["phases"]["failover"]
    assert f["router_marked_down_s"] is not None and 0 <= f["router_marked_down_s"] <= 5
    assert f["hung"] == 0 and f["failed_sent_after_kill"] == 0, (f["errors"], f)  # the errors first: f is long
    assert f["victim_completed_after_restart"] >= 3 and f["restart_healthy_s"] > 0
    assert f["survivor_alone"]["requests"] > 0

    rates = doc["phases"]["voice"]["rates"]
    assert [r["rate"] for r in rates] == [1, 2]
    for r in rates:
        assert r["requests"] > 0 and r["admitted_share"] > 0, r
        assert r["cached_share_metrics"] > 0.5, r  # turns 2-3 find the system prompt and their conversation

    md = (out / "router-cpu-x2.md").read_text()
    assert "goodput_ratio" in md and "A replica killed under load" in md and "Voice sessions" in md
    assert "--policy cache_aware" in md
    assert (raw / "e2e-replica-1.start-2.log").exists() and (raw / "voice-router.log").exists()
    assert "API key required" in (raw / "voice-replica-0.log").read_text()
