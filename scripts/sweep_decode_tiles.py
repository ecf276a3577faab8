"""Sweep the decode kernel's tiles and num_splits on KV-cache decode problems (one query token, pack-GQA).

    python scripts/sweep_decode_tiles.py --compile-only            # fill FLASHGEN_CACHE_DIR, no GPU
    python scripts/sweep_decode_tiles.py [--points 32x8192,1x131072] [--pages 0,16,256] [--splits 1,2,4,8]

flashgen.kernels.serving picks one decode tile per head dim and num_splits by a rule; this measures every tile
(block_m, block_n, warps, stages[, key_warps]) x splits (--fused: and each split tile with fused_combine) on each
(batch x cache length, page size) point, each checked against SDPA once, and prints per point the default's and the
best's K/V read rate (CUDA-event medians; --flush: how L2 is emptied before each timed call).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen import api  # noqa: E402  (attention_with_kvcache's serve_config is replaced per tile)
from flashgen.compile import CompileError, compile_kernel  # noqa: E402
from flashgen.tune_decode import decode_config as config, decode_tiles as tiles  # noqa: E402

HEADS = (32, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--points", default="32x8192,8x32768,1x131072", help="batch x cache length, comma-separated")
    ap.add_argument("--pages", default="0,16,256", help="page sizes (0: contiguous)")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--fused", action="store_true", help="also each split tile with fused_combine (one launch a step)")
    ap.add_argument("--flush", choices=("write", "read", "none"), default="write",
                    help="L2 before each timed call: written (the bench's and tuner's way), read, or left warm")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    ts = tiles(args.head_dim, args.dtype, args.arch)
    if args.compile_only:
        for t, pg, sp, fu in itertools.product(ts, (False, True), (False, True), fused_choices(args)):
            if fu and not sp:
                continue
            try:
                compile_kernel(config(args.head_dim, args.dtype, t, pg, sp, fu), "sm_" + args.arch[2:])
            except CompileError as e:
                print("FAILED", t, pg, sp, fu, str(e).splitlines()[0])
        print(f"{len(ts)} tiles x paged x split compiled")
        return
    sweep(args, ts)


def fused_choices(args: argparse.Namespace) -> tuple[bool, ...]:
    """fused_combine off, and with --fused on too (split tiles only)."""
    return (False, True) if args.fused else (False,)


def sweep(args: argparse.Namespace, ts: list) -> None:
    import torch

    import flashgen
    from flashgen import attention_with_kvcache
    from flashgen.bench import median_ms, time_cuda
    from flashgen.bench_serving import paged

    h, hk = HEADS
    flush = {"write": True, "read": "read", "none": False}[args.flush]
    d, tdt = args.head_dim, {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    real = api.serve_config
    for point in args.points.split(","):
        batch, n = (int(x) for x in point.split("x"))
        q = torch.randn(batch, 1, h, d, device="cuda", dtype=tdt)
        kc, vc = (torch.randn(batch, n, hk, d, device="cuda", dtype=tdt) for _ in range(2))
        lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                               enable_gqa=True).transpose(1, 2)
        kv_bytes = 2 * batch * n * hk * d * q.element_size()
        for page in (int(x) for x in args.pages.split(",")):
            k_arg, v_arg, table = kc, vc, None
            if page:
                k_arg, table = paged(kc, page)
                v_arg = torch.empty_like(k_arg)
                v_arg[table.view(-1).long()] = vc.view(-1, page, hk, d)
            results = []
            default_ms = median_ms(time_cuda(lambda i: attention_with_kvcache(
                q, k_arg, v_arg, cache_seqlens=lens, block_table=table, validate=False), warmup=3, reps=20,
                flush_l2=flush))
            for t, fused in itertools.product(ts, fused_choices(args)):
                for splits in (int(x) for x in args.splits.split(",")):
                    if fused and splits == 1:
                        continue
                    api.serve_config = lambda *a, split=False, **f: config(d, args.dtype, t, bool(page), split,
                                                                           split and fused)
                    try:
                        def call(i: int = 0) -> torch.Tensor:
                            return attention_with_kvcache(q, k_arg, v_arg, cache_seqlens=lens, block_table=table,
                                                          num_splits=splits, validate=False)
                        err = (call().float() - ref.float()).abs().max().item()
                        if not err < 2e-2:
                            print(f"  {t}{' fused' if fused else ''} splits {splits}: WRONG (max error {err:.3g})")
                            continue
                        ms = median_ms(time_cuda(call, warmup=2, reps=15, flush_l2=flush))
                        results.append((ms, t, splits, fused))
                    finally:
                        api.serve_config = real
                        flashgen.reload()  # else the next tile's calls of this signature run this tile's plan
            results.sort(key=lambda r: r[0])
            tb = lambda ms: kv_bytes / (ms * 1e-3) / 1e12  # noqa: E731
            name = lambda r: f"{r[1]}x{r[2]}{' fused' if r[3] else ''}"  # noqa: E731
            best = results[0]
            print(f"{batch} x {n} page {page or '-'}: default {tb(default_ms):.2f} TB/s ({default_ms * 1e3:.0f} us); "
                  f"best {tb(best[0]):.2f} TB/s tile (bm, bn, w, s[, key_warps]) x splits {name(best)}; next: "
                  + ", ".join(f"{name(r)} {tb(r[0]):.2f}" for r in results[1:4]), flush=True)
            kinds: dict = {}  # the best of each kind: key tiles split 1, 2 or 4 ways, fused combine or not
            for r in results:
                kinds.setdefault((r[1][4] if len(r[1]) > 4 else 1, r[3]), r)
            print("  best by (key_warps, fused): " + ", ".join(
                f"{k}: {name(r)} {tb(r[0]):.2f} TB/s ({r[0] * 1e3:.1f} us)" for k, r in sorted(kinds.items())),
                flush=True)


if __name__ == "__main__":
    main()
