"""Calibration: what the latency model starts from, measured at start-up within a time budget, and cached.

What is timed: steps of 1, 2, 4, … max_rows rows (the widest step the planner may choose) at a short context (one row
per slot up to max_batch slots, the rest as consecutive positions of one slot: a prompt chunk riding beside the decode
rows), steps at a long context (what each K/V position a row attends over adds: step_kv_s, on a GPU by the step's
rows, at a voice conversation's length; on the CPU one step at the end of the context), and the
separate prefill launches of long prompts (fresh, and on top of cached tokens; on a GPU at every pair of graph buckets
a prefill replays).

Bounded: the points that matter first (a step of one row, of a full batch, of the token budget, the long context, a
prefill) are timed first, the rest while the budget lasts; every point keeps the fastest of at most TRIES tries and is
never measured again because the host looks busy (that had made start-up take 65-290 s on two busy cores). What was
not timed is predicted from what was (interpolated, extrapolated) and then learned online from the steps served.

Cached: per device, model (and a hash of its config), weight format, backend and step limits, in a JSON file written
atomically; a restart reads it and times one sanity point (a one-row step) instead of the sweep. A corrupt or foreign
file is ignored with a warning and measured over; so is a cache whose steps were several times slower than now.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.backends.decoder import Decoder
from service.engine.engine import DEFAULT_MAX_ROWS
from service.latency_model import SHORT_CONTEXT, LatencyModel
from service.model.config import ModelConfig

log = logging.getLogger("parley")

FORMAT = 2  # of the cached calibration: a change of what is measured or how bumps it (2: step_kv_s by rows)
TRIES = 3  # each point keeps its fastest of at most this many
STEP_ROWS = (1, 2, 4, 8, 16, 32, 64)
BUDGET_S = {"cpu": 3.0, "cuda": 10.0}  # start-up's time for measuring, by device type...
STARTUP_S = {"cpu": 14.0, "cuda": 29.0}  # ...less what start-up has spent past this in all (the bound: 15 s on
# the CPU, 30 s on the H100; a second to start listening)...
MIN_BUDGET_S = 1.0  # ...but never less than this
GPU_LAUNCHES = 4  # steps launched back to back per try on a GPU: the engine's cadence there
SANITY = 3.0  # a cached calibration whose one-row step is this many times slower than now is measured again
EAGER_FRESH = (256, 64, 1024)  # fresh prefill launches timed without graph buckets, most useful first
KV_CONTEXT = 2048  # on a GPU the long context's steps are timed at this position (or the context's end, if sooner): a
# voice conversation's length (1,500-2,200 tokens in `bench voice`), where a position's price is what admission must
# get right; longer contexts pay less a position, so they are predicted a little long, never short
EAGER_NEW = 256  # new tokens of the prefills timed on top of cached ones without graph buckets


# -- what was measured ------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """The LatencyModel's constructor arguments as measured (and, for the points not timed, predicted), and which
    points were timed: what the cache holds."""

    step_s: dict[int, float]
    prefill_s: dict[int, float]
    max_rows: int
    continued_s: dict[tuple[int, int], float] = field(default_factory=dict)
    buckets: list[int] | None = None
    step_kv_s: dict[int, float] = field(default_factory=dict)  # rows → seconds per position beyond SHORT_CONTEXT
    measured: list[str] = field(default_factory=list)  # Point labels, in the order first timed
    seconds: float = 0.0  # how long measuring took

    def latency_model(self) -> LatencyModel:
        return LatencyModel(dict(self.step_s), dict(self.prefill_s), self.max_rows, dict(self.continued_s),
                            None if self.buckets is None else list(self.buckets), dict(self.step_kv_s))


def calibration_to_json(cal: Calibration) -> dict[str, Any]:
    return {"step_s": {str(r): s for r, s in cal.step_s.items()},
            "prefill_s": {str(n): s for n, s in cal.prefill_s.items()},
            "max_rows": cal.max_rows,
            "continued_s": [[n, kv, s] for (n, kv), s in cal.continued_s.items()],
            "buckets": cal.buckets, "step_kv_s": {str(r): s for r, s in cal.step_kv_s.items()},
            "measured": cal.measured, "seconds": cal.seconds}


def calibration_from_json(d: dict[str, Any]) -> Calibration:
    """The inverse of calibration_to_json; ValueError (or TypeError, KeyError) for anything that is not one."""

    def seconds(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
            raise ValueError(f"not a duration: {x!r}")
        return float(x)

    def count(x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"not a count: {x!r}")
        return x

    def table(x: Any) -> dict[Any, Any]:
        if not isinstance(x, dict):
            raise ValueError(f"not a table: {x!r}")
        return x

    cal = Calibration(
        step_s={count(int(r)): seconds(s) for r, s in d["step_s"].items()},
        prefill_s={count(int(n)): seconds(s) for n, s in d["prefill_s"].items()},
        max_rows=count(d["max_rows"]),
        continued_s={(count(n), count(kv)): seconds(s) for n, kv, s in d["continued_s"]},
        buckets=None if d["buckets"] is None else [count(b) for b in d["buckets"]],
        step_kv_s={count(int(r)): seconds(s) for r, s in table(d["step_kv_s"]).items()},
        measured=[str(p) for p in d["measured"]], seconds=seconds(d["seconds"]))
    if 1 not in cal.step_s or not cal.prefill_s:
        raise ValueError("no one-row step or no prefill")
    return cal


# -- what to measure --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """A shape to time. kind "step": `n` rows at a short context; "kv": `n` rows, one per slot, at position `kv`
    (a long context); "prefill": a launch of `n` new tokens over a K/V length `kv` (0: a fresh prompt), whose
    table key is (n, kv) and which runs `run` = (new tokens, K/V length): on a GPU the bucket pair's graph."""

    kind: str
    n: int
    kv: int = 0
    run: tuple[int, int] = (0, 0)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.n}" + (f"@{self.kv}" if self.kv else "")


