"""What deterministic=True costs the backward on Hopper: the sm90 deterministic backward against the backward
autograd takes without it, the same tiles with dq_tma and no ordering, and the sm80 deterministic backward it
replaces, each verified first (the kernels alone, bench shapes: batch = 16384 // N, heads = 2048 // head_dim).

    python scripts/time_deterministic_bwd.py                      # d128, N 4096 and 16384, causal and not
    python scripts/time_deterministic_bwd.py --head-dim 64,128,256 --seqlen 1024,4096,16384

Prints one line per kernel and point: milliseconds, TFLOP/s (2.5x the forward's FLOPs) and the time relative to
the non-deterministic default.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import api  # noqa: E402
from flashgen.bench import flops, time_backward  # noqa: E402
from flashgen.config import BwdConfig, default_bwd_config  # noqa: E402
from flashgen.kernels.backward import load_backward  # noqa: E402
from flashgen.verify import verify_backward  # noqa: E402


def contenders(head_dim: int, dtype: str, causal: bool, arch: str) -> dict[str, BwdConfig]:
    """label -> configuration: the non-deterministic default first (the reference of the ratios)."""
    det = default_bwd_config(head_dim, dtype, causal, arch, deterministic=True)
    return {"default": default_bwd_config(head_dim, dtype, causal, arch),
            "dq_tma": dataclasses.replace(det, deterministic=False),
            "det sm90": det,
            "det sm80": default_bwd_config(head_dim, dtype, causal, arch, deterministic=True, family="sm80")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", default="128", help="comma-separated")
    ap.add_argument("--seqlen", default="4096,16384", help="comma-separated")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--gpu-arch", default="sm90")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    head_dims = [int(x) for x in args.head_dim.split(",")]
    seqlens = [int(x) for x in args.seqlen.split(",")]
    print(f"{'kernel':<64} {'d':>4} {'N':>6} {'mask':<6} {'ms':>8} {'TFLOP/s':>8} {'x default':>9}")
    for d, causal, n in itertools.product(head_dims, (False, True), seqlens):
        batch, heads = max(1, 16384 // n), max(1, 2048 // d)
        fwd = api.load(d, args.dtype, causal, seqlen=n, arch="sm80").compiled
        base_ms = None
        for label, cfg in contenders(d, args.dtype, causal, args.gpu_arch).items():
            kern = load_backward(d, args.dtype, causal, cfg, args.gpu_arch)
            check = verify_backward(kern, fwd, 1, min(n, 1024), min(n, 1024), heads)
            if check.failures:
                print(f"{cfg.name:<64} {d:>4} {n:>6} {'causal' if causal else 'full':<6} fails verification: "
                      f"{'; '.join(check.failures)}")
                continue
            ms = time_backward(kern, fwd, batch, n, n, heads, reps=args.reps)
            base_ms = ms if label == "default" else base_ms
            tflops = flops(batch, heads, n, n, d, causal, "bwd") / ms / 1e9
            rel = f"{ms / base_ms:.2f}" if base_ms else "-"
            print(f"{cfg.name:<64} {d:>4} {n:>6} {'causal' if causal else 'full':<6} {ms:>8.3f} {tflops:>8.1f} "
                  f"{rel:>9}  ({label})", flush=True)


if __name__ == "__main__":
    main()
