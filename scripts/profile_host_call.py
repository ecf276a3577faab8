"""Where the host time of one flashgen call goes: cProfile over many back-to-back calls on a GPU.

    python scripts/profile_host_call.py [--kind kvcache|varlen|dense|mask_mod] [--grad] [--calls 500] [--top 25]

mask_mod: flashgen.attention with bench --kind flex's document mask (a captured tensor read per score, a block map)
on 256 tokens, where the host's work is all there is to time. --grad: q requires grad (dense and mask_mod), so the
forward goes through autograd as in training (the graph is dropped after each call).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("kvcache", "varlen", "dense", "mask_mod"), default="kvcache")
    ap.add_argument("--grad", action="store_true", help="q requires grad (dense, mask_mod)")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import torch

    import flashgen
    from flashgen import bench_flex

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    qv, kv = q[0].expand(64, 32, 128).contiguous(), kc[0, :64].contiguous()
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    qd = q.expand(1, 256, 32, 128).contiguous().requires_grad_(args.grad)
    document = bench_flex.cases(256, 1, 32, qd.device, names=("document",))[0].mask_mod
    call = {
        "kvcache": lambda: flashgen.attention_with_kvcache(q, kc, kc, cache_seqlens=lens, validate=False),
        "varlen": lambda: flashgen.attention_varlen(qv, kv, kv, cu, cu, 64, 64, validate=False),
        "dense": lambda: flashgen.attention(qd[:, :64], kc[:, :64], kc[:, :64]),
        "mask_mod": lambda: flashgen.attention(qd, kc[:, :256], kc[:, :256], mask_mod=document),
    }[args.kind]
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    grad = " (q requires grad)" if args.grad else ""
    print(f"{args.kind}{grad}: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us per call (wall, back to back)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
