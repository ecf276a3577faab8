"""What every kernel launch shares: the FwdParams struct and its packing, the softmax scale's arguments, TMA map
geometry, FP8 descale factors, torch's current stream, and the "no key at all" outputs. The kernels of each kind
(flashgen.kernels) launch through these.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any, Callable

from . import abi
from .config import pack_rows
from .fp8 import descale_bytes
from .tensors import Problem, View

LOG2E = 1.4426950408889634
_F32_MAX = 3.4028234663852886e38


FwdParams = abi.FWD.ctypes_type()
FWD = abi.FWD.struct  # the same bytes packed in one call (a ctypes Structure costs several microseconds)
SM90_BYTES = abi.SM90_FWD.size
STREAM_FOR_TORCH = ("stream= is for GPU arrays; torch tensors run on torch's current stream "
                    "(use `with torch.cuda.stream(s):`)")


def scale_args(softmax_scale: float | None, head_dim: int) -> tuple[float, float]:
    """(softmax_scale, scale_log2) for FwdParams. Any finite scale works: s <= 0 runs as |s| on -Q
    or Q = 0 inside the kernel, so scale_log2 is |s| log2(e) (log2(e) for s = 0)."""
    s = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(s) or abs(s) * LOG2E > _F32_MAX:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite float32 number")
    log2 = abs(s) * LOG2E
    if struct.unpack("f", struct.pack("f", log2))[0] == 0.0:  # so small it is 0 in float32: uniform attention
        s, log2 = 0.0, LOG2E
    return s, log2


def softcap_args(softmax_scale: float | None, head_dim: int, softcap: float) -> tuple[float, float, float]:
    """(scale, scale_log2, softcap_pre) of a call with softcap (0: off, scale_args' pair and 0). With softcap the
    kernels take t = tanh(S * softcap_pre), softcap_pre = scale / softcap, into exponents at softcap * log2(e)."""
    scale, scale_log2 = scale_args(softmax_scale, head_dim)
    if softcap == 0.0:
        return scale, scale_log2, 0.0
    s = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    return s, softcap * LOG2E, s / softcap


def pack_params(q: View, k: View, v: View, o: View, lse_ptr: int, prob: Problem, scale: float, scale_log2: float) -> bytes:
    """The bytes of `struct FwdParams`."""
    qs, ks, vs, os_ = q.strides, k.strides, v.strides, o.strides
    return FWD.pack(q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr,
                     qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
                     prob.batch, prob.heads, prob.heads_k, prob.seqlen_q, prob.seqlen_k, scale, scale_log2)


def tmap_box(strides: tuple[int, ...], head_dim: int, seqlen: int, heads: int, batch: int, elem_bytes: int,
             smem_w: int, rows: int) -> tuple:
    """(dims, byte strides, box) of one tensor map over a (batch, seqlen, heads, head_dim) tensor with element
    `strides`: 4-d over (head_dim, seqlen, heads, batch), boxes of smem_w x `rows` rows."""
    return ((head_dim, seqlen, heads, batch), (elem_bytes * strides[1], elem_bytes * strides[2], elem_bytes * strides[0]),
            (smem_w, rows, 1, 1))


def tmap_box_packed(strides: tuple[int, ...], head_dim: int, seqlen: int, heads: int, heads_k: int, batch: int,
                    elem_bytes: int, smem_w: int, block_m: int) -> tuple:
    """pack_gqa (sm90): (dims, byte strides, box) of q's 5-d map over (head_dim, group, heads_k, seqlen, batch), q's heads
    split into (head of the group, KV head). A box of smem_w x group x 1 x pack_rows positions lands as group * pos rows,
    row r = head r % group of position r / group: the tile's packed rows, none of another KV head."""
    group = heads // heads_k
    return ((head_dim, group, heads_k, seqlen, batch),
            (elem_bytes * strides[2], elem_bytes * strides[2] * group, elem_bytes * strides[1], elem_bytes * strides[0]),
            (smem_w, group, 1, pack_rows(block_m, group), 1))


def descale_args(batch_heads_k: tuple[int, int] | None, device: int, descale: dict[str, Any] | None,
                 dtype: str, vt: int = 0) -> bytes:
    """The packed descale factors and `vt` (fp8.descale_bytes) of an FP8 kernel on (batch, heads_k) KV heads; a kernel
    of another `dtype` (batch_heads_k None) refuses any."""
    if batch_heads_k is None:
        if descale and any(t is not None for t in descale.values()):
            raise ValueError(f"descale factors are for FP8 inputs, not {dtype}")
        return b""
    if device < 0:
        raise TypeError("FP8 inputs must be torch tensors (float8_e4m3fn)")
    return descale_bytes(*batch_heads_k, device, **(descale or {}), vt=vt)


@functools.lru_cache(maxsize=1)
def float32() -> Any:
    import torch  # noqa: PLC0415

    return torch.float32


def current_stream(device: int) -> int:
    """The raw handle of torch's current stream on `device` (capture streams of CUDA graphs included)."""
    return _raw_stream()(device)


@functools.lru_cache(maxsize=1)
def _raw_stream() -> Callable[[int], int]:
    """torch's builtin answering current_stream (an int, without making a Stream object), looked up once."""
    import torch  # noqa: PLC0415

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else lambda device: torch.cuda.current_stream(device).cuda_stream


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph (a decode step asks on every call)."""
    return _capture_check()()


@functools.lru_cache(maxsize=1)
def _capture_check() -> Any:
    """torch's builtin behind torch.cuda.is_current_stream_capturing, without its Python wrapper, where CUDA is
    there; the wrapper elsewhere (a CPU build's builtin raises)."""
    import torch  # noqa: PLC0415

    raw = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if raw is not None and torch.cuda.is_available():
        return raw
    return lambda: torch.cuda.is_current_stream_capturing()


def fill_empty(out: Any, lse: Any) -> None:
    """No key at all: O = 0 and LSE = +inf (lse may be None: not wanted)."""
    if hasattr(out, "zero_"):
        out.zero_()
        if lse is not None:
            lse.fill_(math.inf)
    else:
        out.fill(0)
        if lse is not None:
            lse.fill(math.inf)


__all__ = ["FWD", "FwdParams", "LOG2E", "SM90_BYTES", "STREAM_FOR_TORCH", "capturing", "current_stream", "descale_args",
           "fill_empty", "pack_params", "scale_args", "softcap_args", "tmap_box", "tmap_box_packed"]
