"""py-spy beside a benchmark's server: where the engine's host time goes (issue 37).

The e2e report says how long the engine's host spends per iteration (p50 0.46-0.53 ms, p99 1.3 ms in the H200's
sweeps, against a 0.77-0.90 ms step), not on what. `python -m bench e2e --set profile=sweep-32` records the server's
processes (the front end and the engine process: `--subprocesses`) with py-spy while each loadtest whose name ends
with one of the given suffixes runs, without pausing them (`--nonblocking`: a sample may be torn, none stops the
engine), into `<loadtest>.pyspy.txt` in the raw folder: py-spy's collapsed stacks, one line per (thread, stack) with
its sample count. `summarize` reads one back: for the threads whose name contains a given word (the engine loop's
thread is `parley-engine`), each frame's share of their samples, on the stack (inclusive) and at its top (self).

    python -m bench host-profile RAW/megakernel.fp8-sweep-32.pyspy.txt [--thread engine] [--top 30]
    python -m bench host-profile NEW.pyspy.txt --against OLD.pyspy.txt    # two builds, one machine, one loadtest

With `--against`, the two recordings side by side, by function (lines dropped: two builds' lines move), the functions
whose own samples differ most first. py-spy samples at a fixed rate, so over the same loadtest the counts compare as
they are: an A/B of two builds on one machine (machines of one kind differ more than builds: bench/NOTES.md, s70).

py-spy is a device wheel (bench/device_wheels.txt), not a dependency: where it is missing or may not attach, the
benchmark says so and measures on.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".pyspy.txt"
RATE_HZ = 250  # samples a second: ~2 per 8 ms of the engine's ~1 ms iterations, thousands over a sweep


def py_spy() -> str | None:
    """py-spy's executable: on PATH, or beside this Python's (a virtual environment not activated)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


@contextmanager
def recording(pid: int, out: Path, rate_hz: int = RATE_HZ) -> Iterator[None]:
    """py-spy records process `pid` and its children into `out` while the block runs (where py-spy is installed)."""
    exe = py_spy()
    if exe is None:
        print("host profile: py-spy is not installed (bench/device_wheels.txt); not recorded", flush=True)
        yield
        return
    log = out.with_suffix(".log")
    with open(log, "wb") as err:
        proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads",
                                 "--rate", str(rate_hz), "--format", "raw", "--output", str(out)],
                                stdout=err, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled when interrupted
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if not out.exists():
            print(f"host profile: py-spy wrote nothing (exit {proc.returncode}; see {log})", flush=True)


@dataclass(frozen=True)
class Frame:
    name: str  # py-spy's "function (file:line)"
    inclusive: float  # share of the thread's samples with this frame on the stack
    own: float  # ...with it at the top


def parse(text: str, thread: str) -> tuple[Counter[tuple[str, ...]], int]:
    """The stacks (outermost frame first) of the threads whose name contains `thread`, with their sample counts; and
    how many samples those threads have in all. A line: [process...;]thread (id): name;frame;...;frame count."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        parts = head.split(";")
        at = next((i for i, p in enumerate(parts) if p.startswith("thread (")), None)
        if at is None or thread not in parts[at].partition("): ")[2]:
            continue
        stacks[tuple(parts[at + 1:])] += int(count)
    return stacks, sum(stacks.values())


def tally(stacks: Counter[tuple[str, ...]], name: Callable[[str], str] = str
          ) -> tuple[Counter[str], Counter[str]]:
    """Each frame's samples (keyed by `name(frame)`) on the stack, counted once a stack however often it recurs in
    it, and at its top."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in stacks.items():
        names = [name(f) for f in stack]
        for key in set(names):
            inclusive[key] += n
        if names:
            own[names[-1]] += n
    return inclusive, own


def summarize(text: str, thread: str = "engine", top: int = 30) -> tuple[int, list[Frame]]:
    """The samples of the matching threads, and their `top` frames by inclusive share (a frame counted once a stack,
    however often it recurs in it)."""
    stacks, total = parse(text, thread)
    inclusive, own = tally(stacks)
    frames = [Frame(name, n / total, own[name] / total) for name, n in inclusive.most_common(top)] if total else []
    return total, frames


def function_of(frame: str) -> str:
    """A frame without its line number: `function (file)`."""
    return re.sub(r":\d+\)$", ")", frame)


@dataclass(frozen=True)
class Difference:
    name: str  # function_of(frame)
    inclusive: tuple[int, int]  # samples with it on the stack, in each recording
    own: tuple[int, int]  # ...with it at the top


def compare(text: str, against: str, thread: str = "engine", top: int = 30
            ) -> tuple[tuple[int, int], list[Difference]]:
    """Two recordings of the same loadtest (`text`, and `against`: the baseline): each one's samples of the matching
    threads, and the `top` functions whose own samples differ most between them."""
    counts = []
    for recording in (against, text):
        stacks, total = parse(recording, thread)
        counts.append((*tally(stacks, function_of), total))
    (inc_a, own_a, total_a), (inc_b, own_b, total_b) = counts
    names = sorted(set(inc_a) | set(inc_b), key=lambda k: (-abs(own_b[k] - own_a[k]), -inc_b[k], k))[:top]
    return (total_a, total_b), [Difference(k, (inc_a[k], inc_b[k]), (own_a[k], own_b[k])) for k in names]


def compare_table(totals: tuple[int, int], rows: list[Difference], thread: str) -> str:
    lines = [f"{totals[1]} samples of the threads named *{thread}* against {totals[0]} in the baseline (`--against`)",
             "", "| function | on the stack: baseline | this | at its top: baseline | this | difference |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| `{d.name}` | {d.inclusive[0]} | {d.inclusive[1]} | {d.own[0]} | {d.own[1]} | "
              f"{d.own[1] - d.own[0]:+d} |" for d in rows]
    return "\n".join(lines)


def table(total: int, frames: list[Frame], thread: str) -> str:
    lines = [f"{total} samples of the threads named *{thread}*", "", "| frame | on the stack | at its top |",
             "|---|---:|---:|"]
    lines += [f"| `{f.name}` | {f.inclusive:.1%} | {f.own:.1%} |" for f in frames]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, help=f"a raw folder's <loadtest>{SUFFIX}")
    p.add_argument("--thread", default="engine", help="threads whose name contains this (default: engine)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--against", type=Path, help="a baseline's recording of the same loadtest: the two side by side")
    args = p.parse_args(argv)
    text = args.file.read_text(errors="replace")
    if args.against is not None:
        totals, rows = compare(text, args.against.read_text(errors="replace"), args.thread, args.top)
        print(compare_table(totals, rows, args.thread))
        return 0 if all(totals) else 1
    total, frames = summarize(text, args.thread, args.top)
    print(table(total, frames, args.thread))
    return 0 if total else 1


if __name__ == "__main__":
    raise SystemExit(main())
