"""The serving forward kernels: varlen batches and dense calls with score modifiers (prefill), and KV caches
(contiguous or paged, decode) with split-KV, in kernels generated with exactly the features the call uses
(templates/sm80/serve.cuh.j2, or on Hopper for varlen and window the sm90 family's templates: a feature the call
does not use is not in the code). Each launcher packs its parameter struct and launches on torch's current
stream; split-KV launches add the `_combine` kernel. The configuration rules that need no tuned store live here
too (serve_config, choose_splits); flashgen.resolve picks a tuned kernel where the store has one.
"""
from __future__ import annotations

import functools
import itertools
import math
import struct
from typing import Any, NamedTuple

from .. import abi, driver, grids
from ..checks import Mods
from ..compile import target_for
from ..config import (ARCHS, COMBINE_WARPS, DEFAULT_TILES, ELEM_BYTES, MAX_SPLITS, BwdConfig, ConfigError, KernelConfig,
                      mod_features)
from ..launch import FWD, SM90_BYTES, capturing, current_stream, scale_args, softcap_args, tmap_box
from ..modifiers import MAX_CAPTURED, MAX_RANK, ModifierError, lookup
from .bad_inputs import error_word
from .dense import compiled_kernel

SERVE_PARAMS = abi.SERVE.struct
_MOD_TAIL = abi.SERVE_MOD.tail("t0.ptr")  # the captured tensors' slots after ServeParams (ServeModParams)
_SM90_SERVE_TAIL = abi.SM90_SERVE_FWD.tail("cu_seqlens_q")  # what follows the tensor maps and FwdParams
_SM90_SERVE_MOD_TAIL = abi.SM90_SERVE_MOD_FWD.tail("cu_seqlens_q")  # the same with a modifier's slots after it
# Decode tiles (at most 32 query rows per sequence, packed): (block_m, block_n, num_warps, num_stages)
# by head dim. Two warps even for 16 rows: one warp alone holds the K/V copies of a tile and its
# accumulators, and spills at d128 and d256 where pages are smaller than a tile.
_DECODE_TILES = {32: (32, 128, 2, 3), 64: (32, 128, 2, 3), 96: (32, 32, 2, 3), 128: (32, 64, 2, 3), 256: (32, 32, 2, 3)}
DECODE_ROWS = 32
# Dense tiles of a kernel with a score_mod or mask_mod: eight warps, 32 keys a tile (d64: 64; d256: 64 rows, four
# warps). A modifier's reads and arithmetic per score element need registers DEFAULT_TILES' tiles do not have left,
# and ptxas spills a few bytes in some others (each choice here builds FlexAttention's examples spill-free for
# sm_80 and sm_90a: tests/test_modifier_kernels.py); tuning them per modifier is left to the tuner.
_MODIFIER_TILES = {32: [(128, 32, 8, 2)], 64: [(128, 64, 8, 2)], 96: [(128, 32, 8, 2)], 128: [(128, 32, 8, 2)],
                   256: [(64, 32, 4, 2), (64, 32, 4, 1)]}


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
def serve_config(head_dim: int, dtype: str, causal: bool, rows: int, arch: str, **features: Any) -> KernelConfig:
    """The configuration for a serving call: decode tiles when a sequence has at most 32 (packed)
    rows, else the dense default tiles of the sm80 family, with exactly `features` compiled in. With a
    score_mod / mask_mod digest among them: the dense tiles (_MODIFIER_TILES at d256) at every length."""
    reason = ""
    # A kernel with a modifier takes the dense tiles at every length: the decode tiles' two warps have no registers
    # left for a modifier's reads and arithmetic at most head dims (ptxas spills).
    modified = bool(features.get("score_mod") or features.get("mask_mod") or features.get("block_map"))
    if rows <= DECODE_ROWS and not modified:  # fewer stages where the GPU's shared memory is smaller (sm86/sm89: 99 KB)
        bm, bn, w, stages = _DECODE_TILES[head_dim]
        for s in range(stages, 0, -1):
            cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, "sm80", **features)
            reason = cfg.unfit_reason(arch)
            if reason is None:
                return cfg
    for bm, bn, w, s in (_MODIFIER_TILES.get(head_dim, DEFAULT_TILES[head_dim]) if modified else DEFAULT_TILES[head_dim]):
        cfg = KernelConfig(head_dim, dtype, causal, bm, bn, w, s, "sm80", **features)
        reason = cfg.unfit_reason(arch)
        if reason is None:
            return cfg
    raise ValueError(f"no serving configuration fits {arch} for head_dim={head_dim}: {reason}")


def decode_config(head_dim: int, dtype: str, tile: tuple[int, ...], paged: bool, split: bool,
                  fused_combine: bool = False) -> KernelConfig:
    """A decode kernel: `tile` (block_m, block_n, warps, stages[, key_warps]), pack-GQA, varlen lengths; split-KV with
    its partial results merged by a combine kernel or (fused_combine) by each row block's last split. key_warps (1
    if left out): the warps splitting each key tile, num_warps counting them all."""
    bm, bn, w, s, kw = (*tile, 1)[:5]
    return KernelConfig(head_dim, dtype, False, bm, bn, w, s, varlen=True, paged=paged, pack_gqa=True, split=split,
                        fused_combine=fused_combine, key_warps=kw)


def serve_grids(cfg: KernelConfig, batch: int, heads: int, heads_k: int, seqlen_q: int, total_rows: int,
                num_splits: int) -> tuple[int, int]:
    """Blocks of the main kernel and of the split-KV combine (0 without split), blocks of cfg.threads
    and 32 * COMBINE_WARPS threads. The main grid is how locate() in templates/sm80/serve.cuh.j2
    unfolds blockIdx.x: m-blocks of seqlen_q rows (seqlen_q * heads / heads_k packed (row, head) pairs
    with pack_gqa) x heads (KV heads with pack_gqa) x batch x splits; the combine runs a warp per
    (row, head) of total_rows * heads. The exported launch header's grid_x and combine_grid_x are this rule in C++."""
    main = grids.SERVE.bind(BLOCK_M=cfg.block_m, PACK_GQA=cfg.pack_gqa, SPLIT=cfg.split)
    combine = grids.COMBINE.bind(SPLIT=cfg.split, COMBINE_WARPS=COMBINE_WARPS)
    return main(seqlen_q, heads, heads_k, batch, num_splits), combine(total_rows, heads)


