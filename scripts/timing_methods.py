"""Time kernels by each of the bench's methods, in alternating rounds, to see where the methods disagree.

    python scripts/timing_methods.py --rounds 3 store:sm90_d256_fp8_e4m3_full_s4096_g1_bt16384_hdt2048@4096 ...

Per kernel and round, TFLOP/s by: "alone" (bench.time_cuda: a GPU sleep of 300 us queued ahead of each timed call,
the bench's and the tuner's kernel-alone figure), "alone-50us" (the same with a 50 us sleep), "flushed" (alone, with
256 MB written before each call so that nothing of the previous call stays in L2), "default" (bench.time_cuda as
the bench and the tuner call it: twice L2 written before each call), "b2b" (calls back to
back, CUDA events around loops of 50: what compare.back_to_back_ms reports), each through the loaded Kernel (outputs
allocated per call, as the bench calls it) and through kernels.dense.run into preallocated outputs (as the tuner does).
The bench and the tuner disagree by up to 10% on the same kernel; this says whether the method or the moment does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import flops, median_ms, time_cuda  # noqa: E402
from flashgen.compare import back_to_back_ms  # noqa: E402

from time_configs import parse  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="kernel names or store:KEY, each with @SEQLEN")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    import flashgen
    from flashgen.fp8 import quantize
    from flashgen.kernels.dense import run
    from flashgen.tensors import torch_dtype
    from flashgen.verify import random_qkv

    points = []
    for arg in args.names:
        name, _, n = arg.partition("@")
        cfg, n = parse(name), int(n or 4096)
        b, h = max(1, 16384 // n), max(1, 2048 // cfg.head_dim)
        kern = flashgen.load(cfg.head_dim, cfg.dtype, cfg.causal, config=cfg)
        q, k, v = random_qkv(b, n, n, h, h, cfg.head_dim, "bf16" if cfg.fp8 else cfg.dtype)
        q, k, v, desc = quantize(q, k, v) if cfg.fp8 else (q, k, v, {})
        out = torch.empty(q.shape, dtype=torch_dtype(cfg.output_dtype), device=q.device)
        fl = flops(b, h, n, n, cfg.head_dim, cfg.causal)
        calls = {"Kernel()": lambda i, kern=kern, q=q, k=k, v=v, desc=desc: kern(q, k, v, **desc),
                 "run(out=)": lambda i, kern=kern, q=q, k=k, v=v, desc=desc, out=out:
                     run(kern.compiled, q, k, v, out=out, descale=desc or None)}
        points.append((f"{kern.name} N={n}", fl, calls))
    scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # written before each "flushed" call
    print(f"{'kernel':72} {'call':10} {'round':>5} {'alone':>7} {'alone-50us':>10} {'flushed':>7} {'default':>7} "
          f"{'b2b':>7}  TFLOP/s")
    for r in range(args.rounds):
        for label, fl, calls in points:
            for how, fn in calls.items():
                alone = median_ms(time_cuda(fn, 10, 50, flush_l2=False))
                short = median_ms(time_cuda(fn, 10, 50, queue_ahead_us=50.0, flush_l2=False))
                flush = median_ms(time_cuda(fn, 10, 50, before=scratch.zero_, flush_l2=False))
                default = median_ms(time_cuda(fn, 10, 50))  # what the bench and the tuner use: 2x L2 flushed
                b2b = back_to_back_ms(fn, 50)
                tf = [fl / (ms * 1e-3) / 1e12 for ms in (alone, short, flush, default, b2b)]
                print(f"{label:72} {how:10} {r:5d} {tf[0]:7.1f} {tf[1]:10.1f} {tf[2]:7.1f} {tf[3]:7.1f} {tf[4]:7.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
