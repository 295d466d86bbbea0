"""ServeConfig: every setting of `parley serve`, each a flag and a PARLEY_* environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields


@dataclass
class ServeConfig:
    model: str = "smollm2-135m-instruct"  # the embedded default; or synthetic:<shape>, a .gguf, an HF directory
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"  # auto | reference | megakernel
    device: str | None = None  # cuda | cpu; default: cuda when present
    max_batch: int = 8  # KV slots: requests decoded together
    max_context: int = 2048
    sla_ms: float = 100.0
    sla_tokens: int = 64
    strict_sla: bool = False  # refuse what cannot meet the SLA even when no request could (a CPU)
    sla_margin: float = 0.05  # admission stretches its predictions by this much (widened while tokens come late)
    max_waiting: int = 64
    gpu_hourly_usd: float = 0.0  # exported as parley_gpu_hourly_usd for the cost panels
    drain_timeout_s: float = 30.0
    wedge_timeout_s: float = 30.0  # a decode step or prefill hung this long turns /health 503 (restart me)
    step_delay_ms: float = 0.0  # testing: slow every decode step down on purpose
    fail_step: int = 0  # testing: the decode step number (1-based) that raises, once; 0 = never
    hang_step: int = 0  # testing: the decode step number (1-based) that hangs (for an hour); 0 = never

    @classmethod
    def from_env(cls, **overrides: object) -> ServeConfig:
        """Defaults, then PARLEY_<NAME> variables, then explicit overrides (flags)."""
        cfg = cls()
        for f in fields(cls):
            raw = os.environ.get(f"PARLEY_{f.name.upper()}")
            if raw is not None:
                setattr(cfg, f.name, _parse(raw, f.type))
        for k, v in overrides.items():
            if v is not None:
                setattr(cfg, k, v)
        return cfg


def _parse(raw: str, type_name: object) -> object:
    t = str(type_name)
    if t.startswith("bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if t.startswith("int"):
        return int(raw)
    if t.startswith("float"):
        return float(raw)
    return raw
