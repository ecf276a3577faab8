"""Search and store for decode problems (KV-cache attention of one query token per sequence).

The decode kernel (templates/sm80/serve.cuh.j2 with varlen, pack-GQA, and paged / split where used) has a
small space: a tile (block_m, block_n, warps, stages) and the number of key ranges each row block is
split into (split-KV). `tune_problem` measures all of it on one problem (head dim, dtype, heads, batch,
cache length, page size): every candidate verified against float64 on the problem's own random inputs
before it is timed (CUDA-event medians), and the fastest verified one becomes a store entry ("pass_":
"decode"). flashgen.resolve.tuned_decode is what `attention_with_kvcache(num_splits=0)` asks: the entry of the
nearest stored problem, or None (then the rule of flashgen.kernels.serving chooses).
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .__version__ import __version__
from .api import attention_with_kvcache
from .bench import median_ms, retime_best, time_cuda
from .bench_serving import paged
from .compile import nvcc_version
from .config import ConfigError, KernelConfig
from .driver import version as driver_version
from .kernels.serving import decode_config, kvcache_launch
from .tensors import torch_dtype
from .verify import packed_ref, poisoned_error

SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_POINTS = ((1, 1024), (1, 8192), (1, 131072), (8, 32768), (32, 8192), (128, 4096))  # (batch, cache length)
PAGE_SIZES = (0, 16, 256)  # 0: a contiguous cache


@dataclass(frozen=True)
class DecodeProblem:
    """One decode problem on one GPU: q (batch, 1, heads, head_dim) against a full cache of cache_len keys."""

    head_dim: int
    dtype: str
    heads: int
    heads_k: int
    batch: int
    cache_len: int
    page_size: int  # 0: contiguous (batch, cache_len, heads_k, head_dim)
    gpu_name: str
    gpu_arch: str

    @property
    def key(self) -> str:
        return (f"decode_d{self.head_dim}_{self.dtype}_h{self.heads}k{self.heads_k}_b{self.batch}_n{self.cache_len}"
                f"_p{self.page_size}")

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.cache_len * self.heads_k * self.head_dim * 2

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass_": "decode"}


def decode_tiles(head_dim: int, dtype: str, arch: str) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, warps, stages) of the decode tiles that fit `arch` paged and not, split and not."""
    out = []
    for bm, w, bn, s in itertools.product((16, 32), (1, 2), (32, 64, 128), (2, 3, 4)):
        try:
            cfgs = [decode_config(head_dim, dtype, (bm, bn, w, s), pg, sp) for pg in (False, True) for sp in (False, True)]
        except ConfigError:
            continue
        if all(c.unfit_reason(arch) is None for c in cfgs):
            out.append((bm, bn, w, s))
    return out


