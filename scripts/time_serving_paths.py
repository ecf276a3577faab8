"""Kernel alone against the public call for a sliding-window or packed problem, on a GPU.

    python scripts/time_serving_paths.py [--kind window|varlen] [--n 16384] [--window 1024] [--head-dim 128]

Prints which kernel the public call takes (flashgen.resolve.prefill_config), its device time launched
directly (serving.launch_prefill, no LSE), the public call's device time (bench.time_cuda: the GPU kept
busy ahead, so host cost is hidden while it stays under the queue-ahead time; shown at two queue-ahead
times) and back to back (host cost included), and the host time per call. A gap between the first two
figures is the public path's doing (another kernel, LSE, host time past the queue-ahead).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("window", "varlen"), default="window")
    ap.add_argument("--n", type=int, default=16384, help="window: the sequence length")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    import torch

    import flashgen
    from flashgen import resolve
    from flashgen.kernels import serving
    from flashgen.bench import median_ms, time_cuda
    from flashgen.bench_serving import _causal_flops, lengths
    from flashgen.compare import back_to_back_ms

    d, h = args.head_dim, 2048 // args.head_dim
    if args.kind == "window":
        lens, win = [args.n], args.window
    else:
        lens, win = lengths(64, 64, 8192, 0), -1
    cu = [0, *itertools.accumulate(lens)]
    q, k, v = (torch.randn(cu[-1], h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = sum(_causal_flops(n, n, d, h, win) for n in lens)
    mods = serving.Mods(window=(win, -1))
    if args.kind == "window":
        qd, kd, vd = (t.unsqueeze(0) for t in (q, k, v))
        public = lambda i: flashgen.attention(qd, kd, vd, causal=True, window_size=(win, 0))  # noqa: E731
        cfg = resolve.prefill_config(0, d, "bf16", True, args.n, args.n, serving.call_features(mods, True), win)
        out = torch.empty_like(qd)
        direct = lambda i: serving.launch_prefill(cfg, qd, kd, vd, out, None, cu_q=None, cu_k=None,  # noqa: E731
                                                  max_seqlen_q=args.n, max_seqlen_k=args.n, num_splits=1, mods=mods,
                                                  softmax_scale=None)
    else:
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        n = max(lens)
        public = lambda i: flashgen.attention_varlen(q, k, v, cu_t, cu_t, n, n, causal=True,  # noqa: E731
                                                     validate=False)
        cfg = resolve.prefill_config(0, d, "bf16", True, n, n, {"varlen": True}, -1)
        out = torch.empty_like(q)
        direct = lambda i: serving.launch_prefill(cfg, q, k, v, out, None, cu_q=cu_t, cu_k=cu_t,  # noqa: E731
                                                  max_seqlen_q=n, max_seqlen_k=n, num_splits=1, mods=mods,
                                                  softmax_scale=None)
    rows = [("kernel alone (launch_prefill)", median_ms(time_cuda(direct, warmup=5, reps=50))),
            ("public call, queue ahead 300 us", median_ms(time_cuda(public, warmup=5, reps=50))),
            ("public call, queue ahead 3000 us", median_ms(time_cuda(public, warmup=5, reps=50, queue_ahead_us=3000))),
            ("public call back to back", back_to_back_ms(public, calls=20))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(50):
        public(i)
    host_us = (time.perf_counter() - t0) / 50 * 1e6  # issue time: the queue absorbs it while the GPU is busier
    torch.cuda.synchronize()
    print(f"{args.kind} d{d} {'N=%d window %d' % (args.n, win) if args.kind == 'window' else '64 packed seqs'}: "
          f"kernel {cfg.name}; host issue {host_us:.0f} us per public call")
    for name, ms in rows:
        print(f"  {name:34s} {ms * 1e3:8.1f} us  {flops / (ms * 1e-3) / 1e12:6.0f} TFLOP/s useful")


if __name__ == "__main__":
    main()
