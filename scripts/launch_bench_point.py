"""Launch the kernel load() picks for one bench point (bf16) three times, for a profiler (ncu, nsys) to catch.

    python scripts/launch_bench_point.py FAMILY HEAD_DIM SEQLEN CAUSAL(0|1)   (batch*seqlen = 16384, heads*head_dim = 2048)
"""
import sys

import torch

import flashgen
from flashgen.verify import random_qkv

arch, d, n, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
q, k, v = random_qkv(16384 // n, n, n, 2048 // d, 2048 // d, d, "bf16")
kern = flashgen.load(d, "bf16", causal, seqlen=n, arch=arch)
for _ in range(3):
    kern(q, k, v)
torch.cuda.synchronize()
