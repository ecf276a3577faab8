"""How evenly the persistent kernel's static tile hand-out spreads causal work, against a dynamic one (no GPU).

    python scripts/schedule_balance.py [--seqlen 1024,4096] [--head-dim 64,128,256] [--block-m 128] [--sms 132]
        [--overhead 0,1,2]

Model: a causal tile of m-block m costs `overhead` + (m + 1) key tiles (its rows see m + 1 key blocks of block_m keys).
Static: the kernel's order (flashgen.schedule: longest first, snake waves, what templates/sm90/tile_order.cuh.j2
computes). Dynamic: the same order handed to whichever CTA finishes first (an atomic tile counter). Prints each
one's busiest CTA over the ideal (total / SMs): what a dynamic scheduler could gain at most, before its own cost.
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.schedule import cta_tiles, tile_order  # noqa: E402


def makespans(seqlen: int, head_dim: int, block_m: int, sms: int, overhead: float,
              batch_tokens: int = 16384, heads_dim_total: int = 2048) -> tuple[float, float, float]:
    """(ideal, static, dynamic) busiest-CTA cost in key tiles, for the bench's shapes of one point."""
    order = tile_order(-(-seqlen // block_m), heads_dim_total // head_dim, batch_tokens // seqlen, True)
    cost = [overhead + m + 1 for m, _, _ in order]
    ideal = sum(cost) / sms
    by_tile = dict(zip(order, cost))
    static = max(sum(by_tile[t] for t in cta_tiles(order, sms, c)) for c in range(sms))
    free = [0.0] * sms  # when each CTA is next free; the next tile of the order goes to the earliest
    for c in cost:
        heapq.heappush(free, heapq.heappop(free) + c)
    return ideal, static, max(free)


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=ints, default=[1024, 4096, 16384])
    ap.add_argument("--head-dim", type=ints, default=[64, 128, 256])
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0, 2.0],
                    help="per-tile cost beyond its key tiles, in key tiles (default 0,1,2)")
    args = ap.parse_args()
    print(f"{'N':>6} {'d':>4} {'overhead':>8} {'static/ideal':>13} {'dynamic/ideal':>14} {'static/dynamic':>15}")
    for n in args.seqlen:
        for d in args.head_dim:
            for o in args.overhead:
                ideal, static, dynamic = makespans(n, d, args.block_m, args.sms, o)
                print(f"{n:6d} {d:4d} {o:8.1f} {static / ideal:13.3f} {dynamic / ideal:14.3f} {static / dynamic:15.3f}")


if __name__ == "__main__":
    main()
