"""`parley serve`: every flag is also a PARLEY_<NAME> environment variable (a flag wins over the variable).

    parley serve                               # the embedded SmolLM2-135M-Instruct, on the CPU or the GPU
    parley serve --model /models/Llama-3.2-1B-Instruct --backend megakernel --max-batch 16
    python -m service.cli serve --port 8001
"""

from __future__ import annotations

import argparse
import logging
import sys

from service.config import ServeConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="Parley: real-time voice-agent LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API and the realtime WebSocket",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /v1/realtime, "
                                   "/health and /metrics. Each flag is also a PARLEY_<NAME> variable "
                                   "(e.g. PARLEY_MAX_BATCH=16).")
    d = ServeConfig()
    s.add_argument("--model", help=f"'{d.model}' (embedded, the default), a .gguf file, a Hugging Face "
                                   "checkpoint directory, or synthetic:<shape> [PARLEY_MODEL]")
    s.add_argument("--host", help=f"address to listen on (default {d.host}) [PARLEY_HOST]")
    s.add_argument("--port", type=int, help=f"port (default {d.port}) [PARLEY_PORT]")
    s.add_argument("--backend", choices=("auto", "reference", "megakernel"),
                   help="auto: the megakernel where a GPU can run it, else the PyTorch reference [PARLEY_BACKEND]")
    s.add_argument("--device", help="cuda | cpu (default: cuda when present) [PARLEY_DEVICE]")
    s.add_argument("--max-batch", type=int, help=f"KV slots, requests decoded together (default {d.max_batch}) "
                                                 "[PARLEY_MAX_BATCH]")
    s.add_argument("--max-context", type=int, help=f"tokens per slot, prompt + output (default {d.max_context}) "
                                                   "[PARLEY_MAX_CONTEXT]")
    s.add_argument("--sla-ms", type=float, help=f"deadline for the SLA token (default {d.sla_ms:g}) [PARLEY_SLA_MS]")
    s.add_argument("--sla-tokens", type=int, help=f"which token the SLA is about (default {d.sla_tokens}) "
                                                  "[PARLEY_SLA_TOKENS]")
    s.add_argument("--strict-sla", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse what cannot meet the SLA even where no request could (a CPU) [PARLEY_STRICT_SLA]")
    s.add_argument("--sla-margin", type=float, help=f"admission stretches its predictions by this share, more "
                                                    f"while tokens come late (default {d.sla_margin:g}) "
                                                    "[PARLEY_SLA_MARGIN]")
    s.add_argument("--max-waiting", type=int, help=f"admitted requests that may wait for a slot (default "
                                                   f"{d.max_waiting}) [PARLEY_MAX_WAITING]")
    s.add_argument("--gpu-hourly-usd", type=float, help="this replica's GPU price per hour, for the cost panels "
                                                        "[PARLEY_GPU_HOURLY_USD]")
    s.add_argument("--drain-timeout-s", type=float, help=f"on SIGTERM, how long in-flight requests may take "
                                                         f"(default {d.drain_timeout_s:g}) [PARLEY_DRAIN_TIMEOUT_S]")
    s.add_argument("--wedge-timeout-s", type=float, help=f"a step hung this long turns /health 503 so that an "
                                                         f"orchestrator restarts the server (default "
                                                         f"{d.wedge_timeout_s:g}) [PARLEY_WEDGE_TIMEOUT_S]")
    s.add_argument("--step-delay-ms", type=float, help="testing: slow every decode step down by this much "
                                                       "[PARLEY_STEP_DELAY_MS]")
    s.add_argument("--fail-step", type=int, help="testing: the decode step (1-based) that raises, once "
                                                 "[PARLEY_FAIL_STEP]")
    s.add_argument("--hang-step", type=int, help="testing: the decode step (1-based) that hangs (wedges the engine) "
                                                 "[PARLEY_HANG_STEP]")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    names = ("model", "host", "port", "backend", "device", "max_batch", "max_context", "sla_ms", "sla_tokens",
             "strict_sla", "sla_margin", "max_waiting", "gpu_hourly_usd", "drain_timeout_s", "wedge_timeout_s",
             "step_delay_ms", "fail_step", "hang_step")
    return ServeConfig.from_env(**{n: getattr(args, n) for n in names})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from service.api.server import serve  # torch and the model stack load only when serving

        return serve(config_from_args(args), log_level=args.log_level, access_log=args.access_log)
    return 2


if __name__ == "__main__":
    sys.exit(main())
