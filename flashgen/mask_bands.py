"""mask_mods that are a band of diagonals (causal, a sliding window), read from their traced graph.

A mask_mod whose every test compares q_idx - kv_idx (plus a constant) with a constant, joined by `&`, keeps exactly
the scores with lo <= q_idx - kv_idx <= hi. That is what the built-in causal and window kernels compute, so such a
call runs them (forward and backward) instead of a generated kernel with a block map: the same scores kept, the
built-in kernels' speed. The graph is read, not sampled: anything else (a captured tensor, b or h, `|`, a product
of indices, a float) is not a band, and the call keeps its generated kernel.
"""
from __future__ import annotations

import functools
import math

from .modifiers import Modifier, Node

Band = tuple[float, float]  # (lo, hi) of q_idx - kv_idx, -inf / +inf where unbounded
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _affine(node: Node) -> tuple[int, int, int] | None:
    """(a, b, c) with node = a q_idx + b kv_idx + c, for an integer expression of sums, differences, negations and
    constant multiples of q_idx, kv_idx and integer constants; None for anything else."""
    if node.type != "int":
        return None
    if node.op == "input":
        return {"q_idx": (1, 0, 0), "kv_idx": (0, 1, 0)}.get(node.value)
    if node.op == "const":
        return 0, 0, int(node.value)
    if node.op == "neg":
        x = _affine(node.args[0])
        return None if x is None else (-x[0], -x[1], -x[2])
    if node.op in ("add", "sub"):
        x, y = _affine(node.args[0]), _affine(node.args[1])
        if x is None or y is None:
            return None
        sign = 1 if node.op == "add" else -1
        return x[0] + sign * y[0], x[1] + sign * y[1], x[2] + sign * y[2]
    if node.op == "mul":
        x, y = _affine(node.args[0]), _affine(node.args[1])
        if x is None or y is None:
            return None
        if x[:2] == (0, 0):
            x, y = y, x
        if y[:2] != (0, 0):
            return None  # a product of indices
        return x[0] * y[2], x[1] * y[2], x[2] * y[2]
    return None


def _compare(op: str, left: Node, right: Node) -> Band | None:
    """The band of d = q_idx - kv_idx where `left op right` holds, when left - right is k d + c (k != 0)."""
    x, y = _affine(left), _affine(right)
    if x is None or y is None:
        return None
    a, b, c = x[0] - y[0], x[1] - y[1], x[2] - y[2]  # left - right = a q_idx + b kv_idx + c
    if a != -b or a == 0:
        return None
    if a < 0:  # k d + c op 0 with k < 0  <=>  -k d - c flip(op) 0
        op, a, c = _FLIP[op], -a, -c
    floor, ceil = (-c) // a, -(c // a)  # of -c / a: d is an integer
    return {"lt": (-math.inf, ceil - 1), "le": (-math.inf, floor), "gt": (floor + 1, math.inf),
            "ge": (ceil, math.inf)}[op]


def _band(node: Node) -> Band | None:
    if node.op == "const" and node.type == "bool":
        return (-math.inf, math.inf) if node.value else None
    if node.op == "and":
        x, y = _band(node.args[0]), _band(node.args[1])
        if x is None or y is None:
            return None
        return max(x[0], y[0]), min(x[1], y[1])
    if node.op in _FLIP:
        return _compare(node.op, *node.args)
    return None


def band_of(mask: Modifier) -> Band | None:
    """(lo, hi) where `mask` keeps exactly the scores with lo <= q_idx - kv_idx <= hi (for every b and h), or None:
    a mask_mod of another shape, one that reads tensors, or one given as CUDA text."""
    if mask.kind != "mask" or mask.root is None or mask.captured:
        return None
    return _root_band(mask.root)


@functools.lru_cache(maxsize=256)
def _root_band(root: Node) -> Band | None:  # once per graph: a call that repeats a mask_mod reads it again
    return _band(root)


def builtin_mask(band: Band, seqlen_q: int, seqlen_k: int) -> tuple[bool, tuple[int, int]] | None:
    """(causal, window_size) of the built-in kernels that keep the same scores as `band` for seqlen_q queries and
    seqlen_k keys, or None. flash_attn's masks align to the bottom right; a mask_mod's q_idx and kv_idx count from
    the top left: the two agree where seqlen_q == seqlen_k. Only bands where every query keeps its own key (lo <= 0
    <= hi): a row that keeps no key has its own conventions in each path."""
    lo, hi = band
    if seqlen_q != seqlen_k or not lo <= 0 <= hi:
        return None
    # keys i - left .. i + right: d = i - j in [-right, left]; -1 unbounded
    left = -1 if hi >= seqlen_k - 1 else int(hi)
    right = -1 if -lo >= seqlen_k - 1 else int(-lo)
    if right == 0:
        return True, (left, 0) if left >= 0 else (-1, -1)
    return False, (left, right)


def builtin_for(mask: Modifier, score: Modifier | None, causal: bool, seqlen_q: int,
                seqlen_k: int) -> tuple[bool, tuple[int, int]] | None:
    """(causal, window_size) of the built-in kernels for a call with this traced mask_mod, score_mod (None, or one
    that changes nothing) and causal flag, where the mask keeps a band of diagonals (builtin_mask); else None. The
    call's other modifiers (window_size, softcap, ALiBi, a block mask) are the caller's to rule out."""
    if score is not None and not score.is_identity:
        return None
    band = band_of(mask)
    if band is None:
        return None
    if causal:  # q_idx >= kv_idx where seqlen_q == seqlen_k, the only case builtin_mask maps
        band = (max(band[0], 0), band[1])
    return builtin_mask(band, seqlen_q, seqlen_k)


__all__ = ["Band", "band_of", "builtin_for", "builtin_mask"]
