"""Step 4 for serving problems: varlen batches and KV caches (contiguous or paged), with split-KV.

`attention_varlen` and `attention_with_kvcache` follow flash_attn's functions of the same
purpose. Each call checks its arguments before anything runs, picks a kernel generated with
exactly the features the call uses (templates/sm80/serve.cuh.j2, or on Hopper for varlen and window
the sm90 family's templates: a feature the call does not use is not in the code), packs its
parameter struct and launches on torch's current stream; split-KV calls add the `_combine` kernel.
A KV-cache call that repeats an earlier one's shapes (a decode loop) runs by that call's plan.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any, NamedTuple

from . import driver
from .api import _compiled, refuse_grad
from .compile import target_for
from .config import (_DEFAULT_TILES, ARCHS, COMBINE_WARPS, ELEM_BYTES, HEAD_DIMS, MAX_SPLITS, SM90_DENSE_KNOBS,
                     SM90_FEATURES, KernelConfig, mod_features)
from .launch import _FWD, _SM90_BYTES, _current_stream, scale_args, softcap_args, tmap_box
from .tensors import _TORCH_DTYPES

# FwdParams ("=5Q12q5i2f4x", launch._FWD), then ServeParams' own fields (templates/common/serve_params.cuh.j2).
_SERVE = struct.Struct("=5Q12q5i2f4x7Q4q5if")
assert _SERVE.size == 280
# Sm90ServeFwdParams (templates/sm90/params.cuh.j2) after FwdParams: cu_seqlens_q, cu_seqlens_k, window_left,
# window_right, num_seqs, max_seqlen_q.
_SM90_SERVE_TAIL = struct.Struct("=2Q4i")
assert 3 * 128 + _FWD.size == 552 and 552 + _SM90_SERVE_TAIL.size <= _SM90_BYTES == 640
# Decode tiles (at most 32 query rows per sequence, packed): (block_m, block_n, num_warps, num_stages)
# by head dim. Two warps even for 16 rows: one warp alone holds the K/V copies of a tile and its
# accumulators, and spills at d128 and d256 where pages are smaller than a tile.
_DECODE_TILES = {32: (32, 128, 2, 3), 64: (32, 128, 2, 3), 96: (32, 32, 2, 3), 128: (32, 64, 2, 3), 256: (32, 32, 2, 3)}
DECODE_ROWS = 32


class Mods(NamedTuple):
    """Score modifiers of one call: window (-1: unbounded), softcap (0: off), ALiBi slopes (None: off)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Any = None


@functools.lru_cache(maxsize=4096)
def choose_splits(tiles: int, slots: int, n_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """How many key ranges each row block is split into: the fewest whose waves fill the GPU's
    block slots within 15% of the best (FlashAttention-2's rule); 1 when the tiles alone fill it."""
    if tiles <= 0 or n_blocks <= 1 or tiles >= 0.8 * slots:
        return 1
    limit = min(max_splits, slots, n_blocks)
    effs: dict[int, float] = {}
    for s in range(1, limit + 1):
        if s > 1 and -(-n_blocks // s) == -(-n_blocks // (s - 1)):
            continue  # no fewer key blocks per split than s - 1 gives
        waves = tiles * s / slots
        effs[s] = waves / math.ceil(waves)
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * best)


@functools.lru_cache(maxsize=1024)
def serve_config(head_dim: int, dtype: str, causal: bool, rows: int, arch: str, **features: bool) -> KernelConfig:
    """The configuration for a serving call: decode tiles when a sequence has at most 32 (packed)
    rows, else the dense default tiles of the sm80 family, with exactly `features` compiled in."""
    reason = ""
    if rows <= DECODE_ROWS:  # fewer stages where the GPU's shared memory is smaller (sm86/sm89: 99 KB)
        bm, bn, w, stages = _DECODE_TILES[head_dim]
        for s in range(stages, 0, -1):
            cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, "sm80", **features)
            reason = cfg.unfit_reason(arch)
            if reason is None:
                return cfg
    for bm, bn, w, s in _DEFAULT_TILES[head_dim]:
        cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, "sm80", **features)
        reason = cfg.unfit_reason(arch)
        if reason is None:
            return cfg
    raise ValueError(f"no serving configuration fits {arch} for head_dim={head_dim}: {reason}")


