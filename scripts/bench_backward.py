"""Backward speed: flashgen's backward kernels against SDPA's flash and cuDNN backward, same inputs.

    python scripts/bench_backward.py [--head-dim 64,128,256] [--seqlen 1024,4096,16384] [--dtype bf16] [--out FILE.json]

For each point (batch = 16384 // seqlen, heads = 2048 // head_dim, causal and not): one forward with
grad, then torch.autograd.grad of the output timed alone (CUDA-event medians, GPU kept busy ahead
of each call, as `cli.py bench` times kernels). TFLOP/s count 2.5 x the forward's 4*B*H*N*N*D
(halved for causal). Prints a table; --out also writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashgen  # noqa: E402
from flashgen.bench import flops, median_ms, time_cuda  # noqa: E402
from flashgen.verify import random_qkv  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def time_backward(forward, inputs, dout) -> float:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = forward(*leaves)
    return median_ms(time_cuda(lambda i: torch.autograd.grad(out, leaves, dout, retain_graph=True), reps=30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--seqlen", default="1024,4096,16384")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, {datetime.date.today()}: backward TFLOP/s (2.5 x forward FLOPs)")
    print(f"{'d':>4} {'mask':<6} {'N':>6} {'flashgen':>9} {'flash':>9} {'cudnn':>9} {'x flash':>8} {'x cudnn':>8}")
    for d in (int(x) for x in args.head_dim.split(",")):
        for n in (int(x) for x in args.seqlen.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // n), max(1, 2048 // d)
                q, k, v = random_qkv(b, n, n, h, h, d, args.dtype, seed=0)
                dout = torch.randn_like(q)
                tf = 2.5 * flops(b, h, n, n, d, causal) / 1e12
                res = {"flashgen": tf / (time_backward(lambda q, k, v: flashgen.attention(q, k, v, causal=causal),
                                                       (q, k, v), dout) * 1e-3)}
                for name, be in BACKENDS.items():
                    try:
                        with sdpa_kernel(be):
                            ms = time_backward(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal).transpose(1, 2), [t.transpose(1, 2) for t in (q, k, v)], dout)
                        res[name] = tf / (ms * 1e-3)
                    except RuntimeError as e:
                        res[name] = None
                        print(f"  {name}: {str(e).splitlines()[0][:120]}")
                rows.append({"head_dim": d, "seqlen": n, "causal": causal, "batch": b, "heads": h, **res})
                f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
                r = lambda p: "-" if not res.get(p) else f"{res['flashgen'] / res[p]:.2f}"  # noqa: E731
                print(f"{d:>4} {'causal' if causal else 'full':<6} {n:>6} {f(res['flashgen']):>9} {f(res['flash']):>9} "
                      f"{f(res['cudnn']):>9} {r('flash'):>8} {r('cudnn'):>8}", flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                                              "dtype": args.dtype, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
