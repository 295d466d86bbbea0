"""Fuzz the OpenAPI schema Parley publishes with schemathesis (pinned: schemathesis==4.32.5, requirements-ci.txt)
against a live `parley serve` on loopback: every operation, valid and invalid data, checked for "no 5xx"
(not_a_server_error). Three passes: bodies as generated (valid and invalid), then every body forced to
`"stream": true` (tests/schemathesis_hooks.py), so that the SSE path is fuzzed as hard as the JSON one, then valid
bodies only, streaming, so that most requests get past validation into the engine. The schema carries the model's
limits (max_tokens below the context, token ids in the vocabulary) for the fuzzer to generate within.
Bounded: at most 50 examples per operation and phase, a fixed seed, a subprocess time limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_support import ROOT, Server, health_status, served, tiny_server, wait_idle

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")

SLOTS = 4
RUN_TIMEOUT_S = 240
MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # a lax SLA: more requests reach the engine
    yield from served(tiny_server(tmp_path_factory.mktemp("fuzz") / "parley.log", "--max-batch", str(SLOTS),
                                  "--max-context", "256", "--sla-ms", "600000"))


def test_the_schema_describes_the_request_bodies(fuzz_server: Server) -> None:
    schema = httpx.get(f"{fuzz_server.base}/openapi.json", timeout=30).json()
    components = schema["components"]["schemas"]
    for path, model, fields in (("/v1/completions", "CompletionRequest", {"prompt", "max_tokens", "temperature"}),
                                ("/v1/chat/completions", "ChatCompletionRequest", {"messages", "max_tokens"})):
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert fields <= set(components[model]["properties"])
        assert set(components[model]["required"]) == fields & {"prompt", "messages"}
        responses = op["responses"]
        assert "422" not in responses  # a bad body is a 400 in OpenAI's shape, as documented
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
        assert "text/event-stream" in responses["200"]["content"]
    props = components["CompletionRequest"]["properties"]
    assert props["temperature"]["maximum"] == 2 and props["temperature"]["minimum"] == 0
    assert {"/health", "/metrics", "/v1/models"} <= set(schema["paths"])


@pytest.mark.parametrize("mode,stream", [("all", False), ("all", True), ("positive", True)],
                         ids=["as-generated", "streaming", "valid-streaming"])
def test_fuzzing_never_gets_a_5xx(fuzz_server: Server, tmp_path: Path, mode: str, stream: bool) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PARLEY_FUZZ_STREAM": str(int(stream)),
           "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    cmd = [str(cli), "run", f"{fuzz_server.base}/openapi.json", "--checks", "not_a_server_error",
           "--mode", mode, "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--seed", "8",
           "--request-timeout", "60",
           "--generation-database", "none", "--suppress-health-check", "all", "--no-color",
           "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")]
    try:
        # cwd: schemathesis keeps a cache (.schemathesis/) where it runs; not in the repository
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"schemathesis ran past {RUN_TIMEOUT_S} s:\n{(e.stdout or b'')[-3000:]!r}")
    out = run.stdout + run.stderr
    summary = out[out.rfind("SUMMARY"):] if "SUMMARY" in out else out[-3000:]
    print(summary)
    assert run.returncode == 0, (f"schemathesis found failures:\n{out[-12000:]}\n"
                                 f"--- server log:\n{fuzz_server.log_tail(60)}")
    # every operation the schema publishes was fuzzed: none skipped or left out
    operations = [(path, method) for path, ops in httpx.get(f"{fuzz_server.base}/openapi.json", timeout=30)
                  .json()["paths"].items() for method in ops]
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post")} <= set(operations)
    selected, tested = re.search(r"Selected: (\d+)/(\d+)", out), re.search(r"Tested: (\d+)", out)
    assert selected and tested, out[-3000:]
    assert int(tested[1]) == int(selected[1]) == int(selected[2]) == len(operations), summary
    assert "Traceback" not in fuzz_server.log.read_text(errors="replace"), fuzz_server.log_tail(80)
    assert health_status(fuzz_server.base) == 200
    wait_idle(fuzz_server.base, timeout_s=60)
