"""Block maps: which (query tile, key tile) pairs of an attention call a mask leaves empty, keeps whole, or cuts
through, so the kernel never loads an empty tile and evaluates the mask_mod only on the cut ones.

A `BlockMap` holds one state per (batch, head, query tile, key tile) at some tile size: EMPTY (no score kept),
PARTIAL (the mask_mod decides per score) or FULL (every score kept, the mask_mod is not evaluated). It comes from a
traced mask_mod (`from_mask`: the mask evaluated with torch over every index, reduced per tile) or from torch's
`BlockMask` (`from_block_mask`: its kv_indices are the partial blocks, full_kv_indices the full ones), and is
brought to the kernel's tile size with `retile` (a tile is empty only where every block it covers is empty, full
only where every one is full). A batch or head dimension of 1 stands for all of them (the mask does not read `b`
or `h`; the kernel reads it with stride 0).

The kernel reads `tile_lists()`: per (batch, head, query tile) the count of partial and of full key tiles, and the
key tiles' indices, partial ones first, each group ascending (the layout of BlockMask's kv_num_blocks and
kv_indices, both groups in one list).
"""
from __future__ import annotations

import collections
import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

from .modifiers import Modifier, ModifierError, inputs_used

EMPTY, PARTIAL, FULL = 0, 1, 2
CHUNK_ELEMENTS = 1 << 23  # scores evaluated per pass of from_mask (its index arithmetic is 64-bit)


class TileLists(NamedTuple):
    """What the kernel reads, int32 on the map's device: `num` (B, H, M, 2): partial and full key tiles of each
    query tile; `idx` (B, H, M, N): their indices, partial first (entries past the two counts are unused)."""
    num: Any
    idx: Any


