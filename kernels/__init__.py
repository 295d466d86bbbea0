"""Triton kernels: the decode-step megakernel (megakernel.py, its schedule in instructions.py) and the in-kernel
sampling (sampling.py). Nothing here imports the service."""

from __future__ import annotations

import os


def _interpreter_numpy2_shim() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array, which numpy ≥ 2.4
    refuses (a loop bound loaded from memory then fails). Patch that one conversion, for the interpreter only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_parley_shim", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._parley_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpreter_numpy2_shim()
