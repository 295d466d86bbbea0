"""The benchmarks' entry point (`python -m bench`): its list, the plans declared in bench/runs.py (what the GPU runs
of issue 21 start and measure, and that each fits one 10-minute GPU call), `--set`, a whole e2e run against the
scripted server (report, targets, archive) and, slow, against a real `parley serve` on the tiny synthetic model."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.runs import e2e, voice, with_flags
from tests.server_support import ROOT
from tests.test_loadtest_scripted import scripted_server, url  # noqa: F401  (fixtures)

GPU_CALL_S = 600


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_list_names_every_benchmark(capsys) -> None:
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("e2e", "voice", "voice-fp8", "decode", "sm90-compile", "fp8-quality", "constrained", "soak", "router"):
        assert f"  {name} " in listed
    assert main(["no-such-bench"]) == 2


def test_e2e_plan_is_issue_21s_36s_and_37s() -> None:
    plan = e2e()
    servers = {s.label: s for s in plan.servers}
    assert list(servers) == ["megakernel.bf16", "megakernel.bf16.admissionoff", "megakernel.fp8",
                             "megakernel.fp8.admissionoff", "reference.bf16", "qwen.megakernel.bf16"]
    for label, s in servers.items():
        flags = " ".join(s.serve)
        assert ("--max-batch 16 --max-rows 16" in flags) == ("megakernel" in label)
        swept = [t for t in s.loadtests if "--sweep" in t.args]
        assert bool(swept) == label.startswith(("megakernel.bf16", "megakernel.fp8"))
        for t in swept:  # the sweep searches upward without a cap: doubling from 10/s, then bisecting
            assert "--sweep-rates" not in t.args and t.args[t.args.index("--sweep-start") + 1] == "10"
    for run in ("megakernel.bf16", "megakernel.fp8"):  # issue 36: the capacity beside the goodput, in the same call
        on, off = servers[run], servers[f"{run}.admissionoff"]
        assert off.serve == (*on.serve, "--no-admission") and off.needs_own_server
        [sweep] = [t for t in on.loadtests if t.name == f"{run}-sweep-32"]
        [capacity] = off.loadtests
        assert capacity.name == f"{run}-capacity-32" and capacity.args == sweep.args  # the same rates
        assert on.targets["goodput_over_capacity"] == 0.9 and on.targets["admitted_on_time_min"] == 0.99
        # issue 37: the first token of an idle server's 32-token prompt, and the GPU's idle p99 at the goodput rate
        assert on.targets["ttft_ms_p50"] == 3 and on.targets["gpu_idle_us_p99_at_goodput"] == 50
    assert servers["megakernel.bf16"].targets["goodput_rps"] == 40
    assert servers["megakernel.fp8"].targets["goodput_rps"] == 50
    assert "--weights fp8" in " ".join(servers["megakernel.fp8"].serve)
    assert "synthetic:qwen2.5-1.5b" in servers["qwen.megakernel.bf16"].serve
    # two GPU calls: the swept runs with their capacities, then the peers
    assert e2e(only="megakernel.bf16,megakernel.fp8").estimate_s() < GPU_CALL_S - 60
    assert e2e(only="reference.bf16,qwen.megakernel.bf16").estimate_s() < GPU_CALL_S - 60
    assert e2e(capacity=False).estimate_s() < GPU_CALL_S - 60
    # int8 with row scales runs when named, with its capacity, in a call of its own
    [int8_row] = [s for s in e2e(only="megakernel.int8row").servers if s.label == "megakernel.int8row"]
    assert "--weights int8-row" in " ".join(int8_row.serve) and "megakernel.int8row" not in servers
    assert e2e(only="megakernel.int8row").estimate_s() < GPU_CALL_S - 60


def test_e2e_compares_the_thread_and_the_process_engine_in_one_call() -> None:
    """engine=both: each run twice, with --no-engine-process and with --engine-process, each with a label of its own
    (its loadtests' files and the report's rows apart), the same loadtests, and both within one GPU call; by default
    the server runs its engine as `parley serve` does (no flag: in a process of its own on a GPU)."""
    plan = e2e(only="megakernel.bf16", capacity=False, engine="both", sweep_s=6)
    thread, proc = plan.servers
    assert (thread.label, proc.label) == ("megakernel.bf16.thread", "megakernel.bf16.proc")
    flags = ("--engine-process", "--no-engine-process")
    assert thread.serve == (*thread.serve[:-5], "--no-engine-process", *thread.serve[-4:])
    assert proc.serve == (*thread.serve[:-5], "--engine-process", *thread.serve[-4:])
    (default,) = e2e(only="megakernel.bf16", capacity=False).servers
    assert default.label == "megakernel.bf16" and not set(flags) & set(default.serve)
    assert [t.name.split("-", 1)[1] for t in proc.loadtests] == [t.name.split("-", 1)[1] for t in thread.loadtests]
    assert {t.name.split("-", 1)[0] for t in proc.loadtests} == {"megakernel.bf16.proc"}
    assert [t.args for t in proc.loadtests] == [t.args for t in thread.loadtests]
    assert plan.estimate_s() < 300
    assert [s.label for s in e2e(only="megakernel.bf16", engine="process").servers] == \
        ["megakernel.bf16.proc", "megakernel.bf16.proc.admissionoff"]
    with pytest.raises(ValueError, match="engine"):
        e2e(engine="fork")


def test_voice_plan_fits_one_call() -> None:
    plan = voice()
    server, off = plan.servers
    assert "--max-rows" in server.serve and "--max-context" in server.serve
    names = [t.name for t in server.loadtests]
    assert names == ["session-chat", "session-realtime", "fresh-32", "fresh-1000", "fresh-2000", "fresh-4000",
                     "sweep-chat", "sweep-realtime"]
    sweep = server.loadtests[-1].args
    assert sweep[sweep.index("--sweep-rates") + 1] == "1,2,4,8,16"  # issue 36: 1-16 sessions/s
    assert sweep[sweep.index("--after-refusal") + 1] == "fall-back"  # a refused turn: the agent's fallback answers
    # the capacity: the same server with admission off, the same sessions (seed) at the sweep's rates from 2/s
    assert off.needs_own_server and off.serve == with_flags(server.serve, "--no-admission")
    assert [t.name for t in off.loadtests] == ["capacity-chat", "capacity-realtime"]
    cap = off.loadtests[-1].args
    assert cap[cap.index("--sweep-rates") + 1] == "2,4,8,16"
    assert [a for a in cap if a != "2,4,8,16"] == [a for a in sweep if a != "1,2,4,8,16"]
    assert plan.estimate_s() < GPU_CALL_S - 60
    assert len(voice(capacity_rates="").servers) == 1
    assert "fp8" in " ".join(voice(weights="fp8").servers[0].serve)


def test_with_flags_replaces_and_adds() -> None:
    flags = ("--model", "synthetic:llama-3.2-1b", "--batch-invariant", "--max-batch", "16")
    assert with_flags(flags, "--model synthetic:tiny --device cpu --batch-invariant") == (
        "--model", "synthetic:tiny", "--batch-invariant", "--max-batch", "16", "--device", "cpu")


def test_dry_run_prints_the_commands_and_set_changes_them() -> None:
    out = bench("e2e", "--dry-run", "--set", "only=megakernel.fp8", "--set", "sweep_s=3")
    assert out.returncode == 0, out.stderr
    assert "megakernel.fp8: parley serve --model synthetic:llama-3.2-1b --backend megakernel" in out.stdout
    assert "megakernel.bf16" not in out.stdout and "--duration 3 " in out.stdout
    bad = bench("e2e", "--dry-run", "--set", "sweep_s=fast")
    assert bad.returncode == 2 and "sweep_s is a float" in bad.stderr
    unknown = bench("voice", "--dry-run", "--set", "rates=1")
    assert unknown.returncode == 2 and "sweep_rates" in unknown.stderr


def test_e2e_against_the_scripted_server(tmp_path: Path, url: str) -> None:  # noqa: F811
    raw, results, archive = tmp_path / "raw", tmp_path / "results", tmp_path / "e2e-raw.tgz"
    out = bench("e2e", "--url", url, "--raw", str(raw), "--out", str(results), "--archive", str(archive),
                "--set", "only=megakernel.bf16", "--set", "single_requests=4", "--set", "sweep_s=2",
                "--set", "sweep_start=4", "--set", "sweep_max_rate=8", "--set", "sweep_workers=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [report] = results.glob("e2e-*.json")
    assert {p.suffix for p in results.iterdir()} == {".json", ".md", ".png"}  # results only; raw data elsewhere
    doc = json.loads(report.read_text())
    assert [(r["backend"], r["kind"]) for r in doc["records"]] == [
        ("megakernel.bf16", k) for k in ("single-32", "single-1000", "sweep-32")]
    single, _, sweep = doc["records"]
    assert single["requests"] == 4 and single["prompt_tokens"] == 32 and single["sla_attainment"] == 1.0
    # the scripted server keeps the SLA at every rate: the sweep doubles 4 -> 8 and stops at its cap
    assert [p["rate"] for p in sweep["sweep"]] == [4, 8] and sweep["goodput_rps"] == 8
    goodput = next(t for t in doc["targets"] if t["figure"] == "goodput_rps")
    assert goodput["measured"] == 8 and goodput["met"] is False  # 8 < 40
    assert doc["servers"] == {}  # at --url the flags were the server's own, not the plan's
    # the server's engine loop over each rate alone, from the loadtest's /metrics snapshots around it: the scripted
    # server observes its host-time histogram once per stream it serves, so a rate's iterations are its streams
    first, second = sweep["sweep"]
    assert second["loop_iterations"] == second["requests"] > 0
    assert first["loop_iterations"] > first["requests"] > 0  # the first rate: the warm-up's streams too
    assert first["gpu_idle_us_p99"] is None  # a histogram this server does not export
    assert sweep["host_us_p99_at_goodput"] == second["host_us_p99"] and 1000 < second["host_us_p99"] <= 10_000
    idle = next(t for t in doc["targets"] if t["figure"] == "gpu_idle_us_p99_at_goodput")
    assert idle["measured"] is None and idle["met"] is None  # no GPU: not judged
    assert "| host p99 µs | GPU idle p99 µs |" in report.with_suffix(".md").read_text()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"raw/plan.json", "raw/device.json", "raw/megakernel.bf16-sweep-32.json"} <= names
    # the raw folder folds again into the same report
    again = bench("e2e", "--report-only", "--raw", str(raw), "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again" / report.name).read_text())["records"] == doc["records"]


def test_e2e_report_puts_the_capacity_beside_the_goodput(tmp_path: Path, url: str) -> None:  # noqa: F811
    """The capacity sweep (admission off) is paired with its run's sweep: goodput / capacity and the rates side by
    side. Here both sweeps measure the scripted server, which keeps the SLA at any rate; the capacity sweep's cap is
    twice the goodput sweep's, so the ratio is 0.5."""
    raw, results = tmp_path / "raw", tmp_path / "results"
    raw.mkdir()
    common = ["--url", url, "--quiet", "--sla-tokens", "64", "--sla-ms", "100", "--sweep", "--sweep-start", "4",
              "--duration", "1", "--warmup", "0", "--input-len", "32", "--output-len", "64"]
    for kind, cap in (("sweep-32", "8"), ("capacity-32", "16")):
        out = subprocess.run([sys.executable, "-m", "loadtest.cli", *common, "--sweep-max-rate", cap,
                              "--json", str(raw / f"megakernel.bf16-{kind}.json")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    again = bench("e2e", "--report-only", "--raw", str(raw), "--out", str(results))
    assert again.returncode == 0, again.stderr
    [report] = results.glob("e2e-*.json")
    sweep = next(r for r in json.loads(report.read_text())["records"] if r["kind"] == "sweep-32")
    assert (sweep["goodput_rps"], sweep["capacity_rps"], sweep["goodput_over_capacity"]) == (8, 16, 0.5)
    assert sweep["admitted_on_time_min"] == 1.0
    md = report.with_suffix(".md").read_text()
    assert "| megakernel.bf16 | 8.0 | 16.0 | 0.500 | 1.000 |" in md
    assert "| 16.0 | – | – | – | – | 1.000 |" in md  # a rate only the capacity sweep reached


@pytest.mark.slow
def test_e2e_starts_parley(tmp_path: Path) -> None:
    """One run of the table on a real server: the runner starts `parley serve` with the run's flags (the tiny model
    on the CPU instead of Llama), measures it, keeps its log, latency model and metrics, and stops it. With
    `--api-key`: the server asks for that key, and the loadtests and the runner's own requests send it (a refused
    request would fail the run); no raw file holds it."""
    raw, results = tmp_path / "raw", tmp_path / "results"
    key = "sk-bench-" + secrets.token_urlsafe(12)
    # --sla-ms: this checks the runner, not admission; a 2-core box's tiny model takes ~85 ms to its 64th token, and
    # one slow first request made the guard refuse the next ones at the default 100 ms (2 runs in 4, before and after)
    out = bench("e2e", "--raw", str(raw), "--out", str(results), "--set", "only=reference.bf16",
                "--set", "serve_args=--model synthetic:tiny --device cpu --sla-ms 60000", "--set", "single_requests=3",
                "--api-key", key)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = (raw / "server-reference.bf16.log").read_text()
    assert "model synthetic:tiny, backend reference, device cpu, 16 slots" in log
    assert "API key required on every route but /health and /metrics: 1 key(s)" in log
    assert not [p for p in raw.rglob("*") if p.is_file() and key in p.read_text(errors="replace")]
    assert json.loads((raw / "reference.bf16-latency-model.json").read_text())
    assert "parley_requests_total" in (raw / "reference.bf16-metrics.txt").read_text()
    single = json.loads((raw / "reference.bf16-single-32.json").read_text())["runs"][0]["requests"]
    assert len(single) == 3 and all(r["outcome"] == "ok" and r["output_tokens"] == 64 for r in single)
    [report] = results.glob("e2e-*.json")
    doc = json.loads(report.read_text())
    assert "--model synthetic:tiny" in " ".join(doc["servers"]["reference.bf16"])
    # the engine loop over each loadtest, from /metrics scraped around it: the host's time, and no GPU idle on a CPU
    loop = next(r for r in doc["records"] if r["kind"] == "single-32")
    assert loop["loop_iterations"] >= 3 * 64 and 0 < loop["host_us_p50"] <= loop["host_us_p99"]
    assert loop["gpu_idle_us_p50"] is None and loop["gpu_idle_us_p99"] is None
    assert loop["front_lag_us_p99"] is not None and loop["front_lag_ms_max"] is not None  # its event loop, watched
    # the loadtest stamps x-request-start: the client's own send is counted, within the way to the engine
    assert loop["transit_us_p50"] is not None and 0 < loop["transit_us_p50"] <= loop["received_us_p50"]
    assert "host time per iteration p50 µs" in report.with_suffix(".md").read_text()
    assert "of it the client's send p50 µs" in report.with_suffix(".md").read_text()
    gaps = loop["gaps"]  # one stream's gaps, taken apart (the tiny model's byte tokens: some chunks carry two)
    assert gaps["streams"] == 3 and gaps["gaps"] == sum(len(r["token_times_s"]) - 1 for r in single)
    assert gaps["streams_with_held_back_tokens"] == sum(len(r["token_times_s"]) < 64 for r in single)
    assert "its inter-token gaps taken apart" in report.with_suffix(".md").read_text()
    assert 0 < doc["startup_s"]["reference.bf16"] < 300  # the start-up, as issue 21 bounds it


def test_loop_metrics_reads_a_histogram_between_two_scrapes(tmp_path: Path) -> None:
    """The report's engine-loop figures: the difference of two scrapes, its quantiles interpolated within a bucket;
    a histogram the server does not export (the GPU's idle time on a CPU) gives None, not 0."""
    from bench import loop_metrics

    def scrape(counts: dict[str, int]) -> str:
        lines = ["# TYPE parley_engine_host_seconds histogram"]
        lines += [f'parley_engine_host_seconds_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
        lines += [f"parley_engine_host_seconds_count {counts['+Inf']}", "parley_engine_host_seconds_sum 1.0"]
        return "\n".join(lines) + "\n"

    # 100 iterations before the loadtest, all slow; during it 100 more: 50 under 0.1 ms, 49 under 0.2, 1 over 1 ms
    (tmp_path / "x-single-32.metrics-before.txt").write_text(scrape({"0.0001": 0, "0.0002": 0, "0.001": 100,
                                                                     "+Inf": 100}))
    (tmp_path / "x-single-32.metrics.txt").write_text(scrape({"0.0001": 50, "0.0002": 99, "0.001": 199,
                                                              "+Inf": 200}))
    figures = loop_metrics.figures(tmp_path, "x-single-32")
    assert figures["loop_iterations"] == 100
    assert figures["host_us_p50"] == 100.0  # the 50th of 100 sits at the first bucket's top
    assert figures["host_us_p99"] == 200.0  # the 99th: the second bucket's last
    assert figures["gpu_idle_us_p50"] is None and figures["gpu_idle_us_p99"] is None
    assert figures["delivery_us_p50"] is None  # a server before parley_token_delivery_seconds: None, not 0
    assert figures["hop_us_p50"] is None  # nor one before parley_token_hop_seconds
    assert figures["transit_us_p50"] is None  # nor one before parley_request_transit_seconds
    assert figures["step_gpu_us_p99"] is None and figures["slow_gpu_steps"] is None
    assert loop_metrics.figures(tmp_path, "never-scraped") == {}
    # each step's time on the GPU: 97 steps near a millisecond, 3 of 10-20 ms (a stall the host's figures miss)
    steps = ["# TYPE parley_step_gpu_seconds histogram", 'parley_step_gpu_seconds_bucket{le="0.001"} 0',
             'parley_step_gpu_seconds_bucket{le="0.0015"} 97', 'parley_step_gpu_seconds_bucket{le="0.005"} 97',
             'parley_step_gpu_seconds_bucket{le="0.01"} 97', 'parley_step_gpu_seconds_bucket{le="0.02"} 100',
             'parley_step_gpu_seconds_bucket{le="+Inf"} 100', "parley_step_gpu_seconds_count 100",
             "parley_step_gpu_seconds_sum 0.2"]
    (tmp_path / "y-single-32.metrics.txt").write_text("\n".join(steps) + "\n")
    gpu = loop_metrics.figures(tmp_path, "y-single-32")
    assert gpu["slow_gpu_steps"] == 3 and 1000 < gpu["step_gpu_us_p50"] <= 1500 and gpu["step_gpu_us_p99"] > 10000
    assert loop_metrics.quantile({0.001: 0, float("inf"): 4}, 0.5) == 0.001  # past the last bound: that bound
    # the front end's longest event-loop stall: the top of the highest bucket that counted one
    lag = ["# TYPE parley_front_end_loop_lag_seconds histogram",
           *(f'parley_front_end_loop_lag_seconds_bucket{{le="{le}"}} {n}'
             for le, n in (("0.001", 500), ("0.05", 510), ("0.1", 510), ("0.5", 511), ("+Inf", 511))),
           "parley_front_end_loop_lag_seconds_count 511", "parley_front_end_loop_lag_seconds_sum 0.7"]
    (tmp_path / "z-sweep-32.metrics.txt").write_text("\n".join(lag) + "\n")
    front = loop_metrics.figures(tmp_path, "z-sweep-32")
    assert front["front_lag_ms_max"] == 500.0 and front["front_lag_us_p99"] is not None
    assert loop_metrics.longest({0.1: 0, 0.5: 0, float("inf"): 2}) == 0.5  # past the last bound: that bound
    assert figures["front_lag_ms_max"] is None  # a server before the watch


def test_the_inter_token_target_reads_the_client_s_p99_against_the_gpu_s_step() -> None:
    """#37's inter-token target: the client's p99 over the step's own median on the GPU. The server's step histogram
    is fine enough to tell FP8's 0.76 ms step from 0.8 ms (quarter milliseconds read both as 0.876)."""
    from bench import loop_metrics
    from bench.e2e_report import itl_over_step
    from service.metrics import Metrics

    metrics = Metrics()
    metrics.track_gpu_idle()
    assert metrics.step_gpu is not None
    before = metrics.render().decode()
    for _ in range(95):
        metrics.step_gpu.observe(0.00076)
    for _ in range(5):
        metrics.step_gpu.observe(0.00125)  # a prompt's step now and then
    step = loop_metrics.between(before, metrics.render().decode())["step_gpu_us_p50"]
    assert 750 <= step <= 800
    assert itl_over_step({"itl_ms_p99": 0.84, "step_gpu_us_p50": step}) <= 1.1
    assert itl_over_step({"itl_ms_p99": 0.90, "step_gpu_us_p50": step}) > 1.1
    assert itl_over_step({"itl_ms_p99": 0.9, "step_gpu_us_p50": None}) is None  # no GPU: nothing to read


def test_a_stream_s_gaps_are_taken_apart_by_what_made_them_long() -> None:
    """The single streams' inter-token gaps (bench/token_gaps.py): the last gap apart, and a long gap told apart as a
    late token (the next comes early), a token held back for its text (its chunk carries two), or a late step."""
    from bench.token_gaps import of_requests

    def stream(gaps: list[float], output_tokens: int | None = None) -> dict:
        times = [0.002]
        for g in gaps:
            times.append(times[-1] + g / 1000.0)
        return {"outcome": "ok", "token_times_s": times, "output_tokens": output_tokens or len(times)}

    steady = [1.0] * 20 + [1.2]  # every stream's last gap 1.2 ms
    streams = [stream(steady) for _ in range(6)]
    streams.append(stream([1.0] * 5 + [1.3, 0.7] + [1.0] * 13 + [1.2]))  # a token late, the next on time
    streams.append(stream([1.0] * 5 + [2.0] + [1.0] * 14 + [1.2], output_tokens=23))  # two tokens in one chunk
    streams.append(stream([1.0] * 5 + [1.3, 1.0] + [1.0] * 13 + [1.2]))  # a step late: the stream fell behind
    streams.append({"outcome": "rejected", "token_times_s": [], "output_tokens": 0})
    g = of_requests(streams)
    assert (g["streams"], g["gaps"]) == (9, 9 * 21)
    assert g["gap_ms_p50"] == pytest.approx(1.0) and g["last_gap_ms_p50"] == pytest.approx(1.2)
    assert (g["long_transient"], g["long_held_back"], g["long_late_step"]) == (1, 1, 1)
    assert g["streams_with_held_back_tokens"] == 1
    assert g["gap_ms_p99_without_last"] == pytest.approx(1.3)  # the long gaps, not the last ones (1.2)
    assert of_requests([])["gap_ms_p50"] is None


def test_loop_metrics_reads_the_gpu_s_idle_gaps_by_the_host_phase_that_made_them() -> None:
    """The report's table of long idle gaps: each phase's gaps and seconds between two scrapes of the server's own
    counters, the most idle time first; a phase with none since the first scrape is left out."""
    from bench import loop_metrics
    from service.metrics import Metrics

    metrics = Metrics()
    metrics.track_gpu_idle()
    assert metrics.idle_gaps is not None and metrics.idle_gap_seconds is not None
    metrics.idle_gaps.labels(after="commit").inc()
    metrics.idle_gap_seconds.labels(after="commit").inc(0.0002)
    before = metrics.render().decode()
    for after, seconds in (("handed over", 0.0006), ("handed over", 0.0004), ("send out", 0.0003)):
        metrics.idle_gaps.labels(after=after).inc()
        metrics.idle_gap_seconds.labels(after=after).inc(seconds)
    gaps = loop_metrics.between(before, metrics.render().decode())["idle_gaps"]
    assert list(gaps) == ["handed over", "send out"]  # commit's gap came before the first scrape
    assert gaps["handed over"] == [2, 1.0] and gaps["send out"] == [1, 0.3]


def test_idle_gap_reads_nvidia_smi_samples_and_skips_broken_lines(tmp_path: Path) -> None:
    from bench.idle_gap import read_samples

    path = tmp_path / "clocks.csv"
    path.write_text("2026/11/28 19:40:01.123, 1980, 3201, 312.45, P0, 0x0000000000000000\n"
                    "2026/11/28 19:40:01.143, 345, 3201, [N/A], P0, 0x0000000000000001\n"
                    "2026/11/28 19:40:01.1")  # cut short when the sampler stopped
    samples = read_samples(path)
    assert [s["sm_mhz"] for s in samples] == [1980.0, 345.0]
    assert samples[0]["power_w"] == 312.45 and samples[1]["power_w"] is None
    assert samples[1]["t"] - samples[0]["t"] == pytest.approx(0.020, abs=1e-6)
    assert samples[1]["reasons"] == "0x0000000000000001"
