"""bench/slow_log.py: the engine's slow-iteration lines in a server's log, read back for the e2e and voice reports."""

from pathlib import Path

from bench import slow_log

PREFIX = "2026-12-07 15:00:00,000 WARNING parley.engine[engine]: "
STARTUP = (PREFIX + "an engine iteration took 15010.8 ms launching 32 rows (32 prompt) over 496 positions (plan 0.1, "
           "decode 0.2, decode: input wait 0.0, decode: launch 15010.1, choose 0.3; the thread ran 10535.0 ms on a "
           "CPU, blocked 175 times, was preempted 39 times; 1 iterations over 5 ms since the last report)\n")
READY = "2026-12-07 15:00:01,000 INFO parley[front end 0]: Parley listening on http://127.0.0.1:8000 — model x\n"
WAIT = (PREFIX + "an engine iteration took 5.4 ms launching 1 rows (0 prompt) over 2078 positions (plan 0.0, "
        "copies+prefills 0.0, feed 0.0, decode 0.1, decode: input wait 4.3, decode: launch 0.1, choose 0.1, handed "
        "over 0.0, complete 0.8, gauges 0.0; the thread ran 5.4 ms on a CPU, blocked 0 times, was preempted 0 times; "
        "{n} iterations over 5 ms since the last report{longest})\n")
OLD = (PREFIX + "an engine iteration took 7.8 ms (plan 0.2, copies+prefills 0.0, feed 0.0, decode 2.1, choose 1.6, "
       "handed over 0.0, complete 3.9, gauges 0.0; the thread ran 6.6 ms on a CPU, blocked 11 times, was preempted 0 "
       "times; 5 iterations over 5 ms since the last report, this the longest)\n")


def test_lines_after_the_server_is_ready_are_read_with_their_step_and_phases():
    """Start-up's compile (15 s) is not a serving stall; a line from before steps were named reads too."""
    log = STARTUP + READY + WAIT.format(n=3, longest=", this the longest") + OLD
    lines = slow_log.read(log)
    assert len(lines) == 2
    new, old = lines
    assert new["ms"] == 5.4 and new["step"] == "1 rows (0 prompt) over 2078 positions" and new["over"] == 3
    assert new["phases"]["decode: input wait"] == 4.3 and new["phases"]["handed over"] == 0.0
    assert new["blocked"] == 0 and len(new["phases"]) == 10
    assert old["step"] is None and old["phases"]["complete"] == 3.9 and old["blocked"] == 11 and old["over"] == 5
    assert slow_log.read(STARTUP) == []  # never ready: nothing served


def test_lines_are_counted_by_their_largest_part(tmp_path: Path):
    log = READY + WAIT.format(n=1, longest="") + WAIT.format(n=4, longest=", this the longest") + OLD
    (tmp_path / "server-megakernel.fp8.log").write_text(log)
    by_server = slow_log.of_servers(tmp_path, ["megakernel.fp8", "megakernel.fp8.admissionoff"])  # one has no log
    assert list(by_server) == ["megakernel.fp8"]
    s = by_server["megakernel.fp8"]
    assert s["lines"] == 3 and s["iterations_over_5ms"] == 10
    assert [(p["part"], p["lines"]) for p in s["by_part"]] == [("decode: input wait", 2), ("complete", 1)]
    wait = s["by_part"][0]
    assert wait["ms_p50"] == 5.4 and wait["part_ms_p50"] == 4.3
    assert wait["longest_step"] == "1 rows (0 prompt) over 2078 positions"
    md = "\n".join(slow_log.section(by_server))
    assert "## The engine's slow iterations (its log)" in md and "`megakernel.fp8`: 10 iterations over 5 ms" in md
    assert "| decode: input wait | 2 | 5.4 | 4.3 | 1 rows (0 prompt) over 2078 positions |" in md
    assert "| complete | 1 | 7.8 | 3.9 | – |" in md
    assert slow_log.section({}) == []