def space(head_dim: int, dtype: str, arch: str, paged: bool, cache_len: int) -> list[tuple[KernelConfig, int]]:
    """Every (kernel, num_splits) of a decode problem: each tile, unsplit and split 2..128 ways (no more
    ways than the cache has key blocks)."""
    out = []
    for tile in decode_tiles(head_dim, dtype, arch):
        blocks = -(-cache_len // tile[1])
        out += [(decode_config(head_dim, dtype, tile, paged, s > 1), s) for s in SPLITS if s == 1 or s <= blocks]
    return out


def reference(q: Any, k: Any, v: Any, dtype: Any) -> Any:
    """Attention of q (batch, 1, heads, d) over the whole cache (batch, n, heads_k, d), in `dtype`: (batch, 1, heads,
    d), sequence by sequence (verify.packed_ref)."""
    b, n = k.shape[:2]
    out = packed_ref(q.reshape(b, *q.shape[2:]), k.reshape(b * n, *k.shape[2:]), v.reshape(b * n, *v.shape[2:]),
                     list(range(b + 1)), [i * n for i in range(b + 1)], False, dtype=dtype)
    return out[:, None]


def tune_problem(problem: DecodeProblem, candidates: list[tuple[KernelConfig, int]] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Measure every candidate (default: the whole space) of `problem` on this GPU; the store entry of the fastest
    verified one (None if none verified). The untuned choice (attention_with_kvcache's rule) is measured beside it."""
    import torch  # noqa: PLC0415

    p = problem
    tdt = torch_dtype(p.dtype)
    q = torch.randn(p.batch, 1, p.heads, p.head_dim, device="cuda", dtype=tdt)
    kc, vc = (torch.randn(p.batch, p.cache_len, p.heads_k, p.head_dim, device="cuda", dtype=tdt) for _ in range(2))
    ref = reference(q, kc, vc, torch.float64)
    bound = 2 * (reference(q, kc, vc, tdt).double() - ref).abs().max().item() + 1e-5  # flash_attn's bar
    k_arg, v_arg, table = kc, vc, None
    if p.page_size:
        k_arg, table = paged(kc, p.page_size)
        v_arg = torch.empty_like(k_arg)
        v_arg[table.view(-1).long()] = vc.view(-1, p.page_size, p.heads_k, p.head_dim)
    lens = torch.full((p.batch,), p.cache_len, dtype=torch.int32, device="cuda")
    candidates = candidates if candidates is not None else space(p.head_dim, p.dtype, p.gpu_arch, bool(p.page_size),
                                                                 p.cache_len)
    out = torch.empty_like(q)

    def measure(call: Callable[[], Any]) -> tuple[float | None, str]:
        err = poisoned_error(out, ref, call)
        if not err <= bound:  # NaN (an unwritten element) fails too
            return None, f"max error {err:.3g} > {bound:.3g}"
        return median_ms(time_cuda(lambda i: call(), warmup=2, reps=15)), "ok"

    def untuned() -> None:  # the rule's choice, as a caller without a tuned entry gets it
        out.copy_(attention_with_kvcache(q, k_arg, v_arg, cache_seqlens=lens, block_table=table, validate=False))

    default_ms, default_status = measure(untuned)
    results, failed = [], 0
    for cfg, splits in candidates:
        ms, status = measure(lambda: kvcache_launch(cfg, splits, q, k_arg, v_arg, out, None, lens, table))
        if ms is None:
            failed += 1
            if progress:
                progress(f"  {cfg.name} x{splits}: not verified ({status})")
            continue
        results.append((ms, (cfg, splits)))
    if not results:
        return None
    # The leaders timed again side by side: the stored winner must beat noise, not one lucky pass.
    ms, (cfg, splits) = retime_best(results, lambda c: time_cuda(
        lambda i: kvcache_launch(c[0], c[1], q, k_arg, v_arg, out, None, lens, table), warmup=2, reps=15))[0]
    tb_s = p.kv_bytes / (ms * 1e-3) / 1e12
    if progress:
        progress(f"{p.key}: {tb_s:.2f} TB/s ({ms * 1e3:.1f} us) {cfg.name} x{splits}; untuned "
                 + (f"{p.kv_bytes / (default_ms * 1e-3) / 1e12:.2f} TB/s" if default_ms else default_status)
                 + f"; {len(results)} verified, {failed} failed")
    return {
        "problem": p.to_dict(), "kernel": cfg.name, "config": cfg.to_dict(), "num_splits": splits,
        "median_ms": ms, "tflops": None, "tb_s": tb_s, "trials": len(candidates),
        "date": datetime.date.today().isoformat(), "flashgen": __version__, "nvcc": nvcc_version(),
        "driver": driver_version(),
        "default": {"kernel": "rule (flashgen.serving)", "status": default_status, "median_ms": default_ms,
                    "tb_s": p.kv_bytes / (default_ms * 1e-3) / 1e12 if default_ms else None},
    }


__all__ = ["DECODE_POINTS", "DecodeProblem", "PAGE_SIZES", "decode_config", "decode_tiles", "space", "tune_problem"]
