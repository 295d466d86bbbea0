"""`parley serve`: its flags, their PARLEY_<NAME> variables, defaults and help are service/config.py's ServeConfig.

    parley serve                               # the embedded SmolLM2-135M-Instruct, on the CPU or the GPU
    parley serve --model /models/Llama-3.2-1B-Instruct --backend megakernel --max-batch 16
    python -m service.cli serve --port 8001
"""

from __future__ import annotations

import argparse
import logging
import sys

from service.config import ServeConfig, add_serve_arguments


def parse(argv: list[str] | None = None) -> ServeConfig:
    """The command line (and the PARLEY_* variables) as the ServeConfig to serve with; --help and bad input exit."""
    parser = argparse.ArgumentParser(prog="parley", description="Parley: real-time voice-agent LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API and the realtime WebSocket",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /v1/realtime, /health and /metrics. "
                    "Each flag is also a PARLEY_<NAME> variable (e.g. PARLEY_MAX_BATCH=16); a flag wins.")
    config_of = add_serve_arguments(serve_parser)
    return config_of(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.api.server import serve  # torch and the model stack load only when serving

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
