"""AdmissionLog (`--admission-log FILE`): every verdict admission gives and every admitted request's SLA token, one
JSON object a line, so that an operator (or `bench e2e`) can say why a request was refused and how far the forecast
was off for those admitted.

The counters on /metrics say how many were refused; they cannot say whether a refusal was right. A line per verdict
can: the forecast (unstretched and stretched), the deadline's time left, what the request had spent before the verdict,
the level and its stretch, and which rule refused it. The lines are written by a thread of their own: the verdict runs
on the engine thread (service/engine/handoff.py), which only formats a dict and puts it on a queue.

Lines (times in ms; `t` in seconds on the server's perf_counter clock, the one every line shares):
- {"kind": "verdict", "t", "req", "admitted", "reason", "rule", "in_flight", "prompt_tokens", "cached_tokens",
  "level", "stretch", "since_arrival_ms", "left_ms", "forecast_ms", "stretched_ms", "ahead"}: `rule` is what refused it
  ("late": its own stretched forecast passes its deadline; "delays": it would make an admitted request late that is on
  time without it; "probe": an idle server admitted it as a probe), `forecast_ms` the time from the verdict to its SLA
  token the planner forecast, `stretched_ms` that times the stretch, `left_ms` its deadline less now, `ahead` the steps
  the engine had launched (the newcomer is forecast seated after them); a `delays`
  refusal adds its victim's `victim_over_ms` (past its deadline at the stretch beside the newcomer),
  `victim_alone_over_ms` (without it), `victim_since_ms` (since its first verdict) and `victim_model_ms` (the model
  clock's time since then: what its steps so far were predicted to take);
- {"kind": "sla_token", "t", "req", "after_verdict_ms", "model_ms", "steps_ms", "forecast_ms", "score",
  "latest_score", "stretch", "level", "late", "since_arrival_ms"}: an admitted request's SLA token. `score` is what the
  guard learns: `after_verdict_ms` over `model_ms`, what the latency model predicted for the steps that ran since its
  first verdict (service/model_clock.py); `steps_ms` is what those steps took (their cadence, the host's time between
  steps included), so a score splits into the steps over the model (steps / model) and the time outside their cadence
  (after_verdict / steps); `latest_score` is against its last promise's forecast, `forecast_ms` (service/admission.py's
  Promise), for comparison;
- {"kind": "step", "t", "rows", "prompt_rows", "kv_positions", "launched", "predicted_ms", "ms", "handed_ms"}: a
  measured step (one in STEP_EVERY), what the latency model predicted for it before learning from it and what it
  took (its cadence), so that a score's steps / model splits by the kind of step that ran over (decode rows alone, a
  prompt chunk beside them, a separate prefill launch before it; rows; positions a row); `handed_ms`: the handed-over
  work (verdicts) the engine thread ran within its cadence, and where there was any, `handed`: each task's [kind, ms]
  (prepare, verdict, delays: a verdict's parts; truncate, close: a session's; drain);
- {"kind": "handed", the step's fields, "tasks"}: every step (not a sample) with a handed-over task of 1 ms or more
  within its cadence (service/admission.py HANDED_LINE_S), `tasks` each task's [kind, ms]: what held the GPU up;
- {"kind": "gc", "t", "generation", "ms", "collected"}: a garbage collection of 1 ms or more (service/runtime.py
  GcWatch), `t` its end: it held the GIL, so a step or task around it took that much longer.

A line is formatted and written by the log's own thread: the engine's thread only puts a dict on a queue. Steps come
a thousand a second on a GPU, and the writer formats under the GIL the engine thread needs: only every STEP_EVERY-th
step gets a line (a plain sample: each kind keeps its share, the verdicts' steps included). The writer wakes at most
every WRITE_EVERY_S and writes what has gathered at once, encoded by msgspec (C): each wake-up takes the GIL when the
engine thread lets it go in a torch call or a send, and holds it until the engine thread's next switch interval. Woken
for every line and formatting each with json (~7 us), it made those calls 25-40% slower on the H200 under FP8's sweep
and its zmq sends 3x (bench/NOTES.md, s70). Floats are written as they are (shortest round trip; non-finite: null).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("parley.admission")

STEP_EVERY = 4  # one measured step in this many gets a line
WRITE_EVERY_S = 0.05  # the writer wakes at most this often: ~25 lines a wake-up under a GPU's load


class AdmissionLog:
    def __init__(self, path: str | Path, step_every: int = STEP_EVERY, write_every_s: float = WRITE_EVERY_S) -> None:
        self.path = Path(path)
        self.step_every = step_every
        self.write_every_s = write_every_s
        self._steps = 0  # measured steps seen (step_due)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115  # closed by close()
        self._lines: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="parley-admission-log", daemon=True)
        self._writer.start()

    def step_due(self) -> bool:
        """Whether this measured step gets a line (the engine's thread: a count, nothing more)."""
        self._steps += 1
        return self._steps % self.step_every == 0

    def record(self, kind: str, **fields: Any) -> None:
        """One line (any thread): `kind` and the fields."""
        fields["kind"] = kind
        self._lines.put(fields)

    def _write(self) -> None:
        encode = msgspec.json.Encoder(enc_hook=str).encode
        done = False
        while not done:
            batch = [self._lines.get()]
            time.sleep(self.write_every_s)  # a wake-up per batch, not per line
            while True:
                try:
                    batch.append(self._lines.get_nowait())
                except queue.Empty:
                    break
            lines = []
            for fields in batch:
                if fields is None:  # close(): what came before it is written, then the writer ends
                    done = True
                    break
                kind = fields.pop("kind")
                lines.append(encode({"kind": kind, **fields}) + b"\n")
            try:
                self._file.write(b"".join(lines))  # whole lines, flushed at once: a reader never sees half of one
                self._file.flush()
            except (OSError, ValueError):
                log.exception("the admission log %s cannot be written: no more lines", self.path)
                break

    def close(self) -> None:
        """What was recorded so far written, then the file closed."""
        self._lines.put(None)
        self._writer.join(timeout=5)
        self._file.close()
