"""The machine a benchmark ran on, as every report states it: the accelerator's name ("cpu" without one), the versions
of Python, torch, Triton and llguidance, and Parley's commit.

    python -m bench.device [PATH]     # the JSON on stdout, or into PATH

A benchmark that starts servers asks in a child process (this module run as a script), so that it holds no CUDA
context of its own beside the server's."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except (ImportError, AttributeError):
        return None


def commit() -> str | None:
    """Parley's commit (short), with "+" when the working tree differs from it; None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+" if dirty else "")


def describe(device: str | None = None) -> dict[str, str | None]:
    """{device, python, torch, triton, llguidance, parley}. `device` "cpu" names the CPU even where a GPU is."""
    try:
        import torch

        name = "cpu" if device == "cpu" or not torch.cuda.is_available() else torch.cuda.get_device_name()
    except ImportError:  # a client box measuring a server elsewhere
        name = "cpu"
    return {"device": name, "python": platform.python_version(), "torch": _version("torch"),
            "triton": _version("triton"), "llguidance": _version("llguidance"), "parley": commit()}


def cpu_name(short: bool = False) -> str:
    """The host CPU's model name ("AMD EPYC 7B13"; `short`: without its clock, for file names), for the benchmarks that
    measure the host's Python rather than the device."""
    name = platform.processor() or "cpu"
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return name.split("@")[0].strip() if short else name


def file_stem(name: str, device: str) -> str:
    """`<name>-<device>`, in the characters a file name anywhere accepts: "e2e-NVIDIA-H100-80GB-HBM3"."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "-" for c in f"{name}-{device}")


if __name__ == "__main__":
    text = json.dumps(describe(), indent=1)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    else:
        print(text)