def serve_grids(cfg: KernelConfig, batch: int, heads: int, heads_k: int, seqlen_q: int, total_rows: int,
                num_splits: int) -> tuple[int, int]:
    """Blocks of the main kernel and of the split-KV combine (0 without split), blocks of cfg.threads
    and 32 * COMBINE_WARPS threads. The main grid is how locate() in templates/sm80/serve.cuh.j2
    unfolds blockIdx.x: m-blocks of seqlen_q rows (seqlen_q * heads / heads_k packed (row, head) pairs
    with pack_gqa) x heads (KV heads with pack_gqa) x batch x splits; the combine runs a warp per
    (row, head) of total_rows * heads. The exported launch header's grid_x and combine_grid_x are this rule in C++."""
    rows = seqlen_q * (heads // heads_k if cfg.pack_gqa else 1)
    main = -(-rows // cfg.block_m) * (heads_k if cfg.pack_gqa else heads) * batch * (num_splits if cfg.split else 1)
    return main, (-(-total_rows * heads // COMBINE_WARPS) if cfg.split else 0)


def _slots(cfg: KernelConfig, sm_count: int, arch: str) -> int:
    """Blocks of `cfg` resident on the GPU at once (shared memory and the 32-block cap bound it)."""
    per_sm = min(32, max(1, ARCHS[arch].smem_per_block // max(cfg.smem_bytes, 1)), 2048 // cfg.threads)
    return sm_count * per_sm


# -- argument checks ------------------------------------------------------------------

def _dtype(t: Any, name: str) -> str:
    dt = _TORCH_DTYPES.get(str(t.dtype))
    if dt is None:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.float16, torch.bfloat16")
    return dt


def _check_same(tensors: dict[str, Any], dtype: str, device: Any) -> None:
    import torch  # noqa: PLC0415

    for name, t in tensors.items():
        if not (t.is_cuda or t.is_meta):  # meta: shapes only, through the fake operators
            raise ValueError(f"{name} is on {t.device}; flashgen runs on CUDA tensors (move it with .cuda())")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; q is on {device}")
        if _dtype(t, name) != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; q has {dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
        real = type(t) is torch.Tensor and not t.is_meta  # fake and meta tensors have no data pointer to check
        if (real and t.data_ptr() % 16) or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"{name} needs a 16-byte aligned base and strides that are multiples of 8 elements")


def _checked_dtype(tensors: dict[str, Any], layout: str) -> str:
    """The dtype of tensors that must be torch tensors of `layout`'s rank, on q's device, of one dtype."""
    import torch  # noqa: PLC0415

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != layout.count(",") + 1:
            raise ValueError(f"{name} must be a {layout.count(',') + 1}-d torch tensor {layout}; got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    first = next(iter(tensors.values()))
    dtype = _dtype(first, next(iter(tensors)))
    _check_same(tensors, dtype, first.device)
    return dtype


def _int32(t: Any, name: str, shape: tuple[int, ...], device: Any) -> None:
    import torch  # noqa: PLC0415

    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be a torch.int32 tensor, not {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; q is on {device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _mods(window_size: Any, softcap: float, alibi_slopes: Any, causal: bool, batch: int, heads: int,
          device: Any) -> Mods:
    import torch  # noqa: PLC0415

    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, -1 for unbounded; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries are >= 0, or -1 for unbounded; got {(left, right)}")
    if causal:
        right = 0  # flash_attn: causal is the window's right edge at the diagonal
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: off); got {softcap}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a torch.float32 tensor of shape (heads,) or (batch, heads)")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}); got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device or alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes must be on q's device and contiguous in its last dim")
    return Mods((left, right), softcap, alibi_slopes)


# -- the launch ------------------------------------------------------------------------

def _scales(softmax_scale: float | None, head_dim: int, softcap: float) -> tuple[float, float, float]:
    """(softmax_scale field, scale_log2, softcap_pre) of the forward: launch.softcap_args, with the field 1 under
    softcap (the scale is inside softcap_pre)."""
    scale, scale_log2, softcap_pre = softcap_args(softmax_scale, head_dim, softcap)
    return (1.0 if softcap else scale), scale_log2, softcap_pre


def _launch(cfg: KernelConfig, arch: str, q: Any, k: Any, v: Any, out: Any, lse: Any, *, batch: int,
            seqlen_q: int, seqlen_k: int, total_rows: int, cu_q: Any, cu_k: Any, seqused_k: Any, block_table: Any,
            page_size: int, num_splits: int, mods: Mods, softmax_scale: float | None, lse_strides: tuple[int, int],
            batch_strides: tuple[int, int, int]) -> "_Launch | None":
    """One serving launch (plus the combine when split); returns it with its pointers left out, for a plan to
    repeat. q/out rows: (.., rows, heads, d) views; k, v: (.., keys or page rows, heads_k, d). batch_strides:
    (q/o, k, v) batch (or page) strides."""
    heads, heads_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    blocks, combine_blocks = serve_grids(cfg, batch, heads, heads_k, seqlen_q, total_rows, num_splits)
    if blocks == 0:
        return None
    dev = q.get_device()
    driver.use_device(dev)
    fn, comb = _functions(cfg, arch, driver.primary_context_id(dev))
    scale, scale_log2, softcap_pre = _scales(softmax_scale, d, mods.softcap)
    alibi = mods.alibi
    qb, kb, vb = batch_strides
    fields = (  # ServeParams with its pointers 0 (_POINTERS): _fire fills them
        0, 0, 0, 0, 0,
        qb, q.stride(-3), q.stride(-2), kb, k.stride(-3), k.stride(-2), vb, v.stride(-3), v.stride(-2),
        0 if cu_q is not None else out.stride(0), out.stride(-3), out.stride(-2),
        batch, heads, heads_k, seqlen_q, seqlen_k, scale, scale_log2,
        0, 0, 0, 0, 0, 0, 0,
        0 if block_table is None else block_table.stride(0),
        0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
        lse_strides[0], lse_strides[1], total_rows, page_size, num_splits, mods.window[0], mods.window[1], softcap_pre)
    accum = ((num_splits, total_rows, heads, d), (num_splits, total_rows, heads)) if cfg.split else None
    run = _Launch(dev, fn, comb, blocks, combine_blocks, cfg.threads, fields, accum)
    _fire(run, (q, k, v, out, lse, cu_q, cu_k, seqused_k, block_table, alibi))
    return run


# _SERVE's pointer fields: q k v o lse (0-4), then cu_q cu_k seqused block_table alibi (24-28), o_accum lse_accum (29-30).
_POINTERS = (0, 1, 2, 3, 4, 24, 25, 26, 27, 28, 29, 30)


def _fire(run: "_Launch", tensors: tuple) -> None:
    """Launch `run` (and its combine) on the current stream with the pointers of `tensors` (q, k, v, out, lse,
    cu_q, cu_k, seqused, block_table, alibi; None: 0) and, split, fresh fp32 accumulators."""
    import torch  # noqa: PLC0415

    ptrs = [0 if t is None else t.data_ptr() for t in tensors]
    if run.accum is not None:  # freed after the launch: the caching allocator orders reuse on this stream
        o_accum = torch.empty(run.accum[0], dtype=torch.float32, device=tensors[0].device)
        lse_accum = torch.empty(run.accum[1], dtype=torch.float32, device=tensors[0].device)
        ptrs += [o_accum.data_ptr(), lse_accum.data_ptr()]
    else:
        ptrs += [0, 0]
    fields = list(run.fields)
    for i, ptr in zip(_POINTERS, ptrs):
        fields[i] = ptr
    params = _SERVE.pack(*fields)
    driver.use_device(run.device)
    stream = _current_stream(run.device)
    run.fn.launch((run.blocks, 1, 1), run.threads, params, stream)
    if run.comb is not None:
        run.comb.launch((run.combine_blocks, 1, 1), 32 * COMBINE_WARPS, params, stream)


class _Launch(NamedTuple):
    """A serving launch with its pointers zeroed: what a call with the same shapes, strides and choices repeats."""

    device: int
    fn: Any
    comb: Any
    blocks: int
    combine_blocks: int
    threads: int
    fields: tuple  # _SERVE's fields, pointers 0 (_POINTERS)
    accum: tuple | None  # split-KV: shapes of o_accum and lse_accum


def sm90_config(device: int, head_dim: int, dtype: str, causal: bool, rows: int, seqlen_k: int,
                features: dict[str, bool], window_left: int = -1) -> KernelConfig | None:
    """The sm90 family's kernel for a varlen or window call on Hopper: the tuned one of the nearest problem
    `tune --kind varlen` stored with these features, else the dense kernel `flashgen.attention` would take for
    seqlen_k (tuned, else the default) with the features (varlen: non-persistent; a window alone keeps the
    persistent schedule, which short per-block key loops gain most from); None where the sm80 family's serving
    kernel applies (not Hopper, other features, decode-sized row blocks)."""
    from .tune_varlen import tuned_prefill  # noqa: PLC0415

    wanted = tuple(f for f, on in features.items() if on)
    if _arch_and_slots(device)[0] != "sm90" or not set(wanted) <= set(SM90_FEATURES) or rows <= DECODE_ROWS:
        return None
    tuned = tuned_prefill(device, head_dim, dtype, causal, seqlen_k, features, window_left)
    if tuned is not None and tuned.family == "sm90":
        return tuned
    return _sm90_rule(device, head_dim, dtype, causal, seqlen_k, wanted)


def _sm90_rule(device: int, head_dim: int, dtype: str, causal: bool, seqlen_k: int,
               wanted: tuple[str, ...]) -> KernelConfig:
    """Untuned: the dense kernel for seqlen_k with the features `wanted`."""
    import dataclasses  # noqa: PLC0415

    from .api import _resolver  # noqa: PLC0415

    base = dataclasses.replace(_resolver.kernel(device, head_dim, dtype, causal, seqlen_k, "sm90").config,
                               **dict.fromkeys(SM90_DENSE_KNOBS, False))
    if "varlen" in wanted:  # built non-persistent (so without the persistent-only epilogue overlap)
        base = dataclasses.replace(base, persistent=False, overlap_epilogue=False)
    return _without_spills(dataclasses.replace(base, **dict.fromkeys(wanted, True)))


def untuned_prefill_config(device: int, head_dim: int, dtype: str, causal: bool, max_seqlen_q: int,
                           max_seqlen_k: int, features: dict[str, bool]) -> KernelConfig:
    """What prefill_config takes where nothing is stored for the problem (tune --kind varlen measures it beside
    its winner)."""
    wanted = tuple(f for f, on in features.items() if on)
    arch = _arch_and_slots(device)[0]
    if arch == "sm90" and set(wanted) <= set(SM90_FEATURES) and max_seqlen_q > DECODE_ROWS:
        return _sm90_rule(device, head_dim, dtype, causal, max_seqlen_k, wanted)
    return serve_config(head_dim, dtype, causal, max_seqlen_q, arch, **features)


def prefill_config(device: int, head_dim: int, dtype: str, causal: bool, max_seqlen_q: int, max_seqlen_k: int,
                   features: dict[str, bool], window_left: int = -1) -> KernelConfig:
    """The kernel of an unsplit varlen call or a dense call with score modifiers: sm90_config's on Hopper, else
    the tuned sm80-family one of the nearest stored problem, else serve_config's tiles."""
    cfg = sm90_config(device, head_dim, dtype, causal, max_seqlen_q, max_seqlen_k, features, window_left)
    if cfg is None and max_seqlen_q > DECODE_ROWS:
        from .tune_varlen import tuned_prefill  # noqa: PLC0415

        cfg = tuned_prefill(device, head_dim, dtype, causal, max_seqlen_k, features, window_left)
        cfg = cfg if cfg is not None and cfg.family == "sm80" else None
    return cfg or serve_config(head_dim, dtype, causal, max_seqlen_q, _arch_and_slots(device)[0], **features)


def launch_prefill(cfg: KernelConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, cu_q: Any, cu_k: Any,
                   max_seqlen_q: int, max_seqlen_k: int, num_splits: int, mods: Mods,
                   softmax_scale: float | None) -> None:
    """One varlen or dense-with-modifiers launch of `cfg` (either family): q, k, v, out packed (total, heads, d)
    with cu_q / cu_k (lse (heads, total_q)), or dense (batch, seqlen, heads, d) with cu_q None (lse (batch,
    heads, seqlen_q)); lse may be None."""
    if cu_q is not None:
        batch, views = cu_q.shape[0] - 1, tuple(t.unsqueeze(0) for t in (q, k, v, out))
    else:
        batch, views = q.shape[0], (q, k, v, out)
    if cfg.family == "sm90":
        _launch_sm90(cfg, *views, lse, num_seqs=batch, max_seqlen_q=max_seqlen_q, cu_q=cu_q, cu_k=cu_k, mods=mods,
                     softmax_scale=softmax_scale)
        return
    heads = q.shape[-2]
    if cu_q is not None:
        total = q.shape[0]
        shape = dict(total_rows=total, lse_strides=(0, total), batch_strides=(0, 0, 0))
    else:
        shape = dict(total_rows=batch * max_seqlen_q, lse_strides=(heads * max_seqlen_q, max_seqlen_q),
                     batch_strides=(q.stride(0), k.stride(0), v.stride(0)))
    _launch(cfg, _arch_and_slots(q.get_device())[0], *views, lse, batch=batch, seqlen_q=max_seqlen_q,
            seqlen_k=max_seqlen_k, cu_q=cu_q, cu_k=cu_k, seqused_k=None, block_table=None, page_size=0,
            num_splits=num_splits, mods=mods, softmax_scale=softmax_scale, **shape)


@functools.lru_cache(maxsize=256)
def _without_spills(cfg: KernelConfig) -> KernelConfig:
    """`cfg`, or the family's default tiles with its features where the features' registers make `cfg`
    spill or serialize its wgmmas (ptxas's report; some tuned tiles with large block_n)."""
    import dataclasses  # noqa: PLC0415
    import re  # noqa: PLC0415

    from .config import default_config  # noqa: PLC0415

    kern = _compiled(cfg, target_for("sm90", cfg.family))
    if not kern.resources.spills and not re.search(r"C751[239]", kern.ptxas_log):
        return cfg
    base = default_config(cfg.head_dim, cfg.dtype, cfg.causal, "sm90", "sm90")
    if cfg.varlen:
        base = dataclasses.replace(base, persistent=False, overlap_epilogue=False)
    return dataclasses.replace(base, **dict.fromkeys(cfg.features, True))


def _launch_sm90(cfg: KernelConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, num_seqs: int, max_seqlen_q: int,
                 cu_q: Any, cu_k: Any, mods: Mods, softmax_scale: float | None) -> None:
    """One sm90-family launch: q, k, v, out as (batch, rows, heads, d) views (varlen: the packed tensors as one
    batch, cu_q / cu_k their offsets); lse (batch, heads, rows) or varlen's (heads, total_q), or None."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dev = q.get_device()
    driver.use_device(dev)
    scale, scale_log2 = scale_args(softmax_scale, d)
    fwd = _FWD.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], b, h, hk, sq, sk, scale,
                    scale_log2)
    maps = b"".join(driver.tensor_map(cfg.dtype, t.data_ptr(), *tmap_box(t.stride(), d, n, heads, b, ELEM_BYTES,
                                                                           cfg.smem_w, rows), cfg.row_bytes)
                    for t, n, heads, rows in ((q, sq, h, cfg.block_m), (k, sk, hk, cfg.block_n), (v, sk, hk, cfg.block_n)))
    tail = _SM90_SERVE_TAIL.pack(0 if cu_q is None else cu_q.data_ptr(), 0 if cu_k is None else cu_k.data_ptr(),
                                 *mods.window, num_seqs, max_seqlen_q)
    params = (maps + fwd + tail).ljust(_SM90_BYTES, b"\0")
    if max_seqlen_q * h * num_seqs:
        grid = cfg.grid(num_seqs, h, max_seqlen_q, _arch_and_slots(dev)[1] if cfg.persistent else None)
        fn, _ = _functions(cfg, "sm90", driver.primary_context_id(dev))
        fn.launch(grid, cfg.threads, params, _current_stream(dev))


@functools.lru_cache(maxsize=512)
def _functions(cfg: KernelConfig, arch: str, ctx: int) -> tuple[driver.Function, driver.Function | None]:
    """The main kernel and (split-KV) the combine of `cfg`, loaded in context `ctx`."""
    kern, names = _compiled(cfg, target_for(arch, cfg.family)), cfg.kernel_names
    main = driver.get_function(kern.cubin, names["main"], cfg.smem_bytes, f"{kern.digest}:main", ctx)
    comb = driver.get_function(kern.cubin, names["combine"], 0, f"{kern.digest}:combine", ctx) if cfg.split else None
    return main, comb


def _arch_and_slots(device: int) -> tuple[str, int]:
    info = driver.device_info(device)
    return info.arch, info.sm_count


def _want_split(num_splits: int, cfg_rows_tiles: int, n_blocks: int, cfg: KernelConfig, sm_count: int, arch: str) -> int:
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: flashgen chooses); got {num_splits}")
    if num_splits == 0:
        return choose_splits(cfg_rows_tiles, _slots(cfg, sm_count, arch), n_blocks)
    return min(num_splits, MAX_SPLITS)


NO_BACKWARD = "no backward for KV-cache attention (an inference call)"


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                     return_lse: bool = False, num_splits: int = 1, validate: bool = True,
                     deterministic: bool = False) -> Any:
    """Attention over a packed batch of sequences of different lengths (flash_attn_varlen_func).

    q: (total_q, heads, head_dim); k, v: (total_k, heads_k, head_dim); cu_seqlens_q/_k: int32
    (batch + 1,) offsets, from 0 to total; sequence b is q[cu_q[b]:cu_q[b+1]] against
    k[cu_k[b]:cu_k[b+1]], each with its own bottom-right causal alignment; empty sequences
    are allowed. Returns out like q, and with return_lse also lse (heads, total_q) fp32.
    Differentiable (packed training): with autograd the call goes through the `flashgen::attention_varlen`
    operator, whose backward has the same features (window, softcap, ALiBi); deterministic=True gives
    bit-identical gradients run to run. validate=False skips the checks that read the offsets back (one
    host sync per call): for loops over trusted inputs; CUDA-graph capture skips them by itself."""
    import torch  # noqa: PLC0415

    _checked_dtype({"q": q, "k": k, "v": v}, "(total, heads, head_dim)")
    total_q, heads, d = q.shape
    total_k, heads_k, _ = k.shape
    _check_heads(q, k, v, d, heads, heads_k)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    batch = cu_seqlens_q.shape[0] - 1 if hasattr(cu_seqlens_q, "shape") and cu_seqlens_q.dim() == 1 else -1
    if batch < 0:
        raise ValueError("cu_seqlens_q must be a 1-d int32 tensor of batch + 1 offsets")
    _int32(cu_seqlens_q, "cu_seqlens_q", (batch + 1,), q.device)
    _int32(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), q.device)
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    if validate and not torch.cuda.is_current_stream_capturing():  # one small copy: offsets sound before any launch
        _check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q)
        _check_offsets(cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k)
    mods = _mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device)
    if _wants_grad(q, k, v) or traced(q):
        from . import ops  # noqa: PLC0415  (the differentiable, traceable operator)

        _scale_for_grad(softmax_scale, q, k, v)
        out, lse = ops.attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                           softmax_scale, *mods.window, mods.softcap, mods.alibi, deterministic)
    else:
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, mods, return_lse, num_splits)
    return (out, lse) if return_lse else out


def traced(q: Any) -> bool:
    """Whether the call goes through the operator for its fake implementation: torch.compile, fake or meta tensors."""
    import torch  # noqa: PLC0415

    return torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta


def _wants_grad(q: Any, k: Any, v: Any) -> bool:
    import torch  # noqa: PLC0415

    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _scale_for_grad(softmax_scale: float | None, q: Any, k: Any, v: Any) -> None:
    if softmax_scale is not None and not softmax_scale > 0:
        refuse_grad(q, k, v, f"the backward needs softmax_scale > 0, not {softmax_scale!r}")


def varlen_forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, softmax_scale: float | None, mods: Mods, want_lse: bool = True,
                   num_splits: int = 1) -> tuple[Any, Any]:
    """(out, lse or None) of checked varlen arguments: the body of `attention_varlen` and of its operator."""
    import torch  # noqa: PLC0415

    total_q, heads, d = q.shape
    heads_k = k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    dtype = _dtype(q, "q")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device) if want_lse else None
    if total_q and heads and batch:
        arch, sm_count = _arch_and_slots(q.get_device())
        features = dict(varlen=True, **_mod_features(mods, causal))
        cfg = serve_config(d, dtype, causal, max_seqlen_q, arch, **features)
        tiles = serve_grids(cfg, batch, heads, heads_k, max_seqlen_q, total_q, 1)[0]  # row blocks, one split
        splits = _want_split(num_splits, tiles, -(-max_seqlen_k // cfg.block_n), cfg, sm_count, arch)
        if splits > 1:
            cfg = serve_config(d, dtype, causal, max_seqlen_q, arch, split=True, **features)
        else:
            cfg = prefill_config(q.get_device(), d, dtype, causal, max_seqlen_q, max_seqlen_k, features, mods.window[0])
        launch_prefill(cfg, q, k, v, out, lse, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, num_splits=splits, mods=mods, softmax_scale=softmax_scale)
    elif lse is not None:
        lse.fill_(math.inf)  # rows that see no key
    return out, lse


def has_mods(window_size: Any, softcap: float, alibi_slopes: Any, causal: bool) -> bool:
    """Whether a dense call's score modifiers need the serving kernels (a window that bounds more than causal,
    softcap, ALiBi); the plain kernels take it otherwise."""
    try:
        window = tuple(int(x) for x in window_size)
    except (TypeError, ValueError):
        return True  # _mods explains what is wrong
    return len(window) != 2 or any(mod_features(window, float(softcap), alibi_slopes is not None, causal).values())


def dense_mods_forward(q: Any, k: Any, v: Any, causal: bool, softmax_scale: float | None, mods: Mods,
                       want_lse: bool = True) -> tuple[Any, Any]:
    """(out, lse or None) of dense (batch, seqlen, heads, head_dim) q, k, v with score modifiers (window,
    softcap, ALiBi): the serving kernel without varlen; `flashgen.attention`'s body for such calls."""
    import torch  # noqa: PLC0415

    batch, seqlen_q, heads, d = q.shape
    seqlen_k = k.shape[1]
    dtype = _dtype(q, "q")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if want_lse else None
    if batch * seqlen_q * heads == 0:
        return out, lse
    cfg = prefill_config(q.get_device(), d, dtype, causal, seqlen_q, seqlen_k, _mod_features(mods, causal),
                         mods.window[0])
    launch_prefill(cfg, q, k, v, out, lse, cu_q=None, cu_k=None, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                   num_splits=1, mods=mods, softmax_scale=softmax_scale)
    return out, lse


def check_dense(q: Any, k: Any, v: Any, window_size: Any, softcap: float, alibi_slopes: Any,
                causal: bool) -> Mods:
    """`flashgen.attention`'s checks for a call with score modifiers; returns them."""
    _checked_dtype({"q": q, "k": k, "v": v}, "(batch, seqlen, heads, head_dim)")
    batch, _, heads, d = q.shape
    _check_heads(q, k, v, d, heads, k.shape[2])
    if tuple(v.shape) != tuple(k.shape) or k.shape[0] != batch:
        raise ValueError(f"k and v must have one shape (batch={batch}, seqlen_k, heads_k, head_dim={d}); got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    return _mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device)


def _mod_features(mods: Mods, causal: bool) -> dict[str, bool]:
    return mod_features(mods.window, mods.softcap, mods.alibi is not None, causal)


def _check_heads(q: Any, k: Any, v: Any, d: int, heads: int, heads_k: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported; choose one of {HEAD_DIMS}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k and v must share head_dim; got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"heads={heads} must be a multiple of heads_k={heads_k} (GQA/MQA)")


def _check_offsets(cu: Any, name: str, total: int, max_len: int) -> None:
    vals = cu.tolist()
    if vals[0] != 0 or vals[-1] != total:
        raise ValueError(f"{name} must run from 0 to {total} (the packed length); got {vals[0]} .. {vals[-1]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing")
    if lens and max(lens) > max_len:
        raise ValueError(f"a sequence of {max(lens)} tokens is longer than max_seqlen ({max_len}) for {name}")


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                           cache_seqlens: Any = None, block_table: Any = None, causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: Any = None, num_splits: int = 0,
                           return_lse: bool = False, validate: bool = True) -> Any:
    """Attention of new queries against a KV cache (flash_attn_with_kvcache).

    q: (batch, seqlen_q, heads, head_dim). k_cache, v_cache: (batch, seqlen_cache, heads_k, head_dim),
    or paged (num_pages, page_size, heads_k, head_dim) addressed through block_table (batch, max_pages)
    int32. cache_seqlens: int or int32 (batch,) tokens already in each cache (None: all of a contiguous
    cache). k, v (batch, seqlen_new, heads_k, head_dim), if given, are written into the cache in place
    at cache_seqlens before attending. num_splits: key ranges per query block (split-KV); 0 lets
    flashgen choose. Returns out like q, and with return_lse also lse (batch, heads, seqlen_q) fp32.
    validate=False skips the checks that read cache_seqlens and block_table back (one host sync per
    call; out-of-range values then read or write outside the cache): for decode loops over trusted
    inputs; CUDA-graph capture skips them by itself. A call that repeats an earlier one's shapes, strides and
    options with validate=False (a decode loop) reuses its checks and choices (a plan): pointers, then launch."""
    import torch  # noqa: PLC0415

    key = _plan_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_size,
                    softcap, alibi_slopes, num_splits, return_lse, validate)
    plan = _kv_plans.get(key) if key is not None else None
    if plan is not None:
        done = _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, return_lse)
        if done is not None:
            return done if return_lse else done[0]
    dtype = _checked_dtype({"q": q, "k_cache": k_cache, "v_cache": v_cache}, "(batch, rows, heads, head_dim)")
    batch, seqlen_q, heads, d = q.shape
    heads_k = k_cache.shape[2]
    _check_heads(q, k_cache, v_cache, d, heads, heads_k)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}; got {tuple(v_cache.shape)}")
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor (batch={batch}, max_pages)")
        _int32(block_table, "block_table", tuple(block_table.shape), q.device)
        page_size = k_cache.shape[1]
        if page_size % 16:
            raise ValueError(f"page_size (k_cache.shape[1]) must be a multiple of 16; got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch {batch} (or pass block_table for a paged cache)")
        page_size, capacity = 0, k_cache.shape[1]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is None:
        if paged:
            raise ValueError("a paged cache needs cache_seqlens (the tokens each sequence holds)")
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    else:
        _int32(cache_seqlens, "cache_seqlens", (batch,), q.device)
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append, or neither")
    if k is not None:
        if tuple(k.shape) != tuple(v.shape) or k.dim() != 4 or k.shape[0] != batch or tuple(k.shape[2:]) != (heads_k, d):
            raise ValueError(f"k and v to append must both be (batch={batch}, seqlen_new, heads_k={heads_k}, "
                             f"head_dim={d}); got {tuple(k.shape)} and {tuple(v.shape)}")
        if _dtype(k, "k") != dtype or _dtype(v, "v") != dtype or k.device != q.device or v.device != q.device:
            raise TypeError("k and v to append must have q's dtype and device")
        seqlen_new = k.shape[1]
    mods = _mods(window_size, softcap, alibi_slopes, causal, batch, heads, q.device)
    longest = capacity  # the most keys a sequence has: bounds the split-KV choice
    if validate and not torch.cuda.is_current_stream_capturing():  # one small copy: no access outside the cache
        longest = _check_cache(cache_seqlens, seqlen_new, capacity, block_table, k_cache.shape[0])
    refuse_grad(q, k_cache, v_cache, NO_BACKWARD)
    if k is not None:
        refuse_grad(q, k, v, NO_BACKWARD)
    if seqlen_new:
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table, page_size)
    seqused = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
    out = q.new_empty(q.shape)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if batch * seqlen_q * heads == 0:
        return (out, lse) if return_lse else out
    arch, sm_count = _arch_and_slots(q.get_device())
    group = heads // heads_k
    pack = group > 1 and alibi_slopes is None
    rows = seqlen_q * (group if pack else 1)
    features = dict(varlen=True, paged=paged, pack_gqa=pack, **_mod_features(mods, causal))
    tuned = None
    if num_splits == 0 and seqlen_q == 1 and not any(_mod_features(mods, causal).values()):
        from .tune_decode import tuned_decode  # noqa: PLC0415

        tuned = tuned_decode(q.get_device(), d, dtype, heads, heads_k, batch, capacity, page_size)
    if tuned is not None:  # the tile and split count measured fastest for the nearest decode problem
        cfg, splits = tuned
    else:
        cfg = serve_config(d, dtype, causal, rows, arch, **features)
        n_blocks = -(-longest // cfg.block_n)
        tiles = serve_grids(cfg, batch, heads, heads_k, seqlen_q, batch * seqlen_q, 1)[0]  # row blocks, one split
        splits = _want_split(num_splits, tiles, n_blocks, cfg, sm_count, arch)
        if splits > 1:
            cfg = serve_config(d, dtype, causal, rows, arch, split=True, **features)
    launched = kvcache_launch(cfg, splits, q, k_cache, v_cache, out, lse, seqused, block_table, mods, softmax_scale)
    if key is not None and launched is not None:
        if len(_kv_plans) > 256:
            _kv_plans.clear()
        _kv_plans[key] = _KVPlan(launched, None if lse is None else tuple(lse.shape))
    return (out, lse) if return_lse else out


class _KVPlan(NamedTuple):
    launch: _Launch
    lse_shape: tuple | None


_kv_plans: dict[tuple, _KVPlan] = {}


def _plan_key(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, causal: bool,
              softmax_scale: float | None, window_size: Any, softcap: float, alibi_slopes: Any, num_splits: int,
              return_lse: bool, validate: bool) -> tuple | None:
    """What an attention_with_kvcache call's checks and choices depend on, for the calls a plan can repeat (plain
    tensors, validate=False, no append, no ALiBi, no gradient wanted, cache_seqlens a tensor); None for the others.
    With num_splits=0 the tuned store's stamp is part of it: a store change makes new plans."""
    import torch  # noqa: PLC0415

    if validate or k is not None or v is not None or alibi_slopes is not None or not isinstance(cache_seqlens,
                                                                                               torch.Tensor):
        return None
    if block_table is not None and not isinstance(block_table, torch.Tensor):  # the full path says what is wrong
        return None
    if type(q) is not torch.Tensor or type(k_cache) is not torch.Tensor or type(v_cache) is not torch.Tensor:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return None
    try:
        window = (int(window_size[0]), int(window_size[1]))
    except (TypeError, ValueError, IndexError):
        return None
    table = None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                               block_table.device)
    stamp = None
    if num_splits == 0 and q.is_cuda:
        from .ops import _gpu, _store_stamp  # noqa: PLC0415

        stamp = _store_stamp(*_gpu(q.get_device()))
    return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, cache_seqlens.shape, cache_seqlens.stride(),
            cache_seqlens.dtype, cache_seqlens.device, table, bool(causal), softmax_scale, window, float(softcap),
            num_splits, bool(return_lse), stamp)


def _run_plan(plan: _KVPlan, q: Any, k_cache: Any, v_cache: Any, seqused: Any, block_table: Any,
              return_lse: bool) -> tuple[Any, Any] | None:
    """(out, lse) of a call by its plan; None where a base pointer is not 16-byte aligned (the full path says why)."""
    import torch  # noqa: PLC0415

    qp, kp, vp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    if (qp | kp | vp) & 15:
        return None
    out = q.new_empty(q.shape)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    _fire(plan.launch, (q, k_cache, v_cache, out, lse, None, None, seqused, block_table, None))
    return out, lse


def kvcache_launch(cfg: KernelConfig, splits: int, q: Any, k_cache: Any, v_cache: Any, out: Any, lse: Any,
                   seqused: Any, block_table: Any, mods: Mods = Mods(),
                   softmax_scale: float | None = None) -> "_Launch | None":
    """One KV-cache attention launch with a given kernel and split count (checked arguments; `seqused`: the keys
    each sequence holds, int32 (batch,)): `attention_with_kvcache`'s and the decode tuner's (flashgen.tune_decode)."""
    batch, seqlen_q, heads = q.shape[:3]
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    return _launch(cfg, _arch_and_slots(q.get_device())[0], q, k_cache, v_cache, out, lse, batch=batch, seqlen_q=seqlen_q,
                   seqlen_k=capacity, total_rows=batch * seqlen_q, cu_q=None, cu_k=None, seqused_k=seqused,
                   block_table=block_table, page_size=page_size, num_splits=splits, mods=mods,
                   softmax_scale=softmax_scale, lse_strides=(heads * seqlen_q, seqlen_q),
                   batch_strides=(q.stride(0), k_cache.stride(0), v_cache.stride(0)))


def _check_cache(cache_seqlens: Any, seqlen_new: int, capacity: int, block_table: Any, num_pages: int) -> int:
    """Raise if a sequence would read or write outside its cache; returns the longest sequence after the append."""
    import torch  # noqa: PLC0415

    parts = [cache_seqlens.min().view(1), cache_seqlens.max().view(1)]
    if block_table is not None and block_table.numel():  # only the pages the sequences use are read
        page_size = capacity // block_table.shape[1]
        used = (cache_seqlens.long() + seqlen_new + page_size - 1) // page_size
        live = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < used[:, None]
        used_pages = block_table.masked_fill(~live, 0)
        parts += [used_pages.min().view(1).to(torch.int32), used_pages.max().view(1).to(torch.int32)]
    vals = torch.cat(parts).tolist()
    if vals[0] < 0:
        raise ValueError(f"cache_seqlens has a negative entry ({vals[0]})")
    if vals[1] + seqlen_new > capacity:
        raise ValueError(f"the cache holds {capacity} tokens per sequence; cache_seqlens up to {vals[1]} plus "
                         f"{seqlen_new} appended do not fit")
    if len(vals) > 2 and vals[1] + seqlen_new > 0 and (vals[2] < 0 or vals[3] >= num_pages):
        raise ValueError(f"block_table entries must lie in [0, {num_pages}); got {vals[2]} .. {vals[3]}")
    return vals[1] + seqlen_new


def _append(k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, page_size: int) -> None:
    """Write k, v at positions cache_seqlens[b] + [0, seqlen_new) of each sequence's cache, in place."""
    import torch  # noqa: PLC0415

    batch, n = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(n, device=k.device)[None, :]  # (batch, n)
    if block_table is None:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, n)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        pages = torch.gather(block_table.long(), 1, pos // page_size)
        k_cache[pages, pos % page_size] = k
        v_cache[pages, pos % page_size] = v


__all__ = ["attention_varlen", "attention_with_kvcache", "choose_splits", "serve_config", "serve_grids"]
