"""Compile the megakernel for the H100 (sm_90) on a machine with no GPU, and say what the compiler made of it.

    python -m bench sm90-compile [--model llama-3.2-1b] [--batch 1] [--weights bf16|fp8|int8] [--variant NAME]
                                 [--dump DIR]

Triton compiles for a named target without a device, and its bundled ptxas and cuobjdump report registers, spills
and shared memory; the PTX says which load instructions the weight streams became (cp.async, bulk tensor copies)
and how deep they are pipelined. A GPU call costs minutes of a budget; a compile error or a spill costs nothing here.
The arguments are the ones Megakernel.step passes, captured from a step built on the CPU with tiny layer counts
(shapes, not sizes, decide the code).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.megakernel import KernelConfig


def capture_launch(model: str, batch: int, weights: str, variant: str,
                   kernel_config: KernelConfig | None = None) -> list[tuple]:
    """The (kernel, args, kwargs) of each launch Megakernel.step would make for this model and batch bucket (two where
    the LM head has a launch of its own), under the bench variant's KernelConfig or the one given."""
    from bench.variants import VARIANTS
    from kernels import megakernel as mk
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    config, w, _ = load_synthetic(model, dtype=torch.bfloat16, num_layers=2)
    cfg = VARIANTS[variant](weights) if kernel_config is None else kernel_config
    captured: list[tuple] = []

    class Launcher:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def __getitem__(self, grid: object):  # noqa: ANN204
            def launch(*args: object, **kwargs: object) -> None:
                captured.append((self.fn, args, kwargs))
            return launch

    real = mk.megakernel
    mk.megakernel = Launcher(real)
    try:
        dec = MegakernelDecoder(config, w, max_slots=batch, max_context=256, device="cpu", kernel_config=cfg,
                                use_cuda_graphs=False, weight_format=weights, num_programs=132, max_rows=batch,
                                max_batch=min(batch, 16))
        dec.kernel.fill_blocks(dec.bucket(batch))
        dec.kernel.step(dec.bucket(batch), dec.kernel.block_queries > 0)
    finally:
        mk.megakernel = real
    return captured


def compile_sm90(fn, args: tuple, kwargs: dict):  # noqa: ANN001, ANN201
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    names = fn.arg_names
    sig, constexprs, attrs = {}, {}, {}
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_cooperative_grid", None)
    values = dict(zip(names, args)) | kwargs
    def aligned(path: tuple[int, ...], v: object) -> None:  # what the launcher specialises on real, 16-byte
        if isinstance(v, torch.Tensor):                       # aligned tensors, in tuples too
            attrs[path] = [["tt.divisibility", 16]]
        elif isinstance(v, tuple):
            for j, x in enumerate(v):
                aligned((*path, j), x)

    for i, name in enumerate(names):
        v = values[name]
        if fn.params[i].is_constexpr:
            sig[name], constexprs[(i,)] = "constexpr", v
        else:
            sig[name] = mangle_type(v)  # NamedTuples keep their fields; None fields are constexprs
            aligned((i,), v)
    src = ASTSource(fn=fn, signature=sig, constexprs={names[k[0]]: v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def spills_by_line(bin_dir: Path, cubin: Path, top: int = 6) -> dict[str, int]:
    """Local-memory loads and stores (register spills) in the SASS, counted by the source line they carry: whether
    they sit in a stream's hot loop or at the task loop's head (once a task)."""
    sass = subprocess.run([str(bin_dir / "nvdisasm"), "-gi", str(cubin)], capture_output=True, text=True).stdout
    where, counts = "?", Counter()
    for line in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif re.search(r"\b(?:STL|LDL)\b", line):
            counts[where] += 1
    return dict(counts.most_common(top))


def split_streams(ttgir: str) -> list[int]:
    """The asynchronous copies (cp.async: Triton's pipelined loads) of each called matvec whose tiles split K (a
    function of its own that arrives on a tile's counter, acq_rel): none where its stream's loop is not pipelined."""
    funcs = re.split(r"\n(?=\s*tt\.func )", ttgir)
    return [f.count("async_copy_global_to_local") for f in funcs
            if "matvec_call" in f.split("(", 1)[0] and "atomic_rmw add, acq_rel" in f]


def report(compiled, dump: Path | None) -> dict:  # noqa: ANN001
    import triton

    ptx = compiled.asm["ptx"]
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp/parley-megakernel.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    out = {"registers": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4))} if m else {}
    out["shared"] = compiled.metadata.shared
    for what, pat in (("cp.async", r"cp\.async\.(?:cg|ca)\.shared\.global"),
                      ("cp.async.bulk.tensor", r"cp\.async\.bulk\.tensor"),
                      ("cp.async.wait_group", r"cp\.async\.wait_group"),
                      ("mbarrier.try_wait", r"mbarrier\.try_wait"),
                      ("ld.global (plain)", r"\bld\.global\.(?!nc)"), ("mma", r"\bmma\.sync"),
                      ("wgmma", r"wgmma\.mma_async"), ("cvt from e4m3", r"cvt\.[^;]*e4m3"),
                      # int8 → float16 by bits (_int8_f16): an integer and a float16 add per pair; cvt from s8 would
                      # be a float conversion per element
                      ("int8 pairs (add.s16x2)", r"add\.s16x2"),
                      ("cvt to f16 from s8/s16", r"cvt\.rn\.f16\.s(?:8|16)")):
        out[what] = len(re.findall(pat, ptx))
    out["split streams' async copies"] = split_streams(compiled.asm["ttgir"])
    out["spills by line"] = spills_by_line(bin_dir, cubin)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for k in ("ttgir", "ptx"):
            (dump / f"megakernel.{k}").write_text(compiled.asm[k])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args()
    launches = capture_launch(a.model, a.batch, a.weights, a.variant)
    for i, (fn, args, kwargs) in enumerate(launches):
        compiled = compile_sm90(fn, args, dict(kwargs))
        dump = a.dump / f"part{i}" if a.dump is not None and len(launches) > 1 else a.dump
        part = f" launch {i + 1}/{len(launches)}" if len(launches) > 1 else ""
        print(a.model, f"B={a.batch}", a.weights, a.variant + part, report(compiled, dump))


if __name__ == "__main__":
    main()