@dataclass(frozen=True)
class BlockMap:
    """Tile states (int8 (B, H, M, N), B and H possibly 1) of a seqlen_q x seqlen_k call at `block` =
    (query rows, keys) per tile."""
    states: Any
    block: tuple[int, int]
    seq_lengths: tuple[int, int]

    def __post_init__(self) -> None:
        sq, sk = self.seq_lengths
        want = (-(-sq // self.block[0]), -(-sk // self.block[1]))
        if self.states.dim() != 4 or tuple(self.states.shape[2:]) != want:
            raise ValueError(f"a block map of {sq} x {sk} at tiles {self.block} has {want[0]} x {want[1]} tiles per "
                             f"(batch, head); got states of shape {tuple(self.states.shape)}")

    def retile(self, block_m: int, block_n: int) -> "BlockMap":
        """This map at tiles of block_m rows x block_n keys: EMPTY where every block the tile covers is empty, FULL
        where every one is full, PARTIAL otherwise."""
        if (block_m, block_n) == self.block:
            return self
        held = self.__dict__.setdefault("_retiled", {})  # a reused map is retiled once
        if (block_m, block_n) not in held:
            held[block_m, block_n] = self._retile(block_m, block_n)
        return held[block_m, block_n]

    def to(self, device: Any) -> "BlockMap":
        """This map on `device` (itself where it is there already)."""
        if str(self.states.device) == str(device):
            return self
        held = self.__dict__.setdefault("_moved", {})
        if str(device) not in held:
            held[str(device)] = BlockMap(self.states.to(device), self.block, self.seq_lengths)
        return held[str(device)]

    def _retile(self, block_m: int, block_n: int) -> "BlockMap":
        sq, sk = self.seq_lengths
        # The cells of a grid both tilings are unions of; a cell is inside a sequence where its first index is.
        gq, gk = math.gcd(self.block[0], block_m), math.gcd(self.block[1], block_n)
        rows, cols = -(-sq // gq), -(-sk // gk)
        cells = self.states.repeat_interleave(self.block[0] // gq, 2)[:, :, :rows]
        cells = cells.repeat_interleave(self.block[1] // gk, 3)[:, :, :, :cols]
        return BlockMap(_pool(cells, block_m // gq, block_n // gk), (block_m, block_n), self.seq_lengths)

    def restrict(self, causal: bool, window: tuple[int, int]) -> "BlockMap":
        """This map with the key tiles no row of a query tile sees under `causal` and `window` (flash_attn's
        bottom-right alignment, -1: unbounded) made EMPTY: the kernel's own key range (templates/sm80/serve.cuh.j2,
        key_range), so those tiles are not even listed."""
        left, right = window
        right = 0 if causal else right
        if left < 0 and right < 0:
            return self
        held = self.__dict__.setdefault("_restricted", {})  # a cached map is restricted alike call after call
        if (left, right) not in held:
            held[left, right] = self._restrict(left, right)
        return held[left, right]

    def _restrict(self, left: int, right: int) -> "BlockMap":
        import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
        sq, sk = self.seq_lengths
        bm, bn = self.block
        dev = self.states.device
        shift = sk - sq
        m = torch.arange(self.states.shape[2], device=dev)
        first, last = m * bm, torch.clamp((m + 1) * bm, max=sq) - 1
        n = torch.arange(self.states.shape[3], device=dev)
        seen = torch.ones(len(m), len(n), dtype=torch.bool, device=dev)
        if right >= 0:  # the last key the tile's last row sees
            seen &= n[None, :] * bn <= (last + shift + right)[:, None]
        if left >= 0:  # the first key its first row sees
            seen &= (n[None, :] + 1) * bn - 1 >= (first + shift - left)[:, None]
        return BlockMap(torch.where(seen, self.states, torch.zeros_like(self.states)), self.block, self.seq_lengths)

    @functools.cached_property
    def tile_lists(self) -> TileLists:
        """The kernel's lists (see TileLists), computed once per map."""
        return _lists(self.states)

    @functools.cached_property
    def transposed_lists(self) -> TileLists:
        """The lists of the transposed map, per (batch, head, key tile) its query tiles: `num` (B, H, N, 2), `idx`
        (B, H, N, M), partial first. The backward's main kernel loops over the query tiles of one key tile."""
        return _lists(self.states.transpose(2, 3))

    @functools.cached_property
    def transposed_turns(self) -> Any:
        """int32 (B, H, N, M), entry for entry beside `transposed_lists.idx`: for the j-th query tile m listed for key
        tile n, how many key tiles above n also visit m (listed, not EMPTY). The deterministic sm90 backward adds a
        query tile's dQ parts in that order, from its last key tile down: a turn the counter can reach whatever
        key tiles the map leaves out."""
        import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
        visits = (self.states != EMPTY).to(torch.int32)  # (B, H, M, N)
        above = visits.flip(-1).cumsum(-1).flip(-1) - visits  # key tiles past n that visit m
        idx = self.transposed_lists.idx.long()  # (B, H, N, M): query tiles of key tile n
        return torch.gather(above.transpose(2, 3), 3, idx).to(torch.int32).contiguous()

    def dense(self, batch: int, heads: int) -> Any:
        """The states at score granularity, (batch, heads, seqlen_q, seqlen_k) int8 (for tests and inspection)."""
        sq, sk = self.seq_lengths
        s = self.states.expand(batch, heads, -1, -1)
        return s.repeat_interleave(self.block[0], 2)[:, :, :sq].repeat_interleave(self.block[1], 3)[:, :, :, :sk]


def _lists(states: Any) -> TileLists:
    """Per row of `states` (B, H, R, C): the counts of PARTIAL and FULL entries and their column indices, PARTIAL
    first, each group ascending."""
    import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
    num = torch.stack(((states == PARTIAL).sum(-1), (states == FULL).sum(-1)), -1).to(torch.int32)
    rank = torch.where(states == PARTIAL, 0, torch.where(states == FULL, 1, 2)).to(torch.int8)
    idx = torch.argsort(rank, dim=-1, stable=True).to(torch.int32).contiguous()
    return TileLists(num.contiguous(), idx)


def _pool(cells: Any, fm: int, fn: int) -> Any:
    """States of tiles of fm x fn cells from cell states (B, H, R, C): EMPTY where all cells are, FULL where all
    are, else PARTIAL; cells past R, C (a ragged last tile) count for nothing."""
    import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
    import torch.nn.functional as F  # noqa: N812, PLC0415
    b, h, r, c = cells.shape
    if r == 0 or c == 0:
        return torch.zeros(b, h, -(-r // fm), -(-c // fn), dtype=torch.int8, device=cells.device)
    pad = (0, -c % fn, 0, -r % fm)
    empty = F.pad((cells == EMPTY).to(torch.uint8), pad, value=1)
    full = F.pad((cells == FULL).to(torch.uint8), pad, value=1)
    shape = (b, h, empty.shape[2] // fm, fm, empty.shape[3] // fn, fn)
    all_empty = empty.view(shape).amin((3, 5)).bool()
    all_full = full.view(shape).amin((3, 5)).bool()
    return torch.where(all_full, FULL, torch.where(all_empty, EMPTY, PARTIAL)).to(torch.int8)


def from_mask(mask: Modifier, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
              device: Any = None) -> BlockMap:
    """The block map of a traced mask_mod at block_m x block_n tiles: the mask evaluated with torch (on `device`,
    default its captured tensors' or the CPU) over every (b, h, q_idx, kv_idx) of the call, a few query tiles a pass,
    and reduced per tile. A mask that reads neither `b` nor `h` is evaluated once for all of them (that dimension 1)."""
    import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
    if mask.kind != "mask" or mask.root is None:
        raise ModifierError("a block map is built from a traced mask_mod (trace_mask_mod)")
    if device is None:
        device = mask.tensors[0].device if mask.tensors else "cpu"
    used = inputs_used(mask.root)
    nb, nh = (batch if "b" in used else 1), (heads if "h" in used else 1)
    tiles_q, tiles_k = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    states = torch.empty(nb, nh, tiles_q, tiles_k, dtype=torch.int8, device=device)
    b = torch.arange(nb, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    kv = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    per_pass = max(1, CHUNK_ELEMENTS // max(1, nb * nh * block_m * seqlen_k))  # query tiles a pass
    for t0 in range(0, tiles_q, per_pass):
        t1 = min(tiles_q, t0 + per_pass)
        q = torch.arange(t0 * block_m, min(seqlen_q, t1 * block_m), device=device).view(1, 1, -1, 1)
        keep = mask.evaluate(b, h, q, kv).expand(nb, nh, q.shape[2], seqlen_k)
        cells = torch.where(keep, FULL, EMPTY).to(torch.int8)
        states[:, :, t0:t1] = _pool(cells, block_m, block_n)
    return BlockMap(states, (block_m, block_n), (seqlen_q, seqlen_k))


# Maps from_mask built lately, by (mask digest, call shape, tiles, device), each with its captured tensors (weak
# references) and their version counters when it was built: a call with the same tensor objects, unchanged through
# torch, reuses the map instead of evaluating the mask over every score again.
CACHE_ENTRIES = 16
_cache: "collections.OrderedDict[tuple, tuple[tuple, BlockMap]]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def cached_from_mask(mask: Modifier, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                     block_n: int, device: Any = None) -> BlockMap:
    """from_mask, reused while the mask's captured tensors are the same objects and torch has not written them since
    (their version counters: an in-place op, a slice assignment, copy_). A write torch does not see (another
    framework through DLPack, a raw CUDA kernel) needs clear_cache() before the next call."""
    key = (mask.digest, batch, heads, seqlen_q, seqlen_k, block_m, block_n, str(device))
    stamp = mask_stamp(mask)
    with _cache_lock:
        held = _cache.get(key)
        if held is not None and held[0][0] == stamp and all(r() is t for r, t in zip(held[0][1], mask.tensors)):
            _cache.move_to_end(key)
            return held[1]
    built = from_mask(mask, batch, heads, seqlen_q, seqlen_k, block_m, block_n, device)
    with _cache_lock:
        _cache[key] = ((stamp, tuple(weakref.ref(t) for t in mask.tensors)), built)
        _cache.move_to_end(key)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return built


def mask_stamp(mask: Modifier) -> tuple:
    """What a map built from `mask` depends on beyond its digest and the call's shape: its captured tensors' ids
    and version counters (torch bumps a counter on every write it makes)."""
    return tuple((id(t), t._version) for t in mask.tensors)


def block_mask_stamp(block_mask: Any) -> tuple:
    """What the map of torch's BlockMask depends on: its lengths, block size, and its tensors' ids and versions."""
    tensors = [getattr(block_mask, n) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")]
    return (tuple(block_mask.seq_lengths), str(block_mask.BLOCK_SIZE),
            tuple(None if t is None else (id(t), t._version) for t in tensors))


_generation = 0  # clear_cache's count: what holds a map beyond these caches (a call's plan) compares it


def generation() -> int:
    """How many times clear_cache ran: a map kept since an earlier count may be stale."""
    return _generation


def clear_cache() -> None:
    """Forget every map cached_from_mask and cached_from_block_mask hold (and make the plans that hold one stale)."""
    global _generation
    with _cache_lock:
        _cache.clear()
        _mask_cache.clear()
        _generation += 1


_mask_cache: "collections.OrderedDict[int, tuple[Any, tuple, BlockMap]]" = collections.OrderedDict()


def cached_from_block_mask(block_mask: Any) -> BlockMap:
    """from_block_mask, reused while it is the same BlockMask object and torch has not written its tensors since
    (their version counters): a BlockMask made once and passed to every layer is converted once, and the map's
    retiled, moved and restricted forms and its lists are kept with it."""
    stamp = block_mask_stamp(block_mask)
    with _cache_lock:
        held = _mask_cache.get(id(block_mask))
        if held is not None and held[0]() is block_mask and held[1] == stamp:
            _mask_cache.move_to_end(id(block_mask))
            return held[2]
    built = from_block_mask(block_mask)
    with _cache_lock:
        _mask_cache[id(block_mask)] = (weakref.ref(block_mask), stamp, built)
        _mask_cache.move_to_end(id(block_mask))
        while len(_mask_cache) > CACHE_ENTRIES:
            _mask_cache.popitem(last=False)
    return built


def from_block_mask(block_mask: Any) -> BlockMap:
    """The block map of torch's BlockMask (torch.nn.attention.flex_attention) at its own BLOCK_SIZE: the blocks of
    kv_indices PARTIAL (its mask_mod decides per score), those of full_kv_indices FULL, the rest EMPTY."""
    import torch  # noqa: PLC0415  (torch is optional; block maps are built from torch tensors)
    sq, sk = (int(x) for x in block_mask.seq_lengths)
    bs = block_mask.BLOCK_SIZE
    block = (int(bs[0]), int(bs[1])) if isinstance(bs, (tuple, list)) else (int(bs), int(bs))
    tiles_q, tiles_k = -(-sq // block[0]), -(-sk // block[1])
    num = block_mask.kv_num_blocks
    if num.dim() != 3 or num.shape[2] < tiles_q:
        raise ValueError(f"BlockMask.kv_num_blocks has shape {tuple(num.shape)}; a {sq} x {sk} mask at BLOCK_SIZE "
                         f"{block} needs (batch or 1, heads or 1, {tiles_q})")
    nb, nh = num.shape[:2]
    # One column past the key tiles takes the entries beyond each row's count (BlockMask leaves them undefined).
    states = torch.zeros(nb, nh, tiles_q, tiles_k + 1, dtype=torch.int8, device=num.device)
    for counts, indices, value in ((block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
                                   (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)):
        if counts is None:
            continue
        counts, indices = counts[:, :, :tiles_q], indices[:, :, :tiles_q]
        listed = torch.arange(indices.shape[-1], device=num.device) < counts[..., None]
        where = torch.where(listed, indices.long().clamp(0, tiles_k - 1), tiles_k)
        states.scatter_(3, where, torch.full_like(where, value, dtype=torch.int8))
    return BlockMap(states[..., :tiles_k].contiguous(), block, (sq, sk))


def check_call(block_map: BlockMap, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """ValueError where `block_map` does not describe a call of these sizes."""
    nb, nh = block_map.states.shape[:2]
    if block_map.seq_lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"the block mask is for {block_map.seq_lengths[0]} queries x {block_map.seq_lengths[1]} keys;"
                         f" the call has {seqlen_q} x {seqlen_k}")
    if nb not in (1, batch) or nh not in (1, heads):
        raise ValueError(f"the block mask has batch {nb} and heads {nh}; the call has batch {batch} and heads {heads} "
                         "(1 stands for all)")


__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMap", "TileLists", "block_mask_stamp", "cached_from_block_mask",
           "cached_from_mask", "check_call", "clear_cache", "from_block_mask", "from_mask", "generation", "mask_stamp"]
