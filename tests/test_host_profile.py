"""The host profile beside the e2e benchmark (bench/host_profile.py): which loadtests the plan records, and the
summary of py-spy's collapsed stacks that the next GPU call reads (where the engine thread's time goes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.host_profile import compare, main, py_spy, summarize
from bench.runs import e2e, voice

# py-spy's `record --format raw --threads --subprocesses` lines: [process;]thread (id): name;frames... count
RECORDED = """\
process 10:"python -m service.cli serve";thread (11): MainThread;serve (service/cli.py:40) 5
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (21): parley-engine;\
_loop (service/engine/engine.py:250);_iteration (service/engine/engine.py:284);_launch (service/engine/engine.py:366) 6
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (21): parley-engine;\
_loop (service/engine/engine.py:250);_iteration (service/engine/engine.py:295);\
_complete (service/engine/engine.py:435);observe (prometheus_client/metrics.py:630) 3
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (21): parley-engine;\
_loop (service/engine/engine.py:250) 1
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (22): parley-status;\
_heartbeat (service/engine_process.py:140) 7
not a stack line
"""


def test_the_summary_counts_the_engine_threads_frames_only() -> None:
    total, frames = summarize(RECORDED, "engine")
    assert total == 10  # the front end's main thread and the engine process's status thread are left out
    by_name = {f.name: f for f in frames}
    loop = by_name["_loop (service/engine/engine.py:250)"]
    assert loop.inclusive == pytest.approx(1.0) and loop.own == pytest.approx(0.1)
    launch = by_name["_launch (service/engine/engine.py:366)"]
    assert launch.inclusive == pytest.approx(0.6) and launch.own == pytest.approx(0.6)
    assert by_name["observe (prometheus_client/metrics.py:630)"].own == pytest.approx(0.3)
    assert [f.name for f in frames][0] == "_loop (service/engine/engine.py:250)"  # by share on the stack
    assert summarize(RECORDED, "status")[0] == 7 and summarize(RECORDED, "nobody") == (0, [])


def test_the_command_prints_the_table_and_fails_on_a_file_without_the_thread(tmp_path: Path, capsys) -> None:
    f = tmp_path / "x.pyspy.txt"
    f.write_text(RECORDED)
    assert main([str(f), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 samples of the threads named *engine*")
    assert "| `_launch (service/engine/engine.py:366)` | 60.0% | 60.0% |" in out
    assert main([str(f), "--thread", "nobody"]) == 1


# the same loadtest on another build: its lines moved, its launch took 9 samples, its metrics' observe 1
BASELINE = """\
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (21): parley-engine;\
_loop (service/engine/engine.py:240);_iteration (service/engine/engine.py:270);_launch (service/engine/engine.py:350) 9
process 10:"python -m service.cli serve";process 20:"python -m service.engine_process";thread (21): parley-engine;\
_loop (service/engine/engine.py:240);_iteration (service/engine/engine.py:280);\
_complete (service/engine/engine.py:420);observe (prometheus_client/metrics.py:630) 1
"""


def test_two_builds_compare_by_function_whatever_their_lines(tmp_path: Path, capsys) -> None:
    """An A/B of two builds' recordings of one loadtest: each function's samples in both, lines dropped (they move
    between builds), the largest difference in own samples first."""
    totals, rows = compare(RECORDED, BASELINE, "engine")
    assert totals == (10, 10)
    by_name = {d.name: d for d in rows}
    assert rows[0].name == "_launch (service/engine/engine.py)"  # 9 → 6 at the top: the largest difference
    assert by_name["_launch (service/engine/engine.py)"].own == (9, 6)
    assert by_name["observe (prometheus_client/metrics.py)"].own == (1, 3)
    assert by_name["_loop (service/engine/engine.py)"].inclusive == (10, 10)  # one function, two lines in this build
    assert by_name["_loop (service/engine/engine.py)"].own == (0, 1)
    new, old = tmp_path / "new.pyspy.txt", tmp_path / "old.pyspy.txt"
    new.write_text(RECORDED)
    old.write_text(BASELINE)
    assert main([str(new), "--against", str(old)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 samples of the threads named *engine* against 10 in the baseline")
    assert "| `_launch (service/engine/engine.py)` | 9 | 6 | 9 | 6 | -3 |" in out
    assert main([str(new), "--against", str(old), "--thread", "status"]) == 1  # the baseline has no such thread


def test_the_plan_records_the_named_loadtests_only() -> None:
    servers = {s.label: s for s in e2e(only="megakernel.fp8", profile="sweep-32,capacity-32").servers}
    profiled = {t.name for s in servers.values() for t in s.loadtests if t.profile}
    assert profiled == {"megakernel.fp8-sweep-32", "megakernel.fp8-capacity-32"}
    assert not any(t.profile for s in e2e(only="megakernel.fp8").servers for t in s.loadtests)


def test_the_voice_plan_records_the_named_loadtests_only() -> None:
    """bench voice's loadtests carry no server label: a name given whole is recorded, on whichever server runs it (the
    sweep on the admitting one, the capacity run on the admission-off one), and no other."""
    bench = voice(weights="fp8", profile="sweep-chat,capacity-realtime")
    profiled = {(s.label, t.name) for s in bench.servers for t in s.loadtests if t.profile}
    assert profiled == {("megakernel.fp8", "sweep-chat"), ("megakernel.fp8.admissionoff", "capacity-realtime")}
    assert not any(t.profile for s in voice(weights="fp8").servers for t in s.loadtests)


@pytest.mark.slow
@pytest.mark.skipif(py_spy() is None, reason="py-spy is a device wheel, not a CI dependency")
def test_a_profiled_run_records_the_engine_process(tmp_path: Path) -> None:
    """On a machine with py-spy: the tiny model's server with the engine in a process of its own, recorded over one
    loadtest; the summary finds the engine thread's loop."""
    from tests.test_bench import bench

    raw = tmp_path / "raw"
    out = bench("e2e", "--raw", str(raw), "--out", str(tmp_path / "results"), "--set", "only=reference.bf16",
                "--set", "serve_args=--model synthetic:tiny --device cpu --sla-ms 60000 --engine-process",
                "--set", "single_requests=5", "--set", "profile=single-32")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    total, frames = summarize((raw / "reference.bf16-single-32.pyspy.txt").read_text(), "engine")
    assert total > 0 and any("Engine._loop" in f.name for f in frames)
