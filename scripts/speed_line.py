"""One line of speed on the GPU: the default sm80-family config against PyTorch SDPA backends.

python scripts/speed_line.py [--head-dim 128] [--seqlen 4096] [--dtype bf16]
Same inputs for every kernel; CUDA-event medians after warm-up; inputs rotated past L2.
"""
from __future__ import annotations

import argparse
import datetime

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.bench import flops, l2_rotation, median_ms, time_cuda
from flashgen.verify import random_qkv

ap = argparse.ArgumentParser()
ap.add_argument("--head-dim", type=int, nargs="+", default=[128])
ap.add_argument("--seqlen", type=int, nargs="+", default=[4096])
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--tokens", type=int, default=16384)
args = ap.parse_args()

print(f"# {torch.cuda.get_device_name()} {datetime.date.today()} torch {torch.__version__}")
print(f"{'d':>4} {'N':>6} {'causal':>6} {'config':<44} {'flashgen':>9} {'sdpa-flash':>10} {'sdpa-cudnn':>10} {'x flash':>8} {'x cudnn':>8}")
for d in args.head_dim:
    for n in args.seqlen:
        b, h = max(1, args.tokens // n), 2048 // d
        set_bytes = 2 * 4 * b * n * h * d
        sets = [random_qkv(b, n, n, h, h, d, args.dtype, seed=i) for i in range(l2_rotation(set_bytes))]
        tsets = [tuple(t.transpose(1, 2) for t in s) for s in sets]  # SDPA wants (b, h, n, d)
        for causal in (False, True):
            kern = flashgen.load(d, args.dtype, causal)
            f = flops(b, h, n, n, d, causal) / 1e12
            res = {"flashgen": median_ms(time_cuda(lambda i: kern(*sets[i]), rotate=len(sets)))}
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        res[name] = median_ms(time_cuda(
                            lambda i: torch.nn.functional.scaled_dot_product_attention(*tsets[i], is_causal=causal),
                            rotate=len(sets)))
                except RuntimeError:
                    res[name] = float("nan")
            tf = {k: f / (v / 1e3) for k, v in res.items()}
            print(f"{d:>4} {n:>6} {str(causal):>6} {kern.name:<44} {tf['flashgen']:>9.1f} {tf['flash']:>10.1f} "
                  f"{tf['cudnn']:>10.1f} {tf['flashgen'] / tf['flash']:>8.2f} {tf['flashgen'] / tf['cudnn']:>8.2f}")