def _slots(cfg: KernelConfig, sm_count: int, arch: str) -> int:
    """Blocks of `cfg` resident on the GPU at once (shared memory and the 32-block cap bound it)."""
    per_sm = min(32, max(1, ARCHS[arch].smem_per_block // max(cfg.smem_bytes, 1)), 2048 // cfg.threads)
    return sm_count * per_sm


def _scales(softmax_scale: float | None, head_dim: int, softcap: float) -> tuple[float, float, float]:
    """(softmax_scale field, scale_log2, softcap_pre) of the forward: launch.softcap_args, with the field 1 under
    softcap (the scale is inside softcap_pre)."""
    scale, scale_log2, softcap_pre = softcap_args(softmax_scale, head_dim, softcap)
    return (1.0 if softcap else scale), scale_log2, softcap_pre


def _launch(cfg: KernelConfig, arch: str, q: Any, k: Any, v: Any, out: Any, lse: Any, *, batch: int,
            seqlen_q: int, seqlen_k: int, total_rows: int, cu_q: Any, cu_k: Any, seqused_k: Any, block_table: Any,
            page_size: int, num_splits: int, mods: Mods, softmax_scale: float | None, lse_strides: tuple[int, int],
            batch_strides: tuple[int, int, int]) -> "ServeLaunch | None":
    """One serving launch (plus the combine when split); returns it with its pointers left out, for a plan to
    repeat. q/out rows: (.., rows, heads, d) views; k, v: (.., keys or page rows, heads_k, d). batch_strides:
    (q/o, k, v) batch (or page) strides. The kernel's bounds come from the shapes: the pages of a paged k,
    seqlen_k as a cache's capacity, the packed rows of q and k (varlen)."""
    run = serve_launch(cfg, arch, q, k, v, out, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                        total_rows=total_rows, cu_q=cu_q, block_table=block_table, page_size=page_size,
                        num_splits=num_splits, mods=mods, softmax_scale=softmax_scale, lse_strides=lse_strides,
                        batch_strides=batch_strides)
    if run is not None:
        fire_serve(run, (q, k, v, out, lse, cu_q, cu_k, seqused_k, block_table, mods.alibi, kernel_sinks(mods.sinks)))
    return run


def serve_launch(cfg: KernelConfig, arch: str, q: Any, k: Any, v: Any, out: Any, *, batch: int, seqlen_q: int,
                  seqlen_k: int, total_rows: int, cu_q: Any, block_table: Any, page_size: int, num_splits: int,
                  mods: Mods, softmax_scale: float | None, lse_strides: tuple[int, int],
                  batch_strides: tuple[int, int, int]) -> "ServeLaunch | None":
    """_launch's ServeLaunch, not fired; None where it has no blocks."""
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
    fields = (  # ServeParams with its pointers 0: fire_serve fills them
        0, 0, 0, 0, 0,
        qb, q.stride(-3), q.stride(-2), kb, k.stride(-3), k.stride(-2), vb, v.stride(-3), v.stride(-2),
        0 if cu_q is not None else out.stride(0), out.stride(-3), out.stride(-2),
        batch, heads, heads_k, seqlen_q, seqlen_k, scale, scale_log2,
        0, 0, 0, 0, 0, 0, 0,
        0 if block_table is None else block_table.stride(0),
        0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
        lse_strides[0], lse_strides[1], total_rows, page_size, num_splits, mods.window[0], mods.window[1], softcap_pre,
        k.shape[-4] if block_table is not None else 0, seqlen_k, q.shape[-3], k.shape[-3], error_word(dev), 0, 0)
    # split-KV: floats of o_accum and lse_accum; fused_combine: an arrival counter per row block (blocks per split)
    accum = ((num_splits * total_rows * heads * d, num_splits * total_rows * heads,
              blocks // num_splits if cfg.fused_combine else 0) if cfg.split else None)
    return ServeLaunch(dev, fn, comb, blocks, combine_blocks, cfg.threads, fields, accum,
                       modifier_tail(cfg, mods, dev, batch, heads) if cfg.modified else b"", programmatic=cfg.split)


# The pointers filled per call (the error word is per device): the tensors' and the split-KV accumulators'.
_TENSOR_POINTERS = tuple(abi.SERVE.index(f) for f in ("f.q", "f.k", "f.v", "f.o", "f.lse", "cu_seqlens_q",
                                                       "cu_seqlens_k", "seqused_k", "block_table", "alibi_slopes",
                                                       "sinks"))
_ACCUM_POINTERS = (abi.SERVE.index("o_accum"), abi.SERVE.index("lse_accum"), abi.SERVE.index("tile_counts"))


def kernel_sinks(sinks: Any) -> Any:
    """The sinks as the kernels read them: fp32, contiguous (None stays None)."""
    return None if sinks is None else sinks.detach().float().contiguous()


def fire_serve(run: "ServeLaunch", tensors: tuple) -> None:
    """Launch `run` (and its combine) on the current stream with the pointers of `tensors` (q, k, v, out, lse,
    cu_q, cu_k, seqused, block_table, alibi, sinks (fp32); None: 0) and, split, fp32 accumulators (_workspace)."""
    fields = list(run.fields)
    for i, t in zip(_TENSOR_POINTERS, tensors, strict=True):
        fields[i] = 0 if t is None else t.data_ptr()
    driver.use_device(run.device)
    stream = current_stream(run.device)
    if run.accum is not None:
        o_floats, lse_floats, counters = run.accum
        fresh = capturing()
        scratch = _workspace(run.device, stream, o_floats + lse_floats, fresh)  # alive past the launches
        fields[_ACCUM_POINTERS[0]], fields[_ACCUM_POINTERS[1]] = scratch.data_ptr(), scratch.data_ptr() + 4 * o_floats
        fields[_ACCUM_POINTERS[2]] = _tile_counters(run.device, stream, counters, fresh).data_ptr() if counters else 0
    else:
        fields[_ACCUM_POINTERS[0]] = fields[_ACCUM_POINTERS[1]] = fields[_ACCUM_POINTERS[2]] = 0
    params = SERVE_PARAMS.pack(*fields)
    run.fn.launch((run.blocks, 1, 1), run.threads, params + run.tail, stream, run.programmatic)
    if run.comb is not None:  # the combine takes ServeParams alone: ServeModParams's prefix
        run.comb.launch((run.combine_blocks, 1, 1), 32 * COMBINE_WARPS, params, stream, run.programmatic)


# Split-KV accumulators kept per (device, stream): the launches on one stream run in order, so each call's
# combine has read them before the next call's main kernel writes them. One allocation less per decode step,
# which is most of a small step's cost. Inside a CUDA-graph capture each launch gets its own (the graph's pool
# keeps it), so a replay never shares them with eager calls.
_WORKSPACE_KEEP = 64 << 20  # bytes: larger accumulators are allocated per call, not held
_workspaces: dict[tuple[int, int], Any] = {}


def _workspace(device: int, stream: int, floats: int, fresh: bool) -> Any:
    """`floats` fp32 of scratch for a launch on `stream`: held for the next launches there, or (`fresh`: a capture;
    or large) new, freed once the caller's launches are queued (the caching allocator orders its reuse on the
    stream)."""
    if fresh or 4 * floats > _WORKSPACE_KEEP:
        return _cuda_tensor("empty", floats, "float32", device)
    held = _workspaces.get((device, stream))
    if held is None or held.numel() < floats:
        held = _workspaces[device, stream] = _cuda_tensor("empty", floats, "float32", device)
    return held


# fused_combine's arrival counters, one per row block, kept per (device, stream) apart from the accumulators (whose
# layout changes from call to call): zero when allocated, and every launch leaves them zero (the last split of a
# row block resets its counter). Inside a capture each launch gets zeroed ones of its own, as the accumulators.
_counters: dict[tuple[int, int], Any] = {}


def _tile_counters(device: int, stream: int, n: int, fresh: bool) -> Any:
    """`n` int32 arrival counters, all zero, for a fused-combine launch on `stream` (`fresh`: a capture's own)."""
    if fresh:
        return _cuda_tensor("zeros", n, "int32", device)
    held = _counters.get((device, stream))
    if held is None or held.numel() < n:
        held = _counters[device, stream] = _cuda_tensor("zeros", n, "int32", device)
    return held


def _cuda_tensor(make: str, n: int, dtype: str, device: int) -> Any:
    """torch.empty or torch.zeros of `n` `dtype` on cuda:`device` (torch imported here, off the held buffers' path:
    a decode step asks for them on every call)."""
    import torch  # noqa: PLC0415

    return getattr(torch, make)(n, dtype=getattr(torch, dtype), device=torch.device("cuda", device))


class ServeLaunch(NamedTuple):
    """A serving launch with its pointers zeroed: what a call with the same shapes, strides and choices repeats."""

    device: int
    fn: Any
    comb: Any
    blocks: int
    combine_blocks: int
    threads: int
    fields: tuple  # SERVE_PARAMS's fields, pointers 0 (filled per launch by fire_serve)
    # split-KV: floats of o_accum (splits, rows, heads, d) and lse_accum (.., heads), and (fused_combine) the
    # row blocks' arrival counters
    accum: tuple[int, int, int] | None
    tail: bytes = b""  # a kernel with a score_mod or mask_mod: its captured tensors' slots (ServeModParams)
    # split-KV: the main kernel and the combine wait for the grid before them themselves (templates/sm80/
    # grid_order.cuh.j2), so both launch with programmatic stream serialization: each one's blocks start while the
    # grid before it finishes, instead of after
    programmatic: bool = False


def modifier_tail(cfg: KernelConfig, mods: Mods, device: int, batch: int = 1, heads: int = 1) -> bytes:
    """The ModTensor slots of ServeModParams, packed (modifier_values)."""
    return _MOD_TAIL.pack(*modifier_values(cfg, mods, device, batch, heads))


def modifier_values(cfg: KernelConfig, mods: Mods, device: int, batch: int = 1, heads: int = 1) -> list[int]:
    """The ModTensor slots' values (of ServeModParams, and of Sm90ServeModFwdParams after its serving fields): the
    tensors of mods.score_mod, then of mods.mask_mod, each its pointer and strides (in elements; 0 past its rank),
    the rest null; then, with cfg.block_map, the lists of mods.block_map (at cfg's tiles, for `batch` sequences of
    `heads` heads; a dimension of 1 read with stride 0). The call's modifiers must be the ones `cfg` was generated
    with (by digest), their tensors on `device`."""
    values: list[int] = []
    for kind, mod in (("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod)):
        digest = mod.digest if mod is not None else ""
        if digest != getattr(cfg, kind):
            raise ValueError(f"the call's {kind} (digest {digest!r}) is not the one {cfg.name} was generated with "
                             f"({getattr(cfg, kind)!r})")
        for c, t in zip(mod.captured if mod is not None else (), mod.tensors if mod is not None else ()):
            if t.device.type != "cuda" or t.get_device() != device:
                raise ValueError(f"{kind} reads tensor {c.name!r} on {t.device}; it must be on cuda:{device}, "
                                 "with q, k and v")
            if not c.fits(t):  # the kernel's 32-bit offsets and fixed strides are the traced tensor's
                raise ValueError(f"{kind} reads tensor {c.name!r} of shape {tuple(t.shape)}, strides {t.stride()}; "
                                 f"it was traced with shape {c.shape}, strides {c.strides} (layout {c.layout!r}): "
                                 "trace the modifier again with the tensor it reads")
            values += [t.data_ptr(), *t.stride(), *(0,) * (MAX_RANK - t.dim())]
    slots = len(values) // (1 + MAX_RANK)
    if slots > MAX_CAPTURED:
        raise ValueError(f"score_mod and mask_mod read {slots} tensors; a kernel takes at most {MAX_CAPTURED}")
    values += [0] * ((MAX_CAPTURED - slots) * (1 + MAX_RANK))
    return values + _map_slots(cfg, mods.block_map, device, batch, heads)


def _map_slots(cfg: KernelConfig, block_map: Any, device: int, batch: int, heads: int) -> list[int]:
    """ServeModParams' map_num and map_idx: pointer and four strides each (all 0 without cfg.block_map)."""
    if not cfg.block_map:
        if block_map is not None:
            raise ValueError(f"the call has a block map; {cfg.name} was generated without one")
        return [0] * (2 * (1 + MAX_RANK))
    if block_map is None or block_map.block != (cfg.block_m, cfg.block_n):
        raise ValueError(f"{cfg.name} reads a block map of {cfg.block_m} x {cfg.block_n} tiles; the call's is "
                         f"{None if block_map is None else block_map.block}")
    return list_slots(block_map.tile_lists, device, batch, heads)


def list_slots(lists: Any, device: int, batch: int, heads: int) -> list[int]:
    """Two ModTensor slots (pointer and four strides each) of a block map's (num, idx) lists, for `batch` sequences of
    `heads` heads (a dimension of 1 read with stride 0); ValueError where they are not on `device` or too large for
    the kernel's 32-bit offsets."""
    out: list[int] = []
    for t in lists:
        if t.device.type != "cuda" or t.get_device() != device:
            raise ValueError(f"the block map is on {t.device}; it must be on cuda:{device}, with q, k and v")
        t = t.expand(batch, heads, -1, -1)  # a batch or head dimension of 1 stands for all: stride 0
        if sum((n - 1) * s for n, s in zip(t.shape, t.stride())) >= 2**31:  # the kernel's offsets are int
            raise ValueError(f"the block map's lists ({tuple(t.shape)}) are too large for the kernel's 32-bit offsets")
        out += [t.data_ptr(), *t.stride()]
    return out


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
    _launch(cfg, arch_and_slots(q.get_device())[0], *views, lse, batch=batch, seqlen_q=max_seqlen_q,
            seqlen_k=max_seqlen_k, cu_q=cu_q, cu_k=cu_k, seqused_k=None, block_table=None, page_size=0,
            num_splits=num_splits, mods=mods, softmax_scale=softmax_scale, **shape)


def _launch_sm90(cfg: KernelConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, num_seqs: int, max_seqlen_q: int,
                 cu_q: Any, cu_k: Any, mods: Mods, softmax_scale: float | None) -> None:
    """One sm90-family launch: q, k, v, out as (batch, rows, heads, d) views (varlen: the packed tensors as one
    batch, cu_q / cu_k their offsets); lse (batch, heads, rows) or varlen's (heads, total_q), or None."""
    run = sm90_launch(cfg, q, k, v, out, num_seqs=num_seqs, max_seqlen_q=max_seqlen_q, cu_q=cu_q, cu_k=cu_k, mods=mods,
                      softmax_scale=softmax_scale)
    if run is not None:
        fire_sm90(run, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr())


class Sm90Launch(NamedTuple):
    """An sm90-family serving launch without its q, k, v, out and lse pointers: what a call with the same shapes,
    strides, offsets and modifiers repeats (fire_sm90 adds them)."""

    device: int
    fn: Any
    grid: tuple[int, int, int]
    threads: int
    dtype: str
    swizzle: int
    maps: tuple  # q's, k's and v's tensor maps' (dims, byte strides, box)
    fields: tuple  # FwdParams after its five pointers
    tail: bytes  # what follows FwdParams (Sm90ServeFwdParams' serving fields, a modifier's slots)
    held: Any = None  # what the tail points into that must live until the launch is queued (fp32 sinks)


def sm90_launch(cfg: KernelConfig, q: Any, k: Any, v: Any, out: Any, *, num_seqs: int, max_seqlen_q: int, cu_q: Any,
                cu_k: Any, mods: Mods, softmax_scale: float | None) -> Sm90Launch | None:
    """The sm90-family launch of _launch_sm90's arguments, its pointers left out; None where it has no rows."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dev = q.get_device()
    driver.use_device(dev)
    scale, scale_log2 = scale_args(softmax_scale, d)
    fields = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], b, h, hk, sq, sk, scale, scale_log2)
    maps = tuple(tmap_box(t.stride(), d, n, heads, b, ELEM_BYTES, cfg.smem_w, rows)
                 for t, n, heads, rows in ((q, sq, h, cfg.block_m), (k, sk, hk, cfg.block_n), (v, sk, hk, cfg.block_n)))
    sinks = kernel_sinks(mods.sinks)  # alive until the launch is queued (the allocator orders its reuse)
    serve = (0 if cu_q is None else cu_q.data_ptr(), 0 if cu_k is None else cu_k.data_ptr(), *mods.window, num_seqs,
             max_seqlen_q, error_word(dev), 0 if sinks is None else sinks.data_ptr())
    if cfg.modified:  # the captured tensors' and the block map's slots follow (Sm90ServeModFwdParams)
        tail = _SM90_SERVE_MOD_TAIL.pack(*serve, *modifier_values(cfg, mods, dev, b, h))
    else:
        tail = _SM90_SERVE_TAIL.pack(*serve)
    if not max_seqlen_q * h * num_seqs:
        return None
    grid = cfg.grid(num_seqs, h, max_seqlen_q, arch_and_slots(dev)[1] if cfg.persistent else None)
    fn, _ = _functions(cfg, "sm90", driver.primary_context_id(dev))
    return Sm90Launch(dev, fn, grid, cfg.threads, cfg.dtype, cfg.row_bytes, maps, fields, tail, sinks)


def sm90_maps(run: Sm90Launch, q_ptr: int, k_ptr: int, v_ptr: int) -> bytes:
    """The three tensor maps of `run` at these base pointers (128 bytes each)."""
    return b"".join(driver.tensor_map(run.dtype, p, *geometry, run.swizzle)
                    for p, geometry in zip((q_ptr, k_ptr, v_ptr), run.maps))


def fire_sm90(run: Sm90Launch, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int,
              maps: bytes | None = None) -> None:
    """Launch `run` on the current stream with these pointers (lse 0: not written); `maps`: sm90_maps of the same
    q, k, v pointers where the caller keeps them."""
    if maps is None:
        maps = sm90_maps(run, q_ptr, k_ptr, v_ptr)
    params = (maps + FWD.pack(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, *run.fields) + run.tail).ljust(SM90_BYTES, b"\0")
    run.fn.launch(run.grid, run.threads, params, current_stream(run.device))


@functools.lru_cache(maxsize=512)
def _functions(cfg: KernelConfig, arch: str, ctx: int) -> tuple[driver.Function, driver.Function | None]:
    """The main kernel and (split-KV) the combine of `cfg`, loaded in context `ctx`."""
    kern, names = compiled_kernel(cfg, target_for(arch, cfg.family)), cfg.kernel_names
    main = driver.get_function(kern.cubin, names["main"], cfg.smem_bytes, kern.digest, ctx)
    comb = (driver.get_function(kern.cubin, names["combine"], 0, kern.digest, ctx)
            if "combine" in names else None)
    return main, comb


def arch_and_slots(device: int) -> tuple[str, int]:
    info = driver.device_info(device)
    return info.arch, info.sm_count


def want_split(num_splits: int, cfg_rows_tiles: int, n_blocks: int, cfg: KernelConfig, sm_count: int, arch: str) -> int:
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: flashgen chooses); got {num_splits}")
    if num_splits == 0:
        return choose_splits(cfg_rows_tiles, _slots(cfg, sm_count, arch), n_blocks)
    return min(num_splits, MAX_SPLITS)


NO_BACKWARD = "no backward for KV-cache attention (an inference call)"


def has_mods(window_size: Any, softcap: float, alibi_slopes: Any, causal: bool, sinks: Any = None) -> bool:
    """Whether a dense call's score modifiers need the serving kernels (a window that bounds more than causal,
    softcap, ALiBi, attention sinks); the plain kernels take it otherwise."""
    try:
        window = tuple(int(x) for x in window_size)
    except (TypeError, ValueError):
        return True  # _mods explains what is wrong
    return len(window) != 2 or any(mod_features(window, float(softcap), alibi_slopes is not None, causal,
                                                sinks is not None).values())


def call_features(mods: Mods, causal: bool) -> dict[str, bool]:
    return mod_features(mods.window, mods.softcap, mods.alibi is not None, causal, mods.sinks is not None)


def modifier_config(head_dim: int, dtype: str, causal: bool, rows: int, arch: str, mods: Mods,
                    **features: bool) -> KernelConfig:
    """serve_config's kernel for a call with a score_mod, mask_mod or block map (family sm80; sm90_modifier_config
    gives Hopper's own), generated with the call's modifiers and other score modifiers; with a block map
    wherever the call has a mask_mod or a block map (its tiles are the kernel's: blockmap.BlockMap.retile)."""
    return serve_config(head_dim, dtype, causal, rows, arch, **call_features(mods, causal), **features,
                        score_mod=mods.score_mod.digest if mods.score_mod is not None else "",
                        mask_mod=mods.mask_mod.digest if mods.mask_mod is not None else "",
                        block_map=mods.mask_mod is not None or mods.block_map is not None)


# The sm90 family's kernels with modifiers, by head dim: (block_n, schedule knobs), the first that ptxas builds without
# serialized wgmma and within MODIFIER_SPILL_SLACK taken (the last unchecked). Two consumer warpgroups of 64 rows.
# FlashAttention-3's schedule first (S of the next tile beside this one's P V, the warpgroups taking turns, O rescaled
# lazily), then the in-order one, which needs fewer registers; a table read per score beside a mask (FlexAttention's
# heavier examples) spills 8 bytes at 128 keys (more before the uncut tiles' split form, which shares each row's reads).
# Lazy rescaling (H200, d128, bf16, 4k / 16k): softcap 342 -> 391 / 353 -> 403
# TFLOP/s, ALiBi with its causal mask_mod 388 -> 426 / 467 -> 482 (from the in-order schedule, which it had at 128 keys
# before). Not persistent: `tune --arch sm90` of the flex examples (H200, d128, 4k / 16k, the kernel alone; ms over
# the best of the space) put the persistent scheduler ahead for document ids (in order: 1.046 / 1.012 -> 1.000 /
# 1.000) and a relative-bias table (overlapped 1.090 / 1.056 -> in order 1.000 / 1.000), behind for prefix LM (its
# overlapped schedule spills 92-104 bytes persistent: 1.000 -> 1.057 / 1.079 in order), a random block-sparse mask (in
# order 1.074 / 1.085 -> 1.135 / 1.306; overlapped, not persistent, was best) and softcap (1.000 -> 1.051 / 1.030).
# Tuning takes it where it wins.
SM90_OVERLAP = (("overlap", True), ("pingpong", True), ("lazy_rescale", True))
SM90_IN_ORDER: tuple = ()
SM90_MODIFIER_SCHEDULES = {
    **{d: ((128, SM90_OVERLAP), (128, SM90_IN_ORDER), (64, SM90_OVERLAP), (64, SM90_IN_ORDER))
       for d in (32, 64, 96, 128)},
    256: ((64, SM90_OVERLAP), (64, SM90_IN_ORDER)),
}
# Spill stores (bytes) a forward schedule with modifiers may have and still be taken, at head dims up to 128 (where it
# was measured): the overlapped schedule's few spilled bytes (8-52 at d128) cost less than the in-order schedule they
# displace (H200, d128, 4k: ALiBi with its causal mask_mod, 52 bytes, 426 against 388 TFLOP/s; a relative-bias table
# at 128 keys, 8 bytes, 395 against 380 at 64; measured before the split form, with which ALiBi spills none).
MODIFIER_SPILL_SLACK = 64
SM90_MODIFIER_FEATURES = ("window", "sinks")  # what an sm90 modifier kernel also builds (dense: no varlen)


def sm90_modifier_config(head_dim: int, dtype: str, causal: bool, mods: Mods) -> KernelConfig | None:
    """The sm90 family's forward for a dense call with a score_mod, mask_mod or block map (Hopper): the
    non-persistent kernel with the call's modifiers, a block map wherever the call has a mask_mod or a block map, and
    its window or sinks; the first of SM90_MODIFIER_SCHEDULES that ptxas builds without spills or serialized wgmma.
    None where the family does not build the call (softcap, ALiBi, FP8, other head dims): the sm80 family's then."""
    features = call_features(mods, causal)
    if not {f for f, on in features.items() if on} <= set(SM90_MODIFIER_FEATURES):
        return None
    schedules = SM90_MODIFIER_SCHEDULES.get(head_dim)
    if (schedules is not None and mods.mask_mod is not None and mods.mask_mod.loads_on_cut_tiles
            and (mods.score_mod is not None or head_dim <= 64)):
        # A mask_mod with a load per score on partial tiles goes in order first, at the same block_n, beside a
        # score_mod: the overlapped schedule keeps its verdicts in bits, which take registers beside the next tile's S
        # (H200, document ids: 1.29-1.31x at d64, 1.21-1.23x at d128, where the 128-key tiles spill). Alone, such a
        # mask is applied to S in place once it lands (render's mask_in_place), and the overlapped schedule is ahead
        # from d128 (document ids, H200, 4k / 16k: 1.04 / 1.05x at d128, 1.03 / 1.06x at d256), behind at d64 (0.97 /
        # 0.98x). A mask read by whole tiles (a block-sparse table) is never evaluated.
        schedules = tuple(sorted(schedules, key=lambda s: (-s[0], s[1] != SM90_IN_ORDER)))
    return _sm90_modifier_config(head_dim, dtype, causal, tuple(features.items()),
                                 mods.score_mod.digest if mods.score_mod is not None else "",
                                 mods.mask_mod.digest if mods.mask_mod is not None else "",
                                 mods.mask_mod is not None or mods.block_map is not None, schedules)


@functools.lru_cache(maxsize=512)
def _sm90_modifier_config(head_dim: int, dtype: str, causal: bool, features: tuple, score_mod: str, mask_mod: str,
                          block_map: bool, schedules: tuple | None) -> KernelConfig | None:
    """sm90_modifier_config's choice, once per call signature (a call repeats it: four configs built and checked
    were half its host time)."""
    if schedules is None or dtype not in ("fp16", "bf16"):
        return None
    cfgs = [KernelConfig(head_dim, dtype, causal, 128, bn, 12, 2, "sm90", **dict(features), **dict(knobs),
                         score_mod=score_mod, mask_mod=mask_mod, block_map=block_map)
            for bn, knobs in schedules]
    slack = MODIFIER_SPILL_SLACK if head_dim <= 128 else 0
    return next((c for c in cfgs[:-1] if _builds_clean(c, slack)), cfgs[-1])


def build_fault(kernel: Any, spill_slack: int = 0) -> str | None:
    """Why a compiled kernel is not taken: ptxas serialized its wgmmas (C7512/C7513/C7519), or it spills (more than
    `spill_slack` bytes stored where a slack is given, any spill otherwise); None where it builds clean."""
    if any(code in kernel.ptxas_log for code in ("C7512", "C7513", "C7519")):
        return "serializes its wgmmas (ptxas C751x)"
    spilled = kernel.resources.spill_stores if spill_slack else int(kernel.resources.spills)
    if spilled > spill_slack:
        return f"spills registers ({spilled} bytes stored, {spill_slack} allowed)"
    return None


@functools.lru_cache(maxsize=256)
def _builds_clean(cfg: KernelConfig | BwdConfig, spill_slack: int = 0) -> bool:
    """Whether ptxas builds `cfg` for sm_90a clean (build_fault), spilling at most `spill_slack` bytes."""
    return build_fault(compiled_kernel(cfg, target_for("sm90", cfg.family)), spill_slack) is None


# The sm90 family's backward with modifiers, by head dim: (block_m, block_n, num_warps, num_stages, stagger), the first
# that ptxas builds without spills or serialized wgmma taken (none: the sm80 family's backward). The dense default
# tiles first, then one consumer warpgroup of 64 keys, which has 255 registers: a table read per score (a relative
# bias) spills beside the two-warpgroup tiles' accumulators. Head dim 256 (two warpgroups per 64 keys) is sm80's.
SM90_MODIFIER_BWD_SCHEDULES = {
    32: ((128, 128, 12, 2, True), (64, 64, 8, 2, False)),
    64: ((128, 128, 12, 2, True), (64, 64, 8, 2, False)),
    96: ((64, 64, 8, 2, False),),
    128: ((64, 128, 12, 3, True), (64, 128, 12, 2, False), (64, 64, 8, 2, False)),
}
# Where a modifier loads per score (a bias table, document ids, a block-sparse table), the schedule tried first, by head
# dim. H200, d64 bf16, back to back: 64 x 64 ran document 1.29-1.35x and a random block-sparse mask 1.18-1.20x the
# 128 x 128 tiles (which a relative bias or ALiBi spill), while masks of indices alone (prefix LM, a window) ran
# 1.0-1.8x faster on 128 x 128.
SM90_MODIFIER_BWD_READS_FIRST = {64: (64, 64, 8, 2, False)}
# Head dims whose backward with a block map and no score_mod adds dQ by a producer warp's TMA bulk reduce (dq_tma)
# before trying the consumers' atomics: `tune --pass bwd --arch sm90` on the flex bench's prefix LM, random
# block-sparse and sliding-window masks (H200, bf16, 16 heads, N 4k and 16k) took the d128 rule's tile with dq_tma at
# all six points, 1.02-1.09x the rule's kernel alone; through the public call prefix LM's backward ran 1.07-1.09x.
SM90_MODIFIER_BWD_DQ_TMA = (128,)


def sm90_modifier_bwd_config(head_dim: int, dtype: str, causal: bool, features: tuple[str, ...], deterministic: bool,
                             score_mod: str, mask_mod: str, block_map: bool) -> BwdConfig | None:
    """The sm90 family's backward of a dense call with a score_mod, mask_mod or block map (Hopper): the first of
    SM90_MODIFIER_BWD_SCHEDULES that ptxas builds clean (deterministic, and first with a block map and no score_mod
    at SM90_MODIFIER_BWD_DQ_TMA's head dims: with dq_tma, in as many of its stages as leave room for the dQ tile);
    None where the family does not build the call (softcap, ALiBi, head dim 256) or no schedule builds clean: the
    sm80 family's backward then."""
    schedules = SM90_MODIFIER_BWD_SCHEDULES.get(head_dim, ())
    first = SM90_MODIFIER_BWD_READS_FIRST.get(head_dim)
    if first in schedules and _reads_per_score(score_mod, mask_mod):
        schedules = (first, *(s for s in schedules if s != first))
    tma_first = block_map and not score_mod and head_dim in SM90_MODIFIER_BWD_DQ_TMA
    dq_tma = (True,) if deterministic else (True, False) if tma_first else (False,)
    configs = []
    for (bm, bn, w, stages, stagger), tma in itertools.product(schedules, dq_tma):
        for s in range(stages, 0, -1) if tma else (stages,):
            try:
                cfg = BwdConfig(head_dim, dtype, causal, bm, bn, w, deterministic, "sm90", s, stagger,
                                dq_tma=tma, **dict.fromkeys(features, True), score_mod=score_mod,
                                mask_mod=mask_mod, block_map=block_map)
            except ConfigError:
                continue
            if cfg.unfit_reason("sm90") is None:
                configs.append(cfg)
                break
    return next((c for c in configs if _builds_clean(c)), None)


def _reads_per_score(score_mod: str, mask_mod: str) -> bool:
    """Whether the traced score_mod or mask_mod of these digests ("": none) loads per score
    (Modifier.reads_per_score); False for one this process has not traced (its kernel is not built here either)."""
    for digest, kind in ((score_mod, "score"), (mask_mod, "mask")):
        if digest:
            try:
                if lookup(digest, kind).reads_per_score:
                    return True
            except ModifierError:
                pass
    return False


def modifier_digests(mods: Mods) -> dict[str, str]:
    """The KernelConfig fields of the call's traced score_mod and mask_mod (their digests); {} without either. A
    varlen or KV-cache kernel takes them without a block map (its sequences' lengths vary)."""
    out = {"score_mod": mods.score_mod.digest if mods.score_mod is not None else "",
           "mask_mod": mods.mask_mod.digest if mods.mask_mod is not None else ""}
    return out if any(out.values()) else {}


# Where run_plan writes a call's pointers into ServeParams: q, k, v, o, lse lead it; seqused_k and block_table, and
# o_accum and lse_accum, are neighbours.
_CALL_POINTERS, _POINTER_PAIR, _POINTER = struct.Struct("=5Q"), struct.Struct("=2Q"), struct.Struct("=Q")
_SEQUSED_AT, _ACCUM_AT, _COUNTS_AT, _SINKS_AT = (abi.SERVE.offset(f) for f in ("seqused_k", "o_accum", "tile_counts",
                                                                                "sinks"))
assert abi.SERVE.offset("f.lse") == 32 and abi.SERVE.offset("block_table") == _SEQUSED_AT + 8
assert abi.SERVE.offset("lse_accum") == _ACCUM_AT + 8
_torch: Any = None  # torch, once a plan is made (a plan's tensors are torch tensors)


class KVPlan:
    """What an attention_with_kvcache call repeats for one signature (shapes, strides, dtypes, device, options):
    ServeParams packed with the call's pointers 0, its launches prepared (driver.Prepared), its context, and what it
    allocates. run_plan fills in a call's pointers and launches. `stamp`: the tuned store's stamp it was chosen under
    (`tracks_store`: the choice read the store), which the caller compares once a `look_after` passes."""

    __slots__ = ("launch", "lse_shape", "new_out", "template", "main", "combine", "ctx", "tracks_store", "stamp",
                 "look_after")

    def __init__(self, launch: ServeLaunch, lse_shape: tuple | None, tracks_store: bool = False,
                 stamp: tuple | None = None, q_contiguous: bool = True) -> None:
        global _torch
        import torch  # noqa: PLC0415  (a plan is made from torch tensors: torch is imported)

        _torch = torch
        self.launch, self.lse_shape = launch, lse_shape
        # the output, contiguous: empty_like keeps a contiguous q's layout without being told (a keyword costs)
        self.new_out = (torch.empty_like if q_contiguous else
                        functools.partial(torch.empty_like, memory_format=torch.contiguous_format))
        self.template = SERVE_PARAMS.pack(*launch.fields) + launch.tail
        self.main = launch.fn.prepared((launch.blocks, 1, 1), launch.threads, launch.programmatic)
        self.combine = (None if launch.comb is None else
                        launch.comb.prepared((launch.combine_blocks, 1, 1), 32 * COMBINE_WARPS, launch.programmatic))
        self.ctx = driver.primary_context(launch.device)
        self.tracks_store, self.stamp, self.look_after = tracks_store, stamp, 0.0


def run_plan(plan: KVPlan, q: Any, k_cache: Any, v_cache: Any, seqused: Any, block_table: Any,
             return_lse: bool, sinks: Any = None) -> tuple[Any, Any] | None:
    """(out, lse) of a call by its plan; None where a base pointer is not 16-byte aligned (the full path says why).
    The same launches as fire_serve with the plan's ServeLaunch: its bytes with this call's pointers, on the current
    stream, split-KV scratch from _workspace; `sinks` as the call gives them (made fp32 here where they are not)."""
    qp, kp, vp = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    if (qp | kp | vp) & 15:
        return None
    out = plan.new_out(q)  # new_empty(q.shape) parses its size: dearer
    lse = None if not return_lse else _torch.empty(plan.lse_shape, dtype=_torch.float32, device=q.device)
    run = plan.launch
    here = driver.thread_state()
    driver.make_current(plan.ctx, here)
    stream = current_stream(run.device)
    buf = here[0]
    buf.raw = plan.template
    _CALL_POINTERS.pack_into(buf, 0, qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr())
    table = 0 if block_table is None else block_table.data_ptr()
    _POINTER_PAIR.pack_into(buf, _SEQUSED_AT, seqused.data_ptr(), table)
    if sinks is not None:
        sinks = kernel_sinks(sinks)  # alive until the launches are queued (the allocator orders its reuse)
        _POINTER.pack_into(buf, _SINKS_AT, sinks.data_ptr())
    if run.accum is not None:
        o_floats, lse_floats, counters = run.accum
        fresh = capturing()
        scratch = _workspace(run.device, stream, o_floats + lse_floats, fresh)  # alive past the launches
        at = scratch.data_ptr()
        _POINTER_PAIR.pack_into(buf, _ACCUM_AT, at, at + 4 * o_floats)
        if counters:
            tiles = _tile_counters(run.device, stream, counters, fresh)
            _POINTER.pack_into(buf, _COUNTS_AT, tiles.data_ptr())
    plan.main.launch(stream, here[1])
    if plan.combine is not None:  # the combine reads ServeParams alone: the same bytes' prefix
        plan.combine.launch(stream, here[1])
    return out, lse


def kvcache_launch(cfg: KernelConfig, splits: int, q: Any, k_cache: Any, v_cache: Any, out: Any, lse: Any,
                   seqused: Any, block_table: Any, mods: Mods = Mods(),
                   softmax_scale: float | None = None) -> "ServeLaunch | None":
    """One KV-cache attention launch with a given kernel and split count (checked arguments; `seqused`: the keys
    each sequence holds, int32 (batch,)): `attention_with_kvcache`'s and the decode tuner's (flashgen.tune_decode)."""
    batch, seqlen_q, heads = q.shape[:3]
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    return _launch(cfg, arch_and_slots(q.get_device())[0], q, k_cache, v_cache, out, lse, batch=batch, seqlen_q=seqlen_q,
                   seqlen_k=capacity, total_rows=batch * seqlen_q, cu_q=None, cu_k=None, seqused_k=seqused,
                   block_table=block_table, page_size=page_size, num_splits=splits, mods=mods,
                   softmax_scale=softmax_scale, lse_strides=(heads * seqlen_q, seqlen_q),
                   batch_strides=(q.stride(0), k_cache.stride(0), v_cache.stride(0)))


def append_kv(k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, page_size: int) -> None:
    """Write k, v at positions cache_seqlens[b] + [0, seqlen_new) of each sequence's cache, in place.

    Positions and page ids are clamped into the cache (identity for valid inputs; no host sync): an index out of
    range would stop the CUDA context with a device-side assert. A sequence whose cache_seqlens runs past its
    cache writes into its own row (contiguous) or pages; a bad page id lands on a page in [0, num_pages). The
    kernel then finds the same input out of bounds and reports it (flashgen.kernels.bad_inputs)."""
    import torch  # noqa: PLC0415

    batch, n = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(n, device=k.device)[None, :]  # (batch, n)
    if block_table is None:
        pos = pos.clamp_(0, k_cache.shape[1] - 1)
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, n)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        pos = pos.clamp_(0, block_table.shape[1] * page_size - 1)
        pages = torch.gather(block_table.long(), 1, pos // page_size).clamp_(0, k_cache.shape[0] - 1)
        k_cache[pages, pos % page_size] = k
        v_cache[pages, pos % page_size] = v


__all__ = ["DECODE_ROWS", "MAX_SPLITS", "Mods", "NO_BACKWARD", "SERVE_PARAMS", "ServeLaunch", "Sm90Launch",
           "append_kv", "arch_and_slots", "build_fault", "call_features", "choose_splits", "decode_config", "fire_serve",
           "fire_sm90", "has_mods", "kernel_sinks", "kvcache_launch", "launch_prefill", "list_slots", "modifier_config",
           "modifier_digests", "modifier_tail", "modifier_values", "run_plan", "serve_config", "serve_grids",
           "serve_launch", "sm90_launch", "sm90_maps", "sm90_modifier_bwd_config", "sm90_modifier_config",
           "SM90_MODIFIER_BWD_SCHEDULES", "SM90_MODIFIER_SCHEDULES", "want_split"]
