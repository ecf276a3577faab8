"""Step 6: how fast is it? CUDA-event medians after warm-up, and the FLOP count used everywhere."""
from __future__ import annotations

import statistics
from typing import Any, Callable

from .compile import CompiledKernel
from .config import KernelConfig
from .kernels.backward import backward
from .kernels.dense import run
from .tensors import torch_dtype
from .verify import poisoned_error, random_fp8, random_qkv


BWD_FLOPS_RATIO = 2.5  # the backward's five matmuls (S, dP, dV, dK, dQ) against the forward's two


def flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
          pass_: str = "fwd") -> float:
    """Attention FLOPs: forward 4*B*H*Sq*Sk*D (two matmuls), halved for causal; backward 2.5x that
    (the convention of FlashAttention's benchmarks: its recompute of S is not counted)."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    f = f / 2 if causal else f
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_={pass_!r}; choose fwd or bwd")
    return f * BWD_FLOPS_RATIO if pass_ == "bwd" else f


_L2_SCRATCH: dict[int, Any] = {}


def l2_flush(read: bool = False) -> Callable[[], Any]:
    """A write of twice the current GPU's L2 (a cached scratch buffer): after it, nothing a previous call left in L2
    is there. Timed calls measured without it moved by up to 15% with that residue (docs/performance.md).
    read: a read of the buffer instead (a sum): it evicts the same lines but leaves L2 clean, where a write leaves up
    to L2's size of dirty lines that the timed call's own misses then write back."""
    import torch  # noqa: PLC0415

    dev = torch.cuda.current_device()
    if dev not in _L2_SCRATCH:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20
        _L2_SCRATCH[dev] = torch.empty(2 * l2, dtype=torch.uint8, device=f"cuda:{dev}")
    scratch = _L2_SCRATCH[dev]
    if read:
        words = scratch.view(torch.int32)
        return lambda: words.sum()
    return scratch.zero_


def time_cuda(fn: Callable[[int], Any], warmup: int = 10, reps: int = 50, rotate: int = 1,
              queue_ahead_us: float = 300.0, before: Callable[[], Any] | None = None,
              flush_l2: bool | str = True) -> list[float]:
    """Milliseconds of each of `reps` calls of fn(i) (i cycles over `rotate` input sets), timed by CUDA events.

    Before each timed call the stream is kept busy for `queue_ahead_us` (a GPU sleep), so the
    host has queued the start event and the launch before the GPU reaches them: the events then
    bracket the kernel alone, not the host time it takes to issue it. Host cost is not device
    time; measure it separately where it matters. `before()`, if given, is queued ahead of each
    timed call's sleep, outside the events; with flush_l2 (default) L2 is flushed there too, so each
    call starts from the same cold cache (as FlashAttention-4's published figures are taken); flush_l2="read" flushes
    by reading (l2_flush(read=True))."""
    import torch  # noqa: PLC0415

    for i in range(warmup):
        fn(i % rotate)
    torch.cuda.synchronize()
    sleep_cycles = int(queue_ahead_us * 2000)  # ~2 GHz SM clock; only needs to outlast the host's issue time
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    flush = l2_flush(read=flush_l2 == "read") if flush_l2 else None
    for i in range(reps):
        if before is not None:
            before()
        if flush is not None:
            flush()
        torch.cuda._sleep(sleep_cycles)
        starts[i].record()
        fn(i % rotate)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median_ms(times: list[float]) -> float:
    return statistics.median(times)


def retime_best(results: list[tuple[float, Any]], timer: Callable[[Any], list[float]], top: int = 5,
                rounds: int = 3, keep: tuple = ()) -> list[tuple[float, Any]]:
    """The `top` fastest candidates of (ms, candidate), and those in `keep`, timed again in `rounds` interleaved
    rounds (timer(candidate): a list of ms samples); (median over all rounds, candidate), fastest first. A
    one-pass median of a few reps differs by a few percent between neighbours (clocks, other work), and the
    winner of one pass is often that noise."""
    best = list(dict.fromkeys([c for _, c in sorted(results, key=lambda r: r[0])[:top]] + list(keep)))
    samples: dict[Any, list[float]] = {c: [] for c in best}
    for _ in range(rounds):
        for cand in best:
            samples[cand] += timer(cand)
    return sorted(((median_ms(samples[c]), c) for c in best), key=lambda r: r[0])


class TrialInputs:
    """A serving problem's inputs in a GPU worker (decode, varlen): a subclass sets out, ref (float64) and bound
    (the error a candidate must stay within) and says how to run a candidate (runner); trials verify, then time."""

    out: Any
    ref: Any
    bound: float

    def runner(self, cand: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
        """(one launch of `cand` writing self.out, what the trial result adds about it)."""
        raise NotImplementedError

    def trial(self, cand: Any, warmup: int, reps: int) -> dict[str, Any]:
        """Verify (poisoned output against the float64 reference), then time: the worker's trial result."""
        call, info = self.runner(cand)
        err = poisoned_error(self.out, self.ref, call)
        if not err <= self.bound:  # NaN (an unwritten element) fails too
            return {"status": "verify_failed", "reason": f"max error {err:.3g} > {self.bound:.3g}", "max_err": err,
                    **info}
        return {"status": "ok", "ms": median_ms(time_cuda(lambda i: call(), warmup=warmup, reps=reps)), "max_err": err,
                "reason": "", **info}

    def retime(self, cands: list[Any], rounds: int, warmup: int, reps: int) -> list[float]:
        """Median ms of each (verified) candidate over `rounds` interleaved rounds."""
        calls = [self.runner(c)[0] for c in cands]
        timed = retime_best([(0.0, i) for i in range(len(cands))], lambda i: time_cuda(
            lambda j: calls[i](), warmup=warmup, reps=reps), top=len(cands), rounds=rounds)
        return [ms for ms, _ in sorted(timed, key=lambda r: r[1])]


def l2_rotation(bytes_per_set: int, l2_bytes: int = 60 * 2**20) -> int:
    """How many input sets to cycle through so that repeats do not time the L2 (at least 2x L2 touched)."""
    return max(1, -(-2 * l2_bytes // max(1, bytes_per_set)))


def kernel_timer(cfg: KernelConfig, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int | None = None,
                 seed: int = 0) -> tuple[Callable[[CompiledKernel, int], None], int]:
    """(call(kernel, i), sets): runs a kernel of `cfg`'s dtypes on the i-th of `sets` random input sets of this
    shape, enough sets to rotate past L2. Kernels of one problem share them (re-timing compares on equal inputs)."""
    import torch  # noqa: PLC0415

    hk = heads_k or heads
    eb = cfg.elem_bytes
    set_bytes = batch * (seqlen_q * heads * (cfg.head_dim * eb + cfg.v_dim * 2)  # q, o
                         + eb * seqlen_k * hk * (cfg.head_dim + cfg.v_dim))  # k, v
    if cfg.fp8:
        sets = [random_fp8(batch, seqlen_q, seqlen_k, heads, hk, cfg.head_dim, seed + i)
                for i in range(l2_rotation(set_bytes))]
    else:
        sets = [(*random_qkv(batch, seqlen_q, seqlen_k, heads, hk, cfg.head_dim, cfg.dtype, seed + i,
                             head_dim_v=cfg.head_dim_v), None)
                for i in range(l2_rotation(set_bytes))]
    outs = [(torch.empty((*q.shape[:3], cfg.v_dim), dtype=torch_dtype(cfg.output_dtype), device=q.device),
             torch.empty(batch, heads, seqlen_q, device=q.device)) for q, *_ in sets]

    def call(kernel: CompiledKernel, i: int) -> None:
        q, k, v, descale = sets[i]
        run(kernel, q, k, v, out=outs[i][0], lse=outs[i][1], descale=descale)

    return call, len(sets)


def time_kernel(kernel: CompiledKernel, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int | None = None,
                warmup: int = 10, reps: int = 50, seed: int = 0) -> float:
    """Median milliseconds of `kernel` on random inputs of this shape, inputs rotated past L2."""
    call, sets = kernel_timer(kernel.config, batch, seqlen_q, seqlen_k, heads, heads_k, seed)
    return median_ms(time_cuda(lambda i: call(kernel, i), warmup, reps, rotate=sets))


def time_backward(kernel: CompiledKernel, fwd_kernel: CompiledKernel, batch: int, seqlen_q: int, seqlen_k: int,
                  heads: int, heads_k: int | None = None, warmup: int = 10, reps: int = 50, seed: int = 0) -> float:
    """Median milliseconds of the backward `kernel` alone (all its launches) on random inputs of this
    shape: `fwd_kernel` runs once per input set for out and lse, outside the timing; sets rotated past L2."""
    import torch  # noqa: PLC0415

    cfg = kernel.config
    hk = heads_k or heads
    # read: q k v o dO (+ lse, D); written: dq dk dv (+ the fp32 dQ accumulator)
    set_bytes = 2 * cfg.head_dim * batch * (seqlen_q * heads * 5 + 4 * seqlen_k * hk)
    sets = []
    for i in range(l2_rotation(set_bytes)):
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, hk, cfg.head_dim, cfg.dtype, seed + i)
        out, lse, _ = run(fwd_kernel, q, k, v)
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        sets.append((q, k, v, out, torch.randn_like(q), lse, grads))

    def call(i: int) -> None:
        q, k, v, out, dout, lse, (dq, dk, dv) = sets[i]
        backward(kernel, q, k, v, out, dout, lse, dq=dq, dk=dk, dv=dv)

    return median_ms(time_cuda(call, warmup, reps, rotate=len(sets)))
