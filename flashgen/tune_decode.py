"""Search and store for decode problems (KV-cache attention of one query token per sequence).

The decode kernel (templates/sm80/serve.cuh.j2 with varlen, pack-GQA, and paged / split where used) has a
small space: a tile (block_m, block_n, warps, stages) and the number of key ranges each row block is
split into (split-KV): a candidate is a (kernel, num_splits) pair. A problem (head dim, dtype, heads, batch,
cache length, page size) is tuned by the one pipeline of every kind (flashgen.tunable, flashgen.search, the GPU
worker): each candidate verified against float64 on the problem's own random inputs (`Inputs`, built once in
the worker) before it is timed (CUDA-event medians), and the fastest verified one becomes a store entry
("pass_": "decode", `entry`). flashgen.resolve.tuned_decode is what `attention_with_kvcache(num_splits=0)` asks: the entry of the
nearest stored problem, or None (then the rule of flashgen.kernels.serving chooses).
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .__version__ import __version__
from .api import attention_with_kvcache
from .bench import TrialInputs
from .bench_serving import paged
from .config import KEY_WARPS, ConfigError, KernelConfig
from .kernels.serving import decode_config, kvcache_launch
from .problem import HeldInputs, Rule, gpu_slug
from .tensors import torch_dtype
from .verify import packed_ref

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
    def study_name(self) -> str:
        """The problem's Optuna study (with the space's digest, see flashgen.search.study_name): GPU slug / key."""
        return f"{gpu_slug(self.gpu_name, self.gpu_arch)}/{self.key}"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.cache_len * self.heads_k * self.head_dim * 2

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass_": "decode"}


def decode_tiles(head_dim: int, dtype: str, arch: str) -> list[tuple[int, ...]]:
    """(block_m, block_n, warps, stages) of the decode tiles that fit `arch` paged and not, split and not; then the
    same with each key tile split between 2 or 4 warps, (block_m, block_n, warps, stages, key_warps), warps counting
    every warp (the first tiles' row warps times key_warps)."""
    out: list[tuple[int, ...]] = []
    for kw in KEY_WARPS:
        for bm, w, bn, s in itertools.product((16, 32), (1, 2), (32, 64, 128), (2, 3, 4)):
            tile = (bm, bn, w * kw, s) + ((kw,) if kw > 1 else ())
            try:
                cfgs = [decode_config(head_dim, dtype, tile, pg, sp) for pg in (False, True) for sp in (False, True)]
            except ConfigError:
                continue
            if all(c.unfit_reason(arch) is None for c in cfgs):
                out.append(tile)
    return out


def space(head_dim: int, dtype: str, arch: str, paged: bool, cache_len: int) -> list[tuple[KernelConfig, int]]:
    """Every (kernel, num_splits) of a decode problem: each tile, unsplit and split 2..128 ways (no more
    ways than the cache has key blocks), a split one with its combine kernel or with the combine fused."""
    out = []
    for tile in decode_tiles(head_dim, dtype, arch):
        blocks = -(-cache_len // tile[1])
        out += [(decode_config(head_dim, dtype, tile, paged, s > 1, fused), s) for s in SPLITS
                if s == 1 or s <= blocks for fused in ((False, True) if s > 1 else (False,))]
    return out


def reference(q: Any, k: Any, v: Any, dtype: Any) -> Any:
    """Attention of q (batch, 1, heads, d) over the whole cache (batch, n, heads_k, d), in `dtype`: (batch, 1, heads,
    d), sequence by sequence (verify.packed_ref)."""
    b, n = k.shape[:2]
    out = packed_ref(q.reshape(b, *q.shape[2:]), k.reshape(b * n, *k.shape[2:]), v.reshape(b * n, *v.shape[2:]),
                     list(range(b + 1)), [i * n for i in range(b + 1)], False, dtype=dtype)
    return out[:, None]


@dataclass(frozen=True)
class DecodeCandidate:
    """One point of a decode problem's space: a kernel and the number of key ranges each row block is split into."""

    config: KernelConfig
    num_splits: int

    @property
    def name(self) -> str:
        return f"{self.config.name}_x{self.num_splits}"

    def unfit_reason(self, arch: str) -> str | None:
        return self.config.unfit_reason(arch)


RULE = Rule("rule (flashgen.serving)")  # attention_with_kvcache(num_splits=0) without an entry: the untuned choice


def candidates(problem: DecodeProblem) -> list[DecodeCandidate]:
    """The problem's whole space (`space`) as candidates."""
    p = problem
    return [DecodeCandidate(c, s) for c, s in space(p.head_dim, p.dtype, p.gpu_arch, bool(p.page_size), p.cache_len)]


def problems(head_dims: list[int], dtypes: list[str], heads: int, heads_k: int, points: list[tuple[int, int]],
             pages: list[int], gpu_name: str, gpu_arch: str) -> list[DecodeProblem]:
    """Every (head dim, dtype, (batch, cache length), page size) on one GPU model; a paged cache only where the
    cache length is a whole number of pages."""
    return [DecodeProblem(hd, dt, heads, heads_k, b, n, pg, gpu_name, gpu_arch)
            for hd, dt, (b, n), pg in itertools.product(head_dims, dtypes, points, pages) if not pg or n % pg == 0]


class Inputs(TrialInputs):
    """A decode problem's random inputs on this GPU, the float64 reference and the bar a candidate must meet
    (twice PyTorch's own error in the dtype, flash_attn's bar). Built once per problem in the GPU worker."""

    def __init__(self, problem: DecodeProblem):
        import torch  # noqa: PLC0415

        p = self.problem = problem
        tdt = torch_dtype(p.dtype)
        self.q = torch.randn(p.batch, 1, p.heads, p.head_dim, device="cuda", dtype=tdt)
        kc, vc = (torch.randn(p.batch, p.cache_len, p.heads_k, p.head_dim, device="cuda", dtype=tdt) for _ in range(2))
        self.ref = reference(self.q, kc, vc, torch.float64)
        self.bound = 2 * (reference(self.q, kc, vc, tdt).double() - self.ref).abs().max().item() + 1e-5
        self.k, self.v, self.table = kc, vc, None
        if p.page_size:
            self.k, self.table = paged(kc, p.page_size)
            self.v = torch.empty_like(self.k)
            self.v[self.table.view(-1).long()] = vc.view(-1, p.page_size, p.heads_k, p.head_dim)
        self.lens = torch.full((p.batch,), p.cache_len, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q)

    def runner(self, cand: DecodeCandidate | Rule) -> tuple[Callable[[], Any], dict[str, Any]]:
        """One launch of `cand` writing self.out; the rule's is the call a caller without a tuned entry makes."""
        if isinstance(cand, Rule):
            return lambda: self.out.copy_(attention_with_kvcache(self.q, self.k, self.v, cache_seqlens=self.lens,
                                                                 block_table=self.table, validate=False)), {}
        return lambda: kvcache_launch(cand.config, cand.num_splits, self.q, self.k, self.v, self.out, None, self.lens,
                                      self.table), {}


inputs = HeldInputs(Inputs)  # the GPU worker's, of the problem it is tuning
gpu_trial, gpu_retime = inputs.trial, inputs.retime  # the worker's tasks (flashgen.tunable.DecodeKind)


def entry(problem: DecodeProblem, best: DecodeCandidate, ms: float, trials: int, default: Any,
          versions: dict[str, str]) -> dict[str, Any]:
    """The store entry ("pass_": "decode") of the fastest verified candidate; `default`: the rule's TrialResult."""
    p = problem
    dms = default.ms if default is not None and default.ok else None
    return {
        "problem": p.to_dict(), "kernel": best.config.name, "config": best.config.to_dict(),
        "num_splits": best.num_splits, "median_ms": ms, "tflops": None, "tb_s": p.kv_bytes / (ms * 1e-3) / 1e12,
        "trials": trials, "date": datetime.date.today().isoformat(), "flashgen": __version__, **versions,
        "default": {"kernel": RULE.name,
                    "status": "not measured" if default is None else "ok" if dms else (default.reason or default.status),
                    "median_ms": dms, "tb_s": p.kv_bytes / (dms * 1e-3) / 1e12 if dms else None},
    }


__all__ = ["DECODE_POINTS", "RULE", "DecodeCandidate", "DecodeProblem", "Inputs", "PAGE_SIZES", "candidates", "decode_config",
           "decode_tiles", "entry", "gpu_retime", "gpu_trial", "problems", "space"]
