"""Temporary: a few plain launches of the megakernel for Nsight Compute."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.backends.megakernel import MegakernelDecoder  # noqa: E402
from service.model.synthetic import load_synthetic  # noqa: E402

config, weights, _ = load_synthetic(sys.argv[1], device="cuda", dtype=torch.bfloat16)
mk = MegakernelDecoder(config, weights, max_slots=8, max_context=4096, use_cuda_graphs=False)
b = int(sys.argv[2])
k = mk.kernel
k.tokens[:b] = 1
k.slots[:b] = torch.arange(b, device="cuda", dtype=torch.int32)
k.positions[:b] = 128
for _ in range(3):
    k.step(b)
torch.cuda.synchronize()
print("ok")
