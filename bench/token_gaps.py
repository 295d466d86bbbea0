"""A single stream's inter-token gaps taken apart, from the loadtest's token arrival times (#37: inter-token p99 within
1.1x the step).

On the H100 (bench/NOTES.md, s87) the tail of one stream's gaps had three sources, each its own figure here:
- the **last gap**: a finished request's last token came ~0.1 ms after the others' cadence (its end's bookkeeping ran
  before it was sent);
- **transient** delays: a long gap followed by a short one (the token was late, the next one on time): the way from
  the engine to the client, not the step;
- **held-back** tokens: a chunk that carries two tokens (the front end holds a token whose text is not yet whole UTF-8
  and sends it with the next), one long gap and no short one.
A long gap followed by a normal one in a stream with all its chunks is a **late step** (the stream fell behind).
"""

from __future__ import annotations

from typing import Any

from loadtest.stats import describe

LONG = 1.1  # a gap over this x the median is long (#37's bound)
SHORT = 0.9  # ...and the next one under this x the median makes it transient


def of_requests(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The gaps of streams that came whole (outcome ok): p50 / p99 of all, p99 without each stream's last gap, the
    last gap's p50, and the long gaps by kind (transient, held back, late step)."""
    gaps: list[float] = []
    inner: list[float] = []
    last: list[float] = []
    streams = held_back = 0
    per_stream: list[tuple[list[float], bool]] = []
    for r in requests:
        times = [t * 1000.0 for t in r.get("token_times_s") or []]
        if r.get("outcome") != "ok" or len(times) < 3:
            continue
        g = [b - a for a, b in zip(times, times[1:])]
        whole = len(times) >= (r.get("output_tokens") or len(times))
        streams += 1
        held_back += not whole
        gaps += g
        inner += g[:-1]
        last.append(g[-1])
        per_stream.append((g, whole))
    # the loadtest's own percentiles: this table's p50 / p99 are the report's inter-token ones
    all_, without_last = describe(gaps), describe(inner)
    median = all_["p50"]
    out: dict[str, Any] = {
        "streams": streams, "gaps": len(gaps), "gap_ms_p50": median, "gap_ms_p99": all_["p99"],
        "gap_ms_p99_without_last": without_last["p99"], "last_gap_ms_p50": describe(last)["p50"],
        "streams_with_held_back_tokens": held_back, "long_transient": 0, "long_held_back": 0, "long_late_step": 0}
    if median is None:
        return out
    for g, whole in per_stream:
        for i, gap in enumerate(g[:-1]):  # the last gap is its own figure
            if gap <= LONG * median:
                continue
            if g[i + 1] < SHORT * median:
                out["long_transient"] += 1
            elif not whole and gap > 1.5 * median:
                out["long_held_back"] += 1
            else:
                out["long_late_step"] += 1
    return out
