"""Per-call time of a decode step on a GPU: eager back to back (host included), replayed from a CUDA graph, the
kernels alone, and the host's issue time.

    python scripts/time_decode_call.py [--point b1x8k --point b32x8k --point b1x128k] [--calls 200] [--json PATH]

Each point is batch x cache length at 32 query / 8 KV heads, d128, bf16, one query token, a contiguous cache
full to its length. For attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens) and attention(q, k, v):
  eager   CUDA events around `calls` calls issued back to back (compare.back_to_back_ms): what a decode loop
          pays per call, host included wherever the host is slower than the GPU;
  graph   the same `calls` calls captured in one CUDA graph and replayed: the GPU's time per call without the host;
  kernels bench.time_cuda (the GPU kept busy ahead of each call, so the events bracket the launches alone), L2
          warm as back to back leaves it;
  host    wall time per call issued while the GPU is kept busy (a GPU sleep queued first): the host's cost alone.
The eager figure approaches the graph figure once host <= graph. A row "copy of K and V" times the yardstick: two
device copies (copy_) of the same cache bytes, the same four ways.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POINTS = {"b1x8k": (1, 8192), "b32x8k": (32, 8192), "b1x128k": (1, 131072)}
HEADS, HEADS_K, HEAD_DIM = 32, 8, 128


def graph_us(call: Callable[[], Any], calls: int, replays: int = 20) -> float:
    """Microseconds per call of `calls` calls captured in one CUDA graph, replayed `replays` times back to back."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graphs asks
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def host_us(call: Callable[[], Any], calls: int, loops: int = 5) -> float:
    """Median wall microseconds per call of `calls` calls issued while the GPU sleeps through them (the host alone;
    calls * launches stays under the driver's queue)."""
    import torch

    per = []
    for _ in range(loops):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time ahead of the calls
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def measure(point: str, calls: int) -> list[dict]:
    import torch

    import flashgen
    from flashgen.bench import median_ms, time_cuda
    from flashgen.compare import back_to_back_ms

    batch, n = POINTS[point]
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(batch, n, HEADS_K, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    reference = flashgen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    rows = []
    copies = torch.empty((2, *kc.shape), device="cuda", dtype=kc.dtype)

    def copy() -> Any:  # the yardstick: the same K and V bytes read by a device copy (and written once more)
        copies[0].copy_(kc)
        return copies[1].copy_(vc)

    entries = {"attention_with_kvcache": lambda: flashgen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
               "attention": lambda: flashgen.attention(q, kc, vc), "copy of K and V": copy}
    for name, call in entries.items():
        if call is not copy:
            assert torch.allclose(call(), reference, atol=1e-2, rtol=0), f"{name} differs from attention_with_kvcache"
        row = {"point": point, "call": name,
               "eager_us": back_to_back_ms(lambda i: call(), calls=calls) * 1e3,
               "graph_us": graph_us(call, calls),
               "kernels_us": median_ms(time_cuda(lambda i: call(), warmup=10, reps=50, flush_l2=False)) * 1e3,
               "host_us": host_us(call, min(calls, 200))}
        flashgen.check_errors()
        rows.append(row)
        print(f"{point:8} {name:24} eager {row['eager_us']:7.1f} us  graph {row['graph_us']:7.1f}  kernels "
              f"{row['kernels_us']:7.1f}  host {row['host_us']:6.1f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", choices=sorted(POINTS), action="append", help="default: all three")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    import torch

    rows = [r for p in args.point or list(POINTS) for r in measure(p, args.calls)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
