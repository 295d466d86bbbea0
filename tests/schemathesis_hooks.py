"""Schemathesis hooks for tests/test_reliability_fuzz.py (loaded through SCHEMATHESIS_HOOKS): with
PARLEY_FUZZ_STREAM=1 every JSON object body, in every phase, asks for a stream just before it is sent, so that the
SSE path is fuzzed as hard as the JSON one."""

from __future__ import annotations

import os
from typing import Any

import schemathesis


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if os.environ.get("PARLEY_FUZZ_STREAM") == "1" and isinstance(case.body, dict):
        case.body["stream"] = True
        case.body["stream_options"] = {"include_usage": True}
