"""Which head dims a call may have and which kernel head dim serves them (pure rules, no torch).

Every kernel kind is generated for the head dims in config.HEAD_DIMS (q, k and v of one width); the dense 16-bit
forward and the sm80 family's dense backward also for config.DENSE_ONLY_HEAD_DIMS. The sm90 family's dense 16-bit
forward also has split-width kernels, v narrower than q and k, for the pairs of config.SPLIT_HEAD_DIMS (192 and
128: DeepSeek-V3's MLA prefill); their backward pads. Every other multiple of 8 up to 256, and any other v narrower
or wider than q and k, runs in the smallest built head dim that holds both, with the tensors padded by zeros on the
host: zero columns of q and k leave q.k unchanged, zero columns of v give output
columns that are sliced off, and the gradients of the zero columns are dropped. The call's default softmax_scale
stays 1/sqrt(d_qk) of the caller's d_qk. The sm90 family's backward, which has no kernel at the dense-only head
dims, pads them the same way to the next head dim it has (backward_head_dim).
"""
from __future__ import annotations

import math

from .config import DENSE_HEAD_DIMS, DENSE_ONLY_HEAD_DIMS, HEAD_DIMS, SM90_BWD_HEAD_DIMS, SPLIT_HEAD_DIMS

HEAD_DIM_STEP = 8  # rows of 16 bytes in 16-bit types: the kernels' vector loads and the padding's granularity
MAX_HEAD_DIM = max(HEAD_DIMS)
SUPPORTED = "a multiple of 8 from 8 to 256"


def supported(d: int) -> bool:
    """Whether a call may have head dim `d` (q/k's or v's)."""
    return isinstance(d, int) and HEAD_DIM_STEP <= d <= MAX_HEAD_DIM and d % HEAD_DIM_STEP == 0


def built(dense: bool = False) -> tuple[int, ...]:
    """The head dims with kernels of their own: of the dense 16-bit forward and backward (`dense`: no serving
    feature, modifier or FP8), else of every kernel kind."""
    return DENSE_HEAD_DIMS if dense else HEAD_DIMS


def head_dim_error(d_qk: int, d_v: int | None = None) -> str | None:
    """Why a call with q and k of width d_qk and v of width d_v (None: d_qk) cannot run, or None if it can."""
    for name, d in (("head_dim", d_qk), ("v's head_dim", d_qk if d_v is None else d_v)):
        if not supported(d):
            dense_only = ", ".join(map(str, DENSE_ONLY_HEAD_DIMS))
            return (f"{name}={d} is not supported: a head dim must be {SUPPORTED} (built natively: "
                    f"{', '.join(map(str, HEAD_DIMS))}, and {dense_only} for the dense forward and backward; the "
                    "others run padded to the next of these)")
    return None


def kernel_head_dim(d_qk: int, d_v: int | None = None, dense: bool = False) -> int:
    """The built head dim (of `built(dense)`) that serves q, k of width d_qk and v of width d_v (None: d_qk): the
    smallest that holds both. ValueError where the dims are not supported."""
    why = head_dim_error(d_qk, d_v)
    if why is not None:
        raise ValueError(why)
    want = max(d_qk, d_qk if d_v is None else d_v)
    return min(d for d in built(dense) if d >= want)


def native(d_qk: int, d_v: int | None = None, dense: bool = False) -> bool:
    """Whether the call runs without padding: q, k and v of one width, a built head dim (of `built(dense)`)."""
    return (d_v is None or d_v == d_qk) and d_qk in built(dense)


def split_native(d_qk: int, d_v: int, dense: bool, family: str | None) -> bool:
    """Whether a forward with q, k of width d_qk and v of width d_v runs in a split-width kernel of its own, without
    padding: a pair of SPLIT_HEAD_DIMS in family sm90's dense forward (`dense`: no serving feature or modifier)."""
    return dense and family == "sm90" and (d_qk, d_v) in SPLIT_HEAD_DIMS


def backward_head_dim(d: int, sm90_family: bool) -> int:
    """The head dim the dense backward of a forward at built head dim `d` runs at: `d`, or in the sm90 family
    (which has no kernel at the dense-only head dims) the next of its head dims, the tensors padded by zeros."""
    if not sm90_family or d in SM90_BWD_HEAD_DIMS:
        return d
    return min(k for k in SM90_BWD_HEAD_DIMS if k >= d)


def default_scale(d_qk: int) -> float:
    """The softmax scale of a call that gives none: 1/sqrt of the caller's q/k width, not of the padded one."""
    return 1.0 / math.sqrt(d_qk)


def padded_fraction(d_qk: int, d_v: int | None = None, dense: bool = False, family: str | None = None) -> float:
    """The kernel's work over the call's (>= 1): QK^T and PV each grow with the padded width (1 for a split-width
    kernel of `family`'s)."""
    d_v = d_qk if d_v is None else d_v
    if split_native(d_qk, d_v, dense, family):
        return 1.0
    k = kernel_head_dim(d_qk, d_v, dense)
    return 2 * k / (d_qk + d_v)


__all__ = ["HEAD_DIM_STEP", "MAX_HEAD_DIM", "SUPPORTED", "backward_head_dim", "built", "default_scale",
           "head_dim_error", "kernel_head_dim", "native", "padded_fraction", "split_native", "supported"]
