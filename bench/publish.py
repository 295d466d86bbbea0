"""What a benchmark leaves in bench/results/: <stem>.json (every figure), <stem>.md (the tables the README quotes)
and <stem>.png (the plot), nothing else. Raw per-request data stays in the run's raw folder (git-ignored)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RAW = RESULTS / "raw"  # git-ignored: loadtest files, server logs, metrics


def publish(out: Path, stem: str, doc: dict[str, Any], markdown: str,
            plot: Callable[[Path], None] | None = None) -> list[Path]:
    """Write out/stem.{json,md} and, with `plot`, out/stem.png; the paths written. Without matplotlib the plot is
    left out with a note (the figures are all in the JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(markdown)
    if plot is not None:
        try:
            plot(out / f"{stem}.png")
            paths.append(out / f"{stem}.png")
        except ImportError as e:
            print(f"no plot ({e}): pip install matplotlib")
    return paths


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (no display), imported only by the reports that plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