def _prefill_points(ctx: int, buckets: list[int] | None) -> tuple[list[int], dict[tuple[int, int], tuple[int, int]]]:
    """Where to time prefill launches: fresh prompt lengths (most useful first), and (new tokens, K/V length) table
    keys of launches on top of cached tokens, each with the (new tokens, K/V length) to run for it. With graph
    buckets, every pair a prefill can replay (new ≤ K/V), each run with a shape that replays that pair's graph (one
    that ends on the context's last position would run eagerly); without, a few points (the CPU, where a launch
    costs ~2 ms a token): separate launches serve long prompts, shorter ones ride in the steps."""
    if buckets is None:
        fresh = [n for n in EAGER_FRESH if n <= ctx // 2] or [max(1, ctx // 2)]
        continued = {}
        for kv in sorted({ctx // 2, ctx}):
            n = min(EAGER_NEW, kv // 2)
            if 0 < n < kv:
                continued[n, kv] = (n, kv)
        return fresh, continued
    continued = {}
    for kv_bucket in buckets:
        kv = min(kv_bucket, ctx - 1)
        for n_bucket in (b for b in buckets if b <= kv_bucket):
            continued[n_bucket, kv_bucket] = (min(n_bucket, kv - 1), kv)
    return list(buckets), continued


def plan(ctx: int, max_rows: int, max_batch: int, buckets: list[int] | None) -> list[Point]:
    """Every try to make, in order: the points that matter first twice (a one-row step, a full batch's, the token
    budget's, the long context's, a prefill launch), then the others once, then every point until TRIES."""
    steps = {r: Point("step", r) for r in step_rows(max_rows, max_batch)}
    fresh, continued = _prefill_points(ctx, buckets)
    prefills = [Point("prefill", n, 0, (n, 0)) for n in fresh]
    prefills += [Point("prefill", n, kv, run) for (n, kv), run in continued.items()]
    if buckets is None:  # a fresh prompt first, then one on cached tokens: what a voice turn launches
        prefills = prefills[:1] + prefills[len(fresh):len(fresh) + 1] + prefills[1:len(fresh)] + \
            prefills[len(fresh) + 1:]
    first = [steps[1], steps[max_batch], steps[max_rows]]
    long = [] if ctx - 1 < 2 * SHORT_CONTEXT else [Point("kv", max_batch, ctx - 1)] if buckets is None else \
        [Point("kv", r, min(ctx - 1, KV_CONTEXT)) for r in step_rows(max_batch, max_batch)]
    first += long[-1:]  # the full batch's
    first.append(prefills[0])
    first = list(dict.fromkeys(first))
    rest = [p for p in [*steps.values(), *long, *prefills] if p not in first]
    order = first + first + rest
    for k in range(2, TRIES + 1):
        order += [p for p in first + rest if order.count(p) < k]
    return order


def default_budget(device: torch.device, spent_s: float = 0.0) -> float:
    """How long to measure where --calibration-budget-s is unset: BUDGET_S of the device type, cut to what is left
    of STARTUP_S after the `spent_s` seconds start-up took so far (a model load slowed by a busy host leaves less), at
    least MIN_BUDGET_S."""
    kind = "cpu" if device.type == "cpu" else "cuda"
    return max(MIN_BUDGET_S, min(BUDGET_S[kind], STARTUP_S[kind] - spent_s))


# -- measuring --------------------------------------------------------------------------------------------------
def calibrate(decoder: Decoder, max_rows: int | None = None, max_batch: int | None = None,
              deadline_s: float | None = None) -> LatencyModel:
    """The latency model measure() finds (the decoder's slots and token budget by default)."""
    return measure(decoder, max_rows, max_batch, deadline_s).latency_model()


def measure(decoder: Decoder, max_rows: int | None = None, max_batch: int | None = None,
            deadline_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Calibration:
    """Time the plan's points in order while `deadline_s` lasts (default: BUDGET_S of the device): a try that
    would overrun it is left out, except the first (a one-row step: without it there is no model). Run before
    serving: it writes into KV slots that no request holds yet."""
    max_batch = max(1, min(max_batch or decoder.max_slots, decoder.max_slots))
    max_rows = max(max_rows or getattr(decoder, "max_rows", None) or DEFAULT_MAX_ROWS, max_batch)
    ctx = decoder.max_context
    buckets = decoder.prefill_graph_buckets()
    budget = default_budget(decoder.device) if deadline_s is None else deadline_s
    timer = _Timer(decoder, max_batch)
    times: dict[Point, list[float]] = {}
    start = clock()
    for point in plan(ctx, max_rows, max_batch, buckets):
        launches = GPU_LAUNCHES if timer.gpu and point.kind != "prefill" else 1
        if times and clock() - start + launches * _guess(point, times, ctx) > budget:
            continue
        t0 = clock()
        launches = timer.run(point)
        times.setdefault(point, []).append((clock() - t0) / launches)
        log.debug("calibration: %s took %.2f ms (try %d)", point.label, times[point][-1] * 1e3, len(times[point]))
    cal = _fit({p: min(ts) for p, ts in times.items()}, max_rows, max_batch, buckets)
    cal.seconds = clock() - start
    return cal


class _Timer:
    """Runs one try of a point: on the CPU one launch, its tokens read back (the engine reads them every step); on a
    GPU GPU_LAUNCHES steps back to back (the engine runs a step ahead: its cadence is the steps', not a launch and a
    sync each), or one prefill launch, then a sync. Returns how many launches the caller's clock timed."""

    def __init__(self, decoder: Decoder, max_batch: int) -> None:
        self.decoder, self.max_batch = decoder, max_batch
        self.gpu = decoder.device.type == "cuda"
        self.rng = random.Random(0)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.decoder.config.vocab_size) for _ in range(n)]

    def run(self, point: Point) -> int:
        if point.kind == "prefill":
            new, kv = point.run
            self.decoder.prefill(0, self.tokens(new), kv - new if kv else 0)
            _sync(self.decoder)
            return 1
        slots, positions, sampled = self.rows(point)
        ids: list[int] | torch.Tensor = self.tokens(len(slots))
        if not self.gpu:
            self.decoder.decode(slots, ids, positions, sampled_rows=sampled).argmax.tolist()
            return 1
        ids = torch.tensor(ids, device=self.decoder.device)
        for _ in range(GPU_LAUNCHES):
            out = self.decoder.decode(slots, ids, positions, sampled_rows=sampled)
        out.argmax.tolist()
        return GPU_LAUNCHES

    def rows(self, point: Point) -> tuple[list[int], list[int], int]:
        """A step's rows as (slots, positions, sampled rows), as the planner fills a step: a decode row in each of
        max_batch slots (fewer rows: fewer slots), and the rows left over as one prompt chunk at consecutive
        positions in slot 0, centred on SHORT_CONTEXT so that the step attends over no more than SHORT_CONTEXT
        positions a row on average (step_kv_s adds nothing to it); a "kv" step's rows at the long position. Rows
        [0, sampled) end their slot's run (a decode row, the chunk's last row): they get logits."""
        ctx = self.decoder.max_context
        b = min(point.n, self.max_batch)
        if point.kind == "kv":
            return list(range(b)), [point.kv] * b, b
        chunk = point.n - (b - 1)
        first = max(0, min(SHORT_CONTEXT - chunk // 2, ctx - chunk))
        positions = [first + chunk - 1] + [min(SHORT_CONTEXT, ctx - 1)] * (b - 1) + \
            [first + i for i in range(chunk - 1)]
        return [*range(b), *[0] * (chunk - 1)], positions, b


def run_every_step_shape(decoder: Decoder, max_rows: int, max_batch: int) -> None:
    """One untimed try of every step the calibration times: on a GPU the first run of a shape compiles it and
    captures its graph, which a restart that reads the calibration from its cache would otherwise leave to the
    first users."""
    timer = _Timer(decoder, max(1, min(max_batch, decoder.max_slots)))
    for r in step_rows(max_rows, max_batch):
        timer.run(Point("step", r))


def step_rows(max_rows: int, max_batch: int) -> list[int]:
    """The row counts of the steps timed (or predicted): powers of two up to the token budget, the batch, the budget."""
    return sorted({r for r in STEP_ROWS if r <= max_rows} | {max_batch, max_rows})


def _guess(point: Point, times: dict[Point, list[float]], ctx: int) -> float:
    """What a try of `point` will likely take (pessimistic where nothing alike was timed): to leave out a try that
    would overrun the budget before starting it."""
    if times.get(point):
        return min(times[point])
    done = {p: min(ts) for p, ts in times.items()}
    steps = {p.n: s for p, s in done.items() if p.kind == "step"}
    if point.kind == "prefill":
        work = point.run[0] * (1 + point.run[1] / 2048)  # tokens, and the K/V they attend over
        timed = [(p.run[0] * (1 + p.run[1] / 2048), s) for p, s in done.items() if p.kind == "prefill"]
        if timed:
            w, s = min(timed, key=lambda ws: abs(ws[0] - work))
            return s * work / w
        if steps:
            r = max(steps)
            return steps[r] * work / r
        return 0.0
    if not steps:
        return 0.0
    base = _predict_step(steps, point.n)
    return base * (max(1.0, ctx / SHORT_CONTEXT) ** 0.5 if point.kind == "kv" else 1.0)


def _fit(best: dict[Point, float], max_rows: int, max_batch: int, buckets: list[int] | None) -> Calibration:
    """The constructor arguments from each timed point's fastest try. A stall only ever adds time, and more work
    never takes less: a point is kept at most as slow as any timed point of at least as much work (a step of more
    rows; a prefill of more new tokens over at least as long a K/V). step_kv_s: each long-context step over the short
    one of as many rows, a position's price at those rows. Every step point of the plan is there, timed or predicted
    from those timed (_predict_step), never below a smaller step."""
    best = _no_slower_than_more_work(best)
    measured = {p.n: s for p, s in best.items() if p.kind == "step"}
    step_s: dict[int, float] = {}
    for r in step_rows(max_rows, max_batch):
        step_s[r] = measured[r] if r in measured else max(_predict_step(measured, r), max(step_s.values(), default=0.0))
    step_kv_s = {p.n: max(0.0, s - step_s[p.n]) / (p.n * (p.kv - SHORT_CONTEXT))
                 for p, s in sorted(best.items(), key=lambda ps: ps[0].n) if p.kind == "kv" and p.kv > SHORT_CONTEXT}
    # no prefill launch timed (the budget ran out): one of max_rows tokens is predicted to cost a full step (on the
    # CPU a launch costs about half that a token), a longer one proportionally more
    prefill_s = {p.n: s for p, s in best.items() if p.kind == "prefill" and not p.kv} or {max_rows: step_s[max_rows]}
    return Calibration(
        step_s=step_s, prefill_s=prefill_s,
        max_rows=max_rows, continued_s={(p.n, p.kv): s for p, s in best.items() if p.kind == "prefill" and p.kv},
        buckets=None if buckets is None else list(buckets), step_kv_s=step_kv_s,
        measured=[p.label for p in best])


def _no_slower_than_more_work(best: dict[Point, float]) -> dict[Point, float]:
    def work(p: Point) -> tuple[int, int]:
        return (p.n, p.kv)  # a fresh prefill's K/V length is 0: below any on cached tokens

    def no_more(p: Point, q: Point) -> bool:
        if p.kind != q.kind:
            return False
        (n, kv), (n2, kv2) = work(p), work(q)
        return n <= n2 and kv <= kv2

    return {p: min(s2 for q, s2 in best.items() if no_more(p, q)) for p in best}


def _predict_step(timed: dict[int, float], rows: int) -> float:
    """A step of `rows` rows from the steps timed: between two, linearly; past the largest, linearly from the last
    two but at most proportionally to the rows (r rows never cost more than r/r0 steps of r0: the weights are read
    once a step), so that two noisy small steps do not predict a huge one."""
    below = [r for r in timed if r <= rows]
    if not below or rows <= max(timed):
        return _line(timed, rows)
    r0 = max(below)
    return min(_line(timed, rows), timed[r0] * rows / r0)


def _line(table: dict[int, float], x: int) -> float:
    """Piecewise-linear through the points; past them, linearly from the nearest two (one point: flat)."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]]
    lo, hi = next(((a, b) for a, b in zip(xs, xs[1:]) if x <= b), (xs[-2], xs[-1]))
    return max(0.0, table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo))


def _sync(decoder: Decoder) -> None:
    if decoder.device.type == "cuda":
        torch.cuda.synchronize(decoder.device)


# -- the cache --------------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/parley/calibration, or ~/.cache/parley/calibration."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "parley" / "calibration"


def cache_dir_of(setting: str | None) -> Path | None:
    """--calibration-cache: unset, the default directory; "off" (or empty), no cache; else that directory."""
    if setting is None:
        return default_cache_dir()
    if setting.strip().lower() in ("", "off", "none", "false", "0"):
        return None
    return Path(setting).expanduser()


def device_name(device: torch.device) -> str:
    """What the timings belong to: the GPU's name, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def cache_key(device: torch.device, model_id: str, config: ModelConfig, weights: str, backend: str, max_rows: int,
              max_batch: int, max_context: int, **more: Any) -> dict[str, Any]:
    """Everything the timings depend on; `more`: other settings that change them (--batch-invariant, a delay)."""
    shape = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return {"format": FORMAT, "device": device_name(device), "model": model_id,
            "model_config": hashlib.sha256(shape.encode()).hexdigest()[:16], "weights": weights, "backend": backend,
            "max_rows": max_rows, "max_batch": max_batch, "max_context": max_context, "torch": torch.__version__,
            **more}


def cache_path(directory: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(key["model"])).name)[:48]
    return directory / f"{name}-{key['weights']}-{digest}.json"


def read_keyed(path: Path, key: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The JSON object at `path` where it was written for `key` (write_keyed); None where there is none, and with a
    warning naming `what` where a file is there but unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the %s %s: unreadable (%s)", what, path, e)
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        log.warning("ignoring the %s %s: it was measured for something else", what, path)
        return None
    return data


def write_keyed(path: Path, key: dict[str, Any], body: dict[str, Any], what: str) -> None:
    """`body` with `key` as one JSON object at `path`, atomically (a temporary file renamed over it): a reader sees the
    old file or the new one, never half of one. A file that cannot be written costs a warning naming `what`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, **body}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("could not write the %s %s: %s", what, path, e)


def read_cache(directory: Path, key: dict[str, Any]) -> Calibration | None:
    """The calibration cached for `key`; None (with a warning where a file is there but unusable) otherwise."""
    path = cache_path(directory, key)
    data = read_keyed(path, key, "calibration cache")
    if data is None:
        return None
    try:
        return calibration_from_json(data["calibration"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("ignoring the calibration cache %s: not a calibration (%s)", path, e)
        return None


def write_cache(directory: Path, key: dict[str, Any], cal: Calibration) -> None:
    """The calibration for `key` (write_keyed: a cache that cannot be written costs the next start-up a sweep)."""
    write_keyed(cache_path(directory, key), key, {"calibration": calibration_to_json(cal)}, "calibration cache")


def calibrated(decoder: Decoder, key: dict[str, Any], directory: Path | None, max_rows: int, max_batch: int,
               deadline_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
               seen: dict[int, float] | None = None) -> Calibration:
    """The cached calibration for `key` where one is there, else a fresh one (no step slower than one of as many
    rows or more in `seen`: no_slower_than_seen), then cached. A one-row step is timed to check the cache: SANITY
    times faster now, the cache was measured on a busy host (or another machine) and is measured again; slower, the
    host is likely busy now, which measuring again would only bake in: the cache stays, and the steps served correct
    it."""
    cached = read_cache(directory, key) if directory is not None else None
    if directory is not None and cached is not None:
        now = sanity_step(decoder, max_batch, clock=clock)
        if now * SANITY >= cached.step_s[1]:
            log.info("latency calibration read from %s (a one-row step: %.2f ms cached, %.2f ms now)",
                     cache_path(directory, key), cached.step_s[1] * 1e3, now * 1e3)
            return no_launch_slower_than_riding(cached)  # a cache written before launches were bounded
        log.warning("the cached latency calibration says a one-row step takes %.2f ms, it takes %.2f ms now: "
                    "measuring again", cached.step_s[1] * 1e3, now * 1e3)
    cal = no_launch_slower_than_riding(no_slower_than_seen(measure(decoder, max_rows, max_batch, deadline_s, clock),
                                                           seen or {}))
    if directory is not None:
        write_cache(directory, key, cal)
    return cal


STALL_FACTOR = 2.0  # a calibrated step this many times slower than the warm-up's of as many rows or more: a stall


def no_slower_than_seen(cal: Calibration, seen: dict[int, float]) -> Calibration:
    """The calibration with no step point over STALL_FACTOR times the time a step of at least as many rows was seen
    to take (the warm-up's median, run just before it): such a point is a stall (it only ever adds time, and more
    rows never take less), and is kept at what the warm-up saw. On two cores shared with other jobs, one calibration
    timed a one-row step at 1.15 s that took 54 ms (the warm-up's 16-row steps had taken 137 ms): its strict server
    predicted 74 s for 64 tokens, refused every request, and, with no request served, never learned otherwise. Only
    a gross stall: on the H100 the warm-up's host-timed steps vary (steps pipelined a step ahead end close together
    in host time), and capping every point at the fastest of them set a one-row step at 0.6 ms that takes 1.1."""
    def bound(rows: int) -> float:
        return min((t for r, t in seen.items() if r >= rows), default=math.inf)

    step_s = {r: bound(r) if s > STALL_FACTOR * bound(r) else s for r, s in cal.step_s.items()}
    if step_s == cal.step_s:
        return cal
    log.warning("the latency calibration timed steps far slower than the warm-up ran them (a stalled try): %s ms, "
                "kept at %s ms", {r: round(s * 1e3, 1) for r, s in cal.step_s.items()},
                {r: round(s * 1e3, 1) for r, s in step_s.items()})
    return dataclasses.replace(cal, step_s=step_s)


LAUNCH_STALL_FACTOR = 4.0  # a prefill launch this many times slower than riding its tokens in full steps: a stall


def no_launch_slower_than_riding(cal: Calibration) -> Calibration:
    """The calibration with no prefill launch over LAUNCH_STALL_FACTOR times what its new tokens cost riding in full
    steps (ceil(n / max_rows) steps of max_rows rows over the same K/V, at the calibration's own step times, stalls
    capped already): such a point is a stall, kept at that bound. A genuine launch is at most ~2.5x that (the H100:
    16 tokens 3.2 ms against a 16-row step's 1.3 ms; from a few steps' worth of tokens on, far less than riding; the
    CPU's prefill about a quarter of riding). On two cores shared with other jobs one calibration timed a 16-token
    launch at 276 ms beside 2 ms steps: its server forecast every idle prompt that launches at 0.8-1.7 s, past even
    a probe's room, and refused them all."""
    lat = cal.latency_model()

    def riding(n: int, kv: int = 0) -> float:
        steps = -(-n // cal.max_rows)
        return LAUNCH_STALL_FACTOR * steps * lat.step(cal.max_rows, cal.max_rows * kv)

    prefill_s = {n: min(s, riding(n)) for n, s in cal.prefill_s.items()}
    continued_s = {(n, kv): min(s, riding(n, kv)) for (n, kv), s in cal.continued_s.items()}
    if prefill_s == cal.prefill_s and continued_s == cal.continued_s:
        return cal
    log.warning("the latency calibration timed prefill launches far slower than riding their tokens in steps (a "
                "stalled try): %s ms, kept at %s ms", {n: round(s * 1e3, 1) for n, s in cal.prefill_s.items()},
                {n: round(s * 1e3, 1) for n, s in prefill_s.items()})
    return dataclasses.replace(cal, prefill_s=prefill_s, continued_s=continued_s)


def sanity_step(decoder: Decoder, max_batch: int, tries: int = 2,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of `tries` one-row steps, timed as measure() times them."""
    timer, best = _Timer(decoder, max_batch), math.inf
    for _ in range(tries):
        t0 = clock()
        launches = timer.run(Point("step", 1))
        best = min(best, (clock() - t0) / launches)
    return best
