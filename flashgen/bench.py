"""Step 6: how fast is it? CUDA-event medians after warm-up, and the FLOP count used everywhere."""
from __future__ import annotations

import statistics
from typing import Any, Callable

from .compile import CompiledKernel
from .launch import run


def flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward attention FLOPs: 4*B*H*Sq*Sk*D (two matmuls), halved for causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


def time_cuda(fn: Callable[[int], Any], warmup: int = 10, reps: int = 50, rotate: int = 1,
              queue_ahead_us: float = 300.0) -> list[float]:
    """Milliseconds of each of `reps` calls of fn(i) (i cycles over `rotate` input sets), timed by CUDA events.

    Before each timed call the stream is kept busy for `queue_ahead_us` (a GPU sleep), so the
    host has queued the start event and the launch before the GPU reaches them: the events then
    bracket the kernel alone, not the host time it takes to issue it. Host cost is not device
    time; measure it separately where it matters."""
    import torch  # noqa: PLC0415

    for i in range(warmup):
        fn(i % rotate)
    torch.cuda.synchronize()
    sleep_cycles = int(queue_ahead_us * 2000)  # ~2 GHz SM clock; only needs to outlast the host's issue time
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda._sleep(sleep_cycles)
        starts[i].record()
        fn(i % rotate)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median_ms(times: list[float]) -> float:
    return statistics.median(times)


def l2_rotation(bytes_per_set: int, l2_bytes: int = 60 * 2**20) -> int:
    """How many input sets to cycle through so that repeats do not time the L2 (at least 2x L2 touched)."""
    return max(1, -(-2 * l2_bytes // max(1, bytes_per_set)))


def time_kernel(kernel: CompiledKernel, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int | None = None,
                warmup: int = 10, reps: int = 50, seed: int = 0) -> float:
    """Median milliseconds of `kernel` on random inputs of this shape, inputs rotated past L2."""
    import torch  # noqa: PLC0415

    from .verify import random_qkv  # noqa: PLC0415

    cfg = kernel.config
    hk = heads_k or heads
    set_bytes = 2 * cfg.head_dim * batch * (seqlen_q * heads * 2 + 2 * seqlen_k * hk)
    sets = [random_qkv(batch, seqlen_q, seqlen_k, heads, hk, cfg.head_dim, cfg.dtype, seed + i)
            for i in range(l2_rotation(set_bytes))]
    outs = [(torch.empty_like(q), torch.empty(batch, heads, seqlen_q, device=q.device)) for q, _, _ in sets]

    def call(i: int) -> None:
        q, k, v = sets[i]
        run(kernel, q, k, v, out=outs[i][0], lse=outs[i][1])

    return median_ms(time_cuda(call, warmup, reps, rotate=len(sets)))
