"""Where a backward call's GPU time goes, kernel by kernel: `torch.autograd.grad` through `flashgen.attention`
under the torch profiler, each kernel's mean time per call (the sm90 family's _pre, main and _convert kernels;
anything else as "other"), at each grid point (bf16, batch x N = 16384, heads x head_dim = 2048).

    python scripts/time_bwd_parts.py [--head-dim 64,128,256] [--seqlen 1024,4096] [--calls 10]

Prints one row per point: microseconds per kernel, their sum, and the share of the row kernels (_pre and _convert).
Run a base checkout's copy beside it (PYTHONPATH=.ab-base) for a before-and-after.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def role(name: str) -> str:
    if name.endswith("_pre"):
        return "pre"
    if name.endswith("_convert"):
        return "convert"
    return "main" if name.startswith("bwd_") else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--seqlen", default="1024,4096")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    import flashgen  # noqa: PLC0415

    print(f"{torch.cuda.get_device_name()}: us per backward call, bf16, kernels under the torch profiler")
    print("d    N      mask    pre_us  main_us  conv_us  other_us  total_us  pre+convert")
    for d in (int(x) for x in args.head_dim.split(",")):
        for n in (int(x) for x in args.seqlen.split(",")):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                out = flashgen.attention(q, k, v, causal=causal)
                dout = torch.randn_like(out)
                for _ in range(3):
                    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    torch.cuda.synchronize()
                parts = dict.fromkeys(("pre", "main", "convert", "other"), 0.0)
                for e in prof.key_averages():
                    if e.self_device_time_total > 0:
                        parts[role(e.key)] += e.self_device_time_total / args.calls
                total = sum(parts.values())
                rows = parts["pre"] + parts["convert"]
                print(f"{d:<4} {n:<6} {'causal' if causal else 'full':7} {parts['pre']:7.1f} {parts['main']:8.1f} "
                      f"{parts['convert']:8.1f} {parts['other']:9.1f} {total:9.1f}  {100 * rows / total:5.1f}%",
                      flush=True)


if __name__ == "__main__":
    main()
