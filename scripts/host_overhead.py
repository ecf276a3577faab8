"""Host time per flashgen call (Python, ctypes, tensor maps), measured while the GPU is kept busy."""
import time

import torch

import flashgen
from flashgen.verify import random_qkv

for arch in ("sm80", "sm90"):
    q, k, v = random_qkv(1, 1024, 1024, 8, 8, 128, "bf16")
    kern = flashgen.load(128, "bf16", False, seqlen=1024, arch=arch)
    for _ in range(5):
        kern(q, k, v)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # keep the GPU busy so launches never wait on it
    t = time.perf_counter()
    for _ in range(200):
        kern(q, k, v)
    host_us = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"{kern.name}: {host_us:.1f} us of host time per call")
