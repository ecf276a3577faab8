"""Launch the kernel load() picks for one bench point three times, for a profiler (ncu, nsys) to catch.

    python scripts/launch_bench_point.py FAMILY HEAD_DIM SEQLEN CAUSAL(0|1) [DTYPE] [PASS]   (batch*seqlen = 16384,
    heads*head_dim = 2048; DTYPE bf16 (default), fp16 or fp8_e4m3: bf16 inputs quantized per tensor; PASS fwd
    (default) or bwd: the backward autograd would run, the GPU's tuned one, after one forward)
    python scripts/launch_bench_point.py KERNEL_NAME SEQLEN      (a forward kernel by name, as time_configs.py reads it)
"""
import sys
from pathlib import Path

import torch

import flashgen
from flashgen.compile import compile_kernel, target_for
from flashgen.fp8 import quantize
from flashgen.verify import random_qkv

if sys.argv[1].startswith("fwd_"):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from time_configs import parse  # noqa: E402

    cfg, n, pass_ = parse(sys.argv[1]), int(sys.argv[2]), "fwd"
    arch, d, causal, dtype = cfg.family, cfg.head_dim, cfg.causal, cfg.dtype
else:
    arch, d, n, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bf16"
    pass_ = sys.argv[6] if len(sys.argv) > 6 else "fwd"
    cfg = None
fp8 = dtype == "fp8_e4m3"
q, k, v = random_qkv(16384 // n, n, n, 2048 // d, 2048 // d, d, "bf16" if fp8 else dtype)
q, k, v, descale = quantize(q, k, v) if fp8 else (q, k, v, {})
kern = (flashgen.load(d, dtype, causal, seqlen=n, arch=arch) if cfg is None
        else flashgen.Kernel(compile_kernel(cfg, target_for("sm90", cfg.family))))
if pass_ == "bwd":
    from flashgen.kernels.backward import backward
    from flashgen.resolve import backward_kernel

    out, lse = kern(q, k, v, return_lse=True)
    dout, bwd = torch.randn_like(q), backward_kernel(q.get_device(), d, dtype, causal, n)
    for _ in range(3):
        backward(bwd, q, k, v, out, dout, lse)
else:
    for _ in range(3):
        kern(q, k, v, **descale)
torch.cuda.synchronize()
